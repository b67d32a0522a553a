//! Where a request's conversation is warm: the deepest prefix of it that a node still holds,
//! in a slot or in its host cache, found through the affinity table and checked against the
//! node's slot and host-cache mirror. It reads only: entries found no longer to hold are
//! returned, for the bookkeeping after the choice to forget.

use std::time::{Duration, Instant};

use super::slots::{Opening, SlotPolicy, choose_slot, is_warm, similar_slot};
use super::{HostProbe, Pin, Router};
use crate::fleet::Slot;
use crate::fleet::warm::{HostCache, HostEntry, HostPlace};
use crate::request::Profile;

/// Where a request's conversation is warm, as [`Router::locate`] found it.
#[derive(Debug, Default)]
pub(super) struct Located {
    /// The deepest prefix a node still holds warm.
    pub pin: Option<Pin>,
    /// The prefix table's hash of that prefix.
    pub pin_hash: Option<u64>,
    /// Some deeper prefix was known and has gone cold.
    pub went_cold: bool,
    /// The pin's node may keep a host cache (llama-server based, or not known yet).
    pub pin_keeps_host: bool,
    /// The deepest conversation found in a host cache, warm or not, whose reply will show
    /// how deep that cache goes.
    pub probe: Option<HostProbe>,
    /// Prefixes whose entries no longer hold (slot given to another conversation and not
    /// saved, model unloaded): to forget.
    pub stale: Vec<u64>,
}

impl Router {
    /// The deepest prefix of the request that a node still holds warm, in a slot or in its
    /// host cache. `peer_capacity` is what other nodes' host caches were shown to keep of
    /// this model. Reads only.
    pub(super) fn locate(&self, p: &Profile, peer_capacity: Option<u64>) -> Located {
        let mut found = Located::default();
        let now = Instant::now();
        let opening = Opening::of(p);
        for depth in (1..=p.chain.depth()).rev() {
            let hash = p.chain.hashes[depth];
            let Some(entry) = self.affinity.peek(hash) else {
                continue;
            };
            let node = self.fleet.node(entry.node);
            let place = node.and_then(|node| {
                let slots = node.parallel();
                node.books(|books| {
                    let keeps_host = books.kind.may_keep_host_cache();
                    let state = books.models.get(&p.model_key)?;
                    // A slot past those the node was shown to run is one the mirror gave a
                    // request sent past them: the node may have queued it and given it a
                    // slot of its own choosing, so that conversation is not expected warm.
                    let in_slot = (state.slots.iter().enumerate())
                        .find(|(_, s)| s.lineage == entry.lineage && is_warm(s, now, self.ttl()));
                    // Another conversation sharing this prefix (a system prompt), running
                    // now: llama-server gives the request another slot, idle now. The old
                    // runner keeps the pull: its multi-user cache copies the shared part into
                    // the request's slot, and without it the request, waiting for that
                    // node's slots, mostly takes that one once freed, as the one sharing the
                    // longest prefix (without the pull, shared-system at 2x kept 28% warm
                    // against 63%: docs/benchmarks.md).
                    let running = in_slot.is_some_and(|(_, s)| {
                        s.depth != depth
                            && s.busy > 0
                            && SlotPolicy::of(&books.kind, &node.settings())
                                == SlotPolicy::MostSimilar
                    });
                    let in_slot = (in_slot.filter(|_| !running))
                        .map(|(i, s)| Place::Slot(s.depth, i < slots));
                    let place = in_slot.or_else(|| {
                        // The slot the node restores it into: llama-server's choice for a
                        // prompt no slot holds. An idle one holding a conversation that opens
                        // alike is taken for that opening, as it is where the request keeps
                        // half of what it holds: then nothing is restored.
                        let offer = Offer::of(&state.slots, &opening, now, self.ttl());
                        let in_idle_slot = |lost| {
                            let opening = offer.in_idle_slot(slots)?;
                            Some(Place::Opening { opening, lost })
                        };
                        if offer.similar.is_some_and(|(_, s)| !opening.saves(s)) {
                            return in_idle_slot(false);
                        }
                        let host = &state.warm.host;
                        match host.place(entry.lineage, peer_capacity, slots, offer.saved.as_ref())
                        {
                            Some(place) => Some(Place::Host(place)),
                            // Not lost: it runs, and its turn ends in that slot. The slot the
                            // request is given restores the newest conversation saved opening
                            // alike, if the cache keeps one.
                            None if running => Some(
                                offer
                                    .warm_opening(host, &opening, slots, peer_capacity, keeps_host)
                                    .map_or(Place::Running, |opening| Place::Opening {
                                        opening,
                                        lost: false,
                                    }),
                            ),
                            None => in_idle_slot(true),
                        }
                    })?;
                    Some((place, keeps_host))
                })
            });
            let Some((place, keeps_host)) = place else {
                found.stale.push(hash);
                found.went_cold = true;
                continue;
            };
            let (slot_depth, in_host, expected) = match place {
                Place::Running => continue,
                Place::Slot(slot_depth, seen) => (slot_depth, false, seen),
                Place::Opening { opening, lost } => {
                    // The node gives the request that slot, or restores that conversation
                    // into the one it gives: the opening they share is warm there, and only
                    // that.
                    if lost {
                        found.stale.push(hash);
                    }
                    found.pin = Some(opening.pin(entry.node));
                    found.pin_keeps_host = keeps_host;
                    found.went_cold = true;
                    return found;
                }
                Place::Host(place) => {
                    if found.probe.is_none() {
                        found.probe = Some(HostProbe {
                            node: entry.node,
                            needed: place.needed,
                            newer: u32::try_from(place.newer).unwrap_or(u32::MAX),
                        });
                    }
                    if !(place.warm && keeps_host) {
                        // Kept: a reply may yet show it warm, and teach a larger capacity.
                        found.went_cold = true;
                        continue;
                    }
                    (place.depth, true, place.expected)
                }
            };
            found.pin = Some(Pin {
                node: entry.node,
                lineage: entry.lineage,
                depth,
                continues: slot_depth == depth,
                in_host,
                expected,
            });
            found.pin_hash = Some(hash);
            found.pin_keeps_host = keeps_host;
            return found;
        }
        if p.follow_up {
            found.pin = self.opening_anywhere(&p.model_key, &opening, peer_capacity, now);
            found.pin_keeps_host |= found.pin.is_some();
        }
        found
    }

