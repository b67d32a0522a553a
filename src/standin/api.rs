//! The stand-in's HTTP surface: the route table, the informational endpoints a router polls
//! (`/`, `/api/version`, `/api/tags`, `/api/ps`, `/api/show`), and the fault injection that
//! sits in front of every route.

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use bytes::Bytes;
use serde::Deserialize;
use serde_json::{Value, json};

use super::catalog::{details, digest, show as show_body, tag_entry};
use super::clock::{far_future_rfc3339, instant_rfc3339};
use super::config::{Fault, StandinKind};
use super::error::StandinError;
use super::node::Node;
use super::parse::json_body;
use super::residency::Resident;
use super::server::ConnControl;
use super::{compat, ollama, openai};

/// Largest request body accepted: long conversations and base64 images are big, and the
/// router must be tested with bodies far above Pingora's 64 KiB replay buffer.
const MAX_BODY: usize = 256 << 20;

/// The version string `/api/version` reports: an Ollama before 0.30, or a current one.
const VERSION: &str = "0.5.7-standin";
const CURRENT_VERSION: &str = "0.33.0-standin";

pub fn router(node: Arc<Node>) -> Router {
    Router::new()
        .route("/", get(root))
        .route("/api/version", get(version).head(version))
        .route("/api/tags", get(tags).head(tags))
        .route("/api/ps", get(ps))
        .route("/api/show", post(show))
        .route("/props", get(props))
        .route("/api/chat", post(ollama::chat))
        .route("/api/generate", post(ollama::generate))
        .route("/api/embed", post(ollama::embed_handler))
        .route("/api/embeddings", post(ollama::embeddings_handler))
        .route("/v1/chat/completions", post(openai::chat))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/embeddings", post(openai::embeddings))
        .route("/v1/models", get(openai::models))
        .route("/v1/models/{*model}", get(openai::model))
        .route("/v1/responses", post(compat::responses))
        .route("/v1/messages", post(compat::messages))
        .route("/v1/audio/transcriptions", post(compat::transcriptions))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .layer(middleware::from_fn_with_state(Arc::clone(&node), faults))
        .with_state(node)
}

/// Applies the node's current fault to a new request.
async fn faults(
    State(node): State<Arc<Node>>,
    conn: Option<Extension<ConnControl>>,
    req: Request,
    next: Next,
) -> Response {
    match node.fault() {
        Fault::Hang => hang(&node, conn.map(|Extension(c)| c), req).await,
        Fault::Status(code) => {
            let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            StandinError::new(status, "injected fault").ollama()
        }
        Fault::None | Fault::CutMidStream(_) => next.run(req).await,
    }
}

/// Reads the request, then answers nothing until the fault changes; then closes the
/// connection, as a server that was stuck and gave up would.
async fn hang(node: &Node, conn: Option<ConnControl>, req: Request) -> Response {
    let _ = axum::body::to_bytes(req.into_body(), MAX_BODY).await;
    node.hang_released().await;
    match conn {
        Some(conn) => {
            conn.close();
            std::future::pending().await
        }
        None => StatusCode::SERVICE_UNAVAILABLE.into_response(),
    }
}

async fn root() -> &'static str {
    "Ollama is running"
}

/// llama-server and other OpenAI-compatible servers have no `/api/version`.
async fn version(State(node): State<Arc<Node>>) -> Response {
    match node.cfg.kind {
        StandinKind::OllamaLegacy => Json(json!({ "version": VERSION })).into_response(),
        StandinKind::Ollama => Json(json!({ "version": CURRENT_VERSION })).into_response(),
        StandinKind::LlamaCpp | StandinKind::Openai => not_found().await.into_response(),
    }
}

/// llama-server's `GET /props`, as llama.cpp `tools/server/server-context.cpp`
/// (`get_res_props`) builds it: `total_slots` is `-np`, `default_generation_settings.n_ctx`
/// one slot's context; the fields a router reads, and a few more so a reader of the whole
/// object finds it shaped as the real one. Ollama has no `/props` (`server/routes.go`),
/// nor do other OpenAI-compatible servers.
async fn props(State(node): State<Arc<Node>>) -> Response {
    if node.cfg.kind != StandinKind::LlamaCpp {
        return not_found().await.into_response();
    }
    let model = node.cfg.models.first();
    Json(json!({
        "default_generation_settings": {
            "params": { "n_predict": -1 },
            "n_ctx": model.map_or(0, |m| m.context_length),
        },
        "total_slots": node.cfg.num_parallel,
        "model_alias": model.map_or("", |m| m.name.as_str()),
        "model_path": model.map_or(String::new(), |m| format!("/models/{}.gguf", m.name)),
        "endpoint_slots": true,
        "endpoint_props": false,
        "endpoint_metrics": false,
        "build_info": "standin",
        "is_sleeping": false,
    }))
    .into_response()
}

async fn not_found() -> (StatusCode, &'static str) {
    (StatusCode::NOT_FOUND, "404 page not found")
}

/// A llama-server has none of Ollama's `/api/*` routes (llama.cpp
/// `tools/server/server.cpp`, the route table).
fn lacks_ollama_api(node: &Node) -> bool {
    node.cfg.kind == StandinKind::LlamaCpp
}

/// `/api/tags`: the models on disk.
async fn tags(State(node): State<Arc<Node>>) -> Response {
    if lacks_ollama_api(&node) {
        return not_found().await.into_response();
    }
    let models: Vec<Value> = node.cfg.models.iter().map(tag_entry).collect();
    Json(json!({ "models": models })).into_response()
}

/// `/api/ps`: the resident models, most recently used first.
async fn ps(State(node): State<Arc<Node>>) -> Response {
    if lacks_ollama_api(&node) {
        return not_found().await.into_response();
    }
    let models = node.residency.with_ready(|resident| {
        let mut resident = resident.to_vec();
        resident.sort_by_key(|r| std::cmp::Reverse(r.last_used));
        resident.into_iter().map(ps_entry).collect::<Vec<_>>()
    });
    Json(json!({ "models": models })).into_response()
}

fn ps_entry(r: &Resident) -> Value {
    let expires_at = match r.expires_at() {
        Some(at) => instant_rfc3339(at),
        None => far_future_rfc3339(),
    };
    json!({
        "name": r.model.name,
        "model": r.model.name,
        "size": r.model.size_bytes,
        "digest": digest(&r.model),
        "details": details(&r.model),
        "expires_at": expires_at,
        "size_vram": r.model.size_bytes,
        "context_length": r.context,
    })
}

#[derive(Debug, Deserialize)]
struct ShowRequest {
    model: Option<String>,
    /// Older clients (and `ollama-rs`) send `name`.
    name: Option<String>,
}

/// `/api/show`: details of a model on disk.
async fn show(State(node): State<Arc<Node>>, body: Bytes) -> Response {
    let req: ShowRequest = match json_body(&body) {
        Ok(req) => req,
        Err(e) => return e.ollama(),
    };
    let Some(name) = req.model.or(req.name).filter(|n| !n.is_empty()) else {
        return StandinError::bad_request("model is required").ollama();
    };
    match node.cfg.model(&name) {
        Some(model) => Json(show_body(model)).into_response(),
        None => {
            StandinError::new(StatusCode::NOT_FOUND, format!("model '{name}' not found")).ollama()
        }
    }
}
