//! Where a request's conversation is warm: the deepest prefix of it that a node still holds,
//! in a slot or in its host cache, found through the affinity table and checked against the
//! node's slot and host-cache mirror. Entries that no longer hold are dropped on the way.

use std::time::Instant;

use super::slots::{SlotPolicy, choose_slot, is_warm};
use super::{HostProbe, Pin, Router};
use crate::fleet::warm::{HostEntry, HostPlace};
use crate::request::Profile;

impl Router {
    /// The deepest prefix of the request that a node still holds warm, in a slot or in its
    /// host cache. Entries that no longer hold (slot given to another conversation and not
    /// saved, model unloaded, expired) are dropped on the way; the second value tells
    /// whether any was seen. The third is the deepest conversation found in a host cache,
    /// warm or not, whose reply will show how deep that cache goes.
    /// `peer_capacity` is what other nodes' host caches were shown to keep of this model.
    pub(super) fn find_pin(
        &self,
        p: &Profile,
        peer_capacity: Option<u64>,
    ) -> (Option<Pin>, bool, Option<HostProbe>) {
        let mut went_cold = false;
        let mut probe = None;
        let now = Instant::now();
        for depth in (1..=p.chain.depth()).rev() {
            let hash = p.chain.hashes[depth];
            let Some(entry) = self.affinity.get(hash) else {
                continue;
            };
            let node = self.fleet.node(entry.node);
            let found = node.and_then(|node| {
                let slots = node.parallel();
                node.books(|books| {
                    let host_allowed = books.kind.may_keep_host_cache();
                    let state = books.models.get(&p.model_key)?;
                    // A slot past those the node was shown to run is one the mirror gave a
                    // request sent past them: the node may have queued it and given it a
                    // slot of its own choosing, so that conversation is not expected warm.
                    let in_slot = (state.slots.iter().enumerate())
                        .find(|(_, s)| s.lineage == entry.lineage && is_warm(s, now, self.ttl()))
                        .map(|(i, s)| Place::Slot(s.depth, i < slots));
                    in_slot.or_else(|| {
                        // The slot the node restores it into: llama-server's choice for a
                        // prompt no slot holds.
                        let policy = SlotPolicy::LeastRecentlyUsed;
                        let taken = choose_slot(&state.slots, policy, now, self.ttl())
                            .and_then(|i| state.slots.get(i))
                            .map(|s| HostEntry::of(s, now));
                        let host = &state.warm.host;
                        let place =
                            host.place(entry.lineage, peer_capacity, slots, taken.as_ref())?;
                        Some(Place::Host(place, host_allowed))
                    })
                })
            });
            let (slot_depth, in_host, expected) = match found {
                Some(Place::Slot(slot_depth, seen)) => (slot_depth, false, seen),
                Some(Place::Host(place, allowed)) => {
                    if probe.is_none() {
                        probe = Some(HostProbe {
                            node: entry.node,
                            needed: place.needed,
                            newer: u32::try_from(place.newer).unwrap_or(u32::MAX),
                        });
                    }
                    if !(place.warm && allowed) {
                        // Kept: a reply may yet show it warm, and teach a larger capacity.
                        went_cold = true;
                        continue;
                    }
                    (place.depth, true, place.expected)
                }
                None => {
                    self.affinity.remove(hash);
                    went_cold = true;
                    continue;
                }
            };
            let pin = Pin {
                node: entry.node,
                lineage: entry.lineage,
                depth,
                continues: slot_depth == depth,
                in_host,
                expected,
            };
            return (Some(pin), went_cold, probe);
        }
        (None, went_cold, probe)
    }
}

/// Where a conversation's prefix was found on a node.
enum Place {
    /// In a slot, holding this many boundaries; the flag says whether the node was shown to
    /// run that many slots.
    Slot(usize, bool),
    /// In the host-cache mirror; the flag says whether the node can have a host cache.
    Host(HostPlace, bool),
}
