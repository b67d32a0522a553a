//! Embedding batches fan out. Ollama runs one embedding request at a time per embedding
//! model (`server/sched.go` loads them with one parallel slot), so a batch of many inputs
//! sent to one node runs serially there; the maintainers' advice is several servers behind a
//! proxy (ollama#6262). An `/api/embed` or `/v1/embeddings` request whose `input` list is
//! longer than `embed_fanout.chunk_size` is split into chunks of at most that many inputs,
//! sent to the nodes that hold the model (each node takes the next chunk when it finishes
//! one), and the replies are merged, in input order, into the answer one node would give.
//! A chunk whose node fails (refused, reset, timed out, 5xx or 404) goes to another node,
//! at most `limits.max_retries` times; a 4xx is the client's error and is answered as is.

use std::collections::{BTreeMap, VecDeque};
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use parking_lot::Mutex;
use pingora_core::Result;
use pingora_http::RequestHeader;
use pingora_proxy::Session;
use serde_json::value::RawValue;
use tokio::sync::Notify;

use super::ctx::RequestCtx;
use super::forward::Forwarder;
use super::relay::{Wait, peer, race, upstream_request};
use super::usage::TokenUsage;
use crate::config::Config;
use crate::request::{Endpoint, Profile};
use crate::routing::{Candidate, Decision, Outcome, Router};

/// Largest reply of one chunk: a chunk's vectors, with room for wide models.
const MAX_CHUNK_REPLY: usize = 256 << 20;

type Fields = BTreeMap<String, Box<RawValue>>;

/// A request body whose `input` is a list long enough to split.
pub struct Batch {
    /// Every field of the body as sent; `input` is replaced per chunk.
    fields: Fields,
    inputs: Vec<Box<RawValue>>,
    chunk_size: usize,
}

impl Batch {
    /// The batch in `body`, when its `input` is a list of more than `chunk_size` inputs
    /// (strings, or token lists). A list of numbers is one tokenized input, not a batch.
    pub fn split(body: &[u8], chunk_size: usize) -> Option<Batch> {
        let fields: Fields = serde_json::from_slice(body).ok()?;
        let inputs: Vec<Box<RawValue>> = serde_json::from_str(fields.get("input")?.get()).ok()?;
        let is_input = |raw: &RawValue| matches!(raw.get().as_bytes().first(), Some(b'"' | b'['));
        if inputs.len() <= chunk_size.max(1) || !inputs.iter().all(|raw| is_input(raw)) {
            return None;
        }
        Some(Batch {
            fields,
            inputs,
            chunk_size: chunk_size.max(1),
        })
    }

    /// The inputs of each chunk, in order.
    pub fn chunks(&self) -> Vec<Range<usize>> {
        (0..self.inputs.len())
            .step_by(self.chunk_size)
            .map(|start| start..(start + self.chunk_size).min(self.inputs.len()))
            .collect()
    }

    /// The body of one chunk: the request's fields with these inputs.
    pub fn body(&self, range: Range<usize>) -> Vec<u8> {
        let items: Vec<&str> = self.inputs[range].iter().map(|i| i.get()).collect();
        let mut fields = self.fields.clone();
        if let Ok(input) = RawValue::from_string(format!("[{}]", items.join(","))) {
            fields.insert("input".into(), input);
        }
        serde_json::to_vec(&fields).unwrap_or_default()
    }
}

/// The nodes a batch is spread over, best first, and the best one's score.
pub struct Spread {
    pub nodes: Vec<Arc<crate::fleet::Node>>,
    pub best_score: f64,
}

/// The best candidate, and every other live candidate where the model is resident, at most
/// `max_nodes`. `None` when that is one node: then the batch is not split.
pub fn spread(decision: &Decision, max_nodes: usize) -> Option<Spread> {
    let mut live = decision.ranked.iter().filter(|c| !c.standby);
    let best: &Candidate = live.next()?;
    let nodes: Vec<_> = std::iter::once(best)
        .chain(live.filter(|c| c.resident))
        .take(max_nodes.max(1))
        .map(|c| c.node.clone())
        .collect();
    (nodes.len() > 1).then(|| Spread {
        nodes,
        best_score: best.scores.total(),
    })
}

