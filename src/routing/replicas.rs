//! Other corral replicas' requests in this replica's books (`shared_state:`, see
//! [`crate::shared`]). A request another replica sent counts on its node here as one of ours
//! does: in flight, in its slot, its prefixes warm there; its end frees the slot and wakes
//! requests waiting for one. Each is kept by (replica, run) until that replica says it ended,
//! stops listing it, or goes silent.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use hashbrown::HashMap;
use serde::{Deserialize, Serialize};

use super::book::{Held, forget_if_unused, occupy};
use super::remote::RemoteRun;
use super::slots::Opening;
use super::{Entry, Reserved, Router};
use crate::fleet::kind::Counting;
use crate::fleet::{ClientId, Node, Requester};
use crate::request::Profile;
use crate::shared::{Acquired, Alive, Ended, Event, Replica, Sent, Slots, Waiting};

/// How taking a request's lease in the shared store went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lease {
    /// The request may go: it holds a lease, or no store decides (none configured, the
    /// request takes no slot, or the store did not answer in time).
    Taken,
    /// Requests of all the replicas hold every slot (or wait for one before it): the request
    /// gives its place back. `news`: the store showed more requests on the node than the
    /// decision counted, and they are counted now, so deciding again may choose another node.
    Full { news: bool },
}

impl Router {
    /// Whether a request must take a lease in the shared store before it is sent: where
    /// replicas share one, for a generation.
    pub fn leases(&self, p: &Profile) -> bool {
        self.shared.is_some() && p.endpoint.generates()
    }

    /// Takes the request's lease on its node's slots in the shared store, where replicas
    /// share one.
    pub async fn share(
        self: &Arc<Self>,
        reserved: &mut Reserved,
        p: &Profile,
        requester: &Requester,
        request: u64,
    ) -> Lease {
        let Some(shared) = &self.shared else {
            return Lease::Taken;
        };
        if !p.endpoint.generates() {
            return Lease::Taken;
        }
        let node = reserved.node().clone();
        let slots = Slots {
            node: node.name(),
            model: &p.model_key,
            limit: reserved.limit(),
        };
        // The requests this decision counted on the node besides this one: requests of
        // other replicas heard of while the store answers were not.
        let counted = node.books(|books| {
            let state = books.models.get(p.model_key.as_str());
            state.map_or(0, |s| s.in_flight.saturating_sub(1))
        });
        let rank = self.fleet.wakeups.rank(requester);
        let client = requester.client.wire();
        let (run, acquired) = shared.acquire(slots, client, request, rank).await;
        if acquired == Acquired::Alone {
            // It goes without the store: off the waiters, where it held others back.
            shared.unwait(request);
        }
        match acquired {
            Acquired::Granted | Acquired::Alone => {
                reserved.set_run(run);
                Lease::Taken
            }
            Acquired::Full(holders) => {
                self.note_holders(&node, &p.model_key, &holders, shared.replica());
                let news = u32::try_from(holders.len()).unwrap_or(u32::MAX) > counted;
                Lease::Full { news }
            }
        }
    }

    /// `request` waits for `node`'s slot of `model` (None: for no node), among the waiters the
    /// replicas share.
    pub fn waits_for(&self, request: u64, requester: &Requester, node: Option<&Node>, model: &str) {
        let Some(shared) = &self.shared else {
            return;
        };
        match node {
            Some(node) => {
                let rank = self.fleet.wakeups.rank(requester);
                let client = requester.client.wire();
                shared.waits_for(request, (node.name(), model), client, rank);
            }
            None => shared.unwait(request),
        }
    }

    /// `request` waits no more: see [`crate::shared::Shared::unwait`].
    pub fn unwait(&self, request: u64) {
        if let Some(shared) = &self.shared {
            shared.unwait(request);
        }
    }

    /// Counts the lease holders not known here yet as requests in flight on the node.
    fn note_holders(&self, node: &Arc<Node>, model: &str, holders: &[(u64, u64)], own: u64) {
        let mut remote = self.remote.lock();
        let mut added = 0;
        for &(replica, run) in holders.iter().filter(|(r, _)| *r != own) {
            remote.runs.entry((replica, run)).or_insert_with(|| {
                added += 1;
                RemoteRun {
                    node: node.id,
                    model: model.to_string(),
                    slot: None,
                    charged: 0.0,
                }
            });
        }
        if added > 0 {
            node.books(|books| {
                books.models.entry_ref(model).or_default().in_flight += added;
            });
        }
    }

    fn node_named(&self, name: &str) -> Option<Arc<Node>> {
        self.fleet
            .nodes()
            .iter()
            .find(|n| n.name() == name)
            .cloned()
    }

