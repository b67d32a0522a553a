//! The eight scoring signals. Each is a small pure function of what is known about one node
//! and one request; [`super::score`] adds them up.

use crate::config::Weights;

/// Signal 1: a resident model answers without a load.
pub fn model_loaded(resident: bool, w: &Weights) -> f64 {
    if resident { w.model_loaded } else { 0.0 }
}

/// What is known about the room a model needs on a node, in bytes.
#[derive(Clone, Copy, Debug, Default)]
pub struct Memory {
    /// The model's size in memory (or on disk, when it was never seen loaded).
    pub need: Option<u64>,
    /// The node's memory for models, when configured.
    pub total: Option<u64>,
    /// Bytes taken by the models resident now.
    pub used: u64,
}

/// Signal 2: full marks when resident, most when the model fits in free memory, little when
/// loading it must evict other models. `None` when it cannot fit even on an empty node: the
/// node is then not a candidate. Among nodes where it fits, the snugger fit scores higher
/// (best fit): small nodes take the models that fit them, and large free memory is left
/// for the models that need it.
pub fn memory_fit(resident: bool, m: Memory, w: &Weights) -> Option<f64> {
    if resident {
        return Some(w.memory_fit);
    }
    let (Some(need), Some(total)) = (m.need, m.total) else {
        // Unknown size or memory: neither reward nor rule out.
        return Some(w.memory_fit / 2.0);
    };
    if need > total {
        return None;
    }
    let free = total.saturating_sub(m.used);
    if need <= free {
        let snug = if free == 0 {
            1.0
        } else {
            need as f64 / free as f64
        };
        Some(w.memory_fit * (0.75 + 0.25 * snug))
    } else {
        let shortfall = (need - free) as f64 / need as f64;
        Some(w.memory_fit * 0.25 * (1.0 - shortfall))
    }
}

/// The queue a request meets on a node where `depth` requests are running or waiting for
/// the model and `parallel` run at once: the requests that must end before it starts, per
/// slot, i.e. its expected wait in service times. With one slot (Ollama's default) it is the
/// depth itself; a request running beside a free slot delays nobody.
pub fn queue(depth: u32, parallel: usize) -> f64 {
    let parallel = parallel.max(1) as f64;
    (f64::from(depth) + 1.0 - parallel).max(0.0) / parallel
}

/// Signal 3: every request ahead in the node's queue ([`queue`]) costs the same.
pub fn queue_depth(queue: f64, w: &Weights) -> f64 {
    -w.queue_depth * queue
}

/// Tokens per second, as learned from the node's replies.
#[derive(Clone, Copy, Debug, Default)]
pub struct Speed {
    pub prefill: Option<f64>,
    pub decode: Option<f64>,
}

/// Signal 4: a penalty for being slower than the fleet's best for this model, on prefill or
/// decode, whichever is worse. Half the weight at twice as slow, never more than the
/// weight, so a slow node still gets work when the fast ones are busy. Nothing is known of
/// a node without history, and it is not penalized; a speed may be an upper bound (a node
/// not measured yet, no faster than its unanswered requests allow), which penalizes it no
/// more than it surely deserves.
pub fn latency(node: Speed, best: Speed, w: &Weights) -> f64 {
    fn slowdown(node: Option<f64>, best: Option<f64>) -> f64 {
        match (node, best) {
            (Some(n), Some(b)) if n > 0.0 && b > 0.0 => (b / n).max(1.0),
            _ => 1.0,
        }
    }
    let worst = slowdown(node.prefill, best.prefill).max(slowdown(node.decode, best.decode));
    -w.latency * (1.0 - 1.0 / worst)
}

/// The classes of a request that node roles can name.
#[derive(Clone, Copy, Debug)]
pub struct RequestClass<'a> {
    /// `chat`, `generate`, `embed` or `show`.
    pub endpoint: &'a str,
    /// Normalized model name, `llama3:8b`.
    pub model: &'a str,
    /// `small`, `medium` or `large`, when the model's size is known.
    pub size: Option<&'static str>,
}

/// Size classes by model bytes: under 4 GB small, under 16 GB medium, else large.
pub fn size_class(bytes: u64) -> &'static str {
    match bytes {
        0..4_000_000_000 => "small",
        4_000_000_000..16_000_000_000 => "medium",
        _ => "large",
    }
}

