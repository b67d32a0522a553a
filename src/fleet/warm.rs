//! What a node keeps warm beyond its slots, learned from its replies.
//!
//! Every reply is a measurement of how many prompt tokens the node served from cache
//! ([`measure`]). A llama-server based node (Ollama 0.30 and later, llama.cpp) saves a
//! conversation pushed out of its slot into a host-memory prompt cache and restores it on
//! a match (llama.cpp `tools/server/server-context.cpp`, `get_available_slot`;
//! `server-task.cpp`, `server_prompt_cache`), oldest entries dropped first once the cache's
//! bytes are full. corral mirrors that list ([`HostCache`]) and learns its capacity, in
//! tokens, from what the replies show: a conversation found warm at some depth in the list
//! proves the capacity at least that deep, one found cold proves it shallower. Until a
//! node's own replies show a limit, it is taken to keep what other nodes serving the same
//! model were found to keep ([`PeerCapacities`]).

use std::collections::VecDeque;
use std::time::Instant;

use hashbrown::HashMap;

use super::ewma::Ewma;
use super::kind::Counting;
use super::reply::Reading;

/// How many prompt tokens a reply was served from cache, as measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Measured {
    /// All prompt tokens, cached or evaluated.
    pub total: u64,
    /// Tokens served from cache; `None` when the reply cannot tell (Ollama 0.30.1 counting
    /// before the node's cold prefill rate is known, or a reply without details).
    pub cached: Option<u64>,
}

impl Measured {
    /// Tokens the node evaluated, where known.
    pub fn evaluated(&self) -> Option<u64> {
        self.cached.map(|c| self.total.saturating_sub(c))
    }

    /// The node's verdict: warm when a real part of the prompt came from cache, more than
    /// a chat template's first tokens.
    pub fn observed(&self) -> Observed {
        match self.cached {
            None => Observed::Unknown,
            Some(cached) if cached >= MIN_WARM_TOKENS && cached * 4 >= self.total => Observed::Warm,
            Some(_) => Observed::Cold,
        }
    }
}

/// Fewer cached tokens than this are the template's first tokens, which every prompt shares.
const MIN_WARM_TOKENS: u64 = 16;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Observed {
    Warm,
    Cold,
    Unknown,
}

impl Observed {
    pub fn as_str(self) -> &'static str {
        match self {
            Observed::Warm => "warm",
            Observed::Cold => "cold",
            Observed::Unknown => "unknown",
        }
    }
}

/// Reads a reply as the node's counting says, or learns the counting from it.
///
/// `cold_tps` is the node's learned rate on prompts evaluated whole; `estimated` corral's
/// own estimate of the prompt's tokens. Returns the measurement and, when the reply proved
/// how the node counts, that counting.
pub fn measure(
    reading: Reading,
    counting: Counting,
    cold_tps: Option<f64>,
    estimated: u64,
) -> (Measured, Option<Counting>) {
    match reading {
        Reading::Exact {
            evaluated, cached, ..
        } => (
            Measured {
                total: evaluated + cached,
                cached: Some(cached),
            },
            None,
        ),
        Reading::Total { total } => (
            Measured {
                total,
                cached: None,
            },
            None,
        ),
        Reading::OllamaCount { count, duration_ns } => {
            let seconds = duration_ns.map(|ns| ns as f64 / 1e9);
            let could_evaluate = match (seconds, cold_tps) {
                (Some(s), Some(tps)) if tps > 0.0 => Some(s * tps),
                _ => None,
            };
            let learned = match counting {
                Counting::Unknown => {
                    // Fewer tokens than half the prompt: only evaluated ones are counted.
                    // Many more than the time could evaluate: cached ones are counted too.
                    if estimated >= 4 * MIN_WARM_TOKENS && count * 2 < estimated {
                        Some(Counting::EvaluatedOnly)
                    } else if could_evaluate
                        .is_some_and(|n| count as f64 > 3.0 * n + MIN_WARM_TOKENS as f64)
                    {
                        Some(Counting::CachedAndEvaluated)
                    } else {
                        None
                    }
                }
                _ => None,
            };
            let measured = match learned.unwrap_or(counting) {
                Counting::EvaluatedOnly => {
                    let total = count.max(estimated);
                    Measured {
                        total,
                        cached: Some(total - count),
                    }
                }
                Counting::CachedAndEvaluated => Measured {
                    total: count,
                    cached: could_evaluate.map(|n| {
                        // At least one token is always evaluated.
                        let evaluated = (n.round() as u64).clamp(1.min(count), count);
                        count - evaluated
                    }),
                },
                // Both countings agree on a reply that evaluated (nearly) all: cold.
                Counting::Unknown => Measured {
                    total: count,
                    cached: could_evaluate.map(|_| 0),
                },
            };
            (measured, learned)
        }
    }
}

/// A node's prefill rate on prompts it evaluated whole, in tokens per second: what turns
/// Ollama 0.30.1's `prompt_eval_duration` back into evaluated tokens.
///
/// A server evaluates the prompts of all its slots in one batch per step, so a prompt
/// evaluated beside another's reports a longer duration than it takes alone; a prompt that
/// was partly cached after all reports a shorter one. Beside others is the common case under
/// load, and a rate learned too slow reads a cold reply as partly cached. So the rate is the
/// upper end of the recent samples: the second fastest of the last few, which one cached
/// outlier cannot set.
#[derive(Clone, Copy, Debug, Default)]
pub struct ColdRate {
    /// The latest samples, oldest overwritten first.
    recent: [f64; ColdRate::WINDOW],
    len: usize,
    next: usize,
    /// The rate they give, worked out when a sample comes (requests read it far more often).
    rate: Option<f64>,
}

