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
