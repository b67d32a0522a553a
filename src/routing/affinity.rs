//! Which node holds which conversation prefix: a bounded, expiring table from prefix hash to
//! the node and slot lineage that served it.
//!
//! An entry alone does not prove the prefix is still warm: the node may have given the slot
//! to another conversation, or unloaded the model. The router checks the entry against the
//! node's slots (see [`super::Router`]) and drops it when it no longer holds.

use std::num::NonZeroUsize;
use std::time::{Duration, Instant};

use lru::LruCache;
use parking_lot::Mutex;

/// Shards keep lock contention low; prefix hashes are uniform, so any bits pick a shard.
const SHARDS: usize = 16;

/// Where a prefix was last served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    /// Index of the node in the fleet.
    pub node: u16,
    /// The slot lineage (one conversation's run of turns in one slot) holding the prefix.
    pub lineage: u64,
}

#[derive(Clone, Copy)]
struct Stamped {
    entry: Entry,
    /// Seconds since the table's epoch at the last use: 4 bytes instead of an Instant's 16.
    used_at: u32,
}

pub struct AffinityTable {
    shards: Vec<Mutex<LruCache<u64, Stamped>>>,
    ttl: Duration,
    epoch: Instant,
}

impl AffinityTable {
    pub fn new(capacity: usize, ttl: Duration) -> AffinityTable {
        let per_shard =
            NonZeroUsize::new(capacity.div_ceil(SHARDS).max(1)).unwrap_or(NonZeroUsize::MIN);
        AffinityTable {
            shards: (0..SHARDS)
                .map(|_| Mutex::new(LruCache::new(per_shard)))
                .collect(),
            ttl,
            epoch: Instant::now(),
        }
    }

    fn shard(&self, hash: u64) -> &Mutex<LruCache<u64, Stamped>> {
        &self.shards[(hash % SHARDS as u64) as usize]
    }

    fn now(&self) -> u32 {
        self.epoch.elapsed().as_secs().min(u64::from(u32::MAX)) as u32
    }

    /// The entry for a prefix, unless it expired. Reads only: deciding changes no state.
    pub fn peek(&self, hash: u64) -> Option<Entry> {
        let shard = self.shard(hash).lock();
        let stamped = shard.peek(&hash)?;
        (!self.expired(stamped)).then_some(stamped.entry)
    }

    /// Marks the prefix's entry used by a decision, so that it is evicted last; drops it
    /// where it expired.
    pub fn touch(&self, hash: u64) {
        let mut shard = self.shard(hash).lock();
        match shard.peek(&hash) {
            Some(stamped) if self.expired(stamped) => {
                shard.pop(&hash);
            }
            Some(_) => {
                shard.promote(&hash);
            }
            None => {}
        }
    }

    fn expired(&self, stamped: &Stamped) -> bool {
        u64::from(self.now().saturating_sub(stamped.used_at)) > self.ttl.as_secs()
    }

    pub fn insert(&self, hash: u64, entry: Entry) {
        let used_at = self.now();
        self.shard(hash)
            .lock()
            .put(hash, Stamped { entry, used_at });
    }

    pub fn remove(&self, hash: u64) {
        self.shard(hash).lock().pop(&hash);
    }

    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn ttl(&self) -> Duration {
        self.ttl
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(node: u16) -> Entry {
        Entry { node, lineage: 1 }
    }

    #[test]
    fn stores_and_forgets() {
        let t = AffinityTable::new(100, Duration::from_secs(60));
        t.insert(5, e(2));
        assert_eq!(t.peek(5), Some(e(2)));
        t.remove(5);
        assert_eq!(t.peek(5), None);
        assert!(t.is_empty());
    }

    #[test]
    fn bounded_by_capacity() {
        let t = AffinityTable::new(SHARDS * 4, Duration::from_secs(60));
        for h in 0..1000u64 {
            t.insert(h, e(0));
        }
        assert_eq!(t.len(), SHARDS * 4);
        // The most recent survive.
        assert!(t.peek(999).is_some());
        assert!(t.peek(0).is_none());
        // A prefix a decision used is evicted last; one only read is not kept.
        let oldest_in_shard = |k: u64| {
            (0..1000u64)
                .filter(|h| h % SHARDS as u64 == k % SHARDS as u64)
                .find(|&h| t.peek(h).is_some())
        };
        let (used, read) = (oldest_in_shard(0).unwrap(), oldest_in_shard(1).unwrap());
        t.touch(used);
        assert!(t.peek(read).is_some());
        // One more entry in each of the two shards evicts its least recently used.
        let next = 100 * SHARDS as u64;
        t.insert(used + next, e(0));
        t.insert(read + next, e(0));
        assert!(t.peek(used).is_some(), "touched: kept");
        assert!(t.peek(read).is_none(), "only read: evicted");
    }

    #[test]
    fn expires_after_ttl() {
        let t = AffinityTable::new(10, Duration::ZERO);
        t.insert(1, e(0));
        std::thread::sleep(Duration::from_millis(1100));
        assert_eq!(t.peek(1), None);
        assert_eq!(t.len(), 1, "reading changes nothing");
        t.touch(1);
        assert!(t.is_empty());
    }
}
