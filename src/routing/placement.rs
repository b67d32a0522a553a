//! What a node holds in memory, as corral believes it between polls, and what loading one
//! more model there would cost.
//!
//! `/api/ps` is the truth, but only as of the last poll. Between polls corral knows more: a
//! reply for a model came from memory, and a request it sent where the model was not
//! resident is loading it now. Neither may be added on top of what the poll saw without
//! limit: a node holds only what fits in its memory, and a load that did not fit evicted
//! something. So the models a node is believed to hold are counted most certain first, then
//! most recently seen, only up to the node's memory; what does not fit is taken as evicted.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::fleet::{Ewma, ModelState, Node, Slot};

/// One model a node may hold.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Held<'a> {
    pub model: &'a str,
    /// Bytes it takes in memory.
    pub size: u64,
    /// Requests run or wait for it there, or corral sent one that loads it: it is there (or
    /// will be) whatever else was seen.
    pub certain: bool,
    /// The latest sign of it there: the poll that listed it or the reply that came from it.
    pub seen: Option<Instant>,
    /// Requests run or wait for it there: Ollama unloads it only once they are done.
    pub busy: bool,
}

/// A node's memory as corral believes it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Believed<'a> {
    /// The models held, most certain and most recent first.
    pub models: Vec<&'a str>,
    pub footprint: Footprint,
}

/// Bytes taken in a node's memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Footprint {
    /// By the models held.
    pub used: u64,
    /// By held models that nothing runs or waits for: what a load can evict at once.
    pub idle: u64,
}

impl Believed<'_> {
    pub fn holds(&self, model: &str) -> bool {
        self.models.contains(&model)
    }
}

/// The models a node holds: the certain ones, then the others from the most recently seen,
/// while they fit in `total` bytes (all of them when the memory is unknown).
pub fn believed<'a>(total: Option<u64>, mut held: Vec<Held<'a>>) -> Believed<'a> {
    // Certain first, then the latest seen; `None` (never seen) last.
    held.sort_by(|a, b| b.certain.cmp(&a.certain).then(b.seen.cmp(&a.seen)));
    let mut out = Believed::default();
    let f = &mut out.footprint;
    for h in held {
        let fits = total.is_none_or(|t| f.used.saturating_add(h.size) <= t);
        if !(h.certain || fits) {
            continue;
        }
        out.models.push(h.model);
        f.used = f.used.saturating_add(h.size);
        if !h.busy {
            f.idle = f.idle.saturating_add(h.size);
        }
    }
    out
}

/// Loading a model of `need` bytes here would have to unload a model that requests are
/// running or waiting for: free memory plus every idle model is not enough. Ollama then
/// waits for those requests and unloads that model under them, so any other placement is
/// better. Unknown sizes or memory never say so.
pub fn evicts_busy(need: Option<u64>, total: Option<u64>, m: &Footprint) -> bool {
    let (Some(need), Some(total)) = (need, total) else {
        return false;
    };
    let free = total.saturating_sub(m.used);
    need > free.saturating_add(m.idle)
}

/// Whether loading a model of `need` bytes unloads no model that requests run or wait for,
/// and if so whether it unloads an idle one: `Some(false)` when it fits in free memory,
/// `Some(true)` when it must (or, memory or size unknown, may) unload idle models, `None`
/// when it may unload a busy one. Ollama chooses what it unloads, so where the memory is
/// not known only a node running no other model is safe.
pub fn load_without_busy(need: Option<u64>, total: Option<u64>, m: &Footprint) -> Option<bool> {
    if fits_free(need, total, m.used) {
        return Some(false);
    }
    let busy_held = m.used > m.idle;
    match (need, total) {
        (Some(_), Some(_)) => (!evicts_busy(need, total, m)).then_some(true),
        _ if busy_held => None,
        _ => Some(m.used > 0),
    }
}

