//! Keeping the books while a request runs. Its life is a value that each step consumes:
//! counted on its node ([`Reserved`]: its place among the node's requests, any load it
//! starts reserved), sent ([`Dispatch`]: committed under the placement lock to the slot
//! mirror and the affinity table), then finished or failed, which consumes it. Dropped
//! on any other path (the client left), it gives its count back. Also here: its wait in
//! corral's queue (`WaitTicket`) and what its reply showed of the node's cache. Choosing
//! the node is [`super::Router::decide_with`]'s job.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use hashbrown::HashMap;

use super::router::{Placing, Router};
use super::slots::{Opening, SlotPolicy, choose_slot, first_freed_since};
use super::{AffinityResult, Candidate, Decision, Entry, HostProbe};
use crate::fleet::kind::Counting;
use crate::fleet::reply::{Reading, ReplyStats};
use crate::fleet::warm::{Measured, Observed, measure};
use crate::fleet::{Evidence, ModelState, Node, Rules, Slot};
use crate::request::Profile;

impl Router {
    /// Counts a request as waiting for a slot on `node`, its best choice, unless `max`
    /// requests already wait. Waiting requests add to the node's queue depth, so that
    /// others weigh the wait before joining it.
    pub fn wait_ticket(
        self: &Arc<Self>,
        node: &Arc<Node>,
        model: &str,
        warm: bool,
        max: usize,
    ) -> Option<WaitTicket> {
        if self.waiting.fetch_add(1, Ordering::AcqRel) >= max {
            self.waiting.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        node.books(|books| {
            let state = books.models.entry_ref(model).or_default();
            state.waiting += 1;
            state.waiting_warm += u32::from(warm);
        });
        Some(WaitTicket {
            router: self.clone(),
            node: node.clone(),
            model: model.to_string(),
            warm,
        })
    }

    /// Counts the request against the node while it runs, if the node runs fewer than
    /// `num_parallel` requests for the model (else the request should wait, or go
    /// elsewhere). The count is given back when what is returned, or what it becomes, is
    /// dropped, on every path.
    pub fn try_dispatch(self: &Arc<Self>, node: &Arc<Node>, p: &Profile) -> Option<Reserved> {
        self.dispatch(node, p, false, Past::No, false).map(Reserved)
    }

    /// [`Router::try_dispatch`] to a ranked candidate. Where the model is not resident, the
    /// request loads it: the model's memory is reserved there until the request ends, and
    /// it counts as loading for the next decisions (call under [`Router::placement`]).
    ///
    /// `yields`: the request leaves to the requests waiting warm for the node the slots they
    /// wait for ([`super::stay::yields_to_warm`]).
    pub fn try_send(
        self: &Arc<Self>,
        candidate: &Candidate,
        p: &Profile,
        yields: bool,
    ) -> Option<Reserved> {
        self.dispatch(&candidate.node, p, !candidate.resident, Past::No, yields)
            .map(Reserved)
    }

    /// [`Router::try_send`] past the number the node is believed to run at once (up to
    /// [`super::parallel::probe_limit`]), to learn whether it runs more; for a request that
    /// would otherwise wait for this node. `None` when the number is configured
    /// (`nodes[].num_parallel`) or reported by the node, or corral no longer probes it.
    /// `yields` as for [`Router::try_send`].
    pub fn try_probe(
        self: &Arc<Self>,
        candidate: &Candidate,
        p: &Profile,
        yields: bool,
    ) -> Option<Reserved> {
        let node = &candidate.node;
        if node.parallel_told(&node.settings()) || !self.probes.may_probe(node.id, node.parallel())
        {
            return None;
        }
        self.dispatch(node, p, !candidate.resident, Past::Probe, yields)
            .map(Reserved)
    }

    /// [`Router::try_send`] one past the number the node runs at once, into the node's own
    /// queue, where the node is configured so (`nodes[].queue_at_node`) and slow to begin a
    /// request ([`super::parallel::queues_at_node`]): for a request warm there that would
    /// otherwise wait in corral for this node (a cold one keeps the choice of node until a
    /// slot frees anywhere). `yields` as for [`Router::try_send`].
    pub fn try_queue(
        self: &Arc<Self>,
        candidate: &Candidate,
        p: &Profile,
        yields: bool,
    ) -> Option<Reserved> {
        let node = &candidate.node;
        if !node.settings().queue_at_node {
            return None;
        }
        self.dispatch(node, p, !candidate.resident, Past::Queue, yields)
            .map(Reserved)
    }

    fn dispatch(
        self: &Arc<Self>,
        node: &Arc<Node>,
        p: &Profile,
        loads: bool,
        past: Past,
        yields: bool,
    ) -> Option<Dispatch> {
        let believed = node.parallel();
        let probe = past == Past::Probe;
        let limit = match past {
            Past::No => believed,
            Past::Probe => super::parallel::probe_limit(believed),
            Past::Queue => believed + 1,
        };
        let reserved = node.books(|books| {
            let state = books.models.entry_ref(p.model_key.as_str()).or_default();
            let left_to_warm = if yields { state.waiting_warm } else { 0 };
            // A probe is not sent into a slot left to a warm waiter: that would neither
            // yield nor test anything.
            let into_left_slot = probe && left_to_warm > 0 && (state.in_flight as usize) < believed;
            let quick_to_begin =
                past == Past::Queue && !super::parallel::queues_at_node(state.start_s.get());
            if (state.in_flight + left_to_warm) as usize >= limit
                || into_left_slot
                || quick_to_begin
            {
                return None;
            }
            state.in_flight += 1;
            let reserve = loads && state.loading.is_none();
            if reserve {
                state.loading = Some(Instant::now());
            }
            Some(reserve)
        })?;
        Some(Dispatch {
            router: self.clone(),
            node: node.clone(),
            model: p.model_key.clone(),
            slot: None,
            unseen_slot: false,
            lineage: 0,
            remembered: Vec::new(),
            reserved,
            prediction: None,
            prefill_tps: None,
            start_s: None,
            started: Instant::now(),
            streamed: p.stream,
            first_byte: None,
            probe: probe.then_some(believed),
            queued: past == Past::Queue,
            held: None,
            limit,
            run: None,
        })
    }

    /// Records that the request is sent to the node: it now occupies one of the model's
    /// slots there, as Ollama assigns them (its own slot if it continues a conversation, else
    /// a free one, else the least recently used), and its prefix is remembered as warm there.
    fn commit(&self, dispatch: &mut Dispatch, p: &Profile, decision: &Decision) {
        if !p.endpoint.generates() || dispatch.slot.is_some() {
            return;
        }
        if let Some(key) = p.session {
            let entry = Entry {
                node: dispatch.node.id,
                lineage: 0,
            };
            self.sessions.insert(key, entry);
        }
        let node = &dispatch.node;
        let now = Instant::now();
        let pin = decision.pin.filter(|pin| pin.node == node.id);
        let settings = node.settings();
        let parallel = node.parallel();
        let opening = Opening::of(p);
        let tokens = opening.tokens;
        let mut unseen = false;
        let mut first_sent_before = false;
        let (index, lineage) = node.books(|books| {
            let policy = SlotPolicy::of(&books.kind, &settings);
            let state = books.models.entry_ref(p.model_key.as_str()).or_default();
            fit_slots(&mut state.slots, parallel);
            if let Some(&first) = p.chain.hashes.get(1) {
                first_sent_before = state.warm.first_messages.sent(first);
            }
            let queued = dispatch.queued;
            let continued = pin
                .filter(|pin| pin.continues && !pin.in_host && !queued)
                .and_then(|pin| {
                    let i = state.slots.iter().position(|s| s.lineage == pin.lineage)?;
                    Some((i, pin.lineage))
                });
            // The pause since the conversation's last turn ended: how long one stays live.
            let paused = continued.and_then(|(i, _)| {
                let slot = &state.slots[i];
                (slot.busy == 0).then_some(slot.last_used?)
            });
            if let Some(ended) = paused {
                self.turn_gaps.record(now.saturating_duration_since(ended));
            }
            let (index, lineage) = continued.unwrap_or_else(|| {
                // A conversation restored from the host cache leaves it, and goes on in
                // its own lineage if the request continues it. A queued request restores it
                // once it begins (`begin_in_freed_slot`): until then it stays in the host
                // cache, where others' saves may push it out.
                let restored = pin.filter(|pin| pin.in_host && !queued).and_then(|pin| {
                    let entry = state.warm.host.take(pin.lineage)?;
                    self.turn_gaps
                        .record(now.saturating_duration_since(entry.last_used));
                    Some(pin)
                });
                let lineage = match restored.or(pin.filter(|_| queued)) {
                    Some(pin) if pin.continues => pin.lineage,
                    _ => self.next_lineage.fetch_add(1, Ordering::Relaxed),
                };
                // A prompt that shares part of a slot's conversation (its system prompt)
                // takes that slot under the longest-prefix rule, if it is idle; the
                // multi-user cache copies the shared part into another slot instead.
                let forked = pin
                    .filter(|pin| policy == SlotPolicy::LongestPrefix && !pin.in_host)
                    .and_then(|pin| {
                        state
                            .slots
                            .iter()
                            .position(|s| s.lineage == pin.lineage && s.busy == 0)
                    });
                // A request queued at the node takes the first slot to free there, known
                // once it begins (`Dispatch::first_byte`); any other, one of the node's own
                // slots, never a place past them where a queued request waited.
                let known = &state.slots[..parallel.min(state.slots.len())];
                let chosen = if queued {
                    None
                } else {
                    forked.or_else(|| choose_slot(known, policy, &opening, now, self.ttl()))
                };
                let index = chosen.unwrap_or_else(|| {
                    state.slots.push(Slot::default());
                    state.slots.len() - 1
                });
                unseen = chosen.is_none();
                (index, lineage)
            });
            let held = Held {
                lineage,
                depth: p.chain.depth(),
                opening,
            };
            if queued {
                // Not in one of the node's slots yet: nothing is saved or copied to its
                // host cache until it begins.
                dispatch.held = Some(held);
                hold(&mut state.slots[index], held, now);
            } else {
                occupy(state, index, held, now);
            }
            (index, lineage)
        });
        dispatch.slot = Some(index);
        dispatch.unseen_slot = unseen;
        dispatch.lineage = lineage;
        dispatch.prediction = Some(Prediction {
            affinity: decision.affinity_for(node.id),
            first_sent_before,
            probe: decision.probe.filter(|probe| probe.node == node.id),
            estimated: tokens,
        });
        let depth = p.chain.depth();
        if depth > 0 {
            let entry = Entry {
                node: node.id,
                lineage,
            };
            self.affinity.insert(p.chain.last(), entry);
            dispatch.remembered.push(p.chain.last());
            // The first boundary too: conversations that share it (a system prompt, a
            // document) find the node that holds it.
            if depth > 1 {
                self.affinity.insert(p.chain.hashes[1], entry);
                dispatch.remembered.push(p.chain.hashes[1]);
            }
        }
        if let Some(run) = dispatch.run.as_mut() {
            run.sent(crate::shared::Sent {
                replica: 0,
                run: 0,
                node: node.name().to_string(),
                model: dispatch.model.clone(),
                slot: index,
                lineage,
                depth,
                tokens,
                first_tokens: opening.first_tokens,
                prefixes: dispatch.remembered.clone(),
                session: p.session,
                client: None,
            });
        }
    }

    /// Takes back what [`Router::commit`] recorded for a request that failed before any
    /// reply: the node's slot is not known to hold anything now, and the prefix is not warm
    /// there.
    fn abandon(&self, dispatch: &mut Dispatch) {
        if let Some(run) = dispatch.run.as_mut() {
            run.abandoned();
        }
        for hash in dispatch.remembered.drain(..) {
            if self
                .affinity
                .peek(hash)
                .is_some_and(|e| e.lineage == dispatch.lineage)
            {
                self.affinity.remove(hash);
            }
        }
        let Some(index) = dispatch.slot else { return };
        dispatch.node.books(|books| {
            if let Some(slot) = books
                .models
                .get_mut(&dispatch.model)
                .and_then(|m| m.slots.get_mut(index))
                .filter(|s| s.lineage == dispatch.lineage)
            {
                slot.lineage = 0;
                slot.depth = 0;
            }
        });
    }
}

/// A request counted on its node (any load it starts reserved there) but not sent yet:
/// the shared store may still turn it away (dropped, it gives its count back). Sending
/// it commits it ([`Reserved::commit`]).
pub struct Reserved(Dispatch);

impl Reserved {
    pub fn node(&self) -> &Arc<Node> {
        &self.0.node
    }

