//! Errors a stand-in answers with, in the two shapes clients expect: Ollama's native
//! `{"error":"..."}` and the OpenAI-compatible `{"error":{"message":...}}` that Ollama's
//! `/v1` endpoints return (and that OpenAI client libraries parse).

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// A failed request: an HTTP status and the message Ollama would give.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StandinError {
    pub status: StatusCode,
    pub message: String,
}

impl StandinError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        StandinError {
            status,
            message: message.into(),
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, message)
    }

    /// The words Ollama uses when a model is not on disk.
    pub fn model_not_found(name: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            format!("model '{name}' not found, try pulling it first"),
        )
    }

    /// What Ollama says when asked to chat with an embedding-only model.
    pub fn unsupported(name: &str, what: &str) -> Self {
        Self::bad_request(format!("\"{name}\" does not support {what}"))
    }

    /// Native Ollama shape.
    pub fn ollama(self) -> Response {
        (self.status, Json(json!({ "error": self.message }))).into_response()
    }

    /// OpenAI-compatible shape.
    pub fn openai(self) -> Response {
        let kind = if self.status.is_client_error() {
            "invalid_request_error"
        } else {
            "api_error"
        };
        let body = json!({
            "error": { "message": self.message, "type": kind, "param": null, "code": null }
        });
        (self.status, Json(body)).into_response()
    }
}

impl StandinError {
    /// Anthropic's shape, as Ollama's `/v1/messages` writes it (`anthropic.NewError`).
    pub fn anthropic(self) -> Response {
        let kind = match self.status.as_u16() {
            400 => "invalid_request_error",
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            429 => "rate_limit_error",
            503 | 529 => "overloaded_error",
            _ => "api_error",
        };
        let body = json!({ "type": "error", "error": { "type": kind, "message": self.message } });
        (self.status, Json(body)).into_response()
    }
}

impl std::fmt::Display for StandinError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status.as_u16(), self.message)
    }
}

impl std::error::Error for StandinError {}

impl From<StandinError> for std::io::Error {
    fn from(e: StandinError) -> Self {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string())
    }
}
