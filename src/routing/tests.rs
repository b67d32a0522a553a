//! The router's decisions and books together: requests decided, counted on their nodes, sent,
//! answered and finished as the proxy does it, checked against what corral then knows.

use super::*;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::Config;
use crate::config::{NodeConfig, Weights};
use crate::fleet::ReplyStats;
use crate::fleet::kind::NodeKind;
use crate::fleet::warm::{Capacity, Observed};
use crate::fleet::{Evidence, Rules};
use crate::fleet::{Fleet, Requester};
use crate::fleet::{Inventory, Resident};
use crate::request::Endpoint;
use crate::request::Profile;

const MODEL: &str = "llama3:8b";

/// A router over `n` idle nodes that all hold MODEL resident, of a kind to detect.
fn router(n: usize, slots: usize) -> Arc<Router> {
    router_with(n, slots, false, NodeKind::Auto)
}

/// [`router`] over nodes configured to queue a warm request at the node when it is slow to
/// begin one (`nodes[].queue_at_node`).
fn queuing_router(n: usize, slots: usize) -> Arc<Router> {
    let r = router(n, slots);
    for node in r.fleet.nodes().iter() {
        let mut settings = (*node.settings()).clone();
        settings.queue_at_node = true;
        node.set_settings(settings);
    }
    r
}

/// The same over nodes running Ollama's old runner.
fn legacy_router(n: usize, slots: usize, multiuser_cache: bool) -> Arc<Router> {
    router_with(n, slots, multiuser_cache, NodeKind::OllamaLegacy)
}

fn router_with(n: usize, slots: usize, multiuser_cache: bool, kind: NodeKind) -> Arc<Router> {
    let nodes = (0..n)
        .map(|i| {
            let mut node =
                NodeConfig::new(&format!("n{i}"), &format!("http://127.0.0.1:{}", 1000 + i));
            node.num_parallel = slots;
            node.memory_gb = Some(24.0);
            node.multiuser_cache = multiuser_cache;
            node.kind = kind;
            node
        })
        .collect();
    let config = Config {
        nodes,
        ..Default::default()
    };
    let fleet = Fleet::new(&config).unwrap();
    for node in fleet.nodes().iter() {
        let mut inv = Inventory {
            polled_at: Some(Instant::now()),
            ..Default::default()
        };
        inv.on_disk.insert(MODEL.into(), 4_700_000_000);
        inv.resident.insert(
            MODEL.into(),
            Resident {
                size: 5_000_000_000,
                context_length: Some(8192),
                expires_at: None,
            },
        );
        node.update_inventory(inv);
    }
    Arc::new(Router::new(Arc::new(fleet), &config))
}

fn chat(turns: &[&str]) -> Profile {
    let mut messages = Vec::new();
    for (i, t) in turns.iter().enumerate() {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        messages.push(serde_json::json!({ "role": role, "content": t }));
    }
    let body = serde_json::json!({ "model": MODEL, "messages": messages });
    Profile::parse(Endpoint::Chat, body.to_string().as_bytes()).unwrap()
}

/// Sends a counted request as the proxy does: committed under the placement lock, with the
/// decision corral makes for it now.
fn sent(r: &Arc<Router>, reserved: Reserved, p: &Profile) -> Dispatch {
    let decision = r.decide(p).unwrap();
    reserved.commit(p, &decision, &r.placement())
}

/// Sends a request to `node` as the proxy would, and leaves it running.
fn start(r: &Arc<Router>, p: &Profile, node: usize) -> Dispatch {
    sent(r, r.try_dispatch(&r.fleet.nodes()[node], p).unwrap(), p)
}

/// The request's reply begins `wait` after it was sent, 1 ms of it prefill: the rest was the
/// node's start-up.
fn began_after(d: &mut Dispatch, wait: Duration) {
    std::thread::sleep(wait);
    d.first_byte();
    d.observe(&ReplyStats::parse(ollama_reply(12, 1).as_bytes()).unwrap());
}

/// Ends a request as served.
fn end(d: Dispatch) {
    d.finish(Outcome {
        ok: true,
        ..Default::default()
    });
}

/// Sends a request to `node` as the proxy would, and finishes it.
fn serve(r: &Arc<Router>, p: &Profile, node: usize) {
    let decision = r.decide(p).unwrap();
    let reserved = r.try_dispatch(&r.fleet.nodes()[node], p).unwrap();
    let d = reserved.commit(p, &decision, &r.placement());
    end(d);
}

fn affinity_score(d: &Decision, node: u16) -> f64 {
    let candidate = d.ranked.iter().find(|c| c.node.id == node).unwrap();
    candidate.scores.session_affinity
}

fn total_of(d: &Decision, node: usize) -> f64 {
    d.ranked
        .iter()
        .find(|c| usize::from(c.node.id) == node)
        .unwrap()
        .scores
        .total()
}

#[test]
fn worked_example_leads_by_20_then_7_3_then_trails_by_2() {
    // One slot a node, Ollama's default: every request running or waiting is ahead.
    let r = router(2, 1);
    let first = chat(&["Hello"]);
    serve(&r, &first, 0);
    let follow_up = chat(&["Hello", "Hi there", "Tell me more"]);

    let d = r.decide(&follow_up).unwrap();
    assert_eq!(d.pin.map(|p| p.node), Some(0));
    assert_eq!(d.affinity_for(0), AffinityResult::Hit);
    assert!((total_of(&d, 0) - total_of(&d, 1) - 20.0).abs() < 1e-9);

    let other = chat(&["unrelated"]);
    let node = &r.fleet.nodes()[0];
    let _one = r.try_dispatch(node, &other).unwrap();
    let d = r.decide(&follow_up).unwrap();
    let lead = total_of(&d, 0) - total_of(&d, 1);
    assert!((lead - 7.333).abs() < 0.001, "{lead}");
    assert_eq!(format!("{lead:.1}"), "7.3");

    assert!(
        r.try_dispatch(node, &other).is_none(),
        "its one slot is taken"
    );
    let _two = r.wait_ticket(node, MODEL, false, 8).unwrap();
    let d = r.decide(&follow_up).unwrap();
    assert!((total_of(&d, 0) - total_of(&d, 1) + 2.0).abs() < 1e-9);
    assert_eq!(d.ranked[0].node.id, 1, "the idle peer wins at depth two");
    assert_eq!(d.affinity_for(1), AffinityResult::Miss);
}

#[test]
fn requests_beside_a_free_slot_are_no_queue() {
    // Four slots: two requests running leave two free, so the follow-up meets no queue
    // and its warm node leads by the whole bonus; only what waits for a slot counts.
    let r = router(2, 4);
    serve(&r, &chat(&["Hello"]), 0);
    let follow_up = chat(&["Hello", "Hi there", "Tell me more"]);
    let other = chat(&["unrelated"]);
    let node = &r.fleet.nodes()[0];
    let running: Vec<_> = (0..2)
        .map(|_| r.try_dispatch(node, &other).unwrap())
        .collect();
    let d = r.decide(&follow_up).unwrap();
    assert!((total_of(&d, 0) - total_of(&d, 1) - 20.0).abs() < 1e-9);
    // All four slots taken and four more waiting: five requests ahead on four slots.
    let more: Vec<_> = (0..2)
        .map(|_| r.try_dispatch(node, &other).unwrap())
        .collect();
    let waiting: Vec<_> = (0..4)
        .map(|_| r.wait_ticket(node, MODEL, false, 8).unwrap())
        .collect();
    let d = r.decide(&follow_up).unwrap();
    let queue = 5.0 / 4.0;
    let lead = 20.0 / (1.0 + queue / 2.0) - 6.0 * queue;
    assert!((total_of(&d, 0) - total_of(&d, 1) - lead).abs() < 1e-9);
    drop((running, more, waiting));
}

#[test]
fn new_conversations_avoid_displacing_warm_slots() {
    let r = legacy_router(2, 2, true);
    // Fill node 0's two slots with two conversations.
    serve(&r, &chat(&["a"]), 0);
    serve(&r, &chat(&["b"]), 0);
    let d = r.decide(&chat(&["c"])).unwrap();
    assert_eq!(d.ranked[0].node.id, 1);
    assert_eq!(
        d.ranked[1].scores.session_affinity,
        -Weights::default().slot_displacement
    );
    assert_eq!(d.affinity_for(1), AffinityResult::New);
}

#[test]
fn on_the_old_runner_a_new_conversation_takes_the_slot_of_an_idle_one_not_an_empty_slot() {
    // Ollama without OLLAMA_MULTIUSER_CACHE: "b" shares its first tokens with "a",
    // nothing with the empty slot, so it takes a's slot.
    let r = legacy_router(2, 2, false);
    serve(&r, &chat(&["a"]), 0);
    let d = r.decide(&chat(&["b"])).unwrap();
    assert_eq!(
        affinity_score(&d, 0),
        -Weights::default().slot_displacement,
        "node 0 has an empty slot, yet b would push a out"
    );
    serve(&r, &chat(&["b"]), 0);
    let d = r.decide(&chat(&["a", "reply", "more"])).unwrap();
    assert_eq!(d.pin, None);
    assert_eq!(d.affinity_for(0), AffinityResult::Miss);
    let d = r.decide(&chat(&["b", "reply", "more"])).unwrap();
    assert_eq!(d.pin.map(|p| (p.node, p.continues)), Some((0, true)));

    // With the multi-user cache, "b" takes the empty slot and both stay warm.
    let r = legacy_router(2, 2, true);
    serve(&r, &chat(&["a"]), 0);
    let d = r.decide(&chat(&["b"])).unwrap();
    assert_eq!(affinity_score(&d, 0), 0.0);
    serve(&r, &chat(&["b"]), 0);
    for first in ["a", "b"] {
        let d = r.decide(&chat(&[first, "reply", "more"])).unwrap();
        assert_eq!(
            d.pin.map(|p| (p.node, p.continues)),
            Some((0, true)),
            "{first}"
        );
    }
}

