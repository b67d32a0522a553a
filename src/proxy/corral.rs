//! The proxy service: Pingora's HTTP service, with every request answered in
//! `request_filter`. A request is classified by path; fleet-wide endpoints are answered from
//! state; routed endpoints have their body read, profiled and scored, and are forwarded by
//! [`Forwarder`].

use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use pingora_core::upstreams::peer::HttpPeer;
use pingora_core::{Error, ErrorType, Result};
use pingora_proxy::{ProxyHttp, Session};

use crate::config::Config;
use crate::metrics::{Metrics, model_label};
use crate::request::session::{header_session as session_header, session_hash};
use crate::request::{Endpoint, Profile, Route, form_field};
use crate::routing::Router;

use super::access_log::{self, AccessLog};
use super::ctx::RequestCtx;
use super::forward::Forwarder;
use super::{access, body, clients, fanout, local, respond};

/// The corral proxy service.
pub struct Corral {
    router: Arc<Router>,
    /// Requests in flight or waiting per client, for its limits.
    clients: Arc<clients::ClientBook>,
    forwarder: Forwarder,
    metrics: Arc<Metrics>,
    access_log: Arc<AccessLog>,
}

impl Corral {
    pub fn new(router: Arc<Router>, metrics: Arc<Metrics>, access_log: Arc<AccessLog>) -> Corral {
        Corral {
            router,
            clients: Arc::default(),
            forwarder: Forwarder::new(metrics.clone()),
            metrics,
            access_log,
        }
    }

    async fn handle(&self, session: &mut Session, ctx: &mut RequestCtx) -> Result<()> {
        let route = {
            let req = session.req_header();
            Route::of(&req.method, req.uri.path())
        };
        ctx.route = route.label();
        let config = self.router.config();
        // `GET /` stays open: clients and load balancers probe it to see a server is up.
        if route != Route::Root && !access::client_allowed(&config, session.req_header()) {
            let challenge = [("WWW-Authenticate", "Bearer".to_string())];
            let message = "a valid API key is required: Authorization: Bearer <key>";
            return respond::refuse(session, ctx, 401, message, &challenge).await;
        }
        let req = session.req_header();
        let address = clients::address(client_ip(session), req, &config.trusted_proxies);
        ctx.client = clients::identify(&config, req, address);
        let fleet = &self.router.fleet;
        let (status, result) = match route {
            Route::Model(endpoint) => {
                return self.route_model(session, ctx, endpoint, &config).await;
            }
            Route::Root => (
                200,
                respond::send(
                    session,
                    200,
                    "text/plain; charset=utf-8",
                    Bytes::from_static(b"Ollama is running"),
                    &[],
                )
                .await,
            ),
            Route::Tags => (200, respond::json(session, 200, &local::tags(fleet)).await),
            Route::Ps => (200, respond::json(session, 200, &local::ps(fleet)).await),
            Route::Version => (
                200,
                respond::json(session, 200, &local::version(fleet)).await,
            ),
            Route::OpenAiModels => (
                200,
                respond::json(session, 200, &local::openai_models(fleet)).await,
            ),
            Route::OpenAiModel => {
                let path = session.req_header().uri.path().to_string();
                let name = path.trim_end_matches('/').trim_start_matches("/v1/models/");
                match local::openai_model(fleet, name) {
                    Some(model) => (200, respond::json(session, 200, &model).await),
                    None => {
                        let message = format!("model '{name}' not found");
                        (404, respond::error(session, 404, &message, &[]).await)
                    }
                }
            }
            Route::Status => (200, respond::json(session, 200, &local::status()).await),
            Route::Experimental => {
                let message = "corral does not serve /api/experimental/*: they act through one node's ollama.com account; call a node directly";
                (404, respond::error(session, 404, message, &[]).await)
            }
            Route::Management => return self.manage(session, ctx, &config).await,
            Route::WrongMethod(allowed) => {
                let message = format!("method not allowed: use {allowed}");
                (
                    405,
                    respond::error(session, 405, &message, &[("Allow", allowed.to_string())]).await,
                )
            }
            Route::NotFound => {
                let path = session.req_header().uri.path().to_string();
                (
                    404,
                    respond::error(session, 404, &format!("404 page not found: {path}"), &[]).await,
                )
            }
        };
        ctx.status = status;
        result
    }

