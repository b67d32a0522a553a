//! One view of a node's health, fed by every source corral has: the active check (`GET /`),
//! the poller (`/api/tags`, `/api/ps`), and the outcome of real requests.
//!
//! | from | evidence | to |
//! | --- | --- | --- |
//! | any | a reply succeeds | Up |
//! | any | refused, reset before a reply, reply broken off, poll refused, `health.consecutive_failures` failed checks | Down, *unreachable* |
//! | Up | `breaker.failures` failed replies in a row (timeouts, 5xx) | Down |
//! | HalfOpen | any failed reply | Down |
//! | Down, unreachable | a poll answers, or `health.consecutive_successes` checks pass | HalfOpen |
//! | Down | `breaker.cooldown` passes | HalfOpen |
//!
//! `Up` and `HalfOpen` admit requests; a `Down` node is only a last resort (tried when no
//! admitted node is left). The cool-down is a ceiling, not a wait: a node that stopped
//! answering and answers again is tried at once. A node whose replies fail while its polls
//! answer waits out the cool-down, since an answer from it is no news.
//! docs/robustness.md has the same machine in words.

use std::time::{Duration, Instant};

use crate::config::Config;

/// Where a node stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    Up,
    /// It answered again after being down: requests go, and one failure takes it down.
    HalfOpen,
    Down,
}

impl State {
    pub fn as_str(self) -> &'static str {
        match self {
            State::Up => "up",
            State::HalfOpen => "half_open",
            State::Down => "down",
        }
    }
}

/// One piece of evidence about a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Evidence {
    /// A client's request got a good reply.
    Served,
    /// A client's request failed in a way that may be passing: a timeout, a 5xx.
    Failed,
    /// The node refused a connection, reset it before replying, or broke off a reply: it is
    /// down or restarting. Also a poll whose connection was refused.
    Refused,
    /// The poller read its `/api/tags` and `/api/ps`.
    PollAnswered,
    /// The active check got an HTTP answer (below 500).
    CheckPassed,
    /// The active check got no answer in time, or a 5xx.
    CheckFailed,
}

/// The thresholds, from `breaker` and `health` in the configuration.
#[derive(Clone, Copy, Debug)]
pub struct Rules {
    /// Failed replies in a row that take an up node down.
    pub failures: u32,
    /// The longest a down node waits before it is tried again (half-open).
    pub cooldown: Duration,
    /// Failed checks in a row that take a node down.
    pub check_failures: u32,
    /// Passed checks in a row that make a down node half-open.
    pub check_passes: u32,
}

#[derive(Clone, Copy, Debug)]
pub struct Health {
    state: State,
    /// Failed replies in a row.
    failures: u32,
    check_failures: u32,
    check_passes: u32,
    /// While down: when the cool-down ends and the node is half-open without other news.
    retry_at: Option<Instant>,
    /// While down: it stopped answering (refused, reset, checks failed), rather than
    /// answering badly. Only then is an answer to a poll or check news that it is back:
    /// a node whose replies time out while its polls answer waits out the cool-down.
    unreachable: bool,
}

impl Default for Health {
    /// A node starts up: nothing is known against it. At start the first poll and check
    /// run before corral accepts requests, so this default rarely reaches a client.
    fn default() -> Self {
        Health {
            state: State::Up,
            failures: 0,
            check_failures: 0,
            check_passes: 0,
            retry_at: None,
            unreachable: false,
        }
    }
}

impl Health {
    /// The state now: a down node whose cool-down has passed is half-open.
    pub fn state(&self, now: Instant) -> State {
        match (self.state, self.retry_at) {
            (State::Down, Some(at)) if now >= at => State::HalfOpen,
            (state, _) => state,
        }
    }

    /// Whether requests may be sent as a first choice.
    pub fn admits(&self, now: Instant) -> bool {
        self.state(now) != State::Down
    }

    /// Learns from one piece of evidence. `true` when that changed whether the node admits
    /// requests.
    pub fn record(&mut self, evidence: Evidence, now: Instant, rules: &Rules) -> bool {
        let admitted = self.admits(now);
        // The cool-down's end is a state like any other from here on.
        self.state = self.state(now);
        match evidence {
            Evidence::Served => {
                self.state = State::Up;
                self.failures = 0;
                self.retry_at = None;
            }
            Evidence::Failed => {
                self.failures = self.failures.saturating_add(1);
                if self.state == State::HalfOpen || self.failures >= rules.failures.max(1) {
                    self.go_down(now, rules, false);
                }
            }
            Evidence::Refused => self.go_down(now, rules, true),
            Evidence::PollAnswered => self.answered(),
            Evidence::CheckPassed => {
                self.check_failures = 0;
                self.check_passes = self.check_passes.saturating_add(1);
                if self.check_passes >= rules.check_passes.max(1) {
                    self.answered();
                }
            }
            Evidence::CheckFailed => {
                self.check_passes = 0;
                self.check_failures = self.check_failures.saturating_add(1);
                if self.check_failures >= rules.check_failures.max(1) {
                    self.go_down(now, rules, true);
                }
            }
        }
        admitted != self.admits(now)
    }