/// Signal 5: a bonus when one of the node's roles names the request's class, its model
/// (with or without tag) or its size class.
pub fn role_affinity(roles: &[String], class: RequestClass, w: &Weights) -> f64 {
    let base = class.model.strip_suffix(":latest").unwrap_or(class.model);
    let family = class.model.split(':').next().unwrap_or(class.model);
    let matches = roles.iter().any(|role| {
        let role = role.as_str();
        role.eq_ignore_ascii_case(class.endpoint)
            || role == class.model
            || role == base
            || role == family
            || class.size.is_some_and(|s| role.eq_ignore_ascii_case(s))
    });
    if matches { w.role_affinity } else { 0.0 }
}

/// Signal 6: a bonus in proportion to the node's recent success ratio.
pub fn availability(success_ratio: f64, w: &Weights) -> f64 {
    w.availability * success_ratio.clamp(0.0, 1.0)
}

/// Signal 7: full bonus when the prompt fills at most three quarters of the context it will
/// run in, tapering to zero at a full context; twice the weight as a penalty when it would
/// overflow, or when the request's `num_ctx` differs from the loaded one (Ollama reloads the
/// model then). Nothing when the context is unknown.
pub fn context_fit(
    prompt_tokens: u32,
    requested_ctx: Option<u32>,
    loaded_ctx: Option<u32>,
    w: &Weights,
) -> f64 {
    if let (Some(requested), Some(loaded)) = (requested_ctx, loaded_ctx)
        && requested != loaded
    {
        return -2.0 * w.context_fit;
    }
    let Some(ctx) = requested_ctx.or(loaded_ctx).filter(|c| *c > 0) else {
        return 0.0;
    };
    let fill = f64::from(prompt_tokens) / f64::from(ctx);
    if fill > 1.0 {
        -2.0 * w.context_fit
    } else if fill <= 0.75 {
        w.context_fit
    } else {
        w.context_fit * (1.0 - fill) / 0.25
    }
}

/// Where a request's conversation stands on one node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Warmth {
    /// The node holds the conversation's longest warm prefix.
    HoldsPrefix,
    /// A new conversation here would push another warm one out of the model's slots.
    WouldDisplace,
    /// A free or cold slot is there for it.
    Free,
}