    /// Management calls go to the one node the client names, when enabled and authorized.
    async fn manage(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        config: &Config,
    ) -> Result<()> {
        let path = session.req_header().uri.path().to_string();
        if !config.management.enabled {
            let message = format!(
                "{path} is disabled: it changes one node; enable management in corral's config, or run it against the node directly"
            );
            return respond::refuse(session, ctx, 403, &message, &[]).await;
        }
        if !access::admin_allowed(config, session.req_header()) {
            let message = "management calls need the admin token in X-Fleet-Admin-Token";
            return respond::refuse(session, ctx, 401, message, &[]).await;
        }
        let nodes = self.router.fleet.nodes();
        let target = session
            .req_header()
            .headers
            .get("x-fleet-target")
            .and_then(|v| v.to_str().ok())
            .and_then(|name| nodes.iter().find(|n| n.name() == name))
            .cloned();
        let Some(node) = target else {
            let names: Vec<&str> = nodes.iter().map(|n| n.name()).collect();
            let message = format!("X-Fleet-Target must name one node: {}", names.join(", "));
            return respond::refuse(session, ctx, 400, &message, &[]).await;
        };
        let body = match body::read(
            session,
            config.limits.max_body_bytes,
            config.timeouts.body_read,
        )
        .await
        {
            Ok(body) => body,
            Err(e) => return refuse_body(session, ctx, e).await,
        };
        self.forwarder
            .forward_to(&self.router, session, ctx, &body, node, config)
            .await
    }

    async fn route_model(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        endpoint: Endpoint,
        config: &Config,
    ) -> Result<()> {
        // Before the body is read: a client at its limit costs no more than this answer.
        let per_address = config.queue.per_client;
        let _admitted = match self.clients.admit(&ctx.client, per_address) {
            Ok(admitted) => admitted,
            Err(refusal) => {
                // The body is left unread: the connection cannot be reused.
                session.set_keepalive(None);
                let labels = [ctx.client.label(), refusal.reason()];
                self.metrics.client_refused.with_label_values(&labels).inc();
                let retry_after = [("Retry-After", refusal.retry_after().to_string())];
                return respond::refuse(session, ctx, 429, &refusal.message(), &retry_after).await;
            }
        };
        let limit = config.limits.max_body_bytes;
        let body = match body::read(session, limit, config.timeouts.body_read).await {
            Ok(body) => body,
            Err(e) => return refuse_body(session, ctx, e).await,
        };
        let parsed = if endpoint == Endpoint::Transcriptions {
            transcription_profile(session, &body)
        } else {
            Profile::parse(endpoint, &body).map_err(|e| e.to_string())
        };
        let mut profile = match parsed {
            Ok(p) => p,
            Err(message) => {
                return respond::refuse(session, ctx, 400, &message, &[]).await;
            }
        };
        if profile.session.is_none() {
            let headers = &session.req_header().headers;
            profile.session = session_header(headers, &config.session_headers)
                .map(|key| session_hash(&profile.model_key, key));
        }
        ctx.model = Some(profile.model_key.clone());
        let result = if matches!(endpoint, Endpoint::Embed | Endpoint::OpenAiEmbeddings)
            && let Some(batch) = fanout::Batch::split(&body, config.embed_fanout.chunk_size)
            && let Ok(decision) = self.router.decide_with(&profile, config)
            && let Some(spread) = fanout::spread(&decision, config.embed_fanout.max_nodes)
        {
            drop(decision);
            fanout::serve(
                &self.forwarder,
                &self.router,
                session,
                ctx,
                &profile,
                batch,
                spread,
                config,
            )
            .await
        } else {
            self.forwarder
                .forward(&self.router, session, ctx, &body, &profile, config)
                .await
        };
        self.clients.spend(&ctx.client, ctx.tokens_worked());
        result
    }
}

/// Answers a body corral will not read (too large, too slow, unreadable). The connection is
/// not reused: what is left of the body was not read. A body refused for its size is drained
/// for a moment after the answer, so that a client still sending it gets to read the 413.
async fn refuse_body(
    session: &mut Session,
    ctx: &mut RequestCtx,
    e: body::BodyError,
) -> Result<()> {
    session.set_keepalive(None);
    let answered = respond::refuse(session, ctx, e.status(), &e.to_string(), &[]).await;
    if matches!(e, body::BodyError::TooLarge { .. }) {
        body::drain(session, BODY_DRAIN_TIME, BODY_DRAIN_BYTES).await;
    }
    answered
}

