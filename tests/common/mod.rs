//! Test harness: the real `corral` binary in front of stand-in nodes, all on loopback ports
//! picked at run time, all stopped when the test ends.
#![allow(dead_code)]

use std::io::Write;
use std::net::{SocketAddr, TcpListener};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use corral::standin::{RedisServer, StandinConfig, StandinModel, StandinNode};

pub const MODEL: &str = "llama3:8b";

/// A running `corral` process. Killed on drop.
pub struct Router {
    child: Child,
    pub addr: SocketAddr,
    _config: tempfile::NamedTempFile,
}

/// A node entry for the router's config.
pub struct NodeSpec {
    pub name: String,
    pub url: String,
    pub memory_gb: Option<f64>,
    pub num_parallel: usize,
    pub roles: Vec<String>,
    pub multiuser_cache: bool,
}

impl NodeSpec {
    pub fn of(node: &StandinNode, num_parallel: usize) -> NodeSpec {
        NodeSpec {
            name: node.name().to_string(),
            url: node.url(),
            memory_gb: None,
            num_parallel,
            roles: Vec::new(),
            multiuser_cache: node.config().multiuser_cache,
        }
    }

    pub fn memory(mut self, gb: f64) -> NodeSpec {
        self.memory_gb = Some(gb);
        self
    }

    pub fn role(mut self, role: &str) -> NodeSpec {
        self.roles.push(role.to_string());
        self
    }
}

