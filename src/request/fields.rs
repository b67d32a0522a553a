//! The fields of a request body that a profile reads, found in one pass.
//!
//! serde_json reads a body byte by byte in places and scans its strings eight bytes at a
//! time; at 128 KiB that scan was most of corral's own cost per request (issue 13). So the
//! usual body, an object with the fields below and strings of any content, is read by
//! [`fast`], a strict reader for that shape whose string scan finds a string's end with SIMD
//! search ([`plain_run`]), and anything it is not sure about (escapes
//! in a key, the model or a role, a number it would have to convert, a repeated field, a
//! struct written as a list, invalid JSON...) goes to serde_json as before. [`fast`] only
//! answers for bodies that serde_json accepts with the same fields: it is at least as
//! strict (it also wants the whole body UTF-8, and nesting no deeper than
//! [`MAX_DEPTH`]), and the tests compare the two readers over generated bodies.

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;

/// What [`super::profile`] reads from a body. A raw field is the value's JSON text, as
/// `RawValue::get` gives it (a string keeps its quotes and escapes); JSON `null` reads as
/// absent, as serde reads an `Option`.
#[derive(Debug, Default, PartialEq)]
pub(super) struct Fields<'a> {
    pub model: Option<Cow<'a, str>>,
    /// `/api/show` still accepts the older `name`.
    pub name: Option<Cow<'a, str>>,
    pub stream: Option<bool>,
    /// `options.num_ctx`.
    pub num_ctx: Option<u32>,
    pub messages: Option<Vec<MessageFields<'a>>>,
    pub prompt: Option<&'a str>,
    pub system: Option<&'a str>,
    /// How many items the top-level `images` list has.
    pub images: Option<usize>,
    pub input: Option<&'a str>,
    /// Responses API: a system message ahead of `input`.
    pub instructions: Option<&'a str>,
    /// OpenAI's cache routing hint (chat completions and Responses).
    pub prompt_cache_key: Option<&'a str>,
    /// Anthropic's `metadata.user_id`; other APIs use `metadata` for other things.
    pub metadata: Option<&'a str>,
}

#[derive(Debug, PartialEq)]
pub(super) struct MessageFields<'a> {
    pub role: Cow<'a, str>,
    pub content: Option<&'a str>,
    pub images: Option<Vec<&'a str>>,
    pub tool_calls: Option<&'a str>,
}

/// Reads the fields, the fast way when it can; the error is serde_json's.
pub(super) fn read(body: &[u8]) -> Result<Fields<'_>, serde_json::Error> {
    match fast(body) {
        Some(fields) => Ok(fields),
        None => serde_json::from_slice::<Body>(body).map(Body::into_fields),
    }
}

// --- serde_json: every body -------------------------------------------------------------

/// The fields of interest across all routed endpoints; the rest of the body is skipped.
/// Strings borrow from the body when they have no escapes.
#[derive(Deserialize)]
struct Body<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    name: Option<Cow<'a, str>>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    options: Option<Options>,
    #[serde(borrow, default)]
    messages: Option<Vec<Message<'a>>>,
    #[serde(borrow, default)]
    prompt: Option<&'a RawValue>,
    #[serde(borrow, default)]
    system: Option<&'a RawValue>,
    #[serde(borrow, default)]
    images: Option<Vec<&'a RawValue>>,
    #[serde(borrow, default)]
    input: Option<&'a RawValue>,
    #[serde(borrow, default)]
    instructions: Option<&'a RawValue>,
    #[serde(borrow, default)]
    prompt_cache_key: Option<&'a RawValue>,
    #[serde(borrow, default)]
    metadata: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Options {
    #[serde(default)]
    num_ctx: Option<u32>,
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow)]
    role: Cow<'a, str>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
    #[serde(borrow, default)]
    images: Option<Vec<&'a RawValue>>,
    #[serde(borrow, default)]
    tool_calls: Option<&'a RawValue>,
}

