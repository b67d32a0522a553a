//! `corral-bench fairness`: a person chatting beside a key that runs many agent
//! conversations at once.
//!
//! Three equal nodes of two slots (stand-ins of current Ollama, slots told, a host prompt
//! cache each). The person's key runs 3 conversations of 4 short turns, a pause between
//! turns; the agent's key runs 40 conversations at once, each a 6,000-character task and 4
//! follow-ups sent as soon as a reply ends. Four runs on a fresh fleet and corral each: the
//! person alone, the agent alone, both under their own keys, and both under one key (every
//! request one client, as corral served them before it shared slots between clients). The
//! bounds: with both running, the person's TTFT p90 at most its p90 alone plus one service
//! time (the slot time of an agent turn alone: its wall time x slots / turns), and the agent's
//! wall time at most 1.1x its time alone plus the person's own work (the person's turns'
//! time, alone).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use corral::standin::StandinKind;

use crate::client::{ChatApi, chat, chat_body};
use crate::fleet::{CHAT_MODEL, CorralProcess, Fleet, HostCache, Plan, TimeScale};
use crate::workload::{WorkloadKind, WorkloadSpec};
use corral::standin::RedisServer;

pub struct Options {
    /// Runs of the four cases, one after another.
    pub runs: usize,
    pub scale: TimeScale,
    pub corral: PathBuf,
    /// corral's `weights.move_cost` (0, its default, leaves it off).
    pub move_cost: f64,
    /// corral replicas sharing a redis-server (1: one corral, no store); each request goes
    /// to the next one.
    pub replicas: usize,
    /// Their `shared_state.timeout`.
    pub store_timeout: Duration,
}

const PERSON_KEY: &str = "key-person";
const AGENT_KEY: &str = "key-agent";
const AGENTS: usize = 40;
const AGENT_TURNS: usize = 5;
const PERSON_CONVERSATIONS: usize = 3;
const PERSON_TURNS: usize = 4;
/// The person's pause between a reply and its next turn, in real seconds.
const PERSON_THINK_SECS: f64 = 8.0;
/// The person starts this long (real seconds) after the agent, when the agent's
/// conversations fill every slot.
const PERSON_START_SECS: f64 = 5.0;
const REPLY_TOKENS: u32 = 150;
/// Each node's host prompt cache, in tokens.
const CACHE_RAM_TOKENS: u32 = 40_000;

#[derive(Clone, Copy, PartialEq)]
enum Case {
    PersonAlone,
    AgentAlone,
    OwnKeys,
    OneKey,
}

impl Case {
    fn name(self) -> &'static str {
        match self {
            Case::PersonAlone => "person alone",
            Case::AgentAlone => "agent alone",
            Case::OwnKeys => "both, own keys",
            Case::OneKey => "both, one key",
        }
    }
}

/// What one case measured.
#[derive(Default)]
struct Measured {
    /// The person's turns: time to first token, and the whole turn.
    person_ttft: Vec<f64>,
    person_turns: Vec<f64>,
    /// The agent's turns, whole, and its work's wall time from its first request.
    agent_turns: Vec<f64>,
    agent_wall: Option<f64>,
    errors: usize,
    /// Calls to the shared store that failed or ran past its bound (replicas only).
    store_errors: Option<u64>,
}

pub async fn run(opts: Options) -> Result<String, String> {
    let mut spec = WorkloadSpec::default_for(WorkloadKind::LongChat);
    spec.equal_nodes = true;
    spec.node_slots = Some(2);
    let plan = Plan::for_workload(&spec);
    let cases = [
        Case::PersonAlone,
        Case::AgentAlone,
        Case::OwnKeys,
        Case::OneKey,
    ];
    let mut runs = Vec::new();
    for run in 0..opts.runs {
        let mut measured = Vec::new();
        for case in cases {
            eprintln!(
                "corral-bench: fairness run {} of {}: {}",
                run + 1,
                opts.runs,
                case.name()
            );
            measured.push(measure(&opts, &plan, case, run).await?);
        }
        runs.push(measured);
    }
    let slots = plan.nodes.iter().map(|n| n.slots).sum();
    Ok(report(&opts, slots, &cases, &runs))
}