    /// The most requests for the model the node is to run with this one.
    pub(super) fn limit(&self) -> usize {
        self.0.limit
    }

    pub(super) fn set_run(&mut self, run: crate::shared::Run) {
        self.0.run = Some(run);
    }

    /// Sends the request: records it in the node's slot mirror and the affinity table
    /// (`Router::commit`). Under the placement lock, so that no decision sees the request
    /// counted on the node but not yet in its slots.
    pub fn commit(self, p: &Profile, decision: &Decision, _placing: &Placing<'_>) -> Dispatch {
        let mut dispatch = self.0;
        let router = dispatch.router.clone();
        router.commit(&mut dispatch, p, decision);
        dispatch
    }
}

/// A request waiting in corral for a free slot; counted until dropped.
pub struct WaitTicket {
    router: Arc<Router>,
    node: Arc<Node>,
    model: String,
    warm: bool,
}

impl WaitTicket {
    /// Leaves the queue without deciding again (timed out, or the client left): requests
    /// that left a freed slot to this one, as it waited warm there, look again.
    pub fn leave(self) {
        let wake = self
            .warm
            .then(|| (self.router.clone(), self.node.clone(), self.model.clone()));
        drop(self);
        if let Some((router, node, model)) = wake {
            router.fleet.wakeups.slot_freed(&model, &node);
        }
    }
}

impl Drop for WaitTicket {
    fn drop(&mut self) {
        self.node.books(|books| {
            if let Some(state) = books.models.get_mut(&self.model) {
                state.waiting = state.waiting.saturating_sub(1);
                state.waiting_warm = state.waiting_warm.saturating_sub(u32::from(self.warm));
            }
            forget_if_unused(&mut books.models, &self.model);
        });
        self.router.waiting.fetch_sub(1, Ordering::AcqRel);
    }
}

/// How far past the number of requests a node is believed to run at once one is sent.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Past {
    /// Not past: into a free slot.
    No,
    /// One past, to learn whether the node runs more ([`Router::try_probe`]).
    Probe,
    /// One past, to wait in the node's own queue ([`Router::try_queue`]).
    Queue,
}

