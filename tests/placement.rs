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
