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

use serde_json::Value;

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
    tail.split(|b| *b == b'\n')
        .map(<[u8]>::trim_ascii)
        .map(|l| l.strip_prefix(b"data:").map_or(l, <[u8]>::trim_ascii))
        .filter(|l| l.first() == Some(&b'{'))
        .rev()
        .take(LOOK_BACK)
        .filter_map(|l| serde_json::from_slice::<Value>(l).ok())
        .find_map(|v| of(&v))
}

/// The usage one JSON object reports, if it reports any.
pub fn of(v: &Value) -> Option<TokenUsage> {
    let count = |v: &Value, key: &str| v.get(key).and_then(Value::as_u64);
    for usage in [
        v.get("usage"),
        v.get("response").and_then(|r| r.get("usage")),
    ]
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
    if let Some(timings) = v.get("timings")
        && let Some(evaluated) = count(timings, "prompt_n")
    {
        let cached = count(timings, "cache_n");
        return Some(TokenUsage {
            prompt: evaluated + cached.unwrap_or(0),
            cached,
            completion: count(timings, "predicted_n").unwrap_or(0),
        });
    }
    let prompt = count(v, "prompt_eval_count")?;
    Some(TokenUsage {
        prompt,
        cached: None,
        completion: count(v, "eval_count").unwrap_or(0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage(text: &str) -> Option<TokenUsage> {
        find(text.as_bytes())
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
}
