//! The Grafana dashboard against the real binary: every metric a panel of
//! `grafana/dashboards/corral.json` queries must be one that corral exports, with the label
//! values the panels select on; and the dashboard, its provisioning, the compose file and
//! the Prometheus config must agree with one another.
//!
//! The router runs with its metrics endpoint and admin API on free loopback ports, in front
//! of a stand-in node and of a node that resets every generation request (so that retries
//! and upstream errors happen deterministically, whatever the health checks do).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use futures::StreamExt;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Where corral's datasource is provisioned, and what every panel must name.
const DATASOURCE_YAML: &str = "grafana/provisioning/datasources/prometheus.yaml";
const DASHBOARD_JSON: &str = "grafana/dashboards/corral.json";
const PROVIDER_YAML: &str = "grafana/provisioning/dashboards/corral.yaml";

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

fn read(path: &str) -> String {
    std::fs::read_to_string(repo(path)).unwrap_or_else(|e| panic!("cannot read {path}: {e}"))
}

fn yaml(path: &str) -> serde_yaml::Value {
    serde_yaml::from_str(&read(path)).unwrap_or_else(|e| panic!("{path} is not YAML: {e}"))
}

// --- the router, with metrics and admin API --------------------------------------------------

/// A running `corral` with its metrics endpoint and admin API on loopback. Killed on drop.
struct MetricsRouter {
    child: Child,
    addr: SocketAddr,
    metrics: SocketAddr,
    _config: tempfile::NamedTempFile,
}

