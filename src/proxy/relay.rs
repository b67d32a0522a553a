//! Relaying: connecting to a node, sending it the request, and streaming its reply back to
//! the client chunk by chunk. Nothing here decides where a request goes or keeps books;
//! `forward.rs` chooses what to try next and `account.rs` counts what a reply showed.
//!
//! corral relays with Pingora's transport connector and HTTP/1 client session rather than
//! Pingora's proxy loop, because the body was consumed to choose the node and Pingora 0.9.1
//! replays at most 64 KiB of a consumed body. Holding the bytes here also makes a retry on
//! another node send the same body again.

use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use pingora_core::connectors::TransportConnector;
use pingora_core::protocols::Stream;
use pingora_core::protocols::http::v1::client::HttpSession;
use pingora_core::upstreams::peer::{HttpPeer, Peer};
use pingora_core::{Error, ErrorType, Result};
use pingora_http::{RequestHeader, ResponseHeader};
use pingora_proxy::Session;

use super::batch;
use super::headers;
use crate::config::Timeouts;
use crate::fleet::Node;
use crate::fleet::reply::Tail;
use crate::request::ErrorShape;

/// How long an idle pooled connection to a node is kept.
const POOL_IDLE: Duration = Duration::from_secs(60);
/// Bytes of the reply kept to read its final chunk; a non-streamed reply is one object.
const STREAM_TAIL: usize = 64 * 1024;
const WHOLE_TAIL: usize = 1024 * 1024;

/// How a wait raced against the client ended.
pub(super) enum Wait<T> {
    Done(T),
    TimedOut,
    ClientGone,
}

/// Runs `work` unless the client goes away or `limit` passes first.
pub(super) async fn race<T>(
    session: &mut Session,
    limit: Duration,
    work: impl Future<Output = T>,
) -> Wait<T> {
    let gone = session.as_downstream_mut().read_body_or_idle(true);
    tokio::select! {
        // Work first: once a reply with a declared length is written the client may send
        // its next request on the connection, and the idle read would take that request's
        // first byte for a gone client (and lose it) while the finished reply's end of
        // body was ready all along.
        biased;
        done = tokio::time::timeout(limit, work) => match done {
            Ok(value) => Wait::Done(value),
            Err(_) => Wait::TimedOut,
        },
        _ = gone => Wait::ClientGone,
    }
}

/// Connections to the nodes, pooled and reused.
pub(super) struct Upstream {
    transport: TransportConnector,
}

impl Upstream {
    pub fn new() -> Upstream {
        Upstream {
            transport: TransportConnector::new(None),
        }
    }

    /// Sends the request and reads the reply's header. A pooled connection that the node
    /// closed meanwhile fails on the write or on the first read: that gets one more try on
    /// a fresh connection to the same node, and does not count against the node. `request`
    /// is the client's request as the node should see it; `again` makes it anew from the
    /// client's for that second try (Pingora's session takes the header it writes, and
    /// making it again only when needed spares a copy per request).
    pub async fn exchange(
        &self,
        session: &mut Session,
        peer: &HttpPeer,
        request: RequestHeader,
        again: impl Fn(&RequestHeader) -> Result<RequestHeader>,
        body: &[u8],
        first_byte: Duration,
    ) -> Wait<Result<HttpSession>> {
        let mut request = Some(request);
        let mut fresh = false;
        loop {
            let (stream, reused) = match self.stream(peer, fresh).await {
                Ok(stream) => stream,
                Err(e) => return Wait::Done(Err(e)),
            };
            let mut upstream = HttpSession::new_with_options(stream, peer);
            let header = match request
                .take()
                .map_or_else(|| again(session.req_header()), Ok)
            {
                Ok(header) => header,
                Err(e) => return Wait::Done(Err(e)),
            };
            if let Err(e) = write_request(&mut upstream, header, body).await {
                if reused {
                    fresh = true;
                    continue;
                }
                return Wait::Done(Err(e));
            }
            // `read_response`, not `read_resp_header_parts`: that returns a copy of the header
            // the session keeps, which `answer` reads in place.
            match race(session, first_byte, upstream.read_response()).await {
                Wait::Done(Ok(_)) => return Wait::Done(Ok(upstream)),
                Wait::Done(Err(_)) if reused => fresh = true,
                Wait::Done(Err(e)) => return Wait::Done(Err(e)),
                Wait::TimedOut => return Wait::TimedOut,
                Wait::ClientGone => return Wait::ClientGone,
            }
        }
    }

