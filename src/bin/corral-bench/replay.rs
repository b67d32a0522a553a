//! Replaying a workload through one policy: a fresh fleet, corral in front of it when the
//! policy is corral, every conversation run as a user would (send, read the streamed reply,
//! think, send the next turn with the whole history), and the nodes' own logs at the end.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use corral::standin::{ChurnCounts, ServedRequest, StandinKind};
use parking_lot::Mutex;
use tokio::sync::Semaphore;

use crate::client;
use crate::fleet::{CorralCounts, CorralProcess, Fleet, HostCache, Plan, StoreWait, TimeScale};
use crate::policy::{Picker, Policy};
use crate::workload::{Conversation, WorkloadSpec, rendered_tokens};

/// What does not change between the runs of one replay.
pub struct Env {
    pub scale: TimeScale,
    pub corral_bin: Option<PathBuf>,
    /// Longest a single turn may take, in simulated time, before it counts as an error.
    pub turn_timeout: Duration,
    /// Longest a whole run may take before its remaining turns are abandoned.
    pub run_timeout: Duration,
    /// Which real server every stand-in follows, and its host prompt cache.
    pub node_kind: StandinKind,
    pub host: HostCache,
    /// The chat API the clients speak.
    pub api: client::ChatApi,
    /// corral's `weights.move_cost`.
    pub move_cost: f64,
    /// corral replicas in front of the fleet (at least 1); each turn goes to the next one,
    /// as a round-robin balancer in front of them sends it.
    pub replicas: usize,
    /// The store the replicas share (`shared_state.url`); None: each decides alone.
    pub store: Option<String>,
    /// Ask corral why it chose each node (`X-Fleet-Explain`), for a trace of the run.
    pub explain: bool,
}

/// One turn as the client saw it.
#[derive(Clone, Debug)]
pub struct TurnRecord {
    /// The conversation's index in the workload.
    pub conversation: usize,
    pub turn: usize,
    /// Index of the node that served it, when known.
    pub node: Option<usize>,
    /// Prompt tokens as the node renders and counts them.
    pub prompt_tokens: u32,
    pub prompt_eval_count: Option<u32>,
    pub reply_tokens: u32,
    pub ttft: Option<Duration>,
    pub total: Duration,
    /// When it was sent, from the start of the run.
    pub sent: Duration,
    pub error: Option<String>,
    /// corral's `X-Fleet-Affinity`.
    pub affinity: Option<String>,
    /// corral's `X-Fleet-Explain`, where [`Env::explain`] asked for it.
    pub explain: Option<String>,
}

impl TurnRecord {
    pub fn follow_up(&self) -> bool {
        self.turn > 0
    }
}

/// Everything one policy's run produced.
pub struct Run {
    pub policy: Policy,
    pub records: Vec<TurnRecord>,
    /// Turns never sent: the conversation broke off at an error, or the run timed out.
    pub unsent: usize,
    pub node_names: Vec<String>,
    pub logs: Vec<Vec<ServedRequest>>,
    pub churn: Vec<ChurnCounts>,
    /// What corral's metrics counted, for runs through corral.
    pub corral_counts: Option<CorralCounts>,
    pub elapsed: Duration,
    pub timed_out: bool,
    /// The nodes' `prompt_eval_count` counts cached tokens too (current Ollama).
    pub counts_cached: bool,
    /// Per node, the most generating requests it had open at once for one model, and its
    /// slots: what several replicas deciding alone overrun.
    pub most_open: Vec<(u32, usize)>,
    /// How long the replicas' requests waited on the shared store, from their metrics.
    pub store_wait: Option<StoreWait>,
}