#[test]
fn a_model_that_nothing_used_leaves_no_state_behind() {
    let r = router(1, 2);
    let node = r.fleet.nodes()[0].clone();
    let invented = chat(&["x"]);
    let invented = Profile {
        model_key: "invented:1b".into(),
        ..invented
    };
    drop(r.wait_ticket(&node, &invented.model_key, false, 8));
    // Sent where the client named the node (no node lists the model), and failed.
    let failed = r.try_dispatch(&node, &invented).unwrap();
    let direct = Decision::direct(node.clone());
    failed.commit(&invented, &direct, &r.placement()).fail();
    assert!(!node.lock_books().models.contains_key("invented:1b"));
    // What a served model taught is kept.
    serve(&r, &chat(&["a"]), 0);
    assert!(node.lock_books().models.contains_key(MODEL));
}

/// A chat that opens with a system prompt.
fn chat_after(system: &str, turns: &[&str]) -> Profile {
    let mut messages = vec![serde_json::json!({ "role": "system", "content": system })];
    for (i, t) in turns.iter().enumerate() {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        messages.push(serde_json::json!({ "role": role, "content": t }));
    }
    let body = serde_json::json!({ "model": MODEL, "messages": messages });
    Profile::parse(Endpoint::Chat, body.to_string().as_bytes()).unwrap()
}

#[test]
fn a_new_conversation_is_not_pulled_to_llama_server_by_a_system_prompt_it_shares() {
    let system = "s".repeat(4_000);
    for kind in [NodeKind::Auto, NodeKind::Ollama, NodeKind::LlamaCpp] {
        let r = router_with(2, 2, false, kind);
        serve(&r, &chat_after(&system, &["a"]), 0);
        // "b" shares only the system prompt with "a": placed as new, not drawn to node 0
        // (whose idle slot it would overwrite), though known to share a prefix there.
        let d = r.decide(&chat_after(&system, &["b"])).unwrap();
        assert_eq!(d.pin, None, "{kind:?}");
        assert_eq!(d.affinity_for(0), AffinityResult::New, "{kind:?}");
        assert_eq!(affinity_score(&d, 0), 0.0, "{kind:?}");
        assert_eq!(total_of(&d, 0), total_of(&d, 1), "{kind:?}");
        // A's own follow-up, and a first turn repeated (regenerated), still go home.
        let d = r.decide(&chat_after(&system, &["a", "r", "more"])).unwrap();
        assert_eq!(
            d.pin.map(|p| (p.node, p.continues)),
            Some((0, true)),
            "{kind:?}"
        );
        let d = r.decide(&chat_after(&system, &["a"])).unwrap();
        assert_eq!(
            d.pin.map(|p| (p.node, p.continues)),
            Some((0, true)),
            "{kind:?}"
        );
    }
    // The old runner keeps nothing beyond its slots and gives any new conversation an
    // occupied idle slot: there the shared system prompt still pulls.
    let r = legacy_router(2, 2, false);
    serve(&r, &chat_after(&system, &["a"]), 0);
    let d = r.decide(&chat_after(&system, &["b"])).unwrap();
    assert_eq!(d.pin.map(|p| (p.node, p.continues)), Some((0, false)));
    assert!(affinity_score(&d, 0) > 0.0);
}

#[test]
fn on_llama_server_a_conversation_opening_alike_takes_the_idle_slot_of_another() {
    let system = "s".repeat(4_000);
    // Each case ends with a conversation opening alike served on node 1, so that the prefix
    // table's entry for the system prompt names node 1: a follow-up that merely fell back to
    // it would be pinned there, not to its own node 0.
    let elsewhere = |r: &Arc<Router>| serve(r, &chat_after(&system, &["elsewhere"]), 1);

    // "b" shares a's 1,000-token system prompt, most of a's prompt: llama-server gives it
    // a's idle slot, though the other is empty, and does not save "a", which it keeps half of.
    let r = router_with(2, 2, false, NodeKind::LlamaCpp);
    serve(&r, &chat_after(&system, &["a"]), 0);
    serve(&r, &chat_after(&system, &["b"]), 0);
    elsewhere(&r);
    let d = r.decide(&chat_after(&system, &["a", "r", "more"])).unwrap();
    assert_eq!(
        d.pin.map(|p| (p.node, p.depth, p.continues, p.in_host)),
        Some((0, 1, false, false)),
        "only the system prompt is warm for a's next turn, in b's slot"
    );

    // Once b's conversation is over twice the system prompt, a's next turn takes b's slot
    // and saves it; "a" itself is in no cache, so the system prompt is still all it finds.
    let long = "x".repeat(12_000);
    serve(&r, &chat_after(&system, &["b", "r", &long]), 0);
    elsewhere(&r);
    let d = r.decide(&chat_after(&system, &["a", "r", "more"])).unwrap();
    assert_eq!(
        d.pin.map(|p| (p.node, p.depth, p.in_host)),
        Some((0, 1, false)),
        "a's next turn finds the system prompt on its own node"
    );

    // A conversation four times as long as its system prompt is saved when "b" takes its
    // slot; but while b's slot is idle llama-server gives c's next turn that slot as it is,
    // and restores nothing.
    let r = router_with(2, 2, false, NodeKind::LlamaCpp);
    serve(&r, &chat_after(&system, &[&long]), 0);
    serve(&r, &chat_after(&system, &["b"]), 0);
    elsewhere(&r);
    let follow_up = chat_after(&system, &[&long, "r", "more"]);
    let d = r.decide(&follow_up).unwrap();
    assert_eq!(
        d.pin.map(|p| (p.node, p.depth, p.in_host)),
        Some((0, 1, false)),
        "only the system prompt, in b's slot"
    );
    // With b's slot busy, "c" is restored from host memory into the other.
    let b_next = chat_after(&system, &["b", "r", "again"]);
    let busy = start(&r, &b_next, 0);
    let d = r.decide(&follow_up).unwrap();
    assert_eq!(d.pin.map(|p| (p.node, p.in_host)), Some((0, true)));
    end(busy);
}

/// What another replica tells of a chat it sent to node n0's slot 0 as `lineage`.
fn sent_by_another_replica(p: &Profile, lineage: u64) -> crate::shared::Sent {
    crate::shared::Sent {
        replica: 9,
        run: 1,
        node: "n0".into(),
        model: MODEL.into(),
        slot: 0,
        lineage,
        depth: p.chain.depth(),
        tokens: u64::from(p.prompt_tokens),
        first_tokens: u64::from(p.first_tokens),
        prefixes: vec![p.chain.last(), p.chain.hashes[1]],
        session: None,
        client: None,
    }
}

#[test]
fn a_conversation_another_replica_sends_opening_alike_pushes_ours_out_unsaved() {
    use crate::shared::{Event, Replica};
    let system = "s".repeat(4_000);
    let r = router_with(1, 2, false, NodeKind::LlamaCpp);
    serve(&r, &chat_after(&system, &["a"]), 0);
    // Another replica's conversation, opening with the same system prompt, took a's idle
    // slot; its first message is most of what the slot held, so a was not saved.
    r.apply(Event::Sent(sent_by_another_replica(
        &chat_after(&system, &["b"]),
        1 << 40,
    )));
    let a_next = chat_after(&system, &["a", "r", "more"]);
    // While b's turn runs there, a's next turn would take the other slot: nothing is warm.
    assert_eq!(r.decide(&a_next).unwrap().pin, None, "b runs");
    r.apply(Event::Ended(crate::shared::Ended {
        replica: 9,
        run: 1,
        kept: true,
        client: None,
        held_s: 0.0,
    }));
    let d = r.decide(&a_next).unwrap();
    assert_eq!(
        d.pin.map(|p| (p.depth, p.in_host)),
        Some((1, false)),
        "only the system prompt is warm for a's next turn"
    );
}

