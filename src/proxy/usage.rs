//! Token counts of a finished reply, for usage per client: read from each API's own usage
//! object, in the last JSON objects of the reply (its final chunk, or the event that
//! carries the usage, which in Anthropic's stream comes just before `message_stop`).
//!
//! - Ollama: `prompt_eval_count`, `eval_count` (cached tokens are not reported).
//! - OpenAI chat, completions and embeddings: `usage.prompt_tokens`,
//!   `usage.completion_tokens`, `usage.prompt_tokens_details.cached_tokens`.
//! - OpenAI Responses: `usage` (or `response.usage` in `response.completed`):
//!   `input_tokens`, `output_tokens`, `input_tokens_details.cached_tokens`.
//! - Anthropic Messages: `usage` (or `message.usage` in `message_start`):
//!   `input_tokens` + `cache_read_input_tokens`, `output_tokens`.
//! - llama.cpp: `timings.prompt_n` + `timings.cache_n`, `timings.predicted_n`.

use serde::Deserialize;
use serde::de::{Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

use crate::fleet::reply::{ReplyStats, Tail, objects_from_the_end};

/// How many JSON objects from the end are looked at: usage is in the last two of every API.
const LOOK_BACK: usize = 8;

/// A reply's tokens. `prompt` counts every prompt token, cached or not.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TokenUsage {
    pub prompt: u64,
    pub cached: Option<u64>,
    pub completion: u64,
}

/// The usage in the last JSON objects of a reply's tail (NDJSON lines, SSE `data:` lines,
/// or one JSON body). Lines that do not parse, such as one cut by the tail, are skipped.
pub fn find(tail: &[u8]) -> Option<TokenUsage> {
    objects_from_the_end(tail)
        .take(LOOK_BACK)
        .find_map(|l| sparse_object(l).ok().and_then(|m| m.usage()))
}

/// [`find`] past the last object, which the caller has read already (as [`LastObject`]).
pub fn find_before_last(tail: &[u8]) -> Option<TokenUsage> {
    objects_from_the_end(tail)
        .skip(1)
        .take(LOOK_BACK - 1)
        .find_map(|l| sparse_object(l).ok().and_then(|m| m.usage()))
}

/// What a finished reply's tail shows: the statistics of its last object (as
/// `ReplyStats::parse` reads them) and, when `with_usage`, its usage (as [`find`] reads it),
/// with the last object parsed once for both where that gives the same answers.
pub fn final_figures(tail: &Tail, with_usage: bool) -> (Option<ReplyStats>, Option<TokenUsage>) {
    let last = tail.last_object();
    let parsed = last.and_then(LastObject::parse);
    let stats = match parsed.as_ref().and_then(LastObject::stats) {
        Some(stats) => stats,
        None => last.and_then(ReplyStats::parse),
    };
    if !with_usage {
        return (stats, None);
    }
    // `last` is the first object `find` would look at.
    let usage = match (last, &parsed) {
        (None, _) => find(tail.bytes()),
        (Some(_), Some(parsed)) => parsed.usage().or_else(|| find_before_last(tail.bytes())),
        (Some(_), None) => find_before_last(tail.bytes()),
    };
    (stats, usage)
}

/// A reply's last object, parsed once for both its usage and its statistics: parsing it
/// twice (here and as [`ReplyStats`]) was about 4% of corral's CPU per request at 1 KiB
/// (issue 13).
pub struct LastObject(Members);

impl LastObject {
    /// `None` where [`find`] would skip the object: it does not parse.
    pub fn parse(text: &[u8]) -> Option<LastObject> {
        sparse_object(text).ok().map(LastObject)
    }

    /// The usage the object reports, as [`find`] reads it.
    pub fn usage(&self) -> Option<TokenUsage> {
        self.0.usage()
    }

