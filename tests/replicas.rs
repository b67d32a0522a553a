//! Several corral replicas in front of one fleet, sharing state through a real
//! `redis-server` (`shared_state:`): requests alternate between replicas as a load balancer
//! in front of them would send them.

mod common;

use std::time::{Duration, Instant};

use common::{NodeSpec, Router, Store, chat_body, client, fast_node, header, start};
use corral::standin::{StandinKind, StandinNode};

const NODES: usize = 3;
const SLOTS: usize = 2;

async fn fleet() -> Vec<StandinNode> {
    fleet_of(SLOTS).await
}

/// Three stand-ins of current Ollama of `slots` slots each, prefilling 5,000 tokens a second:
/// a cold turn here costs 20-80 ms more than a warm one. At `fast_node`'s 200,000 a second a
/// cold prefill costs no more than a warm one, corral learns as much from the replies, and
/// where a follow-up lands is decided by the queues alone: one replica then kept 0.55-0.83
/// of them warm, and two sharing a store fell to what two apart keep in some runs.
async fn fleet_of(slots: usize) -> Vec<StandinNode> {
    let mut nodes = Vec::new();
    for i in 0..NODES {
        let mut cfg = fast_node(&format!("n{i}"));
        cfg.num_parallel = slots;
        cfg.prefill_per_token = Duration::from_micros(200);
        cfg.decode_per_token = Duration::from_millis(3);
        // Current Ollama: llama-server's slots and its prompt cache in host memory.
        cfg.kind = StandinKind::Ollama;
        cfg.cache_ram_tokens = 50_000;
        nodes.push(start(cfg).await);
    }
    nodes
}

fn specs(nodes: &[StandinNode]) -> Vec<NodeSpec> {
    nodes
        .iter()
        .map(|n| NodeSpec::of(n, n.config().num_parallel))
        .collect()
}

async fn replicas(nodes: &[StandinNode], count: usize, extra_yaml: &str) -> Vec<Router> {
    let mut routers = Vec::new();
    for _ in 0..count {
        routers.push(Router::start(specs(nodes), extra_yaml).await);
    }
    routers
}

/// What a replay showed, read from the nodes' own logs.
#[derive(Debug)]
struct Replayed {
    /// Of the follow-up turns, the share whose conversation the node had cached.
    warm_share: f64,
    /// The most requests for the model any node had open at once.
    most_open: u32,
    /// Requests that did not end in 200.
    failed: usize,
}

/// `conversations` conversations of `turns` turns at once, each turn sent to the next
/// replica in turn, as a round-robin balancer in front of them would.
async fn replay(
    routers: &[Router],
    nodes: &[StandinNode],
    conversations: usize,
    turns: usize,
) -> Replayed {
    replay_with_pauses(routers, nodes, (conversations, turns), Duration::ZERO).await
}

/// As [`replay`], each turn sent `think` after the last reply ended.
async fn replay_with_pauses(
    routers: &[Router],
    nodes: &[StandinNode],
    (conversations, turns): (usize, usize),
    think: Duration,
) -> Replayed {
    let urls: Vec<String> = routers.iter().map(Router::url).collect();
    let mut tasks = Vec::new();
    for c in 0..conversations {
        let urls = urls.clone();
        tasks.push(tokio::spawn(async move {
            let mut failed = 0;
            let mut messages: Vec<String> = Vec::new();
            for t in 0..turns {
                let filler = "tell me more about the fleet and its nodes ".repeat(8);
                messages.push(format!("conversation {c}, turn {t}: {filler}"));
                let mut body = chat_body(&messages, false);
                body["options"] = serde_json::json!({ "num_predict": 20 });
                let url = &urls[(c + t) % urls.len()];
                let reply = client()
                    .post(format!("{url}/api/chat"))
                    .json(&body)
                    .send()
                    .await;
                let Ok(reply) = reply.map_err(|e| eprintln!("conversation {c}: {e}")) else {
                    failed += 1;
                    break;
                };
                if reply.status() != 200 {
                    eprintln!("conversation {c}: {}", reply.status());
                    failed += 1;
                    break;
                }
                let body: serde_json::Value = reply.json().await.unwrap_or_default();
                let text = body["message"]["content"].as_str().unwrap_or("ok");
                messages.push(text.to_string());
                tokio::time::sleep(think).await;
            }
            failed
        }));
    }
    let mut failed = 0;
    for task in tasks {
        failed += task.await.expect("conversation task");
    }
    let log: Vec<_> = nodes.iter().flat_map(|n| n.log()).collect();
    let follow_ups = log.len().saturating_sub(conversations).max(1);
    let warm = log
        .iter()
        .filter(|r| r.cached_tokens > 0 && r.cached_tokens * 2 >= r.prompt_tokens)
        .count();
    let most_open = nodes
        .iter()
        .filter_map(|n| n.most_open().get(common::MODEL).copied())
        .max()
        .unwrap_or(0);
    Replayed {
        warm_share: warm as f64 / follow_ups as f64,
        most_open,
        failed,
    }
}