impl MetricsRouter {
    /// Starts corral in front of `nodes` (name, url, num_parallel), with `extra_yaml`
    /// (top-level keys), and waits until the proxy and the metrics endpoint accept
    /// connections and the nodes have been polled.
    async fn start(nodes: &[(&str, String, usize)], extra_yaml: &str) -> MetricsRouter {
        let port = free_port();
        let metrics_port = free_port();
        let admin_port = free_port();
        let mut yaml = format!(
            "listen: 127.0.0.1:{port}\n\
             metrics_listen: 127.0.0.1:{metrics_port}\n\
             admin_listen: 127.0.0.1:{admin_port}\n\
             threads: 1\n\
             grace_period_seconds: 0\n\
             graceful_shutdown_timeout_seconds: 1\n\
             pid_file: /tmp/corral-dashboard-{port}.pid\n\
             upgrade_sock: /tmp/corral-dashboard-{port}.sock\n\
             poll:\n  interval: 100ms\n  timeout: 1s\n\
             health:\n  interval: 500ms\n\
             {extra_yaml}\
             nodes:\n"
        );
        for (name, url, parallel) in nodes {
            yaml.push_str(&format!(
                "  - name: {name}\n    url: {url}\n    num_parallel: {parallel}\n"
            ));
        }
        let mut file = tempfile::NamedTempFile::new().expect("temp config");
        file.write_all(yaml.as_bytes()).expect("write config");
        let child = Command::new(env!("CARGO_BIN_EXE_corral"))
            .arg("-c")
            .arg(file.path())
            .env("RUST_LOG", "error")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("corral starts");
        let router = MetricsRouter {
            child,
            addr: ([127, 0, 0, 1], port).into(),
            metrics: ([127, 0, 0, 1], metrics_port).into(),
            _config: file,
        };
        for addr in [router.addr, router.metrics] {
            let deadline = Instant::now() + Duration::from_secs(20);
            while TcpStream::connect(addr).is_err() {
                assert!(Instant::now() < deadline, "corral did not listen on {addr}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        // A few poll intervals: every node's models are known.
        tokio::time::sleep(Duration::from_millis(400)).await;
        router
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    async fn scrape(&self) -> String {
        let resp = client()
            .get(format!("http://{}/metrics", self.metrics))
            .send()
            .await
            .expect("GET /metrics");
        assert_eq!(resp.status(), 200, "GET /metrics");
        resp.text().await.expect("metrics text")
    }
}

impl Drop for MetricsRouter {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A node that passes health checks and lists `model` as resident, but resets the
/// connection of every POST before sending a byte: corral must move on to the next node.
struct ResetNode {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl ResetNode {
    async fn start(model: &str) -> ResetNode {
        let entry = json!({
            "name": model, "model": model, "size": 9_000_000_000u64,
            "size_vram": 9_000_000_000u64, "expires_at": "2099-01-01T00:00:00Z",
            "context_length": 8192,
        });
        let list = json!({ "models": [entry] }).to_string();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            loop {
                let Ok((conn, _)) = listener.accept().await else {
                    continue;
                };
                tokio::spawn(serve_or_reset(conn, list.clone()));
            }
        });
        ResetNode { addr, task }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for ResetNode {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve_or_reset(mut conn: tokio::net::TcpStream, list: String) {
    let mut head = Vec::new();
    let mut chunk = [0u8; 4096];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match conn.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&chunk[..n]),
        }
    }
    let head = String::from_utf8_lossy(&head).to_string();
    let mut words = head.split_whitespace();
    let (method, path) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    if method == "POST" {
        // Closing with unread data and a zero linger sends a reset.
        let _ = conn.set_zero_linger();
        return;
    }
    let (status, body) = match path {
        "/" => ("200 OK", "Ollama is running".to_string()),
        "/api/version" => ("200 OK", r#"{"version":"0.0.0-reset"}"#.to_string()),
        "/api/tags" | "/api/ps" => ("200 OK", list),
        _ => ("404 Not Found", String::new()),
    };
    let reply = format!(
        "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{}",
        body.len(),
        if method == "HEAD" { "" } else { body.as_str() }
    );
    let _ = conn.write_all(reply.as_bytes()).await;
    let _ = conn.shutdown().await;
}

// --- the scrape ----------------------------------------------------------------------------

/// One sample of the text exposition format.
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
}

/// The scrape as samples, and the declared type of every family.
struct Scrape {
    samples: Vec<Sample>,
    types: BTreeMap<String, String>,
}

impl Scrape {
    fn parse(text: &str) -> Scrape {
        let mut samples = Vec::new();
        let mut types = BTreeMap::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let mut parts = rest.split_whitespace();
                if let (Some(name), Some(kind)) = (parts.next(), parts.next()) {
                    types.insert(name.to_string(), kind.to_string());
                }
                continue;
            }
            if line.starts_with('#') || line.trim().is_empty() {
                continue;
            }
            let end = line.find(['{', ' ']).unwrap_or(line.len());
            let name = line[..end].to_string();
            let labels = if line[end..].starts_with('{') {
                let close = line.rfind('}').expect("labels end with }");
                parse_labels(&line[end + 1..close])
            } else {
                BTreeMap::new()
            };
            samples.push(Sample { name, labels });
        }
        Scrape { samples, types }
    }

    /// Samples of a metric as a dashboard names it: a histogram by its base name, or by
    /// `_bucket`, `_sum`, `_count`.
    fn of<'a>(&'a self, metric: &'a str) -> impl Iterator<Item = &'a Sample> + 'a {
        self.samples.iter().filter(move |s| {
            s.name == metric
                || (self.types.get(metric).is_some_and(|t| t == "histogram")
                    && s.name
                        .strip_prefix(metric)
                        .is_some_and(|suffix| matches!(suffix, "_bucket" | "_sum" | "_count")))
        })
    }
}

/// `a="x",b="y\"z"` into a map.
fn parse_labels(text: &str) -> BTreeMap<String, String> {
    let mut labels = BTreeMap::new();
    let mut rest = text.trim();
    while let Some(eq) = rest.find('=') {
        let key = rest[..eq].trim().trim_start_matches(',').trim().to_string();
        let after = rest[eq + 1..].trim_start();
        let Some(body) = after.strip_prefix('"') else {
            break;
        };
        let mut value = String::new();
        let mut chars = body.char_indices();
        let mut end = body.len();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => {
                    if let Some((_, next)) = chars.next() {
                        value.push(match next {
                            'n' => '\n',
                            other => other,
                        });
                    }
                }
                '"' => {
                    end = i + 1;
                    break;
                }
                c => value.push(c),
            }
        }
        labels.insert(key, value);
        rest = body[end..].trim_start();
    }
    labels
}