#[test]
fn a_conversation_another_replica_restores_leaves_the_host_cache() {
    use crate::shared::{Event, Replica};
    let r = router_with(1, 1, false, NodeKind::LlamaCpp);
    let long = "x".repeat(8_000);
    serve(&r, &chat(&[&long]), 0);
    // "b" takes the only slot: "a" is saved to host memory.
    serve(&r, &chat(&["b"]), 0);
    let a_next = chat(&[&long, "r", "more"]);
    let pin = r.decide(&a_next).unwrap().pin.unwrap();
    assert!(pin.in_host, "a is warm in host memory");
    assert!(in_host_cache(&r, pin.lineage));
    // Another replica sends a's next turn there: the node restores it into the slot, saving
    // b, and its cache no longer holds a.
    r.apply(Event::Sent(sent_by_another_replica(&a_next, pin.lineage)));
    assert!(
        !in_host_cache(&r, pin.lineage),
        "a left the host cache for the slot"
    );
    let slot = r.fleet.nodes()[0].lock_books().models[MODEL].slots[0].lineage;
    assert_eq!(slot, pin.lineage, "a runs in the slot");

    // Where a's slot still holds it, the node continues it there and loads nothing: the copy
    // saved while that slot was idle stays in the cache.
    let r = router_with(1, 2, false, NodeKind::LlamaCpp);
    serve(&r, &chat(&[&long]), 0);
    serve(&r, &chat(&["b"]), 0);
    let pin = r.decide(&a_next).unwrap().pin.unwrap();
    assert!(!pin.in_host, "a is warm in its slot");
    assert!(
        in_host_cache(&r, pin.lineage),
        "a's idle slot was copied when b began"
    );
    r.apply(Event::Sent(sent_by_another_replica(&a_next, pin.lineage)));
    assert!(in_host_cache(&r, pin.lineage), "the copy stays");
}

/// Whether corral's mirror of node n0's host cache holds `lineage`.
fn in_host_cache(r: &Arc<Router>, lineage: u64) -> bool {
    let nodes = r.fleet.nodes();
    let books = nodes[0].lock_books();
    let host = &books.models[MODEL].warm.host;
    host.place(lineage, None, 1, None).is_some()
}

#[test]
fn on_llama_server_a_system_prompt_in_a_running_conversations_slot_is_not_warm_for_another() {
    let system = "s".repeat(4_000);
    // A follow-up of a conversation corral has not seen (its client came from elsewhere)
    // shares only the system prompt with "a", which node 1 holds.
    let stranger = chat_after(&system, &["z", "r", "more"]);
    let a_next = chat_after(&system, &["a", "r", "again"]);
    let cases = [
        (
            "llama-server",
            router_with(2, 2, false, NodeKind::LlamaCpp),
            false,
        ),
        ("old runner", legacy_router(2, 2, false), true),
        (
            "old runner, multi-user cache",
            legacy_router(2, 2, true),
            true,
        ),
    ];
    for (name, r, pulls) in cases {
        serve(&r, &chat_after(&system, &["a"]), 1);
        let d = r.decide(&stranger).unwrap();
        assert_eq!(
            d.pin.map(|p| (p.node, p.depth)),
            Some((1, 1)),
            "{name}: idle"
        );
        // While a's next turn runs in that slot, llama-server gives the stranger another
        // one; the old runner keeps the pull (see `Router::locate`).
        let running = start(&r, &a_next, 1);
        let d = r.decide(&stranger).unwrap();
        assert_eq!(
            d.pin.map(|p| (p.node, p.depth)),
            pulls.then_some((1, 1)),
            "{name}: running"
        );
        end(running);
        let d = r.decide(&stranger).unwrap();
        assert_eq!(
            d.pin.map(|p| (p.node, p.depth)),
            Some((1, 1)),
            "{name}: ended"
        );
    }
}

#[test]
fn while_a_conversation_runs_its_system_prompt_is_found_in_another_saved_in_host_memory() {
    let system = "s".repeat(4_000);
    let r = router_with(2, 2, false, NodeKind::LlamaCpp);
    let node = 1;
    // "b" opens with the system prompt; "x" takes the other slot, and llama-server copies
    // b's idle slot into its host cache. "a" then takes b's slot (it opens alike).
    serve(&r, &chat_after(&system, &["b"]), node);
    serve(&r, &chat(&["x"]), node);
    serve(&r, &chat_after(&system, &["a"]), node);
    let a_next = chat_after(&system, &["a", "r", "again"]);
    let running = start(&r, &a_next, node);
    // While a runs, the stranger gets x's slot, into which b's saved conversation is
    // restored: the system prompt is warm in host memory.
    let stranger = chat_after(&system, &["z", "r", "more"]);
    let d = r.decide(&stranger).unwrap();
    assert_eq!(
        d.pin.map(|p| (p.node, p.depth, p.in_host)),
        Some((1, 1, true))
    );
    assert_eq!(d.affinity_for(1), AffinityResult::Host);
    end(running);
}

#[test]
fn a_follow_up_held_nowhere_goes_where_its_system_prompt_is_warm() {
    let system = "s".repeat(4_000);
    let r = router_with(2, 2, false, NodeKind::LlamaCpp);
    // "b" opens with the system prompt on node 1 and ends there, idle in its slot; "c"
    // opens alike on node 0, the last node the prompt went to, and runs there now.
    serve(&r, &chat_after(&system, &["b"]), 1);
    serve(&r, &chat_after(&system, &["c"]), 0);
    let running = start(&r, &chat_after(&system, &["c", "r", "again"]), 0);
    // A follow-up corral has never seen (sent before a restart, or forgotten): nothing of
    // its own is warm anywhere, and c's slot is not given to it while c runs. Node 1
    // gives it b's idle slot, which shares the system prompt.
    let stranger = chat_after(&system, &["z", "r", "more"]);
    let d = r.decide(&stranger).unwrap();
    assert_eq!(
        d.pin.map(|p| (p.node, p.depth, p.in_host)),
        Some((1, 1, false))
    );
    assert_eq!(d.affinity_for(1), AffinityResult::Hit);
    // A new conversation sharing the prompt is not drawn there (a54722e).
    let d = r.decide(&chat_after(&system, &["new"])).unwrap();
    assert_eq!(d.pin, None);
    end(running);

    // On node 1, two conversations opening otherwise take both slots: b's is saved in host
    // memory, from which the slot the follow-up is given restores it.
    serve(&r, &chat(&["x"]), 1);
    serve(&r, &chat(&["y"]), 1);
    let running = start(
        &r,
        &chat_after(&system, &["c", "r", "again", "r", "more"]),
        0,
    );
    let d = r.decide(&stranger).unwrap();
    assert_eq!(
        d.pin.map(|p| (p.node, p.depth, p.in_host)),
        Some((1, 1, true))
    );
    assert_eq!(d.affinity_for(1), AffinityResult::Host);
    end(running);
}

#[test]
fn on_the_old_runner_a_displaced_conversation_is_no_longer_pinned() {
    let r = legacy_router(1, 1, false);
    serve(&r, &chat(&["a"]), 0);
    serve(&r, &chat(&["b"]), 0);
    // "a" lost the node's only slot to "b".
    let d = r.decide(&chat(&["a", "reply", "more"])).unwrap();
    assert_eq!(d.pin, None);
    assert_eq!(d.affinity_for(0), AffinityResult::Miss);
    // "b" still holds it.
    let d = r.decide(&chat(&["b", "reply", "more"])).unwrap();
    assert_eq!(d.pin.map(|p| (p.node, p.continues)), Some((0, true)));
}

/// Sends a request to `node`, lets the node reply with `reply` (its final JSON
/// object), and returns what corral made of it.
fn serve_replying(r: &Arc<Router>, p: &Profile, node: usize, reply: &str) -> Observation {
    let decision = r.decide(p).unwrap();
    let mut d =
        r.try_dispatch(&r.fleet.nodes()[node], p)
            .unwrap()
            .commit(p, &decision, &r.placement());
    let stats = ReplyStats::parse(reply.as_bytes()).unwrap();
    let observation = d.observe(&stats).unwrap();
    end(d);
    observation
}

/// Ollama's final figures: `prompt_eval_count` and its duration in milliseconds.
fn ollama_reply(count: u64, prefill_ms: u64) -> String {
    format!(
        r#"{{"prompt_eval_count":{count},"prompt_eval_duration":{}}}"#,
        prefill_ms * 1_000_000
    )
}

fn llama_cpp_reply(cached: u64, evaluated: u64) -> String {
    format!(
        r#"{{"timings":{{"cache_n":{cached},"prompt_n":{evaluated},"prompt_per_second":1000.0}}}}"#
    )
}

/// An OpenAI-compatible server's final figures: prompt tokens, cached ones and tokens
/// generated, no durations.
fn openai_usage(prompt: u64, cached: u64, generated: u64) -> String {
    format!(
        r#"{{"usage":{{"prompt_tokens":{prompt},"completion_tokens":{generated},"prompt_tokens_details":{{"cached_tokens":{cached}}}}}}}"#
    )
}

#[test]
fn a_node_that_reports_no_durations_is_timed_by_its_first_streamed_token() {
    let rates = |r: &Arc<Router>| {
        let node = &r.fleet.nodes()[0];
        let books = node.lock_books();
        let state = &books.models[MODEL];
        (state.warm.cold_rate.get(), state.decode_tps.get())
    };
    let stats = ReplyStats::parse(openai_usage(2_000, 0, 11).as_bytes()).unwrap();
    // Each step at least this long: the rates below are bounds, whatever the machine.
    let step = Duration::from_millis(20);
    let send = |stream: bool| {
        let r = router(1, 1);
        let body = serde_json::json!({
            "model": MODEL,
            "messages": [{ "role": "user", "content": "a new conversation" }],
            "stream": stream,
        });
        let p = Profile::parse(Endpoint::OpenAiChat, body.to_string().as_bytes()).unwrap();
        let decision = r.decide(&p).unwrap();
        let mut d =
            r.try_dispatch(&r.fleet.nodes()[0], &p)
                .unwrap()
                .commit(&p, &decision, &r.placement());
        std::thread::sleep(step);
        d.first_byte();
        std::thread::sleep(step);
        let o = d.observe(&stats).unwrap();
        assert_eq!(o.observed, Observed::Cold);
        let decode_tps = d.decode_tps(&stats);
        d.finish(Outcome {
            ok: true,
            decode_tps,
            ..Default::default()
        });
        r
    };
    // 2,000 prompt tokens before the first token, 10 more tokens after it, each at
    // least 20 ms.
    let (prefill, decode) = rates(&send(true));
    let prefill = prefill.expect("timed by its first token");
    assert!(prefill > 0.0 && prefill <= 2_000.0 / step.as_secs_f64());
    let decode = decode.expect("timed by the tokens after the first");
    assert!(decode > 0.0 && decode <= 10.0 / step.as_secs_f64());
    // Not streamed, the first byte came after the whole answer: it times nothing.
    assert_eq!(rates(&send(false)), (None, None));
}

