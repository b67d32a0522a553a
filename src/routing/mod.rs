//! Choosing a node for a request, in one pass ([`Router::decide`], `router.rs`): find where
//! its conversation is warm (`locate.rs`, reading only), take a view of every node as plain
//! data (`view.rs`), score each candidate on the eight signals, apply the named adjustments
//! and rank them (`choose.rs`, `signals.rs`, `score.rs`), and return the ranking
//! (`decision.rs`). Keeping the books while the request runs (in-flight counts, waits, load
//! reservations, slots, affinity, what the reply showed) is in `book.rs`; other replicas'
//! requests in `replicas.rs`. This file is an index: no file here imports one that imports it.

mod affinity;
mod book;
pub mod choose;
mod decision;
mod locate;
pub mod parallel;
pub mod placement;
mod remote;
mod replicas;
mod router;
pub mod score;
pub mod signals;
mod slots;
mod stay;
pub mod view;

pub use affinity::{AffinityTable, Entry};
pub use book::{Dispatch, Observation, Outcome, Reserved, WaitTicket};
pub use decision::{AffinityResult, Candidate, Decision, HostProbe, Pin, RouteError};
pub use replicas::Lease;
pub use router::{Placing, Router};
pub use score::Scores;
pub use stay::yields_to_warm;

#[cfg(test)]
mod tests;
