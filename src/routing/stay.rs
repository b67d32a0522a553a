//! Whether a follow-up should wait for the node that holds its conversation warm, decided
//! in seconds rather than by queue length alone.
//!
//! The myopic rule, "go where the request starts soonest", keeps too little warm: every
//! follow-up moved copies its conversation into a second node's cache and pushes other
//! conversations out there, so the fleet's cache shrinks and later turns pay for it. A move
//! therefore costs its whole prefill on the other node twice: once now, and once more in
//! what it displaces. Conversations stay partitioned and move only when their node is
//! overloaded for real.

use std::time::Duration;

/// Seconds until a request would start on a node running `depth` requests (running or
/// waiting for it) with `parallel` slots, each request taking `service_s` seconds.
pub fn expected_wait(depth: u32, parallel: usize, service_s: f64) -> f64 {
    super::signals::queue(depth, parallel) * service_s
}

/// Seconds to prefill `tokens` not cached at a node of `cold_tps` prompt tokens a second.
pub fn prefill_s(tokens: u32, cold_tps: f64) -> Option<f64> {
    (cold_tps > 0.0).then(|| f64::from(tokens) / cold_tps)
}

/// A follow-up leaves the node that holds it warm, with a slot free, for an idle one only
/// where its first token would come there in less than `1 / MOVE_MARGIN` of the time: the
/// whole prompt prefilled cold there (`move_s`), against the part after the last reply on
/// its warm node (`stay_s`). A fleet's first conversations go where nothing is measured
/// yet, so some start on its slowest node, and there, held warm, they would stay for good
/// while a node many times faster idles. The turns after the move are not counted: they
/// would run warm on the faster node, so leaving them out only makes moves rarer, and a
/// move never delays the turn that makes it. The margin keeps nodes of about one speed
/// from trading conversations on noise, and pays for the warm copy left behind.
pub fn moves_to_idle(stay_s: f64, move_s: f64) -> bool {
    move_s * MOVE_MARGIN < stay_s
}

/// See [`moves_to_idle`].
const MOVE_MARGIN: f64 = 2.0;

/// Seconds a move would cost: the uncached prompt at the other node's cold prefill rate,
/// `factor` times (2: itself, and once more in what its copy displaces there).
pub fn move_cost(prompt_tokens: u32, cold_tps: f64, factor: f64) -> Option<f64> {
    prefill_s(prompt_tokens, cold_tps).map(|s| factor * s)
}

/// The follow-up stays on its warm node unless it would start there later than a move,
/// counted with its cost, would let it start elsewhere.
pub fn stays(warm_wait_s: f64, other_wait_s: f64, move_cost_s: f64) -> bool {
    warm_wait_s <= other_wait_s + move_cost_s
}

/// A request not warm on a node leaves a slot freed there to the requests waiting warm for
/// it: a warm turn's first token comes after a short prefill, so serving those first lowers
/// the median wait (and a warm turn that waits less is moved less, so more stays warm). It
/// takes its turn after waiting `max_wait / YIELD_SHARE`, so that yielding alone never
/// makes it time out.
pub fn yields_to_warm(warm_there: bool, waited: Duration, max_wait: Duration) -> bool {
    !warm_there && waited < max_wait / YIELD_SHARE
}

/// See [`yields_to_warm`].
const YIELD_SHARE: u32 = 4;

/// Seconds a node is expected to take to load a model: as measured there or on another
/// node, else [`LOAD_PRIOR_S`].
pub fn load_estimate(learned_s: Option<f64>) -> f64 {
    learned_s.unwrap_or(LOAD_PRIOR_S)
}

/// A model load's seconds before any reply showed one: a few gigabytes read from disk.
const LOAD_PRIOR_S: f64 = 5.0;

/// Later turns a new conversation is counted to have where it starts: a conversation
/// stays where it starts, so its home decides what its next turns pay.
pub const TURNS_AHEAD: f64 = 2.0;

/// The share of its slots' time a node is planned to be busy with the conversations it
/// serves, leaving room for their turns to bunch up.
const UTILIZATION: f64 = 0.8;

/// A node as the home of a new conversation.
#[derive(Clone, Copy, Debug)]
pub struct Home {
    /// Seconds until a slot is free there.
    pub wait_s: f64,
    /// Prompt tokens per second when nothing is cached.
    pub cold_tps: f64,
    /// Live conversations it serves, and how many its slots and host cache keep warm.
    pub live: u32,
    pub room: f64,
    /// Live conversations it can serve without its queue growing, where known.
    pub serves: Option<f64>,
    /// Seconds a request takes there.
    pub service_s: f64,
}

/// Live conversations a node with `parallel` slots can serve, each turn taking `service_s`
/// and each conversation pausing `pause_s` between turns, busy [`UTILIZATION`] of the time.
pub fn serves(parallel: usize, service_s: f64, pause_s: f64) -> Option<f64> {
    (service_s > 0.0)
        .then(|| parallel.max(1) as f64 * (pause_s + service_s) / service_s * UTILIZATION)
}

