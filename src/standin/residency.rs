//! Which models are resident, and what it takes for a request to get one: the part of
//! Ollama's scheduler that the router's "model loaded" and "memory fit" signals predict.
//!
//! A request first tries the fast path (model resident with the wanted context length). If
//! that fails it queues on the node's single loader, as Ollama loads one model at a time:
//! behind the lock it either finds that someone else just loaded the model (it waited for a
//! load, so it counts as cold) or evicts idle models until the new one fits, then loads it.
//! Models unload lazily once idle for longer than their keep-alive.
//!
//! The victim is chosen as Ollama's scheduler chooses it (`server/sched.go`,
//! `findRunnerToUnload` with `ByDurationAndName`, read at ollama/ollama fb30760, 2026-08):
//! loaded models sorted by keep-alive, shortest first, then by model path (the blob's
//! digest); the first idle one goes. Not the least recently used. When none is idle,
//! Ollama marks the first to unload once its requests end and waits; the stand-in waits
//! for any model to go idle and chooses again, which differs only when several are busy.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::Notify;

use super::catalog::digest;
use super::config::{GIB, StandinConfig, StandinModel};
use super::error::StandinError;
use super::slots::SlotTable;

/// How long a model stays resident after its last use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeepAlive {
    For(Duration),
    Forever,
}

/// One resident (or loading) model.
#[derive(Debug)]
pub struct Resident {
    pub model: StandinModel,
    /// Context length the model is loaded with.
    pub context: u32,
    /// False while loading: the memory is taken but requests cannot use it yet.
    pub ready: bool,
    /// Requests holding or waiting for one of its slots; only models without users are evicted.
    pub users: usize,
    pub last_used: Instant,
    pub keep_alive: KeepAlive,
    pub slots: Arc<SlotTable>,
    /// Distinguishes successive loads of the same model, so a stale lease cannot touch a
    /// newer instance.
    pub instance: u64,
}

impl Resident {
    /// When the model unloads if nobody uses it again; `None` means never.
    pub fn expires_at(&self) -> Option<Instant> {
        match self.keep_alive {
            // A keep-alive too long for the clock is forever.
            KeepAlive::For(d) => self.last_used.checked_add(d),
            KeepAlive::Forever => None,
        }
    }

    fn idle(&self) -> bool {
        self.ready && self.users == 0
    }
}

/// What a request for a model needs to know about residency.
#[derive(Clone, Debug)]
pub struct Want {
    pub model: StandinModel,
    pub context: u32,
    pub keep_alive: KeepAlive,
}

/// The resident models of one node.
#[derive(Debug)]
pub struct Residency {
    cfg: StandinConfig,
    resident: Mutex<Vec<Resident>>,
    /// Serialises loads, as Ollama's scheduler does.
    loader: tokio::sync::Mutex<()>,
    /// Signalled whenever a model loses a user, so a waiting load can re-check memory.
    released: Notify,
    next_instance: Mutex<u64>,
    counters: Counters,
}

/// How often models came and went, for benchmarks: every load, every eviction to make room,
/// and every unload at the end of a keep-alive.
#[derive(Debug, Default)]
struct Counters {
    loads: AtomicU64,
    evictions: AtomicU64,
    expirations: AtomicU64,
}

/// A snapshot of a node's model churn since it started (preloads are not counted).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ChurnCounts {
    /// Models loaded for a request.
    pub loads: u64,
    /// Idle models unloaded to make room for another.
    pub evictions: u64,
    /// Idle models unloaded because their keep-alive ran out.
    pub expirations: u64,
}

/// A request's claim on a resident model; while it lives the model is not evicted.
#[derive(Debug)]
pub struct ModelLease {
    residency: Arc<Residency>,
    name: String,
    instance: u64,
    pub slots: Arc<SlotTable>,
    pub context: u32,
    /// This request loaded the model or waited for its load.
    pub cold_load: bool,
    /// Time spent getting the model resident.
    pub load_duration: Duration,
}

/// Outcome of one planning step under the residency lock.
enum Plan {
    Ready(ModelLease),
    Load(LoadingGuard),
    Wait,
}

