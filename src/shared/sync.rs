//! The background side of shared state: connects (and keeps connecting) to the store, sends
//! what the request path queued, listens to the other replicas, and every beat renews this
//! replica's leases, says which of its requests still run, writes what it learned of the
//! nodes, and forgets replicas gone silent.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::StreamExt;
use hashbrown::HashMap;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;
use redis::aio::ConnectionManager;
use tokio::sync::mpsc;

use super::event::{Alive, Event, Waiting, Waits};
use super::link::{Outgoing, Shared, error_kind, metrics};
use super::store;

/// What a replica's books do with the shared state (the router implements it).
pub trait Replica: Send + Sync + 'static {
    /// Applies another replica's event.
    fn apply(&self, event: Event);
    /// Forgets what `replica` said (every other replica's, for `None`): it went silent, or
    /// this replica no longer hears the store.
    fn forget(&self, replica: Option<u64>);
    /// The requests this replica has waiting, per node and model.
    fn waits(&self) -> Vec<Waiting>;
    /// What this replica learned of each node, by node name, to write to the store.
    fn facts(&self) -> Vec<(String, String)>;
    /// What the store holds of a node, written by a replica before: taken where this
    /// replica knows nothing yet.
    fn seed(&self, node: &str, facts: &str);
}

/// Longest a background call to the store may take.
const CALL: Duration = Duration::from_secs(1);
/// Reconnecting backs off from the first to the second.
const BACKOFF: (Duration, Duration) = (Duration::from_millis(100), Duration::from_secs(2));
/// Changes to this replica's waiting requests within this long go out in one [`Waits`].
const WAITS_GATHER: Duration = Duration::from_millis(5);
/// Facts written to the store expire this long after the last replica wrote them.
const FACTS_TTL_S: u64 = 24 * 3600;

pub struct Syncer {
    shared: Arc<Shared>,
    replica: Arc<dyn Replica>,
    /// When each other replica was last heard.
    heard: parking_lot::Mutex<HashMap<u64, Instant>>,
}

impl Syncer {
    pub fn new(shared: Arc<Shared>, replica: Arc<dyn Replica>) -> Syncer {
        Syncer {
            shared,
            replica,
            heard: parking_lot::Mutex::default(),
        }
    }

