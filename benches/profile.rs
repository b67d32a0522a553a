//! What corral does with every request before it can choose a node: classify the path, then
//! read the body once into a profile (model, options, prefix chain, token estimate).
//! Goal of issue 4: a 128 KiB body profiled in under 150 µs.

use std::hint::black_box;

use corral::request::{Profile, Route};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use http::Method;

/// A chat conversation of about `bytes` bytes, as chat clients send it: alternating turns of
/// prose with the escapes real text has (newlines, quotes), model first.
fn chat_body(bytes: usize) -> Vec<u8> {
    let paragraph = "The fleet keeps each conversation warm on the node that served it.\n\
                     A \"follow-up\" only pays for its new tokens there; elsewhere it pays for \
                     the whole history again, which is why routing matters.\n";
    let mut messages = vec![serde_json::json!({
        "role": "system", "content": "You are a helpful assistant."
    })];
    let mut size = 200;
    let mut turn = 0;
    while size < bytes {
        let role = if turn % 2 == 0 { "user" } else { "assistant" };
        let len = (bytes - size).clamp(64, 4096);
        let content: String = paragraph.chars().cycle().take(len).collect();
        size += len + 40;
        messages.push(serde_json::json!({ "role": role, "content": content }));
        turn += 1;
    }
    let body = serde_json::json!({
        "model": "llama3.1:8b",
        "messages": messages,
        "stream": true,
        "options": { "temperature": 0.7, "num_predict": 256 },
    });
    body.to_string().into_bytes()
}

fn peek_and_profile(c: &mut Criterion) {
    let mut group = c.benchmark_group("peek_and_profile");
    for (name, size) in [
        ("1KiB", 1024),
        ("128KiB", 128 * 1024),
        ("1MiB", 1024 * 1024),
    ] {
        let body = chat_body(size);
        group.throughput(Throughput::Bytes(body.len() as u64));
        group.bench_with_input(BenchmarkId::from_parameter(name), &body, |b, body| {
            b.iter(|| {
                let Route::Model(endpoint) = Route::of(&Method::POST, black_box("/api/chat"))
                else {
                    return None;
                };
                Profile::parse(endpoint, black_box(body)).ok()
            })
        });
    }
    group.finish();
}

criterion_group!(benches, peek_and_profile);
criterion_main!(benches);