    fn sent_elsewhere(&self, sent: Sent) {
        let Some(node) = self.node_named(&sent.node) else {
            return;
        };
        // Charged from its start, as its own replica charges it: else each replica would count
        // the other's requests only once they end, and rank that client before where the
        // other replica ranks it.
        let charged = (sent.client.as_deref())
            .and_then(ClientId::from_wire)
            .map_or(0.0, |client| self.fleet.wakeups.charge_start(&client));
        let mut remote = self.remote.lock();
        let known = remote.runs.contains_key(&(sent.replica, sent.run));
        node.books(|books| {
            let state = books.models.entry_ref(sent.model.as_str()).or_default();
            if !known {
                state.in_flight += 1;
            }
            let held = Held {
                lineage: sent.lineage,
                depth: sent.depth,
                opening: Opening {
                    // The last prefix remembered is its first message (see `Router::commit`).
                    first: sent.prefixes.last().copied().unwrap_or(0),
                    first_tokens: sent.first_tokens,
                    tokens: sent.tokens,
                },
            };
            occupy(state, sent.slot, held, Instant::now());
            // Its first message, the last prefix remembered (see `Router::commit`), was sent
            // there: a reply there to another conversation opening with it is no cold rate.
            if let Some(&first) = sent.prefixes.last() {
                state.warm.first_messages.sent(first);
            }
        });
        let run = RemoteRun {
            node: node.id,
            model: sent.model,
            slot: Some((sent.slot, sent.lineage)),
            charged,
        };
        remote.runs.insert((sent.replica, sent.run), run);
        drop(remote);
        let entry = Entry {
            node: node.id,
            lineage: sent.lineage,
        };
        for prefix in sent.prefixes {
            self.affinity.insert(prefix, entry);
        }
        if let Some(key) = sent.session {
            self.sessions.insert(
                key,
                Entry {
                    lineage: 0,
                    ..entry
                },
            );
        }
    }

    /// Takes another replica's request off its node; wakes the requests waiting there.
    fn end(&self, run: RemoteRun, kept: bool) {
        let Some(node) = self.fleet.node(run.node) else {
            return;
        };
        node.books(|books| {
            if let Some(state) = books.models.get_mut(&run.model) {
                state.in_flight = state.in_flight.saturating_sub(1);
                let slot = run.slot.and_then(|(i, lineage)| {
                    state.slots.get_mut(i).filter(|s| s.lineage == lineage)
                });
                if let Some(slot) = slot {
                    slot.busy = slot.busy.saturating_sub(1);
                    slot.last_used = Some(Instant::now());
                    if !kept {
                        (slot.lineage, slot.depth) = (0, 0);
                    }
                }
            }
            forget_if_unused(&mut books.models, &run.model);
        });
        self.fleet.wakeups.slot_freed(&run.model, &node);
    }

    fn ended_elsewhere(&self, ended: Ended) {
        let run = self.remote.lock().runs.remove(&(ended.replica, ended.run));
        let charged = run.as_ref().map_or(0.0, |r| r.charged);
        if let Some(run) = run {
            self.end(run, ended.kept);
        }
        let client = ended.client.as_deref().and_then(ClientId::from_wire);
        if let Some(client) = client {
            // What it held, less what its start was charged.
            let held = ended.held_s.max(0.0) - charged;
            self.fleet.wakeups.charge(client, held);
        }
    }

    fn alive_elsewhere(&self, alive: Alive) {
        let listed: HashSet<u64> = alive.runs.into_iter().collect();
        let gone: Vec<RemoteRun> = {
            let mut remote = self.remote.lock();
            let gone: Vec<(u64, u64)> = (remote.runs.keys())
                .filter(|(replica, run)| *replica == alive.replica && !listed.contains(run))
                .copied()
                .collect();
            (gone.iter())
                .filter_map(|key| remote.runs.remove(key))
                .collect()
        };
        self.waits_elsewhere(alive.replica, alive.waits);
        for run in gone {
            self.end(run, true);
        }
    }

    /// What waits in another replica now, in place of what it said before.
    fn waits_elsewhere(&self, replica: u64, waits: Vec<Waiting>) {
        let old_waits = {
            let mut remote = self.remote.lock();
            let waits: Vec<(u16, String, u32)> = (waits.into_iter())
                .filter_map(|w| Some((self.node_named(&w.node)?.id, w.model, w.count)))
                .collect();
            for (node, model, count) in &waits {
                self.add_waits(*node, model, i64::from(*count));
            }
            remote.waits.insert(replica, waits)
        };
        for (node, model, count) in old_waits.unwrap_or_default() {
            self.add_waits(node, &model, -i64::from(count));
        }
    }

    fn add_waits(&self, node: u16, model: &str, delta: i64) {
        let Some(node) = self.fleet.node(node) else {
            return;
        };
        node.books(|books| {
            let state = books.models.entry_ref(model).or_default();
            let waiting = i64::from(state.waiting).saturating_add(delta).max(0);
            state.waiting = u32::try_from(waiting).unwrap_or(u32::MAX);
            forget_if_unused(&mut books.models, model);
        });
    }
}

impl Replica for Router {
    fn apply(&self, event: Event) {
        match event {
            Event::Sent(sent) => self.sent_elsewhere(sent),
            Event::Ended(ended) => self.ended_elsewhere(ended),
            Event::Alive(alive) => self.alive_elsewhere(alive),
            Event::Waits(waits) => self.waits_elsewhere(waits.replica, waits.waits),
        }
    }