/// Seconds a new conversation costs on a node: the wait for a slot and its prefill there,
/// plus what its [`TURNS_AHEAD`] later turns will cost the node's conversations:
///
/// - nothing while they all fit in its warm room;
/// - where they do not, every conversation there pays a cold prefill on each turn: a
///   node's cache is least-recently-used, and conversations taking turns in a cache too
///   small push each other out in turn. That holds for a node already over as much as for
///   one this conversation would tip over: counting only its own turns there made an
///   overfull fast node the cheapest home for every next conversation, so it never came
///   back under its room;
/// - a service time a turn where the node cannot serve one more without its queue growing.
pub fn start_cost(home: Home, prompt_tokens: u32) -> Option<f64> {
    if home.cold_tps <= 0.0 {
        return None;
    }
    let prefill = f64::from(prompt_tokens) / home.cold_tps;
    let live = f64::from(home.live);
    let made_cold = if live + 1.0 <= home.room {
        0.0
    } else {
        live + 1.0
    };
    let overloaded = home.serves.is_some_and(|serves| live + 1.0 > serves);
    let queued = if overloaded { home.service_s } else { 0.0 };
    Some(home.wait_s + prefill + TURNS_AHEAD * (made_cold * prefill + queued))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_wait_while_a_slot_is_free() {
        assert_eq!(expected_wait(0, 2, 4.0), 0.0);
        assert_eq!(expected_wait(1, 2, 4.0), 0.0);
        assert_eq!(expected_wait(2, 2, 4.0), 2.0);
        assert_eq!(expected_wait(3, 1, 4.0), 12.0);
    }

    #[test]
    fn a_follow_up_waits_for_its_node_unless_the_wait_outweighs_a_move() {
        // 8,000 tokens at 1,000 per second: 8 s of prefill, 16 s counted for the move.
        let cost = move_cost(8_000, 1_000.0, 2.0).unwrap();
        assert_eq!(cost, 16.0);
        assert!(stays(expected_wait(2, 2, 4.0), 0.0, cost), "2 s of wait");
        assert!(!stays(expected_wait(9, 1, 4.0), 0.0, cost), "36 s of wait");
        // A short prompt moves sooner: 200 tokens cost 0.4 s.
        assert!(!stays(2.0, 0.0, move_cost(200, 1_000.0, 2.0).unwrap()));
        assert_eq!(move_cost(100, 0.0, 2.0), None);
    }

    #[test]
    fn a_follow_up_leaves_a_slow_warm_node_only_where_its_first_token_comes_much_sooner() {
        // 900 tokens, 250 of them new since the last reply. Warm on a node of 400 a second
        // its first token takes 0.625 s; idle at 4,000 all 900 take 0.225 s.
        let slow = prefill_s(250, 400.0).unwrap();
        let fast = prefill_s(900, 4_000.0).unwrap();
        assert_eq!((slow, fast), (0.625, 0.225));
        assert!(moves_to_idle(slow, fast));
        // At 2,000 a second (0.45 s) the move is sooner but not twice as soon: it stays.
        assert!(!moves_to_idle(slow, prefill_s(900, 2_000.0).unwrap()));
        // Warm on a node of 1,000 a second (0.25 s), twice 0.225 s is not less.
        assert!(!moves_to_idle(prefill_s(250, 1_000.0).unwrap(), fast));
        // A long history stays where it is warm: 8,000 tokens take 2 s on the fast node.
        assert!(!moves_to_idle(slow, prefill_s(8_000, 4_000.0).unwrap()));
        assert_eq!(prefill_s(1_000, 0.0), None);
    }

    #[test]
    fn a_cold_request_yields_to_warm_waiters_for_a_quarter_of_the_queue_limit() {
        let max_wait = Duration::from_secs(120);
        assert!(yields_to_warm(false, Duration::ZERO, max_wait));
        assert!(yields_to_warm(false, Duration::from_secs(29), max_wait));
        assert!(!yields_to_warm(false, Duration::from_secs(30), max_wait));
        assert!(
            !yields_to_warm(true, Duration::ZERO, max_wait),
            "warm itself"
        );
    }

    #[test]
    fn a_new_conversation_counts_the_cold_turns_it_causes() {
        // 8,000 tokens: 2 s at 4,000 per second, 20 s at 400.
        let home = |cold_tps, live, room| Home {
            wait_s: 0.0,
            cold_tps,
            live,
            room,
            serves: None,
            service_s: 3.0,
        };
        let cost = |h| start_cost(h, 8_000).unwrap();
        assert_eq!(cost(home(4_000.0, 3, 5.0)), 2.0, "room to spare");
        // The sixth in a room of five: all six pay 2 s on each of their next turns.
        assert_eq!(cost(home(4_000.0, 5, 5.0)), 2.0 + TURNS_AHEAD * 6.0 * 2.0);
        // Already over: all eight, and more the further over.
        assert_eq!(cost(home(4_000.0, 7, 5.0)), 2.0 + TURNS_AHEAD * 8.0 * 2.0);
        assert!(cost(home(4_000.0, 8, 5.0)) > cost(home(4_000.0, 7, 5.0)));
        // A tenfold slower node with room costs less than tipping a fast one over or
        // adding to one already over, and more than a fast one with room.
        let slow_room = cost(home(400.0, 1, 5.0));
        assert!(slow_room < cost(home(4_000.0, 5, 5.0)));
        assert!(slow_room < cost(home(4_000.0, 7, 5.0)));
        assert!(cost(home(4_000.0, 3, 5.0)) < slow_room);
        // A node that cannot serve one more pays a service time a turn.
        let busy = Home {
            serves: Some(2.5),
            ..home(4_000.0, 2, 5.0)
        };
        assert_eq!(cost(busy), 2.0 + TURNS_AHEAD * 3.0);
        assert_eq!(start_cost(home(0.0, 0, 5.0), 8_000), None);
    }

    #[test]
    fn a_node_serves_conversations_by_its_slots_and_their_pauses() {
        // 2 slots, turns of 12.5 s, 8 s pauses: 3.28 at full use, 2.6 at 80%.
        let n = serves(2, 12.5, 8.0).unwrap();
        assert!((n - 2.0 * 20.5 / 12.5 * UTILIZATION).abs() < 1e-9);
        assert_eq!(serves(2, 0.0, 8.0), None);
    }
}
