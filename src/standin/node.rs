//! The state one stand-in node keeps across requests (and across stop/restart): its
//! configuration, resident models, current fault and the log of served requests.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::watch;

use super::ServedRequest;
use super::config::{Fault, StandinConfig, StandinModel};
use super::error::StandinError;
use super::residency::{KeepAlive, Residency, Want};

/// Shared by every handler of one node.
#[derive(Debug)]
pub struct Node {
    pub cfg: StandinConfig,
    pub residency: Arc<Residency>,
    fault: watch::Sender<Fault>,
    log: Mutex<Vec<ServedRequest>>,
    /// How long each slot taken had been free (see [`Node::record_handoff`]).
    handoffs: Mutex<Vec<Duration>>,
    ids: AtomicU64,
    /// Generating requests open per model: now, and the most at once.
    open: Mutex<std::collections::HashMap<String, (u32, u32)>>,
    /// One embedding at a time per embedding model (see [`Node::embedding_turn`]).
    embed_lines: Mutex<std::collections::HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

/// Handoffs a node keeps (see [`Node::record_handoff`]).
const MAX_HANDOFFS: usize = 1 << 16;

/// What kind of work a request asks of a model, to refuse chat with an embedding model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Capability {
    Chat,
    Generate,
    Embed,
}

impl Node {
    pub fn new(cfg: StandinConfig) -> Result<Arc<Self>, StandinError> {
        let residency = Residency::new(cfg.clone())?;
        Ok(Arc::new(Node {
            cfg,
            residency,
            fault: watch::Sender::new(Fault::None),
            log: Mutex::new(Vec::new()),
            handoffs: Mutex::new(Vec::new()),
            ids: AtomicU64::new(0),
            open: Mutex::default(),
            embed_lines: Mutex::default(),
        }))
    }

    /// Waits for the model's turn to embed. Ollama loads embedding models with one
    /// parallel slot (`server/sched.go`: "Embedding models should always be loaded with
    /// parallel=1"), so their requests run one after another.
    pub async fn embedding_turn(&self, model: &str) -> tokio::sync::OwnedMutexGuard<()> {
        let line = self
            .embed_lines
            .lock()
            .entry(model.to_string())
            .or_default()
            .clone();
        line.lock_owned().await
    }

    pub fn fault(&self) -> Fault {
        *self.fault.borrow()
    }

    pub fn set_fault(&self, fault: Fault) {
        self.fault.send_replace(fault);
    }

    /// Resolves once the node is no longer hung.
    pub async fn hang_released(&self) {
        let mut rx = self.fault.subscribe();
        // The sender lives as long as the node, so this only ends when the fault changes.
        let _ = rx.wait_for(|f| *f != Fault::Hang).await;
    }

    /// The model on disk that a request names, checked for the capability it needs.
    pub fn model_for(&self, name: &str, need: Capability) -> Result<StandinModel, StandinError> {
        let model = self
            .cfg
            .model(name)
            .cloned()
            .ok_or_else(|| StandinError::model_not_found(name))?;
        match need {
            Capability::Chat if model.is_embedding_only() => {
                Err(StandinError::unsupported(&model.name, "chat"))
            }
            Capability::Generate if model.is_embedding_only() => {
                Err(StandinError::unsupported(&model.name, "generate"))
            }
            _ => Ok(model),
        }
    }

    /// What a request needs from residency: the model, with the request's `num_ctx` or the
    /// model's default (so a request without `num_ctx` after one with it reloads, as in
    /// Ollama), kept alive as the request asks or for the node's default.
    pub fn want(
        &self,
        model: StandinModel,
        num_ctx: Option<u32>,
        keep_alive: Option<KeepAlive>,
    ) -> Want {
        Want {
            context: num_ctx.unwrap_or(model.context_length),
            keep_alive: keep_alive.unwrap_or(KeepAlive::For(self.cfg.keep_alive)),
            model,
        }
    }

    pub fn record(&self, served: ServedRequest) {
        log::debug!(
            "{}: {} {} prompt={} cached={} cold={} slot={}",
            self.cfg.name,
            served.endpoint,
            served.model,
            served.prompt_tokens,
            served.cached_tokens,
            served.cold_load,
            served.slot
        );
        self.log.lock().push(served);
    }

    pub fn log(&self) -> Vec<ServedRequest> {
        self.log.lock().clone()
    }

    /// A slot was taken after being free for `free_for`. Kept up to [`MAX_HANDOFFS`] (the
    /// demo runs for ever; a benchmark reads its first ones).
    pub fn record_handoff(&self, free_for: Duration) {
        let mut handoffs = self.handoffs.lock();
        if handoffs.len() < MAX_HANDOFFS {
            handoffs.push(free_for);
        }
    }

    pub fn handoffs(&self) -> Vec<Duration> {
        self.handoffs.lock().clone()
    }

    /// A generating request for `model` arrived; it counts as open until the guard drops.
    pub fn opened(self: &Arc<Self>, model: &str) -> Open {
        let mut open = self.open.lock();
        let (now, most) = open.entry(model.to_string()).or_default();
        *now += 1;
        *most = (*most).max(*now);
        Open {
            node: self.clone(),
            model: model.to_string(),
        }
    }

    /// The most generating requests per model the node had open at once.
    pub fn most_open(&self) -> std::collections::HashMap<String, u32> {
        let open = self.open.lock();
        open.iter()
            .map(|(m, (_, most))| (m.clone(), *most))
            .collect()
    }

    /// A number for response ids (`chatcmpl-N`), unique within the node.
    pub fn next_id(&self) -> u64 {
        self.ids.fetch_add(1, Ordering::Relaxed) + 1
    }
}

/// A generating request the node has open (see [`Node::opened`]).
#[derive(Debug)]
pub struct Open {
    node: Arc<Node>,
    model: String,
}

impl Drop for Open {
    fn drop(&mut self) {
        if let Some((now, _)) = self.node.open.lock().get_mut(&self.model) {
            *now = now.saturating_sub(1);
        }
    }
}
