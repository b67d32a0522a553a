//! Routing decisions over real sockets: the real `corral` binary in front of stand-in
//! Ollama nodes that model slots, prefix caching and model loads.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::*;
use futures::StreamExt;

fn turns(first: &str) -> Vec<String> {
    vec![format!(
        "{first}: {}",
        "Tell me about fleets of machines. ".repeat(20)
    )]
}

/// Extends a conversation with the reply and a new question.
fn follow(mut t: Vec<String>, reply: String, next: &str) -> Vec<String> {
    t.push(reply);
    t.push(next.to_string());
    t
}

fn last_log(node: &corral::standin::StandinNode) -> corral::standin::ServedRequest {
    node.log()
        .last()
        .cloned()
        .expect("the node served a request")
}

/// corral in front of one node (configured `num_parallel: 1`) with its admin API; returns the
/// router and the URL of the admin API's `/fleet`.
async fn one_node_with_admin(node: &corral::standin::StandinNode) -> (Router, String) {
    let admin_port = free_port();
    let router = Router::start(
        vec![NodeSpec::of(node, 1)],
        &format!("admin_listen: 127.0.0.1:{admin_port}\n"),
    )
    .await;
    (router, format!("http://127.0.0.1:{admin_port}/fleet"))
}

#[tokio::test]
async fn follow_up_lands_on_the_node_holding_its_prefix() {
    let nodes = futures::future::join_all((0..3).map(|i| start(fast_node(&format!("n{i}"))))).await;
    let router = Router::start(nodes.iter().map(|n| NodeSpec::of(n, 2)).collect(), "").await;
    let by_name: HashMap<_, _> = nodes.iter().map(|n| (n.name().to_string(), n)).collect();

    let t1 = turns("conversation");
    let (node1, affinity1, reply1) = chat(&router, &t1).await;
    assert_eq!(affinity1, "new");
    let t2 = follow(t1, reply1, "And then?");
    let (node2, affinity2, reply2) = chat(&router, &t2).await;
    assert_eq!(
        node2, node1,
        "the follow-up went where the conversation is warm"
    );
    assert_eq!(affinity2, "hit");
    let served = last_log(by_name[&node2]);
    assert!(
        served.cached_tokens > 100,
        "the node reused the prefix: {served:?}"
    );

    let t3 = follow(t2, reply2, "Once more?");
    let (node3, affinity3, _) = chat(&router, &t3).await;
    assert_eq!(
        (node3.as_str(), affinity3.as_str()),
        (node1.as_str(), "hit")
    );
}

#[tokio::test]
async fn resident_model_beats_a_cold_one() {
    let mut cold = fast_node("cold");
    cold.preload.clear();
    let cold = start(cold).await;
    let warm = start(fast_node("warm")).await;
    let router = Router::start(vec![NodeSpec::of(&cold, 2), NodeSpec::of(&warm, 2)], "").await;
    for i in 0..4 {
        let (node, _, _) = chat(&router, &turns(&format!("user {i}"))).await;
        assert_eq!(node, "warm");
    }
    assert!(cold.log().is_empty(), "no request paid a cold load");
    assert!(cold.resident().is_empty());
}

#[tokio::test]
async fn big_model_avoids_a_node_too_small_for_it() {
    let big_model = model("qwen2.5:32b", 20.0);
    let mut small = fast_node("small");
    small.memory_bytes = 8_000_000_000;
    small.models.push(big_model.clone());
    let mut large = fast_node("large");
    large.memory_bytes = 48_000_000_000;
    large.models.push(big_model);
    let (small, large) = (start(small).await, start(large).await);
    let router = Router::start(
        vec![
            NodeSpec::of(&small, 2).memory(8.0),
            NodeSpec::of(&large, 2).memory(48.0),
        ],
        "",
    )
    .await;
    for i in 0..3 {
        let body = serde_json::json!({
            "model": "qwen2.5:32b", "stream": false,
            "messages": [{ "role": "user", "content": format!("question {i}") }],
        });
        let resp = client()
            .post(format!("{}/api/chat", router.url()))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(header(&resp, "x-fleet-node"), "large");
    }
    assert!(small.log().iter().all(|r| r.model != "qwen2.5:32b"));
}

