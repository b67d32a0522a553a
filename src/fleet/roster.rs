//! The nodes of the fleet, as the configuration in force lists them: added, kept (with their
//! state and requests in flight) and removed on reload, and what is learned of each.

use std::sync::Arc;
use std::sync::atomic::{AtomicU16, Ordering};

use arc_swap::ArcSwap;

use super::health::{Evidence, Rules};
use super::node::{Inventory, Node};
use super::wake::Wakeups;
use crate::config::{Config, NodeConfig};

pub struct Fleet {
    nodes: ArcSwap<Vec<Arc<Node>>>,
    next_id: AtomicU16,
    /// Wakes the poller for the nodes marked `poll_wanted`.
    poll_wanted: tokio::sync::Notify,
    /// Requests waiting in corral's queue listen here for news that may change their choice.
    pub wakeups: Wakeups,
}

/// What a reload changed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Changes {
    pub added: Vec<String>,
    pub removed: Vec<String>,
    pub kept: Vec<String>,
}

impl Fleet {
    /// Builds the fleet. Its health checks and polls run as the background services
    /// [`crate::fleet::Checker`] and [`crate::fleet::Poller`].
    pub fn new(config: &Config) -> Result<Fleet, String> {
        let fleet = Fleet {
            nodes: ArcSwap::from_pointee(Vec::new()),
            next_id: AtomicU16::new(0),
            poll_wanted: tokio::sync::Notify::new(),
            wakeups: Wakeups::default(),
        };
        fleet.apply(&config.nodes)?;
        Ok(fleet)
    }

    /// Installs a new node list, keeping the nodes whose name and URL are unchanged (with
    /// their state) and updating their settings.
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
        self.wakeups.fleet_changed();
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

    /// Resolved, and admitting requests (up or half-open).
    pub fn is_healthy(&self, node: &Node) -> bool {
        node.resolved().is_some() && node.admits()
    }

    pub fn healthy(&self) -> Vec<Arc<Node>> {
        self.nodes
            .load()
            .iter()
            .filter(|n| self.is_healthy(n))
            .cloned()
            .collect()
    }

    /// Asks the poller to read the node's `/api/ps` now rather than at its next tick: a reply
    /// showed a model load there, which may have evicted another model.
    pub fn poll_soon(&self, node: &Node) {
        node.poll_wanted.store(true, Ordering::Release);
        // A stored permit: a request made while the poller is busy is not lost.
        self.poll_wanted.notify_one();
    }

    /// Completes when [`Fleet::poll_soon`] was called for some node.
    pub async fn poll_requested(&self) {
        self.poll_wanted.notified().await
    }

    /// Records evidence about a node's health. When that admits it or cuts it off, every
    /// waiting request looks again.
    pub fn learn(&self, node: &Node, evidence: Evidence, rules: &Rules) {
        node.learn(evidence, rules);
        self.announce(node);
    }

    /// Wakes every waiting request if the node started or stopped admitting requests since
    /// they were last told. The poller calls it every round for every node, for cool-downs
    /// that ran out.
    pub fn announce(&self, node: &Node) {
        if node.admission_changed() {
            log::info!("node {} is {}", node.name(), node.health().as_str());
            self.wakeups.fleet_changed();
        }
    }