/// What a request leaves in its slot.
#[derive(Clone, Copy)]
pub(super) struct Held {
    pub lineage: u64,
    pub depth: usize,
    /// Its prompt's tokens and first message.
    pub opening: Opening,
}

/// Puts a request in slot `index` of the mirror (made long enough to have it).
pub(super) fn occupy(state: &mut ModelState, index: usize, held: Held, now: Instant) {
    if state.slots.len() <= index {
        state.slots.resize(index + 1, Slot::default());
    }
    // A conversation no slot holds comes back from the host cache, which it leaves
    // (`server_prompt_cache::load`); one a slot holds goes on there, and a copy saved while
    // that slot was idle stays.
    if !state.slots.iter().any(|s| s.lineage == held.lineage) {
        state.warm.host.take(held.lineage);
    }
    // The conversation the slot held is saved to host memory (llama-server's prompt cache;
    // the old runner's cache, learned empty, keeps nothing), unless the request keeps at
    // least half of it: one opening alike with a long first message.
    let displaced = &state.slots[index];
    if displaced.lineage != 0 && displaced.lineage != held.lineage && held.opening.saves(displaced)
    {
        let saved = displaced.saved(now);
        state.warm.host.save(saved);
    }
    hold(&mut state.slots[index], held, now);
    // Once a task has its slot, llama-server copies every idle slot's conversation into its
    // host cache (`--cache-idle-slots`, on by default with a host cache:
    // `server-context.cpp`, after `launch_slot_with_task`). The copies take room there and
    // push older conversations out.
    for idle in state.slots.iter().filter(|s| s.busy == 0) {
        state.warm.host.save(idle.saved(now));
    }
}