impl ColdRate {
    const WINDOW: usize = 8;

    pub fn get(&self) -> Option<f64> {
        self.rate
    }

    /// Takes `rate` (another replica's) where no reply was measured here yet.
    pub fn seed(&mut self, rate: f64) {
        if self.len == 0 && rate.is_finite() && rate > 0.0 {
            self.recent[0] = rate;
            (self.len, self.next) = (1, 1);
            self.rate = Some(rate);
        }
    }

    /// Records a reply believed to have evaluated its whole prompt.
    pub fn record(&mut self, tokens: u64, seconds: f64) {
        if tokens == 0 || seconds <= 0.0 || !seconds.is_finite() {
            return;
        }
        self.recent[self.next] = tokens as f64 / seconds;
        self.next = (self.next + 1) % Self::WINDOW;
        self.len = (self.len + 1).min(Self::WINDOW);
        let mut samples = self.recent;
        let samples = &mut samples[..self.len];
        samples.sort_unstable_by(|a, b| b.total_cmp(a));
        // With one or two samples the fastest; from three on, the second fastest.
        let at = if samples.len() >= 3 { 1 } else { 0 };
        self.rate = samples.get(at).copied();
    }
}

/// One conversation saved from a slot into the node's host memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostEntry {
    pub lineage: u64,
    /// Boundaries of the conversation it holds.
    pub depth: usize,
    /// Its tokens, as corral estimates them.
    pub tokens: u64,
    /// The hash of its first message; 0 when not known.
    pub first: u64,
    /// When its last turn was served.
    pub last_used: Instant,
}

/// The node's host-memory prompt cache as corral believes it: saved conversations oldest
/// first, and the capacity learned for it.
#[derive(Clone, Debug, Default)]
pub struct HostCache {
    entries: VecDeque<HostEntry>,
    /// The tokens of `entries`, kept as they change so that their mean costs nothing.
    saved_tokens: u64,
    capacity: Capacity,
    /// Recent replies to conversations found in the list: how deep each was, and whether
    /// the node had it warm.
    seen: VecDeque<(u64, bool)>,
    /// Some reply in `seen` found a conversation cold: the node's own evidence speaks to
    /// its limit, and no peer's capacity stands in for it.
    limit_shown: bool,
    /// The deepest conversation `seen` found warm: the cache holds at least this much.
    warm_floor: u64,
    /// The most conversations a reply showed the cache keeping: one found warm and those
    /// saved after it.
    kept_seen: usize,
    /// The largest conversation saved: llama-server's cache keeps at least a context's
    /// worth of tokens (`server_prompt_cache::update`: never fewer than `n_ctx`), so at
    /// least this much.
    largest_saved: u64,
}

/// The learned capacity of a host cache, in estimated tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Capacity {
    /// No reply has shown a limit yet: every saved conversation counts as warm.
    #[default]
    Unbounded,
    Tokens(u64),
}

impl Capacity {
    fn holds(self, needed: u64) -> bool {
        match self {
            Capacity::Unbounded => true,
            Capacity::Tokens(t) => needed <= t,
        }
    }
}

/// What [`HostCache::survey`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Survey {
    capacity: Capacity,
    /// Conversations saved, warm or not.
    saved: usize,
    /// Tokens of the newest saved conversations that the capacity keeps.
    warm_tokens: u64,
    /// Saved copies of conversations that slots hold, kept by the capacity.
    pub copies: usize,
    /// Saved conversations no slot holds whose last turn was recent: still live, whether
    /// the cache kept them or not.
    pub live: usize,
}

impl Survey {
    /// Whether saving `tokens` more would push no conversation counted warm out. Before
    /// any reply has shown a limit, the cache is taken to hold as many conversations as
    /// the node has `slots`, so that new conversations spread by slots meanwhile.
    pub fn has_room(&self, tokens: u64, slots: usize) -> bool {
        match self.capacity {
            Capacity::Tokens(capacity) => self.warm_tokens + tokens <= capacity,
            Capacity::Unbounded => self.saved < slots,
        }
    }
}

/// Where a conversation stands in a host cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostPlace {
    pub depth: usize,
    /// Tokens of it and of every conversation saved after it: what the cache must hold
    /// for it to be still there.
    pub needed: u64,
    /// Conversations saved after it.
    pub newer: usize,
    /// Whether the learned capacity holds that much: not known to be lost.
    pub warm: bool,
    /// Whether corral expects it there ([`HostCache::expects`]): routing follows `warm`
    /// (the node is the only one that may still hold it), the prediction checked against
    /// the reply follows this.
    pub expected: bool,
}

impl HostCache {
    /// Saved conversations remembered, warm or not, so that a later reply can show how
    /// deep the real cache goes.
    const MAX_ENTRIES: usize = 1024;
    /// Replies the capacity is learned from: the most recent ones, so that it follows a
    /// node whose cache changes (other models loaded, a restart).
    const SEEN: usize = 64;

