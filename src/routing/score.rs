//! Adding up the signals, ranking the candidates, and explaining the result.

use std::fmt::Write;
use std::hash::Hasher as _;

use serde::Serialize;

/// One candidate's score on each signal.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Scores {
    pub model_loaded: f64,
    pub memory_fit: f64,
    pub queue_depth: f64,
    pub latency: f64,
    pub role_affinity: f64,
    pub availability: f64,
    pub context_fit: f64,
    pub session_affinity: f64,
    // The adjustments after the signals, in the order [`super::choose::rank`] applies them,
    // each in its own field: zero where it did not apply.
    /// A new conversation for a model whose every home has its slots full: a node that can
    /// load it without evicting anything scores as if it were loaded there.
    pub second_home: f64,
    /// A new conversation leads where it costs least in seconds (wait, prefill, and the cold
    /// turns it would cause there).
    pub spread: f64,
    /// A follow-up warm nowhere, on nodes that keep nothing beyond their slots, leads where
    /// it starts soonest.
    pub restart: f64,
    /// A follow-up leads on its busy warm node where it starts there no later than a move
    /// (`weights.move_cost`).
    pub stay: f64,
    /// A follow-up leads on an idle node where its turns cost less than half what they cost
    /// on the slower node holding it warm.
    pub rehome: f64,
    /// A node leads that loads the model where the request would otherwise wait longer.
    pub sooner: f64,
}

impl Scores {
    fn map(&self, f: impl Fn(f64) -> f64) -> Scores {
        Scores {
            model_loaded: f(self.model_loaded),
            memory_fit: f(self.memory_fit),
            queue_depth: f(self.queue_depth),
            latency: f(self.latency),
            role_affinity: f(self.role_affinity),
            availability: f(self.availability),
            context_fit: f(self.context_fit),
            session_affinity: f(self.session_affinity),
            second_home: f(self.second_home),
            spread: f(self.spread),
            restart: f(self.restart),
            stay: f(self.stay),
            rehome: f(self.rehome),
            sooner: f(self.sooner),
        }
    }

    pub fn total(&self) -> f64 {
        self.model_loaded
            + self.memory_fit
            + self.queue_depth
            + self.latency
            + self.role_affinity
            + self.availability
            + self.context_fit
            + self.session_affinity
            + self.adjustments().iter().map(|(_, lead)| lead).sum::<f64>()
    }

    /// The adjustments after the signals, by name, in the order they are applied.
    pub fn adjustments(&self) -> [(&'static str, f64); 6] {
        [
            ("second_home", self.second_home),
            ("spread", self.spread),
            ("restart", self.restart),
            ("stay", self.stay),
            ("rehome", self.rehome),
            ("sooner", self.sooner),
        ]
    }
}

/// Orders candidates best first. Equal totals fall back to a hash of the conversation and
/// the node's name, so that two replicas with the same state choose alike and different
/// conversations spread across equal nodes.
pub fn rank<T>(candidates: &mut [T], key: impl Fn(&T) -> (f64, &str), conversation: u64) {
    let tie = |name: &str| {
        let mut h = crate::request::xxh3();
        h.write(&conversation.to_le_bytes());
        h.write(name.as_bytes());
        h.finish()
    };
    candidates.sort_by(|a, b| {
        let (sa, na) = key(a);
        let (sb, nb) = key(b);
        sb.total_cmp(&sa).then_with(|| tie(nb).cmp(&tie(na)))
    });
}

/// The `X-Fleet-Explain` header value: every candidate's signals, best first.
pub fn explain<'a>(rows: impl Iterator<Item = (&'a str, &'a Scores)>) -> String {
    let mut out = String::new();
    for (i, (name, s)) in rows.enumerate() {
        if i > 0 {
            out.push_str("; ");
        }
        let name: String = name
            .chars()
            .map(|c| {
                if c.is_ascii_graphic() && c != ';' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        // Adding zero turns a negative zero ("-0.0") into a plain one.
        let s = s.map(|x| x + 0.0);
        let _ = write!(
            out,
            "{name} total={:.1} loaded={:.1} memory={:.1} queue={:.1} latency={:.1} role={:.1} availability={:.1} context={:.1} affinity={:.1}",
            s.total(),
            s.model_loaded,
            s.memory_fit,
            s.queue_depth,
            s.latency,
            s.role_affinity,
            s.availability,
            s.context_fit,
            s.session_affinity
        );
        // Adjustments, named only where they applied.
        for (adjustment, lead) in s.adjustments() {
            if lead != 0.0 {
                let _ = write!(out, " {adjustment}={lead:.1}");
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_by_total_then_stable_hash() {
        let mut v = vec![("a", 1.0), ("b", 3.0), ("c", 2.0)];
        rank(&mut v, |x| (x.1, x.0), 42);
        assert_eq!(v.iter().map(|x| x.0).collect::<String>(), "bca");

        // Ties: same order whatever the input order, for a given conversation.
        let mut one = vec![("a", 1.0), ("b", 1.0), ("c", 1.0)];
        let mut two = vec![("c", 1.0), ("a", 1.0), ("b", 1.0)];
        rank(&mut one, |x| (x.1, x.0), 7);
        rank(&mut two, |x| (x.1, x.0), 7);
        assert_eq!(one, two);
        // Different conversations do not all pick the same node.
        let firsts: std::collections::HashSet<_> = (0..50u64)
            .map(|c| {
                let mut v = vec![("a", 1.0), ("b", 1.0), ("c", 1.0)];
                rank(&mut v, |x| (x.1, x.0), c);
                v[0].0
            })
            .collect();
        assert_eq!(firsts.len(), 3);
    }

    #[test]
    fn explain_lists_every_signal() {
        let s = Scores {
            model_loaded: 50.0,
            session_affinity: 20.0,
            ..Default::default()
        };
        let text = explain([("desk top", &s), ("b", &Scores::default())].into_iter());
        assert!(
            text.starts_with("desk_top total=70.0 loaded=50.0"),
            "{text}"
        );
        assert!(text.contains("; b total=0.0"));
        assert!(text.is_ascii());
        let negative_zero = Scores {
            queue_depth: -0.0,
            ..Default::default()
        };
        assert!(explain([("a", &negative_zero)].into_iter()).contains("queue=0.0"));
    }

    #[test]
    fn explain_names_each_adjustment_that_applied_and_its_lead() {
        let signals = Scores {
            model_loaded: 50.0,
            session_affinity: 20.0,
            ..Default::default()
        };
        let none = explain([("a", &signals)].into_iter());
        assert!(none.ends_with("affinity=20.0"), "{none}");
        let adjusted = Scores {
            spread: 3.5,
            sooner: 1.0,
            ..signals
        };
        let text = explain([("a", &adjusted)].into_iter());
        assert!(
            text.ends_with("affinity=20.0 spread=3.5 sooner=1.0"),
            "{text}"
        );
        // The total counts them; the signals' columns are left as the signals scored.
        assert!(text.starts_with("a total=74.5 loaded=50.0"), "{text}");
    }
}
