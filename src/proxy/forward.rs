//! Sending the request to the chosen node and streaming its reply back, chunk by chunk.
//!
//! corral forwards with Pingora's transport connector and HTTP/1 client session rather than
//! Pingora's proxy loop, because the body was consumed to choose the node and Pingora 0.9.1
//! replays at most 64 KiB of a consumed body. Holding the bytes here also makes a retry on
//! another node send the same body again.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use pingora_core::connectors::TransportConnector;
use pingora_core::protocols::http::v1::client::HttpSession;
use pingora_core::upstreams::peer::{HttpPeer, Peer};
use pingora_core::{Error, ErrorType, Result};
use pingora_http::{RequestHeader, ResponseHeader};
use pingora_proxy::Session;

use super::RequestCtx;
use super::reply::{ReplyStats, Tail};
use crate::config::Timeouts;
use crate::fleet::{Fleet, Node};
use crate::metrics::{Metrics, model_label};
use crate::request::Profile;
use crate::routing::{Candidate, Decision, Dispatch, Outcome, Router};

/// Headers that describe one connection, not the message, and are never forwarded; and the
/// router's own headers, which a client must not be able to forge.
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "expect",
    "content-length",
];

/// How long an idle pooled connection to a node is kept.
const POOL_IDLE: Duration = Duration::from_secs(60);
/// Bytes of the reply kept to read its final chunk; a non-streamed reply is one object.
const STREAM_TAIL: usize = 64 * 1024;
const WHOLE_TAIL: usize = 1024 * 1024;

pub struct Forwarder {
    transport: TransportConnector,
    timeouts: Timeouts,
    max_retries: usize,
    metrics: Arc<Metrics>,
}

/// Why an attempt on one node failed before any byte of its reply reached the client, so
/// the next node may be tried.
struct AttemptError {
    error: Box<Error>,
    timed_out: bool,
}

impl AttemptError {
    /// The `kind` label of `corral_upstream_errors_total`.
    fn kind(&self) -> &'static str {
        use ErrorType::*;
        match self.error.etype() {
            _ if self.timed_out => "first_byte_timeout",
            ConnectTimedout | ConnectRefused | ConnectNoRoute | ConnectError
            | ConnectProxyFailure | BindError | TLSHandshakeFailure | TLSHandshakeTimedout => {
                "connect"
            }
            _ => "reset",
        }
    }
}

enum Wait<T> {
    Done(T),
    TimedOut,
    ClientGone,
}

impl Forwarder {
    pub fn new(timeouts: Timeouts, max_retries: usize, metrics: Arc<Metrics>) -> Forwarder {
        Forwarder {
            transport: TransportConnector::new(None),
            timeouts,
            max_retries,
            metrics,
        }
    }

    /// Books an attempt that failed before any reply, and keeps it as the last error.
    fn failed(&self, node: &Node, dispatch: Dispatch, error: AttemptError) -> AttemptError {
        log::warn!("{}: {}", node.name(), error.error);
        dispatch.finish(Outcome::default());
        let name = node.name();
        self.metrics.retries.with_label_values(&[name]).inc();
        self.metrics
            .upstream_errors
            .with_label_values(&[name, error.kind()])
            .inc();
        error
    }

    fn peer(&self, node: &Node) -> HttpPeer {
        let a = &node.address;
        let mut peer = HttpPeer::new(a.addr, a.tls, a.host.clone());
        peer.options.connection_timeout = Some(self.timeouts.connect);
        peer.options.write_timeout = Some(self.timeouts.idle);
        peer.options.idle_timeout = Some(POOL_IDLE);
        peer
    }

