//! One replica's link to the store: the leases and waits the request path takes, and the
//! events it queues for the background task ([`super::sync`]) to send.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use arc_swap::ArcSwapOption;
use prometheus::{HistogramVec, IntCounterVec};
use redis::aio::ConnectionManager;
use tokio::sync::mpsc;

use crate::config::SharedStateConfig;

use super::event::{Ended, Event, Sent};
use super::store;

/// One replica's link to the store.
pub struct Shared {
    pub(super) replica: u64,
    pub(super) config: SharedStateConfig,
    pub(super) keys: store::Keys,
    pub(super) client: redis::Client,
    pub(super) scripts: store::Scripts,
    /// Set once connected; the manager reconnects on its own after that.
    pub(super) conn: ArcSwapOption<ConnectionManager>,
    pub(super) outbox: mpsc::UnboundedSender<Outgoing>,
    pub(super) inbox: parking_lot::Mutex<Option<mpsc::UnboundedReceiver<Outgoing>>>,
    /// Requests whose `Sent` went out and whose `Ended` did not yet, for the beat's `Alive`.
    /// Held while queueing either, so the channel carries them in the order of this set.
    pub(super) published: parking_lot::Mutex<HashSet<u64>>,
    /// Leases held, by run: their key, renewed every beat.
    pub(super) leases: parking_lot::Mutex<hashbrown::HashMap<u64, String>>,
    /// Requests entered among the waiters of the node they wait for, renewed every beat until
    /// they leave.
    pub(super) waiting: parking_lot::Mutex<hashbrown::HashMap<u64, Entered>>,
    /// A request began or stopped waiting for a node: the background task tells the other
    /// replicas what waits now ([`super::Waits`]).
    pub(super) waits_changed: tokio::sync::Notify,
    pub(super) next_run: AtomicU64,
}

/// A node's slots of one model, `limit` of them: what a lease is taken of.
pub struct Slots<'a> {
    pub node: &'a str,
    pub model: &'a str,
    pub limit: usize,
}

/// Where a waiting request is entered among the waiters, and as whose, of what rank.
#[derive(Clone, PartialEq)]
pub(super) struct Entered {
    pub(super) keys: store::WaiterKeys,
    pub(super) client: String,
    pub(super) rank: f64,
}

/// What the background task sends for the request path.
pub(super) enum Outgoing {
    Publish(Event),
    /// Enters a request among a node's waiters, or updates its rank.
    Enter(Entered, String, u64),
    /// Takes a request off a node's waiters.
    Leave(store::WaiterKeys, String),
    /// Gives a lease back (key, member).
    Release(String, String),
}

/// How taking a slot's lease went.
#[derive(Debug, PartialEq, Eq)]
pub enum Acquired {
    /// The lease is this request's until it ends.
    Granted,
    /// Every slot is held, by these requests (replica, run).
    Full(Vec<(u64, u64)>),
    /// The store did not answer in time, or failed: decide alone.
    Alone,
}

impl Shared {
    pub fn new(config: &SharedStateConfig) -> Result<Arc<Shared>, String> {
        let client = redis::Client::open(config.url.as_str())
            .map_err(|e| format!("shared_state.url: {e}"))?;
        let (outbox, inbox) = mpsc::unbounded_channel();
        // Registered now, at startup, rather than on a request's path.
        metrics();
        Ok(Arc::new(Shared {
            replica: replica_id(),
            config: config.clone(),
            keys: store::Keys::new(&config.key_prefix),
            client,
            scripts: store::Scripts::default(),
            conn: ArcSwapOption::empty(),
            outbox,
            inbox: parking_lot::Mutex::new(Some(inbox)),
            published: parking_lot::Mutex::default(),
            leases: parking_lot::Mutex::default(),
            waiting: parking_lot::Mutex::default(),
            waits_changed: tokio::sync::Notify::new(),
            next_run: AtomicU64::new(1),
        }))
    }

    /// This replica's id, random per process.
    pub fn replica(&self) -> u64 {
        self.replica
    }

    /// Where this replica numbers its conversation lines from, so that lines of different
    /// replicas never share a number in anyone's books.
    pub fn lineage_base(&self) -> u64 {
        (self.replica & 0x3f_ffff) << 40
    }

