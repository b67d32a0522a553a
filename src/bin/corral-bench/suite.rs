//! `corral-bench replay`: every selected workload through every selected policy, one after
//! the other on the same machine, then the report (JSON and Markdown) and the charts.

use std::path::{Path, PathBuf};

use crate::fleet::{self, TimeScale};
use crate::plot::{Bars, Cdf};
use crate::policy::Policy;
use crate::replay::{self, Env};
use crate::report::{self, NodeRow, ReplayReport, WorkloadReport};
use crate::workload::{self, Overrides, WorkloadKind, WorkloadSpec};

pub struct Options {
    pub workloads: Vec<WorkloadKind>,
    pub policies: Vec<Policy>,
    pub overrides: Overrides,
    /// Run every workload once per seed (empty: once, with --seed or its default).
    pub seeds: Vec<u64>,
    pub scale: TimeScale,
    pub node_kind: corral::standin::StandinKind,
    pub host: crate::fleet::HostCache,
    /// The chat API clients use; `None`: the one the node kind's users speak.
    pub api: Option<crate::client::ChatApi>,
    pub move_cost: f64,
    pub corral_bin: Option<PathBuf>,
    pub out: PathBuf,
    pub plots: Option<PathBuf>,
}

pub async fn run(opts: Options) -> Result<ReplayReport, String> {
    let trace = std::env::var_os("CORRAL_BENCH_TRACE").map(PathBuf::from);
    let env = Env {
        scale: opts.scale,
        corral_bin: resolve_corral(&opts)?,
        turn_timeout: opts
            .scale
            .of_secs(3600.0)
            .max(std::time::Duration::from_secs(30)),
        run_timeout: std::time::Duration::from_secs(600),
        node_kind: opts.node_kind,
        host: opts.host,
        api: opts.api.unwrap_or(match opts.node_kind {
            corral::standin::StandinKind::LlamaCpp | corral::standin::StandinKind::Openai => {
                crate::client::ChatApi::Openai
            }
            _ => crate::client::ChatApi::Ollama,
        }),
        move_cost: opts.move_cost,
        replicas: 1,
        store: None,
        // A traced run records why corral chose each node.
        explain: trace.is_some(),
    };
    let mut workloads = Vec::new();
    let seeds: Vec<Option<u64>> = if opts.seeds.is_empty() {
        vec![None]
    } else {
        opts.seeds.iter().copied().map(Some).collect()
    };
    let runs = opts
        .workloads
        .iter()
        .flat_map(|&kind| seeds.iter().map(move |&seed| (kind, seed)));
    for (kind, seed) in runs {
        let mut spec = WorkloadSpec::default_for(kind).with(&opts.overrides);
        if let Some(seed) = seed {
            spec.seed = seed;
        }
        let conversations = workload::conversations(&spec);
        let mut policies = Vec::new();
        for &policy in &opts.policies {
            eprintln!(
                "corral-bench: {} (seed {}) through {} ...",
                kind.name(),
                spec.seed,
                policy.name()
            );
            let run = replay::run(&env, &spec, &conversations, policy).await?;
            let stats = report::stats(&run);
            if let Some(dir) = &trace {
                write_trace(dir, &run, kind, spec.seed)?;
            }
            eprintln!(
                "corral-bench:   {} turns in {:.1} s, follow-up warm {:.1}%, follow-up TTFT p50 {:.1} ms p90 {:.1} ms, {} errors, predictions agreeing with the nodes' logs {}/{}",
                stats.turns,
                stats.elapsed_s,
                stats.follow_up_warm.share() * 100.0,
                stats.ttft_follow_up_ms.p50,
                stats.ttft_follow_up_ms.p90,
                stats.errors + stats.unsent,
                stats.predictions_agreed,
                stats.predictions_checked
            );
            policies.push(stats);
        }
        workloads.push(WorkloadReport::new(spec, policies));
    }
    let report = ReplayReport {
        time_scale: opts.scale.0,
        machine: machine(),
        fleet: fleet::chat_nodes(opts.overrides.equal_nodes)
            .iter()
            .map(|n| NodeRow {
                slots: opts.overrides.node_slots.unwrap_or(n.slots),
                ..NodeRow::of(n)
            })
            .collect(),
        workloads,
    };
    write_outputs(&report, &opts)?;
    Ok(report)
}

fn resolve_corral(opts: &Options) -> Result<Option<PathBuf>, String> {
    if !opts.policies.iter().any(|p| p.through_corral()) {
        return Ok(None);
    }
    match &opts.corral_bin {
        Some(path) if path.exists() => Ok(Some(path.clone())),
        Some(path) => Err(format!("{} does not exist", path.display())),
        None => fleet::sibling_corral().map(Some),
    }
}

