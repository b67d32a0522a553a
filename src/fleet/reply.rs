//! What a reply says about the node that produced it, read from its last JSON object:
//! Ollama's final chunk (`prompt_eval_count`, `eval_duration`...), OpenAI-style `usage`,
//! llama.cpp's `timings`.

use serde::Deserialize;

pub use super::kind::ReplyShape;

/// What one reply says about its prompt tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reading {
    /// The node says how many it evaluated and how many it served from cache (llama.cpp's
    /// `timings`, OpenAI's `usage.prompt_tokens_details.cached_tokens`).
    Exact {
        evaluated: u64,
        cached: u64,
        shape: ReplyShape,
    },
    /// Ollama's `prompt_eval_count`: evaluated tokens before 0.30.1, cached plus evaluated
    /// since; `prompt_eval_duration` covers the evaluated ones only.
    OllamaCount {
        count: u64,
        duration_ns: Option<u64>,
    },
    /// Only the prompt's total (OpenAI's `usage.prompt_tokens` without details).
    Total { total: u64 },
}

/// Keeps the last bytes of a reply, where the final chunk is.
pub struct Tail {
    buf: Vec<u8>,
    cap: usize,
    truncated: bool,
}

impl Tail {
    pub fn new(cap: usize) -> Tail {
        Tail {
            buf: Vec::new(),
            cap,
            truncated: false,
        }
    }

    /// Appends a chunk. The buffer may grow to twice its capacity before its front is
    /// dropped, so that each byte is moved at most once however small the chunks are.
    pub fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
        if self.buf.len() > 2 * self.cap {
            let excess = self.buf.len() - self.cap;
            self.buf.drain(..excess);
            self.truncated = true;
        }
    }

    /// The bytes kept: the end of the reply.
    pub fn bytes(&self) -> &[u8] {
        &self.buf
    }

    /// The last complete JSON object: the last NDJSON line, the last SSE `data:` event that
    /// is not `[DONE]`, or the whole body of a plain JSON reply.
    pub fn last_object(&self) -> Option<&[u8]> {
        let text = &self.buf[..];
        let last = objects_from_the_end(text).next()?;
        // A line cut at the front by the buffer is not an object.
        if self.truncated && last.as_ptr() == text.as_ptr() {
            return None;
        }
        Some(last)
    }
}

/// The lines of a reply's text that hold a JSON object (NDJSON lines, SSE `data:` lines, or
/// one JSON body), trimmed, last first. Found with `memrchr`: a byte-at-a-time split was a
/// measurable part of settling each reply (issue 13).
pub fn objects_from_the_end(text: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut end = text.len();
    let mut starts = memchr::memrchr_iter(b'\n', text)
        .map(|newline| newline + 1)
        .chain(std::iter::once(0));
    std::iter::from_fn(move || {
        let start = starts.next()?;
        let line = &text[start..end];
        end = start.saturating_sub(1);
        Some(line)
    })
    .map(<[u8]>::trim_ascii)
    .map(|l| l.strip_prefix(b"data:").map_or(l, <[u8]>::trim_ascii))
    .filter(|l| l.first() == Some(&b'{'))
}

#[derive(Debug, Default, Deserialize, PartialEq)]
pub struct ReplyStats {
    #[serde(default)]
    pub load_duration: Option<u64>,
    #[serde(default)]
    pub prompt_eval_count: Option<u64>,
    #[serde(default)]
    pub prompt_eval_duration: Option<u64>,
    #[serde(default)]
    pub eval_count: Option<u64>,
    #[serde(default)]
    pub eval_duration: Option<u64>,
    #[serde(default)]
    pub usage: Option<Usage>,
    #[serde(default)]
    pub timings: Option<Timings>,
}

#[derive(Debug, Default, Deserialize, PartialEq)]
pub struct Usage {
    #[serde(default)]
    pub prompt_tokens: Option<u64>,
    #[serde(default)]
    pub completion_tokens: Option<u64>,
    #[serde(default)]
    pub prompt_tokens_details: Option<PromptDetails>,
}