/// Replays of 12 live conversations x 4 turns on 6 slots, each on a fresh fleet, `rounds`
/// times each: through one replica, two sharing a store, and two apart.
struct Rounds {
    alone: Vec<Replayed>,
    shared: Vec<Replayed>,
    apart: Vec<Replayed>,
}

async fn contended_rounds(rounds: usize) -> Rounds {
    let (conversations, turns) = (12, 4);
    let store = Store::start().await;
    let mut r = Rounds {
        alone: Vec::new(),
        shared: Vec::new(),
        apart: Vec::new(),
    };
    for _ in 0..rounds {
        let nodes = fleet().await;
        let one = replicas(&nodes, 1, "").await;
        r.alone
            .push(replay(&one, &nodes, conversations, turns).await);
        drop(one);

        let nodes = fleet().await;
        let metrics = [common::free_port(), common::free_port()];
        let mut two = Vec::new();
        for port in metrics {
            let yaml = format!("{}metrics_listen: 127.0.0.1:{port}\n", store.yaml());
            two.extend(replicas(&nodes, 1, &yaml).await);
        }
        // Both replicas subscribed before the replay.
        tokio::time::sleep(Duration::from_millis(500)).await;
        r.shared
            .push(replay(&two, &nodes, conversations, turns).await);
        for port in metrics {
            let scrape = common::scrape(port).await;
            let store_lines = scrape
                .lines()
                .filter(|l| l.starts_with("corral_shared_state"));
            for line in store_lines.filter(|l| !l.contains("_bucket")) {
                eprintln!("{port} {line}");
            }
        }
        drop(two);

        let nodes = fleet().await;
        let two_apart = replicas(&nodes, 2, "").await;
        r.apart
            .push(replay(&two_apart, &nodes, conversations, turns).await);
    }
    eprintln!(
        "one replica {:?}\ntwo sharing {:?}\ntwo apart {:?}",
        r.alone, r.shared, r.apart
    );
    for run in r.alone.iter().chain(&r.shared) {
        assert_eq!(run.failed, 0, "{run:?}");
    }
    r
}

