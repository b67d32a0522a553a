//! The fleet: every node, one view of each node's health (fed by active checks, polls and
//! real requests), and the background tasks that keep what corral knows about each node
//! current.
//!
//! The node list can change while corral runs (a configuration reload). A node keeps its
//! identity, and so its state and in-flight requests, across reloads as long as its name and
//! URL stay the same; requests already sent to a removed node finish normally.

mod check;
mod client;
mod ewma;
mod fair;
mod health;
pub mod kind;
mod node;
mod poller;
pub mod reply;
mod roster;
mod wake;
pub mod warm;

pub use check::Checker;
pub use ewma::Ewma;
pub use fair::ClientId;
pub use health::{Evidence, Rules, State};
pub use node::{Books, Inventory, ModelState, Node, Resident, Resolved, Slot, SuccessRatio};
pub use poller::Poller;
pub use reply::ReplyStats;
pub use roster::{Changes, Fleet};
pub use wake::{Listener, Requester, Wakeups};
