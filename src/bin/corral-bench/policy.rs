//! The routing policies compared. The baselines choose a node on the client side, among the
//! nodes that list the model, and talk to it directly (no proxy hop); corral is a URL.

use std::sync::atomic::{AtomicUsize, Ordering};

use clap::ValueEnum;
use parking_lot::Mutex;
use serde::Serialize;

use crate::rng::Rng;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    /// A node chosen at random for every request: what Open WebUI does with several
    /// Ollama URLs.
    Random,
    /// Each node in turn.
    RoundRobin,
    /// The node with the fewest requests in flight from this client.
    LeastConnections,
    /// A hash of the conversation picks the node: a sticky session, as `hash $cookie` in
    /// nginx would do with a session cookie. Salted by the seed, as random chat ids would be.
    StickyHash,
    /// A hash of the conversation picks the node, each node weighted by its slots
    /// (nginx `hash ... consistent` with `weight=` set to the slots), salted by the seed as
    /// random chat ids would be.
    HashBySlots,
    /// The node with the fewest requests in flight per slot.
    LeastPerSlot,
    /// A node chosen at random among those where the model is resident now.
    RandomResident,
    /// Through the corral router.
    Corral,
    /// Through corral, one conversation at a time: the yardstick of the placement
    /// workload's TTFT (not among the default policies).
    CorralOneAtATime,
}

impl Policy {
    pub const ALL: [Policy; 5] = [
        Policy::Random,
        Policy::RoundRobin,
        Policy::LeastConnections,
        Policy::StickyHash,
        Policy::Corral,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Policy::Random => "random",
            Policy::RoundRobin => "round-robin",
            Policy::LeastConnections => "least-connections",
            Policy::StickyHash => "sticky-hash",
            Policy::HashBySlots => "hash-by-slots",
            Policy::LeastPerSlot => "least-per-slot",
            Policy::RandomResident => "random-resident",
            Policy::Corral => "corral",
            Policy::CorralOneAtATime => "corral-1-at-a-time",
        }
    }

    /// The requests go through corral, which chooses the node.
    pub fn through_corral(self) -> bool {
        matches!(self, Policy::Corral | Policy::CorralOneAtATime)
    }
}

/// Client-side node choice for the baseline policies.
pub struct Picker {
    policy: Policy,
    rng: Mutex<Rng>,
    next: AtomicUsize,
    /// Requests in flight per node, for least-connections.
    in_flight: Vec<AtomicUsize>,
    /// Each node's slots, for the slot-weighted policies.
    slots: Vec<usize>,
    /// The run's seed, mixed into the conversation hash: real clients hash chat ids that are
    /// random (Open WebUI's are UUIDs), so which conversations share a node is luck, and
    /// the seeds should sample that luck rather than repeat one partition.
    salt: u64,
}

/// A request counted against a node; gives the count back when dropped.
pub struct InFlight<'a> {
    picker: &'a Picker,
    pub node: usize,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.picker.in_flight[self.node].fetch_sub(1, Ordering::Relaxed);
    }
}

impl Picker {
    /// A picker over nodes with these slot counts.
    pub fn new(policy: Policy, slots: Vec<usize>, seed: u64) -> Picker {
        Picker {
            policy,
            rng: Mutex::new(Rng::derive(seed, policy.name(), 0)),
            salt: seed,
            next: AtomicUsize::new(0),
            in_flight: slots.iter().map(|_| AtomicUsize::new(0)).collect(),
            slots,
        }
    }

    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// Chooses among `candidates` (indexes of nodes that have the model, never empty) and
    /// counts the request against the choice. `None` for corral, which chooses itself.
    pub fn pick(&self, conversation: usize, candidates: &[usize]) -> Option<InFlight<'_>> {
        let n = candidates.len();
        if n == 0 {
            return None;
        }
        let i = match self.policy {
            Policy::Corral | Policy::CorralOneAtATime => return None,
            Policy::Random | Policy::RandomResident => self.rng.lock().below(n as u64) as usize,
            Policy::HashBySlots => self.hash_by_slots(conversation, candidates),
            Policy::LeastPerSlot => self.least_per_slot(candidates),
            Policy::RoundRobin => self.next.fetch_add(1, Ordering::Relaxed) % n,
            Policy::StickyHash => self.sticky(conversation, n),
            Policy::LeastConnections => self.least_loaded(candidates),
        };
        let node = candidates[i];
        self.in_flight[node].fetch_add(1, Ordering::Relaxed);
        Some(InFlight { picker: self, node })
    }

    /// The candidate with the fewest requests in flight; ties go round the candidates in
    /// turn, as nginx's `least_conn` falls back to round-robin.
    fn least_loaded(&self, candidates: &[usize]) -> usize {
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let n = candidates.len();
        (0..n)
            .map(|k| (start + k) % n)
            .min_by_key(|&i| self.in_flight[candidates[i]].load(Ordering::Relaxed))
            .unwrap_or(0)
    }
}

impl Picker {
    fn slots_of(&self, node: usize) -> usize {
        self.slots.get(node).copied().unwrap_or(1).max(1)
    }

