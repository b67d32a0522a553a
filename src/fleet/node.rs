//! One node of the fleet and what corral knows about it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use std::net::SocketAddr;

use arc_swap::{ArcSwap, ArcSwapOption};
use hashbrown::HashMap;
use parking_lot::Mutex;
use pingora_core::protocols::tls::CaType;
use pingora_core::upstreams::peer::HttpPeer;

use super::ewma::Ewma;
use super::health::{Evidence, Health, Rules, State};
use super::kind::KindState;
use super::warm::{HostEntry, WarmState};
use crate::config::{NodeConfig, NodeTarget};

/// What the poller last read from the node's `/api/tags` and `/api/ps`.
#[derive(Clone, Debug, Default)]
pub struct Inventory {
    /// When the reply this inventory comes from was requested; `None` until the first
    /// successful poll, when nothing is known about the node's models yet.
    pub polled_at: Option<Instant>,
    /// Models on disk, by normalized name, with their size in bytes.
    pub on_disk: HashMap<String, u64>,
    /// Models loaded in memory, by normalized name.
    pub resident: HashMap<String, Resident>,
    /// The entries of `/api/tags` and `/api/ps` as the node sent them, for corral's own
    /// `/api/tags` and `/api/ps`, which merge the fleet's.
    pub tags_entries: Vec<serde_json::Value>,
    pub ps_entries: Vec<serde_json::Value>,
    /// What `/api/version` said.
    pub version: Option<String>,
}

