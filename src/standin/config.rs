//! What a stand-in node is: its memory, its models on disk, its speed, and the faults it can
//! be told to show. Everything here is plain data; behaviour lives in the other modules.

use std::time::Duration;

use super::engine::{BatchRule, Order};

/// One gibibyte, the unit Ollama reports memory in.
pub const GIB: u64 = 1 << 30;

/// A model "on disk": listed by `/api/tags`, loadable if it fits in the node's memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StandinModel {
    /// Ollama-style name with tag, e.g. `llama3:8b`. A request for a name without a tag
    /// means `:latest`, as in Ollama.
    pub name: String,
    /// Bytes the model occupies once loaded (weights plus KV cache, as `/api/ps` reports).
    pub size_bytes: u64,
    /// Context length the model is loaded with unless a request asks for another `num_ctx`.
    pub context_length: u32,
}

impl StandinModel {
    /// A model with the given name, resident size and default context length.
    pub fn new(name: &str, size_bytes: u64, context_length: u32) -> Self {
        StandinModel {
            name: name.to_string(),
            size_bytes,
            context_length,
        }
    }

    /// Embedding-only models (Ollama's `nomic-embed-text`, `mxbai-embed-large`, ...) refuse
    /// chat and generate; the stand-in recognises them by name as it has no weights to ask.
    pub fn is_embedding_only(&self) -> bool {
        self.name.contains("embed")
    }
}

/// Everything that defines one stand-in node. Durations are simulated with real sleeps, so
/// tests use tiny values and the demo uses human-scale ones.
#[derive(Clone, Debug)]
pub struct StandinConfig {
    /// Node name, used in logs and by the demo.
    pub name: String,
    /// Memory available for models; the sizes of resident models always fit in it.
    pub memory_bytes: u64,
    /// Slots per loaded model (`OLLAMA_NUM_PARALLEL`): how many requests run at once and
    /// how many prompt prefixes stay warm per model.
    pub num_parallel: usize,
    /// Models on disk.
    pub models: Vec<StandinModel>,
    /// Models resident when the node starts, loaded with their default context length.
    pub preload: Vec<String>,
    /// Time to load a model that is not resident.
    pub load_time: Duration,
    /// Prefill cost of each prompt token that is not in the chosen slot's prefix cache.
    pub prefill_per_token: Duration,
    /// Time between output tokens.
    pub decode_per_token: Duration,
    /// Output tokens when the request does not say (`num_predict`, `max_tokens`).
    pub reply_tokens: u32,
    /// Idle time after which a resident model unloads, unless a request sets `keep_alive`.
    pub keep_alive: Duration,
    /// `OLLAMA_MULTIUSER_CACHE`: how a prompt that continues no slot picks one (see
    /// `slots::choose_slot`). Off, as in Ollama. Only for [`StandinKind::OllamaLegacy`].
    pub multiuser_cache: bool,
    /// Which real server the node behaves as: its slot rule, its host prompt cache, how
    /// its replies count cached tokens, what `/api/version` says.
    pub kind: StandinKind,
    /// The host-memory prompt cache of llama-server based kinds (`--cache-ram`), in
    /// tokens; 0 keeps none.
    pub cache_ram_tokens: u32,
    /// llama-server's `--cache-idle-slots` (on by default): when a task starts, every idle
    /// slot's prompt is copied into the host cache.
    pub cache_idle_slots: bool,
}

/// The real servers a stand-in can follow.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StandinKind {
    /// Ollama before 0.30 (`runner/ollamarunner/cache.go`): longest-prefix slots, no host
    /// cache, `prompt_eval_count` counts evaluated tokens; version 0.5.7.
    #[default]
    OllamaLegacy,
    /// Ollama 0.30.1 and later: a llama-server runner (slot similarity, host prompt cache,
    /// see `llama_server`), `prompt_eval_count` counts cached and evaluated tokens, its
    /// OpenAI `usage` has no cached-token details; version 0.33.0.
    Ollama,
    /// llama-server used directly: the same rule; replies carry `timings` (`cache_n`,
    /// `prompt_n`) and `usage.prompt_tokens_details.cached_tokens`; no `/api/version`.
    LlamaCpp,
    /// Another OpenAI-compatible server reporting `cached_tokens`; its prefix cache is
    /// the llama-server rule's as well; no `/api/version`.
    Openai,
}