/// Puts a request in a slot: it uses it, and leaves its conversation there.
fn hold(slot: &mut Slot, held: Held, now: Instant) {
    slot.lineage = held.lineage;
    slot.depth = held.depth;
    slot.last_used = Some(now);
    slot.busy += 1;
    slot.tokens = held.opening.tokens;
    slot.first = held.opening.first;
}

/// Makes the mirror `parallel` slots long. Slots beyond that, added for requests sent past
/// the slots corral knew of, go once idle (the node queued such a request, or runs fewer
/// slots since a reload): which of its slots the request then took is not known, so its
/// conversation is not counted warm.
fn fit_slots(slots: &mut Vec<Slot>, parallel: usize) {
    while slots.len() > parallel && slots.last().is_some_and(|s| s.busy == 0) {
        slots.pop();
    }
    if slots.len() < parallel {
        slots.resize(parallel, Slot::default());
    }
}

/// Drops a model's state on a node once nothing runs or waits there and nothing was learned:
/// a client can name any model, and a node not polled yet is tried for all of them, so
/// without this every invented name would stay in memory and in the metrics' labels.
pub(super) fn forget_if_unused(models: &mut HashMap<String, ModelState>, model: &str) {
    let unused = models.get(model).is_some_and(|s| {
        !s.busy()
            && s.loading.is_none()
            && s.last_success.is_none()
            && s.slots.iter().all(|slot| slot.lineage == 0)
    });
    if unused {
        models.remove(model);
    }
}

