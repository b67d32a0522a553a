//! What a decision is: the candidates ranked best first, where the conversation was found
//! warm, and why a request could not be placed (with the HTTP status that says so).

use std::sync::Arc;

use super::Scores;
use crate::fleet::Node;

/// The node holding a request's longest warm prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pin {
    /// The node's id.
    pub node: u16,
    pub lineage: u64,
    /// Boundaries of the request that the node holds.
    pub depth: usize,
    /// The prefix is the whole of what the slot holds: the request continues that slot's
    /// conversation (rather than branching from it or sharing its system prompt).
    pub continues: bool,
    /// The prefix is not in a slot but saved in the node's host-memory prompt cache.
    pub in_host: bool,
    /// corral expects the node to hold it still ([`crate::fleet::warm::HostPlace::expected`]): always in
    /// a slot; in the host cache, by what replies have shown of its capacity.
    pub expected: bool,
}

/// A conversation found in a node's host-cache mirror, warm or not by the learned capacity:
/// the reply will show which, and so correct the capacity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostProbe {
    pub node: u16,
    pub needed: u64,
    /// Conversations saved after it (u32: a dispatch carries this, and stays small).
    pub newer: u32,
}

/// A node as ranked for a request. Choosing ranks views of the nodes (`N` is a
/// [`NodeView`](super::view::NodeView) there); the decision hands each out with its node.
pub struct Candidate<N = Arc<Node>> {
    pub node: N,
    pub scores: Scores,
    /// The model is resident there, or loading for a request corral already sent: sending
    /// the request starts no load.
    pub resident: bool,
    /// Loading the model there would have to unload a model that requests are running or
    /// waiting for: ranked after every node where it would not.
    pub evicts_busy: bool,
    /// Failing health checks or cut off by its circuit breaker: only a last resort.
    pub standby: bool,
}

impl<N> Candidate<N> {
    /// The same ranking, about another handle on the node.
    pub fn with_node<M>(self, node: M) -> Candidate<M> {
        Candidate {
            node,
            scores: self.scores,
            resident: self.resident,
            evicts_busy: self.evicts_busy,
            standby: self.standby,
        }
    }
}

pub struct Decision {
    /// Best first.
    pub ranked: Vec<Candidate>,
    pub pin: Option<Pin>,
    /// The request continues a conversation: it carries an earlier reply, or its prefix was
    /// known and has gone cold.
    pub follow_up: bool,
    /// The client named the node (a management call): nothing was scored or chosen.
    pub direct: bool,
    /// Where corral expects the conversation in a node's host cache, to check the reply.
    pub probe: Option<HostProbe>,
}

/// What `X-Fleet-Affinity` reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AffinityResult {
    /// Sent to the node holding the conversation's warm prefix in a slot.
    Hit,
    /// Sent to the node holding it in its host-memory prompt cache.
    Host,
    /// A follow-up sent where its prefix is not expected warm.
    Miss,
    /// Nothing to be warm yet.
    New,
}

impl AffinityResult {
    pub fn as_str(self) -> &'static str {
        match self {
            AffinityResult::Hit => "hit",
            AffinityResult::Host => "host",
            AffinityResult::Miss => "miss",
            AffinityResult::New => "new",
        }
    }

    /// corral expects the prefix warm there: in a slot or in host memory.
    pub fn is_warm(self) -> bool {
        matches!(self, AffinityResult::Hit | AffinityResult::Host)
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RouteError {
    NoHealthyNode,
    ModelNotFound(String),
    /// The model exists but no healthy node has the memory for it.
    TooLarge {
        model: String,
        need: u64,
    },
}

impl RouteError {
    /// The HTTP status a client gets: 404 for a model no node has, 503 (worth retrying)
    /// otherwise.
    pub fn status(&self) -> u16 {
        match self {
            RouteError::ModelNotFound(_) => 404,
            RouteError::NoHealthyNode | RouteError::TooLarge { .. } => 503,
        }
    }
}

impl std::fmt::Display for RouteError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RouteError::NoHealthyNode => f.write_str("no healthy node in the fleet"),
            RouteError::ModelNotFound(model) => write!(f, "model '{model}' not found"),
            RouteError::TooLarge { model, need } => write!(
                f,
                "model '{model}' needs {:.1} GB, more memory than any healthy node has",
                *need as f64 / 1e9
            ),
        }
    }
}

impl Decision {
    /// A request the client sent to the node it named.
    pub fn direct(node: Arc<Node>) -> Decision {
        Decision {
            ranked: vec![Candidate {
                node,
                scores: Scores::default(),
                resident: true,
                evicts_busy: false,
                standby: false,
            }],
            pin: None,
            follow_up: false,
            direct: true,
            probe: None,
        }
    }

    /// The best candidate for which `tried` is false. The ranking is the fallback order:
    /// standby nodes (failing checks, breaker open) come after every live one.
    pub fn best_untried(&self, tried: impl Fn(u16) -> bool) -> Option<&Candidate> {
        self.ranked.iter().find(|c| !tried(c.node.id))
    }

    /// The request's prefix is expected warm on the node with this id.
    pub fn warm_on(&self, node: u16) -> bool {
        self.affinity_for(node).is_warm()
    }

    /// The affinity result if the request goes to the node with this id.
    pub fn affinity_for(&self, node: u16) -> AffinityResult {
        match self.pin {
            // Sent to its node, the only one that may hold it, but expected cold there.
            Some(pin) if pin.node == node && !pin.expected => AffinityResult::Miss,
            Some(pin) if pin.node == node && pin.in_host => AffinityResult::Host,
            Some(pin) if pin.node == node => AffinityResult::Hit,
            Some(_) => AffinityResult::Miss,
            None if self.follow_up => AffinityResult::Miss,
            None => AffinityResult::New,
        }
    }
}
