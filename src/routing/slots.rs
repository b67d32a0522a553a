//! corral's mirror of a node's slots: which slot the node gives a prompt, and whether a new
//! conversation there would push a warm one out. Each runner's rule is its own: Ollama's old
//! runner (`runner/ollamarunner/cache.go`) and llama-server (`tools/server/server-context.cpp`).

use std::time::{Duration, Instant};

use crate::config::NodeConfig;
use crate::fleet::kind::{KindState, NodeKind};
use crate::fleet::{ModelState, Slot};
use crate::request::Profile;

pub(super) fn is_warm(slot: &Slot, now: Instant, ttl: Duration) -> bool {
    slot.lineage != 0 && slot.last_used.is_some_and(|t| now.duration_since(t) <= ttl)
}

/// How a prompt opens, for llama-server's similarity rule: conversations opening with the
/// same first message (a system prompt) share that much of each other's prompts.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Opening {
    /// The hash of the first message; 0 when the prompt has none.
    pub first: u64,
    /// Estimated tokens of the first message, and of the whole prompt.
    pub first_tokens: u64,
    pub tokens: u64,
}

impl Opening {
    /// How the request's prompt opens.
    pub fn of(p: &Profile) -> Opening {
        Opening {
            first: p.chain.hashes.get(1).copied().unwrap_or(0),
            first_tokens: u64::from(p.first_tokens),
            tokens: u64::from(p.prompt_tokens),
        }
    }

    /// Whether llama-server would give the prompt `slot`, idle, for what it shares: the
    /// common prefix must exceed a tenth of the prompt (its default
    /// `--slot-prompt-similarity`). Prompts opening differently share only a chat template's
    /// first tokens, below that.
    pub fn draws_to(&self, slot: &Slot) -> bool {
        self.opens_like(slot) && self.first_tokens * 10 > self.tokens
    }

    /// Whether the slot's conversation is saved to the host cache when the prompt takes the
    /// slot: llama-server saves it unless the prompt keeps at least half of it.
    pub fn saves(&self, slot: &Slot) -> bool {
        !self.opens_like(slot) || self.first_tokens * 2 < slot.tokens
    }

    fn opens_like(&self, slot: &Slot) -> bool {
        self.first != 0 && slot.lineage != 0 && slot.first == self.first
    }
}

/// How a node's runner chooses the slot of a prompt that continues none: Ollama's
/// `OLLAMA_MULTIUSER_CACHE` setting (`nodes[].multiuser_cache`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SlotPolicy {
    /// Ollama's default: the idle slot sharing the longest prefix with the prompt. Every
    /// prompt shares its first tokens (BOS, the chat template) with any slot that holds
    /// something, so that is the first idle slot holding a conversation, never an empty
    /// one while such a slot is idle.
    LongestPrefix,
    /// The old runner's multi-user cache: an empty slot, else the least recently used idle
    /// one, into which the part a prompt shares with another slot is copied
    /// (`findBestCacheSlot`).
    LeastRecentlyUsed,
    /// llama-server: the idle slot sharing the most of the prompt, if more than a tenth of
    /// it; else as [`SlotPolicy::LeastRecentlyUsed`].
    MostSimilar,
}

impl SlotPolicy {
    /// The old Ollama runner without the multi-user cache takes the longest prefix;
    /// llama-server (Ollama 0.30 and later, llama.cpp) the most similar, else an empty
    /// slot, else the least recently used. A node of unknown kind is taken for current
    /// Ollama.
    pub(super) fn of(kind: &KindState, settings: &NodeConfig) -> SlotPolicy {
        match (
            kind.kind == NodeKind::OllamaLegacy,
            settings.multiuser_cache,
        ) {
            (true, false) => SlotPolicy::LongestPrefix,
            (true, true) => SlotPolicy::LeastRecentlyUsed,
            (false, _) => SlotPolicy::MostSimilar,
        }
    }
}

/// Whether a new conversation sent here would take the slot of a warm one.
pub(super) fn displaces_warm(
    state: &ModelState,
    parallel: usize,
    policy: SlotPolicy,
    now: Instant,
    ttl: Duration,
) -> bool {
    let warm = |s: &Slot| is_warm(s, now, ttl);
    match policy {
        // It takes an idle slot holding a conversation if there is one; with every slot
        // busy, it will take the next to free, which holds the conversation just served.
        SlotPolicy::LongestPrefix => {
            let all_busy = state.slots.len() >= parallel && state.slots.iter().all(|s| s.busy > 0);
            state
                .slots
                .iter()
                .any(|s| warm(s) && (s.busy == 0 || all_busy))
        }
        SlotPolicy::LeastRecentlyUsed | SlotPolicy::MostSimilar => {
            state.slots.len() >= parallel && state.slots.iter().all(warm)
        }
    }
}

