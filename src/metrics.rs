//! Prometheus metrics, in the `prometheus` crate's default registry that Pingora's
//! Prometheus service serves.
//!
//! Events (requests, retries, cold loads...) are counted as they happen. Fleet state (health,
//! in-flight counts, resident models) is read when Prometheus scrapes, by [`FleetCollector`],
//! so gauges are never stale and the request path does no gauge bookkeeping. Labels stay
//! bounded: nodes come from the config, and a model label only names models some node
//! reports (others are counted as `other`).

use std::sync::Arc;

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    register_histogram, register_histogram_vec, register_int_counter_vec,
};

use crate::fleet::Fleet;
use crate::routing::Router;

/// Request and TTFT latencies from a fast cached reply to a cold load of a big model.
const SECONDS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];
const SCORES: &[f64] = &[
    -50.0, -25.0, 0.0, 25.0, 50.0, 75.0, 90.0, 100.0, 110.0, 125.0, 150.0,
];

pub struct Metrics {
    pub requests: IntCounterVec,
    pub affinity: IntCounterVec,
    pub cold_loads: IntCounterVec,
    pub model_loads: IntCounterVec,
    pub prompt_tokens: IntCounterVec,
    pub prompt_tokens_estimated: IntCounterVec,
    pub cache_predictions: IntCounterVec,
    pub retries: IntCounterVec,
    pub upstream_errors: IntCounterVec,
    pub duration: HistogramVec,
    pub ttft: HistogramVec,
    pub queue_wait: HistogramVec,
    pub winning_score: Histogram,
    /// Tokens per client key name (config names, or `anonymous`), model and kind.
    pub client_tokens: IntCounterVec,
    /// Requests refused for a client's limit, per key name and limit.
    pub client_refused: IntCounterVec,
    /// Requests that waited in corral for a slot, per key name.
    pub client_waited: IntCounterVec,
    /// Time requests waited in corral for a slot, per key name.
    pub client_wait_seconds: prometheus::CounterVec,
    /// Slots freed on a node and handed to a waiting request that took the slot, and that
    /// declined it: `corral_handoffs_total`'s two series, looked up once (both exist at 0
    /// from start).
    pub handoffs_taken: IntCounter,
    pub handoffs_declined: IntCounter,
}

impl Metrics {
    /// Registers corral's metrics in the default registry. Once per process.
    pub fn register() -> prometheus::Result<Metrics> {
        let handoffs = register_int_counter_vec!(
            "corral_handoffs_total",
            "Slots freed on a node and handed to a request waiting in corral, by outcome: taken (sent there), declined (it went on waiting, or went elsewhere).",
            &["outcome"]
        )?;
        Ok(Metrics {
            requests: register_int_counter_vec!(
                "corral_requests_total",
                "Requests answered, by node (none when no node was chosen), model, endpoint and status.",
                &["node", "model", "endpoint", "status"]
            )?,
            affinity: register_int_counter_vec!(
                "corral_affinity_total",
                "Routing decisions by affinity result: hit (sent where the conversation is warm), miss, new.",
                &["result"]
            )?,
            cold_loads: register_int_counter_vec!(
                "corral_cold_loads_total",
                "Model loads corral caused: requests sent to a node where the model was neither resident nor already loading.",
                &["node", "model"]
            )?,
            model_loads: register_int_counter_vec!(
                "corral_model_loads_total",
                "Model loads seen in replies (load_duration of at least 0.1 s).",
                &["node", "model"]
            )?,
            prompt_tokens: register_int_counter_vec!(
                "corral_prompt_tokens_total",
                "Prompt tokens as nodes reported them: evaluated, or served from the prefix cache.",
                &["node", "model", "kind"]
            )?,
            prompt_tokens_estimated: register_int_counter_vec!(
                "corral_prompt_tokens_estimated_total",
                "Prompt tokens as corral estimated them (4 bytes per token) for replies that reported evaluated tokens.",
                &["node", "model"]
            )?,
            cache_predictions: register_int_counter_vec!(
                "corral_cache_predictions_total",
                "Replies by what corral predicted of the node's cache (hit, host, miss, new) and what the reply showed (warm, cold, unknown).",
                &["node", "predicted", "observed"]
            )?,
            retries: register_int_counter_vec!(
                "corral_retries_total",
                "Attempts on a node that failed before any reply and moved on to the next node.",
                &["node"]
            )?,
            upstream_errors: register_int_counter_vec!(
                "corral_upstream_errors_total",
                "Failures talking to nodes, by kind.",
                &["node", "kind"]
            )?,
            duration: register_histogram_vec!(
                HistogramOpts::new(
                    "corral_request_duration_seconds",
                    "Time from the request's arrival to the reply's last byte."
                )
                .buckets(SECONDS.to_vec()),
                &["node", "model"]
            )?,
            ttft: register_histogram_vec!(
                HistogramOpts::new(
                    "corral_time_to_first_token_seconds",
                    "Time from sending the request to a node until the reply's first body byte."
                )
                .buckets(SECONDS.to_vec()),
                &["node", "model"]
            )?,
            queue_wait: register_histogram_vec!(
                HistogramOpts::new(
                    "corral_queue_wait_seconds",
                    "Time a routed request waited in corral before it was sent to the node that answered: for a free slot, or for a node to come back (0 when it waited for neither)."
                )
                .buckets(SECONDS.to_vec()),
                &["node", "model"]
            )?,
            winning_score: register_histogram!(
                HistogramOpts::new(
                    "corral_winning_score",
                    "Total score of the node each request was routed to."
                )
                .buckets(SCORES.to_vec())
            )?,
            client_tokens: register_int_counter_vec!(
                "corral_client_tokens_total",
                "Tokens by client (the api_keys name, or anonymous), model and kind: prompt (all prompt tokens), cached (of those, served from cache, where the node says), completion.",
                &["client", "model", "kind"]
            )?,
            client_refused: register_int_counter_vec!(
                "corral_client_refused_total",
                "Requests refused with 429 for a client's limit, by client (the api_keys name, or anonymous) and limit: max_requests, tokens_per_minute, per_client (queue.per_client, per address).",
                &["client", "limit"]
            )?,
            client_waited: register_int_counter_vec!(
                "corral_client_waited_total",
                "Requests that waited in corral for a slot before they were sent, by client.",
                &["client"]
            )?,
            client_wait_seconds: prometheus::register_counter_vec!(
                "corral_client_wait_seconds_total",
                "Time requests waited in corral for a slot, by client.",
                &["client"]
            )?,
            handoffs_taken: handoffs.with_label_values(&["taken"]),
            handoffs_declined: handoffs.with_label_values(&["declined"]),
        })
    }
}

