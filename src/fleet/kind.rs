//! What kind of server a node is, and so how it caches prompts and how its replies count
//! them. Detected at run time from `/api/version` and from the replies themselves, unless
//! the configuration says (`nodes[].kind`).
//!
//! Facts from the servers' sources (Ollama `llm/llama_server.go`, `server/routes.go`,
//! `runner/ollamarunner/cache.go`; llama.cpp `tools/server/server-context.cpp`):
//! - Ollama >= 0.30 runs GGUF models in an upstream llama-server: slots chosen by prompt
//!   similarity, else least recently used, plus a host-RAM prompt cache (`--cache-ram`);
//!   from 0.30.1 on, `prompt_eval_count` counts cached and evaluated tokens together.
//! - Older Ollama: its own runner's slots only; `prompt_eval_count` counts evaluated tokens.
//! - A llama.cpp server reports `timings.cache_n` and `timings.prompt_n`.
//! - Other OpenAI-compatible servers (vLLM, SGLang) report
//!   `usage.prompt_tokens_details.cached_tokens`.

use serde::{Deserialize, Serialize};

pub use crate::config::NodeKind;

/// What an Ollama reply's `prompt_eval_count` counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Counting {
    /// Not known yet: on a reply that evaluated the whole prompt both readings agree.
    #[default]
    Unknown,
    /// Only the tokens evaluated (Ollama before 0.30.1).
    EvaluatedOnly,
    /// Cached plus evaluated tokens (Ollama 0.30.1 and later); `prompt_eval_duration` covers
    /// only the evaluated ones.
    CachedAndEvaluated,
}

/// What corral has learned of a node's kind so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KindState {
    pub kind: NodeKind,
    pub counting: Counting,
    /// Whether the node is known to keep a host-memory prompt cache beyond its slots:
    /// `Some(false)` for the old Ollama runner, `Some(true)` for llama-server based ones,
    /// `None` while unknown (then the cache's capacity is learned from replies alone).
    pub host_cache: Option<bool>,
}

impl KindState {
    /// The node may keep a host-memory prompt cache: not known not to (the old runner).
    pub fn may_keep_host_cache(&self) -> bool {
        self.host_cache != Some(false)
    }

    /// The state implied by a configured kind; `auto` knows nothing yet.
    pub fn configured(kind: NodeKind) -> KindState {
        let (counting, host_cache) = match kind {
            NodeKind::Auto => (Counting::Unknown, None),
            NodeKind::Ollama => (Counting::CachedAndEvaluated, Some(true)),
            NodeKind::OllamaLegacy => (Counting::EvaluatedOnly, Some(false)),
            NodeKind::LlamaCpp => (Counting::Unknown, Some(true)),
            NodeKind::Openai => (Counting::Unknown, None),
        };
        KindState {
            kind,
            counting,
            host_cache,
        }
    }

    /// Learns from `/api/version`. A dev build ("0.0.0") or an unparsable version says
    /// nothing; replies will tell.
    pub fn learn_version(&mut self, version: &str) {
        if self.kind != NodeKind::Auto {
            return;
        }
        let Some(v) = parse_version(version) else {
            return;
        };
        if v == (0, 0, 0) {
            return;
        }
        *self = if v >= (0, 30, 0) {
            let mut state = KindState::configured(NodeKind::Ollama);
            if v < (0, 30, 1) {
                state.counting = Counting::EvaluatedOnly;
            }
            state
        } else {
            KindState::configured(NodeKind::OllamaLegacy)
        };
    }

    /// Learns from a reply's own fields: llama.cpp's `timings`, OpenAI's cached tokens.
    pub fn learn_reply_shape(&mut self, shape: ReplyShape) {
        if self.kind != NodeKind::Auto {
            return;
        }
        match shape {
            ReplyShape::LlamaCppTimings => *self = KindState::configured(NodeKind::LlamaCpp),
            ReplyShape::CachedTokens => *self = KindState::configured(NodeKind::Openai),
            ReplyShape::OllamaCount | ReplyShape::Other => {}
        }
    }
}

/// llama-server's `GET /props` (always served; only `POST /props` needs `--props`), the
/// fields corral reads. llama.cpp `tools/server/server-context.cpp`, `get_res_props`:
/// `total_slots` is `params.n_parallel` (`-np`), `default_generation_settings.n_ctx` the
/// context of one slot.
#[derive(Debug, Deserialize)]
pub struct Props {
    total_slots: Option<serde_json::Value>,
}

/// The slots a node's `/props` shows, if it is a llama-server's: a whole number of at least
/// one, else nothing (another server's page, a proxy's error, a missing field).
pub fn slots_from_props(body: &[u8]) -> Option<usize> {
    let props: Props = serde_json::from_slice(body).ok()?;
    let slots = props.total_slots?.as_u64()?;
    usize::try_from(slots).ok().filter(|&n| n >= 1)
}

impl KindState {
    /// Whether the poller should read `/props`: a llama.cpp server, or an undetected node
    /// that has no `/api/version` (so it is no Ollama). Ollama has no `/props` route
    /// (`server/routes.go`), nor do other OpenAI-compatible servers once detected.
    pub fn may_have_props(&self, answered_version: bool) -> bool {
        match self.kind {
            NodeKind::LlamaCpp => true,
            NodeKind::Auto => !answered_version,
            NodeKind::Ollama | NodeKind::OllamaLegacy | NodeKind::Openai => false,
        }
    }

