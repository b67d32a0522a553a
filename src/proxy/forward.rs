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
use super::headers;
use super::reply::{Reading, ReplyStats, Tail};
use crate::config::{Config, Timeouts};
use crate::fleet::{Evidence, Fleet, Node, Rules};
use crate::metrics::{Metrics, model_label};
use crate::request::{ErrorShape, Profile};
use crate::routing::{
    Candidate, Decision, Dispatch, Observation, Outcome, RouteError, Router, WaitTicket,
};

/// How long an idle pooled connection to a node is kept.
const POOL_IDLE: Duration = Duration::from_secs(60);
/// Bytes of the reply kept to read its final chunk; a non-streamed reply is one object.
const STREAM_TAIL: usize = 64 * 1024;
const WHOLE_TAIL: usize = 1024 * 1024;

pub struct Forwarder {
    transport: TransportConnector,
    metrics: Arc<Metrics>,
}

/// Why an attempt on one node failed before any byte of its reply reached the client, so
/// the next node may be tried.
struct AttemptError {
    error: Box<Error>,
    timed_out: bool,
}

impl AttemptError {
    /// The node did not take the request at all (refused, unreachable): it has not seen it,
    /// and it may come back.
    fn unreachable(&self) -> bool {
        self.kind() == "connect" && !self.timed_out
    }

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

pub(super) enum Wait<T> {
    Done(T),
    TimedOut,
    ClientGone,
}

impl Forwarder {
    pub fn new(metrics: Arc<Metrics>) -> Forwarder {
        Forwarder {
            transport: TransportConnector::new(None),
            metrics,
        }
    }

    /// Books an attempt that failed before any reply, and keeps it as the last error.
    fn failed(
        &self,
        router: &Router,
        config: &Config,
        mut dispatch: Dispatch,
        error: AttemptError,
    ) -> AttemptError {
        router.abandon(&mut dispatch);
        let node = dispatch.node.clone();
        log::warn!("{}: {}", node.name(), error.error);
        // Refused, or closed before a reply on a fresh connection: the node is down or
        // restarting. Cut it off now, before this request's slot is handed to a waiter.
        if matches!(error.kind(), "connect" | "reset") {
            router
                .fleet
                .learn(&node, Evidence::Refused, &Rules::of(config));
        }
        dispatch.finish(Outcome::default());
        let name = node.name();
        self.metrics.retries.with_label_values(&[name]).inc();
        self.metrics
            .upstream_errors
            .with_label_values(&[name, error.kind()])
            .inc();
        error
    }