/// Every `kind` of `corral_upstream_errors_total` (see `proxy/forward.rs` and `proxy/relay.rs`).
pub const UPSTREAM_ERROR_KINDS: &[&str] = &[
    "connect",
    "reset",
    "first_byte_timeout",
    "broken_stream",
    "idle_timeout",
    "status_5xx",
];

impl Metrics {
    /// Creates at 0 the counters the dashboard queries, so that its panels read 0 on a
    /// healthy fleet rather than "No data" until the first event: per node, retries and
    /// every kind of upstream error; per node and model it reports, cold loads, loads and
    /// prompt tokens; every affinity result. `corral_requests_total` is left to requests:
    /// its endpoint and status are not known before one arrives.
    pub fn count_fleet(&self, fleet: &Fleet) {
        for result in ["hit", "miss", "new"] {
            self.affinity.with_label_values(&[result]);
        }
        for node in fleet.nodes().iter() {
            let name = node.name();
            self.retries.with_label_values(&[name]);
            for kind in UPSTREAM_ERROR_KINDS {
                self.upstream_errors.with_label_values(&[name, kind]);
            }
            let inv = node.inventory();
            let models = inv.on_disk.keys().chain(inv.resident.keys());
            for model in models {
                let labels = [name, model.as_str()];
                self.cold_loads.with_label_values(&labels);
                self.model_loads.with_label_values(&labels);
                self.prompt_tokens_estimated.with_label_values(&labels);
                for kind in ["evaluated", "cached"] {
                    self.prompt_tokens
                        .with_label_values(&[name, model.as_str(), kind]);
                }
            }
        }
    }
}

/// The model label: the model if some node reports it, else `other`.
pub fn model_label<'a>(fleet: &Fleet, model: &'a str) -> &'a str {
    let known = fleet.nodes().iter().any(|n| {
        let inv = n.inventory();
        inv.on_disk.contains_key(model) || inv.resident.contains_key(model)
    });
    if known { model } else { "other" }
}

/// Reads fleet state into gauges at scrape time.
pub struct FleetCollector {
    router: Arc<Router>,
    /// For the per-node counters of nodes a reload added.
    metrics: Arc<Metrics>,
    node_up: IntGaugeVec,
    in_flight: IntGaugeVec,
    waiting: IntGaugeVec,
    resident_models: IntGaugeVec,
    model_resident: IntGaugeVec,
    affinity_entries: IntGauge,
    success_ratio: prometheus::GaugeVec,
    start_delay: prometheus::GaugeVec,
    evictions: IntCounterVec,
    descs: Vec<Desc>,
}

