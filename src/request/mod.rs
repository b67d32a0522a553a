//! What a client asked for: which endpoint, and the profile of its body.

mod conversation;
mod endpoint;
mod profile;

pub use conversation::{PrefixChain, prompt_chain};
pub use endpoint::{Endpoint, Route};
pub use profile::{Profile, ProfileError, normalize_model};
