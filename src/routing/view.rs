//! What choosing reads of each node: a [`NodeView`] per node, taken at one instant under
//! the node's lock, so that every signal of a decision sees the same state of the node.

use std::sync::Arc;
use std::time::{Duration, Instant};

use hashbrown::HashMap;

use super::parallel::Probes;
use super::placement::{self, Footprint};
use super::slots::{SlotPolicy, displaces_warm};
use crate::config::NodeConfig;
use crate::fleet::{Books, Inventory, ModelState, Node, Slot};

/// One node as a decision sees it, for one model: plain data, copied out of the node under
/// its lock, so that choosing cannot read anything else.
#[derive(Clone)]
pub struct NodeView {
    /// The node's id in the fleet.
    pub id: u16,
    pub settings: Arc<NodeConfig>,
    /// Failing health checks or cut off by its breaker: a last resort only.
    pub standby: bool,
    /// Recent ratio of replies that were not failures.
    pub success_ratio: f64,
    /// Requests it runs at once per model, as told or learned (surely: it may run more while
    /// its slots are not known).
    pub parallel: usize,
    /// Requests corral may have running there at once: `parallel`, or, while that is only a
    /// lower bound, as many as a probe may send ([`Probes::counted`]). A queue is counted
    /// against this, so that a node never busy enough to show its slots is not judged full
    /// at the number it showed.
    pub admits: usize,
    /// The model is in its memory (or loading for a request corral sent), as believed.
    pub resident: bool,
    /// Its last poll listed the model on disk: it can load it.
    pub on_disk: bool,
    /// Its memory in bytes, where known, and what the models believed held take of it.
    pub memory_total: Option<u64>,
    pub footprint: Footprint,
    /// The context length the model was loaded with there, where resident and reported.
    pub loaded_context: Option<u32>,
    /// Its slot count is known (configured, or settled by probing): only then can its slots
    /// be called full.
    pub slots_known: bool,
    /// Where loading the model must evict: how much the fleet uses the most used model
    /// that may go ([`placement::victim_use`]).
    pub victim_use: Option<u32>,
    pub model: ModelView,
}

/// When a decision reads the nodes.
pub struct Moment {
    pub now: Instant,
    /// How long a slot's conversation stays warm after its last use.
    pub ttl: Duration,
    /// How long after its last turn a conversation counts as live (the learned pause between
    /// turns, see [`placement::TurnGaps`]).
    pub live: Duration,
    /// Whether that pause has been learned: until a conversation has come back for a next
    /// turn, nothing says that conversations continue, and only those running count live.
    pub pause_known: bool,
    /// What other nodes' host caches were shown to keep of the requested model
    /// ([`crate::fleet::warm::PeerCapacities`]).
    pub peer_capacity: Option<u64>,
}

impl NodeView {
    pub fn name(&self) -> &str {
        &self.settings.name
    }

    /// Reads `node` for a request for `model`, or `None` when the node has been polled
    /// and has no such model. `sizes` gives the memory of models the node's last poll
    /// did not list.
    pub(super) fn take(
        node: &Arc<Node>,
        model: &str,
        standby: bool,
        probes: &Probes,
        sizes: &mut ModelSizes,
        at: &Moment,
    ) -> Option<NodeView> {
        let settings = node.settings();
        let inv = node.inventory();
        let resident_now = inv.resident.get(model);
        if inv.polled_at.is_some() && resident_now.is_none() && !inv.on_disk.contains_key(model) {
            return None;
        }
        let parallel = node.parallel();
        // Its slots are known when configured, reported by the node or settled by a probe;
        // until then the number corral believes may be a lower bound, to be probed rather
        // than worked around with another load.
        let counted = probes.counted(node.id, parallel, node.parallel_told(&settings));
        let memory_total = settings.memory_bytes();
        let (model_view, footprint, resident, success_ratio) = node.books(|books| {
            let policy = SlotPolicy::of(&books.kind, &settings);
            let view = ModelView::read(books, model, parallel, policy, at);
            let (footprint, resident) =
                node_memory(&books.models, &inv, memory_total, sizes, model);
            // A llama.cpp server lists no models (no /api/ps) and runs the one it has.
            let resident =
                resident || (inv.polled_at.is_none() && books.kind.serves_its_one_model());
            (view, footprint, resident, books.success.get(at.now))
        });
        Some(NodeView {
            id: node.id,
            standby,
            success_ratio,
            parallel,
            admits: counted.admits,
            resident,
            on_disk: inv.on_disk.contains_key(model),
            memory_total,
            footprint,
            loaded_context: resident_now.and_then(|r| r.context_length),
            slots_known: counted.known,
            victim_use: None,
            model: model_view,
            settings,
        })
    }
}

