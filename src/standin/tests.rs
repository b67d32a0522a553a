//! End-to-end tests of a stand-in node over real HTTP, with `reqwest` and with the two client
//! crates the router's users run (`ollama-rs`, `async-openai`), so the wire formats are
//! checked by code nobody here wrote. Durations are tiny; timing assertions are lower
//! bounds only, which a slow machine cannot break.

use std::error::Error;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use serde_json::{Value, json};

use super::{Fault, StandinConfig, StandinKind, StandinModel, StandinNode, start_fleet};

type TestResult = Result<(), Box<dyn Error + Send + Sync>>;

const LOAD: Duration = Duration::from_millis(150);
const DECODE: Duration = Duration::from_millis(15);

fn cfg() -> StandinConfig {
    let mut cfg = StandinConfig::new("test");
    cfg.load_time = LOAD;
    cfg.prefill_per_token = Duration::from_micros(10);
    cfg.decode_per_token = DECODE;
    cfg.reply_tokens = 6;
    cfg.models.extend([
        StandinModel::new("tiny:1b", 1_000_000_000, 2048),
        StandinModel::new("nomic-embed-text:latest", 274_000_000, 2048),
        StandinModel::new("giant:405b", 1 << 40, 8192),
    ]);
    cfg
}

async fn start(cfg: StandinConfig) -> std::io::Result<StandinNode> {
    StandinNode::start(cfg, SocketAddr::from(([127, 0, 0, 1], 0))).await
}

/// POSTs JSON and returns the status and the JSON reply.
async fn post(node: &StandinNode, path: &str, body: Value) -> Result<(u16, Value), reqwest::Error> {
    let resp = reqwest::Client::new()
        .post(format!("{}{path}", node.url()))
        .json(&body)
        .send()
        .await?;
    let status = resp.status().as_u16();
    Ok((status, resp.json().await?))
}

async fn get(node: &StandinNode, path: &str) -> Result<(u16, String), reqwest::Error> {
    let resp = reqwest::get(format!("{}{path}", node.url())).await?;
    let status = resp.status().as_u16();
    Ok((status, resp.text().await?))
}

/// Reads a streamed body read by read: the chunks, and whether the body ended in an error.
async fn reads(resp: reqwest::Response) -> (Vec<Bytes>, bool) {
    let mut chunks = Vec::new();
    let mut body = resp.bytes_stream();
    while let Some(item) = body.next().await {
        match item {
            Ok(chunk) => chunks.push(chunk),
            Err(_) => return (chunks, true),
        }
    }
    (chunks, false)
}

