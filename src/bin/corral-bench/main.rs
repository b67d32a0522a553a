//! `corral-bench`: the measurements behind docs/benchmarks.md.
//!
//! - `fairness` measures a person's chat beside a key running 40 agent conversations, with
//!   each under its own key and both under one.
//! - `handoff` measures how long a node's slot stays free while requests wait for it, through
//!   corral's queue and the nodes' own.
//! - `replicas` runs 1, 2 and 4 corral replicas in front of one fleet, alone and sharing
//!   state through Redis, with each conversation's turns alternating between them.
//! - `replay` runs multi-turn workloads against a simulated fleet through corral and four
//!   baseline policies in one run, and reports warm shares, TTFT, model churn and throughput.
//! - `plot-hash` charts one corral build against the client-side hash from
//!   scripts/bench-hash.py's per-seed figures.
//! - `backend`, `bare-pingora`, `make-body`, `stream-probe`, `free-port` and
//!   `overhead-report` are the parts scripts/bench-overhead.sh uses to compare corral with a
//!   bare Pingora pass-through, nginx and a direct connection.

mod backend;
mod bare;
mod client;
mod embed;
mod fairness;
mod fleet;
mod handoff;
mod hash_plot;
mod overhead;
mod plot;
mod policy;
mod probe;
mod replay;
mod replicas;
mod report;
mod rng;
mod suite;
mod workload;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand};

use fleet::TimeScale;
use policy::Policy;
use workload::{Overrides, WorkloadKind};

