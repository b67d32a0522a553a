//! The fleet: every node, its health from Pingora's active checks, and the background tasks
//! that keep what corral knows about each node current.
//!
//! The node list can change while corral runs (a configuration reload). A node keeps its
//! identity, and so its state and in-flight requests, across reloads as long as its name and
//! URL stay the same; requests already sent to a removed node finish normally.

pub mod kind;
mod node;
mod poller;

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU16, Ordering};

use arc_swap::ArcSwap;
use async_trait::async_trait;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;
use pingora_load_balancing::discovery::ServiceDiscovery;
use pingora_load_balancing::health_check::HttpHealthCheck;
use pingora_load_balancing::selection::RoundRobin;
use pingora_load_balancing::{Backend, Backends, LoadBalancer};

pub use node::{
    Breaker, Ewma, Inventory, ModelState, Node, Resident, Resolved, Slot, SuccessRatio,
};
pub use poller::Poller;

use crate::config::{Config, NodeConfig};

type NodeList = ArcSwap<Vec<Arc<Node>>>;

pub struct Fleet {
    nodes: Arc<NodeList>,
    /// Pingora's load balancer, used here for its backends' health only: corral does its
    /// own selection.
    health: Arc<LoadBalancer<RoundRobin>>,
    next_id: AtomicU16,
}

/// What a reload changed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Changes {
    pub added: Vec<String>,
    pub removed: Vec<String>,
    pub kept: Vec<String>,
}

impl Fleet {
    /// Builds the fleet. Its health checks run as the background service from
    /// [`Fleet::health_service`].
    pub fn new(config: &Config) -> Result<Fleet, String> {
        let nodes: Arc<NodeList> = Arc::new(ArcSwap::from_pointee(Vec::new()));
        let discovery = FleetDiscovery(nodes.clone());
        let mut backends = Backends::new(Box::new(discovery));
        let mut check = HttpHealthCheck::new("localhost", false);
        check.consecutive_failure = config.health.consecutive_failures.max(1);
        check.consecutive_success = config.health.consecutive_successes.max(1);
        check.peer_template.options.connection_timeout = Some(config.timeouts.connect);
        check.peer_template.options.read_timeout = Some(config.poll.timeout);
        backends.set_health_check(Box::new(check));
        let mut lb = LoadBalancer::from_backends(backends);
        lb.health_check_frequency = Some(config.health.interval);
        lb.parallel_health_check = true;
        let fleet = Fleet {
            nodes,
            health: Arc::new(lb),
            next_id: AtomicU16::new(0),
        };
        fleet.apply(&config.nodes)?;
        Ok(fleet)
    }

    /// Installs a new node list, keeping the nodes whose name and URL are unchanged (with
    /// their state) and updating their settings. Call [`Fleet::start`] afterwards so that
    /// health checks learn the new set.
    pub fn apply(&self, configs: &[NodeConfig]) -> Result<Changes, String> {
        let current = self.nodes.load_full();
        let mut changes = Changes::default();
        let mut next = Vec::with_capacity(configs.len());
        for config in configs {
            let same = current
                .iter()
                .find(|n| n.name() == config.name && n.url() == config.url);
            match same {
                Some(node) => {
                    node.set_settings(config.clone());
                    changes.kept.push(config.name.clone());
                    next.push(node.clone());
                }
                None => {
                    let id = self.next_id.fetch_add(1, Ordering::Relaxed);
                    next.push(Arc::new(Node::new(id, config.clone())?));
                    changes.added.push(config.name.clone());
                }
            }
        }
        for node in current.iter() {
            if !next.iter().any(|n| Arc::ptr_eq(n, node)) {
                changes.removed.push(node.name().to_string());
            }
        }
        self.nodes.store(Arc::new(next));
        Ok(changes)
    }

    /// A snapshot of the nodes.
    pub fn nodes(&self) -> Arc<Vec<Arc<Node>>> {
        self.nodes.load_full()
    }

    /// The node with this id, if it is still in the fleet.
    pub fn node(&self, id: u16) -> Option<Arc<Node>> {
        self.nodes.load().iter().find(|n| n.id == id).cloned()
    }

    /// Resolved and passing Pingora's health checks (the circuit breaker is the router's to
    /// read). Nodes start healthy until a check fails.
    pub fn is_healthy(&self, node: &Node) -> bool {
        node.resolved()
            .is_some_and(|r| self.health.backends().ready(&r.backend))
    }