    /// The statistics, exactly as `ReplyStats::parse` reads the same text, where this parse
    /// can tell: a text it accepted is valid JSON, so a typed parse differs only by refusing
    /// a repeated field, at the top (known here) or inside `usage` or `timings` (not
    /// tracked: those objects, from OpenAI-style and llama.cpp nodes, are left to the typed
    /// parse). `None` when it cannot tell.
    pub fn stats(&self) -> Option<Option<ReplyStats>> {
        let members = &self.0;
        let nested = [USAGE, TIMINGS]
            .iter()
            .any(|k| members.get(*k).is_some_and(|v| !v.is_null()));
        if members.repeated || nested {
            return None;
        }
        // What deserializing `ReplyStats` from these members as a `Value` object gives: each
        // count absent or null is `None`, a whole number that fits a u64 is itself, anything
        // else fails the whole (`usage` and `timings` are null or absent here).
        let count = |at: usize| match members.get(at) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v.as_u64().map(Some).ok_or(()),
        };
        let stats = || -> Result<ReplyStats, ()> {
            Ok(ReplyStats {
                load_duration: count(LOAD_DURATION)?,
                prompt_eval_count: count(PROMPT_EVAL_COUNT)?,
                prompt_eval_duration: count(PROMPT_EVAL_DURATION)?,
                eval_count: count(EVAL_COUNT)?,
                eval_duration: count(EVAL_DURATION)?,
                usage: None,
                timings: None,
            })
        };
        Some(stats().ok())
    }
}

/// The members of a reply object that [`of`] reads, and their places in [`Members`].
const READ_KEYS: [&str; 8] = [
    "usage",
    "response",
    "timings",
    "prompt_eval_count",
    "eval_count",
    // Read by ReplyStats (see LastObject::stats).
    "load_duration",
    "prompt_eval_duration",
    "eval_duration",
];
const USAGE: usize = 0;
const RESPONSE: usize = 1;
const TIMINGS: usize = 2;
const PROMPT_EVAL_COUNT: usize = 3;
const EVAL_COUNT: usize = 4;
const LOAD_DURATION: usize = 5;
const PROMPT_EVAL_DURATION: usize = 6;
const EVAL_DURATION: usize = 7;

/// Parses a JSON object as `serde_json::from_slice::<Value>` does (the same texts accepted,
/// the same refused, a repeated member's last value kept), but builds only the members that
/// [`of`] reads: the others (a reply's text, a Responses event's output...) are checked and
/// dropped. A final chunk is parsed once per reply, and building all of it was the costly
/// part.
fn sparse_object(text: &[u8]) -> serde_json::Result<Members> {
    // serde_json checks each string of a byte slice for UTF-8 apart, which for the dozen
    // short strings of a final chunk cost more than checking the whole text once (issue 13).
    // Outside its strings JSON is ASCII, so a text that is not UTF-8 fails either way.
    match simdutf8::basic::from_utf8(text) {
        Ok(text) => serde_json::from_str::<Members>(text),
        Err(_) => serde_json::from_slice::<Members>(text),
    }
}

/// The members of an object that [`READ_KEYS`] names, each in its place there: a fixed
/// array rather than a map, so that parsing a reply's last object allocates no key and
/// reading a member compares no string (issue 13).
struct Members {
    values: [Option<Value>; READ_KEYS.len()],
    /// A member that [`READ_KEYS`] names came twice (the last one is kept, as a `Value` keeps
    /// it).
    repeated: bool,
}

impl Members {
    fn get(&self, at: usize) -> Option<&Value> {
        self.values[at].as_ref()
    }

    /// The usage the object reports, as [`of`] reads it from the whole object.
    fn usage(&self) -> Option<TokenUsage> {
        usage_of(|at| self.get(at))
    }
}