/// Whether a node's slots for a model are all taken by live conversations: every slot
/// holds one that is running now or ran within `live` (a new conversation there would push
/// one of them out, to come back cold on its next turn).
pub fn slots_full(slots: &[Slot], parallel: usize, now: Instant, live: Duration) -> bool {
    slots.len() >= parallel && slots.iter().all(|s| is_live(s, now, live))
}

fn is_live(s: &Slot, now: Instant, live: Duration) -> bool {
    s.lineage != 0 && (s.busy > 0 || s.last_used.is_some_and(|t| now.duration_since(t) <= live))
}

/// Conversations a node serves for a model that are live: held in a slot and running now or
/// run within `live`, plus those its host cache saved within `live` (kept there or not,
/// they come back to this node).
pub fn live_conversations(slots: &[Slot], saved_live: usize, now: Instant, live: Duration) -> u32 {
    let in_slots = slots.iter().filter(|s| is_live(s, now, live)).count();
    u32::try_from(in_slots + saved_live).unwrap_or(u32::MAX)
}

/// The model fits in the node's free memory: loading it there evicts nothing. Unknown
/// sizes or memory never say so.
pub fn fits_free(need: Option<u64>, total: Option<u64>, used: u64) -> bool {
    match (need, total) {
        (Some(need), Some(total)) => need <= total.saturating_sub(used),
        _ => false,
    }
}

/// Every node that holds the model (one flag per node) has its slots full of live
/// conversations ([`slots_full`]). False when no node holds it.
pub fn homes_full(homes: impl IntoIterator<Item = bool>) -> bool {
    let mut any = false;
    for full in homes {
        if !full {
            return false;
        }
        any = true;
    }
    any
}

/// The model-loaded signal of a node that could become a second home for the model, for a
/// conversation that no node holds warm: when every home is full and the model fits here
/// without evicting anything, as much as a loaded model (the node serves it from free
/// slots where a home would push a live conversation out); otherwise nothing.
pub fn second_home(homes_full: bool, fits_free: bool, model_loaded_weight: f64) -> f64 {
    if homes_full && fits_free {
        model_loaded_weight
    } else {
        0.0
    }
}

/// The usual pause between a conversation's turns, as seen.
#[derive(Debug, Default)]
pub struct TurnGaps {
    gap_s: parking_lot::Mutex<Ewma>,
}

impl TurnGaps {
    /// A pause between one turn's reply and the next turn of the same conversation.
    pub fn record(&self, gap: Duration) {
        self.gap_s.lock().record(gap.as_secs_f64());
    }

    /// The usual pause between turns, seconds, once corral has seen some.
    pub fn pause_s(&self) -> Option<f64> {
        self.gap_s.lock().get()
    }
}

/// How long a conversation counts as live after its last turn, from the usual pause between
/// turns ([`TurnGaps::pause_s`]): twice it, never past `fallback`; `fallback` until a pause
/// is known.
pub fn live_window(pause_s: Option<f64>, fallback: Duration) -> Duration {
    match pause_s {
        Some(gap) => Duration::from_secs_f64(2.0 * gap).min(fallback),
        None => fallback,
    }
}

/// The most used of the idle models a load would evict on a node, given each one's use
/// fleet-wide (requests running or waiting for it on every node): Ollama picks the victim
/// itself, so corral counts the one whose loss would hurt most. 0 when none is in use.
pub fn victim_use(idle_models_use: impl IntoIterator<Item = u32>) -> u32 {
    idle_models_use.into_iter().max().unwrap_or(0)
}

/// The memory-fit score of a node where loading the model must evict an idle one, divided
/// by one more than [`victim_use`]: among nodes where a load must evict, it goes where
/// the models that go are least used fleet-wide.
pub fn weigh_victims(memory_fit: f64, victim_use: u32) -> f64 {
    memory_fit / (1.0 + f64::from(victim_use))
}