    /// A request about to go to `node`: takes a lease of one of its `limit` slots for `model`,
    /// unless requests that rank before it (`rank`: its place in the fair order between
    /// clients, lower first) wait for one, in any replica; then `request` (this replica's
    /// number for the request, the same on every try) is entered among the node's waiters,
    /// until it is granted a lease or [`Shared::unwait`]. Waits at most `shared_state.timeout`;
    /// the returned run gives the lease back when dropped, and tells the other replicas where
    /// the request went ([`Run::sent`]).
    pub async fn acquire(
        self: &Arc<Self>,
        slots: Slots<'_>,
        client: Option<String>,
        request: u64,
        rank: f64,
    ) -> (Run, Acquired) {
        let Slots { node, model, limit } = slots;
        let who = client.clone().unwrap_or_default();
        let id = self.next_run.fetch_add(1, Ordering::Relaxed);
        let mut run = Run {
            shared: self.clone(),
            id,
            lease: None,
            sent: None,
            kept: true,
            client,
        };
        let Some(conn) = self.conn.load_full() else {
            metrics().errors.with_label_values(&["not_connected"]).inc();
            return (run, Acquired::Alone);
        };
        let key = self.keys.slots(node, model);
        let member = store::member(self.replica, id);
        // Listed as held before the call, so that a concurrent call of this replica for the
        // same key does not take the lease this one may be granted for one given back.
        let live: Vec<String> = {
            let mut leases = self.leases.lock();
            leases.insert(id, key.clone());
            (leases.iter())
                .filter(|(_, k)| **k == key)
                .map(|(run, _)| store::member(self.replica, *run))
                .collect()
        };
        let waiters = self.keys.waiters(node, model);
        let waiter = store::waiter(self.replica, request);
        let rank = if rank.is_finite() { rank } else { f64::MAX };
        let started = Instant::now();
        let call = async {
            let mut conn = (*conn).clone();
            let mut invocation = self.scripts.acquire.key(&key);
            (invocation.key(&waiters.rank))
                .key(&waiters.until)
                .key(&waiters.client)
                .key(self.keys.ranks());
            invocation.arg(&member).arg(limit).arg(self.lease_ms());
            invocation.arg(store::member_prefix(self.replica));
            invocation
                .arg(&waiter)
                .arg(rank)
                .arg(&who)
                .arg(self.waiter_ms());
            invocation.arg(&live);
            invocation.invoke_async::<Vec<String>>(&mut conn).await
        };
        let reply = tokio::time::timeout(self.config.timeout, call).await;
        metrics()
            .seconds
            .with_label_values(&["acquire"])
            .observe(started.elapsed().as_secs_f64());
        let failed = |kind: &str| {
            self.leases.lock().remove(&id);
            metrics().errors.with_label_values(&[kind]).inc();
            // The script may yet run: give back what it would take.
            let _ = self
                .outbox
                .send(Outgoing::Release(key.clone(), member.clone()));
        };
        let reply = match reply {
            Ok(Ok(reply)) => reply,
            Ok(Err(e)) => {
                log::debug!("shared state: acquire failed: {e}");
                failed(error_kind(&e));
                return (run, Acquired::Alone);
            }
            Err(_) => {
                failed("timeout");
                return (run, Acquired::Alone);
            }
        };
        match store::Reply::parse(&reply) {
            Some(store::Reply::Granted) => {
                run.lease = Some(key);
                // The script took it off this node's waiters; off another's too.
                let before = self.set_waiting(request, None);
                if let Some(before) = before.filter(|e| e.keys != waiters) {
                    self.leave(before.keys, waiter);
                }
                (run, Acquired::Granted)
            }
            Some(store::Reply::Full(holders)) => {
                self.leases.lock().remove(&id);
                let entered = Entered {
                    keys: waiters.clone(),
                    client: who,
                    rank,
                };
                // The script entered it there (or updated its rank); off another node's.
                let before = self.set_waiting(request, Some(entered));
                if let Some(before) = before.filter(|e| e.keys != waiters) {
                    self.leave(before.keys, waiter);
                }
                (run, Acquired::Full(holders))
            }
            None => {
                failed("reply");
                (run, Acquired::Alone)
            }
        }
    }

    /// `request`, of `client` and rank `rank`, waits for `node`'s slot of `model`: it is entered
    /// among that node's waiters (and taken off any other's), so that every replica's
    /// requests for the slot give it way when it ranks before them.
    pub fn waits_for(
        &self,
        request: u64,
        (node, model): (&str, &str),
        client: Option<String>,
        rank: f64,
    ) {
        let entered = Entered {
            keys: self.keys.waiters(node, model),
            client: client.unwrap_or_default(),
            rank: if rank.is_finite() { rank } else { f64::MAX },
        };
        let before = self.set_waiting(request, Some(entered.clone()));
        if before.as_ref() == Some(&entered) {
            return;
        }
        let waiter = store::waiter(self.replica, request);
        if let Some(before) = before.filter(|e| e.keys != entered.keys) {
            self.leave(before.keys, waiter.clone());
        }
        let _ = (self.outbox).send(Outgoing::Enter(entered, waiter, self.waiter_ms()));
    }

    /// `request` waits no more (it ended, or goes on without a lease): off the waiters.
    pub fn unwait(&self, request: u64) {
        if let Some(entered) = self.set_waiting(request, None) {
            self.leave(entered.keys, store::waiter(self.replica, request));
        }
    }

