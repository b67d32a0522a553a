//! Reading a client's request body, bounded in size and time.
//!
//! corral must read the body before it can choose a node (the model may be the last key),
//! so it holds the whole body, and forwards those same bytes itself: Pingora 0.9.1 cannot
//! replay a consumed body over 64 KiB (see docs/design.md).

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use pingora_proxy::Session;

#[derive(Debug)]
pub enum BodyError {
    TooLarge { limit: usize },
    Timeout,
    Read(String),
}

impl std::fmt::Display for BodyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BodyError::TooLarge { limit } => {
                write!(f, "request body is larger than the limit of {limit} bytes")
            }
            BodyError::Timeout => write!(f, "request body was not received in time"),
            BodyError::Read(e) => write!(f, "cannot read request body: {e}"),
        }
    }
}

impl BodyError {
    pub fn status(&self) -> u16 {
        match self {
            BodyError::TooLarge { .. } => 413,
            BodyError::Timeout => 408,
            BodyError::Read(_) => 400,
        }
    }
}

pub async fn read(
    session: &mut Session,
    limit: usize,
    within: Duration,
) -> Result<Bytes, BodyError> {
    let declared = session
        .req_header()
        .headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|len| len > limit) {
        return Err(BodyError::TooLarge { limit });
    }
    // A body that comes in one read (Pingora reads up to 64 KiB at a time) is kept as that
    // read gave it; a longer one is joined once, into room for all of it.
    let mut single: Option<Bytes> = None;
    let mut joined = BytesMut::new();
    let reading = async {
        while let Some(chunk) = session
            .read_request_body()
            .await
            .map_err(|e| BodyError::Read(e.to_string()))?
        {
            let held = single.as_ref().map_or(joined.len(), Bytes::len);
            if held + chunk.len() > limit {
                return Err(BodyError::TooLarge { limit });
            }
            match single.take() {
                None if joined.is_empty() => single = Some(chunk),
                None => joined.extend_from_slice(&chunk),
                Some(first) => {
                    joined.reserve(declared.unwrap_or(0).max(first.len() + chunk.len()));
                    joined.extend_from_slice(&first);
                    joined.extend_from_slice(&chunk);
                }
            }
        }
        Ok(())
    };
    tokio::time::timeout(within, reading)
        .await
        .map_err(|_| BodyError::Timeout)??;
    Ok(single.unwrap_or_else(|| joined.freeze()))
}

/// Reads and drops what is left of a refused body, for at most `within` and `max` bytes, so
/// that a client still sending it reads corral's answer rather than a reset connection (it
/// would otherwise fail writing into a socket corral closed: a broken pipe, no status).
pub async fn drain(session: &mut Session, within: Duration, max: usize) {
    let draining = async {
        let mut dropped = 0usize;
        while dropped < max {
            match session.read_request_body().await {
                Ok(Some(chunk)) => dropped += chunk.len(),
                Ok(None) | Err(_) => break,
            }
        }
    };
    let _ = tokio::time::timeout(within, draining).await;
}
