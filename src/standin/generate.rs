//! One generating request from parsed job to first token: resolve the model, get it resident
//! (waiting for a load if needed), take a slot (waiting in line if all are busy), and have
//! the model's engine evaluate the prompt tokens the slot does not already hold, in batches
//! shared with the other slots ([`super::engine`]). Decoding is in [`super::stream`].

use std::sync::Arc;
use std::time::Instant;

use axum::response::Response;

use super::ServedRequest;
use super::clock::unix_now;
use super::config::Fault;
use super::engine::Run;
use super::error::StandinError;
use super::node::{Node, Open};
use super::prompt::{fit_to_context, reply_tokens, tokens_in};
use super::residency::{KeepAlive, ModelLease};
use super::slots::SlotLease;
use super::stream::respond;
use super::wire::{Api, Stats, Wire};

/// A generating request, whatever API it came in through.
#[derive(Clone, Debug)]
pub struct Job {
    pub api: Api,
    pub model: String,
    /// The rendered prompt (see [`super::prompt`]).
    pub prompt: Vec<u8>,
    /// Output tokens asked for; `None` (or negative, Ollama's "unlimited") means the node's
    /// `reply_tokens`.
    pub max_tokens: Option<i64>,
    pub num_ctx: Option<u32>,
    pub keep_alive: Option<KeepAlive>,
    pub stream: bool,
    pub include_usage: bool,
}

/// A request past prefill, holding its model and slot until decoding ends.
#[derive(Debug)]
pub struct Generation {
    pub wire: Wire,
    pub stream: bool,
    /// The streamed pieces of the reply, one per token.
    pub tokens: Vec<String>,
    pub stats: Stats,
    /// The request's work on the model's engine, which paces the output tokens.
    pub run: Run,
    /// `Some(n)` when the node was told to cut the connection after `n` body chunks.
    pub cut_after: Option<u32>,
    started: Instant,
    prompt: Vec<u8>,
    slot: SlotLease,
    _model: ModelLease,
    _open: Open,
}

impl Generation {
    /// Ends decoding: the slot keeps prompt plus reply, the slot and model are released,
    /// and the statistics get their measured decode time and total.
    pub fn finish(self) -> Stats {
        let reply = self.tokens.concat();
        let mut held = self.prompt;
        held.extend(self.wire.api.held_reply(&reply));
        self.slot.finish(held);
        let mut stats = self.stats;
        stats.eval_duration = self.run.decode_duration();
        stats.total_duration = self.started.elapsed();
        stats
    }
}

/// Serves a generating request end to end.
pub async fn run(node: Arc<Node>, job: Job) -> Response {
    let api = job.api;
    let open = node.opened(&job.model);
    match prepare(&node, job, open).await {
        Ok(generation) => respond(generation).await,
        Err(e) => api.error(e),
    }
}

/// Everything up to the first output token.
async fn prepare(node: &Node, job: Job, open: Open) -> Result<Generation, StandinError> {
    let started = Instant::now();
    let cut_after = match node.fault() {
        Fault::CutMidStream(n) => Some(n),
        _ => None,
    };
    let model = node.model_for(&job.model, job.api.capability())?;
    let want = node.want(model, job.num_ctx, job.keep_alive);
    let lease = node.residency.acquire(&want).await?;
    let prompt = fit_to_context(job.prompt, lease.context);
    let slot = lease.slots.acquire(&prompt).await;
    if let Some(free_for) = slot.free_for() {
        node.record_handoff(free_for);
    }
    let mut stats = stats_before_decode(node, &lease, &slot, &prompt, job.max_tokens);
    node.record(ServedRequest {
        endpoint: job.api.path().to_string(),
        model: want.model.name.clone(),
        prompt_tokens: stats.prompt_tokens,
        cached_tokens: stats.cached_tokens,
        cold_load: lease.cold_load,
        slot: slot.index(),
    });
    let mut run = slot.run(stats.prompt_eval_count(), stats.eval_count);
    stats.prompt_eval_duration = run.prompt_evaluated().await;
    Ok(Generation {
        wire: Wire {
            api: job.api,
            model: job.model,
            id: openai_id(job.api, node.next_id()),
            created: unix_now(),
            include_usage: job.include_usage,
            kind: node.cfg.kind,
        },
        stream: job.stream,
        tokens: reply_tokens(&prompt, stats.eval_count),
        stats,
        run,
        cut_after,
        started,
        prompt,
        slot,
        _model: lease,
        _open: open,
    })
}

/// The counts and load time, known once the slot is chosen; the engine measures the rest.
fn stats_before_decode(
    node: &Node,
    lease: &ModelLease,
    slot: &SlotLease,
    prompt: &[u8],
    max_tokens: Option<i64>,
) -> Stats {
    let prompt_tokens = tokens_in(prompt.len());
    let cached_tokens = slot.cached_tokens();
    let eval_count = output_tokens(max_tokens, node.cfg.reply_tokens);
    Stats {
        prompt_tokens,
        cached_tokens,
        eval_count,
        load_duration: lease.load_duration,
        ..Stats::default()
    }
}

/// Output length: what the request asks for, or the node's default when it does not say or
/// asks for "unlimited" (negative `num_predict`).
pub fn output_tokens(asked: Option<i64>, default: u32) -> u32 {
    match asked {
        Some(n) if n >= 0 => u32::try_from(n).unwrap_or(u32::MAX),
        _ => default,
    }
}

fn openai_id(api: Api, n: u64) -> String {
    match api {
        Api::OpenAiCompletion => format!("cmpl-{n}"),
        Api::Responses => format!("resp_{n}"),
        Api::AnthropicMessages => format!("msg_{n}"),
        _ => format!("chatcmpl-{n}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_length_defaults_and_limits() {
        assert_eq!(output_tokens(None, 8), 8);
        assert_eq!(output_tokens(Some(-1), 8), 8);
        assert_eq!(output_tokens(Some(0), 8), 0);
        assert_eq!(output_tokens(Some(3), 8), 3);
    }
}
