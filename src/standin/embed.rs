//! Embedding requests, shared by `/api/embed`, `/api/embeddings` and `/v1/embeddings`. They
//! need the model resident (and so can trigger a load) but use no slot and no prefix cache.

use std::time::{Duration, Instant};

use super::ServedRequest;
use super::node::{Capability, Node};
use super::prompt::{embedding, tokens_in};
use super::residency::KeepAlive;

use super::error::StandinError;

/// What an embedding request asks for.
#[derive(Clone, Debug)]
pub struct EmbedJob {
    pub path: &'static str,
    pub model: String,
    pub inputs: Vec<String>,
    pub num_ctx: Option<u32>,
    pub keep_alive: Option<KeepAlive>,
}

/// The embeddings and the costs Ollama reports with them.
#[derive(Clone, Debug)]
pub struct Embedded {
    pub vectors: Vec<Vec<f32>>,
    pub prompt_tokens: u32,
    pub load_duration: Duration,
    pub total_duration: Duration,
}

pub async fn embed(node: &Node, job: EmbedJob) -> Result<Embedded, StandinError> {
    let started = Instant::now();
    let model = node.model_for(&job.model, Capability::Embed)?;
    let want = node.want(model, job.num_ctx, job.keep_alive);
    let embedding_only = want.model.is_embedding_only();
    let lease = node.residency.acquire(&want).await?;
    let _turn = match embedding_only {
        true => Some(node.embedding_turn(&want.model.name).await),
        false => None,
    };
    let prompt_tokens = job.inputs.iter().map(|i| tokens_in(i.len())).sum();
    node.record(ServedRequest {
        endpoint: job.path.to_string(),
        model: want.model.name.clone(),
        prompt_tokens,
        cached_tokens: 0,
        cold_load: lease.cold_load,
        slot: 0,
    });
    tokio::time::sleep(node.cfg.prefill_per_token * prompt_tokens).await;
    Ok(Embedded {
        vectors: job.inputs.iter().map(|i| embedding(i)).collect(),
        prompt_tokens,
        load_duration: lease.load_duration,
        total_duration: started.elapsed(),
    })
}
