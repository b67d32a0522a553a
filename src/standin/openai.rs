//! Ollama's OpenAI-compatible endpoints: `/v1/chat/completions`, `/v1/completions`,
//! `/v1/embeddings` and `/v1/models`. Requests render exactly as their native counterparts,
//! so a conversation is as warm through `/v1` as through `/api/chat`.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde::Deserialize;
use serde_json::{Value, json};

use super::catalog::openai_model;
use super::embed::{EmbedJob, embed};
use super::error::StandinError;
use super::generate::{Job, run};
use super::node::Node;
use super::ollama::string_inputs;
use super::parse::{json_body, required_model};
use super::prompt::{Turn, render_chat, render_completion};
use super::wire::Api;

#[derive(Debug, Deserialize)]
struct ChatCompletionRequest {
    model: Option<String>,
    messages: Option<Vec<Message>>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    max_tokens: Option<i64>,
    max_completion_tokens: Option<i64>,
}

#[derive(Debug, Deserialize)]
struct Message {
    #[serde(default)]
    role: String,
    /// A string, or a list of parts (`{"type":"text"}` / `{"type":"image_url"}`).
    content: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct CompletionRequest {
    model: Option<String>,
    prompt: Option<Value>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    max_tokens: Option<i64>,
}

#[derive(Debug, Default, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

#[derive(Debug, Deserialize)]
struct EmbeddingRequest {
    model: Option<String>,
    input: Option<Value>,
}

pub async fn chat(State(node): State<Arc<Node>>, body: Bytes) -> Response {
    match chat_job(&body) {
        Ok(job) => run(node, job).await,
        Err(e) => e.openai(),
    }
}

pub async fn completions(State(node): State<Arc<Node>>, body: Bytes) -> Response {
    match completion_job(&body) {
        Ok(job) => run(node, job).await,
        Err(e) => e.openai(),
    }
}

fn chat_job(body: &[u8]) -> Result<Job, StandinError> {
    let req: ChatCompletionRequest = json_body(body)?;
    let model = required_model(req.model)?;
    let messages = req.messages.unwrap_or_default();
    if messages.is_empty() {
        return Err(StandinError::bad_request("messages is required"));
    }
    let turns: Vec<Turn> = messages.into_iter().map(turn).collect();
    Ok(job(
        Api::OpenAiChat,
        model,
        render_chat(&turns),
        req.max_completion_tokens.or(req.max_tokens),
        req.stream,
        req.stream_options,
    ))
}

fn completion_job(body: &[u8]) -> Result<Job, StandinError> {
    let req: CompletionRequest = json_body(body)?;
    let model = required_model(req.model)?;
    let prompt = match req.prompt {
        Some(Value::String(s)) => s,
        None | Some(Value::Null) => String::new(),
        Some(_) => return Err(StandinError::bad_request("prompt must be a string")),
    };
    Ok(job(
        Api::OpenAiCompletion,
        model,
        render_completion(None, &prompt, &[]),
        req.max_tokens,
        req.stream,
        req.stream_options,
    ))
}

fn job(
    api: Api,
    model: String,
    prompt: Vec<u8>,
    max_tokens: Option<i64>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
) -> Job {
    Job {
        api,
        model,
        prompt,
        max_tokens,
        num_ctx: None,
        keep_alive: None,
        // OpenAI clients stream only when they ask to.
        stream: stream.unwrap_or(false),
        include_usage: stream_options.unwrap_or_default().include_usage,
    }
}

/// A message in the renderer's terms: text parts concatenated, image parts as images.
fn turn(m: Message) -> Turn {
    let mut t = Turn {
        role: m.role,
        ..Turn::default()
    };
    match m.content {
        Some(Value::String(s)) => t.content = s,
        Some(Value::Array(parts)) => {
            for part in parts {
                add_part(&mut t, &part);
            }
        }
        _ => {}
    }
    t
}

fn add_part(t: &mut Turn, part: &Value) {
    match part["type"].as_str() {
        Some("text") => t
            .content
            .push_str(part["text"].as_str().unwrap_or_default()),
        Some("image_url") => {
            let url = &part["image_url"];
            let url = url["url"].as_str().or(url.as_str()).unwrap_or_default();
            t.images.push(url.to_string());
        }
        _ => {}
    }
}

/// `/v1/embeddings`: `input` is a string or a list of strings.
pub async fn embeddings(State(node): State<Arc<Node>>, body: Bytes) -> Response {
    let result = async {
        let req: EmbeddingRequest = json_body(&body)?;
        let model = required_model(req.model)?;
        let job = EmbedJob {
            path: "/v1/embeddings",
            inputs: string_inputs(req.input)?,
            model: model.clone(),
            num_ctx: None,
            keep_alive: None,
        };
        let done = embed(&node, job).await?;
        let data: Vec<Value> = done
            .vectors
            .into_iter()
            .enumerate()
            .map(|(i, v)| json!({ "object": "embedding", "embedding": v, "index": i }))
            .collect();
        Ok::<_, StandinError>(json!({
            "object": "list",
            "data": data,
            "model": model,
            "usage": { "prompt_tokens": done.prompt_tokens, "total_tokens": done.prompt_tokens },
        }))
    };
    match result.await {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.openai(),
    }
}

/// `/v1/models`: the models on disk.
pub async fn models(State(node): State<Arc<Node>>) -> Json<Value> {
    let data: Vec<Value> = node.cfg.models.iter().map(openai_model).collect();
    Json(json!({ "object": "list", "data": data }))
}

/// `/v1/models/{model}`.
pub async fn model(State(node): State<Arc<Node>>, Path(name): Path<String>) -> Response {
    match node.cfg.model(&name) {
        Some(m) => Json(openai_model(m)).into_response(),
        None => StandinError::model_not_found(&name).openai(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_renders_like_native_chat() {
        let body = br#"{"model":"m","messages":[{"role":"user","content":[
            {"type":"text","text":"hi"},{"type":"image_url","image_url":{"url":"data:x"}}]}],
            "stream":true,"stream_options":{"include_usage":true},"max_tokens":4}"#;
        let job = chat_job(body).map_err(|e| e.message);
        let job = job
            .as_ref()
            .map(|j| (j.stream, j.include_usage, j.max_tokens));
        assert_eq!(job, Ok((true, true, Some(4))));

        let native = render_chat(&[Turn {
            role: "user".into(),
            content: "hi".into(),
            images: vec!["data:x".into()],
        }]);
        assert_eq!(chat_job(body).map(|j| j.prompt).ok(), Some(native));
    }

    #[test]
    fn streaming_is_opt_in() {
        let job = completion_job(br#"{"model":"m","prompt":"go"}"#);
        assert_eq!(
            job.map(|j| (j.stream, j.prompt)).ok(),
            Some((false, b"go".to_vec()))
        );
        assert!(completion_job(br#"{"model":"m","prompt":[1,2]}"#).is_err());
        assert!(chat_job(br#"{"model":"m","messages":[]}"#).is_err());
    }
}
