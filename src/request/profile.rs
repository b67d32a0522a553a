//! Reading a request body once, without copying it, into what routing needs to know.

use std::sync::LazyLock;

use memchr::memmem::Finder;
use serde::Deserialize;
use serde_json::value::RawValue;

use super::conversation::{PROMPT_BLOCK, PrefixChain, prompt_chain};
use super::endpoint::Endpoint;
use super::fields::{self, Fields};
use super::session::session_hash;

/// A rough count used by every tokenizer-free router: four bytes of text per token.
const BYTES_PER_TOKEN: usize = 4;
/// What one image costs a vision model's context, roughly (LLaVA-style encoders).
const TOKENS_PER_IMAGE: u32 = 576;

/// Everything routing learns from a request.
#[derive(Clone, Debug)]
pub struct Profile {
    pub endpoint: Endpoint,
    /// The model as the client named it.
    pub model: String,
    /// The model as nodes list it: `llama3` becomes `llama3:latest`.
    pub model_key: String,
    pub stream: bool,
    /// `options.num_ctx`, when the client sets the context length.
    pub num_ctx: Option<u32>,
    /// Estimated prompt tokens (text and images).
    pub prompt_tokens: u32,
    /// Estimated tokens of the first message (or system text, or first prompt block): the
    /// part other conversations opening with it share. 0 where not known.
    pub first_tokens: u32,
    /// Estimated tokens after the model's last reply in a chat's messages: what a node
    /// still holding the conversation must prefill. The whole prompt where the body
    /// carries no reply, or is not a list of chat messages.
    pub new_tokens: u32,
    pub images: u32,
    /// Prefix hashes over message boundaries (chat) or prompt blocks (generate). Empty past
    /// the model for endpoints that keep no cache (embeddings, show).
    pub chain: PrefixChain,
    /// The body carries an earlier reply of the model: the client continues a conversation.
    pub follow_up: bool,
    /// Stable across a conversation's turns: the hash of its first boundary. Breaks ties.
    pub conversation: u64,
    /// A session key the client sent (OpenAI's `prompt_cache_key`, Anthropic's
    /// `metadata.user_id`, or a session header): pins the conversation to a node, ahead of
    /// its prefix chain (see [`super::session`]).
    pub session: Option<u64>,
}

#[derive(Debug, PartialEq, Eq)]
pub enum ProfileError {
    /// Not JSON, not UTF-8, or a field of the wrong type.
    Invalid(String),
    MissingModel,
}

impl std::fmt::Display for ProfileError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ProfileError::Invalid(e) => write!(f, "invalid request body: {e}"),
            ProfileError::MissingModel => write!(f, "model is required"),
        }
    }
}

/// One item of a Responses API `input` list: a message (`role`, `content`), or another item
/// (function call, its output...) hashed whole.
#[derive(Deserialize)]
struct InputItem<'a> {
    #[serde(borrow, default)]
    role: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow, default, rename = "type")]
    kind: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct AnthropicMetadata {
    #[serde(default)]
    user_id: Option<String>,
}

