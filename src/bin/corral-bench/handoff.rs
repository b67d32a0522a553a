//! `corral-bench handoff`: how long a node's slot stays free while requests wait for it.
//!
//! The replay fleet (stand-ins of current Ollama, slots told) under closed-loop clients, `load`
//! of them per slot, each sending its next short chat as soon as its last reply ended: at 2 per
//! slot, about as many requests wait as run. Each stand-in notes, for every slot a request
//! takes, how long the slot had been free; with requests always waiting, that is the handoff
//! from a reply's end to the next request's start on the node. Through corral the waiting
//! requests wait in corral's queue; the baseline, in the same run, sends each client's requests
//! straight to one node, where they wait in the node's own queue (Ollama's, and the
//! stand-in's: a fair semaphore), the floor a router's queue is measured against.

use std::path::PathBuf;
use std::time::Duration;

use corral::standin::StandinKind;
use serde_json::json;

use crate::fleet::{CHAT_MODEL, CorralProcess, Fleet, HostCache, Plan, TimeScale};
use crate::workload::{WorkloadKind, WorkloadSpec};

pub struct Options {
    /// Clients per slot.
    pub load: usize,
    /// Requests each client sends.
    pub requests: usize,
    pub scale: TimeScale,
    pub corral: PathBuf,
}

/// Handoffs (milliseconds) and how many requests were served, for one path.
struct Measured {
    handoffs_ms: Vec<f64>,
    served: usize,
    /// Through corral: the freed slots it handed to waiting requests, taken and declined.
    handed: Option<(u64, u64)>,
}

pub async fn run(opts: Options) -> Result<String, String> {
    let plan = Plan::for_workload(&WorkloadSpec::default_for(WorkloadKind::LongChat));
    let direct = measure(&opts, &plan, false).await?;
    let through = measure(&opts, &plan, true).await?;
    Ok(report(&opts, &plan, &direct, &through))
}

async fn measure(opts: &Options, plan: &Plan, through_corral: bool) -> Result<Measured, String> {
    let fleet = Fleet::start(plan, opts.scale, StandinKind::Ollama, HostCache::of(0)).await?;
    let corral = match through_corral {
        true => Some(CorralProcess::start(&opts.corral, &fleet, opts.scale, "", None).await?),
        false => None,
    };
    // Each client's target: corral, or one node, as many clients per node as `load` per slot.
    let targets: Vec<String> = fleet
        .nodes
        .iter()
        .zip(&plan.nodes)
        .flat_map(|(node, spec)| {
            let url = corral
                .as_ref()
                .map_or_else(|| node.url(), |c| c.url.clone());
            std::iter::repeat_n(url, spec.slots * opts.load)
        })
        .collect();
    let client = reqwest::Client::new();
    let clients = targets.into_iter().enumerate().map(|(c, url)| {
        let client = client.clone();
        let requests = opts.requests;
        tokio::spawn(async move {
            for r in 0..requests {
                // A new conversation each time: every request is as short as the last.
                let body = json!({
                    "model": CHAT_MODEL, "stream": false,
                    "options": { "num_predict": 8 },
                    "messages": [{ "role": "user", "content": format!("client {c} request {r}: hello") }],
                });
                let resp = client
                    .post(format!("{url}/api/chat"))
                    .json(&body)
                    .send()
                    .await
                    .map_err(|e| format!("{url}: {e}"))?;
                if !resp.status().is_success() {
                    return Err(format!("{url}: status {}", resp.status()));
                }
                resp.bytes().await.map_err(|e| format!("{url}: {e}"))?;
            }
            Ok::<(), String>(())
        })
    });
    for done in futures::future::join_all(clients).await {
        done.map_err(|e| format!("a client task failed: {e}"))??;
    }
    let handed = match &corral {
        Some(corral) => Some(corral.handoffs().await?),
        None => None,
    };
    drop(corral);
    let handoffs_ms = (fleet.nodes.iter())
        .flat_map(|n| n.handoffs())
        .map(|d: Duration| d.as_secs_f64() * 1000.0)
        .collect();
    let served = fleet.logs().iter().map(Vec::len).sum();
    Ok(Measured {
        handoffs_ms,
        served,
        handed,
    })
}

fn report(opts: &Options, plan: &Plan, direct: &Measured, through: &Measured) -> String {
    let slots: usize = plan.nodes.iter().map(|n| n.slots).sum();
    let mut out = format!(
        "{} clients on {slots} slots ({} per slot), {} requests each, time scale {}\n\n\
         | queue | requests | handoffs | p50 ms | p90 ms | p99 ms | max ms |\n\
         | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n",
        slots * opts.load,
        opts.load,
        opts.requests,
        opts.scale.0,
    );
    for (name, m) in [("the node's own", direct), ("corral's", through)] {
        let mut v = m.handoffs_ms.clone();
        v.sort_by(f64::total_cmp);
        let q = |p: f64| {
            v.get(((v.len() as f64 - 1.0) * p).round() as usize)
                .copied()
        };
        let cell = |x: Option<f64>| x.map_or("-".to_string(), |x| format!("{x:.3}"));
        out.push_str(&format!(
            "| {name} | {} | {} | {} | {} | {} | {} |\n",
            m.served,
            v.len(),
            cell(q(0.5)),
            cell(q(0.9)),
            cell(q(0.99)),
            cell(v.last().copied()),
        ));
    }
    if let Some((taken, declined)) = through.handed {
        out.push_str(&format!(
            "\ncorral handed {} freed slots to waiting requests: {taken} taken, {declined} declined \
             (`corral_handoffs_total`)\n",
            taken + declined
        ));
    }
    out
}
