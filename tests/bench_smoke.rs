//! The replay benchmark runs end to end on a tiny workload: every workload through all five
//! policies, corral as its own process, charts drawn. It checks what the benchmark must get
//! right to be worth reading (every turn served, the nodes' logs and the replies agreeing),
//! never how fast anything was.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const POLICIES: [&str; 5] = [
    "random",
    "round-robin",
    "least-connections",
    "sticky-hash",
    "corral",
];
const WORKLOADS: [&str; 4] = ["long-chat", "shared-system", "model-mix", "overload"];
const CONVERSATIONS: u64 = 2;
const TURNS: u64 = 2;

#[test]
fn replay_serves_every_turn_through_every_policy() {
    let out = tempfile::tempdir().expect("a temporary directory");
    run_replay(out.path());

    let text = std::fs::read_to_string(out.path().join("replay.json")).expect("replay.json");
    let report: serde_json::Value = serde_json::from_str(&text).expect("replay.json is JSON");
    let workloads = report["workloads"].as_array().expect("a list of workloads");
    let names: Vec<&str> = workloads
        .iter()
        .filter_map(|w| w["spec"]["kind"].as_str())
        .collect();
    assert_eq!(names, WORKLOADS);
    for w in workloads {
        check_workload(w);
    }
    let markdown = std::fs::read_to_string(out.path().join("replay.md")).expect("replay.md");
    assert!(markdown.contains("| corral |"), "{markdown}");
    for chart in [
        "replay-warm-share.png",
        "replay-ttft-follow-up.png",
        "replay-long-chat-ttft-cdf.png",
        "replay-model-mix-churn.png",
    ] {
        let bytes = std::fs::read(out.path().join(chart)).expect("the chart exists");
        assert!(bytes.starts_with(b"\x89PNG"), "{chart} is a PNG");
    }
}

#[test]
fn a_traced_replay_records_where_each_turn_went_and_why_corral_chose_it() {
    let out = tempfile::tempdir().expect("a temporary directory");
    let trace = tempfile::tempdir().expect("a temporary directory");
    let args = [
        "--workload",
        "long-chat",
        "--policy",
        "corral",
        "--policy",
        "sticky-hash",
        "--conversations",
        "2",
        "--seed",
        "3",
        "--no-plots",
    ];
    run_replay_with(out.path(), &args, Some(trace.path()));
    let rows = |policy: &str| {
        let path = trace.path().join(format!("long-chat-seed3-{policy}.csv"));
        let text = std::fs::read_to_string(&path).expect("a trace per policy");
        let mut lines = text.lines();
        let header: Vec<&str> = lines.next().expect("a header").split(',').collect();
        let column = |name: &str| header.iter().position(|h| *h == name).expect(name);
        let (node, explain) = (column("node"), column("explain"));
        lines
            .map(|line| {
                let fields: Vec<&str> = line.split(',').collect();
                assert_eq!(fields.len(), header.len(), "{line}");
                (fields[node].to_string(), fields[explain].to_string())
            })
            .collect::<Vec<_>>()
    };
    let corral = rows("corral");
    assert_eq!(corral.len() as u64, 2 * TURNS, "every turn traced");
    for (node, explain) in &corral {
        // X-Fleet-Explain lists the chosen node first, with its scores.
        assert!(
            explain.starts_with(&format!("{node} total=")),
            "{node}: {explain}"
        );
    }
    let hash = rows("sticky-hash");
    assert_eq!(hash.len() as u64, 2 * TURNS);
    assert!(
        hash.iter()
            .all(|(node, explain)| !node.is_empty() && explain.is_empty())
    );
}