fn write_outputs(report: &ReplayReport, opts: &Options) -> Result<(), String> {
    std::fs::create_dir_all(&opts.out)
        .map_err(|e| format!("cannot create {}: {e}", opts.out.display()))?;
    let json = serde_json::to_string_pretty(report).map_err(|e| e.to_string())?;
    write(&opts.out.join("replay.json"), json.as_bytes())?;
    write(&opts.out.join("replay.md"), report.markdown().as_bytes())?;
    if let Some(dir) = &opts.plots {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        charts(report, dir)?;
    }
    Ok(())
}

/// With `CORRAL_BENCH_TRACE=dir`, every turn of the run goes to
/// `dir/<workload>-seed<seed>-<policy>.csv` for analysis.
fn write_trace(dir: &Path, run: &replay::Run, kind: WorkloadKind, seed: u64) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let name = format!("{}-seed{seed}-{}.csv", kind.name(), run.policy.name());
    write(&dir.join(name), report::trace_csv(run).as_bytes())
}

fn write(path: &Path, bytes: &[u8]) -> Result<(), String> {
    std::fs::write(path, bytes).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

/// The replay's charts: warm share and follow-up TTFT for every workload, the TTFT
/// distribution of the long chats, and model churn in the model mix.
fn charts(report: &ReplayReport, dir: &Path) -> Result<(), String> {
    let groups: Vec<String> = report
        .workloads
        .iter()
        .map(|w| w.spec.kind.name().to_string())
        .collect();
    let per_policy = |f: &dyn Fn(&report::PolicyStats) -> f64| -> Vec<(String, Vec<f64>)> {
        policies_in(report)
            .into_iter()
            .map(|p| {
                let values = report
                    .workloads
                    .iter()
                    .map(|w| w.get(p).map_or(f64::NAN, f))
                    .collect();
                (p.name().to_string(), values)
            })
            .collect()
    };
    Bars {
        title: "Follow-up prompt tokens served from the node's cache",
        y_label: "warm share (%)",
        groups: groups.clone(),
        series: per_policy(&|s| s.follow_up_warm.share() * 100.0),
        log_y: false,
        annotate: true,
        whiskers: Vec::new(),
        bounds: Vec::new(),
    }
    .draw(&dir.join("replay-warm-share.png"))?;
    Bars {
        title: "Follow-up time to first token, median (simulated ms, log scale)",
        y_label: "TTFT p50 (ms)",
        groups,
        series: per_policy(&|s| s.ttft_follow_up_ms.p50),
        log_y: true,
        annotate: true,
        whiskers: Vec::new(),
        bounds: Vec::new(),
    }
    .draw(&dir.join("replay-ttft-follow-up.png"))?;
    if let Some(w) = workload(report, WorkloadKind::LongChat) {
        Cdf {
            title: "long-chat: follow-up time to first token",
            x_label: "TTFT (simulated ms, log scale)",
            series: w
                .policies
                .iter()
                .map(|p| {
                    (
                        p.policy.name().to_string(),
                        p.ttft_follow_up_samples_ms.clone(),
                    )
                })
                .collect(),
        }
        .draw(&dir.join("replay-long-chat-ttft-cdf.png"))?;
    }
    if let Some(w) = workload(report, WorkloadKind::ModelMix) {
        let metric = |f: fn(&report::PolicyStats) -> u64| -> Vec<f64> {
            w.policies.iter().map(|p| f(p) as f64).collect()
        };
        Bars {
            title: "model-mix: model loads and unloads across the fleet",
            y_label: "count",
            groups: w
                .policies
                .iter()
                .map(|p| p.policy.name().to_string())
                .collect(),
            series: vec![
                ("cold loads".into(), metric(|p| p.cold_loads)),
                ("evictions".into(), metric(|p| p.evictions)),
                (
                    "keep-alive unloads".into(),
                    metric(|p| p.keep_alive_unloads),
                ),
            ],
            log_y: false,
            annotate: true,
            whiskers: Vec::new(),
            bounds: Vec::new(),
        }
        .draw(&dir.join("replay-model-mix-churn.png"))?;
    }
    Ok(())
}

fn policies_in(report: &ReplayReport) -> Vec<Policy> {
    Policy::ALL
        .into_iter()
        .filter(|&p| report.workloads.iter().any(|w| w.get(p).is_some()))
        .collect()
}

fn workload(report: &ReplayReport, kind: WorkloadKind) -> Option<&WorkloadReport> {
    report.workloads.iter().find(|w| w.spec.kind == kind)
}

/// `nproc` and the CPU model, for the report.
pub fn machine() -> String {
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let mem_gib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("MemTotal:"))?;
            let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
            Some(kib / 1024.0 / 1024.0)
        })
        .unwrap_or(0.0);
    format!("{cpus} CPUs ({model}), {mem_gib:.0} GiB")
}