/// A request counted against a node. Dropping it gives back the in-flight count and the
/// slot, and wakes requests waiting for one.
pub struct Dispatch {
    router: Arc<Router>,
    pub node: Arc<Node>,
    model: String,
    slot: Option<usize>,
    /// The mirror gave the request a slot past those it knows (the old runner's every known
    /// slot was busy): the node ran it in a slot corral has not seen, or queued it.
    unseen_slot: bool,
    /// The slot lineage and prefix hashes `commit` recorded, for `abandon`.
    lineage: u64,
    remembered: Vec<u64>,
    /// This request loads the model on the node: it holds the model's reservation there.
    reserved: bool,
    /// What corral expected of the node's cache when it sent the request.
    prediction: Option<Prediction>,
    prefill_tps: Option<f64>,
    /// Seconds the node took to begin the request, from its reply: learned with the node's
    /// speeds when the request finishes.
    start_s: Option<f64>,
    started: Instant,
    /// The client asked for a stream: the reply's first byte carries its first token.
    streamed: bool,
    /// Time from sending to the reply's first byte, once it came: the request then counts
    /// in the model's `streaming` there.
    first_byte: Option<Duration>,
    /// Sent past the number the node was believed to run at once (that number), and not
    /// yet shown to have run beside as many: a candidate for "the node queued it".
    probe: Option<usize>,
    /// Sent one past the number the node runs at once, to wait in its queue
    /// ([`Router::try_queue`]): it takes the first slot to free there.
    queued: bool,
    /// What a queued request leaves in the slot it takes once it begins.
    held: Option<Held>,
    /// The most requests for the model the node was to run with this one.
    pub(super) limit: usize,
    /// The request's place in the books shared with other replicas, when there are.
    pub(super) run: Option<crate::shared::Run>,
}

impl Dispatch {
    /// The request was sent where the model was neither resident nor loading: it starts a
    /// load (`corral_cold_loads_total`).
    pub fn starts_load(&self) -> bool {
        self.reserved
    }

    /// The reply's first byte came: it counts as streaming until the request ends, and the
    /// replies streaming beside it show how many requests the node runs at once.
    pub fn first_byte(&mut self) {
        if self.first_byte.is_some() {
            return;
        }
        let ttfb = self.started.elapsed();
        self.first_byte = Some(ttfb);
        // A new conversation's first token came after its whole prompt: until some reply
        // of the node's has reported its prefill, that is its cold rate (a little low: it
        // includes the hop). Without it a slow node would count as fast as the fleet's best
        // from its first token to the end of its first reply, tens of seconds on a slow
        // node, and take every conversation that came meanwhile.
        let first_token_rate = self
            .prediction
            .filter(|p| p.affinity == AffinityResult::New)
            .filter(|_| self.streamed && !self.reserved && self.probe.is_none() && !self.queued)
            .map(|p| p.estimated);
        let others = self.node.books(|books| {
            let state = books.models.get_mut(&self.model)?;
            state.streaming += 1;
            if let Some(tokens) = first_token_rate
                && state.warm.cold_rate.get().is_none()
            {
                state.warm.cold_rate.record(tokens, ttfb.as_secs_f64());
            }
            Some(state.streaming - 1)
        });
        let Some(others) = others else { return };
        let shown = super::parallel::shown_parallel(others);
        self.node.learn_parallel_at_least(shown);
        // Beside fewer than believed, it may have been queued, or a reply it ran beside may
        // have ended first: the reply's durations tell (see `observe`).
        self.probe = self
            .probe
            .filter(|&believed| super::parallel::probe_queued(believed, shown));
        if self.probe.is_some() && self.unseen_slot {
            self.take_freed_slot();
        }
        if let Some(held) = self.held.take() {
            self.begin_in_freed_slot(held);
        }
    }

