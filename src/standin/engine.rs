//! The compute of one loaded model: every slot's work goes through one batch per step.
//!
//! A real server does not give each slot a processor of its own. llama-server builds one
//! batch per iteration (llama.cpp `tools/server/server-context.cpp`, `update_slots`): first
//! the sampled token of every generating slot, then prompt tokens of the slots still
//! prefilling, in slot order, until the batch holds `n_batch` tokens; then one `llama_decode`
//! of the whole batch. Ollama's old runner does the same (`runner/ollamarunner/runner.go`,
//! `forwardBatch`, before 0.30), visiting its sequences round-robin from the first one a full
//! batch left out, decoding and prefilling sequences alike. So two prompts evaluated at once
//! each take about twice as long as one alone, and a slot generating beside a long prefill
//! gets one token per full batch.
//!
//! The cost of one step: `prefill_per_token` per token in it, but at least one
//! `decode_per_token` when it carries a generating slot's token (a batch reads the weights
//! once, however many sequences share it: batched decoding is cheap, and a few decode tokens
//! ride along with a prompt batch almost free). A request alone on its model takes exactly
//! what it took before there was an engine: its prefill, then one decode step per output
//! token.
//!
//! Durations a reply reports are the engine's own clock (the sum of the steps it took part
//! in), not the wall clock, so a busy test machine does not change what a node reports.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::mpsc;
use tokio::time::Instant;

/// How a server fills its batches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    /// llama-server: every generating slot's token first, then prompts in slot order.
    DecodeFirst,
    /// Ollama's old runner: sequences in turn from where the last full batch stopped.
    RoundRobin,
}

/// A server's batching rule and costs.
#[derive(Clone, Copy, Debug)]
pub struct BatchRule {
    pub order: Order,
    /// Most tokens in one batch (`n_batch`; Ollama passes its `num_batch`, 512 by default).
    pub batch_tokens: u32,
    pub prefill_per_token: Duration,
    pub decode_per_token: Duration,
}

/// What a [`Run`] hears from the engine, stamped with the engine's clock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Progress {
    /// The whole prompt is evaluated: the step it first took part in started at `started`,
    /// the step that finished it ended at `done`.
    Prompt { started: Duration, done: Duration },
    /// One output token, at the end of the step that made it.
    Token { at: Duration },
}

/// One request's work on the engine.
#[derive(Debug)]
struct Job {
    id: u64,
    slot: usize,
    prompt_left: u32,
    tokens_left: u32,
    /// Engine time of the first step this job took part in.
    started: Option<Duration>,
    progress: mpsc::UnboundedSender<Progress>,
}

impl Job {
    fn need(&self) -> Need {
        Need {
            slot: self.slot,
            prompt_left: self.prompt_left,
        }
    }
}

/// What planning a step needs to know of a job: a job with no prompt left is generating.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Need {
    slot: usize,
    prompt_left: u32,
}

#[derive(Debug, Default)]
struct State {
    /// Ordered by slot.
    jobs: Vec<Job>,
    /// A task is stepping the engine.
    running: bool,
    /// The engine's clock: the sum of all steps so far.
    clock: Duration,
    /// Where the old runner's next batch starts.
    next_slot: usize,
    next_id: u64,
}

/// The compute of one loaded model.
#[derive(Debug)]
pub struct Engine {
    rule: BatchRule,
    state: Mutex<State>,
}

impl Engine {
    pub fn new(rule: BatchRule) -> Self {
        Engine {
            rule,
            state: Mutex::default(),
        }
    }

