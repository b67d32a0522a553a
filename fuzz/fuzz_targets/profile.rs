//! Profiling an untrusted request body: `Profile::parse` must return (a profile or an error)
//! for any bytes, for every endpoint, without panicking and without running long.
//!
//! The first byte picks the endpoint; the rest is the body.

#![no_main]

use corral::request::{Endpoint, PrefixChain, Profile, normalize_model};
use libfuzzer_sys::fuzz_target;

const ENDPOINTS: [Endpoint; 10] = [
    Endpoint::Chat,
    Endpoint::Generate,
    Endpoint::Embed,
    Endpoint::Embeddings,
    Endpoint::Show,
    Endpoint::OpenAiChat,
    Endpoint::OpenAiCompletions,
    Endpoint::OpenAiEmbeddings,
    Endpoint::OpenAiResponses,
    Endpoint::AnthropicMessages,
];

fuzz_target!(|data: &[u8]| {
    let Some((&selector, body)) = data.split_first() else {
        return;
    };
    let endpoint = ENDPOINTS[usize::from(selector) % ENDPOINTS.len()];
    if let Ok(p) = Profile::parse(endpoint, body) {
        // What the router relies on for any accepted body.
        assert_eq!(p.endpoint, endpoint);
        assert!(!p.model.trim().is_empty());
        assert_eq!(p.model_key, normalize_model(&p.model));
        assert_eq!(
            p.chain.hashes.first(),
            PrefixChain::start(&p.model_key).hashes.first(),
            "the chain starts at the model"
        );
        if !endpoint.generates() {
            assert_eq!(p.chain.depth(), 0, "{endpoint:?} keeps no prefix chain");
        }
    }
});
