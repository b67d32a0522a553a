//! The bytes a generating endpoint sends: Ollama's NDJSON chunks and final statistics, and
//! the OpenAI-compatible SSE chunks, `usage` and `[DONE]`. Field names and shapes follow
//! Ollama's docs/api.md and docs/openai.md, and are checked against the response structs of
//! the `ollama-rs` and `async-openai` crates.

use std::time::Duration;

use axum::response::Response;
use bytes::Bytes;
use serde_json::{Value, json};

use super::clock::now_rfc3339;
use super::compat::CompatWire;
use super::config::StandinKind;
use super::error::StandinError;
use super::node::Capability;
use super::prompt::render_chat_reply;

/// The generating endpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    OllamaChat,
    OllamaGenerate,
    OpenAiChat,
    OpenAiCompletion,
    /// The APIs of [`super::compat`].
    Responses,
    AnthropicMessages,
    Transcription,
}

impl Api {
    pub fn path(self) -> &'static str {
        match self {
            Api::OllamaChat => "/api/chat",
            Api::OllamaGenerate => "/api/generate",
            Api::OpenAiChat => "/v1/chat/completions",
            Api::OpenAiCompletion => "/v1/completions",
            Api::Responses => "/v1/responses",
            Api::AnthropicMessages => "/v1/messages",
            Api::Transcription => "/v1/audio/transcriptions",
        }
    }

    pub fn capability(self) -> Capability {
        match self {
            Api::OllamaChat
            | Api::OpenAiChat
            | Api::Responses
            | Api::AnthropicMessages
            | Api::Transcription => Capability::Chat,
            Api::OllamaGenerate | Api::OpenAiCompletion => Capability::Generate,
        }
    }

    fn is_chat(self) -> bool {
        self.capability() == Capability::Chat
    }

    fn is_openai(self) -> bool {
        matches!(self, Api::OpenAiChat | Api::OpenAiCompletion)
    }

    /// Served by [`super::compat`]'s formats.
    fn is_compat(self) -> bool {
        matches!(
            self,
            Api::Responses | Api::AnthropicMessages | Api::Transcription
        )
    }

    /// An error in the shape this endpoint's clients parse.
    pub fn error(self, e: StandinError) -> Response {
        match self {
            Api::AnthropicMessages => e.anthropic(),
            Api::Responses | Api::Transcription => e.openai(),
            _ if self.is_openai() => e.openai(),
            _ => e.ollama(),
        }
    }

    /// How the reply extends the prompt in the next request's render: for chat, as the
    /// assistant turn the client will send back; for completions, appended verbatim.
    pub fn held_reply(self, reply: &str) -> Vec<u8> {
        if self.is_chat() {
            render_chat_reply(reply)
        } else {
            reply.as_bytes().to_vec()
        }
    }
}

/// The simulated costs of one generation, reported in final chunks and `usage`.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    pub prompt_tokens: u32,
    pub cached_tokens: u32,
    pub eval_count: u32,
    pub load_duration: Duration,
    pub prompt_eval_duration: Duration,
    pub eval_duration: Duration,
    pub total_duration: Duration,
}

impl Stats {
    /// Prompt tokens actually evaluated, what Ollama reports as `prompt_eval_count`.
    pub fn prompt_eval_count(&self) -> u32 {
        self.prompt_tokens - self.cached_tokens
    }
}

/// Formats one response of one endpoint.
#[derive(Clone, Debug)]
pub struct Wire {
    pub api: Api,
    pub model: String,
    /// OpenAI response id, the same for every chunk.
    pub id: String,
    /// OpenAI `created`, Unix seconds.
    pub created: u64,
    /// OpenAI `stream_options.include_usage`: send a usage chunk before `[DONE]`.
    pub include_usage: bool,
    /// Which server's counting the reply follows.
    pub kind: StandinKind,
}