    /// Installs a node's fresh inventory, waking the requests waiting for the models it
    /// loaded or unloaded.
    pub fn update_inventory(&self, node: &Node, inventory: Inventory) {
        for model in node.update_inventory(inventory) {
            self.wakeups.model_changed(&model);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::health::State;
    use crate::fleet::wake::Requester;

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
        let a = fleet.nodes()[0].clone();
        a.lock_books()
            .models
            .entry("m".into())
            .or_default()
            .in_flight = 3;

        let mut a2 = node("a", 1);
        a2.num_parallel = 8;
        let changes = fleet.apply(&[a2, node("c", 3), node("b", 9)]).unwrap();
        assert_eq!(changes.kept, vec!["a"]);
        assert_eq!(changes.added, vec!["c", "b"], "b moved: a new node");
        assert_eq!(changes.removed, vec!["b"]);

        let now = fleet.nodes();
        assert!(Arc::ptr_eq(&now[0], &a));
        assert_eq!(now[0].lock_books().models["m"].in_flight, 3);
        assert_eq!(now[0].settings().num_parallel, 8);
        let ids: std::collections::HashSet<u16> = now.iter().map(|n| n.id).collect();
        assert_eq!(ids.len(), 3, "ids are never reused");
        assert!(fleet.node(a.id).is_some());
    }

    #[test]
    fn a_node_is_healthy_only_where_its_name_resolved_and_while_it_admits_requests() {
        let config = Config {
            nodes: vec![
                node("a", 1),
                NodeConfig::new("off", "http://laptop.invalid:11434"),
            ],
            ..Default::default()
        };
        let fleet = Fleet::new(&config).expect("an unresolvable node does not stop the start");
        let (a, off) = (fleet.nodes()[0].clone(), fleet.nodes()[1].clone());
        assert!(off.resolved().is_none());
        assert!(!fleet.is_healthy(&off));
        assert!(fleet.is_healthy(&a));

        // Its name resolves (the laptop woke up): healthy until found otherwise.
        assert!(off.set_address("127.0.0.1:7".parse().unwrap()));
        assert!(
            !off.set_address("127.0.0.1:7".parse().unwrap()),
            "not a move"
        );
        assert!(fleet.is_healthy(&off));

        // One view: a refused request cuts a off, and waiting requests hear of it.
        let rules = Rules::of(&config);
        let listener = fleet.wakeups.listen("m", Requester::default());
        let news = listener.news(&fleet.wakeups);
        tokio::pin!(news);
        fleet.learn(&a, Evidence::Refused, &rules);
        assert!(!fleet.is_healthy(&a));
        assert!(futures::FutureExt::now_or_never(news.as_mut()).is_some());
        // A poll answer lets it back at once.
        fleet.learn(&a, Evidence::PollAnswered, &rules);
        assert_eq!(a.health(), State::HalfOpen);
        assert!(fleet.is_healthy(&a));
    }

    #[test]
    fn a_model_loaded_or_unloaded_wakes_the_requests_waiting_for_it() {
        let config = Config {
            nodes: vec![node("a", 1)],
            ..Default::default()
        };
        let fleet = Fleet::new(&config).unwrap();
        let a = fleet.nodes()[0].clone();
        let (m, other) = (
            fleet.wakeups.listen("m", Requester::default()),
            fleet.wakeups.listen("other", Requester::default()),
        );
        let loaded = Inventory::with_resident;
        for inventory in [loaded(&["m"]), loaded(&[])] {
            let (for_m, for_other) = (m.news(&fleet.wakeups), other.news(&fleet.wakeups));
            tokio::pin!(for_m, for_other);
            fleet.update_inventory(&a, inventory);
            assert!(futures::FutureExt::now_or_never(for_m.as_mut()).is_some());
            assert!(futures::FutureExt::now_or_never(for_other.as_mut()).is_none());
        }
    }

    #[test]
    fn a_cool_down_that_runs_out_is_announced_once() {
        let config = Config {
            nodes: vec![node("a", 1)],
            ..Default::default()
        };
        let fleet = Fleet::new(&config).unwrap();
        let a = fleet.nodes()[0].clone();
        let rules = Rules {
            cooldown: std::time::Duration::from_millis(30),
            ..Rules::of(&config)
        };
        fleet.learn(&a, Evidence::Failed, &rules);
        fleet.learn(&a, Evidence::Failed, &rules);
        fleet.learn(&a, Evidence::Failed, &rules);
        assert_eq!(a.health(), State::Down);
        let listener = fleet.wakeups.listen("m", Requester::default());
        let news = listener.news(&fleet.wakeups);
        tokio::pin!(news);
        fleet.announce(&a);
        assert!(
            futures::FutureExt::now_or_never(news.as_mut()).is_none(),
            "nothing new yet"
        );
        std::thread::sleep(std::time::Duration::from_millis(40));
        fleet.announce(&a);
        assert!(futures::FutureExt::now_or_never(news.as_mut()).is_some());
        let again = listener.news(&fleet.wakeups);
        tokio::pin!(again);
        fleet.announce(&a);
        assert!(futures::FutureExt::now_or_never(again.as_mut()).is_none());
    }
}