impl Profile {
    pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<Profile, ProfileError> {
        let parsed = fields::read(body).map_err(|e| ProfileError::Invalid(e.to_string()))?;
        let model = match (&parsed.model, &parsed.name, endpoint) {
            (Some(m), _, _) if !m.trim().is_empty() => m.to_string(),
            (None, Some(n), Endpoint::Show) if !n.trim().is_empty() => n.to_string(),
            _ => return Err(ProfileError::MissingModel),
        };
        let model_key = normalize_model(&model);
        let stream = parsed
            .stream
            .unwrap_or_else(|| endpoint.streams_by_default());
        let num_ctx = parsed.num_ctx;

        let mut chain = PrefixChain::start(&model_key);
        let mut text_bytes = 0usize;
        let mut images = 0u32;
        let mut follow_up = false;
        // Anthropic's `system` and the Responses API's `instructions` open the conversation.
        let leading_system = match endpoint {
            Endpoint::AnthropicMessages => parsed.system,
            Endpoint::OpenAiResponses => parsed.instructions,
            _ => None,
        };
        // The first boundary's text: what conversations opening alike share.
        let mut first_bytes = 0usize;
        // The text after the last assistant message, and its images; `None` where not known.
        let mut new_text: Option<(usize, usize)> = None;
        if let Some(system) = leading_system {
            first_bytes = system.len();
            text_bytes += system.len();
            chain.push(&[b"system", system.as_bytes(), b""]);
        }
        if endpoint == Endpoint::OpenAiResponses {
            let input = parsed.input.unwrap_or("null");
            text_bytes += input.len();
            images = saturating_u32(count(&INPUT_IMAGE, input));
            follow_up = responses_input_chain(input, &mut chain)?;
        } else if let Some(messages) = &parsed.messages {
            for (i, m) in messages.iter().enumerate() {
                let content = m.content.unwrap_or_default();
                let tools = m.tool_calls.unwrap_or_default();
                if i == 0 && leading_system.is_none() {
                    first_bytes = content.len() + tools.len();
                }
                text_bytes += content.len() + tools.len();
                let message_images = m.images.as_ref().map_or(0, Vec::len);
                // OpenAI and Anthropic carry images as content parts.
                let parts = count(&IMAGE_URL, content) + count(&IMAGE, content);
                images = images.saturating_add(saturating_u32(message_images + parts));
                follow_up |= m.role == "assistant";
                new_text = match (m.role == "assistant", new_text) {
                    (true, _) => Some((0, 0)),
                    (false, Some((bytes, pictures))) => Some((
                        bytes + content.len() + tools.len(),
                        pictures + message_images + parts,
                    )),
                    (false, None) => None,
                };
                if endpoint.generates() {
                    let mut parts: Vec<&[u8]> =
                        vec![m.role.as_bytes(), content.as_bytes(), tools.as_bytes()];
                    for image in m.images.iter().flatten() {
                        parts.push(image.as_bytes());
                    }
                    chain.push(&parts);
                }
            }
        } else if endpoint.generates() {
            let system = parsed.system.map(str::as_bytes);
            let prompt = parsed.prompt.map_or(&b""[..], str::as_bytes);
            text_bytes += system.map_or(0, <[u8]>::len) + prompt.len();
            first_bytes = system.map_or(prompt.len().min(PROMPT_BLOCK), <[u8]>::len);
            chain = prompt_chain(&model_key, system, prompt);
        }
        if let Some(top) = parsed.images {
            images = images.saturating_add(saturating_u32(top));
        }
        if let (Some(input), false) = (parsed.input, endpoint == Endpoint::OpenAiResponses) {
            text_bytes += input.len();
        }
        let session = explicit_session(endpoint, &parsed).map(|key| session_hash(&model_key, &key));
        let prompt_tokens = saturating_u32(text_bytes.div_ceil(BYTES_PER_TOKEN))
            .saturating_add(images.saturating_mul(TOKENS_PER_IMAGE));
        let first_tokens = saturating_u32(first_bytes.div_ceil(BYTES_PER_TOKEN)).min(prompt_tokens);
        let new_tokens = new_text.map_or(prompt_tokens, |(bytes, pictures)| {
            let text = saturating_u32(bytes.div_ceil(BYTES_PER_TOKEN));
            let images = saturating_u32(pictures).saturating_mul(TOKENS_PER_IMAGE);
            text.saturating_add(images).min(prompt_tokens)
        });
        let conversation = chain.hashes.get(1).copied().unwrap_or(chain.last());
        Ok(Profile {
            endpoint,
            model,
            model_key,
            stream,
            num_ctx,
            prompt_tokens,
            first_tokens,
            new_tokens,
            images,
            chain,
            follow_up,
            conversation,
            session,
        })
    }

    /// The profile of an audio transcription: the model comes from the multipart form, and
    /// audio has no prefix to keep warm.
    pub fn transcription(model: &str) -> Profile {
        let model_key = normalize_model(model);
        let chain = PrefixChain::start(&model_key);
        Profile {
            endpoint: Endpoint::Transcriptions,
            model: model.to_string(),
            conversation: chain.last(),
            model_key,
            stream: false,
            num_ctx: None,
            prompt_tokens: 0,
            first_tokens: 0,
            new_tokens: 0,
            images: 0,
            chain,
            follow_up: false,
            session: None,
        }
    }
}

