//! The APIs current Ollama serves through converters in front of its chat handler
//! (`server/routes.go`): OpenAI's Responses API (`openai/responses.go`,
//! `middleware/openai.go` `ResponsesMiddleware`), Anthropic's Messages API
//! (`anthropic/anthropic.go`, `middleware/anthropic.go`) and OpenAI's audio transcriptions
//! (`TranscriptionMiddleware`). Each request becomes a chat job rendered as `/api/chat`
//! renders it, so a conversation is as warm through these APIs as through the native one;
//! replies are written in each API's own shapes and SSE event types, with the token counts
//! Ollama puts there (`PromptEvalCount`, `EvalCount`; Responses' `cached_tokens` is 0).

use std::sync::Arc;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use bytes::Bytes;
use serde::Deserialize;
use serde_json::{Value, json};

use super::error::StandinError;
use super::generate::{Job, run};
use super::node::Node;
use super::parse::{json_body, required_model};
use super::prompt::{Turn, render_chat};
use super::wire::{Api, Stats};

#[derive(Debug, Deserialize)]
struct ResponsesRequest {
    model: Option<String>,
    /// A string (one user message) or a list of input items.
    input: Option<Value>,
    instructions: Option<String>,
    max_output_tokens: Option<i64>,
    stream: Option<bool>,
}

#[derive(Debug, Deserialize)]
struct MessagesRequest {
    model: Option<String>,
    max_tokens: Option<i64>,
    messages: Option<Vec<AnthropicMessage>>,
    /// A string or a list of text blocks.
    system: Option<Value>,
    stream: Option<bool>,
}

#[derive(Debug, Deserialize)]
struct AnthropicMessage {
    #[serde(default)]
    role: String,
    content: Option<Value>,
}

/// `POST /v1/responses`.
pub async fn responses(State(node): State<Arc<Node>>, body: Bytes) -> Response {
    match responses_job(&body) {
        Ok(job) => run(node, job).await,
        Err(e) => e.openai(),
    }
}

/// `POST /v1/messages`.
pub async fn messages(State(node): State<Arc<Node>>, body: Bytes) -> Response {
    match messages_job(&body) {
        Ok(job) => run(node, job).await,
        Err(e) => e.anthropic(),
    }
}

/// `POST /v1/audio/transcriptions`: a multipart form with `model` and `file`; the reply is
/// `{"text": ...}`, never streamed.
pub async fn transcriptions(
    State(node): State<Arc<Node>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    match transcription_job(&headers, &body) {
        Ok(job) => run(node, job).await,
        Err(e) => e.openai(),
    }
}

fn responses_job(body: &[u8]) -> Result<Job, StandinError> {
    let req: ResponsesRequest = json_body(body)?;
    let model = required_model(req.model)?;
    let mut turns = Vec::new();
    if let Some(instructions) = req.instructions.filter(|i| !i.is_empty()) {
        turns.push(text_turn("system", instructions));
    }
    match req.input {
        Some(Value::String(text)) => turns.push(text_turn("user", text)),
        Some(Value::Array(items)) => {
            for item in items {
                turns.push(input_item_turn(&item)?);
            }
        }
        None | Some(Value::Null) => {}
        Some(_) => {
            return Err(StandinError::bad_request(
                "input must be a string or array of items",
            ));
        }
    }
    Ok(chat_job(
        Api::Responses,
        model,
        &turns,
        req.max_output_tokens,
        req.stream,
    ))
}

/// One Responses input item as a chat turn: messages by role (content a string or
/// `input_text`/`output_text` parts), function call outputs as tool turns.
fn input_item_turn(item: &Value) -> Result<Turn, StandinError> {
    match item["type"].as_str().unwrap_or("message") {
        "message" => {
            let role = item["role"].as_str().unwrap_or("user");
            let role = if role == "developer" { "system" } else { role };
            Ok(text_turn(role, blocks_text(&item["content"])))
        }
        "function_call_output" => Ok(text_turn("tool", value_text(&item["output"]))),
        "function_call" => Ok(text_turn("assistant", value_text(&item["arguments"]))),
        other => Err(StandinError::bad_request(format!(
            "unsupported input item type: {other}"
        ))),
    }
}

fn messages_job(body: &[u8]) -> Result<Job, StandinError> {
    let req: MessagesRequest = json_body(body)?;
    let model = required_model(req.model)?;
    let messages = req.messages.unwrap_or_default();
    if messages.is_empty() {
        return Err(StandinError::bad_request("messages is required"));
    }
    let mut turns = Vec::new();
    if let Some(system) = req.system.filter(|s| !s.is_null()) {
        turns.push(text_turn("system", blocks_text(&system)));
    }
    for m in messages {
        turns.push(text_turn(
            &m.role,
            blocks_text(&m.content.unwrap_or_default()),
        ));
    }
    Ok(chat_job(
        Api::AnthropicMessages,
        model,
        &turns,
        req.max_tokens,
        req.stream,
    ))
}

