//! The simulated fleet the replay runs on, and the `corral` process put in front of it.
//!
//! Every figure here is given as real hardware shows it (tokens per second, seconds to load a
//! model) and divided by the replay's time scale when the stand-in nodes are configured, so
//! the whole replay runs in minutes while keeping the ratios between nodes, prefill, decoding,
//! loads and think times that real fleets have.

use std::io::Write;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use corral::standin::{
    ChurnCounts, GIB, ServedRequest, StandinConfig, StandinKind, StandinModel, StandinNode,
};

use crate::workload::{WorkloadKind, WorkloadSpec};

/// One node, described as the hardware it stands for.
#[derive(Clone, Debug)]
pub struct NodeSpec {
    pub name: &'static str,
    /// What the node is meant to resemble, for the report.
    pub hardware: &'static str,
    pub memory_gib: u64,
    /// `OLLAMA_NUM_PARALLEL`.
    pub slots: usize,
    pub prefill_tps: f64,
    pub decode_tps: f64,
    pub load_secs: f64,
}

/// A model on disk, with what it takes in memory once loaded (weights and KV cache).
#[derive(Clone, Debug)]
pub struct ModelSpec {
    pub name: &'static str,
    pub size_gb: f64,
    pub context: u32,
}

/// The model every node preloads and the chat workloads use.
pub const CHAT_MODEL: &str = "llama3.1:8b";

/// Ollama's default keep-alive, in real seconds.
pub const KEEP_ALIVE_SECS: f64 = 300.0;

/// Four machines of different memory and speed, as a home lab or a small team has them.
/// Speeds are of the order llama.cpp shows for 8B models at 4-bit on long contexts.
pub fn nodes() -> Vec<NodeSpec> {
    vec![
        NodeSpec {
            name: "big",
            hardware: "workstation, 2x 24 GB GPU",
            memory_gib: 48,
            slots: 4,
            prefill_tps: 4000.0,
            decode_tps: 60.0,
            load_secs: 10.0,
        },
        NodeSpec {
            name: "gpu",
            hardware: "desktop, one 24 GB GPU",
            memory_gib: 24,
            slots: 4,
            prefill_tps: 3000.0,
            decode_tps: 50.0,
            load_secs: 10.0,
        },
        NodeSpec {
            name: "mac",
            hardware: "laptop, 32 GB unified memory (24 for models)",
            memory_gib: 24,
            slots: 2,
            prefill_tps: 1000.0,
            decode_tps: 30.0,
            load_secs: 20.0,
        },
        NodeSpec {
            name: "mini",
            hardware: "mini PC, iGPU with 12 GB",
            memory_gib: 12,
            slots: 2,
            prefill_tps: 400.0,
            decode_tps: 12.0,
            load_secs: 30.0,
        },
    ]
}

/// Three equal machines, the `gpu` desktop each: the fleet where a client-side hash is at its
/// strongest, since an unweighted hash gives every node its fair share of the conversations.
pub fn equal_nodes() -> Vec<NodeSpec> {
    let gpu = nodes().into_iter().find(|n| n.name == "gpu");
    let gpu = gpu.unwrap_or_else(|| unreachable!("the replay fleet has a gpu node"));
    ["gpu-1", "gpu-2", "gpu-3"]
        .into_iter()
        .map(|name| NodeSpec {
            name,
            ..gpu.clone()
        })
        .collect()
}

/// The nodes the chat workloads run on: the replay fleet, or three equal nodes.
pub fn chat_nodes(equal: bool) -> Vec<NodeSpec> {
    if equal { equal_nodes() } else { nodes() }
}

/// The models of the model-mix workload: together larger than any one node's memory.
pub fn models() -> Vec<ModelSpec> {
    let m = |name, size_gb| ModelSpec {
        name,
        size_gb,
        context: 32768,
    };
    vec![
        m(CHAT_MODEL, 6.0),
        m("qwen2.5:14b", 11.0),
        m("mistral-small:24b", 16.0),
        m("gemma2:27b", 19.0),
        m("qwen2.5:32b", 22.0),
    ]
}

