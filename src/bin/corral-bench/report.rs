//! Turning runs into figures: warm shares from the nodes' logs (cross-checked against the
//! replies), TTFT percentiles, model churn, throughput; then the goals of issue 4 checked
//! against them, and the Markdown tables of docs/benchmarks.md.

use std::collections::HashMap;
use std::fmt::Write;
use std::time::Duration;

use corral::standin::ServedRequest;
use serde::Serialize;

use crate::fleet::{CorralCounts, NodeSpec, Plan, TimeScale};
use crate::policy::Policy;
use crate::replay::{Run, TurnRecord};
use crate::workload::{WorkloadKind, WorkloadSpec};

/// Nearest-rank percentiles of a set of durations, in milliseconds of simulated time.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Percentiles {
    pub n: usize,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
}

impl Percentiles {
    pub fn of(sorted: &[f64]) -> Percentiles {
        let at = |q: f64| {
            if sorted.is_empty() {
                return f64::NAN;
            }
            let rank = (q * sorted.len() as f64).ceil() as usize;
            sorted[rank.clamp(1, sorted.len()) - 1]
        };
        Percentiles {
            n: sorted.len(),
            p50: at(0.50),
            p90: at(0.90),
            p99: at(0.99),
        }
    }
}

/// Share of prompt tokens that were already in the serving node's cache.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct WarmShare {
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
}

impl WarmShare {
    pub fn share(&self) -> f64 {
        if self.prompt_tokens == 0 {
            0.0
        } else {
            self.cached_tokens as f64 / self.prompt_tokens as f64
        }
    }

