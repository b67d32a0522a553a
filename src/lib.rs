//! corral: a cache-aware load balancer for fleets of Ollama servers, built on Pingora.
//!
//! The modules follow a request's path: [`config`] says what the fleet is, [`request`] reads
//! and profiles a client's body, [`fleet`] holds what background tasks learned about every
//! node, [`routing`] scores the nodes and remembers where conversations are warm, and
//! [`proxy`] forwards the body and streams the reply back. [`standin`] is a simulated Ollama
//! node used by the demo, the tests and the benchmarks; it is compiled only with the `demo`
//! feature (on by default, off in the release image).

pub mod admin;
pub mod config;
pub mod fleet;
pub mod metrics;
pub mod proxy;
pub mod reload;
pub mod request;
pub mod routing;
pub mod server;
pub mod shared;
#[cfg(feature = "demo")]
pub mod standin;
pub mod tls;
