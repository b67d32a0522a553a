//! Node health as a new user meets it: corral started together with its nodes, a node killed
//! and restarted under load, nodes behind TLS, and a dashboard on a healthy fleet.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::*;
use corral::standin::StandinNode;
use futures::StreamExt;
use parking_lot::Mutex;

fn spec(name: &str, url: String, num_parallel: usize) -> NodeSpec {
    NodeSpec {
        name: name.into(),
        url,
        memory_gb: None,
        num_parallel,
        roles: Vec::new(),
        multiuser_cache: false,
    }
}

/// corral's own defaults for checks and polls, as a new user runs it.
const DEFAULT_INTERVALS: &str = "health:\n  interval: 5s\npoll:\n  interval: 2s\n  timeout: 1s\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_that_listen_a_second_after_corral_serve_every_request_sent_after() {
    let ports = [free_port(), free_port()];
    let specs = ports
        .iter()
        .enumerate()
        .map(|(i, port)| spec(&format!("n{i}"), format!("http://127.0.0.1:{port}"), 4))
        .collect();
    // corral starts first: its first poll and check find nothing listening.
    let router = Router::start(specs, DEFAULT_INTERVALS).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut nodes = Vec::new();
    for (i, port) in ports.iter().enumerate() {
        let addr = SocketAddr::from(([127, 0, 0, 1], *port));
        let node = StandinNode::start(fast_node(&format!("n{i}")), addr).await;
        nodes.push(node.expect("the node takes its port"));
    }
    // The nodes listen now, long before corral's next health check (5 s) and, likely,
    // before its next poll (2 s).
    let sends = (0..8).map(|i| {
        client()
            .post(format!("{}/api/chat", router.url()))
            .json(&chat_body(&[format!("question {i}")], false))
            .send()
    });
    let mut statuses = Vec::new();
    for reply in futures::future::join_all(sends).await {
        statuses.push(reply.expect("a reply").status().as_u16());
    }
    assert_eq!(
        statuses, [200; 8],
        "every request sent after the nodes listen"
    );
    let served: usize = nodes.iter().map(|n| n.log().len()).sum();
    assert_eq!(served, 8);
}

/// What one request of the replay saw.
struct Outcome {
    node: Option<String>,
    /// Why it failed; `None` when it was served whole.
    error: Option<String>,
    took: Duration,
}

/// Sends one turn and reads the whole reply, streamed chunk by chunk or not; returns the
/// reply's text for the next turn.
async fn turn(router: &str, turns: &[String], stream: bool) -> (Outcome, String) {
    let started = Instant::now();
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    let outcome = |node: Option<String>, error: Option<String>| Outcome {
        node,
        error,
        took: started.elapsed(),
    };
    let resp = match client
        .post(format!("{router}/api/chat"))
        .json(&chat_body(turns, stream))
        .send()
        .await
    {
        Ok(resp) => resp,
        Err(e) => return (outcome(None, Some(e.to_string())), String::new()),
    };
    let node = Some(header(&resp, "x-fleet-node")).filter(|n| !n.is_empty());
    let status = resp.status();
    let mut text = String::new();
    let mut body = Vec::new();
    let mut chunks = resp.bytes_stream();
    while let Some(chunk) = chunks.next().await {
        match chunk {
            Ok(bytes) => body.extend_from_slice(&bytes),
            Err(e) => return (outcome(node, Some(format!("cut: {e}"))), text),
        }
    }
    let body = String::from_utf8_lossy(&body).to_string();
    if status != 200 {
        return (outcome(node, Some(format!("{status}: {body}"))), text);
    }
    for line in body.lines().filter(|l| !l.trim().is_empty()) {
        let Ok(value) = serde_json::from_str::<serde_json::Value>(line) else {
            return (outcome(node, Some(format!("not JSON: {line}"))), text);
        };
        if let Some(e) = value.get("error") {
            return (outcome(node, Some(format!("error line: {e}"))), text);
        }
        text.push_str(value["message"]["content"].as_str().unwrap_or_default());
    }
    (outcome(node, None), text)
}

