//! Keeping working when nodes misbehave, clients misbehave and load spikes.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::*;
use corral::standin::Fault;
use futures::StreamExt;

fn slow(name: &str, decode_ms: u64) -> corral::standin::StandinConfig {
    let mut c = fast_node(name);
    c.decode_per_token = Duration::from_millis(decode_ms);
    c
}

#[tokio::test]
async fn a_node_whose_name_does_not_resolve_is_down_not_fatal() {
    let node = start(fast_node("n")).await;
    let admin_port = free_port();
    // A laptop that is off: its name does not resolve (.invalid never does, RFC 6761).
    let off = NodeSpec {
        name: "laptop".into(),
        url: "http://laptop.invalid:11434".into(),
        memory_gb: None,
        num_parallel: 2,
        roles: Vec::new(),
        multiuser_cache: false,
    };
    let router = Router::start(
        vec![off, NodeSpec::of(&node, 2)],
        &format!("admin_listen: 127.0.0.1:{admin_port}\n"),
    )
    .await;
    for i in 0..4 {
        let (picked, _, _) = chat(&router, &[format!("conversation {i}")]).await;
        assert_eq!(picked, "n");
    }
    let fleet = get_json(&format!("http://127.0.0.1:{admin_port}/fleet")).await;
    let laptop = &fleet["nodes"][0];
    assert_eq!(laptop["name"], "laptop", "{fleet}");
    assert_eq!(laptop["address"], serde_json::Value::Null, "{fleet}");
    assert_eq!(laptop["healthy"], false, "{fleet}");
    assert_eq!(
        fleet["nodes"][1]["address"],
        node.addr().to_string(),
        "{fleet}"
    );
}

#[tokio::test]
async fn black_hole_node_is_timed_out_retried_elsewhere_and_then_avoided() {
    let hole = start(fast_node("hole")).await;
    let good = start(fast_node("good")).await;
    let router = Router::start(
        vec![NodeSpec::of(&hole, 2).role("chat"), NodeSpec::of(&good, 2)],
        "health:\n  interval: 1h\ntimeouts:\n  first_byte: 300ms\nbreaker:\n  failures: 2\n  cooldown: 1m\n",
    )
    .await;
    hole.set_fault(Fault::Hang);
    let mut retries = Vec::new();
    for i in 0..4 {
        let resp = post_chat(&router, &chat_body(&[format!("q{i}")], false)).await;
        assert_eq!(resp.status(), 200);
        assert_eq!(header(&resp, "x-fleet-node"), "good");
        retries.push(header(&resp, "x-fleet-retries"));
    }
    assert_eq!(
        retries,
        ["1", "1", "0", "0"],
        "two timeouts open the breaker"
    );
}

#[tokio::test]
async fn a_stream_cut_mid_reply_ends_with_an_error_the_client_can_read() {
    let node = start(slow("n", 20)).await;
    let router = Router::start(vec![NodeSpec::of(&node, 2)], "").await;
    node.set_fault(Fault::CutMidStream(2));

    let resp = hold(&router, "ndjson please", 10).await;
    let text = String::from_utf8(resp.bytes().await.unwrap().to_vec()).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3, "two chunks, then the error: {text}");
    assert!(
        lines[2]["error"]
            .as_str()
            .unwrap()
            .contains("failed mid-reply")
    );

    let body = serde_json::json!({ "model": MODEL, "stream": true,
        "messages": [{ "role": "user", "content": "sse please" }] });
    let resp = client()
        .post(format!("{}/v1/chat/completions", router.url()))
        .json(&body)
        .send()
        .await
        .unwrap();
    let text = resp.text().await.unwrap();
    assert!(text.contains("event: error\ndata: {"), "{text}");
    assert!(!text.contains("[DONE]"));
}

