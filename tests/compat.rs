//! The routes of current Ollama beyond its native and chat-completions APIs, through the real
//! `corral` binary to stand-in nodes that serve them as Ollama does: OpenAI's Responses API
//! (driven by `async-openai`), Anthropic's Messages API (driven over the wire, as Claude
//! Code and the Anthropic SDKs send it: no maintained Rust client crate was available),
//! audio transcriptions (`async-openai`, multipart), `/v1/models/{model}`, `HEAD`,
//! `/api/status` and `/api/experimental/*`.

mod common;

use std::collections::HashMap;

use async_openai::Client;
use async_openai::config::OpenAIConfig;
use async_openai::types::audio::{AudioInput, CreateTranscriptionRequestArgs};
use async_openai::types::responses::{CreateResponseArgs, ResponseStreamEvent};
use common::*;
use futures::StreamExt;
use serde_json::{Value, json};

async fn fleet(n: usize) -> (Vec<corral::standin::StandinNode>, Router) {
    let mut cfgs: Vec<_> = (0..n).map(|i| fast_node(&format!("n{i}"))).collect();
    for c in &mut cfgs {
        c.decode_per_token = std::time::Duration::from_millis(10);
    }
    let nodes = futures::future::join_all(cfgs.into_iter().map(start)).await;
    let router = Router::start(nodes.iter().map(|n| NodeSpec::of(n, 2)).collect(), "").await;
    (nodes, router)
}

fn openai(router: &Router) -> Client<OpenAIConfig> {
    Client::with_config(
        OpenAIConfig::new()
            .with_api_base(format!("{}/v1", router.url()))
            .with_api_key("unused"),
    )
}

fn served(nodes: &[corral::standin::StandinNode], endpoint: &str) -> usize {
    nodes
        .iter()
        .map(|n| n.log().iter().filter(|r| r.endpoint == endpoint).count())
        .sum()
}

#[tokio::test]
async fn responses_api_through_async_openai_whole_and_streamed() {
    let (nodes, router) = fleet(2).await;
    let client = openai(&router);
    let request = CreateResponseArgs::default()
        .model(MODEL)
        .instructions("Answer briefly.")
        .input("Tell me about fleets.")
        .build()
        .unwrap();
    let reply = client
        .responses()
        .create(request)
        .await
        .expect("a response");
    assert_eq!(reply.model, MODEL);
    assert!(!reply.output_text().unwrap_or_default().is_empty());
    let usage = reply.usage.expect("usage");
    assert!(
        usage.input_tokens > 0 && usage.output_tokens == 4,
        "{usage:?}"
    );
    assert_eq!(served(&nodes, "/v1/responses"), 1);

    let request = CreateResponseArgs::default()
        .model(MODEL)
        .input("Stream about fleets.")
        .build()
        .unwrap();
    let mut stream = client
        .responses()
        .create_stream(request)
        .await
        .expect("a stream");
    let mut kinds = Vec::new();
    let mut text = String::new();
    let mut completed = None;
    while let Some(event) = stream.next().await {
        let event = event.expect("an event the client parses");
        kinds.push(match &event {
            ResponseStreamEvent::ResponseCreated(_) => "created",
            ResponseStreamEvent::ResponseOutputTextDelta(d) => {
                text.push_str(&d.delta);
                "delta"
            }
            ResponseStreamEvent::ResponseCompleted(c) => {
                completed = Some(c.response.clone());
                "completed"
            }
            _ => "other",
        });
    }
    assert_eq!(kinds.first(), Some(&"created"), "{kinds:?}");
    assert_eq!(kinds.last(), Some(&"completed"), "{kinds:?}");
    assert_eq!(
        kinds.iter().filter(|k| **k == "delta").count(),
        4,
        "{kinds:?}"
    );
    let completed = completed.expect("response.completed");
    assert_eq!(completed.output_text().unwrap_or_default(), text);
    assert!(completed.usage.expect("usage").input_tokens > 0);
}

/// Reads an SSE reply chunk by chunk: every network chunk, and the events in order.
async fn sse_events(resp: reqwest::Response) -> (usize, Vec<(String, Value)>) {
    let mut chunks = 0;
    let mut buf = String::new();
    let mut body = resp.bytes_stream();
    while let Some(chunk) = body.next().await {
        chunks += 1;
        buf.push_str(&String::from_utf8_lossy(&chunk.expect("a chunk")));
    }
    let events = buf
        .split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let kind = e
                .lines()
                .find_map(|l| l.strip_prefix("event: "))
                .unwrap_or_default()
                .to_string();
            let data = e
                .lines()
                .find_map(|l| l.strip_prefix("data: "))
                .and_then(|d| serde_json::from_str(d).ok())
                .unwrap_or(Value::Null);
            (kind, data)
        })
        .collect();
    (chunks, events)
}