fn transcription_job(headers: &HeaderMap, body: &[u8]) -> Result<Job, StandinError> {
    let content_type = headers
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    let field = |name| crate::request::form_field(content_type, body, name);
    if !content_type.starts_with("multipart/form-data") {
        return Err(StandinError::bad_request(
            "failed to parse multipart form: request Content-Type isn't multipart/form-data",
        ));
    }
    let model = field("model")
        .and_then(|m| std::str::from_utf8(m).ok())
        .filter(|m| !m.is_empty())
        .ok_or_else(|| StandinError::bad_request("model is required"))?;
    let audio = field("file").ok_or_else(|| StandinError::bad_request("file is required"))?;
    if audio.is_empty() {
        return Err(StandinError::bad_request("audio file is empty"));
    }
    // The audio renders as an attachment: its bytes, not its size, decide the prompt.
    let turn = Turn {
        role: "user".into(),
        content: "Transcribe this audio.".into(),
        images: vec![format!("{:x}", twox_hash::XxHash3_64::oneshot(audio))],
    };
    Ok(chat_job(
        Api::Transcription,
        model.to_string(),
        &[turn],
        None,
        Some(false),
    ))
}

fn chat_job(
    api: Api,
    model: String,
    turns: &[Turn],
    max_tokens: Option<i64>,
    stream: Option<bool>,
) -> Job {
    Job {
        api,
        model,
        prompt: render_chat(turns),
        max_tokens,
        num_ctx: None,
        keep_alive: None,
        // Both APIs stream only when asked to.
        stream: stream.unwrap_or(false),
        include_usage: false,
    }
}

fn text_turn(role: &str, content: String) -> Turn {
    Turn {
        role: role.to_string(),
        content,
        images: Vec::new(),
    }
}

/// The text of a content value: a string, or the `text` of its blocks joined.
fn blocks_text(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(blocks) => blocks
            .iter()
            .filter_map(|b| b["text"].as_str().or(b.as_str()))
            .collect::<Vec<_>>()
            .join(""),
        _ => String::new(),
    }
}

fn value_text(v: &Value) -> String {
    v.as_str().map_or_else(|| v.to_string(), str::to_string)
}

/// Formats replies of these APIs; see [`super::wire::Wire`], which delegates here.
pub struct CompatWire<'a> {
    pub api: Api,
    pub model: &'a str,
    /// The response id: `resp_N` (Responses) or `msg_N` (Anthropic).
    pub id: &'a str,
    pub created: u64,
}

