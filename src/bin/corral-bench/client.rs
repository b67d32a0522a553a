//! One chat turn as a client sees it: send the conversation so far, stream the reply, and
//! note when the first token arrived.

use std::time::{Duration, Instant};

use futures::StreamExt;
use serde::Deserialize;
use serde_json::json;

/// What one streamed `/api/chat` reply told the client.
#[derive(Debug, Default)]
pub struct Reply {
    /// Time from sending the request to the first chunk that carries content.
    pub ttft: Option<Duration>,
    pub total: Duration,
    pub content: String,
    /// Prompt tokens the node evaluated (those not in its cache), from the final chunk.
    pub prompt_eval_count: Option<u32>,
    pub eval_count: Option<u32>,
    /// corral's `X-Fleet-Node` and `X-Fleet-Affinity`, when the reply came through corral.
    pub fleet_node: Option<String>,
    pub fleet_affinity: Option<String>,
}

/// One line of Ollama's NDJSON stream; only the fields the benchmark reads.
#[derive(Deserialize)]
struct Chunk {
    #[serde(default)]
    message: Option<ChunkMessage>,
    #[serde(default)]
    done: bool,
    #[serde(default)]
    prompt_eval_count: Option<u32>,
    #[serde(default)]
    eval_count: Option<u32>,
    #[serde(default)]
    error: Option<String>,
}

#[derive(Deserialize)]
struct ChunkMessage {
    #[serde(default)]
    content: String,
}

/// The JSON body of a streamed chat turn.
pub fn chat_body(model: &str, messages: &[(&str, &str)], reply_tokens: u32) -> Vec<u8> {
    let messages: Vec<_> = messages
        .iter()
        .map(|(role, content)| json!({ "role": role, "content": content }))
        .collect();
    let body = json!({
        "model": model,
        "messages": messages,
        "stream": true,
        "options": { "num_predict": reply_tokens },
    });
    body.to_string().into_bytes()
}

/// Sends one turn to `base` (a node or corral) and reads the whole streamed reply.
/// Errors are the reason the turn failed: a status, a broken stream, a reply without end.
pub async fn chat(
    client: &reqwest::Client,
    base: &str,
    body: Vec<u8>,
    timeout: Duration,
) -> Result<Reply, String> {
    let started = Instant::now();
    let exchange = async {
        let resp = client
            .post(format!("{base}/api/chat"))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .map_err(|e| format!("request failed: {e}"))?;
        let header = |name: &str| {
            resp.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let mut reply = Reply {
            fleet_node: header("x-fleet-node"),
            fleet_affinity: header("x-fleet-affinity"),
            ..Default::default()
        };
        let status = resp.status();
        if !status.is_success() {
            let text = resp.text().await.unwrap_or_default();
            return Err(format!("status {status}: {}", text.trim()));
        }
        read_stream(resp, started, &mut reply).await?;
        reply.total = started.elapsed();
        Ok(reply)
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| format!("no complete reply within {timeout:?}"))?
}

/// Reads NDJSON lines as they arrive, however the network splits them.
async fn read_stream(
    resp: reqwest::Response,
    started: Instant,
    reply: &mut Reply,
) -> Result<(), String> {
    let mut stream = resp.bytes_stream();
    let mut pending: Vec<u8> = Vec::new();
    let mut done = false;
    while let Some(piece) = stream.next().await {
        let piece = piece.map_err(|e| format!("stream broken: {e}"))?;
        pending.extend_from_slice(&piece);
        while let Some(end) = pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = pending.drain(..=end).collect();
            done |= take_line(&line, started, reply)?;
        }
    }
    if !pending.iter().all(u8::is_ascii_whitespace) {
        done |= take_line(&pending, started, reply)?;
    }
    if done {
        Ok(())
    } else {
        Err("stream ended without a final chunk".into())
    }
}

/// Applies one line to the reply; true on the final chunk.
fn take_line(line: &[u8], started: Instant, reply: &mut Reply) -> Result<bool, String> {
    let text = std::str::from_utf8(line).map_err(|e| format!("reply is not UTF-8: {e}"))?;
    if text.trim().is_empty() {
        return Ok(false);
    }
    let chunk: Chunk =
        serde_json::from_str(text).map_err(|e| format!("bad chunk {:?}: {e}", text.trim()))?;
    if let Some(error) = chunk.error {
        return Err(format!("error in stream: {error}"));
    }
    if let Some(m) = chunk.message.filter(|m| !m.content.is_empty()) {
        reply.ttft.get_or_insert_with(|| started.elapsed());
        reply.content.push_str(&m.content);
    }
    if chunk.done {
        reply.prompt_eval_count = chunk.prompt_eval_count;
        reply.eval_count = chunk.eval_count;
    }
    Ok(chunk.done)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_fill_the_reply() {
        let started = Instant::now();
        let mut reply = Reply::default();
        let first = br#"{"message":{"role":"assistant","content":"he"},"done":false}"#;
        assert_eq!(take_line(first, started, &mut reply), Ok(false));
        assert!(reply.ttft.is_some());
        let last = br#"{"message":{"role":"assistant","content":""},"done":true,"prompt_eval_count":12,"eval_count":3}"#;
        assert_eq!(take_line(last, started, &mut reply), Ok(true));
        assert_eq!(reply.content, "he");
        assert_eq!(reply.prompt_eval_count, Some(12));
        assert!(take_line(br#"{"error":"boom"}"#, started, &mut reply).is_err());
    }

    #[test]
    fn body_asks_for_a_stream_of_the_given_length() {
        let body = chat_body("m", &[("user", "hi")], 7);
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        assert_eq!(v["stream"], true);
        assert_eq!(v["options"]["num_predict"], 7);
        assert_eq!(v["messages"][0]["content"], "hi");
    }
}