/// The use fleet-wide (requests running or waiting, on every node) of each model `node`'s
/// last poll listed that no request runs or waits for there: what a load there may evict.
pub(super) fn idle_models_use(nodes: &[Arc<Node>], node: &Node) -> Vec<u32> {
    let inv = node.inventory();
    let busy = |state: Option<&ModelState>| state.is_some_and(ModelState::busy);
    let idle: Vec<&str> = node.books(|books| {
        let resident = inv.resident.keys().map(String::as_str);
        resident.filter(|m| !busy(books.models.get(*m))).collect()
    });
    let use_of = |model: &str| -> u32 {
        let on =
            |n: &Arc<Node>| n.books(|books| books.models.get(model).map_or(0, ModelState::depth));
        nodes.iter().map(on).sum()
    };
    idle.into_iter().map(use_of).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const GB: u64 = 1_000_000_000;

    fn held(model: &str, size_gb: u64, seen_ago_ms: u64, now: Instant) -> Held<'_> {
        Held {
            model,
            size: size_gb * GB,
            certain: false,
            seen: Some(now - Duration::from_millis(seen_ago_ms)),
            busy: false,
        }
    }

    #[test]
    fn models_count_only_up_to_memory_most_recent_first() {
        let now = Instant::now();
        // The poll saw a and b; replies then came from c, then from a again: c's load
        // evicted one of them, and a was used after that, so b is the one taken as gone.
        let m = believed(
            Some(24 * GB),
            vec![
                held("a", 5, 10, now),
                held("b", 13, 300, now),
                held("c", 16, 100, now),
            ],
        );
        assert_eq!(m.models, ["a", "c"]);
        assert_eq!(m.footprint.used, 21 * GB);
        assert!(!m.holds("b"));
        // Memory unknown: everything seen counts.
        let all = believed(None, vec![held("a", 5, 10, now), held("b", 13, 300, now)]);
        assert_eq!(all.footprint.used, 18 * GB);
    }

    #[test]
    fn certain_models_always_count_and_busy_ones_are_not_idle() {
        let now = Instant::now();
        let loading = Held {
            certain: true,
            busy: true,
            seen: None,
            ..held("new", 16, 0, now)
        };
        let m = believed(
            Some(24 * GB),
            vec![held("old", 13, 0, now), held("small", 5, 50, now), loading],
        );
        assert_eq!(m.models, ["new", "small"], "old no longer fits beside new");
        assert_eq!(m.footprint.idle, 5 * GB);
    }

    #[test]
    fn evicting_busy_models_only_when_idle_and_free_memory_fall_short() {
        let now = Instant::now();
        let busy = |model, gb| Held {
            busy: true,
            ..held(model, gb, 0, now)
        };
        let total = Some(24 * GB);
        // 16 GB busy, 5 GB idle, 3 GB free.
        let m = believed(total, vec![busy("x", 16), held("y", 5, 0, now)]);
        let f = &m.footprint;
        assert!(!evicts_busy(Some(8 * GB), total, f), "evicting y is enough");
        assert!(evicts_busy(Some(9 * GB), total, f), "x would have to go");
        assert!(!evicts_busy(None, total, f));
        assert!(!evicts_busy(Some(9 * GB), None, f));
    }

    fn slot(lineage: u64, busy: u32, used_ago_ms: u64, now: Instant) -> Slot {
        Slot {
            lineage,
            busy,
            last_used: Some(now - Duration::from_millis(used_ago_ms)),
            ..Slot::default()
        }
    }

    #[test]
    fn live_conversations_are_those_in_slots_used_lately_and_those_saved_lately() {
        let now = Instant::now();
        let live = Duration::from_millis(500);
        let slots = [
            slot(1, 0, 100, now),
            slot(2, 1, 5_000, now),
            slot(3, 0, 5_000, now),
            Slot::default(),
        ];
        assert_eq!(
            live_conversations(&slots, 0, now, live),
            2,
            "1 recent, 2 busy"
        );
        assert_eq!(live_conversations(&slots, 3, now, live), 5);
        assert_eq!(live_conversations(&[], 0, now, live), 0);
    }

    #[test]
    fn slots_are_full_when_every_one_holds_a_live_conversation() {
        let now = Instant::now();
        let live = Duration::from_millis(500);
        let two_live = [slot(1, 0, 100, now), slot(2, 1, 5_000, now)];
        assert!(
            slots_full(&two_live, 2, now, live),
            "idle but recent, and busy"
        );
        let one_stale = [slot(1, 0, 100, now), slot(2, 0, 5_000, now)];
        assert!(
            !slots_full(&one_stale, 2, now, live),
            "that conversation is over"
        );
        let one_empty = [slot(1, 1, 0, now), Slot::default()];
        assert!(!slots_full(&one_empty, 2, now, live));
        assert!(
            !slots_full(&two_live[..1], 2, now, live),
            "a slot never used"
        );
        assert!(slots_full(&two_live[..1], 1, now, live));
    }

    #[test]
    fn a_second_home_only_where_the_model_fits_free_memory_and_every_home_is_full() {
        let (total, w) = (Some(24 * GB), 50.0);
        assert!(fits_free(Some(5 * GB), total, 16 * GB));
        assert!(!fits_free(Some(13 * GB), total, 16 * GB), "it would evict");
        assert!(!fits_free(None, total, 0), "size unknown");
        assert!(!fits_free(Some(5 * GB), None, 0), "memory unknown");

        assert!(homes_full([true, true]));
        assert!(!homes_full([true, false]), "a home has a free slot");
        assert!(!homes_full([]), "resident nowhere: plain placement");

        assert_eq!(second_home(true, true, w), w);
        assert_eq!(second_home(true, false, w), 0.0);
        assert_eq!(second_home(false, true, w), 0.0);
    }

    #[test]
    fn conversations_stay_live_for_twice_the_usual_pause() {
        let gaps = TurnGaps::default();
        let ttl = Duration::from_secs(300);
        assert_eq!(live_window(gaps.pause_s(), ttl), ttl, "nothing learned yet");
        gaps.record(Duration::from_secs(4));
        assert_eq!(live_window(gaps.pause_s(), ttl), Duration::from_secs(8));
        gaps.record(Duration::from_secs(2_000));
        assert_eq!(live_window(gaps.pause_s(), ttl), ttl, "never past the TTL");
    }

    #[test]
    fn loads_that_must_evict_go_where_what_goes_is_least_used_fleet_wide() {
        assert_eq!(victim_use([]), 0);
        assert_eq!(victim_use([0, 3, 1]), 3, "the most used idle model counts");
        let fit = 5.0;
        assert_eq!(weigh_victims(fit, 0), fit);
        assert!(weigh_victims(fit, 1) < fit);
        assert!(weigh_victims(fit, 3) < weigh_victims(fit, 1));
    }

    #[test]
    fn a_load_may_unload_idle_models_but_never_one_in_use() {
        let fp = |used_gb: u64, idle_gb: u64| Footprint {
            used: used_gb * GB,
            idle: idle_gb * GB,
        };
        let (need, total) = (Some(5 * GB), Some(24 * GB));
        assert_eq!(load_without_busy(need, total, &fp(10, 0)), Some(false));
        assert_eq!(load_without_busy(need, total, &fp(22, 4)), Some(true));
        assert_eq!(load_without_busy(need, total, &fp(22, 1)), None);
        // Memory unknown: only a node running no model is safe, and one holding idle ones
        // may unload them.
        assert_eq!(load_without_busy(need, None, &fp(0, 0)), Some(false));
        assert_eq!(load_without_busy(need, None, &fp(4, 4)), Some(true));
        assert_eq!(load_without_busy(need, None, &fp(8, 4)), None);
    }
}
