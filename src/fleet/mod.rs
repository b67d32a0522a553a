//! The fleet: every node, its health from Pingora's active checks, and the background tasks
//! that keep what corral knows about each node current.

mod node;
mod poller;

use std::sync::Arc;

use async_trait::async_trait;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;
use pingora_load_balancing::health_check::HttpHealthCheck;
use pingora_load_balancing::selection::RoundRobin;
use pingora_load_balancing::{Backends, LoadBalancer, discovery};

pub use node::{Ewma, Inventory, ModelState, Node, Resident, Slot};
pub use poller::Poller;

use crate::config::Config;

pub struct Fleet {
    pub nodes: Vec<Arc<Node>>,
    /// Pingora's load balancer, used here for its backends' health only: corral does its
    /// own selection.
    health: Arc<LoadBalancer<RoundRobin>>,
}

impl Fleet {
    /// Builds the fleet and the two background services that must run beside the proxy:
    /// Pingora's health checks and the inventory poller.
    pub fn new(config: &Config) -> Result<Fleet, String> {
        let nodes = config
            .nodes
            .iter()
            .enumerate()
            .map(|(i, n)| Node::new(i, n.clone()).map(Arc::new))
            .collect::<Result<Vec<_>, _>>()?;
        let set = nodes.iter().map(|n| n.backend.clone()).collect();
        let mut backends = Backends::new(discovery::Static::new(set));
        let mut check = HttpHealthCheck::new("localhost", false);
        check.consecutive_failure = config.health.consecutive_failures.max(1);
        check.consecutive_success = config.health.consecutive_successes.max(1);
        check.peer_template.options.connection_timeout = Some(config.timeouts.connect);
        check.peer_template.options.read_timeout = Some(config.poll.timeout);
        backends.set_health_check(Box::new(check));
        let mut lb = LoadBalancer::from_backends(backends);
        lb.health_check_frequency = Some(config.health.interval);
        lb.parallel_health_check = true;
        Ok(Fleet {
            nodes,
            health: Arc::new(lb),
        })
    }

    /// Passing Pingora's health checks. Nodes start healthy until a check fails.
    pub fn is_healthy(&self, node: &Node) -> bool {
        self.health.backends().ready(&node.backend)
    }

    /// The health-check service, to hand to Pingora as a background service.
    pub fn health_service(&self) -> HealthChecks {
        HealthChecks(self.health.clone())
    }

    /// Discovers the static backends so that health checks know them. Call once at start.
    pub async fn start(&self) -> Result<(), String> {
        self.health.update().await.map_err(|e| e.to_string())
    }

    pub fn healthy(&self) -> impl Iterator<Item = &Arc<Node>> {
        self.nodes.iter().filter(|n| self.is_healthy(n))
    }
}

/// Runs Pingora's health checks for the fleet's shared load balancer.
pub struct HealthChecks(Arc<LoadBalancer<RoundRobin>>);

#[async_trait]
impl BackgroundService for HealthChecks {
    async fn start(&self, shutdown: ShutdownWatch) {
        self.0.start(shutdown).await
    }
}