#[cfg(test)]
impl Inventory {
    /// An inventory with these models resident (1 byte each) and nothing else known.
    pub(crate) fn with_resident(names: &[&str]) -> Inventory {
        let resident = |name: &&str| {
            let r = Resident {
                size: 1,
                context_length: None,
                expires_at: None,
            };
            (name.to_string(), r)
        };
        Inventory {
            resident: names.iter().map(resident).collect(),
            ..Default::default()
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Resident {
    /// Bytes the loaded model takes (weights, KV cache, graph).
    pub size: u64,
    /// The loaded context length, where the node reports it (recent Ollama versions).
    pub context_length: Option<u32>,
    /// When Ollama will unload it, as it reported (RFC 3339).
    pub expires_at: Option<String>,
}

/// One of a model's parallel slots on a node, as the router believes it is filled.
#[derive(Clone, Debug, Default)]
pub struct Slot {
    /// The conversation line whose prefix the slot holds; 0 when empty.
    pub lineage: u64,
    /// How many boundaries of that conversation the slot holds.
    pub depth: usize,
    pub last_used: Option<Instant>,
    /// Requests using the slot now.
    pub busy: u32,
    /// Prompt tokens it holds, as corral estimates them.
    pub tokens: u64,
    /// The hash of the conversation's first message (a system prompt other conversations
    /// may open with too); 0 when not known.
    pub first: u64,
}

impl Slot {
    /// What saving the slot's conversation at `now` puts in the node's host cache.
    pub fn saved(&self, now: Instant) -> HostEntry {
        HostEntry {
            lineage: self.lineage,
            depth: self.depth,
            tokens: self.tokens,
            first: self.first,
            last_used: self.last_used.unwrap_or(now),
        }
    }
}

/// The router's own view of one model on one node.
#[derive(Clone, Debug, Default)]
pub struct ModelState {
    /// Requests sent to this node for this model and not finished. corral sends at most
    /// `num_parallel`, so they all run, and one more to a node set to `queue_at_node` that is
    /// slow to begin a request (see `start_s`), which waits in the node's own queue.
    pub in_flight: u32,
    /// Requests waiting in corral for a slot here, this node being their best choice.
    pub waiting: u32,
    /// Of those waiting, the ones warm here: a cold request leaves them the slots they wait
    /// for (see [`crate::routing::Router::try_send`]).
    pub waiting_warm: u32,
    /// Of the requests in flight, those whose reply has begun: the node runs them at once.
    pub streaming: u32,
    pub slots: Vec<Slot>,
    /// Time to the reply's first byte, in milliseconds.
    pub ttfb_ms: Ewma,
    /// Prompt tokens evaluated per second, from Ollama's final chunk.
    pub prefill_tps: Ewma,
    /// Tokens generated per second, from Ollama's final chunk.
    pub decode_tps: Ewma,
    /// When the speeds were last measured.
    pub speed_at: Option<Instant>,
    /// When a reply for this model last succeeded here: the model was resident then, even
    /// if the last poll has not seen it yet.
    pub last_success: Option<Instant>,
    /// Since when corral has had a request on its way here that loads the model (it was
    /// neither resident nor loading when sent): its memory is reserved until that request
    /// ends.
    pub loading: Option<Instant>,
    /// Seconds the node took to load the model, from replies that loaded it.
    pub load_s: Ewma,
    /// Seconds from sending a request into a free slot to the node beginning its prompt:
    /// the reply's time to first byte less its load and prefill. The runner's batch under
    /// way, which the request waits for, and Ollama's own work on it (the template, the hop
    /// to the runner).
    pub start_s: Ewma,
    /// What the node keeps warm beyond its slots, and its cold prefill rate, as learned
    /// from its replies.
    pub warm: WarmState,
}

impl ModelState {
    /// Requests run or wait for the model here.
    pub fn busy(&self) -> bool {
        self.depth() > 0
    }

    /// Requests running or waiting for the model here.
    pub fn depth(&self) -> u32 {
        self.in_flight + self.waiting
    }
}

/// A node: its configuration, its health handle, and the state corral keeps for it.
pub struct Node {
    /// Stable for the node's life, never reused: affinity entries name nodes by it.
    pub id: u16,
    name: String,
    /// The name as the `X-Fleet-Node` value of every reply it serves, made once.
    name_value: http::HeaderValue,
    url: String,
    /// The `Host` header of requests to it, made once: `host:port`.
    host: String,
    host_value: http::HeaderValue,
    /// Memory, roles, parallel slots: may change on a configuration reload.
    settings: ArcSwap<NodeConfig>,
    /// Where the node is reached, from its URL.
    pub target: NodeTarget,
    /// Where its host name resolved last. `None` until it resolves: the node is down.
    resolved: ArcSwapOption<Resolved>,
    inventory: ArcSwap<Inventory>,
    /// What corral keeps about the node while requests run: see [`Books`].
    books: Mutex<Books>,
    /// Whether it answers: one view fed by checks, polls and requests.
    health: Mutex<Health>,
    /// Whether it admitted requests when waiting requests were last told (see
    /// [`Node::admission_changed`]).
    announced: AtomicBool,
    /// For an `https://` node with `ca_file`: the roots its certificate is checked against.
    ca: Option<Arc<CaType>>,
    /// A reply showed a model load here: the poller reads the node again at once.
    pub(super) poll_wanted: AtomicBool,
    /// Slots the node showed (llama.cpp's `/props`, or replies streaming at once); 0 while
    /// unknown.
    learned_parallel: AtomicUsize,
    /// The node said how many it runs (llama.cpp's `/props`): not a lower bound to probe.
    parallel_reported: AtomicBool,
}

/// What corral keeps about a node while requests run, kept together under one lock so
/// that a decision reads one consistent state of the node: its models' requests, slots,
/// speeds and cache mirror, its recent success ratio, the kind of server it is, and the
/// models seen evicted.
#[derive(Debug, Default)]
pub struct Books {
    pub models: HashMap<String, ModelState>,
    /// Recent ratio of replies that were not failures (1.0 = all good).
    pub success: SuccessRatio,
    /// What kind of server it is, as configured or detected.
    pub kind: KindState,
    /// Models seen leaving the node's memory to make room for another, per model.
    pub evictions_seen: HashMap<String, u64>,
}

/// A node's resolved address.
#[derive(Debug)]
pub struct Resolved {
    pub addr: SocketAddr,
}

/// A node's recent success ratio. It starts at 1 (no evidence against a node) and drifts
/// back to 1 with time, so a node that failed and recovered is not shunned for ever while
/// its peers take all the traffic it would need to prove itself.
#[derive(Clone, Copy, Debug)]
pub struct SuccessRatio {
    value: f64,
    at: Instant,
}

impl SuccessRatio {
    const ALPHA: f64 = 0.2;
    /// Time for half of a shortfall to be forgiven.
    const HALF_LIFE: Duration = Duration::from_secs(30);

    pub fn new() -> SuccessRatio {
        SuccessRatio {
            value: 1.0,
            at: Instant::now(),
        }
    }

    pub fn get(&self, now: Instant) -> f64 {
        let halves = now.duration_since(self.at).as_secs_f64() / Self::HALF_LIFE.as_secs_f64();
        1.0 - (1.0 - self.value) * 0.5f64.powf(halves)
    }

    pub fn record(&mut self, ok: bool, now: Instant) {
        let current = self.get(now);
        let sample = if ok { 1.0 } else { 0.0 };
        self.value = current + Self::ALPHA * (sample - current);
        self.at = now;
    }
}

impl Default for SuccessRatio {
    fn default() -> Self {
        SuccessRatio::new()
    }
}

impl Node {
    /// A node, with its host name resolved now if it can be. One that cannot is down
    /// until the poller resolves it, so that one machine switched off does not keep
    /// corral from starting.
    pub fn new(id: u16, config: NodeConfig) -> Result<Node, String> {
        let target = config.target()?;
        let ca = match &config.ca_file {
            Some(path) if target.tls => Some(crate::tls::roots_with(path.as_ref())?),
            _ => None,
        };
        let resolved = target.resolve_blocking();
        let host = if target.host.contains(':') {
            // An IPv6 address is bracketed in a Host header.
            format!("[{}]:{}", target.host, target.port)
        } else {
            format!("{}:{}", target.host, target.port)
        };
        let value = |text: &str, what: &str| {
            http::HeaderValue::from_str(text)
                .map_err(|_| format!("{what} '{text}' cannot be an HTTP header value"))
        };
        let name_value = value(&config.name, "name")?;
        let host_value = value(&host, "host")?;
        let books = Books {
            kind: KindState::configured(config.kind),
            ..Books::default()
        };
        let node = Node {
            id,
            name: config.name.clone(),
            name_value,
            url: config.url.clone(),
            host,
            host_value,
            settings: ArcSwap::from_pointee(config),
            target,
            resolved: ArcSwapOption::empty(),
            inventory: ArcSwap::from_pointee(Inventory::default()),
            books: Mutex::new(books),
            health: Mutex::new(Health::default()),
            announced: AtomicBool::new(true),
            ca,
            poll_wanted: AtomicBool::new(false),
            learned_parallel: AtomicUsize::new(0),
            parallel_reported: AtomicBool::new(false),
        };
        match resolved {
            Ok(addr) => {
                node.set_address(addr);
            }
            Err(e) => log::warn!("node {}: {e}; it is down until it resolves", node.name),
        }
        Ok(node)
    }

    /// Where the node's host name resolved last; `None` while it never has.
    pub fn resolved(&self) -> Option<Arc<Resolved>> {
        self.resolved.load_full()
    }

    /// Records where the node's host name resolves now. `true` when that moved it.
    pub fn set_address(&self, addr: SocketAddr) -> bool {
        if self
            .resolved
            .load()
            .as_ref()
            .is_some_and(|r| r.addr == addr)
        {
            return false;
        }
        self.resolved.store(Some(Arc::new(Resolved { addr })));
        true
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    /// Requests the node runs at once per model: as configured, else 1 (Ollama's default
    /// since 0.9.7, OLLAMA_NUM_PARALLEL in envconfig/config.go), or more where the node
    /// showed more slots.
    pub fn parallel(&self) -> usize {
        self.settings()
            .num_parallel
            .max(self.learned_parallel.load(Ordering::Relaxed))
            .max(1)
    }

    /// Runs fewer requests for `model` than it is believed to run at once.
    pub fn has_room(&self, model: &str) -> bool {
        self.free_slots(model) > 0
    }

    /// How many more requests for `model` it is believed to run at once.
    pub fn free_slots(&self, model: &str) -> usize {
        let running = self.books(|books| books.models.get(model).map_or(0, |m| m.in_flight));
        self.parallel().saturating_sub(running as usize)
    }

    pub fn settings(&self) -> Arc<NodeConfig> {
        self.settings.load_full()
    }

    pub fn set_settings(&self, config: NodeConfig) {
        if config.kind != self.settings().kind {
            self.books.lock().kind = KindState::configured(config.kind);
        }
        self.settings.store(Arc::new(config));
    }

    /// Reads or changes the node's books under their lock, held only while `f` runs: `f`
    /// must be quick and never wait.
    pub fn books<R>(&self, f: impl FnOnce(&mut Books) -> R) -> R {
        f(&mut self.books.lock())
    }

    /// The books' lock itself, for tests that set up or inspect a node's state.
    #[cfg(test)]
    pub(crate) fn lock_books(&self) -> parking_lot::MutexGuard<'_, Books> {
        self.books.lock()
    }

    /// Records that the node showed it runs at least `slots` requests at once.
    pub fn learn_parallel_at_least(&self, slots: usize) {
        self.learned_parallel.fetch_max(slots, Ordering::Relaxed);
    }

    /// Records the slots the node showed itself (llama.cpp's `/props`); returns the number
    /// believed before.
    pub fn learn_parallel(&self, slots: usize) -> usize {
        self.parallel_reported.store(true, Ordering::Relaxed);
        self.learned_parallel.swap(slots, Ordering::Relaxed)
    }

    /// Its number of requests at once is known, not a lower bound: configured (in
    /// `settings`, the node's as the caller read them), or reported by the node itself.
    pub fn parallel_told(&self, settings: &NodeConfig) -> bool {
        settings.num_parallel > 0 || self.parallel_reported.load(Ordering::Relaxed)
    }

    /// Slots the node showed, by `/props` or by running requests at once; `None` while it
    /// has shown none.
    pub fn slots_shown(&self) -> Option<usize> {
        match self.learned_parallel.load(Ordering::Relaxed) {
            0 => None,
            n => Some(n),
        }
    }

    pub fn inventory(&self) -> Arc<Inventory> {
        self.inventory.load_full()
    }

    pub fn success_ratio(&self) -> f64 {
        self.books.lock().success.get(Instant::now())
    }

    /// Where the node stands now.
    pub fn health(&self) -> State {
        self.health.lock().state(Instant::now())
    }

    /// Whether requests may go to the node as a first choice.
    pub fn admits(&self) -> bool {
        self.health.lock().admits(Instant::now())
    }

    /// Learns from one piece of evidence. Call through [`super::roster::Fleet::learn`], which
    /// wakes waiting requests when the node's admission changed.
    pub(super) fn learn(&self, evidence: Evidence, rules: &Rules) {
        let now = Instant::now();
        // The success ratio is of replies: a failed request reports `Failed` once, besides
        // the `Refused` its connection may have shown.
        match evidence {
            Evidence::Served => self.books.lock().success.record(true, now),
            Evidence::Failed => self.books.lock().success.record(false, now),
            _ => {}
        }
        self.health.lock().record(evidence, now, rules);
    }

    /// `true` once each time the node starts or stops admitting requests, whether by
    /// evidence or by its cool-down running out, which no event marks.
    pub(super) fn admission_changed(&self) -> bool {
        let admits = self.admits();
        self.announced.swap(admits, Ordering::AcqRel) != admits
    }

    /// How to reach the node at its last resolved address: TLS with SNI and the roots to
    /// check it against, for `https://`. `None` while its name never resolved.
    pub fn peer(&self, connect_timeout: Duration) -> Option<HttpPeer> {
        let addr = self.resolved()?.addr;
        let t = &self.target;
        let mut peer = HttpPeer::new(addr, t.tls, t.host.clone());
        peer.options.connection_timeout = Some(connect_timeout);
        peer.options.ca = self.ca.clone();
        Some(peer)
    }

    /// The `Host` header for requests to the node.
    pub fn host_header(&self) -> &str {
        &self.host
    }

    /// [`Node::host_header`] as a header value.
    pub fn host_value(&self) -> &http::HeaderValue {
        &self.host_value
    }

    /// The node's name as a header value (`X-Fleet-Node`).
    pub fn name_value(&self) -> &http::HeaderValue {
        &self.name_value
    }

    /// Installs a fresh inventory. Slots of models that the node no longer holds are
    /// emptied, so the conversations they held stop counting as warm, unless a reply
    /// succeeded after the poll was sent (the poll raced with a load). Returns the models
    /// loaded, unloaded, added or removed since the last inventory: requests waiting for
    /// them may now choose differently.
    pub fn update_inventory(&self, fresh: Inventory) -> Vec<String> {
        let previous = self.inventory();
        let changed = changed_models(&previous, &fresh);
        let polled_at = fresh.polled_at;
        let mut books = self.books.lock();
        if previous.polled_at.is_some() {
            let evicted = evictions(&previous.resident, &fresh.resident);
            for model in evicted {
                *books.evictions_seen.entry(model.to_string()).or_default() += 1;
            }
        }
        if let Some(version) = &fresh.version {
            books.kind.learn_version(version);
        }
        for (name, state) in books.models.iter_mut() {
            // A request running for the model means it is loaded, or loading: a poll taken
            // during the first load does not list it yet.
            let unloaded = !fresh.resident.contains_key(name) && state.in_flight == 0;
            let served_since = match (state.last_success, polled_at) {
                (Some(served), Some(polled)) => served > polled,
                _ => false,
            };
            if unloaded && !served_since {
                for slot in &mut state.slots {
                    slot.lineage = 0;
                    slot.depth = 0;
                }
                state.warm.host.clear();
                state.last_success = None;
            }
        }
        drop(books);
        self.inventory.store(Arc::new(fresh));
        changed
    }
}

/// Models that left memory between two polls to make room for another: they are gone
/// while some model arrived. A model that left with nothing arriving unloaded on its own
/// (keep-alive, or a client's `keep_alive: 0`).
fn evictions<'a>(
    before: &'a HashMap<String, Resident>,
    after: &HashMap<String, Resident>,
) -> Vec<&'a str> {
    let arrived = after.keys().any(|m| !before.contains_key(m));
    if !arrived {
        return Vec::new();
    }
    before
        .keys()
        .filter(|m| !after.contains_key(*m))
        .map(String::as_str)
        .collect()
}

/// Models whose residency or presence on disk differs between two inventories.
fn changed_models(old: &Inventory, new: &Inventory) -> Vec<String> {
    let mut changed: Vec<String> = Vec::new();
    let mut note = |name: &String| {
        if !changed.contains(name) {
            changed.push(name.clone());
        }
    };
    for (a, b) in [(old, new), (new, old)] {
        a.resident
            .keys()
            .filter(|m| !b.resident.contains_key(*m))
            .for_each(&mut note);
        a.on_disk
            .keys()
            .filter(|m| !b.on_disk.contains_key(*m))
            .for_each(&mut note);
    }
    changed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ewma_starts_at_first_sample_and_moves_slowly() {
        let mut e = Ewma::default();
        assert_eq!(e.get(), None);
        e.record(100.0);
        assert_eq!(e.get(), Some(100.0));
        e.record(0.0);
        assert_eq!(e.get(), Some(80.0));
        e.record(f64::NAN);
        assert_eq!(e.get(), Some(80.0));
    }

    #[test]
    fn success_ratio_falls_on_failure_and_heals_with_time() {
        let t0 = Instant::now();
        let mut r = SuccessRatio::new();
        assert_eq!(r.get(t0), 1.0);
        r.record(false, t0);
        assert!((r.get(t0) - 0.8).abs() < 1e-9);
        assert!((r.get(t0 + SuccessRatio::HALF_LIFE) - 0.9).abs() < 1e-9);
        r.record(true, t0);
        assert!(r.get(t0) > 0.8);
    }

    #[test]
    fn an_inventory_names_the_models_loaded_and_unloaded_since_the_last() {
        let node = Node::new(0, NodeConfig::new("a", "http://127.0.0.1:9")).unwrap();
        let resident = Inventory::with_resident;
        assert_eq!(node.update_inventory(resident(&["a", "b"])).len(), 2);
        assert!(node.update_inventory(resident(&["a", "b"])).is_empty());
        let mut changed = node.update_inventory(resident(&["b", "c"]));
        changed.sort();
        assert_eq!(changed, vec!["a", "c"]);
    }

    #[test]
    fn unload_empties_slots_unless_served_after_poll() {
        let node = Node::new(0, NodeConfig::new("a", "http://127.0.0.1:9")).unwrap();
        let before = Instant::now();
        {
            let mut books = node.lock_books();
            let m = books.models.entry("m:latest".into()).or_default();
            m.slots = vec![Slot {
                lineage: 7,
                depth: 2,
                last_used: Some(before),
                busy: 0,
                tokens: 10,
                first: 0,
            }];
            m.last_success = Some(Instant::now());
        }
        // A poll sent before the last success does not clear it.
        node.update_inventory(Inventory {
            polled_at: Some(before),
            ..Default::default()
        });
        assert_eq!(node.lock_books().models["m:latest"].slots[0].lineage, 7);
        let set_in_flight =
            |n: u32| node.books(|b| b.models.get_mut("m:latest").unwrap().in_flight = n);
        // Nor does one taken while a request for it runs (the model is loading).
        set_in_flight(1);
        node.update_inventory(Inventory {
            polled_at: Some(Instant::now()),
            ..Default::default()
        });
        assert_eq!(node.lock_books().models["m:latest"].slots[0].lineage, 7);
        set_in_flight(0);
        // A later poll that sees the model gone does.
        node.update_inventory(Inventory {
            polled_at: Some(Instant::now()),
            ..Default::default()
        });
        assert_eq!(node.lock_books().models["m:latest"].slots[0].lineage, 0);
    }

    #[test]
    fn a_model_gone_while_another_arrived_was_evicted() {
        let node = Node::new(0, NodeConfig::new("a", "http://127.0.0.1:9")).unwrap();
        let holding = |models: &[&str]| Inventory {
            polled_at: Some(Instant::now()),
            resident: models
                .iter()
                .map(|m| {
                    let r = Resident {
                        size: 1,
                        context_length: None,
                        expires_at: None,
                    };
                    (m.to_string(), r)
                })
                .collect(),
            ..Default::default()
        };
        node.update_inventory(holding(&["a", "b"]));
        // "c" arrived and "a" left: an eviction.
        node.update_inventory(holding(&["b", "c"]));
        // "b" left and nothing arrived: an unload (keep-alive), not an eviction.
        node.update_inventory(holding(&["c"]));
        let seen = node.books(|b| b.evictions_seen.clone());
        assert_eq!(seen.get("a"), Some(&1));
        assert_eq!(seen.get("b"), None);
        assert_eq!(seen.len(), 1);
    }
}