/// The slot the node gives a prompt that continues no conversation it holds, in the
/// mirror; `None` when the old runner's every known slot is busy.
///
/// llama-server first looks for an idle slot sharing more than a tenth of the prompt,
/// which the mirror sees as one holding a conversation that opens alike (the first such,
/// since they share as much; `server-context.cpp`, `get_available_slot`).
///
/// A request that finds every slot corral knows of busy was sent past them (a probe): the
/// node runs it in a slot corral has not seen, or queues it until one frees. llama-server
/// saves the conversation of the slot it then takes into host memory, which taking the
/// least recently used slot and saving its conversation mirrors. The old runner saves
/// nothing, and giving the request a running conversation's slot made corral forget a
/// conversation the node still held (whose next turn then went elsewhere, cold, and pushed
/// out another): there the request gets a slot of its own ([`None`]).
pub(super) fn choose_slot(
    slots: &[Slot],
    policy: SlotPolicy,
    opening: &Opening,
    now: Instant,
    ttl: Duration,
) -> Option<usize> {
    match policy {
        SlotPolicy::LongestPrefix => {
            // Any slot with content beats an empty one, whatever its age: the node keeps
            // a slot's content until the model unloads (which the poller clears).
            let first_idle = |holds: bool| {
                slots
                    .iter()
                    .position(|s| s.busy == 0 && (s.lineage != 0) == holds)
            };
            first_idle(true).or_else(|| first_idle(false))
        }
        SlotPolicy::LeastRecentlyUsed | SlotPolicy::MostSimilar => {
            let similar = (policy == SlotPolicy::MostSimilar)
                .then(|| similar_slot(slots, opening, now, ttl))
                .flatten();
            let cold = || slots.iter().position(|s| !is_warm(s, now, ttl));
            let lru = |idle_only: bool| {
                slots
                    .iter()
                    .enumerate()
                    .filter(|(_, s)| !idle_only || s.busy == 0)
                    .min_by_key(|(_, s)| s.last_used)
                    .map(|(i, _)| i)
            };
            similar
                .or_else(cold)
                .or_else(|| lru(true))
                .or_else(|| lru(false))
        }
    }
}

/// The idle slot llama-server gives a prompt for what it shares with it: in the mirror, the
/// first warm one holding a conversation that opens alike (they share as much).
pub(super) fn similar_slot(
    slots: &[Slot],
    opening: &Opening,
    now: Instant,
    ttl: Duration,
) -> Option<usize> {
    (slots.iter()).position(|s| s.busy == 0 && is_warm(s, now, ttl) && opening.draws_to(s))
}

