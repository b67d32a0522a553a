//! What is known about one request as it goes through the proxy.

use std::time::{Duration, Instant};

use super::{clients, usage};

/// What is known about one request as it goes; read by logging and metrics.
#[derive(Default)]
pub struct RequestCtx {
    pub started: Option<Instant>,
    /// The path label of the request: a routed endpoint, a fleet endpoint, or `other`.
    pub route: &'static str,
    pub model: Option<String>,
    /// The model's metrics label, once a node answered (see `metrics::model_label`).
    pub model_label: Option<String>,
    pub node: Option<String>,
    /// The winning node's total score.
    pub score: Option<f64>,
    pub affinity: Option<&'static str>,
    /// Routed to a node where the model was not resident.
    pub cold_load: bool,
    pub status: u16,
    pub retries: usize,
    pub ttfb: Option<Duration>,
    /// Time the request waited in corral for a slot before it was sent.
    pub waited: Option<Duration>,
    pub bytes_out: usize,
    pub client_gone: bool,
    /// The node broke off its reply after it had begun.
    pub broken: bool,
    /// Who sent the request: usage is counted under its name, and its requests wait their
    /// turn among other clients'.
    pub client: clients::Client,
    /// The reply's tokens, as it reports them.
    pub usage: Option<usage::TokenUsage>,
    /// The reply's prompt tokens, all and served from cache, as measured from it.
    pub prompt_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    /// The node's cache verdict: `warm`, `cold` or `unknown`.
    pub cache: Option<&'static str>,
}

impl RequestCtx {
    /// Tokens the fleet worked on for the request: prompt tokens evaluated (not served from
    /// cache) and completion tokens, as its reply measured them.
    pub(super) fn tokens_worked(&self) -> u64 {
        let Some(usage) = self.usage else {
            return 0;
        };
        let evaluated = match self.prompt_tokens {
            // Measured for the node's kind (Ollama's counts differ between versions).
            Some(total) => total.saturating_sub(self.cached_tokens.unwrap_or(0)),
            None => usage.prompt.saturating_sub(usage.cached.unwrap_or(0)),
        };
        evaluated + usage.completion
    }
}