async fn measure(opts: &Options, plan: &Plan, case: Case, run: usize) -> Result<Measured, String> {
    let fleet = Fleet::start(
        plan,
        opts.scale,
        StandinKind::Ollama,
        HostCache::of(CACHE_RAM_TOKENS),
    )
    .await?;
    let mut keys = format!(
        "api_keys:\n  - {{name: person, key: {PERSON_KEY}}}\n  - {{name: agent, key: {AGENT_KEY}}}\n"
    );
    if opts.move_cost > 0.0 {
        keys.push_str(&format!("weights:\n  move_cost: {}\n", opts.move_cost));
    }
    let store = match opts.replicas > 1 {
        true => Some(RedisServer::start().await?),
        false => None,
    };
    if let Some(store) = &store {
        keys.push_str(&format!(
            "shared_state:\n  url: {}\n  timeout: {}us\n",
            store.url(),
            opts.store_timeout.as_micros()
        ));
    }
    let mut corrals = Vec::new();
    for _ in 0..opts.replicas.max(1) {
        let corral =
            CorralProcess::start(&opts.corral, &fleet, opts.scale, &keys, Some(PERSON_KEY)).await?;
        corrals.push(corral);
    }
    let urls: Vec<String> = corrals.iter().map(|c| c.url.clone()).collect();
    let agent_key = match case {
        Case::OneKey => PERSON_KEY,
        _ => AGENT_KEY,
    };
    let started = Instant::now();
    let agent = (case != Case::PersonAlone).then(|| {
        let urls = urls.clone();
        tokio::spawn(agent_work(urls, agent_key, run, opts.scale))
    });
    let person = (case != Case::AgentAlone).then(|| {
        let urls = urls.clone();
        let scale = opts.scale;
        tokio::spawn(async move {
            if case != Case::PersonAlone {
                tokio::time::sleep(scale.of_secs(PERSON_START_SECS)).await;
            }
            person_work(urls, run, scale).await
        })
    });
    let mut m = Measured::default();
    if let Some(agent) = agent {
        let (turns, errors) = agent.await.map_err(|e| format!("agent task: {e}"))?;
        m.agent_wall = Some(started.elapsed().as_secs_f64());
        m.agent_turns = turns;
        m.errors += errors;
    }
    if let Some(person) = person {
        let (ttft, turns, errors) = person.await.map_err(|e| format!("person task: {e}"))?;
        m.person_ttft = ttft;
        m.person_turns = turns;
        m.errors += errors;
    }
    if store.is_some() {
        let mut errors = 0;
        for corral in &corrals {
            errors += corral.store_wait().await?.errors;
        }
        m.store_errors = Some(errors);
    }
    drop(corrals);
    drop(store);
    drop(fleet);
    Ok(m)
}

/// A client whose every request carries `key`.
fn keyed_client(key: &str) -> Result<reqwest::Client, String> {
    let mut headers = reqwest::header::HeaderMap::new();
    let value = format!("Bearer {key}")
        .parse()
        .map_err(|e| format!("key: {e}"))?;
    headers.insert(reqwest::header::AUTHORIZATION, value);
    reqwest::Client::builder()
        .default_headers(headers)
        .build()
        .map_err(|e| format!("client: {e}"))
}

/// One conversation of `turns` turns, each sent `think` after the last reply ended, turn t to
/// `urls[(offset + t) % urls.len()]`; returns each turn's time to first token and whole time,
/// in simulated seconds, and the errors.
async fn conversation(
    client: reqwest::Client,
    urls: Vec<String>,
    offset: usize,
    first: String,
    turns: usize,
    think: Duration,
    scale: TimeScale,
) -> (Vec<f64>, Vec<f64>, usize) {
    let (mut ttft, mut whole, mut errors) = (Vec::new(), Vec::new(), 0);
    let mut history: Vec<(String, String)> = vec![("user".into(), first)];
    let timeout = Duration::from_secs(600);
    for turn in 0..turns {
        let messages: Vec<(&str, &str)> = history
            .iter()
            .map(|(r, c)| (r.as_str(), c.as_str()))
            .collect();
        let body = chat_body(ChatApi::Ollama, CHAT_MODEL, &messages, REPLY_TOKENS);
        let url = &urls[(offset + turn) % urls.len().max(1)];
        match chat(&client, ChatApi::Ollama, url, body, timeout).await {
            Ok(reply) => {
                // Simulated seconds: real durations times the scale.
                if let Some(t) = reply.ttft {
                    ttft.push(t.as_secs_f64() * scale.0);
                }
                whole.push(reply.total.as_secs_f64() * scale.0);
                history.push(("assistant".into(), reply.content));
            }
            Err(e) => {
                eprintln!("corral-bench: fairness: {e}");
                errors += 1;
                return (ttft, whole, errors + turns - turn - 1);
            }
        }
        history.push(("user".into(), format!("Turn {turn}: go on, and say more.")));
        tokio::time::sleep(think).await;
    }
    (ttft, whole, errors)
}

async fn agent_work(
    urls: Vec<String>,
    key: &str,
    run: usize,
    scale: TimeScale,
) -> (Vec<f64>, usize) {
    let client = match keyed_client(key) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("corral-bench: fairness: {e}");
            return (Vec::new(), AGENTS * AGENT_TURNS);
        }
    };
    let tasks = (0..AGENTS).map(|a| {
        // About 6,000 characters, each task its own.
        let task = format!("Run {run}, agent task {a}. ") + &"Refactor this module. ".repeat(280);
        tokio::spawn(conversation(
            client.clone(),
            urls.clone(),
            a,
            task,
            AGENT_TURNS,
            Duration::ZERO,
            scale,
        ))
    });
    let (mut turns, mut errors) = (Vec::new(), 0);
    for done in futures::future::join_all(tasks).await {
        let (_, whole, e) = done.unwrap_or_else(|_| (Vec::new(), Vec::new(), AGENT_TURNS));
        turns.extend(whole);
        errors += e;
    }
    (turns, errors)
}