    /// Tries the ranked candidates in order until one answers, then streams its reply.
    pub async fn forward(
        &self,
        router: &Router,
        session: &mut Session,
        ctx: &mut RequestCtx,
        body: &Bytes,
        profile: &Profile,
        decision: &Decision,
    ) -> Result<()> {
        let attempts = decision.ranked.len().min(1 + self.max_retries);
        let mut last: Option<AttemptError> = None;
        for (retries, candidate) in decision.ranked.iter().take(attempts).enumerate() {
            ctx.retries = retries;
            let mut dispatch = router.dispatch(&candidate.node, profile);
            let peer = self.peer(&candidate.node);
            let request = upstream_request(session.req_header(), &candidate.node, body.len())?;
            let started = Instant::now();
            let mut upstream = match self.send(&peer, &request, body).await {
                Ok(upstream) => upstream,
                Err(error) => {
                    let error = AttemptError {
                        error,
                        timed_out: false,
                    };
                    last = Some(self.failed(&candidate.node, dispatch, error));
                    continue;
                }
            };
            router.commit(&mut dispatch, profile, decision);
            let header = race(
                session,
                self.timeouts.first_byte,
                upstream.read_resp_header_parts(),
            )
            .await;
            match header {
                Wait::Done(Ok(_)) => {
                    let reply = Relay {
                        fleet: &router.fleet,
                        candidate,
                        decision,
                        profile,
                        started,
                        retries,
                    };
                    return self
                        .relay(session, ctx, upstream, &peer, dispatch, reply)
                        .await;
                }
                Wait::Done(Err(error)) => {
                    log::warn!("{}: no reply: {}", candidate.node.name(), error);
                    dispatch.finish(Outcome::default());
                    last = Some(AttemptError {
                        error,
                        timed_out: false,
                    });
                }
                Wait::TimedOut => {
                    log::warn!(
                        "{}: no reply within first_byte timeout",
                        candidate.node.name()
                    );
                    dispatch.finish(Outcome::default());
                    last = Some(AttemptError {
                        error: Error::explain(
                            ErrorType::ReadTimedout,
                            "waiting for the first byte",
                        ),
                        timed_out: true,
                    });
                }
                Wait::ClientGone => {
                    // Dropping the upstream session closes its connection, which makes
                    // Ollama cancel the generation.
                    ctx.client_gone = true;
                    return Ok(());
                }
            }
        }
        let (status, reason) = match &last {
            Some(e) if e.timed_out => (504, e.error.to_string()),
            Some(e) => (502, e.error.to_string()),
            None => (502, "no candidate".to_string()),
        };
        ctx.status = status;
        let message = format!(
            "no node could serve the request after {attempts} attempt(s); last error: {reason}"
        );
        super::respond::error(
            session,
            status,
            &message,
            &[("X-Fleet-Retries", attempts.saturating_sub(1).to_string())],
        )
        .await
    }

    /// Counts the routing decision once a node has answered.
    fn book_decision(&self, ctx: &mut RequestCtx, reply: &Relay, labels: &[&str; 2]) {
        let candidate = reply.candidate;
        let affinity = reply.decision.affinity_for(candidate.node.index).as_str();
        let score = candidate.scores.total();
        self.metrics.affinity.with_label_values(&[affinity]).inc();
        self.metrics.winning_score.observe(score);
        if !candidate.resident {
            self.metrics.cold_loads.with_label_values(labels).inc();
        }
        ctx.node = Some(candidate.node.name().to_string());
        ctx.score = Some(score);
        ctx.affinity = Some(affinity);
        ctx.cold_load = !candidate.resident;
    }

    /// Counts what the reply's final statistics verify: loads, and prompt tokens evaluated
    /// or served from cache.
    fn book_stats(&self, stats: &ReplyStats, profile: &Profile, labels: &[&str; 2]) {
        const LOAD_SECONDS: f64 = 0.1;
        if stats
            .load_duration
            .is_some_and(|ns| ns as f64 / 1e9 >= LOAD_SECONDS)
        {
            self.metrics.model_loads.with_label_values(labels).inc();
        }
        let (node, model) = (labels[0], labels[1]);
        let tokens = |kind: &str, n: u64| {
            self.metrics
                .prompt_tokens
                .with_label_values(&[node, model, kind])
                .inc_by(n)
        };
        if let Some((evaluated, cached)) = stats.prompt_tokens() {
            tokens("evaluated", evaluated);
            if let Some(cached) = cached {
                tokens("cached", cached);
            } else {
                self.metrics
                    .prompt_tokens_estimated
                    .with_label_values(labels)
                    .inc_by(u64::from(profile.prompt_tokens));
            }
        }
    }