#[tokio::test]
async fn a_slow_node_gets_less_work_but_is_not_starved() {
    let fast = start(slow("fast", 2)).await;
    let slow_node = start(slow("slow", 30)).await;
    let router = Router::start(
        vec![NodeSpec::of(&fast, 2), NodeSpec::of(&slow_node, 2)],
        "",
    )
    .await;
    // Learn both nodes' speeds: new conversations spread over equal nodes at first.
    let mut i = 0;
    while fast.log().is_empty() || slow_node.log().is_empty() {
        chat(&router, &[format!("warm-up {i}")]).await;
        i += 1;
        assert!(i < 40, "both nodes got work");
    }
    let mut picks = Vec::new();
    for i in 0..10 {
        picks.push(chat(&router, &[format!("sequential {i}")]).await.0);
    }
    assert!(
        picks.iter().all(|n| n == "fast"),
        "one at a time, the fast node wins: {picks:?}"
    );
    // Under load the slow node takes what the fast one cannot.
    let router = &router;
    let picks = futures::future::join_all((0..6).map(|i| async move {
        let mut body = chat_body(&[format!("burst {i}")], false);
        body["options"] = serde_json::json!({ "num_predict": 20 });
        header(&post_chat(router, &body).await, "x-fleet-node")
    }))
    .await;
    assert!(picks.iter().any(|n| n == "slow"), "{picks:?}");
}