/// The worked example over sockets, on nodes of one slot each (Ollama's default): a queue of
/// two sends the follow-up to an otherwise identical idle peer.
#[tokio::test]
async fn pinned_node_with_a_queue_loses_to_an_idle_peer() {
    let mut cfgs = vec![fast_node("a"), fast_node("b")];
    for c in &mut cfgs {
        c.num_parallel = 1;
        c.decode_per_token = Duration::from_millis(20);
        // Current Ollama: conversations pushed out of the one slot stay warm in host memory.
        c.kind = corral::standin::StandinKind::Ollama;
        c.cache_ram_tokens = 100_000;
    }
    let nodes = futures::future::join_all(cfgs.into_iter().map(start)).await;
    let admin_port = free_port();
    let extra = format!("admin_listen: 127.0.0.1:{admin_port}\n");
    let fleet = async || get_json(&format!("http://127.0.0.1:{admin_port}/fleet")).await;
    // Three conversations start on a, the only node; then b joins, idle.
    let router = Router::start(vec![NodeSpec::of(&nodes[0], 1)], &extra).await;
    let mut convs = Vec::new();
    for i in 0..3 {
        let t = turns(&format!("user {i}"));
        let (node, _, reply) = chat(&router, &t).await;
        assert_eq!(node, "a");
        convs.push(follow(t, reply, "go on"));
    }
    let both: Vec<NodeSpec> = nodes.iter().map(|n| NodeSpec::of(n, 1)).collect();
    router.rewrite_config(&both, &extra);
    router.signal("HUP");
    eventually("b joins with the model resident", async || {
        let f = fleet().await;
        let b = f["nodes"]
            .as_array()
            .and_then(|n| n.iter().find(|n| n["name"] == "b"));
        b.is_some_and(|b| b["resident"].as_array().is_some_and(|r| !r.is_empty()))
    })
    .await;
    // One follow-up runs on a (depth one: a still leads by 7.3). a saved conversations 0
    // and 1 from its one slot; no reply has shown its cache's limit yet, so corral sends 0
    // back to a (only a may hold it) but expects only the newest saved kept: `miss`.
    let d = hold_turns(&router, &convs[0], 200).await;
    assert_eq!(header(&d, "x-fleet-node"), "a");
    assert_eq!(header(&d, "x-fleet-affinity"), "miss");
    // ...and a second waits in corral for a's one slot (depth two)...
    let waiter = client()
        .post(format!("{}/api/chat", router.url()))
        .json(&chat_body(&convs[1], false))
        .send();
    let waiter = tokio::spawn(waiter);
    eventually("the second follow-up waits in corral", async || {
        fleet().await["waiting"].as_u64() == Some(1)
    })
    .await;

    // ...so the third conversation's follow-up goes to the idle peer: 20/2 - 12 = -2 < 0.
    let resp = client()
        .post(format!("{}/api/chat", router.url()))
        .header("X-Fleet-Explain", "1")
        .json(&chat_body(&convs[2], false))
        .send()
        .await
        .unwrap();
    let explain = header(&resp, "x-fleet-explain");
    assert_eq!(header(&resp, "x-fleet-node"), "b", "{explain}");
    assert_eq!(header(&resp, "x-fleet-affinity"), "miss");
    assert!(explain.contains("a total=83.0"), "{explain}");
    assert!(explain.contains("b total=85.0"), "{explain}");
    assert!(
        explain.contains("queue=-12.0") && explain.contains("affinity=10.0"),
        "{explain}"
    );
    drop(d);
    let waited = waiter.await.unwrap().unwrap();
    assert_eq!(
        header(&waited, "x-fleet-node"),
        "a",
        "it waited for its warm node"
    );
    // a kept it in host memory, beyond what corral expected of a cache whose limit no
    // reply has shown (the first follow-up was cut off before its reply could show it).
    assert_eq!(header(&waited, "x-fleet-affinity"), "miss");
    waited.bytes().await.unwrap();
    let follow_ups = nodes[0].log().split_off(3);
    assert!(
        !follow_ups.is_empty() && follow_ups.iter().all(|r| r.cached_tokens > 0),
        "a served its follow-ups from cache: {follow_ups:?}"
    );
}