    /// A request queued at the node began: in the first slot that freed there after it was
    /// sent, which takes it as any prompt takes a slot (its conversation saved to the host
    /// cache, idle slots copied there). Where no slot is seen to have freed, it stays where
    /// the mirror put it, past the known slots, and is not counted warm after.
    fn begin_in_freed_slot(&mut self, held: Held) {
        let Some(own) = self.slot else { return };
        let now = Instant::now();
        let moved = self.node.books(|books| {
            let state = books.models.get_mut(&self.model)?;
            let freed = freed_for(state, own, self.started)?;
            // Its conversation, if the host cache kept it, comes back from there (`occupy`).
            state.slots[own] = Slot::default();
            occupy(state, freed, held, now);
            Some(freed)
        });
        if let Some(freed) = moved {
            self.slot = Some(freed);
        }
    }

    /// A probe in a slot the mirror had not seen began beside no more than the node was
    /// believed to run: the node likely queued it, and then gave it the first slot to free
    /// after it was sent (the old runner waits for any slot, then takes an idle one). That
    /// slot's conversation is gone from the node, and the probe's is there: the mirror
    /// moves the request into it, or it would count the gone conversation warm and forget
    /// the probe's.
    fn take_freed_slot(&mut self) {
        let Some(own) = self.slot else { return };
        let moved = self.node.books(|books| {
            let state = books.models.get_mut(&self.model)?;
            let freed = freed_for(state, own, self.started)?;
            let held = std::mem::take(&mut state.slots[own]);
            state.slots[freed] = Slot {
                busy: 1,
                last_used: Some(Instant::now()),
                ..held
            };
            Some(freed)
        });
        if let Some(freed) = moved {
            self.slot = Some(freed);
        }
    }

    /// Whether a probe that began beside no more than the believed number was queued by the
    /// node: most of its time to first byte went before the node began on it (the reply's
    /// load, prefill and, unstreamed, generation durations), or the reply does not say.
    fn waited_for_a_slot(&self, stats: &ReplyStats) -> bool {
        if self.first_byte.is_none() {
            return false;
        }
        self.worked_before_first_byte(stats)
            .is_none_or(|(ttfb, worked)| super::parallel::waited(ttfb, worked))
    }

    /// The reply's seconds to its first byte, and the node's reported work before that byte
    /// (load, prefill and, unstreamed, generation); `None` where either is not known.
    fn worked_before_first_byte(&self, stats: &ReplyStats) -> Option<(f64, f64)> {
        let ttfb = self.first_byte?.as_secs_f64();
        let prefill = stats.prefill_seconds()?;
        let secs = |ns: Option<u64>| ns.map_or(0.0, |ns| ns as f64 / 1e9);
        let generation = if self.streamed {
            0.0
        } else {
            secs(stats.eval_duration)
        };
        Some((ttfb, secs(stats.load_duration) + prefill + generation))
    }

    /// How long the node took to begin the request, where it was sent into a free slot (one
    /// sent past the slots may have waited for one).
    fn start_delay(&self, stats: &ReplyStats) -> Option<f64> {
        if self.queued || self.probe.is_some() {
            return None;
        }
        let (ttfb, worked) = self.worked_before_first_byte(stats)?;
        Some(super::parallel::start_delay(ttfb, worked))
    }
}

/// The slot a request the node queued took: the first to free after it was `sent`. Only a
/// request alone in its place in the mirror (`own`) moves.
fn freed_for(state: &ModelState, own: usize, sent: Instant) -> Option<usize> {
    state.slots.get(own).filter(|s| s.busy == 1)?;
    first_freed_since(&state.slots, own, sent)
}

