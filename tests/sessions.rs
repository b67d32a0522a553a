//! Explicit session keys over real sockets: a key pins every conversation that carries it to
//! one node, whatever its first message; without a key, a conversation still follows its
//! prefix.

mod common;

use std::collections::HashSet;

use common::*;
use serde_json::{Value, json};

const CONVERSATIONS: usize = 6;

fn first_message(i: usize) -> String {
    format!(
        "Conversation {i} opens differently. {}",
        "About fleets. ".repeat(20)
    )
}

async fn fleet(extra_yaml: &str) -> (Vec<corral::standin::StandinNode>, Router) {
    let nodes = futures::future::join_all((0..3).map(|i| start(fast_node(&format!("n{i}"))))).await;
    let router = Router::start(
        nodes.iter().map(|n| NodeSpec::of(n, 2)).collect(),
        extra_yaml,
    )
    .await;
    (nodes, router)
}

/// Sends `body` to `path` with `headers`; returns the node that answered.
async fn send(router: &Router, path: &str, headers: &[(&str, &str)], body: &Value) -> String {
    let mut request = client().post(format!("{}{path}", router.url())).json(body);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let resp = request.send().await.expect("a reply");
    assert_eq!(resp.status(), 200, "{path}");
    header(&resp, "x-fleet-node")
}

/// The nodes that answered `CONVERSATIONS` conversations with different first messages,
/// each built by `body` and sent with `headers`.
async fn nodes_for(
    router: &Router,
    path: &str,
    headers: &[(&str, &str)],
    body: impl Fn(String) -> Value,
) -> HashSet<String> {
    let mut nodes = HashSet::new();
    for i in 0..CONVERSATIONS {
        nodes.insert(send(router, path, headers, &body(first_message(i))).await);
    }
    nodes
}

fn native(text: String) -> Value {
    json!({ "model": MODEL, "stream": false, "messages": [{ "role": "user", "content": text }] })
}

#[tokio::test]
async fn each_session_key_source_pins_its_conversations_to_one_node() {
    let (_nodes, router) = fleet("").await;
    let without = nodes_for(&router, "/api/chat", &[], native).await;
    assert!(
        without.len() > 1,
        "without a key, new conversations spread: {without:?}"
    );

    let header_key = nodes_for(&router, "/api/chat", &[("X-Session-Id", "s-1")], native).await;
    assert_eq!(header_key.len(), 1, "X-Session-Id: {header_key:?}");

    let open_webui = nodes_for(
        &router,
        "/api/chat",
        &[("X-OpenWebUI-Chat-Id", "chat-42")],
        native,
    )
    .await;
    assert_eq!(open_webui.len(), 1, "X-OpenWebUI-Chat-Id: {open_webui:?}");

    let cache_key = nodes_for(&router, "/v1/chat/completions", &[], |text| {
        json!({ "model": MODEL, "prompt_cache_key": "user-7",
            "messages": [{ "role": "user", "content": text }] })
    })
    .await;
    assert_eq!(cache_key.len(), 1, "prompt_cache_key: {cache_key:?}");

    let anthropic = nodes_for(&router, "/v1/messages", &[], |text| {
        json!({ "model": MODEL, "max_tokens": 4, "metadata": { "user_id": "claude-session-9" },
            "messages": [{ "role": "user", "content": text }] })
    })
    .await;
    assert_eq!(anthropic.len(), 1, "metadata.user_id: {anthropic:?}");
}

#[tokio::test]
async fn without_a_key_a_conversation_still_follows_its_prefix() {
    let (_nodes, router) = fleet("").await;
    // A keyed conversation, continued without its key, and one that never had a key.
    let keyed = vec![first_message(100)];
    let node = send(
        &router,
        "/api/chat",
        &[("X-Session-Id", "k")],
        &chat_body(&keyed, false),
    )
    .await;
    let mut next = keyed.clone();
    next.push("reply".into());
    next.push("And then?".into());
    let resp = post_chat(&router, &chat_body(&next, false)).await;
    assert_eq!(header(&resp, "x-fleet-node"), node);
    assert_eq!(header(&resp, "x-fleet-affinity"), "hit");

    let plain = vec![first_message(200)];
    let (first_node, _, reply) = chat(&router, &plain).await;
    let mut plain_next = plain.clone();
    plain_next.push(reply);
    plain_next.push("More?".into());
    let (second_node, affinity, _) = chat(&router, &plain_next).await;
    assert_eq!(
        (second_node.as_str(), affinity.as_str()),
        (first_node.as_str(), "hit")
    );
}

#[tokio::test]
async fn session_headers_are_configurable() {
    let (_nodes, router) = fleet("session_headers: [x-my-conversation]\n").await;
    let custom = nodes_for(&router, "/api/chat", &[("X-My-Conversation", "c1")], native).await;
    assert_eq!(custom.len(), 1, "{custom:?}");
    // A header no longer listed is not a key.
    let ignored = nodes_for(&router, "/api/chat", &[("X-Session-Id", "s-1")], native).await;
    assert!(ignored.len() > 1, "{ignored:?}");
}