#[tokio::test]
async fn six_conversations_on_three_nodes_of_two_slots_all_stay_warm() {
    let nodes = futures::future::join_all((0..3).map(|i| {
        let mut c = fast_node(&format!("n{i}"));
        c.decode_per_token = Duration::from_millis(5);
        start(c)
    }))
    .await;
    let router = Router::start(nodes.iter().map(|n| NodeSpec::of(n, 2)).collect(), "").await;

    let conversation = |i: usize| {
        let router = &router;
        async move {
            let mut t = turns(&format!("conversation {i}"));
            let (first, affinity, mut reply) = chat(router, &t).await;
            assert_eq!(affinity, "new");
            for turn in 0..3 {
                t = follow(t, reply, &format!("follow-up {turn}"));
                let (node, affinity, r) = chat(router, &t).await;
                assert_eq!(
                    (node.as_str(), affinity.as_str()),
                    (first.as_str(), "hit"),
                    "conversation {i} turn {turn}"
                );
                reply = r;
            }
            first
        }
    };
    let homes = futures::future::join_all((0..6).map(conversation)).await;
    let mut per_node: HashMap<String, usize> = HashMap::new();
    for h in &homes {
        *per_node.entry(h.clone()).or_default() += 1;
    }
    assert!(
        per_node.values().all(|&n| n == 2),
        "two conversations per node: {per_node:?}"
    );
    // The nodes confirm it: every follow-up reused its prefix.
    for node in &nodes {
        let log = node.log();
        let first_turn = log.iter().map(|r| r.prompt_tokens).min().unwrap_or(0);
        let follow_ups: Vec<_> = log
            .iter()
            .filter(|r| r.prompt_tokens > first_turn)
            .collect();
        assert_eq!(follow_ups.len(), 6, "{}: {log:?}", node.name());
        assert!(
            follow_ups.iter().all(|r| r.cached_tokens > 100),
            "{}: {log:?}",
            node.name()
        );
    }
}

/// `X-Fleet-Affinity` says what the node's cache then does, whichever rule the node uses
/// to give a new conversation a slot (Ollama's `OLLAMA_MULTIUSER_CACHE`).
#[tokio::test]
async fn affinity_header_agrees_with_the_nodes_cache_under_both_slot_rules() {
    for multiuser_cache in [false, true] {
        let mut cfg = fast_node("n");
        cfg.multiuser_cache = multiuser_cache;
        let node = start(cfg).await;
        let router = Router::start(vec![NodeSpec::of(&node, 2)], "").await;

        let alpha = turns("alpha");
        let (_, _, reply) = chat(&router, &alpha).await;
        chat(&router, &turns("bravo")).await;
        let (_, affinity, _) = chat(&router, &follow(alpha, reply, "And then?")).await;
        let served = last_log(&node);
        // By default "bravo" took alpha's slot although the other was empty.
        let (expected, reused) = if multiuser_cache {
            ("hit", true)
        } else {
            ("miss", false)
        };
        assert_eq!(affinity, expected, "multiuser_cache: {multiuser_cache}");
        assert_eq!(served.cached_tokens > 100, reused, "{served:?}");
    }
}