#[test]
fn on_current_ollama_a_displaced_conversation_stays_warm_in_host_memory() {
    let r = router(1, 1);
    let long = "x".repeat(400);
    serve(&r, &chat(&["a", "r", &long]), 0);
    serve(&r, &chat(&["b", "r", &long]), 0);
    // "a" lost the only slot to "b", which saved it into host memory.
    let follow_up = chat(&["a", "r", &long, "reply", "more"]);
    let d = r.decide(&follow_up).unwrap();
    assert_eq!(d.pin.map(|p| (p.node, p.in_host)), Some((0, true)));
    assert_eq!(d.affinity_for(0), AffinityResult::Host);
    assert_eq!(
        affinity_score(&d, 0),
        Weights::default().session_affinity,
        "a host-warm prefix earns the affinity bonus"
    );
    // Restored into the slot, "a" goes on there, and "b" is saved in its turn.
    let o = serve_replying(&r, &follow_up, 0, &llama_cpp_reply(100, 3));
    assert_eq!(
        (o.predicted, o.observed),
        (AffinityResult::Host, Observed::Warm)
    );
    assert_eq!(o.agrees(), Some(true));
    let d = r
        .decide(&chat(&["a", "r", &long, "reply", "more", "x", "y"]))
        .unwrap();
    assert_eq!(d.affinity_for(0), AffinityResult::Hit);
    let d = r
        .decide(&chat(&["b", "r", &long, "reply", "more"]))
        .unwrap();
    assert_eq!(d.affinity_for(0), AffinityResult::Host);
}

#[test]
fn a_restore_that_first_saves_the_slot_it_takes_can_push_its_own_conversation_out() {
    let r = router(1, 1);
    let long = "x".repeat(400);
    let (a, b) = (chat(&["a", "r", &long]), chat(&["b", "r", &long]));
    serve(&r, &a, 0);
    serve(&r, &b, 0);
    let follow_up = chat(&["a", "r", &long, "reply", "more"]);
    assert_eq!(
        r.decide(&follow_up).unwrap().affinity_for(0),
        AffinityResult::Host
    );
    // The cache holds a alone, but restoring it saves b from the only slot first, and
    // a cache one token short of both drops a to make room.
    let both = u64::from(a.prompt_tokens + b.prompt_tokens);
    let node = r.fleet.nodes()[0].clone();
    let capacity = |tokens| {
        let mut books = node.lock_books();
        let host = &mut books.models.get_mut(MODEL).unwrap().warm.host;
        host.set_capacity(Capacity::Tokens(tokens));
    };
    capacity(both - 1);
    let d = r.decide(&follow_up).unwrap();
    assert_eq!((d.pin, d.affinity_for(0)), (None, AffinityResult::Miss));
    capacity(both);
    assert_eq!(
        r.decide(&follow_up).unwrap().affinity_for(0),
        AffinityResult::Host
    );
}

#[test]
fn idle_slots_are_copied_into_the_host_cache_as_llama_server_copies_them() {
    let r = router(1, 3);
    let long = "x".repeat(400);
    let turn = |c: &str| chat(&[c, "r", &long]);
    let own = u64::from(turn("a").prompt_tokens);
    for c in ["a", "b", "c"] {
        serve(&r, &turn(c), 0);
    }
    // Each request copied the slots that were idle: a, then b.
    let node = &r.fleet.nodes()[0];
    assert_eq!(node.lock_books().models[MODEL].warm.host.len(), 2);
    let follow = |c: &str| chat(&[c, "r", &long, "reply", "more"]);
    let b = r.decide(&follow("b")).unwrap();
    assert_eq!(
        b.affinity_for(0),
        AffinityResult::Hit,
        "b is still in its slot"
    );
    // "d" takes a's slot (least recently used): a, held whole already, stays the
    // oldest; c is copied after b.
    serve(&r, &turn("d"), 0);
    let a = r.decide(&follow("a")).unwrap();
    assert_eq!(a.affinity_for(0), AffinityResult::Host);
    assert_eq!(a.probe.expect("a is in the host cache").needed, 3 * own);
    // "e" takes b's slot: b keeps its place before c's copy rather than being saved
    // again as the newest, and d is copied after them.
    serve(&r, &turn("e"), 0);
    let b = r.decide(&follow("b")).unwrap();
    assert_eq!(b.affinity_for(0), AffinityResult::Host);
    assert_eq!(b.probe.expect("b is in the host cache").needed, 3 * own);
}

#[test]
fn host_cache_capacity_is_learned_from_replies() {
    let r = router(1, 1);
    let long = "x".repeat(400);
    for c in ["a", "b", "c", "d"] {
        serve(&r, &chat(&[c, "r", &long]), 0);
    }
    // a, b, c saved (oldest first); d in the slot. "a" is the deepest: it needs the
    // cache to hold all three. Nothing is known lost, so it goes to its node; but with
    // no limit shown yet, a cache is expected to keep as many as the node has slots,
    // and two were saved after it. The node says it was cold.
    let a = chat(&["a", "r", &long, "reply", "more"]);
    let d = r.decide(&a).unwrap();
    assert_eq!(d.pin.map(|p| (p.node, p.in_host)), Some((0, true)));
    assert_eq!(d.affinity_for(0), AffinityResult::Miss);
    let needed_a = d.probe.unwrap().needed;
    let o = serve_replying(&r, &a, 0, &llama_cpp_reply(0, 120));
    assert_eq!((o.observed, o.agrees()), (Observed::Cold, Some(true)));
    let node = &r.fleet.nodes()[0];
    let capacity = node.lock_books().models[MODEL].warm.host.capacity();
    // Below what "a" needed, no lower than one conversation (a third of it here).
    assert!(
        matches!(capacity, Capacity::Tokens(t) if t < needed_a && 3 * t >= needed_a),
        "{capacity:?} for {needed_a}"
    );
    // Now b (also three deep: c, d, then a saved after it) is predicted cold...
    let b = chat(&["b", "r", &long, "reply", "more"]);
    let d = r.decide(&b).unwrap();
    assert_eq!(d.affinity_for(0), AffinityResult::Miss);
    let needed_b = d.probe.expect("still probed").needed;
    assert!(needed_b >= needed_a);
    // ...and the node shows it warm: one reply against the other, the larger capacity
    // (here none at all) wins, and b counts as warm again.
    let o = serve_replying(&r, &b, 0, &llama_cpp_reply(100, 3));
    assert_eq!((o.observed, o.agrees()), (Observed::Warm, Some(false)));
    let grown = node.lock_books().models[MODEL].warm.host.capacity();
    assert_eq!(grown, Capacity::Unbounded);
    assert_eq!(
        node.lock_books().kind.kind,
        NodeKind::LlamaCpp,
        "the replies' timings told the kind"
    );
}

#[test]
fn a_node_whose_replies_showed_no_limit_yet_takes_its_peers() {
    let r = router(2, 1);
    let long = "x".repeat(400);
    for node in 0..2 {
        for c in ["a", "b", "c", "d"] {
            serve(&r, &chat(&[&format!("{c}{node}"), "r", &long]), node);
        }
    }
    // Each node saved three conversations; the oldest needs all three kept.
    let on_0 = chat(&["a0", "r", &long, "reply", "more"]);
    let on_1 = chat(&["a1", "r", &long, "reply", "more"]);
    // Nothing known yet: kept on its node, but three deep on one slot, expected cold.
    let d = r.decide(&on_1).unwrap();
    assert_eq!(d.pin.map(|p| p.node), Some(1));
    assert_eq!(d.affinity_for(1), AffinityResult::Miss);
    // Node 0's reply shows its cache did not keep its oldest.
    let o = serve_replying(&r, &on_0, 0, &llama_cpp_reply(0, 120));
    assert_eq!(o.observed, Observed::Cold);
    // Node 1, as deep, is now taken to have lost it too, and is still probed...
    let d = r.decide(&on_1).unwrap();
    assert_eq!(d.pin, None);
    assert_eq!(d.affinity_for(1), AffinityResult::Miss);
    assert_eq!(d.probe.map(|p| p.node), Some(1));
    // ...so that its own reply decides: it kept it, and nothing shallower is doubted.
    // (b1 is not shallower now: restoring it first saves a1, grown, from the slot.)
    let o = serve_replying(&r, &on_1, 1, &llama_cpp_reply(100, 3));
    assert_eq!((o.observed, o.agrees()), (Observed::Warm, Some(false)));
    let c1 = chat(&["c1", "r", &long, "reply", "more"]);
    assert_eq!(r.decide(&c1).unwrap().affinity_for(1), AffinityResult::Host);
}