/// Requests waiting in corral for `node`, from the admin API.
async fn waiting_for(admin: &str, node: &str) -> u64 {
    let fleet = get_json(&format!("{admin}/fleet")).await;
    let nodes = fleet["nodes"].as_array().cloned().unwrap_or_default();
    let Some(n) = nodes.iter().find(|n| n["name"] == node) else {
        return 0;
    };
    let models = n["models"].as_object().cloned().unwrap_or_default();
    models.values().filter_map(|m| m["waiting"].as_u64()).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_killed_while_requests_wait_for_it_strands_none_and_serves_soon_after_it_returns() {
    const CONVERSATIONS: usize = 60;
    const TURNS: usize = 3;
    const CLIENTS: usize = 12;
    const PARALLEL: usize = 2;
    const MAX_WAIT: Duration = Duration::from_secs(20);
    // About 150 ms a request: 12 clients keep both nodes' 2 slots full and a queue waiting.
    let slow = |name: &str| {
        let mut cfg = fast_node(name);
        cfg.decode_per_token = Duration::from_millis(5);
        cfg.reply_tokens = 30;
        cfg
    };
    let a = start(slow("a")).await;
    let b = start(slow("b")).await;
    let admin_port = free_port();
    let admin = format!("http://127.0.0.1:{admin_port}");
    let router = Router::start(
        vec![NodeSpec::of(&a, PARALLEL), NodeSpec::of(&b, PARALLEL)],
        &format!(
            "{DEFAULT_INTERVALS}admin_listen: 127.0.0.1:{admin_port}\nqueue:\n  max_wait: {}s\n",
            MAX_WAIT.as_secs()
        ),
    )
    .await;
    let url = router.url();

    // The replay: each client takes the next conversation and plays its turns in order,
    // every other conversation streamed.
    let next = Arc::new(AtomicUsize::new(0));
    let outcomes = Arc::new(Mutex::new(Vec::new()));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (next, outcomes, url) = (next.clone(), outcomes.clone(), url.clone());
            tokio::spawn(async move {
                loop {
                    let c = next.fetch_add(1, Ordering::Relaxed);
                    if c >= CONVERSATIONS {
                        return;
                    }
                    let mut turns = vec![format!("conversation {c}: hello")];
                    for t in 0..TURNS {
                        let (outcome, reply) = turn(&url, &turns, c % 2 == 1).await;
                        outcomes.lock().push(outcome);
                        turns.push(reply);
                        turns.push(format!("conversation {c}: turn {}", t + 1));
                    }
                }
            })
        })
        .collect();

    // Kill a at a moment when requests wait in corral for it.
    let deadline = Instant::now() + Duration::from_secs(10);
    let waited = loop {
        let waiting = waiting_for(&admin, "a").await;
        if waiting > 0 && outcomes.lock().len() >= 8 {
            break waiting;
        }
        assert!(Instant::now() < deadline, "no request ever waited for a");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    a.stop().await;
    let done_at_kill = outcomes.lock().len();

    // It comes back 4 s later and answers polls at once; it serves again within 3 s.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let served_before = a.log().len();
    a.restart().await.expect("a listens again");
    let restarted = Instant::now();
    let back_after = loop {
        if a.log().len() > served_before {
            break restarted.elapsed();
        }
        assert!(
            restarted.elapsed() < Duration::from_secs(10),
            "a took no request for 10 s after it came back"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };

    for client in clients {
        client.await.expect("the client task ends");
    }
    let outcomes = outcomes.lock();
    let failed: Vec<_> = outcomes.iter().filter(|o| o.error.is_some()).collect();
    let slowest = outcomes.iter().map(|o| o.took).max().unwrap_or_default();
    let on_a = outcomes
        .iter()
        .filter(|o| o.node.as_deref() == Some("a"))
        .count();
    eprintln!(
        "replay: {} requests, {waited} waiting for a when it was killed after {done_at_kill}, \
         {} failed, slowest {slowest:?}, a served again {back_after:?} after it came back, \
         {on_a} served by a",
        outcomes.len(),
        failed.len()
    );
    assert_eq!(outcomes.len(), CONVERSATIONS * TURNS, "every request ended");
    assert!(
        slowest < MAX_WAIT + Duration::from_secs(5),
        "a request was stranded: {slowest:?}"
    );
    // Only what ran on a when it died may fail: at most its slots.
    assert!(
        failed.len() <= PARALLEL,
        "{} failed: {:?}",
        failed.len(),
        failed
            .iter()
            .map(|o| (o.node.clone(), o.error.clone()))
            .collect::<Vec<_>>()
    );
    assert!(
        failed.iter().all(|o| o.node.as_deref() == Some("a")),
        "only requests running on a fail"
    );
    assert!(
        back_after <= Duration::from_secs(3),
        "a served again only {back_after:?} after it came back"
    );
}

/// A certificate authority and a certificate it signed for `localhost`.
struct Certificates {
    ca_pem: String,
    leaf_der: Vec<u8>,
    key_der: Vec<u8>,
}

fn certificates() -> Certificates {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca_params, ca_key);
    let leaf_key = KeyPair::generate().unwrap();
    let leaf = CertificateParams::new(vec!["localhost".to_string()])
        .unwrap()
        .signed_by(&leaf_key, &issuer)
        .unwrap();
    Certificates {
        ca_pem: ca_cert.pem(),
        leaf_der: leaf.der().to_vec(),
        key_der: leaf_key.serialize_der(),
    }
}