/// For diagnosing a run: one JSON line per turn (conversation, turn, node, tokens, times,
/// corral's affinity claim), in `dir`, one file per policy run.
fn write_turn_log(
    dir: &Path,
    policy: Policy,
    fleet: &Fleet,
    records: &[TurnRecord],
) -> Result<(), String> {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let mut out = String::new();
    for r in records {
        let line = serde_json::json!({
            "conversation": r.conversation,
            "turn": r.turn,
            "node": r.node.and_then(|i| fleet.specs.get(i)).map(|s| s.name),
            "prompt_tokens": r.prompt_tokens,
            "prompt_eval_count": r.prompt_eval_count,
            "sent_ms": ms(r.sent),
            "ttft_ms": r.ttft.map(ms),
            "total_ms": ms(r.total),
            "affinity": r.affinity,
            "error": r.error,
        });
        out.push_str(&line.to_string());
        out.push('\n');
    }
    let path = dir.join(format!(
        "turns-{}-{}.jsonl",
        policy.name(),
        std::process::id()
    ));
    std::fs::write(&path, out).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

/// Shared by the conversations of one run.
struct RunCtx {
    env_scale: TimeScale,
    spec: WorkloadSpec,
    picker: Picker,
    fleet: Fleet,
    /// The corral replicas' URLs (none for the baselines).
    corral_urls: Vec<String>,
    client: reqwest::Client,
    turn_timeout: Duration,
    api: client::ChatApi,
    /// When the run started.
    started: Instant,
}

pub async fn run(
    env: &Env,
    spec: &WorkloadSpec,
    conversations: &[Arc<Conversation>],
    policy: Policy,
) -> Result<Run, String> {
    let plan = Plan::for_workload(spec);
    let fleet = Fleet::start(&plan, env.scale, env.node_kind, env.host).await?;
    let corrals = match (policy.through_corral(), &env.corral_bin) {
        (true, Some(bin)) => {
            let mut extra = match env.move_cost > 0.0 {
                true => format!("weights:\n  move_cost: {}\n", env.move_cost),
                false => String::new(),
            };
            if let Some(url) = &env.store {
                extra.push_str(&format!("shared_state:\n  url: {url}\n"));
            }
            let mut corrals = Vec::new();
            for _ in 0..env.replicas.max(1) {
                corrals.push(CorralProcess::start(bin, &fleet, env.scale, &extra, None).await?);
            }
            corrals
        }
        (true, None) => return Err("no corral binary to run".into()),
        (false, _) => Vec::new(),
    };
    let mut spec = spec.clone();
    if policy == Policy::CorralOneAtATime {
        spec.concurrency = 1;
    }
    let spec = &spec;
    let mut headers = reqwest::header::HeaderMap::new();
    if env.explain {
        headers.insert(
            "x-fleet-explain",
            reqwest::header::HeaderValue::from_static("1"),
        );
    }
    let client = reqwest::Client::builder()
        .pool_idle_timeout(Duration::from_secs(30))
        .default_headers(headers)
        .build()
        .map_err(|e| format!("cannot build an HTTP client: {e}"))?;
    let ctx = Arc::new(RunCtx {
        env_scale: env.scale,
        spec: spec.clone(),
        picker: Picker::new(
            policy,
            fleet.configs.iter().map(|c| c.num_parallel).collect(),
            spec.seed,
        ),
        corral_urls: corrals.iter().map(|c| c.url.clone()).collect(),
        fleet,
        client,
        turn_timeout: env.turn_timeout,
        api: env.api,
        started: Instant::now(),
    });

    let started = ctx.started;
    let gate = Arc::new(Semaphore::new(spec.concurrency));
    let sink: Arc<Mutex<Vec<TurnRecord>>> = Arc::default();
    let tasks: Vec<_> = conversations
        .iter()
        .map(|c| {
            let (ctx, gate, c) = (Arc::clone(&ctx), Arc::clone(&gate), Arc::clone(c));
            let sink = Arc::clone(&sink);
            tokio::spawn(async move {
                if let Ok(_permit) = gate.acquire_owned().await {
                    run_conversation(&ctx, &c, &sink).await;
                }
            })
        })
        .collect();
    let aborts: Vec<_> = tasks.iter().map(|t| t.abort_handle()).collect();
    let timed_out = tokio::time::timeout(env.run_timeout, futures::future::join_all(tasks))
        .await
        .is_err();
    if timed_out {
        log::warn!(
            "{} / {}: stopped after {:?}, turns not yet sent are counted as unsent",
            spec.kind.name(),
            policy.name(),
            env.run_timeout
        );
        aborts.iter().for_each(|a| a.abort());
    }
    let elapsed = started.elapsed();
    let mut corral_counts = None;
    let mut store_wait = env.store.as_ref().map(|_| StoreWait::default());
    for corral in &corrals {
        let counts = corral.counts().await?;
        corral_counts = Some(counts.plus(corral_counts.unwrap_or_default()));
        if let Some(wait) = &mut store_wait {
            wait.add(&corral.store_wait().await?);
        }
    }
    drop(corrals);

    let records = std::mem::take(&mut *sink.lock());
    if let Some(dir) = std::env::var_os("CORRAL_BENCH_TURN_LOGS") {
        write_turn_log(Path::new(&dir), policy, &ctx.fleet, &records)?;
    }
    let unsent = (spec.conversations * spec.turns).saturating_sub(records.len());
    Ok(Run {
        policy,
        records,
        unsent,
        node_names: ctx.fleet.specs.iter().map(|s| s.name.to_string()).collect(),
        logs: ctx.fleet.logs(),
        churn: ctx.fleet.churn(),
        corral_counts,
        elapsed,
        timed_out,
        // Over /v1 the client reads evaluated tokens directly (see client::Reply).
        counts_cached: env.node_kind == StandinKind::Ollama && env.api == client::ChatApi::Ollama,
        most_open: (ctx.fleet.nodes.iter().zip(&ctx.fleet.configs))
            .map(|(node, cfg)| {
                let most = node.most_open().into_values().max().unwrap_or(0);
                (most, cfg.num_parallel)
            })
            .collect(),
        store_wait,
    })
}

/// One user's conversation: every turn carries the whole history, as chat clients send it.
/// Stops at the first failed turn, since the next one would need its reply.
async fn run_conversation(ctx: &RunCtx, c: &Conversation, sink: &Mutex<Vec<TurnRecord>>) {
    let scale = ctx.env_scale;
    if c.id < ctx.spec.concurrency {
        tokio::time::sleep(scale.of_secs(c.start_secs)).await;
    }
    let mut history: Vec<(&'static str, String)> = Vec::new();
    if let Some(system) = &c.system {
        history.push(("system", system.to_string()));
    }
    for (turn, message) in c.messages.iter().enumerate() {
        if turn > 0 {
            let think = c.think_secs.get(turn - 1).copied().unwrap_or(0.0);
            tokio::time::sleep(scale.of_secs(think)).await;
        }
        history.push(("user", message.clone()));
        let (record, reply) = send_turn(ctx, c, turn, &history).await;
        let failed = record.error.is_some();
        sink.lock().push(record);
        if failed {
            break;
        }
        history.push(("assistant", reply));
    }
}

/// Sends one turn through the run's policy and records what happened.
async fn send_turn(
    ctx: &RunCtx,
    c: &Conversation,
    turn: usize,
    history: &[(&'static str, String)],
) -> (TurnRecord, String) {
    let messages: Vec<(&str, &str)> = history.iter().map(|(r, m)| (*r, m.as_str())).collect();
    let body = client::chat_body(ctx.api, &c.model, &messages, ctx.spec.reply_tokens);
    let mut record = TurnRecord {
        conversation: c.id,
        turn,
        node: None,
        prompt_tokens: rendered_tokens(messages.iter().copied()),
        prompt_eval_count: None,
        reply_tokens: 0,
        ttft: None,
        total: Duration::ZERO,
        sent: ctx.started.elapsed(),
        error: None,
        affinity: None,
        explain: None,
    };
    let mut candidates = ctx.fleet.candidates(&c.model);
    if ctx.picker.policy() == Policy::RandomResident {
        // Where the model is resident now, as a client reading each node's /api/ps sees.
        let resident: Vec<usize> = candidates
            .iter()
            .copied()
            .filter(|&i| ctx.fleet.nodes[i].resident().contains(&c.model))
            .collect();
        if !resident.is_empty() {
            candidates = resident;
        }
    }
    let chosen = ctx.picker.pick(c.id, &candidates);
    let replica = ctx
        .corral_urls
        .get((c.id + turn) % ctx.corral_urls.len().max(1));
    let base = match (&chosen, replica) {
        (Some(f), _) => ctx.fleet.nodes[f.node].url(),
        (None, Some(url)) => url.clone(),
        (None, None) => {
            record.error = Some(format!("no node has {}", c.model));
            return (record, String::new());
        }
    };
    record.node = chosen.as_ref().map(|f| f.node);
    let result = client::chat(&ctx.client, ctx.api, &base, body, ctx.turn_timeout).await;
    drop(chosen);
    match result {
        Ok(reply) => {
            if let Some(name) = &reply.fleet_node {
                record.node = ctx.fleet.index_of(name);
            }
            record.affinity = reply.fleet_affinity;
            record.explain = reply.fleet_explain;
            record.ttft = reply.ttft;
            record.total = reply.total;
            record.prompt_eval_count = reply.prompt_eval_count;
            record.reply_tokens = reply.eval_count.unwrap_or(0);
            (record, reply.content)
        }
        Err(e) => {
            record.error = Some(e);
            (record, String::new())
        }
    }
}