    async fn connect(&self, shutdown: &mut ShutdownWatch) -> Option<ConnectionManager> {
        let mut backoff = BACKOFF.0;
        loop {
            let config = redis::aio::ConnectionManagerConfig::new()
                .set_connection_timeout(Some(CALL))
                .set_response_timeout(Some(CALL))
                .set_max_delay(BACKOFF.1);
            let connecting = self
                .shared
                .client
                .get_connection_manager_with_config(config);
            match tokio::time::timeout(CALL, connecting).await {
                Ok(Ok(conn)) => return Some(conn),
                Ok(Err(e)) => log::warn!("shared state: cannot connect: {e}"),
                Err(_) => log::warn!("shared state: no connection within {CALL:?}"),
            }
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = shutdown.changed() => return None,
            }
            backoff = (backoff * 2).min(BACKOFF.1);
        }
    }

    /// Reads what other replicas wrote of the nodes.
    async fn seed(&self, conn: &mut ConnectionManager) {
        let nodes: Vec<String> = self.replica.facts().into_iter().map(|(n, _)| n).collect();
        if nodes.is_empty() {
            return;
        }
        let keys: Vec<String> = nodes.iter().map(|n| self.shared.keys.facts(n)).collect();
        let mut mget = redis::cmd("MGET");
        mget.arg(&keys);
        let read = mget.query_async::<Vec<Option<String>>>(conn);
        match tokio::time::timeout(CALL, read).await {
            Ok(Ok(values)) => {
                for (node, facts) in nodes.iter().zip(values) {
                    if let Some(facts) = facts {
                        self.replica.seed(node, &facts);
                    }
                }
            }
            Ok(Err(e)) => log::warn!("shared state: cannot read node facts: {e}"),
            Err(_) => log::warn!("shared state: node facts not read within {CALL:?}"),
        }
    }

    /// Listens to the other replicas, reconnecting when the subscription breaks. While it is
    /// broken, nothing they say arrives: their requests are forgotten, and this replica
    /// decides on its own until it hears them again.
    async fn listen(self: Arc<Self>) {
        let mut backoff = BACKOFF.0;
        let channel = self.shared.keys.events();
        loop {
            match self.shared.client.get_async_pubsub().await {
                Ok(mut pubsub) => match pubsub.subscribe(&channel).await {
                    Ok(()) => {
                        backoff = BACKOFF.0;
                        let mut messages = pubsub.on_message();
                        while let Some(message) = messages.next().await {
                            self.heard(message.get_payload_bytes());
                        }
                        log::warn!("shared state: subscription lost; deciding alone");
                    }
                    Err(e) => log::warn!("shared state: cannot subscribe: {e}"),
                },
                Err(e) => log::debug!("shared state: cannot connect to listen: {e}"),
            }
            metrics().errors.with_label_values(&["subscription"]).inc();
            self.heard.lock().clear();
            self.replica.forget(None);
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(BACKOFF.1);
        }
    }

    fn heard(&self, payload: &[u8]) {
        let event: Event = match serde_json::from_slice(payload) {
            Ok(event) => event,
            Err(e) => {
                log::debug!("shared state: an event that does not parse: {e}");
                return;
            }
        };
        let from = event.replica();
        if from == self.shared.replica {
            return;
        }
        self.heard.lock().insert(from, Instant::now());
        self.replica.apply(event);
    }

    /// Sends what the request path queued, in order, batching what queued meanwhile.
    async fn send(self: Arc<Self>, conn: ConnectionManager, mut inbox: Inbox) {
        let channel = self.shared.keys.events();
        let mut batch = Vec::new();
        while inbox.recv_many(&mut batch, 256).await > 0 {
            let mut pipe = redis::pipe();
            for outgoing in batch.drain(..) {
                match outgoing {
                    Outgoing::Publish(event) => match serde_json::to_string(&event) {
                        Ok(text) => {
                            pipe.publish(&channel, text).ignore();
                        }
                        Err(e) => log::warn!("shared state: event not sent: {e}"),
                    },
                    Outgoing::Enter(entered, waiter, ms) => {
                        let keys = &entered.keys;
                        let mut enter = redis::cmd("EVAL");
                        enter.arg(store::ENTER).arg(4);
                        enter.arg(&keys.rank).arg(&keys.until).arg(&keys.client);
                        enter.arg(self.shared.keys.ranks());
                        enter
                            .arg(waiter)
                            .arg(entered.rank)
                            .arg(&entered.client)
                            .arg(ms);
                        pipe.add_command(enter).ignore();
                    }
                    Outgoing::Leave(keys, waiter) => {
                        pipe.zrem(&keys.rank, &waiter).ignore();
                        pipe.zrem(&keys.until, &waiter).ignore();
                        pipe.hdel(&keys.client, &waiter).ignore();
                    }
                    Outgoing::Release(key, member) => {
                        pipe.zrem(key, member).ignore();
                    }
                }
            }
            let mut conn = conn.clone();
            background("send", pipe.query_async::<()>(&mut conn)).await;
        }
    }

    /// Tells the other replicas what waits here now, once the changes that come together are
    /// in: in order with this replica's `Sent` and `Ended`, through the same queue.
    async fn tell_waits(&self) {
        tokio::time::sleep(WAITS_GATHER).await;
        let shared = &self.shared;
        shared.publish(Event::Waits(Waits {
            replica: shared.replica,
            waits: self.replica.waits(),
        }));
    }

    /// Pushes back the deadlines of `entries` (key, member) by `ms`, where they still stand.
    async fn renew(&self, conn: &mut ConnectionManager, entries: &[(String, String)], ms: u64) {
        if entries.is_empty() {
            return;
        }
        let mut renew = self.shared.scripts.renew.prepare_invoke();
        renew.arg(ms);
        for (key, member) in entries {
            renew.key(key).arg(member);
        }
        background("renew", renew.invoke_async::<u64>(conn)).await;
    }

    /// One beat: renew leases and waiters, say what runs and waits, write facts, forget the
    /// silent.
    async fn beat(&self, conn: &ConnectionManager) {
        let shared = &self.shared;
        let replica = shared.replica;
        let leases: Vec<(String, String)> = (shared.leases.lock().iter())
            .map(|(run, key)| (key.clone(), store::member(replica, *run)))
            .collect();
        let waiting: Vec<(store::WaiterKeys, String)> = (shared.waiting.lock().iter())
            .map(|(request, entered)| (entered.keys.clone(), store::waiter(replica, *request)))
            .collect();
        let mut conn = conn.clone();
        self.renew(&mut conn, &leases, shared.lease_ms()).await;
        let until: Vec<(String, String)> = (waiting.iter())
            .map(|(keys, waiter)| (keys.until.clone(), waiter.clone()))
            .collect();
        self.renew(&mut conn, &until, shared.waiter_ms()).await;
        // What the others learned since (read before this replica writes its own over it):
        // taken where this replica knows nothing yet, as by a replica that starts.
        self.seed(&mut conn).await;
        let mut pipe = redis::pipe();
        let alive = {
            let published = shared.published.lock();
            Alive {
                replica: shared.replica,
                runs: published.iter().copied().collect(),
                waits: self.replica.waits(),
            }
        };
        if let Ok(text) = serde_json::to_string(&Event::Alive(alive)) {
            pipe.publish(shared.keys.events(), text).ignore();
        }
        let waiter_ms = i64::try_from(shared.waiter_ms()).unwrap_or(i64::MAX);
        for (keys, _) in &waiting {
            pipe.pexpire(&keys.rank, waiter_ms).ignore();
            pipe.pexpire(&keys.client, waiter_ms).ignore();
        }
        for (node, facts) in self.replica.facts() {
            pipe.set_ex(shared.keys.facts(&node), facts, FACTS_TTL_S)
                .ignore();
        }
        background("beat", pipe.query_async::<()>(&mut conn)).await;
        let silent: Vec<u64> = {
            let mut heard = self.heard.lock();
            let lease = shared.config.lease;
            let gone: Vec<u64> = (heard.iter())
                .filter(|(_, at)| at.elapsed() > lease)
                .map(|(replica, _)| *replica)
                .collect();
            heard.retain(|replica, _| !gone.contains(replica));
            gone
        };
        for replica in silent {
            log::info!("shared state: replica {replica:016x} went silent; forgetting it");
            self.replica.forget(Some(replica));
        }
    }
}

