//! Fair to every client: one API key's burst does not hold back another key's turn, and a
//! key over its limits is refused with 429 and `Retry-After`, limits read anew on reload.

mod common;

use std::time::{Duration, Instant};

use async_openai::Client;
use async_openai::config::OpenAIConfig;
use async_openai::types::chat::{
    ChatCompletionRequestUserMessageArgs, CreateChatCompletionRequestArgs,
};
use common::*;
use serde_json::json;

const KEYS: &str = "api_keys:\n  - {name: person, key: kp}\n  - {name: agent, key: ka}\n";

/// One node of one slot whose replies take about 0.3 s.
async fn one_slot_node() -> corral::standin::StandinNode {
    let mut cfg = fast_node("n");
    cfg.num_parallel = 1;
    cfg.reply_tokens = 20;
    cfg.decode_per_token = Duration::from_millis(15);
    start(cfg).await
}

/// Sends a streamed chat under `key` and returns the reply once its head came.
async fn post_as(router_url: &str, key: &str, text: &str) -> reqwest::Response {
    let body = json!({ "model": MODEL, "messages": [{ "role": "user", "content": text }] });
    client()
        .post(format!("{router_url}/api/chat"))
        .bearer_auth(key)
        .json(&body)
        .send()
        .await
        .expect("a reply")
}

