//! The proxy path over real sockets: streaming, large bodies, retries, errors, and the
//! endpoints corral answers itself.

mod common;

use std::time::{Duration, Instant};

use common::*;
use futures::StreamExt;

/// Reads a streamed reply, noting when each chunk arrived.
async fn timed_chunks(resp: reqwest::Response) -> Vec<(Instant, bytes::Bytes)> {
    let mut out = Vec::new();
    let mut stream = resp.bytes_stream();
    while let Some(chunk) = stream.next().await {
        out.push((Instant::now(), chunk.expect("stream chunk")));
    }
    out
}

fn slow_node(name: &str) -> corral::standin::StandinConfig {
    let mut c = fast_node(name);
    c.decode_per_token = Duration::from_millis(150);
    c.reply_tokens = 5;
    c
}

#[tokio::test]
async fn ndjson_streams_chunk_by_chunk() {
    let node = start(slow_node("n")).await;
    let router = Router::start(vec![NodeSpec::of(&node, 2)], "").await;
    let resp = client()
        .post(format!("{}/api/chat", router.url()))
        .json(&chat_body(&["Hello".into()], true))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(header(&resp, "content-type").starts_with("application/x-ndjson"));
    let chunks = timed_chunks(resp).await;
    let text: Vec<u8> = chunks.iter().flat_map(|(_, c)| c.to_vec()).collect();
    let lines: Vec<serde_json::Value> = text
        .split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| serde_json::from_slice(l).expect("each line is JSON"))
        .collect();
    assert_eq!(lines.len(), 6, "five tokens and the final chunk");
    assert_eq!(lines.last().unwrap()["done"], true);
    // Unbuffered: the tokens came as separate reads, spread over the decode time. A router
    // that buffered the reply would deliver them in one burst at the end.
    assert!(chunks.len() >= 5, "{} reads", chunks.len());
    let spread = chunks.last().unwrap().0 - chunks.first().unwrap().0;
    assert!(
        spread >= Duration::from_millis(450),
        "first to last chunk: {spread:?}"
    );
}

#[tokio::test]
async fn sse_streams_event_by_event() {
    let node = start(slow_node("n")).await;
    let router = Router::start(vec![NodeSpec::of(&node, 2)], "").await;
    let body = serde_json::json!({
        "model": MODEL, "stream": true,
        "messages": [{ "role": "user", "content": "Hello" }],
    });
    let resp = client()
        .post(format!("{}/v1/chat/completions", router.url()))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(header(&resp, "content-type").starts_with("text/event-stream"));
    assert_eq!(header(&resp, "x-fleet-node"), "n");
    let chunks = timed_chunks(resp).await;
    let text = String::from_utf8(chunks.iter().flat_map(|(_, c)| c.to_vec()).collect()).unwrap();
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert!(events.iter().all(|e| e.starts_with("data: ")), "{text}");
    assert_eq!(*events.last().unwrap(), "data: [DONE]");
    assert!(chunks.len() >= 5);
    let spread = chunks.last().unwrap().0 - chunks.first().unwrap().0;
    assert!(
        spread >= Duration::from_millis(450),
        "first to last event: {spread:?}"
    );
}

