//! The router: the fleet, what it remembers of conversations, and the configuration in
//! force; and its decision, one pass from a snapshot of the nodes to a ranked list.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;

use super::affinity::AffinityTable;
use super::decision::{Decision, Pin, RouteError};
use super::remote::Remote;
use super::view::{self, ModelSizes, NodeView};
use super::{choose, parallel, placement};
use crate::config::Config;
use crate::fleet::warm::PeerCapacities;
use crate::fleet::{Fleet, Listener, Requester};
use crate::request::Profile;
use crate::shared::Shared;

pub struct Router {
    pub fleet: Arc<Fleet>,
    pub affinity: AffinityTable,
    /// Explicit session keys (see `request::session`) to the node that last served them.
    pub sessions: AffinityTable,
    /// The configuration in force; replaced whole on reload.
    pub(super) config: ArcSwap<Config>,
    pub(super) next_lineage: AtomicU64,
    /// Requests waiting for a slot, fleet-wide (per node and model in `ModelState`).
    pub(super) waiting: AtomicUsize,
    /// Held from a decision until its request is counted on its node (and any load it
    /// starts reserved), so that decisions made at the same instant see each other's loads.
    pub(super) placement: parking_lot::Mutex<()>,
    /// The usual pause between a conversation's turns: how long one counts as live.
    pub(super) turn_gaps: placement::TurnGaps,
    /// Probes of how many requests each node runs at once ([`parallel`]).
    pub(super) probes: parallel::Probes,
    /// Host-cache capacities the nodes' replies have shown, per model.
    pub(super) peer_capacities: PeerCapacities,
    /// The store replicas share state through, when configured (`shared_state:`).
    pub shared: Option<Arc<Shared>>,
    /// The other replicas' requests and waits, as they told them.
    pub(super) remote: parking_lot::Mutex<Remote>,
}

impl Router {
    pub fn new(fleet: Arc<Fleet>, config: &Config) -> Router {
        // The URL was checked with the configuration.
        let shared = (config.shared_state.as_ref()).and_then(|c| match Shared::new(c) {
            Ok(shared) => Some(shared),
            Err(e) => {
                log::error!("{e}; deciding alone");
                None
            }
        });
        // Lines of different replicas must not share a number.
        let first_lineage = shared.as_ref().map_or(0, |s| s.lineage_base()) + 1;
        Router {
            fleet,
            affinity: AffinityTable::new(config.affinity.capacity, config.affinity.ttl),
            // One entry per keyed session, where prefixes take about two per conversation,
            // and the table reserves its capacity up front: a quarter is room enough.
            sessions: AffinityTable::new(config.affinity.capacity / 4, config.affinity.ttl),
            config: ArcSwap::from_pointee(config.clone()),
            next_lineage: AtomicU64::new(first_lineage),
            waiting: AtomicUsize::new(0),
            placement: parking_lot::Mutex::new(()),
            turn_gaps: placement::TurnGaps::default(),
            probes: parallel::Probes::default(),
            peer_capacities: PeerCapacities::default(),
            shared,
            remote: parking_lot::Mutex::default(),
        }
    }