impl Residency {
    /// Residency with the configured models preloaded. Fails if a preloaded model is not on
    /// disk or the preloaded models do not fit together.
    pub fn new(cfg: StandinConfig) -> Result<Arc<Self>, StandinError> {
        let residency = Arc::new(Residency {
            resident: Mutex::new(Vec::new()),
            loader: tokio::sync::Mutex::new(()),
            released: Notify::new(),
            next_instance: Mutex::new(0),
            counters: Counters::default(),
            cfg,
        });
        for name in &residency.cfg.preload {
            residency.preload(name)?;
        }
        Ok(residency)
    }

    fn preload(&self, name: &str) -> Result<(), StandinError> {
        let model = self
            .cfg
            .model(name)
            .cloned()
            .ok_or_else(|| StandinError::model_not_found(name))?;
        let mut resident = self.resident.lock();
        let used: u64 = resident.iter().map(|r| r.model.size_bytes).sum();
        if used + model.size_bytes > self.cfg.memory_bytes {
            return Err(self.too_big(&model));
        }
        let context = model.context_length;
        let keep_alive = KeepAlive::For(self.cfg.keep_alive);
        resident.push(self.new_resident(model, context, true, keep_alive));
        Ok(())
    }

    /// Gets `want.model` resident with `want.context`, loading it if needed, and claims it.
    pub async fn acquire(self: &Arc<Self>, want: &Want) -> Result<ModelLease, StandinError> {
        if want.model.size_bytes > self.cfg.memory_bytes {
            return Err(self.too_big(&want.model));
        }
        if let Some(lease) = self.claim_ready(want, false, Duration::ZERO) {
            return Ok(lease);
        }
        let started = Instant::now();
        let _loader = self.loader.lock().await;
        let loading = loop {
            let released = self.released.notified();
            tokio::pin!(released);
            released.as_mut().enable();
            match self.plan_load(want, started) {
                Plan::Ready(lease) => return Ok(lease),
                Plan::Load(guard) => break guard,
                Plan::Wait => released.await,
            }
        };
        tokio::time::sleep(self.cfg.load_time).await;
        loading.complete(started.elapsed())
    }

    /// The fast path: claim the model if it is ready with the wanted context.
    fn claim_ready(
        self: &Arc<Self>,
        want: &Want,
        cold_load: bool,
        load_duration: Duration,
    ) -> Option<ModelLease> {
        let mut resident = self.resident.lock();
        self.expire_idle(&mut resident);
        let r = resident
            .iter_mut()
            .find(|r| r.ready && r.model.name == want.model.name && r.context == want.context)?;
        r.users += 1;
        r.last_used = Instant::now();
        r.keep_alive = want.keep_alive;
        Some(self.lease(r, cold_load, load_duration))
    }

    /// Under the loader lock: either the model became ready meanwhile, or make room and
    /// reserve its memory, or wait for busy models to go idle.
    fn plan_load(self: &Arc<Self>, want: &Want, started: Instant) -> Plan {
        if let Some(lease) = self.claim_ready(want, true, started.elapsed()) {
            return Plan::Ready(lease);
        }
        let mut resident = self.resident.lock();
        if let Some(pos) = resident
            .iter()
            .position(|r| r.model.name == want.model.name)
        {
            // Loaded with another context length: reload once its requests are done.
            if !resident[pos].idle() {
                return Plan::Wait;
            }
            resident.remove(pos);
        }
        if !self.make_room(&mut resident, want.model.size_bytes) {
            return Plan::Wait;
        }
        let entry = self.new_resident(want.model.clone(), want.context, false, want.keep_alive);
        let instance = entry.instance;
        resident.push(entry);
        Plan::Load(LoadingGuard {
            residency: Arc::clone(self),
            name: want.model.name.clone(),
            instance,
            done: false,
        })
    }

