//! Ollama's native model endpoints: `/api/chat`, `/api/generate`, `/api/embed` and
//! `/api/embeddings`. Each handler turns the body into a [`Job`] (or an embedding job) and
//! hands it on; the shapes of the replies live in [`super::wire`].

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde::Deserialize;
use serde_json::{Value, json};

use super::clock::now_rfc3339;
use super::embed::{EmbedJob, embed};
use super::error::StandinError;
use super::generate::{Job, run};
use super::node::Node;
use super::parse::{Options, json_body, keep_alive, required_model};
use super::prompt::{Turn, render_chat, render_completion};
use super::residency::KeepAlive;
use super::wire::Api;

#[derive(Debug, Deserialize)]
struct ChatRequest {
    model: Option<String>,
    messages: Option<Vec<Message>>,
    stream: Option<bool>,
    options: Option<Options>,
    keep_alive: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct Message {
    #[serde(default)]
    role: String,
    content: Option<String>,
    images: Option<Vec<String>>,
}

#[derive(Debug, Deserialize)]
struct GenerateRequest {
    model: Option<String>,
    prompt: Option<String>,
    system: Option<String>,
    images: Option<Vec<String>>,
    stream: Option<bool>,
    options: Option<Options>,
    keep_alive: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct EmbedRequest {
    model: Option<String>,
    input: Option<Value>,
    options: Option<Options>,
    keep_alive: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct EmbeddingsRequest {
    model: Option<String>,
    prompt: Option<String>,
    options: Option<Options>,
    keep_alive: Option<Value>,
}

/// A native request either generates, or (with nothing to say) only loads or unloads the
/// model: Ollama's way to preload (`{"model":"m"}`) or evict (`"keep_alive":0`).
enum Native {
    Generate(Job),
    LoadOnly(LoadOnly),
}

struct LoadOnly {
    api: Api,
    model: String,
    num_ctx: Option<u32>,
    keep_alive: Option<KeepAlive>,
}

pub async fn chat(State(node): State<Arc<Node>>, body: Bytes) -> Response {
    match chat_request(&body) {
        Ok(native) => serve(node, native).await,
        Err(e) => e.ollama(),
    }
}

pub async fn generate(State(node): State<Arc<Node>>, body: Bytes) -> Response {
    match generate_request(&body) {
        Ok(native) => serve(node, native).await,
        Err(e) => e.ollama(),
    }
}

async fn serve(node: Arc<Node>, native: Native) -> Response {
    match native {
        Native::Generate(job) => run(node, job).await,
        Native::LoadOnly(load) => match load_only(&node, &load).await {
            Ok(reason) => Json(load_reply(&load, reason)).into_response(),
            Err(e) => e.ollama(),
        },
    }
}

fn chat_request(body: &[u8]) -> Result<Native, StandinError> {
    let req: ChatRequest = json_body(body)?;
    let model = required_model(req.model)?;
    let options = req.options.unwrap_or_default();
    let keep_alive = keep_alive(req.keep_alive.as_ref())?;
    let messages = req.messages.unwrap_or_default();
    if messages.is_empty() {
        return Ok(load_only_request(
            Api::OllamaChat,
            model,
            &options,
            keep_alive,
        ));
    }
    let turns: Vec<Turn> = messages.into_iter().map(turn).collect();
    Ok(Native::Generate(job(
        Api::OllamaChat,
        model,
        render_chat(&turns),
        &options,
        keep_alive,
        req.stream,
    )))
}

fn generate_request(body: &[u8]) -> Result<Native, StandinError> {
    let req: GenerateRequest = json_body(body)?;
    let model = required_model(req.model)?;
    let options = req.options.unwrap_or_default();
    let keep_alive = keep_alive(req.keep_alive.as_ref())?;
    let prompt = req.prompt.unwrap_or_default();
    let images = req.images.unwrap_or_default();
    if prompt.is_empty() && images.is_empty() {
        return Ok(load_only_request(
            Api::OllamaGenerate,
            model,
            &options,
            keep_alive,
        ));
    }
    let render = render_completion(req.system.as_deref(), &prompt, &images);
    Ok(Native::Generate(job(
        Api::OllamaGenerate,
        model,
        render,
        &options,
        keep_alive,
        req.stream,
    )))
}

fn turn(m: Message) -> Turn {
    Turn {
        role: m.role,
        content: m.content.unwrap_or_default(),
        images: m.images.unwrap_or_default(),
    }
}

fn job(
    api: Api,
    model: String,
    prompt: Vec<u8>,
    options: &Options,
    keep_alive: Option<KeepAlive>,
    stream: Option<bool>,
) -> Job {
    Job {
        api,
        model,
        prompt,
        max_tokens: options.num_predict,
        num_ctx: options.context(),
        keep_alive,
        // Ollama streams unless told not to.
        stream: stream.unwrap_or(true),
        include_usage: false,
    }
}

fn load_only_request(
    api: Api,
    model: String,
    options: &Options,
    keep_alive: Option<KeepAlive>,
) -> Native {
    Native::LoadOnly(LoadOnly {
        api,
        model,
        num_ctx: options.context(),
        keep_alive,
    })
}

/// Loads the model (or unloads it for `keep_alive: 0`) and says which it did.
async fn load_only(node: &Node, load: &LoadOnly) -> Result<&'static str, StandinError> {
    let model = node.model_for(&load.model, load.api.capability())?;
    if load.keep_alive == Some(KeepAlive::For(std::time::Duration::ZERO)) {
        node.residency.unload(&model.name);
        return Ok("unload");
    }
    let want = node.want(model, load.num_ctx, load.keep_alive);
    drop(node.residency.acquire(&want).await?);
    Ok("load")
}

fn load_reply(load: &LoadOnly, reason: &str) -> Value {
    let mut v = json!({ "model": load.model, "created_at": now_rfc3339() });
    if load.api == Api::OllamaChat {
        v["message"] = json!({ "role": "assistant", "content": "" });
    } else {
        v["response"] = json!("");
    }
    v["done_reason"] = json!(reason);
    v["done"] = json!(true);
    v
}

/// `/api/embed`: `input` is a string or a list of strings.
pub async fn embed_handler(State(node): State<Arc<Node>>, body: Bytes) -> Response {
    let result = async {
        let req: EmbedRequest = json_body(&body)?;
        let model = required_model(req.model)?;
        let options = req.options.unwrap_or_default();
        let job = EmbedJob {
            path: "/api/embed",
            inputs: string_inputs(req.input)?,
            num_ctx: options.context(),
            keep_alive: keep_alive(req.keep_alive.as_ref())?,
            model: model.clone(),
        };
        let done = embed(&node, job).await?;
        Ok::<_, StandinError>(json!({
            "model": model,
            "embeddings": done.vectors,
            "total_duration": nanos(done.total_duration),
            "load_duration": nanos(done.load_duration),
            "prompt_eval_count": done.prompt_tokens,
        }))
    };
    match result.await {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.ollama(),
    }
}

/// `/api/embeddings`, the older single-prompt endpoint.
pub async fn embeddings_handler(State(node): State<Arc<Node>>, body: Bytes) -> Response {
    let result = async {
        let req: EmbeddingsRequest = json_body(&body)?;
        let options = req.options.unwrap_or_default();
        let prompt = req.prompt.unwrap_or_default();
        let job = EmbedJob {
            path: "/api/embeddings",
            model: required_model(req.model)?,
            inputs: if prompt.is_empty() {
                vec![]
            } else {
                vec![prompt]
            },
            num_ctx: options.context(),
            keep_alive: keep_alive(req.keep_alive.as_ref())?,
        };
        let done = embed(&node, job).await?;
        let vector = done.vectors.into_iter().next().unwrap_or_default();
        Ok::<_, StandinError>(json!({ "embedding": vector }))
    };
    match result.await {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.ollama(),
    }
}

/// A string or a list of strings, as both embed APIs accept.
pub fn string_inputs(input: Option<Value>) -> Result<Vec<String>, StandinError> {
    match input {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![s]),
        Some(Value::Array(items)) => items
            .into_iter()
            .map(|item| match item {
                Value::String(s) => Ok(s),
                _ => Err(StandinError::bad_request("invalid input type")),
            })
            .collect(),
        Some(_) => Err(StandinError::bad_request("invalid input type")),
    }
}

fn nanos(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_bodies_render_messages() {
        let body = br#"{"messages":[{"role":"user","content":"hi","images":["aa"]}],
                        "options":{"num_ctx":4096,"num_predict":3},"model":"m","stream":false}"#;
        let Ok(Native::Generate(job)) = chat_request(body) else {
            panic!("expected a generation");
        };
        assert_eq!(job.model, "m");
        assert_eq!(
            (job.num_ctx, job.max_tokens, job.stream),
            (Some(4096), Some(3), false)
        );
        assert!(job.prompt.starts_with(b"<|user|>"));
        assert!(job.prompt.ends_with(b"hi\n"));
    }

    #[test]
    fn empty_chat_only_loads() {
        assert!(matches!(
            chat_request(br#"{"model":"m"}"#),
            Ok(Native::LoadOnly(_))
        ));
        assert!(matches!(
            generate_request(br#"{"model":"m","prompt":""}"#),
            Ok(Native::LoadOnly(_))
        ));
    }

    #[test]
    fn malformed_bodies_are_rejected() {
        let status = |r: Result<Native, StandinError>| r.err().map(|e| e.status.as_u16());
        assert_eq!(status(chat_request(b"{not json")), Some(400));
        assert_eq!(status(chat_request(br#"{"messages":[]}"#)), Some(400));
        assert_eq!(status(generate_request(br#"{"prompt":"x"}"#)), Some(400));
    }

    #[test]
    fn embed_inputs_are_strings() {
        assert_eq!(
            string_inputs(Some(json!("a"))).ok(),
            Some(vec!["a".to_string()])
        );
        assert_eq!(
            string_inputs(Some(json!(["a", "b"]))).map(|v| v.len()).ok(),
            Some(2)
        );
        assert!(string_inputs(Some(json!([1]))).is_err());
    }
}