/// With Ollama's default slot rule a new conversation would push out any idle one, so it
/// goes to the node that holds none, and the first conversation stays warm.
#[tokio::test]
async fn a_new_conversation_goes_where_it_pushes_no_conversation_out() {
    let nodes = futures::future::join_all((0..2).map(|i| start(fast_node(&format!("n{i}"))))).await;
    let router = Router::start(nodes.iter().map(|n| NodeSpec::of(n, 2)).collect(), "").await;
    let by_name: HashMap<_, _> = nodes.iter().map(|n| (n.name().to_string(), n)).collect();

    let alpha = turns("alpha");
    let (home, _, reply) = chat(&router, &alpha).await;
    let resp = client()
        .post(format!("{}/api/chat", router.url()))
        .header("X-Fleet-Explain", "1")
        .json(&chat_body(&turns("bravo"), false))
        .send()
        .await
        .unwrap();
    let explain = header(&resp, "x-fleet-explain");
    assert_ne!(header(&resp, "x-fleet-node"), home, "{explain}");
    // Although one of its two slots is empty, bravo would have displaced alpha there.
    let home_scores = explain
        .split("; ")
        .find(|s| s.starts_with(&format!("{home} ")))
        .unwrap_or_default();
    assert!(home_scores.ends_with("affinity=-8.0"), "{explain}");
    resp.bytes().await.unwrap();
    let (node, affinity, _) = chat(&router, &follow(alpha, reply, "And then?")).await;
    assert_eq!((node.as_str(), affinity.as_str()), (home.as_str(), "hit"));
    assert!(last_log(by_name[&home]).cached_tokens > 100);
}

#[tokio::test]
async fn explain_header_scores_every_candidate() {
    let nodes = futures::future::join_all((0..3).map(|i| start(fast_node(&format!("n{i}"))))).await;
    let router = Router::start(nodes.iter().map(|n| NodeSpec::of(n, 2)).collect(), "").await;
    let resp = client()
        .post(format!("{}/api/chat", router.url()))
        .header("X-Fleet-Explain", "1")
        .json(&chat_body(&turns("x"), true))
        .send()
        .await
        .unwrap();
    let explain = header(&resp, "x-fleet-explain");
    for n in &nodes {
        assert!(
            explain.contains(&format!("{} total=", n.name())),
            "{explain}"
        );
    }
    for signal in [
        "loaded=",
        "memory=",
        "queue=",
        "latency=",
        "role=",
        "availability=",
        "context=",
        "affinity=",
    ] {
        assert_eq!(explain.matches(signal).count(), 3, "{signal} in {explain}");
    }
    let score: f64 = header(&resp, "x-fleet-score").parse().unwrap();
    assert!(explain.starts_with(&format!(
        "{} total={score:.1}",
        header(&resp, "x-fleet-node")
    )));
    let mut body = resp.bytes_stream();
    while body.next().await.is_some() {}
}

/// A current Ollama (llama-server runner) keeps a conversation pushed out of its only slot
/// in its host-memory prompt cache; corral, told neither the kind nor the slot count,
/// keeps sending the conversation there and calls it `host`.
#[tokio::test]
async fn a_conversation_displaced_into_host_memory_goes_back_to_its_node() {
    let current_ollama = |name: &str| {
        let mut cfg = fast_node(name);
        cfg.num_parallel = 1;
        cfg.kind = corral::standin::StandinKind::Ollama;
        cfg.cache_ram_tokens = 100_000;
        cfg
    };
    let nodes = futures::future::join_all(["x", "y"].map(|n| start(current_ollama(n)))).await;
    let router = Router::start(
        nodes
            .iter()
            .map(|n| NodeSpec {
                num_parallel: 1,
                ..NodeSpec::of(n, 1)
            })
            .collect(),
        "",
    )
    .await;
    let by_name: HashMap<_, _> = nodes.iter().map(|n| (n.name().to_string(), n)).collect();

    let a1 = turns("first");
    let (home, _, reply) = chat(&router, &a1).await;
    // New conversations until one takes the home node's only slot.
    let mut displaced = false;
    for i in 0..32 {
        let (node, affinity, _) = chat(&router, &turns(&format!("other {i}"))).await;
        assert_eq!(affinity, "new");
        if node == home {
            displaced = true;
            break;
        }
    }
    assert!(displaced, "some new conversation went to {home}");

    let a2 = follow(a1, reply, "And then?");
    let (node, affinity, _) = chat(&router, &a2).await;
    assert_eq!(
        (node.as_str(), affinity.as_str()),
        (home.as_str(), "host"),
        "the follow-up went back to the node that keeps it in host memory"
    );
    let served = last_log(by_name[&node]);
    assert!(
        served.cached_tokens > 100,
        "the node restored the conversation from its host cache: {served:?}"
    );
}

