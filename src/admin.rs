//! The admin API: what corral knows about the fleet, and how it would route a request,
//! as JSON. Served on `admin_listen` (loopback by default), optionally behind a bearer token.

use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use bytes::BytesMut;
use http::{Response, StatusCode};
use pingora_core::apps::http_app::ServeHttp;
use pingora_core::protocols::http::ServerSession;
use serde_json::{Value, json};

use crate::fleet::Node;
use crate::request::{Endpoint, Profile, Route};
use crate::routing::Router;

/// Largest body `POST /explain` reads.
const MAX_EXPLAIN_BODY: usize = 64 * 1024 * 1024;

pub struct Admin {
    router: Arc<Router>,
}

impl Admin {
    pub fn new(router: Arc<Router>) -> Admin {
        Admin { router }
    }

    /// The token in force (it may change on reload) matches the request's bearer token.
    fn authorized(&self, session: &ServerSession) -> bool {
        let config = self.router.config();
        let Some(token) = &config.admin_token else {
            return true;
        };
        crate::proxy::bearer(session.req_header())
            .is_some_and(|given| crate::proxy::same_secret(given, token))
    }

    /// Per node: health, models on disk and resident, in-flight and queue per model,
    /// learned speeds, and the slots holding warm conversations.
    pub fn fleet_status(&self) -> Value {
        let fleet = &self.router.fleet;
        let now = Instant::now();
        let nodes: Vec<Value> = fleet
            .nodes()
            .iter()
            .map(|n| node_status(n, fleet.is_healthy(n), now))
            .collect();
        json!({
            "nodes": nodes,
            "affinity_entries": self.router.affinity.len(),
            "waiting": self.router.waiting(),
        })
    }

    /// The scoring table for a request body, without forwarding anything.
    pub fn explain(&self, endpoint: Endpoint, body: &[u8]) -> (StatusCode, Value) {
        let profile = match Profile::parse(endpoint, body) {
            Ok(p) => p,
            Err(e) => return (StatusCode::BAD_REQUEST, json!({ "error": e.to_string() })),
        };
        let decision = match self.router.decide(&profile) {
            Ok(d) => d,
            Err(e) => {
                let status =
                    StatusCode::from_u16(e.status()).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
                return (status, json!({ "error": e.to_string() }));
            }
        };
        let fleet = &self.router.fleet;
        let candidates: Vec<Value> = decision
            .ranked
            .iter()
            .map(|c| {
                json!({
                    "node": c.node.name(),
                    "total": c.scores.total(),
                    "resident": c.resident,
                    "standby": c.standby,
                    "affinity": decision.affinity_for(c.node.id).as_str(),
                    "scores": c.scores,
                })
            })
            .collect();
        let pin = decision.pin.map(|p| {
            json!({
                "node": fleet.node(p.node).map(|n| n.name().to_string()),
                "depth": p.depth,
                "continues": p.continues,
            })
        });
        let table = json!({
            "endpoint": endpoint.path(),
            "model": profile.model_key,
            "stream": profile.stream,
            "prompt_tokens": profile.prompt_tokens,
            "prefix_depth": profile.chain.depth(),
            "follow_up": decision.follow_up,
            "pin": pin,
            "winner": decision.ranked.first().map(|c| c.node.name()),
            "candidates": candidates,
        });
        (StatusCode::OK, table)
    }
}

