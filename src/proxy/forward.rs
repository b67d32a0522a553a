//! Forwarding policy: which node a request is sent to next, when it waits for a slot, when a
//! failed attempt moves on to another node, and when corral gives up and answers itself.
//! Choosing and ranking nodes is `routing`; sending and streaming back is `relay.rs`;
//! counting what a reply showed is `account.rs`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::HeaderValue;
use pingora_core::{Error, ErrorType, Result};
use pingora_proxy::Session;

use super::account::{Account, Answered};
use super::ctx::RequestCtx;
use super::relay::{self, End, Upstream, Wait, race};
use crate::config::Config;
use crate::fleet::{Evidence, Listener, Node, Rules};
use crate::metrics::{Metrics, model_label};
use crate::request::Profile;
use crate::routing::{
    Candidate, Decision, Dispatch, Lease, Outcome, Reserved, RouteError, Router, WaitTicket,
    yields_to_warm,
};

/// A request waiting for a node weighs its choice again at least this often, news or not:
/// what corral knows of the nodes (the slots they run, their speeds, the models on their
/// disks) changes with every reply and poll, and a queue joined when it looked short may
/// since be worth a load elsewhere.
const RELOOK: Duration = Duration::from_secs(1);
/// How soon a request the shared store turned away looks again, news or not.
const SHARED_RELOOK: Duration = Duration::from_millis(100);

pub struct Forwarder {
    upstream: Upstream,
    account: Account,
}

/// Takes a request off the waiters the replicas share when dropped.
struct Unwait<'r>(&'r Router, u64);

impl Drop for Unwait<'_> {
    fn drop(&mut self) {
        self.0.unwait(self.1);
    }
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

impl Forwarder {
    pub fn new(metrics: Arc<Metrics>) -> Forwarder {
        Forwarder {
            upstream: Upstream::new(),
            account: Account::new(metrics),
        }
    }

