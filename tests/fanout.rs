//! Embedding batches fanned out over the nodes holding the model, over real sockets: the
//! merged reply equals one node's reply for the whole batch (order, shape, values), and a
//! node that dies mid-batch has its chunk served elsewhere.

mod common;

use std::time::Duration;

use async_openai::Client;
use async_openai::config::OpenAIConfig;
use async_openai::types::embeddings::CreateEmbeddingRequestArgs;
use common::*;
use serde_json::{Value, json};

const EMBED: &str = "nomic-embed-text:latest";

async fn fleet(prefill: Duration) -> (Vec<corral::standin::StandinNode>, Router) {
    let cfgs = (0..3).map(|i| {
        let mut c = fast_node(&format!("n{i}"));
        c.models.push(model(EMBED, 0.3));
        c.preload.push(EMBED.to_string());
        c.prefill_per_token = prefill;
        c
    });
    let nodes = futures::future::join_all(cfgs.map(start)).await;
    let specs = nodes.iter().map(|n| NodeSpec::of(n, 2)).collect();
    let router = Router::start(specs, "embed_fanout:\n  chunk_size: 8\n").await;
    (nodes, router)
}

fn inputs(n: usize) -> Vec<String> {
    (0..n)
        .map(|i| format!("input number {i}: some text to embed"))
        .collect()
}

async fn post(url: &str, body: &Value) -> reqwest::Response {
    client().post(url).json(body).send().await.expect("a reply")
}

fn keys(v: &Value) -> Vec<String> {
    let mut keys: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
    keys.sort();
    keys
}

#[tokio::test]
async fn a_batch_is_split_over_the_nodes_and_merged_in_order() {
    let (nodes, router) = fleet(Duration::from_micros(5)).await;
    let body = json!({ "model": EMBED, "input": inputs(100) });
    let resp = post(&format!("{}/api/embed", router.url()), &body).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(
        header(&resp, "x-fleet-fanout"),
        "13",
        "100 inputs in chunks of 8"
    );
    let served_by = header(&resp, "x-fleet-node");
    let merged: Value = resp.json().await.unwrap();
    let seen: Vec<_> = nodes.iter().map(|n| n.log()).collect();
    let whole: Value = post(&format!("{}/api/embed", nodes[0].url()), &body)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(
        merged["embeddings"], whole["embeddings"],
        "same vectors, same order"
    );
    assert_eq!(
        keys(&merged),
        keys(&whole),
        "same shape as one node's reply"
    );
    assert_eq!(merged["prompt_eval_count"], whole["prompt_eval_count"]);
    let used: Vec<_> = nodes
        .iter()
        .zip(&seen)
        .filter(|(_, log)| !log.is_empty())
        .map(|(n, _)| n.name())
        .collect();
    assert!(
        used.len() >= 2,
        "the chunks were spread: {used:?} ({served_by})"
    );
    for name in &used {
        assert!(served_by.contains(name), "{served_by} names {name}");
    }
    // At most chunk_size inputs per request a node saw.
    let requests: Vec<u64> = seen
        .iter()
        .flatten()
        .map(|r| u64::from(r.prompt_tokens))
        .collect();
    assert_eq!(requests.len(), 13, "{requests:?}");
    let one_input = whole["prompt_eval_count"].as_u64().unwrap() / 100;
    assert!(
        requests.iter().all(|&t| t <= 8 * (one_input + 1)),
        "{requests:?}"
    );

    // A short batch is one request to one node.
    let short = json!({ "model": EMBED, "input": inputs(5) });
    let resp = post(&format!("{}/api/embed", router.url()), &short).await;
    assert_eq!(resp.status(), 200);
    assert!(header(&resp, "x-fleet-fanout").is_empty());
}

#[tokio::test]
async fn openai_embeddings_fan_out_through_async_openai() {
    let (nodes, router) = fleet(Duration::from_micros(5)).await;
    let client = Client::with_config(
        OpenAIConfig::new()
            .with_api_base(format!("{}/v1", router.url()))
            .with_api_key("unused"),
    );
    let request = CreateEmbeddingRequestArgs::default()
        .model(EMBED)
        .input(inputs(30))
        .build()
        .unwrap();
    let reply = client
        .embeddings()
        .create(request)
        .await
        .expect("embeddings");
    assert_eq!(reply.data.len(), 30);
    let direct: Value = post(
        &format!("{}/v1/embeddings", nodes[1].url()),
        &json!({ "model": EMBED, "input": inputs(30) }),
    )
    .await
    .json()
    .await
    .unwrap();
    for (i, item) in reply.data.iter().enumerate() {
        assert_eq!(item.index as usize, i);
        let expected: Vec<f32> =
            serde_json::from_value(direct["data"][i]["embedding"].clone()).unwrap();
        assert_eq!(item.embedding, expected, "input {i}");
    }
    assert_eq!(
        u64::from(reply.usage.prompt_tokens),
        direct["usage"]["prompt_tokens"].as_u64().unwrap()
    );
    let served: usize = nodes.iter().map(|n| n.log().len()).sum();
    assert!(
        served >= 4,
        "30 inputs in chunks of 8 is four requests: {served}"
    );
}

#[tokio::test]
async fn a_node_dying_mid_batch_has_its_chunk_served_elsewhere() {
    // 1 ms per token: each chunk takes tens of milliseconds, so a node can die mid-chunk.
    let (nodes, router) = fleet(Duration::from_millis(1)).await;
    let body = json!({ "model": EMBED, "input": inputs(96) });
    let url = format!("{}/api/embed", router.url());
    let batch = tokio::spawn({
        let body = body.clone();
        async move { post(&url, &body).await }
    });
    eventually("n1 started a chunk", async || !nodes[1].log().is_empty()).await;
    nodes[1].stop().await;
    let resp = batch.await.unwrap();
    assert_eq!(resp.status(), 200);
    let retries: usize = header(&resp, "x-fleet-retries").parse().unwrap();
    assert!(retries >= 1, "n1's chunk was retried");
    let merged: Value = resp.json().await.unwrap();
    let whole: Value = post(&format!("{}/api/embed", nodes[0].url()), &body)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(merged["embeddings"], whole["embeddings"]);
    assert_eq!(merged["embeddings"].as_array().unwrap().len(), 96);
}

#[tokio::test]
async fn a_client_that_leaves_stops_the_batch() {
    // 12 chunks of about 80 ms each over 3 nodes: at least 320 ms of work.
    let (nodes, router) = fleet(Duration::from_millis(1)).await;
    let body = json!({ "model": EMBED, "input": inputs(96) });
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(100))
        .build()
        .unwrap();
    let gone = impatient
        .post(format!("{}/api/embed", router.url()))
        .json(&body)
        .send()
        .await;
    assert!(gone.is_err(), "the client gave up first");
    // Long enough for every chunk to have been sent, had corral not stopped.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let chunks: usize = nodes.iter().map(|n| n.log().len()).sum();
    assert!(
        chunks < 12,
        "{chunks} of 12 chunks were sent after the client left"
    );
}
