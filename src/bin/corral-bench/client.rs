//! One chat turn as a client sees it: send the conversation so far, stream the reply, and
//! note when the first token arrived. Over Ollama's `/api/chat` (NDJSON) or the OpenAI chat
//! endpoint `/v1/chat/completions` (server-sent events), as the node kind's users would.

use std::time::{Duration, Instant};

use futures::StreamExt;
use serde::Deserialize;
use serde_json::json;

/// The chat API a turn is sent through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChatApi {
    /// Ollama's `/api/chat`.
    Ollama,
    /// `/v1/chat/completions`, streamed with `stream_options.include_usage`.
    Openai,
}

impl ChatApi {
    pub fn parse(name: &str) -> Option<ChatApi> {
        match name {
            "ollama" => Some(ChatApi::Ollama),
            "openai" => Some(ChatApi::Openai),
            _ => None,
        }
    }

    fn path(self) -> &'static str {
        match self {
            ChatApi::Ollama => "/api/chat",
            ChatApi::Openai => "/v1/chat/completions",
        }
    }
}

/// What one streamed chat reply told the client.
#[derive(Debug, Default)]
pub struct Reply {
    /// Time from sending the request to the first chunk that carries content.
    pub ttft: Option<Duration>,
    pub total: Duration,
    pub content: String,
    /// Ollama: the final chunk's `prompt_eval_count` (what it counts depends on the
    /// version). OpenAI: prompt tokens the node evaluated, from llama.cpp's
    /// `timings.prompt_n`, else `usage.prompt_tokens` less `cached_tokens`.
    pub prompt_eval_count: Option<u32>,
    pub eval_count: Option<u32>,
    /// corral's `X-Fleet-Node` and `X-Fleet-Affinity`, when the reply came through corral,
    /// and `X-Fleet-Explain` where the request asked for it.
    pub fleet_node: Option<String>,
    pub fleet_affinity: Option<String>,
    pub fleet_explain: Option<String>,
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

/// One `data:` event of an OpenAI chat stream; only the fields the benchmark reads.
#[derive(Deserialize)]
struct OpenaiChunk {
    #[serde(default)]
    choices: Vec<OpenaiChoice>,
    #[serde(default)]
    usage: Option<OpenaiUsage>,
    /// llama.cpp's `timings` (tools/server/server-task.cpp, `result_timings::to_json`).
    #[serde(default)]
    timings: Option<LlamaTimings>,
    #[serde(default)]
    error: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct OpenaiChoice {
    #[serde(default)]
    delta: Option<ChunkMessageOpt>,
}

#[derive(Deserialize)]
struct ChunkMessageOpt {
    #[serde(default)]
    content: Option<String>,
}

#[derive(Deserialize)]
struct OpenaiUsage {
    #[serde(default)]
    prompt_tokens: Option<u32>,
    #[serde(default)]
    completion_tokens: Option<u32>,
    #[serde(default)]
    prompt_tokens_details: Option<PromptTokensDetails>,
}

#[derive(Deserialize)]
struct PromptTokensDetails {
    #[serde(default)]
    cached_tokens: Option<u32>,
}

#[derive(Deserialize)]
struct LlamaTimings {
    #[serde(default)]
    prompt_n: Option<u32>,
    #[serde(default)]
    predicted_n: Option<u32>,
}

/// The JSON body of a streamed chat turn.
pub fn chat_body(
    api: ChatApi,
    model: &str,
    messages: &[(&str, &str)],
    reply_tokens: u32,
) -> Vec<u8> {
    let messages: Vec<_> = messages
        .iter()
        .map(|(role, content)| json!({ "role": role, "content": content }))
        .collect();
    let body = match api {
        ChatApi::Ollama => json!({
            "model": model,
            "messages": messages,
            "stream": true,
            "options": { "num_predict": reply_tokens },
        }),
        ChatApi::Openai => json!({
            "model": model,
            "messages": messages,
            "stream": true,
            "stream_options": { "include_usage": true },
            "max_tokens": reply_tokens,
        }),
    };
    body.to_string().into_bytes()
}

/// Sends one turn to `base` (a node or corral) and reads the whole streamed reply.
/// Errors are the reason the turn failed: a status, a broken stream, a reply without end.
pub async fn chat(
    client: &reqwest::Client,
    api: ChatApi,
    base: &str,
    body: Vec<u8>,
    timeout: Duration,
) -> Result<Reply, String> {
    let started = Instant::now();
    let exchange = async {
        let resp = client
            .post(format!("{base}{}", api.path()))
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
            fleet_explain: header("x-fleet-explain"),
            ..Default::default()
        };
        let status = resp.status();
        if !status.is_success() {
            let text = resp.text().await.unwrap_or_default();
            return Err(format!("status {status}: {}", text.trim()));
        }
        read_stream(api, resp, started, &mut reply).await?;
        reply.total = started.elapsed();
        Ok(reply)
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| format!("no complete reply within {timeout:?}"))?
}

/// Reads NDJSON lines or SSE lines as they arrive, however the network splits them.
async fn read_stream(
    api: ChatApi,
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
            done |= take(api, &line, started, reply)?;
        }
    }
    if !pending.iter().all(u8::is_ascii_whitespace) {
        done |= take(api, &pending, started, reply)?;
    }
    if done {
        Ok(())
    } else {
        Err("stream ended without a final chunk".into())
    }
}