impl StandinKind {
    /// Whether the node chooses slots as llama-server does, with a host prompt cache.
    pub fn is_llama_server(self) -> bool {
        !matches!(self, StandinKind::OllamaLegacy)
    }

    pub fn parse(name: &str) -> Option<StandinKind> {
        Some(match name {
            "ollama-legacy" => StandinKind::OllamaLegacy,
            "ollama" => StandinKind::Ollama,
            "llama-cpp" => StandinKind::LlamaCpp,
            "openai" => StandinKind::Openai,
            _ => return None,
        })
    }
}

impl StandinConfig {
    /// A fast node for tests: 64 GiB, 2 slots, `llama3:8b` on disk and preloaded, 200 ms
    /// loads, 50 µs prefill per token, 2 ms per output token, 8-token replies.
    pub fn new(name: &str) -> Self {
        StandinConfig {
            name: name.to_string(),
            memory_bytes: 64 * GIB,
            num_parallel: 2,
            models: vec![StandinModel::new("llama3:8b", 4_700_000_000, 8192)],
            preload: vec!["llama3:8b".to_string()],
            load_time: Duration::from_millis(200),
            prefill_per_token: Duration::from_micros(50),
            decode_per_token: Duration::from_millis(2),
            reply_tokens: 8,
            keep_alive: Duration::from_secs(5 * 60),
            multiuser_cache: false,
            kind: StandinKind::OllamaLegacy,
            cache_ram_tokens: 0,
            cache_idle_slots: true,
        }
    }

    /// How the node's server batches the work of its slots (see [`super::engine`]). Ollama
    /// passes its `num_batch` (512 by default: `api/types.go`) to its runner and to
    /// llama-server as `-b` (`llm/llama_server.go`); llama-server alone defaults to 2048; for
    /// other OpenAI-compatible servers (vLLM's scheduler also serves running requests' tokens
    /// first, then prompts under a token budget) the same rule with 2048 stands in.
    pub fn batch_rule(&self) -> BatchRule {
        let (order, batch_tokens) = match self.kind {
            StandinKind::OllamaLegacy => (Order::RoundRobin, 512),
            StandinKind::Ollama => (Order::DecodeFirst, 512),
            StandinKind::LlamaCpp | StandinKind::Openai => (Order::DecodeFirst, 2048),
        };
        BatchRule {
            order,
            batch_tokens,
            prefill_per_token: self.prefill_per_token,
            decode_per_token: self.decode_per_token,
        }
    }

    /// The model on disk with this name (`:latest` implied when the name has no tag).
    pub(crate) fn model(&self, name: &str) -> Option<&StandinModel> {
        let wanted = normalize_name(name);
        self.models
            .iter()
            .find(|m| normalize_name(&m.name) == wanted)
    }
}

/// Ollama treats `llama3` and `llama3:latest` as the same model.
pub(crate) fn normalize_name(name: &str) -> String {
    if name.contains(':') {
        name.to_string()
    } else {
        format!("{name}:latest")
    }
}

/// A misbehaviour the node shows to every new request until told otherwise.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Behave normally.
    None,
    /// Accept connections and read requests but never answer. A hung request's connection
    /// is closed when the fault changes or the node stops.
    Hang,
    /// On generating endpoints, send this many body chunks and then drop the connection
    /// without the terminating chunk. A non-streamed reply counts as one chunk: with 0 no
    /// body byte is sent, otherwise half of the JSON is sent before the cut.
    CutMidStream(u32),
    /// Answer every request with this status and `{"error":"injected fault"}`.
    Status(u16),
}