fn lines(chunks: &[Bytes]) -> Vec<Value> {
    let all: Vec<u8> = chunks.concat();
    String::from_utf8_lossy(&all)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

fn user(content: &str) -> Value {
    json!({ "role": "user", "content": content })
}

#[tokio::test]
async fn a_follow_up_turn_reuses_the_cached_prefix() -> TestResult {
    let node = start(cfg()).await?;
    let mut messages = vec![
        json!({ "role": "system", "content": "You are terse." }),
        user("Tell me about llamas and why they live in herds."),
    ];
    let first = json!({ "model": "llama3:8b", "messages": messages, "stream": false });
    let (status, reply) = post(&node, "/api/chat", first).await?;
    assert_eq!(status, 200);
    assert_eq!(node.log()[0].cached_tokens, 0);

    messages.push(reply["message"].clone());
    messages.push(user("And alpacas?"));
    let second = json!({ "model": "llama3:8b", "messages": messages, "stream": false });
    let (status, reply) = post(&node, "/api/chat", second).await?;
    assert_eq!(status, 200);

    let served = &node.log()[1];
    assert!(served.cached_tokens > 0, "{served:?}");
    assert_eq!(served.slot, node.log()[0].slot);
    assert_eq!(
        reply["prompt_eval_count"],
        json!(served.prompt_tokens - served.cached_tokens)
    );
    assert_eq!(reply["eval_count"], 6);
    Ok(())
}

#[tokio::test]
async fn a_streamed_reply_also_warms_the_next_turn() -> TestResult {
    let node = start(cfg()).await?;
    let mut messages = vec![user("Stream me something.")];
    let resp = reqwest::Client::new()
        .post(format!("{}/api/chat", node.url()))
        .json(&json!({ "model": "llama3:8b", "messages": messages }))
        .send()
        .await?;
    let (chunks, broken) = reads(resp).await;
    assert!(!broken);
    let reply: String = lines(&chunks)
        .iter()
        .filter_map(|l| l["message"]["content"].as_str().map(str::to_string))
        .collect();

    messages.push(json!({ "role": "assistant", "content": reply }));
    messages.push(user("More."));
    let next = json!({ "model": "llama3:8b", "messages": messages, "stream": false });
    post(&node, "/api/chat", next).await?;
    let served = &node.log()[1];
    // Everything but the new user message (14 bytes) is cached.
    assert!(served.cached_tokens > 0);
    assert!(
        served.prompt_tokens - served.cached_tokens <= 5,
        "{served:?}"
    );
    Ok(())
}

#[tokio::test]
async fn a_cold_model_load_takes_the_load_time() -> TestResult {
    let node = start(cfg()).await?;
    assert_eq!(node.resident(), ["llama3:8b"]);
    let body = json!({ "model": "tiny:1b", "prompt": "hi", "stream": false });
    let started = Instant::now();
    let (status, reply) = post(&node, "/api/generate", body.clone()).await?;
    assert_eq!(status, 200);
    assert!(started.elapsed() >= LOAD);
    assert!(reply["load_duration"].as_u64() >= Some(LOAD.as_nanos() as u64));
    assert!(node.log()[0].cold_load);
    assert!(node.resident().contains(&"tiny:1b".to_string()));

    post(&node, "/api/generate", body).await?;
    assert!(!node.log()[1].cold_load);
    Ok(())
}

#[tokio::test]
async fn streamed_tokens_arrive_as_separate_reads() -> TestResult {
    let node = start(cfg()).await?;
    let resp = reqwest::Client::new()
        .post(format!("{}/api/generate", node.url()))
        .json(&json!({ "model": "llama3:8b", "prompt": "Count." }))
        .send()
        .await?;
    assert_eq!(
        resp.headers().get("content-type").map(|v| v.as_bytes()),
        Some(&b"application/x-ndjson"[..])
    );
    let (chunks, broken) = reads(resp).await;
    assert!(!broken);
    assert!(chunks.len() >= 3, "{} reads", chunks.len());
    let lines = lines(&chunks);
    assert_eq!(lines.len(), 7); // six tokens and the final chunk
    assert!(lines[..6].iter().all(|l| l["done"] == false));
    let last = &lines[6];
    assert_eq!(
        (&last["done"], &last["done_reason"]),
        (&json!(true), &json!("stop"))
    );
    assert_eq!(last["eval_count"], 6);
    assert!(last["eval_duration"].as_u64() >= Some(6 * DECODE.as_nanos() as u64));
    Ok(())
}

#[tokio::test]
async fn stop_refuses_connections_and_restart_serves_again() -> TestResult {
    let node = start(cfg()).await?;
    assert_eq!(
        get(&node, "/").await?,
        (200, "Ollama is running".to_string())
    );
    post(
        &node,
        "/api/generate",
        json!({"model": "llama3:8b", "prompt": "x", "stream": false}),
    )
    .await?;

    node.stop().await;
    assert!(tokio::net::TcpStream::connect(node.addr()).await.is_err());
    // Its port is below the ephemeral range: no listener bound to port 0 meanwhile (another
    // test's) can be given it.
    let port = node.addr().port();
    assert!(port < super::port::first_ephemeral(), "port {port}");

    node.restart().await?;
    assert_eq!(get(&node, "/").await?.0, 200);
    assert_eq!(node.log().len(), 1, "state survives a restart");
    Ok(())
}

#[tokio::test]
async fn stop_aborts_a_reply_in_flight() -> TestResult {
    let mut cfg = cfg();
    cfg.reply_tokens = 200;
    let node = start(cfg).await?;
    let resp = reqwest::Client::new()
        .post(format!("{}/api/chat", node.url()))
        .json(&json!({ "model": "llama3:8b", "messages": [user("long please")] }))
        .send()
        .await?;
    let mut body = resp.bytes_stream();
    assert!(matches!(body.next().await, Some(Ok(_))));
    node.stop().await;
    let mut broken = false;
    while let Some(item) = body.next().await {
        broken |= item.is_err();
    }
    assert!(broken, "the body must end in an error, not complete");
    Ok(())
}

#[tokio::test]
async fn cut_mid_stream_ends_the_body_early() -> TestResult {
    let node = start(cfg()).await?;
    node.set_fault(Fault::CutMidStream(2));
    let client = reqwest::Client::new();
    let resp = client
        .post(format!("{}/api/chat", node.url()))
        .json(&json!({ "model": "llama3:8b", "messages": [user("hi")] }))
        .send()
        .await?;
    let (chunks, broken) = reads(resp).await;
    assert!(broken);
    assert_eq!(lines(&chunks).len(), 2);

    let resp = client
        .post(format!("{}/v1/chat/completions", node.url()))
        .json(&json!({ "model": "llama3:8b", "messages": [user("hi")] }))
        .send()
        .await?;
    let (chunks, broken) = reads(resp).await;
    assert!(broken, "a non-streamed reply is cut too");
    let half = chunks.concat();
    assert!(!half.is_empty() && serde_json::from_slice::<Value>(&half).is_err());

    node.set_fault(Fault::None);
    let ok = json!({ "model": "llama3:8b", "messages": [user("hi")], "stream": false });
    assert_eq!(post(&node, "/api/chat", ok).await?.0, 200);
    Ok(())
}

#[tokio::test]
async fn status_fault_answers_every_request_with_the_status() -> TestResult {
    let node = start(cfg()).await?;
    node.set_fault(Fault::Status(503));
    let (status, body) = get(&node, "/api/tags").await?;
    assert_eq!(status, 503);
    assert_eq!(
        serde_json::from_str::<Value>(&body)?,
        json!({"error": "injected fault"})
    );
    let chat = json!({ "model": "llama3:8b", "messages": [user("hi")] });
    assert_eq!(post(&node, "/api/chat", chat).await?.0, 503);
    assert!(node.log().is_empty());
    Ok(())
}

#[tokio::test]
async fn hang_fault_never_answers_until_cleared() -> TestResult {
    let node = start(cfg()).await?;
    node.set_fault(Fault::Hang);
    let client = reqwest::Client::new();
    let hung = tokio::spawn(client.get(format!("{}/api/version", node.url())).send());
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!hung.is_finished());

    node.set_fault(Fault::None);
    assert!(
        hung.await?.is_err(),
        "a hung request's connection is closed, not answered"
    );
    assert_eq!(get(&node, "/api/version").await?.0, 200);
    Ok(())
}