async fn post(router: &Router, path: &str, body: &Value) -> reqwest::Response {
    client()
        .post(format!("{}{path}", router.url()))
        .header("anthropic-version", "2023-06-01")
        .json(body)
        .send()
        .await
        .expect("a reply")
}

#[tokio::test]
async fn responses_follow_up_items_find_their_prefix() {
    let (nodes, router) = fleet(3).await;
    let first = json!([{ "role": "user", "content": [{ "type": "input_text",
        "text": format!("Long question. {}", "About fleets. ".repeat(40)) }] }]);
    let body = json!({ "model": MODEL, "instructions": "be brief", "input": first });
    let resp = post(&router, "/v1/responses", &body).await;
    assert_eq!(resp.status(), 200);
    let node = header(&resp, "x-fleet-node");
    assert_eq!(header(&resp, "x-fleet-affinity"), "new");
    let reply: Value = resp.json().await.unwrap();
    let answer = reply["output"][0].clone();
    let mut items = first.as_array().unwrap().clone();
    items.push(answer);
    items.push(json!({ "role": "user", "content": "And then?" }));
    let body = json!({ "model": MODEL, "instructions": "be brief", "input": items });
    let resp = post(&router, "/v1/responses", &body).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(header(&resp, "x-fleet-node"), node);
    assert_eq!(header(&resp, "x-fleet-affinity"), "hit");
    let by_name: HashMap<_, _> = nodes.iter().map(|n| (n.name().to_string(), n)).collect();
    let last = by_name[&node].log().last().cloned().unwrap();
    assert!(
        last.cached_tokens > 100,
        "the node reused the prefix: {last:?}"
    );
}

#[tokio::test]
async fn anthropic_messages_whole_streamed_follow_up_and_errors() {
    let (nodes, router) = fleet(3).await;
    let first = json!({ "role": "user", "content": [{ "type": "text",
        "text": format!("Question. {}", "About fleets. ".repeat(40)) }] });
    let system = json!([{ "type": "text", "text": "You are terse." }]);
    let body = json!({ "model": MODEL, "max_tokens": 4, "system": system, "messages": [first] });
    let resp = post(&router, "/v1/messages", &body).await;
    assert_eq!(resp.status(), 200);
    let node = header(&resp, "x-fleet-node");
    let reply: Value = resp.json().await.unwrap();
    assert_eq!(reply["type"], "message");
    assert_eq!(reply["role"], "assistant");
    assert_eq!(reply["content"][0]["type"], "text");
    assert!(reply["usage"]["input_tokens"].as_u64().unwrap() > 0);
    assert_eq!(reply["usage"]["output_tokens"], 4);

    // The follow-up streams, goes where the conversation is warm, and arrives event by event.
    let answer = json!({ "role": "assistant", "content": reply["content"].clone() });
    let next = json!({ "role": "user", "content": "And then?" });
    let body = json!({ "model": MODEL, "max_tokens": 4, "system": system, "stream": true,
        "messages": [first, answer, next] });
    let resp = post(&router, "/v1/messages", &body).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(header(&resp, "x-fleet-node"), node);
    assert_eq!(header(&resp, "x-fleet-affinity"), "hit");
    assert!(header(&resp, "content-type").starts_with("text/event-stream"));
    let (chunks, events) = sse_events(resp).await;
    let kinds: Vec<&str> = events.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        kinds,
        [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    assert!(events.iter().all(|(k, d)| d["type"] == k.as_str()));
    assert!(
        chunks >= 4,
        "tokens arrived as they were made, in {chunks} chunks"
    );
    assert_eq!(events[7].1["usage"]["output_tokens"], 4);
    let by_name: HashMap<_, _> = nodes.iter().map(|n| (n.name().to_string(), n)).collect();
    assert!(by_name[&node].log().last().unwrap().cached_tokens > 100);

    // Errors in Anthropic's shape, from corral and from the node.
    let resp = post(&router, "/v1/messages", &json!({ "messages": [] })).await;
    assert_eq!(resp.status(), 400);
    let error: Value = resp.json().await.unwrap();
    assert_eq!(error["type"], "error");
    assert_eq!(error["error"]["type"], "invalid_request_error");
    let body = json!({ "model": "nope:1b", "max_tokens": 8, "messages": [next] });
    let resp = post(&router, "/v1/messages", &body).await;
    assert_eq!(resp.status(), 404);
    let error: Value = resp.json().await.unwrap();
    assert_eq!(error["error"]["type"], "not_found_error", "{error}");
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("nope:1b")
    );
}