impl<'de> Deserialize<'de> for Members {
    fn deserialize<D: Deserializer<'de>>(de: D) -> Result<Members, D::Error> {
        struct Object;
        impl<'de> Visitor<'de> for Object {
            type Value = Members;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Members, A::Error> {
                let mut members = Members {
                    values: Default::default(),
                    repeated: false,
                };
                while let Some(key) = map.next_key::<Key>()? {
                    match key.0 {
                        Some(at) => {
                            let value = map.next_value::<Value>()?;
                            members.repeated |= members.values[at].replace(value).is_some();
                        }
                        None => {
                            map.next_value::<Checked>()?;
                        }
                    }
                }
                Ok(members)
            }
        }
        de.deserialize_any(Object)
    }
}

/// The place in [`READ_KEYS`] of `key`. A match compares a key's length before its bytes,
/// and most keys of a reply are none of these.
fn key_place(key: &str) -> Option<usize> {
    match key {
        "usage" => Some(USAGE),
        "response" => Some(RESPONSE),
        "timings" => Some(TIMINGS),
        "prompt_eval_count" => Some(PROMPT_EVAL_COUNT),
        "eval_count" => Some(EVAL_COUNT),
        "load_duration" => Some(LOAD_DURATION),
        "prompt_eval_duration" => Some(PROMPT_EVAL_DURATION),
        "eval_duration" => Some(EVAL_DURATION),
        _ => None,
    }
}

/// An object key: the place in [`READ_KEYS`] of the key it is, if any. Read without
/// allocating, checked as a `String` key is.
struct Key(Option<usize>);

impl<'de> Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(de: D) -> Result<Key, D::Error> {
        struct Name;
        impl<'de> Visitor<'de> for Name {
            type Value = Key;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string key")
            }
            fn visit_str<E: serde::de::Error>(self, key: &str) -> Result<Key, E> {
                Ok(Key(key_place(key)))
            }
        }
        de.deserialize_str(Name)
    }
}

/// Any JSON value, checked as building a `Value` would check it (strings as UTF-8 with valid
/// escapes, the nesting limit), and dropped.
struct Checked;

impl<'de> Deserialize<'de> for Checked {
    fn deserialize<D: Deserializer<'de>>(de: D) -> Result<Checked, D::Error> {
        struct Any;
        impl<'de> Visitor<'de> for Any {
            type Value = Checked;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_bool<E>(self, _: bool) -> Result<Checked, E> {
                Ok(Checked)
            }
            fn visit_i64<E>(self, _: i64) -> Result<Checked, E> {
                Ok(Checked)
            }
            fn visit_u64<E>(self, _: u64) -> Result<Checked, E> {
                Ok(Checked)
            }
            fn visit_f64<E>(self, _: f64) -> Result<Checked, E> {
                Ok(Checked)
            }
            fn visit_str<E>(self, _: &str) -> Result<Checked, E> {
                Ok(Checked)
            }
            fn visit_unit<E>(self) -> Result<Checked, E> {
                Ok(Checked)
            }
            fn visit_none<E>(self) -> Result<Checked, E> {
                Ok(Checked)
            }
            fn visit_some<D: Deserializer<'de>>(self, de: D) -> Result<Checked, D::Error> {
                Checked::deserialize(de)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Checked, A::Error> {
                while seq.next_element::<Checked>()?.is_some() {}
                Ok(Checked)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Checked, A::Error> {
                while map.next_entry::<Checked, Checked>()?.is_some() {}
                Ok(Checked)
            }
        }
        de.deserialize_any(Any)
    }
}

/// The usage one JSON object reports, if it reports any.
#[cfg(test)]
pub fn of(v: &Value) -> Option<TokenUsage> {
    usage_of(|at| v.get(READ_KEYS[at]))
}

