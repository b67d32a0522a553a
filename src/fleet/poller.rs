//! Reads every node's `/api/tags` and `/api/ps` in the background, so the request path only
//! reads what was learned and never waits on a node to decide.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;
use serde::Deserialize;

use super::client::{GetError, NodeClient};
use super::health::{Evidence, Rules};
use super::kind::slots_from_props;
use super::node::{Inventory, Node, Resident};
use super::roster::Fleet;
use crate::request::normalize_model;

#[derive(Deserialize)]
struct ModelList {
    #[serde(default)]
    models: Vec<serde_json::Value>,
}

#[derive(Deserialize)]
struct Version {
    #[serde(default)]
    version: Option<String>,
}

/// Fields of a `/api/tags` or `/api/ps` entry. Older servers omit some; all are optional.
#[derive(Deserialize)]
struct ModelEntry {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    size: u64,
    /// The part of `size` in GPU memory; stands in for `size` where that is missing.
    #[serde(default)]
    size_vram: Option<u64>,
    #[serde(default)]
    expires_at: Option<String>,
    #[serde(default)]
    context_length: Option<u32>,
}

impl ModelEntry {
    fn key(&self) -> Option<String> {
        self.name
            .as_deref()
            .or(self.model.as_deref())
            .map(normalize_model)
    }
}

pub struct Poller {
    fleet: Arc<Fleet>,
    /// For nodes found down (refused) or answering again.
    rules: Rules,
    client: NodeClient,
    interval: Duration,
}

impl Poller {
    pub fn new(fleet: Arc<Fleet>, interval: Duration, timeout: Duration, rules: Rules) -> Poller {
        Poller {
            fleet,
            rules,
            client: NodeClient::new(timeout),
            interval,
        }
    }

    /// Polls every node once, concurrently.
    pub async fn poll_all(&self) {
        let nodes = self.fleet.nodes();
        let polls = nodes.iter().map(|node| self.poll(node));
        futures::future::join_all(polls).await;
    }

    /// Polls the nodes that asked for it ([`Fleet::poll_soon`]).
    async fn poll_wanted(&self) {
        let nodes = self.fleet.nodes();
        let wanted = nodes
            .iter()
            .filter(|n| n.poll_wanted.swap(false, Ordering::AcqRel));
        futures::future::join_all(wanted.map(|node| self.poll(node))).await;
    }

    /// Polls one node, after resolving its host name again.
    async fn poll(&self, node: &Node) {
        self.resolve(node).await;
        let started = Instant::now();
        let (tags, ps, version) = tokio::join!(
            self.get::<ModelList>(node, "/api/tags"),
            self.get::<ModelList>(node, "/api/ps"),
            self.get::<Version>(node, "/api/version"),
        );
        let answered_version = version.is_ok();
        if node.books(|b| b.kind.may_have_props(answered_version)) {
            self.learn_slots(node).await;
        }
        match (tags, ps) {
            (Ok(tags), Ok(ps)) => {
                let mut inventory = inventory_of(started, tags, ps);
                inventory.version = version.ok().and_then(|v| v.version);
                self.fleet.update_inventory(node, inventory);
                self.fleet.learn(node, Evidence::PollAnswered, &self.rules);
            }
            (Err(e), _) | (_, Err(e)) => {
                log::debug!("poll of {} failed: {e}", node.name());
                // Nothing listens there: stop sending requests now, not at the next
                // health check or at the next client's refused connection.
                if matches!(e, GetError::Connect(_)) {
                    self.fleet.learn(node, Evidence::Refused, &self.rules);
                }
            }
        }
        // A cool-down that ran out: waiting requests may try the node now.
        self.fleet.announce(node);
    }

