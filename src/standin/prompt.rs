//! How the stand-in turns a request into the text a model would see, counts its tokens, and
//! invents a deterministic reply.
//!
//! The render is what slots cache, so it follows the one rule that makes prefix caching
//! work in Ollama: turn N+1 of a conversation renders to turn N's render, plus the reply
//! the model gave, plus the new message. Token counts use a fixed 4 bytes per token, which is
//! close to real tokenizers on English text and keeps the arithmetic in tests obvious.

use twox_hash::XxHash3_64;

/// Bytes per token of rendered text.
pub const BYTES_PER_TOKEN: usize = 4;

/// Tokens an image costs, as a vision projector emits a fixed number of embeddings per image.
pub const IMAGE_TOKENS: usize = 256;

/// Dimensions of the stand-in's embeddings: small, as nothing reads their values.
pub const EMBEDDING_DIMS: usize = 8;

/// Words the replies are made of. Plain lowercase words keep every reply valid UTF-8 and
/// every word one token.
const WORDS: [&str; 32] = [
    "the", "model", "answer", "is", "cache", "token", "prefix", "warm", "node", "fleet", "quick",
    "slow", "light", "river", "stone", "cloud", "paper", "garden", "signal", "route", "llama",
    "corral", "field", "fence", "morning", "simple", "clear", "bright", "small", "steady", "open",
    "calm",
];

/// One chat message as the renderer needs it, whatever API it came from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Turn {
    pub role: String,
    pub content: String,
    /// Images as the client sent them (base64 or a URL): only their bytes' hash matters.
    pub images: Vec<String>,
}

/// Tokens in `len` bytes of rendered text (a partial token counts as one).
pub fn tokens_in(len: usize) -> u32 {
    saturating_u32(len.div_ceil(BYTES_PER_TOKEN))
}

/// Whole tokens two renders share from their start: the bytes in common, floored to tokens,
/// as a KV cache can only reuse whole tokens.
pub fn common_prefix_tokens(a: &[u8], b: &[u8]) -> u32 {
    let common = a.iter().zip(b).take_while(|(x, y)| x == y).count();
    saturating_u32(common / BYTES_PER_TOKEN)
}

/// Renders chat messages as `<|role|>IMAGES CONTENT\n`, concatenated.
pub fn render_chat(turns: &[Turn]) -> Vec<u8> {
    let mut out = Vec::new();
    for turn in turns {
        out.extend_from_slice(format!("<|{}|>", turn.role).as_bytes());
        for image in &turn.images {
            out.extend_from_slice(&image_block(image));
        }
        out.extend_from_slice(turn.content.as_bytes());
        out.push(b'\n');
    }
    out
}

/// Renders a completion prompt: the system prompt (if any) on its own line, then images,
/// then the prompt itself.
pub fn render_completion(system: Option<&str>, prompt: &str, images: &[String]) -> Vec<u8> {
    let mut out = Vec::new();
    if let Some(system) = system.filter(|s| !s.is_empty()) {
        out.extend_from_slice(system.as_bytes());
        out.push(b'\n');
    }
    for image in images {
        out.extend_from_slice(&image_block(image));
    }
    out.extend_from_slice(prompt.as_bytes());
    out
}

/// How a chat reply appears in the next turn's render, so the slot can hold exactly that.
pub fn render_chat_reply(reply: &str) -> Vec<u8> {
    render_chat(&[Turn {
        role: "assistant".to_string(),
        content: reply.to_string(),
        images: Vec::new(),
    }])
}

/// An image's place in the render: `IMAGE_TOKENS` tokens of text derived from its bytes, so
/// the same image renders the same and a different one breaks the prefix.
fn image_block(image: &str) -> Vec<u8> {
    let tag = format!("{:016x}", XxHash3_64::oneshot(image.as_bytes()));
    tag.bytes()
        .cycle()
        .take(IMAGE_TOKENS * BYTES_PER_TOKEN)
        .collect()
}

/// Keeps only the last `context` tokens of a render that does not fit the loaded context,
/// as Ollama truncates an overlong prompt from the front (which also defeats the prefix cache).
pub fn fit_to_context(mut render: Vec<u8>, context: u32) -> Vec<u8> {
    let room = context as usize * BYTES_PER_TOKEN;
    if render.len() > room {
        let excess_tokens = tokens_in(render.len()) as usize - context as usize;
        render.drain(..excess_tokens * BYTES_PER_TOKEN);
    }
    render
}