    /// Hold this from [`Router::decide`] until the chosen node is counted
    /// ([`Router::try_send`]) and the request committed to its slots ([`super::Reserved::commit`]):
    /// a load or conversation placed by one decision is then seen by the next. Each step is
    /// quick and never waits on the network.
    pub fn placement(&self) -> Placing<'_> {
        Placing::hold(&self.placement)
    }

    pub fn config(&self) -> Arc<Config> {
        self.config.load_full()
    }

    /// Installs a reloaded configuration. The fleet's node list is applied separately
    /// ([`Fleet::apply`]); the affinity table keeps its size and TTL until a restart.
    pub fn set_config(&self, config: Config) {
        self.config.store(Arc::new(config));
        // Limits may have grown: let waiting requests look again.
        self.fleet.wakeups.fleet_changed();
    }

    /// Requests waiting for a slot now, fleet-wide.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Acquire)
    }

    /// What a request for `model` waiting in the queue listens to: a slot freed or a load
    /// or unload for that model, a node admitted or cut off, a reload. See
    /// [`Listener::news`].
    pub fn listen(&self, model: &str, requester: Requester) -> Listener {
        self.fleet.wakeups.listen(model, requester)
    }

    pub(super) fn ttl(&self) -> Duration {
        self.affinity.ttl()
    }

    /// Scores every healthy node that has the model and ranks them, under the
    /// configuration in force.
    pub fn decide(&self, p: &Profile) -> Result<Decision, RouteError> {
        self.decide_with(p, &self.config())
    }

    /// [`Router::decide`] under `config`: the snapshot a request took when it arrived, so that
    /// it is scored, forwarded and timed under one configuration even across a reload.
    pub fn decide_with(&self, p: &Profile, config: &Config) -> Result<Decision, RouteError> {
        self.decide_waiting(p, config, None)
    }

    /// [`Router::decide_with`] for a request among others waiting for a slot: `ahead` gives
    /// per node the requests waiting there that go before it in the fair order between
    /// clients (those behind it do not delay it), in place of every request waiting there.
    pub fn decide_waiting(
        &self,
        p: &Profile,
        config: &Config,
        ahead: Option<&[(u16, u32)]>,
    ) -> Result<Decision, RouteError> {
        let now = Instant::now();
        let nodes = self.fleet.nodes();
        if nodes.is_empty() {
            return Err(RouteError::NoHealthyNode);
        }
        let peer_capacity = self.peer_capacities.of(&p.model_key);
        let located = self.locate(p, peer_capacity);
        // A prefix shared with other conversations is not a new conversation's own on
        // llama-server (see [`shared_with_others`]): it draws the request nowhere.
        let keeps_host = located.pin_keeps_host;
        let pin = (located.pin).filter(|&pin| !shared_with_others(p, pin, keeps_host));
        // An explicit session key names the node ahead of the prefix chain; the chain still
        // says what is warm there (`pin`, for hit or miss and the slot mirror).
        let warm_node = p
            .session
            .and_then(|key| self.sessions.peek(key))
            .map(|entry| entry.node)
            .or(pin.map(|pin| pin.node));
        let model = p.model_key.as_str();
        let mut sizes = ModelSizes::new(&nodes);
        let request = choose::Request {
            need: sizes.of(model),
            warm_node,
            pin_node: pin.map(|pin| pin.node),
            now,
            pause_s: self.turn_gaps.pause_s(),
        };
        let at = view::Moment {
            now,
            ttl: self.ttl(),
            live: placement::live_window(request.pause_s, self.ttl()),
            pause_known: request.pause_s.is_some(),
            peer_capacity,
        };
        let mut views: Vec<NodeView> = nodes
            .iter()
            .filter_map(|node| {
                // Nodes that are down are ranked after all others: first choices never go
                // there, but a request tries them when no node that admits requests is left,
                // rather than refuse one that a node might still serve.
                let standby = !self.fleet.is_healthy(node);
                NodeView::take(node, model, standby, &self.probes, &mut sizes, &at)
            })
            .collect();
        let node_of = |id: u16| nodes.iter().find(|node| node.id == id);
        for v in &mut views {
            // Where the model's load would have to evict: how much the fleet uses what it
            // may evict ([`placement::victim_use`]).
            let (need, total) = (request.need, v.memory_total);
            let evicts = !v.resident && !placement::fits_free(need, total, v.footprint.used);
            if let Some(node) =
                node_of(v.id).filter(|_| evicts && need.is_some() && total.is_some())
            {
                let idle = placement::idle_models_use(&nodes, node);
                v.victim_use = Some(placement::victim_use(idle));
            }
            if let Some(ahead) = ahead {
                let on_node = ahead.iter().find(|(node, _)| *node == v.id);
                v.model.waiting = on_node.map_or(0, |(_, n)| *n);
            }
        }
        // Choosing reads the views alone; each ranked view then gets its node back.
        let ranked = choose::rank(p, request, &views, &config.weights)?
            .into_iter()
            .filter_map(|c| node_of(c.node.id).cloned().map(|node| c.with_node(node)))
            .collect();
        // The books after the choice: what was found stale is forgotten, what was used
        // is kept longest.
        for &hash in &located.stale {
            self.affinity.remove(hash);
        }
        if let Some(hash) = located.pin_hash {
            self.affinity.touch(hash);
        }
        if let Some(key) = p.session {
            self.sessions.touch(key);
        }
        Ok(Decision {
            ranked,
            pin,
            follow_up: p.follow_up || located.went_cold,
            direct: false,
            probe: located.probe,
        })
    }
}

/// Whether a new conversation's warm prefix is only one it shares with other conversations
/// (a system prompt), on a node that may keep prompts in a host cache beyond its slots
/// (`keeps_host`: llama-server, as in Ollama 0.30 and later and llama.cpp, or a node of kind
/// not known yet). There it is not drawn to that node: llama-server gives a prompt the idle
/// slot that shares most of it (`server-context.cpp`, `get_available_slot`), and saves that
/// slot's conversation to its host cache first only when the prompt would keep less than
/// half of it, so a new conversation sharing a long system prompt overwrites another's
/// turns; and a follow-up finding such a slot idle takes it rather than restore its own
/// conversation from the host cache. Conversations gathered on one node by their system
/// prompt push each other out; placed as new, they spread by cost and room. The old runner
/// keeps the pull: any new conversation takes an occupied idle slot there, and one sharing
/// the system prompt at least reuses it.
fn shared_with_others(p: &Profile, pin: Pin, keeps_host: bool) -> bool {
    keeps_host && !p.follow_up && !pin.continues
}

/// Held while a request is placed ([`Router::placement`]): a decision, the request's count
/// on its node and its commit to the node's slots happen under it, so that requests
/// arriving together see each other's loads and conversations.
pub struct Placing<'r> {
    _held: parking_lot::MutexGuard<'r, ()>,
}

impl<'r> Placing<'r> {
    pub(super) fn hold(lock: &'r parking_lot::Mutex<()>) -> Placing<'r> {
        Placing { _held: lock.lock() }
    }
}