#[test]
fn the_cold_prefill_rate_turns_ollama_0_30_1_counts_into_cached_tokens() {
    let r = router_with(1, 1, false, NodeKind::Ollama);
    let long = "x".repeat(4000);
    // A new conversation: the whole prompt (about 1000 tokens) evaluated in 1 s.
    let first = chat(&[&long]);
    let o = serve_replying(&r, &first, 0, &ollama_reply(1000, 1000));
    // Nothing to compare the duration with yet: the node's verdict is unknown.
    assert_eq!(
        (o.predicted, o.observed),
        (AffinityResult::New, Observed::Unknown)
    );
    // The follow-up counts all 1010 tokens but took 10 ms: 10 evaluated.
    let next = chat(&[&long, "reply", "more"]);
    let o = serve_replying(&r, &next, 0, &ollama_reply(1010, 10));
    assert_eq!(o.predicted, AffinityResult::Hit);
    assert_eq!(o.measured.cached, Some(1000));
    assert_eq!(o.observed, Observed::Warm);
    // The prefill speed learned is that of evaluated tokens, not 101,000 per second.
    let tps = r.fleet.nodes()[0].lock_books().models[MODEL]
        .prefill_tps
        .get();
    assert!(tps.is_some_and(|t| (t - 1000.0).abs() < 1.0), "{tps:?}");
}

#[test]
fn a_new_conversation_read_as_warm_under_a_too_slow_rate_still_corrects_it() {
    let r = router_with(1, 1, false, NodeKind::Ollama);
    let cold_rate = || {
        r.fleet.nodes()[0].lock_books().models[MODEL]
            .warm
            .cold_rate
            .get()
    };
    // A first prompt evaluated beside others: about 1000 tokens in 3 s.
    let first = chat(&[&"x".repeat(4000)]);
    serve_replying(&r, &first, 0, &ollama_reply(1000, 3000));
    assert!(cold_rate().is_some_and(|t| (t - 333.3).abs() < 1.0));
    // Another new conversation, evaluated alone: 1 s. Against 333 tokens/s it reads as
    // two thirds cached; it is still the node's speed.
    let other = chat(&[&"y".repeat(4000)]);
    let o = serve_replying(&r, &other, 0, &ollama_reply(1000, 1000));
    assert_eq!(
        (o.predicted, o.observed),
        (AffinityResult::New, Observed::Warm)
    );
    assert!(cold_rate().is_some_and(|t| (t - 1000.0).abs() < 1.0));
}

#[test]
fn a_new_conversation_whose_system_prompt_a_node_saw_teaches_it_no_cold_rate() {
    // Two current-Ollama nodes, whose counts include cached tokens: only a prompt known to
    // be evaluated whole gives the cold rate.
    let r = router_with(2, 1, false, NodeKind::Ollama);
    let cold_rate = |node: usize| {
        r.fleet.nodes()[node].lock_books().models[MODEL]
            .warm
            .cold_rate
            .get()
    };
    let system = "s".repeat(4_000);
    // About 1010 tokens evaluated whole in 1 s on node 0.
    serve_replying(
        &r,
        &chat_after(&system, &["a"]),
        0,
        &ollama_reply(1010, 1000),
    );
    assert!(cold_rate(0).is_some_and(|t| (t - 1010.0).abs() < 1.0));
    // "b" shares the system prompt and goes to node 0 too: new, but node 0 holds that
    // prompt (10 ms), so its time is no cold rate.
    let o = serve_replying(&r, &chat_after(&system, &["b"]), 0, &ollama_reply(1010, 10));
    assert_eq!(o.predicted, AffinityResult::New);
    assert!(cold_rate(0).is_some_and(|t| (t - 1010.0).abs() < 1.0));
    // "c" shares it too, but node 1 never had it: evaluated whole in 2 s there.
    serve_replying(
        &r,
        &chat_after(&system, &["c"]),
        1,
        &ollama_reply(1010, 2000),
    );
    assert!(cold_rate(1).is_some_and(|t| (t - 505.0).abs() < 1.0));
}

#[test]
fn a_system_prompt_another_replica_sent_to_a_node_teaches_it_no_cold_rate() {
    use crate::shared::{Event, Replica};
    let r = router_with(1, 2, false, NodeKind::Ollama);
    let system = "s".repeat(4_000);
    r.apply(Event::Sent(sent_by_another_replica(
        &chat_after(&system, &["a"]),
        1,
    )));
    // This replica's first conversation opening with that prompt finds it cached: no rate.
    let ours = chat_after(&system, &["b"]);
    let o = serve_replying(&r, &ours, 0, &ollama_reply(1010, 10));
    assert_eq!(o.predicted, AffinityResult::New);
    let node = r.fleet.nodes()[0].clone();
    assert_eq!(node.lock_books().models[MODEL].warm.cold_rate.get(), None);
}

#[test]
fn what_another_replica_says_waits_replaces_what_it_said_before() {
    use crate::shared::{Alive, Event, Replica, Waiting, Waits};
    let r = router(2, 1);
    let waiting = |count| {
        vec![Waiting {
            node: "n0".into(),
            model: MODEL.into(),
            count,
        }]
    };
    let on_n0 = || {
        r.fleet.nodes()[0]
            .lock_books()
            .models
            .get(MODEL)
            .map(|m| m.waiting)
    };
    r.apply(Event::Alive(Alive {
        replica: 9,
        runs: Vec::new(),
        waits: waiting(3),
    }));
    assert_eq!(on_n0(), Some(3));
    // Between beats: two of them were served.
    r.apply(Event::Waits(Waits {
        replica: 9,
        waits: waiting(1),
    }));
    assert_eq!(on_n0(), Some(1));
    r.apply(Event::Waits(Waits {
        replica: 9,
        waits: Vec::new(),
    }));
    assert_eq!(on_n0().unwrap_or(0), 0);
}

#[test]
fn a_busy_warm_node_keeps_the_follow_up_while_waiting_beats_moving() {
    let r = router(2, 1);
    let mut config = (*r.config()).clone();
    config.weights.move_cost = 2.0;
    r.set_config(config);
    let long = "x".repeat(400);
    let first = chat(&["a", "r", &long]);
    serve_replying(&r, &first, 0, &llama_cpp_reply(0, 100));
    // Node 1 has shown its cold prefill rate (1,000 tokens per second).
    serve_replying(&r, &chat(&["other"]), 1, &llama_cpp_reply(0, 100));
    let follow_up = chat(&["a", "r", &long, "reply", "more"]);
    let other = chat(&["unrelated"]);
    let _one = r.try_dispatch(&r.fleet.nodes()[0], &other).unwrap();
    let _two = r.wait_ticket(&r.fleet.nodes()[0], MODEL, false, 8).unwrap();
    // Depth two: by the signals alone the idle peer leads by 2 (the worked example),
    // but node 0 serves in microseconds, and a move costs 2 x 106 tokens / 1,000 per s.
    let d = r.decide(&follow_up).unwrap();
    assert_eq!(
        d.ranked[0].node.id, 0,
        "waiting for the warm node is sooner"
    );
    assert_eq!(d.affinity_for(0), AffinityResult::Hit);
    assert!((total_of(&d, 0) - total_of(&d, 1) - 1.0).abs() < 1e-9);
    // Once node 0 takes 100 s a request, the move is sooner.
    for _ in 0..50 {
        r.fleet.nodes()[0]
            .lock_books()
            .models
            .get_mut(MODEL)
            .unwrap()
            .warm
            .service_s
            .record(100.0);
    }
    let d = r.decide(&follow_up).unwrap();
    assert_eq!(d.ranked[0].node.id, 1, "a long wait is worth a move");
}

#[test]
fn unload_seen_by_poller_drops_affinity() {
    let r = router(2, 2);
    serve(&r, &chat(&["a"]), 1);
    assert!(r.decide(&chat(&["a", "x", "y"])).unwrap().pin.is_some());
    let node = &r.fleet.nodes()[1];
    let mut inv = (*node.inventory()).clone();
    inv.resident.clear();
    inv.polled_at = Some(Instant::now());
    node.update_inventory(inv);
    let d = r.decide(&chat(&["a", "x", "y"])).unwrap();
    assert_eq!(d.pin, None);
    assert!(
        r.affinity.peek(chat(&["a"]).chain.last()).is_none(),
        "entry dropped"
    );
}

#[test]
fn a_finished_request_wakes_only_the_requests_waiting_for_its_model() {
    use futures::FutureExt;
    let r = router(1, 2);
    let node = r.fleet.nodes()[0].clone();
    let (same, other) = (
        r.listen(MODEL, Requester::default()),
        r.listen("other:1b", Requester::default()),
    );
    let same = same.news(&r.fleet.wakeups);
    let other = other.news(&r.fleet.wakeups);
    tokio::pin!(same, other);
    drop(r.try_dispatch(&node, &chat(&["x"])).unwrap());
    assert!(
        same.as_mut().now_or_never().is_some(),
        "a slot freed for it"
    );
    assert!(other.as_mut().now_or_never().is_none(), "nothing for it");
    // A reload concerns every waiter.
    r.set_config((*r.config()).clone());
    assert!(other.as_mut().now_or_never().is_some());
}

