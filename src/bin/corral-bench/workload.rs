//! The four workloads and the conversations they are made of.
//!
//! A workload is generated once from its seed and replayed identically through every
//! policy: same conversations, same messages, same think times, same arrival order.

use std::sync::Arc;

use clap::ValueEnum;
use serde::Serialize;

use crate::fleet::{CHAT_MODEL, models};
use crate::rng::Rng;

/// Bytes of text per token, as the stand-in counts them.
pub const BYTES_PER_TOKEN: usize = 4;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum WorkloadKind {
    /// Long multi-turn chats: a pasted document, then follow-up questions.
    LongChat,
    /// Many users of a few applications, each with a long system prompt.
    SharedSystem,
    /// Several models, together larger than any one node's memory.
    ModelMix,
    /// More concurrent conversations than the fleet has slots.
    Overload,
    /// Three models on a fleet where each fits somewhere without evicting another, and
    /// conversations that start all at once (its own fleet: see `fleet::Plan`).
    Placement,
}

impl WorkloadKind {
    /// The workloads run when none is named. `placement` runs on a fleet of its own and
    /// is named explicitly (scripts/bench-placement.sh).
    pub const ALL: [WorkloadKind; 4] = [
        WorkloadKind::LongChat,
        WorkloadKind::SharedSystem,
        WorkloadKind::ModelMix,
        WorkloadKind::Overload,
    ];

    pub fn name(self) -> &'static str {
        match self {
            WorkloadKind::LongChat => "long-chat",
            WorkloadKind::SharedSystem => "shared-system",
            WorkloadKind::ModelMix => "model-mix",
            WorkloadKind::Overload => "overload",
            WorkloadKind::Placement => "placement",
        }
    }
}

/// The knobs of one workload. Durations are real-hardware seconds (see `TimeScale`).
#[derive(Clone, Debug, Serialize)]
pub struct WorkloadSpec {
    pub kind: WorkloadKind,
    pub conversations: usize,
    pub turns: usize,
    /// Conversations in progress at once.
    pub concurrency: usize,
    /// Tokens of the first turn's context: the pasted document (long-chat), each shared
    /// system prompt (shared-system), the first message (model-mix, overload).
    pub prompt_tokens: u32,
    /// Tokens of each later user message (on average; ±50%).
    pub followup_tokens: u32,
    /// Tokens the model is asked to reply (`num_predict`).
    pub reply_tokens: u32,
    /// A user's pause between a reply and the next message (on average; ±50%).
    pub think_secs: f64,
    /// Distinct system prompts shared by the conversations (shared-system only).
    pub system_prompts: usize,
    /// Models and their share of conversations.
    pub models: Vec<(String, u32)>,
    pub seed: u64,
    /// Slots of every node, instead of the fleet's own.
    pub node_slots: Option<usize>,
    /// corral's configuration leaves out every node's slots (`num_parallel`): it learns them.
    pub slots_untold: bool,
    /// Every node starts with no model loaded, as a fleet does each morning (models unload
    /// after `keep_alive`) and after a restart.
    pub cold_start: bool,
    /// The chat workloads run on three equal nodes instead of the replay fleet's four speeds.
    pub equal_nodes: bool,
}

/// Values given on the command line, applied to every selected workload.
#[derive(Clone, Debug, Default)]
pub struct Overrides {
    pub conversations: Option<usize>,
    pub turns: Option<usize>,
    pub concurrency: Option<usize>,
    pub prompt_tokens: Option<u32>,
    pub followup_tokens: Option<u32>,
    pub reply_tokens: Option<u32>,
    pub think_secs: Option<f64>,
    pub seed: Option<u64>,
    pub node_slots: Option<usize>,
    pub slots_untold: bool,
    pub cold_start: bool,
    pub equal_nodes: bool,
}

