//! The active health check: `GET /` on every node every `health.interval`. Any HTTP answer
//! below 500 passes (Ollama answers "Ollama is running"; an OpenAI-compatible server may
//! answer 404 at its root and is alive all the same); no answer in time, or a 5xx, fails.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;

use super::client::NodeClient;
use super::health::{Evidence, Rules};
use super::{Fleet, Node};

pub struct Checker {
    fleet: Arc<Fleet>,
    rules: Rules,
    client: NodeClient,
    interval: Duration,
}

impl Checker {
    pub fn new(fleet: Arc<Fleet>, interval: Duration, timeout: Duration, rules: Rules) -> Checker {
        Checker {
            fleet,
            rules,
            client: NodeClient::new(timeout),
            interval,
        }
    }

    /// Checks every node once, concurrently.
    pub async fn check_all(&self) {
        let nodes = self.fleet.nodes();
        futures::future::join_all(nodes.iter().map(|n| self.check(n))).await;
    }

    async fn check(&self, node: &Node) {
        if node.resolved().is_none() {
            return;
        }
        let evidence = match self.client.get(node, "/").await {
            Ok((status, _)) if status < 500 => Evidence::CheckPassed,
            Ok((status, _)) => {
                log::debug!("health check of {}: status {status}", node.name());
                Evidence::CheckFailed
            }
            Err(e) => {
                log::debug!("health check of {}: {e}", node.name());
                Evidence::CheckFailed
            }
        };
        self.fleet.learn(node, evidence, &self.rules);
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
