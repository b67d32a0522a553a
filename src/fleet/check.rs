//! The active health check: `GET /` on every node every `health.interval`, by Pingora's own
//! HTTP health check (pingora-load-balancing's `HttpHealthCheck`) over the node's peer, so
//! over TLS with the node's SNI and roots where its URL says https. Any HTTP answer below 500
//! passes (Ollama answers "Ollama is running"; an OpenAI-compatible server may answer 404 at
//! its root and is alive all the same); no answer in time, or a 5xx, fails. The verdict is
//! evidence for the node's one health view ([`super::health`]), not a state of its own.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;

use parking_lot::Mutex;
use pingora_core::{Error, ErrorType};
use pingora_http::{RequestHeader, ResponseHeader};
use pingora_load_balancing::Backend;
use pingora_load_balancing::health_check::{HealthCheck, HttpHealthCheck};

use super::health::{Evidence, Rules};
use super::node::Node;
use super::roster::Fleet;

pub struct Checker {
    fleet: Arc<Fleet>,
    rules: Rules,
    /// Connect, send and read the reply's head within this.
    timeout: Duration,
    interval: Duration,
    /// Probes between rounds, kept for their connector: making one loads the system's root
    /// certificates (a few hundred files), which every check paid before. Each check sets
    /// all that is its node's (request, peer, validator) on the probe it takes.
    spare: Mutex<Vec<HttpHealthCheck>>,
}

impl Checker {
    pub fn new(fleet: Arc<Fleet>, interval: Duration, timeout: Duration, rules: Rules) -> Checker {
        Checker {
            fleet,
            rules,
            timeout,
            interval,
            spare: Mutex::new(Vec::new()),
        }
    }

    /// Checks every node once, concurrently.
    pub async fn check_all(&self) {
        let nodes = self.fleet.nodes();
        futures::future::join_all(nodes.iter().map(|n| self.check(n))).await;
    }

    async fn check(&self, node: &Node) {
        let (Some(resolved), Some(peer)) = (node.resolved(), node.peer(self.timeout)) else {
            return;
        };
        let host = node.host_header();
        let spare = self.spare.lock().pop();
        let mut probe = match (spare, request(host)) {
            (Some(mut probe), Ok(req)) => {
                probe.req = req;
                probe
            }
            _ => HttpHealthCheck::new(host, peer.is_tls()),
        };
        // The node's own peer: its SNI, its roots (`ca_file`) and the connect timeout.
        probe.peer_template = peer;
        probe.peer_template.options.read_timeout = Some(self.timeout);
        probe.validator = Some(Box::new(alive));
        let backend = Backend::new(&resolved.addr.to_string());
        let verdict = match backend {
            Ok(backend) => tokio::time::timeout(self.timeout, probe.check(&backend))
                .await
                .unwrap_or_else(|_| Error::e_explain(ErrorType::ReadTimedout, "no answer in time")),
            Err(e) => Err(e),
        };
        self.spare.lock().push(probe);
        let evidence = match verdict {
            Ok(()) => Evidence::CheckPassed,
            Err(e) => {
                log::debug!("health check of {}: {e}", node.name());
                Evidence::CheckFailed
            }
        };
        self.fleet.learn(node, evidence, &self.rules);
    }
}

/// The request of [`HttpHealthCheck::new`]: `GET /` with the node's `Host`.
fn request(host: &str) -> pingora_core::Result<RequestHeader> {
    let mut req = RequestHeader::build("GET", b"/", None)?;
    req.append_header("Host", host)?;
    Ok(req)
}

/// Any answer below 500 shows a live server; a 5xx does not.
fn alive(reply: &ResponseHeader) -> pingora_core::Result<()> {
    match reply.status.as_u16() {
        status if status < 500 => Ok(()),
        status => Error::e_explain(
            ErrorType::CustomCode("status", status),
            "health check answered with a server error",
        ),
    }
}

#[async_trait]
impl BackgroundService for Checker {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut tick = tokio::time::interval(self.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The first round ran before the listener opened (server.rs): the next is due
        // after one interval.
        tick.tick().await;
        loop {
            tokio::select! {
                _ = tick.tick() => self.check_all().await,
                _ = shutdown.changed() => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_probe_sends_the_request_of_a_new_one() {
        let made = HttpHealthCheck::new("gpu.lan:11434", false).req;
        let ours = request("gpu.lan:11434").unwrap();
        let wire = pingora_core::protocols::http::v1::client::http_req_header_to_wire;
        assert_eq!(wire(&ours), wire(&made));
    }

    #[test]
    fn any_answer_below_500_is_alive() {
        for (status, ok) in [
            (200, true),
            (404, true),
            (499, true),
            (500, false),
            (503, false),
        ] {
            let reply = ResponseHeader::build(status, None).unwrap();
            assert_eq!(alive(&reply).is_ok(), ok, "status {status}");
        }
    }
}