    /// Queues a request that holds `slot`: `prompt_tokens` to evaluate, then `output_tokens`
    /// to generate. It joins the next step. Dropping the [`Run`] withdraws it.
    pub fn submit(self: &Arc<Self>, slot: usize, prompt_tokens: u32, output_tokens: u32) -> Run {
        let (progress, events) = mpsc::unbounded_channel();
        let mut state = self.state.lock();
        if prompt_tokens == 0 {
            // Nothing to evaluate (an empty prompt): only the output costs steps.
            let now = state.clock;
            let _ = progress.send(Progress::Prompt {
                started: now,
                done: now,
            });
        }
        if prompt_tokens > 0 || output_tokens > 0 {
            state.next_id += 1;
            let job = Job {
                id: state.next_id,
                slot,
                prompt_left: prompt_tokens,
                tokens_left: output_tokens,
                started: None,
                progress,
            };
            let at = state.jobs.partition_point(|j| j.slot <= slot);
            state.jobs.insert(at, job);
            if !state.running {
                state.running = true;
                tokio::spawn(Arc::clone(self).step_while_busy());
            }
        }
        Run {
            events,
            prompt_done: Duration::ZERO,
            last_token: Duration::ZERO,
        }
    }

    /// Steps until no job is left; a later submit starts a new task.
    async fn step_while_busy(self: Arc<Self>) {
        // Steps follow each other on a running deadline so timer delays do not add up.
        let mut deadline = Instant::now();
        loop {
            let (step, duration) = {
                let mut state = self.state.lock();
                state.jobs.retain(|job| !job.progress.is_closed());
                if state.jobs.is_empty() {
                    state.running = false;
                    return;
                }
                let needs: Vec<Need> = state.jobs.iter().map(Job::need).collect();
                let (takes, next_slot) = plan(&needs, &self.rule, state.next_slot);
                let duration = step_cost(&needs, &takes, &self.rule);
                state.next_slot = next_slot;
                let clock = state.clock;
                let step: Vec<(u64, u32)> = state
                    .jobs
                    .iter_mut()
                    .zip(takes)
                    .filter(|(_, take)| *take > 0)
                    .map(|(job, take)| {
                        job.started.get_or_insert(clock);
                        (job.id, take)
                    })
                    .collect();
                (step, duration)
            };
            deadline = deadline.max(Instant::now()) + duration;
            tokio::time::sleep_until(deadline).await;
            self.state.lock().advance(&step, duration);
        }
    }
}

impl State {
    /// Applies a finished step: prompts move on, generating jobs get a token each, and jobs
    /// with nothing left go.
    fn advance(&mut self, step: &[(u64, u32)], duration: Duration) {
        self.clock += duration;
        let now = self.clock;
        for &(id, take) in step {
            let Some(job) = self.jobs.iter_mut().find(|job| job.id == id) else {
                continue; // withdrawn during the step
            };
            if job.prompt_left > 0 {
                job.prompt_left -= take.min(job.prompt_left);
                if job.prompt_left == 0 {
                    let started = job.started.unwrap_or(now);
                    let _ = job.progress.send(Progress::Prompt { started, done: now });
                }
            } else {
                job.tokens_left = job.tokens_left.saturating_sub(1);
                let _ = job.progress.send(Progress::Token { at: now });
            }
        }
        self.jobs
            .retain(|job| job.prompt_left > 0 || job.tokens_left > 0);
    }
}

/// The tokens each job gets in the next step, indexed like `jobs` (ordered by slot), and
/// where the old runner's following step starts.
fn plan(jobs: &[Need], rule: &BatchRule, next_slot: usize) -> (Vec<u32>, usize) {
    let mut takes = vec![0; jobs.len()];
    let mut room = rule.batch_tokens.max(1);
    match rule.order {
        Order::DecodeFirst => {
            for (take, job) in takes.iter_mut().zip(jobs) {
                if job.prompt_left == 0 {
                    *take = 1;
                    room = room.saturating_sub(1);
                }
            }
            for (take, job) in takes.iter_mut().zip(jobs) {
                if room == 0 {
                    break;
                }
                if job.prompt_left > 0 {
                    *take = job.prompt_left.min(room);
                    room -= *take;
                }
            }
            (takes, next_slot)
        }
        Order::RoundRobin => {
            let first = jobs.partition_point(|job| job.slot < next_slot) % jobs.len().max(1);
            let mut resume = None;
            for i in (first..jobs.len()).chain(0..first) {
                let job = jobs[i];
                let need = job.prompt_left.max(1);
                takes[i] = need.min(room);
                room -= takes[i];
                if takes[i] == 0 && resume.is_none() {
                    resume = Some(job.slot);
                }
            }
            (takes, resume.unwrap_or(next_slot))
        }
    }
}