    /// For a follow-up whose own turns no node holds: a llama-server node where its opening
    /// (a system prompt other conversations share) is warm, in an idle slot that a prompt
    /// opening alike takes, else in a saved conversation its host cache keeps, which the
    /// slot the node gives is restored from. A follow-up pushed out of its node's cache is
    /// still warm for most of its prompt where one of those is; placed as new, it went
    /// where nothing of it was. Nodes with such a slot idle come first (nothing to restore),
    /// then those with the most idle slots.
    fn opening_anywhere(
        &self,
        model: &str,
        opening: &Opening,
        peer_capacity: Option<u64>,
        now: Instant,
    ) -> Option<Pin> {
        if opening.first == 0 {
            return None;
        }
        let mut best: Option<((bool, usize), Pin)> = None;
        for node in self
            .fleet
            .nodes()
            .iter()
            .filter(|n| self.fleet.is_healthy(n))
        {
            let slots = node.parallel();
            let found = node.books(|books| {
                if !books.kind.may_keep_host_cache()
                    || SlotPolicy::of(&books.kind, &node.settings()) != SlotPolicy::MostSimilar
                {
                    return None;
                }
                let state = books.models.get(model)?;
                let idle = state.slots.iter().filter(|s| s.busy == 0).count();
                let offer = Offer::of(&state.slots, opening, now, self.ttl());
                let warm =
                    offer.warm_opening(&state.warm.host, opening, slots, peer_capacity, true)?;
                Some(((!warm.in_host, idle), warm.pin(node.id)))
            });
            if let Some((rank, pin)) = found
                && best.as_ref().is_none_or(|(b, _)| rank > *b)
            {
                best = Some((rank, pin));
            }
        }
        best.map(|(_, pin)| pin)
    }
}

/// Where a conversation's prefix was found on a node.
enum Place {
    /// In a slot, holding this many boundaries; the flag says whether the node was shown to
    /// run that many slots.
    Slot(usize, bool),
    /// In the host-cache mirror.
    Host(HostPlace),
    /// In the slot of another conversation sharing the prefix, running now: the node gives
    /// the request another slot, so the prefix is not warm for it there.
    Running,
    /// Only the opening is warm: the node would give the request an idle slot holding a
    /// conversation that opens alike without restoring the request's own, or, while the
    /// conversation holding the prefix runs, restore one saved opening alike into the slot
    /// it gives. `lost` when the host cache does not hold the request's own conversation
    /// either.
    Opening { opening: WarmOpening, lost: bool },
}

/// A conversation through which a request's opening (its first message) is warm on a node.
#[derive(Clone, Copy, Debug)]
struct WarmOpening {
    lineage: u64,
    /// Saved in the host cache (restored into the slot the request is given), not idle in a
    /// slot.
    in_host: bool,
    /// As for [`Place::Slot`], or by the cache's capacity.
    expected: bool,
}

impl WarmOpening {
    /// The request pinned to `node` for its opening only.
    fn pin(self, node: u16) -> Pin {
        Pin {
            node,
            lineage: self.lineage,
            depth: 1,
            continues: false,
            in_host: self.in_host,
            expected: self.expected,
        }
    }
}

/// What llama-server offers a prompt that continues no slot of a node, in the mirror: the
/// idle slot holding a conversation that opens alike, which it gives for what they share
/// (`similar`), and the conversation it saves first from the slot it takes (`saved`).
struct Offer<'s> {
    similar: Option<(usize, &'s Slot)>,
    saved: Option<HostEntry>,
}

impl<'s> Offer<'s> {
    fn of(slots: &'s [Slot], opening: &Opening, now: Instant, ttl: Duration) -> Offer<'s> {
        let similar = similar_slot(slots, opening, now, ttl).and_then(|i| Some((i, slots.get(i)?)));
        let saved = choose_slot(slots, SlotPolicy::MostSimilar, opening, now, ttl)
            .and_then(|i| slots.get(i))
            .map(|s| s.saved(now));
        Offer { similar, saved }
    }

    /// The opening warm in the idle slot that shares it (`slots`: those the node was shown
    /// to run).
    fn in_idle_slot(&self, slots: usize) -> Option<WarmOpening> {
        self.similar.map(|(i, s)| WarmOpening {
            lineage: s.lineage,
            in_host: false,
            expected: i < slots,
        })
    }

    /// Where the opening is warm on the node: in the idle slot that shares it, else in the
    /// newest conversation saved opening alike that the host cache keeps, which the slot
    /// the request is given restores.
    fn warm_opening(
        &self,
        host: &HostCache,
        opening: &Opening,
        slots: usize,
        peer_capacity: Option<u64>,
        keeps_host: bool,
    ) -> Option<WarmOpening> {
        self.in_idle_slot(slots).or_else(|| {
            let lineage = host.opening(opening.first)?;
            let place = host.place(lineage, peer_capacity, slots, self.saved.as_ref())?;
            (place.warm && keeps_host).then_some(WarmOpening {
                lineage,
                in_host: true,
                expected: place.expected,
            })
        })
    }
}