// --- the dashboard -------------------------------------------------------------------------

fn dashboard() -> Value {
    serde_json::from_str(&read(DASHBOARD_JSON)).expect("the dashboard is JSON")
}

/// Every PromQL expression of the dashboard: panel targets (rows' nested panels included)
/// and the templating variables' queries.
fn expressions(dashboard: &Value) -> Vec<String> {
    fn panel_exprs(panels: &Value, out: &mut Vec<String>) {
        for panel in panels.as_array().into_iter().flatten() {
            for target in panel["targets"].as_array().into_iter().flatten() {
                if let Some(expr) = target["expr"].as_str() {
                    out.push(expr.to_string());
                }
            }
            panel_exprs(&panel["panels"], out);
        }
    }
    let mut out = Vec::new();
    panel_exprs(&dashboard["panels"], &mut out);
    for var in dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let query = &var["query"];
        if let Some(q) = query.as_str().or_else(|| query["query"].as_str()) {
            out.push(q.to_string());
        }
    }
    out
}

/// Metric names in an expression: `corral_[a-z_]+` not preceded by a name character.
fn metric_names(expr: &str) -> Vec<String> {
    let mut names = Vec::new();
    let bytes = expr.as_bytes();
    let mut from = 0;
    while let Some(at) = expr[from..].find("corral_").map(|i| from + i) {
        let preceded = at > 0 && {
            let c = bytes[at - 1];
            c.is_ascii_alphanumeric() || c == b'_' || c == b':'
        };
        let end = at
            + expr[at..]
                .find(|c: char| !(c.is_ascii_lowercase() || c == '_'))
                .unwrap_or(expr.len() - at);
        if !preceded {
            names.push(expr[at..end].to_string());
        }
        from = end;
    }
    names
}

/// The base name of a histogram series name, or the name itself.
fn family(name: &str) -> &str {
    ["_bucket", "_sum", "_count"]
        .iter()
        .find_map(|suffix| name.strip_suffix(suffix))
        .unwrap_or(name)
}

/// Equality matchers (`label="value"`, no variables) in the selector right after each
/// metric name: the label values a panel depends on.
fn equality_matchers(expr: &str) -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    for name in metric_names(expr) {
        let Some(at) = expr.find(&format!("{name}{{")) else {
            continue;
        };
        let open = at + name.len() + 1;
        let Some(close) = expr[open..].find('}').map(|i| open + i) else {
            continue;
        };
        for matcher in expr[open..close].split(',') {
            let Some((label, value)) = matcher.split_once('=') else {
                continue;
            };
            let label = label.trim();
            if label.ends_with('!') || value.starts_with('~') {
                continue;
            }
            let value = value.trim().trim_matches('"');
            if value.contains('$') {
                continue;
            }
            out.push((name.clone(), label.to_string(), value.to_string()));
        }
    }
    out
}

// --- the tests -------------------------------------------------------------------------------

async fn post(router: &MetricsRouter, path: &str, body: &Value) -> reqwest::Response {
    client()
        .post(format!("{}{path}", router.url()))
        .json(body)
        .send()
        .await
        .unwrap_or_else(|e| panic!("POST {path}: {e}"))
}

