//! `corral-bench embed-fanout`: one batch of embedding inputs sent to one stand-in node,
//! against the same batch through corral, which splits it over every node holding the model.
//!
//! Stand-in nodes embed one request at a time per embedding model, as Ollama does
//! (`server/sched.go` loads embedding models with one parallel slot), at `prefill_us` per
//! token. Each run checks that corral's merged reply has the direct reply's vectors in the
//! same order before its time counts.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use corral::standin::{StandinConfig, StandinModel, StandinNode};
use serde_json::{Value, json};

const MODEL: &str = "nomic-embed-text:latest";

pub struct Options {
    pub nodes: usize,
    pub inputs: usize,
    pub chunk_size: usize,
    pub runs: usize,
    /// Simulated embedding cost per input token, in microseconds.
    pub prefill_us: u64,
    pub corral: PathBuf,
}

/// Kills the corral process when dropped.
struct Corral(Child, PathBuf);

impl Drop for Corral {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
        let _ = std::fs::remove_file(&self.1);
    }
}

pub async fn run(opts: Options) -> Result<String, String> {
    let mut nodes = Vec::new();
    for i in 0..opts.nodes {
        let mut cfg = StandinConfig::new(&format!("e{i}"));
        cfg.models = vec![StandinModel::new(MODEL, 274_000_000, 2048)];
        cfg.preload = vec![MODEL.to_string()];
        cfg.prefill_per_token = Duration::from_micros(opts.prefill_us);
        let node = StandinNode::start(cfg, "127.0.0.1:0".parse().map_err(|_| "addr")?)
            .await
            .map_err(|e| format!("stand-in: {e}"))?;
        nodes.push(node);
    }
    let port = crate::fleet::free_port()?;
    let mut yaml = format!(
        "threads: 2\ngrace_period_seconds: 0\ngraceful_shutdown_timeout_seconds: 1\n\
         pid_file: /tmp/corral-bench-{port}.pid\nupgrade_sock: /tmp/corral-bench-{port}.sock\n\
         listen: 127.0.0.1:{port}\nmetrics_listen: null\nadmin_listen: null\n\
         poll:\n  interval: 200ms\nembed_fanout:\n  chunk_size: {}\nnodes:\n",
        opts.chunk_size
    );
    for node in &nodes {
        yaml.push_str(&format!(
            "  - name: {}\n    url: {}\n    num_parallel: 1\n",
            node.name(),
            node.url()
        ));
    }
    let config = std::env::temp_dir().join(format!("corral-bench-embed-{port}.yaml"));
    std::fs::File::create(&config)
        .and_then(|mut f| f.write_all(yaml.as_bytes()))
        .map_err(|e| format!("cannot write {}: {e}", config.display()))?;
    let child = Command::new(&opts.corral)
        .arg("-c")
        .arg(&config)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", opts.corral.display()))?;
    let _corral = Corral(child, config);
    let url = format!("http://127.0.0.1:{port}");
    let client = reqwest::Client::new();
    wait_ready(&client, &url).await?;

    let mut direct = Vec::new();
    let mut fanned = Vec::new();
    for run in 0..opts.runs {
        // New texts every run: nothing is cached between runs.
        let inputs: Vec<String> = (0..opts.inputs)
            .map(|i| format!("run {run} input {i}: {}", "a sentence to embed. ".repeat(8)))
            .collect();
        let body = json!({ "model": MODEL, "input": inputs });
        let target = &nodes[run % nodes.len()];
        let (t_direct, whole) =
            timed(&client, &format!("{}/api/embed", target.url()), &body).await?;
        let (t_fanned, merged) = timed(&client, &format!("{url}/api/embed"), &body).await?;
        if merged["embeddings"] != whole["embeddings"] {
            return Err(format!(
                "run {run}: corral's merged vectors differ from one node's"
            ));
        }
        direct.push(t_direct);
        fanned.push(t_fanned);
    }
    Ok(report(&opts, &direct, &fanned))
}

async fn wait_ready(client: &reqwest::Client, url: &str) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if let Ok(resp) = client.get(format!("{url}/api/ps")).send().await
            && resp.text().await.unwrap_or_default().contains(MODEL)
        {
            // Two more polls: every node has been read.
            tokio::time::sleep(Duration::from_millis(500)).await;
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err("corral did not list the model within 30 s".into())
}

async fn timed(client: &reqwest::Client, url: &str, body: &Value) -> Result<(f64, Value), String> {
    let started = Instant::now();
    let resp = client
        .post(url)
        .json(body)
        .send()
        .await
        .map_err(|e| format!("{url}: {e}"))?;
    if !resp.status().is_success() {
        return Err(format!("{url}: status {}", resp.status()));
    }
    let value: Value = resp.json().await.map_err(|e| format!("{url}: {e}"))?;
    Ok((started.elapsed().as_secs_f64() * 1000.0, value))
}

fn report(opts: &Options, direct: &[f64], fanned: &[f64]) -> String {
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let range = |v: &[f64]| {
        let min = v.iter().copied().fold(f64::INFINITY, f64::min);
        let max = v.iter().copied().fold(0.0, f64::max);
        format!("{min:.0}-{max:.0}")
    };
    let speedups: Vec<f64> = direct.iter().zip(fanned).map(|(d, f)| d / f).collect();
    format!(
        "{} inputs, {} nodes, chunks of {}, {} us/token, {} runs (vectors checked equal)\n\n\
         | path | median ms | range ms |\n| --- | ---: | ---: |\n\
         | one node, whole batch | {:.0} | {} |\n\
         | corral, fanned out | {:.0} | {} |\n\n\
         speed-up per run: median {:.2}x, range {:.2}x-{:.2}x\n",
        opts.inputs,
        opts.nodes,
        opts.chunk_size,
        opts.prefill_us,
        opts.runs,
        median(direct),
        range(direct),
        median(fanned),
        range(fanned),
        median(&speedups),
        speedups.iter().copied().fold(f64::INFINITY, f64::min),
        speedups.iter().copied().fold(0.0, f64::max),
    )
}
