//! Learning how many requests a node runs at once per model when corral is not told
//! (`nodes[].num_parallel`): Ollama does not say, and corral sends a node no more requests
//! than it believes it runs, so it would never find out.
//!
//! When a request would otherwise wait in corral for its best node, corral may send it one
//! past that belief (a probe). A reply whose first byte comes while other replies from the
//! same node and model are still streaming proves the node ran them together. A probe whose
//! first byte comes when no more than the believed number are streaming may have been
//! queued by the node, or have run beside one that ended first; its reply's durations tell
//! which ([`waited`]): most of its time to first byte passed before the node worked on it,
//! and the node queued it. After a few such probes corral stops probing that node.
//!
//! One probe at a time: while the number is a lower bound, a node is sent one request past
//! what it was shown to run ([`probe_limit`]), and choosing counts it as running that many,
//! so one that was never busy enough to be probed is not judged full at one request (a new
//! conversation went to an idle slow node rather than to a fast one believed to have one
//! slot). Probes used to double, which showed a node's slots in fewer rounds of first
//! bytes; but in a burst of new conversations the fast nodes answer first, so their belief
//! grew first, and a four-slot node was sent eight long prompts at once: four queued inside
//! it, given away before corral measured any node, and each conversation stays where it
//! starts. One probe at a time queues at most one request inside a node; the others wait
//! in corral and go where the measurements, once they come, say (docs/benchmarks.md).

use std::collections::HashMap;

/// Probes that found the node queuing before corral stops probing it. More than one: a
/// probe also looks queued when the request ahead of it happens to finish first.
const MAX_QUEUED_PROBES: u8 = 3;

/// corral probes no further than this many requests at once per model.
const MAX_PROBED: usize = 16;

/// Whether a request may be sent past the `believed` number of requests the node runs
/// at once, after `queued` probes there found it queuing.
pub fn may_probe(believed: usize, queued: u8) -> bool {
    queued < MAX_QUEUED_PROBES && believed < MAX_PROBED
}

/// How many requests at once a node believed to run `believed` may be sent while probing:
/// one more.
pub fn probe_limit(believed: usize) -> usize {
    believed + 1
}

/// A node set to `queue_at_node` that takes at least this long to begin a request sent into
/// a free slot (see `ModelState::start_s`) is sent one request more than it runs at once.
/// That request waits in the node's own queue and begins the moment a slot frees, in the
/// runner's next batch rather than the one after. A node that begins within milliseconds is
/// sent no more than it runs: corral then keeps the choice of node until a slot frees.
pub const START_WORTH_HIDING_S: f64 = 0.1;

/// Whether a node whose requests take `start_s` to begin is sent one more than it runs.
pub fn queues_at_node(start_s: Option<f64>) -> bool {
    start_s.is_some_and(|s| s >= START_WORTH_HIDING_S)
}

/// Seconds a reply took to begin at the node: its time to first byte `ttfb_s` less the
/// node's reported work before that byte `worked_s`.
pub fn start_delay(ttfb_s: f64, worked_s: f64) -> f64 {
    (ttfb_s - worked_s).max(0.0)
}

/// Whether a reply that took `ttfb_s` to its first byte, of which the node reported
/// `worked_s` of work (load, prefill), waited for a slot there: more than half of it
/// went before the node began.
pub fn waited(ttfb_s: f64, worked_s: f64) -> bool {
    ttfb_s - worked_s > 0.5 * ttfb_s
}

/// What a reply's first byte shows, given the replies from the same node and model still
/// streaming when it came (`others`): the node runs at least this many at once.
pub fn shown_parallel(others: u32) -> usize {
    others as usize + 1
}

/// Whether a probe, sent when the node was believed to run `believed` at once, found it
/// queuing: its reply began while no more than `believed` replies streamed with it.
pub fn probe_queued(believed: usize, shown: usize) -> bool {
    shown <= believed
}

/// What probes found of one node.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Found {
    /// Probes that found it queuing.
    pub queued: u8,
    /// The most requests at once it was believed to run when a probe last found it
    /// queuing: its limit, as far as corral knows.
    pub limit: usize,
}

/// Whether the node's number of requests at once is known, not just a lower bound: a probe
/// found it queuing past `believed` (or past more, before a reply showed otherwise).
pub fn settled(found: Found, believed: usize) -> bool {
    found.queued > 0 && found.limit >= believed
}

/// See [`Probes::counted`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Counted {
    pub known: bool,
    pub admits: usize,
}

/// Per node, what probes found.
#[derive(Debug, Default)]
pub struct Probes {
    found: parking_lot::Mutex<HashMap<u16, Found>>,
}

impl Probes {
    fn get(&self, node: u16) -> Found {
        self.found.lock().get(&node).copied().unwrap_or_default()
    }