    /// Finds a node with a free slot for the request, sends it, and streams the reply.
    /// When every candidate is busy the request waits in corral (bounded in count and
    /// time) and is scored again on every change that could move it: a slot freed or a
    /// load for its model, a node admitted or cut off, a reload. A node that fails before
    /// replying is left out and the request is scored again without it, at most
    /// `limits.max_retries` times; when every node refused the connection (none has seen
    /// the request), the request waits for one to come back, up to `queue.max_wait`.
    pub async fn forward(
        &self,
        router: &Arc<Router>,
        session: &mut Session,
        ctx: &mut RequestCtx,
        body: &Bytes,
        profile: &Profile,
        config: &Config,
    ) -> Result<()> {
        let deadline = Instant::now() + config.queue.max_wait;
        // Nodes tried since the request last waited, and how each failed.
        let mut failures: Vec<Failure> = Vec::new();
        // Failed attempts in all, for `X-Fleet-Retries`.
        let mut retries = 0;
        let mut waiting: Option<WaitTicket> = None;
        let listener = router.listen(&profile.model_key);
        loop {
            // The request's own wait must not weigh on its new ranking.
            drop(waiting.take());
            // Listen before looking, so that news meanwhile is not missed.
            let news = listener.news(&router.fleet.wakeups);
            let tried: Vec<u16> = failures.iter().map(|f| f.node).collect();
            let exhausted = failures.len() > config.limits.max_retries;
            // Decide and count the request on its node (reserving any load it starts) as
            // one step, so that requests arriving together see each other's loads.
            let placing = router.placement();
            let decided = router.decide_with(profile, config);
            let picked = decided.as_ref().map(|decision| {
                let choice = if exhausted {
                    Pick::Exhausted
                } else {
                    pick(router, decision, &tried, profile)
                };
                (decision, choice)
            });
            drop(placing);
            let (decision, picked) = match picked {
                Ok(picked) => picked,
                Err(_) if !failures.is_empty() => return fail(session, ctx, &failures).await,
                Err(e) => return refuse(session, ctx, e.clone(), config).await,
            };
            let (candidate, dispatch) = match picked {
                Pick::Send(candidate, dispatch) => (candidate, dispatch),
                Pick::Exhausted if failures.iter().all(|f| f.error.unreachable()) => {
                    // Nothing listens anywhere: the fleet is restarting, or starting with
                    // corral. Wait for a node to come back rather than refuse, counted as
                    // waiting (for the best-ranked node) like any other wait.
                    let max = config.queue.max_waiting;
                    let best = decision.ranked.first().map(|c| &c.node);
                    waiting = best.and_then(|n| router.wait_ticket(n, &profile.model_key, max));
                    if waiting.is_none() {
                        let message = "too many requests are waiting for a node";
                        return busy(session, ctx, message, config).await;
                    }
                    let left = deadline.saturating_duration_since(Instant::now());
                    match race(session, left, news).await {
                        Wait::Done(()) => {
                            failures.clear();
                            continue;
                        }
                        Wait::TimedOut => {
                            let message =
                                "every node refused the connection, and none came back in time";
                            return busy(session, ctx, message, config).await;
                        }
                        Wait::ClientGone => {
                            ctx.client_gone = true;
                            return Ok(());
                        }
                    }
                }
                Pick::Exhausted => return fail(session, ctx, &failures).await,
                Pick::Wait(best) => {
                    let max = config.queue.max_waiting;
                    waiting = router.wait_ticket(&best.node, &profile.model_key, max);
                    if waiting.is_none() {
                        let message = "too many requests are waiting for a node";
                        return busy(session, ctx, message, config).await;
                    }
                    let left = deadline.saturating_duration_since(Instant::now());
                    match race(session, left, news).await {
                        Wait::Done(()) => continue,
                        Wait::TimedOut => {
                            let message = "no node had a free slot in time";
                            return busy(session, ctx, message, config).await;
                        }
                        Wait::ClientGone => {
                            ctx.client_gone = true;
                            return Ok(());
                        }
                    }
                }
            };
            let attempt = Attempt {
                router,
                config,
                candidate,
                decision,
                profile,
                retries,
            };
            match self.attempt(session, ctx, body, attempt, dispatch).await {
                Ok(result) => return result,
                Err(error) => {
                    retries += 1;
                    failures.push(Failure {
                        node: candidate.node.id,
                        name: candidate.node.name().to_string(),
                        error,
                    });
                }
            }
        }
    }

    /// Sends a management call to the node the client named: no scoring, no retries.
    pub async fn forward_to(
        &self,
        router: &Arc<Router>,
        session: &mut Session,
        ctx: &mut RequestCtx,
        body: &Bytes,
        node: Arc<Node>,
        config: &Config,
    ) -> Result<()> {
        let profile = Profile::management();
        let decision = Decision::direct(node);
        let candidate = &decision.ranked[0];
        let Some(dispatch) = router.try_dispatch(&candidate.node, &profile) else {
            return busy(
                session,
                ctx,
                "the node is busy with other management calls",
                config,
            )
            .await;
        };
        let attempt = Attempt {
            router,
            config,
            candidate,
            decision: &decision,
            profile: &profile,
            retries: 0,
        };
        match self.attempt(session, ctx, body, attempt, dispatch).await {
            Ok(result) => result,
            Err(error) => {
                let failure = Failure {
                    node: candidate.node.id,
                    name: candidate.node.name().to_string(),
                    error,
                };
                fail(session, ctx, &[failure]).await
            }
        }
    }

