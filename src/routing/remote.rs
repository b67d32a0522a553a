//! What this replica knows of the other replicas' requests and waits (`shared_state:`);
//! [`super::replicas`] keeps it.

use hashbrown::HashMap;

/// Requests and waits of the other replicas.
#[derive(Default)]
pub(super) struct Remote {
    pub runs: HashMap<(u64, u64), RemoteRun>,
    /// Each replica's waits as it last listed them: node, model, count.
    pub waits: HashMap<u64, Vec<(u16, String, u32)>>,
}

pub(super) struct RemoteRun {
    pub node: u16,
    pub model: String,
    /// Its slot and conversation line, once its `Sent` came; none for a request known only
    /// as a lease holder.
    pub slot: Option<(usize, u64)>,
    /// The slot time its client was charged when its `Sent` came, settled by its end.
    pub charged: f64,
}
