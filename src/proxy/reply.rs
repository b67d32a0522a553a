//! What a reply says about the node that produced it, read from its last JSON object:
//! Ollama's final chunk (`prompt_eval_count`, `eval_duration`...), OpenAI-style `usage`,
//! llama.cpp's `timings`.

use serde::Deserialize;

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
        let mut lines = text
            .split(|b| *b == b'\n')
            .map(|l| l.trim_ascii())
            .map(|l| l.strip_prefix(b"data:").map_or(l, <[u8]>::trim_ascii))
            .filter(|l| l.first() == Some(&b'{'));
        let last = lines.next_back()?;
        // A line cut at the front by the buffer is not an object.
        if self.truncated && last.as_ptr() == text.as_ptr() {
            return None;
        }
        Some(last)
    }
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
        const LOAD_SECONDS: f64 = 0.1;
        self.load_duration
            .is_some_and(|ns| ns as f64 / 1e9 >= LOAD_SECONDS)
    }

    /// Prompt tokens the node evaluated, and those it served from its prefix cache when it
    /// says so (llama.cpp's timings, OpenAI's cached_tokens; Ollama reports only the
    /// evaluated ones).
    pub fn prompt_tokens(&self) -> Option<(u64, Option<u64>)> {
        if let Some(Timings {
            prompt_n: Some(evaluated),
            cache_n: Some(cached),
            ..
        }) = &self.timings
        {
            return Some((*evaluated, Some(*cached)));
        }
        let usage = self.usage.as_ref();
        let cached = usage
            .and_then(|u| u.prompt_tokens_details.as_ref())
            .and_then(|d| d.cached_tokens);
        if let (Some(total), Some(cached)) = (usage.and_then(|u| u.prompt_tokens), cached) {
            return Some((total.saturating_sub(cached), Some(cached)));
        }
        if let Some(evaluated) = self.prompt_eval_count {
            return Some((evaluated, None));
        }
        usage.and_then(|u| u.prompt_tokens).map(|n| (n, None))
    }

    /// Prompt tokens evaluated per second (only uncached tokens are evaluated).
    pub fn prefill_tps(&self) -> Option<f64> {
        rate(self.prompt_eval_count, self.prompt_eval_duration)
            .or_else(|| self.timings.as_ref()?.prompt_per_second)
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
        assert_eq!(s.prefill_tps(), Some(10.0));
        assert_eq!(s.decode_tps(), Some(10.0));
        assert_eq!(s.prompt_tokens(), Some((10, None)));
    }

    #[test]
    fn llama_cpp_timings_report_cache() {
        let s = ReplyStats::parse(br#"{"timings":{"cache_n":90,"prompt_n":10}}"#).unwrap();
        assert_eq!(s.prompt_tokens(), Some((10, Some(90))));
    }

    #[test]
    fn finds_sse_usage_before_done() {
        let mut t = Tail::new(1024);
        t.push(b"data: {\"choices\":[]}\n\ndata: {\"usage\":{\"prompt_tokens\":9,\"prompt_tokens_details\":{\"cached_tokens\":7}}}\n\ndata: [DONE]\n\n");
        let s = ReplyStats::parse(t.last_object().unwrap()).unwrap();
        assert_eq!(s.prompt_tokens(), Some((2, Some(7))));
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
}