    /// A cache known to hold nothing (the old Ollama runner).
    pub fn none() -> HostCache {
        HostCache {
            entries: VecDeque::new(),
            saved_tokens: 0,
            capacity: Capacity::Tokens(0),
            seen: VecDeque::new(),
            limit_shown: true,
            warm_floor: 0,
            kept_seen: 0,
            largest_saved: 0,
        }
    }

    /// The capacity learned from this node's own replies.
    pub fn capacity(&self) -> Capacity {
        self.capacity
    }

    /// The capacity the cache is taken to have: its own, or while its replies have shown
    /// no limit, `peers` (what nodes serving the same model keep, [`PeerCapacities`]) but
    /// never less than it was seen to hold. Ollama starts every llama-server without
    /// `--cache-ram`, so nodes of one model keep about as many tokens, and the first
    /// node to show a limit spares the others the same surprise.
    pub fn capacity_with(&self, peers: Option<u64>) -> Capacity {
        match (self.capacity, peers) {
            (Capacity::Unbounded, Some(tokens)) if !self.limit_shown => {
                Capacity::Tokens(tokens.max(self.warm_floor))
            }
            (own, _) => own,
        }
    }

    /// The capacity this node's replies have shown, for its peers; `None` while they show
    /// no limit.
    pub fn shown_limit(&self) -> Option<u64> {
        match self.capacity {
            Capacity::Tokens(tokens) if self.limit_shown => Some(tokens),
            _ => None,
        }
    }

    pub fn set_capacity(&mut self, capacity: Capacity) {
        self.capacity = capacity;
        self.limit_shown = capacity != Capacity::Unbounded;
    }

    /// A slot's conversation saved, as llama-server saves a prompt
    /// (`server_prompt_cache::alloc`): as the newest, unless the cache holds it whole
    /// already (saved before, and not grown since), where it stays as old as it was.
    pub fn save(&mut self, entry: HostEntry) {
        if entry.lineage == 0 {
            return;
        }
        let held = self.entries.iter_mut().find(|e| e.lineage == entry.lineage);
        if let Some(held) = held.filter(|e| e.depth >= entry.depth && e.tokens >= entry.tokens) {
            held.last_used = held.last_used.max(entry.last_used);
            return;
        }
        self.take(entry.lineage);
        self.largest_saved = self.largest_saved.max(entry.tokens);
        self.saved_tokens += entry.tokens;
        self.entries.push_back(entry);
        while self.entries.len() > Self::MAX_ENTRIES {
            if let Some(oldest) = self.entries.pop_front() {
                self.saved_tokens = self.saved_tokens.saturating_sub(oldest.tokens);
            }
        }
    }

    /// A conversation restored into a slot leaves the cache.
    pub fn take(&mut self, lineage: u64) -> Option<HostEntry> {
        let i = self.entries.iter().position(|e| e.lineage == lineage)?;
        let entry = self.entries.remove(i)?;
        self.saved_tokens = self.saved_tokens.saturating_sub(entry.tokens);
        Some(entry)
    }

    /// Tokens saving `entry` would add: none where the cache holds it whole already.
    fn adds(&self, entry: &HostEntry) -> u64 {
        let held = (self.entries.iter()).any(|e| {
            e.lineage == entry.lineage && e.depth >= entry.depth && e.tokens >= entry.tokens
        });
        if entry.lineage == 0 || held {
            0
        } else {
            entry.tokens
        }
    }

    /// Where `lineage` stands in the cache when the node restores it into a slot whose
    /// conversation (`saved_first`) it saves first: llama-server makes room for that save
    /// by dropping the oldest entries before it looks for the one to restore
    /// (`server_prompt_cache::alloc`, then `load`), so the save can push out the very
    /// conversation it is about to restore. The save counts in the tokens needed, which a
    /// learned capacity judges; not in the conversations saved after it, which the guess
    /// made before any limit is shown counts against the node's slots.
    pub fn place(
        &self,
        lineage: u64,
        peers: Option<u64>,
        slots: usize,
        saved_first: Option<&HostEntry>,
    ) -> Option<HostPlace> {
        let capacity = self.capacity_with(peers);
        let first = saved_first
            .filter(|e| e.lineage != lineage)
            .map_or(0, |e| self.adds(e));
        let mut needed = first;
        for (newer, e) in self.entries.iter().rev().enumerate() {
            needed += e.tokens;
            if e.lineage == lineage {
                return Some(HostPlace {
                    depth: e.depth,
                    needed,
                    newer,
                    warm: capacity.holds(needed),
                    expected: self.expects(capacity, needed, newer, slots),
                });
            }
        }
        None
    }

    /// The newest saved conversation opening with the first message `first` (a system
    /// prompt conversations share), where that message is known.
    pub fn opening(&self, first: u64) -> Option<u64> {
        let newest = self.entries.iter().rev().find(|e| e.first == first);
        newest.filter(|_| first != 0).map(|e| e.lineage)
    }