/// What choosing reads of the requested model's state on one node.
#[derive(Clone, Debug, Default)]
pub struct ModelView {
    /// Requests running there.
    pub in_flight: u32,
    /// Requests waiting in corral for a slot there.
    pub waiting: u32,
    /// A new conversation here would push a warm one out of its slot.
    pub new_conversation_displaces: bool,
    /// Learned prompt and generation speeds, tokens per second, and when last measured.
    pub prefill_tps: Option<f64>,
    pub decode_tps: Option<f64>,
    pub speed_at: Option<Instant>,
    /// Seconds a request takes there, start to end, as measured (loads left out).
    pub service_s: Option<f64>,
    /// Seconds the node took to load the model, as measured.
    pub load_s: Option<f64>,
    /// Prompt tokens per second when nothing is cached.
    pub cold_tps: Option<f64>,
    /// While none is measured: at most this, from requests still waiting for their first
    /// byte there ([`unanswered_rate`]).
    pub cold_tps_at_most: Option<f64>,
    /// Every slot holds a live conversation ([`placement::slots_full`]).
    pub full: bool,
    /// Live conversations it serves ([`placement::live_conversations`]).
    pub live_conversations: u32,
    /// Conversations it keeps warm: its slots and what its host cache holds, as learned.
    pub warm_room: f64,
    /// It is known to keep nothing warm beyond its slots (the old Ollama runner has no host
    /// prompt cache).
    pub slots_only: bool,
}

impl ModelView {
    /// Requests running there and waiting in corral for it: its queue.
    pub fn depth(&self) -> u32 {
        self.in_flight + self.waiting
    }

    fn read(
        books: &Books,
        model: &str,
        parallel: usize,
        policy: SlotPolicy,
        at: &Moment,
    ) -> ModelView {
        let host_allowed = books.kind.may_keep_host_cache();
        // Nothing sent here yet for the model: read as empty, with all its slots and host
        // cache for room (a view of nothing would offer no warm room at all, and a node
        // that has not served the model would never be a new conversation's home).
        let empty;
        let state = match books.models.get(model) {
            Some(state) => state,
            None => {
                empty = ModelState::default();
                &empty
            }
        };
        let live = if at.pause_known {
            at.live
        } else {
            Duration::ZERO
        };
        let since = at.now.checked_sub(live).unwrap_or(at.now);
        let in_slot = |lineage| state.slots.iter().any(|s| s.lineage == lineage);
        let host = state.warm.host.survey(at.peer_capacity, since, in_slot);
        // A conversation pushed out of a slot is not lost where the host cache keeps a copy
        // of it (llama-server copies idle slots' conversations) or has room for it; where
        // the cache is full, it pushes the oldest saved one out instead.
        let held = state.slots.iter().filter(|s| s.lineage != 0).count();
        let victim = state.slots.iter().map(|s| s.tokens).max().unwrap_or(0);
        let host_keeps = host_allowed && (host.copies == held || host.has_room(victim, parallel));
        ModelView {
            in_flight: state.in_flight,
            waiting: state.waiting,
            new_conversation_displaces: !host_keeps
                && displaces_warm(state, parallel, policy, at.now, at.ttl),
            prefill_tps: state.prefill_tps.get(),
            decode_tps: state.decode_tps.get(),
            speed_at: state.speed_at,
            service_s: state.warm.service_s.get(),
            load_s: state.load_s.get(),
            cold_tps: state.warm.cold_rate.get().or(state.prefill_tps.get()),
            cold_tps_at_most: (state.streaming == 0)
                .then(|| unanswered_rate(&state.slots, at.now))
                .flatten(),
            full: placement::slots_full(&state.slots, parallel, at.now, at.live),
            live_conversations: placement::live_conversations(
                &state.slots,
                host.live,
                at.now,
                live,
            ),
            warm_room: parallel as f64
                + if host_allowed {
                    (state.warm.host).room(parallel, at.peer_capacity, host.copies)
                } else {
                    0.0
                },
            slots_only: !host_allowed,
        }
    }
}