/// When a slot frees, a turn whose conversation the node keeps warm goes before a cold
/// request that has waited longer: the warm turn's prefill is short, so it starts at once
/// and the queue's median wait falls.
#[tokio::test]
async fn a_warm_turn_waiting_for_its_node_goes_before_a_cold_one_that_came_first() {
    let mut cfg = fast_node("n");
    cfg.num_parallel = 1;
    cfg.decode_per_token = Duration::from_millis(20);
    cfg.kind = corral::standin::StandinKind::Ollama;
    cfg.cache_ram_tokens = 100_000;
    let node = start(cfg).await;
    let (router, fleet_url) = one_node_with_admin(&node).await;
    let waiting = async |n: u64| get_json(&fleet_url).await["waiting"] == n;
    let send = |t: Vec<String>| {
        let request = client()
            .post(format!("{}/api/chat", router.url()))
            .json(&chat_body(&t, false));
        tokio::spawn(async move {
            let resp = request.send().await.expect("a reply");
            (resp.status().as_u16(), header(&resp, "x-fleet-affinity"))
        })
    };

    let a1 = turns("the warm conversation");
    let (_, _, reply) = chat(&router, &a1).await;
    // Another conversation takes the only slot; the first one stays in host memory.
    let held = hold(&router, "holding the slot", 4000).await;
    // Cold requests wait before and after it, so that neither first come first served nor
    // last come first served would serve it first.
    let before = send(turns("a cold conversation"));
    eventually("the cold request waits", async || waiting(1).await).await;
    let warm = send(follow(a1, reply, "And then?"));
    eventually("the warm turn waits behind it", async || waiting(2).await).await;
    let after = send(turns("another cold conversation"));
    eventually("another cold request waits", async || waiting(3).await).await;
    drop(held);

    assert_eq!(warm.await.unwrap(), (200, "host".to_string()));
    for cold in [before, after] {
        assert_eq!(cold.await.unwrap(), (200, "new".to_string()));
    }
    let log = node.log();
    let [.., first, second, third] = log.as_slice() else {
        panic!("the node served all three: {log:?}");
    };
    assert!(
        first.cached_tokens > 100 && second.cached_tokens.max(third.cached_tokens) < 100,
        "the warm turn took the freed slot first: {log:?}"
    );
}

/// A llama.cpp server shows its slots in `/props`; corral, configured with the default
/// `num_parallel` (1), learns them and runs that many requests there at once instead of
/// queueing all but one.
#[tokio::test]
async fn slots_a_llama_server_shows_are_learned_and_used() {
    let mut cfg = fast_node("llama");
    cfg.num_parallel = 3;
    cfg.kind = corral::standin::StandinKind::LlamaCpp;
    let node = start(cfg).await;
    let (router, fleet_url) = one_node_with_admin(&node).await;
    eventually("corral shows the node's 3 slots", async || {
        get_json(&fleet_url).await["nodes"][0]["slots_shown"] == 3
    })
    .await;
    let fleet = get_json(&fleet_url).await;
    assert_eq!(fleet["nodes"][0]["kind"], "llama-cpp", "{fleet}");
    // Configured 1, shown 3: corral sends 3 at once.
    assert_eq!(fleet["nodes"][0]["num_parallel"], 1, "{fleet}");
    assert_eq!(fleet["nodes"][0]["parallel"], 3, "{fleet}");

    // Three long replies at once: each gets its header only once corral admits it.
    let texts: Vec<String> = (0..3).map(|i| format!("held conversation {i}")).collect();
    let held = futures::future::join_all(texts.iter().map(|t| hold(&router, t, 4000))).await;
    let fleet = get_json(&fleet_url).await;
    assert_eq!(
        fleet["nodes"][0]["models"][MODEL]["in_flight"], 3,
        "all three ran at once: {fleet}"
    );
    drop(held);
}