impl WorkloadSpec {
    /// The default size of each workload: large enough to show the effect, small enough
    /// that all four run through five policies in about five minutes at time scale 40.
    pub fn default_for(kind: WorkloadKind) -> WorkloadSpec {
        let chat_only = vec![(CHAT_MODEL.to_string(), 1)];
        let base = WorkloadSpec {
            kind,
            conversations: 12,
            turns: 6,
            concurrency: 6,
            prompt_tokens: 24_000,
            followup_tokens: 250,
            reply_tokens: 150,
            think_secs: 8.0,
            system_prompts: 0,
            models: chat_only,
            seed: 42,
            node_slots: None,
            slots_untold: false,
            cold_start: false,
            equal_nodes: false,
        };
        match kind {
            WorkloadKind::LongChat => base,
            WorkloadKind::SharedSystem => WorkloadSpec {
                conversations: 48,
                turns: 3,
                concurrency: 8,
                prompt_tokens: 6_000,
                followup_tokens: 200,
                system_prompts: 4,
                ..base
            },
            WorkloadKind::ModelMix => WorkloadSpec {
                conversations: 40,
                turns: 3,
                concurrency: 8,
                prompt_tokens: 3_000,
                followup_tokens: 200,
                models: model_mix(),
                ..base
            },
            WorkloadKind::Placement => WorkloadSpec {
                conversations: 24,
                turns: 5,
                concurrency: 6,
                prompt_tokens: 3_000,
                followup_tokens: 200,
                models: crate::fleet::placement_models()
                    .into_iter()
                    .map(|m| (m.name.to_string(), 1))
                    .collect(),
                ..base
            },
            WorkloadKind::Overload => WorkloadSpec {
                conversations: 36,
                turns: 4,
                concurrency: 18,
                prompt_tokens: 8_000,
                followup_tokens: 200,
                think_secs: 2.0,
                ..base
            },
        }
    }

    pub fn with(mut self, o: &Overrides) -> WorkloadSpec {
        self.conversations = o.conversations.unwrap_or(self.conversations).max(1);
        self.turns = o.turns.unwrap_or(self.turns).max(1);
        self.concurrency = o.concurrency.unwrap_or(self.concurrency).max(1);
        self.prompt_tokens = o.prompt_tokens.unwrap_or(self.prompt_tokens).max(1);
        self.followup_tokens = o.followup_tokens.unwrap_or(self.followup_tokens).max(1);
        self.reply_tokens = o.reply_tokens.unwrap_or(self.reply_tokens).max(1);
        self.think_secs = o.think_secs.unwrap_or(self.think_secs).max(0.0);
        self.seed = o.seed.unwrap_or(self.seed);
        self.node_slots = o.node_slots.map(|n| n.max(1)).or(self.node_slots);
        self.slots_untold |= o.slots_untold;
        self.cold_start |= o.cold_start;
        self.equal_nodes |= o.equal_nodes;
        self
    }
}

/// Popularity of the model-mix models: the small ones are asked for most.
fn model_mix() -> Vec<(String, u32)> {
    let weights = [30, 25, 20, 15, 10];
    models()
        .into_iter()
        .zip(weights)
        .map(|(m, w)| (m.name.to_string(), w))
        .collect()
}

/// One user's conversation, fixed before the replay starts.
#[derive(Debug)]
pub struct Conversation {
    pub id: usize,
    pub model: String,
    /// A system prompt, shared with other conversations in the shared-system workload.
    pub system: Option<Arc<str>>,
    /// The user's message on each turn.
    pub messages: Vec<String>,
    /// The pause before each turn after the first, in real seconds.
    pub think_secs: Vec<f64>,
    /// The pause before the first turn, in real seconds (spreads the first arrivals).
    pub start_secs: f64,
}

/// Generates every conversation of a workload from its seed.
pub fn conversations(spec: &WorkloadSpec) -> Vec<Arc<Conversation>> {
    let systems = shared_system_prompts(spec);
    (0..spec.conversations)
        .map(|id| Arc::new(conversation(spec, &systems, id)))
        .collect()
}

fn shared_system_prompts(spec: &WorkloadSpec) -> Vec<Arc<str>> {
    if spec.kind != WorkloadKind::SharedSystem {
        return Vec::new();
    }
    (0..spec.system_prompts.max(1))
        .map(|i| {
            let mut rng = Rng::derive(spec.seed, "system", i as u64);
            let bytes = rng.around(spec.prompt_tokens, 0.1) as usize * BYTES_PER_TOKEN;
            Arc::from(format!("You are assistant {i}. {}", rng.text(bytes)))
        })
        .collect()
}

