//! A stand-in Ollama node: simulated, fast, deterministic and in-process.
//!
//! It serves the demo fleet, the integration tests and the benchmarks, so it behaves like a
//! real Ollama in every way that matters to a cache-aware router:
//!
//! - **Models and memory.** Models on disk have sizes; resident models must fit the node's
//!   memory. A request for a model that is not resident waits `load_time` after idle
//!   models are evicted in Ollama's order (`residency`). Idle models unload after
//!   `keep_alive`; a different `num_ctx` reloads.
//! - **Slots and prefix caching.** Each resident model has `num_parallel` slots holding the
//!   rendered text of their last request and reply; a request takes the slot sharing the
//!   longest prefix and only pays prefill for the rest (`slots`, `prompt`).
//! - **Timing.** Prefill costs `prefill_per_token` per uncached prompt token, then output
//!   tokens stream one every `decode_per_token`, each flushed as its own chunk (`stream`).
//!   The slots of a model share its compute as the real servers' batches do (`engine`):
//!   prompts evaluated at once share the prefill rate, and a generating slot waits for the
//!   batch its neighbours' prompts fill.
//! - **Wire formats.** Ollama's native API and its OpenAI-compatible `/v1` API, in the shapes
//!   the `ollama-rs` and `async-openai` crates parse (`wire`, `ollama`, `openai`).
//! - **Faults.** Hanging, cutting streams and failing with a status on command, and
//!   stopping/restarting the listener with connections aborted (`server`).
//!
//! The request path: `api` routes, `ollama`/`openai` parse a body into a job,
//! `generate` resolves the model, takes a slot and prefills, `stream` decodes.
//!
//! Beside it, [`RedisServer`] starts a real `redis-server` for the tests and benchmarks of
//! replicas sharing state.

mod api;
mod catalog;
mod clock;
mod compat;
mod config;
mod embed;
mod engine;
mod error;
mod generate;
mod llama_server;
mod node;
mod ollama;
mod openai;
mod parse;
mod port;
mod prompt;
mod redis;
mod residency;
mod server;
mod slots;
mod stream;
mod wire;

#[cfg(test)]
mod tests;

use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;

pub use config::{Fault, GIB, StandinConfig, StandinKind, StandinModel, demo_fleet};
pub use redis::RedisServer;
pub use residency::ChurnCounts;

use node::Node;
use server::Server;

/// One generating or embedding request the node served, as the node saw it.
#[derive(Clone, Debug)]
pub struct ServedRequest {
    /// The endpoint, e.g. `/api/chat`.
    pub endpoint: String,
    pub model: String,
    /// Prompt tokens in total.
    pub prompt_tokens: u32,
    /// Prompt tokens reused from the slot's prefix cache.
    pub cached_tokens: u32,
    /// The model had to be loaded for this request (it triggered the load or waited for it).
    pub cold_load: bool,
    /// The slot that served it (0 for embeddings, which use no slot).
    pub slot: usize,
}

/// A running stand-in node. Dropping it stops serving.
#[derive(Debug)]
pub struct StandinNode {
    node: Arc<Node>,
    server: Server,
}

impl StandinNode {
    /// Starts a node listening on `addr` (port 0 picks a free port). Fails if the address
    /// cannot be bound, or if a preloaded model is unknown or the preloads do not fit.
    pub async fn start(cfg: StandinConfig, addr: SocketAddr) -> io::Result<StandinNode> {
        let node = Node::new(cfg)?;
        let server = Server::start(api::router(Arc::clone(&node)), addr).await?;
        log::info!("stand-in {} listening on {}", node.cfg.name, server.addr());
        Ok(StandinNode { node, server })
    }

    pub fn addr(&self) -> SocketAddr {
        self.server.addr()
    }

    /// Base URL, e.g. `http://127.0.0.1:41234`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr())
    }

    pub fn name(&self) -> &str {
        &self.node.cfg.name
    }

    /// What the node was started with.
    pub fn config(&self) -> &StandinConfig {
        &self.node.cfg
    }

    /// Applies `fault` to every request that arrives from now on.
    pub fn set_fault(&self, fault: Fault) {
        self.node.set_fault(fault);
    }

    /// Closes the listener and aborts open connections, including replies in flight. Once
    /// it returns, connecting is refused. Model and slot state are kept for [`restart`].
    ///
    /// [`restart`]: StandinNode::restart
    pub async fn stop(&self) {
        self.server.stop().await;
    }

    /// Listens again on the same port with the same state. A no-op if not stopped.
    pub async fn restart(&self) -> io::Result<()> {
        self.server.restart().await
    }

    /// For each slot a generating request took that had served one before: how long it had
    /// been free. While requests wait for every slot (in the node's queue or a router's),
    /// that is the time from a reply's end to the next request's start there.
    pub fn handoffs(&self) -> Vec<std::time::Duration> {
        self.node.handoffs()
    }

    /// The most generating requests per model the node had open at once (in its queue or
    /// its slots), since it started.
    pub fn most_open(&self) -> std::collections::HashMap<String, u32> {
        self.node.most_open()
    }

    /// Every generating and embedding request served so far, in order of service start.
    pub fn log(&self) -> Vec<ServedRequest> {
        self.node.log()
    }

    /// How many models this node has loaded, evicted and unloaded at keep-alive's end since
    /// it started: what the benchmarks report as cold loads and evictions.
    pub fn churn(&self) -> ChurnCounts {
        self.node.residency.churn()
    }

    /// Names of the models resident now (idle models past their keep-alive are unloaded
    /// first).
    pub fn resident(&self) -> Vec<String> {
        self.node
            .residency
            .with_ready(|resident| resident.iter().map(|r| r.model.name.clone()).collect())
    }
}

impl Drop for StandinNode {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// Starts one node per config, each on its own free port of 127.0.0.1.
pub async fn start_fleet(cfgs: Vec<StandinConfig>) -> io::Result<Vec<StandinNode>> {
    let mut nodes = Vec::with_capacity(cfgs.len());
    for cfg in cfgs {
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
        nodes.push(StandinNode::start(cfg, addr).await?);
    }
    Ok(nodes)
}