fn node_status(node: &Node, healthy: bool, now: Instant) -> Value {
    let inv = node.inventory();
    let resident: Vec<Value> = inv
        .resident
        .iter()
        .map(|(name, r)| {
            json!({
                "model": name,
                "size": r.size,
                "context_length": r.context_length,
                "expires_at": r.expires_at,
            })
        })
        .collect();
    let mut on_disk: Vec<&String> = inv.on_disk.keys().collect();
    on_disk.sort();
    let settings = node.settings();
    let models: serde_json::Map<String, Value> = node.books(|books| {
        books
            .models
            .iter()
            .map(|(name, m)| {
                let slots: Vec<Value> = m
                .slots
                .iter()
                .filter(|s| s.lineage != 0)
                .map(|s| {
                    json!({
                        "depth": s.depth,
                        "busy": s.busy,
                        "idle_seconds": s.last_used.map(|t| now.duration_since(t).as_secs_f64()),
                    })
                })
                .collect();
                let status = json!({
                    "in_flight": m.in_flight,
                    "waiting": m.waiting,
                    "ttfb_ms": m.ttfb_ms.get(),
                    "prefill_tokens_per_second": m.prefill_tps.get(),
                    "decode_tokens_per_second": m.decode_tps.get(),
                    "warm_slots": slots,
                });
                (name.clone(), status)
            })
            .collect()
    });
    json!({
        "name": node.name(),
        "url": node.url(),
        // Where the URL's host resolved last; null while it never has.
        "address": node.resolved().map(|r| r.addr.to_string()),
        "healthy": healthy,
        "success_ratio": node.success_ratio(),
        "memory_gb": settings.memory_gb,
        // As configured; null when unset (corral probes for it).
        "num_parallel": (settings.num_parallel > 0).then_some(settings.num_parallel),
        // What corral sends it at once per model now: configured, shown or probed.
        "parallel": node.parallel(),
        // Slots the node showed itself (llama.cpp's /props, or requests run at once); null
        // while it has shown none.
        "slots_shown": node.slots_shown(),
        "kind": node.books(|b| b.kind.kind.as_str()),
        "roles": settings.roles,
        "health": node.health().as_str(),
        "breaker_open": node.health() == crate::fleet::State::Down,
        "polled": inv.polled_at.is_some(),
        "version": inv.version,
        "resident": resident,
        "on_disk": on_disk,
        "models": models,
    })
}

fn reply(status: StatusCode, body: &Value) -> Response<Vec<u8>> {
    let bytes = serde_json::to_vec_pretty(body).unwrap_or_default();
    Response::builder()
        .status(status)
        .header(http::header::CONTENT_TYPE, "application/json")
        .header(http::header::CONTENT_LENGTH, bytes.len())
        .body(bytes)
        .unwrap_or_default()
}

async fn read_body(session: &mut ServerSession) -> Result<BytesMut, String> {
    let mut body = BytesMut::new();
    while let Some(chunk) = session
        .read_request_body()
        .await
        .map_err(|e| e.to_string())?
    {
        if body.len() + chunk.len() > MAX_EXPLAIN_BODY {
            return Err("body too large".into());
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

#[async_trait]
impl ServeHttp for Admin {
    async fn response(&self, session: &mut ServerSession) -> Response<Vec<u8>> {
        if !self.authorized(session) {
            return reply(
                StatusCode::UNAUTHORIZED,
                &json!({ "error": "the admin API needs Authorization: Bearer <admin_token>" }),
            );
        }
        let method = session.req_header().method.clone();
        let path = session.req_header().uri.path().to_string();
        match (method.as_str(), path.as_str()) {
            ("GET", "/healthz") => reply(StatusCode::OK, &json!({ "status": "ok" })),
            ("GET", "/fleet") => reply(StatusCode::OK, &self.fleet_status()),
            ("POST", "/explain") => {
                // `?endpoint=/v1/chat/completions` explains for another endpoint.
                let query = session.req_header().uri.query().unwrap_or("");
                let target = query
                    .split('&')
                    .find_map(|kv| kv.strip_prefix("endpoint="))
                    .unwrap_or("/api/chat");
                let Route::Model(endpoint) = Route::of(&http::Method::POST, target) else {
                    return reply(
                        StatusCode::BAD_REQUEST,
                        &json!({ "error": format!("'{target}' is not a routed endpoint") }),
                    );
                };
                match read_body(session).await {
                    Ok(body) => {
                        let (status, table) = self.explain(endpoint, &body);
                        reply(status, &table)
                    }
                    Err(e) => reply(StatusCode::BAD_REQUEST, &json!({ "error": e })),
                }
            }
            _ => reply(
                StatusCode::NOT_FOUND,
                &json!({ "error": "admin endpoints: GET /fleet, POST /explain, GET /healthz" }),
            ),
        }
    }
}