impl Wire {
    pub fn content_type(&self, stream: bool) -> &'static str {
        match (stream, self.api.is_openai() || self.api.is_compat()) {
            (false, _) => "application/json",
            (true, false) => "application/x-ndjson",
            (true, true) => "text/event-stream",
        }
    }

    fn compat(&self) -> CompatWire<'_> {
        CompatWire {
            api: self.api,
            model: &self.model,
            id: &self.id,
            created: self.created,
        }
    }

    /// Events a stream opens with, before its first token (Responses, Anthropic).
    pub fn opening(&self) -> Vec<Bytes> {
        self.compat().opening()
    }

    /// Token number `index` of a stream, framed.
    pub fn token_at(&self, index: usize, text: &str) -> Bytes {
        if self.api.is_compat() {
            return self.compat().token(index, text);
        }
        self.token(text)
    }

    /// What follows the last of `tokens` tokens, whose text is `text`.
    pub fn trailer_of(&self, stats: &Stats, text: &str, tokens: usize) -> Vec<Bytes> {
        if self.api.is_compat() {
            return self.compat().trailer(stats, text, tokens);
        }
        self.trailer(stats)
    }

    /// One streamed token, framed.
    pub fn token(&self, text: &str) -> Bytes {
        if self.api.is_openai() {
            sse(&self.openai_chunk(text, None))
        } else {
            ndjson(&self.ollama_chunk(text, None))
        }
    }

    /// What follows the last token: Ollama's final chunk with statistics, or OpenAI's
    /// finish chunk, optional usage chunk and `[DONE]`.
    pub fn trailer(&self, stats: &Stats) -> Vec<Bytes> {
        if !self.api.is_openai() {
            return vec![ndjson(&self.ollama_chunk("", Some(stats)))];
        }
        let mut finish = self.openai_chunk("", Some("stop"));
        if !self.include_usage {
            self.add_timings(&mut finish, stats);
        }
        let mut out = vec![sse(&finish)];
        if self.include_usage {
            let mut usage = self.openai_base(true);
            usage["choices"] = json!([]);
            usage["usage"] = self.openai_usage(stats);
            self.add_timings(&mut usage, stats);
            out.push(sse(&usage));
        }
        out.push(Bytes::from_static(b"data: [DONE]\n\n"));
        out
    }

    /// The single JSON object of a non-streamed reply.
    pub fn whole(&self, text: &str, stats: &Stats) -> Bytes {
        let value = if self.api.is_compat() {
            self.compat().whole(text, stats)
        } else if self.api.is_openai() {
            let mut v = self.openai_base(false);
            v["choices"] = json!([self.openai_choice(text, Some("stop"), false)]);
            v["usage"] = self.openai_usage(stats);
            self.add_timings(&mut v, stats);
            v
        } else {
            self.ollama_chunk(text, Some(stats))
        };
        Bytes::from(value.to_string())
    }

    fn ollama_chunk(&self, text: &str, done: Option<&Stats>) -> Value {
        let mut v = json!({ "model": self.model, "created_at": now_rfc3339() });
        if self.api.is_chat() {
            v["message"] = json!({ "role": "assistant", "content": text });
        } else {
            v["response"] = json!(text);
        }
        v["done"] = json!(done.is_some());
        if let Some(stats) = done {
            v["done_reason"] = json!("stop");
            v["total_duration"] = nanos(stats.total_duration);
            v["load_duration"] = nanos(stats.load_duration);
            // Ollama 0.30.1 and later count cached tokens too (llama-server's
            // cache_n + prompt_n); older Ollama only the evaluated ones.
            let count = match self.kind {
                StandinKind::OllamaLegacy => stats.prompt_eval_count(),
                _ => stats.prompt_tokens,
            };
            v["prompt_eval_count"] = json!(count);
            v["prompt_eval_duration"] = nanos(stats.prompt_eval_duration);
            v["eval_count"] = json!(stats.eval_count);
            v["eval_duration"] = nanos(stats.eval_duration);
        }
        v
    }

    fn openai_base(&self, chunk: bool) -> Value {
        let object = match (self.api.is_chat(), chunk) {
            (true, true) => "chat.completion.chunk",
            (true, false) => "chat.completion",
            (false, _) => "text_completion",
        };
        json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": "fp_ollama",
        })
    }

    fn openai_chunk(&self, text: &str, finish: Option<&str>) -> Value {
        let mut v = self.openai_base(true);
        v["choices"] = json!([self.openai_choice(text, finish, true)]);
        v
    }

    fn openai_choice(&self, text: &str, finish: Option<&str>, chunk: bool) -> Value {
        if !self.api.is_chat() {
            return json!({ "text": text, "index": 0, "finish_reason": finish });
        }
        let key = if chunk { "delta" } else { "message" };
        let mut choice = json!({ "index": 0, "finish_reason": finish });
        choice[key] = json!({ "role": "assistant", "content": text });
        choice
    }
}

