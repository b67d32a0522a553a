//! What a client asked for: which endpoint, and the profile of its body.

mod conversation;
mod endpoint;
mod fields;
mod multipart;
mod profile;
pub mod session;

pub(crate) use conversation::xxh3;
pub use conversation::{PrefixChain, prompt_chain};
pub use endpoint::{Endpoint, ErrorShape, Route};
pub use multipart::form_field;
pub use profile::{Profile, ProfileError, normalize_model};