type Inbox = mpsc::UnboundedReceiver<Outgoing>;

/// A background call to the store, bounded by [`CALL`]: a failure or a timeout is logged and
/// counted, and the beat or the sender goes on.
async fn background<T>(what: &str, call: impl Future<Output = redis::RedisResult<T>>) {
    match tokio::time::timeout(CALL, call).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => {
            log::debug!("shared state: {what} failed: {e}");
            metrics().errors.with_label_values(&[error_kind(&e)]).inc();
        }
        Err(_) => metrics().errors.with_label_values(&["timeout"]).inc(),
    }
}

/// The background service: [`Syncer`] running for the server's life.
pub struct Service(pub Arc<Syncer>);

#[async_trait]
impl BackgroundService for Service {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let syncer = &self.0;
        let Some(inbox) = syncer.shared.inbox.lock().take() else {
            return;
        };
        let Some(mut conn) = syncer.connect(&mut shutdown).await else {
            return;
        };
        log::info!(
            "shared state: replica {:016x} connected",
            syncer.shared.replica
        );
        syncer.seed(&mut conn).await;
        // Loaded now, so that a request's first lease takes one round trip, not two. A store
        // that restarts empty has them loaded again by the first call that misses them.
        for script in [&syncer.shared.scripts.acquire, &syncer.shared.scripts.renew] {
            let loading = script.load_async(&mut conn);
            if let Ok(Err(e)) = tokio::time::timeout(CALL, loading).await {
                log::warn!("shared state: cannot load a script: {e}");
            }
        }
        syncer.shared.conn.store(Some(Arc::new(conn.clone())));
        let listening = tokio::spawn(syncer.clone().listen());
        let sending = tokio::spawn(syncer.clone().send(conn.clone(), inbox));
        let mut tick = tokio::time::interval(syncer.shared.beat());
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => syncer.beat(&conn).await,
                _ = syncer.shared.waits_changed.notified() => syncer.tell_waits().await,
                _ = shutdown.changed() => break,
            }
        }
        listening.abort();
        sending.abort();
    }
}