#[tokio::test]
async fn errors_look_like_ollama() -> TestResult {
    let node = start(cfg()).await?;
    let (status, body) = post(
        &node,
        "/api/chat",
        json!({"model": "nope:1b", "messages": [user("x")]}),
    )
    .await?;
    assert_eq!(status, 404);
    assert_eq!(
        body["error"],
        "model 'nope:1b' not found, try pulling it first"
    );

    let (status, body) = post(
        &node,
        "/api/generate",
        json!({"model": "giant:405b", "prompt": "x"}),
    )
    .await?;
    assert_eq!(status, 500);
    let msg = body["error"].as_str().unwrap_or_default();
    assert!(
        msg.starts_with("model requires more system memory (1024.0 GiB)"),
        "{msg}"
    );

    let (status, _) = post(&node, "/api/chat", json!({"messages": [user("x")]})).await?;
    assert_eq!(status, 400);
    let resp = reqwest::Client::new()
        .post(format!("{}/api/chat", node.url()))
        .body("{not json")
        .send()
        .await?;
    assert_eq!(resp.status().as_u16(), 400);
    assert!(resp.json::<Value>().await?["error"].is_string());

    let embed_chat = json!({"model": "nomic-embed-text", "messages": [user("x")]});
    assert_eq!(post(&node, "/api/chat", embed_chat).await?.0, 400);

    let (status, body) = post(
        &node,
        "/v1/chat/completions",
        json!({"model": "nope", "messages": [user("x")]}),
    )
    .await?;
    assert_eq!(status, 404);
    assert!(body["error"]["message"].is_string());

    assert_eq!(get(&node, "/no/such/path").await?.0, 404);
    assert!(node.log().is_empty());
    Ok(())
}