fn check_workload(w: &serde_json::Value) {
    let kind = w["spec"]["kind"].as_str().unwrap_or("?");
    let policies = w["policies"].as_array().expect("a list of policies");
    let names: Vec<&str> = policies
        .iter()
        .filter_map(|p| p["policy"].as_str())
        .collect();
    assert_eq!(names, POLICIES, "{kind}");
    for p in policies {
        let at = format!("{kind} / {}", p["policy"]);
        assert_eq!(p["turns"], CONVERSATIONS * TURNS, "{at}: every turn served");
        assert_eq!(p["errors"], 0, "{at}: no errors");
        assert_eq!(p["unsent"], 0, "{at}: no turn left unsent");
        assert_eq!(p["timed_out"], false, "{at}");
        assert_eq!(
            p["matched_in_logs"], p["turns"],
            "{at}: every turn found in its node's log"
        );
        assert_eq!(
            p["log_reply_disagreements"], 0,
            "{at}: logs and replies agree on cached tokens"
        );
        let prompt = p["follow_up_warm"]["prompt_tokens"].as_u64().unwrap_or(0);
        assert!(prompt > 0, "{at}: follow-ups were counted");
    }
}

/// The placement workload over two seeds, through a baseline, corral and corral one
/// conversation at a time: every turn served, corral's own counts of loads and evictions
/// scraped and equal to the nodes', and the table of the spread over seeds written.
#[test]
fn placement_runs_over_seeds_and_corral_counts_what_the_nodes_count() {
    let out = tempfile::tempdir().expect("a temporary directory");
    let args = [
        "--workload",
        "placement",
        "--policy",
        "sticky-hash,corral,corral-one-at-a-time",
        "--seeds",
        "1,2",
        "--conversations",
        "6",
        "--concurrency",
        "6",
        "--no-plots",
    ];
    run_replay_with(out.path(), &args, None);
    let text = std::fs::read_to_string(out.path().join("replay.json")).expect("replay.json");
    let report: serde_json::Value = serde_json::from_str(&text).expect("replay.json is JSON");
    let workloads = report["workloads"].as_array().expect("a list of workloads");
    let seeds: Vec<u64> = workloads
        .iter()
        .filter_map(|w| w["spec"]["seed"].as_u64())
        .collect();
    assert_eq!(seeds, [1, 2]);
    for w in workloads {
        for p in w["policies"].as_array().expect("policies") {
            let at = format!("seed {} / {}", w["spec"]["seed"], p["policy"]);
            assert_eq!(p["turns"], 6 * TURNS, "{at}: every turn served");
            let counts = &p["corral_counts"];
            if p["policy"] == "sticky-hash" {
                assert!(counts.is_null(), "{at}");
                continue;
            }
            assert_eq!(counts["loads"], p["cold_loads"], "{at}: loads agree");
            assert_eq!(counts["evictions"], p["evictions"], "{at}: evictions agree");
        }
    }
    let markdown = std::fs::read_to_string(out.path().join("replay.md")).expect("replay.md");
    assert!(
        markdown.contains("### placement over seeds 1, 2"),
        "{markdown}"
    );
}

#[test]
fn handoff_counts_a_handoff_for_every_slot_taken_again_on_both_queues() {
    let corral = Path::new(env!("CARGO_BIN_EXE_corral"));
    let out = Command::new(env!("CARGO_BIN_EXE_corral-bench"))
        .args([
            "handoff",
            "--requests",
            "3",
            "--time-scale",
            "200",
            "--corral",
        ])
        .arg(corral)
        .stderr(Stdio::inherit())
        .output()
        .expect("corral-bench runs");
    assert!(out.status.success(), "corral-bench handoff failed");
    let text = String::from_utf8(out.stdout).expect("UTF-8");
    // 24 clients on 12 slots, 3 requests each: 72 served; every slot served its first request
    // without a handoff before it.
    for queue in ["the node's own", "corral's"] {
        let row = text
            .lines()
            .find(|l| l.starts_with(&format!("| {queue} |")))
            .unwrap_or_else(|| panic!("a row for {queue}: {text}"));
        let cols: Vec<&str> = row.split('|').map(str::trim).collect();
        assert_eq!(cols[2], "72", "{row}");
        let handoffs: usize = cols[3].parse().expect("a count");
        assert!((72 - 12..72).contains(&handoffs), "{row}");
    }
}