    /// One try on one node. `Err` when it failed before any reply reached the client, so
    /// another node may be tried; `Ok` with the request's final result otherwise.
    async fn attempt(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        body: &Bytes,
        attempt: Attempt<'_>,
        mut dispatch: Dispatch,
    ) -> std::result::Result<Result<()>, AttemptError> {
        let timeouts = &attempt.config.timeouts;
        let node = &attempt.candidate.node;
        ctx.retries = attempt.retries;
        let Some(peer) = peer(node, timeouts) else {
            let error = AttemptError {
                error: Error::explain(ErrorType::ConnectError, "its host name does not resolve"),
                timed_out: false,
            };
            return Err(self.failed(attempt.router, attempt.config, dispatch, error));
        };
        // A client key is corral's credential, not the node's (`Authorization`, or
        // Anthropic's `x-api-key`).
        let strip_auth = !attempt.config.api_keys.is_empty();
        let request = match upstream_request(session.req_header(), node, body.len(), strip_auth) {
            Ok(request) => request,
            Err(e) => return Ok(Err(e)),
        };
        let started = Instant::now();
        attempt
            .router
            .commit(&mut dispatch, attempt.profile, attempt.decision);
        let header = self
            .exchange(session, &peer, &request, body, timeouts.first_byte)
            .await;
        let error = match header {
            Wait::Done(Ok(upstream)) => {
                let reply = Relay {
                    fleet: &attempt.router.fleet,
                    candidate: attempt.candidate,
                    decision: attempt.decision,
                    profile: attempt.profile,
                    started,
                    retries: attempt.retries,
                    idle: timeouts.idle,
                    rules: Rules::of(attempt.config),
                };
                let result = self
                    .relay(session, ctx, upstream, &peer, dispatch, reply)
                    .await;
                return Ok(result);
            }
            Wait::Done(Err(error)) => AttemptError {
                error,
                timed_out: false,
            },
            Wait::TimedOut => AttemptError {
                error: Error::explain(
                    ErrorType::ReadTimedout,
                    "no reply within the first_byte timeout",
                ),
                timed_out: true,
            },
            Wait::ClientGone => {
                // Dropping the upstream session closes its connection, which makes
                // Ollama cancel the generation.
                ctx.client_gone = true;
                return Ok(Ok(()));
            }
        };
        Err(self.failed(attempt.router, attempt.config, dispatch, error))
    }

    /// Counts the routing decision once a node has answered.
    fn book_decision(&self, ctx: &mut RequestCtx, reply: &Relay, labels: &[&str; 2]) {
        let candidate = reply.candidate;
        ctx.node = Some(candidate.node.name().to_string());
        if reply.decision.direct {
            // Nothing was chosen: no score, affinity or load to count.
            return;
        }
        let affinity = reply.decision.affinity_for(candidate.node.id).as_str();
        let score = candidate.scores.total();
        self.metrics.affinity.with_label_values(&[affinity]).inc();
        self.metrics.winning_score.observe(score);
        if !candidate.resident {
            self.metrics.cold_loads.with_label_values(labels).inc();
        }
        ctx.score = Some(score);
        ctx.affinity = Some(affinity);
        ctx.cold_load = !candidate.resident;
    }

    /// Counts what the reply's final statistics verify: loads, prompt tokens evaluated or
    /// served from cache (as measured for the node's kind), and whether corral's
    /// prediction of the cache held.
    fn book_stats(
        &self,
        stats: &ReplyStats,
        observation: Option<&Observation>,
        profile: &Profile,
        labels: &[&str; 2],
    ) {
        if stats.loaded_model() {
            self.metrics.model_loads.with_label_values(labels).inc();
        }
        let (node, model) = (labels[0], labels[1]);
        let tokens = |kind: &str, n: u64| {
            self.metrics
                .prompt_tokens
                .with_label_values(&[node, model, kind])
                .inc_by(n)
        };
        let measured = match observation {
            Some(o) => {
                self.metrics
                    .cache_predictions
                    .with_label_values(&[node, o.predicted.as_str(), o.observed.as_str()])
                    .inc();
                Some((o.measured.evaluated(), o.measured.cached))
            }
            // Not a generation (an embedding): whatever was counted was evaluated.
            None => match stats.reading() {
                Some(Reading::Exact {
                    evaluated, cached, ..
                }) => Some((Some(evaluated), Some(cached))),
                Some(Reading::OllamaCount { count, .. }) => Some((Some(count), None)),
                _ => None,
            },
        };
        if let Some((evaluated, cached)) = measured {
            if let Some(evaluated) = evaluated {
                tokens("evaluated", evaluated);
                self.metrics
                    .prompt_tokens_estimated
                    .with_label_values(labels)
                    .inc_by(u64::from(profile.prompt_tokens));
            }
            if let Some(cached) = cached {
                tokens("cached", cached);
            }
        }
    }

    /// Sends one request to a node and reads its whole reply, for requests corral answers
    /// from several replies (embedding fan-out). Not raced against the client: the
    /// timeouts bound it. Replies past `max_reply` bytes fail.
    pub(super) async fn fetch(
        &self,
        peer: &HttpPeer,
        request: &RequestHeader,
        body: &[u8],
        timeouts: &Timeouts,
        max_reply: usize,
    ) -> Result<(u16, Bytes)> {
        let (stream, _reused) = self.transport.get_stream(peer).await?;
        let mut upstream = HttpSession::new_with_options(stream, peer);
        write_request(&mut upstream, request, body).await?;
        let timed_out =
            |what: &str| Error::explain(ErrorType::ReadTimedout, format!("no {what} in time"));
        tokio::time::timeout(timeouts.first_byte, upstream.read_resp_header_parts())
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
        if upstream.is_body_done() {
            upstream.respect_keepalive();
            if let Some(stream) = upstream.reuse().await {
                self.transport
                    .release_stream(stream, peer.reuse_hash(), Some(POOL_IDLE));
            }
        }
        Ok((status, reply.into()))
    }