    /// Evicts idle models, in Ollama's order ([`victim`]), until `size` more bytes fit.
    /// Evicts nothing and returns false when even evicting every idle model would not be
    /// enough.
    fn make_room(&self, resident: &mut Vec<Resident>, size: u64) -> bool {
        let used: u64 = resident.iter().map(|r| r.model.size_bytes).sum();
        let idle: u64 = resident
            .iter()
            .filter(|r| r.idle())
            .map(|r| r.model.size_bytes)
            .sum();
        if used - idle + size > self.cfg.memory_bytes {
            return false;
        }
        let mut used = used;
        while used + size > self.cfg.memory_bytes {
            let Some(victim) = victim(resident) else {
                return false;
            };
            let evicted = resident.remove(victim);
            self.counters.evictions.fetch_add(1, Ordering::Relaxed);
            log::debug!("{}: evicting {}", self.cfg.name, evicted.model.name);
            used -= evicted.model.size_bytes;
        }
        true
    }

    /// Unloads idle models whose keep-alive has run out: checked lazily, on each request and
    /// each listing, instead of with timers.
    fn expire_idle(&self, resident: &mut Vec<Resident>) {
        let now = Instant::now();
        resident.retain(|r| {
            let expired = r.idle() && r.expires_at().is_some_and(|at| at <= now);
            if expired {
                self.counters.expirations.fetch_add(1, Ordering::Relaxed);
                log::debug!("{}: {} expired", self.cfg.name, r.model.name);
            }
            !expired
        });
    }

    /// Unloads a model now, or as soon as its requests are done if it is busy (a request
    /// with `keep_alive: 0` and nothing to generate).
    pub fn unload(&self, name: &str) {
        let mut resident = self.resident.lock();
        for r in resident.iter_mut().filter(|r| r.model.name == name) {
            r.keep_alive = KeepAlive::For(Duration::ZERO);
        }
        resident.retain(|r| !(r.model.name == name && r.idle()));
    }

    /// Loads, evictions and keep-alive unloads so far.
    pub fn churn(&self) -> ChurnCounts {
        let c = &self.counters;
        ChurnCounts {
            loads: c.loads.load(Ordering::Relaxed),
            evictions: c.evictions.load(Ordering::Relaxed),
            expirations: c.expirations.load(Ordering::Relaxed),
        }
    }

    /// Runs `f` over the ready models, after expiring idle ones.
    pub fn with_ready<T>(&self, f: impl FnOnce(&[&Resident]) -> T) -> T {
        let mut resident = self.resident.lock();
        self.expire_idle(&mut resident);
        let ready: Vec<&Resident> = resident.iter().filter(|r| r.ready).collect();
        f(&ready)
    }

    fn new_resident(
        &self,
        model: StandinModel,
        context: u32,
        ready: bool,
        keep_alive: KeepAlive,
    ) -> Resident {
        let mut next = self.next_instance.lock();
        *next += 1;
        let batches = self.cfg.batch_rule();
        Resident {
            model,
            context,
            ready,
            users: 0,
            last_used: Instant::now(),
            keep_alive,
            slots: Arc::new(if self.cfg.kind.is_llama_server() {
                let cfg = &self.cfg;
                SlotTable::llama_server(
                    cfg.num_parallel,
                    cfg.cache_ram_tokens,
                    cfg.cache_idle_slots,
                    batches,
                )
            } else {
                SlotTable::new(self.cfg.num_parallel, self.cfg.multiuser_cache, batches)
            }),
            instance: *next,
        }
    }

    fn lease(self: &Arc<Self>, r: &Resident, cold_load: bool, load: Duration) -> ModelLease {
        ModelLease {
            residency: Arc::clone(self),
            name: r.model.name.clone(),
            instance: r.instance,
            slots: Arc::clone(&r.slots),
            context: r.context,
            cold_load,
            load_duration: load,
        }
    }

    fn too_big(&self, model: &StandinModel) -> StandinError {
        StandinError::internal(format!(
            "model requires more system memory ({:.1} GiB) than is available ({:.1} GiB)",
            model.size_bytes as f64 / GIB as f64,
            self.cfg.memory_bytes as f64 / GIB as f64,
        ))
    }

