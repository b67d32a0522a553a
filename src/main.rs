//! The `corral` binary: `corral -c conf/corral.yaml` runs the router in front of a fleet;
//! `corral demo` runs it in front of a built-in simulated fleet.

use std::path::Path;

use clap::{Parser, Subcommand};
use pingora_core::server::configuration::Opt;

use corral::config::Config;
#[cfg(feature = "demo")]
use corral::{config::NodeConfig, standin};

/// mimalloc instead of the system's malloc: see Cargo.toml. corral-bench runs its bare
/// Pingora on the same allocator, so that the two compare proxy work.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "corral",
    version,
    about = "A cache-aware load balancer for Ollama fleets"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    server: ServerFlags,
}

/// The flags corral passes on to Pingora's server. They are declared here, not taken from
/// Pingora's `Opt`, whose help texts are mislabelled (its `-u` reads "This is the base set of
/// command line arguments for a pingora-based service").
#[derive(clap::Args)]
struct ServerFlags {
    /// The configuration file: corral's keys and Pingora's server keys (see conf/corral.yaml)
    #[arg(short, long, value_name = "FILE")]
    conf: Option<String>,
    /// Check the configuration and exit
    #[arg(short, long)]
    test: bool,
    /// Run in the background
    #[arg(short, long)]
    daemon: bool,
    /// Take over the listening sockets of a running corral (graceful upgrade; send the old
    /// process SIGQUIT once this one waits)
    #[arg(short, long)]
    upgrade: bool,
}

impl From<ServerFlags> for Opt {
    fn from(flags: ServerFlags) -> Self {
        Opt {
            conf: flags.conf,
            test: flags.test,
            daemon: flags.daemon,
            upgrade: flags.upgrade,
            ..Opt::default()
        }
    }
}

#[derive(Subcommand)]
enum Command {
    /// Run in front of a built-in fleet of three simulated Ollama nodes.
    #[cfg(feature = "demo")]
    Demo {
        /// Where the router listens.
        #[arg(long, default_value = "127.0.0.1:11435")]
        listen: String,
    },
}

fn main() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        eprintln!("corral: {e}");
        std::process::exit(2);
    }
}

fn run(cli: Cli) -> Result<(), String> {
    let config = match &cli.server.conf {
        Some(path) => Config::load(Path::new(path))?,
        None => Config::default(),
    };
    #[cfg(feature = "demo")]
    let demo = cli.command.is_some();
    let config = match cli.command {
        #[cfg(feature = "demo")]
        Some(Command::Demo { listen }) => demo_config(config, listen)?,
        None if config.nodes.is_empty() => {
            return Err(format!(
                "no nodes configured: pass -c conf/corral.yaml (see conf/corral.yaml){}",
                if cfg!(feature = "demo") {
                    ", or try `corral demo`"
                } else {
                    ""
                }
            ));
        }
        None => config,
    };
    config.validate()?;
    if cli.server.test {
        println!(
            "corral: configuration is valid ({} nodes)",
            config.nodes.len()
        );
    }
    // The demo's banner once the server is built: its addresses are then known to be free.
    #[cfg(feature = "demo")]
    let banner = demo.then(|| config.clone());
    let server = corral::server::build(config, cli.server.into())?;
    #[cfg(feature = "demo")]
    if let Some(config) = banner {
        print_demo_banner(&config);
    }
    server.run_forever()
}

/// The configuration with the built-in simulated fleet as its nodes.
#[cfg(feature = "demo")]
fn demo_config(mut config: Config, listen: String) -> Result<Config, String> {
    config.listen = listen;
    config.nodes = start_demo_fleet()?;
    // The demo shows scoring from the first request: poll and check often.
    config.poll.interval = std::time::Duration::from_millis(500);
    config.health.interval = std::time::Duration::from_secs(1);
    Ok(config)
}

/// Starts the simulated nodes on a runtime of their own, on free loopback ports.
#[cfg(feature = "demo")]
fn start_demo_fleet() -> Result<Vec<NodeConfig>, String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = match tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
        {
            Ok(rt) => rt,
            Err(e) => {
                let _ = tx.send(Err(e.to_string()));
                return;
            }
        };
        runtime.block_on(async move {
            let configs = standin::demo_fleet();
            match standin::start_fleet(configs.clone()).await {
                Ok(nodes) => {
                    let list = configs
                        .iter()
                        .zip(&nodes)
                        .map(|(cfg, node)| {
                            let mut n = NodeConfig::new(node.name(), &node.url());
                            n.memory_gb = Some(cfg.memory_bytes as f64 / 1e9);
                            n.num_parallel = cfg.num_parallel;
                            n
                        })
                        .collect();
                    let _ = tx.send(Ok(list));
                    // Serve until the process ends.
                    std::future::pending::<()>().await;
                    drop(nodes);
                }
                Err(e) => {
                    let _ = tx.send(Err(e.to_string()));
                }
            }
        });
    });
    rx.recv().map_err(|e| e.to_string())?
}

#[cfg(feature = "demo")]
fn print_demo_banner(config: &Config) {
    println!(
        "corral demo: a simulated fleet of {} nodes",
        config.nodes.len()
    );
    for n in &config.nodes {
        println!(
            "  {:<8} {}  {:.0} GB, {} slots",
            n.name,
            n.url,
            n.memory_gb.unwrap_or(0.0),
            n.num_parallel
        );
    }
    let addr = &config.listen;
    println!("router on http://{addr} -- try:");
    println!(
        "  curl -si http://{addr}/api/chat -d '{{\"model\":\"llama3:8b\",\"messages\":[{{\"role\":\"user\",\"content\":\"Hello\"}}],\"stream\":false}}' | grep -i x-fleet"
    );
    println!("  curl -s http://{addr}/api/tags");
    println!(
        "  curl -N http://{addr}/api/chat -H 'X-Fleet-Explain: 1' -d '{{\"model\":\"llama3:8b\",\"messages\":[{{\"role\":\"user\",\"content\":\"Hi\"}}]}}'"
    );
}