/// [`of`] the object whose member named `READ_KEYS[at]` is `member(at)`.
fn usage_of<'v>(member: impl Fn(usize) -> Option<&'v Value>) -> Option<TokenUsage> {
    let count = |v: &Value, key: &str| v.get(key).and_then(Value::as_u64);
    for usage in [member(USAGE), member(RESPONSE).and_then(|r| r.get("usage"))]
        .into_iter()
        .flatten()
    {
        if let Some(prompt) = count(usage, "prompt_tokens") {
            let cached = usage
                .get("prompt_tokens_details")
                .and_then(|d| count(d, "cached_tokens"));
            let completion = count(usage, "completion_tokens").unwrap_or(0);
            return Some(TokenUsage {
                prompt,
                cached,
                completion,
            });
        }
        if let Some(input) = count(usage, "input_tokens") {
            let details = usage
                .get("input_tokens_details")
                .and_then(|d| count(d, "cached_tokens"));
            // Anthropic counts cache reads apart from input_tokens.
            let cache_read = count(usage, "cache_read_input_tokens");
            let prompt = input + cache_read.unwrap_or(0);
            return Some(TokenUsage {
                prompt,
                cached: details.or(cache_read),
                completion: count(usage, "output_tokens").unwrap_or(0),
            });
        }
    }
    if let Some(timings) = member(TIMINGS)
        && let Some(evaluated) = count(timings, "prompt_n")
    {
        let cached = count(timings, "cache_n");
        return Some(TokenUsage {
            prompt: evaluated + cached.unwrap_or(0),
            cached,
            completion: count(timings, "predicted_n").unwrap_or(0),
        });
    }
    let prompt = member(PROMPT_EVAL_COUNT).and_then(Value::as_u64)?;
    Some(TokenUsage {
        prompt,
        cached: None,
        completion: member(EVAL_COUNT).and_then(Value::as_u64).unwrap_or(0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage(text: &str) -> Option<TokenUsage> {
        find(text.as_bytes())
    }

    #[test]
    fn every_read_key_has_its_own_place() {
        for (at, key) in READ_KEYS.iter().enumerate() {
            assert_eq!(key_place(key), Some(at), "{key}");
        }
        assert_eq!(key_place("message"), None);
        assert_eq!(key_place("Usage"), None);
    }

    #[test]
    fn ollama_final_chunk() {
        let u =
            usage("{\"done\":false}\n{\"done\":true,\"prompt_eval_count\":12,\"eval_count\":3}\n");
        assert_eq!(
            u,
            Some(TokenUsage {
                prompt: 12,
                cached: None,
                completion: 3
            })
        );
    }

    #[test]
    fn openai_stream_usage_before_done() {
        let u = usage(
            "data: {\"choices\":[]}\n\ndata: {\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":7}}}\n\ndata: [DONE]\n\n",
        );
        assert_eq!(
            u,
            Some(TokenUsage {
                prompt: 9,
                cached: Some(7),
                completion: 2
            })
        );
    }

    #[test]
    fn responses_completed_event() {
        let u = usage(
            "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"usage\":{\"input_tokens\":20,\"output_tokens\":5,\"input_tokens_details\":{\"cached_tokens\":16}}}}\n\n",
        );
        assert_eq!(
            u,
            Some(TokenUsage {
                prompt: 20,
                cached: Some(16),
                completion: 5
            })
        );
    }

    #[test]
    fn anthropic_message_delta_before_stop() {
        let u = usage(
            "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"input_tokens\":11,\"output_tokens\":4}}\n\nevent: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
        );
        assert_eq!(
            u,
            Some(TokenUsage {
                prompt: 11,
                cached: None,
                completion: 4
            })
        );
        let whole = usage(
            "{\"usage\":{\"input_tokens\":2,\"cache_read_input_tokens\":8,\"output_tokens\":1}}",
        );
        assert_eq!(
            whole,
            Some(TokenUsage {
                prompt: 10,
                cached: Some(8),
                completion: 1
            })
        );
    }

    #[test]
    fn llama_cpp_timings_and_nothing() {
        let u = usage("{\"timings\":{\"prompt_n\":3,\"cache_n\":90,\"predicted_n\":7}}");
        assert_eq!(
            u,
            Some(TokenUsage {
                prompt: 93,
                cached: Some(90),
                completion: 7
            })
        );
        assert_eq!(usage("data: {\"choices\":[]}\n\ndata: [DONE]\n\n"), None);
        assert_eq!(usage("{\"usage\":{\"prompt_tok"), None);
    }

    /// What `find` read before objects were parsed sparsely: the whole object as a `Value`.
    fn find_by_value(tail: &[u8]) -> Option<TokenUsage> {
        tail.split(|b| *b == b'\n')
            .map(<[u8]>::trim_ascii)
            .map(|l| l.strip_prefix(b"data:").map_or(l, <[u8]>::trim_ascii))
            .filter(|l| l.first() == Some(&b'{'))
            .rev()
            .take(LOOK_BACK)
            .filter_map(|l| serde_json::from_slice::<Value>(l).ok())
            .find_map(|v| of(&v))
    }

    #[test]
    fn sparse_parse_accepts_and_refuses_what_value_does() {
        let deep = format!(
            r#"{{"x":{}1{},"prompt_eval_count":1}}"#,
            "[".repeat(200),
            "]".repeat(200)
        );
        let cases: Vec<Vec<u8>> = vec![
            br#"{"prompt_eval_count":1,"message":{"content":"\ud800"}}"#.to_vec(),
            b"{\"prompt_eval_count\":1,\"message\":\"\xff\"}".to_vec(),
            br#"{"prompt_eval_count":1,"message":"\q"}"#.to_vec(),
            br#"{"prompt_eval_count":1,"message":"a\u00e9\n"}"#.to_vec(),
            br#"{"prompt_eval_count":1} x"#.to_vec(),
            br#"{"prompt_eval_count":1,"prompt_eval_count":7,"eval_count":2}"#.to_vec(),
            br#"{"usage":{"prompt_tokens":3},"usage":5,"prompt_eval_count":4}"#.to_vec(),
            br#"{"prompt_eval_count":-1,"eval_count":2.5}"#.to_vec(),
            br#"{"prompt_eval_count":18446744073709551616}"#.to_vec(),
            br#"{"prompt\u005feval_count":9}"#.to_vec(),
            br#"{"a":[1,{"b":null,"c":[true,false]}],"timings":{"prompt_n":2}}"#.to_vec(),
            deep.into_bytes(),
        ];
        for case in &cases {
            let text = String::from_utf8_lossy(case);
            let whole = serde_json::from_slice::<Value>(case);
            let sparse = sparse_object(case);
            assert_eq!(whole.is_ok(), sparse.is_ok(), "{text}");
            assert_eq!(
                whole.ok().and_then(|v| of(&v)),
                sparse.ok().and_then(|m| m.usage()),
                "{text}"
            );
        }
    }

    proptest::proptest! {
        /// Over replies built from the fields every API uses, valid or broken, sparse parsing
        /// finds the usage that parsing whole objects found.
        #[test]
        fn sparse_find_matches_value_find(pieces in proptest::collection::vec(0usize..PIECES.len(), 0..40)) {
            let tail: String = pieces.iter().map(|i| PIECES[*i]).collect();
            proptest::prop_assert_eq!(find(tail.as_bytes()), find_by_value(tail.as_bytes()));
        }

        /// Parsing the last object once reads the statistics and usage that parsing it twice
        /// (typed, then sparse) read, whole or cut by a small tail.
        #[test]
        fn final_figures_match_two_parses(
            pieces in proptest::collection::vec(0usize..PIECES.len(), 0..40),
            cap in proptest::sample::select(vec![8usize, 64, 4096]),
        ) {
            let mut tail = Tail::new(cap);
            for i in &pieces {
                tail.push(PIECES[*i].as_bytes());
            }
            let two = (
                tail.last_object().and_then(ReplyStats::parse),
                find(tail.bytes()),
            );
            proptest::prop_assert_eq!(final_figures(&tail, true), two);
        }
    }

    const PIECES: &[&str] = &[
        "\n",
        "data: ",
        "{",
        "}",
        ",",
        ":",
        "[",
        "]",
        "\"usage\":",
        "\"response\":",
        "\"timings\":",
        "\"prompt_eval_count\":",
        "\"eval_count\":",
        "\"prompt_tokens\":",
        "\"completion_tokens\":",
        "\"prompt_tokens_details\":",
        "\"cached_tokens\":",
        "\"input_tokens\":",
        "\"output_tokens\":",
        "\"cache_read_input_tokens\":",
        "\"input_tokens_details\":",
        "\"prompt_n\":",
        "\"cache_n\":",
        "\"predicted_n\":",
        "\"load_duration\":",
        "\"prompt_eval_duration\":",
        "\"eval_duration\":",
        "{\"load_duration\":200000000,\"prompt_eval_count\":26,\"eval_count\":9,\"eval_duration\":700}",
        "\"message\":",
        "\"content\":",
        "\"text \\u00e9\\n\"",
        "\"\\ud800\"",
        "12",
        "-3",
        "4.5",
        "null",
        "true",
        "\"x\"",
        "{\"prompt_eval_count\":5,\"eval_count\":2}",
        "{\"usage\":{\"prompt_tokens\":9,\"prompt_tokens_details\":{\"cached_tokens\":7}}}",
        "{\"type\":\"response.completed\",\"response\":{\"usage\":{\"input_tokens\":20}}}",
        "{\"timings\":{\"prompt_n\":3,\"cache_n\":90}}",
        "[DONE]",
    ];

    /// The statistics read from the shared parse are the typed parse's, wherever it answers;
    /// and the usage is `find`'s.
    #[test]
    fn one_parse_reads_what_two_did() {
        let cases: &[&str] = &[
            r#"{"model":"m","done":true,"load_duration":200000000,"prompt_eval_count":26,"prompt_eval_duration":200000,"eval_count":9,"eval_duration":700000}"#,
            r#"{"prompt_eval_count":1,"prompt_eval_count":2}"#,
            r#"{"eval_count":1.5}"#,
            r#"{"eval_count":-1,"prompt_eval_count":3}"#,
            r#"{"load_duration":"slow","prompt_eval_count":3}"#,
            r#"{"usage":{"prompt_tokens":9,"prompt_tokens":10}}"#,
            r#"{"usage":{"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":7}}}"#,
            r#"{"timings":{"prompt_n":2,"cache_n":5,"predicted_per_second":10}}"#,
            r#"{"usage":null,"timings":null,"eval_count":4,"eval_duration":1000}"#,
            r#"{"message":{"content":"\u00e9 \"quoted\""},"prompt_eval_count":5}"#,
            r#"{"type":"response.completed","response":{"usage":{"input_tokens":20}}}"#,
            r#"{"x":[1,{"y":null}],"done":true}"#,
        ];
        for case in cases {
            let last = LastObject::parse(case.as_bytes()).expect(case);
            if let Some(stats) = last.stats() {
                assert_eq!(stats, ReplyStats::parse(case.as_bytes()), "{case}");
            }
            assert_eq!(last.usage(), find(case.as_bytes()), "{case}");
        }
        let repeated = LastObject::parse(cases[1].as_bytes()).unwrap();
        assert!(
            repeated.stats().is_none(),
            "a repeated field goes to the typed parse"
        );
        let ollama = LastObject::parse(cases[0].as_bytes()).unwrap();
        assert!(
            ollama.stats().is_some_and(|s| s.is_some()),
            "Ollama's final chunk is read once"
        );
    }

    #[test]
    fn usage_before_the_last_object() {
        let tail =
            b"data: {\"usage\":{\"prompt_tokens\":9}}\n\ndata: {\"type\":\"message_stop\"}\n\n";
        assert_eq!(find_before_last(tail), find(tail));
        assert_eq!(find_before_last(b"{\"prompt_eval_count\":1}"), None);
    }
}
