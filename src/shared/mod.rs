//! Several corral replicas acting as one through Redis or Valkey (`shared_state:`).
//!
//! Each replica keeps its own books, as a lone corral does, and tells the others on the
//! store's event channel what it sends where and when it ends ([`event`]); it applies what
//! they tell to its books, so that every replica sees the fleet's slots filled by all of them
//! and knows where their conversations are warm. What must never be decided twice, the last
//! free slot of a node, is a lease taken by one script on the store ([`store`]). What replies
//! taught about a node is written to the store every beat and read by a replica that starts.
//!
//! The request path waits on the store only to take a lease, at most `timeout`; past it, or
//! on any error, the request goes on as a lone corral would send it. Everything else is sent
//! and received by the background task ([`sync`]).

pub mod event;
mod link;
mod store;
mod sync;

pub use event::{Alive, Ended, Event, Sent, Waiting, Waits};
pub use link::{Acquired, Run, Shared, Slots, StoreMetrics, metrics};
pub use sync::{Replica, Service, Syncer};