/// The slot that freed first at or after `since`, other than `own`, and has not been given
/// out since: the one the node gave a request it queued at `since`.
pub(super) fn first_freed_since(slots: &[Slot], own: usize, since: Instant) -> Option<usize> {
    slots
        .iter()
        .enumerate()
        .filter(|&(i, s)| i != own && s.busy == 0 && s.last_used.is_some_and(|t| t >= since))
        .min_by_key(|(_, s)| s.last_used)
        .map(|(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_queued_request_gets_the_slot_that_freed_first_after_it_was_sent() {
        let sent = Instant::now();
        let slot = |lineage, busy, freed_ms: Option<u64>| Slot {
            lineage,
            depth: 1,
            last_used: freed_ms.map(|ms| sent + Duration::from_millis(ms)),
            busy,
            tokens: 10,
            first: 0,
        };
        let before = Slot {
            last_used: sent.checked_sub(Duration::from_millis(5)),
            ..slot(6, 0, None)
        };
        // Slot 0 freed before it was sent, 1 runs, 2 freed at 30 ms, 3 at 10 ms, 4 is its own.
        let slots = [
            before,
            slot(7, 1, Some(0)),
            slot(8, 0, Some(30)),
            slot(9, 0, Some(10)),
            slot(5, 0, Some(1)),
        ];
        assert_eq!(first_freed_since(&slots, 4, sent), Some(3));
        // Given out again since (busy): the next to free.
        let mut retaken = slots.clone();
        retaken[3].busy = 1;
        assert_eq!(first_freed_since(&retaken, 4, sent), Some(2));
        // Nothing freed since it was sent.
        assert_eq!(first_freed_since(&slots[..2], 4, sent), None);
    }

    #[test]
    fn by_default_a_busy_slot_is_not_taken_and_content_beats_emptiness() {
        let now = Instant::now();
        let ttl = Duration::from_secs(300);
        let slot = |lineage, busy| Slot {
            lineage,
            depth: 1,
            last_used: Some(now),
            busy,
            tokens: 10,
            first: 0,
        };
        let none = Opening::default();
        let slots = [slot(0, 0), slot(7, 1), slot(8, 0), slot(9, 0)];
        assert_eq!(
            choose_slot(&slots, SlotPolicy::LongestPrefix, &none, now, ttl),
            Some(2)
        );
        assert_eq!(
            choose_slot(&slots, SlotPolicy::LeastRecentlyUsed, &none, now, ttl),
            Some(0)
        );
        let all_busy_or_empty = [slot(7, 1), slot(0, 0)];
        assert_eq!(
            choose_slot(
                &all_busy_or_empty,
                SlotPolicy::LongestPrefix,
                &none,
                now,
                ttl
            ),
            Some(1)
        );
        // Every slot busy: on the old runner a probe past them takes none of theirs; on
        // llama-server the least recently used, whose conversation goes to host memory.
        let all_busy = [slot(7, 1), slot(8, 1)];
        assert_eq!(
            choose_slot(&all_busy, SlotPolicy::LongestPrefix, &none, now, ttl),
            None
        );
        assert_eq!(
            choose_slot(&all_busy, SlotPolicy::LeastRecentlyUsed, &none, now, ttl),
            Some(0)
        );

        // Displacement by default: an idle slot holding a conversation; with every slot
        // busy, the next to free; a busy slot beside an empty one, no.
        let state = |slots: Vec<Slot>| ModelState {
            slots,
            ..Default::default()
        };
        let displaces = |slots: Vec<Slot>, policy| {
            let n = slots.len();
            displaces_warm(&state(slots), n, policy, now, ttl)
        };
        let by_default = SlotPolicy::LongestPrefix;
        assert!(displaces(vec![slot(0, 0), slot(8, 0)], by_default));
        assert!(displaces(vec![slot(7, 1)], by_default));
        assert!(!displaces(vec![slot(7, 1), slot(0, 0)], by_default));
        assert!(!displaces(
            vec![slot(0, 0), slot(8, 0)],
            SlotPolicy::LeastRecentlyUsed
        ));
        assert!(displaces(
            vec![slot(7, 1), slot(8, 0)],
            SlotPolicy::LeastRecentlyUsed
        ));
    }

    #[test]
    fn on_llama_server_a_prompt_takes_an_idle_slot_opening_alike_before_an_empty_one() {
        let now = Instant::now();
        let ttl = Duration::from_secs(300);
        let slot = |lineage, first, busy, tokens| Slot {
            lineage,
            depth: 2,
            last_used: Some(now),
            busy,
            tokens,
            first,
        };
        // A prompt of 1,200 tokens opening with a 1,000-token system prompt (hash 5).
        let opening = Opening {
            first: 5,
            first_tokens: 1_000,
            tokens: 1_200,
        };
        let llama_server = SlotPolicy::MostSimilar;
        let slots = [slot(0, 0, 0, 0), slot(7, 5, 1, 1_100), slot(8, 5, 0, 1_100)];
        assert_eq!(
            choose_slot(&slots, llama_server, &opening, now, ttl),
            Some(2)
        );
        // The old runner's multi-user cache copies the shared part into an empty slot.
        let multiuser = SlotPolicy::LeastRecentlyUsed;
        assert_eq!(choose_slot(&slots, multiuser, &opening, now, ttl), Some(0));
        // Its conversation keeps more than half of what slot 2 holds: not saved. Of a
        // conversation more than twice as long as the system prompt, less: saved.
        assert!(!opening.saves(&slots[2]));
        assert!(opening.saves(&slot(8, 5, 0, 2_500)));
        // Opening otherwise, or with a first message under a tenth of the prompt: the
        // empty slot, as before, and whatever a slot holds is saved.
        let other = Opening {
            first: 6,
            ..opening
        };
        assert_eq!(choose_slot(&slots, llama_server, &other, now, ttl), Some(0));
        assert!(other.saves(&slots[2]));
        let short = Opening {
            first_tokens: 100,
            ..opening
        };
        assert!(!short.draws_to(&slots[2]));
        assert_eq!(choose_slot(&slots, llama_server, &short, now, ttl), Some(0));
        // A prompt with no first message is drawn nowhere; the old runner keeps its rule.
        let unknown = Opening::default();
        assert!(!unknown.draws_to(&slot(8, 0, 0, 1_100)));
        assert_eq!(
            choose_slot(&slots, SlotPolicy::LongestPrefix, &opening, now, ttl),
            Some(2)
        );
    }
}
