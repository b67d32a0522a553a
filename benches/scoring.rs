//! Choosing a node: finding the conversation's warm prefix and scoring every candidate on the
//! eight signals, for fleets of 3, 16 and 64 nodes. The request is a follow-up whose previous
//! turn was served (so the affinity lookup finds a pin), against nodes that all hold the model.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use corral::config::{Config, NodeConfig};
use corral::fleet::{Fleet, Inventory, Resident};
use corral::request::{Endpoint, Profile};
use corral::routing::{Outcome, Router};
use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};

const MODEL: &str = "llama3.1:8b";

/// A router over `n` nodes that all list MODEL on disk and resident, as after a poll.
fn router(n: usize) -> Result<Arc<Router>, String> {
    let nodes = (0..n)
        .map(|i| {
            let mut node =
                NodeConfig::new(&format!("n{i}"), &format!("http://127.0.0.1:{}", 20000 + i));
            node.memory_gb = Some(24.0);
            node.num_parallel = 4;
            node
        })
        .collect();
    let config = Config {
        nodes,
        ..Default::default()
    };
    let fleet = Fleet::new(&config)?;
    for node in fleet.nodes().iter() {
        let mut inv = Inventory {
            polled_at: Some(Instant::now()),
            ..Default::default()
        };
        inv.on_disk.insert(MODEL.into(), 4_900_000_000);
        let resident = Resident {
            size: 6_000_000_000,
            context_length: Some(32768),
            expires_at: None,
        };
        inv.resident.insert(MODEL.into(), resident);
        node.update_inventory(inv);
    }
    Ok(Arc::new(Router::new(Arc::new(fleet), &config)))
}

fn chat(turns: &[&str]) -> Result<Profile, String> {
    let messages: Vec<_> = turns
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            serde_json::json!({ "role": role, "content": t })
        })
        .collect();
    let body = serde_json::json!({ "model": MODEL, "messages": messages });
    Profile::parse(Endpoint::Chat, body.to_string().as_bytes()).map_err(|e| e.to_string())
}

/// Serves a request on the node corral would choose, so that its prefix is remembered.
fn serve(r: &Arc<Router>, p: &Profile) -> Result<(), String> {
    let decision = r.decide(p).map_err(|e| format!("{e:?}"))?;
    let node = decision
        .ranked
        .first()
        .map(|c| Arc::clone(&c.node))
        .ok_or("no candidate")?;
    let reserved = r.try_dispatch(&node, p).ok_or("the node is full")?;
    let dispatch = reserved.commit(p, &decision, &r.placement());
    dispatch.finish(Outcome {
        ok: true,
        ..Default::default()
    });
    Ok(())
}

/// A router with some conversations in flight, and the follow-up to score.
fn setup(n: usize) -> Result<(Arc<Router>, Profile), String> {
    let r = router(n)?;
    for i in 0..(2 * n) {
        serve(&r, &chat(&[&format!("other conversation {i}")])?)?;
    }
    let first = ["Summarise this document for me, please."];
    serve(&r, &chat(&first)?)?;
    let follow_up = chat(&[
        first[0],
        "Here is a summary.",
        "Now list the open questions.",
    ])?;
    Ok((r, follow_up))
}

fn scoring(c: &mut Criterion) {
    let mut group = c.benchmark_group("decide");
    for n in [3, 16, 64] {
        let (router, follow_up) = match setup(n) {
            Ok(x) => x,
            Err(e) => {
                eprintln!("scoring bench setup failed for {n} nodes: {e}");
                continue;
            }
        };
        group.bench_with_input(BenchmarkId::new("nodes", n), &follow_up, |b, p| {
            b.iter(|| router.decide(black_box(p)).is_ok())
        });
    }
    group.finish();
}

criterion_group!(benches, scoring);
criterion_main!(benches);
