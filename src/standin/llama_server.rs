//! How llama-server (used directly, and as the runner of Ollama 0.30 and later) chooses a
//! slot and keeps prompts in host memory, followed from llama.cpp's source
//! (`tools/server/server-context.cpp`: `get_available_slot`; `tools/server/server-task.cpp`:
//! `server_prompt_cache::alloc`, `load`, `update`), with sizes in tokens standing for bytes
//! (a fixed KV size per token):
//!
//! - Among idle slots holding a prompt, the one whose common prefix is the largest fraction
//!   of the new prompt wins, if that fraction exceeds `slot_prompt_similarity` (0.1). If
//!   the slot would keep less than half of what it holds, its prompt is saved first.
//! - Otherwise the least recently used idle slot (the last of equals; never-used slots
//!   first) is taken, and its prompt is saved.
//! - Saving (`alloc`): skipped if a cached prompt already contains it whole, or if it alone
//!   exceeds the limit; cached prompts that it contains whole are dropped; the oldest are
//!   dropped until it fits.
//! - After a save the cache is searched (`load`) for the prompt that keeps more of itself
//!   (at least a quarter) and covers more of the new prompt than the slot does; it is
//!   restored into the slot and leaves the cache.
//! - Once the task has its slot, every idle slot's prompt is saved too
//!   (`--cache-idle-slots`, on by default with a host cache: `server-context.cpp`, the
//!   `[TAG_IDLE_SLOT_CLEAR]` loop after `launch_slot_with_task`; `common/common.h`
//!   `cache_idle_slots = true`). With `-np N` given, as Ollama gives it, the KV cache is not
//!   unified and the slots keep their prompts: the cache holds copies of them, which take
//!   its room and push older prompts out.

use std::collections::VecDeque;

use super::prompt::{common_prefix_tokens, tokens_in};
use super::slots::Slot;

/// llama-server's default `--slot-prompt-similarity`.
const SLOT_PROMPT_SIMILARITY: f64 = 0.1;

/// The host-memory prompt cache (`--cache-ram`), oldest prompt first.
#[derive(Clone, Debug, Default)]
pub struct PromptCache {
    states: VecDeque<Vec<u8>>,
    limit_tokens: u32,
}

impl PromptCache {
    pub fn new(limit_tokens: u32) -> PromptCache {
        PromptCache {
            states: VecDeque::new(),
            limit_tokens,
        }
    }

    fn tokens(&self) -> u32 {
        self.states.iter().map(|s| tokens_in(s.len())).sum()
    }

    /// `server_prompt_cache::alloc` followed by the copy.
    fn save(&mut self, prompt: &[u8]) {
        if prompt.is_empty() || self.limit_tokens == 0 {
            return;
        }
        let size = tokens_in(prompt.len());
        if self
            .states
            .iter()
            .any(|s| common_prefix_tokens(s, prompt) == size)
        {
            return;
        }
        if size > self.limit_tokens {
            return;
        }
        self.states
            .retain(|s| common_prefix_tokens(s, prompt) != tokens_in(s.len()));
        while !self.states.is_empty() && self.tokens() + size > self.limit_tokens {
            self.states.pop_front();
        }
        self.states.push_back(prompt.to_vec());
    }

    /// `server_prompt_cache::load`: the cached prompt to restore into a slot holding
    /// `held`, if one is better for `prompt`.
    fn load(&mut self, held: &[u8], prompt: &[u8]) -> Option<Vec<u8>> {
        let prompt_len = f64::from(tokens_in(prompt.len()).max(1));
        let lcp_best = f64::from(common_prefix_tokens(held, prompt));
        let mut keep_best = if held.is_empty() {
            -1.0
        } else {
            lcp_best / f64::from(tokens_in(held.len()).max(1))
        };
        let mut sim_best = lcp_best / prompt_len;
        let mut best = None;
        for (i, state) in self.states.iter().enumerate() {
            let lcp = f64::from(common_prefix_tokens(state, prompt));
            let keep = lcp / f64::from(tokens_in(state.len()).max(1));
            let sim = lcp / prompt_len;
            if keep < 0.25 {
                continue;
            }
            if keep_best < keep && sim_best < sim {
                keep_best = keep;
                sim_best = sim;
                best = Some(i);
            }
        }
        self.states.remove(best?)
    }

    /// `server_prompt_cache::update`: the oldest prompts go while over the limit.
    fn update(&mut self) {
        while !self.states.is_empty() && self.tokens() > self.limit_tokens {
            self.states.pop_front();
        }
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.states.len()
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.states.is_empty()
    }
}