    /// Whether corral expects the cache to keep a conversation that needs `needed` tokens
    /// of it, with `newer` conversations saved after it. Before a reply has shown a limit,
    /// nothing is known lost, but a cache is expected to keep only as many conversations as
    /// the node has `slots` (what [`Survey::has_room`] plans on) or as replies showed it
    /// keeping, or as many tokens as replies found warm or it surely keeps: a cache larger
    /// than that shows itself by warm replies, one smaller by a cold one.
    fn expects(&self, capacity: Capacity, needed: u64, newer: usize, slots: usize) -> bool {
        match capacity {
            Capacity::Unbounded => {
                newer < slots.max(self.kept_seen)
                    || needed <= self.warm_floor.max(self.largest_saved)
            }
            Capacity::Tokens(_) => capacity.holds(needed),
        }
    }

    /// One pass over the saved conversations, newest first, for a decision: the copies of
    /// conversations that `in_slot` says a slot holds that the capacity keeps, the other
    /// conversations whose last turn was served since `since`, and the tokens kept warm.
    pub fn survey(
        &self,
        peers: Option<u64>,
        since: Instant,
        in_slot: impl Fn(u64) -> bool,
    ) -> Survey {
        let capacity = self.capacity_with(peers);
        let mut survey = Survey {
            capacity,
            saved: self.entries.len(),
            warm_tokens: 0,
            copies: 0,
            live: 0,
        };
        let mut needed = 0;
        for e in self.entries.iter().rev() {
            needed += e.tokens;
            let kept = capacity.holds(needed);
            if kept {
                survey.warm_tokens = needed;
            }
            if in_slot(e.lineage) {
                survey.copies += usize::from(kept);
            } else if e.last_used >= since {
                survey.live += 1;
            }
        }
        survey
    }

    /// Corrects the capacity with what a reply showed of a conversation that needed
    /// `needed` tokens of cache, with `newer` conversations saved after it. The capacity is the one that explains the recent replies
    /// best (fewest found warm beyond it or cold within it; see [`best_capacity`]): one odd
    /// reply (a prompt counted differently, a slot chosen otherwise) moves it only as far as
    /// the evidence as a whole allows.
    pub fn learn(&mut self, needed: u64, newer: usize, observed: Observed) {
        let warm = match observed {
            Observed::Warm => true,
            Observed::Cold => false,
            Observed::Unknown => return,
        };
        if warm {
            // It and the `newer` conversations saved after it were all kept.
            self.kept_seen = self.kept_seen.max(newer + 1);
        }
        // Cold within what the cache surely keeps: the conversation was lost otherwise
        // (the mirror and the node disagree about what was saved), not for want of room.
        if !warm && needed <= self.largest_saved {
            return;
        }
        self.seen.push_back((needed, warm));
        while self.seen.len() > Self::SEEN {
            self.seen.pop_front();
        }
        self.capacity = best_capacity(&self.seen, self.largest_saved);
        self.limit_shown = self.seen.iter().any(|&(_, warm)| !warm);
        self.warm_floor = (self.seen.iter())
            .filter(|&&(_, warm)| warm)
            .map(|&(needed, _)| needed)
            .max()
            .unwrap_or(0);
    }