    pub fn healthy(&self) -> Vec<Arc<Node>> {
        self.nodes
            .load()
            .iter()
            .filter(|n| self.is_healthy(n))
            .cloned()
            .collect()
    }

    /// The health-check service, to hand to Pingora as a background service.
    pub fn health_service(&self) -> HealthChecks {
        HealthChecks(self.health.clone())
    }

    /// Makes the health checks learn the current node set. Discovery only reads memory.
    pub async fn start(&self) -> Result<(), String> {
        self.health.update().await.map_err(|e| e.to_string())
    }
}

/// Tells Pingora's health checks which backends the fleet has now.
struct FleetDiscovery(Arc<NodeList>);

#[async_trait]
impl ServiceDiscovery for FleetDiscovery {
    async fn discover(&self) -> pingora_core::Result<(BTreeSet<Backend>, HashMap<u64, bool>)> {
        let nodes = self.0.load();
        let set = nodes
            .iter()
            .filter_map(|n| Some(n.resolved()?.backend.clone()))
            .collect();
        Ok((set, HashMap::new()))
    }
}

/// Runs Pingora's health checks for the fleet's load balancer.
pub struct HealthChecks(Arc<LoadBalancer<RoundRobin>>);

#[async_trait]
impl BackgroundService for HealthChecks {
    async fn start(&self, shutdown: ShutdownWatch) {
        self.0.start(shutdown).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt;

    fn node(name: &str, port: u16) -> NodeConfig {
        NodeConfig::new(name, &format!("http://127.0.0.1:{port}"))
    }

    #[test]
    fn apply_keeps_unchanged_nodes_and_their_state() {
        let config = Config {
            nodes: vec![node("a", 1), node("b", 2)],
            ..Default::default()
        };
        let fleet = Fleet::new(&config).unwrap();
        fleet.start().now_or_never().unwrap().unwrap();
        let a = fleet.nodes()[0].clone();
        a.models.lock().entry("m".into()).or_default().in_flight = 3;

        let mut a2 = node("a", 1);
        a2.num_parallel = 8;
        let changes = fleet.apply(&[a2, node("c", 3), node("b", 9)]).unwrap();
        assert_eq!(changes.kept, vec!["a"]);
        assert_eq!(changes.added, vec!["c", "b"], "b moved: a new node");
        assert_eq!(changes.removed, vec!["b"]);

        let now = fleet.nodes();
        assert!(Arc::ptr_eq(&now[0], &a));
        assert_eq!(now[0].models.lock()["m"].in_flight, 3);
        assert_eq!(now[0].settings().num_parallel, 8);
        let ids: std::collections::HashSet<u16> = now.iter().map(|n| n.id).collect();
        assert_eq!(ids.len(), 3, "ids are never reused");
        assert!(fleet.node(a.id).is_some());
    }

    #[test]
    fn a_node_is_healthy_only_where_its_name_resolved_and_follows_a_move() {
        let config = Config {
            nodes: vec![
                node("a", 1),
                NodeConfig::new("off", "http://laptop.invalid:11434"),
            ],
            ..Default::default()
        };
        let fleet = Fleet::new(&config).expect("an unresolvable node does not stop the start");
        fleet.start().now_or_never().unwrap().unwrap();
        let (a, off) = (fleet.nodes()[0].clone(), fleet.nodes()[1].clone());
        assert!(off.resolved().is_none());
        assert!(!fleet.is_healthy(&off));
        assert!(fleet.is_healthy(&a));
        let known = |fleet: &Fleet| -> Vec<String> {
            let backends = fleet.health.backends().get_backend();
            backends.iter().map(|b| b.addr.to_string()).collect()
        };
        assert_eq!(known(&fleet), vec!["127.0.0.1:1"]);

        // Its name resolves (the laptop woke up): the health checks learn it, and it is
        // healthy until they find otherwise.
        assert!(off.set_address("127.0.0.1:7".parse().unwrap()));
        assert!(
            !off.set_address("127.0.0.1:7".parse().unwrap()),
            "not a move"
        );
        fleet.start().now_or_never().unwrap().unwrap();
        assert!(fleet.is_healthy(&off));
        // It moves: the old address is forgotten.
        assert!(off.set_address("127.0.0.1:8".parse().unwrap()));
        fleet.start().now_or_never().unwrap().unwrap();
        assert_eq!(known(&fleet), vec!["127.0.0.1:1", "127.0.0.1:8"]);
        assert!(fleet.is_healthy(&off));
    }
}