/// Sends the traffic that makes every metric family appear.
async fn exercise(router: &MetricsRouter) {
    // A chat, and its follow-up on the node that holds its prefix: affinity new, then hit;
    // evaluated tokens, TTFT, duration, winning score.
    let first = ["Why is the sky blue?".to_string()];
    let (node, affinity, reply) = chat_on(router, &first).await;
    assert_eq!((node.as_str(), affinity.as_str()), ("a", "new"));
    let follow = [first[0].clone(), reply, "And sunsets?".to_string()];
    let (node, affinity, _) = chat_on(router, &follow).await;
    assert_eq!((node.as_str(), affinity.as_str()), ("a", "hit"));

    // A streamed chat, read to the end.
    let resp = post(
        router,
        "/api/chat",
        &chat_body(&["Tell me a story.".into()], true),
    )
    .await;
    assert_eq!(resp.status(), 200);
    let mut stream = resp.bytes_stream();
    while let Some(chunk) = stream.next().await {
        chunk.expect("stream chunk");
    }

    // OpenAI-style chat and follow-up: the node reports cached prompt tokens.
    let mut messages = vec![json!({ "role": "user", "content": "Name three rivers, please." })];
    for turn in 0..2 {
        let body = json!({ "model": MODEL, "messages": messages, "stream": false });
        let resp = post(router, "/v1/chat/completions", &body).await;
        assert_eq!(resp.status(), 200);
        let reply: Value = resp.json().await.unwrap();
        messages.push(reply["choices"][0]["message"].clone());
        messages.push(json!({ "role": "user", "content": format!("And {turn} more?") }));
    }

    // An unknown model: 404 answered by corral itself (node "none").
    let body = json!({ "model": "no-such-model:1b", "messages": [] });
    assert_eq!(post(router, "/api/chat", &body).await.status(), 404);

    // qwen is resident only on the node that resets: one retry, an upstream error, then a
    // cold load on "a", whose reply reports the load.
    let body = json!({
        "model": "qwen2.5:14b", "stream": false,
        "messages": [{ "role": "user", "content": "Hello" }],
    });
    let resp = post(router, "/api/chat", &body).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(header(&resp, "x-fleet-node"), "a");
    assert_eq!(header(&resp, "x-fleet-retries"), "1");
    resp.bytes().await.unwrap();
}

/// Like `common::chat`, against this file's router.
async fn chat_on(router: &MetricsRouter, turns: &[String]) -> (String, String, String) {
    let resp = post(router, "/api/chat", &chat_body(turns, false)).await;
    assert_eq!(resp.status(), 200);
    let node = header(&resp, "x-fleet-node");
    let affinity = header(&resp, "x-fleet-affinity");
    let body: Value = resp.json().await.unwrap();
    let text = body["message"]["content"].as_str().unwrap_or_default();
    (node, affinity, text.to_string())
}

/// What the scrape lacks that the dashboard queries: metric names, and label values of
/// equality matchers.
fn missing(dashboard: &Value, scrape: &Scrape) -> Vec<String> {
    let mut missing = BTreeSet::new();
    for expr in expressions(dashboard) {
        for name in metric_names(&expr) {
            let base = family(&name);
            let found = if base != name {
                scrape.types.get(base).is_some_and(|t| t == "histogram")
                    && scrape.samples.iter().any(|s| s.name == name)
            } else {
                scrape.of(&name).next().is_some()
            };
            if !found {
                missing.insert(name);
            }
        }
        for (name, label, value) in equality_matchers(&expr) {
            let found = scrape
                .of(family(&name))
                .any(|s| s.labels.get(&label) == Some(&value));
            if !found {
                missing.insert(format!("{name}{{{label}=\"{value}\"}}"));
            }
        }
    }
    missing.into_iter().collect()
}