    /// Connects and writes the request. A pooled connection the node has closed meanwhile
    /// gets one more try on a fresh connection to the same node.
    async fn send(
        &self,
        peer: &HttpPeer,
        request: &RequestHeader,
        body: &[u8],
    ) -> Result<HttpSession> {
        let (stream, reused) = self.transport.get_stream(peer).await?;
        let mut upstream = HttpSession::new_with_options(stream, peer);
        match write_request(&mut upstream, request, body).await {
            Ok(()) => Ok(upstream),
            Err(_) if reused => {
                let stream = self.transport.new_stream(peer).await?;
                let mut upstream = HttpSession::new_with_options(stream, peer);
                write_request(&mut upstream, request, body).await?;
                Ok(upstream)
            }
            Err(e) => Err(e),
        }
    }

    /// Streams the reply to the client as it arrives and learns from its final chunk.
    async fn relay(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        mut upstream: HttpSession,
        peer: &HttpPeer,
        dispatch: Dispatch,
        reply: Relay<'_>,
    ) -> Result<()> {
        let node = &reply.candidate.node;
        let upstream_header = upstream
            .resp_header()
            .ok_or_else(|| Error::explain(ErrorType::InternalError, "reply header missing"))?;
        let status = upstream_header.status.as_u16();
        let framing = ReplyKind::of(upstream_header);
        let header = downstream_header(upstream_header, session, &reply)?;
        let model = model_label(reply.fleet, &reply.profile.model_key).to_string();
        let labels = [node.name(), model.as_str()];
        self.book_decision(ctx, &reply, &labels);
        ctx.status = status;
        session
            .write_response_header(Box::new(header), false)
            .await?;

        let mut tail = Tail::new(if reply.profile.stream {
            STREAM_TAIL
        } else {
            WHOLE_TAIL
        });
        let mut ttfb = None;
        let broken = loop {
            match race(session, self.timeouts.idle, upstream.read_body_bytes()).await {
                Wait::Done(Ok(Some(chunk))) => {
                    if ttfb.is_none() {
                        let t = reply.started.elapsed();
                        self.metrics
                            .ttft
                            .with_label_values(&labels)
                            .observe(t.as_secs_f64());
                        ttfb = Some(t);
                    }
                    tail.push(&chunk);
                    ctx.bytes_out += chunk.len();
                    session.write_response_body(Some(chunk), false).await?;
                }
                Wait::Done(Ok(None)) => break None,
                Wait::Done(Err(e)) => break Some(("broken_stream", e.to_string())),
                Wait::TimedOut => {
                    break Some((
                        "idle_timeout",
                        "no data within the idle timeout".to_string(),
                    ));
                }
                Wait::ClientGone => {
                    ctx.client_gone = true;
                    return Ok(());
                }
            }
        };
        ctx.ttfb = ttfb;

        if let Some((kind, reason)) = &broken {
            log::warn!("{}: reply broke off: {reason}", node.name());
            self.metrics
                .upstream_errors
                .with_label_values(&[node.name(), kind])
                .inc();
            dispatch.finish(Outcome::default());
            ctx.broken = true;
            let Some(notice) = framing.error_notice(node.name(), reason) else {
                // A reply with a declared length cannot be ended cleanly: let the client
                // see the connection drop rather than a short body.
                return Err(Error::explain(
                    ErrorType::ReadError,
                    "node broke off the reply",
                ));
            };
            session.write_response_body(Some(notice), false).await?;
            return session.write_response_body(None, true).await;
        }
        session.write_response_body(None, true).await?;

        let stats = tail.last_object().and_then(ReplyStats::parse);
        let ok = status < 500;
        if !ok {
            self.metrics
                .upstream_errors
                .with_label_values(&[node.name(), "status_5xx"])
                .inc();
        }
        if let Some(stats) = &stats {
            self.book_stats(stats, reply.profile, &labels);
        }
        dispatch.finish(Outcome {
            ok,
            ttfb,
            prefill_tps: stats.as_ref().and_then(ReplyStats::prefill_tps),
            decode_tps: stats.as_ref().and_then(ReplyStats::decode_tps),
        });
        ctx.stats = stats;
        if upstream.is_body_done() {
            upstream.respect_keepalive();
            if let Some(stream) = upstream.reuse().await {
                self.transport
                    .release_stream(stream, peer.reuse_hash(), Some(POOL_IDLE));
            }
        }
        Ok(())
    }
}

/// The routing facts a reply's headers report.
struct Relay<'a> {
    fleet: &'a Fleet,
    candidate: &'a Candidate,
    decision: &'a Decision,
    profile: &'a Profile,
    started: Instant,
    retries: usize,
}