fn conversation(spec: &WorkloadSpec, systems: &[Arc<str>], id: usize) -> Conversation {
    let mut rng = Rng::derive(spec.seed, spec.kind.name(), id as u64);
    let weights: Vec<u32> = spec.models.iter().map(|(_, w)| *w).collect();
    let drawn = rng.weighted(&weights);
    // Placement: a third per model, in turn, so that the first arrivals ask for every
    // model at once.
    let index = match spec.kind {
        WorkloadKind::Placement => id % spec.models.len().max(1),
        _ => drawn,
    };
    let model = spec
        .models
        .get(index)
        .map_or(CHAT_MODEL.to_string(), |(m, _)| m.clone());
    let system = (!systems.is_empty()).then(|| {
        let i = rng.below(systems.len() as u64) as usize;
        Arc::clone(&systems[i])
    });
    let first_tokens = match spec.kind {
        // The system prompt carries the long context; the question is short.
        WorkloadKind::SharedSystem => rng.around(spec.followup_tokens, 0.5),
        WorkloadKind::LongChat => rng.around(spec.prompt_tokens, 0.1),
        WorkloadKind::ModelMix | WorkloadKind::Overload | WorkloadKind::Placement => {
            rng.around(spec.prompt_tokens, 0.3)
        }
    };
    let mut messages = vec![format!(
        "[user {id}] {}",
        rng.text(first_tokens as usize * BYTES_PER_TOKEN)
    )];
    for _ in 1..spec.turns {
        let tokens = rng.around(spec.followup_tokens, 0.5) as usize;
        messages.push(rng.text(tokens * BYTES_PER_TOKEN));
    }
    let think_secs = (1..spec.turns)
        .map(|_| spec.think_secs * (0.5 + rng.unit()))
        .collect();
    let spread = spec.think_secs * rng.unit();
    Conversation {
        id,
        model,
        system,
        messages,
        think_secs,
        // Placement: the first conversations arrive together.
        start_secs: if spec.kind == WorkloadKind::Placement {
            0.0
        } else {
            spread
        },
    }
}

/// The prompt tokens a stand-in node counts for these messages: it renders each as
/// `<|role|>content\n` and counts 4 bytes a token, rounding up. Used to match the client's
/// turns with the nodes' logs.
pub fn rendered_tokens<'a>(messages: impl Iterator<Item = (&'a str, &'a str)>) -> u32 {
    let bytes: usize = messages
        .map(|(role, content)| role.len() + 4 + content.len() + 1)
        .sum();
    bytes.div_ceil(BYTES_PER_TOKEN) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workloads_are_reproducible() {
        let spec = WorkloadSpec::default_for(WorkloadKind::SharedSystem).with(&Overrides {
            conversations: Some(5),
            prompt_tokens: Some(100),
            ..Default::default()
        });
        let a = conversations(&spec);
        let b = conversations(&spec);
        assert_eq!(a.len(), 5);
        for (x, y) in a.iter().zip(&b) {
            assert_eq!(x.messages, y.messages);
            assert_eq!(x.system, y.system);
            assert_eq!(x.model, y.model);
        }
        assert!(
            a.iter()
                .all(|c| c.system.is_some() && c.messages.len() == 3)
        );
    }

    #[test]
    fn long_chat_opens_with_the_document() {
        let spec = WorkloadSpec::default_for(WorkloadKind::LongChat);
        let c = &conversations(&spec)[0];
        let tokens = c.messages[0].len() / BYTES_PER_TOKEN;
        assert!((21_000..=27_000).contains(&tokens), "{tokens}");
        assert_eq!(c.think_secs.len(), spec.turns - 1);
    }

    #[test]
    fn placement_asks_for_every_model_at_once() {
        let spec = WorkloadSpec::default_for(WorkloadKind::Placement);
        let c = conversations(&spec);
        let first: Vec<&str> = c[..6].iter().map(|c| c.model.as_str()).collect();
        for (model, _) in &spec.models {
            assert_eq!(first.iter().filter(|m| *m == model).count(), 2, "{model}");
        }
        assert!(c.iter().all(|c| c.start_secs == 0.0));
    }

    #[test]
    fn rendered_tokens_count_role_tags() {
        // "<|user|>" (8) + "abcd" (4) + "\n" (1) = 13 bytes: 4 tokens.
        assert_eq!(rendered_tokens([("user", "abcd")].into_iter()), 4);
    }
}
