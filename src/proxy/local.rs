//! Endpoints corral answers from fleet state, without forwarding: the fleet looks like one
//! Ollama whose models are the union of its healthy nodes' models.

use std::collections::BTreeMap;

use serde_json::{Value, json};

use crate::fleet::Fleet;
use crate::request::normalize_model;

/// `/api/tags`: every model on disk on some healthy node, once.
pub fn tags(fleet: &Fleet) -> Value {
    json!({ "models": union(fleet, |inv| &inv.tags_entries) })
}

/// `/api/ps`: every model resident on some healthy node, once.
pub fn ps(fleet: &Fleet) -> Value {
    json!({ "models": union(fleet, |inv| &inv.ps_entries) })
}

/// `/v1/models`, OpenAI's shape of the same list as `/api/tags`.
pub fn openai_models(fleet: &Fleet) -> Value {
    let data: Vec<Value> = union(fleet, |inv| &inv.tags_entries)
        .iter()
        .filter_map(|m| {
            let id = m.get("name").or_else(|| m.get("model"))?.as_str()?;
            Some(json!({ "id": id, "object": "model", "created": 0, "owned_by": "library" }))
        })
        .collect();
    json!({ "object": "list", "data": data })
}

/// `/v1/models/{model}`: one model of the fleet's union, in OpenAI's shape.
pub fn openai_model(fleet: &Fleet, name: &str) -> Option<Value> {
    let wanted = normalize_model(name);
    let models = openai_models(fleet);
    models["data"]
        .as_array()?
        .iter()
        .find(|m| {
            m["id"]
                .as_str()
                .is_some_and(|id| normalize_model(id) == wanted)
        })
        .cloned()
}

/// `/api/status`: Ollama reports whether its cloud models and web tools are turned off.
/// corral routes only to models on its nodes' disks and does not forward the web tools, so
/// for a client of corral they are off, by corral's configuration.
pub fn status() -> Value {
    json!({ "cloud": { "disabled": true, "source": "config" } })
}

/// `/api/version`: the oldest version among healthy nodes, since a client can rely only on
/// what every node it may land on supports.
pub fn version(fleet: &Fleet) -> Value {
    let oldest = fleet
        .healthy()
        .iter()
        .filter_map(|n| n.inventory().version.clone())
        .min_by(|a, b| version_key(a).cmp(&version_key(b)));
    json!({ "version": oldest.unwrap_or_else(|| "0.0.0".into()) })
}

fn version_key(v: &str) -> Vec<u64> {
    v.split(|c: char| !c.is_ascii_digit())
        .filter_map(|p| p.parse().ok())
        .collect()
}

fn union(fleet: &Fleet, pick: impl Fn(&crate::fleet::Inventory) -> &Vec<Value>) -> Vec<Value> {
    let mut by_name: BTreeMap<String, Value> = BTreeMap::new();
    for node in fleet.healthy().iter() {
        let inv = node.inventory();
        for entry in pick(&inv) {
            let Some(name) = entry
                .get("name")
                .or_else(|| entry.get("model"))
                .and_then(Value::as_str)
            else {
                continue;
            };
            by_name
                .entry(normalize_model(name))
                .or_insert_with(|| entry.clone());
        }
    }
    by_name.into_values().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_compare_numerically() {
        assert!(version_key("0.10.1") > version_key("0.9.7"));
        assert!(version_key("0.5.7-standin") < version_key("0.5.10"));
    }
}