    fn add(&mut self, prompt: u32, cached: u32) {
        self.prompt_tokens += u64::from(prompt);
        self.cached_tokens += u64::from(cached);
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct PolicyStats {
    pub policy: Policy,
    pub turns: usize,
    pub errors: usize,
    pub unsent: usize,
    pub timed_out: bool,
    /// From the nodes' logs: the figures the report quotes.
    pub follow_up_warm: WarmShare,
    pub first_turn_warm: WarmShare,
    /// From `prompt_eval_count` in the replies: the cross-check.
    pub follow_up_warm_by_reply: WarmShare,
    /// Turns found in a node's log / turns whose log and reply disagree on cached tokens.
    pub matched_in_logs: usize,
    pub log_reply_disagreements: usize,
    pub ttft_first_ms: Percentiles,
    pub ttft_follow_up_ms: Percentiles,
    /// Mean time to first token over every turn, first turns and follow-ups: what users
    /// wait in all, so that a policy cannot buy follow-up figures with first-turn waits.
    pub ttft_mean_ms: f64,
    /// Models loaded / evicted for room / unloaded at the end of their keep-alive, fleet-wide.
    pub cold_loads: u64,
    pub evictions: u64,
    pub keep_alive_unloads: u64,
    /// Requests that waited for a model load (triggered it or queued behind it).
    pub requests_waiting_on_loads: usize,
    /// What corral's own metrics counted (runs through corral).
    pub corral_counts: Option<CorralCounts>,
    pub elapsed_s: f64,
    pub turns_per_s: f64,
    pub output_tokens_per_s: f64,
    /// Turns served by each node, in fleet order.
    pub turns_per_node: Vec<usize>,
    /// Follow-ups served by another node than the conversation's previous turn.
    pub follow_ups_moved: usize,
    /// corral's `X-Fleet-Affinity` on follow-ups: hit, host, miss, new.
    pub follow_up_affinity: HashMap<String, usize>,
    /// Follow-ups through corral whose prediction (`hit`/`host` warm, else cold) could be
    /// checked against the node's log, and those where it matched the node's verdict (warm:
    /// at least 16 cached tokens and a quarter of the prompt, corral's own threshold).
    pub predictions_checked: usize,
    pub predictions_agreed: usize,
    /// The checked follow-ups by corral's claim, the node's verdict and the turn, e.g.
    /// `host->cold@t1`: which predictions are wrong, and when.
    pub prediction_cases: HashMap<String, usize>,
    /// Wrong predictions made before any reply had shown a host cache's limit (a follow-up
    /// called `host` and found cold): what no learning from replies could have avoided.
    pub wrong_before_a_limit_was_shown: usize,
    /// Every follow-up TTFT, sorted, for the CDF plot.
    pub ttft_follow_up_samples_ms: Vec<f64>,
}

pub fn stats(run: &Run) -> PolicyStats {
    let ok: Vec<&TurnRecord> = run.records.iter().filter(|r| r.error.is_none()).collect();
    let (by_log, matched, disagreements) = warm_from_logs(run, &ok);
    let mut by_reply = WarmShare::default();
    for r in ok.iter().filter(|r| r.follow_up()) {
        let evaluated = evaluated_by_reply(run, r).unwrap_or(r.prompt_tokens);
        by_reply.add(r.prompt_tokens, r.prompt_tokens.saturating_sub(evaluated));
    }
    let ttft = |follow_up: bool| -> Vec<f64> {
        let mut v: Vec<f64> = ok
            .iter()
            .filter(|r| r.follow_up() == follow_up)
            .filter_map(|r| r.ttft)
            .map(|d| d.as_secs_f64() * 1000.0)
            .collect();
        v.sort_by(f64::total_cmp);
        v
    };
    let follow_up_samples = ttft(true);
    let mut turns_per_node = vec![0; run.node_names.len()];
    for node in ok.iter().filter_map(|r| r.node) {
        turns_per_node[node] += 1;
    }
    let follow_ups_moved = moved(&ok);
    let mut follow_up_affinity = HashMap::new();
    for a in ok
        .iter()
        .filter(|r| r.follow_up())
        .filter_map(|r| r.affinity.clone())
    {
        *follow_up_affinity.entry(a).or_insert(0) += 1;
    }
    let secs = run.elapsed.as_secs_f64().max(1e-9);
    let output: u64 = ok.iter().map(|r| u64::from(r.reply_tokens)).sum();
    PolicyStats {
        policy: run.policy,
        turns: ok.len(),
        errors: run.records.len() - ok.len(),
        unsent: run.unsent,
        timed_out: run.timed_out,
        follow_up_warm: by_log.follow_up,
        first_turn_warm: by_log.first,
        follow_up_warm_by_reply: by_reply,
        matched_in_logs: matched,
        log_reply_disagreements: disagreements,
        ttft_first_ms: Percentiles::of(&ttft(false)),
        ttft_follow_up_ms: Percentiles::of(&follow_up_samples),
        ttft_mean_ms: mean(&[ttft(false), follow_up_samples.clone()].concat()),
        cold_loads: run.churn.iter().map(|c| c.loads).sum(),
        evictions: run.churn.iter().map(|c| c.evictions).sum(),
        keep_alive_unloads: run.churn.iter().map(|c| c.expirations).sum(),
        requests_waiting_on_loads: run.logs.iter().flatten().filter(|l| l.cold_load).count(),
        corral_counts: run.corral_counts,
        elapsed_s: secs,
        turns_per_s: ok.len() as f64 / secs,
        output_tokens_per_s: output as f64 / secs,
        turns_per_node,
        follow_ups_moved,
        follow_up_affinity,
        predictions_checked: by_log.checked,
        predictions_agreed: by_log.agreed,
        wrong_before_a_limit_was_shown: by_log.wrong_before_a_limit_was_shown(),
        prediction_cases: by_log.cases,
        ttft_follow_up_samples_ms: follow_up_samples,
    }
}

/// The middle value (the mean of the two middle ones of an even count); NaN of nothing.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => f64::NAN,
        _ if n % 2 == 1 => v[n / 2],
        _ => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn mean(values: &[f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.iter().sum::<f64>() / values.len() as f64
}

/// Follow-ups served by another node than their conversation's previous turn.
fn moved(ok: &[&TurnRecord]) -> usize {
    let mut served: HashMap<(usize, usize), usize> = HashMap::new();
    for r in ok {
        if let Some(node) = r.node {
            served.insert((r.conversation, r.turn), node);
        }
    }
    ok.iter()
        .filter(|r| r.follow_up())
        .filter(|r| {
            let before = served.get(&(r.conversation, r.turn - 1));
            r.node.is_some() && before.is_some() && r.node != before.copied()
        })
        .count()
}

/// The evaluated tokens a reply reports, where its `prompt_eval_count` counts only those
/// (Ollama before 0.30.1); current Ollama's counts cached ones too and tells nothing here.
fn evaluated_by_reply(run: &Run, r: &TurnRecord) -> Option<u32> {
    if run.counts_cached {
        return None;
    }
    r.prompt_eval_count
}

#[derive(Default)]
struct LogWarmth {
    first: WarmShare,
    follow_up: WarmShare,
    checked: usize,
    agreed: usize,
    cases: HashMap<String, usize>,
    /// Each checked follow-up: sent, answered, called `host`, predicted warm, found warm.
    verdicts: Vec<Verdict>,
    /// Cached tokens the node logged, by (conversation, turn).
    cached: HashMap<(usize, usize), u32>,
}

struct Verdict {
    sent: Duration,
    answered: Duration,
    host: bool,
    predicted_warm: bool,
    warm: bool,
}

/// Finds each successful turn in its node's log by its prompt size, and takes the cached
/// tokens the node recorded. Turns of equal size on one node are told apart by the cached
/// tokens their replies report where possible; a turn paired with a log entry that says
/// otherwise counts as a disagreement, which would mean the client and the node disagree
/// about what happened.
fn warm_from_logs(run: &Run, ok: &[&TurnRecord]) -> (LogWarmth, usize, usize) {
    let mut logged: HashMap<(usize, u32), Vec<u32>> = HashMap::new();
    for (node, log) in run.logs.iter().enumerate() {
        let chat = |e: &&ServedRequest| {
            matches!(e.endpoint.as_str(), "/api/chat" | "/v1/chat/completions")
        };
        for entry in log.iter().filter(chat) {
            logged
                .entry((node, entry.prompt_tokens))
                .or_default()
                .push(entry.cached_tokens);
        }
    }
    let by_reply = |r: &TurnRecord| {
        evaluated_by_reply(run, r).map(|evaluated| r.prompt_tokens.saturating_sub(evaluated))
    };
    let mut warmth = LogWarmth::default();
    let (mut matched, mut disagreements) = (0, 0);
    // Exact pairs first, so that an ambiguous pairing never hides behind a lucky one.
    let mut unpaired = Vec::new();
    for r in ok {
        let Some(bucket) = r.node.and_then(|n| logged.get_mut(&(n, r.prompt_tokens))) else {
            continue;
        };
        match by_reply(r).and_then(|c| bucket.iter().position(|&x| x == c)) {
            Some(i) => {
                let cached = bucket.swap_remove(i);
                matched += 1;
                warmth.add(r, cached);
            }
            None => unpaired.push(*r),
        }
    }
    for r in unpaired {
        let Some(node) = r.node else { continue };
        let Some(cached) = logged.get_mut(&(node, r.prompt_tokens)).and_then(Vec::pop) else {
            continue;
        };
        matched += 1;
        disagreements += usize::from(by_reply(r).is_some_and(|c| c != cached));
        warmth.add(r, cached);
    }
    (warmth, matched, disagreements)
}

impl LogWarmth {
    fn wrong_before_a_limit_was_shown(&self) -> usize {
        let shown = (self.verdicts.iter())
            .filter(|v| v.host && !v.warm)
            .map(|v| v.answered)
            .min();
        (self.verdicts.iter())
            .filter(|v| v.predicted_warm != v.warm && shown.is_none_or(|at| v.sent < at))
            .count()
    }

    fn add(&mut self, r: &TurnRecord, cached: u32) {
        let share = if r.follow_up() {
            &mut self.follow_up
        } else {
            &mut self.first
        };
        share.add(r.prompt_tokens, cached);
        self.cached.insert((r.conversation, r.turn), cached);
        if let Some(affinity) = r.affinity.as_deref().filter(|_| r.follow_up()) {
            let predicted_warm = matches!(affinity, "hit" | "host");
            let warm = cached >= 16 && cached * 4 >= r.prompt_tokens;
            self.checked += 1;
            self.agreed += usize::from(predicted_warm == warm);
            self.verdicts.push(Verdict {
                sent: r.sent,
                answered: r.sent + r.total,
                host: affinity == "host",
                predicted_warm,
                warm,
            });
            let verdict = if warm { "warm" } else { "cold" };
            *self
                .cases
                .entry(format!("{affinity}->{verdict}@t{}", r.turn))
                .or_default() += 1;
        }
    }
}

/// Every turn of a run as CSV, in the order sent, with the cached tokens its node logged:
/// where each conversation went, what corral called it, and what the node found.
pub fn trace_csv(run: &Run) -> String {
    let ok: Vec<&TurnRecord> = run.records.iter().filter(|r| r.error.is_none()).collect();
    let (warmth, _, _) = warm_from_logs(run, &ok);
    let mut records: Vec<&TurnRecord> = run.records.iter().collect();
    records.sort_by_key(|r| r.sent);
    let ms = |d: Duration| format!("{:.1}", d.as_secs_f64() * 1000.0);
    let mut out = String::from(
        "sent_ms,conversation,turn,node,affinity,prompt_tokens,cached_tokens,ttft_ms,total_ms,error,explain\n",
    );
    for r in records {
        let node = r.node.and_then(|n| run.node_names.get(n));
        let cached = warmth.cached.get(&(r.conversation, r.turn));
        out += &format!(
            "{},{},{},{},{},{},{},{},{},{},{}\n",
            ms(r.sent),
            r.conversation,
            r.turn,
            node.map_or("", String::as_str),
            r.affinity.as_deref().unwrap_or(""),
            r.prompt_tokens,
            cached.map_or(String::new(), u32::to_string),
            r.ttft.map_or(String::new(), ms),
            ms(r.total),
            r.error.is_some(),
            // Spaces and semicolons separate its fields; the fleet's node names hold no comma.
            r.explain.as_deref().unwrap_or(""),
        );
    }
    out
}

/// One of the goals, checked against the figures of the same run.
#[derive(Clone, Debug, Serialize)]
pub struct Goal {
    pub goal: String,
    pub measured: String,
    pub met: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct WorkloadReport {
    pub spec: WorkloadSpec,
    pub policies: Vec<PolicyStats>,
    pub goals: Vec<Goal>,
}

impl WorkloadReport {
    pub fn new(spec: WorkloadSpec, policies: Vec<PolicyStats>) -> WorkloadReport {
        let goals = goals(&spec, &policies);
        WorkloadReport {
            spec,
            policies,
            goals,
        }
    }

    pub fn get(&self, policy: Policy) -> Option<&PolicyStats> {
        self.policies.iter().find(|p| p.policy == policy)
    }
}

fn goals(spec: &WorkloadSpec, policies: &[PolicyStats]) -> Vec<Goal> {
    let get = |p: Policy| policies.iter().find(|s| s.policy == p);
    let mut out = Vec::new();
    let Some(corral) = get(Policy::Corral) else {
        return out;
    };
    match spec.kind {
        WorkloadKind::LongChat => {
            let warm = corral.follow_up_warm.share();
            if let Some(sticky) = get(Policy::StickyHash) {
                let s = sticky.follow_up_warm.share();
                out.push(Goal {
                    goal: "follow-up warm share at least sticky-hash's".into(),
                    measured: format!("corral {} vs sticky-hash {}", pct(warm), pct(s)),
                    met: warm >= s,
                });
            }
            if let Some(random) = get(Policy::Random) {
                let r = random.follow_up_warm.share();
                out.push(Goal {
                    goal: "follow-up warm share at least twice random's".into(),
                    measured: format!("corral {} vs random {}", pct(warm), pct(r)),
                    met: warm >= 2.0 * r,
                });
                let (c, r) = (corral.ttft_follow_up_ms.p50, random.ttft_follow_up_ms.p50);
                out.push(Goal {
                    goal: "follow-up TTFT p50 at least 3x better than random's".into(),
                    measured: format!("corral {c:.1} ms vs random {r:.1} ms ({:.1}x)", r / c),
                    met: c * 3.0 <= r,
                });
            }
        }
        WorkloadKind::ModelMix => {
            let others: Vec<_> = policies
                .iter()
                .filter(|p| !p.policy.through_corral())
                .collect();
            let fewest = others.iter().map(|p| p.cold_loads).min().unwrap_or(0);
            out.push(Goal {
                goal: "fewer cold loads than every baseline".into(),
                measured: format!(
                    "corral {} vs fewest among baselines {fewest}",
                    corral.cold_loads
                ),
                met: !others.is_empty() && corral.cold_loads < fewest,
            });
        }
        WorkloadKind::Placement => {
            // Every model must be loaded once: the nodes start empty.
            let minimum = spec.models.len() as u64;
            out.push(Goal {
                goal: "model loads at most 1.5x the minimum".into(),
                measured: format!("{} loads, minimum {minimum}", corral.cold_loads),
                met: corral.cold_loads * 2 <= minimum * 3,
            });
            if let Some(alone) = get(Policy::CorralOneAtATime) {
                let (c, a) = (corral.ttft_follow_up_ms.p90, alone.ttft_follow_up_ms.p90);
                out.push(Goal {
                    goal: "follow-up TTFT p90 within 2x of corral's 1-at-a-time p90".into(),
                    measured: format!("{c:.1} ms vs {a:.1} ms ({:.2}x)", c / a),
                    met: c <= 2.0 * a,
                });
            }
            if let Some(counts) = corral.corral_counts {
                out.push(Goal {
                    goal: "corral's counters agree with the nodes' own counts".into(),
                    measured: format!(
                        "loads {} vs nodes' {}, evictions {} vs nodes' {}",
                        counts.loads, corral.cold_loads, counts.evictions, corral.evictions
                    ),
                    met: counts.loads == corral.cold_loads && counts.evictions == corral.evictions,
                });
            }
        }
        WorkloadKind::SharedSystem | WorkloadKind::Overload => {}
    }
    out
}

/// Everything one invocation of `corral-bench replay` measured.
#[derive(Clone, Debug, Serialize)]
pub struct ReplayReport {
    pub time_scale: f64,
    pub machine: String,
    pub fleet: Vec<NodeRow>,
    pub workloads: Vec<WorkloadReport>,
}

#[derive(Clone, Debug, Serialize)]
pub struct NodeRow {
    pub name: String,
    pub hardware: String,
    pub memory_gib: u64,
    pub slots: usize,
    pub prefill_tps: f64,
    pub decode_tps: f64,
    pub load_secs: f64,
}

impl NodeRow {
    pub fn of(s: &NodeSpec) -> NodeRow {
        NodeRow {
            name: s.name.into(),
            hardware: s.hardware.into(),
            memory_gib: s.memory_gib,
            slots: s.slots,
            prefill_tps: s.prefill_tps,
            decode_tps: s.decode_tps,
            load_secs: s.load_secs,
        }
    }
}

fn pct(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

fn ms(x: f64) -> String {
    if x.is_nan() {
        "-".into()
    } else if x >= 100.0 {
        format!("{x:.0}")
    } else {
        format!("{x:.1}")
    }
}

impl ReplayReport {
    /// The report as Markdown: the fleet, then per workload its table and goals.
    pub fn markdown(&self) -> String {
        let mut md = String::new();
        let scale = TimeScale(self.time_scale);
        let _ = writeln!(
            md,
            "Time scale {}: every duration is 1/{} of the real-hardware figure. Machine: {}.\n",
            self.time_scale, self.time_scale, self.machine
        );
        md.push_str(
            "| node | stands for | memory | slots | prefill tok/s | decode tok/s | load |\n",
        );
        md.push_str("| --- | --- | --- | --- | --- | --- | --- |\n");
        for n in &self.fleet {
            let _ = writeln!(
                md,
                "| {} | {} | {} GiB | {} | {:.0} | {:.0} | {:.0} s ({:.0} ms simulated) |",
                n.name,
                n.hardware,
                n.memory_gib,
                n.slots,
                n.prefill_tps,
                n.decode_tps,
                n.load_secs,
                scale.of_secs(n.load_secs).as_secs_f64() * 1000.0
            );
        }
        for w in &self.workloads {
            md.push_str(&workload_markdown(w));
        }
        md.push_str(&spread_markdown(&self.workloads));
        md
    }
}

/// For workloads run with several seeds: each policy's range over the seeds.
fn spread_markdown(workloads: &[WorkloadReport]) -> String {
    let mut md = String::new();
    let mut kinds: Vec<WorkloadKind> = Vec::new();
    for w in workloads {
        if !kinds.contains(&w.spec.kind) {
            kinds.push(w.spec.kind);
        }
    }
    for kind in kinds {
        let runs: Vec<&WorkloadReport> = workloads.iter().filter(|w| w.spec.kind == kind).collect();
        if runs.len() < 2 {
            continue;
        }
        let seeds: Vec<String> = runs.iter().map(|w| w.spec.seed.to_string()).collect();
        let _ = writeln!(
            md,
            "\n### {} over seeds {}: min-max (mean)\n",
            kind.name(),
            seeds.join(", ")
        );
        md.push_str(
            "| policy | model loads | evictions | follow-up warm | TTFT follow-up p50 ms | \
             TTFT follow-up p90 ms | corral's counts agree |\n",
        );
        md.push_str("| --- | --- | --- | --- | --- | --- | --- |\n");
        let mut policies: Vec<Policy> = Vec::new();
        for p in runs.iter().flat_map(|w| &w.policies) {
            if !policies.contains(&p.policy) {
                policies.push(p.policy);
            }
        }
        for policy in policies {
            let stats: Vec<&PolicyStats> = runs.iter().filter_map(|w| w.get(policy)).collect();
            let range = |f: &dyn Fn(&PolicyStats) -> f64, fmt: &dyn Fn(f64) -> String| {
                let v: Vec<f64> = stats.iter().map(|s| f(s)).collect();
                let min = v.iter().copied().fold(f64::INFINITY, f64::min);
                let max = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let mean = v.iter().sum::<f64>() / v.len().max(1) as f64;
                format!("{}-{} ({})", fmt(min), fmt(max), fmt(mean))
            };
            let count = |x: f64| format!("{x:.0}");
            let counted: Vec<bool> = stats
                .iter()
                .filter_map(|s| {
                    let c = s.corral_counts?;
                    Some(c.loads == s.cold_loads && c.evictions == s.evictions)
                })
                .collect();
            let agree = if counted.is_empty() {
                "-".to_string()
            } else {
                let n = counted.iter().filter(|a| **a).count();
                format!("{n} of {}", counted.len())
            };
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} | {agree} |",
                policy.name(),
                range(&|s| s.cold_loads as f64, &count),
                range(&|s| s.evictions as f64, &count),
                range(&|s| s.follow_up_warm.share(), &pct),
                range(&|s| s.ttft_follow_up_ms.p50, &ms),
                range(&|s| s.ttft_follow_up_ms.p90, &ms),
            );
        }
        for w in &runs {
            let missed: Vec<&str> = w
                .goals
                .iter()
                .filter(|g| !g.met)
                .map(|g| g.goal.as_str())
                .collect();
            let _ = writeln!(
                md,
                "- seed {}: {} of {} goals met{}",
                w.spec.seed,
                w.goals.len() - missed.len(),
                w.goals.len(),
                if missed.is_empty() {
                    String::new()
                } else {
                    format!(" (missed: {})", missed.join("; "))
                }
            );
        }
    }
    md
}

fn workload_markdown(w: &WorkloadReport) -> String {
    let s = &w.spec;
    let mut md = String::new();
    let _ = writeln!(
        md,
        "\n### {}\n\n{} conversations x {} turns, {} at a time; first-turn context {} tokens, \
         follow-ups {} tokens, replies {} tokens, think {} s (real), seed {}.\n",
        s.kind.name(),
        s.conversations,
        s.turns,
        s.concurrency,
        s.prompt_tokens,
        s.followup_tokens,
        s.reply_tokens,
        s.think_secs,
        s.seed
    );
    if s.kind == WorkloadKind::Placement {
        md.push_str(&fleet_markdown(&Plan::for_workload(s)));
    }
    md.push_str(
        "| policy | follow-up warm | first-turn warm | TTFT first p50 / p90 / p99 ms | \
         TTFT follow-up p50 / p90 / p99 ms | cold loads | evictions | keep-alive unloads | \
         errors | turns/s | tokens/s |\n",
    );
    md.push_str("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
    for p in &w.policies {
        let (f, u) = (&p.ttft_first_ms, &p.ttft_follow_up_ms);
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} / {} / {} | {} / {} / {} | {} | {} | {} | {} | {:.2} | {:.0} |",
            p.policy.name(),
            pct(p.follow_up_warm.share()),
            pct(p.first_turn_warm.share()),
            ms(f.p50),
            ms(f.p90),
            ms(f.p99),
            ms(u.p50),
            ms(u.p90),
            ms(u.p99),
            p.cold_loads,
            p.evictions,
            p.keep_alive_unloads,
            p.errors + p.unsent,
            p.turns_per_s,
            p.output_tokens_per_s
        );
    }
    md.push_str(&checks_markdown(w));
    for g in &w.goals {
        let mark = if g.met { "met" } else { "MISSED" };
        let _ = writeln!(md, "- goal: {} -- {} ({mark})", g.goal, g.measured);
    }
    md
}

/// The cross-checks and where corral sent follow-ups, one line each.
fn checks_markdown(w: &WorkloadReport) -> String {
    let mut md = String::from("\n");
    for p in &w.policies {
        let _ = writeln!(
            md,
            "- {}: {} of {} turns found in node logs, {} disagree with the reply's \
             prompt_eval_count; follow-up warm share by replies {}; turns per node {:?}; \
             follow-ups moved to another node {}{}{}",
            p.policy.name(),
            p.matched_in_logs,
            p.turns,
            p.log_reply_disagreements,
            pct(p.follow_up_warm_by_reply.share()),
            p.turns_per_node,
            p.follow_ups_moved,
            affinity_note(p),
            counts_note(p)
        );
    }
    md
}

fn counts_note(p: &PolicyStats) -> String {
    p.corral_counts.map_or(String::new(), |c| {
        format!(
            "; corral counted {} loads it caused and {} evictions (nodes: {} loads, {} evictions)",
            c.loads, c.evictions, p.cold_loads, p.evictions
        )
    })
}

/// A workload's own fleet, where it is not the default one.
fn fleet_markdown(plan: &Plan) -> String {
    let mut md = String::from("Its fleet (corral is told each node's memory");
    md.push_str(if plan.tell_slots {
        " and slots):\n\n"
    } else {
        " only):\n\n"
    });
    md.push_str(
        "| node | memory | slots | models on disk (GB) | prefill / decode tok/s | load |\n",
    );
    md.push_str("| --- | --- | --- | --- | --- | --- |\n");
    for (n, disk) in plan.nodes.iter().zip(&plan.disks) {
        let models: Vec<String> = disk
            .iter()
            .map(|m| format!("{} ({})", m.name, m.size_gb))
            .collect();
        let _ = writeln!(
            md,
            "| {} | {} GiB | {} | {} | {:.0} / {:.0} | {:.0} s |",
            n.name,
            n.memory_gib,
            n.slots,
            models.join(", "),
            n.prefill_tps,
            n.decode_tps,
            n.load_secs
        );
    }
    md.push('\n');
    md
}

fn affinity_note(p: &PolicyStats) -> String {
    if p.follow_up_affinity.is_empty() {
        return String::new();
    }
    let mut kinds: Vec<_> = p.follow_up_affinity.iter().collect();
    kinds.sort();
    let list: Vec<String> = kinds.iter().map(|(k, v)| format!("{k} {v}")).collect();
    let mut cases: Vec<_> = p.prediction_cases.iter().collect();
    cases.sort();
    let cases: Vec<String> = cases.iter().map(|(k, v)| format!("{k} {v}")).collect();
    format!(
        "; follow-up X-Fleet-Affinity: {}; claim->node's verdict: {}",
        list.join(", "),
        cases.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        let p = Percentiles::of(&v);
        assert_eq!((p.p50, p.p90, p.p99), (50.0, 90.0, 99.0));
        let one = Percentiles::of(&[7.0]);
        assert_eq!((one.p50, one.p99), (7.0, 7.0));
        assert!(Percentiles::of(&[]).p50.is_nan());
    }

    #[test]
    fn warm_share_is_a_ratio_of_tokens() {
        let mut w = WarmShare::default();
        assert_eq!(w.share(), 0.0);
        w.add(100, 90);
        w.add(100, 0);
        assert!((w.share() - 0.45).abs() < 1e-12);
    }
}