/// How long a step takes: its tokens at the prefill rate, or one decode step when it
/// carries a generating job's token and that is longer (a batch reads the weights once, and
/// a small one takes that long however few tokens it holds). A step of prompt tokens alone
/// costs its tokens, as a lone request's prefill always has here.
fn step_cost(jobs: &[Need], takes: &[u32], rule: &BatchRule) -> Duration {
    let mut tokens = 0;
    let mut decodes = false;
    for (job, &take) in jobs.iter().zip(takes) {
        tokens += take;
        decodes |= job.prompt_left == 0 && take > 0;
    }
    let compute = rule.prefill_per_token * tokens;
    if decodes {
        compute.max(rule.decode_per_token)
    } else {
        compute
    }
}

/// A request's view of its work on the engine.
#[derive(Debug)]
pub struct Run {
    events: mpsc::UnboundedReceiver<Progress>,
    prompt_done: Duration,
    last_token: Duration,
}

impl Run {
    /// Waits until the whole prompt is evaluated; returns how long that took by the engine's
    /// clock, from the first step the request took part in.
    pub async fn prompt_evaluated(&mut self) -> Duration {
        while let Some(progress) = self.events.recv().await {
            if let Progress::Prompt { started, done } = progress {
                self.prompt_done = done;
                self.last_token = done;
                return done - started;
            }
        }
        Duration::ZERO
    }

    /// Waits for the next output token; false when there are no more.
    pub async fn next_token(&mut self) -> bool {
        match self.events.recv().await {
            Some(Progress::Token { at }) => {
                self.last_token = at;
                true
            }
            _ => false,
        }
    }