    /// The node answered a probe: if it had stopped answering, it is tried again at once.
    fn answered(&mut self) {
        if self.state == State::Down && self.unreachable {
            self.state = State::HalfOpen;
            self.retry_at = None;
        }
    }

    fn go_down(&mut self, now: Instant, rules: &Rules, unreachable: bool) {
        // A node down for both reasons stays unreachable until it answers.
        self.unreachable = unreachable || (self.state == State::Down && self.unreachable);
        self.state = State::Down;
        self.failures = 0;
        self.retry_at = Some(now + rules.cooldown);
    }
}

impl Rules {
    /// The thresholds of `breaker` and `health` in this configuration.
    pub fn of(config: &Config) -> Rules {
        let to_u32 = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        Rules {
            failures: config.breaker.failures,
            cooldown: config.breaker.cooldown,
            check_failures: to_u32(config.health.consecutive_failures),
            check_passes: to_u32(config.health.consecutive_successes),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RULES: Rules = Rules {
        failures: 3,
        cooldown: Duration::from_secs(10),
        check_failures: 1,
        check_passes: 1,
    };

    #[test]
    fn a_refusal_takes_a_node_down_at_once_and_a_poll_answer_brings_it_back_at_once() {
        let t0 = Instant::now();
        let mut h = Health::default();
        assert_eq!(h.state(t0), State::Up);
        assert!(h.record(Evidence::Refused, t0, &RULES), "admission changed");
        assert_eq!(h.state(t0), State::Down);
        assert!(!h.admits(t0 + Duration::from_secs(1)));
        // Long before the cool-down ends, the node answers a poll: tried again now.
        let t1 = t0 + Duration::from_millis(100);
        assert!(h.record(Evidence::PollAnswered, t1, &RULES));
        assert_eq!(h.state(t1), State::HalfOpen);
        assert!(h.admits(t1));
        // A request served there: fully up.
        assert!(
            !h.record(Evidence::Served, t1, &RULES),
            "it was admitted already"
        );
        assert_eq!(h.state(t1), State::Up);
    }

    #[test]
    fn the_cool_down_is_a_ceiling() {
        let t0 = Instant::now();
        let mut h = Health::default();
        h.record(Evidence::Refused, t0, &RULES);
        assert_eq!(
            h.state(t0 + RULES.cooldown - Duration::from_millis(1)),
            State::Down
        );
        assert_eq!(h.state(t0 + RULES.cooldown), State::HalfOpen);
        // Half-open: one failure of any kind takes it down again, for a new cool-down.
        let t1 = t0 + RULES.cooldown;
        assert!(h.record(Evidence::Failed, t1, &RULES));
        assert_eq!(h.state(t1), State::Down);
        assert_eq!(h.state(t1 + RULES.cooldown), State::HalfOpen);
    }

    #[test]
    fn failed_replies_count_up_to_the_threshold_and_a_success_resets_them() {
        let t0 = Instant::now();
        let mut h = Health::default();
        assert!(!h.record(Evidence::Failed, t0, &RULES));
        assert!(!h.record(Evidence::Failed, t0, &RULES));
        assert!(!h.record(Evidence::Served, t0, &RULES));
        assert!(!h.record(Evidence::Failed, t0, &RULES));
        assert!(!h.record(Evidence::Failed, t0, &RULES));
        assert!(h.admits(t0), "two failures in a row are not three");
        assert!(h.record(Evidence::Failed, t0, &RULES));
        assert_eq!(h.state(t0), State::Down);
        // Its polls kept answering while its replies timed out: an answer is no news, the
        // cool-down is waited out.
        assert!(!h.record(Evidence::PollAnswered, t0, &RULES));
        assert_eq!(h.state(t0), State::Down);
        let t1 = t0 + RULES.cooldown;
        assert_eq!(h.state(t1), State::HalfOpen);
        h.record(Evidence::Failed, t1, &RULES);
        assert_eq!(h.state(t1), State::Down, "one more failure while half-open");
    }

    #[test]
    fn checks_count_in_a_row_as_configured() {
        let t0 = Instant::now();
        let rules = Rules {
            check_failures: 2,
            check_passes: 2,
            ..RULES
        };
        let mut h = Health::default();
        assert!(!h.record(Evidence::CheckFailed, t0, &rules));
        assert!(!h.record(Evidence::CheckPassed, t0, &rules), "not in a row");
        assert!(!h.record(Evidence::CheckFailed, t0, &rules));
        assert!(h.record(Evidence::CheckFailed, t0, &rules));
        assert!(!h.admits(t0));
        assert!(!h.record(Evidence::CheckPassed, t0, &rules));
        assert!(h.record(Evidence::CheckPassed, t0, &rules));
        assert_eq!(h.state(t0), State::HalfOpen);
        // A poll answer while up changes nothing.
        h.record(Evidence::Served, t0, &rules);
        assert!(!h.record(Evidence::PollAnswered, t0, &rules));
        assert_eq!(h.state(t0), State::Up);
    }
}