/// A TLS front for a plain stand-in node: the stand-in as an `https://` node. Records the
/// server name (SNI) each client asked for.
struct TlsFront {
    addr: SocketAddr,
    names: Arc<Mutex<Vec<Option<String>>>>,
    task: tokio::task::JoinHandle<()>,
}

impl TlsFront {
    async fn start(backend: SocketAddr, certs: &Certificates) -> TlsFront {
        use pingora_core::tls::{CertificateDer, PrivateKeyDer, ServerConfig, TlsAcceptor};
        pingora_core::tls::install_default_crypto_provider();
        let key = PrivateKeyDer::try_from(certs.key_der.clone()).unwrap();
        let config = ServerConfig::builder()
            .with_no_client_auth()
            .with_single_cert(vec![CertificateDer::from(certs.leaf_der.clone())], key)
            .unwrap();
        let acceptor = TlsAcceptor::from(Arc::new(config));
        // Where corral will find `localhost`: the first address it resolves to.
        let local = tokio::net::lookup_host(("localhost", 0))
            .await
            .unwrap()
            .next()
            .unwrap();
        let listener = tokio::net::TcpListener::bind(local).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let names = Arc::new(Mutex::new(Vec::new()));
        let seen = names.clone();
        let task = tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let (acceptor, seen) = (acceptor.clone(), seen.clone());
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let name = tls.get_ref().1.server_name().map(str::to_string);
                    seen.lock().push(name);
                    let Ok(mut plain) = tokio::net::TcpStream::connect(backend).await else {
                        return;
                    };
                    let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
                });
            }
        });
        TlsFront { addr, names, task }
    }
}

impl Drop for TlsFront {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_node_is_checked_polled_and_routed_to_over_tls_with_sni_from_its_url() {
    let certs = certificates();
    let dir = tempfile::tempdir().unwrap();
    let ca_file = dir.path().join("lab-ca.pem");
    std::fs::write(&ca_file, &certs.ca_pem).unwrap();
    let node = start(fast_node("secure")).await;
    let front = TlsFront::start(node.addr(), &certs).await;
    let url = format!("https://localhost:{}", front.addr.port());
    let node_yaml = |ca: Option<&std::path::Path>| {
        let mut yaml = format!("  - name: secure\n    url: {url}\n    num_parallel: 2\n");
        if let Some(ca) = ca {
            yaml.push_str(&format!("    ca_file: {}\n", ca.display()));
        }
        yaml
    };
    let admin_port = free_port();
    let admin = format!("http://127.0.0.1:{admin_port}");
    let router = Router::start_with_node_yaml(
        &node_yaml(Some(&ca_file)),
        &format!("admin_listen: 127.0.0.1:{admin_port}\n"),
    )
    .await;