#[tokio::test]
async fn requests_wait_for_a_slot_bounded_in_time_and_count() {
    let node = start(slow("n", 50)).await;
    let admin_port = free_port();
    let router = Router::start(
        vec![NodeSpec::of(&node, 1)],
        &format!(
            "admin_listen: 127.0.0.1:{admin_port}\nqueue:\n  max_wait: 1500ms\n  max_waiting: 1\n"
        ),
    )
    .await;
    let held = hold(&router, "holding the only slot", 100).await;

    // One may wait; it gives up after max_wait with 503 and Retry-After.
    let waiter = tokio::spawn({
        let url = router.url();
        async move {
            let started = Instant::now();
            let resp = client()
                .post(format!("{url}/api/chat"))
                .json(&chat_body(&["waiting".into()], false))
                .send()
                .await
                .unwrap();
            (
                resp.status().as_u16(),
                header(&resp, "retry-after"),
                started.elapsed(),
            )
        }
    });
    let deadline = Instant::now() + Duration::from_secs(5);
    while waiting(admin_port).await != 1 {
        assert!(Instant::now() < deadline, "the first request never queued");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A second waiter is one too many: refused at once.
    let resp = post_chat(&router, &chat_body(&["one too many".into()], false)).await;
    assert_eq!(resp.status(), 503);
    let body: serde_json::Value = resp.json().await.unwrap();
    assert!(body["error"].as_str().unwrap().contains("waiting"));

    let (status, retry_after, waited) = waiter.await.unwrap();
    assert_eq!(status, 503);
    assert!(!retry_after.is_empty());
    assert!(waited >= Duration::from_millis(1500), "{waited:?}");
    drop(held);
}

/// Requests waiting in the router's queue, from the admin API.
async fn waiting(admin_port: u16) -> u64 {
    let fleet = get_json(&format!("http://127.0.0.1:{admin_port}/fleet")).await;
    fleet["waiting"].as_u64().unwrap_or(u64::MAX)
}

#[tokio::test]
async fn a_waiting_request_goes_to_whichever_node_frees_first() {
    let a = start(slow("a", 50)).await;
    let b = start(slow("b", 50)).await;
    let admin_port = free_port();
    let metrics_port = free_port();
    let router = Router::start(
        vec![NodeSpec::of(&a, 1), NodeSpec::of(&b, 1)],
        &format!(
            "admin_listen: 127.0.0.1:{admin_port}\nmetrics_listen: 127.0.0.1:{metrics_port}\n"
        ),
    )
    .await;
    let long = hold(&router, "long", 200).await;
    let short = hold(&router, "short", 6).await;
    let short_node = header(&short, "x-fleet-node");
    assert_ne!(header(&long, "x-fleet-node"), short_node, "one each");

    let url = router.url();
    let send = |text: &str, timeout: Duration| {
        let request = client()
            .post(format!("{url}/api/chat"))
            .timeout(timeout)
            .json(&chat_body(&[text.into()], false));
        tokio::spawn(request.send())
    };
    let queued = send("queued", Duration::from_secs(30));
    eventually("the request waits in corral", async || {
        waiting(admin_port).await == 1
    })
    .await;
    let resp = queued.await.unwrap().unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(
        header(&resp, "x-fleet-node"),
        short_node,
        "it took the first slot to free up"
    );
    // The wait is measured: on the short reply's node, one request found the slot free and
    // one waited for the rest of that reply (6 tokens at 50 ms).
    let scrape = scrape(metrics_port).await;
    let wait = |series: &str, le: Option<&str>| {
        let mut labels = vec![("node", short_node.as_str())];
        labels.extend(le.map(|le| ("le", le)));
        sample(
            &scrape,
            &format!("corral_queue_wait_seconds_{series}"),
            &labels,
        )
    };
    assert_eq!(wait("count", None), Some(2.0), "{scrape}");
    assert_eq!(wait("bucket", Some("0.005")), Some(1.0), "{scrape}");
    let waited = wait("sum", None).unwrap_or_default();
    assert!((0.05..30.0).contains(&waited), "{waited} s");

    // A client that leaves while queued leaves the queue.
    let _again = hold(&router, "short again", 200).await;
    let impatient = send("impatient", Duration::from_millis(1500));
    eventually("the impatient request waits", async || {
        waiting(admin_port).await == 1
    })
    .await;
    let gave_up = impatient.await.unwrap().unwrap_err();
    assert!(gave_up.is_timeout(), "{gave_up}");
    eventually("the queue lets go of a client that left", async || {
        waiting(admin_port).await == 0
    })
    .await;
    drop(long);
}

#[tokio::test]
async fn per_client_limit_answers_429() {
    let node = start(slow("n", 50)).await;
    let router = Router::start(vec![NodeSpec::of(&node, 4)], "queue:\n  per_client: 1\n").await;
    let held = hold(&router, "mine", 100).await;
    let resp = post_chat(&router, &chat_body(&["also mine".into()], false)).await;
    assert_eq!(resp.status(), 429);
    assert!(!header(&resp, "retry-after").is_empty());
    // The answer comes before the body is read: here the body never comes at all, and
    // the reply arrives anyway, well before `timeouts.body_read` (60 s).
    let addr = router.addr;
    let reply = tokio::task::spawn_blocking(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(b"POST /api/chat HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
            .unwrap();
        let mut reply = [0u8; 64];
        let n = s.read(&mut reply).unwrap_or(0);
        String::from_utf8_lossy(&reply[..n]).into_owned()
    })
    .await
    .unwrap();
    assert!(reply.starts_with("HTTP/1.1 429"), "{reply}");
    drop(held);
}

#[tokio::test]
async fn malformed_and_hostile_input_gets_json_errors_and_harms_no_one() {
    let node = start(slow("n", 20)).await;
    let router = Router::start(
        vec![NodeSpec::of(&node, 4)],
        "timeouts:\n  body_read: 300ms\n",
    )
    .await;
    // Another client's stream runs throughout.
    let bystander = hold(&router, "bystander", 40).await;

    // 100,000 levels of nesting where corral reads a type: its own 400.
    let nest = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
    let deep = format!(r#"{{"model":"{MODEL}","messages":{}}}"#, nest(100_000));
    let resp = client()
        .post(format!("{}/api/chat", router.url()))
        .body(deep)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    assert!(header(&resp, "x-fleet-node").is_empty());
    let body: serde_json::Value = resp.json().await.unwrap();
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("invalid request body"),
        "{body}"
    );
    // Where corral only skips a field it does not need, serde_json skips without
    // recursing: the body is valid JSON, so it is forwarded and the node answers.
    let deep = format!(
        r#"{{"model":"{MODEL}","extra":{},"messages":[]}}"#,
        nest(100_000)
    );
    let resp = client()
        .post(format!("{}/api/chat", router.url()))
        .body(deep)
        .send()
        .await
        .unwrap();
    assert_eq!(header(&resp, "x-fleet-node"), "n");
    assert_eq!(resp.status(), 200);

    let resp = client()
        .post(format!("{}/api/chat", router.url()))
        .body(r#"{"model": 42, "messages": "nope"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);

    // A client that sends half its body and stalls: 408, not a stuck worker.
    let addr = router.addr;
    let stalled = tokio::task::spawn_blocking(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(
            b"POST /api/chat HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"model\":",
        )
        .unwrap();
        let mut reply = String::new();
        let _ = s.read_to_string(&mut reply);
        reply
    })
    .await
    .unwrap();
    assert!(stalled.starts_with("HTTP/1.1 408"), "{stalled}");
    assert!(stalled.contains("\"error\""));

    // The bystander's stream finished whole, and the router still serves.
    let text = String::from_utf8(bystander.bytes().await.unwrap().to_vec()).unwrap();
    let last: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    assert_eq!(last["done"], true);
    assert_eq!(chat(&router, &["still fine?".into()]).await.0, "n");
}

/// Writes `request` on a new connection (or after `before` on the same one) and reads
/// until the router closes it.
async fn exchange(addr: std::net::SocketAddr, parts: Vec<(Vec<u8>, Duration)>) -> String {
    tokio::task::spawn_blocking(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        for (bytes, pause) in parts {
            // A refused head may close the connection while the rest is still being sent.
            let _ = s.write_all(&bytes);
            std::thread::sleep(pause);
        }
        let mut reply = Vec::new();
        let _ = s.read_to_end(&mut reply);
        String::from_utf8_lossy(&reply).into_owned()
    })
    .await
    .unwrap()
}