    /// Engine time from the end of the prompt to the latest token.
    pub fn decode_duration(&self) -> Duration {
        self.last_token.saturating_sub(self.prompt_done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PREFILL: Duration = Duration::from_millis(1);
    const DECODE: Duration = Duration::from_millis(10);

    fn rule(order: Order, batch_tokens: u32) -> BatchRule {
        BatchRule {
            order,
            batch_tokens,
            prefill_per_token: PREFILL,
            decode_per_token: DECODE,
        }
    }

    fn prefilling(slot: usize, prompt_left: u32) -> Need {
        Need { slot, prompt_left }
    }

    fn generating(slot: usize) -> Need {
        Need {
            slot,
            prompt_left: 0,
        }
    }

    #[test]
    fn llama_server_puts_generating_tokens_first_then_prompts_in_slot_order() {
        let jobs = [prefilling(0, 400), generating(1), prefilling(2, 300)];
        let (takes, _) = plan(&jobs, &rule(Order::DecodeFirst, 512), 0);
        // 1 decode token, then slot 0's 400, then what is left of the batch for slot 2.
        assert_eq!(takes, vec![400, 1, 111]);
        let cost = step_cost(&jobs, &takes, &rule(Order::DecodeFirst, 512));
        assert_eq!(cost, PREFILL * 512);
    }

    #[test]
    fn a_long_prompt_in_a_lower_slot_fills_the_batch_before_a_short_one() {
        let jobs = [prefilling(0, 2000), prefilling(1, 75)];
        let (takes, _) = plan(&jobs, &rule(Order::DecodeFirst, 512), 0);
        assert_eq!(takes, vec![512, 0]);
        let jobs = [prefilling(0, 75), prefilling(1, 2000)];
        let (takes, _) = plan(&jobs, &rule(Order::DecodeFirst, 512), 0);
        assert_eq!(takes, vec![75, 437]);
    }

    #[test]
    fn the_old_runner_starts_where_the_last_full_batch_left_a_sequence_out() {
        let jobs = [prefilling(0, 600), generating(1), prefilling(2, 50)];
        let r = rule(Order::RoundRobin, 512);
        let (takes, next) = plan(&jobs, &r, 0);
        // Slot 0 fills the batch; slot 1 gets nothing and is where the next batch starts.
        assert_eq!((takes, next), (vec![512, 0, 0], 1));
        let jobs = [prefilling(0, 88), generating(1), prefilling(2, 50)];
        let (takes, next) = plan(&jobs, &r, 1);
        assert_eq!((takes, next), (vec![88, 1, 50], 1));
    }

    #[test]
    fn a_step_of_generating_tokens_alone_costs_one_decode() {
        let jobs = [generating(0), generating(3)];
        let r = rule(Order::DecodeFirst, 512);
        let (takes, _) = plan(&jobs, &r, 0);
        assert_eq!(step_cost(&jobs, &takes, &r), DECODE);
        // A few prompt tokens beside them cost no more than the decode step.
        let jobs = [generating(0), prefilling(1, 4)];
        let (takes, _) = plan(&jobs, &r, 0);
        assert_eq!(step_cost(&jobs, &takes, &r), DECODE);
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_alone_takes_its_prefill_then_a_decode_per_token() {
        let engine = Arc::new(Engine::new(rule(Order::DecodeFirst, 512)));
        let mut run = engine.submit(0, 1000, 3);
        let begun = Instant::now();
        assert_eq!(run.prompt_evaluated().await, PREFILL * 1000);
        assert_eq!(begun.elapsed(), PREFILL * 1000);
        for _ in 0..3 {
            assert!(run.next_token().await);
        }
        assert!(!run.next_token().await);
        assert_eq!(run.decode_duration(), DECODE * 3);
    }

    #[tokio::test(start_paused = true)]
    async fn two_prompts_at_once_share_the_batch() {
        let engine = Arc::new(Engine::new(rule(Order::DecodeFirst, 512)));
        let mut first = engine.submit(0, 300, 0);
        let mut second = engine.submit(1, 300, 0);
        // Steps of 512 tokens (300 + 212) then 88: each takes longer than its 300 ms alone.
        let (a, b) = tokio::join!(first.prompt_evaluated(), second.prompt_evaluated());
        assert_eq!((a, b), (PREFILL * 512, PREFILL * 600));
    }

    #[tokio::test(start_paused = true)]
    async fn a_generating_request_waits_for_a_neighbour_s_prompt_batch() {
        let engine = Arc::new(Engine::new(rule(Order::DecodeFirst, 512)));
        let mut talker = engine.submit(0, 1, 4);
        let mut reader = engine.submit(1, 1024, 1);
        let begun = Instant::now();
        // Step 1: the talker's one prompt token and 511 of the reader's.
        assert_eq!(talker.prompt_evaluated().await, PREFILL * 512);
        // Step 2: the talker's first token beside 511 more of the reader's.
        assert!(talker.next_token().await);
        assert_eq!(begun.elapsed(), PREFILL * (512 + 512));
        // Step 3: the reader's last 2 with the talker's second token: a decode step.
        assert_eq!(reader.prompt_evaluated().await, PREFILL * 1024 + DECODE);
    }

    #[tokio::test(start_paused = true)]
    async fn a_withdrawn_request_frees_the_batch() {
        let engine = Arc::new(Engine::new(rule(Order::DecodeFirst, 512)));
        let gone = engine.submit(0, 100_000, 1);
        let mut kept = engine.submit(1, 10, 1);
        drop(gone);
        assert_eq!(kept.prompt_evaluated().await, PREFILL * 10);
    }
}