    /// Applies `f` to the resident entry of this exact load, if it still exists.
    fn with_instance(&self, name: &str, instance: u64, f: impl FnOnce(&mut Resident)) {
        let mut resident = self.resident.lock();
        if let Some(r) = resident
            .iter_mut()
            .find(|r| r.model.name == name && r.instance == instance)
        {
            f(r);
        }
    }
}

/// The idle model Ollama unloads first to make room: the shortest keep-alive, then the
/// lowest model path (`ByDurationAndName` in `server/sched.go`; a model's path ends in its
/// blob's digest). A keep-alive of "forever" is Ollama's negative duration, which sorts
/// last as an unsigned number.
fn victim(resident: &[Resident]) -> Option<usize> {
    let duration = |r: &Resident| match r.keep_alive {
        KeepAlive::For(d) => d,
        KeepAlive::Forever => Duration::MAX,
    };
    resident
        .iter()
        .enumerate()
        .filter(|(_, r)| r.idle())
        .min_by_key(|(_, r)| (duration(r), digest(&r.model)))
        .map(|(i, _)| i)
}

impl Drop for ModelLease {
    fn drop(&mut self) {
        self.residency
            .with_instance(&self.name, self.instance, |r| {
                r.users = r.users.saturating_sub(1);
                r.last_used = Instant::now();
            });
        self.residency.released.notify_waiters();
    }
}

/// A model being loaded. If the loading request goes away (client gone, node stopped)
/// before the load completes, the reservation is dropped so the next request starts over.
struct LoadingGuard {
    residency: Arc<Residency>,
    name: String,
    instance: u64,
    done: bool,
}

impl LoadingGuard {
    /// Marks the model ready and claims it for the request that loaded it.
    fn complete(mut self, load_duration: Duration) -> Result<ModelLease, StandinError> {
        let residency = Arc::clone(&self.residency);
        let mut lease = None;
        residency.with_instance(&self.name, self.instance, |r| {
            r.ready = true;
            r.users += 1;
            r.last_used = Instant::now();
            lease = Some(residency.lease(r, true, load_duration));
        });
        self.done = lease.is_some();
        if self.done {
            residency.counters.loads.fetch_add(1, Ordering::Relaxed);
        }
        // Only this guard removes a loading entry, so the entry is always there.
        lease.ok_or_else(|| StandinError::internal("model load was interrupted".to_string()))
    }
}

