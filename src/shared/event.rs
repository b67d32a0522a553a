//! What one replica tells the others, on the store's event channel: the requests it sends and
//! ends, and every beat which of them still run and what waits. Nodes and models go by name,
//! which every replica reads from the same configuration.

use serde::{Deserialize, Serialize};

/// One message on the channel. JSON: small, and readable with `redis-cli subscribe`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    Sent(Sent),
    Ended(Ended),
    Alive(Alive),
    Waits(Waits),
}

impl Event {
    /// The replica that sent it.
    pub fn replica(&self) -> u64 {
        match self {
            Event::Sent(e) => e.replica,
            Event::Ended(e) => e.replica,
            Event::Alive(e) => e.replica,
            Event::Waits(e) => e.replica,
        }
    }
}

/// A replica sent a request to a node, which put it in a slot.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Sent {
    pub replica: u64,
    /// The replica's number for the request, unique while the replica runs.
    pub run: u64,
    pub node: String,
    pub model: String,
    /// The slot the replica's mirror gave it, and the conversation line it holds there.
    pub slot: usize,
    pub lineage: u64,
    /// Boundaries of the conversation the slot holds after the request.
    pub depth: usize,
    /// Prompt tokens, as estimated.
    pub tokens: u64,
    /// Estimated tokens of its first message, which conversations opening alike share.
    #[serde(default)]
    pub first_tokens: u64,
    /// Prefix hashes now warm there: the conversation's deepest, then its first boundary
    /// where that is another (so the last is always its first message).
    pub prefixes: Vec<u64>,
    /// The explicit session key, if the request had one.
    pub session: Option<u64>,
    /// Whose request it is (`key:NAME` or `addr:IP`): the fair order between clients charges
    /// it a slot's use from its start, as the replica that sent it does.
    #[serde(default)]
    pub client: Option<String>,
}

/// A request a replica sent has ended: its slot is free.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Ended {
    pub replica: u64,
    pub run: u64,
    /// The reply came: the slot holds the conversation. False when the request failed
    /// before any reply, so the slot is not known to hold anything.
    pub kept: bool,
    /// Whose request it was (`key:NAME` or `addr:IP`) and how long it held the slot, in
    /// seconds: what it counts in the fair order between clients.
    #[serde(default)]
    pub client: Option<String>,
    #[serde(default)]
    pub held_s: f64,
}

/// Sent every beat: the replica is alive, these of its requests run, these wait.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Alive {
    pub replica: u64,
    pub runs: Vec<u64>,
    pub waits: Vec<Waiting>,
}

/// Sent soon after a replica's waiting requests change, between beats: what waits now, as in
/// [`Alive::waits`]. A beat is a quarter of the lease (2 s by default), and a queue listed
/// that long ago has often moved on: a node would look busy with requests already served.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Waits {
    pub replica: u64,
    pub waits: Vec<Waiting>,
}

/// Requests a replica has waiting for a node, per model.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Waiting {
    pub node: String,
    pub model: String,
    pub count: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_travel_as_tagged_json() {
        let sent = Event::Sent(Sent {
            replica: 7,
            run: 3,
            node: "gpu".into(),
            model: "llama3:8b".into(),
            slot: 1,
            lineage: 99,
            depth: 2,
            tokens: 1200,
            first_tokens: 800,
            prefixes: vec![5, 6],
            session: None,
            client: Some("key:team-a".into()),
        });
        let text = serde_json::to_string(&sent).unwrap();
        assert!(text.starts_with(r#"{"event":"sent","replica":7"#), "{text}");
        assert_eq!(serde_json::from_str::<Event>(&text).unwrap(), sent);
        let ended = r#"{"event":"ended","replica":7,"run":3,"kept":true}"#;
        let ended: Event = serde_json::from_str(ended).unwrap();
        assert_eq!(ended.replica(), 7);
        let waits =
            r#"{"event":"waits","replica":7,"waits":[{"node":"gpu","model":"m","count":2}]}"#;
        let waits: Event = serde_json::from_str(waits).unwrap();
        assert_eq!(waits.replica(), 7);
        assert!(serde_json::from_str::<Event>(r#"{"event":"other"}"#).is_err());
    }
}