    /// Counts a reply's tokens under its client's key name.
    pub fn book_usage(&self, client: &str, model: &str, usage: super::usage::TokenUsage) {
        let client = if client.is_empty() {
            crate::config::ANONYMOUS
        } else {
            client
        };
        let count = |kind: &str, n: u64| {
            self.metrics
                .client_tokens
                .with_label_values(&[client, model, kind])
                .inc_by(n)
        };
        count("prompt", usage.prompt);
        count("completion", usage.completion);
        if let Some(cached) = usage.cached {
            count("cached", cached);
        }
    }

    /// Sends the request and reads the reply's header. A pooled connection that the node
    /// closed meanwhile fails on the write or on the first read: that gets one more try on
    /// a fresh connection to the same node, and does not count against the node.
    async fn exchange(
        &self,
        session: &mut Session,
        peer: &HttpPeer,
        request: &RequestHeader,
        body: &[u8],
        first_byte: Duration,
    ) -> Wait<Result<HttpSession>> {
        let mut fresh = false;
        loop {
            let (stream, reused) = if fresh {
                (self.transport.new_stream(peer).await, false)
            } else {
                match self.transport.get_stream(peer).await {
                    Ok((stream, reused)) => (Ok(stream), reused),
                    Err(e) => (Err(e), false),
                }
            };
            let stream = match stream {
                Ok(stream) => stream,
                Err(e) => return Wait::Done(Err(e)),
            };
            let mut upstream = HttpSession::new_with_options(stream, peer);
            if let Err(e) = write_request(&mut upstream, request, body).await {
                if reused {
                    fresh = true;
                    continue;
                }
                return Wait::Done(Err(e));
            }
            match race(session, first_byte, upstream.read_resp_header_parts()).await {
                Wait::Done(Ok(_)) => return Wait::Done(Ok(upstream)),
                Wait::Done(Err(_)) if reused => fresh = true,
                Wait::Done(Err(e)) => return Wait::Done(Err(e)),
                Wait::TimedOut => return Wait::TimedOut,
                Wait::ClientGone => return Wait::ClientGone,
            }
        }
    }