    /// A llama.cpp server runs the one model it was started with, whatever a request
    /// names (`tools/server/server-context.cpp`; its router mode aside), and has no
    /// `/api/ps` to say so: the model is loaded there.
    pub fn serves_its_one_model(&self) -> bool {
        self.kind == NodeKind::LlamaCpp
    }

    /// A `/props` answer with slots says the node is a llama.cpp server.
    pub fn learn_props(&mut self) {
        if self.kind == NodeKind::Auto {
            *self = KindState::configured(NodeKind::LlamaCpp);
        }
    }
}

/// Which cache report a reply carried.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplyShape {
    LlamaCppTimings,
    CachedTokens,
    OllamaCount,
    Other,
}

/// `"0.30.1"`, `"v0.12.3-rc1"` → (0, 30, 1), (0, 12, 3).
pub fn parse_version(version: &str) -> Option<(u32, u32, u32)> {
    let v = version.trim().trim_start_matches('v');
    let core = v.split(['-', '+', ' ']).next()?;
    let mut parts = core.split('.').map(|p| p.parse::<u32>().ok());
    let major = parts.next()??;
    let minor = parts.next().flatten().unwrap_or(0);
    let patch = parts.next().flatten().unwrap_or(0);
    Some((major, minor, patch))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_parse() {
        assert_eq!(parse_version("0.30.1"), Some((0, 30, 1)));
        assert_eq!(parse_version("v0.12.3-rc1"), Some((0, 12, 3)));
        assert_eq!(parse_version("0.33.0-rc2"), Some((0, 33, 0)));
        assert_eq!(parse_version("1.2"), Some((1, 2, 0)));
        assert_eq!(parse_version("dev"), None);
    }

    #[test]
    fn version_decides_ollama_kind_and_counting() {
        let learn = |v: &str| {
            let mut s = KindState::default();
            s.learn_version(v);
            s
        };
        let current = learn("0.33.0-rc2");
        assert_eq!(current.kind, NodeKind::Ollama);
        assert_eq!(current.counting, Counting::CachedAndEvaluated);
        assert_eq!(current.host_cache, Some(true));
        let first_llama_server = learn("0.30.0");
        assert_eq!(first_llama_server.kind, NodeKind::Ollama);
        assert_eq!(first_llama_server.counting, Counting::EvaluatedOnly);
        let old = learn("0.12.3");
        assert_eq!(old.kind, NodeKind::OllamaLegacy);
        assert_eq!(old.counting, Counting::EvaluatedOnly);
        assert_eq!(old.host_cache, Some(false));
        // A dev build says nothing.
        assert_eq!(learn("0.0.0"), KindState::default());
    }

    #[test]
    fn configured_kind_is_not_overridden() {
        let mut s = KindState::configured(NodeKind::OllamaLegacy);
        s.learn_version("0.33.0");
        s.learn_reply_shape(ReplyShape::LlamaCppTimings);
        assert_eq!(s.kind, NodeKind::OllamaLegacy);
    }

    /// Shaped as llama.cpp builds `GET /props` (`get_res_props`), trimmed; -np 2.
    #[test]
    fn props_show_a_llama_server_slots() {
        let real = br#"{"default_generation_settings":{"params":{"n_predict":-1},"n_ctx":2048},
            "total_slots":2,"model_alias":"model.gguf","endpoint_slots":true,
            "endpoint_props":false,"build_info":"b1-abc","is_sleeping":false}"#;
        assert_eq!(slots_from_props(real), Some(2));
        assert_eq!(slots_from_props(br#"{"total_slots":16}"#), Some(16));
        // Not a llama-server, or nonsense: nothing learned.
        assert_eq!(slots_from_props(b"404 page not found"), None);
        assert_eq!(slots_from_props(br#"{"error":"not found"}"#), None);
        assert_eq!(slots_from_props(br#"{"total_slots":0}"#), None);
        assert_eq!(slots_from_props(br#"{"total_slots":-1}"#), None);
        assert_eq!(slots_from_props(br#"{"total_slots":"2"}"#), None);
    }

    #[test]
    fn props_are_read_only_where_a_node_may_have_them() {
        let auto = KindState::default();
        assert!(auto.may_have_props(false));
        assert!(!auto.may_have_props(true));
        let llama = KindState::configured(NodeKind::LlamaCpp);
        assert!(llama.may_have_props(true));
        for kind in [NodeKind::Ollama, NodeKind::OllamaLegacy, NodeKind::Openai] {
            assert!(!KindState::configured(kind).may_have_props(false));
        }
        let mut s = KindState::default();
        s.learn_props();
        assert_eq!(s.kind, NodeKind::LlamaCpp);
        let mut s = KindState::configured(NodeKind::Openai);
        s.learn_props();
        assert_eq!(s.kind, NodeKind::Openai);
    }

    #[test]
    fn replies_reveal_llama_cpp_and_openai_servers() {
        let mut s = KindState::default();
        s.learn_reply_shape(ReplyShape::OllamaCount);
        assert_eq!(s.kind, NodeKind::Auto);
        s.learn_reply_shape(ReplyShape::LlamaCppTimings);
        assert_eq!(s.kind, NodeKind::LlamaCpp);
        let mut s = KindState::default();
        s.learn_reply_shape(ReplyShape::CachedTokens);
        assert_eq!(s.kind, NodeKind::Openai);
    }
}