/// The allocator corral runs on (src/main.rs), so that `bare-pingora`, the floor corral is
/// measured against, differs from it by the proxy's work and not by the allocator.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(name = "corral-bench", about = "Benchmarks for corral")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Replay multi-turn workloads through corral and the baseline policies.
    Replay(Box<ReplayArgs>),
    /// Serve an in-memory Ollama-shaped backend (for the overhead measurement).
    Backend {
        /// Loopback address to listen on.
        #[arg(long, default_value = "127.0.0.1:11500")]
        listen: SocketAddr,
        #[arg(long, default_value_t = 1)]
        threads: usize,
        /// Content chunks in a streamed reply (a header can ask for another number).
        #[arg(long, default_value_t = 16)]
        chunks: usize,
    },
    /// Serve Pingora's own proxy loop with one fixed peer: the floor corral is measured
    /// against.
    BarePingora {
        /// Loopback address to listen on.
        #[arg(long)]
        listen: SocketAddr,
        /// The backend every request goes to.
        #[arg(long)]
        upstream: SocketAddr,
        #[arg(long, default_value_t = 1)]
        threads: usize,
    },
    /// Write a chat body of about this many bytes to standard output.
    MakeBody {
        #[arg(long)]
        bytes: usize,
        #[arg(long)]
        stream: bool,
    },
    /// Measure how long streamed chunks take from the backend to here, through a URL.
    StreamProbe {
        /// The backend or a proxy in front of it.
        #[arg(long)]
        url: String,
        /// Name of the target in the CSV line printed.
        #[arg(long)]
        target: String,
        #[arg(long, default_value_t = 20)]
        requests: usize,
        #[arg(long, default_value_t = 50)]
        chunks: usize,
        /// Pause between chunks, in microseconds.
        #[arg(long, default_value_t = 2000)]
        interval_us: u64,
    },
    /// One embedding batch to one node, against the same batch fanned out by corral.
    EmbedFanout {
        #[arg(long, default_value_t = 3)]
        nodes: usize,
        #[arg(long, default_value_t = 512)]
        inputs: usize,
        #[arg(long, default_value_t = 32)]
        chunk_size: usize,
        #[arg(long, default_value_t = 5)]
        runs: usize,
        /// Simulated embedding cost per token, microseconds.
        #[arg(long, default_value_t = 20)]
        prefill_us: u64,
        /// The corral binary (default: the one next to corral-bench).
        #[arg(long)]
        corral: Option<PathBuf>,
    },
    /// How long a slot stays free while requests wait for it: corral's queue against the
    /// nodes' own, on the replay fleet under closed-loop clients.
    Handoff {
        /// Clients per slot: 2 keeps about as many requests waiting as running.
        #[arg(long, default_value_t = 2)]
        load: usize,
        /// Requests each client sends, one after another.
        #[arg(long, default_value_t = 40)]
        requests: usize,
        #[arg(long, default_value_t = 40.0)]
        time_scale: f64,
        /// The corral binary (default: the one next to corral-bench).
        #[arg(long)]
        corral: Option<PathBuf>,
    },
    /// A person's chat beside a key that runs 40 agent conversations at once.
    Fairness {
        /// Runs of the four cases (person alone, agent alone, both under own keys, both
        /// under one key).
        #[arg(long, default_value_t = 3)]
        runs: usize,
        #[arg(long, default_value_t = 20.0)]
        time_scale: f64,
        /// The corral binary (default: the one next to corral-bench).
        #[arg(long)]
        corral: Option<PathBuf>,
        /// corral's `weights.move_cost` (0, its default, leaves it off).
        #[arg(long, default_value_t = 0.0)]
        move_cost: f64,
        /// corral replicas; more than one share a redis-server, each request to the next.
        #[arg(long, default_value_t = 1)]
        replicas: usize,
        /// Their `shared_state.timeout`, in microseconds (corral's default: 2 ms).
        #[arg(long, default_value_t = 2000)]
        store_timeout_us: u64,
    },
    /// 1, 2 and 4 corral replicas in front of one fleet, alone and sharing a redis-server.
    Replicas {
        /// Replica counts to run (comma-separated).
        #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
        replicas: Vec<usize>,
        /// Workload seeds (comma-separated): every cell runs once per seed.
        #[arg(long, value_delimiter = ',', default_value = "1,2,3")]
        seeds: Vec<u64>,
        #[arg(long, default_value_t = 2)]
        node_slots: usize,
        /// Each node's host prompt cache, in tokens.
        #[arg(long, default_value_t = 40_000)]
        cache_ram_tokens: u32,
        #[arg(long, default_value_t = 40.0)]
        time_scale: f64,
        /// The corral binary (default: the one next to corral-bench).
        #[arg(long)]
        corral: Option<PathBuf>,
    },
    /// Print a free loopback port.
    FreePort,
    /// Chart one corral build against the client-side hash, cell by cell, from
    /// `scripts/bench-hash.py --json`'s figures: `<out>-time.png` and `<out>-warm.png`.
    PlotHash {
        /// The file `bench-hash.py --json` wrote (one cell a line).
        #[arg(long)]
        json: PathBuf,
        /// The build to chart, as bench-hash.py named it (`--corral NAME=...`).
        #[arg(long, default_value = "corral")]
        build: String,
        /// The charts' title, before what each shows.
        #[arg(long, default_value = "corral against the hash")]
        title: String,
        /// The build's name on the charts (default: `--build`).
        #[arg(long)]
        label: Option<String>,
        /// Path and name the charts' files start with.
        #[arg(long)]
        out: PathBuf,
    },
    /// Turn the overhead script's CSV into tables, ratios, goals and a chart.
    OverheadReport {
        #[arg(long)]
        csv: PathBuf,
        #[arg(long)]
        plot: Option<PathBuf>,
    },
}