#[tokio::test]
async fn listings_describe_the_models() -> TestResult {
    let node = start(cfg()).await?;
    assert_eq!(
        get(&node, "/api/version").await?.1,
        r#"{"version":"0.5.7-standin"}"#
    );

    let tags: Value = serde_json::from_str(&get(&node, "/api/tags").await?.1)?;
    let first = &tags["models"][0];
    assert_eq!(first["name"], "llama3:8b");
    assert_eq!(first["size"], 4_700_000_000u64);
    assert_eq!(first["details"]["format"], "gguf");
    assert_eq!(tags["models"].as_array().map(Vec::len), Some(4));

    let ps: Value = serde_json::from_str(&get(&node, "/api/ps").await?.1)?;
    let loaded = &ps["models"][0];
    assert_eq!(loaded["name"], "llama3:8b");
    assert_eq!(loaded["context_length"], 8192);
    assert_eq!(loaded["size_vram"], 4_700_000_000u64);
    assert!(
        loaded["expires_at"]
            .as_str()
            .is_some_and(|s| s.ends_with('Z'))
    );

    let (status, show) = post(&node, "/api/show", json!({"model": "llama3:8b"})).await?;
    assert_eq!(status, 200);
    assert_eq!(show["model_info"]["general.context_length"], 8192);
    assert_eq!(
        post(&node, "/api/show", json!({"name": "nope"})).await?.0,
        404
    );

    let models: Value = serde_json::from_str(&get(&node, "/v1/models").await?.1)?;
    assert_eq!(models["data"][0]["id"], "llama3:8b");
    Ok(())
}

#[tokio::test]
async fn another_num_ctx_reloads_the_model() -> TestResult {
    let node = start(cfg()).await?;
    let body = json!({
        "model": "llama3:8b", "prompt": "x", "stream": false, "options": {"num_ctx": 4096}
    });
    let started = Instant::now();
    post(&node, "/api/generate", body.clone()).await?;
    assert!(started.elapsed() >= LOAD);
    post(&node, "/api/generate", body).await?;
    let cold: Vec<bool> = node.log().iter().map(|s| s.cold_load).collect();
    assert_eq!(cold, [true, false]);
    let ps: Value = serde_json::from_str(&get(&node, "/api/ps").await?.1)?;
    assert_eq!(ps["models"][0]["context_length"], 4096);
    Ok(())
}

