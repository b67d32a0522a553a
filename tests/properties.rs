//! Properties of request profiling and scoring, checked on generated input (proptest).
//!
//! Request bodies are written by hand here (not through `serde_json::to_string` of a map) so
//! that key order, unknown fields and whitespace are under the test's control, as they are
//! under the client's.

use std::time::{Duration, Instant};

use corral::config::Weights;
use corral::request::{
    Endpoint, PrefixChain, Profile, ProfileError, normalize_model, prompt_chain,
};
use corral::routing::score;
use corral::routing::signals::{self, Memory, Speed, Warmth};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use serde_json::{Value, json};

const ENDPOINTS: [Endpoint; 8] = [
    Endpoint::Chat,
    Endpoint::Generate,
    Endpoint::Embed,
    Endpoint::Embeddings,
    Endpoint::Show,
    Endpoint::OpenAiChat,
    Endpoint::OpenAiCompletions,
    Endpoint::OpenAiEmbeddings,
];

/// Field names `Profile::parse` reads; an "unknown" field must not reuse them (a duplicate
/// known field is an error, as it should be).
const KNOWN_TOP: [&str; 12] = [
    "model",
    "name",
    "stream",
    "options",
    "messages",
    "prompt",
    "system",
    "images",
    "input",
    "instructions",
    "prompt_cache_key",
    "metadata",
];
/// The block size of prompt hashing (not exported; `prompt_block_size` checks it).
const PROMPT_BLOCK: usize = 1024;

const KNOWN_MESSAGE: [&str; 4] = ["role", "content", "images", "tool_calls"];

fn endpoint() -> impl Strategy<Value = Endpoint> {
    prop::sample::select(ENDPOINTS.to_vec())
}

fn chat_endpoint() -> impl Strategy<Value = Endpoint> {
    prop::sample::select(vec![Endpoint::Chat, Endpoint::OpenAiChat])
}

/// Text with the characters that JSON must escape or that trip naive scanners: quotes,
/// backslashes, control characters, line separators, non-BMP characters.
fn text(max: usize) -> impl Strategy<Value = String> {
    let tricky = prop::sample::select(vec![
        '"', '\\', '/', '\n', '\t', '\u{0}', '\u{1f}', '\u{7f}', '\u{2028}', 'é', '中', '😀', '{',
        '}', '[', ']', ':', ',',
    ]);
    prop::collection::vec(prop_oneof![3 => any::<char>(), 2 => tricky], 0..max)
        .prop_map(|chars| chars.into_iter().collect())
}

/// A model name as clients write it: aliases of one another (`m`, `m:latest`, ` m `),
/// registry paths with ports, and arbitrary non-blank text.
fn model_name() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(vec![
            "llama3",
            "llama3:latest",
            " llama3 ",
            "llama3:8b",
            "Llama3",
            "qwen2.5:0.5b",
            "host:5000/ns/m",
            "host:5000/ns/m:latest",
            "gpt-oss:20b",
        ])
        .prop_map(String::from),
        text(12).prop_filter("a model name is not blank", |s| !s.trim().is_empty()),
    ]
}

fn base64ish() -> impl Strategy<Value = String> {
    "[A-Za-z0-9+/]{0,24}={0,2}"
}

/// Any JSON value, nested a few levels.
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::from), // NaN and infinities become null
        text(16).prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((text(8), inner), 0..6)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

/// An unknown field: a name `Profile::parse` does not read, with any value.
fn unknown_field(known: &'static [&'static str]) -> impl Strategy<Value = (String, Value)> {
    (
        "[a-z_]{1,10}".prop_filter("not a known field", move |k| !known.contains(&k.as_str())),
        json_value(),
    )
}

/// Whitespace that JSON allows between tokens.
fn ws() -> impl Strategy<Value = String> {
    prop::sample::select(vec!["", "", " ", "\n", "\t ", "\r\n  "]).prop_map(String::from)
}

