//! Replies corral writes itself: JSON errors shaped like Ollama's, and small JSON documents.

use bytes::Bytes;
use pingora_core::Result;
use pingora_http::ResponseHeader;
use pingora_proxy::Session;

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

/// `{"error": "..."}` with the given status, as Ollama answers errors.
pub async fn error(
    session: &mut Session,
    status: u16,
    message: &str,
    extra: &[(&'static str, String)],
) -> Result<()> {
    send(
        session,
        status,
        "application/json; charset=utf-8",
        error_body(message).into(),
        extra,
    )
    .await
}

/// The body of an error: `{"error": "..."}`.
pub fn error_body(message: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({ "error": message })).unwrap_or_default()
}