/// The JSON error of the last response in `reply`, after checking its status line.
fn json_error(reply: &str, status: &str) -> String {
    let last = reply.rfind("HTTP/1.1 ").map_or("", |i| &reply[i..]);
    assert!(last.starts_with(&format!("HTTP/1.1 {status}")), "{reply}");
    assert!(last.contains("Content-Type: application/json"), "{reply}");
    let body = last.split("\r\n\r\n").nth(1).unwrap_or_default();
    let body: serde_json::Value =
        serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {reply}"));
    body["error"]
        .as_str()
        .unwrap_or_else(|| panic!("{reply}"))
        .to_string()
}

fn head_with(extra: &str) -> Vec<u8> {
    format!("GET /api/tags HTTP/1.1\r\nHost: x\r\n{extra}\r\n").into_bytes()
}

#[tokio::test]
async fn request_heads_past_their_limits_get_json_errors_and_harm_no_one() {
    let node = start(slow("n", 20)).await;
    let metrics_port = free_port();
    let router = Router::start(
        vec![NodeSpec::of(&node, 4)],
        &format!(
            "metrics_listen: 127.0.0.1:{metrics_port}\n\
             timeouts:\n  header_read: 700ms\nlimits:\n  max_header_bytes: 8192\n"
        ),
    )
    .await;
    let addr = router.addr;
    let bystander = hold(&router, "bystander", 40).await;
    let now = Duration::ZERO;

    // Over corral's limit: 431, whether the head is whole or still coming.
    let big = head_with(&format!("X-Big: {}\r\n", "x".repeat(10_000)));
    let error = json_error(&exchange(addr, vec![(big, now)]).await, "431");
    assert!(
        error.contains("limits.max_header_bytes (8192 bytes)"),
        "{error}"
    );
    // Over Pingora's own limit (1 MiB), which Pingora answered with an empty 400.
    let huge = head_with(&format!("X-Huge: {}\r\n", "x".repeat(1_100_000)));
    json_error(&exchange(addr, vec![(huge, now)]).await, "431");
    let many: String = (0..300).map(|i| format!("X-{i}: y\r\n")).collect();
    let error = json_error(&exchange(addr, vec![(head_with(&many), now)]).await, "431");
    assert!(error.contains("more than 256 header fields"), "{error}");

    // Malformed heads: 400 naming what is wrong.
    let bad_name = head_with("Bad Name: v\r\n");
    let error = json_error(&exchange(addr, vec![(bad_name, now)]).await, "400");
    assert!(
        error.contains("malformed request head: invalid header name"),
        "{error}"
    );
    let bad_line = b"GET /api/tags?q=a b HTTP/1.1\r\nHost: x\r\n\r\n".to_vec();
    json_error(&exchange(addr, vec![(bad_line, now)]).await, "400");
    let connect = b"CONNECT 10.0.0.1:22 HTTP/1.1\r\nHost: 10.0.0.1:22\r\n\r\n".to_vec();
    json_error(&exchange(addr, vec![(connect, now)]).await, "405");

    // Framing that could smuggle a request is still Pingora's to judge: its plain 400
    // (docs/robustness.md), and the connection closes.
    let smuggle = b"POST /api/chat HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\
                    Content-Length: 2\r\n\r\n{}"
        .to_vec();
    let reply = exchange(addr, vec![(smuggle, now)]).await;
    assert!(reply.starts_with("HTTP/1.1 400"), "{reply}");

    // A head that stalls: 408 once `timeouts.header_read` has passed since its first byte.
    let started = Instant::now();
    let stalled = b"GET /api/tags HTTP/1.1\r\nHost:".to_vec();
    let error = json_error(&exchange(addr, vec![(stalled, now)]).await, "408");
    assert!(error.contains("not received within 700ms"), "{error}");
    assert!(started.elapsed() >= Duration::from_millis(700));

    // A head trickled in pieces within the limit is read whole and served.
    let mut pieces: Vec<(Vec<u8>, Duration)> = head_with("Connection: close\r\n")
        .chunks(7)
        .map(|c| (c.to_vec(), Duration::from_millis(10)))
        .collect();
    pieces.last_mut().unwrap().1 = now;
    let reply = exchange(addr, pieces).await;
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    assert!(reply.contains(MODEL), "{reply}");

    // Every request on a kept-alive connection is held to the limits, not just the first.
    let second = head_with(&format!("X-Big: {}\r\n", "x".repeat(10_000)));
    let reply = exchange(
        addr,
        vec![(head_with(""), Duration::from_millis(200)), (second, now)],
    )
    .await;
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    json_error(&reply, "431");

    // The bystander's stream finished whole, the router still serves, and the refusals
    // were counted.
    let text = String::from_utf8(bystander.bytes().await.unwrap().to_vec()).unwrap();
    let last: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    assert_eq!(last["done"], true);
    assert_eq!(chat(&router, &["still fine?".into()]).await.0, "n");
    let scrape = scrape(metrics_port).await;
    let count = |status: &str| -> f64 {
        let label =
            format!("endpoint=\"other\",model=\"none\",node=\"none\",status=\"{status}\"}}");
        scrape
            .lines()
            .find(|l| l.starts_with("corral_requests_total{") && l.contains(&label))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or(0.0)
    };
    assert_eq!(
        (count("431"), count("400"), count("408")),
        (4.0, 2.0, 1.0),
        "{scrape}"
    );
}