/// The fastest prompt rate a node could have whose busy slots have all been prefilling
/// since they were taken without a first byte: each slot's prompt over its age. A node
/// that has not answered yet is otherwise taken to be as fast as the fleet's best, and one
/// tenfold slower would take a whole wave of new conversations before its first reply
/// showed its speed.
pub fn unanswered_rate(slots: &[Slot], now: Instant) -> Option<f64> {
    slots
        .iter()
        .filter(|s| s.busy > 0 && s.tokens > 0)
        .filter_map(|s| {
            let age = now.saturating_duration_since(s.last_used?).as_secs_f64();
            (age > 0.0).then(|| s.tokens as f64 / age)
        })
        .min_by(f64::total_cmp)
}

/// The model's size in memory where some node has it loaded, else its size on disk.
pub(super) fn model_size(nodes: &[Arc<Node>], model: &str) -> Option<u64> {
    // One pass over the inventories, without collecting them: this runs for every decision.
    // (`None` is below every `Some`, so `max` keeps the largest size any node gives.)
    let (mut loaded, mut on_disk) = (None, None);
    for node in nodes {
        let inv = node.inventory();
        loaded = loaded.max(inv.resident.get(model).map(|r| r.size));
        on_disk = on_disk.max(inv.on_disk.get(model).copied());
    }
    loaded.or(on_disk)
}

/// Model sizes in memory, looked up once per decision.
pub(super) struct ModelSizes<'n> {
    nodes: &'n [Arc<Node>],
    known: HashMap<String, Option<u64>>,
}

impl<'n> ModelSizes<'n> {
    pub(super) fn new(nodes: &'n [Arc<Node>]) -> Self {
        ModelSizes {
            nodes,
            known: HashMap::new(),
        }
    }

    pub(super) fn of(&mut self, model: &str) -> Option<u64> {
        if let Some(size) = self.known.get(model) {
            return *size;
        }
        let size = model_size(self.nodes, model);
        self.known.insert(model.to_string(), size);
        size
    }
}