/// What corral expected of a node's cache for one request, to check against the reply.
#[derive(Clone, Copy, Debug)]
struct Prediction {
    affinity: AffinityResult,
    /// The request's first message was sent to this node before (see
    /// [`crate::fleet::warm::FirstMessages`]).
    first_sent_before: bool,
    probe: Option<HostProbe>,
    /// corral's estimate of the prompt's tokens.
    estimated: u64,
}

/// A reply's cache measurement set against corral's prediction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Observation {
    pub predicted: AffinityResult,
    pub measured: Measured,
    pub observed: Observed,
}

impl Observation {
    /// Whether the prediction (warm for `hit` and `host`, cold otherwise) matched the node.
    pub fn agrees(&self) -> Option<bool> {
        let predicted_warm = self.predicted.is_warm();
        match self.observed {
            Observed::Warm => Some(predicted_warm),
            Observed::Cold => Some(!predicted_warm),
            Observed::Unknown => None,
        }
    }
}

/// What a finished reply taught about the node.
#[derive(Clone, Copy, Debug, Default)]
pub struct Outcome {
    pub ok: bool,
    pub ttfb: Option<Duration>,
    pub prefill_tps: Option<f64>,
    pub decode_tps: Option<f64>,
    /// Seconds the node spent loading the model for the request, where it loaded it.
    pub load_s: Option<f64>,
}

impl Dispatch {
    /// Reads the reply's report of cached prompt tokens as the node's kind counts them,
    /// learns from it (the node's kind and counting, its cold prefill rate, its host
    /// cache's capacity), and sets it against what corral predicted.
    pub fn observe(&mut self, stats: &ReplyStats) -> Option<Observation> {
        self.start_s = self.start_delay(stats);
        if let Some(believed) = self.probe.take()
            && self.waited_for_a_slot(stats)
        {
            self.router.probes.found_queuing(self.node.id, believed);
        }
        let prediction = self.prediction?;
        let reading = stats.reading()?;
        let node = self.node.clone();
        let observed = node.books(|books| {
            books.kind.learn_reply_shape(stats.shape());
            let counting = books.kind.counting;
            let state = books.models.get_mut(&self.model)?;
            let (measured, learned) = measure(
                reading,
                counting,
                state.warm.cold_rate.get(),
                prediction.estimated,
            );
            if let Some(learned) = learned
                && books.kind.counting == Counting::Unknown
            {
                books.kind.counting = learned;
            }
            let state = books.models.get_mut(&self.model)?;
            let observed = measured.observed();
            // The cold rate comes from replies that evaluated their whole prompt: a new
            // conversation whose first message (a system prompt it may share) was not sent
            // here before (the rate is not judged by the reply's reading, which the rate
            // itself makes), or any reply whose count is of evaluated tokens only.
            let whole_prompt =
                prediction.affinity == AffinityResult::New && !prediction.first_sent_before;
            // A node that does not say how long it took (OpenAI-compatible servers such as
            // vLLM) is timed by its first streamed token, where that followed the prefill
            // of the whole prompt and no load.
            let timed = (whole_prompt && self.streamed && !self.reserved)
                .then_some(self.first_byte)
                .flatten()
                .map(|t| t.as_secs_f64());
            let seconds = stats.prefill_seconds().or(timed);
            // Where the count is of evaluated tokens, every reply gives the rate.
            let counts_evaluated = matches!(reading, Reading::Exact { .. })
                || learned.unwrap_or(counting) == Counting::EvaluatedOnly;
            // The tokens the prefill duration covers.
            let covered = if whole_prompt && !counts_evaluated {
                Some(measured.total)
            } else {
                measured.evaluated()
            };
            if let (Some(seconds), Some(evaluated)) = (seconds, covered) {
                if whole_prompt || counts_evaluated {
                    state.warm.cold_rate.record(evaluated, seconds);
                }
                if evaluated > 0 && seconds > 0.0 {
                    self.prefill_tps = Some(evaluated as f64 / seconds);
                }
            }
            // What an old runner's replies show says nothing of a host cache: it has none.
            let shown = match prediction.probe {
                Some(probe) if books.kind.may_keep_host_cache() => {
                    (state.warm.host).learn(probe.needed, probe.newer as usize, observed);
                    Some(state.warm.host.shown_limit())
                }
                _ => None,
            };
            Some((
                Observation {
                    predicted: prediction.affinity,
                    measured,
                    observed,
                },
                shown,
            ))
        });
        let (observation, shown) = observed?;
        if let Some(shown) = shown {
            let peers = &self.router.peer_capacities;
            peers.record(&self.model, node.id, shown);
        }
        Some(observation)
    }

