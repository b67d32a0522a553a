//! Model placement through the real `corral` binary in front of stand-in nodes that load
//! and evict models as Ollama does: loads corral starts are counted in the next decisions,
//! and a reply that shows a load makes corral read the node's residency again at once.

mod common;

use std::time::Duration;

use common::*;
use corral::standin::{GIB, StandinConfig};

/// A node with `gib` GiB for models and these models on disk, none loaded, 200 ms loads.
fn empty_node(name: &str, gib: u64, models: &[(&str, f64)]) -> StandinConfig {
    let mut cfg = fast_node(name);
    cfg.memory_bytes = gib * GIB;
    cfg.models = models.iter().map(|(m, gb)| model(m, *gb)).collect();
    cfg.preload = Vec::new();
    cfg.load_time = Duration::from_millis(200);
    cfg
}

/// Sends a one-message chat for `model` and returns the node that answered.
async fn ask(router_url: String, model: String, text: String) -> String {
    let body = serde_json::json!({
        "model": model,
        "messages": [{ "role": "user", "content": text }],
        "stream": false,
    });
    let resp = client()
        .post(format!("{router_url}/api/chat"))
        .json(&body)
        .send()
        .await
        .expect("a reply");
    assert_eq!(resp.status(), 200, "{model}");
    header(&resp, "x-fleet-node")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn six_first_requests_for_three_models_load_each_model_once_without_eviction() {
    // Each node holds any two of the three 10 GB models, not all three.
    let models = [("x:1", 10.0), ("y:1", 10.0), ("z:1", 10.0)];
    let a = start(empty_node("a", 24, &models)).await;
    let b = start(empty_node("b", 24, &models)).await;
    let memory_gb = (24 * GIB) as f64 / 1e9;
    let nodes = vec![
        NodeSpec::of(&a, 2).memory(memory_gb),
        NodeSpec::of(&b, 2).memory(memory_gb),
    ];
    let router = Router::start(nodes, "").await;

    // Two first requests per model, all sent at once.
    let asks = ["x:1", "y:1", "z:1", "x:1", "y:1", "z:1"]
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let (url, m) = (router.url(), m.to_string());
            tokio::spawn(ask(url, m, format!("conversation {i}")))
        });
    let answered: Vec<String> = futures::future::join_all(asks)
        .await
        .into_iter()
        .map(|r| r.expect("the request task ran"))
        .collect();

    let (ca, cb) = (a.churn(), b.churn());
    assert_eq!(
        ca.loads + cb.loads,
        3,
        "each model loaded once: {ca:?} {cb:?}, answered by {answered:?}"
    );
    assert_eq!(ca.evictions + cb.evictions, 0, "{ca:?} {cb:?}");
    for i in 0..3 {
        assert_eq!(
            answered[i],
            answered[i + 3],
            "both requests for {} on one node",
            models[i].0
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_that_loaded_a_model_makes_corral_read_the_nodes_residency_again() {
    // Room for one model: loading y evicts x.
    let mut cfg = empty_node("solo", 12, &[("x:1", 10.0), ("y:1", 10.0)]);
    cfg.preload = vec!["x:1".into()];
    let node = start(cfg).await;
    let metrics_port = free_port();
    // Polls an hour apart: only the first one happens during the test.
    let extra =
        format!("metrics_listen: 127.0.0.1:{metrics_port}\npoll:\n  interval: 1h\n  timeout: 1s\n");
    let router = Router::start(vec![NodeSpec::of(&node, 2)], &extra).await;
    let resident = async || -> Vec<String> {
        let ps = get_json(&format!("{}/api/ps", router.url())).await;
        let models = ps["models"].as_array().cloned().unwrap_or_default();
        models
            .iter()
            .filter_map(|m| m["name"].as_str().map(str::to_string))
            .collect()
    };
    eventually("the first poll saw x", async || resident().await == ["x:1"]).await;

    ask(router.url(), "y:1".into(), "hello".into()).await;
    assert_eq!(node.churn().evictions, 1, "the node evicted x for y");
    eventually("corral re-read the node: y in, x out", async || {
        resident().await == ["y:1"]
    })
    .await;
    let text = scrape(metrics_port).await;
    let has = |line: &str| text.lines().any(|l| l == line);
    assert!(
        has(r#"corral_evictions_seen_total{model="x:1",node="solo"} 1"#),
        "{text}"
    );
    assert!(
        has(r#"corral_cold_loads_total{model="y:1",node="solo"} 1"#),
        "{text}"
    );
}

/// Sends a chat for `model` whose reply streams, and returns the stream once its first
/// chunk came, with the time it came and the node that answers.
async fn open_stream(
    router_url: &str,
    model: &str,
    text: &str,
) -> (
    impl futures::Stream<Item = reqwest::Result<bytes::Bytes>> + Unpin + use<>,
    std::time::Instant,
    String,
) {
    use futures::StreamExt;
    let body = serde_json::json!({
        "model": model,
        "messages": [{ "role": "user", "content": text }],
        "stream": true,
    });
    let resp = client()
        .post(format!("{router_url}/api/chat"))
        .json(&body)
        .send()
        .await
        .expect("a reply");
    assert_eq!(resp.status(), 200);
    let node = header(&resp, "x-fleet-node");
    let mut stream = resp.bytes_stream();
    let first = stream
        .next()
        .await
        .expect("a first chunk")
        .expect("readable");
    assert!(!first.is_empty());
    (stream, std::time::Instant::now(), node)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_not_told_its_slots_that_runs_two_gets_two_requests_at_once() {
    use futures::StreamExt;
    // The node runs two requests at once; corral is not told (0: `num_parallel` left out).
    let mut cfg = empty_node("two", 24, &[("x:1", 4.7)]);
    cfg.preload = vec!["x:1".into()];
    cfg.num_parallel = 2;
    cfg.decode_per_token = Duration::from_millis(20);
    cfg.reply_tokens = 40;
    let node = start(cfg).await;
    let router = Router::start(vec![NodeSpec::of(&node, 0)], "").await;

    let (mut first, _, _) = open_stream(&router.url(), "x:1", "conversation one").await;
    // Read to its end as it comes, noting when its last chunk came.
    let first_ended = tokio::spawn(async move {
        let mut last = std::time::Instant::now();
        while let Some(chunk) = first.next().await {
            chunk.expect("readable");
            last = std::time::Instant::now();
        }
        last
    });
    // Sent while the first streams: rather than wait in corral, it probes the node.
    let (second, second_began, _) = open_stream(&router.url(), "x:1", "conversation two").await;
    let first_ended = first_ended.await.expect("the reading task ran");
    assert!(
        second_began < first_ended,
        "the second reply began only after the first ended: corral held it back"
    );
    drop(second);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_whose_node_is_full_of_live_conversations_gains_a_second_home_without_eviction() {
    // The small node holds only x; the big one has room for x beside y.
    let slow = |mut cfg: StandinConfig| {
        cfg.num_parallel = 2;
        cfg.decode_per_token = Duration::from_millis(20);
        cfg.reply_tokens = 20;
        cfg
    };
    let small = start(slow(empty_node("small", 8, &[("x:1", 4.7)]))).await;
    let big = start(slow(empty_node("big", 24, &[("x:1", 4.7), ("y:1", 16.0)]))).await;
    let nodes = vec![
        NodeSpec::of(&small, 2).memory((8 * GIB) as f64 / 1e9),
        NodeSpec::of(&big, 2).memory((24 * GIB) as f64 / 1e9),
    ];
    let router = Router::start(nodes, "").await;

    // Two conversations: x goes to the node it fits best, and both run there.
    let (one, _, first_node) = open_stream(&router.url(), "x:1", "conversation one").await;
    let (two, _, second_node) = open_stream(&router.url(), "x:1", "conversation two").await;
    assert_eq!(
        (first_node.as_str(), second_node.as_str()),
        ("small", "small")
    );
    // A third while both of small's slots are taken by live conversations.
    let third = ask(router.url(), "x:1".into(), "conversation three".into()).await;
    assert_eq!(
        third, "big",
        "x gains a second home where it fits in free memory"
    );
    drop((one, two));
    let (s, b) = (small.churn(), big.churn());
    assert_eq!((s.loads, b.loads), (1, 1), "{s:?} {b:?}");
    assert_eq!(s.evictions + b.evictions, 0, "{s:?} {b:?}");
}

/// Sends `n` new conversations for `model` at once and returns the nodes that answered.
async fn burst(router_url: &str, model: &str, n: usize, name: &str) -> Vec<String> {
    let asks = (0..n).map(|i| {
        let (url, model, text) = (
            router_url.to_string(),
            model.to_string(),
            format!("{name} {i}"),
        );
        tokio::spawn(ask(url, model, text))
    });
    futures::future::join_all(asks)
        .await
        .into_iter()
        .map(|r| r.expect("the request task ran"))
        .collect()
}

/// A node of one slot with x on disk, nothing loaded, whose replies take `reply_ms`.
fn one_slot(name: &str, reply_ms: u64) -> StandinConfig {
    let mut cfg = empty_node(name, 24, &[("x:1", 4.7)]);
    cfg.num_parallel = 1;
    cfg.reply_tokens = 20;
    cfg.decode_per_token = Duration::from_millis(reply_ms / 20);
    cfg
}

/// As most fleets are configured: neither its memory nor its slots told.
fn spec(node: &corral::standin::StandinNode) -> NodeSpec {
    NodeSpec::of(node, 0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_fresh_fleet_requests_that_would_wait_load_the_model_on_every_node() {
    let nodes =
        futures::future::join_all((0..3).map(|i| start(one_slot(&format!("n{i}"), 400)))).await;
    let router = Router::start(nodes.iter().map(spec).collect(), "").await;

    // Six at once on three empty nodes of one slot: the first loads x on one node; nothing
    // has ended yet, so the wait there is unknown and the next ones load it elsewhere.
    let answered = burst(&router.url(), "x:1", 6, "fresh").await;
    for node in &nodes {
        let churn = node.churn();
        assert!(
            !node.log().is_empty(),
            "{} served nothing: {answered:?}",
            node.name()
        );
        assert_eq!(churn.loads, 1, "{}: {churn:?}", node.name());
        assert_eq!(churn.evictions, 0, "{}: {churn:?}", node.name());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn once_its_models_timed_out_a_fleet_loads_again_on_every_node_a_burst_waits_for() {
    let short_keep_alive = |name: &str| {
        let mut cfg = one_slot(name, 400);
        cfg.keep_alive = Duration::from_millis(500);
        cfg
    };
    let (a, b) = (
        start(short_keep_alive("a")).await,
        start(short_keep_alive("b")).await,
    );
    let router = Router::start(vec![spec(&a), spec(&b)], "").await;
    burst(&router.url(), "x:1", 4, "morning").await;
    assert_eq!((a.churn().loads, b.churn().loads), (1, 1));

    // Idle past its keep-alive, each node unloads x, and corral's polls see it gone.
    eventually("both nodes unloaded x and corral saw it", async || {
        let ps = get_json(&format!("{}/api/ps", router.url())).await;
        a.resident().is_empty() && b.resident().is_empty() && ps["models"] == serde_json::json!([])
    })
    .await;
    let answered = burst(&router.url(), "x:1", 4, "afternoon").await;
    for node in [&a, &b] {
        assert_eq!(node.churn().loads, 2, "{}: {answered:?}", node.name());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_node_loads_the_model_again_when_requests_queue_elsewhere() {
    // Replies of 1 s on one slot each, x loaded on both; no load has been seen, so corral
    // counts one as 5 s: a queue of several seconds on `a` is worth a load on `b`.
    let preloaded = |name: &str| {
        let mut cfg = one_slot(name, 1000);
        cfg.preload = vec!["x:1".into()];
        cfg
    };
    let a = start(preloaded("a")).await;
    let b_cfg = preloaded("b");
    let b = start(b_cfg.clone()).await;
    let b_addr = b.addr();
    let admin_port = free_port();
    let admin = format!("admin_listen: 127.0.0.1:{admin_port}\n");
    // Slots told: with them untold, how long the queue on `a` looks hangs on what corral's
    // probes of its slots happen to find by then, which a busy machine's timing changes.
    let told = |node: &corral::standin::StandinNode| NodeSpec::of(node, 1);
    let router = Router::start(vec![told(&a), told(&b)], &admin).await;
    let answered = burst(&router.url(), "x:1", 2, "before").await;
    assert!(answered.iter().any(|n| n == "b"), "{answered:?}");

    // `b` restarts: a new process on the same address, with nothing loaded. Stopping waits
    // until its listener is closed, so that the new one can bind the port.
    b.stop().await;
    drop(b);
    let mut fresh = b_cfg;
    fresh.preload.clear();
    let b = corral::standin::StandinNode::start(fresh, b_addr)
        .await
        .expect("b restarts on its address");
    eventually("corral takes b to be up without x", async || {
        let body =
            serde_json::json!({ "model": "x:1", "messages": [{ "role": "user", "content": "?" }] });
        let table: serde_json::Value = client()
            .post(format!("http://127.0.0.1:{admin_port}/explain"))
            .json(&body)
            .send()
            .await
            .expect("the admin API answers")
            .json()
            .await
            .expect("a JSON table");
        let candidates = table["candidates"].as_array().cloned().unwrap_or_default();
        let b_now = candidates.iter().find(|c| c["node"] == "b");
        b_now.is_some_and(|c| c["resident"] == false && c["standby"] == false)
    })
    .await;

    let answered = burst(&router.url(), "x:1", 8, "after").await;
    assert!(
        answered.iter().any(|n| n == "b"),
        "the restarted node served none of them: {answered:?}"
    );
    assert_eq!(b.churn().loads, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_added_while_requests_wait_loads_the_model_and_serves_them() {
    let mut a_cfg = one_slot("a", 1000);
    a_cfg.preload = vec!["x:1".into()];
    let a = start(a_cfg).await;
    let b = start(one_slot("b", 1000)).await;
    let patient = "queue:\n  max_wait: 60s\n";
    let router = Router::start(vec![spec(&a)], patient).await;

    // Eight at once on one slot of 1 s: seven wait in corral.
    let waiting = {
        let url = router.url();
        tokio::spawn(async move { burst(&url, "x:1", 8, "queued").await })
    };
    eventually("requests wait in corral", async || a.log().len() == 1).await;
    router.rewrite_config(&[spec(&a), spec(&b)], patient);
    router.signal("HUP");

    let answered = waiting.await.expect("the burst ran");
    assert!(
        answered.iter().any(|n| n == "b"),
        "the added node served none of the waiting requests: {answered:?}"
    );
    assert_eq!(b.churn().loads, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_conversations_that_must_wait_share_the_queue_between_equal_nodes() {
    // Two equal nodes of one slot with x loaded, each busy with a long reply.
    let busy_node = |name: &str| {
        let mut cfg = one_slot(name, 2000);
        cfg.preload = vec!["x:1".into()];
        cfg
    };
    let (a, b) = (start(busy_node("a")).await, start(busy_node("b")).await);
    let admin_port = free_port();
    let admin = format!("admin_listen: 127.0.0.1:{admin_port}\n");
    let nodes = vec![NodeSpec::of(&a, 1), NodeSpec::of(&b, 1)];
    let router = Router::start(nodes, &admin).await;
    let holds = futures::future::join_all((0..2).map(|i| {
        let url = router.url();
        tokio::spawn(ask(url, "x:1".into(), format!("long {i}")))
    }));
    let running = tokio::spawn(holds);
    eventually("both nodes run one", async || {
        a.log().len() == 1 && b.log().len() == 1
    })
    .await;

    // Four new conversations: none can start, and they wait two for each node.
    let waiting = {
        let url = router.url();
        tokio::spawn(async move { burst(&url, "x:1", 4, "waits").await })
    };
    let fleet = format!("http://127.0.0.1:{admin_port}/fleet");
    eventually("four requests wait, two for each node", async || {
        let status = get_json(&fleet).await;
        let waits: Vec<u64> = (status["nodes"].as_array().cloned().unwrap_or_default())
            .iter()
            .map(|n| n["models"]["x:1"]["waiting"].as_u64().unwrap_or(0))
            .collect();
        waits == [2, 2]
    })
    .await;
    // Every one is served (which node serves it is decided again as slots free).
    assert_eq!(waiting.await.expect("the burst ran").len(), 4);
    running.await.expect("the long replies ran");
}

/// Ten new conversations at once on two nodes of one slot with x loaded, replies of 0.3 s on
/// `fast` and 1.2 s on `slow`: two start, eight wait. Served as slots free, `fast` runs about
/// four for each of `slow`'s and both finish near 2.4 s; a queue per node filled before
/// either speed is known (five each) would keep `slow` busy for 6 s.
async fn ten_waiting_on_a_fast_and_a_slow_node(num_parallel: usize) {
    let loaded = |name: &str, reply_ms: u64| {
        let mut cfg = one_slot(name, reply_ms);
        cfg.preload = vec!["x:1".into()];
        cfg
    };
    let (fast, slow) = (
        start(loaded("fast", 300)).await,
        start(loaded("slow", 1200)).await,
    );
    let nodes = vec![
        NodeSpec::of(&fast, num_parallel),
        NodeSpec::of(&slow, num_parallel),
    ];
    let router = Router::start(nodes, "").await;

    let answered = burst(&router.url(), "x:1", 10, "waits").await;
    let on = |name: &str| answered.iter().filter(|n| *n == name).count();
    assert!(
        (1..=3).contains(&on("slow")) && on("fast") >= 7,
        "fast served {}, slow {}: {answered:?}",
        on("fast"),
        on("slow")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_conversations_that_must_wait_go_to_nodes_by_their_speed() {
    ten_waiting_on_a_fast_and_a_slow_node(1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_conversations_that_must_wait_go_to_nodes_by_their_speed_slots_untold() {
    // corral probes each node's slots: one request past what it has shown waits there.
    ten_waiting_on_a_fast_and_a_slow_node(0).await;
}