impl Drop for LoadingGuard {
    fn drop(&mut self) {
        if !self.done {
            let (name, instance) = (&self.name, self.instance);
            self.residency
                .resident
                .lock()
                .retain(|r| !(r.model.name == *name && r.instance == instance));
            self.residency.released.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> StandinConfig {
        let mut cfg = StandinConfig::new("t");
        cfg.memory_bytes = 10;
        cfg.models = vec![
            StandinModel::new("a:1", 4, 100),
            StandinModel::new("b:1", 4, 100),
            StandinModel::new("c:1", 4, 100),
            StandinModel::new("huge:1", 11, 100),
        ];
        cfg.preload = vec!["a:1".into(), "b:1".into()];
        cfg.load_time = Duration::from_millis(5);
        cfg
    }

    fn want(cfg: &StandinConfig, name: &str, context: u32) -> Want {
        Want {
            model: cfg
                .model(name)
                .cloned()
                .unwrap_or_else(|| StandinModel::new(name, 0, 0)),
            context,
            keep_alive: KeepAlive::For(Duration::from_secs(60)),
        }
    }

    fn names(r: &Residency) -> Vec<String> {
        r.with_ready(|rs| rs.iter().map(|r| r.model.name.clone()).collect())
    }

    #[tokio::test]
    async fn preloaded_models_are_warm() -> Result<(), StandinError> {
        let cfg = cfg();
        let r = Residency::new(cfg.clone())?;
        let lease = r.acquire(&want(&cfg, "a:1", 100)).await?;
        assert!(!lease.cold_load);
        Ok(())
    }

    #[tokio::test]
    async fn loading_evicts_as_ollama_does_not_the_least_recently_used() -> Result<(), StandinError>
    {
        // Equal keep-alives: the lower digest goes, however recently it was used.
        let cfg = cfg();
        let digest_of = |name: &str| cfg.model(name).map(digest);
        let (first, second) = if digest_of("a:1") < digest_of("b:1") {
            ("a:1", "b:1")
        } else {
            ("b:1", "a:1")
        };
        let r = Residency::new(cfg.clone())?;
        drop(r.acquire(&want(&cfg, second, 100)).await?);
        drop(r.acquire(&want(&cfg, first, 100)).await?); // the most recently used
        let lease = r.acquire(&want(&cfg, "c:1", 100)).await?;
        assert!(lease.cold_load);
        let mut left = names(&r);
        left.sort();
        let mut expected = vec![second.to_string(), "c:1".to_string()];
        expected.sort();
        assert_eq!(left, expected, "{first} went though it was used last");
        let churn = r.churn();
        assert_eq!((churn.loads, churn.evictions, churn.expirations), (1, 1, 0));

        // A shorter keep-alive goes first, whatever the digests.
        let r = Residency::new(cfg.clone())?;
        let mut short = want(&cfg, second, 100);
        short.keep_alive = KeepAlive::For(Duration::from_secs(30));
        drop(r.acquire(&short).await?);
        drop(r.acquire(&want(&cfg, "c:1", 100)).await?);
        assert!(!names(&r).contains(&second.to_string()));
        assert!(names(&r).contains(&first.to_string()));
        Ok(())
    }

    #[tokio::test]
    async fn busy_models_are_not_evicted_the_load_waits() -> Result<(), StandinError> {
        let cfg = cfg();
        let r = Residency::new(cfg.clone())?;
        let a = r.acquire(&want(&cfg, "a:1", 100)).await?;
        let b = r.acquire(&want(&cfg, "b:1", 100)).await?;
        let loader = {
            let (r, w) = (Arc::clone(&r), want(&cfg, "c:1", 100));
            tokio::spawn(async move { r.acquire(&w).await.map(|l| l.cold_load) })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!loader.is_finished());
        drop(b);
        assert_eq!(loader.await.ok().and_then(Result::ok), Some(true));
        drop(a);
        assert_eq!(names(&r), ["a:1", "c:1"]);
        Ok(())
    }

    #[tokio::test]
    async fn a_model_bigger_than_memory_fails() -> Result<(), StandinError> {
        let cfg = cfg();
        let r = Residency::new(cfg.clone())?;
        let err = r.acquire(&want(&cfg, "huge:1", 100)).await.err();
        let msg = err.map(|e| e.message).unwrap_or_default();
        assert!(
            msg.starts_with("model requires more system memory"),
            "{msg}"
        );
        Ok(())
    }

    #[tokio::test]
    async fn another_context_length_reloads() -> Result<(), StandinError> {
        let cfg = cfg();
        let r = Residency::new(cfg.clone())?;
        let lease = r.acquire(&want(&cfg, "a:1", 50)).await?;
        assert!(lease.cold_load);
        assert_eq!(lease.context, 50);
        drop(lease);
        assert!(!r.acquire(&want(&cfg, "a:1", 50)).await?.cold_load);
        Ok(())
    }

    #[tokio::test]
    async fn idle_models_expire_after_keep_alive() -> Result<(), StandinError> {
        let cfg = cfg();
        let r = Residency::new(cfg.clone())?;
        let mut w = want(&cfg, "a:1", 100);
        w.keep_alive = KeepAlive::For(Duration::ZERO);
        drop(r.acquire(&w).await?);
        assert_eq!(names(&r), ["b:1"]);
        Ok(())
    }

    #[tokio::test]
    async fn concurrent_requests_share_one_load() -> Result<(), StandinError> {
        let cfg = StandinConfig {
            load_time: Duration::from_millis(150),
            ..cfg()
        };
        let r = Residency::new(cfg.clone())?;
        let w = want(&cfg, "c:1", 100);
        let started = Instant::now();
        let (x, y) = tokio::join!(r.acquire(&w), r.acquire(&w));
        assert!(x?.cold_load && y?.cold_load);
        assert!(started.elapsed() < Duration::from_millis(300));
        Ok(())
    }
}