    /// The reply's decode speed: as the node reports it, else, for a streamed reply, its
    /// tokens after the first over the time they took.
    pub fn decode_tps(&self, stats: &ReplyStats) -> Option<f64> {
        if let Some(tps) = stats.decode_tps() {
            return Some(tps);
        }
        let first = self.first_byte.filter(|_| self.streamed)?.as_secs_f64();
        let tokens = stats.usage.as_ref()?.completion_tokens?;
        let after = self.started.elapsed().as_secs_f64() - first;
        (tokens > 1 && after > 0.0).then(|| (tokens - 1) as f64 / after)
    }

    /// Prefill speed measured by [`Dispatch::observe`]: evaluated tokens per second.
    pub fn prefill_tps(&self) -> Option<f64> {
        self.prefill_tps
    }

    /// The request failed before any reply: what sending it recorded is taken back
    /// (`Router::abandon`), and the node's failure counted.
    pub fn fail(mut self) {
        let router = self.router.clone();
        router.abandon(&mut self);
        self.finish(Outcome::default());
    }

    /// The request ended: what its reply showed of the node goes to its books, and its
    /// count is given back.
    pub fn finish(self, outcome: Outcome) {
        let rules = Rules::of(&self.router.config.load());
        let evidence = if outcome.ok {
            Evidence::Served
        } else {
            Evidence::Failed
        };
        self.router.fleet.learn(&self.node, evidence, &rules);
        if !outcome.ok {
            return;
        }
        let own_prefill = self.prefill_tps;
        let decode_tps = outcome.decode_tps;
        self.node.books(|books| {
            let state = books.models.entry_ref(self.model.as_str()).or_default();
            state.last_success = Some(Instant::now());
            // A load is the node's once per model, not each request's: the service time that
            // queued requests wait for leaves it out, and a load this request started is the
            // node's load time (one it only waited for the end of says less).
            let load_s = outcome.load_s.unwrap_or(0.0);
            let service_s = self.started.elapsed().as_secs_f64() - load_s;
            state.warm.service_s.record(service_s.max(0.0));
            if let Some(load_s) = outcome.load_s.filter(|_| self.reserved) {
                state.load_s.record(load_s);
            }
            if let Some(ttfb) = outcome.ttfb {
                state.ttfb_ms.record(ttfb.as_secs_f64() * 1000.0);
            }
            if let Some(tps) = outcome.prefill_tps.or(own_prefill) {
                state.prefill_tps.record(tps);
            }
            if let Some(tps) = decode_tps {
                state.decode_tps.record(tps);
            }
            if let Some(start_s) = self.start_s {
                state.start_s.record(start_s);
            }
            if outcome.prefill_tps.or(own_prefill).is_some() || decode_tps.is_some() {
                state.speed_at = Some(Instant::now());
            }
        });
    }
}

impl Drop for Dispatch {
    fn drop(&mut self) {
        self.node.books(|books| {
            if let Some(state) = books.models.get_mut(&self.model) {
                state.in_flight = state.in_flight.saturating_sub(1);
                if self.first_byte.is_some() {
                    state.streaming = state.streaming.saturating_sub(1);
                }
                // Loaded (the reply's success is now the sign of it) or failed: either
                // way the reservation ends.
                if self.reserved {
                    state.loading = None;
                }
                if let Some(slot) = self.slot.and_then(|i| state.slots.get_mut(i)) {
                    slot.busy = slot.busy.saturating_sub(1);
                    slot.last_used = Some(Instant::now());
                }
            }
            forget_if_unused(&mut books.models, &self.model);
        });
        // Only a request waiting for this model can use the slot.
        self.router
            .fleet
            .wakeups
            .slot_freed(&self.model, &self.node);
    }
}
