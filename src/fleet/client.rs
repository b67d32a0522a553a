//! The GET requests of the active check and the poller, over the same transport as client
//! requests (Pingora's connector): plain or TLS with SNI from the node's URL and its roots
//! (see [`Node::peer`]), so a node the checks call healthy is one requests can reach.
//!
//! Every GET uses a fresh connection: a few requests per node every couple of seconds, and
//! no pooled connection outlives the runtime it was made on (the first poll runs before
//! Pingora's own runtimes start).

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use pingora_core::connectors::TransportConnector;
use pingora_core::protocols::http::v1::client::HttpSession;
use pingora_core::{ErrorType, Result as PingoraResult};
use pingora_http::RequestHeader;

use super::node::Node;

/// A reply larger than this is not a model list: the node is not what corral expects.
const MAX_BODY: usize = 16 * 1024 * 1024;

pub struct NodeClient {
    transport: TransportConnector,
    /// Connect, send and read the whole reply within this.
    timeout: Duration,
}

/// Why a GET got no reply.
#[derive(Debug)]
pub enum GetError {
    /// The connection was refused or failed: nothing listens there.
    Connect(String),
    /// No whole reply in time, or a reply that could not be read.
    Other(String),
}

impl std::fmt::Display for GetError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GetError::Connect(e) => write!(f, "connect: {e}"),
            GetError::Other(e) => f.write_str(e),
        }
    }
}

impl NodeClient {
    pub fn new(timeout: Duration) -> NodeClient {
        NodeClient {
            transport: TransportConnector::new(None),
            timeout,
        }
    }

    /// `GET path` on the node: the reply's status and body.
    pub async fn get(&self, node: &Node, path: &str) -> Result<(u16, Bytes), GetError> {
        match tokio::time::timeout(self.timeout, self.exchange(node, path)).await {
            Ok(result) => result,
            Err(_) => Err(GetError::Other(format!(
                "no reply within {:?}",
                self.timeout
            ))),
        }
    }

    async fn exchange(&self, node: &Node, path: &str) -> Result<(u16, Bytes), GetError> {
        let peer = node
            .peer(self.timeout)
            .ok_or_else(|| GetError::Connect("its host name does not resolve".into()))?;
        let stream = self.transport.new_stream(&peer).await.map_err(|e| {
            use ErrorType::*;
            let message = e.to_string();
            match e.etype() {
                ConnectTimedout | ConnectRefused | ConnectNoRoute | ConnectError => {
                    GetError::Connect(message)
                }
                // A TLS failure is the node's configuration, not its absence.
                _ => GetError::Other(message),
            }
        })?;
        let mut session = HttpSession::new_with_options(stream, &peer);
        let other = |e: Box<pingora_core::Error>| GetError::Other(e.to_string());
        let request = request(node, path).map_err(other)?;
        session
            .write_request_header(Box::new(request))
            .await
            .map_err(other)?;
        session.finish_body().await.map_err(other)?;
        let header = session.read_resp_header_parts().await.map_err(other)?;
        let mut body = BytesMut::new();
        while let Some(chunk) = session.read_body_bytes().await.map_err(other)? {
            if body.len() + chunk.len() > MAX_BODY {
                return Err(GetError::Other(format!(
                    "{path}: reply over {MAX_BODY} bytes"
                )));
            }
            body.extend_from_slice(&chunk);
        }
        Ok((header.status.as_u16(), body.freeze()))
    }
}

fn request(node: &Node, path: &str) -> PingoraResult<RequestHeader> {
    let mut request = RequestHeader::build("GET", path.as_bytes(), None)?;
    request.insert_header("Host", node.host_value().clone())?;
    request.insert_header("Accept", "application/json")?;
    request.insert_header("Connection", "close")?;
    request.insert_header("User-Agent", "corral")?;
    Ok(request)
}