    /// Forgets every saved conversation (the model unloaded); the capacity stays learned.
    pub fn clear(&mut self) {
        self.entries.clear();
        self.saved_tokens = 0;
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// How many conversations the cache keeps beyond the node's slots, by its learned
    /// capacity and the mean size of what it saved, less the room taken by `copies` of
    /// conversations that slots hold; before a reply has shown a limit, as many as the node
    /// has `slots` (as [`Survey::has_room`] assumes). A cache known to hold nothing
    /// keeps none.
    pub fn room(&self, slots: usize, peers: Option<u64>, copies: usize) -> f64 {
        let Capacity::Tokens(capacity) = self.capacity_with(peers) else {
            return slots as f64;
        };
        match self.saved_tokens.checked_div(self.entries.len() as u64) {
            Some(mean) if mean > 0 => (capacity as f64 / mean as f64 - copies as f64).max(0.0),
            _ if capacity == 0 => 0.0,
            _ => slots as f64,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// The capacity that misjudges the fewest of these replies (warm beyond it, or cold within
/// it), unbounded when no cold reply calls for a limit; of a range that explains them
/// equally, the middle above `floor` (what the cache surely holds).
fn best_capacity(seen: &VecDeque<(u64, bool)>, floor: u64) -> Capacity {
    let errors = |capacity: Capacity| {
        seen.iter()
            .filter(|&&(needed, warm)| capacity.holds(needed) != warm)
            .count()
    };
    let mut best = (errors(Capacity::Unbounded), Capacity::Unbounded);
    let mut candidates: Vec<u64> = seen
        .iter()
        .map(|&(needed, warm)| {
            if warm {
                needed
            } else {
                needed.saturating_sub(1)
            }
        })
        .collect();
    candidates.sort_unstable_by(|a, b| b.cmp(a));
    for tokens in candidates {
        let capacity = Capacity::Tokens(tokens);
        let e = errors(capacity);
        if e < best.0 {
            best = (e, capacity);
        }
    }
    // Every capacity down to the deepest conversation found warm within it explains the
    // replies as well: the middle of that range halves the doubt with each surprise.
    match best.1 {
        Capacity::Tokens(hi) => {
            let lo = (seen.iter())
                .filter(|&&(needed, warm)| warm && needed <= hi)
                .map(|&(needed, _)| needed)
                .max()
                .unwrap_or(0)
                .max(floor.min(hi));
            Capacity::Tokens(lo + (hi - lo) / 2)
        }
        Capacity::Unbounded => Capacity::Unbounded,
    }
}

/// The host-cache capacities that nodes' own replies have shown, per model, so that a node
/// whose replies have not shown its limit yet is taken to keep what its peers keep: the
/// median of theirs.
#[derive(Debug, Default)]
pub struct PeerCapacities {
    by_model: parking_lot::RwLock<HashMap<String, Shown>>,
}

#[derive(Debug, Default)]
struct Shown {
    /// Each node's shown capacity, by node id.
    nodes: Vec<(u16, u64)>,
    median: Option<u64>,
}

impl PeerCapacities {
    /// What the nodes serving `model` were shown to keep, in tokens.
    pub fn of(&self, model: &str) -> Option<u64> {
        self.by_model.read().get(model).and_then(|s| s.median)
    }

    /// What `node`'s replies have shown of its cache for `model`.
    pub fn shown_by(&self, model: &str, node: u16) -> Option<u64> {
        let by_model = self.by_model.read();
        let shown = by_model.get(model)?;
        shown
            .nodes
            .iter()
            .find(|&&(id, _)| id == node)
            .map(|&(_, t)| t)
    }

    /// Records what `node`'s replies have shown of its cache for `model`: `None` where they
    /// show no limit (any more).
    pub fn record(&self, model: &str, node: u16, shown: Option<u64>) {
        let known = self.by_model.read().get(model).map(|s| {
            let mine = s.nodes.iter().find(|&&(id, _)| id == node);
            mine.map(|&(_, tokens)| tokens)
        });
        if known.flatten() == shown {
            return;
        }
        let mut by_model = self.by_model.write();
        let s = by_model.entry(model.to_string()).or_default();
        s.nodes.retain(|&(id, _)| id != node);
        if let Some(tokens) = shown {
            s.nodes.push((node, tokens));
        }
        let mut tokens: Vec<u64> = s.nodes.iter().map(|&(_, t)| t).collect();
        tokens.sort_unstable();
        s.median = tokens.get(tokens.len().saturating_sub(1) / 2).copied();
    }
}

/// What corral learns per node and model, beyond the slots.
#[derive(Clone, Debug, Default)]
pub struct WarmState {
    pub cold_rate: ColdRate,
    pub host: HostCache,
    /// Seconds a request takes here, from sending it to its reply's end.
    pub service_s: Ewma,
    pub first_messages: FirstMessages,
}

/// The first messages (system prompts, mostly) of the conversations lately sent to a node:
/// a new conversation whose first message is among them may find it cached there, so its
/// reply measures no cold prefill rate.
#[derive(Clone, Debug, Default)]
pub struct FirstMessages {
    recent: VecDeque<u64>,
}

impl FirstMessages {
    /// As many as a node keeps warm at most, in its slots and host cache, several times over.
    const KEPT: usize = 64;

    /// Records a conversation's first message (its prefix hash) as sent here, and says
    /// whether it was sent here before.
    pub fn sent(&mut self, hash: u64) -> bool {
        let before = self.recent.iter().position(|&h| h == hash);
        if let Some(i) = before {
            self.recent.remove(i);
        }
        self.recent.push_back(hash);
        if self.recent.len() > Self::KEPT {
            self.recent.pop_front();
        }
        before.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::kind::ReplyShape;
    use std::time::Duration;

    fn ollama(count: u64, seconds: f64) -> Reading {
        Reading::OllamaCount {
            count,
            duration_ns: Some((seconds * 1e9) as u64),
        }
    }

    #[test]
    fn llama_cpp_and_openai_say_what_was_cached() {
        let (m, learned) = measure(
            Reading::Exact {
                evaluated: 10,
                cached: 90,
                shape: ReplyShape::LlamaCppTimings,
            },
            Counting::Unknown,
            None,
            5,
        );
        assert_eq!(
            m,
            Measured {
                total: 100,
                cached: Some(90)
            }
        );
        assert_eq!(m.evaluated(), Some(10));
        assert_eq!(m.observed(), Observed::Warm);
        assert_eq!(learned, None);
        let (m, _) = measure(Reading::Total { total: 40 }, Counting::Unknown, None, 40);
        assert_eq!(m.observed(), Observed::Unknown);
    }

    #[test]
    fn ollama_0_30_1_counts_cached_tokens_infer_them_from_the_duration() {
        // 1000 prompt tokens in 0.1 s on a node that evaluates 1000 per second: 100
        // evaluated, 900 cached.
        let (m, _) = measure(
            ollama(1000, 0.1),
            Counting::CachedAndEvaluated,
            Some(1000.0),
            1000,
        );
        assert_eq!(m.total, 1000);
        assert_eq!(m.cached, Some(900));
        assert_eq!(m.observed(), Observed::Warm);
        // The whole prompt evaluated: cold.
        let (m, _) = measure(
            ollama(1000, 1.05),
            Counting::CachedAndEvaluated,
            Some(1000.0),
            1000,
        );
        assert_eq!(m.cached, Some(0));
        assert_eq!(m.observed(), Observed::Cold);
        // Without a learned rate nothing can be said.
        let (m, _) = measure(ollama(1000, 0.1), Counting::CachedAndEvaluated, None, 1000);
        assert_eq!(m.observed(), Observed::Unknown);
    }

    #[test]
    fn older_ollama_counts_only_evaluated_tokens() {
        let (m, _) = measure(ollama(16, 0.02), Counting::EvaluatedOnly, None, 769);
        assert_eq!(m.total, 769);
        assert_eq!(m.cached, Some(753));
        assert_eq!(m.observed(), Observed::Warm);
        let (m, _) = measure(ollama(769, 0.9), Counting::EvaluatedOnly, None, 700);
        assert_eq!(m.cached, Some(0));
        assert_eq!(m.observed(), Observed::Cold);
    }

    #[test]
    fn an_unknown_counting_is_learned_from_the_first_warm_reply() {
        // Few tokens counted for a long prompt: evaluated only.
        let (m, learned) = measure(ollama(16, 0.02), Counting::Unknown, Some(800.0), 769);
        assert_eq!(learned, Some(Counting::EvaluatedOnly));
        assert_eq!(m.observed(), Observed::Warm);
        // All tokens counted in a tenth of the time they take: cached ones are counted.
        let (m, learned) = measure(ollama(769, 0.1), Counting::Unknown, Some(800.0), 769);
        assert_eq!(learned, Some(Counting::CachedAndEvaluated));
        assert_eq!(m.cached, Some(689));
        // A cold reply proves nothing, and both countings call it cold.
        let (m, learned) = measure(ollama(769, 0.95), Counting::Unknown, Some(800.0), 769);
        assert_eq!(learned, None);
        assert_eq!(m.observed(), Observed::Cold);
    }

    #[test]
    fn the_cold_rate_is_the_upper_end_of_recent_samples() {
        let mut r = ColdRate::default();
        assert_eq!(r.get(), None);
        // Prompts that shared the node's batches with others report a third of its speed.
        r.record(1000, 3.0);
        assert!((r.get().unwrap() - 333.3).abs() < 0.1);
        // One evaluated alone shows the node's own speed.
        r.record(1000, 1.0);
        assert_eq!(r.get(), Some(1000.0));
        // A reply that was partly cached after all is one outlier: not the rate.
        r.record(1000, 0.1);
        assert_eq!(r.get(), Some(1000.0));
        for _ in 0..5 {
            r.record(1000, 3.0);
        }
        assert_eq!(r.get(), Some(1000.0));
        // Replies that say nothing are not samples.
        r.record(0, 1.0);
        r.record(10, 0.0);
        assert_eq!(r.get(), Some(1000.0));
        // Once the fast samples are older than the window, the node is that slow now.
        for _ in 0..6 {
            r.record(1000, 2.0);
        }
        assert_eq!(r.get(), Some(500.0));
    }

    fn has_room(h: &HostCache, tokens: u64, slots: usize, peers: Option<u64>) -> bool {
        h.survey(peers, Instant::now(), |_| false)
            .has_room(tokens, slots)
    }

    fn entry(lineage: u64, tokens: u64) -> HostEntry {
        HostEntry {
            lineage,
            depth: 3,
            tokens,
            first: 0,
            last_used: Instant::now(),
        }
    }

    #[test]
    fn before_a_limit_is_shown_only_the_newest_saved_are_expected_warm() {
        let mut h = HostCache::default();
        for lineage in 1..=3 {
            h.save(entry(lineage, 100));
        }
        // Nothing is known lost, but on a node of 2 slots only the 2 newest are expected.
        let expected = |h: &HostCache, lineage| {
            let place = h.place(lineage, None, 2, None).unwrap();
            assert!(place.warm, "not known lost");
            place.expected
        };
        assert!(expected(&h, 3) && expected(&h, 2));
        assert!(!expected(&h, 1), "two saved after it");
        // A reply found one warm with two saved after it: as deep by count is expected now,
        // though one has grown since.
        let mut grown = h.clone();
        grown.learn(0, 2, Observed::Warm);
        grown.save(HostEntry {
            depth: 5,
            ..entry(1, 150)
        });
        grown.learn(0, 5, Observed::Cold);
        assert!(
            expected(&grown, 2),
            "two saved after it, and two kept that deep"
        );
        // A reply found it warm 300 tokens deep: as deep is expected now.
        h.learn(300, 0, Observed::Warm);
        assert_eq!(h.capacity(), Capacity::Unbounded);
        assert!(expected(&h, 1));
        // Once replies show a capacity (300 to 400 tokens), it alone decides.
        h.learn(400, 0, Observed::Cold);
        h.save(entry(4, 100));
        assert!(
            h.place(2, None, 1, None).unwrap().expected,
            "300 tokens deep, whatever the slots"
        );
        let lost = h.place(1, None, 2, None).unwrap();
        assert!(!lost.warm && !lost.expected, "400 tokens deep");
    }

    #[test]
    fn a_restore_counts_the_save_that_makes_room_for_the_slot_it_takes() {
        let mut h = HostCache::default();
        h.set_capacity(Capacity::Tokens(300));
        h.save(entry(1, 100));
        h.save(entry(2, 100));
        h.save(entry(3, 50));
        // 1 needs 250 of 300 tokens; a slot holding what the cache holds whole adds nothing.
        let place = h.place(1, None, 4, Some(&entry(3, 50))).unwrap();
        assert_eq!((place.needed, place.newer, place.warm), (250, 2, true));
        // A slot holding 100 tokens the cache lacks is saved first, and pushes 1 out.
        let place = h.place(1, None, 4, Some(&entry(4, 100))).unwrap();
        assert_eq!((place.needed, place.newer), (350, 2));
        assert!(!place.warm && !place.expected);
        // A slot holding an older turn of the same conversation is no other save.
        let place = h.place(1, None, 4, Some(&entry(1, 80))).unwrap();
        assert_eq!(place.needed, 250);
    }

    #[test]
    fn until_its_own_replies_show_a_limit_a_cache_keeps_what_its_peers_keep() {
        let mut h = HostCache::default();
        h.save(entry(1, 100));
        h.save(entry(2, 200));
        h.save(entry(3, 300));
        // Conversation 1 needs 600 tokens of cache: warm with nothing known, cold by a
        // peer that was shown to keep 500.
        assert!(h.place(1, None, 4, None).unwrap().warm);
        assert!(!h.place(1, Some(500), 4, None).unwrap().warm);
        assert!(h.place(2, Some(500), 4, None).unwrap().warm);
        assert_eq!(
            h.room(4, Some(600), 0),
            3.0,
            "600 tokens of 200-token conversations"
        );
        assert!(!has_room(&h, 100, 4, Some(600)));
        // Its own replies found 600 tokens warm: never less than that.
        h.learn(600, 0, Observed::Warm);
        assert_eq!(h.capacity_with(Some(500)), Capacity::Tokens(600));
        assert_eq!(h.shown_limit(), None, "no limit of its own to share");
        // Once they find one cold, its own evidence alone decides.
        h.learn(650, 0, Observed::Cold);
        assert_eq!(h.capacity_with(Some(10_000)), Capacity::Tokens(624));
        assert_eq!(h.shown_limit(), Some(624));
        // A node that has none shares nothing, whatever its peers keep.
        assert_eq!(
            HostCache::none().capacity_with(Some(500)),
            Capacity::Tokens(0)
        );
    }

    #[test]
    fn a_cache_keeps_at_least_the_largest_conversation_it_saved() {
        let mut h = HostCache::default();
        h.save(entry(1, 8_000));
        h.save(entry(2, 9_000));
        // Conversation 2, the newest saved, comes back cold: llama-server keeps at least
        // a context's worth of tokens, so it was lost some other way, not for want of room.
        h.learn(h.place(2, None, 4, None).unwrap().needed, 0, Observed::Cold);
        assert_eq!(h.capacity(), Capacity::Unbounded);
        assert_eq!(h.shown_limit(), None);
        // A cold reply deeper than that is a limit, learned no lower than what one holds.
        h.learn(17_000, 0, Observed::Cold);
        assert_eq!(h.capacity(), Capacity::Tokens(9_000 + (16_999 - 9_000) / 2));
    }

    #[test]
    fn peers_share_the_median_of_the_limits_their_replies_showed() {
        let peers = PeerCapacities::default();
        assert_eq!(peers.of("m"), None);
        peers.record("m", 0, Some(1_000));
        assert_eq!(peers.of("m"), Some(1_000));
        peers.record("m", 1, Some(3_000));
        peers.record("m", 2, Some(2_000));
        assert_eq!(peers.of("m"), Some(2_000));
        assert_eq!(peers.of("other"), None, "per model");
        // A node that learns again replaces its own; one whose replies no longer show a
        // limit leaves.
        peers.record("m", 2, Some(5_000));
        assert_eq!(peers.of("m"), Some(3_000));
        peers.record("m", 1, None);
        peers.record("m", 2, None);
        assert_eq!(peers.of("m"), Some(1_000));
        peers.record("m", 0, None);
        assert_eq!(peers.of("m"), None);
    }

    #[test]
    fn host_cache_places_conversations_by_what_was_saved_after_them() {
        let mut h = HostCache::default();
        h.save(entry(1, 100));
        h.save(entry(2, 200));
        h.save(entry(3, 300));
        assert_eq!(h.place(3, None, 4, None).map(|p| p.needed), Some(300));
        assert_eq!(h.place(1, None, 4, None).map(|p| p.needed), Some(600));
        assert!(
            h.place(1, None, 4, None).unwrap().warm,
            "unbounded until a reply shows a limit"
        );
        // Saving again moves it to the newest end.
        h.save(entry(1, 120));
        assert_eq!(h.place(1, None, 4, None).map(|p| p.needed), Some(120));
        assert_eq!(h.place(2, None, 4, None).map(|p| p.needed), Some(620));
        assert_eq!(h.take(2).map(|e| e.tokens), Some(200));
        assert_eq!(h.place(2, None, 4, None), None);
        assert_eq!(h.len(), 2);
    }

    #[test]
    fn a_host_cache_keeps_as_many_conversations_as_its_capacity_holds_of_their_mean_size() {
        let mut h = HostCache::default();
        assert_eq!(
            h.room(4, None, 0),
            4.0,
            "as many as slots until a limit is learned"
        );
        h.save(entry(1, 100));
        h.save(entry(2, 300));
        assert_eq!(h.room(4, None, 0), 4.0);
        h.set_capacity(Capacity::Tokens(1_000));
        assert_eq!(
            h.room(4, None, 0),
            5.0,
            "1,000 tokens of 200-token conversations"
        );
        // Saved again larger, and restored: the mean follows what the cache holds.
        h.save(entry(1, 300));
        assert_eq!(h.room(4, None, 0), 1_000.0 / 300.0);
        h.take(2);
        assert_eq!(h.room(4, None, 0), 1_000.0 / 300.0);
        h.take(1);
        assert_eq!(h.room(4, None, 0), 4.0, "nothing saved: as many as slots");
        h.save(entry(1, 100));
        h.save(entry(2, 300));
        assert_eq!(
            h.room(4, None, 2),
            1_000.0 / 200.0 - 2.0,
            "copies of slots' conversations take room"
        );
        assert_eq!(h.room(4, None, 9), 0.0);
        assert_eq!(HostCache::none().room(4, None, 0), 0.0);
        let since = Instant::now() + Duration::from_secs(1);
        let no_slot = |_| false;
        assert_eq!(h.survey(None, since, no_slot).live, 0);
        h.save(HostEntry {
            last_used: since,
            ..entry(3, 100)
        });
        h.save(HostEntry {
            last_used: since,
            ..entry(4, 100)
        });
        assert_eq!(h.survey(None, since, no_slot).live, 2);
        let slot_holds_4 = h.survey(None, since, |l| l == 4);
        assert_eq!(slot_holds_4.live, 1, "a slot counts its own");
        assert_eq!(slot_holds_4.copies, 1, "and its copy is kept");
    }

    #[test]
    fn a_conversation_saved_whole_already_keeps_its_place() {
        let mut h = HostCache::default();
        h.save(entry(1, 100));
        h.save(entry(2, 100));
        // Copied again unchanged (an idle slot's copy): skipped, as llama-server skips a
        // prompt its cache contains whole, so 1 stays the oldest.
        h.save(entry(1, 100));
        assert_eq!(h.place(1, None, 4, None).map(|p| p.needed), Some(200));
        // Grown by a turn: saved as the newest.
        h.save(HostEntry {
            depth: 5,
            ..entry(1, 150)
        });
        assert_eq!(h.place(1, None, 4, None).map(|p| p.needed), Some(150));
        assert_eq!(h.len(), 2);
    }

    #[test]
    fn capacity_is_learned_from_unexpected_hits_and_misses() {
        let mut h = HostCache::default();
        for l in 1..=5 {
            h.save(entry(l, 100));
        }
        // Conversation 2 needed 400 tokens and came back cold: the cache holds fewer, and
        // with nothing found warm yet, corral takes the middle of what is possible: from
        // the largest conversation it saved (100) to 399.
        h.learn(h.place(2, None, 4, None).unwrap().needed, 0, Observed::Cold);
        assert_eq!(h.capacity(), Capacity::Tokens(249));
        assert!(!h.place(2, None, 4, None).unwrap().warm);
        assert!(!h.place(3, None, 4, None).unwrap().warm, "300 tokens deep");
        assert!(
            h.place(4, None, 4, None).unwrap().warm,
            "200 tokens deep still fits"
        );
        // Conversation 1, 500 deep, was warm after all, against one cold reply at 400:
        // each capacity misjudges one reply, and the largest (none) wins.
        h.learn(h.place(1, None, 4, None).unwrap().needed, 0, Observed::Warm);
        assert_eq!(h.capacity(), Capacity::Unbounded);
        assert!(h.place(2, None, 4, None).unwrap().warm);
        // An unknown verdict teaches nothing.
        h.learn(50, 0, Observed::Unknown);
        assert_eq!(h.capacity(), Capacity::Unbounded);
        // More cold replies at 400 and 450 outweigh the one warm reply at 500.
        h.learn(400, 0, Observed::Cold);
        h.learn(450, 0, Observed::Cold);
        assert_eq!(h.capacity(), Capacity::Tokens(249));
        // Warm replies within, cold beyond: the boundary lies between them.
        let mut h = HostCache::default();
        for (needed, warm) in [(100, true), (300, true), (700, false), (900, false)] {
            h.learn(
                needed,
                0,
                if warm { Observed::Warm } else { Observed::Cold },
            );
        }
        assert_eq!(
            h.capacity(),
            Capacity::Tokens(499),
            "halfway between the deepest warm and the shallowest cold"
        );
        // Room: three saved conversations of 100 tokens in a cache of 249: two are kept
        // warm, and 49 more fit.
        let mut room = HostCache::default();
        for l in 1..=3 {
            room.save(entry(l, 100));
        }
        assert!(
            has_room(&room, 10_000, 4, None),
            "no limit shown: as many as the slots"
        );
        assert!(!has_room(&room, 10, 3, None));
        room.learn(400, 0, Observed::Cold);
        assert_eq!(room.capacity(), Capacity::Tokens(249));
        assert!(has_room(&room, 49, 4, None) && !has_room(&room, 50, 4, None));
        // The old runner keeps nothing: no saved conversation is warm.
        let mut none = HostCache::none();
        none.save(entry(9, 10));
        assert!(!none.place(9, None, 4, None).unwrap().warm);
    }
}