#[tokio::test]
async fn every_metric_the_dashboard_queries_is_exported() {
    let dashboard = dashboard();
    let names: BTreeSet<String> = expressions(&dashboard)
        .iter()
        .flat_map(|e| metric_names(e))
        .map(|n| family(&n).to_string())
        .collect();
    assert!(
        names.len() >= 10,
        "the dashboard queries only {names:?}: did extraction break?"
    );

    let mut a = fast_node("a");
    a.models.push(model("qwen2.5:14b", 9.0));
    // Loads of at least 0.1 s are counted as model loads.
    a.load_time = Duration::from_millis(150);
    let a = start(a).await;
    let reset = ResetNode::start("qwen2.5:14b").await;
    // With a store, for the shared-state panels (a replica alone exports the same metrics).
    let store = Store::start().await;
    let nodes = [("a", a.url(), 1), ("reset", reset.url(), 2)];
    let router = MetricsRouter::start(&nodes, &store.yaml()).await;

    exercise(&router).await;

    // Gauges are read at scrape time and counters as requests finish: a few tries at most.
    let deadline = Instant::now() + Duration::from_secs(10);
    let (text, lacking) = loop {
        let text = router.scrape().await;
        let lacking = missing(&dashboard, &Scrape::parse(&text));
        if lacking.is_empty() || Instant::now() > deadline {
            break (text, lacking);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert!(
        lacking.is_empty(),
        "{DASHBOARD_JSON} queries what corral does not export: {lacking:?}\n--- scrape:\n{text}"
    );
}

#[test]
fn metric_names_are_extracted_as_promql_reads_them() {
    let expr = r#"histogram_quantile(0.95, sum by (node, le) (rate(corral_time_to_first_token_seconds_bucket{node=~"$node"}[5m]))) / on() xcorral_fake + job:corral_rule:sum"#;
    assert_eq!(
        metric_names(expr),
        ["corral_time_to_first_token_seconds_bucket"]
    );
    assert_eq!(
        family("corral_time_to_first_token_seconds_bucket"),
        "corral_time_to_first_token_seconds"
    );
    assert_eq!(family("corral_requests_total"), "corral_requests_total");
    let expr = r#"sum(rate(corral_affinity_total{result="hit"}[1m])) / sum(rate(corral_prompt_tokens_total{node=~"$node", kind="cached", model!="x", node="$node"}[1m]))"#;
    assert_eq!(
        equality_matchers(expr),
        [
            (
                "corral_affinity_total".into(),
                "result".into(),
                "hit".into()
            ),
            (
                "corral_prompt_tokens_total".into(),
                "kind".into(),
                "cached".into()
            ),
        ]
    );
    let scrape = Scrape::parse(
        "# TYPE corral_winning_score histogram\ncorral_winning_score_bucket{le=\"+Inf\"} 3\n\
         corral_requests_total{endpoint=\"/api/chat\",model=\"a,b\",node=\"x\\\"y\",status=\"200\"} 1\n",
    );
    assert_eq!(scrape.of("corral_winning_score").count(), 1);
    let labels = &scrape.of("corral_requests_total").next().unwrap().labels;
    assert_eq!(labels["model"], "a,b");
    assert_eq!(labels["node"], "x\"y");
    assert_eq!(labels["status"], "200");
}

/// Every panel queries the provisioned datasource by its fixed uid, and has a query.
#[test]
fn panels_use_the_provisioned_datasource() {
    let provisioned = yaml(DATASOURCE_YAML);
    let uid = provisioned["datasources"][0]["uid"]
        .as_str()
        .expect("the provisioned datasource has a uid")
        .to_string();
    assert_eq!(provisioned["datasources"][0]["type"], "prometheus");

    let dashboard = dashboard();
    assert!(dashboard["uid"].as_str().is_some_and(|u| !u.is_empty()));
    let mut ids = BTreeSet::new();
    let mut queried = 0;
    fn panels(v: &Value) -> Vec<&Value> {
        let mut out = Vec::new();
        for p in v.as_array().into_iter().flatten() {
            out.push(p);
            out.extend(panels(&p["panels"]));
        }
        out
    }
    for panel in panels(&dashboard["panels"]) {
        let title = panel["title"].as_str().unwrap_or("?");
        assert!(
            ids.insert(panel["id"].as_u64().expect("panel id")),
            "{title}: duplicate id"
        );
        assert!(panel["gridPos"]["w"].as_u64().is_some(), "{title}: gridPos");
        if panel["type"] == "row" {
            assert_ne!(panel["collapsed"], true, "{title}: rows open, no clicks");
            continue;
        }
        assert_eq!(panel["datasource"]["uid"], uid.as_str(), "{title}");
        let targets = panel["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{title}: no query");
        for t in targets {
            assert_eq!(t["datasource"]["uid"], uid.as_str(), "{title}");
            assert!(
                t["expr"].as_str().is_some_and(|e| e.contains("corral_")),
                "{title}: a target queries no corral metric"
            );
            queried += 1;
        }
    }
    assert!(queried >= 20, "{queried} queries");
    for var in dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
    {
        assert_eq!(
            var["datasource"]["uid"],
            uid.as_str(),
            "variable {}",
            var["name"]
        );
    }
}

/// The compose file mounts what the provisioning expects, Prometheus scrapes the port the
/// container's config serves metrics on, and Grafana reads the scrape interval.
#[test]
fn provisioning_compose_and_prometheus_agree() {
    let compose = yaml("docker-compose.yml");
    let grafana = &compose["services"]["grafana"];
    let mounts: Vec<(String, String)> = grafana["volumes"]
        .as_sequence()
        .expect("grafana volumes")
        .iter()
        .filter_map(|v| {
            let mut parts = v.as_str()?.split(':');
            Some((parts.next()?.to_string(), parts.next()?.to_string()))
        })
        .collect();
    let target_of = |source: &str| {
        mounts
            .iter()
            .find(|(s, _)| s.trim_start_matches("./") == source)
            .map(|(_, t)| t.clone())
            .unwrap_or_else(|| panic!("grafana does not mount {source}: {mounts:?}"))
    };
    assert_eq!(
        target_of("grafana/provisioning"),
        "/etc/grafana/provisioning"
    );
    let dashboards = target_of("grafana/dashboards");
    let provider = yaml(PROVIDER_YAML);
    assert_eq!(
        provider["providers"][0]["options"]["path"].as_str(),
        Some(dashboards.as_str()),
        "the dashboard provider reads where compose mounts grafana/dashboards"
    );
    let home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
        .as_str()
        .expect("a home dashboard");
    assert_eq!(home, format!("{dashboards}/corral.json"));

    let datasource = yaml(DATASOURCE_YAML);
    let url = datasource["datasources"][0]["url"].as_str().unwrap();
    assert!(compose["services"]["prometheus"].is_mapping());
    assert_eq!(url, "http://prometheus:9090");

    let prometheus = yaml("deploy/prometheus.yml");
    let interval = prometheus["global"]["scrape_interval"].as_str().unwrap();
    assert_eq!(
        datasource["datasources"][0]["jsonData"]["timeInterval"].as_str(),
        Some(interval),
        "Grafana's $__rate_interval assumes Prometheus's scrape interval"
    );
    let job = prometheus["scrape_configs"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|j| j["job_name"] == "corral")
        .expect("a corral job");
    let target = job["static_configs"][0]["targets"][0].as_str().unwrap();
    for config in ["deploy/corral.yaml", "deploy/corral-demo.yaml"] {
        let corral = yaml(config);
        let listen = corral["metrics_listen"].as_str().unwrap();
        assert!(
            listen.starts_with("0.0.0.0:"),
            "{config}: metrics must listen on 0.0.0.0 in a container"
        );
        let port = listen.rsplit(':').next().unwrap();
        assert_eq!(target, format!("corral:{port}"), "{config}");
        assert!(
            corral["admin_listen"]
                .as_str()
                .is_some_and(|a| a.starts_with("0.0.0.0:"))
        );
    }
    // The corral service's config and the one corral-demo uses both parse as corral config.
    for config in ["deploy/corral.yaml", "deploy/corral-demo.yaml"] {
        let mut value = yaml(config);
        // Node host names are compose services, unresolvable here: check the rest.
        if let Some(nodes) = value
            .get_mut("nodes")
            .and_then(serde_yaml::Value::as_sequence_mut)
        {
            for node in nodes {
                node["url"] = "http://127.0.0.1:11434".into();
            }
        }
        let text = serde_yaml::to_string(&value).unwrap();
        corral::config::Config::from_yaml(&text)
            .unwrap_or_else(|e| panic!("{config} is not a valid corral config: {e}"));
    }
}