#[derive(clap::Args)]
struct ReplayArgs {
    /// Workloads to run (repeat the flag, or give a comma-separated list). Default: all.
    #[arg(long = "workload", value_enum, value_delimiter = ',')]
    workloads: Vec<WorkloadKind>,
    /// Policies to compare. Default: all five.
    #[arg(long = "policy", value_enum, value_delimiter = ',')]
    policies: Vec<Policy>,
    /// Real-hardware durations are divided by this to get simulated ones.
    #[arg(long, default_value_t = 40.0)]
    time_scale: f64,
    /// Where replay.json and replay.md are written.
    #[arg(long, default_value = "target/bench")]
    out: PathBuf,
    /// Where the PNG charts are written (default: --out).
    #[arg(long)]
    plots: Option<PathBuf>,
    /// Skip the charts.
    #[arg(long)]
    no_plots: bool,
    /// The corral binary (default: the one next to corral-bench).
    #[arg(long)]
    corral: Option<PathBuf>,
    /// Overrides for every selected workload (defaults differ per workload).
    #[arg(long)]
    conversations: Option<usize>,
    #[arg(long)]
    turns: Option<usize>,
    /// Conversations in progress at once.
    #[arg(long)]
    concurrency: Option<usize>,
    /// Tokens of the first turn's context (document, system prompt or first message).
    #[arg(long)]
    prompt_tokens: Option<u32>,
    /// Tokens of each later user message.
    #[arg(long)]
    followup_tokens: Option<u32>,
    #[arg(long)]
    reply_tokens: Option<u32>,
    /// A user's pause between turns, in real-hardware seconds.
    #[arg(long)]
    think_secs: Option<f64>,
    #[arg(long)]
    seed: Option<u64>,
    /// Run each workload once per seed (comma-separated), with a table of the spread.
    #[arg(long, value_delimiter = ',')]
    seeds: Vec<u64>,
    /// Slots (`OLLAMA_NUM_PARALLEL`) of every node, instead of the fleet's own.
    #[arg(long)]
    node_slots: Option<usize>,
    /// Leave every node's slots out of corral's configuration: it learns them from replies.
    #[arg(long)]
    slots_untold: bool,
    /// Start every node with no model loaded (the first requests decide where models load).
    #[arg(long)]
    cold_start: bool,
    /// Run the chat workloads on three equal nodes (each the fleet's `gpu` desktop) instead
    /// of four of different speeds: where a client-side hash is strongest.
    #[arg(long)]
    equal_nodes: bool,
    /// The real server every stand-in node follows: ollama-legacy (Ollama before 0.30),
    /// ollama (0.30.1 and later), llama-cpp, openai. corral is not told it.
    #[arg(long, default_value = "ollama-legacy")]
    node_kind: String,
    /// Host prompt cache of llama-server based kinds, in tokens (`--cache-ram`).
    #[arg(long, default_value_t = 0)]
    cache_ram_tokens: u32,
    /// llama-server's `--no-cache-idle-slots`: idle slots are not copied into the host cache
    /// when a task starts.
    #[arg(long)]
    no_cache_idle_slots: bool,
    /// The chat API clients use: ollama (`/api/chat`), openai (`/v1/chat/completions`),
    /// or auto: what the node kind's users speak (openai for llama-cpp and openai nodes).
    #[arg(long, default_value = "auto")]
    api: String,
    /// corral's `weights.move_cost` (0, its default, leaves deciding in seconds off).
    #[arg(long, default_value_t = 0.0)]
    move_cost: f64,
}

fn main() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let cli = Cli::parse();
    if let Err(e) = run(cli.command) {
        eprintln!("corral-bench: {e}");
        std::process::exit(1);
    }
}