    /// Sends one request to a node and reads its whole reply, for requests corral answers
    /// from several replies (embedding fan-out). Not raced against the client: the
    /// timeouts bound it. Replies past `max_reply` bytes fail.
    pub async fn fetch(
        &self,
        peer: &HttpPeer,
        request: &RequestHeader,
        body: &[u8],
        timeouts: &Timeouts,
        max_reply: usize,
    ) -> Result<(u16, Bytes)> {
        let (stream, _reused) = self.stream(peer, false).await?;
        let mut upstream = HttpSession::new_with_options(stream, peer);
        write_request(&mut upstream, request.clone(), body).await?;
        let timed_out =
            |what: &str| Error::explain(ErrorType::ReadTimedout, format!("no {what} in time"));
        tokio::time::timeout(timeouts.first_byte, upstream.read_response())
            .await
            .map_err(|_| timed_out("reply"))??;
        let status = upstream.resp_header().map_or(0, |h| h.status.as_u16());
        let mut reply = Vec::new();
        while let Some(chunk) = tokio::time::timeout(timeouts.idle, upstream.read_body_bytes())
            .await
            .map_err(|_| timed_out("data"))??
        {
            if reply.len() + chunk.len() > max_reply {
                return Error::e_explain(ErrorType::ReadError, "reply too large");
            }
            reply.extend_from_slice(&chunk);
        }
        self.release(upstream, peer).await;
        Ok((status, reply.into()))
    }

    /// A connection to the node: a pooled one unless `fresh`, else a new one; and whether it
    /// was pooled. What `TransportConnector::get_stream` does, but with the future that
    /// connects (a TLS handshake's state, about 8 KiB) boxed: it is only needed when no
    /// pooled connection is left, and held inline it made every future that awaits a
    /// request's reply that much larger, each of them copied when it is made (issue 13).
    async fn stream(&self, peer: &HttpPeer, fresh: bool) -> Result<(Stream, bool)> {
        if !fresh && let Some(stream) = self.transport.reused_stream(peer).await {
            return Ok((stream, true));
        }
        let stream = Box::pin(self.transport.new_stream(peer)).await?;
        Ok((stream, false))
    }

    /// Returns the connection to the pool when its reply was read to the end and the node
    /// keeps connections alive.
    pub async fn release(&self, mut upstream: HttpSession, peer: &HttpPeer) {
        if upstream.is_body_done() {
            upstream.respect_keepalive();
            if let Some(stream) = upstream.reuse().await {
                self.transport
                    .release_stream(stream, peer.reuse_hash(), Some(POOL_IDLE));
            }
        }
    }
}