impl<'a> Body<'a> {
    fn into_fields(self) -> Fields<'a> {
        let raw = |v: Option<&'a RawValue>| v.map(RawValue::get);
        Fields {
            model: self.model,
            name: self.name,
            stream: self.stream,
            num_ctx: self.options.and_then(|o| o.num_ctx),
            messages: self.messages.map(|messages| {
                messages
                    .into_iter()
                    .map(|m| MessageFields {
                        role: m.role,
                        content: raw(m.content),
                        images: m
                            .images
                            .map(|images| images.into_iter().map(RawValue::get).collect()),
                        tool_calls: raw(m.tool_calls),
                    })
                    .collect()
            }),
            prompt: raw(self.prompt),
            system: raw(self.system),
            images: self.images.map(|images| images.len()),
            input: raw(self.input),
            instructions: raw(self.instructions),
            prompt_cache_key: raw(self.prompt_cache_key),
            metadata: raw(self.metadata),
        }
    }
}

// --- the fast reader: the usual body ----------------------------------------------------

/// Nesting the fast reader follows; deeper bodies go to serde_json, whose limit is 128.
const MAX_DEPTH: usize = 64;

/// The fields of a body that is a JSON object of the usual shape, or `None` for serde_json
/// to read (or refuse) it.
fn fast(body: &[u8]) -> Option<Fields<'_>> {
    // serde_json checks only the strings it keeps; checking the whole body is stricter,
    // and lets every slice below be a `&str` without another check.
    let text = simdutf8::basic::from_utf8(body).ok()?;
    let mut r = Reader { text, at: 0 };
    let fields = r.body()?;
    r.ws();
    (r.at == text.len()).then_some(fields)
}

struct Reader<'a> {
    text: &'a str,
    at: usize,
}

/// Top-level fields, each at most once (serde refuses a repeated field).
#[derive(Clone, Copy)]
enum Field {
    Model,
    Name,
    Stream,
    Options,
    Messages,
    Prompt,
    System,
    Images,
    Input,
    Instructions,
    PromptCacheKey,
    Metadata,
}

impl Field {
    fn of(key: &str) -> Option<Field> {
        Some(match key {
            "model" => Field::Model,
            "name" => Field::Name,
            "stream" => Field::Stream,
            "options" => Field::Options,
            "messages" => Field::Messages,
            "prompt" => Field::Prompt,
            "system" => Field::System,
            "images" => Field::Images,
            "input" => Field::Input,
            "instructions" => Field::Instructions,
            "prompt_cache_key" => Field::PromptCacheKey,
            "metadata" => Field::Metadata,
            _ => return None,
        })
    }
}