#[derive(Debug, Default, Deserialize, PartialEq)]
pub struct PromptDetails {
    #[serde(default)]
    pub cached_tokens: Option<u64>,
}

/// llama.cpp server's per-request timings.
#[derive(Debug, Default, Deserialize, PartialEq)]
pub struct Timings {
    #[serde(default)]
    pub cache_n: Option<u64>,
    #[serde(default)]
    pub prompt_n: Option<u64>,
    #[serde(default)]
    pub prompt_per_second: Option<f64>,
    #[serde(default)]
    pub predicted_per_second: Option<f64>,
}

impl ReplyStats {
    pub fn parse(object: &[u8]) -> Option<ReplyStats> {
        serde_json::from_slice(object).ok()
    }

    /// The node loaded the model for this request (or the request waited for its load):
    /// Ollama's `load_duration` of at least 0.1 s. A resident model's is a few milliseconds.
    pub fn loaded_model(&self) -> bool {
        self.load_seconds().is_some()
    }

    /// Seconds the node took to load the model for this request, where it loaded it
    /// ([`ReplyStats::loaded_model`]).
    pub fn load_seconds(&self) -> Option<f64> {
        const LOAD_SECONDS: f64 = 0.1;
        let seconds = self.load_duration? as f64 / 1e9;
        (seconds >= LOAD_SECONDS).then_some(seconds)
    }

    /// What the reply says about its prompt tokens, as the node kind that sent it counts
    /// them. Only Ollama's count is ambiguous: see [`Reading::OllamaCount`].
    pub fn reading(&self) -> Option<Reading> {
        if let Some(Timings {
            prompt_n: Some(evaluated),
            cache_n: Some(cached),
            ..
        }) = &self.timings
        {
            return Some(Reading::Exact {
                evaluated: *evaluated,
                cached: *cached,
                shape: ReplyShape::LlamaCppTimings,
            });
        }
        let usage = self.usage.as_ref();
        let cached = usage
            .and_then(|u| u.prompt_tokens_details.as_ref())
            .and_then(|d| d.cached_tokens);
        if let (Some(total), Some(cached)) = (usage.and_then(|u| u.prompt_tokens), cached) {
            return Some(Reading::Exact {
                evaluated: total.saturating_sub(cached),
                cached: cached.min(total),
                shape: ReplyShape::CachedTokens,
            });
        }
        if let Some(count) = self.prompt_eval_count {
            return Some(Reading::OllamaCount {
                count,
                duration_ns: self.prompt_eval_duration,
            });
        }
        usage
            .and_then(|u| u.prompt_tokens)
            .map(|total| Reading::Total { total })
    }

    /// The cache report's shape, which tells a node's kind.
    pub fn shape(&self) -> ReplyShape {
        match self.reading() {
            Some(Reading::Exact { shape, .. }) => shape,
            Some(Reading::OllamaCount { .. }) => ReplyShape::OllamaCount,
            _ => ReplyShape::Other,
        }
    }

    /// Seconds the node spent evaluating the prompt, where it says.
    pub fn prefill_seconds(&self) -> Option<f64> {
        if let Some(ns) = self.prompt_eval_duration.filter(|ns| *ns > 0) {
            return Some(ns as f64 / 1e9);
        }
        let t = self.timings.as_ref()?;
        match (t.prompt_n, t.prompt_per_second) {
            (Some(n), Some(tps)) if n > 0 && tps > 0.0 => Some(n as f64 / tps),
            _ => None,
        }
    }

    /// Tokens generated per second.
    pub fn decode_tps(&self) -> Option<f64> {
        rate(self.eval_count, self.eval_duration)
            .or_else(|| self.timings.as_ref()?.predicted_per_second)
    }
}