    /// Records the node `request` waits for now (`None`: none) and returns where it waited
    /// before. When that node changed, the background task tells the other replicas what
    /// waits here ([`super::Waits`]); a new rank at the same node changes no count.
    fn set_waiting(&self, request: u64, entered: Option<Entered>) -> Option<Entered> {
        let mut waiting = self.waiting.lock();
        let before = match entered {
            Some(entered) => waiting.insert(request, entered),
            None => waiting.remove(&request),
        };
        let moved = before.as_ref().map(|e| &e.keys) != waiting.get(&request).map(|e| &e.keys);
        drop(waiting);
        if moved {
            self.waits_changed.notify_one();
        }
        before
    }

    fn leave(&self, keys: store::WaiterKeys, waiter: String) {
        let _ = self.outbox.send(Outgoing::Leave(keys, waiter));
    }

    /// How long a waiter's entry lasts unless renewed: two beats, so that one late beat does
    /// not drop it, and a dead replica's waiters hold no slot back for long.
    pub(super) fn waiter_ms(&self) -> u64 {
        u64::try_from((self.beat() * 2).as_millis()).unwrap_or(u64::MAX)
    }

    pub(super) fn lease_ms(&self) -> u64 {
        u64::try_from(self.config.lease.as_millis()).unwrap_or(u64::MAX)
    }

    /// The time between beats: leases are renewed, `Alive` sent, facts written.
    pub(super) fn beat(&self) -> Duration {
        (self.config.lease / 4).clamp(Duration::from_millis(250), Duration::from_secs(2))
    }

    pub(super) fn publish(&self, event: Event) {
        let _ = self.outbox.send(Outgoing::Publish(event));
    }
}

/// A request's place in the shared books, from taking its lease to its end. Dropping it gives
/// the lease back and tells the other replicas the request ended.
pub struct Run {
    shared: Arc<Shared>,
    id: u64,
    lease: Option<String>,
    /// When the request took its slot on the node, once it did.
    sent: Option<Instant>,
    kept: bool,
    /// Whose request it is ([`crate::fleet::ClientId::wire`]).
    client: Option<String>,
}

impl Run {
    /// Tells the other replicas the request reached its node and took a slot there.
    pub fn sent(&mut self, mut sent: Sent) {
        sent.replica = self.shared.replica;
        sent.run = self.id;
        sent.client.clone_from(&self.client);
        let mut published = self.shared.published.lock();
        published.insert(self.id);
        self.shared.publish(Event::Sent(sent));
        self.sent = Some(Instant::now());
    }

    /// The request failed before any reply: its slot holds nothing known.
    pub fn abandoned(&mut self) {
        self.kept = false;
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        let shared = &self.shared;
        if let Some(key) = self.lease.take() {
            shared.leases.lock().remove(&self.id);
            let member = store::member(shared.replica, self.id);
            let _ = shared.outbox.send(Outgoing::Release(key, member));
        }
        if let Some(sent) = self.sent {
            let mut published = shared.published.lock();
            published.remove(&self.id);
            shared.publish(Event::Ended(Ended {
                replica: shared.replica,
                run: self.id,
                kept: self.kept,
                client: self.client.take(),
                held_s: sent.elapsed().as_secs_f64(),
            }));
        }
    }
}

/// The `kind` label of `corral_shared_state_errors_total` for a store error.
pub(super) fn error_kind(e: &redis::RedisError) -> &'static str {
    if e.is_timeout() {
        "timeout"
    } else if e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() {
        "connection"
    } else {
        "reply"
    }
}

/// A replica id: random per process (std's hasher is seeded at random), never 0.
fn replica_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    h.finish().max(1)
}

pub struct StoreMetrics {
    /// `corral_shared_state_errors_total{kind}`.
    pub errors: IntCounterVec,
    /// `corral_shared_state_seconds{op}`: time the request path waited on the store.
    pub seconds: HistogramVec,
}

/// Registered once per process, on first use (only replicas with a store use them).
pub fn metrics() -> &'static StoreMetrics {
    static METRICS: OnceLock<StoreMetrics> = OnceLock::new();
    METRICS.get_or_init(|| {
        let errors = IntCounterVec::new(
            prometheus::Opts::new(
                "corral_shared_state_errors_total",
                "Store calls that failed or ran past shared_state.timeout; the replica decided alone",
            ),
            &["kind"],
        )
        .expect("valid metric");
        let seconds = HistogramVec::new(
            prometheus::HistogramOpts::new(
                "corral_shared_state_seconds",
                "Time a request waited on the shared store",
            )
            .buckets(vec![
                0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05,
            ]),
            &["op"],
        )
        .expect("valid metric");
        // Every kind at 0 from the start, so that a rate over them reads 0, not "no data".
        for kind in [
            "not_connected",
            "timeout",
            "connection",
            "reply",
            "subscription",
        ] {
            errors.with_label_values(&[kind]);
        }
        // A second registry (tests build several routers in one process) keeps the first.
        let _ = prometheus::register(Box::new(errors.clone()));
        let _ = prometheus::register(Box::new(seconds.clone()));
        StoreMetrics { errors, seconds }
    })
}