/// How streaming a reply back ended.
pub(super) enum End {
    /// The node's reply ended. The client has all of it but `last` (the final bytes, where
    /// they came in the batch that ended the reply) and the end of the body, which the caller
    /// writes ([`end_reply`]) once the request's books are settled.
    Complete { last: Option<Bytes> },
    /// The node stopped before the end of its reply; the label is the `kind` of
    /// `corral_upstream_errors_total`.
    Broken { kind: &'static str, reason: String },
    /// The client went away.
    ClientGone,
}

/// A reply streamed back: how it ended, when its first byte came, and its last bytes.
pub(super) struct Streamed {
    pub end: End,
    pub ttfb: Option<Duration>,
    pub bytes: usize,
    pub tail: Tail,
}

/// Copies the reply's body to the client as each chunk arrives, unbuffered (chunks that
/// arrived together are written together: see [`batch`]), keeping the last bytes to read
/// the final chunk's statistics. `first_byte` is told the time from `started` to the first
/// chunk when it comes. The end of the client's body is not written: see [`End::Complete`].
pub(super) async fn stream_back(
    session: &mut Session,
    upstream: &mut HttpSession,
    streamed_reply: bool,
    idle: Duration,
    started: Instant,
    mut first_byte: impl FnMut(Duration),
) -> Result<Streamed> {
    let mut tail = Tail::new(if streamed_reply {
        STREAM_TAIL
    } else {
        WHOLE_TAIL
    });
    let mut ttfb = None;
    let mut bytes = 0;
    // Reused for every write: once the client's write is done with a batch, its room is
    // taken back (see `batch`).
    let mut out = BytesMut::new();
    let end = loop {
        match race(session, idle, upstream.read_body_ref()).await {
            Wait::Done(Ok(Some(chunk))) => {
                if ttfb.is_none() {
                    let t = started.elapsed();
                    first_byte(t);
                    ttfb = Some(t);
                }
                out.extend_from_slice(chunk);
                let next = batch::read_ready(upstream, &mut out);
                let chunks = out.split().freeze();
                tail.push(&chunks);
                bytes += chunks.len();
                if let batch::Next::End = next {
                    // The reply's last bytes wait for the books: see `End::Complete`.
                    break End::Complete { last: Some(chunks) };
                }
                session.write_response_body(Some(chunks), false).await?;
                match next {
                    batch::Next::Wait | batch::Next::End => {}
                    batch::Next::Failed(e) => {
                        break End::Broken {
                            kind: "broken_stream",
                            reason: e.to_string(),
                        };
                    }
                }
            }
            Wait::Done(Ok(None)) => break End::Complete { last: None },
            Wait::Done(Err(e)) => {
                break End::Broken {
                    kind: "broken_stream",
                    reason: e.to_string(),
                };
            }
            Wait::TimedOut => {
                break End::Broken {
                    kind: "idle_timeout",
                    reason: "no data within the idle timeout".to_string(),
                };
            }
            Wait::ClientGone => break End::ClientGone,
        }
    };
    Ok(Streamed {
        end,
        ttfb,
        bytes,
        tail,
    })
}

/// Writes a complete reply's last bytes and ends the client's body. Called after the
/// request's books are settled, so that a client sending its next turn the moment this one
/// ends finds the node's slot free, not its own previous request still counted there.
pub(super) async fn end_reply(session: &mut Session, last: Option<Bytes>) -> Result<()> {
    if let Some(last) = last {
        session.write_response_body(Some(last), false).await?;
    }
    session.write_response_body(None, true).await
}

/// Ends a reply the node broke off: with an error in the stream's own format where it has
/// one, else by failing, so that the client sees the connection drop rather than a short
/// body.
pub(super) async fn end_broken(
    session: &mut Session,
    framing: ReplyKind,
    node: &str,
    reason: &str,
    shape: ErrorShape,
) -> Result<()> {
    let Some(notice) = framing.error_notice(node, reason, shape) else {
        return Err(Error::explain(
            ErrorType::ReadError,
            "node broke off the reply",
        ));
    };
    session.write_response_body(Some(notice), false).await?;
    session.write_response_body(None, true).await
}

/// How a reply is framed, which decides how a reply cut short is ended for the client.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ReplyKind {
    NdJson,
    Sse,
    Other,
}

impl ReplyKind {
    pub fn of(header: &ResponseHeader) -> ReplyKind {
        let ct = header
            .headers
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        let chunked = header.headers.get(http::header::CONTENT_LENGTH).is_none();
        if !chunked {
            ReplyKind::Other
        } else if ct.starts_with("application/x-ndjson") {
            ReplyKind::NdJson
        } else if ct.starts_with("text/event-stream") {
            ReplyKind::Sse
        } else {
            ReplyKind::Other
        }
    }

    /// The last words of a stream the node broke off, in the stream's own format, so that
    /// clients see an error rather than a reply that merely stopped.
    /// `shape` picks the SSE error event of the endpoint's API: Anthropic's
    /// `{"type":"error","error":{...}}`, the Responses API's `{"type":"error","message"...}`,
    /// else OpenAI's chat shape.
    fn error_notice(self, node: &str, reason: &str, shape: ErrorShape) -> Option<Bytes> {
        let message = format!("node {node} failed mid-reply: {reason}");
        match self {
            ReplyKind::NdJson => {
                let line = serde_json::json!({ "error": message }).to_string() + "\n";
                Some(Bytes::from(line))
            }
            ReplyKind::Sse => {
                let data = match shape {
                    ErrorShape::Anthropic => serde_json::json!({
                        "type": "error",
                        "error": { "type": "api_error", "message": message },
                    }),
                    _ => serde_json::json!({
                        "type": "error",
                        "code": "upstream_error",
                        "message": message,
                        "param": null,
                        "sequence_number": 0,
                        "error": { "message": message, "type": "upstream_error" },
                    }),
                };
                Some(Bytes::from(format!("event: error\ndata: {data}\n\n")))
            }
            ReplyKind::Other => None,
        }
    }
}