/// Extends the chain by the Responses API's `input`: a string is one user message; a list
/// has one boundary per item. True when the input carries an earlier reply (an assistant
/// message, a function call or its output).
fn responses_input_chain(input: &str, chain: &mut PrefixChain) -> Result<bool, ProfileError> {
    let invalid = |e: serde_json::Error| ProfileError::Invalid(format!("input: {e}"));
    let first = input.trim_start().as_bytes().first().copied();
    match first {
        Some(b'"') => {
            chain.push(&[b"user", input.as_bytes(), b""]);
            Ok(false)
        }
        Some(b'[') => {
            let items: Vec<&RawValue> = serde_json::from_str(input).map_err(invalid)?;
            let mut follow_up = false;
            for raw in items {
                let item: InputItem = serde_json::from_str(raw.get()).map_err(invalid)?;
                let role = item.role.as_deref().unwrap_or_default();
                let kind = item.kind.as_deref().unwrap_or("message");
                follow_up |= role == "assistant" || kind != "message";
                // A message hashes as a chat message does; other items whole.
                match item.content {
                    Some(content) => chain.push(&[role.as_bytes(), content.get().as_bytes(), b""]),
                    None => chain.push(&[kind.as_bytes(), raw.get().as_bytes(), b""]),
                }
            }
            Ok(follow_up)
        }
        Some(b'n') | None => Ok(false),
        _ => Err(ProfileError::Invalid(
            "input must be a string or a list of items".into(),
        )),
    }
}

/// The session key a body carries: `prompt_cache_key` (OpenAI), or `metadata.user_id` on
/// the Anthropic endpoint. Keys that are not strings, or are empty, are ignored.
fn explicit_session(endpoint: Endpoint, body: &Fields) -> Option<String> {
    let non_empty = |s: String| (!s.trim().is_empty()).then_some(s);
    if let Some(key) = body
        .prompt_cache_key
        .and_then(|raw| serde_json::from_str::<String>(raw).ok())
        .and_then(non_empty)
    {
        return Some(key);
    }
    if endpoint != Endpoint::AnthropicMessages {
        return None;
    }
    let metadata: AnthropicMetadata = serde_json::from_str(body.metadata?).ok()?;
    metadata.user_id.and_then(non_empty)
}

impl Profile {
    /// The profile of a management call: it streams progress, keeps no cache, and is
    /// counted under a model name of its own.
    pub fn management() -> Profile {
        Profile {
            endpoint: Endpoint::Manage,
            model: "(management)".into(),
            model_key: "(management)".into(),
            stream: true,
            num_ctx: None,
            prompt_tokens: 0,
            first_tokens: 0,
            new_tokens: 0,
            images: 0,
            chain: PrefixChain::default(),
            follow_up: false,
            conversation: 0,
            session: None,
        }
    }
}

