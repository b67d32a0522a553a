//! Replies corral writes itself: JSON errors shaped as the API of the request's path
//! expects (Ollama's, OpenAI's or Anthropic's), and small JSON documents.

use bytes::Bytes;
use pingora_core::Result;
use pingora_http::ResponseHeader;
use pingora_proxy::Session;
use serde_json::json;

use crate::request::ErrorShape;

/// Writes a complete response with a body.
pub async fn send(
    session: &mut Session,
    status: u16,
    content_type: &str,
    body: Bytes,
    extra: &[(&'static str, String)],
) -> Result<()> {
    let mut header = ResponseHeader::build(status, Some(3 + extra.len()))?;
    header.insert_header("Content-Type", content_type)?;
    header.insert_header("Content-Length", body.len().to_string())?;
    for (name, value) in extra {
        header.insert_header(*name, value.as_str())?;
    }
    let head_only = session.req_header().method == http::Method::HEAD;
    session
        .write_response_header(Box::new(header), head_only || body.is_empty())
        .await?;
    if !head_only && !body.is_empty() {
        session.write_response_body(Some(body), true).await?;
    }
    Ok(())
}

pub async fn json(session: &mut Session, status: u16, value: &serde_json::Value) -> Result<()> {
    let body = serde_json::to_vec(value).unwrap_or_default();
    send(
        session,
        status,
        "application/json; charset=utf-8",
        body.into(),
        &[],
    )
    .await
}

/// An error with the given status, in the shape the path's API answers errors with
/// (`{"error": "..."}` on Ollama's own paths).
/// Answers with a JSON error ([`error`]) and records its status for the access log and
/// the metrics.
pub async fn refuse(
    session: &mut Session,
    ctx: &mut super::ctx::RequestCtx,
    status: u16,
    message: &str,
    extra: &[(&'static str, String)],
) -> Result<()> {
    ctx.status = status;
    error(session, status, message, extra).await
}

pub async fn error(
    session: &mut Session,
    status: u16,
    message: &str,
    extra: &[(&'static str, String)],
) -> Result<()> {
    let shape = ErrorShape::of_path(session.req_header().uri.path());
    send(
        session,
        status,
        "application/json; charset=utf-8",
        error_body(shape, status, message).into(),
        extra,
    )
    .await
}

/// The body of an error, as Ollama writes it for each API (`openai.NewError`,
/// `anthropic.NewError`).
pub fn error_body(shape: ErrorShape, status: u16, message: &str) -> Vec<u8> {
    let value = match shape {
        ErrorShape::Ollama => json!({ "error": message }),
        ErrorShape::OpenAi => {
            let kind = match status {
                400 => "invalid_request_error",
                404 => "not_found_error",
                _ => "api_error",
            };
            json!({ "error": { "message": message, "type": kind, "param": null, "code": null } })
        }
        ErrorShape::Anthropic => {
            let kind = match status {
                400 | 413 => "invalid_request_error",
                401 => "authentication_error",
                403 => "permission_error",
                404 => "not_found_error",
                429 => "rate_limit_error",
                503 | 529 => "overloaded_error",
                _ => "api_error",
            };
            json!({ "type": "error", "error": { "type": kind, "message": message } })
        }
    };
    serde_json::to_vec(&value).unwrap_or_default()
}
