//! The parallel slots of one loaded model, each holding the KV state of one rendered prefix.
//!
//! This is the behaviour the router exploits: a request reuses the slot with the longest
//! common prefix, so a conversation stays warm until enough other conversations have taken
//! its slot. When every slot is busy, requests queue in arrival order, as Ollama's scheduler
//! does.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::engine::{BatchRule, Engine, Run};
use super::llama_server::{PromptCache, save_idle_slots, take_slot};
use super::prompt::{common_prefix_tokens, tokens_in};

/// One slot: the rendered text whose KV state it holds.
#[derive(Clone, Debug, Default)]
pub struct Slot {
    pub text: Vec<u8>,
    pub busy: bool,
    /// Logical time of last use, for least-recently-used choice.
    pub last_used: u64,
    /// When its last request let it go.
    pub freed: Option<Instant>,
}

#[cfg(test)]
impl Slot {
    /// A slot holding `text`, for the slot rules' tests.
    pub(super) fn holding(text: &str, busy: bool, last_used: u64) -> Slot {
        Slot {
            text: text.as_bytes().to_vec(),
            busy,
            last_used,
            freed: None,
        }
    }
}

/// The slot a request should take and the whole tokens it shares with that slot. `None`
/// when every slot is busy.
///
/// Ollama's default: among free slots, the longest common prefix wins (the earliest slot
/// on ties); when no free slot shares a token, the least recently used free slot is taken.
/// With `multiuser_cache` (`OLLAMA_MULTIUSER_CACHE`): a free slot whose whole content the
/// prompt continues, else the least recently used free slot, into which the longest shared
/// prefix is copied.
pub fn choose_slot(slots: &[Slot], prompt: &[u8], multiuser_cache: bool) -> Option<(usize, u32)> {
    let free = || slots.iter().enumerate().filter(|(_, s)| !s.busy);
    let best = free()
        .map(|(i, s)| (i, common_prefix_tokens(&s.text, prompt)))
        .max_by_key(|&(i, common)| (common, std::cmp::Reverse(i)))?;
    let continues = |i: usize| !slots[i].text.is_empty() && prompt.starts_with(&slots[i].text);
    if best.1 > 0 && (!multiuser_cache || continues(best.0)) {
        return Some(best);
    }
    let copied = if multiuser_cache { best.1 } else { 0 };
    free()
        .min_by_key(|&(i, s)| (s.last_used, i))
        .map(|(i, _)| (i, copied))
}

/// Prompt tokens a request can skip: the shared prefix, except that at least one token is
/// always evaluated (llama.cpp needs logits for the last prompt token).
pub fn cached_tokens(common: u32, prompt_tokens: u32) -> u32 {
    common.min(prompt_tokens.saturating_sub(1))
}

/// All slots of one loaded model. A new table (all slots empty) comes with every load, which
/// is how unloading clears the cache.
#[derive(Debug)]
pub struct SlotTable {
    /// One permit per slot; tokio's semaphore is fair, which gives the FIFO queue.
    permits: Arc<Semaphore>,
    slots: Mutex<Vec<Slot>>,
    clock: AtomicU64,
    multiuser_cache: bool,
    /// llama-server's rule and host prompt cache, instead of Ollama's old runner's.
    prompt_cache: Option<Mutex<PromptCache>>,
    /// Idle slots' prompts are copied into `prompt_cache` when a task starts.
    cache_idle_slots: bool,
    /// The compute all slots share.
    engine: Arc<Engine>,
}

impl SlotTable {
    pub fn new(num_parallel: usize, multiuser_cache: bool, batches: BatchRule) -> Self {
        let n = num_parallel.max(1);
        SlotTable {
            permits: Arc::new(Semaphore::new(n)),
            slots: Mutex::new(vec![Slot::default(); n]),
            clock: AtomicU64::new(0),
            multiuser_cache,
            prompt_cache: None,
            cache_idle_slots: false,
            engine: Arc::new(Engine::new(batches)),
        }
    }