#[tokio::test]
async fn loading_evicts_and_keep_alive_zero_unloads() -> TestResult {
    let mut cfg = cfg();
    cfg.memory_bytes = 5_000_000_000;
    let node = start(cfg).await?;
    let (status, reply) = post(&node, "/api/generate", json!({"model": "tiny:1b"})).await?;
    assert_eq!((status, &reply["done_reason"]), (200, &json!("load")));
    assert_eq!(
        node.resident(),
        ["tiny:1b"],
        "llama3:8b was evicted to make room"
    );

    let unload = json!({"model": "tiny:1b", "keep_alive": 0});
    let (_, reply) = post(&node, "/api/generate", unload).await?;
    assert_eq!(reply["done_reason"], "unload");
    assert!(node.resident().is_empty());
    assert!(node.log().is_empty(), "load-only requests generate nothing");
    Ok(())
}

#[tokio::test]
async fn busy_slots_make_requests_wait_their_turn() -> TestResult {
    let mut cfg = cfg();
    cfg.num_parallel = 1;
    let node = start(cfg).await?;
    let body = |p: &str| json!({ "model": "llama3:8b", "prompt": p, "stream": false });
    let started = Instant::now();
    let (a, b) = tokio::join!(
        post(&node, "/api/generate", body("first")),
        post(&node, "/api/generate", body("second"))
    );
    assert_eq!((a?.0, b?.0), (200, 200));
    // One slot: the two replies were decoded one after the other.
    assert!(started.elapsed() >= DECODE * 12);
    assert!(node.log().iter().all(|s| s.slot == 0));
    Ok(())
}

#[tokio::test]
async fn prompts_evaluated_at_once_share_the_model_s_compute() -> TestResult {
    // Two slots, two 1,000-token prompts at once: each slot is free, but their prompts go
    // through one batch per step, so the later one ends after all 2,000 tokens' prefill.
    // Alone, one takes 1,000 tokens' prefill and 6 decode steps (290 ms here).
    let prefill = Duration::from_micros(200);
    for kind in [StandinKind::OllamaLegacy, StandinKind::Ollama] {
        let mut cfg = cfg();
        cfg.kind = kind;
        cfg.prefill_per_token = prefill;
        let node = start(cfg).await?;
        let body = |p: String| json!({ "model": "llama3:8b", "prompt": p, "stream": false });
        let timed = |p: String| {
            let node = &node;
            async move {
                let started = Instant::now();
                let reply = post(node, "/api/generate", body(p)).await;
                (reply, started.elapsed())
            }
        };
        let ((a, a_took), (b, b_took)) =
            tokio::join!(timed("a".repeat(4000)), timed("b".repeat(4000)));
        assert_eq!((a?.0, b?.0), (200, 200));
        let log = node.log();
        let slots: Vec<usize> = log.iter().map(|s| s.slot).collect();
        assert!(
            slots.contains(&0) && slots.contains(&1),
            "{kind:?}: {slots:?}"
        );
        let evaluated: u32 = log.iter().map(|s| s.prompt_tokens - s.cached_tokens).sum();
        assert!(evaluated >= 2000, "{kind:?}: {evaluated}");
        assert!(
            a_took.max(b_took) >= prefill * evaluated,
            "{kind:?}: {a_took:?} and {b_took:?} for {evaluated} tokens"
        );
    }
    Ok(())
}
#[tokio::test]
async fn embeddings_need_the_model_but_no_slot() -> TestResult {
    let node = start(cfg()).await?;
    let (status, reply) = post(
        &node,
        "/api/embed",
        json!({"model": "nomic-embed-text", "input": ["a", "b"]}),
    )
    .await?;
    assert_eq!(status, 200);
    assert_eq!(reply["embeddings"].as_array().map(Vec::len), Some(2));
    assert!(node.log()[0].cold_load);

    let (_, legacy) = post(
        &node,
        "/api/embeddings",
        json!({"model": "nomic-embed-text", "prompt": "a"}),
    )
    .await?;
    assert_eq!(legacy["embedding"], reply["embeddings"][0]);

    let (_, openai) = post(
        &node,
        "/v1/embeddings",
        json!({"model": "nomic-embed-text", "input": "a"}),
    )
    .await?;
    assert_eq!(openai["data"][0]["embedding"], reply["embeddings"][0]);
    assert_eq!(openai["object"], "list");
    let endpoints: Vec<String> = node.log().into_iter().map(|s| s.endpoint).collect();
    assert_eq!(
        endpoints,
        ["/api/embed", "/api/embeddings", "/v1/embeddings"]
    );
    Ok(())
}

