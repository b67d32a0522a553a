//! A bounded soak: 2,000 requests, streamed and not, while nodes are stopped and restarted
//! one at a time. No request may fail before its reply started (those are retried on
//! another node), and every reply cut short is reported as such, to the client and in the
//! metrics.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::*;
use futures::StreamExt;

const REQUESTS: usize = 2000;
const CONCURRENCY: usize = 16;

#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    /// A complete reply.
    Complete,
    /// The reply started (status 200) and was cut short.
    Broken,
    /// No reply at all, or an error status: what the router must never let through.
    Failed(String),
}

async fn run(url: &str, i: usize) -> Outcome {
    let stream = i.is_multiple_of(2);
    let mut body = chat_body(&[format!("soak request {i}")], stream);
    body["options"] = serde_json::json!({ "num_predict": 30 });
    let resp = match client()
        .post(format!("{url}/api/chat"))
        .json(&body)
        .send()
        .await
    {
        Ok(resp) => resp,
        Err(e) => return Outcome::Failed(format!("request {i}: {e}")),
    };
    if resp.status() != 200 {
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        return Outcome::Failed(format!("request {i}: {status} {text}"));
    }
    let mut bytes = Vec::new();
    let mut chunks = resp.bytes_stream();
    while let Some(chunk) = chunks.next().await {
        match chunk {
            Ok(c) => bytes.extend_from_slice(&c),
            // A whole reply with a declared length is cut by closing the connection, so
            // that the client sees a short body; a stream must end with an error line.
            Err(_) if !stream => return Outcome::Broken,
            Err(e) => return Outcome::Failed(format!("request {i}: stream cut silently: {e}")),
        }
    }
    let text = String::from_utf8_lossy(&bytes);
    let last = text
        .lines()
        .last()
        .and_then(|l| serde_json::from_str::<serde_json::Value>(l).ok());
    match last {
        Some(v) if v["done"] == true => Outcome::Complete,
        Some(v) if stream && v["error"].is_string() => Outcome::Broken,
        _ => Outcome::Failed(format!("request {i}: reply ended unfinished: {text}")),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_with_nodes_dying_and_coming_back() {
    let nodes: Vec<_> = futures::future::join_all((0..3).map(|i| {
        let mut c = fast_node(&format!("n{i}"));
        c.decode_per_token = Duration::from_millis(4);
        c.num_parallel = 4;
        start(c)
    }))
    .await
    .into_iter()
    .map(Arc::new)
    .collect();
    let metrics_port = free_port();
    let router = Router::start(
        nodes.iter().map(|n| NodeSpec::of(n, 4)).collect(),
        &format!(
            "metrics_listen: 127.0.0.1:{metrics_port}\nhealth:\n  interval: 300ms\n\
             breaker:\n  failures: 2\n  cooldown: 200ms\n"
        ),
    )
    .await;

    // Chaos: stop one node at a time for a while, then bring it back.
    let done = Arc::new(AtomicBool::new(false));
    let chaos = tokio::spawn({
        let (nodes, done) = (nodes.clone(), done.clone());
        async move {
            let mut cuts = 0;
            let mut i = 0;
            while !done.load(Ordering::Relaxed) && cuts < 200 {
                tokio::time::sleep(Duration::from_millis(400)).await;
                let node = &nodes[i % nodes.len()];
                node.stop().await;
                cuts += 1;
                tokio::time::sleep(Duration::from_millis(600)).await;
                node.restart().await.expect("restart");
                i += 1;
            }
            cuts
        }
    });

    let url = router.url();
    let outcomes: Vec<Outcome> = tokio::time::timeout(
        Duration::from_secs(240),
        futures::stream::iter(0..REQUESTS)
            .map(|i| {
                let url = url.clone();
                async move { run(&url, i).await }
            })
            .buffer_unordered(CONCURRENCY)
            .collect(),
    )
    .await
    .expect("the soak finished in time");
    done.store(true, Ordering::Relaxed);
    let cuts = chaos.await.unwrap();

    let failed: Vec<&Outcome> = outcomes
        .iter()
        .filter(|o| matches!(o, Outcome::Failed(_)))
        .collect();
    let broken = outcomes.iter().filter(|o| **o == Outcome::Broken).count();
    let complete = outcomes.iter().filter(|o| **o == Outcome::Complete).count();
    println!(
        "soak: {REQUESTS} requests, {cuts} node stops, {complete} complete, {broken} cut mid-reply"
    );
    assert!(
        failed.is_empty(),
        "requests failed before their reply started: {failed:?}"
    );
    assert!(cuts >= 5, "the soak ran through several node stops");

    // Requests are counted when Pingora logs them, just after the reply ends.
    let broken_streams = async || -> usize {
        scrape(metrics_port)
            .await
            .lines()
            .filter(|l| {
                l.starts_with("corral_upstream_errors_total{")
                    && l.contains("kind=\"broken_stream\"")
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as usize
    };
    eventually("every cut reply is counted", async || {
        broken_streams().await >= broken
    })
    .await;
    assert_eq!(
        broken_streams().await,
        broken,
        "every cut reply was counted, and only those"
    );
}