    /// Slots chosen as llama-server chooses them, with a host prompt cache of
    /// `cache_tokens` (see [`super::llama_server`]), and idle slots copied into it when a
    /// task starts where `cache_idle_slots`.
    pub fn llama_server(
        num_parallel: usize,
        cache_tokens: u32,
        cache_idle_slots: bool,
        batches: BatchRule,
    ) -> Self {
        SlotTable {
            prompt_cache: Some(Mutex::new(PromptCache::new(cache_tokens))),
            cache_idle_slots,
            ..SlotTable::new(num_parallel, false, batches)
        }
    }

    /// Waits for a free slot (first come, first served), then takes the best one for
    /// `prompt`. The slot holds the prompt from now on; [`SlotLease::finish`] adds the reply.
    pub async fn acquire(self: &Arc<Self>, prompt: &[u8]) -> SlotLease {
        // The semaphore is never closed; without a permit the slot search still works.
        let permit = Arc::clone(&self.permits).acquire_owned().await.ok();
        let mut slots = self.slots.lock();
        let chosen = match &self.prompt_cache {
            Some(cache) => take_slot(&mut slots, &mut cache.lock(), prompt),
            None => choose_slot(&slots, prompt, self.multiuser_cache),
        };
        let (index, common) = chosen.unwrap_or((0, 0));
        let slot = &mut slots[index];
        let free_for = slot.freed.map(|t| t.elapsed());
        slot.busy = true;
        slot.last_used = self.tick();
        slot.text = prompt.to_vec();
        if let Some(cache) = self.prompt_cache.as_ref().filter(|_| self.cache_idle_slots) {
            save_idle_slots(&slots, &mut cache.lock());
        }
        SlotLease {
            table: Arc::clone(self),
            index,
            cached_tokens: cached_tokens(common, tokens_in(prompt.len())),
            free_for,
            _permit: permit,
        }
    }

    /// Copies of the slots, for tests and diagnostics.
    #[cfg(test)]
    pub fn snapshot(&self) -> Vec<Slot> {
        self.slots.lock().clone()
    }

    fn tick(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::Relaxed) + 1
    }
}

/// A request's hold on one slot; dropping it frees the slot (also when a client disconnects
/// or the node stops mid-reply).
#[derive(Debug)]
pub struct SlotLease {
    table: Arc<SlotTable>,
    index: usize,
    cached_tokens: u32,
    /// How long the slot had been free when this request took it (`None`: never used): with
    /// requests always waiting, the handoff from the reply that freed it to this request.
    free_for: Option<Duration>,
    _permit: Option<OwnedSemaphorePermit>,
}

impl SlotLease {
    pub fn index(&self) -> usize {
        self.index
    }

    pub fn free_for(&self) -> Option<Duration> {
        self.free_for
    }

    pub fn cached_tokens(&self) -> u32 {
        self.cached_tokens
    }

    /// Puts the request's work on the model's shared compute: `prompt_tokens` to evaluate,
    /// then `output_tokens` to generate.
    pub fn run(&self, prompt_tokens: u32, output_tokens: u32) -> Run {
        self.table
            .engine
            .submit(self.index, prompt_tokens, output_tokens)
    }

    /// Records what the slot holds after generation: the prompt plus the reply as the next
    /// turn would render it.
    pub fn finish(&self, held: Vec<u8>) {
        self.table.slots.lock()[self.index].text = held;
    }
}

