//! Conversation identity derived from the body alone: a chain of hashes over message
//! boundaries.
//!
//! `h0 = H(model)` and `h_i = H(h_{i-1}, role_i, content_i, images_i)`. Turn N+1 of a
//! conversation repeats turn N's messages, so it contains turn N's deepest hash; the longest
//! hash found in the affinity table names the node holding the warmest prefix. Edited or
//! branched conversations and shared system prompts match at the depth they share.

use std::hash::Hasher;

use twox_hash::XxHash3_64;
use twox_hash::xxhash3_64::{RawHasher, SecretBuffer};

/// A streaming XXH3 hasher with the default secret. It allocates nothing, where
/// `XxHash3_64::new` boxes its secret: hashes are made on every request.
pub fn xxh3() -> impl Hasher {
    RawHasher::new(SecretBuffer::default())
}

/// Prompts of `/api/generate` and `/v1/completions` are hashed in blocks of this many bytes,
/// so that a prompt extending an earlier one shares its leading hashes.
pub const PROMPT_BLOCK: usize = 1024;

/// Hashes of every prefix of a request, shallowest first. `hashes[0]` is the model alone.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrefixChain {
    pub hashes: Vec<u64>,
}

impl PrefixChain {
    pub fn start(model: &str) -> PrefixChain {
        PrefixChain {
            hashes: vec![XxHash3_64::oneshot(model.as_bytes())],
        }
    }

    /// Extends the chain by one boundary made of the given parts.
    pub fn push(&mut self, parts: &[&[u8]]) {
        let mut h = xxh3();
        h.write(&self.last().to_le_bytes());
        for part in parts {
            // The length keeps ("ab","c") and ("a","bc") apart.
            h.write(&(part.len() as u64).to_le_bytes());
            h.write(part);
        }
        self.hashes.push(h.finish());
    }

    pub fn last(&self) -> u64 {
        self.hashes.last().copied().unwrap_or_default()
    }

    /// Number of boundaries past the model: messages, or prompt blocks.
    pub fn depth(&self) -> usize {
        self.hashes.len().saturating_sub(1)
    }
}

/// The chain of a plain prompt, hashed in fixed-size blocks after an optional system text.
pub fn prompt_chain(model: &str, system: Option<&[u8]>, prompt: &[u8]) -> PrefixChain {
    let mut chain = PrefixChain::start(model);
    if let Some(system) = system {
        chain.push(&[b"system", system]);
    }
    for block in prompt.chunks(PROMPT_BLOCK) {
        chain.push(&[block]);
    }
    chain
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(model: &str, msgs: &[(&str, &str)]) -> PrefixChain {
        let mut c = PrefixChain::start(model);
        for (role, content) in msgs {
            c.push(&[role.as_bytes(), content.as_bytes(), b""]);
        }
        c
    }

    #[test]
    fn the_chain_is_xxh3_streamed_as_if_hashed_whole() {
        // XXH3's published value for no input: hashes stay comparable across builds.
        assert_eq!(PrefixChain::start("").last(), 0x2d06_8005_38d3_94c2);
        // A part long enough for the vector path, streamed, as its bytes hashed at once.
        let long = vec![b'a'; 100_000];
        let mut chain = PrefixChain::start("m");
        chain.push(&[b"user", &long]);
        let mut whole = chain.hashes[0].to_le_bytes().to_vec();
        for part in [&b"user"[..], &long] {
            whole.extend((part.len() as u64).to_le_bytes());
            whole.extend(part);
        }
        assert_eq!(chain.last(), XxHash3_64::oneshot(&whole));
    }

    #[test]
    fn follow_up_contains_previous_turn() {
        let t1 = chat("m", &[("system", "be brief"), ("user", "hi")]);
        let t2 = chat(
            "m",
            &[
                ("system", "be brief"),
                ("user", "hi"),
                ("assistant", "hello"),
                ("user", "more"),
            ],
        );
        assert_eq!(t2.hashes[..t1.hashes.len()], t1.hashes[..]);
        assert_ne!(t2.last(), t1.last());
        assert_eq!(t2.depth(), 4);
    }

    #[test]
    fn model_role_and_boundaries_matter() {
        assert_ne!(
            chat("a", &[("user", "x")]).last(),
            chat("b", &[("user", "x")]).last()
        );
        assert_ne!(
            chat("a", &[("user", "x")]).last(),
            chat("a", &[("system", "x")]).last()
        );
        assert_ne!(
            chat("a", &[("user", "ab"), ("user", "c")]).last(),
            chat("a", &[("user", "a"), ("user", "bc")]).last()
        );
    }

    #[test]
    fn shared_system_prompt_shares_first_hash() {
        let a = chat(
            "m",
            &[("system", "long shared prompt"), ("user", "question a")],
        );
        let b = chat(
            "m",
            &[("system", "long shared prompt"), ("user", "question b")],
        );
        assert_eq!(a.hashes[1], b.hashes[1]);
        assert_ne!(a.hashes[2], b.hashes[2]);
    }

    #[test]
    fn prompts_share_leading_blocks() {
        let base = vec![b'x'; PROMPT_BLOCK * 2 + 10];
        let mut longer = base.clone();
        longer.extend_from_slice(&[b'y'; 500]);
        let a = prompt_chain("m", None, &base);
        let b = prompt_chain("m", None, &longer);
        assert_eq!(a.hashes[..3], b.hashes[..3]);
        assert_eq!(a.depth(), 3);
    }
}