fn rate(count: Option<u64>, duration_ns: Option<u64>) -> Option<f64> {
    match (count, duration_ns) {
        (Some(c), Some(d)) if c > 0 && d > 0 => Some(c as f64 / (d as f64 / 1e9)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_ollama_final_chunk() {
        let mut t = Tail::new(1024);
        t.push(b"{\"done\":false}\n{\"done\":true,\"prompt_eval_count\":10,");
        t.push(
            b"\"prompt_eval_duration\":1000000000,\"eval_count\":5,\"eval_duration\":500000000}\n",
        );
        let s = ReplyStats::parse(t.last_object().unwrap()).unwrap();
        assert_eq!(s.prefill_seconds(), Some(1.0));
        assert_eq!(s.decode_tps(), Some(10.0));
        assert_eq!(
            s.reading(),
            Some(Reading::OllamaCount {
                count: 10,
                duration_ns: Some(1_000_000_000)
            })
        );
        assert_eq!(s.shape(), ReplyShape::OllamaCount);
    }

    #[test]
    fn llama_cpp_timings_report_cache() {
        let s = ReplyStats::parse(
            br#"{"timings":{"cache_n":90,"prompt_n":10,"prompt_per_second":100.0}}"#,
        )
        .unwrap();
        assert_eq!(
            s.reading(),
            Some(Reading::Exact {
                evaluated: 10,
                cached: 90,
                shape: ReplyShape::LlamaCppTimings
            })
        );
        assert_eq!(s.prefill_seconds(), Some(0.1));
    }

    #[test]
    fn finds_sse_usage_before_done() {
        let mut t = Tail::new(1024);
        t.push(b"data: {\"choices\":[]}\n\ndata: {\"usage\":{\"prompt_tokens\":9,\"prompt_tokens_details\":{\"cached_tokens\":7}}}\n\ndata: [DONE]\n\n");
        let s = ReplyStats::parse(t.last_object().unwrap()).unwrap();
        assert_eq!(
            s.reading(),
            Some(Reading::Exact {
                evaluated: 2,
                cached: 7,
                shape: ReplyShape::CachedTokens
            })
        );
        assert_eq!(s.shape(), ReplyShape::CachedTokens);
        let plain = ReplyStats::parse(br#"{"usage":{"prompt_tokens":9}}"#).unwrap();
        assert_eq!(plain.reading(), Some(Reading::Total { total: 9 }));
        let usage = s.usage.unwrap();
        assert_eq!(usage.prompt_tokens, Some(9));
        assert_eq!(usage.prompt_tokens_details.unwrap().cached_tokens, Some(7));
    }

    #[test]
    fn keeps_only_the_tail() {
        let mut t = Tail::new(16);
        t.push(&[b'x'; 100]);
        t.push(b"\n{\"a\":1}");
        assert_eq!(t.last_object(), Some(&b"{\"a\":1}"[..]));
        for _ in 0..1000 {
            t.push(b"ab");
        }
        assert!(t.buf.len() <= 32, "bounded by twice the capacity");
        let mut t = Tail::new(8);
        t.push(b"{\"long\":\"object cut by the buffer\"}");
        assert_eq!(t.last_object(), None);
    }

    proptest::proptest! {
        /// The lines found from the end are those of a plain split, in reverse.
        #[test]
        fn objects_from_the_end_are_a_split_reversed(
            text in proptest::collection::vec(proptest::sample::select(b"{}\n\r :datx".to_vec()), 0..40)
        ) {
            let split: Vec<&[u8]> = text
                .split(|b| *b == b'\n')
                .map(<[u8]>::trim_ascii)
                .map(|l| l.strip_prefix(b"data:").map_or(l, <[u8]>::trim_ascii))
                .filter(|l| l.first() == Some(&b'{'))
                .rev()
                .collect();
            let found: Vec<&[u8]> = objects_from_the_end(&text).collect();
            proptest::prop_assert_eq!(found, split);
        }
    }
}