impl Drop for SlotLease {
    fn drop(&mut self) {
        let tick = self.table.tick();
        let mut slots = self.table.slots.lock();
        let slot = &mut slots[self.index];
        slot.busy = false;
        slot.last_used = tick;
        slot.freed = Some(Instant::now());
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::engine::Order;
    use super::*;

    fn slot(text: &str, busy: bool, last_used: u64) -> Slot {
        Slot::holding(text, busy, last_used)
    }

    #[test]
    fn longest_common_prefix_wins() {
        let slots = [
            slot("aaaabbbb", false, 1),
            slot("aaaabbbbcccc", false, 2),
            slot("zzzz", false, 0),
        ];
        assert_eq!(
            choose_slot(&slots, b"aaaabbbbccccdddd", false),
            Some((1, 3))
        );
    }

    #[test]
    fn busy_slots_are_skipped_even_with_the_best_prefix() {
        let slots = [slot("aaaabbbb", true, 1), slot("aaaa", false, 2)];
        assert_eq!(choose_slot(&slots, b"aaaabbbb", false), Some((1, 1)));
    }

    #[test]
    fn without_a_shared_token_the_least_recently_used_free_slot_is_taken() {
        let slots = [
            slot("xxxx", false, 5),
            slot("yyyy", true, 1),
            slot("zzzz", false, 3),
        ];
        assert_eq!(choose_slot(&slots, b"aaaa", false), Some((2, 0)));
    }

    #[test]
    fn a_partial_token_is_no_prefix() {
        let slots = [slot("aab", false, 5), slot("", false, 1)];
        assert_eq!(choose_slot(&slots, b"aabbcc", false), Some((1, 0)));
    }

    #[test]
    fn the_multiuser_cache_continues_whole_slots_and_otherwise_takes_the_oldest() {
        let slots = [
            slot("<|u|>aaaa", false, 5),
            slot("", false, 0),
            slot("<|u|>bbbb", false, 3),
        ];
        // A new conversation shares "<|u|>" (1 whole token) with two slots: Ollama's
        // default overwrites the first of them, the multi-user cache takes the empty
        // slot and copies the shared token there.
        assert_eq!(choose_slot(&slots, b"<|u|>cccc", false), Some((0, 1)));
        assert_eq!(choose_slot(&slots, b"<|u|>cccc", true), Some((1, 1)));
        // A continuation keeps its slot under both (9 shared bytes: 2 whole tokens).
        assert_eq!(choose_slot(&slots, b"<|u|>bbbbREPLY", true), Some((2, 2)));
        assert_eq!(choose_slot(&slots, b"<|u|>bbbbREPLY", false), Some((2, 2)));
    }

    #[test]
    fn all_busy_means_no_slot() {
        let slots = [slot("a", true, 0), slot("b", true, 0)];
        assert_eq!(choose_slot(&slots, b"a", false), None);
    }

    #[test]
    fn at_least_one_prompt_token_is_evaluated() {
        assert_eq!(cached_tokens(10, 10), 9);
        assert_eq!(cached_tokens(12, 10), 9);
        assert_eq!(cached_tokens(4, 10), 4);
        assert_eq!(cached_tokens(0, 0), 0);
    }

    fn batches() -> BatchRule {
        BatchRule {
            order: Order::DecodeFirst,
            batch_tokens: 512,
            prefill_per_token: Duration::ZERO,
            decode_per_token: Duration::ZERO,
        }
    }

    #[tokio::test]
    async fn leases_hold_the_prompt_and_release_the_slot() {
        let table = Arc::new(SlotTable::new(2, false, batches()));
        let lease = table.acquire(b"aaaabbbb").await;
        assert_eq!((lease.index(), lease.cached_tokens()), (0, 0));
        lease.finish(b"aaaabbbbREPLY".to_vec());
        drop(lease);

        let again = table.acquire(b"aaaabbbbREPLYmore").await;
        assert_eq!((again.index(), again.cached_tokens()), (0, 3));
        let other = table.acquire(b"qqqq").await;
        assert_eq!(other.index(), 1);
        assert!(table.snapshot().iter().all(|s| s.busy));
    }

    #[tokio::test]
    async fn idle_slots_are_copied_into_the_host_cache_only_with_cache_idle_slots() {
        for copies in [true, false] {
            let table = Arc::new(SlotTable::llama_server(2, 100_000, copies, batches()));
            let first = table.acquire(b"aaaabbbbcccc").await;
            first.finish(b"aaaabbbbccccREPLY".to_vec());
            drop(first);
            // A task starts on the other slot while the first one is idle.
            let _second = table.acquire(b"qqqqrrrr").await;
            let cached = table.prompt_cache.as_ref().map(|c| c.lock().len());
            assert_eq!(cached, Some(usize::from(copies)), "copies: {copies}");
        }
    }

    #[tokio::test]
    async fn a_full_table_queues_until_a_slot_frees() {
        let table = Arc::new(SlotTable::new(1, false, batches()));
        let first = table.acquire(b"aaaa").await;
        let waiter = {
            let table = Arc::clone(&table);
            tokio::spawn(async move { table.acquire(b"aaaabbbb").await.cached_tokens() })
        };
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        drop(first);
        assert_eq!(waiter.await.ok(), Some(1));
    }
}