impl CompatWire<'_> {
    /// The message item id of a Responses reply.
    fn item_id(&self) -> String {
        format!("msg_{}", self.id.trim_start_matches("resp_"))
    }

    /// Events before the first token.
    pub fn opening(&self) -> Vec<Bytes> {
        match self.api {
            Api::Responses => vec![
                event(
                    "response.created",
                    json!({ "sequence_number": 0, "response": self.response("in_progress", json!([]), None) }),
                ),
                event(
                    "response.in_progress",
                    json!({ "sequence_number": 1, "response": self.response("in_progress", json!([]), None) }),
                ),
                event(
                    "response.output_item.added",
                    json!({ "sequence_number": 2, "output_index": 0, "item": {
                        "id": self.item_id(), "type": "message", "status": "in_progress",
                        "role": "assistant", "content": [] } }),
                ),
                event(
                    "response.content_part.added",
                    json!({ "sequence_number": 3, "item_id": self.item_id(), "output_index": 0,
                        "content_index": 0, "part": output_text("") }),
                ),
            ],
            Api::AnthropicMessages => vec![
                event(
                    "message_start",
                    json!({ "message": {
                        "id": self.id, "type": "message", "role": "assistant", "model": self.model,
                        "content": [], "usage": { "input_tokens": 0, "output_tokens": 0 } } }),
                ),
                event(
                    "content_block_start",
                    json!({ "index": 0, "content_block": { "type": "text", "text": "" } }),
                ),
            ],
            _ => Vec::new(),
        }
    }

    /// One token, as the event that carries it.
    pub fn token(&self, index: usize, text: &str) -> Bytes {
        match self.api {
            Api::Responses => event(
                "response.output_text.delta",
                json!({ "sequence_number": 4 + index, "item_id": self.item_id(),
                    "output_index": 0, "content_index": 0, "delta": text, "logprobs": [] }),
            ),
            _ => event(
                "content_block_delta",
                json!({ "index": 0, "delta": { "type": "text_delta", "text": text } }),
            ),
        }
    }

    /// Events after the last of `tokens` tokens: the closing events and the usage.
    pub fn trailer(&self, stats: &Stats, text: &str, tokens: usize) -> Vec<Bytes> {
        match self.api {
            Api::Responses => {
                let seq = 4 + tokens;
                let item = self.message_item(text);
                let done = self.response("completed", json!([item.clone()]), Some(stats));
                vec![
                    event(
                        "response.output_text.done",
                        json!({ "sequence_number": seq, "item_id": self.item_id(), "output_index": 0,
                            "content_index": 0, "text": text, "logprobs": [] }),
                    ),
                    event(
                        "response.content_part.done",
                        json!({ "sequence_number": seq + 1, "item_id": self.item_id(),
                            "output_index": 0, "content_index": 0, "part": output_text(text) }),
                    ),
                    event(
                        "response.output_item.done",
                        json!({ "sequence_number": seq + 2, "output_index": 0, "item": item }),
                    ),
                    event(
                        "response.completed",
                        json!({ "sequence_number": seq + 3, "response": done }),
                    ),
                ]
            }
            _ => vec![
                event("content_block_stop", json!({ "index": 0 })),
                event(
                    "message_delta",
                    json!({ "delta": { "stop_reason": "end_turn" },
                        "usage": anthropic_usage(stats) }),
                ),
                event("message_stop", json!({})),
            ],
        }
    }

    /// The body of a reply that is not streamed.
    pub fn whole(&self, text: &str, stats: &Stats) -> Value {
        match self.api {
            Api::Responses => {
                self.response("completed", json!([self.message_item(text)]), Some(stats))
            }
            Api::AnthropicMessages => json!({
                "id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": [{ "type": "text", "text": text }],
                "stop_reason": "end_turn", "usage": anthropic_usage(stats),
            }),
            _ => json!({ "text": text.trim() }),
        }
    }

    fn message_item(&self, text: &str) -> Value {
        json!({ "id": self.item_id(), "type": "message", "status": "completed",
            "role": "assistant", "content": [output_text(text)] })
    }

    /// A Responses API response object, with the fields Ollama fills in.
    fn response(&self, status: &str, output: Value, stats: Option<&Stats>) -> Value {
        let usage = stats.map(|s| {
            let input = s.prompt_eval_count();
            json!({ "input_tokens": input, "output_tokens": s.eval_count,
                "total_tokens": input + s.eval_count,
                "input_tokens_details": { "cached_tokens": 0 },
                "output_tokens_details": { "reasoning_tokens": 0 } })
        });
        json!({
            "id": self.id, "object": "response", "created_at": self.created,
            "completed_at": stats.map(|_| self.created), "status": status,
            "incomplete_details": null, "model": self.model, "previous_response_id": null,
            "output": output, "error": null, "tools": [], "parallel_tool_calls": true,
            "store": false, "background": false, "metadata": {}, "usage": usage,
        })
    }
}

fn output_text(text: &str) -> Value {
    json!({ "type": "output_text", "text": text, "annotations": [], "logprobs": [] })
}

/// Anthropic's usage: `input_tokens` is Ollama's `PromptEvalCount`.
fn anthropic_usage(stats: &Stats) -> Value {
    json!({ "input_tokens": stats.prompt_eval_count(), "output_tokens": stats.eval_count })
}

/// One SSE event, `event:` then `data:` with the type repeated inside, as Ollama writes.
fn event(kind: &str, mut data: Value) -> Bytes {
    data["type"] = json!(kind);
    Bytes::from(format!("event: {kind}\ndata: {data}\n\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn responses_input_renders_like_chat() {
        let job = responses_job(
            br#"{"model":"m","instructions":"be brief","input":[
            {"role":"user","content":[{"type":"input_text","text":"hi"}]}],"stream":true}"#,
        )
        .map_err(|e| e.message);
        let native = render_chat(&[
            text_turn("system", "be brief".into()),
            text_turn("user", "hi".into()),
        ]);
        assert_eq!(job.as_ref().map(|j| j.prompt.clone()), Ok(native));
        assert_eq!(job.map(|j| j.stream), Ok(true));
        assert!(responses_job(br#"{"model":"m","input":5}"#).is_err());
    }

    #[test]
    fn anthropic_system_blocks_and_content_blocks() {
        let job = messages_job(
            br#"{"model":"m","max_tokens":3,"system":[{"type":"text","text":"sys"}],
            "messages":[{"role":"user","content":[{"type":"text","text":"hello"}]}]}"#,
        )
        .map_err(|e| e.message);
        let native = render_chat(&[
            text_turn("system", "sys".into()),
            text_turn("user", "hello".into()),
        ]);
        assert_eq!(
            job.as_ref().map(|j| (j.prompt.clone(), j.max_tokens)),
            Ok((native, Some(3)))
        );
        assert!(messages_job(br#"{"model":"m","messages":[]}"#).is_err());
    }

    #[test]
    fn events_carry_their_type() {
        let wire = CompatWire {
            api: Api::AnthropicMessages,
            model: "m",
            id: "msg_1",
            created: 1,
        };
        let text = String::from_utf8(wire.token(0, "x").to_vec()).unwrap();
        assert!(
            text.starts_with("event: content_block_delta\ndata: {"),
            "{text}"
        );
        assert!(text.contains("\"type\":\"content_block_delta\""), "{text}");
    }
}