    fn forget(&self, replica: Option<u64>) {
        let (runs, waits) = {
            let mut remote = self.remote.lock();
            let keys: Vec<(u64, u64)> = (remote.runs.keys())
                .filter(|(r, _)| replica.is_none_or(|replica| *r == replica))
                .copied()
                .collect();
            let runs: Vec<RemoteRun> = keys.iter().filter_map(|k| remote.runs.remove(k)).collect();
            let waits: Vec<(u16, String, u32)> = match replica {
                Some(replica) => remote.waits.remove(&replica).unwrap_or_default(),
                None => remote.waits.drain().flat_map(|(_, w)| w).collect(),
            };
            (runs, waits)
        };
        for (node, model, count) in waits {
            self.add_waits(node, &model, -i64::from(count));
        }
        for run in runs {
            self.end(run, true);
        }
    }

    fn waits(&self) -> Vec<Waiting> {
        let remote = self.remote.lock();
        let mut theirs: HashMap<(u16, &str), u32> = HashMap::new();
        for (node, model, count) in remote.waits.values().flatten() {
            *theirs.entry((*node, model.as_str())).or_default() += count;
        }
        let mut waits = Vec::new();
        for node in self.fleet.nodes().iter() {
            node.books(|books| {
                for (model, state) in &books.models {
                    let others = theirs.get(&(node.id, model.as_str())).copied();
                    let count = state.waiting.saturating_sub(others.unwrap_or(0));
                    if count > 0 {
                        waits.push(Waiting {
                            node: node.name().to_string(),
                            model: model.clone(),
                            count,
                        });
                    }
                }
            });
        }
        waits
    }

    fn facts(&self) -> Vec<(String, String)> {
        let nodes = self.fleet.nodes();
        nodes
            .iter()
            .filter_map(|node| {
                let facts = NodeFacts::of(self, node);
                Some((node.name().to_string(), serde_json::to_string(&facts).ok()?))
            })
            .collect()
    }

    fn seed(&self, name: &str, facts: &str) {
        let Some(node) = self.node_named(name) else {
            return;
        };
        match serde_json::from_str::<NodeFacts>(facts) {
            Ok(facts) => facts.seed(self, &node),
            Err(e) => log::debug!("shared state: facts of {name} do not parse: {e}"),
        }
    }
}

/// What replies taught about a node, as replicas write it to the store.
#[derive(Debug, Default, PartialEq, Serialize, Deserialize)]
struct NodeFacts {
    /// Slots the node showed (0: none shown).
    slots: usize,
    counting: Counting,
    host_cache: Option<bool>,
    models: Vec<ModelFacts>,
}

#[derive(Debug, Default, PartialEq, Serialize, Deserialize)]
struct ModelFacts {
    model: String,
    ttfb_ms: Option<f64>,
    prefill_tps: Option<f64>,
    decode_tps: Option<f64>,
    load_s: Option<f64>,
    service_s: Option<f64>,
    cold_rate: Option<f64>,
    /// Tokens the node's host cache was shown to keep of the model.
    host_tokens: Option<u64>,
}

impl NodeFacts {
    fn of(router: &Router, node: &Node) -> NodeFacts {
        node.books(|books| NodeFacts {
            slots: node.slots_shown().unwrap_or(0),
            counting: books.kind.counting,
            host_cache: books.kind.host_cache,
            models: (books.models.iter())
                .filter(|(_, s)| s.last_success.is_some())
                .map(|(model, s)| ModelFacts {
                    model: model.clone(),
                    ttfb_ms: s.ttfb_ms.get(),
                    prefill_tps: s.prefill_tps.get(),
                    decode_tps: s.decode_tps.get(),
                    load_s: s.load_s.get(),
                    service_s: s.warm.service_s.get(),
                    cold_rate: s.warm.cold_rate.get(),
                    host_tokens: router
                        .peer_capacities
                        .shown_by(model, node.id)
                        .or(s.warm.host.shown_limit()),
                })
                .collect(),
        })
    }

    /// Takes what this replica does not know yet.
    fn seed(self, router: &Router, node: &Node) {
        if self.slots > 0 {
            node.learn_parallel_at_least(self.slots);
        }
        for m in &self.models {
            if let Some(tokens) = m.host_tokens
                && router.peer_capacities.shown_by(&m.model, node.id).is_none()
            {
                router
                    .peer_capacities
                    .record(&m.model, node.id, Some(tokens));
            }
        }
        node.books(|books| {
            if books.kind.counting == Counting::Unknown {
                books.kind.counting = self.counting;
            }
            if books.kind.host_cache.is_none() {
                books.kind.host_cache = self.host_cache;
            }
            for m in self.models {
                let state = books.models.entry_ref(m.model.as_str()).or_default();
                state.ttfb_ms.seed(m.ttfb_ms);
                state.prefill_tps.seed(m.prefill_tps);
                state.decode_tps.seed(m.decode_tps);
                state.load_s.seed(m.load_s);
                state.warm.service_s.seed(m.service_s);
                if let Some(rate) = m.cold_rate {
                    state.warm.cold_rate.seed(rate);
                }
            }
        });
    }
}