fn raw(v: &Value) -> String {
    serde_json::to_string(v).expect("a Value always serializes")
}

/// A JSON object from raw key/value pairs, in the given order, with the given whitespace
/// around separators.
fn object(fields: &[(String, String)], pad: &str) -> String {
    let inner: Vec<String> = fields
        .iter()
        .map(|(k, v)| format!("{pad}{}{pad}:{pad}{v}{pad}", raw(&Value::from(k.as_str()))))
        .collect();
    format!("{{{}}}", inner.join(","))
}

/// Orders `items` by the keys (one per item, extra keys ignored): a permutation drawn by
/// proptest and shrunk with it.
fn permute<T>(items: Vec<T>, keys: &[u32]) -> Vec<T> {
    let mut keyed: Vec<(u32, usize, T)> = items
        .into_iter()
        .enumerate()
        .map(|(i, item)| (keys.get(i).copied().unwrap_or(0), i, item))
        .collect();
    keyed.sort_by_key(|(k, i, _)| (*k, *i));
    keyed.into_iter().map(|(_, _, item)| item).collect()
}

#[derive(Clone, Debug)]
struct Message {
    role: &'static str,
    /// A string, or OpenAI content parts.
    content: Value,
    images: Vec<String>,
    tool_calls: Option<Value>,
    /// Fields the profile ignores (`thinking`, `name`, anything).
    extra: Vec<(String, Value)>,
}