/// A chunk waiting for a node, and the nodes that failed it.
struct Chunk {
    index: usize,
    tried: Vec<u16>,
}

#[derive(Default)]
struct Shared {
    pending: VecDeque<Chunk>,
    in_flight: usize,
    replies: Vec<Option<Bytes>>,
    /// A 4xx from a node: the client's error, answered as the node gave it.
    client_error: Option<(u16, Bytes)>,
    failures: Vec<String>,
    /// Nodes that served at least one chunk, by name.
    served_by: Vec<String>,
}

/// What every worker shares.
struct Plan<'a> {
    forwarder: &'a Forwarder,
    router: &'a Arc<Router>,
    config: &'a Config,
    profile: &'a Profile,
    batch: &'a Batch,
    ranges: Vec<Range<usize>>,
    client: RequestHeader,
    /// The client, for its place among the clients waiting for a slot.
    requester: crate::fleet::Requester,
    shared: Mutex<Shared>,
    changed: Notify,
}

/// Answers a batch from the nodes of `spread`.
#[allow(clippy::too_many_arguments)]
pub async fn serve(
    forwarder: &Forwarder,
    router: &Arc<Router>,
    session: &mut Session,
    ctx: &mut RequestCtx,
    profile: &Profile,
    batch: Batch,
    spread: Spread,
    config: &Config,
) -> Result<()> {
    let Spread { nodes, best_score } = spread;
    let started = Instant::now();
    let ranges = batch.chunks();
    let shared = Shared {
        pending: (0..ranges.len())
            .map(|index| Chunk {
                index,
                tried: Vec::new(),
            })
            .collect(),
        replies: vec![None; ranges.len()],
        ..Shared::default()
    };
    let plan = Plan {
        forwarder,
        router,
        config,
        profile,
        batch: &batch,
        ranges,
        client: session.req_header().clone(),
        requester: ctx.client.requester.clone(),
        shared: Mutex::new(shared),
        changed: Notify::new(),
    };
    let workers = futures::future::join_all(nodes.iter().map(|node| worker(&plan, node)));
    // Chunks are bounded by the nodes' timeouts; a client that leaves ends them at once
    // (dropping a chunk's connection makes its node stop).
    if let Wait::ClientGone = race(session, Duration::MAX, workers).await {
        ctx.client_gone = true;
        return Ok(());
    }
    let shared = std::mem::take(&mut *plan.shared.lock());
    let label = crate::metrics::model_label(&router.fleet, &profile.model_key).to_string();
    ctx.node = Some("fanout".into());
    ctx.model_label = Some(label.clone());
    ctx.ttfb = Some(started.elapsed());

    if let Some((status, body)) = shared.client_error {
        ctx.status = status;
        ctx.bytes_out = body.len();
        return super::respond::send(
            session,
            status,
            "application/json; charset=utf-8",
            body,
            &[],
        )
        .await;
    }
    let replies: Option<Vec<Bytes>> = shared.replies.into_iter().collect();
    let merged = replies
        .ok_or_else(|| format!("embedding batch failed: {}", shared.failures.join("; ")))
        .and_then(|replies| merge(profile.endpoint, &plan.ranges, &replies, started));
    let (body, usage) = match merged {
        Ok(merged) => merged,
        Err(message) => {
            let retries = [("X-Fleet-Retries", shared.failures.len().to_string())];
            return super::respond::refuse(session, ctx, 502, &message, &retries).await;
        }
    };
    forwarder.book_usage(ctx.client.label(), &label, usage);
    ctx.usage = Some(usage);
    ctx.status = 200;
    ctx.bytes_out = body.len();
    let headers = [
        ("X-Fleet-Node", shared.served_by.join(",")),
        ("X-Fleet-Score", super::headers::score_text(best_score)),
        ("X-Fleet-Affinity", "new".to_string()),
        ("X-Fleet-Retries", shared.failures.len().to_string()),
        ("X-Fleet-Fanout", plan.ranges.len().to_string()),
    ];
    super::respond::send(
        session,
        200,
        "application/json; charset=utf-8",
        body.into(),
        &headers,
    )
    .await
}