#[tokio::test]
async fn openai_streams_sse_with_usage_and_done() -> TestResult {
    let node = start(cfg()).await?;
    let messages = vec![user("Hello there, how are you today?")];
    let body = json!({ "model": "llama3:8b", "messages": messages, "stream": false });
    let (_, first) = post(&node, "/v1/chat/completions", body).await?;
    let reply = first["choices"][0]["message"]["content"].clone();

    let mut next = messages;
    next.push(json!({ "role": "assistant", "content": reply }));
    next.push(user("Fine."));
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", node.url()))
        .json(&json!({
            "model": "llama3:8b", "messages": next, "stream": true,
            "stream_options": { "include_usage": true }
        }))
        .send()
        .await?;
    let (chunks, broken) = reads(resp).await;
    assert!(!broken);
    let text = String::from_utf8_lossy(&chunks.concat()).to_string();
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.last(), Some(&"data: [DONE]"));
    let usage: Value = serde_json::from_str(events[events.len() - 2].trim_start_matches("data: "))?;
    let cached = usage["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
    assert!(cached > Some(0), "{usage}");
    assert_eq!(cached, Some(u64::from(node.log()[1].cached_tokens)));
    Ok(())
}

#[tokio::test]
async fn ollama_rs_parses_every_reply() -> TestResult {
    use ollama_rs::Ollama;
    use ollama_rs::generation::chat::ChatMessage;
    use ollama_rs::generation::chat::request::ChatMessageRequest;
    use ollama_rs::generation::completion::request::GenerationRequest;
    use ollama_rs::generation::embeddings::request::GenerateEmbeddingsRequest;

    let node = start(cfg()).await?;
    let ollama = Ollama::try_new(node.url())?;
    let model = "llama3:8b".to_string();

    let chat = ChatMessageRequest::new(model.clone(), vec![ChatMessage::user("hi".into())]);
    let reply = ollama.send_chat_messages(chat.clone()).await?;
    assert!(reply.done && !reply.message.content.is_empty());
    assert_eq!(reply.final_data.map(|f| f.eval_count), Some(6));

    let mut stream = ollama.send_chat_messages_stream(chat).await?;
    let mut parts = Vec::new();
    while let Some(part) = stream.next().await {
        parts.push(part.map_err(|()| "stream error")?);
    }
    assert_eq!(parts.len(), 7);
    assert!(
        parts
            .last()
            .is_some_and(|p| p.done && p.final_data.is_some())
    );

    let generated = ollama
        .generate(GenerationRequest::new(model.clone(), "go"))
        .await?;
    assert_eq!(generated.eval_count, Some(6));

    let embed = GenerateEmbeddingsRequest::new("nomic-embed-text".into(), "x".into());
    assert_eq!(ollama.generate_embeddings(embed).await?.embeddings.len(), 1);
    assert_eq!(ollama.list_local_models().await?.len(), 4);
    assert!(!ollama.show_model_info(model).await?.model_info.is_empty());
    Ok(())
}