/// The placement workload's fleet: two 24 GB nodes that each have three models on disk
/// (any two of the smaller ones fit together, all three do not) and an 8 GB node with only
/// the 8B model; 2 slots each.
pub fn placement_nodes() -> Vec<NodeSpec> {
    let gpu = |name| NodeSpec {
        name,
        hardware: "desktop, one 24 GB GPU",
        memory_gib: 24,
        slots: 2,
        prefill_tps: 3000.0,
        decode_tps: 50.0,
        load_secs: 15.0,
    };
    vec![
        gpu("gpu-a"),
        gpu("gpu-b"),
        NodeSpec {
            name: "small",
            hardware: "mini PC with an 8 GB GPU",
            memory_gib: 8,
            slots: 2,
            prefill_tps: 2000.0,
            decode_tps: 40.0,
            load_secs: 10.0,
        },
    ]
}

/// The placement workload's models: 4.7, 16 and 13 GB.
pub fn placement_models() -> Vec<ModelSpec> {
    let m = |name, size_gb| ModelSpec {
        name,
        size_gb,
        context: 32768,
    };
    vec![
        m(CHAT_MODEL, 4.7),
        m("mistral-small:24b", 16.0),
        m("gpt-oss:20b", 13.0),
    ]
}

/// The fleet a workload runs on, and what corral is told about it.
#[derive(Clone, Debug)]
pub struct Plan {
    pub nodes: Vec<NodeSpec>,
    /// Per node, the models on its disk.
    pub disks: Vec<Vec<ModelSpec>>,
    /// Per node, the models loaded when it starts.
    pub preload: Vec<Vec<&'static str>>,
    /// corral is told each node's slots (`num_parallel`) as well as its memory.
    pub tell_slots: bool,
    /// The nodes give a new conversation an empty slot, else the least recently used
    /// (`OLLAMA_MULTIUSER_CACHE=1`, and llama-server's rule in Ollama 0.30 and later),
    /// rather than Ollama's older longest-prefix rule.
    pub multiuser_cache: bool,
}

impl Plan {
    pub fn for_workload(spec: &WorkloadSpec) -> Plan {
        let mut plan = Plan::of_kind(spec.kind, spec.equal_nodes);
        if let Some(slots) = spec.node_slots {
            plan.nodes.iter_mut().for_each(|n| n.slots = slots);
        }
        plan.tell_slots &= !spec.slots_untold;
        if spec.cold_start {
            plan.preload.iter_mut().for_each(Vec::clear);
        }
        plan
    }

    fn of_kind(kind: WorkloadKind, equal_nodes: bool) -> Plan {
        match kind {
            WorkloadKind::Placement => {
                let nodes = placement_nodes();
                let disks = nodes
                    .iter()
                    .map(|n| {
                        let all = placement_models().into_iter();
                        all.filter(|m| n.memory_gib >= 24 || m.name == CHAT_MODEL)
                            .collect()
                    })
                    .collect();
                Plan {
                    preload: vec![Vec::new(); nodes.len()],
                    nodes,
                    disks,
                    // Told nothing but memory.
                    tell_slots: false,
                    multiuser_cache: true,
                }
            }
            _ => {
                let nodes = chat_nodes(equal_nodes);
                // Every model that fits a node's memory is on its disk (an operator pulls
                // what a machine can run), and the chat model is preloaded.
                let disks = nodes
                    .iter()
                    .map(|n| {
                        let all = models().into_iter();
                        all.filter(|m| m.size_gb * 1e9 <= (n.memory_gib * GIB) as f64)
                            .collect()
                    })
                    .collect();
                Plan {
                    preload: vec![vec![CHAT_MODEL]; nodes.len()],
                    nodes,
                    disks,
                    tell_slots: true,
                    multiuser_cache: false,
                }
            }
        }
    }
}

/// Simulated time: every real-hardware duration is divided by this factor.
#[derive(Clone, Copy, Debug)]
pub struct TimeScale(pub f64);

impl TimeScale {
    /// The simulated duration of `secs` real seconds.
    pub fn of_secs(self, secs: f64) -> Duration {
        Duration::from_secs_f64((secs / self.0).max(0.0))
    }

    /// The simulated time of one token at `tps` real tokens per second.
    pub fn per_token(self, tps: f64) -> Duration {
        self.of_secs(1.0 / tps)
    }
}