/// A llama.cpp server lists no models (it has no `/api/ps`) and runs the one it was started
/// with: corral takes that model as loaded on every such node, so an idle one serves a new
/// conversation rather than it waiting for the one node that has replied so far.
#[tokio::test]
async fn an_idle_llama_server_takes_a_new_conversation() {
    let llama = |name: &str| {
        let mut cfg = fast_node(name);
        cfg.num_parallel = 1;
        cfg.kind = corral::standin::StandinKind::LlamaCpp;
        cfg
    };
    let nodes = futures::future::join_all(["x", "y"].map(|n| start(llama(n)))).await;
    let router = Router::start(nodes.iter().map(|n| NodeSpec::of(n, 1)).collect(), "").await;

    let first = turns("first conversation");
    let (home, _, reply) = chat(&router, &first).await;
    // The conversation's next turn keeps its node's only slot busy for a while.
    let held = hold_turns(&router, &follow(first, reply, "Go on at length."), 4000).await;
    assert_eq!(header(&held, "x-fleet-node"), home);

    let (node, affinity, _) = chat(&router, &turns("second conversation")).await;
    assert_eq!(affinity, "new");
    assert_ne!(node, home, "the new conversation went to the idle node");
    drop(held);
}

/// What a node saw of one request when it arrived.
#[derive(Clone, Debug)]
struct Arrival {
    /// The conversation's first message, and how many messages it had.
    first: String,
    messages: usize,
    /// Requests the node was already working on.
    beside: usize,
}

/// A node that takes `start_up` to begin every request (as Ollama on a busy CPU takes to
/// render the template and hand the prompt to its runner), reports a 1 ms prefill, and
/// works 1.5 s more on a conversation whose first message starts with "hold". It lists
/// MODEL resident and records each request's arrival.
struct SlowStartNode {
    addr: std::net::SocketAddr,
    arrivals: std::sync::Arc<std::sync::Mutex<Vec<Arrival>>>,
    task: tokio::task::JoinHandle<()>,
}

impl SlowStartNode {
    async fn start(start_up: Duration) -> SlowStartNode {
        use axum::routing::post;
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::{Arc, Mutex};
        let arrivals = Arc::new(Mutex::new(Vec::new()));
        let working = Arc::new(AtomicUsize::new(0));
        let seen = arrivals.clone();
        let chat = move |axum::Json(body): axum::Json<serde_json::Value>| {
            let (seen, working) = (seen.clone(), working.clone());
            async move {
                let messages = body["messages"].as_array().cloned().unwrap_or_default();
                let first = messages.first().map_or(String::new(), |m| {
                    m["content"].as_str().unwrap_or_default().to_string()
                });
                let beside = working.fetch_add(1, Ordering::SeqCst);
                let hold = first.starts_with("hold");
                seen.lock().unwrap().push(Arrival {
                    first,
                    messages: messages.len(),
                    beside,
                });
                tokio::time::sleep(start_up).await;
                let generation = if hold {
                    Duration::from_millis(1500)
                } else {
                    Duration::ZERO
                };
                tokio::time::sleep(generation).await;
                working.fetch_sub(1, Ordering::SeqCst);
                axum::Json(serde_json::json!({
                    "model": MODEL,
                    "message": { "role": "assistant", "content": "fine" },
                    "done": true,
                    "prompt_eval_count": 40,
                    "prompt_eval_duration": 1_000_000,
                    "eval_count": 2,
                    "eval_duration": generation.as_nanos() as u64 + 1_000,
                }))
            }
        };
        let app = ollama_listing(MODEL, "0.0.0").route("/api/chat", post(chat));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        SlowStartNode {
            addr,
            arrivals,
            task,
        }
    }