#[tokio::test]
async fn transcriptions_route_by_the_form_model() {
    let mut cfgs = vec![fast_node("plain"), fast_node("whisper")];
    cfgs[1].models.push(model("whisper-tiny:latest", 0.2));
    let nodes = futures::future::join_all(cfgs.into_iter().map(start)).await;
    let router = Router::start(nodes.iter().map(|n| NodeSpec::of(n, 2)).collect(), "").await;
    let request = CreateTranscriptionRequestArgs::default()
        .file(AudioInput::from_vec_u8(
            "a.wav".into(),
            b"RIFF fake audio".to_vec(),
        ))
        .model("whisper-tiny")
        .build()
        .unwrap();
    // Ollama answers `{"text": ...}` only, without the `usage` that async-openai's typed
    // reply requires: the client's own multipart encoding, its raw reply.
    let raw = openai(&router)
        .audio()
        .transcription()
        .create_raw(request)
        .await
        .expect("a transcription");
    let reply: Value = serde_json::from_slice(&raw).unwrap();
    assert!(!reply["text"].as_str().unwrap().is_empty(), "{reply}");
    assert_eq!(
        served(&nodes[1..], "/v1/audio/transcriptions"),
        1,
        "only 'whisper' has the model"
    );

    // No model field: OpenAI's error shape.
    let form = "--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\r\nxx\r\n--b--\r\n";
    let resp = client()
        .post(format!("{}/v1/audio/transcriptions", router.url()))
        .header("content-type", "multipart/form-data; boundary=b")
        .body(form)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let error: Value = resp.json().await.unwrap();
    assert_eq!(error["error"]["type"], "invalid_request_error", "{error}");
}

#[tokio::test]
async fn model_lookup_heads_status_and_experimental() {
    let (_nodes, router) = fleet(2).await;
    let url = |p: &str| format!("{}{p}", router.url());
    let model = get_json(&url(&format!("/v1/models/{MODEL}"))).await;
    assert_eq!(model["id"], MODEL);
    assert_eq!(model["object"], "model");
    let resp = client()
        .get(url("/v1/models/nope:1b"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);
    let error: Value = resp.json().await.unwrap();
    assert_eq!(error["error"]["type"], "not_found_error", "{error}");

    for path in ["/api/tags", "/api/version"] {
        let resp = client().head(url(path)).send().await.unwrap();
        assert_eq!(resp.status(), 200, "{path}");
        assert!(resp.bytes().await.unwrap().is_empty(), "HEAD has no body");
    }
    let status = get_json(&url("/api/status")).await;
    assert_eq!(status["cloud"]["disabled"], true);
    let resp = client()
        .post(url("/api/experimental/web_search"))
        .json(&json!({ "query": "x" }))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);
    let error: Value = resp.json().await.unwrap();
    assert!(error["error"].as_str().unwrap().contains("experimental"));
}

#[tokio::test]
async fn a_stream_cut_mid_reply_ends_with_the_apis_own_error_event() {
    let (nodes, router) = fleet(1).await;
    nodes[0].set_fault(corral::standin::Fault::CutMidStream(3));
    let body = json!({ "model": MODEL, "max_tokens": 8, "stream": true,
        "messages": [{ "role": "user", "content": "cut me" }] });
    let (_, events) = sse_events(post(&router, "/v1/messages", &body).await).await;
    let (kind, data) = events.last().expect("events");
    assert_eq!(kind, "error", "{events:?}");
    assert_eq!(data["type"], "error");
    assert_eq!(
        data["error"]["type"], "api_error",
        "Anthropic's shape: {data}"
    );
    assert_eq!(
        events[0].0, "message_start",
        "what the node sent came first"
    );

    let body = json!({ "model": MODEL, "input": "cut me too", "stream": true });
    let (_, events) = sse_events(post(&router, "/v1/responses", &body).await).await;
    let (kind, data) = events.last().expect("events");
    assert_eq!(kind, "error", "{events:?}");
    assert!(
        data["message"]
            .as_str()
            .unwrap()
            .contains("failed mid-reply"),
        "{data}"
    );
}