#[tokio::test]
async fn client_api_keys_guard_the_proxy() {
    let node = start(fast_node("n")).await;
    let router = Router::start(vec![NodeSpec::of(&node, 2)], "api_keys: [k-one, k-two]\n").await;
    let url = format!("{}/api/chat", router.url());
    let body = chat_body(&["hi".into()], false);
    let send = async |key: Option<&str>| {
        let mut request = client().post(&url).json(&body);
        if let Some(key) = key {
            request = request.bearer_auth(key);
        }
        request.send().await.unwrap()
    };
    let resp = send(None).await;
    assert_eq!(resp.status(), 401);
    assert_eq!(header(&resp, "www-authenticate"), "Bearer");
    assert_eq!(send(Some("wrong")).await.status(), 401);
    for key in ["k-one", "k-two"] {
        assert_eq!(send(Some(key)).await.status(), 200, "{key}");
    }
    let tags = client()
        .get(format!("{}/api/tags", router.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(tags.status(), 401, "fleet endpoints are guarded too");
    let root = client().get(router.url()).send().await.unwrap();
    assert_eq!(root.status(), 200, "GET / stays open for liveness probes");
}

#[tokio::test]
async fn management_calls_need_the_token_and_a_named_node() {
    let a = start(fast_node("a")).await;
    let b = start(fast_node("b")).await;
    let router = Router::start(
        vec![NodeSpec::of(&a, 2), NodeSpec::of(&b, 2)],
        "admin_token: tok\nmanagement:\n  enabled: true\n",
    )
    .await;
    let url = format!("{}/api/copy", router.url());
    let body = serde_json::json!({ "source": MODEL, "destination": "mine:latest" });
    let resp = client().post(&url).json(&body).send().await.unwrap();
    assert_eq!(resp.status(), 401);
    let resp = client()
        .post(&url)
        .header("X-Fleet-Admin-Token", "tok")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    assert!(resp.text().await.unwrap().contains("X-Fleet-Target"));
    let resp = client()
        .post(&url)
        .header("X-Fleet-Admin-Token", "tok")
        .header("X-Fleet-Target", "b")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(
        header(&resp, "x-fleet-node"),
        "b",
        "sent to the named node, whatever it answers"
    );
    for routed in ["x-fleet-score", "x-fleet-affinity", "x-fleet-retries"] {
        assert!(
            resp.headers().get(routed).is_none(),
            "a management call is not routed, yet it says {routed}"
        );
    }
}

#[tokio::test]
async fn ndjson_stream_is_read_chunk_by_chunk_by_a_slow_reader_without_loss() {
    // The node writes its tokens as fast as it can; the client reads far slower, so the
    // reply backs up through corral.
    let node = start(slow("n", 0)).await;
    let router = Router::start(vec![NodeSpec::of(&node, 2)], "").await;
    let resp = hold(&router, "many tokens", 300).await;
    let mut stream = resp.bytes_stream();
    let mut text = Vec::new();
    while let Some(chunk) = stream.next().await {
        text.extend_from_slice(&chunk.unwrap());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let lines: Vec<serde_json::Value> = text
        .split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| serde_json::from_slice(l).expect("every line whole"))
        .collect();
    assert_eq!(lines.len(), 301);
    assert_eq!(lines[300]["done"], true);
}

#[tokio::test]
async fn an_oversized_body_gets_its_413_not_a_broken_pipe() {
    // corral refuses a body over the limit as soon as it sees its Content-Length. A client
    // still writing the rest used to fail with a broken pipe or a reset, never seeing the 413,
    // when corral closed the connection under it.
    let node = start(fast_node("n")).await;
    let router = Router::start(
        vec![NodeSpec::of(&node, 2)],
        "limits:\n  max_body_bytes: 1048576\n",
    )
    .await;
    let body = big_body_model_last(8 * 1024 * 1024);
    for attempt in 0..20 {
        let resp = client()
            .post(format!("{}/api/chat", router.url()))
            .body(body.clone())
            .send()
            .await
            .unwrap_or_else(|e| panic!("attempt {attempt}: no answer: {e:?}"));
        assert_eq!(resp.status(), 413, "attempt {attempt}");
        let answer: serde_json::Value = resp.json().await.unwrap();
        assert!(
            answer["error"]
                .as_str()
                .unwrap()
                .contains("larger than the limit"),
            "{answer}"
        );
    }
}
