//! Live configuration changes: SIGHUP, or a change to the file when `watch_config` is set,
//! re-reads the configuration. Nodes are added, removed or re-weighted without dropping
//! requests in flight; an invalid file is rejected with its error logged, and the
//! configuration in force stays.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;
use tokio::signal::unix::{SignalKind, signal};

use crate::config::Config;
use crate::routing::Router;

pub struct Reloader {
    path: PathBuf,
    router: Arc<Router>,
}

impl Reloader {
    pub fn new(path: PathBuf, router: Arc<Router>) -> Reloader {
        Reloader { path, router }
    }

    /// Reads the file and applies it. On error nothing changes.
    pub async fn reload(&self) -> Result<String, String> {
        let config = Config::load(&self.path)?;
        let current = self.router.config();
        let fleet = &self.router.fleet;
        let changes = fleet.apply(&config.nodes)?;
        let restart_only = needs_restart(&current, &config);
        self.router.set_config(config);
        let mut summary = format!(
            "configuration reloaded: {} nodes (added {:?}, removed {:?})",
            changes.kept.len() + changes.added.len(),
            changes.added,
            changes.removed
        );
        if !restart_only.is_empty() {
            summary.push_str(&format!(
                "; changes to {} take effect only after a restart",
                restart_only.join(", ")
            ));
        }
        Ok(summary)
    }

    async fn reload_and_log(&self) {
        match self.reload().await {
            Ok(summary) => log::info!("{summary}"),
            Err(e) => log::error!("configuration not reloaded, the previous one stays: {e}"),
        }
    }
}

/// Settings read once at start: listeners, background task intervals, the affinity table.
fn needs_restart(old: &Config, new: &Config) -> Vec<&'static str> {
    let fields = [
        ("listen", old.listen != new.listen),
        ("metrics_listen", old.metrics_listen != new.metrics_listen),
        ("admin_listen", old.admin_listen != new.admin_listen),
        ("access_log", old.access_log != new.access_log),
        ("health", !same(&old.health, &new.health)),
        ("poll", !same(&old.poll, &new.poll)),
        ("affinity", !same(&old.affinity, &new.affinity)),
        ("watch_config", old.watch_config != new.watch_config),
    ];
    fields
        .into_iter()
        .filter(|(_, changed)| *changed)
        .map(|(name, _)| name)
        .collect()
}

fn same<T: serde::Serialize>(a: &T, b: &T) -> bool {
    serde_json::to_value(a).ok() == serde_json::to_value(b).ok()
}

/// The file's modification time and length: a change to either is a change.
fn stamp(path: &PathBuf) -> Option<(SystemTime, u64)> {
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.modified().ok()?, meta.len()))
}

#[async_trait]
impl BackgroundService for Reloader {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut hangup = match signal(SignalKind::hangup()) {
            Ok(s) => s,
            Err(e) => {
                log::error!("cannot listen for SIGHUP, reload by signal is off: {e}");
                return;
            }
        };
        let watch = self.router.config().watch_config;
        // Without watching, the timer never fires.
        let mut tick = tokio::time::interval(watch.unwrap_or(Duration::from_secs(3600)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut seen = stamp(&self.path);
        loop {
            tokio::select! {
                _ = hangup.recv() => {
                    log::info!("SIGHUP: reloading {}", self.path.display());
                    self.reload_and_log().await;
                    seen = stamp(&self.path);
                }
                _ = tick.tick(), if watch.is_some() => {
                    let now = stamp(&self.path);
                    if now != seen {
                        seen = now;
                        log::info!("{} changed: reloading", self.path.display());
                        self.reload_and_log().await;
                    }
                }
                _ = shutdown.changed() => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restart_only_keys_are_named() {
        let old = Config::default();
        let mut new = Config::default();
        assert!(needs_restart(&old, &new).is_empty());
        new.listen = "127.0.0.1:1".into();
        new.poll.interval = Duration::from_secs(9);
        new.weights.model_loaded = 10.0;
        assert_eq!(needs_restart(&old, &new), vec!["listen", "poll"]);
    }
}