impl<'a> Reader<'a> {
    fn bytes(&self) -> &'a [u8] {
        self.text.as_bytes()
    }

    fn peek(&self) -> Option<u8> {
        self.bytes().get(self.at).copied()
    }

    /// JSON's four whitespace bytes, as serde_json skips them.
    fn ws(&mut self) {
        while let Some(b' ' | b'\n' | b'\t' | b'\r') = self.peek() {
            self.at += 1;
        }
    }

    /// Skips whitespace and takes `byte` if it comes next.
    fn eat(&mut self, byte: u8) -> bool {
        self.ws();
        let next = self.peek() == Some(byte);
        self.at += usize::from(next);
        next
    }

    fn literal(&mut self, word: &str) -> Option<()> {
        let end = self.at.checked_add(word.len())?;
        (self.text.get(self.at..end)? == word).then(|| self.at = end)
    }

    /// Reads `{ "key": value, ... }`, handing each key to `member`, which reads the value.
    fn object(&mut self, mut member: impl FnMut(&mut Self, &'a str) -> Option<()>) -> Option<()> {
        if !self.eat(b'{') {
            return None;
        }
        if self.eat(b'}') {
            return Some(());
        }
        loop {
            self.ws();
            let key = self.plain_string()?;
            if !self.eat(b':') {
                return None;
            }
            self.ws();
            member(self, key)?;
            if self.eat(b'}') {
                return Some(());
            }
            if !self.eat(b',') {
                return None;
            }
        }
    }

    /// Reads `[ value, ... ]`, handing each item to `item`.
    fn array(&mut self, mut item: impl FnMut(&mut Self) -> Option<()>) -> Option<()> {
        if !self.eat(b'[') {
            return None;
        }
        if self.eat(b']') {
            return Some(());
        }
        loop {
            self.ws();
            item(self)?;
            if self.eat(b']') {
                return Some(());
            }
            if !self.eat(b',') {
                return None;
            }
        }
    }

    fn body(&mut self) -> Option<Fields<'a>> {
        let mut fields = Fields::default();
        let mut seen = 0u32;
        self.object(|r, key| {
            let Some(field) = Field::of(key) else {
                return r.skip(1);
            };
            let bit = 1 << field as u32;
            if seen & bit != 0 {
                return None;
            }
            seen |= bit;
            match field {
                Field::Model => fields.model = r.nullable(Self::plain_string)?.map(Cow::Borrowed),
                Field::Name => fields.name = r.nullable(Self::plain_string)?.map(Cow::Borrowed),
                Field::Stream => fields.stream = r.nullable(Self::boolean)?,
                Field::Options => {
                    fields.num_ctx = r.nullable(Self::options)?.flatten();
                }
                Field::Messages => fields.messages = r.nullable(Self::messages)?,
                Field::Prompt => fields.prompt = r.raw(1)?,
                Field::System => fields.system = r.raw(1)?,
                Field::Images => fields.images = r.nullable(|r| r.count_items(1))?,
                Field::Input => fields.input = r.raw(1)?,
                Field::Instructions => fields.instructions = r.raw(1)?,
                Field::PromptCacheKey => fields.prompt_cache_key = r.raw(1)?,
                Field::Metadata => fields.metadata = r.raw(1)?,
            }
            Some(())
        })?;
        Some(fields)
    }

    /// `null` as `None`, else what `read` reads.
    fn nullable<T>(&mut self, read: impl FnOnce(&mut Self) -> Option<T>) -> Option<Option<T>> {
        if self.peek() == Some(b'n') {
            self.literal("null")?;
            return Some(None);
        }
        read(self).map(Some)
    }

    fn boolean(&mut self) -> Option<bool> {
        match self.peek()? {
            b't' => self.literal("true").map(|()| true),
            b'f' => self.literal("false").map(|()| false),
            _ => None,
        }
    }

    /// `options`: its `num_ctx`, the rest skipped.
    fn options(&mut self) -> Option<Option<u32>> {
        let mut num_ctx = None;
        let mut seen = false;
        self.object(|r, key| {
            if key != "num_ctx" {
                return r.skip(2);
            }
            if std::mem::replace(&mut seen, true) {
                return None;
            }
            num_ctx = r.nullable(Self::small_integer)?;
            Some(())
        })?;
        Some(num_ctx)
    }

    /// A non-negative integer as JSON writes it (no sign, fraction or exponent, which serde
    /// would refuse or convert) that fits a `u32`.
    fn small_integer(&mut self) -> Option<u32> {
        let bytes = self.bytes();
        let start = self.at;
        let digits = bytes[start..]
            .iter()
            .take_while(|b| b.is_ascii_digit())
            .count();
        let end = start + digits;
        if digits == 0 || (digits > 1 && bytes[start] == b'0') {
            return None;
        }
        if matches!(bytes.get(end), Some(b'.' | b'e' | b'E')) {
            return None;
        }
        let value = self.text.get(start..end)?.parse().ok()?;
        self.at = end;
        Some(value)
    }

    fn messages(&mut self) -> Option<Vec<MessageFields<'a>>> {
        let mut messages = Vec::new();
        self.array(|r| {
            messages.push(r.message()?);
            Some(())
        })?;
        Some(messages)
    }

    fn message(&mut self) -> Option<MessageFields<'a>> {
        let (mut role, mut content, mut images, mut tool_calls) = (None, None, None, None);
        let mut seen = 0u8;
        self.object(|r, key| {
            let bit = match key {
                "role" => 1,
                "content" => 2,
                "images" => 4,
                "tool_calls" => 8,
                _ => return r.skip(3),
            };
            if seen & bit != 0 {
                return None;
            }
            seen |= bit;
            match bit {
                1 => role = Some(r.plain_string()?),
                2 => content = r.raw(3)?,
                4 => images = r.nullable(|r| r.raw_items(3))?,
                _ => tool_calls = r.raw(3)?,
            }
            Some(())
        })?;
        Some(MessageFields {
            // serde refuses a message without a role (and a null one).
            role: Cow::Borrowed(role?),
            content,
            images,
            tool_calls,
        })
    }

    fn raw_items(&mut self, depth: usize) -> Option<Vec<&'a str>> {
        let mut items = Vec::new();
        self.array(|r| {
            items.push(r.raw_value(depth + 1)?);
            Some(())
        })?;
        Some(items)
    }

    fn count_items(&mut self, depth: usize) -> Option<usize> {
        let mut items = 0usize;
        self.array(|r| {
            items += 1;
            r.skip(depth + 1)
        })?;
        Some(items)
    }

    /// A value's JSON text, `None` for `null` (the outer `None`: not read).
    fn raw(&mut self, depth: usize) -> Option<Option<&'a str>> {
        self.nullable(|r| r.raw_value(depth))
    }

    fn raw_value(&mut self, depth: usize) -> Option<&'a str> {
        let start = self.at;
        self.skip(depth)?;
        self.text.get(start..self.at)
    }

    /// Skips one value, checking it as serde_json checks a value it ignores. `depth` is the
    /// nesting of the value.
    fn skip(&mut self, depth: usize) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        match self.peek()? {
            b'"' => self.string().map(|_| ()),
            b'{' => self.object(|r, _| r.skip(depth + 1)),
            b'[' => self.array(|r| r.skip(depth + 1)),
            b't' => self.literal("true"),
            b'f' => self.literal("false"),
            b'n' => self.literal("null"),
            b'-' | b'0'..=b'9' => self.number(),
            _ => None,
        }
    }

    /// JSON's number grammar: `-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?`.
    fn number(&mut self) -> Option<()> {
        let bytes = self.bytes();
        let digits = |at: usize| {
            bytes[at..]
                .iter()
                .take_while(|b| b.is_ascii_digit())
                .count()
        };
        let mut at = self.at + usize::from(bytes.get(self.at) == Some(&b'-'));
        let int = digits(at);
        if int == 0 || (int > 1 && bytes[at] == b'0') {
            return None;
        }
        at += int;
        if bytes.get(at) == Some(&b'.') {
            let frac = digits(at + 1);
            if frac == 0 {
                return None;
            }
            at += 1 + frac;
        }
        if let Some(b'e' | b'E') = bytes.get(at) {
            at += 1;
            if let Some(b'+' | b'-') = bytes.get(at) {
                at += 1;
            }
            let exp = digits(at);
            if exp == 0 {
                return None;
            }
            at += exp;
        }
        self.at = at;
        Some(())
    }

    /// A string without escapes, its contents (a key, the model, a role); `None` for one
    /// with escapes, which serde_json unescapes.
    fn plain_string(&mut self) -> Option<&'a str> {
        let start = self.at;
        let escaped = self.string()?;
        if escaped {
            return None;
        }
        self.text.get(start + 1..self.at - 1)
    }

    /// Skips a string, checking it as serde_json does (escapes valid, no raw control
    /// characters). True when it has escapes.
    fn string(&mut self) -> Option<bool> {
        let bytes = self.bytes();
        if bytes.get(self.at) != Some(&b'"') {
            return None;
        }
        let mut at = self.at + 1;
        let mut escaped = false;
        loop {
            at += plain_run(&bytes[at..]);
            match *bytes.get(at)? {
                b'"' => {
                    self.at = at + 1;
                    return Some(escaped);
                }
                b'\\' => {
                    escaped = true;
                    at += match *bytes.get(at + 1)? {
                        b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => 2,
                        b'u' if bytes.get(at + 2..at + 6)?.iter().all(u8::is_ascii_hexdigit) => 6,
                        _ => return None,
                    };
                }
                // A raw control character.
                _ => return None,
            }
        }
    }
}