    pub fn may_probe(&self, node: u16, believed: usize) -> bool {
        may_probe(believed, self.get(node).queued)
    }

    /// What choosing counts of a node believed to run `believed` at once: whether that is
    /// known (`told`, or [`settled`] by a probe), and the requests it may be sent:
    /// `believed` where known or no longer probed, else the [`probe_limit`].
    pub fn counted(&self, node: u16, believed: usize, told: bool) -> Counted {
        let found = self.get(node);
        let known = told || settled(found, believed);
        let admits = if known || !may_probe(believed, found.queued) {
            believed
        } else {
            probe_limit(believed)
        };
        Counted { known, admits }
    }

    pub fn found_queuing(&self, node: u16, believed: usize) {
        let mut found = self.found.lock();
        let f = found.entry(node).or_default();
        f.queued = f.queued.saturating_add(1);
        f.limit = believed;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_is_queued_at_once_its_requests_take_a_tenth_of_a_second_to_begin() {
        assert!(!queues_at_node(None), "nothing measured");
        assert!(
            !queues_at_node(Some(0.004)),
            "a GPU node's few milliseconds"
        );
        assert!(queues_at_node(Some(0.1)));
        assert!(
            queues_at_node(Some(1.2)),
            "a one-thread CPU node under load"
        );
    }

    #[test]
    fn a_request_began_when_its_reported_work_before_the_first_byte_did() {
        assert_eq!(start_delay(1.5, 1.0), 0.5);
        // Reported work longer than the wait (clocks, rounding): it began at once.
        assert_eq!(start_delay(1.0, 1.2), 0.0);
    }

    #[test]
    fn a_reply_waited_when_most_of_its_first_byte_went_before_the_work() {
        // 2 s to the first byte, 1.9 of them prefill: it ran at once.
        assert!(!waited(2.0, 1.9));
        // 2 s, 0.6 of them prefill: it waited 1.4 s for a slot.
        assert!(waited(2.0, 0.6));
        assert!(!waited(2.0, 1.0), "half is not most");
    }

    #[test]
    fn a_probe_goes_one_past_what_the_node_was_shown_to_run() {
        assert_eq!(probe_limit(1), 2);
        assert_eq!(probe_limit(2), 3);
        assert_eq!(probe_limit(4), 5);
    }

    #[test]
    fn choosing_counts_an_unsettled_node_at_its_probe_limit() {
        let probes = Probes::default();
        assert_eq!(
            probes.counted(1, 2, false).admits,
            3,
            "a lower bound: probed"
        );
        assert_eq!(probes.counted(1, 2, true).admits, 2, "told");
        assert!(probes.counted(1, 2, true).known);
        probes.found_queuing(1, 2);
        assert_eq!(probes.counted(1, 2, false).admits, 2, "settled");
        // A reply showed three at once: a lower bound again.
        assert_eq!(probes.counted(1, 3, false).admits, 4);
        for _ in 1..MAX_QUEUED_PROBES {
            probes.found_queuing(1, 1);
        }
        assert_eq!(probes.counted(1, 3, false).admits, 3, "no longer probed");
    }

    #[test]
    fn probes_stop_after_a_few_found_the_node_queuing() {
        assert!(may_probe(1, 0));
        assert!(may_probe(1, MAX_QUEUED_PROBES - 1));
        assert!(!may_probe(1, MAX_QUEUED_PROBES));
        assert!(!may_probe(MAX_PROBED, 0), "bounded");
        let probes = Probes::default();
        for _ in 0..MAX_QUEUED_PROBES {
            assert!(probes.may_probe(7, 2));
            probes.found_queuing(7, 2);
        }
        assert!(!probes.may_probe(7, 2));
        assert!(probes.may_probe(8, 2), "per node");
    }

    #[test]
    fn the_limit_is_known_once_a_probe_found_the_node_queuing_there() {
        let probes = Probes::default();
        assert!(
            !probes.counted(1, 1, false).known,
            "1 is only a lower bound"
        );
        probes.found_queuing(1, 1);
        assert!(probes.counted(1, 1, false).known);
        // A later reply showed two at once: 2 is a lower bound again.
        assert!(!probes.counted(1, 2, false).known);
        probes.found_queuing(1, 2);
        assert!(probes.counted(1, 2, false).known);
        assert!(!probes.counted(2, 2, false).known, "per node");
    }

    #[test]
    fn a_reply_beginning_beside_others_shows_them_run_together() {
        assert_eq!(shown_parallel(0), 1);
        assert_eq!(shown_parallel(2), 3);
        // Believed 1: a probe that began beside one streaming reply ran in parallel.
        assert!(!probe_queued(1, shown_parallel(1)));
        // One that began alone waited for the reply ahead of it.
        assert!(probe_queued(1, shown_parallel(0)));
        assert!(probe_queued(2, shown_parallel(1)));
    }
}