async fn write_request(
    upstream: &mut HttpSession,
    request: RequestHeader,
    body: &[u8],
) -> Result<()> {
    upstream.write_request_header(Box::new(request)).await?;
    if !body.is_empty() {
        upstream.write_body(body).await?;
    }
    upstream.finish_body().await?;
    Ok(())
}

/// The node's peer at its last resolved address; `None` while its name never resolved.
pub(super) fn peer(node: &Node, timeouts: &Timeouts) -> Option<HttpPeer> {
    let mut peer = node.peer(timeouts.connect)?;
    peer.options.write_timeout = Some(timeouts.idle);
    peer.options.idle_timeout = Some(POOL_IDLE);
    Some(peer)
}

/// The client's request as the node should see it.
pub(super) fn upstream_request(
    client: &RequestHeader,
    node: &Node,
    body_len: usize,
    strip_auth: bool,
) -> Result<RequestHeader> {
    headers::upstream_request(client, node.host_value(), body_len, strip_auth)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(content_type: &str, length: Option<usize>) -> ResponseHeader {
        let mut header = ResponseHeader::build(200, None).unwrap();
        header.insert_header("Content-Type", content_type).unwrap();
        if let Some(length) = length {
            header
                .insert_header("Content-Length", length.to_string())
                .unwrap();
        }
        header
    }

    #[test]
    fn a_reply_is_framed_by_its_type_only_without_a_declared_length() {
        let ndjson = reply("application/x-ndjson", None);
        let sse = reply("text/event-stream; charset=utf-8", None);
        let sized = reply("application/x-ndjson", Some(10));
        let json = reply("application/json", None);
        assert_eq!(ReplyKind::of(&ndjson), ReplyKind::NdJson);
        assert_eq!(ReplyKind::of(&sse), ReplyKind::Sse);
        assert_eq!(ReplyKind::of(&sized), ReplyKind::Other);
        assert_eq!(ReplyKind::of(&json), ReplyKind::Other);
    }

    fn notice(kind: ReplyKind, shape: ErrorShape) -> Option<String> {
        let bytes = kind.error_notice("gpu", "reset", shape)?;
        Some(String::from_utf8(bytes.to_vec()).unwrap())
    }

    #[test]
    fn an_ndjson_stream_ends_with_an_error_line() {
        let line = notice(ReplyKind::NdJson, ErrorShape::Ollama).unwrap();
        assert!(line.ends_with('\n'));
        let value: serde_json::Value = serde_json::from_str(line.trim_end()).unwrap();
        assert_eq!(value["error"], "node gpu failed mid-reply: reset");
    }

    #[test]
    fn an_sse_stream_ends_with_an_error_event_in_its_api_shape() {
        let event = |shape| {
            let text = notice(ReplyKind::Sse, shape).unwrap();
            let data = text
                .strip_prefix("event: error\ndata: ")
                .and_then(|rest| rest.strip_suffix("\n\n"))
                .unwrap()
                .to_string();
            serde_json::from_str::<serde_json::Value>(&data).unwrap()
        };
        let anthropic = event(ErrorShape::Anthropic);
        assert_eq!(anthropic["type"], "error");
        assert_eq!(anthropic["error"]["type"], "api_error");
        let openai = event(ErrorShape::OpenAi);
        assert_eq!(openai["error"]["type"], "upstream_error");
        assert_eq!(openai["message"], "node gpu failed mid-reply: reset");
    }

    #[test]
    fn a_reply_with_a_declared_length_has_no_notice() {
        assert_eq!(notice(ReplyKind::Other, ErrorShape::Ollama), None);
    }
}