/// Runs the benchmark binary on every workload, tiny.
fn run_replay(out: &Path) {
    let conversations = CONVERSATIONS.to_string();
    run_replay_with(
        out,
        &[
            "--seed",
            "7",
            "--conversations",
            &conversations,
            "--concurrency",
            "2",
        ],
        None,
    );
}

/// Runs `corral-bench replay` with tiny sizes and these arguments, tracing every turn into
/// `trace` where given, killing it if it outlives a generous deadline.
fn run_replay_with(out: &Path, args: &[&str], trace: Option<&Path>) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_corral-bench"));
    if let Some(dir) = trace {
        command.env("CORRAL_BENCH_TRACE", dir);
    }
    let mut child = command
        .args(["replay", "--time-scale", "200"])
        .args(["--turns", &TURNS.to_string()])
        .args(["--prompt-tokens", "400"])
        .args([
            "--followup-tokens",
            "20",
            "--reply-tokens",
            "4",
            "--think-secs",
            "1",
        ])
        .args(args)
        .arg("--out")
        .arg(out)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("corral-bench starts");
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                assert!(status.success(), "corral-bench replay failed: {status}");
                return;
            }
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(100)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("corral-bench replay did not finish within 120 s");
            }
        }
    }
}

#[test]
fn plot_hash_charts_a_build_against_the_hash_from_bench_hash_figures() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let json = dir.path().join("cells.json");
    // Two cells as scripts/bench-hash.py --json writes them; a seed without follow-ups has
    // nulls. The old runner's cell misses its warm bound by 6 points.
    let cell = |kind: &str, load: u32, mine: [f64; 3], hashed: [f64; 3]| {
        let figures = |[warm, p50, wall]: [f64; 3]| {
            serde_json::json!({
                "warm": [warm, warm + 2.0, null], "p50": [p50, p50 * 3.0, null],
                "p90": [p50, p50, p50], "mean": [p50, p50, p50], "wall": [wall, wall, wall],
                "errors": [0, 0, 0], "idle": [0, 0, 0],
            })
        };
        serde_json::json!({
            "workload": "long-chat", "kind": kind, "load": load, "slots_untold": false,
            "policies": { "now": figures(mine), "sticky-hash": figures(hashed) },
        })
    };
    let lines = [
        cell("ollama", 1, [80.0, 10.0, 2.0], [70.0, 20.0, 4.0]),
        cell("ollama-legacy", 2, [10.0, 30.0, 3.0], [16.0, 10.0, 3.0]),
    ];
    let text: Vec<String> = lines.iter().map(|l| l.to_string()).collect();
    std::fs::write(&json, text.join("\n") + "\n").expect("write the figures");
    let prefix = dir.path().join("told");
    let plot = |build: &str| {
        Command::new(env!("CARGO_BIN_EXE_corral-bench"))
            .args(["plot-hash", "--build", build, "--json"])
            .arg(&json)
            .arg("--out")
            .arg(&prefix)
            .output()
            .expect("corral-bench runs")
    };
    let out = plot("now");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Medians against medians (p50: 20 against 40 ms), the whisker seed by seed.
    assert!(
        stdout.contains("| Ollama 1x | 0.50x [0.50-0.50] | 0.50x [0.50-0.50] | 0.50x [0.50-0.50] | 0.50x [0.50-0.50] | +10.0 [+10.0 to +10.0] |"),
        "{stdout}"
    );
    assert!(
        stdout.contains("| old runner 2x | 3.00x [3.00-3.00] | 3.00x [3.00-3.00] | 3.00x [3.00-3.00] | 1.00x [1.00-1.00] | -6.0 [-6.0 to -6.0] |"),
        "{stdout}"
    );
    for chart in ["told-time.png", "told-warm.png"] {
        let bytes = std::fs::read(dir.path().join(chart)).expect("the chart is written");
        assert!(bytes.starts_with(b"\x89PNG"), "{chart} is a PNG");
    }
    // A build the figures do not hold is an error that names the builds they do.
    let out = plot("main");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("no figures for main (it has now, sticky-hash)"),
        "{stderr}"
    );
}