    /// Reads a llama.cpp server's slot count from `/props` (see [`slots_from_props`]); a
    /// node that has none keeps its configured `num_parallel`.
    async fn learn_slots(&self, node: &Node) {
        let slots = match self.client.get(node, "/props").await {
            Ok((200, body)) => slots_from_props(&body),
            _ => None,
        };
        let Some(slots) = slots else {
            return;
        };
        node.books(|b| b.kind.learn_props());
        let before = node.learn_parallel(slots);
        if before != slots {
            log::info!("node {} shows {slots} slots (/props)", node.name());
            // More slots may admit requests that are waiting now.
            self.fleet.wakeups.fleet_changed();
        }
    }

    /// Follows a node whose name now resolves elsewhere (a recreated container), or for
    /// the first time. A name that fails to resolve keeps its last address: a resolver's
    /// hiccup is not the node's failure.
    async fn resolve(&self, node: &Node) {
        if node.target.fixed().is_some() {
            return;
        }
        match node.target.resolve().await {
            Ok(addr) => {
                if node.set_address(addr) {
                    log::info!("node {} is at {addr}", node.name());
                    self.fleet.wakeups.fleet_changed();
                }
            }
            Err(e) => log::debug!("node {}: {e}", node.name()),
        }
    }

    async fn get<T: serde::de::DeserializeOwned>(
        &self,
        node: &Node,
        path: &str,
    ) -> Result<T, GetError> {
        let (status, body) = self.client.get(node, path).await?;
        if !(200..300).contains(&status) {
            return Err(GetError::Other(format!("{path}: status {status}")));
        }
        serde_json::from_slice(&body).map_err(|e| GetError::Other(format!("{path}: {e}")))
    }
}

fn entries(list: &ModelList) -> impl Iterator<Item = ModelEntry> + '_ {
    list.models
        .iter()
        .filter_map(|v| ModelEntry::deserialize(v).ok())
}

fn inventory_of(polled_at: Instant, tags: ModelList, ps: ModelList) -> Inventory {
    let on_disk = entries(&tags)
        .filter_map(|m| Some((m.key()?, m.size)))
        .collect();
    let resident = entries(&ps)
        .filter_map(|m| {
            let key = m.key()?;
            let resident = Resident {
                size: if m.size > 0 {
                    m.size
                } else {
                    m.size_vram.unwrap_or(0)
                },
                context_length: m.context_length,
                expires_at: m.expires_at,
            };
            Some((key, resident))
        })
        .collect();
    Inventory {
        polled_at: Some(polled_at),
        on_disk,
        resident,
        tags_entries: tags.models,
        ps_entries: ps.models,
        version: None,
    }
}

#[async_trait]
impl BackgroundService for Poller {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut tick = tokio::time::interval(self.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The first round ran before the listener opened (server.rs): the next is due
        // after one interval.
        tick.tick().await;
        loop {
            tokio::select! {
                _ = tick.tick() => self.poll_all().await,
                _ = self.fleet.poll_requested() => self.poll_wanted().await,
                _ = shutdown.changed() => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_old_and_new_shapes() {
        let tags: ModelList = serde_json::from_str(
            r#"{"models":[{"name":"llama3:8b","model":"llama3:8b","size":4700000000,"digest":"x"},
                          {"model":"qwen","size":10}]}"#,
        )
        .unwrap();
        // An older /api/ps: no context_length, no size_vram.
        let ps: ModelList = serde_json::from_str(
            r#"{"models":[{"name":"llama3:8b","size":5000000000,"expires_at":"2026-01-01T00:00:00Z"}]}"#,
        )
        .unwrap();
        let inv = inventory_of(Instant::now(), tags, ps);
        assert_eq!(inv.on_disk["llama3:8b"], 4_700_000_000);
        assert_eq!(inv.on_disk["qwen:latest"], 10);
        assert_eq!(inv.resident["llama3:8b"].size, 5_000_000_000);
        assert_eq!(inv.resident["llama3:8b"].context_length, None);
    }

    #[test]
    fn empty_reply_means_no_models() {
        let empty: ModelList = serde_json::from_str("{}").unwrap();
        assert!(empty.models.is_empty());
    }
}