/// How long, and how many bytes, a refused body is drained for.
const BODY_DRAIN_TIME: Duration = Duration::from_secs(1);
const BODY_DRAIN_BYTES: usize = 64 * 1024 * 1024;

/// A transcription's profile: its model is the multipart form's `model` field.
fn transcription_profile(session: &Session, body: &[u8]) -> std::result::Result<Profile, String> {
    let content_type = session
        .req_header()
        .headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    let model = form_field(content_type, body, "model")
        .and_then(|m| std::str::from_utf8(m).ok())
        .map(str::trim)
        .filter(|m| !m.is_empty())
        .ok_or("model is required: a multipart/form-data body with a model field")?;
    Ok(Profile::transcription(model))
}

/// One request counted against its client; given back on drop.
#[async_trait]
impl ProxyHttp for Corral {
    type CTX = RequestCtx;

    fn new_ctx(&self) -> RequestCtx {
        RequestCtx {
            started: Some(Instant::now()),
            route: "other",
            ..Default::default()
        }
    }

    async fn request_filter(&self, session: &mut Session, ctx: &mut RequestCtx) -> Result<bool> {
        self.handle(session, ctx).await?;
        Ok(true)
    }

    async fn upstream_peer(
        &self,
        _session: &mut Session,
        _ctx: &mut RequestCtx,
    ) -> Result<Box<HttpPeer>> {
        // request_filter answers every request (see the module docs), so Pingora's own
        // forwarding never starts.
        Error::e_explain(ErrorType::InternalError, "corral forwards requests itself")
    }

    async fn logging(&self, session: &mut Session, e: Option<&Error>, ctx: &mut RequestCtx) {
        if let Some(e) = e {
            log::debug!("request ended with error: {e}");
        }
        let elapsed = ctx.started.map(|t| t.elapsed()).unwrap_or_default();
        // A client that left, or a reply cut short, gets no status of its own from the
        // node: count it as the 499 and 502 that access logs conventionally use.
        let status = match (ctx.status, ctx.client_gone, ctx.broken) {
            (_, true, _) => 499,
            (_, _, true) => 502,
            (0, ..) => session.response_written().map_or(0, |r| r.status.as_u16()),
            (s, ..) => s,
        };
        let fleet = &self.router.fleet;
        let model = match (&ctx.model_label, &ctx.model) {
            (Some(label), _) => Some(label.as_str()),
            (None, Some(m)) => Some(model_label(fleet, m)),
            (None, None) => None,
        };
        let node = ctx.node.as_deref();
        self.metrics
            .requests
            .with_label_values(&[
                node.unwrap_or("none"),
                model.unwrap_or("none"),
                ctx.route,
                &status.to_string(),
            ])
            .inc();
        if let (Some(node), Some(model)) = (node, model) {
            self.metrics
                .duration
                .with_label_values(&[node, model])
                .observe(elapsed.as_secs_f64());
        }
        if self.access_log.enabled() {
            let req = session.req_header();
            self.access_log.write(&access_log::Entry {
                time: access_log::now(),
                client: match ctx.client.address {
                    // Forwarded by a trusted proxy: the client it forwarded for.
                    Some(ip) if Some(ip) != client_ip(session) => Some(ip.to_string()),
                    _ => session.client_addr().map(|a| a.to_string()),
                },
                method: req.method.as_str(),
                endpoint: req.uri.path(),
                model: ctx.model.as_deref(),
                key_name: (!ctx.client.name.is_empty()).then_some(ctx.client.name.as_str()),
                node,
                score: ctx.score,
                affinity: ctx.affinity,
                cold_load: ctx.cold_load,
                retries: ctx.retries,
                status,
                bytes: ctx.bytes_out,
                wait_ms: ctx.waited.map(|t| t.as_secs_f64() * 1000.0),
                ttfb_ms: ctx.ttfb.map(|t| t.as_secs_f64() * 1000.0),
                duration_ms: elapsed.as_secs_f64() * 1000.0,
                prompt_tokens: ctx.prompt_tokens,
                cached_tokens: ctx.cached_tokens,
                cache: ctx.cache,
            });
        }
    }
}

/// The client's IP address, when it connected over TCP.
fn client_ip(session: &Session) -> Option<IpAddr> {
    session.client_addr()?.as_inet().map(|a| a.ip())
}