/// Each llama-server stand-in's host prompt cache: its size in tokens (`--cache-ram`; 0
/// keeps none), and whether idle slots are copied into it when a task starts
/// (`--cache-idle-slots`, llama-server's default).
#[derive(Clone, Copy, Debug)]
pub struct HostCache {
    pub tokens: u32,
    pub idle_slots: bool,
}

impl HostCache {
    /// `tokens` of cache, idle slots copied into it as llama-server does by default.
    pub fn of(tokens: u32) -> HostCache {
        HostCache {
            tokens,
            idle_slots: true,
        }
    }
}

/// The stand-in configuration of one node of a plan, following the real server `kind`.
pub fn standin_config(
    plan: &Plan,
    node: usize,
    scale: TimeScale,
    kind: StandinKind,
    host: HostCache,
) -> StandinConfig {
    let spec = &plan.nodes[node];
    let mut cfg = StandinConfig::new(spec.name);
    cfg.memory_bytes = spec.memory_gib * GIB;
    cfg.num_parallel = spec.slots;
    cfg.models = plan.disks[node]
        .iter()
        .map(|m| StandinModel::new(m.name, (m.size_gb * 1e9) as u64, m.context))
        .collect();
    cfg.preload = plan.preload[node].iter().map(|m| m.to_string()).collect();
    cfg.load_time = scale.of_secs(spec.load_secs);
    cfg.prefill_per_token = scale.per_token(spec.prefill_tps);
    cfg.decode_per_token = scale.per_token(spec.decode_tps);
    cfg.keep_alive = scale.of_secs(KEEP_ALIVE_SECS);
    cfg.multiuser_cache = plan.multiuser_cache;
    cfg.kind = kind;
    cfg.cache_ram_tokens = host.tokens;
    cfg.cache_idle_slots = host.idle_slots;
    cfg
}

/// A running fleet of stand-in nodes, fresh for every policy so each starts from the same
/// state. Dropping it stops every node.
pub struct Fleet {
    pub specs: Vec<NodeSpec>,
    pub configs: Vec<StandinConfig>,
    pub nodes: Vec<StandinNode>,
    /// corral is told each node's slots.
    tell_slots: bool,
}

impl Fleet {
    pub async fn start(
        plan: &Plan,
        scale: TimeScale,
        kind: StandinKind,
        host: HostCache,
    ) -> Result<Fleet, String> {
        let specs = plan.nodes.clone();
        let configs: Vec<StandinConfig> = (0..specs.len())
            .map(|i| standin_config(plan, i, scale, kind, host))
            .collect();
        let mut nodes = Vec::with_capacity(configs.len());
        for cfg in &configs {
            let addr = SocketAddr::from(([127, 0, 0, 1], 0));
            let node = StandinNode::start(cfg.clone(), addr)
                .await
                .map_err(|e| format!("stand-in {} did not start: {e}", cfg.name))?;
            nodes.push(node);
        }
        Ok(Fleet {
            specs,
            configs,
            nodes,
            tell_slots: plan.tell_slots,
        })
    }

    /// Nodes that have `model` on disk: what a client-side balancer such as Open WebUI
    /// learns from each node's `/api/tags`.
    pub fn candidates(&self, model: &str) -> Vec<usize> {
        self.configs
            .iter()
            .enumerate()
            .filter(|(_, c)| c.models.iter().any(|m| m.name == model))
            .map(|(i, _)| i)
            .collect()
    }

    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.specs.iter().position(|s| s.name == name)
    }

    pub fn logs(&self) -> Vec<Vec<ServedRequest>> {
        self.nodes.iter().map(StandinNode::log).collect()
    }

    /// Model churn per node. Listing the resident models first applies keep-alive unloads
    /// that are due, which the stand-in otherwise notices only when asked (corral's poller
    /// asks every 200 ms, the baselines never do): so every policy is counted alike.
    pub fn churn(&self) -> Vec<ChurnCounts> {
        self.nodes
            .iter()
            .map(|n| {
                n.resident();
                n.churn()
            })
            .collect()
    }
}

/// A `corral` process in front of a fleet, on a free loopback port. Killed when dropped.
pub struct CorralProcess {
    child: Child,
    pub url: String,
    /// Where corral serves its Prometheus metrics.
    metrics_url: String,
    config: PathBuf,
}