    /// Streams the reply to the client as it arrives and learns from its final chunk.
    async fn relay(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        mut upstream: HttpSession,
        peer: &HttpPeer,
        mut dispatch: Dispatch,
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
        ctx.model_label = Some(model.clone());
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
            match race(session, reply.idle, upstream.read_body_bytes()).await {
                Wait::Done(Ok(Some(chunk))) => {
                    if ttfb.is_none() {
                        dispatch.first_byte();
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
            if *kind == "broken_stream" {
                // The connection dropped mid-reply: most likely the node went down. Cut it
                // off before the slots it frees draw waiting requests to it.
                reply.fleet.learn(node, Evidence::Refused, &reply.rules);
            }
            dispatch.finish(Outcome::default());
            ctx.broken = true;
            let shape = reply.profile.endpoint.error_shape();
            let Some(notice) = framing.error_notice(node.name(), reason, shape) else {
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
        let observation = match &stats {
            Some(stats) if ok => dispatch.observe(stats),
            _ => None,
        };
        if let Some(stats) = &stats {
            self.book_stats(stats, observation.as_ref(), reply.profile, &labels);
            if stats.loaded_model() {
                // The load may have evicted another model: read what the node holds now
                // rather than count this one on top of the others.
                reply.fleet.poll_soon(node);
            }
        }
        if let Some(o) = &observation {
            ctx.prompt_tokens = Some(o.measured.total);
            ctx.cached_tokens = o.measured.cached;
            ctx.cache = Some(o.observed.as_str());
        }
        if ok
            && status < 400
            && let Some(usage) = super::usage::find(tail.bytes())
        {
            self.book_usage(&ctx.client, &model, usage);
        }
        dispatch.finish(Outcome {
            ok,
            ttfb,
            prefill_tps: dispatch.prefill_tps(),
            decode_tps: stats.as_ref().and_then(ReplyStats::decode_tps),
        });
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

/// What to do with a request after ranking.
enum Pick<'d> {
    /// Send it to this candidate, counted against it.
    Send(&'d Candidate, Dispatch),
    /// The best candidate runs as many requests as it has slots: wait for it, or for the
    /// ranking to change.
    Wait(&'d Candidate),
    /// Every candidate has been tried.
    Exhausted,
}

/// Follows the ranking: the best candidate not tried yet. Standby nodes (failing checks,
/// breaker open) are a last resort, taken only when no live node is left untried.
fn pick<'d>(
    router: &Arc<Router>,
    decision: &'d Decision,
    tried: &[u16],
    profile: &Profile,
) -> Pick<'d> {
    let mut untried = decision
        .ranked
        .iter()
        .filter(|c| !tried.contains(&c.node.id));
    let best = match untried.clone().find(|c| !c.standby) {
        Some(live) => live,
        None => match untried.next() {
            Some(standby) => standby,
            None => return Pick::Exhausted,
        },
    };
    // Rather than wait for the best node, probe whether it runs more requests at once.
    match router
        .try_send(best, profile)
        .or_else(|| router.try_probe(best, profile))
    {
        Some(dispatch) => Pick::Send(best, dispatch),
        None => Pick::Wait(best),
    }
}

/// A node that failed before replying, and how.
struct Failure {
    node: u16,
    name: String,
    error: AttemptError,
}

/// What one try on one node needs to know.
struct Attempt<'a> {
    router: &'a Arc<Router>,
    /// The configuration the request was decided under, for all of its attempts.
    config: &'a Config,
    candidate: &'a Candidate,
    decision: &'a Decision,
    profile: &'a Profile,
    retries: usize,
}

/// The node's peer at its last resolved address; `None` while its name never resolved.
pub(super) fn peer(node: &Node, timeouts: &Timeouts) -> Option<HttpPeer> {
    let mut peer = node.peer(timeouts.connect)?;
    peer.options.write_timeout = Some(timeouts.idle);
    peer.options.idle_timeout = Some(POOL_IDLE);
    Some(peer)
}

/// Every node tried failed before replying.
async fn fail(session: &mut Session, ctx: &mut RequestCtx, failures: &[Failure]) -> Result<()> {
    let timed_out = failures.last().is_some_and(|f| f.error.timed_out);
    let status = if timed_out { 504 } else { 502 };
    ctx.status = status;
    let tries: Vec<String> = failures
        .iter()
        .map(|f| {
            format!(
                "{} ({}: {})",
                f.name,
                f.error.kind(),
                f.error.error.etype().as_str()
            )
        })
        .collect();
    let message = format!(
        "no node could serve the request; tried {}",
        tries.join(", ")
    );
    let retries = [(
        "X-Fleet-Retries",
        failures.len().saturating_sub(1).to_string(),
    )];
    super::respond::error(session, status, &message, &retries).await
}

/// No node can take the request now: 503, with a hint when to try again.
async fn busy(
    session: &mut Session,
    ctx: &mut RequestCtx,
    message: &str,
    config: &Config,
) -> Result<()> {
    ctx.status = 503;
    let retry_after = [("Retry-After", retry_after(config).to_string())];
    super::respond::error(session, 503, message, &retry_after).await
}

fn retry_after(config: &Config) -> u64 {
    config.health.interval.as_secs().max(1)
}

/// The router found no node for the request.
async fn refuse(
    session: &mut Session,
    ctx: &mut RequestCtx,
    e: RouteError,
    config: &Config,
) -> Result<()> {
    match e.status() {
        503 => busy(session, ctx, &e.to_string(), config).await,
        status => {
            ctx.status = status;
            super::respond::error(session, status, &e.to_string(), &[]).await
        }
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
    /// Longest silence allowed between two chunks.
    idle: Duration,
    /// For what a reply broken off teaches about the node.
    rules: Rules,
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

/// The client's request as the node should see it.
pub(super) fn upstream_request(
    client: &RequestHeader,
    node: &Node,
    body_len: usize,
    strip_auth: bool,
) -> Result<RequestHeader> {
    headers::upstream_request(client, &node.host_header(), body_len, strip_auth)
}

/// The node's reply header as the client should see it, with the routing headers added.
fn downstream_header(
    upstream: &ResponseHeader,
    session: &Session,
    reply: &Relay,
) -> Result<ResponseHeader> {
    let client_is_http11 = session.req_header().version >= http::Version::HTTP_11;
    let mut header = headers::downstream_reply(upstream, client_is_http11)?;
    let node = &reply.candidate.node;
    header.insert_header("X-Fleet-Node", node.name())?;
    if reply.decision.direct {
        return Ok(header);
    }
    header.insert_header(
        "X-Fleet-Score",
        format!("{:.1}", reply.candidate.scores.total()),
    )?;
    header.insert_header(
        "X-Fleet-Affinity",
        reply.decision.affinity_for(node.id).as_str(),
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
