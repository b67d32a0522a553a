//! The affinity table with a million conversations in it: lookup (hit and miss) and insert
//! (which evicts the least recently used entry once the table is full), and the memory one
//! tracked conversation costs. Goal of issue 4: 1M conversations in under 200 MB.
//!
//! How many entries a conversation holds: the router inserts the deepest prefix of every
//! turn and refreshes the first boundary (`Router::commit`), and looks up the previous turn's
//! prefix on the next turn. So a conversation in progress keeps two live entries (its latest
//! prefix and its first boundary); the prefixes of its older turns stay until they expire or
//! are the least recently used, which they are first.

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::Duration;

use corral::routing::{AffinityTable, Entry};
use criterion::{BenchmarkId, Criterion};

/// Counts the bytes the program holds, so the table's memory can be measured exactly.
struct Counting;

static HELD: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        HELD.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the layout is passed through unchanged.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        HELD.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the pointer came from `alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const CONVERSATIONS: u64 = 1_000_000;
/// Live entries per conversation in progress (see the module docs).
const ENTRIES_PER_CONVERSATION: u64 = 2;

/// Spreads small integers over the hash space, as prefix hashes are.
fn key(i: u64) -> u64 {
    twox_hash::XxHash3_64::oneshot(&i.to_le_bytes())
}

fn entry(i: u64) -> Entry {
    Entry {
        node: (i % 16) as u16,
        lineage: i,
    }
}

/// A table holding `entries` entries, in a table of exactly that capacity.
fn filled(entries: u64) -> AffinityTable {
    let table = AffinityTable::new(entries as usize, Duration::from_secs(300));
    for i in 0..entries {
        table.insert(key(i), entry(i));
    }
    table
}

/// Resident set size of the process, in bytes (Linux).
fn rss() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

/// Prints the memory a million tracked conversations take, measured two ways: bytes the
/// table allocated, and growth of the resident set (which adds the allocator's overhead).
fn memory_report() {
    let entries = CONVERSATIONS * ENTRIES_PER_CONVERSATION;
    let (held_before, rss_before) = (HELD.load(Ordering::Relaxed), rss());
    let table = filled(entries);
    let held = (HELD.load(Ordering::Relaxed) - held_before).max(0) as f64;
    let rss_growth = match (rss(), rss_before) {
        (Some(after), Some(before)) => after.saturating_sub(before) as f64,
        _ => f64::NAN,
    };
    // The table is sharded, each shard with an equal part of the capacity: a shard that
    // receives more than its part evicts, so slightly fewer than `entries` stay.
    let kept = table.len() as f64;
    let mb = |b: f64| b / 1e6;
    println!(
        "affinity memory: {} conversations x {ENTRIES_PER_CONVERSATION} entries, capacity \
         {entries}, {kept} entries kept: {:.1} MB allocated ({:.1} bytes/entry, \
         {:.1} bytes/conversation), resident set grew {:.1} MB ({:.1} bytes/conversation)",
        CONVERSATIONS,
        mb(held),
        held / kept,
        held / CONVERSATIONS as f64,
        mb(rss_growth),
        rss_growth / CONVERSATIONS as f64,
    );
    drop(black_box(table));
}

fn lookups_and_inserts(c: &mut Criterion) {
    let table = filled(CONVERSATIONS);
    let mut group = c.benchmark_group("affinity_1M");
    let mut i = 0u64;
    group.bench_function(BenchmarkId::from_parameter("get_hit"), |b| {
        b.iter(|| {
            i = (i + 7919) % CONVERSATIONS;
            table.peek(black_box(key(i)))
        })
    });
    let mut miss = CONVERSATIONS * 10;
    group.bench_function(BenchmarkId::from_parameter("get_miss"), |b| {
        b.iter(|| {
            miss += 1;
            table.peek(black_box(key(miss)))
        })
    });
    // Inserting new prefixes into the full table: each one evicts the oldest entry.
    let mut next = CONVERSATIONS;
    group.bench_function(BenchmarkId::from_parameter("insert_evicting"), |b| {
        b.iter(|| {
            next += 1;
            table.insert(black_box(key(next)), entry(next));
        })
    });
    group.finish();
}

fn main() {
    memory_report();
    let mut criterion = Criterion::default().configure_from_args();
    lookups_and_inserts(&mut criterion);
    criterion.final_summary();
}