    /// Books an attempt that failed before any reply, and keeps it as the last error.
    fn failed(
        &self,
        router: &Router,
        config: &Config,
        dispatch: Dispatch,
        error: AttemptError,
    ) -> AttemptError {
        let node = dispatch.node.clone();
        log::warn!("{}: {}", node.name(), error.error);
        // Refused, or closed before a reply on a fresh connection: the node is down or
        // restarting. Cut it off now, before this request's slot is handed to a waiter.
        if matches!(error.kind(), "connect" | "reset") {
            router
                .fleet
                .learn(&node, Evidence::Refused, &Rules::of(config));
        }
        dispatch.fail();
        self.account.attempt_failed(node.name(), error.kind());
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
        // When the request began waiting in corral for the attempt it makes next.
        let mut waiting_since: Option<Instant> = None;
        // Decisions taken again at once because the shared store showed other replicas'
        // requests holding the chosen node's slots.
        let mut relooks = 0;
        let listener = router.listen(&profile.model_key, ctx.client.requester.clone());
        // Off the waiters the replicas share however this ends (`shared_state:`).
        let _unwait = Unwait(router, listener.id());
        loop {
            // Listen before looking, so that news meanwhile is not missed.
            let news = listener.news(&router.fleet.wakeups);
            // Decide, count the request on its node (reserving any load it starts) and
            // commit it to the node's slots as one step, under the placement lock, so that
            // requests arriving together see each other's loads and conversations.
            let (handoff, decided);
            let step = {
                let placing = router.placement();
                // The request's own wait must not weigh on its new ranking. Given up only
                // now, under the lock every decision takes: until this request has decided,
                // a request cold on its node still sees it waiting warm there.
                drop(waiting.take());
                // A slot handed to this request: it goes on to the next waiter unless this
                // request takes it.
                handoff = listener.take_handoff();
                let ahead = listener.waiting_ahead();
                decided = router.decide_waiting(profile, config, Some(&ahead));
                let waited = waiting_since.map_or(Duration::ZERO, |t| t.elapsed());
                match next(&decided, &failures, config.limits.max_retries) {
                    Next::Try(decision, candidate) => {
                        let reserved = reserve(
                            router, decision, candidate, profile, waited, &listener, config,
                        );
                        let placed = match reserved {
                            // Sent at once where no store is to be asked: committed now.
                            Some(reserved) if !router.leases(profile) => {
                                let dispatch = reserved.commit(profile, decision, &placing);
                                Placed::Sent(candidate, dispatch)
                            }
                            Some(reserved) => Placed::Leasing(candidate, reserved),
                            None => Placed::Waits(Some(candidate), Awaited::Slot),
                        };
                        Ok((decision, placed))
                    }
                    // Nothing listens anywhere: the fleet is restarting, or starting with
                    // corral. Wait for a node to come back rather than refuse, counted as
                    // waiting (for the best-ranked node) like any other wait.
                    Next::Revive(decision) => {
                        let best = decision.ranked.first();
                        Ok((decision, Placed::Waits(best, Awaited::NodeBack)))
                    }
                    Next::Fail => Err(None),
                    Next::Refuse(e) => Err(Some(e)),
                }
            };
            let (decision, placed) = match step {
                Ok(placed) => placed,
                Err(None) => return fail(session, ctx, &failures).await,
                Err(Some(e)) => return refuse(session, ctx, e.clone(), config).await,
            };
            let sent = match placed {
                Placed::Sent(candidate, dispatch) => Ok((candidate, dispatch)),
                Placed::Waits(best, awaited) => Err((best, awaited)),
                Placed::Leasing(candidate, mut reserved) => {
                    let requester = &ctx.client.requester;
                    let id = listener.id();
                    match router.share(&mut reserved, profile, requester, id).await {
                        Lease::Taken => {
                            let dispatch = reserved.commit(profile, decision, &router.placement());
                            Ok((candidate, dispatch))
                        }
                        // The store showed requests there that the decision did not count
                        // (other replicas' not heard of yet), counted now: decide again at
                        // once rather than wait for this node while another may have a slot
                        // free. At most once per candidate, so a view that lags cannot loop.
                        Lease::Full { news: true } if relooks < decision.ranked.len() => {
                            relooks += 1;
                            continue;
                        }
                        // Other replicas took its last slot first: wait as for a busy node,
                        // now counting their requests.
                        Lease::Full { .. } => Err((Some(candidate), Awaited::SharedSlot)),
                    }
                }
            };
            if let Some(h) = &handoff {
                let taken = matches!(&sent, Ok((c, _)) if h.is_on(c.node.id));
                self.account.handoff(taken);
            }
            let (best, awaited) = match sent {
                Ok((candidate, dispatch)) => {
                    listener.sent(candidate.node.id, handoff);
                    let attempt = Attempt {
                        router,
                        config,
                        candidate,
                        decision,
                        profile,
                        retries,
                        waited: waiting_since.take().map_or(Duration::ZERO, |t| t.elapsed()),
                    };
                    let result = self.attempt(session, ctx, body, attempt, dispatch).await;
                    listener.ended();
                    match result {
                        Ok(result) => return result,
                        Err(error) => {
                            retries += 1;
                            failures.push(Failure {
                                node: candidate.node.id,
                                name: candidate.node.name().to_string(),
                                error,
                            });
                            continue;
                        }
                    }
                }
                Err(wait) => wait,
            };
            if let (Some(h), Some(best)) = (&handoff, best) {
                log::debug!(
                    "{}: declines a slot on {}, waits for {}: {:?}",
                    ctx.client.label(),
                    h.node_name(),
                    best.node.name(),
                    crate::routing::score::explain(
                        decision.ranked.iter().map(|c| (c.node.name(), &c.scores))
                    )
                );
            }
            // Among the waiters the replicas share, for the node it waits for: only there is
            // it sure to take a slot (it may decline one elsewhere, and must not hold it back).
            let waits_on = match awaited {
                Awaited::Slot | Awaited::SharedSlot => best.map(|c| c.node.as_ref()),
                Awaited::NodeBack => None,
            };
            let requester = &ctx.client.requester;
            router.waits_for(listener.id(), requester, waits_on, &profile.model_key);
            let max = config.queue.max_waiting;
            waiting = best.and_then(|c| {
                let warm = decision.warm_on(c.node.id);
                listener.waits(c.node.id, warm, handoff);
                router.wait_ticket(&c.node, &profile.model_key, warm, max)
            });
            if waiting.is_none() {
                let message = "too many requests are waiting for a node";
                return busy(session, ctx, message, config).await;
            }
            waiting_since.get_or_insert_with(Instant::now);
            let left = deadline.saturating_duration_since(Instant::now());
            // A slot held elsewhere frees when that replica says its request ended; its
            // lease may also have been given back before this replica heard of it.
            let relook = match awaited {
                Awaited::SharedSlot => SHARED_RELOOK,
                _ => RELOOK,
            };
            let news_or_relook = tokio::time::timeout(relook, news);
            let gone = match race(session, left, news_or_relook).await {
                // News came: where every node refused, they may all be worth trying again.
                Wait::Done(Ok(())) if awaited == Awaited::NodeBack => {
                    failures.clear();
                    continue;
                }
                Wait::Done(_) => continue,
                Wait::TimedOut => None,
                Wait::ClientGone => Some(()),
            };
            // Leaving the queue: requests that left a slot to this one look again.
            if let Some(ticket) = waiting.take() {
                ticket.leave();
            }
            if gone.is_some() {
                ctx.client_gone = true;
                return Ok(());
            }
            return busy(session, ctx, awaited.gave_up(), config).await;
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
        let Some(reserved) = router.try_dispatch(&candidate.node, &profile) else {
            return busy(
                session,
                ctx,
                "the node is busy with other management calls",
                config,
            )
            .await;
        };
        let dispatch = reserved.commit(&profile, &decision, &router.placement());
        let attempt = Attempt {
            router,
            config,
            candidate,
            decision: &decision,
            profile: &profile,
            retries: 0,
            waited: Duration::ZERO,
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
        dispatch: Dispatch,
    ) -> std::result::Result<Result<()>, AttemptError> {
        let timeouts = &attempt.config.timeouts;
        let node = &attempt.candidate.node;
        ctx.retries = attempt.retries;
        let Some(peer) = relay::peer(node, timeouts) else {
            let error = AttemptError {
                error: Error::explain(ErrorType::ConnectError, "its host name does not resolve"),
                timed_out: false,
            };
            return Err(self.failed(attempt.router, attempt.config, dispatch, error));
        };
        // A client key is corral's credential, not the node's (`Authorization`, or
        // Anthropic's `x-api-key`).
        let strip_auth = !attempt.config.api_keys.is_empty();
        let rewrite = |client: &_| relay::upstream_request(client, node, body.len(), strip_auth);
        let request = match rewrite(session.req_header()) {
            Ok(request) => request,
            Err(e) => return Ok(Err(e)),
        };
        let started = Instant::now();
        let header = self
            .upstream
            .exchange(session, &peer, request, rewrite, body, timeouts.first_byte)
            .await;
        let error = match header {
            Wait::Done(Ok(upstream)) => {
                let result = self
                    .answer(session, ctx, upstream, &peer, dispatch, &attempt, started)
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

    /// Streams the node's reply back to the client and settles the request's books.
    #[allow(clippy::too_many_arguments)]
    async fn answer(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        mut upstream: pingora_core::protocols::http::v1::client::HttpSession,
        peer: &pingora_core::upstreams::peer::HttpPeer,
        mut dispatch: Dispatch,
        attempt: &Attempt<'_>,
        started: Instant,
    ) -> Result<()> {
        let (node, fleet) = (&attempt.candidate.node, &attempt.router.fleet);
        let upstream_header = upstream
            .resp_header()
            .ok_or_else(|| Error::explain(ErrorType::InternalError, "reply header missing"))?;
        let status = upstream_header.status.as_u16();
        let framing = relay::ReplyKind::of(upstream_header);
        let header = reply_header(upstream_header, session, attempt)?;
        let model = model_label(fleet, &attempt.profile.model_key).to_string();
        let labels = [node.name(), model.as_str()];
        self.account.decision(
            ctx,
            attempt.candidate,
            attempt.decision,
            attempt.waited,
            &labels,
        );
        ctx.model_label = Some(model.clone());
        ctx.status = status;
        session
            .write_response_header(Box::new(header), false)
            .await?;

        let ttft = self.account.metrics().ttft.with_label_values(&labels);
        let idle = attempt.config.timeouts.idle;
        let first_byte = |t: std::time::Duration| {
            ttft.observe(t.as_secs_f64());
            // The replies streaming beside it show how many requests the node runs at once.
            dispatch.first_byte();
        };
        let streamed = relay::stream_back(
            session,
            &mut upstream,
            attempt.profile.stream,
            idle,
            started,
            first_byte,
        )
        .await?;
        ctx.ttfb = streamed.ttfb;
        ctx.bytes_out += streamed.bytes;
        let last = match streamed.end {
            End::Complete { last } => last,
            End::ClientGone => {
                // Dropping the upstream session closes its connection, which makes
                // Ollama cancel the generation.
                ctx.client_gone = true;
                return Ok(());
            }
            End::Broken { kind, reason } => {
                log::warn!("{}: reply broke off: {reason}", node.name());
                self.account.upstream_error(node.name(), kind);
                if kind == "broken_stream" {
                    // The connection dropped mid-reply: most likely the node went down.
                    // Cut it off before the slots it frees draw waiting requests to it.
                    fleet.learn(node, Evidence::Refused, &Rules::of(attempt.config));
                }
                dispatch.finish(Outcome::default());
                ctx.broken = true;
                let shape = attempt.profile.endpoint.error_shape();
                return relay::end_broken(session, framing, node.name(), &reason, shape).await;
            }
        };
        // The connection goes back to the pool before the slot is freed, so that the
        // request handed the slot finds it there instead of opening another.
        self.upstream.release(upstream, peer).await;
        let answered = Answered {
            fleet,
            node,
            profile: attempt.profile,
            tail: &streamed.tail,
            labels,
        };
        self.account.settle(ctx, dispatch, answered);
        relay::end_reply(session, last).await?;
        Ok(())
    }

    /// Counts a reply's tokens under its client's key name.
    pub fn book_usage(&self, client: &str, model: &str, usage: super::usage::TokenUsage) {
        self.account.usage(client, model, usage);
    }

    /// Sends one request to a node and reads its whole reply (embedding fan-out).
    pub(super) fn upstream(&self) -> &Upstream {
        &self.upstream
    }
}

/// What the forward loop does next, from the last decision and the attempts so far.
enum Next<'d> {
    /// Try the best candidate not tried yet (the ranking puts standby nodes last): send the
    /// request there if it has a slot, else wait for it.
    Try(&'d Decision, &'d Candidate),
    /// Every node tried refused the connection (none has seen the request): wait for one
    /// to come back.
    Revive(&'d Decision),
    /// Every node tried failed otherwise, or the retries ran out: 502 or 504.
    Fail,
    /// No node can serve the request: the router's reason, with its status.
    Refuse(&'d RouteError),
}

/// The forward loop's next step: pure, so that each case is tested on its own.
fn next<'d>(
    decided: &'d Result<Decision, RouteError>,
    failures: &[Failure],
    max_retries: usize,
) -> Next<'d> {
    let decision = match decided {
        Ok(decision) => decision,
        Err(_) if !failures.is_empty() => return Next::Fail,
        Err(e) => return Next::Refuse(e),
    };
    let untried = (failures.len() <= max_retries)
        .then(|| decision.best_untried(|id| failures.iter().any(|f| f.node == id)))
        .flatten();
    match untried {
        Some(candidate) => Next::Try(decision, candidate),
        None if failures.iter().all(|f| f.error.unreachable()) => Next::Revive(decision),
        None => Next::Fail,
    }
}

/// How far placing a request got.
// Made and matched once per decision, on the stack: boxing the dispatch would cost an
// allocation per request to save a copy of a few hundred bytes.
#[allow(clippy::large_enum_variant)]
enum Placed<'d> {
    /// Counted on the candidate and committed to its slots: to be sent.
    Sent(&'d Candidate, Dispatch),
    /// Counted on the candidate; the store the replicas share is asked for a lease first.
    Leasing(&'d Candidate, Reserved),
    /// To wait: for the candidate, or for any node where none is given.
    Waits(Option<&'d Candidate>, Awaited),
}

/// What a waiting request waits for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Awaited {
    /// A free slot on its best node, or a change in the ranking.
    Slot,
    /// Any node, after every node it tried refused the connection.
    NodeBack,
    /// A slot on its best node, which the shared store showed held by other replicas.
    SharedSlot,
}

impl Awaited {
    /// The 503's message when the wait ran out.
    fn gave_up(self) -> &'static str {
        match self {
            Awaited::Slot | Awaited::SharedSlot => "no node had a free slot in time",
            Awaited::NodeBack => "every node refused the connection, and none came back in time",
        }
    }
}

/// Counts the request on `best` if it has a slot the request may take, or where a probe
/// may learn whether it runs more requests at once; `None`: wait for it.
fn reserve(
    router: &Arc<Router>,
    decision: &Decision,
    best: &Candidate,
    profile: &Profile,
    waited: Duration,
    listener: &Listener,
    config: &Config,
) -> Option<Reserved> {
    if listener.leaves_to_others(&best.node) {
        return None;
    }
    let warm = decision.warm_on(best.node.id);
    // Within the fair order between clients: a cold request leaves a slot to a warm one of a
    // client before it (or its own), not to one of a client that has had more.
    let yields = yields_to_warm(warm, waited, config.queue.max_wait)
        && listener.warm_waiter_first(best.node.id);
    // Rather than wait for the best node, probe whether it runs more requests at once; or,
    // where it is slow to begin a request and holds this one's conversation, wait in its own
    // queue. A request cold everywhere waits in corral, free to take whichever slot frees
    // first.
    router
        .try_send(best, profile, yields)
        .or_else(|| router.try_probe(best, profile, yields))
        .or_else(|| warm.then(|| router.try_queue(best, profile, yields))?)
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
    /// How long the request waited in corral for a slot before this attempt.
    waited: Duration,
}

/// Every node tried failed before replying.
async fn fail(session: &mut Session, ctx: &mut RequestCtx, failures: &[Failure]) -> Result<()> {
    let (status, message) = failure_reply(failures);
    let retries = [(
        "X-Fleet-Retries",
        failures.len().saturating_sub(1).to_string(),
    )];
    super::respond::refuse(session, ctx, status, &message, &retries).await
}

/// The status and message when every node tried failed: 504 when the last one timed out,
/// else 502, naming each node and how it failed.
fn failure_reply(failures: &[Failure]) -> (u16, String) {
    let timed_out = failures.last().is_some_and(|f| f.error.timed_out);
    let status = if timed_out { 504 } else { 502 };
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
    (status, message)
}

/// No node can take the request now: 503, with a hint when to try again.
async fn busy(
    session: &mut Session,
    ctx: &mut RequestCtx,
    message: &str,
    config: &Config,
) -> Result<()> {
    let retry_after = [("Retry-After", retry_after(config).to_string())];
    super::respond::refuse(session, ctx, 503, message, &retry_after).await
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
        status => super::respond::refuse(session, ctx, status, &e.to_string(), &[]).await,
    }
}

/// The node's reply header as the client should see it, with the routing headers added.
fn reply_header(
    upstream: &pingora_http::ResponseHeader,
    session: &Session,
    attempt: &Attempt,
) -> Result<pingora_http::ResponseHeader> {
    let client_is_http11 = session.req_header().version >= http::Version::HTTP_11;
    let mut header = super::headers::downstream_reply(upstream, client_is_http11)?;
    let (candidate, decision) = (attempt.candidate, attempt.decision);
    let node = &candidate.node;
    // Values made without formatting or checking a string where they can be: this runs for
    // every reply (issue 13).
    header.insert_header("X-Fleet-Node", node.name_value().clone())?;
    if decision.direct {
        return Ok(header);
    }
    header.insert_header(
        "X-Fleet-Score",
        super::headers::score_text(candidate.scores.total()),
    )?;
    let affinity = decision.affinity_for(node.id).as_str();
    header.insert_header("X-Fleet-Affinity", HeaderValue::from_static(affinity))?;
    header.insert_header("X-Fleet-Retries", HeaderValue::from(attempt.retries))?;
    if wants_explain(session) {
        let rows = decision.ranked.iter().map(|c| (c.node.name(), &c.scores));
        header.insert_header("X-Fleet-Explain", crate::routing::score::explain(rows))?;
    }
    Ok(header)
}

fn wants_explain(session: &Session) -> bool {
    // A name made once: looking a `&str` up parses it first, on every reply.
    static EXPLAIN: http::HeaderName = http::HeaderName::from_static("x-fleet-explain");
    session
        .req_header()
        .headers
        .get(&EXPLAIN)
        .is_some_and(|v| matches!(v.as_bytes(), b"1" | b"true" | b"yes"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error(etype: ErrorType, timed_out: bool) -> AttemptError {
        AttemptError {
            error: Error::explain(etype, "test"),
            timed_out,
        }
    }

    fn failure(name: &str, etype: ErrorType, timed_out: bool) -> Failure {
        Failure {
            node: 0,
            name: name.to_string(),
            error: error(etype, timed_out),
        }
    }

    fn decision(nodes: &[(&str, bool)]) -> Decision {
        let ranked = (nodes.iter().enumerate())
            .map(|(id, &(name, standby))| {
                let config = crate::config::NodeConfig::new(name, "http://127.0.0.1:9");
                Candidate {
                    node: Arc::new(Node::new(id as u16, config).unwrap()),
                    scores: Default::default(),
                    resident: true,
                    evicts_busy: false,
                    standby,
                }
            })
            .collect();
        Decision {
            ranked,
            pin: None,
            follow_up: false,
            direct: false,
            probe: None,
        }
    }

    fn failed(node: u16, etype: ErrorType) -> Failure {
        let timed_out = matches!(etype, ErrorType::ReadTimedout);
        Failure {
            node,
            ..failure("", etype, timed_out)
        }
    }

    /// The next step, as the name of the node to try or of what to do.
    fn step(decided: &Result<Decision, RouteError>, failures: &[Failure], max: usize) -> String {
        match next(decided, failures, max) {
            Next::Try(_, c) => c.node.name().to_string(),
            Next::Revive(_) => "revive".into(),
            Next::Fail => "fail".into(),
            Next::Refuse(e) => format!("refuse {}", e.status()),
        }
    }

    #[test]
    fn without_a_candidate_it_refuses_unless_a_node_was_tried() {
        let none = Err(RouteError::ModelNotFound("m".into()));
        assert_eq!(step(&none, &[], 2), "refuse 404");
        let tried = [failed(0, ErrorType::ConnectionClosed)];
        assert_eq!(step(&none, &tried, 2), "fail");
    }

    #[test]
    fn it_tries_the_best_untried_node_in_the_rankings_order() {
        // As ranked: standby nodes last.
        let d = Ok(decision(&[("a", false), ("b", false), ("sick", true)]));
        assert_eq!(step(&d, &[], 2), "a");
        let a_failed = [failed(0, ErrorType::ConnectionClosed)];
        assert_eq!(step(&d, &a_failed, 2), "b");
        let both = [
            failed(0, ErrorType::ConnectionClosed),
            failed(1, ErrorType::ConnectRefused),
        ];
        assert_eq!(
            step(&d, &both, 2),
            "sick",
            "standby only when no live node is left"
        );
    }

    #[test]
    fn when_every_node_refused_the_connection_it_waits_for_one_to_come_back() {
        let d = Ok(decision(&[("a", false), ("b", false)]));
        let refused = [
            failed(0, ErrorType::ConnectRefused),
            failed(1, ErrorType::ConnectRefused),
        ];
        assert_eq!(step(&d, &refused, 2), "revive");
        // One of them saw the request: trying again could run it twice.
        let one_saw_it = [
            failed(0, ErrorType::ConnectRefused),
            failed(1, ErrorType::ReadTimedout),
        ];
        assert_eq!(step(&d, &one_saw_it, 2), "fail");
    }

    #[test]
    fn past_its_retries_it_stops_trying_though_nodes_are_left() {
        let d = Ok(decision(&[("a", false), ("b", false), ("c", false)]));
        let two = [
            failed(0, ErrorType::ConnectionClosed),
            failed(1, ErrorType::ConnectionClosed),
        ];
        assert_eq!(step(&d, &two, 2), "c");
        assert_eq!(step(&d, &two, 1), "fail");
        let refused = [
            failed(0, ErrorType::ConnectRefused),
            failed(1, ErrorType::ConnectRefused),
        ];
        assert_eq!(step(&d, &refused, 1), "revive");
    }

    #[test]
    fn only_a_refused_connection_means_the_node_never_saw_the_request() {
        assert!(error(ErrorType::ConnectRefused, false).unreachable());
        assert!(error(ErrorType::ConnectError, false).unreachable());
        // A connection that was taken and then dropped may have started the generation.
        assert!(!error(ErrorType::ConnectionClosed, false).unreachable());
        assert!(!error(ErrorType::ReadTimedout, true).unreachable());
    }

    #[test]
    fn attempt_errors_carry_the_metric_kinds() {
        assert_eq!(error(ErrorType::ConnectRefused, false).kind(), "connect");
        assert_eq!(
            error(ErrorType::TLSHandshakeFailure, false).kind(),
            "connect"
        );
        assert_eq!(error(ErrorType::ConnectionClosed, false).kind(), "reset");
        assert_eq!(
            error(ErrorType::ReadTimedout, true).kind(),
            "first_byte_timeout"
        );
    }

    #[test]
    fn giving_up_names_every_node_tried_and_times_out_as_504() {
        let failures = [
            failure("gpu", ErrorType::ConnectRefused, false),
            failure("mac", ErrorType::ReadTimedout, true),
        ];
        let (status, message) = failure_reply(&failures);
        assert_eq!(status, 504);
        assert!(
            message.contains("gpu (connect: ConnectRefused)"),
            "{message}"
        );
        assert!(message.contains("mac (first_byte_timeout"), "{message}");
        let refused = [failure("gpu", ErrorType::ConnectionClosed, false)];
        assert_eq!(failure_reply(&refused).0, 502);
    }
}