/// What corral's own metrics counted over a run, fleet-wide.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct CorralCounts {
    /// `corral_cold_loads_total`: loads corral caused.
    pub loads: u64,
    /// `corral_evictions_seen_total`: models it saw pushed out by another's load.
    pub evictions: u64,
    /// `corral_model_loads_total`: replies that reported a load.
    pub load_replies: u64,
}

impl CorralCounts {
    /// The counts of two replicas together.
    pub fn plus(self, other: CorralCounts) -> CorralCounts {
        CorralCounts {
            loads: self.loads + other.loads,
            evictions: self.evictions + other.evictions,
            load_replies: self.load_replies + other.load_replies,
        }
    }
}

/// `corral_shared_state_seconds{op="acquire"}` and `corral_shared_state_errors_total` of one
/// or more replicas: how long requests waited on the shared store, and how often it failed.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct StoreWait {
    /// Cumulative counts by upper bound (seconds), as the histogram's buckets give them.
    pub buckets: Vec<(f64, u64)>,
    pub count: u64,
    pub errors: u64,
}

impl StoreWait {
    /// Reads it from a Prometheus text scrape.
    pub fn parse(text: &str) -> StoreWait {
        let mut buckets = Vec::new();
        for line in text.lines() {
            let Some(rest) = line.strip_prefix("corral_shared_state_seconds_bucket{") else {
                continue;
            };
            let le = rest
                .split("le=\"")
                .nth(1)
                .and_then(|v| v.split('"').next())
                .and_then(|v| v.parse::<f64>().ok());
            let value = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok());
            if let (Some(le), Some(value)) = (le, value)
                && le.is_finite()
            {
                buckets.push((le, value as u64));
            }
        }
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        StoreWait {
            buckets,
            count: metric_sum(text, "corral_shared_state_seconds_count"),
            errors: metric_sum(text, "corral_shared_state_errors_total"),
        }
    }

    /// Adds another replica's.
    pub fn add(&mut self, other: &StoreWait) {
        if self.buckets.is_empty() {
            self.buckets = other.buckets.clone();
        } else {
            for (mine, theirs) in self.buckets.iter_mut().zip(&other.buckets) {
                mine.1 += theirs.1;
            }
        }
        self.count += other.count;
        self.errors += other.errors;
    }

    /// The q-quantile in seconds, interpolated within its bucket as Prometheus'
    /// `histogram_quantile` does; None when nothing was observed or it lies past the last
    /// bucket.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        if self.count == 0 {
            return None;
        }
        let rank = q * self.count as f64;
        let mut below = (0.0, 0u64);
        for &(le, cumulative) in &self.buckets {
            if cumulative as f64 >= rank {
                let inside = (cumulative - below.1).max(1) as f64;
                return Some(below.0 + (le - below.0) * (rank - below.1 as f64) / inside);
            }
            below = (le, cumulative);
        }
        None
    }
}

/// How often corral polls `/api/ps` and checks health during the replay.
const POLL_INTERVAL: Duration = Duration::from_millis(200);

impl CorralProcess {
    /// Starts `binary` with a generated configuration, with `extra_yaml` (top-level keys)
    /// added, and waits until it has polled every node at least once. `key`: one of the
    /// `api_keys` that `extra_yaml` sets, if any.
    pub async fn start(
        binary: &Path,
        fleet: &Fleet,
        scale: TimeScale,
        extra_yaml: &str,
        key: Option<&str>,
    ) -> Result<Self, String> {
        // A port free when picked may be taken by another process (a test beside this one)
        // before corral binds it; corral then waits for it, and that process would answer
        // in its place. Such a start is given up and made again on other ports.
        let mut attempts = 0;
        loop {
            let (port, metrics_port) = (free_port()?, free_port()?);
            match Self::start_on(binary, fleet, scale, extra_yaml, key, port, metrics_port).await {
                Err(e) if e == PORT_TAKEN && attempts < 3 => attempts += 1,
                started => return started,
            }
        }
    }