fn message() -> impl Strategy<Value = Message> {
    let content = prop_oneof![
        3 => text(40).prop_map(Value::String),
        1 => (text(20), base64ish()).prop_map(|(t, img)| json!([
            {"type": "text", "text": t},
            {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{img}")}}
        ])),
    ];
    (
        prop::sample::select(vec![
            "system",
            "user",
            "assistant",
            "tool",
            "Ünïcode \"role\"",
        ]),
        content,
        prop::collection::vec(base64ish(), 0..3),
        prop::option::of(json_value()),
        prop::collection::vec(unknown_field(&KNOWN_MESSAGE), 0..2),
    )
        .prop_map(|(role, content, images, tool_calls, extra)| Message {
            role,
            content,
            images,
            tool_calls,
            extra,
        })
}

impl Message {
    /// The message's fields in canonical order, plus its unknown ones when asked.
    fn fields(&self, with_extra: bool) -> Vec<(String, String)> {
        let mut f = vec![
            ("role".to_string(), raw(&Value::from(self.role))),
            ("content".to_string(), raw(&self.content)),
        ];
        if !self.images.is_empty() {
            f.push(("images".into(), raw(&json!(self.images))));
        }
        if let Some(t) = &self.tool_calls {
            f.push(("tool_calls".into(), raw(t)));
        }
        if with_extra {
            f.extend(self.extra.iter().map(|(k, v)| (k.clone(), raw(v))));
        }
        f
    }
}

fn messages_raw(msgs: &[Message]) -> String {
    let items: Vec<String> = msgs.iter().map(|m| object(&m.fields(false), "")).collect();
    format!("[{}]", items.join(","))
}

fn chat_body(model: &str, msgs: &[Message]) -> String {
    object(
        &[
            ("model".into(), raw(&Value::from(model))),
            ("messages".into(), messages_raw(msgs)),
        ],
        "",
    )
}

/// Everything of a profile that routing reads.
type Fingerprint = (
    Endpoint,
    String,
    String,
    bool,
    Option<u32>,
    u32,
    u32,
    PrefixChain,
    bool,
    u64,
);

fn fingerprint(p: &Profile) -> Fingerprint {
    (
        p.endpoint,
        p.model.clone(),
        p.model_key.clone(),
        p.stream,
        p.num_ctx,
        p.prompt_tokens,
        p.images,
        p.chain.clone(),
        p.follow_up,
        p.conversation,
    )
}

/// What holds of every profile `parse` accepts, whatever the body.
fn check_accepted(endpoint: Endpoint, p: &Profile) -> Result<(), TestCaseError> {
    prop_assert_eq!(p.endpoint, endpoint);
    prop_assert!(!p.model.trim().is_empty());
    prop_assert_eq!(&p.model_key, &normalize_model(&p.model));
    let start = PrefixChain::start(&p.model_key);
    prop_assert_eq!(p.chain.hashes.first(), start.hashes.first());
    if !endpoint.generates() {
        prop_assert_eq!(p.chain.depth(), 0);
    }
    Ok(())
}

fn parse_checked(endpoint: Endpoint, body: &[u8]) -> Result<(), TestCaseError> {
    if let Ok(p) = Profile::parse(endpoint, body) {
        check_accepted(endpoint, &p)?;
    }
    Ok(())
}

/// A request with every field `parse` reads, each optional, plus unknown fields.
#[derive(Clone, Debug)]
struct Request {
    model: String,
    stream: Option<bool>,
    num_ctx: Option<u32>,
    option_extra: Vec<(String, Value)>,
    messages: Option<Vec<Message>>,
    system: Option<String>,
    prompt: Option<String>,
    images: Option<Vec<String>>,
    input: Option<Value>,
    extra: Vec<(String, Value)>,
}

fn request() -> impl Strategy<Value = Request> {
    (
        model_name(),
        prop::option::of(any::<bool>()),
        prop::option::of(any::<u32>()),
        prop::collection::vec(unknown_field(&["num_ctx"]), 0..3),
        prop::option::of(prop::collection::vec(message(), 0..5)),
        prop::option::of(text(30)),
        prop::option::of(text(60)),
        prop::option::of(prop::collection::vec(base64ish(), 0..3)),
        prop::option::of(prop_oneof![
            text(30).prop_map(Value::String),
            prop::collection::vec(text(10).prop_map(Value::String), 0..4).prop_map(Value::Array),
        ]),
        prop::collection::vec(unknown_field(&KNOWN_TOP), 0..4),
    )
        .prop_map(
            |(
                model,
                stream,
                num_ctx,
                option_extra,
                messages,
                system,
                prompt,
                images,
                input,
                extra,
            )| {
                Request {
                    model,
                    stream,
                    num_ctx,
                    option_extra,
                    messages,
                    system,
                    prompt,
                    images,
                    input,
                    extra,
                }
            },
        )
}

impl Request {
    /// The body with `model` first, no unknown fields and no whitespace when `shuffle` is
    /// `None`; else with unknown fields everywhere, every object's keys reordered by the
    /// keys given, and `pad` around every separator.
    fn body(&self, shuffle: Option<(&[u32], &str)>) -> String {
        let (keys, pad) = shuffle.unwrap_or((&[], ""));
        let with_extra = shuffle.is_some();
        let reorder = |fields: Vec<(String, String)>, salt: usize| -> Vec<(String, String)> {
            if with_extra {
                let rotated: Vec<u32> = keys.iter().cycle().skip(salt).take(16).copied().collect();
                permute(fields, &rotated)
            } else {
                fields
            }
        };
        let mut top = vec![("model".to_string(), raw(&Value::from(self.model.as_str())))];
        if let Some(s) = self.stream {
            top.push(("stream".into(), s.to_string()));
        }
        let mut options = Vec::new();
        if let Some(n) = self.num_ctx {
            options.push(("num_ctx".to_string(), n.to_string()));
        }
        if with_extra {
            options.extend(self.option_extra.iter().map(|(k, v)| (k.clone(), raw(v))));
        }
        if self.num_ctx.is_some() || with_extra {
            top.push(("options".into(), object(&reorder(options, 1), pad)));
        }
        if let Some(msgs) = &self.messages {
            let items: Vec<String> = msgs
                .iter()
                .enumerate()
                .map(|(i, m)| object(&reorder(m.fields(with_extra), i + 2), pad))
                .collect();
            top.push(("messages".into(), format!("[{}]", items.join(","))));
        }
        if let Some(s) = &self.system {
            top.push(("system".into(), raw(&Value::from(s.as_str()))));
        }
        if let Some(p) = &self.prompt {
            top.push(("prompt".into(), raw(&Value::from(p.as_str()))));
        }
        if let Some(images) = &self.images {
            top.push(("images".into(), raw(&json!(images))));
        }
        if let Some(input) = &self.input {
            top.push(("input".into(), raw(input)));
        }
        if with_extra {
            top.extend(self.extra.iter().map(|(k, v)| (k.clone(), raw(v))));
        }
        object(&reorder(top, 0), pad)
    }
}

fn weights() -> impl Strategy<Value = Weights> {
    let w = || 0.0..100.0f64;
    (w(), w(), w(), w(), w(), w(), w(), w(), w()).prop_map(
        |(loaded, memory, queue, latency, role, availability, context, session, displace)| {
            Weights {
                model_loaded: loaded,
                memory_fit: memory,
                queue_depth: queue,
                latency,
                role_affinity: role,
                availability,
                context_fit: context,
                session_affinity: session,
                slot_displacement: displace,
                // Deciding in seconds is off, as by default: the properties are the signals'.
                move_cost: 0.0,
            }
        },
    )
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
}

proptest! {
    /// Turn N+1 of a conversation repeats turn N's messages, so turn N's chain is a prefix
    /// of turn N+1's: the affinity table finds the node that served turn N.
    #[test]
    fn chain_of_a_turn_prefixes_the_next(
        endpoint in chat_endpoint(),
        model in model_name(),
        msgs in prop::collection::vec(message(), 1..8),
    ) {
        let full = Profile::parse(endpoint, chat_body(&model, &msgs).as_bytes())
            .map_err(|e| TestCaseError::fail(format!("{e}")))?;
        prop_assert_eq!(full.chain.depth(), msgs.len());
        for n in 0..=msgs.len() {
            let turn = Profile::parse(endpoint, chat_body(&model, &msgs[..n]).as_bytes())
                .map_err(|e| TestCaseError::fail(format!("{e}")))?;
            prop_assert_eq!(turn.chain.depth(), n);
            prop_assert_eq!(&turn.chain.hashes[..], &full.chain.hashes[..=n]);
            if n > 0 {
                prop_assert_eq!(turn.conversation, full.conversation);
                prop_assert_eq!(
                    turn.follow_up,
                    msgs[..n].iter().any(|m| m.role == "assistant")
                );
            }
        }
    }

    /// A prompt that extends an earlier one shares its complete leading blocks (and the
    /// system text's hash).
    #[test]
    fn prompt_blocks_prefix_a_longer_prompt(
        endpoint in prop::sample::select(vec![Endpoint::Generate, Endpoint::OpenAiCompletions]),
        system in prop::option::of(text(20)),
        prompt in prop_oneof![text(800), "[a-z ]{900,3000}"],
        more in text(400),
    ) {
        let body = |p: &str| {
            let mut f = vec![("model".to_string(), raw(&json!("m")))];
            if let Some(s) = &system {
                f.push(("system".into(), raw(&Value::from(s.as_str()))));
            }
            f.push(("prompt".into(), raw(&Value::from(p))));
            object(&f, "")
        };
        let short = Profile::parse(endpoint, body(&prompt).as_bytes()).unwrap();
        let long = Profile::parse(endpoint, body(&format!("{prompt}{more}")).as_bytes()).unwrap();
        // Blocks hash the prompt's JSON text; all of the shorter one but its closing quote
        // starts the longer one.
        let prompt_raw = raw(&Value::from(prompt.as_str()));
        let shared_blocks = (prompt_raw.len() - 1) / PROMPT_BLOCK;
        let shared = 1 + usize::from(system.is_some()) + shared_blocks;
        prop_assert!(short.chain.hashes.len() >= shared);
        prop_assert_eq!(&short.chain.hashes[..shared], &long.chain.hashes[..shared]);
        // The chain is the one `prompt_chain` builds from the fields' JSON text.
        let system_raw = system.as_ref().map(|s| raw(&Value::from(s.as_str())));
        let expected = prompt_chain(
            "m:latest",
            system_raw.as_deref().map(str::as_bytes),
            prompt_raw.as_bytes(),
        );
        prop_assert_eq!(&short.chain, &expected);
    }

    /// Two names of one model (`m`, `m:latest`) share their chains; different models share
    /// no hash at all, not even for the same messages.
    #[test]
    fn models_never_share_a_chain(
        endpoint in chat_endpoint(),
        a in model_name(),
        b in model_name(),
        msgs in prop::collection::vec(message(), 1..4),
    ) {
        let pa = Profile::parse(endpoint, chat_body(&a, &msgs).as_bytes()).unwrap();
        let pb = Profile::parse(endpoint, chat_body(&b, &msgs).as_bytes()).unwrap();
        if normalize_model(&a) == normalize_model(&b) {
            prop_assert_eq!(&pa.chain, &pb.chain);
        } else {
            prop_assert_ne!(pa.chain.hashes[1], pb.chain.hashes[1]);
            for h in &pa.chain.hashes {
                prop_assert!(!pb.chain.hashes.contains(h), "{a:?} and {b:?} share {h:x}");
            }
        }
    }

    /// Key order, unknown fields (at the top, in options, in messages) and whitespace
    /// between tokens leave the profile as it is.
    #[test]
    fn key_order_and_unknown_fields_do_not_matter(
        endpoint in endpoint(),
        req in request(),
        keys in prop::collection::vec(any::<u32>(), 16),
        pad in ws(),
    ) {
        let plain = req.body(None);
        let shuffled = req.body(Some((&keys, &pad)));
        let a = Profile::parse(endpoint, plain.as_bytes());
        let b = Profile::parse(endpoint, shuffled.as_bytes());
        match (&a, &b) {
            (Ok(a), Ok(b)) => {
                prop_assert_eq!(fingerprint(a), fingerprint(b));
                check_accepted(endpoint, a)?;
            }
            _ => prop_assert!(false, "{a:?} / {b:?}\n{plain}\n{shuffled}"),
        }
    }

    /// Any bytes: an error or a profile, never a panic.
    #[test]
    fn parse_survives_any_bytes(
        endpoint in endpoint(),
        bytes in prop::collection::vec(any::<u8>(), 0..512),
    ) {
        parse_checked(endpoint, &bytes)?;
    }

    /// Valid bodies cut short or with a byte changed: the inputs a parser gets wrong.
    #[test]
    fn parse_survives_damaged_bodies(
        endpoint in endpoint(),
        req in request(),
        keys in prop::collection::vec(any::<u32>(), 16),
        cut in any::<prop::sample::Index>(),
        at in any::<prop::sample::Index>(),
        byte in any::<u8>(),
    ) {
        let body = req.body(Some((&keys, " "))).into_bytes();
        parse_checked(endpoint, &body[..cut.index(body.len() + 1)])?;
        let mut changed = body.clone();
        changed[at.index(body.len())] = byte;
        parse_checked(endpoint, &changed)?;
    }

    /// Any JSON value, and objects whose known fields hold values of any type.
    #[test]
    fn parse_survives_any_json(
        endpoint in endpoint(),
        value in json_value(),
        typed in prop::collection::vec(
            (prop::sample::select(KNOWN_TOP.to_vec()), json_value()), 0..6),
        model in prop::option::of(model_name()),
    ) {
        parse_checked(endpoint, raw(&value).as_bytes())?;
        let mut fields: Vec<(String, String)> = Vec::new();
        if let Some(m) = &model {
            fields.push(("model".into(), raw(&Value::from(m.as_str()))));
        }
        for (k, v) in &typed {
            // A repeated key is rejected before anything else is looked at: keep one.
            if !fields.iter().any(|(f, _)| f == k) {
                fields.push((k.to_string(), raw(v)));
            }
        }
        parse_checked(endpoint, object(&fields, "").as_bytes())?;
    }

    /// The warm node's bonus shrinks as its queue grows, never past the weight; no other
    /// warmth earns more.
    #[test]
    fn session_affinity_shrinks_with_depth(w in weights(), d1 in any::<u32>(), d2 in any::<u32>()) {
        let (lo, hi) = (d1.min(d2), d1.max(d2));
        let (lo, hi) = (f64::from(lo), f64::from(hi));
        let near = signals::session_affinity(Warmth::HoldsPrefix, lo, &w);
        let far = signals::session_affinity(Warmth::HoldsPrefix, hi, &w);
        prop_assert!(far <= near);
        prop_assert!(near <= w.session_affinity && far >= 0.0);
        prop_assert_eq!(signals::session_affinity(Warmth::HoldsPrefix, 0.0, &w), w.session_affinity);
        // At the same depth, holding the prefix earns at least as much as any other warmth.
        for warmth in [Warmth::WouldDisplace, Warmth::Free] {
            prop_assert!(signals::session_affinity(warmth, lo, &w) <= near);
        }
    }

    /// Every request on the node costs the same.
    #[test]
    fn queue_depth_is_linear(w in weights(), a in 0..1_000_000u32, b in 0..1_000_000u32) {
        let q = |d: u32| signals::queue_depth(f64::from(d), &w);
        prop_assert_eq!(q(0), 0.0);
        prop_assert!(close(q(a + b), q(a) + q(b)), "{} vs {}", q(a + b), q(a) + q(b));
        prop_assert!(close(q(a), -w.queue_depth * f64::from(a)));
        prop_assert!(q(a.max(b)) <= q(a.min(b)));
    }

    /// Full marks when resident; ruled out exactly when the model is larger than the node;
    /// never above the weight; any fit in free memory above any load that must evict; and
    /// among loads that must evict, no better with less free memory or a larger model.
    /// (Among fits in free memory the snugger one is better: best fit.)
    #[test]
    fn memory_fit_bounds(
        w in weights(),
        resident in any::<bool>(),
        need in prop::option::of(0..2_000_000_000_000u64),
        total in prop::option::of(0..2_000_000_000_000u64),
        used in 0..3_000_000_000_000u64,
        more_used in 0..1_000_000_000_000u64,
        more_need in 0..1_000_000_000_000u64,
    ) {
        let fit = |need, used| signals::memory_fit(resident, Memory { need, total, used }, &w);
        let got = fit(need, used);
        if resident {
            prop_assert_eq!(got, Some(w.memory_fit));
            return Ok(());
        }
        match (need, total) {
            (Some(n), Some(t)) => prop_assert_eq!(got.is_none(), n > t),
            _ => prop_assert!(got.is_some()),
        }
        if let Some(v) = got {
            prop_assert!((0.0..=w.memory_fit).contains(&v), "{v}");
            let fuller = fit(need, used + more_used).expect("more use rules nothing out");
            let Some((n, t)) = need.zip(total) else {
                prop_assert!(close(v, w.memory_fit / 2.0), "unknown: {v}");
                return Ok(());
            };
            let tolerance = 1e-9 * w.memory_fit.max(1.0);
            if n <= t.saturating_sub(used) {
                prop_assert!(v >= 0.75 * w.memory_fit - tolerance, "fits, yet {v}");
            } else {
                prop_assert!(v <= 0.25 * w.memory_fit + tolerance, "evicts, yet {v}");
                prop_assert!(fuller <= v, "{fuller} > {v} with more memory used");
                if let Some(b) = fit(Some(n + more_need), used) {
                    prop_assert!(b <= v, "{b} > {v} for a larger model");
                }
            }
        }
    }

    /// A bounded penalty, zero for the fleet's best, and no smaller for a slower node.
    #[test]
    fn latency_penalty_bounds(
        w in weights(),
        prefill in prop::option::of(prop_oneof![1e-3..1e6f64, Just(0.0), Just(-1.0)]),
        decode in prop::option::of(prop_oneof![1e-3..1e6f64, Just(0.0), Just(-1.0)]),
        best_prefill in prop::option::of(1e-3..1e6f64),
        best_decode in prop::option::of(1e-3..1e6f64),
        slower in 1.0..1e6f64,
    ) {
        let best = Speed { prefill: best_prefill, decode: best_decode };
        let node = Speed { prefill, decode };
        let p = signals::latency(node, best, &w);
        prop_assert!((-w.latency..=0.0).contains(&p), "{p}");
        prop_assert_eq!(signals::latency(best, best, &w), 0.0);
        let slow = |s: Option<f64>| s.map(|v| if v > 0.0 { v / slower } else { v });
        let worse = signals::latency(
            Speed { prefill: slow(prefill), decode: slow(decode) },
            best,
            &w,
        );
        prop_assert!(worse <= p, "{worse} > {p} for a node {slower}x slower");
    }

    /// Between twice the weight as a penalty and the weight as a bonus; no better for a
    /// longer prompt.
    #[test]
    fn context_fit_bounds(
        w in weights(),
        tokens in any::<u32>(),
        more in any::<u32>(),
        requested in prop::option::of(prop_oneof![Just(0u32), 1..262_144u32, Just(u32::MAX)]),
        loaded in prop::option::of(prop_oneof![Just(0u32), 1..262_144u32, Just(u32::MAX)]),
    ) {
        let fit = |t| signals::context_fit(t, requested, loaded, &w);
        let v = fit(tokens);
        prop_assert!((-2.0 * w.context_fit..=w.context_fit).contains(&v), "{v}");
        prop_assert!(fit(tokens.saturating_add(more)) <= v);
    }

    /// Between nothing and the weight, rising with the success ratio.
    #[test]
    fn availability_bounds(
        w in weights(),
        a in prop_oneof![any::<f64>(), -1.0..2.0f64].prop_filter("a ratio", |r| !r.is_nan()),
        b in prop_oneof![any::<f64>(), -1.0..2.0f64].prop_filter("a ratio", |r| !r.is_nan()),
    ) {
        let va = signals::availability(a, &w);
        let vb = signals::availability(b, &w);
        prop_assert!((0.0..=w.availability).contains(&va), "{va}");
        if a <= b {
            prop_assert!(va <= vb);
        }
    }

    /// The ranking depends on the candidates alone, not on the order they come in; higher
    /// totals come first; nothing is lost or duplicated.
    #[test]
    fn rank_is_a_total_deterministic_order(
        candidates in prop::collection::hash_map(
            "[a-z0-9.-]{1,8}",
            prop_oneof![
                // Few distinct totals, so that ties are common.
                3 => prop::sample::select(vec![0.0, -0.0, 7.3, 20.0, -12.5, 70.0]),
                1 => any::<f64>(),
            ],
            1..8,
        ),
        conversation in any::<u64>(),
        keys in prop::collection::vec(any::<u32>(), 8),
    ) {
        let input: Vec<(String, f64)> = candidates.into_iter().collect();
        let mut one = input.clone();
        let mut two = permute(input.clone(), &keys);
        two.reverse();
        score::rank(&mut one, |c| (c.1, c.0.as_str()), conversation);
        score::rank(&mut two, |c| (c.1, c.0.as_str()), conversation);
        let names = |v: &[(String, f64)]| v.iter().map(|c| c.0.clone()).collect::<Vec<_>>();
        prop_assert_eq!(names(&one), names(&two));
        for pair in one.windows(2) {
            prop_assert!(pair[0].1.total_cmp(&pair[1].1).is_ge(), "{pair:?}");
            if !pair[0].1.is_nan() && !pair[1].1.is_nan() {
                prop_assert!(pair[0].1 >= pair[1].1, "{pair:?}");
            }
        }
        let mut sorted_in = names(&input);
        let mut sorted_out = names(&one);
        sorted_in.sort();
        sorted_out.sort();
        prop_assert_eq!(sorted_in, sorted_out);
    }
}

#[test]
fn prompt_block_size() {
    assert_eq!(prompt_chain("m", None, &[b'x'; PROMPT_BLOCK]).depth(), 1);
    assert_eq!(
        prompt_chain("m", None, &[b'x'; PROMPT_BLOCK + 1]).depth(),
        2
    );
}

/// 100,000 levels of nesting in every position of every endpoint's body: an error where
/// `parse` expects a typed field (`typed`: checked for arrays, since a nested object can be
/// an unknown field of a typed one), skipped without recursion where it keeps the raw text
/// or ignores the field; in every case quickly and on a small stack.
#[test]
fn deep_nesting_returns_quickly_on_a_small_stack() {
    const LEVELS: usize = 100_000;
    let arrays = format!("{}{}", "[".repeat(LEVELS), "]".repeat(LEVELS));
    let objects = format!("{}1{}", r#"{"a":"#.repeat(LEVELS), "}".repeat(LEVELS));
    let unclosed = "[".repeat(LEVELS);
    // Where the nesting goes, how to put it there, and whether parse must reject it.
    type Position = (&'static str, fn(&str) -> String, bool);
    let positions: [Position; 9] = [
        ("top level", |d| d.to_string(), true),
        ("model", |d| format!(r#"{{"model":{d}}}"#), true),
        (
            "options",
            |d| format!(r#"{{"model":"m","options":{d}}}"#),
            true,
        ),
        (
            "messages",
            |d| format!(r#"{{"model":"m","messages":{d}}}"#),
            true,
        ),
        (
            "images",
            |d| format!(r#"{{"model":"m","images":[{d}]}}"#),
            false,
        ),
        (
            "content",
            |d| format!(r#"{{"model":"m","messages":[{{"role":"user","content":{d}}}]}}"#),
            false,
        ),
        (
            "prompt",
            |d| format!(r#"{{"model":"m","prompt":{d}}}"#),
            false,
        ),
        (
            "input",
            |d| format!(r#"{{"model":"m","input":{d}}}"#),
            false,
        ),
        (
            "unknown",
            |d| format!(r#"{{"model":"m","keep":{d}}}"#),
            false,
        ),
    ];
    let start = Instant::now();
    std::thread::Builder::new()
        .stack_size(1 << 20)
        .spawn(move || {
            for (name, wrap, typed) in positions {
                for (shape, nest) in [("arrays", &arrays), ("objects", &objects)] {
                    let body = wrap(nest);
                    for endpoint in ENDPOINTS {
                        let got = Profile::parse(endpoint, body.as_bytes());
                        if typed && shape == "arrays" {
                            assert!(got.is_err(), "{name} {shape} {endpoint:?}");
                        }
                    }
                }
                let body = wrap(&unclosed);
                for endpoint in ENDPOINTS {
                    assert!(
                        matches!(
                            Profile::parse(endpoint, body.as_bytes()),
                            Err(ProfileError::Invalid(_))
                        ),
                        "{name} unclosed {endpoint:?}"
                    );
                }
            }
        })
        .expect("spawn")
        .join()
        .expect("no panic, no stack overflow");
    // Generous for a debug build on a busy machine: the point is "not quadratic".
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "{:?}",
        start.elapsed()
    );
}
