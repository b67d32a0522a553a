//! Accounting for a request once a node answered: the routing decision in the metrics and
//! the access log, what the reply's final statistics showed (loads, prompt tokens evaluated
//! or served from cache, whether corral's cache prediction held), tokens per client, and
//! the request's end on its node's books.

use std::sync::Arc;
use std::time::Duration;

use super::ctx::RequestCtx;
use super::usage::TokenUsage;
use crate::fleet::reply::{Reading, ReplyStats, Tail};
use crate::fleet::{Fleet, Node};
use crate::metrics::Metrics;
use crate::request::Profile;
use crate::routing::{Candidate, Decision, Dispatch, Observation, Outcome};

pub(super) struct Account {
    metrics: Arc<Metrics>,
}

/// A reply's final statistics and where they came from, to settle its request.
pub(super) struct Answered<'a> {
    pub fleet: &'a Fleet,
    pub node: &'a Arc<Node>,
    pub profile: &'a Profile,
    pub tail: &'a Tail,
    /// `[node, model]` metric labels.
    pub labels: [&'a str; 2],
}

impl Account {
    pub fn new(metrics: Arc<Metrics>) -> Account {
        Account { metrics }
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// A request waiting in corral was handed a freed slot and `taken` it, or not.
    pub fn handoff(&self, taken: bool) {
        match taken {
            true => self.metrics.handoffs_taken.inc(),
            false => self.metrics.handoffs_declined.inc(),
        }
    }

    /// An attempt failed before any reply and the next node is tried.
    pub fn attempt_failed(&self, node: &str, kind: &str) {
        self.metrics.retries.with_label_values(&[node]).inc();
        self.upstream_error(node, kind);
    }

    pub fn upstream_error(&self, node: &str, kind: &str) {
        self.metrics
            .upstream_errors
            .with_label_values(&[node, kind])
            .inc();
    }

    /// Counts the routing decision once a node has answered, with the time the request
    /// waited in corral for a slot before it was sent there.
    pub fn decision(
        &self,
        ctx: &mut RequestCtx,
        candidate: &Candidate,
        decision: &Decision,
        waited: Duration,
        labels: &[&str; 2],
    ) {
        ctx.node = Some(candidate.node.name().to_string());
        if decision.direct {
            // Nothing was chosen: no score, affinity, wait or load to count.
            return;
        }
        let wait = self.metrics.queue_wait.with_label_values(labels);
        wait.observe(waited.as_secs_f64());
        ctx.waited = Some(waited);
        if !waited.is_zero() {
            let client = [ctx.client.label()];
            self.metrics.client_waited.with_label_values(&client).inc();
            let seconds = self.metrics.client_wait_seconds.with_label_values(&client);
            seconds.inc_by(waited.as_secs_f64());
        }
        let affinity = decision.affinity_for(candidate.node.id).as_str();
        let score = candidate.scores.total();
        self.metrics.affinity.with_label_values(&[affinity]).inc();
        self.metrics.winning_score.observe(score);
        if !candidate.resident {
            self.metrics.cold_loads.with_label_values(labels).inc();
        }
        ctx.score = Some(score);
        ctx.affinity = Some(affinity);
        ctx.cold_load = !candidate.resident;
    }

    /// Settles a reply that ended normally: what its final chunk showed goes to the metrics,
    /// the access log and the node's books, and the request's slot is released. The reply's
    /// status and first byte are as `ctx` recorded them.
    pub fn settle(&self, ctx: &mut RequestCtx, mut dispatch: Dispatch, reply: Answered) {
        let ok = ctx.status < 500;
        let (stats, usage) = super::usage::final_figures(reply.tail, ok && ctx.status < 400);
        if !ok {
            self.upstream_error(reply.labels[0], "status_5xx");
        }
        let observation = match &stats {
            Some(stats) if ok => dispatch.observe(stats),
            _ => None,
        };
        if let Some(stats) = &stats {
            self.stats(stats, observation.as_ref(), reply.profile, &reply.labels);
            if stats.loaded_model() {
                // The load may have evicted another model: read what the node holds now
                // rather than count this one on top of the others.
                reply.fleet.poll_soon(reply.node);
            }
        }
        if let Some(o) = &observation {
            ctx.prompt_tokens = Some(o.measured.total);
            ctx.cached_tokens = o.measured.cached;
            ctx.cache = Some(o.observed.as_str());
        }
        if let Some(usage) = usage {
            self.usage(ctx.client.label(), reply.labels[1], usage);
        }
        ctx.usage = usage;
        let outcome = Outcome {
            ok,
            ttfb: ctx.ttfb,
            prefill_tps: dispatch.prefill_tps(),
            decode_tps: stats.as_ref().and_then(|s| dispatch.decode_tps(s)),
            load_s: stats.as_ref().and_then(ReplyStats::load_seconds),
        };
        dispatch.finish(outcome);
    }

    /// Counts what the reply's final statistics verify: loads, prompt tokens evaluated or
    /// served from cache (as measured for the node's kind), and whether corral's
    /// prediction of the cache held.
    fn stats(
        &self,
        stats: &ReplyStats,
        observation: Option<&Observation>,
        profile: &Profile,
        labels: &[&str; 2],
    ) {
        if stats.loaded_model() {
            self.metrics.model_loads.with_label_values(labels).inc();
        }
        let (node, model) = (labels[0], labels[1]);
        if let Some(o) = observation {
            self.metrics
                .cache_predictions
                .with_label_values(&[node, o.predicted.as_str(), o.observed.as_str()])
                .inc();
        }
        let counts = PromptCounts::of(stats, observation);
        let tokens = |kind: &str, n: u64| {
            self.metrics
                .prompt_tokens
                .with_label_values(&[node, model, kind])
                .inc_by(n)
        };
        if let Some(evaluated) = counts.evaluated {
            tokens("evaluated", evaluated);
            self.metrics
                .prompt_tokens_estimated
                .with_label_values(labels)
                .inc_by(u64::from(profile.prompt_tokens));
        }
        if let Some(cached) = counts.cached {
            tokens("cached", cached);
        }
    }

    /// Counts a reply's tokens under its client's key name.
    pub fn usage(&self, client: &str, model: &str, usage: TokenUsage) {
        let client = if client.is_empty() {
            crate::config::ANONYMOUS
        } else {
            client
        };
        let count = |kind: &str, n: u64| {
            self.metrics
                .client_tokens
                .with_label_values(&[client, model, kind])
                .inc_by(n)
        };
        count("prompt", usage.prompt);
        count("completion", usage.completion);
        if let Some(cached) = usage.cached {
            count("cached", cached);
        }
    }
}

/// The prompt tokens a reply shows as evaluated and as served from cache, where it says.
#[derive(Debug, Default, PartialEq, Eq)]
struct PromptCounts {
    evaluated: Option<u64>,
    cached: Option<u64>,
}

impl PromptCounts {
    /// A generation's counts are its cache measurement (which knows how the node's kind
    /// counts); anything else (an embedding) evaluated whatever it counted.
    fn of(stats: &ReplyStats, observation: Option<&Observation>) -> PromptCounts {
        if let Some(o) = observation {
            return PromptCounts {
                evaluated: o.measured.evaluated(),
                cached: o.measured.cached,
            };
        }
        match stats.reading() {
            Some(Reading::Exact {
                evaluated, cached, ..
            }) => PromptCounts {
                evaluated: Some(evaluated),
                cached: Some(cached),
            },
            Some(Reading::OllamaCount { count, .. }) => PromptCounts {
                evaluated: Some(count),
                cached: None,
            },
            _ => PromptCounts::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(json: &str) -> ReplyStats {
        ReplyStats::parse(json.as_bytes()).unwrap()
    }

    #[test]
    fn an_embedding_counts_what_it_reports_as_evaluated() {
        let ollama = stats(r#"{"prompt_eval_count": 12}"#);
        assert_eq!(
            PromptCounts::of(&ollama, None),
            PromptCounts {
                evaluated: Some(12),
                cached: None
            }
        );
        let llama_cpp = stats(r#"{"timings": {"prompt_n": 5, "cache_n": 20}}"#);
        assert_eq!(
            PromptCounts::of(&llama_cpp, None),
            PromptCounts {
                evaluated: Some(5),
                cached: Some(20)
            }
        );
        let openai = stats(r#"{"usage": {"prompt_tokens": 30}}"#);
        assert_eq!(PromptCounts::of(&openai, None), PromptCounts::default());
    }

    #[test]
    fn a_generation_counts_its_cache_measurement() {
        use crate::fleet::warm::{Measured, Observed};
        use crate::routing::AffinityResult;
        // Ollama >= 0.30.1 counts cached and evaluated tokens together: the measurement,
        // not the raw count, says how many were evaluated.
        let reply = stats(r#"{"prompt_eval_count": 1000, "prompt_eval_duration": 10}"#);
        let observation = Observation {
            predicted: AffinityResult::Hit,
            measured: Measured {
                total: 1000,
                cached: Some(990),
            },
            observed: Observed::Warm,
        };
        let counts = PromptCounts::of(&reply, Some(&observation));
        assert_eq!(counts.cached, Some(990));
        assert_eq!(counts.evaluated, Some(10));
    }
}