/// What the node holds in memory as corral believes it now, and whether `model` is among
/// it: what its last poll listed, what replies came from since, and what corral's own
/// requests are loading there, counted only up to its memory ([`placement::believed`]).
fn node_memory(
    models: &HashMap<String, ModelState>,
    inv: &Inventory,
    total: Option<u64>,
    sizes: &mut ModelSizes,
    model: &str,
) -> (placement::Footprint, bool) {
    let mut held = Vec::with_capacity(inv.resident.len() + 1);
    for (name, r) in &inv.resident {
        let state = models.get(name);
        let busy = state.is_some_and(ModelState::busy);
        let served = state.and_then(|s| s.last_success);
        held.push(placement::Held {
            model: name,
            size: r.size,
            certain: busy || state.is_some_and(|s| s.loading.is_some()),
            seen: served.max(inv.polled_at),
            busy,
        });
    }
    for (name, state) in models.iter() {
        if inv.resident.contains_key(name) {
            continue;
        }
        let running = state.in_flight > 0 || state.loading.is_some();
        let served_since_poll = match (state.last_success, inv.polled_at) {
            (Some(served), Some(polled)) => served > polled,
            (Some(_), None) => true,
            _ => false,
        };
        if running || served_since_poll {
            held.push(placement::Held {
                model: name,
                size: sizes.of(name).unwrap_or(0),
                certain: running,
                seen: state.last_success,
                busy: state.busy(),
            });
        }
    }
    // The node demonstrably holds what its last poll listed, even beyond a `memory_gb` set
    // too low: only later signs are weighed against its memory.
    let polled: u64 = inv.resident.values().map(|r| r.size).sum();
    let believed = placement::believed(total.map(|t| t.max(polled)), held);
    (believed.footprint, believed.holds(model))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::Resident;

    const GB: u64 = 1_000_000_000;

    #[test]
    fn a_node_that_has_not_answered_is_no_faster_than_its_waiting_prompts_allow() {
        let now = Instant::now();
        let slot = |busy, tokens, age_ms| Slot {
            lineage: 1,
            depth: 1,
            last_used: Some(now - Duration::from_millis(age_ms)),
            busy,
            tokens,
            first: 0,
        };
        // 8,000 tokens without a first byte for 2 s allow 4,000 a second, for 4 s 2,000:
        // the tighter bound counts. Idle slots and empty ones show nothing.
        let slots = [
            slot(1, 8_000, 2_000),
            slot(1, 8_000, 4_000),
            slot(0, 100, 9_000),
        ];
        let rate = unanswered_rate(&slots, now).unwrap();
        assert!((rate - 2_000.0).abs() < 1.0, "{rate}");
        assert_eq!(unanswered_rate(&[slot(0, 8_000, 2_000)], now), None);
        assert_eq!(unanswered_rate(&[slot(1, 0, 2_000)], now), None);
        assert_eq!(unanswered_rate(&[], now), None);
    }

    fn node_holding(resident: &[(&str, u64)], on_disk: &[&str]) -> Arc<Node> {
        let mut config = NodeConfig::new("n", "http://127.0.0.1:9");
        config.memory_gb = Some(24.0);
        let node = Arc::new(Node::new(0, config).unwrap());
        let mut inv = Inventory {
            polled_at: Some(Instant::now()),
            ..Default::default()
        };
        for (model, size) in resident {
            let r = Resident {
                size: *size,
                context_length: Some(4096),
                expires_at: None,
            };
            inv.resident.insert(model.to_string(), r);
            inv.on_disk.insert(model.to_string(), *size);
        }
        for model in on_disk {
            inv.on_disk.insert(model.to_string(), 4 * GB);
        }
        node.update_inventory(inv);
        node
    }

    fn take(node: &Arc<Node>, model: &str) -> Option<NodeView> {
        let nodes = [node.clone()];
        let mut sizes = ModelSizes::new(&nodes);
        let at = Moment {
            now: Instant::now(),
            ttl: Duration::from_secs(300),
            live: Duration::from_secs(300),
            pause_known: true,
            peer_capacity: None,
        };
        NodeView::take(node, model, false, &Probes::default(), &mut sizes, &at)
    }

    #[test]
    fn a_polled_node_without_the_model_gives_no_view() {
        let node = node_holding(&[("a", 5 * GB)], &["b"]);
        assert!(take(&node, "c").is_none());
        let on_disk = take(&node, "b").unwrap();
        assert!(!on_disk.resident);
        assert_eq!(on_disk.footprint.used, 5 * GB);
        assert_eq!(on_disk.loaded_context, None);
        let loaded = take(&node, "a").unwrap();
        assert!(loaded.resident);
        assert_eq!(loaded.loaded_context, Some(4096));
        assert_eq!(loaded.memory_total, Some(24 * GB));
    }

    #[test]
    fn the_view_carries_the_books_of_the_requested_model() {
        let node = node_holding(&[("a", 5 * GB), ("b", 6 * GB)], &[]);
        node.books(|books| {
            let a = books.models.entry("a".into()).or_default();
            a.in_flight = 2;
            a.waiting = 1;
            a.decode_tps.record(40.0);
        });
        let view = take(&node, "a").unwrap();
        assert_eq!((view.model.in_flight, view.model.waiting), (2, 1));
        assert_eq!(view.model.decode_tps, Some(40.0));
        // Both models are held; only "b" is idle, and so evictable at once.
        assert_eq!(view.footprint.used, 11 * GB);
        assert_eq!(view.footprint.idle, 6 * GB);
        let other = take(&node, "b").unwrap();
        assert_eq!(other.model.in_flight, 0);
        // Nothing sent for "b" yet: its slots and a host cache of as many are room.
        assert_eq!(other.model.warm_room, 2.0 * other.parallel as f64);
        assert!(!other.model.full && !other.model.slots_only);
    }
}