impl Wire {
    fn openai_usage(&self, stats: &Stats) -> Value {
        let mut usage = json!({
            "prompt_tokens": stats.prompt_tokens,
            "completion_tokens": stats.eval_count,
            "total_tokens": stats.prompt_tokens + stats.eval_count,
        });
        // Current Ollama's OpenAI usage has no details (openai/openai.go).
        if self.kind != StandinKind::Ollama {
            usage["prompt_tokens_details"] = json!({ "cached_tokens": stats.cached_tokens });
        }
        usage
    }

    /// llama-server's `timings` in the last object of an OpenAI reply
    /// (tools/server/server-task.cpp, `result_timings`).
    fn add_timings(&self, v: &mut Value, stats: &Stats) {
        if self.kind != StandinKind::LlamaCpp {
            return;
        }
        let evaluated = stats.prompt_eval_count();
        let prompt_ms = stats.prompt_eval_duration.as_secs_f64() * 1000.0;
        let per_second = if prompt_ms > 0.0 {
            f64::from(evaluated) / (prompt_ms / 1000.0)
        } else {
            0.0
        };
        v["timings"] = json!({
            "cache_n": stats.cached_tokens,
            "prompt_n": evaluated,
            "prompt_ms": prompt_ms,
            "prompt_per_second": per_second,
            "predicted_n": stats.eval_count,
        });
    }
}

fn nanos(d: Duration) -> Value {
    json!(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

fn ndjson(v: &Value) -> Bytes {
    let mut line = v.to_string();
    line.push('\n');
    Bytes::from(line)
}

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wire(api: Api, include_usage: bool) -> Wire {
        Wire {
            api,
            model: "m:1".into(),
            id: "chatcmpl-1".into(),
            created: 1,
            include_usage,
            kind: StandinKind::OllamaLegacy,
        }
    }

    fn parse(b: &Bytes) -> Value {
        let text = String::from_utf8_lossy(b);
        let json = text.trim().trim_start_matches("data: ");
        serde_json::from_str(json).unwrap_or(Value::Null)
    }

    #[test]
    fn ollama_final_chunk_reports_uncached_prompt_tokens() {
        let stats = Stats {
            prompt_tokens: 10,
            cached_tokens: 7,
            eval_count: 3,
            ..Stats::default()
        };
        let last = wire(Api::OllamaChat, false).trailer(&stats);
        let v = parse(&last[0]);
        assert_eq!(v["done"], true);
        assert_eq!(v["prompt_eval_count"], 3);
        assert_eq!(v["message"]["content"], "");
        assert!(last[0].ends_with(b"}\n"));
    }

    #[test]
    fn openai_stream_ends_with_usage_and_done() {
        let stats = Stats {
            prompt_tokens: 10,
            cached_tokens: 7,
            eval_count: 3,
            ..Stats::default()
        };
        let tail = wire(Api::OpenAiChat, true).trailer(&stats);
        assert_eq!(tail.len(), 3);
        assert_eq!(parse(&tail[0])["choices"][0]["finish_reason"], "stop");
        assert_eq!(parse(&tail[1])["usage"]["total_tokens"], 13);
        assert_eq!(
            parse(&tail[1])["usage"]["prompt_tokens_details"]["cached_tokens"],
            7
        );
        assert_eq!(&tail[2][..], b"data: [DONE]\n\n");
    }

    #[test]
    fn completions_use_text_choices() {
        let v = parse(&wire(Api::OpenAiCompletion, false).token("hi"));
        assert_eq!(v["object"], "text_completion");
        assert_eq!(v["choices"][0]["text"], "hi");
        let g = parse(&wire(Api::OllamaGenerate, false).token("hi"));
        assert_eq!(g["response"], "hi");
        assert_eq!(g["done"], false);
    }
}