    /// A hash of `bytes`, salted by the seed (see `salt`).
    fn salted(&self, bytes: &[u8]) -> u64 {
        twox_hash::XxHash3_64::oneshot_with_seed(self.salt, bytes)
    }

    /// A hash of the conversation, salted by the seed, over the `n` candidates.
    fn sticky(&self, conversation: usize, n: usize) -> usize {
        (self.salted(&(conversation as u64).to_le_bytes()) % n as u64) as usize
    }

    /// Weighted rendezvous hashing: the candidate with the highest `-weight / ln(u)`, u
    /// uniform from a hash of (conversation, node) salted by the seed; each wins in
    /// proportion to its slots.
    fn hash_by_slots(&self, conversation: usize, candidates: &[usize]) -> usize {
        let score = |i: usize| {
            let node = candidates[i];
            let mut bytes = [0u8; 16];
            bytes[..8].copy_from_slice(&(conversation as u64).to_le_bytes());
            bytes[8..].copy_from_slice(&(node as u64).to_le_bytes());
            let h = self.salted(&bytes);
            let u = ((h >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
            -(self.slots_of(node) as f64) / u.ln()
        };
        (0..candidates.len())
            .max_by(|&a, &b| score(a).total_cmp(&score(b)))
            .unwrap_or(0)
    }

    /// The candidate with the fewest requests in flight per slot; ties in turn.
    fn least_per_slot(&self, candidates: &[usize]) -> usize {
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let n = candidates.len();
        let load = |i: usize| {
            let node = candidates[i];
            self.in_flight[node].load(Ordering::Relaxed) as f64 / self.slots_of(node) as f64
        };
        (0..n)
            .map(|k| (start + k) % n)
            .min_by(|&a, &b| load(a).total_cmp(&load(b)))
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sticky_is_stable_and_round_robin_rotates() {
        let p = Picker::new(Policy::StickyHash, vec![1; 4], 1);
        let a = p.pick(7, &[0, 1, 2, 3]).map(|f| f.node);
        let b = p.pick(7, &[0, 1, 2, 3]).map(|f| f.node);
        assert_eq!(a, b);
        let rr = Picker::new(Policy::RoundRobin, vec![1; 3], 1);
        let picks: Vec<_> = (0..3)
            .filter_map(|c| rr.pick(c, &[0, 1, 2]).map(|f| f.node))
            .collect();
        assert_eq!(picks, [0, 1, 2]);
    }

    #[test]
    fn least_connections_avoids_busy_nodes() {
        let p = Picker::new(Policy::LeastConnections, vec![1; 3], 1);
        let first = p.pick(0, &[0, 1, 2]);
        let second = p.pick(1, &[0, 1, 2]);
        let third = p.pick(2, &[0, 1, 2]);
        let mut nodes: Vec<_> = [&first, &second, &third]
            .iter()
            .filter_map(|f| f.as_ref().map(|f| f.node))
            .collect();
        nodes.sort_unstable();
        assert_eq!(nodes, [0, 1, 2]);
        drop(second);
        assert!(p.pick(3, &[0, 1, 2]).is_some());
    }

    #[test]
    fn corral_picks_nothing_client_side() {
        assert!(
            Picker::new(Policy::Corral, vec![1; 2], 1)
                .pick(0, &[0, 1])
                .is_none()
        );
    }

    #[test]
    fn slot_weighted_policies_follow_the_slots() {
        let p = Picker::new(Policy::HashBySlots, vec![4, 1], 1);
        let on_big = (0..2000)
            .filter(|&c| p.pick(c, &[0, 1]).map(|f| f.node) == Some(0))
            .count();
        assert!(
            (1450..1750).contains(&on_big),
            "{on_big} of 2000, 4:1 expected"
        );
        assert_eq!(
            p.pick(7, &[0, 1]).map(|f| f.node),
            p.pick(7, &[0, 1]).map(|f| f.node)
        );
        let p = Picker::new(Policy::LeastPerSlot, vec![4, 1], 1);
        let held: Vec<_> = (0..5).filter_map(|c| p.pick(c, &[0, 1])).collect();
        let on_big = held.iter().filter(|f| f.node == 0).count();
        assert_eq!(on_big, 4, "four on the 4-slot node, one on the other");
    }

    #[test]
    fn the_seed_draws_a_new_partition_of_the_conversations() {
        let nodes = [0, 1, 2, 3];
        for policy in [Policy::HashBySlots, Policy::StickyHash] {
            let partition = |seed| {
                let p = Picker::new(policy, vec![4, 4, 2, 2], seed);
                (0..24)
                    .filter_map(|c| p.pick(c, &nodes).map(|f| f.node))
                    .collect::<Vec<_>>()
            };
            assert_eq!(
                partition(1),
                partition(1),
                "{policy:?}: one seed, one partition"
            );
            let differ = (2..6)
                .filter(|&seed| partition(seed) != partition(1))
                .count();
            assert_eq!(
                differ, 4,
                "{policy:?}: every other seed moves some conversation"
            );
        }
    }
}