/// The reply's tokens, each with the spacing it is streamed with: words chosen by a PRNG
/// seeded from the render, so the same prompt always gets the same reply.
pub fn reply_tokens(render: &[u8], count: u32) -> Vec<String> {
    let mut rng = SplitMix64(XxHash3_64::oneshot(render));
    (0..count)
        .map(|i| {
            let word = WORDS[(rng.next() % WORDS.len() as u64) as usize];
            if i == 0 {
                word.to_string()
            } else {
                format!(" {word}")
            }
        })
        .collect()
}

/// A unit-length embedding derived from the text, so equal inputs embed equally.
pub fn embedding(text: &str) -> Vec<f32> {
    let raw: Vec<f32> = (0..EMBEDDING_DIMS as u64)
        .map(|dim| {
            let h = XxHash3_64::oneshot_with_seed(dim, text.as_bytes());
            (h >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect();
    let norm = raw.iter().map(|x| x * x).sum::<f32>().sqrt();
    if norm > 0.0 {
        raw.iter().map(|x| x / norm).collect()
    } else {
        raw
    }
}

fn saturating_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// SplitMix64: tiny, fast and good enough to pick words deterministically.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn turn(role: &str, content: &str) -> Turn {
        Turn {
            role: role.to_string(),
            content: content.to_string(),
            images: Vec::new(),
        }
    }

    #[test]
    fn tokens_are_four_bytes_rounded_up() {
        assert_eq!(tokens_in(0), 0);
        assert_eq!(tokens_in(1), 1);
        assert_eq!(tokens_in(4), 1);
        assert_eq!(tokens_in(5), 2);
        assert_eq!(tokens_in(400), 100);
    }

    #[test]
    fn common_prefix_counts_whole_tokens_only() {
        assert_eq!(common_prefix_tokens(b"abcdefgh", b"abcdefgX"), 1);
        assert_eq!(common_prefix_tokens(b"abcdefgh", b"abcdefgh"), 2);
        assert_eq!(common_prefix_tokens(b"abc", b"abc"), 0);
        assert_eq!(common_prefix_tokens(b"", b"abcd"), 0);
        assert_eq!(common_prefix_tokens(b"Xbcdefgh", b"abcdefgh"), 0);
    }

    #[test]
    fn chat_render_concatenates_roles_and_contents() {
        let render = render_chat(&[turn("system", "be brief"), turn("user", "hi")]);
        assert_eq!(render, b"<|system|>be brief\n<|user|>hi\n");
    }

    #[test]
    fn next_turn_extends_the_previous_render_with_the_reply() {
        let first = vec![turn("user", "hello there")];
        let prompt = render_chat(&first);
        let reply: String = reply_tokens(&prompt, 5).concat();
        let mut held = prompt.clone();
        held.extend(render_chat_reply(&reply));

        let mut second = first;
        second.push(turn("assistant", &reply));
        second.push(turn("user", "and then?"));
        let next = render_chat(&second);
        assert!(next.starts_with(&held));
    }

    #[test]
    fn images_cost_fixed_tokens_and_differ_by_content() {
        let mut with_image = turn("user", "");
        with_image.images = vec!["aGVsbG8=".to_string()];
        let base = tokens_in(render_chat(&[turn("user", "")]).len());
        let render = render_chat(std::slice::from_ref(&with_image));
        assert_eq!(tokens_in(render.len()), base + IMAGE_TOKENS as u32);

        let mut other = with_image.clone();
        other.images = vec!["d29ybGQ=".to_string()];
        assert_ne!(render, render_chat(&[other]));
    }

    #[test]
    fn completion_render_prepends_system() {
        assert_eq!(render_completion(Some("sys"), "go", &[]), b"sys\ngo");
        assert_eq!(render_completion(None, "go", &[]), b"go");
    }

    #[test]
    fn replies_are_deterministic_words() {
        let a = reply_tokens(b"prompt", 6);
        assert_eq!(a, reply_tokens(b"prompt", 6));
        assert_eq!(a.len(), 6);
        assert!(!a[0].starts_with(' '));
        assert!(a[1..].iter().all(|t| t.starts_with(' ')));
        assert_ne!(a, reply_tokens(b"other prompt", 6));
    }

    #[test]
    fn overlong_prompts_keep_their_tail() {
        let render = b"aaaabbbbccccdd".to_vec(); // 4 tokens
        assert_eq!(fit_to_context(render.clone(), 8), render);
        assert_eq!(fit_to_context(render, 2), b"ccccdd");
    }

    #[test]
    fn embeddings_are_unit_vectors_and_stable() {
        let e = embedding("hello");
        assert_eq!(e.len(), EMBEDDING_DIMS);
        let norm: f32 = e.iter().map(|x| x * x).sum();
        assert!((norm - 1.0).abs() < 1e-4);
        assert_eq!(e, embedding("hello"));
        assert_ne!(e, embedding("world"));
    }
}