/// The markers of image parts in content (`"image_url"`, `"image"`) and in a Responses
/// `input` (`"input_image"`), searched with SIMD substring search.
static IMAGE_URL: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(br#""image_url""#));
static IMAGE: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(br#""image""#));
static INPUT_IMAGE: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(br#""input_image""#));

/// Non-overlapping occurrences of the marker in the JSON value `raw`, as
/// `raw.matches(marker).count()` counts them.
///
/// Most content is one string, and a string needs no search: inside a JSON string token a
/// quote is either a delimiter or escaped (`\"`), and a marker ends in a letter and a quote,
/// so it can only occur as the token's very end.
fn count(marker: &Finder, raw: &str) -> usize {
    let raw = raw.as_bytes();
    if raw.first() == Some(&b'"') {
        usize::from(raw.ends_with(marker.needle()))
    } else {
        marker.find_iter(raw).count()
    }
}

/// Counts past `u32::MAX` (bodies are bounded, but not by this code) stay at the maximum.
fn saturating_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// Ollama names a model `name:tag` and reads a bare name as `name:latest`.
pub fn normalize_model(model: &str) -> String {
    let model = model.trim();
    // A colon inside a registry host's port (host:5000/ns/name) is not a tag separator.
    let last_segment = model.rsplit('/').next().unwrap_or(model);
    if last_segment.contains(':') {
        model.to_string()
    } else {
        format!("{model}:latest")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: &str) -> Profile {
        Profile::parse(Endpoint::Chat, body.as_bytes()).expect("valid body")
    }

    #[test]
    fn model_may_come_last() {
        let p = chat(
            r#"{"messages":[{"role":"user","content":"hi"}],"stream":false,"model":"llama3"}"#,
        );
        assert_eq!(p.model, "llama3");
        assert_eq!(p.model_key, "llama3:latest");
        assert!(!p.stream);
        assert_eq!(p.chain.depth(), 1);
    }

    #[test]
    fn stream_defaults_per_api() {
        let body = r#"{"model":"m","messages":[]}"#;
        assert!(
            Profile::parse(Endpoint::Chat, body.as_bytes())
                .unwrap()
                .stream
        );
        assert!(
            !Profile::parse(Endpoint::OpenAiChat, body.as_bytes())
                .unwrap()
                .stream
        );
        let body = r#"{"model":"m","messages":[],"stream":true}"#;
        assert!(
            Profile::parse(Endpoint::OpenAiChat, body.as_bytes())
                .unwrap()
                .stream
        );
    }

    #[test]
    fn errors_are_specific() {
        assert_eq!(
            Profile::parse(Endpoint::Chat, br#"{"messages":[]}"#).unwrap_err(),
            ProfileError::MissingModel
        );
        assert_eq!(
            Profile::parse(Endpoint::Chat, br#"{"model":"  "}"#).unwrap_err(),
            ProfileError::MissingModel
        );
        assert!(matches!(
            Profile::parse(Endpoint::Chat, b"{not json").unwrap_err(),
            ProfileError::Invalid(_)
        ));
        let err = Profile::parse(Endpoint::Chat, br#"{"model":"m","stream":"yes"}"#).unwrap_err();
        assert!(err.to_string().contains("boolean"), "{err}");
        assert!(matches!(
            Profile::parse(Endpoint::Chat, b"{\"model\":\"\xff\"}").unwrap_err(),
            ProfileError::Invalid(_)
        ));
        assert!(matches!(
            Profile::parse(Endpoint::Chat, b"[1,2]").unwrap_err(),
            ProfileError::Invalid(_)
        ));
    }

    #[test]
    fn new_tokens_are_those_after_the_last_reply() {
        let parse = |messages: serde_json::Value| {
            let body = serde_json::json!({ "model": "m", "messages": messages });
            Profile::parse(Endpoint::Chat, body.to_string().as_bytes()).unwrap()
        };
        let text = |bytes: usize| "x".repeat(bytes);
        let opening = parse(serde_json::json!([
            { "role": "system", "content": text(4_000) },
            { "role": "user", "content": text(400) },
        ]));
        assert_eq!(
            opening.new_tokens, opening.prompt_tokens,
            "no reply: all of it"
        );
        let turn = parse(serde_json::json!([
            { "role": "user", "content": text(4_000) },
            { "role": "assistant", "content": text(800) },
            { "role": "user", "content": text(398) },
            { "role": "tool", "content": text(398) },
        ]));
        // Each content counted with its quotes, as in `prompt_tokens`.
        assert_eq!(turn.new_tokens, 200);
        assert!(turn.prompt_tokens > 1_300);
        let image = parse(serde_json::json!([
            { "role": "user", "content": text(4_000) },
            { "role": "assistant", "content": "ok" },
            { "role": "user", "content": text(398), "images": ["aGk="] },
        ]));
        assert_eq!(image.new_tokens, 100 + TOKENS_PER_IMAGE);
    }

    #[test]
    fn deep_nesting_is_an_error_not_a_crash() {
        let deep = format!(
            r#"{{"model":"m","options":{}{}}}"#,
            "[".repeat(100_000),
            "]".repeat(100_000)
        );
        assert!(Profile::parse(Endpoint::Chat, deep.as_bytes()).is_err());
    }

    #[test]
    fn follow_up_and_options() {
        let p = chat(
            r#"{"model":"m","options":{"num_ctx":8192,"temperature":0},"messages":[
                {"role":"user","content":"hi"},{"role":"assistant","content":"hello"},
                {"role":"user","content":"more","images":["aGVsbG8="]}]}"#,
        );
        assert!(p.follow_up);
        assert_eq!(p.num_ctx, Some(8192));
        assert_eq!(p.images, 1);
        assert!(p.prompt_tokens >= TOKENS_PER_IMAGE);
        assert_eq!(p.chain.depth(), 3);
    }

    #[test]
    fn conversation_id_is_stable_across_turns() {
        let t1 = chat(r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#);
        let t2 = chat(
            r#"{"model":"m","messages":[{"role":"user","content":"hi"},
               {"role":"assistant","content":"yo"},{"role":"user","content":"and?"}]}"#,
        );
        assert_eq!(t1.conversation, t2.conversation);
        assert!(t2.chain.hashes.contains(&t1.chain.last()));
    }

    #[test]
    fn the_first_message_is_sized_for_what_conversations_opening_alike_share() {
        let system = "s".repeat(4_000);
        let body = format!(
            r#"{{"model":"m","messages":[{{"role":"system","content":"{system}"}},
               {{"role":"user","content":"{}"}}]}}"#,
            "u".repeat(400)
        );
        let p = chat(&body);
        // Each content is counted with its quotes, as in `prompt_tokens`.
        assert_eq!((p.first_tokens, p.prompt_tokens), (1_001, 1_101));
        // A plain prompt shares its system text, else its first block.
        let body = format!(r#"{{"model":"m","system":"{system}","prompt":"hi"}}"#);
        let p = Profile::parse(Endpoint::Generate, body.as_bytes()).unwrap();
        assert_eq!(p.first_tokens, 1_001);
        let body = format!(r#"{{"model":"m","prompt":"{}"}}"#, "a".repeat(3000));
        let p = Profile::parse(Endpoint::Generate, body.as_bytes()).unwrap();
        assert_eq!(p.first_tokens, 256);
    }

    #[test]
    fn generate_hashes_prompt_blocks() {
        let body = format!(r#"{{"model":"m","prompt":"{}"}}"#, "a".repeat(3000));
        let p = Profile::parse(Endpoint::Generate, body.as_bytes()).unwrap();
        assert_eq!(p.chain.depth(), 3);
        assert!(p.stream);
        assert!(p.prompt_tokens >= 750);
    }

    #[test]
    fn embeddings_keep_no_chain_and_show_accepts_name() {
        let p = Profile::parse(Endpoint::Embed, br#"{"model":"e","input":["a","b"]}"#).unwrap();
        assert_eq!(p.chain.depth(), 0);
        assert!(!p.stream);
        let p = Profile::parse(Endpoint::Show, br#"{"name":"llama3:8b"}"#).unwrap();
        assert_eq!(p.model_key, "llama3:8b");
    }

    #[test]
    fn millions_of_images_saturate_instead_of_overflowing() {
        // Found by hand while fuzzing: 7.5 million images overflowed u32 tokens.
        let images = vec!["0"; 7_500_000].join(",");
        let body = format!(r#"{{"model":"m","images":[{images}]}}"#);
        let p = Profile::parse(Endpoint::Generate, body.as_bytes()).unwrap();
        assert_eq!(p.images, 7_500_000);
        assert_eq!(p.prompt_tokens, u32::MAX);
    }

    #[test]
    fn explicit_session_keys_from_the_body() {
        let p = Profile::parse(
            Endpoint::OpenAiChat,
            br#"{"model":"m","prompt_cache_key":"k","messages":[]}"#,
        )
        .unwrap();
        assert_eq!(p.session, Some(session_hash("m:latest", "k")));
        let body = br#"{"model":"m","metadata":{"user_id":"u"},"messages":[]}"#;
        let anthropic = Profile::parse(Endpoint::AnthropicMessages, body).unwrap();
        assert_eq!(anthropic.session, Some(session_hash("m:latest", "u")));
        // OpenAI's metadata is free-form: not a session key there.
        assert_eq!(
            Profile::parse(Endpoint::OpenAiChat, body).unwrap().session,
            None
        );
        let odd = br#"{"model":"m","prompt_cache_key":5,"metadata":[1],"messages":[]}"#;
        assert_eq!(
            Profile::parse(Endpoint::AnthropicMessages, odd)
                .unwrap()
                .session,
            None
        );
    }

    #[test]
    fn responses_and_anthropic_chains_match_native_chat() {
        let native = chat(
            r#"{"model":"m","messages":[{"role":"system","content":"sys"},{"role":"user","content":"hi"}]}"#,
        );
        let anthropic = Profile::parse(
            Endpoint::AnthropicMessages,
            br#"{"model":"m","system":"sys","messages":[{"role":"user","content":"hi"}]}"#,
        )
        .unwrap();
        let responses = Profile::parse(
            Endpoint::OpenAiResponses,
            br#"{"model":"m","instructions":"sys","input":"hi"}"#,
        )
        .unwrap();
        let items = Profile::parse(
            Endpoint::OpenAiResponses,
            br#"{"model":"m","instructions":"sys","input":[{"role":"user","content":"hi"},
              {"type":"message","role":"assistant","content":"yo"},{"role":"user","content":"and?"}]}"#,
        )
        .unwrap();
        assert_eq!(anthropic.chain, native.chain);
        assert_eq!(responses.chain, native.chain);
        assert_eq!(items.chain.hashes[..3], native.chain.hashes[..]);
        assert!(items.follow_up && !responses.follow_up);
        let image = Profile::parse(
            Endpoint::AnthropicMessages,
            br#"{"model":"m","messages":[{"role":"user","content":[
              {"type":"image","source":{"type":"base64","data":"aGk="}},{"type":"text","text":"what?"}]}]}"#,
        )
        .unwrap();
        assert_eq!(image.images, 1);
        assert!(!responses.stream, "Responses streams only when asked");
        assert!(Profile::parse(Endpoint::OpenAiResponses, br#"{"model":"m","input":5}"#).is_err());
    }

    #[test]
    fn normalizes_tags() {
        assert_eq!(normalize_model("llama3"), "llama3:latest");
        assert_eq!(normalize_model("llama3:8b"), "llama3:8b");
        assert_eq!(normalize_model("host:5000/ns/m"), "host:5000/ns/m:latest");
    }

    proptest::proptest! {
        /// The markers are counted exactly as `str::matches` counted them, in JSON strings
        /// (escaped quotes and backslashes, `\u` escapes, non-ASCII) and in lists and objects
        /// made of the markers' own pieces.
        #[test]
        fn image_markers_count_as_str_matches(
            pieces in proptest::collection::vec(0usize..MARKER_PIECES.len(), 0..30),
            escape_unicode: bool,
        ) {
            let text: String = pieces.iter().map(|i| MARKER_PIECES[*i]).collect();
            let string = if escape_unicode {
                // Quotes and non-ASCII as `\u` escapes, as some clients write them.
                let escaped: String = text
                    .chars()
                    .map(|c| match c {
                        '"' => "\\u0022".to_string(),
                        '\\' => "\\\\".to_string(),
                        '\n' => "\\n".to_string(),
                        c if !c.is_ascii() => format!("\\u{:04x}", c as u32 & 0xffff),
                        c => c.to_string(),
                    })
                    .collect();
                format!("\"{escaped}\"")
            } else {
                serde_json::to_string(&text).unwrap()
            };
            let list = format!("[{string},{{\"type\":{string}}},\"x\"]");
            // The text itself stands for raw lists and objects, which are searched; what
            // starts with a quote in a body is always a whole string token.
            let mut raws = vec![&string, &list];
            if !text.starts_with('"') {
                raws.push(&text);
            }
            for raw in raws {
                for (finder, marker) in [
                    (&IMAGE, "\"image\""),
                    (&IMAGE_URL, "\"image_url\""),
                    (&INPUT_IMAGE, "\"input_image\""),
                ] {
                    if raw.starts_with('"') {
                        // Only a JSON string token takes the short way.
                        proptest::prop_assert!(serde_json::from_str::<String>(raw).is_ok());
                    }
                    proptest::prop_assert_eq!(count(finder, raw), raw.matches(marker).count(), "{}", raw);
                }
            }
        }
    }

    const MARKER_PIECES: &[&str] = &[
        "\"",
        "image",
        "_url",
        "input_",
        "\\",
        "\\\"",
        "a",
        "\u{e9}",
        "\u{1f600}",
        "{",
        ":",
        "\n",
    ];

    #[test]
    fn images_counted_in_every_shape() {
        // Ollama's images list, OpenAI's image_url parts inside nested content, and tool
        // calls carrying the word in their arguments (escaped: not a part).
        let body = r#"{"model":"m","messages":[
            {"role":"user","content":"look \"image\" caf\u00e9 \u2603","images":["aGk=","aGk="]},
            {"role":"user","content":[{"type":"text","text":"two"},
                {"type":"image_url","image_url":{"url":"data:image/png;base64,aGk="}},
                {"type":"image_url","image_url":{"url":"https://x/y.png"}}]},
            {"role":"assistant","content":"","tool_calls":[{"function":{"name":"f",
                "arguments":"{\"image\":1}"}}]}]}"#;
        let p = chat(body);
        // 2 in `images`, and each image_url part names "image_url" twice (type and key).
        assert_eq!(p.images, 2 + 4);
        assert_eq!(p.chain.depth(), 3);
        assert!(p.follow_up);
        let responses = Profile::parse(
            Endpoint::OpenAiResponses,
            br#"{"model":"m","input":[{"role":"user","content":[
              {"type":"input_image","image_url":"data:,"},{"type":"input_text","text":"\"input_image\""}]}]}"#,
        )
        .unwrap();
        assert_eq!(responses.images, 1);
    }
}