fn mean_warm(runs: &[Replayed]) -> f64 {
    runs.iter().map(|r| r.warm_share).sum::<f64>() / runs.len().max(1) as f64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_replicas_sharing_a_store_act_as_one() {
    let r = contended_rounds(6).await;
    assert!(
        r.alone.iter().all(|r| r.most_open <= SLOTS as u32),
        "{:?}",
        r.alone
    );
    assert!(
        r.shared.iter().all(|r| r.most_open <= SLOTS as u32),
        "two replicas sent a node more than its {SLOTS} slots: {:?}",
        r.shared
    );
    // Replicas that share where conversations are warm keep about what one replica keeps,
    // and far more than replicas apart, which each know only the turns they sent: in three
    // runs of this, one replica kept every follow-up warm in all 18 replays, two sharing
    // 0.97-1.00 a replay (means 0.99-0.995), two apart 0.38-0.88 (means 0.54-0.62). The
    // bounds leave room for a slower machine; the 0.02 is measured by the ignored
    // test below.
    let (alone, shared, apart) = (
        mean_warm(&r.alone),
        mean_warm(&r.shared),
        mean_warm(&r.apart),
    );
    assert!(
        shared >= apart + 0.2,
        "two replicas sharing kept little more warm than two apart ({shared:.3} vs {apart:.3}): \
         {:?} against {:?}",
        r.shared,
        r.apart
    );
    assert!(
        shared >= alone - 0.1,
        "two replicas sharing kept fewer warm than one ({shared:.3} vs {alone:.3}): {:?}",
        r.shared
    );
}

/// The bound, under contention: within 0.02 of one replica's warm share. A
/// measurement, not run in CI: each miss moves a replay's share by 0.028. On this fleet one
/// replica keeps every follow-up warm. Two sharing kept 421-423 of 432 in four runs of 12
/// replays when a replica heard what waited in another only at its beats (2 s apart), the
/// bound missed by about 0.005; told within a few ms of each change, 423-427 (0.984 pooled,
/// within it). The misses are follow-ups moved off their warm node while it
/// was busy with a queue, to a node with a free slot. Run with
/// `cargo test --test replicas -- --ignored`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "a measurement: within the bound by about 0.004 pooled (see above)"]
async fn under_contention_two_replicas_keep_one_replicas_warm_share() {
    let r = contended_rounds(6).await;
    assert!(
        mean_warm(&r.shared) >= mean_warm(&r.alone) - 0.02,
        "two replicas kept fewer follow-ups warm than one: {:?} against {:?}",
        r.shared,
        r.alone
    );
}

/// Sends turn 1 to one replica and turn 2 to the other: whether the second went where the
/// first is warm.
async fn follow_up_finds_its_node(a: &Router, b: &Router, n: usize) -> bool {
    let first = vec![format!("a new conversation {n}: {}", "words ".repeat(60))];
    let reply = client()
        .post(format!("{}/api/chat", a.url()))
        .json(&chat_body(&first, false))
        .send()
        .await
        .expect("turn 1");
    let node = header(&reply, "x-fleet-node");
    let second = [first[0].clone(), "ok".into(), "and then?".into()];
    let reply = client()
        .post(format!("{}/api/chat", b.url()))
        .json(&chat_body(&second, false))
        .send()
        .await
        .expect("turn 2");
    header(&reply, "x-fleet-node") == node && header(&reply, "x-fleet-affinity") == "hit"
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_store_going_away_loses_no_request_and_sharing_resumes_when_it_is_back() {
    let mut store = Store::start().await;
    let nodes = fleet().await;
    let metrics_port = common::free_port();
    let yaml = format!("{}metrics_listen: 127.0.0.1:{metrics_port}\n", store.yaml());
    let mut routers = replicas(&nodes, 1, &yaml).await;
    routers.extend(replicas(&nodes, 1, &store.yaml()).await);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(follow_up_finds_its_node(&routers[0], &routers[1], 0).await);

    // A replay across both replicas; the store dies in the middle of it.
    let replaying = replay(&routers, &nodes, 8, 6);
    let killing = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        store.stop();
    };
    let (replayed, ()) = tokio::join!(replaying, killing);
    assert_eq!(replayed.failed, 0, "{replayed:?}");
    let scrape = common::scrape(metrics_port).await;
    let errors: f64 = scrape
        .lines()
        .filter(|l| l.starts_with("corral_shared_state_errors_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(errors > 0.0, "no store error counted:\n{scrape}");

    // Requests keep being served without the store.
    let started = Instant::now();
    assert!(
        client()
            .post(format!("{}/api/chat", routers[1].url()))
            .json(&chat_body(&["alone".into()], false))
            .send()
            .await
            .is_ok_and(|r| r.status() == 200)
    );
    eprintln!("served without the store in {:?}", started.elapsed());

    store.restart().await;
    let mut n = 1;
    common::eventually("the replicas share again", async || {
        n += 1;
        follow_up_finds_its_node(&routers[0], &routers[1], n).await
    })
    .await;
}

/// Starts a streamed chat of `tokens` tokens on `router` and returns it once its first
/// chunk arrived: by then the request holds its slot on the node.
async fn streaming(router: &Router, text: &str, tokens: u32) -> reqwest::Response {
    let mut body = chat_body(&[text.to_string()], true);
    body["options"] = serde_json::json!({ "num_predict": tokens });
    let mut reply = client()
        .post(format!("{}/api/chat", router.url()))
        .json(&body)
        .send()
        .await
        .expect("a streamed reply");
    assert_eq!(reply.status(), 200);
    let first = reply.chunk().await.expect("a first chunk");
    assert!(first.is_some_and(|c| !c.is_empty()));
    reply
}

async fn short_chat(url: String, text: String) -> reqwest::StatusCode {
    let mut body = chat_body(&[text], false);
    body["options"] = serde_json::json!({ "num_predict": 5 });
    client()
        .post(format!("{url}/api/chat"))
        .json(&body)
        .send()
        .await
        .map_or(reqwest::StatusCode::BAD_GATEWAY, |r| r.status())
}

/// A stand-in of one slot, decoding 10 ms a token.
fn one_slot_node() -> corral::standin::StandinConfig {
    let mut cfg = fast_node("n0");
    cfg.num_parallel = 1;
    cfg.decode_per_token = Duration::from_millis(10);
    cfg
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slot_another_replica_frees_or_leaves_behind_goes_to_a_waiting_request() {
    let store = Store::start().await;
    let mut cfg = one_slot_node();
    cfg.kind = StandinKind::Ollama;
    cfg.cache_ram_tokens = 50_000;
    let node = start(cfg).await;
    let spec = || vec![NodeSpec::of(&node, 1)];
    // Leases of 1 s, so that a dead replica's slot comes back within the test.
    let yaml = format!("{}  lease: 1s\n", store.yaml());
    let a = Router::start(spec(), &yaml).await;
    let b = Router::start(spec(), &yaml).await;
    tokio::time::sleep(Duration::from_millis(500)).await;

    // A's request holds the one slot; B's waits for it, and is served when A's ends.
    let mut running = streaming(&a, "a long answer, please", 100).await;
    let waiting = tokio::spawn(short_chat(b.url(), "a short one".into()));
    while running.chunk().await.expect("the stream goes on").is_some() {}
    assert_eq!(waiting.await.expect("task"), 200);
    assert_eq!(
        node.most_open().get(common::MODEL).copied(),
        Some(1),
        "B sent its request while A's held the node's one slot"
    );

    // A replica that starts now learns from the store what the others learned of the node.
    let admin = common::free_port();
    let joining = format!("{yaml}admin_listen: 127.0.0.1:{admin}\n");
    tokio::time::sleep(Duration::from_millis(600)).await;
    let c = Router::start(spec(), &joining).await;
    let fleet = common::get_json(&format!("http://127.0.0.1:{admin}/fleet")).await;
    let learned = &fleet["nodes"][0]["models"][common::MODEL];
    assert!(
        learned["ttfb_ms"].as_f64().is_some_and(|ms| ms > 0.0)
            && learned["decode_tokens_per_second"].as_f64().is_some(),
        "the new replica knows nothing of n0: {fleet}"
    );
    // It shares from then on, without a restart of the others: both ways.
    let mut n = 0;
    common::eventually("the replica that joined shares", async || {
        n += 2;
        follow_up_finds_its_node(&b, &c, n).await && follow_up_finds_its_node(&c, &a, n + 1).await
    })
    .await;
    drop(c);

    // A dies holding the slot: its lease expires and B, having waited, is served.
    let _held = streaming(&a, "an answer that never ends", 5_000).await;
    drop(a);
    assert_eq!(short_chat(b.url(), "after the crash".into()).await, 200);
    assert_eq!(node.most_open().get(common::MODEL).copied(), Some(1));
}

/// What a `waits` event on the store's channel says waits for n0, if it is one.
fn waits_on_n0(payload: &str) -> Option<u64> {
    let event: serde_json::Value = serde_json::from_str(payload).ok()?;
    (event["event"] == "waits").then(|| {
        let waits = event["waits"].as_array().cloned().unwrap_or_default();
        (waits.iter())
            .filter(|w| w["node"] == "n0")
            .filter_map(|w| w["count"].as_u64())
            .sum()
    })
}

/// A request that starts or stops waiting in one replica is told to the others then, not
/// only in the replica's next beat (2 s with the default lease), which would have them count
/// a queue already served: the store's event channel carries a `waits` event counting it
/// waiting, and one without it once it was served.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_tells_the_others_what_waits_in_it_when_that_changes() {
    use futures::StreamExt;
    let store = Store::start().await;
    let node = start(one_slot_node()).await;
    let a = Router::start(vec![NodeSpec::of(&node, 1)], &store.yaml()).await;
    let listener = redis::Client::open(store.url()).expect("a url");
    let mut pubsub = listener.get_async_pubsub().await.expect("connects");
    pubsub.subscribe("corral:events").await.expect("subscribes");
    let mut events = pubsub.on_message();
    let mut next_waits = async || loop {
        let message = events.next().await.expect("the channel stays open");
        let payload: String = message.get_payload().unwrap_or_default();
        if let Some(count) = waits_on_n0(&payload) {
            return count;
        }
    };
    let within = Duration::from_secs(10);

    let mut running = streaming(&a, "a long answer, please", 100).await;
    let waiting = tokio::spawn(short_chat(a.url(), "a short one".into()));
    let told = tokio::time::timeout(within, async { while next_waits().await != 1 {} });
    told.await
        .expect("no waits event counted the request waiting in A");

    while running.chunk().await.expect("the stream goes on").is_some() {}
    assert_eq!(waiting.await.expect("task"), 200);
    let told = tokio::time::timeout(within, async { while next_waits().await != 0 {} });
    told.await
        .expect("no waits event said the request was served");
}

/// A chat of `tokens` tokens under `key`, on `router`; returns when its reply ended.
async fn keyed_chat(url: String, key: &str, text: &str, tokens: u32) -> Instant {
    let mut body = chat_body(&[text.to_string()], false);
    body["options"] = serde_json::json!({ "num_predict": tokens });
    let reply = client()
        .post(format!("{url}/api/chat"))
        .bearer_auth(key)
        .json(&body)
        .send()
        .await
        .expect("a reply");
    assert_eq!(reply.status(), 200);
    let _ = reply.bytes().await;
    Instant::now()
}

/// Two replicas sharing a store, each with its admin API, in front of one node of one slot,
/// with three named keys: `k-agent`, `k-person` and `k-filler`.
struct Keyed {
    _store: Store,
    _node: StandinNode,
    replicas: [(Router, u16); 2],
}

async fn keyed_replicas() -> Keyed {
    let store = Store::start().await;
    let node = start(one_slot_node()).await;
    let keys = "api_keys:\n  - {name: agent, key: k-agent}\n  - {name: person, key: k-person}\n  - {name: filler, key: k-filler}\n";
    let replica = async || {
        let admin = common::free_port();
        let yaml = format!("{}{keys}admin_listen: 127.0.0.1:{admin}\n", store.yaml());
        (
            Router::start(vec![NodeSpec::of(&node, 1)], &yaml).await,
            admin,
        )
    };
    let replicas = [replica().await, replica().await];
    // Both subscribed.
    tokio::time::sleep(Duration::from_millis(500)).await;
    Keyed {
        _store: store,
        _node: node,
        replicas,
    }
}

/// The filler's streamed reply through `router`, once it holds the node's one slot.
async fn hold_the_slot(router: &Router) -> reqwest::Response {
    let mut body = chat_body(&["filler".to_string()], true);
    body["options"] = serde_json::json!({ "num_predict": 40 });
    let mut filler = client()
        .post(format!("{}/api/chat", router.url()))
        .bearer_auth("k-filler")
        .json(&body)
        .send()
        .await
        .expect("the filler's reply");
    assert!(filler.chunk().await.expect("a chunk").is_some());
    filler
}

/// Until the replica with this admin port counts at least `n` requests waiting (its own, and
/// the other replica's as it last heard).
async fn waiting_at_least(admin: u16, n: u64) {
    let url = format!("http://127.0.0.1:{admin}/fleet");
    common::eventually("requests wait", async || {
        common::get_json(&url).await["waiting"].as_u64() >= Some(n)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn service_a_client_had_through_another_replica_counts_in_the_fair_order() {
    let keyed = keyed_replicas().await;
    let [(a, admin), (b, _)] = &keyed.replicas;

    // The agent has had about a second of the slot, all of it through B.
    for i in 0..4 {
        keyed_chat(b.url(), "k-agent", &format!("agent task {i}"), 25).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;

    // On A, a third client holds the slot; the agent's request arrives, then the person's.
    let mut filler = hold_the_slot(a).await;
    let agent = tokio::spawn(keyed_chat(a.url(), "k-agent", "agent, on A", 5));
    waiting_at_least(*admin, 1).await;
    let person = tokio::spawn(keyed_chat(a.url(), "k-person", "person, on A", 5));
    waiting_at_least(*admin, 2).await;
    while filler.chunk().await.expect("the stream goes on").is_some() {}

    let (agent, person) = (agent.await.expect("agent"), person.await.expect("person"));
    assert!(
        person < agent,
        "the freed slot went to the agent, which had more service through the other replica"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slot_goes_to_the_fairest_waiting_request_whichever_replica_it_waits_in() {
    let keyed = keyed_replicas().await;
    let [(x, admin_x), (y, admin_y)] = &keyed.replicas;
    // The agent has had the slot for a while.
    for i in 0..3 {
        keyed_chat(x.url(), "k-agent", &format!("agent task {i}"), 25).await;
    }

    // A third client holds the slot through X; the agent's next request waits in X, the
    // person's in Y.
    let mut filler = hold_the_slot(x).await;
    let agent = tokio::spawn(keyed_chat(x.url(), "k-agent", "agent, on X", 5));
    waiting_at_least(*admin_x, 1).await;
    let person = tokio::spawn(keyed_chat(y.url(), "k-person", "person, on Y", 5));
    waiting_at_least(*admin_y, 1).await;
    // Both are entered among the node's waiters.
    tokio::time::sleep(Duration::from_millis(300)).await;
    while filler.chunk().await.expect("the stream goes on").is_some() {}

    let (agent, person) = (agent.await.expect("agent"), person.await.expect("person"));
    assert!(
        person < agent,
        "the slot freed in X went to X's agent, though Y's person had less service"
    );
}

/// With a slot for every live conversation one replica keeps every follow-up warm, and two
/// sharing a store must too. The hard part is the first turns, reaching both replicas at
/// once: each counts only the requests it has heard of, so the store turns some away from a
/// node the other replica filled, and they must go where a slot is free at once rather than
/// wait for that node (waiting, they gave a node five conversations for its four slots, and
/// 1-3 of 36 follow-ups moved off their warm node in about half the replays).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_a_slot_for_every_conversation_two_replicas_keep_every_follow_up_warm() {
    const ROOMY: usize = 4;
    let think = Duration::from_millis(20);
    let nodes = fleet_of(ROOMY).await;
    let one = replicas(&nodes, 1, "").await;
    let alone = replay_with_pauses(&one, &nodes, (12, 4), think).await;
    drop(one);

    let store = Store::start().await;
    let nodes = fleet_of(ROOMY).await;
    let mut two = replicas(&nodes, 1, &store.yaml()).await;
    two.extend(replicas(&nodes, 1, &store.yaml()).await);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let shared = replay_with_pauses(&two, &nodes, (12, 4), think).await;
    eprintln!("one replica {alone:?}\ntwo sharing {shared:?}");
    assert_eq!((alone.failed, shared.failed), (0, 0));
    assert!(shared.most_open <= ROOMY as u32, "{shared:?}");
    assert!(
        shared.warm_share >= alone.warm_share - 0.02,
        "two replicas kept fewer follow-ups warm than one: {shared:?} against {alone:?}"
    );
}

/// Requests reaching two replicas at the same instant, before either hears of the other's:
/// only the lease taken in the store keeps them from both taking the node's one slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn requests_reaching_two_replicas_at_once_take_one_slot_between_them() {
    let store = Store::start().await;
    let node = start(one_slot_node()).await;
    let a = Router::start(vec![NodeSpec::of(&node, 1)], &store.yaml()).await;
    let b = Router::start(vec![NodeSpec::of(&node, 1)], &store.yaml()).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    for round in 0..5 {
        let (to_a, to_b) = (
            format!("round {round}, via A"),
            format!("round {round}, via B"),
        );
        let (first, second) = tokio::join!(short_chat(a.url(), to_a), short_chat(b.url(), to_b));
        assert_eq!((first.as_u16(), second.as_u16()), (200, 200));
    }
    assert_eq!(
        node.most_open().get(common::MODEL).copied(),
        Some(1),
        "two replicas sent the node's one slot two requests at once"
    );
}