#[tokio::test]
async fn async_openai_parses_every_reply() -> TestResult {
    use async_openai::Client;
    use async_openai::config::OpenAIConfig;
    use async_openai::types::chat::CreateChatCompletionRequest;
    use async_openai::types::completions::CreateCompletionRequest;
    use async_openai::types::embeddings::CreateEmbeddingRequest;

    let node = start(cfg()).await?;
    let client =
        Client::with_config(OpenAIConfig::new().with_api_base(format!("{}/v1", node.url())));
    let chat = json!({ "model": "llama3:8b", "messages": [user("hi")], "max_tokens": 4 });

    let reply = client
        .chat()
        .create(serde_json::from_value::<CreateChatCompletionRequest>(
            chat.clone(),
        )?)
        .await?;
    assert_eq!(reply.usage.as_ref().map(|u| u.completion_tokens), Some(4));

    let mut streamed = chat;
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({ "include_usage": true });
    let mut stream = client
        .chat()
        .create_stream(serde_json::from_value::<CreateChatCompletionRequest>(
            streamed,
        )?)
        .await?;
    let mut usage = None;
    let mut text = String::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk?;
        usage = usage.or(chunk.usage);
        for choice in chunk.choices {
            text.push_str(choice.delta.content.as_deref().unwrap_or_default());
        }
    }
    assert_eq!(Some(text), reply.choices[0].message.content.clone());
    let total = |u: Option<&async_openai::types::chat::CompletionUsage>| u.map(|u| u.total_tokens);
    assert_eq!(total(usage.as_ref()), total(reply.usage.as_ref()));

    let completion = json!({ "model": "llama3:8b", "prompt": "go" });
    let done = client
        .completions()
        .create(serde_json::from_value::<CreateCompletionRequest>(
            completion,
        )?)
        .await?;
    assert!(!done.choices[0].text.is_empty());

    let embed = json!({ "model": "nomic-embed-text", "input": ["a", "b"] });
    let embedded = client
        .embeddings()
        .create(serde_json::from_value::<CreateEmbeddingRequest>(embed)?)
        .await?;
    assert_eq!(embedded.data.len(), 2);
    assert_eq!(client.models().list().await?.data.len(), 4);
    Ok(())
}

#[tokio::test]
async fn a_fleet_starts_on_distinct_ports() -> TestResult {
    let nodes = start_fleet(vec![cfg(), cfg()]).await?;
    assert_ne!(nodes[0].addr(), nodes[1].addr());
    assert!(nodes[0].url().starts_with("http://127.0.0.1:"));
    assert_eq!(nodes[1].name(), "test");
    Ok(())
}

#[tokio::test]
async fn the_demo_fleet_starts_and_refuses_what_cannot_fit() -> TestResult {
    let nodes = start_fleet(super::demo_fleet()).await?;
    assert_eq!(nodes[0].resident(), ["llama3:8b"]);
    assert!(nodes[2].resident().is_empty());
    let big = json!({ "model": "llama3:70b", "prompt": "x" });
    let (status, body) = post(&nodes[0], "/api/generate", big.clone()).await?;
    assert_eq!(status, 500);
    assert!(
        body["error"]
            .as_str()
            .is_some_and(|e| e.contains("37.3 GiB")),
        "{body}"
    );
    assert_eq!(post(&nodes[1], "/api/generate", big).await?.0, 404);
    Ok(())
}

/// A llama-cpp stand-in answers `GET /props` as llama-server does (`total_slots` = `-np`,
/// one slot's `n_ctx`); the Ollama kinds have no such route.
#[tokio::test]
async fn llama_cpp_kind_shows_its_slots_in_props() -> TestResult {
    let mut llama = cfg();
    llama.kind = super::StandinKind::LlamaCpp;
    llama.num_parallel = 3;
    let node = start(llama).await?;
    let (status, body) = get(&node, "/props").await?;
    assert_eq!(status, 200);
    let props: Value = serde_json::from_str(&body)?;
    assert_eq!(props["total_slots"], 3);
    assert_eq!(props["default_generation_settings"]["n_ctx"], 8192);
    for path in ["/api/version", "/api/tags", "/api/ps"] {
        assert_eq!(get(&node, path).await?.0, 404, "{path}");
    }

    let mut ollama = cfg();
    ollama.kind = super::StandinKind::Ollama;
    let node = start(ollama).await?;
    assert_eq!(get(&node, "/props").await?.0, 404);
    Ok(())
}
