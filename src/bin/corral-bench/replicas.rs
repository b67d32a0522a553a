//! `corral-bench replicas`: 1, 2 and 4 corral replicas in front of one fleet, each deciding
//! alone and sharing state through a `redis-server`, with every conversation's turns sent
//! to the replicas in turn, as a round-robin balancer in front of them would.
//!
//! The fleet is three equal stand-ins of current Ollama (`--node-slots` slots, told, and a
//! host prompt cache each); 12 conversations at once of a 4,000-token first message and
//! short follow-ups. Per cell and over the seeds (median and range): follow-up warm share,
//! follow-up TTFT p50 and p90, errors, the nodes sent more requests at once than their
//! slots, and how long the replicas' requests waited on the store (p50, p99, from their
//! `corral_shared_state_seconds` histograms) with the store's errors.

use std::path::PathBuf;
use std::time::Duration;

use corral::standin::StandinKind;

use crate::client::ChatApi;
use crate::fleet::{HostCache, StoreWait, TimeScale};
use crate::policy::Policy;
use crate::replay::{self, Env};
use crate::report;
use crate::workload::{self, WorkloadKind, WorkloadSpec};
use corral::standin::RedisServer;

pub struct Options {
    pub replicas: Vec<usize>,
    pub seeds: Vec<u64>,
    pub node_slots: usize,
    pub cache_ram_tokens: u32,
    pub scale: TimeScale,
    pub corral: PathBuf,
}

/// One replay's figures.
struct Measured {
    warm: f64,
    p50_ms: f64,
    p90_ms: f64,
    errors: usize,
    /// Nodes that had more generating requests open at once than their slots.
    overrun: usize,
    store: Option<StoreWait>,
}

pub async fn run(opts: Options) -> Result<String, String> {
    let cells: Vec<(usize, bool)> = (opts.replicas.iter())
        .flat_map(|&n| [(n, false), (n, true)])
        .collect();
    let mut measured: Vec<Vec<Measured>> = cells.iter().map(|_| Vec::new()).collect();
    for &seed in &opts.seeds {
        let spec = spec(&opts, seed);
        let conversations = workload::conversations(&spec);
        for (cell, &(replicas, shared)) in cells.iter().enumerate() {
            let store = match shared {
                true => Some(RedisServer::start().await?),
                false => None,
            };
            let env = Env {
                scale: opts.scale,
                corral_bin: Some(opts.corral.clone()),
                turn_timeout: opts.scale.of_secs(3600.0).max(Duration::from_secs(30)),
                run_timeout: Duration::from_secs(600),
                node_kind: StandinKind::Ollama,
                host: HostCache::of(opts.cache_ram_tokens),
                api: ChatApi::Ollama,
                move_cost: 0.0,
                replicas,
                store: store.as_ref().map(RedisServer::url),
                explain: false,
            };
            eprintln!(
                "corral-bench: replicas: seed {seed}, {} ...",
                cell_name(replicas, shared)
            );
            let run = replay::run(&env, &spec, &conversations, Policy::Corral).await?;
            let stats = report::stats(&run);
            let m = Measured {
                warm: stats.follow_up_warm.share(),
                p50_ms: stats.ttft_follow_up_ms.p50,
                p90_ms: stats.ttft_follow_up_ms.p90,
                errors: stats.errors + stats.unsent,
                overrun: (run.most_open.iter())
                    .filter(|(most, slots)| *most as usize > *slots)
                    .count(),
                store: run.store_wait,
            };
            eprintln!(
                "corral-bench:   follow-up warm {:.1}%, TTFT p50 {:.0} ms p90 {:.0} ms, {} errors, {} nodes overrun",
                m.warm * 100.0,
                m.p50_ms,
                m.p90_ms,
                m.errors,
                m.overrun
            );
            measured[cell].push(m);
        }
    }
    Ok(report(&opts, &cells, &measured))
}

fn spec(opts: &Options, seed: u64) -> WorkloadSpec {
    let mut spec = WorkloadSpec::default_for(WorkloadKind::LongChat);
    spec.seed = seed;
    spec.conversations = 12;
    spec.concurrency = 12;
    spec.turns = 5;
    spec.prompt_tokens = 4_000;
    spec.equal_nodes = true;
    spec.node_slots = Some(opts.node_slots);
    spec
}

fn cell_name(replicas: usize, shared: bool) -> String {
    let who = match replicas {
        1 => "1 replica".to_string(),
        n => format!("{n} replicas"),
    };
    match shared {
        true => format!("{who}, store"),
        false => format!("{who}, alone"),
    }
}

fn report(opts: &Options, cells: &[(usize, bool)], measured: &[Vec<Measured>]) -> String {
    let spread = |values: Vec<f64>, show: &dyn Fn(f64) -> String| -> String {
        let mut v: Vec<f64> = values.into_iter().filter(|x| x.is_finite()).collect();
        if v.is_empty() {
            return "-".into();
        }
        v.sort_by(f64::total_cmp);
        let median = v[v.len() / 2];
        format!("{} ({}-{})", show(median), show(v[0]), show(v[v.len() - 1]))
    };
    let pct = |x: f64| format!("{:.1}%", x * 100.0);
    let ms = |x: f64| format!("{x:.0}");
    let us = |x: f64| format!("{:.0}", x * 1e6);
    let mut out = format!(
        "Three equal stand-ins of current Ollama x {} slots (told; host cache {} tokens), 12 \
         conversations at once x 5 turns, 4,000-token first messages, time scale {}; seeds {:?}. \
         Each turn goes to the next replica. Median (min-max) over the seeds; TTFT in simulated \
         ms, the store's wait in real microseconds.\n\n\
         | replicas | follow-up warm | TTFT p50 | TTFT p90 | errors | nodes over their slots | store wait p50 | p99 | store errors |\n\
         | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n",
        opts.node_slots, opts.cache_ram_tokens, opts.scale.0, opts.seeds
    );
    for (&(replicas, shared), runs) in cells.iter().zip(measured) {
        let store = |q: f64| -> Vec<f64> {
            (runs.iter())
                .filter_map(|m| m.store.as_ref()?.quantile(q))
                .collect()
        };
        let (p50, p99) = match shared {
            true => (spread(store(0.5), &us), spread(store(0.99), &us)),
            false => ("-".into(), "-".into()),
        };
        let store_errors: u64 = (runs.iter())
            .filter_map(|m| m.store.as_ref().map(|s| s.errors))
            .sum();
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {p50} | {p99} | {} |\n",
            cell_name(replicas, shared),
            spread(runs.iter().map(|m| m.warm).collect(), &pct),
            spread(runs.iter().map(|m| m.p50_ms).collect(), &ms),
            spread(runs.iter().map(|m| m.p90_ms).collect(), &ms),
            runs.iter().map(|m| m.errors).sum::<usize>(),
            runs.iter().map(|m| m.overrun).sum::<usize>(),
            match shared {
                true => store_errors.to_string(),
                false => "-".into(),
            },
        ));
    }
    out.push_str(
        "\nThe store's wait is interpolated within the histogram's buckets (0.1, 0.25, 0.5, 1, \
         2, 5 ms, ...), as Prometheus' histogram_quantile does. Errors and overruns are totals \
         over the seeds.\n",
    );
    out
}