/// The YAML a test router runs with: loopback listeners, fast polls and checks.
pub fn config_yaml(port: u16, nodes: &[NodeSpec], extra_yaml: &str) -> String {
    let mut yaml = format!(
        "listen: 127.0.0.1:{port}\n\
         pid_file: /tmp/corral-test-{port}.pid\nupgrade_sock: /tmp/corral-test-{port}.sock\n"
    );
    if !extra_yaml.contains("poll:") {
        yaml.push_str("poll:\n  interval: 100ms\n  timeout: 1s\n");
    }
    for (key, value) in [
        ("metrics_listen", "null"),
        ("admin_listen", "null"),
        ("threads", "1"),
        ("grace_period_seconds", "0"),
        ("graceful_shutdown_timeout_seconds", "1"),
    ] {
        if !extra_yaml.contains(key) {
            yaml.push_str(&format!("{key}: {value}\n"));
        }
    }
    if !extra_yaml.contains("health:") {
        yaml.push_str("health:\n  interval: 500ms\n");
    }
    yaml.push_str(extra_yaml);
    yaml.push_str("\nnodes:\n");
    for n in nodes {
        yaml.push_str(&format!("  - name: {}\n    url: {}\n", n.name, n.url));
        // 0: not told, as when `num_parallel` is left out.
        if n.num_parallel > 0 {
            yaml.push_str(&format!("    num_parallel: {}\n", n.num_parallel));
        }
        if let Some(gb) = n.memory_gb {
            yaml.push_str(&format!("    memory_gb: {gb}\n"));
        }
        if n.multiuser_cache {
            yaml.push_str("    multiuser_cache: true\n");
        }
        if !n.roles.is_empty() {
            yaml.push_str(&format!("    roles: [{}]\n", n.roles.join(", ")));
        }
    }
    yaml
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

impl Router {
    /// Starts corral with these nodes and extra YAML (top-level keys), and waits until it
    /// has polled every node.
    pub async fn start(nodes: Vec<NodeSpec>, extra_yaml: &str) -> Router {
        Router::start_with_args(nodes, extra_yaml, &[]).await
    }

    /// As [`Router::start`], with extra command-line arguments for `corral`.
    pub async fn start_with_args(nodes: Vec<NodeSpec>, extra_yaml: &str, args: &[&str]) -> Router {
        let port = free_port();
        let router = Router::spawn(port, &config_yaml(port, &nodes, extra_yaml), args).await;
        router.wait_polled().await;
        router
    }

    /// As [`Router::start`], returning as soon as corral listens.
    pub async fn start_at_once(nodes: Vec<NodeSpec>, extra_yaml: &str) -> Router {
        let port = free_port();
        Router::spawn(port, &config_yaml(port, &nodes, extra_yaml), &[]).await
    }

    /// As [`Router::start`], with the `nodes:` list's entries written by the caller (keys
    /// that [`NodeSpec`] does not have, such as `ca_file`).
    pub async fn start_with_node_yaml(node_yaml: &str, extra_yaml: &str) -> Router {
        let port = free_port();
        let yaml = config_yaml(port, &[], extra_yaml) + node_yaml;
        let router = Router::spawn(port, &yaml, &[]).await;
        router.wait_polled().await;
        router
    }

    async fn spawn(port: u16, yaml: &str, args: &[&str]) -> Router {
        let mut file = tempfile::NamedTempFile::new().expect("temp config");
        file.write_all(yaml.as_bytes()).expect("write config");
        let child = Command::new(env!("CARGO_BIN_EXE_corral"))
            .arg("-c")
            .arg(file.path())
            .args(args)
            .env(
                "RUST_LOG",
                std::env::var("CORRAL_TEST_LOG").unwrap_or("warn".into()),
            )
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("corral starts");
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let router = Router {
            child,
            addr,
            _config: file,
        };
        router.wait_listening().await;
        router
    }

    /// Rewrites the configuration file in place (same listen port), for reload tests.
    pub fn rewrite_config(&self, nodes: &[NodeSpec], extra_yaml: &str) {
        std::fs::write(
            self._config.path(),
            config_yaml(self.addr.port(), nodes, extra_yaml),
        )
        .expect("rewrite config");
    }

    pub fn write_raw_config(&self, text: &str) {
        std::fs::write(self._config.path(), text).expect("rewrite config");
    }

    pub fn config_path(&self) -> std::path::PathBuf {
        self._config.path().to_path_buf()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends a signal by name (HUP, TERM, QUIT) to the process.
    pub fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .arg(format!("-{name}"))
            .arg(self.pid().to_string())
            .status()
            .expect("kill runs");
        assert!(status.success());
    }

    /// Waits for the process to exit, up to `within`.
    pub async fn wait_exit(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + within;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            if Instant::now() > deadline {
                return None;
            }
            // Asynchronously: stand-in nodes share this runtime and must keep answering.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Asynchronously: corral polls its nodes before it listens, and stand-in nodes share
    /// this runtime, so they must keep answering meanwhile.
    async fn wait_listening(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while tokio::net::TcpStream::connect(self.addr).await.is_err() {
            assert!(Instant::now() < deadline, "corral did not start listening");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until /api/version answers for every node polled: a poll has completed.
    async fn wait_polled(&self) {
        // Two poll intervals after start, every node has been read at least once.
        tokio::time::sleep(Duration::from_millis(300)).await;
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for Router {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A stand-in node config with fast, test-sized timings.
pub fn fast_node(name: &str) -> StandinConfig {
    let mut c = StandinConfig::new(name);
    c.prefill_per_token = Duration::from_micros(5);
    c.decode_per_token = Duration::from_millis(1);
    c.load_time = Duration::from_millis(50);
    c.reply_tokens = 4;
    c
}

pub fn model(name: &str, gb: f64) -> StandinModel {
    StandinModel::new(name, (gb * 1e9) as u64, 8192)
}

pub async fn start(cfg: StandinConfig) -> StandinNode {
    StandinNode::start(cfg, "127.0.0.1:0".parse().unwrap())
        .await
        .expect("stand-in starts")
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap()
}

/// A chat body: alternating user/assistant turns.
/// Waits up to 10 s for `check` to hold, checking every 50 ms.
pub async fn eventually(what: &str, mut check: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !check().await {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A GET whose reply is JSON.
pub async fn get_json(url: &str) -> serde_json::Value {
    client()
        .get(url)
        .send()
        .await
        .expect("a reply")
        .json()
        .await
        .expect("a JSON reply")
}

/// The text of corral's Prometheus endpoint on `metrics_port`.
pub async fn scrape(metrics_port: u16) -> String {
    client()
        .get(format!("http://127.0.0.1:{metrics_port}/metrics"))
        .send()
        .await
        .expect("metrics answer")
        .text()
        .await
        .expect("metrics text")
}

/// Reads one sample's value from a Prometheus text scrape.
pub fn sample(scrape: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    scrape
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .find_map(|l| l.rsplit(' ').next()?.parse().ok())
}

pub fn chat_body(turns: &[String], stream: bool) -> serde_json::Value {
    let messages: Vec<_> = turns
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            serde_json::json!({ "role": role, "content": t })
        })
        .collect();
    serde_json::json!({ "model": MODEL, "messages": messages, "stream": stream })
}

/// Sends a non-streamed chat and returns (node, affinity, reply text).
pub async fn chat(router: &Router, turns: &[String]) -> (String, String, String) {
    let resp = client()
        .post(format!("{}/api/chat", router.url()))
        .json(&chat_body(turns, false))
        .send()
        .await
        .expect("chat reply");
    assert_eq!(resp.status(), 200);
    let node = header(&resp, "x-fleet-node");
    let affinity = header(&resp, "x-fleet-affinity");
    let body: serde_json::Value = resp.json().await.unwrap();
    let text = body["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    (node, affinity, text)
}

/// POSTs a body to `/api/chat`.
pub async fn post_chat(router: &Router, body: &serde_json::Value) -> reqwest::Response {
    client()
        .post(format!("{}/api/chat", router.url()))
        .json(body)
        .send()
        .await
        .expect("chat reply")
}

/// A streamed chat of these turns that keeps its node busy for about `tokens` decode steps;
/// returns once the reply header arrived, so the router counts it in flight.
pub async fn hold_turns(router: &Router, turns: &[String], tokens: u32) -> reqwest::Response {
    let mut body = chat_body(turns, true);
    body["options"] = serde_json::json!({ "num_predict": tokens });
    let resp = post_chat(router, &body).await;
    assert_eq!(resp.status(), 200);
    resp
}

/// [`hold_turns`] for a one-message conversation.
pub async fn hold(router: &Router, text: &str, tokens: u32) -> reqwest::Response {
    hold_turns(router, &[text.to_string()], tokens).await
}

pub fn header(resp: &reqwest::Response, name: &str) -> String {
    resp.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string()
}

/// The routes of an Ollama server that has `model` on disk and loaded, for a test node to
/// add its `/api/chat` to: what corral's health checks and polls read.
pub fn ollama_listing(model: &str, version: &'static str) -> axum::Router {
    use axum::routing::get;
    let tags = serde_json::json!({ "models": [{ "name": model, "model": model, "size": 4_700_000_000u64 }] });
    let ps = tags.clone();
    axum::Router::new()
        .route("/", get(|| async { "Ollama is running" }))
        .route(
            "/api/version",
            get(move || async move { axum::Json(serde_json::json!({ "version": version })) }),
        )
        .route(
            "/api/tags",
            get(move || {
                let t = tags.clone();
                async move { axum::Json(t) }
            }),
        )
        .route(
            "/api/ps",
            get(move || {
                let t = ps.clone();
                async move { axum::Json(t) }
            }),
        )
}

/// A node that lists MODEL as resident and answers `/api/chat` with the exact bytes it
/// received: proves a body crossed the router unchanged.
pub struct EchoNode {
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl EchoNode {
    pub async fn start() -> EchoNode {
        use axum::routing::post;
        let app = ollama_listing(MODEL, "0.0.0-echo")
            .route(
                "/api/chat",
                post(|body: axum::body::Bytes| async move {
                    (
                        [(axum::http::header::CONTENT_TYPE, "application/octet-stream")],
                        body,
                    )
                }),
            )
            .layer(axum::extract::DefaultBodyLimit::disable());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        EchoNode { addr, task }
    }

    pub fn spec(&self, name: &str) -> NodeSpec {
        NodeSpec {
            name: name.into(),
            url: format!("http://{}", self.addr),
            memory_gb: None,
            num_parallel: 2,
            roles: Vec::new(),
            multiuser_cache: false,
        }
    }
}

impl Drop for EchoNode {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A chat body of about `size` bytes whose "model" key comes last.
pub fn big_body_model_last(size: usize) -> Vec<u8> {
    let filler = "x".repeat(size);
    format!(r#"{{"messages":[{{"role":"user","content":"{filler}"}}],"stream":false,"model":"{MODEL}"}}"#).into_bytes()
}

/// A `redis-server` of Debian's package (`.ci/run` installs it), on a loopback port picked
/// here, with nothing saved to disk ([`RedisServer`]). Killed on drop.
pub struct Store(RedisServer);

impl Store {
    pub async fn start() -> Store {
        Store(RedisServer::start().await.expect("redis-server starts"))
    }

    pub fn url(&self) -> String {
        self.0.url()
    }

    /// The `shared_state:` section for corral's YAML. The bound on a request's wait for
    /// the store is raised from 2 ms: debug builds on a shared machine often need more, and
    /// past it a replica decides alone, which a test of the shared limits must not see.
    pub fn yaml(&self) -> String {
        format!("shared_state:\n  url: {}\n  timeout: 100ms\n", self.url())
    }

    /// Starts the server again on the same port, empty (as after a crash or a flush).
    pub async fn restart(&mut self) {
        self.0.restart().await.expect("redis-server starts again");
    }

    /// Kills the server (by its pid): every connection to it drops.
    pub fn stop(&mut self) {
        self.0.stop();
    }
}