#[tokio::test]
async fn one_mib_body_with_model_last_is_forwarded_byte_for_byte() {
    let echo = EchoNode::start().await;
    let router = Router::start(vec![echo.spec("echo")], "").await;
    let body = big_body_model_last(1024 * 1024);
    let resp = client()
        .post(format!("{}/api/chat", router.url()))
        .body(body.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(header(&resp, "x-fleet-node"), "echo");
    let echoed = resp.bytes().await.unwrap();
    assert_eq!(echoed.len(), body.len());
    assert!(
        echoed == body,
        "the node received exactly the client's bytes"
    );
}

#[tokio::test]
async fn one_mib_body_is_retried_on_the_next_node_after_a_refused_connection() {
    let first = start(fast_node("first")).await;
    let echo = EchoNode::start().await;
    // "first" is preferred (role bonus), passes its first health check and poll, then goes
    // away; checks and polls are slow here, so the router still believes it healthy.
    let router = Router::start(
        vec![NodeSpec::of(&first, 2).role("chat"), echo.spec("echo")],
        "health:\n  interval: 1h\npoll:\n  interval: 1h\n  timeout: 1s\n",
    )
    .await;
    first.stop().await;
    let body = big_body_model_last(1024 * 1024);
    let resp = client()
        .post(format!("{}/api/chat", router.url()))
        .body(body.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(header(&resp, "x-fleet-node"), "echo");
    assert_eq!(header(&resp, "x-fleet-retries"), "1");
    assert!(resp.bytes().await.unwrap() == body);
}

#[tokio::test]
async fn requests_fail_over_when_a_node_dies_and_return_when_it_recovers() {
    let a = start(fast_node("a")).await;
    let b = start(fast_node("b")).await;
    // Active checks are slow here: the circuit breaker takes the dead node out.
    let router = Router::start(
        vec![NodeSpec::of(&a, 2), NodeSpec::of(&b, 2)],
        "health:\n  interval: 1h\nbreaker:\n  failures: 2\n  cooldown: 300ms\n",
    )
    .await;
    a.stop().await;
    let mut retried = 0;
    for i in 0..8 {
        let resp = client()
            .post(format!("{}/api/chat", router.url()))
            .json(&chat_body(&[format!("question {i}")], false))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(header(&resp, "x-fleet-node"), "b");
        retried += header(&resp, "x-fleet-retries").parse::<usize>().unwrap();
    }
    // A refused connection (a client's, or the poller's) opens a's breaker at once.
    assert!(retried <= 1, "later requests skip a: {retried} retries");

    // Back again: after the cool-down the poller's next successful probe closes the
    // breaker, and a takes work again.
    a.restart().await.unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    let router = &router;
    let nodes = futures::future::join_all(
        (0..8).map(|i| async move { chat(router, &[format!("again {i}")]).await.0 }),
    )
    .await;
    assert!(
        nodes.iter().any(|n| n == "a"),
        "a recovered node gets traffic again: {nodes:?}"
    );
}

async fn expect_error(resp: reqwest::Response, status: u16, needle: &str) {
    assert_eq!(resp.status().as_u16(), status);
    assert!(header(&resp, "content-type").starts_with("application/json"));
    let body: serde_json::Value = resp.json().await.expect("a JSON error body");
    let message = body["error"].as_str().expect("an error field");
    assert!(
        message.contains(needle),
        "{message:?} should mention {needle:?}"
    );
}

#[tokio::test]
async fn bad_requests_get_clear_json_errors() {
    let node = start(fast_node("n")).await;
    let router = Router::start(
        vec![NodeSpec::of(&node, 2)],
        "limits:\n  max_body_bytes: 2097152\n",
    )
    .await;
    let url = |p: &str| format!("{}{p}", router.url());
    let c = client();

    expect_error(
        c.post(url("/api/chat"))
            .body("{not json")
            .send()
            .await
            .unwrap(),
        400,
        "invalid request body",
    )
    .await;
    expect_error(
        c.post(url("/api/chat"))
            .body(r#"{"messages":[]}"#)
            .send()
            .await
            .unwrap(),
        400,
        "model is required",
    )
    .await;
    expect_error(
        c.post(url("/api/chat"))
            .body(&b"{\"model\":\"\xff\"}"[..])
            .send()
            .await
            .unwrap(),
        400,
        "invalid",
    )
    .await;
    expect_error(
        c.post(url("/api/chat"))
            .body(r#"{"model":"m","stream":"yes"}"#)
            .send()
            .await
            .unwrap(),
        400,
        "boolean",
    )
    .await;
    expect_error(
        c.post(url("/api/chat"))
            .body(r#"{"model":"nope:1b","messages":[]}"#)
            .send()
            .await
            .unwrap(),
        404,
        "model 'nope:1b' not found",
    )
    .await;
    expect_error(
        c.post(url("/api/chat"))
            .body(big_body_model_last(3 * 1024 * 1024))
            .send()
            .await
            .unwrap(),
        413,
        "larger than",
    )
    .await;
    expect_error(
        c.post(url("/api/pull"))
            .body(r#"{"model":"x"}"#)
            .send()
            .await
            .unwrap(),
        403,
        "disabled",
    )
    .await;
    expect_error(
        c.delete(url("/api/delete"))
            .body(r#"{"model":"x"}"#)
            .send()
            .await
            .unwrap(),
        403,
        "disabled",
    )
    .await;
    expect_error(
        c.get(url("/api/nothing")).send().await.unwrap(),
        404,
        "not found",
    )
    .await;
    expect_error(c.get(url("/api/chat")).send().await.unwrap(), 405, "POST").await;

    // After all that, the router still serves.
    let (n, _, _) = chat(&router, &["still there?".into()]).await;
    assert_eq!(n, "n");
}

#[tokio::test]
async fn with_every_node_down_a_request_waits_for_one_and_503s_only_when_the_wait_is_over() {
    let node = start(fast_node("n")).await;
    let router = Router::start(
        vec![NodeSpec::of(&node, 2)],
        "health:\n  interval: 200ms\nqueue:\n  max_wait: 3s\n",
    )
    .await;
    node.stop().await;
    let send = || {
        client()
            .post(format!("{}/api/chat", router.url()))
            .json(&chat_body(&["hi".into()], false))
            .send()
    };

    // Nothing comes back: 503 with Retry-After, once queue.max_wait is over.
    let started = Instant::now();
    let resp = send().await.unwrap();
    assert_eq!(resp.status(), 503);
    assert!(
        started.elapsed() >= Duration::from_secs(3),
        "held for queue.max_wait first"
    );
    assert!(!header(&resp, "retry-after").is_empty());
    let body: serde_json::Value = resp.json().await.unwrap();
    let error = body["error"].as_str().unwrap();
    assert!(error.contains("refused"), "{error}");

    // The node comes back while a request waits: the request is served.
    let waiting = tokio::spawn(send());
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !waiting.is_finished(),
        "the request waits while the node is down"
    );
    node.restart().await.unwrap();
    let resp = waiting.await.unwrap().unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(header(&resp, "x-fleet-node"), "n");
}

#[tokio::test]
async fn fleet_endpoints_merge_the_nodes() {
    let mut a = fast_node("a");
    a.models.push(model("qwen2.5:14b", 9.0));
    let a = start(a).await;
    let b = start(fast_node("b")).await;
    let router = Router::start(vec![NodeSpec::of(&a, 2), NodeSpec::of(&b, 2)], "").await;
    let c = client();
    let get = |p: &str| c.get(format!("{}{p}", router.url())).send();

    let tags: serde_json::Value = get("/api/tags").await.unwrap().json().await.unwrap();
    let mut names: Vec<&str> = tags["models"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["name"].as_str().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, vec!["llama3:8b", "qwen2.5:14b"], "each model once");

    let ps: serde_json::Value = get("/api/ps").await.unwrap().json().await.unwrap();
    assert_eq!(ps["models"].as_array().unwrap().len(), 1);

    let models: serde_json::Value = get("/v1/models").await.unwrap().json().await.unwrap();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"].as_array().unwrap().len(), 2);

    let version: serde_json::Value = get("/api/version").await.unwrap().json().await.unwrap();
    assert!(version["version"].is_string());

    let root = get("/").await.unwrap();
    assert_eq!(root.status(), 200);
    assert_eq!(root.text().await.unwrap(), "Ollama is running");
    let head = c.head(router.url()).send().await.unwrap();
    assert_eq!(head.status(), 200);
}

#[tokio::test]
async fn a_client_that_leaves_releases_its_place() {
    let node = start(slow_node("n")).await;
    let router = Router::start(vec![NodeSpec::of(&node, 2)], "").await;
    let mut body = chat_body(&["long one".into()], true);
    body["options"] = serde_json::json!({ "num_predict": 100 });
    let resp = client()
        .post(format!("{}/api/chat", router.url()))
        .json(&body)
        .send()
        .await
        .unwrap();
    let mut stream = resp.bytes_stream();
    stream.next().await.expect("a first chunk").unwrap();
    drop(stream);
    // The router counts nothing in flight once it notices.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let resp = client()
            .post(format!("{}/api/chat", router.url()))
            .header("X-Fleet-Explain", "1")
            .json(&chat_body(&["short".into()], false))
            .send()
            .await
            .unwrap();
        let explain = header(&resp, "x-fleet-explain");
        if explain.contains("queue=0.0") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "in-flight count never released: {explain}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Sends `count` chats one after another on one kept-alive connection, each the moment the
/// previous reply has been read whole, and returns each reply's status (0: the connection
/// failed).
async fn back_to_back(addr: std::net::SocketAddr, count: usize) -> Vec<u16> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let body = chat_body(&["hi".to_string()], false).to_string();
    let request = format!(
        "POST /api/chat HTTP/1.1\r\nHost: corral\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut statuses = Vec::with_capacity(count);
    let Ok(mut stream) = tokio::net::TcpStream::connect(addr).await else {
        return vec![0; count];
    };
    let mut buf = Vec::new();
    for _ in 0..count {
        if stream.write_all(request.as_bytes()).await.is_err() {
            statuses.push(0);
            break;
        }
        // Read one whole reply: its head, then Content-Length bytes of body.
        let reply = loop {
            let mut headers = [httparse::EMPTY_HEADER; 32];
            let mut parsed = httparse::Response::new(&mut headers);
            if let Ok(httparse::Status::Complete(head_len)) = parsed.parse(&buf) {
                let length = parsed
                    .headers
                    .iter()
                    .find(|h| h.name.eq_ignore_ascii_case("content-length"))
                    .and_then(|h| std::str::from_utf8(h.value).ok()?.parse::<usize>().ok());
                if let Some(length) = length
                    && buf.len() >= head_len + length
                {
                    break Some((parsed.code.unwrap_or(0), head_len + length));
                }
            }
            let mut chunk = [0u8; 4096];
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => break None,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        match reply {
            Some((status, used)) => {
                statuses.push(status);
                buf.drain(..used);
            }
            None => {
                statuses.push(0);
                break;
            }
        }
    }
    statuses.resize(count, 0);
    statuses
}

#[tokio::test]
async fn back_to_back_requests_on_kept_alive_connections_are_all_served() {
    // Once a reply with a declared length is written, a client may send its next request at
    // once. corral used to watch for a gone client while it read the node's (already
    // finished) reply, and sometimes took the next request's first byte for a disconnect:
    // that reply was logged as 499 and the next request arrived as "OST /api/chat" (405).
    let echo = EchoNode::start().await;
    let mut spec = echo.spec("echo");
    spec.num_parallel = 64;
    let router = Router::start(vec![spec], "threads: 2\n").await;
    let addr = router.url().trim_start_matches("http://").parse().unwrap();
    let clients: Vec<_> = (0..8)
        .map(|_| tokio::spawn(back_to_back(addr, 150)))
        .collect();
    let mut statuses = Vec::new();
    for c in clients {
        statuses.extend(c.await.unwrap());
    }
    let failed: Vec<_> = statuses.iter().filter(|s| **s != 200).collect();
    assert!(
        failed.is_empty(),
        "{} of {} back-to-back requests were not served: {failed:?}",
        failed.len(),
        statuses.len()
    );
}