/// Whether a byte inside a JSON string needs a look: a quote, a backslash or a control
/// character (which JSON does not allow raw).
fn special(byte: u8) -> bool {
    byte == b'"' || byte == b'\\' || byte < 0x20
}

/// The length of the run of bytes at the start of `bytes` that need no look. The next quote
/// or backslash is found by `memchr` (SIMD, the CPU's widest vectors chosen at run time), and
/// the run before it is checked for control characters by its smallest byte, a reduction the
/// compiler vectorizes. Two passes, but each far cheaper than testing every byte three ways:
/// this scan was the largest part of reading a 128 KiB body (issue 13).
fn plain_run(bytes: &[u8]) -> usize {
    let end = memchr::memchr2(b'"', b'\\', bytes).unwrap_or(bytes.len());
    let run = &bytes[..end];
    if run.iter().fold(u8::MAX, |least, &b| least.min(b)) >= 0x20 {
        return end;
    }
    run.iter().position(|b| special(*b)).unwrap_or(end)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn serde(body: &[u8]) -> Option<Fields<'_>> {
        serde_json::from_slice::<Body>(body)
            .ok()
            .map(Body::into_fields)
    }

    /// Whenever the fast reader answers, serde_json reads the same fields.
    fn agrees(body: &[u8]) -> bool {
        match fast(body) {
            Some(fields) => {
                assert_eq!(
                    Some(&fields),
                    serde(body).as_ref(),
                    "{}",
                    String::from_utf8_lossy(body)
                );
                true
            }
            None => false,
        }
    }

    #[test]
    fn the_usual_bodies_are_read_fast_and_as_serde_reads_them() {
        let usual: &[&str] = &[
            r#"{"model":"llama3","messages":[{"role":"user","content":"hi \"there\"\n\u00e9"}],"stream":false}"#,
            r#" { "model" : "m" , "options" : { "num_ctx" : 8192 , "temperature" : 0.7e-3 } ,
                "messages" : [ { "role":"user", "content":[{"type":"image_url","image_url":{"url":"x"}}],
                "images":["aGk=", "aGk="], "tool_calls": [{"function":{"arguments":"{}"}}] } ] } "#,
            r#"{"model":"m","prompt":"p","system":null,"images":[1,2,[3]],"stream":true,"x":[true,false,null,-0,1.5E+2]}"#,
            r#"{"model":"m","input":[{"role":"user","content":"x"}],"instructions":"s","prompt_cache_key":"k","metadata":{"user_id":"u"}}"#,
            r#"{"name":"llama3:8b","model":null,"messages":null,"options":null}"#,
            r#"{"model":"m","options":{"num_ctx":null},"messages":[{"role":"user","content":null,"images":null}]}"#,
            r#"{"model":"m","options":{"num_ctx":4294967295}}"#,
            "{}",
        ];
        for body in usual {
            assert!(agrees(body.as_bytes()), "not read fast: {body}");
        }
    }

    #[test]
    fn doubtful_bodies_go_to_serde() {
        let doubtful: &[&[u8]] = &[
            br#"{"mod\u0065l":"m"}"#,
            br#"{"model":"m\u0031"}"#,
            br#"{"model":"m","model":"n"}"#,
            br#"["m"]"#,
            br#"{"model":"m","options":{"num_ctx":8192.0}}"#,
            br#"{"model":"m","options":{"num_ctx":-1}}"#,
            br#"{"model":"m","options":{"num_ctx":4294967296}}"#,
            br#"{"model":"m","options":{"num_ctx":1,"num_ctx":2}}"#,
            br#"{"model":"m","messages":[{"content":"no role"}]}"#,
            br#"{"model":"m","messages":[{"role":"user","role":"user"}]}"#,
            br#"{"model":"m","stream":"yes"}"#,
            br#"{"model":"m","x":01}"#,
            br#"{"model":"m","x":1.}"#,
            br#"{"model":"m","x":"\q"}"#,
            br#"{"model":"m","x":"\u12g4"}"#,
            b"{\"model\":\"m\",\"x\":\"tab\there\"}",
            b"{\"model\":\"m\",\"x\":\"\xff\"}",
            br#"{"model":"m",}"#,
            br#"{"model":"m"} x"#,
            br#"{"model":"m""#,
        ];
        for body in doubtful {
            assert!(fast(body).is_none(), "{}", String::from_utf8_lossy(body));
        }
        let deep = format!(
            r#"{{"model":"m","x":{}{}}}"#,
            "[".repeat(70),
            "]".repeat(70)
        );
        assert!(fast(deep.as_bytes()).is_none());
        assert!(read(deep.as_bytes()).is_ok(), "serde_json reads it");
    }

    #[test]
    fn runs_end_at_the_first_byte_that_needs_a_look() {
        for len in 0..100 {
            for special_byte in [b'"', b'\\', 0x1f, 0] {
                let mut bytes = vec![b'a'; len];
                bytes.push(special_byte);
                bytes.extend_from_slice(&[b'b'; 40]);
                assert_eq!(plain_run(&bytes), len);
                // The first of two bytes that need a look ends the run, whichever kinds.
                bytes.extend_from_slice(&[b'"', 0x01, b'\\']);
                assert_eq!(plain_run(&bytes), len);
                bytes[len] = b'c';
                assert_eq!(plain_run(&bytes), len + 41);
            }
            assert_eq!(plain_run(&vec![0xc3; len]), len, "UTF-8 bytes need no look");
        }
    }

    proptest::proptest! {
        /// Over bodies made of the pieces of the usual ones, valid or broken: when the fast
        /// reader answers, serde_json accepts the body and reads the same fields.
        #[test]
        fn fast_answers_only_as_serde(pieces in proptest::collection::vec(0usize..PIECES.len(), 0..40)) {
            let body: String = pieces.iter().map(|i| PIECES[*i]).collect();
            agrees(body.as_bytes());
            let wrapped = format!("{{\"model\":\"m\",{body}}}");
            agrees(wrapped.as_bytes());
        }
    }

    /// JSON texts (valid but for the odd leaf) whose objects use the keys the readers look
    /// for, with values of every type, so that many of them are bodies of the right shape.
    fn json(depth: u32) -> proptest::strategy::BoxedStrategy<String> {
        use proptest::prelude::*;
        let leaf = proptest::sample::select(LEAVES).prop_map(str::to_string);
        leaf.prop_recursive(depth, 48, 6, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4)
                    .prop_map(|items| format!("[{}]", items.join(","))),
                proptest::collection::vec(
                    (
                        proptest::sample::select(KEYS),
                        inner,
                        proptest::sample::select(SPACES)
                    ),
                    0..5
                )
                .prop_map(|members| {
                    let members: Vec<String> = members
                        .iter()
                        .map(|(k, v, ws)| format!("{ws}\"{k}\"{ws}:{ws}{v}{ws}"))
                        .collect();
                    format!("{{{}}}", members.join(","))
                }),
            ]
        })
        .boxed()
    }

    const KEYS: &[&str] = &[
        "model",
        "name",
        "stream",
        "options",
        "num_ctx",
        "messages",
        "role",
        "content",
        "images",
        "tool_calls",
        "prompt",
        "system",
        "input",
        "instructions",
        "prompt_cache_key",
        "metadata",
        "user_id",
        "x",
    ];
    const LEAVES: &[&str] = &[
        "\"m\"",
        "\"user\"",
        "\"a \\\"b\\\" \\n\"",
        "\"\\u00e9\\ud800\"",
        "\"caf\u{e9}\"",
        "\"\\u0041\"",
        "0",
        "12",
        "-3",
        "4.5",
        "1e9",
        "8192",
        "4294967296",
        "8192.0",
        "null",
        "true",
        "false",
        "\"\t\"",
        "01",
    ];
    const SPACES: &[&str] = &["", " ", "\n  "];

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]
        /// Over generated JSON of the bodies' shape: when the fast reader answers, serde_json
        /// reads the same fields; and it does answer for some of them.
        #[test]
        fn fast_answers_as_serde_on_generated_bodies(body in json(4)) {
            agrees(body.as_bytes());
        }
    }

    #[test]
    fn generated_bodies_are_often_read_fast() {
        use proptest::strategy::{Strategy, ValueTree};
        let mut runner = proptest::test_runner::TestRunner::deterministic();
        let strategy = json(4);
        let answered = (0..2000)
            .filter(|_| {
                let body = strategy.new_tree(&mut runner).map(|t| t.current());
                body.is_ok_and(|b| agrees(b.as_bytes()))
            })
            .count();
        assert!(answered > 100, "only {answered} of 2000 read fast");
    }

    const PIECES: &[&str] = &[
        "{",
        "}",
        "[",
        "]",
        ",",
        ":",
        " ",
        "\n",
        "\"model\"",
        "\"name\"",
        "\"stream\"",
        "\"options\"",
        "\"num_ctx\"",
        "\"messages\"",
        "\"role\"",
        "\"content\"",
        "\"images\"",
        "\"tool_calls\"",
        "\"prompt\"",
        "\"system\"",
        "\"input\"",
        "\"instructions\"",
        "\"prompt_cache_key\"",
        "\"metadata\"",
        "\"x\"",
        "\"user\"",
        "\"a \\\"b\\\" \\n\"",
        "\"\\u00e9\\ud800\"",
        "\"caf\u{e9}\"",
        "\"\\q\"",
        "\"\t\"",
        "0",
        "12",
        "-3",
        "4.5",
        "1e9",
        "01",
        "4294967296",
        "null",
        "true",
        "false",
        "nul",
        "\"",
    ];
}
