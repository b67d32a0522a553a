//! Real client libraries, written by others, talking to corral as if it were one Ollama or
//! one OpenAI-compatible server.

mod common;

use async_openai::Client;
use async_openai::config::OpenAIConfig;
use async_openai::types::chat::{
    ChatCompletionRequestUserMessageArgs, CreateChatCompletionRequestArgs,
};
use async_openai::types::embeddings::CreateEmbeddingRequestArgs;
use common::*;
use futures::StreamExt;
use ollama_rs::Ollama;
use ollama_rs::generation::chat::ChatMessage;
use ollama_rs::generation::chat::request::ChatMessageRequest;
use ollama_rs::generation::completion::request::GenerationRequest;
use ollama_rs::generation::embeddings::request::{EmbeddingsInput, GenerateEmbeddingsRequest};

async fn fleet() -> (Vec<corral::standin::StandinNode>, Router) {
    let mut cfgs = vec![fast_node("a"), fast_node("b")];
    for c in &mut cfgs {
        c.models.push(model("nomic-embed-text:latest", 0.3));
    }
    let nodes = futures::future::join_all(cfgs.into_iter().map(start)).await;
    let router = Router::start(nodes.iter().map(|n| NodeSpec::of(n, 2)).collect(), "").await;
    (nodes, router)
}

#[tokio::test]
async fn ollama_rs_chats_streams_generates_embeds_and_lists() {
    let (nodes, router) = fleet().await;
    let ollama = Ollama::builder()
        .host("http://127.0.0.1")
        .port(router.addr.port())
        .build();

    let models = ollama.list_local_models().await.expect("list models");
    let names: Vec<_> = models.iter().map(|m| m.name.as_str()).collect();
    assert!(
        names.contains(&MODEL) && names.contains(&"nomic-embed-text:latest"),
        "{names:?}"
    );

    let first = vec![ChatMessage::user("Hello there, tell me a story".into())];
    let reply = ollama
        .send_chat_messages(ChatMessageRequest::new(MODEL.into(), first.clone()))
        .await
        .expect("chat");
    assert!(!reply.message.content.is_empty());

    // The follow-up streams, and its prefix was reused on the node that served turn one.
    let mut history = first;
    history.push(reply.message.clone());
    history.push(ChatMessage::user("And then?".into()));
    let mut stream = ollama
        .send_chat_messages_stream(ChatMessageRequest::new(MODEL.into(), history))
        .await
        .expect("chat stream");
    let mut pieces = 0;
    let mut last = None;
    while let Some(item) = stream.next().await {
        let item = item.expect("stream item");
        pieces += 1;
        last = Some(item);
    }
    let last = last.expect("a final chunk");
    assert!(last.done && pieces > 2, "{pieces} pieces");
    let final_data = last.final_data.expect("final statistics");
    let cached = nodes
        .iter()
        .flat_map(|n| n.log())
        .map(|r| r.cached_tokens)
        .max();
    assert!(cached > Some(0), "the follow-up reused a prefix");
    assert!(
        final_data.prompt_eval_count < 20,
        "only the new tokens were evaluated"
    );

    let generated = ollama
        .generate(GenerationRequest::new(MODEL.into(), "Why is the sky blue?"))
        .await
        .expect("generate");
    assert!(!generated.response.is_empty());

    let embedded = ollama
        .generate_embeddings(GenerateEmbeddingsRequest::new(
            "nomic-embed-text:latest".into(),
            EmbeddingsInput::Multiple(vec!["a".into(), "b".into()]),
        ))
        .await
        .expect("embed");
    assert_eq!(embedded.embeddings.len(), 2);
}

#[tokio::test]
async fn async_openai_chats_streams_embeds_and_lists() {
    let (_nodes, router) = fleet().await;
    let config = OpenAIConfig::new()
        .with_api_base(format!("{}/v1", router.url()))
        .with_api_key("unused");
    let client = Client::with_config(config);

    let models = client.models().list().await.expect("list models");
    assert!(models.data.iter().any(|m| m.id == MODEL));

    let message = ChatCompletionRequestUserMessageArgs::default()
        .content("Hello from OpenAI land")
        .build()
        .unwrap();
    let request = CreateChatCompletionRequestArgs::default()
        .model(MODEL)
        .messages([message.into()])
        .build()
        .unwrap();
    let reply = client
        .chat()
        .create(request.clone())
        .await
        .expect("chat completion");
    let text = reply.choices[0].message.content.clone().unwrap_or_default();
    assert!(!text.is_empty());

    let mut stream = client.chat().create_stream(request).await.expect("stream");
    let mut deltas = 0;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.expect("stream chunk");
        if chunk
            .choices
            .first()
            .and_then(|c| c.delta.content.as_ref())
            .is_some()
        {
            deltas += 1;
        }
    }
    assert!(deltas >= 2, "{deltas} content deltas");

    let embeddings = client
        .embeddings()
        .create(
            CreateEmbeddingRequestArgs::default()
                .model("nomic-embed-text:latest")
                .input("embed me")
                .build()
                .unwrap(),
        )
        .await
        .expect("embeddings");
    assert_eq!(embeddings.data.len(), 1);
}