impl FleetCollector {
    pub fn new(router: Arc<Router>, metrics: Arc<Metrics>) -> prometheus::Result<FleetCollector> {
        let node_up = IntGaugeVec::new(
            Opts::new("corral_node_up", "1 when the node passes health checks."),
            &["node"],
        )?;
        let in_flight = IntGaugeVec::new(
            Opts::new(
                "corral_in_flight",
                "Requests sent to the node for the model and not finished.",
            ),
            &["node", "model"],
        )?;
        let waiting = IntGaugeVec::new(
            Opts::new(
                "corral_queue_depth",
                "Requests waiting in corral for a slot on this node, their best choice (corral sends a node at most num_parallel requests per model).",
            ),
            &["node", "model"],
        )?;
        let resident_models = IntGaugeVec::new(
            Opts::new(
                "corral_resident_models",
                "Models loaded on the node, per its /api/ps.",
            ),
            &["node"],
        )?;
        let model_resident = IntGaugeVec::new(
            Opts::new(
                "corral_model_resident",
                "1 for each model loaded on the node.",
            ),
            &["node", "model"],
        )?;
        let affinity_entries = IntGauge::new(
            "corral_affinity_entries",
            "Conversation prefixes in the affinity table.",
        )?;
        let success_ratio = prometheus::GaugeVec::new(
            Opts::new(
                "corral_node_success_ratio",
                "Recent share of the node's replies that did not fail.",
            ),
            &["node"],
        )?;
        let start_delay = prometheus::GaugeVec::new(
            Opts::new(
                "corral_node_start_delay_seconds",
                format!(
                    "Recent seconds from sending a request into a free slot to the node beginning its prompt; from {} s on, a node set to queue_at_node is sent one request more than it runs at once, to wait in its own queue.",
                    crate::routing::parallel::START_WORTH_HIDING_S
                ),
            ),
            &["node", "model"],
        )?;
        // Counted by the nodes' state as polls see them; copied out at each scrape.
        let evictions = IntCounterVec::new(
            Opts::new(
                "corral_evictions_seen_total",
                "Models seen leaving a node's memory (/api/ps) while another model arrived: unloaded to make room.",
            ),
            &["node", "model"],
        )?;
        let descs = [
            evictions.desc(),
            node_up.desc(),
            in_flight.desc(),
            waiting.desc(),
            resident_models.desc(),
            model_resident.desc(),
            affinity_entries.desc(),
            success_ratio.desc(),
            start_delay.desc(),
        ]
        .into_iter()
        .flatten()
        .cloned()
        .collect();
        Ok(FleetCollector {
            router,
            metrics,
            node_up,
            in_flight,
            waiting,
            resident_models,
            model_resident,
            affinity_entries,
            success_ratio,
            start_delay,
            evictions,
            descs,
        })
    }

    /// The gauges with labels, rebuilt at each scrape.
    fn vecs(&self) -> [&IntGaugeVec; 5] {
        [
            &self.node_up,
            &self.in_flight,
            &self.waiting,
            &self.resident_models,
            &self.model_resident,
        ]
    }

    fn refresh(&self) {
        for gauge in self.vecs() {
            gauge.reset();
        }
        self.success_ratio.reset();
        self.start_delay.reset();
        self.evictions.reset();
        let fleet = &self.router.fleet;
        let nodes = fleet.nodes();
        // Nodes a reload added and models a poll found since the start.
        self.metrics.count_fleet(fleet);
        for node in nodes.iter() {
            let name = node.name();
            self.node_up
                .with_label_values(&[name])
                .set(i64::from(fleet.is_healthy(node)));
            self.success_ratio
                .with_label_values(&[name])
                .set(node.success_ratio());
            let inv = node.inventory();
            self.resident_models
                .with_label_values(&[name])
                .set(inv.resident.len() as i64);
            for model in inv.resident.keys() {
                self.model_resident.with_label_values(&[name, model]).set(1);
            }
            node.books(|books| {
                for (model, n) in &books.evictions_seen {
                    self.evictions
                        .with_label_values(&[name, model.as_str()])
                        .inc_by(*n);
                }
                for (model, state) in &books.models {
                    let labels = [name, model.as_str()];
                    self.in_flight
                        .with_label_values(&labels)
                        .set(i64::from(state.in_flight));
                    self.waiting
                        .with_label_values(&labels)
                        .set(i64::from(state.waiting));
                    if let Some(delay) = state.start_s.get() {
                        self.start_delay.with_label_values(&labels).set(delay);
                    }
                }
            });
        }
        self.affinity_entries.set(self.router.affinity.len() as i64);
    }
}

impl Collector for FleetCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        self.refresh();
        let mut families = Vec::new();
        for gauge in self.vecs() {
            families.extend(gauge.collect());
        }
        families.extend(self.evictions.collect());
        families.extend(self.affinity_entries.collect());
        families.extend(self.success_ratio.collect());
        families.extend(self.start_delay.collect());
        families
    }
}
