//! `corral-bench backend`: an in-memory Ollama-shaped server for the proxy overhead
//! measurement. It does as little as possible, so that what is measured is the proxy in front
//! of it: `/api/chat` answers a fixed JSON reply, or a fixed NDJSON stream whose chunks carry
//! the time they were sent; `/api/tags` and `/api/ps` list one model so corral's poller sees
//! it as resident.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use bytes::Bytes;
use serde_json::json;

/// The model the backend lists and the bench's bodies name.
pub const MODEL: &str = "bench:1b";

/// Header asking for a pause between streamed chunks, in microseconds.
pub const INTERVAL_HEADER: &str = "x-bench-interval-us";
/// Header asking for a number of streamed chunks.
pub const CHUNKS_HEADER: &str = "x-bench-chunks";

/// Only the end of a body is searched for the stream flag: the bench's bodies put it last
/// (serde_json writes keys in order, and `stream` sorts after `messages` and `model`), and
/// scanning 128 KiB would make the backend slower than the proxies it measures.
const STREAM_FLAG_WINDOW: usize = 256;

#[derive(Clone)]
struct Config {
    chunks: usize,
}

/// Serves until the process is killed.
pub fn serve(listen: SocketAddr, threads: usize, chunks: usize) -> Result<(), String> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.max(1))
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start a runtime: {e}"))?;
    runtime.block_on(async move {
        if !listen.ip().is_loopback() {
            return Err(format!("{listen}: the backend only listens on loopback"));
        }
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .map_err(|e| format!("cannot listen on {listen}: {e}"))?;
        eprintln!("corral-bench backend on http://{listen}");
        // Without TCP_NODELAY, a streamed chunk written while the previous one is not yet
        // acknowledged waits for the peer's delayed ACK (40 ms on Linux).
        let listener = listener.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        axum::serve(listener, router(chunks))
            .await
            .map_err(|e| format!("backend stopped: {e}"))
    })
}

fn router(chunks: usize) -> Router {
    let tags = json!({ "models": [{
        "name": MODEL, "model": MODEL, "size": 1_000_000_000u64,
        "modified_at": "2025-01-01T00:00:00Z", "digest": "0".repeat(64),
    }]});
    let ps = json!({ "models": [{
        "name": MODEL, "model": MODEL, "size": 1_000_000_000u64, "size_vram": 1_000_000_000u64,
        "expires_at": "2099-01-01T00:00:00Z", "context_length": 8192,
    }]});
    let tags = Bytes::from(tags.to_string());
    let ps = Bytes::from(ps.to_string());
    Router::new()
        .route("/", get(|| async { "Ollama is running" }))
        .route(
            "/api/version",
            get(|| async { json_response(Bytes::from_static(br#"{"version":"0.0.0-bench"}"#)) }),
        )
        .route("/api/tags", get(move || async move { json_response(tags) }))
        .route("/api/ps", get(move || async move { json_response(ps) }))
        .route("/api/chat", post(chat))
        .layer(axum::extract::DefaultBodyLimit::disable())
        .with_state(Config { chunks })
}

fn json_response(body: Bytes) -> Response {
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}

async fn chat(State(cfg): State<Config>, headers: HeaderMap, body: Bytes) -> Response {
    let tail = &body[body.len().saturating_sub(STREAM_FLAG_WINDOW)..];
    let streamed = !contains(tail, br#""stream":false"#);
    if !streamed {
        return json_response(Bytes::from_static(WHOLE_REPLY));
    }
    let number = |name: &str| -> Option<u64> {
        headers
            .get(name)
            .and_then(|v: &HeaderValue| v.to_str().ok())
            .and_then(|v| v.parse().ok())
    };
    let chunks = number(CHUNKS_HEADER).map_or(cfg.chunks, |n| n as usize);
    let interval = Duration::from_micros(number(INTERVAL_HEADER).unwrap_or(0));
    let stream = futures::stream::unfold(0usize, move |i| async move {
        if i > chunks {
            return None;
        }
        if i > 0 && !interval.is_zero() {
            tokio::time::sleep(interval).await;
        }
        Some((Ok::<_, Infallible>(chunk(i, chunks)), i + 1))
    });
    let mut response = Response::new(Body::from_stream(stream));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/x-ndjson"),
    );
    response
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// A non-streamed reply of the size Ollama sends for a short answer.
const WHOLE_REPLY: &[u8] = br#"{"model":"bench:1b","created_at":"2025-01-01T00:00:00.000000000Z","message":{"role":"assistant","content":"The quick brown fox jumps over the lazy dog."},"done_reason":"stop","done":true,"total_duration":1000000,"load_duration":100000,"prompt_eval_count":26,"prompt_eval_duration":200000,"eval_count":12,"eval_duration":700000}"#;

/// Chunk `i` of `n` content chunks (the last one, `i == n`, is the final chunk), carrying
/// the wall-clock time it was made, in nanoseconds since the epoch.
fn chunk(i: usize, n: usize) -> Bytes {
    let sent_ns = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let line = if i < n {
        format!(
            r#"{{"model":"{MODEL}","created_at":"2025-01-01T00:00:00Z","message":{{"role":"assistant","content":"token{i} "}},"done":false,"sent_ns":{sent_ns}}}"#
        )
    } else {
        format!(
            r#"{{"model":"{MODEL}","created_at":"2025-01-01T00:00:00Z","message":{{"role":"assistant","content":""}},"done_reason":"stop","done":true,"total_duration":1000000,"load_duration":0,"prompt_eval_count":26,"prompt_eval_duration":200000,"eval_count":{n},"eval_duration":700000,"sent_ns":{sent_ns}}}"#
        )
    };
    Bytes::from(line + "\n")
}

/// A chat body of about `bytes` bytes, as `make-body` writes it for the load tool.
pub fn chat_body(bytes: usize, stream: bool) -> Vec<u8> {
    let mut rng = crate::rng::Rng::new(4);
    let skeleton = json!({ "model": MODEL, "messages": [], "stream": stream }).to_string();
    // Each message costs its content plus this much JSON around it.
    let overhead = r#"{"content":"","role":"assistant"},"#.len();
    let mut messages = Vec::new();
    let mut left = bytes.saturating_sub(skeleton.len());
    let mut user = true;
    while left > overhead {
        let content_len = (left - overhead).min(4096);
        let role = if user { "user" } else { "assistant" };
        messages.push(json!({ "role": role, "content": rng.text(content_len) }));
        left = left.saturating_sub(content_len + overhead);
        user = !user;
    }
    json!({ "model": MODEL, "messages": messages, "stream": stream })
        .to_string()
        .into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_have_the_asked_size_and_end_with_the_flag() {
        for size in [1024, 128 * 1024] {
            let body = chat_body(size, false);
            let diff = body.len().abs_diff(size);
            assert!(diff < 64 + size / 100, "{size}: {}", body.len());
            let tail = &body[body.len() - 32..];
            assert!(contains(tail, br#""stream":false"#));
        }
        assert!(contains(&chat_body(1024, true), br#""stream":true"#));
    }

    #[test]
    fn chunks_are_ndjson_lines_with_a_timestamp() {
        for i in [0, 3] {
            let c = chunk(i, 3);
            assert!(c.ends_with(b"\n"));
            let v: serde_json::Value = serde_json::from_slice(&c).unwrap_or_default();
            assert_eq!(v["done"], i == 3);
            assert!(v["sent_ns"].as_u64().is_some_and(|t| t > 0));
        }
        let v: serde_json::Value = serde_json::from_slice(WHOLE_REPLY).unwrap_or_default();
        assert_eq!(v["done"], true);
    }
}