    /// Its entry in corral's `nodes:`, one slot.
    fn yaml(&self, queue_at_node: bool) -> String {
        format!(
            "  - name: slow\n    url: http://{}\n    num_parallel: 1\n    queue_at_node: {queue_at_node}\n",
            self.addr
        )
    }

    fn arrival(&self, first: &str, messages: usize) -> Arrival {
        let arrivals = self.arrivals.lock().unwrap();
        let found = arrivals
            .iter()
            .find(|a| a.first == first && a.messages == messages);
        found
            .cloned()
            .unwrap_or_else(|| panic!("{first} never arrived: {arrivals:?}"))
    }
}

impl Drop for SlowStartNode {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One slot; "a" served, then "hold" runs long in the slot while a's follow-up and a new
/// conversation "c" come. Returns what the node saw of both when they arrived.
async fn follow_up_and_new_beside_a_long_request(
    start_up: Duration,
    queue_at_node: bool,
) -> (Arrival, Arrival) {
    let node = SlowStartNode::start(start_up).await;
    let router = Router::start_with_node_yaml(&node.yaml(queue_at_node), "").await;
    let a = vec!["a".to_string()];
    let (reply, _, _) = chat(&router, &a).await;
    let held = {
        let router_url = router.url();
        tokio::spawn(async move {
            let body = chat_body(&["hold".to_string()], false);
            client()
                .post(format!("{router_url}/api/chat"))
                .json(&body)
                .send()
                .await
                .unwrap()
                .status()
        })
    };
    eventually("hold reaches the node", async || {
        node.arrivals
            .lock()
            .unwrap()
            .iter()
            .any(|x| x.first == "hold")
    })
    .await;
    let follow_up = follow(a, reply, "and then?");
    let (warm, cold) = tokio::join!(chat(&router, &follow_up), async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        chat(&router, &["c".to_string()]).await
    });
    assert_eq!(held.await.unwrap(), 200);
    assert!(!warm.0.is_empty() && !cold.0.is_empty());
    (node.arrival("a", 3), node.arrival("c", 1))
}

#[tokio::test]
async fn a_warm_follow_up_waits_in_the_queue_of_a_node_slow_to_begin_a_request() {
    // Configured to queue at the node, which takes 0.3 s from arrival to work on every
    // request: corral measured it on "a" and sends a's follow-up, warm there, at once into
    // the node's queue beside "hold", which holds the one slot. The new conversation "c",
    // cold everywhere, still waits in corral until the slot frees.
    let start_up = Duration::from_millis(300);
    let (follow_up, new) = follow_up_and_new_beside_a_long_request(start_up, true).await;
    assert_eq!(follow_up.beside, 1, "sent while hold ran: {follow_up:?}");
    assert_eq!(new.beside, 0, "sent once hold ended: {new:?}");
}

#[tokio::test]
async fn no_request_goes_past_the_slots_of_a_node_that_begins_at_once_or_is_not_set_to_queue() {
    for (start_up, queue_at_node) in [(Duration::ZERO, true), (Duration::from_millis(300), false)] {
        let (follow_up, new) =
            follow_up_and_new_beside_a_long_request(start_up, queue_at_node).await;
        assert_eq!(follow_up.beside, 0, "sent once hold ended: {follow_up:?}");
        assert_eq!(new.beside, 0, "{new:?}");
    }
}