/// The three-node fleet `corral demo` starts: a fast GPU desktop, a laptop and a slow
/// mini PC, so that routing decisions are visible to a human watching the stream.
///
/// The numbers are of the order real hardware shows with 4-bit quantized models:
/// - desktop: a 24 GiB GPU (RTX 3090/4090 class). Prefill 20 µs/token (≈ 50k tokens/s),
///   decode 10 ms/token (≈ 100 tokens/s on an 8B model), 4 slots, loads in 1.5 s from NVMe.
/// - laptop: 16 GiB of unified memory (Apple M-series class). Prefill 80 µs/token
///   (≈ 12k tokens/s), decode 25 ms/token (≈ 40 tokens/s), 2 slots, loads in 3 s.
/// - minipc: 8 GiB usable by an iGPU or CPU. Prefill 200 µs/token (≈ 5k tokens/s),
///   decode 50 ms/token (≈ 20 tokens/s), 2 slots, loads in 5 s.
///
/// `llama3:8b` (4.7 GB) and the embedding model (274 MB) are everywhere; `qwen2.5:14b`
/// (9.0 GB) only fits comfortably on desktop and laptop; `llama3:70b` (40 GB) is on the
/// desktop's disk but fits nowhere, so requests for it fail as they would on Ollama.
/// Replies are 24 tokens so a human sees them stream.
pub fn demo_fleet() -> Vec<StandinConfig> {
    let llama8 = StandinModel::new("llama3:8b", 4_700_000_000, 8192);
    let qwen14 = StandinModel::new("qwen2.5:14b", 9_000_000_000, 8192);
    let embed = StandinModel::new("nomic-embed-text:latest", 274_000_000, 2048);
    let llama70 = StandinModel::new("llama3:70b", 40_000_000_000, 8192);
    vec![
        demo_node(
            ("desktop", 24, 4),
            vec![llama8.clone(), qwen14.clone(), embed.clone(), llama70],
            &["llama3:8b"],
            [1500, 20, 10],
        ),
        demo_node(
            ("laptop", 16, 2),
            vec![llama8.clone(), qwen14, embed.clone()],
            &["llama3:8b"],
            [3000, 80, 25],
        ),
        demo_node(("minipc", 8, 2), vec![llama8, embed], &[], [5000, 200, 50]),
    ]
}

/// One demo node: `(name, memory GiB, slots)`, its models, what it preloads, and
/// `timing` as `[load ms, prefill µs/token, decode ms/token]`.
fn demo_node(
    (name, memory_gib, num_parallel): (&str, u64, usize),
    models: Vec<StandinModel>,
    preload: &[&str],
    timing: [u64; 3],
) -> StandinConfig {
    StandinConfig {
        name: name.to_string(),
        memory_bytes: memory_gib * GIB,
        num_parallel,
        models,
        preload: preload.iter().map(|name| name.to_string()).collect(),
        load_time: Duration::from_millis(timing[0]),
        prefill_per_token: Duration::from_micros(timing[1]),
        decode_per_token: Duration::from_millis(timing[2]),
        reply_tokens: 24,
        keep_alive: Duration::from_secs(5 * 60),
        multiuser_cache: false,
        kind: StandinKind::OllamaLegacy,
        cache_ram_tokens: 0,
        cache_idle_slots: true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_without_tag_mean_latest() {
        let mut cfg = StandinConfig::new("n");
        cfg.models
            .push(StandinModel::new("nomic-embed-text:latest", 1, 2048));
        assert!(cfg.model("nomic-embed-text").is_some());
        assert!(cfg.model("llama3:8b").is_some());
        assert!(cfg.model("llama3").is_none());
    }

    #[test]
    fn demo_fleet_preloads_where_promised() {
        let fleet = demo_fleet();
        let names: Vec<_> = fleet.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["desktop", "laptop", "minipc"]);
        assert_eq!(fleet[0].preload, ["llama3:8b"]);
        assert_eq!(fleet[1].preload, ["llama3:8b"]);
        assert!(fleet[2].preload.is_empty());
        assert!(fleet[2].model("qwen2.5:14b").is_none());
        let too_big = fleet[0].model("llama3:70b").map(|m| m.size_bytes);
        assert!(too_big.is_some_and(|size| size > fleet[0].memory_bytes));
    }
}