/// How a reply is framed, which decides how a reply cut short is ended for the client.
#[derive(Clone, Copy, PartialEq, Eq)]
enum ReplyKind {
    NdJson,
    Sse,
    Other,
}

impl ReplyKind {
    fn of(header: &ResponseHeader) -> ReplyKind {
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
    fn error_notice(self, node: &str, reason: &str) -> Option<Bytes> {
        let message = format!("node {node} failed mid-reply: {reason}");
        match self {
            ReplyKind::NdJson => {
                let line = serde_json::json!({ "error": message }).to_string() + "\n";
                Some(Bytes::from(line))
            }
            ReplyKind::Sse => {
                let data = serde_json::json!({ "error": { "message": message, "type": "upstream_error" } });
                Some(Bytes::from(format!("event: error\ndata: {data}\n\n")))
            }
            ReplyKind::Other => None,
        }
    }
}

/// Runs `work` unless the client goes away or `limit` passes first.
async fn race<T>(session: &mut Session, limit: Duration, work: impl Future<Output = T>) -> Wait<T> {
    let gone = session.as_downstream_mut().read_body_or_idle(true);
    tokio::select! {
        done = tokio::time::timeout(limit, work) => match done {
            Ok(value) => Wait::Done(value),
            Err(_) => Wait::TimedOut,
        },
        _ = gone => Wait::ClientGone,
    }
}

async fn write_request(
    upstream: &mut HttpSession,
    request: &RequestHeader,
    body: &[u8],
) -> Result<()> {
    upstream
        .write_request_header(Box::new(request.clone()))
        .await?;
    if !body.is_empty() {
        upstream.write_body(body).await?;
    }
    upstream.finish_body().await?;
    Ok(())
}

/// The client's request as the node should see it: same method, path and headers, minus
/// hop-by-hop and `X-Fleet-*` headers, with the node's host and the body's exact length.
fn upstream_request(client: &RequestHeader, node: &Node, body_len: usize) -> Result<RequestHeader> {
    let path = client
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_string();
    let mut req = RequestHeader::build(
        client.method.clone(),
        path.as_bytes(),
        Some(client.headers.len()),
    )?;
    for (name, value) in client.headers.iter() {
        let n = name.as_str();
        if HOP_BY_HOP.contains(&n) || n == "host" || n.starts_with("x-fleet-") {
            continue;
        }
        req.append_header(name.clone(), value.clone())?;
    }
    let port = node.address.addr.port();
    req.insert_header("Host", format!("{}:{port}", node.address.host))?;
    req.insert_header("Content-Length", body_len.to_string())?;
    Ok(req)
}

/// The node's reply header as the client should see it, with the routing headers added.
fn downstream_header(
    upstream: &ResponseHeader,
    session: &Session,
    reply: &Relay,
) -> Result<ResponseHeader> {
    let mut header = ResponseHeader::build(upstream.status, Some(upstream.headers.len() + 6))?;
    for (name, value) in upstream.headers.iter() {
        if HOP_BY_HOP.contains(&name.as_str()) {
            continue;
        }
        header.append_header(name.clone(), value.clone())?;
    }
    if let Some(length) = upstream.headers.get(http::header::CONTENT_LENGTH) {
        header.insert_header(http::header::CONTENT_LENGTH, length.clone())?;
    } else if session.req_header().version >= http::Version::HTTP_11 {
        header.insert_header(http::header::TRANSFER_ENCODING, "chunked")?;
    }
    let node = &reply.candidate.node;
    header.insert_header("X-Fleet-Node", node.name())?;
    header.insert_header(
        "X-Fleet-Score",
        format!("{:.1}", reply.candidate.scores.total()),
    )?;
    header.insert_header(
        "X-Fleet-Affinity",
        reply.decision.affinity_for(node.index).as_str(),
    )?;
    header.insert_header("X-Fleet-Retries", reply.retries.to_string())?;
    if wants_explain(session) {
        let rows = reply
            .decision
            .ranked
            .iter()
            .map(|c| (c.node.name(), &c.scores));
        header.insert_header("X-Fleet-Explain", crate::routing::score::explain(rows))?;
    }
    Ok(header)
}

fn wants_explain(session: &Session) -> bool {
    session
        .req_header()
        .headers
        .get("x-fleet-explain")
        .is_some_and(|v| matches!(v.as_bytes(), b"1" | b"true" | b"yes"))
}