/// `get_available_slot`: picks an idle slot for `prompt`, saving and restoring prompts
/// through the host cache, and returns it with the whole tokens it now shares with the
/// prompt. `None` when every slot is busy.
pub fn take_slot(
    slots: &mut [Slot],
    cache: &mut PromptCache,
    prompt: &[u8],
) -> Option<(usize, u32)> {
    let prompt_len = f64::from(tokens_in(prompt.len()).max(1));
    let mut chosen = None;
    let mut sim_best = 0.0;
    for (i, slot) in slots.iter().enumerate() {
        if slot.busy || slot.text.is_empty() {
            continue;
        }
        let sim = f64::from(common_prefix_tokens(&slot.text, prompt)) / prompt_len;
        if sim > sim_best && sim > SLOT_PROMPT_SIMILARITY {
            sim_best = sim;
            chosen = Some(i);
        }
    }
    let update_cache = if let Some(i) = chosen {
        let keep = sim_best * prompt_len / f64::from(tokens_in(slots[i].text.len()).max(1));
        keep < 0.5
    } else {
        let mut last = None;
        for (i, slot) in slots.iter().enumerate() {
            if slot.busy {
                continue;
            }
            if last.is_none_or(|t| slot.last_used <= t) {
                last = Some(slot.last_used);
                chosen = Some(i);
            }
        }
        chosen.is_some()
    };
    let index = chosen?;
    if update_cache && cache.limit_tokens > 0 {
        let slot = &mut slots[index];
        cache.save(&slot.text);
        if let Some(restored) = cache.load(&slot.text, prompt) {
            slot.text = restored;
        }
        cache.update();
    }
    Some((index, common_prefix_tokens(&slots[index].text, prompt)))
}

/// The idle-slot save after a task started (see the module's last rule): each idle slot's
/// prompt is saved, skipped where the cache already holds it whole.
pub fn save_idle_slots(slots: &[Slot], cache: &mut PromptCache) {
    if cache.limit_tokens == 0 {
        return;
    }
    for slot in slots.iter().filter(|s| !s.busy && !s.text.is_empty()) {
        cache.save(&slot.text);
        cache.update();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(text: &str, busy: bool, last_used: u64) -> Slot {
        Slot::holding(text, busy, last_used)
    }

    const A: &str = "<|user|>aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    const B: &str = "<|user|>bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";
    const C: &str = "<|user|>cccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccc";

    #[test]
    fn a_continuation_takes_its_slot_by_similarity() {
        let mut slots = [slot(A, false, 1), slot(B, false, 2)];
        let mut cache = PromptCache::new(1000);
        let next = format!("{B}<|assistant|>reply");
        assert_eq!(
            take_slot(&mut slots, &mut cache, next.as_bytes()),
            Some((1, 27))
        );
        assert!(
            cache.is_empty(),
            "nothing saved: the slot keeps all it held"
        );
    }

    #[test]
    fn a_new_prompt_takes_the_least_recently_used_slot_and_saves_it() {
        let mut slots = [slot(A, false, 2), slot(B, false, 1), slot(C, true, 0)];
        let mut cache = PromptCache::new(1000);
        // 2 shared tokens of 27: below the 0.1 similarity.
        let new = format!("<|user|>{}", "d".repeat(100));
        assert_eq!(
            take_slot(&mut slots, &mut cache, new.as_bytes()),
            Some((1, 2))
        );
        assert_eq!(cache.len(), 1);
        // B comes back: the LRU slot is now 0 (A); A is saved and B restored into it.
        slots[1].text = new.as_bytes().to_vec();
        slots[1].last_used = 3;
        let b_again = format!("{B}<|assistant|>reply");
        assert_eq!(
            take_slot(&mut slots, &mut cache, b_again.as_bytes()),
            Some((0, 27))
        );
        assert_eq!(slots[0].text, B.as_bytes());
        assert_eq!(cache.len(), 1, "B left the cache, A went in");
        assert_eq!(cache.states[0], A.as_bytes());
    }

    #[test]
    fn idle_slots_are_copied_into_the_cache_when_a_task_starts() {
        let mut slots = [slot(A, false, 1), slot(B, true, 2), slot(C, false, 3)];
        let mut cache = PromptCache::new(60);
        cache.save(format!("<|user|>{}", "d".repeat(40)).as_bytes());
        save_idle_slots(&slots, &mut cache);
        // A and C (27 tokens each) saved, B busy; the older prompt went to make room.
        assert_eq!(cache.len(), 2);
        assert_eq!(cache.states[0], A.as_bytes());
        assert_eq!(cache.states[1], C.as_bytes());
        // Saved again unchanged: already held whole, nothing moves.
        save_idle_slots(&slots, &mut cache);
        assert_eq!(cache.states[0], A.as_bytes());
        // A slot that grew replaces its older copy.
        slots[0].text = format!("{A}<|assistant|>x").into_bytes();
        save_idle_slots(&slots, &mut cache);
        assert_eq!(cache.len(), 2);
        assert!(cache.states.iter().all(|s| s.as_slice() != A.as_bytes()));
        // Without a host cache nothing happens.
        let mut none = PromptCache::new(0);
        save_idle_slots(&slots, &mut none);
        assert!(none.is_empty());
    }

    #[test]
    fn the_oldest_prompts_go_when_the_cache_is_full() {
        let mut cache = PromptCache::new(60);
        cache.save(A.as_bytes());
        cache.save(B.as_bytes());
        cache.save(C.as_bytes());
        assert_eq!(cache.len(), 2, "27 tokens each, 60 at most");
        assert_eq!(cache.states[0], B.as_bytes());
        // A prompt that contains a cached one whole replaces it.
        cache.save(format!("{C}more").as_bytes());
        assert_eq!(cache.len(), 2);
        assert!(cache.states.iter().all(|s| s.as_slice() != C.as_bytes()));
        // One larger than the whole cache is not saved.
        cache.save(&[b'z'; 300]);
        assert_eq!(cache.len(), 2);
        // Without a cache nothing is kept.
        let mut none = PromptCache::new(0);
        none.save(A.as_bytes());
        assert!(none.is_empty());
    }
}
