//! `corral-bench stream-probe`: how long a streamed chunk takes from the backend to the
//! client, directly or through a proxy.
//!
//! The backend stamps every chunk with the wall-clock time it was handed to the socket; the
//! probe notes when each complete line arrives. Both run on one machine, so the clocks agree,
//! and the difference is the delivery delay. A proxy that buffers shows it here at once.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::StreamExt;
use serde::Deserialize;

use crate::backend::{CHUNKS_HEADER, INTERVAL_HEADER, chat_body};
use crate::report::Percentiles;

pub struct ProbeOptions {
    pub url: String,
    pub requests: usize,
    pub chunks: usize,
    pub interval: Duration,
}

#[derive(Deserialize)]
struct Stamped {
    sent_ns: Option<u64>,
}

/// Per-chunk delivery delays in milliseconds, sorted.
pub async fn run(opts: &ProbeOptions) -> Result<Vec<f64>, String> {
    let client = reqwest::Client::new();
    let body = chat_body(1024, true);
    let mut delays = Vec::with_capacity(opts.requests * opts.chunks);
    for _ in 0..opts.requests {
        let resp = client
            .post(format!("{}/api/chat", opts.url.trim_end_matches('/')))
            .header("content-type", "application/json")
            .header(CHUNKS_HEADER, opts.chunks.to_string())
            .header(INTERVAL_HEADER, opts.interval.as_micros().to_string())
            .body(body.clone())
            .timeout(Duration::from_secs(30) + opts.interval * opts.chunks as u32)
            .send()
            .await
            .map_err(|e| format!("probe request failed: {e}"))?;
        if !resp.status().is_success() {
            return Err(format!("probe got status {}", resp.status()));
        }
        read_delays(resp, &mut delays).await?;
    }
    delays.sort_by(f64::total_cmp);
    Ok(delays)
}

async fn read_delays(resp: reqwest::Response, delays: &mut Vec<f64>) -> Result<(), String> {
    let mut stream = resp.bytes_stream();
    let mut pending = Vec::new();
    while let Some(piece) = stream.next().await {
        let piece = piece.map_err(|e| format!("probe stream broken: {e}"))?;
        let now = now_ns();
        pending.extend_from_slice(&piece);
        while let Some(end) = pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = pending.drain(..=end).collect();
            let stamped: Stamped =
                serde_json::from_slice(&line).map_err(|e| format!("probe got a bad line: {e}"))?;
            if let Some(sent) = stamped.sent_ns {
                delays.push(now.saturating_sub(sent) as f64 / 1e6);
            }
        }
    }
    Ok(())
}

fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// The probe's result as one CSV line of the overhead script's file.
pub fn csv_line(target: &str, delays: &[f64]) -> String {
    let p = Percentiles::of(delays);
    format!(
        "chunk-delay,stream,{target},0,{:.4},{:.4},{:.4},0",
        p.p50, p.p90, p.p99
    )
}
