//! Explicit session keys: a client that names its conversation (OpenAI's `prompt_cache_key`,
//! Anthropic's `metadata.user_id`, an `X-Session-Id` or Open WebUI's `X-OpenWebUI-Chat-Id`
//! header) is pinned to one node by that name, ahead of the prefix chain. The chain still
//! decides what is warm there; the key only decides where the conversation lives.

use std::hash::Hasher as _;

use http::HeaderMap;

/// Header names read for a session key when `session_headers` is not configured, in order.
pub const DEFAULT_SESSION_HEADERS: &[&str] = &["x-session-id", "x-openwebui-chat-id"];

/// The key of a session for one model: the same key with two models names two sessions,
/// since the models may live on different nodes.
pub fn session_hash(model_key: &str, key: &str) -> u64 {
    let mut h = super::xxh3();
    h.write(b"session\0");
    h.write(&(model_key.len() as u64).to_le_bytes());
    h.write(model_key.as_bytes());
    h.write(key.as_bytes());
    h.finish()
}

/// The first configured header that carries a non-empty value.
pub fn header_session<'h>(headers: &'h HeaderMap, names: &[String]) -> Option<&'h str> {
    names.iter().find_map(|name| {
        let value = headers.get(name.as_str())?.to_str().ok()?.trim();
        (!value.is_empty()).then_some(value)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_configured_header_with_a_value_wins() {
        let mut headers = HeaderMap::new();
        headers.insert("x-openwebui-chat-id", "chat-7".parse().unwrap());
        headers.insert("x-session-id", "  ".parse().unwrap());
        let names: Vec<String> = DEFAULT_SESSION_HEADERS
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(header_session(&headers, &names), Some("chat-7"));
        headers.insert("x-session-id", "s1".parse().unwrap());
        assert_eq!(header_session(&headers, &names), Some("s1"));
        assert_eq!(header_session(&headers, &["x-other".to_string()]), None);
    }

    #[test]
    fn sessions_are_per_model() {
        assert_eq!(session_hash("m:1", "k"), session_hash("m:1", "k"));
        assert_ne!(session_hash("m:1", "k"), session_hash("m:2", "k"));
        assert_ne!(session_hash("m:1", "k"), session_hash("m:1", "j"));
    }
}