#[test]
fn in_flight_is_released_on_drop() {
    let r = router(1, 2);
    let p = chat(&["a"]);
    {
        let _d = r.try_dispatch(&r.fleet.nodes()[0], &p).unwrap();
        assert_eq!(r.fleet.nodes()[0].lock_books().models[MODEL].in_flight, 1);
    }
    let models = r.fleet.nodes()[0].lock_books().models.clone();
    assert_eq!(models.get(MODEL).map_or(0, |s| s.in_flight), 0);
}

#[test]
fn unknown_model_and_too_large_model_are_refused() {
    let r = router(2, 2);
    let body = br#"{"model":"nope","messages":[]}"#;
    let p = Profile::parse(Endpoint::Chat, body).unwrap();
    assert_eq!(
        r.decide(&p).err(),
        Some(RouteError::ModelNotFound("nope".into()))
    );

    for node in r.fleet.nodes().iter() {
        let mut inv = (*node.inventory()).clone();
        inv.on_disk.insert("big:70b".into(), 40_000_000_000);
        node.update_inventory(inv);
    }
    let p = Profile::parse(Endpoint::Chat, br#"{"model":"big:70b","messages":[]}"#).unwrap();
    assert!(matches!(r.decide(&p), Err(RouteError::TooLarge { .. })));
}

#[test]
fn big_model_avoids_small_node() {
    let mut small = NodeConfig::new("small", "http://127.0.0.1:1001");
    small.memory_gb = Some(8.0);
    let mut big = NodeConfig::new("big", "http://127.0.0.1:1002");
    big.memory_gb = Some(48.0);
    let config = Config {
        nodes: vec![small, big],
        ..Default::default()
    };
    let fleet = Fleet::new(&config).unwrap();
    for node in fleet.nodes().iter() {
        let mut inv = Inventory {
            polled_at: Some(Instant::now()),
            ..Default::default()
        };
        inv.on_disk.insert("qwen:32b".into(), 20_000_000_000);
        node.update_inventory(inv);
    }
    let r = Arc::new(Router::new(Arc::new(fleet), &config));
    let p = Profile::parse(Endpoint::Chat, br#"{"model":"qwen:32b","messages":[]}"#).unwrap();
    let d = r.decide(&p).unwrap();
    assert_eq!(d.ranked.len(), 1);
    assert_eq!(d.ranked[0].node.name(), "big");
}

#[test]
fn requests_waiting_for_a_node_count_in_its_queue_depth() {
    let r = router(2, 1);
    let p = chat(&["x"]);
    let node = r.fleet.nodes()[0].clone();
    let _running = r.try_dispatch(&node, &p).unwrap();
    assert!(r.try_dispatch(&node, &p).is_none(), "one slot: full");
    let _waiting = r.wait_ticket(&node, MODEL, false, 10).unwrap();
    assert_eq!(r.waiting(), 1);
    assert!(
        r.wait_ticket(&node, MODEL, false, 1).is_none(),
        "max_waiting reached"
    );
    let d = r.decide(&chat(&["y"])).unwrap();
    let queue = d
        .ranked
        .iter()
        .find(|c| c.node.id == node.id)
        .unwrap()
        .scores
        .queue_depth;
    assert_eq!(queue, -12.0, "one running and one waiting");
    drop(_waiting);
    assert_eq!(r.waiting(), 0);
    assert_eq!(node.lock_books().models[MODEL].waiting, 0);
}

#[test]
fn a_cold_request_leaves_a_freed_slot_to_a_request_waiting_warm_for_it() {
    let r = router(1, 2);
    let p = chat(&["x"]);
    let node = r.fleet.nodes()[0].clone();
    let candidate = &r.decide(&p).unwrap().ranked[0];
    let running = r.try_dispatch(&node, &p).unwrap();
    let warm = r.wait_ticket(&node, MODEL, true, 10).unwrap();
    let _cold = r.wait_ticket(&node, MODEL, false, 10).unwrap();
    assert_eq!(node.lock_books().models[MODEL].waiting_warm, 1);
    // One slot free, one request waiting warm for it: a yielding request leaves it.
    assert!(
        r.try_send(candidate, &p, true).is_none(),
        "left to the warm one"
    );
    // Two free, one warm waiter: one is left to take.
    let other = r.try_dispatch(&node, &p).unwrap();
    drop(running);
    drop(other);
    let taken = r
        .try_send(candidate, &p, true)
        .expect("a slot beyond the warm one's");
    assert!(r.try_send(candidate, &p, true).is_none());
    // Not yielding (warm itself, or waited long enough), it takes the slot.
    let last = r.try_send(candidate, &p, false).expect("takes its turn");
    drop((taken, last));
    // The warm request decided: its claim goes with its ticket.
    drop(warm);
    assert_eq!(node.lock_books().models[MODEL].waiting_warm, 0);
    assert!(r.try_send(candidate, &p, true).is_some());
}

#[test]
fn a_cold_request_does_not_probe_into_a_slot_it_leaves_to_a_warm_waiter() {
    // Not told its slots: believed to run one, probed one past that.
    let r = router(1, 0);
    let p = chat(&["x"]);
    let node = r.fleet.nodes()[0].clone();
    let candidate = &r.decide(&p).unwrap().ranked[0];
    let _warm = r.wait_ticket(&node, MODEL, true, 10).unwrap();
    assert!(
        r.try_send(candidate, &p, true).is_none(),
        "left to the warm one"
    );
    assert!(
        r.try_probe(candidate, &p, true).is_none(),
        "nor sent as a probe into it"
    );
    let running = r
        .try_send(candidate, &p, false)
        .expect("the warm one's turn");
    // Full by belief: the slot a probe would find is the warm waiter's too.
    assert!(r.try_probe(candidate, &p, true).is_none());
    assert!(r.try_probe(candidate, &p, false).is_some());
    drop(running);
}

#[test]
fn a_warm_request_leaving_the_queue_wakes_those_that_left_it_a_slot() {
    use futures::FutureExt;
    let r = router(1, 1);
    let node = r.fleet.nodes()[0].clone();
    let listener = r.listen(MODEL, Requester::default());
    let news = listener.news(&r.fleet.wakeups);
    tokio::pin!(news);
    r.wait_ticket(&node, MODEL, false, 10).unwrap().leave();
    assert!(
        news.as_mut().now_or_never().is_none(),
        "a cold one: no news"
    );
    r.wait_ticket(&node, MODEL, true, 10).unwrap().leave();
    assert!(news.as_mut().now_or_never().is_some(), "a warm one gave up");
    assert_eq!(r.waiting(), 0);
}

/// Two empty 24 GB nodes with three 10 GB models on disk: each holds two of them.
fn empty_pair() -> Arc<Router> {
    let r = router(2, 2);
    for node in r.fleet.nodes().iter() {
        let mut inv = Inventory {
            polled_at: Some(Instant::now()),
            ..Default::default()
        };
        for m in ["x:1", "y:1", "z:1"] {
            inv.on_disk.insert(m.into(), 10_000_000_000);
        }
        node.update_inventory(inv);
    }
    r
}

fn ask(model: &str, text: &str) -> Profile {
    let body = serde_json::json!({
        "model": model,
        "messages": [{ "role": "user", "content": text }],
    });
    Profile::parse(Endpoint::Chat, body.to_string().as_bytes()).unwrap()
}

/// Decides and sends as the forwarder does, under the placement lock.
fn place(r: &Arc<Router>, p: &Profile) -> Dispatch {
    let placing = r.placement();
    let d = r.decide(p).unwrap();
    let reserved = r.try_send(&d.ranked[0], p, false).unwrap();
    reserved.commit(p, &d, &placing)
}

#[test]
fn requests_arriving_together_see_each_others_loads() {
    let r = empty_pair();
    let mut sent = Vec::new();
    for (i, model) in ["x:1", "y:1", "z:1", "x:1", "y:1", "z:1"]
        .iter()
        .enumerate()
    {
        let d = place(&r, &ask(model, &format!("conversation {i}")));
        sent.push((model.to_string(), d));
    }
    let node_of = |model: &str| -> Vec<u16> {
        let mut ids: Vec<u16> = sent
            .iter()
            .filter(|(m, _)| m == model)
            .map(|(_, d)| d.node.id)
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    };
    for model in ["x:1", "y:1", "z:1"] {
        assert_eq!(node_of(model).len(), 1, "{model} loaded on one node only");
    }
    let loads = sent.iter().filter(|(_, d)| d.starts_load()).count();
    assert_eq!(loads, 3, "each model loaded once");
    for node in r.fleet.nodes().iter() {
        let on_node = sent.iter().filter(|(_, d)| d.node.id == node.id);
        let mut models: Vec<&str> = on_node.map(|(m, _)| m.as_str()).collect();
        models.sort_unstable();
        models.dedup();
        assert!(models.len() <= 2, "{} asked for {models:?}", node.name());
    }
    // The reservation ends with its request; the model then counts as resident
    // because the reply came from it.
    let (model, first) = sent.remove(0);
    let node = first.node.clone();
    end(first);
    let d = r.decide(&ask(&model, "later")).unwrap();
    let c = d.ranked.iter().find(|c| c.node.id == node.id).unwrap();
    assert!(c.resident && c.scores.model_loaded == 50.0);
    assert!(node.lock_books().models[&model].loading.is_none());
}

#[test]
fn what_a_poll_lists_stays_resident_and_later_replies_count_only_up_to_memory() {
    let r = empty_pair();
    let node = r.fleet.nodes()[0].clone();
    // memory_gb says 24 GB, yet the poll lists 30 GB: the poll is believed.
    let mut inv = (*node.inventory()).clone();
    for m in ["x:1", "y:1", "z:1"] {
        let size = 10_000_000_000;
        let r = Resident {
            size,
            context_length: None,
            expires_at: None,
        };
        inv.resident.insert(m.into(), r);
    }
    inv.polled_at = Some(Instant::now());
    node.update_inventory(inv);
    let loaded_on_0 = |model: &str| {
        let d = r.decide(&ask(model, "q")).unwrap();
        let c = d.ranked.iter().find(|c| c.node.id == node.id).unwrap();
        c.resident
    };
    assert!(["x:1", "y:1", "z:1"].iter().all(|m| loaded_on_0(m)));

    // Node 1 polled empty; replies then came from x, y and z in turn: only the two
    // most recent fit its 24 GB, so x is taken as evicted.
    let other = r.fleet.nodes()[1].clone();
    for m in ["x:1", "y:1", "z:1"] {
        std::thread::sleep(Duration::from_millis(2));
        let p = ask(m, "q");
        let d = sent(&r, r.try_dispatch(&other, &p).unwrap(), &p);
        end(d);
    }
    let held_on_1 = |model: &str| {
        let d = r.decide(&ask(model, "q")).unwrap();
        d.ranked.iter().any(|c| c.node.id == other.id && c.resident)
    };
    assert!(!held_on_1("x:1"));
    assert!(held_on_1("y:1") && held_on_1("z:1"));
}

#[test]
fn a_load_that_would_evict_a_busy_model_ranks_after_one_that_evicts_an_idle_one() {
    let r = empty_pair();
    let nodes = r.fleet.nodes();
    // Each node holds two models; on node 0 both have requests running.
    for (node, models) in nodes.iter().zip([["x:1", "y:1"], ["x:1", "y:1"]]) {
        let mut inv = (*node.inventory()).clone();
        for m in models {
            inv.resident.insert(
                m.into(),
                Resident {
                    size: 10_000_000_000,
                    context_length: None,
                    expires_at: None,
                },
            );
        }
        inv.polled_at = Some(Instant::now());
        node.update_inventory(inv);
    }
    let _x = r.try_dispatch(&nodes[0], &ask("x:1", "a")).unwrap();
    let _y = r.try_dispatch(&nodes[0], &ask("y:1", "b")).unwrap();
    // Node 0 scores higher on every other count: a role names the model.
    let mut settings = (*nodes[0].settings()).clone();
    settings.roles = vec!["z:1".into()];
    nodes[0].set_settings(settings);
    let d = r.decide(&ask("z:1", "c")).unwrap();
    assert!(d.ranked[0].scores.total() < d.ranked[1].scores.total());
    assert_eq!(
        d.ranked[0].node.id, nodes[1].id,
        "idle models evicted instead"
    );
    assert!(d.ranked[1].evicts_busy && !d.ranked[0].evicts_busy);
}

#[test]
fn down_nodes_rank_last_but_are_not_refused() {
    let r = router(2, 2);
    let nodes = r.fleet.nodes();
    let rules = Rules::of(&r.config());
    r.fleet.learn(&nodes[0], Evidence::Refused, &rules);
    let d = r.decide(&chat(&["x"])).unwrap();
    assert_eq!(d.ranked[0].node.id, nodes[1].id);
    assert!(d.ranked[1].standby && !d.ranked[0].standby);
    r.fleet.learn(&nodes[1], Evidence::Refused, &rules);
    let d = r.decide(&chat(&["x"])).unwrap();
    assert_eq!(
        d.ranked.len(),
        2,
        "with every node down, still better than a refusal"
    );
    assert!(d.ranked.iter().all(|c| c.standby));
}

#[test]
fn slower_node_is_penalized_by_what_it_showed() {
    let r = router(2, 4);
    let p = chat(&["x"]);
    for (node, decode) in [(0, 100.0), (1, 25.0)] {
        let d = sent(&r, r.try_dispatch(&r.fleet.nodes()[node], &p).unwrap(), &p);
        d.finish(Outcome {
            ok: true,
            decode_tps: Some(decode),
            ..Default::default()
        });
    }
    let d = r.decide(&chat(&["y"])).unwrap();
    let latency = |id: usize| {
        d.ranked
            .iter()
            .find(|c| usize::from(c.node.id) == id)
            .unwrap()
            .scores
            .latency
    };
    assert_eq!(latency(0), 0.0);
    assert!((latency(1) + 15.0 * 0.75).abs() < 0.01, "{}", latency(1));
}

#[test]
fn ties_break_the_same_way_every_time() {
    let a = router(3, 2);
    let b = router(3, 2);
    for c in ["x", "y", "z", "w"] {
        let p = chat(&[c]);
        let pick = |r: &Arc<Router>| r.decide(&p).unwrap().ranked[0].node.id;
        assert_eq!(pick(&a), pick(&b));
    }
}

#[test]
fn probes_go_one_past_what_a_node_not_told_its_slots_was_shown_to_run() {
    // Not told (0): Ollama's default of 1 is believed until replies show more.
    let r = router(1, 0);
    let node = r.fleet.nodes()[0].clone();
    let p = chat(&["a new conversation"]);
    let decision = r.decide(&p).unwrap();
    let candidate = &decision.ranked[0];
    let counted = |r: &Arc<Router>| r.decide(&p).unwrap().ranked[0].scores.queue_depth;
    let mut first = sent(
        &r,
        r.try_send(candidate, &p, false).expect("a slot free"),
        &p,
    );
    first.first_byte();
    assert!(
        r.try_send(candidate, &p, false).is_none(),
        "believed to run one"
    );
    // Counted as running two while one is only a lower bound: no queue yet.
    assert_eq!(counted(&r), 0.0);
    let mut second = sent(&r, r.try_probe(candidate, &p, false).expect("probed"), &p);
    assert!(r.try_probe(candidate, &p, false).is_none(), "two at most");
    // Its first byte came while the first streamed: it runs two.
    second.first_byte();
    assert_eq!(node.parallel(), 2);
    // Now up to three: one probe at a time, however many it was shown to run.
    let mut third = sent(&r, r.try_probe(candidate, &p, false).expect("probed"), &p);
    assert!(r.try_probe(candidate, &p, false).is_none(), "three at most");
    third.first_byte();
    assert_eq!(node.parallel(), 3);
    assert_eq!(counted(&r), 0.0, "counted as running four");
    // A probe sent past three that begins beside two: either it ran beside one that
    // ended first, or the node queued it. Its reply's durations tell.
    let reply = |prefill_ms: u64| {
        let json = format!(
            r#"{{"done":true,"prompt_eval_count":12,"prompt_eval_duration":{},"eval_count":5,"eval_duration":1000000}}"#,
            prefill_ms * 1_000_000
        );
        ReplyStats::parse(json.as_bytes()).unwrap()
    };
    let step = Duration::from_millis(20);
    let mut ran_at_once = sent(&r, r.try_probe(candidate, &p, false).expect("probed"), &p);
    std::thread::sleep(step);
    drop(second);
    ran_at_once.first_byte();
    // All of its time to first byte (at least 20 ms) was prefill: it ran at once.
    ran_at_once.observe(&reply(1_000));
    assert_eq!(counted(&r), 0.0, "still a lower bound");
    drop(ran_at_once);
    let mut queued = sent(&r, r.try_probe(candidate, &p, false).expect("probed"), &p);
    std::thread::sleep(step);
    drop(first);
    queued.first_byte();
    // 20 ms or more to its first byte, 1 ms of prefill: it waited for a slot.
    queued.observe(&reply(1));
    assert_eq!(node.parallel(), 3);
    // Settled at three: with three running, a fourth would wait.
    let _another = r
        .try_send(candidate, &p, false)
        .expect("two running, a slot free");
    assert!(counted(&r) < 0.0, "three running on three");
}

#[test]
fn a_probe_past_the_known_slots_takes_the_slot_that_frees_first_once_shown_queued() {
    // Old runner, slots not told: one slot believed. "a" runs in it when "b" is sent
    // past it as a probe; the node runs b in another slot or queues it, and a keeps
    // its slot either way.
    let r = router_with(1, 0, false, NodeKind::OllamaLegacy);
    let node = r.fleet.nodes()[0].clone();
    let (a, b) = (chat(&["a"]), chat(&["b"]));
    let decision = r.decide(&a).unwrap();
    let candidate = &decision.ranked[0];
    let mut first = r
        .try_send(candidate, &a, false)
        .expect("a slot free")
        .commit(&a, &decision, &r.placement());
    first.first_byte();
    let decision_b = r.decide(&b).unwrap();
    let mut probe =
        r.try_probe(candidate, &b, false)
            .expect("probed")
            .commit(&b, &decision_b, &r.placement());
    assert_eq!(node.lock_books().models[MODEL].slots.len(), 2);
    let follow_up = |name: &str| {
        let d = r.decide(&chat(&[name, "reply", "more"])).unwrap();
        (d.pin.map(|p| p.node), d.affinity_for(0))
    };
    assert_eq!(follow_up("a"), (Some(0), AffinityResult::Hit));
    // b is pinned (the node is the only one that may hold it), but in a slot the node
    // has not shown it runs: not expected warm.
    assert_eq!(follow_up("b"), (Some(0), AffinityResult::Miss));
    // b began only once a had ended: the node queued it, gave it the slot a freed, and
    // so runs one slot. a is gone from the node; b is warm in that slot.
    drop(first);
    probe.first_byte();
    assert_eq!(follow_up("a"), (None, AffinityResult::Miss));
    assert_eq!(follow_up("b"), (Some(0), AffinityResult::Hit));
    drop(probe);
    serve(&r, &chat(&["c"]), 0);
    assert_eq!(node.parallel(), 1);
    assert_eq!(node.lock_books().models[MODEL].slots.len(), 1);
}

#[test]
fn a_probe_that_begins_beside_the_known_slots_keeps_its_own() {
    let r = router_with(1, 0, false, NodeKind::OllamaLegacy);
    let (a, b) = (chat(&["a"]), chat(&["b"]));
    let decision = r.decide(&a).unwrap();
    let candidate = &decision.ranked[0];
    let mut first = r
        .try_send(candidate, &a, false)
        .expect("a slot free")
        .commit(&a, &decision, &r.placement());
    first.first_byte();
    let decision_b = r.decide(&b).unwrap();
    let mut probe =
        r.try_probe(candidate, &b, false)
            .expect("probed")
            .commit(&b, &decision_b, &r.placement());
    // b began while a streamed: the node runs both, each in its own slot.
    probe.first_byte();
    drop((first, probe));
    for name in ["a", "b"] {
        let d = r.decide(&chat(&[name, "reply", "more"])).unwrap();
        assert_eq!(d.affinity_for(0), AffinityResult::Hit, "{name}");
    }
}

#[test]
fn a_new_conversations_first_token_gives_the_nodes_cold_rate_before_its_reply_ends() {
    let r = router(1, 1);
    let node = r.fleet.nodes()[0].clone();
    let cold_rate = || node.lock_books().models[MODEL].warm.cold_rate.get();
    let body = serde_json::json!({
        "model": MODEL,
        "messages": [{ "role": "user", "content": "x".repeat(4_000) }],
        "stream": true,
    });
    let p = Profile::parse(Endpoint::Chat, body.to_string().as_bytes()).unwrap();
    let decision = r.decide(&p).unwrap();
    let mut d = r
        .try_dispatch(&node, &p)
        .unwrap()
        .commit(&p, &decision, &r.placement());
    assert_eq!(cold_rate(), None);
    let step = Duration::from_millis(20);
    std::thread::sleep(step);
    d.first_byte();
    // Its whole prompt (about 1,000 tokens) in at least 20 ms.
    let rate = cold_rate().expect("known at the first token");
    assert!(rate > 0.0 && rate <= p.prompt_tokens as f64 / step.as_secs_f64());
}

#[test]
fn a_node_slow_to_begin_a_request_is_sent_one_more_which_takes_the_slot_that_frees_first() {
    let r = queuing_router(1, 1);
    let node = r.fleet.nodes()[0].clone();
    let long = "x".repeat(400);
    let (a, b, c) = (
        chat(&["a", "r", &long]),
        chat(&["b", "r", &long]),
        chat(&["c", "r", &long]),
    );
    let decision = r.decide(&a).unwrap();
    let candidate = &decision.ranked[0];
    // "a" began its prompt 120 ms or more after it was sent, into a free slot: the
    // node's start-up (1 ms of it prefill).
    let mut first = sent(&r, r.try_send(candidate, &a, false).expect("free"), &a);
    assert!(
        r.try_queue(candidate, &b, false).is_none(),
        "no start-up measured: corral keeps the choice of node"
    );
    began_after(&mut first, Duration::from_millis(120));
    end(first);
    let mut running = sent(&r, r.try_send(candidate, &c, false).expect("free"), &c);
    running.first_byte();
    assert!(
        r.try_send(candidate, &b, false).is_none(),
        "its one slot runs c"
    );
    let mut queued = sent(&r, r.try_queue(candidate, &b, false).expect("queued"), &b);
    assert!(
        r.try_queue(candidate, &a, false).is_none(),
        "one queued at most"
    );
    let follow_up = |turns: &Profile| {
        let d = r.decide(turns).unwrap();
        d.affinity_for(0)
    };
    let more = |name: &str| chat(&[name, "r", &long, "reply", "more"]);
    // While b waits in the node's queue, c still holds the slot, and b holds none yet.
    assert_eq!(follow_up(&more("c")), AffinityResult::Hit);
    assert_eq!(follow_up(&more("b")), AffinityResult::Miss);
    // c ended, b began in the slot it freed: c went to the host cache, as any
    // conversation displaced from a slot does.
    end(running);
    queued.first_byte();
    assert_eq!(follow_up(&more("b")), AffinityResult::Hit);
    assert_eq!(follow_up(&more("c")), AffinityResult::Host);
    // c's next turn queues behind b: it stays in the host cache until it begins in the slot
    // b frees, and then leaves it.
    let c_lineage = r
        .decide(&more("c"))
        .unwrap()
        .pin
        .expect("in host memory")
        .lineage;
    let reserved = r.try_queue(candidate, &more("c"), false).expect("queued");
    let mut c_queued = sent(&r, reserved, &more("c"));
    assert!(in_host_cache(&r, c_lineage), "c waits in the node's queue");
    end(queued);
    c_queued.first_byte();
    assert!(!in_host_cache(&r, c_lineage), "c began in b's slot");
    end(c_queued);
    // The place the mirror held b and c in meanwhile, past the node's slots, is gone.
    serve(&r, &chat(&["d"]), 0);
    assert_eq!(node.lock_books().models[MODEL].slots.len(), 1);
}

#[test]
fn a_request_is_not_put_where_a_queued_one_waited_past_the_nodes_slots() {
    let r = queuing_router(1, 2);
    let long = "x".repeat(400);
    let conv = |name: &str| chat(&[name, "r", &long]);
    let more = |name: &str| chat(&[name, "r", &long, "reply", "more"]);
    let decision = r.decide(&conv("a")).unwrap();
    let candidate = &decision.ranked[0];
    let send = |name: &str| {
        sent(
            &r,
            r.try_send(candidate, &conv(name), false).unwrap(),
            &conv(name),
        )
    };
    let queue = |name: &str| {
        let reserved = r.try_queue(candidate, &more(name), false).expect("queued");
        sent(&r, reserved, &more(name))
    };
    let pause = || std::thread::sleep(Duration::from_millis(2));
    let mut a = send("a");
    began_after(&mut a, Duration::from_millis(120));
    end(a);
    for name in ["q1", "q2"] {
        serve(&r, &conv(name), 0);
    }
    let (mut r1, mut r2) = (send("r1"), send("r2"));
    r1.first_byte();
    r2.first_byte();
    // Two follow-ups queue at the node in turn, each taking the slot that frees next.
    let mut q1 = queue("q1");
    pause();
    end(r1);
    let mut q2 = queue("q2");
    q1.first_byte();
    pause();
    end(r2);
    pause();
    end(q1);
    // A slot is free: a new conversation goes into one of the node's two, not into the
    // place q1 waited in past them.
    let mut n = send("n");
    n.first_byte();
    q2.first_byte();
    end(n);
    end(q2);
    let affinity = |name: &str| {
        r.decide(&chat(&[name, "r", &long, "reply", "more", "r", "again"]))
            .unwrap()
            .affinity_for(0)
    };
    assert_eq!(affinity("q1"), AffinityResult::Host);
    assert_eq!(affinity("q2"), AffinityResult::Hit);
    let new_follow_up = r.decide(&more("n")).unwrap();
    assert_eq!(new_follow_up.affinity_for(0), AffinityResult::Hit);
}

#[test]
fn a_node_is_sent_no_more_than_it_runs_unless_set_to_queue_and_slow_to_begin() {
    // (set to queue, time to first byte beyond the 1 ms of prefill reported, queued?)
    let cases = [
        (true, Duration::ZERO, false),
        (false, Duration::from_millis(120), false),
        (true, Duration::from_millis(120), true),
    ];
    for (queue_at_node, wait, queued) in cases {
        let r = if queue_at_node {
            queuing_router(1, 1)
        } else {
            router(1, 1)
        };
        let (a, b, c) = (chat(&["a"]), chat(&["b"]), chat(&["c"]));
        let decision = r.decide(&a).unwrap();
        let candidate = &decision.ranked[0];
        let mut first = sent(&r, r.try_send(candidate, &a, false).expect("free"), &a);
        began_after(&mut first, wait);
        end(first);
        let _running = sent(&r, r.try_send(candidate, &c, false).expect("free"), &c);
        assert!(
            r.try_send(candidate, &b, false).is_none(),
            "its one slot runs c"
        );
        let case = (queue_at_node, wait);
        assert_eq!(
            r.try_queue(candidate, &b, false).is_some(),
            queued,
            "{case:?}"
        );
    }
}
