//! Reads every node's `/api/tags` and `/api/ps` in the background, so the request path only
//! reads what was learned and never waits on a node to decide.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;
use serde::Deserialize;

use super::Fleet;
use super::node::{Inventory, Node, Resident};
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
    /// The circuit breaker's cool-down, for nodes found down.
    cooldown: Duration,
    client: reqwest::Client,
    interval: Duration,
}

impl Poller {
    pub fn new(
        fleet: Arc<Fleet>,
        interval: Duration,
        timeout: Duration,
        cooldown: Duration,
    ) -> Poller {
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout)
            .build()
            .unwrap_or_default();
        Poller {
            fleet,
            cooldown,
            client,
            interval,
        }
    }

    /// Polls every node once, concurrently.
    pub async fn poll_all(&self) {
        let nodes = self.fleet.nodes();
        let polls = nodes.iter().map(|node| self.poll(node));
        let moved = futures::future::join_all(polls).await;
        if moved.contains(&true) {
            // The health checks learn the new addresses.
            if let Err(e) = self.fleet.start().await {
                log::warn!("health checks did not learn the nodes' new addresses: {e}");
            }
        }
    }

    /// Polls the nodes that asked for it ([`Fleet::poll_soon`]).
    async fn poll_wanted(&self) {
        let nodes = self.fleet.nodes();
        let wanted = nodes
            .iter()
            .filter(|n| n.poll_wanted.swap(false, Ordering::AcqRel));
        futures::future::join_all(wanted.map(|node| self.poll(node))).await;
    }

    /// Polls one node, after resolving its host name again. `true` when the node moved.
    async fn poll(&self, node: &Node) -> bool {
        let moved = self.resolve(node).await;
        let started = Instant::now();
        let base = node.url().trim_end_matches('/');
        let (tags, ps, version) = tokio::join!(
            self.get::<ModelList>(format!("{base}/api/tags")),
            self.get::<ModelList>(format!("{base}/api/ps")),
            self.get::<Version>(format!("{base}/api/version")),
        );
        match (tags, ps) {
            (Ok(tags), Ok(ps)) => {
                let mut inventory = inventory_of(started, tags, ps);
                inventory.version = version.ok().and_then(|v| v.version);
                node.update_inventory(inventory);
                node.breaker.lock().probe_succeeded(Instant::now());
            }
            (Err(e), _) | (_, Err(e)) => {
                log::debug!("poll of {} failed: {e}", node.name());
                // Nothing listens there: stop sending requests now, not at the next
                // health check or at the next client's refused connection.
                if e.is_connect() {
                    node.breaker.lock().trip(Instant::now(), self.cooldown);
                }
            }
        }
        moved
    }

    /// Follows a node whose name now resolves elsewhere (a recreated container), or for
    /// the first time. A name that fails to resolve keeps its last address: a resolver's
    /// hiccup is not the node's failure.
    async fn resolve(&self, node: &Node) -> bool {
        if node.target.fixed().is_some() {
            return false;
        }
        match node.target.resolve().await {
            Ok(addr) => {
                let moved = node.set_address(addr);
                if moved {
                    log::info!("node {} is at {addr}", node.name());
                }
                moved
            }
            Err(e) => {
                log::debug!("node {}: {e}", node.name());
                false
            }
        }
    }

    async fn get<T: serde::de::DeserializeOwned>(&self, url: String) -> Result<T, reqwest::Error> {
        self.client
            .get(url)
            .send()
            .await?
            .error_for_status()?
            .json()
            .await
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