fn run(command: Command) -> Result<(), String> {
    match command {
        Command::Replay(args) => replay(*args),
        Command::Backend {
            listen,
            threads,
            chunks,
        } => backend::serve(listen, threads, chunks),
        Command::BarePingora {
            listen,
            upstream,
            threads,
        } => bare::serve(listen, upstream, threads),
        Command::MakeBody { bytes, stream } => {
            use std::io::Write;
            std::io::stdout()
                .write_all(&backend::chat_body(bytes, stream))
                .map_err(|e| format!("cannot write the body: {e}"))
        }
        Command::StreamProbe {
            url,
            target,
            requests,
            chunks,
            interval_us,
        } => {
            let opts = probe::ProbeOptions {
                url,
                requests,
                chunks,
                interval: Duration::from_micros(interval_us),
            };
            let delays = runtime()?.block_on(probe::run(&opts))?;
            println!("{}", probe::csv_line(&target, &delays));
            Ok(())
        }
        Command::EmbedFanout {
            nodes,
            inputs,
            chunk_size,
            runs,
            prefill_us,
            corral,
        } => {
            if nodes == 0 || runs == 0 || chunk_size == 0 {
                return Err("--nodes, --runs and --chunk-size must be at least 1".into());
            }
            let opts = embed::Options {
                nodes,
                inputs,
                chunk_size,
                runs,
                prefill_us,
                corral: match corral {
                    Some(path) => path,
                    None => fleet::sibling_corral()?,
                },
            };
            print!("{}", runtime()?.block_on(embed::run(opts))?);
            Ok(())
        }
        Command::Fairness {
            runs,
            time_scale,
            corral,
            move_cost,
            replicas,
            store_timeout_us,
        } => {
            if runs == 0 || time_scale <= 0.0 || replicas == 0 {
                return Err("--runs, --time-scale and --replicas must be above 0".into());
            }
            let opts = fairness::Options {
                runs,
                move_cost,
                replicas,
                store_timeout: Duration::from_micros(store_timeout_us),
                scale: TimeScale(time_scale),
                corral: match corral {
                    Some(path) => path,
                    None => fleet::sibling_corral()?,
                },
            };
            print!("{}", runtime()?.block_on(fairness::run(opts))?);
            Ok(())
        }
        Command::Handoff {
            load,
            requests,
            time_scale,
            corral,
        } => {
            if load == 0 || requests == 0 || time_scale <= 0.0 {
                return Err("--load, --requests and --time-scale must be above 0".into());
            }
            let opts = handoff::Options {
                load,
                requests,
                scale: TimeScale(time_scale),
                corral: match corral {
                    Some(path) => path,
                    None => fleet::sibling_corral()?,
                },
            };
            print!("{}", runtime()?.block_on(handoff::run(opts))?);
            Ok(())
        }
        Command::Replicas {
            replicas,
            seeds,
            node_slots,
            cache_ram_tokens,
            time_scale,
            corral,
        } => {
            if replicas.contains(&0) || seeds.is_empty() || node_slots == 0 || time_scale <= 0.0 {
                return Err(
                    "--replicas, --node-slots and --time-scale must be above 0, and a seed given"
                        .into(),
                );
            }
            let opts = replicas::Options {
                replicas,
                seeds,
                node_slots,
                cache_ram_tokens,
                scale: TimeScale(time_scale),
                corral: match corral {
                    Some(path) => path,
                    None => fleet::sibling_corral()?,
                },
            };
            print!("{}", runtime()?.block_on(replicas::run(opts))?);
            Ok(())
        }
        Command::FreePort => {
            println!("{}", fleet::free_port()?);
            Ok(())
        }
        Command::PlotHash {
            json,
            build,
            title,
            label,
            out,
        } => {
            let label = label.as_deref().unwrap_or(&build);
            print!("{}", hash_plot::run(&json, &build, label, &title, &out)?);
            Ok(())
        }
        Command::OverheadReport { csv, plot } => {
            print!("{}", overhead::report(&csv, plot.as_deref())?);
            Ok(())
        }
    }
}

fn replay(args: ReplayArgs) -> Result<(), String> {
    if !(args.time_scale.is_finite() && args.time_scale > 0.0) {
        return Err("--time-scale must be a positive number".into());
    }
    let workloads = if args.workloads.is_empty() {
        WorkloadKind::ALL.to_vec()
    } else {
        args.workloads
    };
    let policies = if args.policies.is_empty() {
        Policy::ALL.to_vec()
    } else {
        args.policies
    };
    let plots = match (args.no_plots, args.plots) {
        (true, _) => None,
        (false, Some(dir)) => Some(dir),
        (false, None) => Some(args.out.clone()),
    };
    let opts = suite::Options {
        workloads,
        policies,
        overrides: Overrides {
            conversations: args.conversations,
            turns: args.turns,
            concurrency: args.concurrency,
            prompt_tokens: args.prompt_tokens,
            followup_tokens: args.followup_tokens,
            reply_tokens: args.reply_tokens,
            think_secs: args.think_secs,
            seed: args.seed,
            node_slots: args.node_slots,
            slots_untold: args.slots_untold,
            cold_start: args.cold_start,
            equal_nodes: args.equal_nodes,
        },
        seeds: args.seeds,
        scale: TimeScale(args.time_scale),
        node_kind: corral::standin::StandinKind::parse(&args.node_kind).ok_or_else(|| {
            format!(
                "--node-kind {}: use ollama-legacy, ollama, llama-cpp or openai",
                args.node_kind
            )
        })?,
        host: fleet::HostCache {
            tokens: args.cache_ram_tokens,
            idle_slots: !args.no_cache_idle_slots,
        },
        api: match args.api.as_str() {
            "auto" => None,
            name => Some(
                crate::client::ChatApi::parse(name)
                    .ok_or_else(|| format!("--api {name}: use auto, ollama or openai"))?,
            ),
        },
        move_cost: args.move_cost,
        corral_bin: args.corral,
        out: args.out,
        plots,
    };
    let report = runtime()?.block_on(suite::run(opts))?;
    print!("{}", report.markdown());
    Ok(())
}

/// Two worker threads: the machines this runs on have two cores, shared with corral.
fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start a runtime: {e}"))
}