async fn person_work(
    urls: Vec<String>,
    run: usize,
    scale: TimeScale,
) -> (Vec<f64>, Vec<f64>, usize) {
    let client = match keyed_client(PERSON_KEY) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("corral-bench: fairness: {e}");
            return (Vec::new(), Vec::new(), PERSON_CONVERSATIONS * PERSON_TURNS);
        }
    };
    let think = scale.of_secs(PERSON_THINK_SECS);
    let chats = (0..PERSON_CONVERSATIONS).map(|c| {
        let first = format!("Run {run}, person's chat {c}: what should I cook tonight?");
        tokio::spawn(conversation(
            client.clone(),
            urls.clone(),
            c,
            first,
            PERSON_TURNS,
            think,
            scale,
        ))
    });
    let (mut ttft, mut whole, mut errors) = (Vec::new(), Vec::new(), 0);
    for done in futures::future::join_all(chats).await {
        let (t, w, e) = done.unwrap_or_else(|_| (Vec::new(), Vec::new(), PERSON_TURNS));
        ttft.extend(t);
        whole.extend(w);
        errors += e;
    }
    (ttft, whole, errors)
}

fn quantile(values: &[f64], p: f64) -> Option<f64> {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(((v.len() as f64 - 1.0) * p).round() as usize)
        .copied()
}

fn mean(values: &[f64]) -> Option<f64> {
    (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64)
}

fn report(opts: &Options, slots: usize, cases: &[Case], runs: &[Vec<Measured>]) -> String {
    let cell = |x: Option<f64>| x.map_or("-".to_string(), |x| format!("{x:.2}"));
    let mut out = format!(
        "Three equal nodes x 2 slots (current Ollama stand-ins, slots told), time scale {}, \
         move_cost {}, {} corral replica(s) (more than one: sharing a redis-server, each request \
         to the next, shared_state.timeout {:?}); times simulated (real hardware's), seconds.\n\
         person: {PERSON_CONVERSATIONS} conversations x {PERSON_TURNS} turns, \
         {PERSON_THINK_SECS} s pauses, from {PERSON_START_SECS} s; \
         agent: {AGENTS} conversations x {AGENT_TURNS} turns at once, 6,000-char tasks.\n\n\
         | run | case | person TTFT p50 | p90 | agent turn mean (with its wait) | agent wall | errors | store errors |\n\
         | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n",
        opts.scale.0, opts.move_cost, opts.replicas, opts.store_timeout,
    );
    let mut verdicts = String::new();
    for (r, measured) in runs.iter().enumerate() {
        for (case, m) in cases.iter().zip(measured) {
            out.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} | {} |\n",
                r + 1,
                case.name(),
                cell(quantile(&m.person_ttft, 0.5)),
                cell(quantile(&m.person_ttft, 0.9)),
                cell(mean(&m.agent_turns)),
                cell(m.agent_wall.map(|w| w * opts.scale.0)),
                m.errors,
                m.store_errors.map_or("-".to_string(), |e| e.to_string()),
            ));
        }
        let [alone, agent_alone, own, one] = measured.as_slice() else {
            continue;
        };
        // One service time: the slot time of an agent turn, alone (every slot busy all along).
        let service = agent_alone.agent_wall.unwrap_or(0.0) * opts.scale.0 * slots as f64
            / agent_alone.agent_turns.len().max(1) as f64;
        let person_work: f64 = alone.person_turns.iter().sum();
        let bound_p90 = quantile(&alone.person_ttft, 0.9).unwrap_or(0.0) + service;
        let wall_alone = agent_alone.agent_wall.unwrap_or(0.0) * opts.scale.0;
        let bound_wall = 1.1 * wall_alone + person_work;
        for (name, m) in [("own keys", own), ("one key", one)] {
            let p90 = quantile(&m.person_ttft, 0.9).unwrap_or(f64::INFINITY);
            let wall = m.agent_wall.unwrap_or(f64::INFINITY) * opts.scale.0;
            let verdict = |ok: bool| if ok { "met" } else { "**missed**" };
            verdicts.push_str(&format!(
                "| {} | {name} | {p90:.2} vs {bound_p90:.2}: {} | {wall:.1} vs {bound_wall:.1}: {} |\n",
                r + 1,
                verdict(p90 <= bound_p90),
                verdict(wall <= bound_wall),
            ));
        }
    }
    out.push_str(
        "\nBounds (issue 41): person TTFT p90 at most alone + one service time (an agent turn's \
         slot time, alone); agent wall \
         at most 1.1x alone + the person's own work.\n\n\
         | run | case | person p90 vs bound | agent wall vs bound |\n| --- | --- | --- | --- |\n",
    );
    out.push_str(&verdicts);
    out
}