fn take(api: ChatApi, line: &[u8], started: Instant, reply: &mut Reply) -> Result<bool, String> {
    match api {
        ChatApi::Ollama => take_line(line, started, reply),
        ChatApi::Openai => take_event_line(line, started, reply),
    }
}

/// Applies one line of an OpenAI event stream to the reply; true at `data: [DONE]`.
/// Usage and timings may come in the finish chunk or in a usage chunk of their own.
fn take_event_line(line: &[u8], started: Instant, reply: &mut Reply) -> Result<bool, String> {
    let text = std::str::from_utf8(line).map_err(|e| format!("reply is not UTF-8: {e}"))?;
    let Some(data) = text.trim().strip_prefix("data:") else {
        // Blank separators, comments, `event:` lines.
        return Ok(false);
    };
    let data = data.trim();
    if data == "[DONE]" {
        return Ok(true);
    }
    let chunk: OpenaiChunk =
        serde_json::from_str(data).map_err(|e| format!("bad event {data:?}: {e}"))?;
    if let Some(error) = chunk.error {
        return Err(format!("error in stream: {error}"));
    }
    for choice in chunk.choices {
        if let Some(content) = choice
            .delta
            .and_then(|d| d.content)
            .filter(|c| !c.is_empty())
        {
            reply.ttft.get_or_insert_with(|| started.elapsed());
            reply.content.push_str(&content);
        }
    }
    if let Some(usage) = chunk.usage {
        let cached = usage
            .prompt_tokens_details
            .and_then(|d| d.cached_tokens)
            .unwrap_or(0);
        if let Some(prompt) = usage.prompt_tokens {
            reply
                .prompt_eval_count
                .get_or_insert(prompt.saturating_sub(cached));
        }
        if usage.completion_tokens.is_some() {
            reply.eval_count = usage.completion_tokens;
        }
    }
    if let Some(timings) = chunk.timings {
        // llama.cpp's own count of the tokens it evaluated is the most direct.
        if timings.prompt_n.is_some() {
            reply.prompt_eval_count = timings.prompt_n;
        }
        if reply.eval_count.is_none() {
            reply.eval_count = timings.predicted_n;
        }
    }
    Ok(false)
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
        let body = chat_body(ChatApi::Ollama, "m", &[("user", "hi")], 7);
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        assert_eq!(v["stream"], true);
        assert_eq!(v["options"]["num_predict"], 7);
        assert_eq!(v["messages"][0]["content"], "hi");
        let body = chat_body(ChatApi::Openai, "m", &[("user", "hi")], 7);
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        assert_eq!(v["stream"], true);
        assert_eq!(v["stream_options"]["include_usage"], true);
        assert_eq!(v["max_tokens"], 7);
        assert_eq!(v["messages"][0]["content"], "hi");
    }

    /// A llama-server stream: content deltas, a finish chunk, a usage chunk carrying
    /// `timings`, `[DONE]`. Evaluated tokens are `timings.prompt_n`.
    #[test]
    fn llama_cpp_events_fill_the_reply() {
        let started = Instant::now();
        let mut reply = Reply::default();
        let lines: [&[u8]; 6] = [
            br#"data: {"choices":[{"index":0,"delta":{"role":"assistant","content":null}}]}"#,
            b"",
            br#"data: {"choices":[{"index":0,"delta":{"content":"he"}}]}"#,
            br#"data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#,
            br#"data: {"choices":[],"usage":{"prompt_tokens":900,"completion_tokens":4,"prompt_tokens_details":{"cached_tokens":880}},"timings":{"cache_n":880,"prompt_n":20,"predicted_n":4}}"#,
            b"data: [DONE]",
        ];
        let mut done = Vec::new();
        for line in lines {
            done.push(take(ChatApi::Openai, line, started, &mut reply).unwrap());
        }
        assert_eq!(done, [false, false, false, false, false, true]);
        assert!(reply.ttft.is_some());
        assert_eq!(reply.content, "he");
        assert_eq!(reply.prompt_eval_count, Some(20));
        assert_eq!(reply.eval_count, Some(4));
    }

    /// A server without `timings`: evaluated = prompt tokens less cached tokens.
    #[test]
    fn openai_usage_gives_evaluated_tokens() {
        let started = Instant::now();
        let mut reply = Reply::default();
        let usage = br#"data: {"choices":[],"usage":{"prompt_tokens":900,"completion_tokens":4,"prompt_tokens_details":{"cached_tokens":700}}}"#;
        assert_eq!(take_event_line(usage, started, &mut reply), Ok(false));
        assert_eq!(reply.prompt_eval_count, Some(200));
        let mut reply = Reply::default();
        let bare = br#"data: {"choices":[],"usage":{"prompt_tokens":900,"completion_tokens":4}}"#;
        assert_eq!(take_event_line(bare, started, &mut reply), Ok(false));
        assert_eq!(reply.prompt_eval_count, Some(900));
        assert!(
            take_event_line(
                br#"data: {"error":{"message":"boom"}}"#,
                started,
                &mut reply
            )
            .is_err()
        );
    }
}