/// Signal 8: the node holding the warm prefix gets `weight / (1 + queue / 2)` ([`queue`]), so
/// that a saturated node loses to an idle peer. A node where the request would displace
/// another conversation's warm slot pays a small penalty, steering new conversations to free
/// slots.
pub fn session_affinity(warmth: Warmth, queue: f64, w: &Weights) -> f64 {
    match warmth {
        Warmth::HoldsPrefix => w.session_affinity / (1.0 + queue / 2.0),
        Warmth::WouldDisplace => -w.slot_displacement,
        Warmth::Free => 0.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w() -> Weights {
        Weights::default()
    }

    #[test]
    fn loaded_is_fifty() {
        assert_eq!(model_loaded(true, &w()), 50.0);
        assert_eq!(model_loaded(false, &w()), 0.0);
    }

    #[test]
    fn memory_fit_orders_resident_free_evicting() {
        let gb = 1_000_000_000;
        let resident = memory_fit(true, Memory::default(), &w()).unwrap();
        let roomy = memory_fit(
            false,
            Memory {
                need: Some(5 * gb),
                total: Some(24 * gb),
                used: 0,
            },
            &w(),
        )
        .unwrap();
        let tight = memory_fit(
            false,
            Memory {
                need: Some(5 * gb),
                total: Some(24 * gb),
                used: 18 * gb,
            },
            &w(),
        )
        .unwrap();
        let evicting = memory_fit(
            false,
            Memory {
                need: Some(5 * gb),
                total: Some(24 * gb),
                used: 22 * gb,
            },
            &w(),
        )
        .unwrap();
        assert_eq!(resident, 20.0);
        assert!(
            resident > tight && tight > roomy && roomy > evicting,
            "best fit first: {tight} {roomy} {evicting}"
        );
        assert!(roomy >= 15.0 && evicting <= 5.0);
        // A small node that the model fills beats a large empty one.
        let small = Memory {
            need: Some(5 * gb),
            total: Some(8 * gb),
            used: 0,
        };
        let large = Memory {
            total: Some(24 * gb),
            ..small
        };
        assert!(memory_fit(false, small, &w()) > memory_fit(false, large, &w()));
        assert_eq!(
            memory_fit(
                false,
                Memory {
                    need: Some(40 * gb),
                    total: Some(24 * gb),
                    used: 0
                },
                &w()
            ),
            None
        );
        assert_eq!(
            memory_fit(
                false,
                Memory {
                    need: None,
                    total: Some(24 * gb),
                    used: 0
                },
                &w()
            ),
            Some(10.0)
        );
    }

    #[test]
    fn queue_costs_six_each() {
        assert_eq!(queue_depth(0.0, &w()), 0.0);
        assert_eq!(queue_depth(3.0, &w()), -18.0);
    }

    #[test]
    fn the_queue_counts_what_waits_for_a_slot_per_slot() {
        // One slot: every request running or waiting is ahead.
        assert_eq!(queue(0, 1), 0.0);
        assert_eq!(queue(1, 1), 1.0);
        assert_eq!(queue(2, 1), 2.0);
        // Four slots: nobody waits until all four run; then one slot's turn per request.
        assert_eq!(queue(3, 4), 0.0);
        assert_eq!(queue(4, 4), 0.25);
        assert_eq!(queue(8, 4), 1.25);
        assert_eq!(queue(2, 0), 2.0, "unknown slots count as one");
    }

    #[test]
    fn latency_penalizes_slower_nodes_boundedly() {
        let best = Speed {
            prefill: Some(1000.0),
            decode: Some(50.0),
        };
        assert_eq!(latency(best, best, &w()), 0.0);
        let half = Speed {
            prefill: Some(1000.0),
            decode: Some(25.0),
        };
        assert_eq!(latency(half, best, &w()), -7.5);
        let crawl = Speed {
            prefill: Some(1.0),
            decode: Some(0.1),
        };
        let p = latency(crawl, best, &w());
        assert!(p < -14.0 && p > -15.0, "{p}");
        assert_eq!(latency(Speed::default(), best, &w()), 0.0);
    }

    #[test]
    fn roles_match_endpoint_model_family_or_size() {
        let class = RequestClass {
            endpoint: "chat",
            model: "llama3:70b",
            size: Some("large"),
        };
        let roles = |r: &[&str]| r.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(role_affinity(&roles(&["chat"]), class, &w()), 10.0);
        assert_eq!(role_affinity(&roles(&["llama3:70b"]), class, &w()), 10.0);
        assert_eq!(role_affinity(&roles(&["llama3"]), class, &w()), 10.0);
        assert_eq!(role_affinity(&roles(&["large"]), class, &w()), 10.0);
        assert_eq!(role_affinity(&roles(&["embed", "small"]), class, &w()), 0.0);
        assert_eq!(role_affinity(&[], class, &w()), 0.0);
        assert_eq!(size_class(274_000_000), "small");
        assert_eq!(size_class(9_000_000_000), "medium");
        assert_eq!(size_class(40_000_000_000), "large");
    }

    #[test]
    fn availability_scales_with_success() {
        assert_eq!(availability(1.0, &w()), 10.0);
        assert_eq!(availability(0.5, &w()), 5.0);
        assert_eq!(availability(7.0, &w()), 10.0);
    }

    #[test]
    fn context_fit_rewards_room_and_punishes_overflow_or_reload() {
        assert_eq!(context_fit(1000, None, Some(8192), &w()), 5.0);
        assert_eq!(context_fit(7168, None, Some(8192), &w()), 2.5);
        assert_eq!(context_fit(9000, None, Some(8192), &w()), -10.0);
        assert_eq!(context_fit(1000, Some(4096), Some(8192), &w()), -10.0);
        assert_eq!(context_fit(1000, Some(8192), Some(8192), &w()), 5.0);
        assert_eq!(context_fit(1000, None, None, &w()), 0.0);
    }

    #[test]
    fn session_affinity_shrinks_with_queue() {
        assert_eq!(session_affinity(Warmth::HoldsPrefix, 0.0, &w()), 20.0);
        assert!((session_affinity(Warmth::HoldsPrefix, 1.0, &w()) - 13.333).abs() < 0.01);
        assert_eq!(session_affinity(Warmth::HoldsPrefix, 2.0, &w()), 10.0);
        assert_eq!(session_affinity(Warmth::WouldDisplace, 0.0, &w()), -8.0);
        assert_eq!(session_affinity(Warmth::Free, 5.0, &w()), 0.0);
    }
}
