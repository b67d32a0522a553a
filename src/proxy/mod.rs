//! The proxy: Pingora's HTTP service (`corral.rs`), with every request answered in
//! `request_filter`. A request is classified by path; fleet-wide endpoints are answered from
//! state (`local.rs`); routed endpoints have their body read (`body.rs`), profiled and scored,
//! and are forwarded (`forward.rs`): sent and streamed back (`relay.rs`), their reply
//! accounted for (`account.rs`); embedding batches are split over nodes (`fanout.rs`).
//! This file is an index: no file here imports one that imports it.

mod access;
mod access_log;
mod account;
mod batch;
mod body;
mod clients;
mod corral;
mod ctx;
mod fanout;
mod forward;
mod head;
mod headers;
mod local;
mod relay;
mod respond;
mod usage;

pub use access::{bearer, same_secret};
pub use access_log::AccessLog;
pub use corral::Corral;
pub use ctx::RequestCtx;
pub use head::ClientConnections;
