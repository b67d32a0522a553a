//! Whether a follow-up should wait for the node that holds its conversation warm, decided
//! in seconds rather than by queue length alone.
//!
//! The myopic rule, "go where the request starts soonest", keeps too little warm: every
//! follow-up moved copies its conversation into a second node's cache and pushes other
//! conversations out there, so the fleet's cache shrinks and later turns pay for it. A move
//! therefore costs its whole prefill on the other node twice: once now, and once more in
//! what it displaces. Conversations stay partitioned and move only when their node is
//! overloaded for real.

/// Seconds until a request would start on a node running `depth` requests (running or
/// waiting for it) with `parallel` slots, each request taking `service_s` seconds.
pub fn expected_wait(depth: u32, parallel: usize, service_s: f64) -> f64 {
    let parallel = parallel.max(1) as f64;
    let ahead = (f64::from(depth) + 1.0 - parallel).max(0.0);
    ahead * service_s / parallel
}

/// Seconds a move would cost: the uncached prompt at the other node's cold prefill rate,
/// `factor` times (2: itself, and once more in what its copy displaces there).
pub fn move_cost(prompt_tokens: u32, cold_tps: f64, factor: f64) -> Option<f64> {
    (cold_tps > 0.0).then(|| factor * f64::from(prompt_tokens) / cold_tps)
}

/// The follow-up stays on its warm node unless it would start there later than a move,
/// counted with its cost, would let it start elsewhere.
pub fn stays(warm_wait_s: f64, other_wait_s: f64, move_cost_s: f64) -> bool {
    warm_wait_s <= other_wait_s + move_cost_s
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
}