/// Sends a chat under `key` and returns its status and when its reply ended.
async fn chat_as(router_url: String, key: &str, text: String) -> (u16, Instant) {
    let resp = post_as(&router_url, key, &text).await;
    let status = resp.status().as_u16();
    resp.bytes().await.expect("the whole reply");
    (status, Instant::now())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_keys_burst_does_not_hold_back_another_keys_turn() {
    let node = one_slot_node().await;
    let metrics_port = free_port();
    let yaml = format!("{KEYS}metrics_listen: 127.0.0.1:{metrics_port}\n");
    let router = Router::start(vec![NodeSpec::of(&node, 1)], &yaml).await;

    // The agent sends six at once on the one slot: one runs, five wait.
    let agent: Vec<_> = (0..6)
        .map(|i| tokio::spawn(chat_as(router.url(), "ka", format!("agent task {i}"))))
        .collect();
    eventually("the agent's first request runs", async || {
        node.log().len() == 1
    })
    .await;
    tokio::time::sleep(Duration::from_millis(50)).await;

    // The person asks once, through an OpenAI client, after all of them.
    let config = OpenAIConfig::new()
        .with_api_base(format!("{}/v1", router.url()))
        .with_api_key("kp");
    let message = ChatCompletionRequestUserMessageArgs::default()
        .content("a person's question")
        .build()
        .unwrap();
    let request = CreateChatCompletionRequestArgs::default()
        .model(MODEL)
        .messages([message.into()])
        .build()
        .unwrap();
    let reply = Client::with_config(config).chat().create(request).await;
    let person_done = Instant::now();
    assert!(reply.is_ok(), "{reply:?}");

    let mut agent_done = Vec::new();
    for task in agent {
        let (status, done) = task.await.expect("the agent's request ran");
        assert_eq!(status, 200);
        agent_done.push(done);
    }
    // The slot the running request frees goes to the person, who has had nothing, not to
    // the agent's requests that came first: at most the running one ends before it (one
    // more at the edge of a reply's end).
    let before = agent_done.iter().filter(|t| **t < person_done).count();
    assert!(
        before <= 2,
        "{before} of the agent's 6 requests ended before the person's"
    );
    let scrape = scrape(metrics_port).await;
    let waited = sample(
        &scrape,
        "corral_client_waited_total",
        &[("client", "agent")],
    );
    assert!(waited.unwrap_or(0.0) >= 4.0, "{waited:?}");
    // Each slot the node freed was handed to one of them, which took it.
    let taken = sample(&scrape, "corral_handoffs_total", &[("outcome", "taken")]);
    assert!(taken.unwrap_or(0.0) >= 4.0, "{taken:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_keys_requests_wait_for_an_interactive_keys() {
    let node = one_slot_node().await;
    let keys = "api_keys:\n  - {name: chat, key: kc}\n  - {name: jobs, key: kj, priority: batch}\n";
    let router = Router::start(vec![NodeSpec::of(&node, 1)], keys).await;

    // The chat key runs a request first: it has had more than the jobs key, which a fair
    // share alone would now serve first.
    let first = tokio::spawn(chat_as(router.url(), "kc", "first question".into()));
    eventually("the chat key's request runs", async || {
        node.log().len() == 1
    })
    .await;
    let jobs: Vec<_> = (0..4)
        .map(|i| tokio::spawn(chat_as(router.url(), "kj", format!("job {i}"))))
        .collect();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (status, chat_done) = chat_as(router.url(), "kc", "second question".into()).await;
    assert_eq!(status, 200);
    assert_eq!(first.await.expect("the first request ran").0, 200);
    let mut before = 0;
    for job in jobs {
        let (status, done) = job.await.expect("a job ran");
        assert_eq!(status, 200);
        before += usize::from(done < chat_done);
    }
    // The slot the first request frees goes to the interactive key: no job before it. The
    // fair share alone gives the same order in some runs (which client a freed slot meets
    // first depends on when the first reply's charge is settled), so this checks the class
    // end to end; fleet/wake.rs's unit test is the one that fails without it.
    assert_eq!(before, 0, "jobs ended before the chat key's turn");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_over_its_limits_is_refused_until_reloaded() {
    let node = one_slot_node().await;
    let metrics_port = free_port();
    let limits = |max: usize| {
        format!(
            "metrics_listen: 127.0.0.1:{metrics_port}\napi_keys:\n  \
             - {{name: person, key: kp, max_requests: {max}, tokens_per_minute: 6}}\n"
        )
    };
    let nodes = || vec![NodeSpec::of(&node, 1)];
    let router = Router::start(nodes(), &limits(1)).await;

    // One request in flight is the key's limit: a second at the same time is refused.
    let held = post_as(&router.url(), "kp", "hold").await;
    assert_eq!(held.status(), 200);
    let refused = post_as(&router.url(), "kp", "and?").await;
    assert_eq!(refused.status(), 429);
    assert_eq!(header(&refused, "retry-after"), "1");
    let error: serde_json::Value = refused.json().await.unwrap();
    assert!(
        error["error"].as_str().unwrap_or("").contains("1 requests"),
        "{error}"
    );
    held.bytes().await.expect("the held reply ends");

    // That reply spent more than the key's 6 tokens a minute: it waits for them to come back.
    let (status, _) = chat_as(router.url(), "kp", "once more".into()).await;
    assert_eq!(status, 429);
    let over = post_as(&router.url(), "kp", "?").await;
    let retry_after: u64 = header(&over, "retry-after").parse().expect("seconds");
    assert!(
        retry_after > 1,
        "back at 0.1 tokens a second: {retry_after}"
    );
    let scrape = scrape(metrics_port).await;
    let count = |limit| {
        let labels = [("client", "person"), ("limit", limit)];
        sample(&scrape, "corral_client_refused_total", &labels).unwrap_or(0.0)
    };
    assert_eq!(
        (count("max_requests"), count("tokens_per_minute")),
        (1.0, 2.0)
    );

    // Limits are read anew on reload: without a token limit the key is served at once.
    let open = format!(
        "metrics_listen: 127.0.0.1:{metrics_port}\napi_keys:\n  - {{name: person, key: kp}}\n"
    );
    router.rewrite_config(&nodes(), &open);
    router.signal("HUP");
    eventually("the reload lifts the limit", async || {
        chat_as(router.url(), "kp", "after the reload".into())
            .await
            .0
            == 200
    })
    .await;
}