/// One node's share: takes chunks until none is left that it may take. A node that fails
/// a chunk hands it back and stops.
async fn worker(plan: &Plan<'_>, node: &Arc<crate::fleet::Node>) {
    let strip_auth = !plan.config.api_keys.is_empty();
    let max_tries = plan.config.limits.max_retries + 1;
    loop {
        let changed = plan.changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        let chunk = {
            let mut shared = plan.shared.lock();
            if shared.client_error.is_some() {
                return;
            }
            let eligible = shared
                .pending
                .iter()
                .position(|c| !c.tried.contains(&node.id) && c.tried.len() < max_tries);
            match eligible {
                Some(at) => {
                    shared.in_flight += 1;
                    shared.pending.remove(at)
                }
                // Another node may yet hand a chunk back.
                None if shared.in_flight > 0 => None,
                None => return,
            }
        };
        let Some(mut chunk) = chunk else {
            changed.await;
            continue;
        };
        let outcome = send_chunk(plan, node, chunk.index, strip_auth).await;
        let stop = {
            let mut shared = plan.shared.lock();
            shared.in_flight -= 1;
            match outcome {
                ChunkOutcome::Done(reply) => {
                    shared.replies[chunk.index] = Some(reply);
                    if !shared.served_by.iter().any(|n| n == node.name()) {
                        shared.served_by.push(node.name().to_string());
                    }
                    false
                }
                ChunkOutcome::ClientError(status, body) => {
                    shared.client_error.get_or_insert((status, body));
                    true
                }
                ChunkOutcome::Failed(why) => {
                    shared.failures.push(format!("{}: {why}", node.name()));
                    chunk.tried.push(node.id);
                    shared.pending.push_front(chunk);
                    true
                }
            }
        };
        plan.changed.notify_waiters();
        if stop {
            return;
        }
    }
}

enum ChunkOutcome {
    Done(Bytes),
    ClientError(u16, Bytes),
    Failed(String),
}

/// Sends one chunk to one node, counted against the node like any request (waiting, as
/// requests do, while the node runs `num_parallel` of them).
async fn send_chunk(
    plan: &Plan<'_>,
    node: &Arc<crate::fleet::Node>,
    index: usize,
    strip_auth: bool,
) -> ChunkOutcome {
    let deadline = tokio::time::Instant::now() + plan.config.queue.max_wait;
    let listener = plan
        .router
        .listen(&plan.profile.model_key, plan.requester.clone());
    let dispatch = loop {
        // Listen before looking, so that a slot freed meanwhile is not missed.
        let news = listener.news(&plan.router.fleet.wakeups);
        let handoff = listener.take_handoff();
        if !listener.leaves_to_others(node)
            && let Some(reserved) = plan.router.try_dispatch(node, plan.profile)
        {
            listener.sent(node.id, handoff);
            // An embedding holds no conversation: committing it records nothing.
            let chosen = Decision::direct(node.clone());
            break reserved.commit(plan.profile, &chosen, &plan.router.placement());
        }
        listener.waits(node.id, false, handoff);
        if tokio::time::timeout_at(deadline, news).await.is_err() {
            return ChunkOutcome::Failed("no free slot in time".into());
        }
    };
    let timeouts = &plan.config.timeouts;
    let Some(peer) = peer(node, timeouts) else {
        dispatch.finish(Outcome::default());
        return ChunkOutcome::Failed("its host name does not resolve".into());
    };
    let body = plan.batch.body(plan.ranges[index].clone());
    let request = match upstream_request(&plan.client, node, body.len(), strip_auth) {
        Ok(request) => request,
        Err(e) => return ChunkOutcome::Failed(e.to_string()),
    };
    let started = Instant::now();
    let reply = plan
        .forwarder
        .upstream()
        .fetch(&peer, &request, &body, timeouts, MAX_CHUNK_REPLY)
        .await;
    let ok = matches!(&reply, Ok((status, _)) if (200..300).contains(status));
    dispatch.finish(Outcome {
        ok,
        ttfb: ok.then(|| started.elapsed()),
        ..Outcome::default()
    });
    match reply {
        Ok((status, body)) if (200..300).contains(&status) => ChunkOutcome::Done(body),
        Ok((status, _)) if status == 404 || status >= 500 => {
            ChunkOutcome::Failed(format!("status {status}"))
        }
        Ok((status, body)) => ChunkOutcome::ClientError(status, body),
        Err(e) => {
            use pingora_core::ErrorType::*;
            if matches!(
                e.etype(),
                ConnectTimedout | ConnectRefused | ConnectNoRoute | ConnectError
            ) {
                let rules = crate::fleet::Rules::of(plan.config);
                plan.router
                    .fleet
                    .learn(node, crate::fleet::Evidence::Refused, &rules);
            }
            ChunkOutcome::Failed(e.to_string())
        }
    }
}