    async fn start_on(
        binary: &Path,
        fleet: &Fleet,
        scale: TimeScale,
        extra_yaml: &str,
        key: Option<&str>,
        port: u16,
        metrics_port: u16,
    ) -> Result<Self, String> {
        let mut yaml = corral_yaml(port, metrics_port, fleet, scale);
        yaml.push_str(extra_yaml);
        // For diagnosing a run: corral's access log, one file per corral started.
        if let Some(dir) = std::env::var_os("CORRAL_BENCH_ACCESS_LOGS") {
            let path = Path::new(&dir).join(format!("access-{port}.jsonl"));
            yaml.push_str(&format!("access_log: {}\n", path.display()));
        }
        let config = std::env::temp_dir().join(format!("corral-bench-{port}.yaml"));
        std::fs::File::create(&config)
            .and_then(|mut f| f.write_all(yaml.as_bytes()))
            .map_err(|e| format!("cannot write {}: {e}", config.display()))?;
        // corral on CPUs of its own (`taskset -c LIST`), as on a host of its own, where the
        // bench's clients and stand-ins would otherwise take turns with it for the same cores.
        let mut command = match std::env::var("CORRAL_BENCH_CPUS") {
            Ok(cpus) => {
                let mut taskset = Command::new("taskset");
                taskset.arg("-c").arg(cpus).arg(binary);
                taskset
            }
            Err(_) => Command::new(binary),
        };
        let child = command
            .arg("-c")
            .arg(&config)
            .env(
                "RUST_LOG",
                std::env::var("CORRAL_BENCH_LOG").unwrap_or("warn".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", binary.display()))?;
        let process = CorralProcess {
            child,
            url: format!("http://127.0.0.1:{port}"),
            metrics_url: format!("http://127.0.0.1:{metrics_port}/metrics"),
            config,
        };
        // A llama-server lists no models (no /api/tags): corral's merged list stays empty.
        let nodes_list_models = fleet
            .configs
            .iter()
            .any(|c| c.kind != StandinKind::LlamaCpp);
        process
            .wait_ready(port, metrics_port, nodes_list_models, key)
            .await?;
        Ok(process)
    }

    /// Waits until corral itself listens on both its ports (gives up with [`PORT_TAKEN`]
    /// where another process holds one) and `/api/tags` lists the chat model (a poll came
    /// in; where `nodes_list_models` is false, any answer does), then two more poll
    /// intervals so that every node has been read.
    async fn wait_ready(
        &self,
        port: u16,
        metrics_port: u16,
        nodes_list_models: bool,
        key: Option<&str>,
    ) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(30);
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let metrics_addr = SocketAddr::from(([127, 0, 0, 1], metrics_port));
        let held = |addr| TcpStream::connect(addr).is_ok();
        let client = reqwest::Client::new();
        let started = Instant::now();
        loop {
            if Instant::now() > deadline {
                return Err("corral did not become ready within 30 s".into());
            }
            let ours = listens_on(self.child.id(), port);
            let metrics_ours = listens_on(self.child.id(), metrics_port);
            if (!ours && held(addr)) || (!metrics_ours && held(metrics_addr)) {
                // Another process holds a port.
                if started.elapsed() > Duration::from_secs(2) {
                    return Err(PORT_TAKEN.into());
                }
            } else if ours && metrics_ours {
                let tags = client.get(format!("{}/api/tags", self.url));
                let listed = match key {
                    Some(key) => tags.bearer_auth(key),
                    None => tags,
                }
                .send()
                .await
                .ok()
                .filter(|r| r.status().is_success());
                if let Some(resp) = listed {
                    let text = resp.text().await.unwrap_or_default();
                    if text.contains(CHAT_MODEL) || !nodes_list_models {
                        tokio::time::sleep(POLL_INTERVAL * 2).await;
                        return Ok(());
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl CorralProcess {
    /// corral's counts of loads and evictions so far, from its metrics, after two poll
    /// intervals so that the last loads' polls are in.
    pub async fn counts(&self) -> Result<CorralCounts, String> {
        tokio::time::sleep(POLL_INTERVAL * 2).await;
        let text = self.scrape().await?;
        Ok(CorralCounts {
            loads: metric_sum(&text, "corral_cold_loads_total"),
            evictions: metric_sum(&text, "corral_evictions_seen_total"),
            load_replies: metric_sum(&text, "corral_model_loads_total"),
        })
    }

    /// How long its requests waited on the shared store, from its metrics.
    pub async fn store_wait(&self) -> Result<StoreWait, String> {
        Ok(StoreWait::parse(&self.scrape().await?))
    }

    /// The slots it handed to waiting requests, taken and declined, from its metrics.
    pub async fn handoffs(&self) -> Result<(u64, u64), String> {
        let text = self.scrape().await?;
        let outcome =
            |o: &str| metric_sum(&text, &format!("corral_handoffs_total{{outcome=\"{o}\"}}"));
        Ok((outcome("taken"), outcome("declined")))
    }

    async fn scrape(&self) -> Result<String, String> {
        reqwest::get(&self.metrics_url)
            .await
            .and_then(reqwest::Response::error_for_status)
            .map_err(|e| format!("cannot scrape corral: {e}"))?
            .text()
            .await
            .map_err(|e| format!("cannot read corral's metrics: {e}"))
    }
}

/// The sum of a metric's samples over all its labels, in Prometheus' text format.
fn metric_sum(text: &str, name: &str) -> u64 {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

impl Drop for CorralProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.config);
    }
}

/// corral's configuration for the replay: the fleet as an operator would describe it
/// (memory, slots), default weights, polls fast enough for simulated time, and an affinity
/// lifetime equal to the nodes' keep-alive.
fn corral_yaml(port: u16, metrics_port: u16, fleet: &Fleet, scale: TimeScale) -> String {
    let ttl_ms = scale.of_secs(KEEP_ALIVE_SECS).as_millis().max(1);
    let mut yaml = format!(
        "version: 1\nthreads: 2\ngrace_period_seconds: 0\ngraceful_shutdown_timeout_seconds: 1\n\
         pid_file: /tmp/corral-bench-{port}.pid\nupgrade_sock: /tmp/corral-bench-{port}.sock\n\
         listen: 127.0.0.1:{port}\nmetrics_listen: 127.0.0.1:{metrics_port}\nadmin_listen: null\n\
         poll:\n  interval: {}ms\n  timeout: 2s\nhealth:\n  interval: 1s\n\
         affinity:\n  ttl: {ttl_ms}ms\nnodes:\n",
        POLL_INTERVAL.as_millis()
    );
    for (node, cfg) in fleet.nodes.iter().zip(&fleet.configs) {
        yaml.push_str(&format!(
            "  - name: {}\n    url: {}\n    memory_gb: {:.3}\n",
            cfg.name,
            node.url(),
            cfg.memory_bytes as f64 / 1e9,
        ));
        if fleet.tell_slots {
            yaml.push_str(&format!("    num_parallel: {}\n", cfg.num_parallel));
        }
    }
    yaml
}

/// Why [`CorralProcess::start_on`] gave up: its port was taken before corral bound it.
const PORT_TAKEN: &str = "corral's port was taken by another process";

/// Whether process `pid` listens on 127.0.0.1:`port` (Linux: the listening sockets in
/// `/proc/net/tcp` against the process's open file descriptors). Where there is no such
/// table to read (not Linux), whatever listens there is taken for it.
fn listens_on(pid: u32, port: u16) -> bool {
    let Ok(table) = std::fs::read_to_string("/proc/net/tcp") else {
        return true;
    };
    let local = format!("0100007F:{port:04X}");
    let inodes: Vec<String> = table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // local_address, state (0A: listening), inode.
            (fields.get(1) == Some(&local.as_str()) && fields.get(3) == Some(&"0A"))
                .then(|| fields.get(9).map(|inode| format!("socket:[{inode}]")))
                .flatten()
        })
        .collect();
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    fds.flatten()
        .filter_map(|fd| std::fs::read_link(fd.path()).ok())
        .any(|target| inodes.iter().any(|i| target.as_os_str() == i.as_str()))
}

/// A port nothing listens on right now.
pub fn free_port() -> Result<u16, String> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("no free port: {e}"))
}

/// The `corral` binary built beside this one (`target/release/corral` next to
/// `target/release/corral-bench`).
pub fn sibling_corral() -> Result<PathBuf, String> {
    let me = std::env::current_exe().map_err(|e| format!("cannot locate corral-bench: {e}"))?;
    let dir = me
        .parent()
        .ok_or_else(|| "corral-bench has no parent directory".to_string())?;
    let path = dir.join(format!("corral{}", std::env::consts::EXE_SUFFIX));
    if path.exists() {
        Ok(path)
    } else {
        Err(format!(
            "{} not found: build it with `cargo build --release --bins`, or pass --corral PATH",
            path.display()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_port_is_ours_only_while_this_process_listens_on_it() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        assert!(listens_on(std::process::id(), port));
        // Held by another process: pid 1 is never this test.
        assert!(!listens_on(1, port));
        drop(listener);
        assert!(!listens_on(std::process::id(), port));
    }

    #[test]
    fn metric_sums_add_every_label() {
        let text = "# HELP corral_cold_loads_total x\n\
                    corral_cold_loads_total{model=\"a\",node=\"n\"} 2\n\
                    corral_cold_loads_total{model=\"b\",node=\"n\"} 1\n\
                    corral_cold_loads_total_other 9\n";
        assert_eq!(metric_sum(text, "corral_cold_loads_total"), 3);
        assert_eq!(metric_sum(text, "corral_evictions_seen_total"), 0);
    }

    #[test]
    fn store_wait_quantiles_interpolate_within_buckets() {
        let text = "corral_shared_state_seconds_bucket{op=\"acquire\",le=\"0.0001\"} 0\n\
                    corral_shared_state_seconds_bucket{op=\"acquire\",le=\"0.001\"} 80\n\
                    corral_shared_state_seconds_bucket{op=\"acquire\",le=\"0.002\"} 100\n\
                    corral_shared_state_seconds_bucket{op=\"acquire\",le=\"+Inf\"} 100\n\
                    corral_shared_state_seconds_count{op=\"acquire\"} 100\n\
                    corral_shared_state_errors_total{kind=\"timeout\"} 3\n";
        let mut wait = StoreWait::parse(text);
        assert_eq!(wait.buckets.len(), 3);
        assert_eq!((wait.count, wait.errors), (100, 3));
        // The 50th of 80 in (0.1, 1] ms: 0.1 + 0.9 x 50/80.
        let p50 = wait.quantile(0.5).unwrap();
        assert!((p50 - 0.000_662_5).abs() < 1e-9, "{p50}");
        assert!((wait.quantile(0.99).unwrap() - 0.001_95).abs() < 1e-9);
        wait.add(&StoreWait::parse(text));
        assert_eq!((wait.count, wait.buckets[1].1), (200, 160));
        assert_eq!(StoreWait::default().quantile(0.5), None);
    }

    #[test]
    fn scale_divides_real_time() {
        let s = TimeScale(25.0);
        assert_eq!(s.of_secs(10.0), Duration::from_millis(400));
        assert_eq!(s.per_token(4000.0), Duration::from_micros(10));
    }

    #[test]
    fn models_fit_where_they_are_on_disk() {
        let plans = [
            (WorkloadKind::LongChat, false),
            (WorkloadKind::LongChat, true),
            (WorkloadKind::Placement, false),
        ];
        for (kind, equal_nodes) in plans {
            let plan = Plan::of_kind(kind, equal_nodes);
            for i in 0..plan.nodes.len() {
                let cfg = standin_config(
                    &plan,
                    i,
                    TimeScale(25.0),
                    StandinKind::Ollama,
                    HostCache::of(0),
                );
                assert!(cfg.models.iter().any(|m| m.name == CHAT_MODEL));
                assert!(cfg.models.iter().all(|m| m.size_bytes <= cfg.memory_bytes));
            }
        }
        // Placement: any two of the smaller models fit a 24 GB node, all three do not.
        let gib24 = (24 * GIB) as f64;
        let sizes: Vec<f64> = placement_models().iter().map(|m| m.size_gb * 1e9).collect();
        assert!(sizes[0] + sizes[1] <= gib24 && sizes[0] + sizes[2] <= gib24);
        assert!(sizes[1] + sizes[2] > gib24);
        let total: f64 = models().iter().map(|m| m.size_gb).sum();
        let largest = nodes().iter().map(|n| n.memory_gib).max().unwrap_or(0);
        assert!(total * 1e9 > (largest * GIB) as f64);
    }
}