    // Checked and polled over TLS: healthy, with its models known.
    eventually("the https node is polled and up", async || {
        let fleet = get_json(&format!("{admin}/fleet")).await;
        let n = &fleet["nodes"][0];
        n["polled"] == true && n["healthy"] == true && n["health"] == "up"
    })
    .await;
    let fleet = get_json(&format!("{admin}/fleet")).await;
    assert_eq!(fleet["nodes"][0]["version"], "0.5.7-standin", "{fleet}");
    // Routed to.
    let resp = post_chat(&router, &chat_body(&["over TLS".into()], false)).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(header(&resp, "x-fleet-node"), "secure");
    assert_eq!(node.log().len(), 1, "the request crossed the TLS front");
    let names = front.names.lock().clone();
    assert!(names.len() >= 4, "checks, polls and the request: {names:?}");
    assert!(
        names.iter().all(|n| n.as_deref() == Some("localhost")),
        "SNI from the URL on every connection: {names:?}"
    );
    drop(router);

    // Without the lab's CA the certificate is not trusted: verification is on, nothing is
    // polled, and the node is not healthy.
    let admin_port = free_port();
    let admin = format!("http://127.0.0.1:{admin_port}");
    let _untrusting = Router::start_with_node_yaml(
        &node_yaml(None),
        &format!("admin_listen: 127.0.0.1:{admin_port}\n"),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let fleet = get_json(&format!("{admin}/fleet")).await;
    assert_eq!(fleet["nodes"][0]["polled"], false, "{fleet}");
    assert_eq!(fleet["nodes"][0]["healthy"], false, "{fleet}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_scrape_shows_every_counter_the_dashboard_reads_at_zero_per_node() {
    let a = start(fast_node("a")).await;
    let b = start(fast_node("b")).await;
    let metrics_port = free_port();
    let extra = format!("metrics_listen: 127.0.0.1:{metrics_port}\n");
    let router = Router::start(vec![NodeSpec::of(&a, 2)], &extra).await;
    // Every kind docs/metrics.md lists.
    let kinds = [
        "connect",
        "reset",
        "first_byte_timeout",
        "broken_stream",
        "idle_timeout",
        "status_5xx",
    ];
    let zero_for = |scrape: &str, node: &str| {
        assert_eq!(
            sample(scrape, "corral_retries_total", &[("node", node)]),
            Some(0.0),
            "{node}: {scrape}"
        );
        for kind in kinds {
            let labels = [("node", node), ("kind", kind)];
            assert_eq!(
                sample(scrape, "corral_upstream_errors_total", &labels),
                Some(0.0),
                "{node} {kind}"
            );
        }
    };
    let fresh = scrape(metrics_port).await;
    zero_for(&fresh, "a");
    // Every counter the dashboard reads per node and model, for the model a reports.
    let (node, model) = (("node", "a"), ("model", MODEL));
    for family in [
        "corral_cold_loads_total",
        "corral_model_loads_total",
        "corral_prompt_tokens_estimated_total",
    ] {
        assert_eq!(
            sample(&fresh, family, &[node, model]),
            Some(0.0),
            "{family}"
        );
    }
    for kind in ["evaluated", "cached"] {
        let labels = [node, model, ("kind", kind)];
        assert_eq!(
            sample(&fresh, "corral_prompt_tokens_total", &labels),
            Some(0.0)
        );
    }
    for result in ["hit", "miss", "new"] {
        assert_eq!(
            sample(&fresh, "corral_affinity_total", &[("result", result)]),
            Some(0.0)
        );
    }

    // A node added by a reload has them too.
    router.rewrite_config(&[NodeSpec::of(&a, 2), NodeSpec::of(&b, 2)], &extra);
    router.signal("HUP");
    eventually("b is in the fleet", async || {
        sample(
            &scrape(metrics_port).await,
            "corral_node_up",
            &[("node", "b")],
        )
        .is_some()
    })
    .await;
    zero_for(&scrape(metrics_port).await, "b");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_requests_after_start_see_the_models_of_the_first_poll() {
    let mut small = fast_node("a");
    small.models = vec![model("phi3:mini", 2.2)];
    small.preload = vec!["phi3:mini".into()];
    let a = start(small).await;
    let b = start(fast_node("b")).await;
    // No poll or check after the first before the requests are answered: what corral knows
    // it learned before it listened.
    let router = Router::start_at_once(
        vec![NodeSpec::of(&a, 4), NodeSpec::of(&b, 4)],
        "health:\n  interval: 1h\npoll:\n  interval: 1h\n  timeout: 1s\n",
    )
    .await;
    let sends = (0..8).map(|i| {
        let body = serde_json::json!({ "model": "phi3:mini", "stream": false,
            "messages": [{ "role": "user", "content": format!("first {i}") }] });
        client()
            .post(format!("{}/api/chat", router.url()))
            .json(&body)
            .send()
    });
    for reply in futures::future::join_all(sends).await {
        let reply = reply.expect("a reply");
        assert_eq!(
            (reply.status().as_u16(), header(&reply, "x-fleet-node")),
            (200, "a".to_string()),
            "only a has phi3:mini"
        );
    }
}

/// Requests in flight for `model` on `node`, from the admin API.
async fn in_flight_on(admin: &str, node: &str) -> u64 {
    let fleet = get_json(&format!("{admin}/fleet")).await;
    let nodes = fleet["nodes"].as_array().cloned().unwrap_or_default();
    let Some(n) = nodes.iter().find(|n| n["name"] == node) else {
        return 0;
    };
    let models = n["models"].as_object().cloned().unwrap_or_default();
    models
        .values()
        .filter_map(|m| m["in_flight"].as_u64())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waiting_for_a_busy_node_moves_to_a_node_that_comes_back() {
    let a = start(fast_node("a")).await;
    let b = start(fast_node("b")).await;
    let admin_port = free_port();
    let admin = format!("http://127.0.0.1:{admin_port}");
    let router = Router::start(
        vec![NodeSpec::of(&a, 1), NodeSpec::of(&b, 1)],
        &format!("admin_listen: 127.0.0.1:{admin_port}\n"),
    )
    .await;
    a.stop().await;
    eventually("a is down", async || {
        let fleet = get_json(&format!("{admin}/fleet")).await;
        fleet["nodes"][0]["healthy"] == false
    })
    .await;
    // b's only slot is taken by a long stream (2,000 tokens at 2 ms: about 4 s).
    let long = hold(&router, "a long story", 2000).await;
    assert_eq!(header(&long, "x-fleet-node"), "b");
    // The next request waits in corral for b: a is down.
    let url = router.url();
    let waiting = tokio::spawn(async move {
        client()
            .post(format!("{url}/api/chat"))
            .json(&chat_body(&["short question".into()], false))
            .send()
            .await
    });
    eventually("the request waits for b", async || {
        waiting_for(&admin, "b").await == 1
    })
    .await;
    // a comes back: the waiting request is placed again at once, while b is still busy.
    a.restart().await.unwrap();
    let reply = waiting.await.unwrap().unwrap();
    assert_eq!(reply.status(), 200);
    assert_eq!(header(&reply, "x-fleet-node"), "a");
    assert_eq!(
        in_flight_on(&admin, "b").await,
        1,
        "b's long stream still runs: no completion woke the waiter"
    );
    drop(long);
}