/// The chunks' replies as one reply of the endpoint, and the batch's token usage.
fn merge(
    endpoint: Endpoint,
    ranges: &[Range<usize>],
    replies: &[Bytes],
    started: Instant,
) -> std::result::Result<(Vec<u8>, TokenUsage), String> {
    let bad = |i: usize, what: &str| format!("chunk {i}: the node's reply {what}");
    let mut first: Option<Fields> = None;
    let mut vectors: Vec<Box<RawValue>> = Vec::new();
    let mut prompt_tokens = 0u64;
    let mut load_ns = 0u64;
    let list_key = match endpoint {
        Endpoint::OpenAiEmbeddings => "data",
        _ => "embeddings",
    };
    for (i, (reply, range)) in replies.iter().zip(ranges).enumerate() {
        let mut fields: Fields =
            serde_json::from_slice(reply).map_err(|_| bad(i, "is not a JSON object"))?;
        let list: Vec<Box<RawValue>> = fields
            .get(list_key)
            .and_then(|l| serde_json::from_str(l.get()).ok())
            .ok_or_else(|| bad(i, &format!("has no {list_key} list")))?;
        if list.len() != range.len() {
            return Err(bad(
                i,
                &format!("has {} vectors for {} inputs", list.len(), range.len()),
            ));
        }
        let number = |v: Option<&Box<RawValue>>| v.and_then(|v| v.get().parse::<u64>().ok());
        match endpoint {
            Endpoint::OpenAiEmbeddings => {
                let usage: Option<BTreeMap<String, u64>> = fields
                    .get("usage")
                    .and_then(|u| serde_json::from_str(u.get()).ok());
                prompt_tokens += usage
                    .and_then(|u| u.get("prompt_tokens").copied())
                    .unwrap_or(0);
                for item in list {
                    let mut item: Fields = serde_json::from_str(item.get())
                        .map_err(|_| bad(i, "has a malformed embedding"))?;
                    let index = RawValue::from_string(vectors.len().to_string())
                        .map_err(|_| bad(i, "could not be re-indexed"))?;
                    item.insert("index".into(), index);
                    let item = serde_json::value::to_raw_value(&item)
                        .map_err(|_| bad(i, "could not be re-encoded"))?;
                    vectors.push(item);
                }
            }
            _ => {
                prompt_tokens += number(fields.get("prompt_eval_count")).unwrap_or(0);
                load_ns = load_ns.max(number(fields.get("load_duration")).unwrap_or(0));
                vectors.extend(list);
            }
        }
        fields.remove(list_key);
        first.get_or_insert(fields);
    }
    let mut merged = first.unwrap_or_default();
    let raw = |v: String| RawValue::from_string(v).map_err(|e| e.to_string());
    let list = serde_json::value::to_raw_value(&vectors).map_err(|e| e.to_string())?;
    merged.insert(list_key.into(), list);
    match endpoint {
        Endpoint::OpenAiEmbeddings => {
            let usage =
                format!(r#"{{"prompt_tokens":{prompt_tokens},"total_tokens":{prompt_tokens}}}"#);
            merged.insert("usage".into(), raw(usage)?);
        }
        _ => {
            merged.insert("prompt_eval_count".into(), raw(prompt_tokens.to_string())?);
            merged.insert("load_duration".into(), raw(load_ns.to_string())?);
            let total = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
            merged.insert("total_duration".into(), raw(total.to_string())?);
        }
    }
    let body = serde_json::to_vec(&merged).map_err(|e| e.to_string())?;
    let usage = TokenUsage {
        prompt: prompt_tokens,
        cached: None,
        completion: 0,
    };
    Ok((body, usage))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_long_lists_only() {
        let body = br#"{"model":"e","input":["a","b","c","d","e"],"truncate":true}"#;
        let batch = Batch::split(body, 2).unwrap();
        assert_eq!(batch.chunks(), vec![0..2, 2..4, 4..5]);
        let chunk: serde_json::Value = serde_json::from_slice(&batch.body(2..4)).unwrap();
        assert_eq!(chunk["input"], serde_json::json!(["c", "d"]));
        assert_eq!(chunk["truncate"], true);
        assert_eq!(chunk["model"], "e");
        assert!(Batch::split(body, 5).is_none(), "fits one chunk");
        assert!(Batch::split(br#"{"model":"e","input":"one"}"#, 1).is_none());
        assert!(
            Batch::split(br#"{"model":"e","input":[1,2,3]}"#, 1).is_none(),
            "tokens of one input"
        );
        assert!(Batch::split(br#"{"model":"e","input":[[1],[2],[3]]}"#, 1).is_some());
    }

    #[test]
    fn merges_in_order_with_one_replys_shape() {
        let ranges = vec![0..2, 2..3];
        let replies = [
            Bytes::from_static(br#"{"model":"e","embeddings":[[0.1],[0.2]],"total_duration":5,"load_duration":7,"prompt_eval_count":4}"#),
            Bytes::from_static(br#"{"model":"e","embeddings":[[0.3]],"total_duration":5,"load_duration":1,"prompt_eval_count":2}"#),
        ];
        let (body, usage) = merge(Endpoint::Embed, &ranges, &replies, Instant::now()).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["embeddings"], serde_json::json!([[0.1], [0.2], [0.3]]));
        assert_eq!(v["prompt_eval_count"], 6);
        assert_eq!(v["load_duration"], 7);
        assert_eq!(usage.prompt, 6);
        let keys: Vec<_> = v.as_object().unwrap().keys().cloned().collect();
        assert_eq!(keys.len(), 5, "{keys:?}");

        let replies = [
            Bytes::from_static(br#"{"object":"list","data":[{"object":"embedding","embedding":[1],"index":0},{"object":"embedding","embedding":[2],"index":1}],"model":"e","usage":{"prompt_tokens":3,"total_tokens":3}}"#),
            Bytes::from_static(br#"{"object":"list","data":[{"object":"embedding","embedding":[3],"index":0}],"model":"e","usage":{"prompt_tokens":1,"total_tokens":1}}"#),
        ];
        let (body, _) = merge(
            Endpoint::OpenAiEmbeddings,
            &ranges,
            &replies,
            Instant::now(),
        )
        .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["data"][2]["index"], 2);
        assert_eq!(v["data"][2]["embedding"], serde_json::json!([3]));
        assert_eq!(v["usage"]["total_tokens"], 4);
        let short = [replies[0].clone(), Bytes::from_static(br#"{"data":[]}"#)];
        assert!(merge(Endpoint::OpenAiEmbeddings, &ranges, &short, Instant::now()).is_err());
    }
}
