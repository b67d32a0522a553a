//! Choosing: the request's profile and a view of every node that has its model in,
//! candidates ranked best first out. Pure: nothing here reads a lock or the clock, so a
//! decision can be checked on node views built by hand ([`super::view`] takes the views).

use std::time::{Duration, Instant};

use super::placement;
use super::score::{self, Scores};
use super::signals::{self, Memory, RequestClass, Speed, Warmth};
use super::stay;
use super::view::NodeView;
use super::{Candidate, RouteError};

/// A node's view as ranked for the request.
pub type Ranked<'v> = Candidate<&'v NodeView>;
use crate::config::Weights;
use crate::request::Profile;

/// What a decision knows of the request beyond its profile.
#[derive(Clone, Copy, Debug)]
pub struct Request {
    /// The model's size in memory, where any node knows it.
    pub need: Option<u64>,
    /// The node holding the conversation's warm prefix, or named by its session key.
    pub warm_node: Option<u16>,
    /// The node holding its warm prefix, for the move-or-wait comparison.
    pub pin_node: Option<u16>,
    /// The decision's instant, against which speed history ages.
    pub now: Instant,
    /// The usual pause between a conversation's turns, seconds, once seen.
    pub pause_s: Option<f64>,
}

/// Scores every node in `views` for the request and ranks them best first: live nodes
/// before standby ones, and among live ones a node where loading the model would unload
/// a model in use after one where it would not. Ties break by the conversation, so that
/// equal nodes share conversations evenly and a conversation meets the same node again.
pub fn rank<'v>(
    p: &Profile,
    request: Request,
    views: &'v [NodeView],
    weights: &Weights,
) -> Result<Vec<Ranked<'v>>, RouteError> {
    let now = request.now;
    let best = best_speed(views);
    let class = RequestClass {
        endpoint: p.endpoint.class(),
        model: &p.model_key,
        size: request.need.map(signals::size_class),
    };
    let mut ranked = Vec::with_capacity(views.len());
    // Per candidate, in the same order: its queue, measured speeds, live conversations and
    // warm room.
    let mut starts: Vec<Start> = Vec::with_capacity(views.len());
    // Per candidate, in the same order: what a second home for the model needs to know.
    let mut homes: Vec<Home> = Vec::with_capacity(views.len());
    let mut too_large = false;
    for view in views {
        let state = &view.model;
        let depth = state.depth();
        let queue = signals::queue(depth, view.admits);
        let memory = Memory {
            need: request.need,
            total: view.memory_total,
            used: view.footprint.used,
        };
        let Some(mut memory_fit) = signals::memory_fit(view.resident, memory, weights) else {
            too_large = true;
            continue;
        };
        if let Some(victim_use) = view.victim_use {
            // Where the load must evict, the less the fleet uses what may go, the better.
            memory_fit = placement::weigh_victims(memory_fit, victim_use);
        }
        let evicts_busy = !view.resident
            && placement::evicts_busy(request.need, view.memory_total, &view.footprint);
        let warmth = if request.warm_node == Some(view.id) {
            Warmth::HoldsPrefix
        } else if p.endpoint.generates() && state.new_conversation_displaces {
            Warmth::WouldDisplace
        } else {
            Warmth::Free
        };
        // Not measured yet, a node is no faster than its requests not yet answered show: a
        // node ten times slower is not taken for the fleet's best while its first long
        // prompt is still in prefill.
        let speed = Speed {
            prefill: state
                .prefill_tps
                .or(state.cold_tps)
                .or(state.cold_tps_at_most),
            decode: state.decode_tps,
        };
        let w = weights;
        let scores = Scores {
            model_loaded: signals::model_loaded(view.resident, w),
            memory_fit,
            queue_depth: signals::queue_depth(queue, w),
            latency: signals::latency(speed, best, w) * freshness(state.speed_at, now),
            role_affinity: signals::role_affinity(&view.settings.roles, class, w),
            availability: signals::availability(view.success_ratio, w),
            context_fit: signals::context_fit(p.prompt_tokens, p.num_ctx, view.loaded_context, w),
            session_affinity: signals::session_affinity(warmth, queue, w),
            ..Scores::default()
        };
        ranked.push(Candidate {
            node: view,
            scores,
            resident: view.resident,
            evicts_busy,
            standby: view.standby,
        });
        starts.push(Start {
            load_s: state.load_s,
            load_evicts: (!view.resident && view.on_disk)
                .then(|| {
                    placement::load_without_busy(request.need, view.memory_total, &view.footprint)
                })
                .flatten(),
            cold_tps: state.cold_tps,
            cold_tps_at_most: state.cold_tps_at_most,
            service_s: state.service_s,
            parallel: view.parallel,
            admits: view.admits,
            depth,
            live: state.live_conversations,
            room: state.warm_room,
            slots_only: state.slots_only,
        });
        homes.push(Home {
            full: view.resident.then_some(state.full && view.slots_known),
            fits_free: placement::fits_free(request.need, view.memory_total, view.footprint.used),
            context: view.loaded_context,
        });
    }
    // Only a new conversation opens a second home: a follow-up whose prefix was lost would
    // pay the load itself, which costs more than prefilling its history.
    if request.warm_node.is_none() && !p.follow_up && p.endpoint.generates() {
        open_second_home(&mut ranked, &homes, p, weights);
        spread_by_warm_room(&mut ranked, &starts, p, request.pause_s);
    }
    if request.warm_node.is_none() && p.follow_up && p.endpoint.generates() {
        restart_where_soonest(&mut ranked, &starts, p);
    }
    if let Some(pin_node) = request.pin_node.filter(|_| weights.move_cost > 0.0) {
        let factor = weights.move_cost;
        keep_warm_if_sooner(&mut ranked, &starts, pin_node, p.prompt_tokens, factor);
    }
    if let Some(pin_node) = request
        .pin_node
        .filter(|_| p.follow_up && p.endpoint.generates())
    {
        rehome_if_faster(&mut ranked, &starts, pin_node, p);
    }
    load_where_sooner(&mut ranked, &starts, p.prompt_tokens, request.warm_node);
    if ranked.is_empty() {
        return Err(match (too_large, request.need) {
            (true, Some(need)) => RouteError::TooLarge {
                model: p.model.clone(),
                need,
            },
            _ => RouteError::ModelNotFound(p.model.clone()),
        });
    }
    score::rank(
        &mut ranked,
        |c| (c.scores.total(), c.node.name()),
        p.conversation,
    );
    // Stable: standby nodes keep their order among themselves, after the others; and
    // among live ones, a node where the load would unload a model in use comes last.
    ranked.sort_by_key(|c| (c.standby, c.evicts_busy));
    Ok(ranked)
}

/// One candidate as a home for the request's model.
struct Home {
    /// Where the model is resident: whether its slots are full of live conversations.
    full: Option<bool>,
    /// The model fits in the node's free memory.
    fits_free: bool,
    /// The context the model is loaded with there.
    context: Option<u32>,
}

/// A new conversation, for a model whose every home has its slots full of live
/// conversations: nodes where the model fits in free memory score as if it were loaded
/// there ([`placement::second_home`]), with the context it is loaded with at home, so the
/// model gains a home without evicting anything rather than push a live conversation out
/// of its slot.
fn open_second_home(ranked: &mut [Ranked], homes: &[Home], p: &Profile, w: &Weights) {
    let live = ranked.iter().zip(homes).filter(|(c, _)| !c.standby);
    let full = placement::homes_full(live.filter_map(|(_, h)| h.full));
    let context = homes.iter().find_map(|h| h.full.and(h.context));
    for (c, home) in ranked.iter_mut().zip(homes) {
        let bonus = placement::second_home(full, home.fits_free, w.model_loaded);
        if c.resident || c.standby || bonus == 0.0 {
            continue;
        }
        // As if loaded, with the context it has at home.
        let context_fit = signals::context_fit(p.prompt_tokens, p.num_ctx, context, w);
        c.scores.second_home =
            (bonus - c.scores.model_loaded) + (context_fit - c.scores.context_fit);
    }
}

/// A new conversation goes where it costs least in seconds ([`stay::start_cost`]: the wait,
/// its prefill, and the cold turns it will cause there), among the live nodes where the
/// model is resident that the signals other than speed and queue depth rate best (role,
/// memory, context, availability): it is given just the lead it needs (`spread`). A
/// conversation stays where it starts, so where it starts decides what stays warm: by speed
/// and queue alone every new conversation goes to the fastest node, whose cache then pushes
/// live conversations out while slower nodes keep room unused. A node not measured yet is
/// taken to be as fast as the best measured; where none is, the signals decide alone.
fn spread_by_warm_room(ranked: &mut [Ranked], starts: &[Start], p: &Profile, pause_s: Option<f64>) {
    let weighed = weighable(ranked);
    let fits = |i: usize| weighed(&ranked[i]);
    let fastest = Fastest::of(starts);
    // Waiting for a slot costs the first turn seconds for certain, while the cold turns it
    // would cause elsewhere are a forecast (the conversations counted live there may have
    // ended): where a node has a slot free, the conversation starts on one that has. That
    // holds for a node the other signals rate a little lower (one healing from failures):
    // where only such a node is free, the signals decide, queue depth included.
    let free = |i: usize| starts[i].free();
    let some_free = (0..ranked.len()).any(|i| placeable(&ranked[i]) && free(i));
    let costs = starts.iter().enumerate().filter_map(|(i, start)| {
        if !fits(i) || (some_free && !free(i)) {
            return None;
        }
        let (cold_tps, service_s) = start.rates(&fastest)?;
        let home = stay::Home {
            wait_s: stay::expected_wait(start.depth, start.admits, service_s),
            cold_tps,
            live: start.live,
            room: start.room,
            serves: pause_s.and_then(|pause| stay::serves(start.parallel, service_s, pause)),
            service_s,
        };
        Some((i, stay::start_cost(home, p.prompt_tokens)?))
    });
    let costs: Vec<(usize, f64)> = costs.collect();
    if let Some(pick) = roomiest_near_cheapest(ranked, starts, &costs) {
        lead_by(ranked, pick, |s| &mut s.spread);
    }
}

/// Start costs within this fraction of the cheapest count as equal. Nodes of one kind
/// measure a few per cent apart by noise alone; taken at face value, the one that happened
/// to measure fastest started most new conversations, and its cache overflowed while the
/// others kept room (three equal nodes: 10, 8 and 6 conversations of 24).
const NEAR_CHEAPEST: f64 = 0.1;

/// Of the candidates whose cost is within [`NEAR_CHEAPEST`] of the cheapest, the one with
/// the most warm room to spare (its room less its live conversations); equal room keeps
/// the signals' order.
fn roomiest_near_cheapest(
    ranked: &[Ranked],
    starts: &[Start],
    costs: &[(usize, f64)],
) -> Option<usize> {
    let least = costs.iter().map(|&(_, c)| c).min_by(f64::total_cmp)?;
    let near = costs
        .iter()
        .filter(|&&(_, c)| c <= least * (1.0 + NEAR_CHEAPEST));
    let spare = |i: usize| starts[i].room - f64::from(starts[i].live);
    cheapest(ranked, near.map(|&(i, _)| (i, -spare(i))))
}

/// A follow-up whose prefix no node holds warm, on nodes that keep nothing beyond their
/// slots (the old Ollama runner), goes where its first token comes soonest: the wait for a
/// slot plus its whole history's prefill. Wherever it lands there it pushes one slot's
/// conversation out and no host memory keeps it, so the nodes differ only in when it starts;
/// the signals queued such follow-ups on the fastest node. Where a node may keep a host
/// cache, the signals decide: where a lost conversation lands decides whose saved
/// conversations that cache pushes out, and moving them where they start soonest raised the
/// mean follow-up TTFT (docs/benchmarks.md). So do they where a live node is left out of
/// the weighing (the other signals rate it lower, or the model is not resident there).
fn restart_where_soonest(ranked: &mut [Ranked], starts: &[Start], p: &Profile) {
    let fastest = Fastest::of(starts);
    let weighed = weighable(ranked);
    let live = || (ranked.iter().zip(starts).enumerate()).filter(|(_, (c, _))| !c.standby);
    let comparable = |(c, start): (&Ranked, &Start)| {
        start.slots_only && weighed(c) && start.rates(&fastest).is_some()
    };
    if !live().all(|(_, pair)| comparable(pair)) {
        return;
    }
    let costs = live().filter_map(|(i, (_, start))| {
        let (cold_tps, service_s) = start.rates(&fastest)?;
        let wait_s = stay::expected_wait(start.depth, start.admits, service_s);
        Some((i, wait_s + f64::from(p.prompt_tokens) / cold_tps))
    });
    if let Some(pick) = cheapest(ranked, costs) {
        lead_by(ranked, pick, |s| &mut s.restart);
    }
}

/// Whether a placement by cost in seconds weighs a candidate: a live node where the model is
/// resident and its load evicts no model in use, that the signals other than speed, queue
/// depth and session affinity (role, memory, context, availability) rate within a point of
/// the best such. The cost counts in seconds what those three signals stand for, the
/// conversations a new one would push out included: left in, the displacement penalty kept
/// a fast node out of the weighing whenever its slots held conversations used within the
/// keep-alive, ended or not, and new conversations went to the slowest nodes.
fn weighable(ranked: &[Ranked]) -> impl Fn(&Ranked) -> bool + use<> {
    fn settled(c: &Ranked) -> f64 {
        c.scores.total() - c.scores.latency - c.scores.queue_depth - c.scores.session_affinity
    }
    let bar = (ranked.iter().filter(|c| placeable(c)).map(settled)).max_by(f64::total_cmp);
    move |c| bar.is_some_and(|bar| placeable(c) && settled(c) >= bar - 1.0)
}

/// A live node where the model is resident and its load evicts no model in use.
fn placeable(c: &Ranked) -> bool {
    c.resident && !c.standby && !c.evicts_busy
}

/// The candidate of least cost among `costs` (index, seconds); equal costs keep the
/// signals' order.
fn cheapest(ranked: &[Ranked], costs: impl Iterator<Item = (usize, f64)>) -> Option<usize> {
    let total = |i: usize| ranked[i].scores.total();
    let best = costs.reduce(|best, next| {
        let better = next.1 < best.1 || (next.1 == best.1 && total(next.0) > total(best.0));
        if better { next } else { best }
    });
    best.map(|(i, _)| i)
}

/// The best total among the live candidates other than `pick`, if there is one.
fn best_other(ranked: &[Ranked], pick: usize) -> Option<usize> {
    (0..ranked.len())
        .filter(|&i| i != pick && !ranked[i].standby)
        .max_by(|&a, &b| {
            ranked[a]
                .scores
                .total()
                .total_cmp(&ranked[b].scores.total())
        })
}

/// Gives `pick` just the lead it needs over every other live candidate, in the adjustment's
/// own field, so that its X-Fleet-Score shows it won and X-Fleet-Explain says why.
fn lead_by(ranked: &mut [Ranked], pick: usize, adjustment: fn(&mut Scores) -> &mut f64) {
    if let Some(raise) = lead(ranked, pick) {
        *adjustment(&mut ranked[pick].scores) += raise;
    }
}

/// How much `pick`'s total must rise to lead every other live candidate by a point, where
/// it does not lead already.
fn lead(ranked: &[Ranked], pick: usize) -> Option<f64> {
    let other = best_other(ranked, pick)?;
    let gap = ranked[other].scores.total() - ranked[pick].scores.total();
    (gap >= 0.0).then_some(gap + 1.0)
}

/// Where the request would wait for a slot on every live node that has the model, a node
/// that can load the model without unloading one in use takes it when it would start
/// there sooner: its load and the prompt's cold prefill there, against the wait for a slot
/// and the prefill on the best node that has the model. A load that must unload an idle
/// model counts twice, since that model is loaded again when next wanted. Where the wait
/// is not known yet (no request has ended there), it is at least what is running there,
/// which began no earlier than a load starting now would end: the load goes ahead. So a
/// waited-for model spreads to every node that can hold it, on a fresh fleet, after a
/// restart or once it timed out, and never by pushing out a model in use.
fn load_where_sooner(
    ranked: &mut [Ranked],
    starts: &[Start],
    prompt_tokens: u32,
    warm_node: Option<u16>,
) {
    let live = |c: &Ranked| !c.standby && !c.evicts_busy;
    let has_model = |i: usize| live(&ranked[i]) && ranked[i].resident;
    if (0..ranked.len()).any(|i| has_model(i) && starts[i].free()) {
        return;
    }
    let total = |i: usize| ranked[i].scores.total();
    let Some(best) = (0..ranked.len())
        .filter(|&i| has_model(i))
        .max_by(|&a, &b| total(a).total_cmp(&total(b)))
    else {
        // No node has the model yet: the signals choose where it loads first.
        return;
    };
    let fastest = Fastest::of(starts);
    let prefill = |i: usize| {
        (starts[i].cold_rate(&fastest)).map_or(0.0, |tps| f64::from(prompt_tokens) / tps)
    };
    let learned_load = starts
        .iter()
        .filter_map(|s| s.load_s)
        .max_by(f64::total_cmp);
    let load_s = |i: usize| {
        let evicts = starts[i].load_evicts.filter(|_| live(&ranked[i]))?;
        let times = if evicts { 2.0 } else { 1.0 };
        Some(times * stay::load_estimate(starts[i].load_s.or(learned_load)))
    };
    // Seconds until the request's first token where it loads the model.
    let start_loading = |i: usize| Some(load_s(i)? + prefill(i));
    let costs = (0..ranked.len()).filter_map(|i| Some((i, start_loading(i)?)));
    let Some(pick) = cheapest(ranked, costs) else {
        return;
    };
    let sooner = match (starts[best].wait(), start_loading(pick)) {
        (Some(wait_s), Some(loading_s)) => {
            let warm_there = warm_node == Some(ranked[best].node.id);
            let best_prefill = if warm_there { 0.0 } else { prefill(best) };
            loading_s < wait_s + best_prefill
        }
        _ => true,
    };
    if sooner {
        lead_by(ranked, pick, |s| &mut s.sooner);
    }
}

/// The best cold prefill rate and service time measured among the candidates.
struct Fastest {
    cold_tps: Option<f64>,
    service_s: Option<f64>,
}

impl Fastest {
    fn of(starts: &[Start]) -> Fastest {
        let cold_tps = starts
            .iter()
            .filter_map(|s| s.cold_tps)
            .max_by(f64::total_cmp);
        let service_s = starts
            .iter()
            .filter_map(|s| s.service_s)
            .min_by(f64::total_cmp);
        Fastest {
            cold_tps,
            service_s,
        }
    }
}

/// What starting a request on a candidate would take.
struct Start {
    /// Seconds it took to load the model, as measured.
    load_s: Option<f64>,
    /// Where its last poll listed the model on disk, the model is not resident and loading
    /// it unloads no model in use: whether it must unload an idle one (or may: its memory
    /// is not known).
    load_evicts: Option<bool>,
    /// Prompt tokens per second when nothing is cached, where measured.
    cold_tps: Option<f64>,
    /// Where not measured: at most this, from requests not answered yet.
    cold_tps_at_most: Option<f64>,
    /// Seconds a request takes there, where measured.
    service_s: Option<f64>,
    /// Requests it surely runs at once, which its capacity for live conversations is
    /// planned on, and those corral may send it now (see [`NodeView::admits`]).
    parallel: usize,
    admits: usize,
    depth: u32,
    /// Live conversations there, and how many its slots and host cache keep warm.
    live: u32,
    room: f64,
    /// It keeps nothing warm beyond its slots.
    slots_only: bool,
}

impl Start {
    /// Its cold prefill rate and service time, measured or guessed. A node not measured yet
    /// is taken to be as fast as the fleet's best, as the latency signal takes it: it gets
    /// work, and so a measurement; but no faster than its requests not yet answered show it
    /// can be.
    fn rates(&self, fastest: &Fastest) -> Option<(f64, f64)> {
        let cold_tps = self.cold_rate(fastest)?;
        Some((cold_tps, self.service_s.or(fastest.service_s)?))
    }

    /// Its cold prefill rate, measured or guessed as [`Start::rates`] guesses it.
    fn cold_rate(&self, fastest: &Fastest) -> Option<f64> {
        let guess = fastest.cold_tps.map(|best| match self.cold_tps_at_most {
            Some(at_most) => best.min(at_most),
            None => best,
        });
        self.cold_tps.or(guess).filter(|&tps| tps > 0.0)
    }

    /// It has a slot free for the request now.
    fn free(&self) -> bool {
        (self.depth as usize) < self.admits
    }

    /// Seconds until a slot is free, where the service time is measured.
    fn wait(&self) -> Option<f64> {
        let service = self.service_s?;
        Some(stay::expected_wait(self.depth, self.admits, service))
    }
}

/// The best learned speeds for the model among the nodes, the yardstick of the latency
/// signal.
fn best_speed(views: &[NodeView]) -> Speed {
    let mut best = Speed::default();
    for view in views {
        best.prefill = max_opt(best.prefill, view.model.prefill_tps);
        best.decode = max_opt(best.decode, view.model.decode_tps);
    }
    best
}

fn max_opt(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    }
}

/// When the conversation's warm node is outscored, keeps the follow-up there anyway if,
/// counted in seconds, it would start there no later than a move to the best other node
/// (see [`stay`]): the warm node is given just the lead it needs (`stay`). Needs
/// measured service times and prefill rates; without them the signals decide alone, as
/// in the README's worked example. Off unless `weights.move_cost` is set.
fn keep_warm_if_sooner(
    ranked: &mut [Ranked],
    starts: &[Start],
    warm_node: u16,
    prompt_tokens: u32,
    factor: f64,
) {
    let Some(warm) = ranked.iter().position(|c| c.node.id == warm_node) else {
        return;
    };
    let Some(other) = best_other(ranked, warm) else {
        return;
    };
    let gap = ranked[other].scores.total() - ranked[warm].scores.total();
    if gap < 0.0 || ranked[warm].standby {
        return;
    }
    let Some(warm_wait) = starts[warm].wait() else {
        return;
    };
    let (Some(other_wait), Some(other_tps)) = (starts[other].wait(), starts[other].cold_tps) else {
        return;
    };
    let Some(cost) = stay::move_cost(prompt_tokens, other_tps, factor) else {
        return;
    };
    if stay::stays(warm_wait, other_wait, cost) {
        lead_by(ranked, warm, |s| &mut s.stay);
    }
}

/// A follow-up leaves its warm node, where that has a slot free, for an idle one where its
/// first token would come in less than half the time ([`stay::moves_to_idle`]): the idle
/// node is given just the lead it needs (`rehome`). Both nodes' cold prefill rates must be
/// measured, the idle node weighed as placements by cost weigh nodes ([`weighable`]), with
/// a slot not held by a live conversation ([`placement::slots_full`]), so that the move
/// pushes none out of its slot.
/// Nothing happens where the request's new part is not known (it carries no earlier reply).
fn rehome_if_faster(ranked: &mut [Ranked], starts: &[Start], warm_node: u16, p: &Profile) {
    if p.new_tokens >= p.prompt_tokens {
        return;
    }
    let Some(warm) = ranked.iter().position(|c| c.node.id == warm_node) else {
        return;
    };
    // Only where its warm node has a slot free: under load, whether to wait for it or move
    // is the queue's and the session affinity's to weigh (moving there cost warm turns).
    let start = &starts[warm];
    if !start.free() || ranked[warm].standby {
        return;
    }
    let Some(stay_s) = (start.cold_tps).and_then(|tps| stay::prefill_s(p.new_tokens, tps)) else {
        return;
    };
    let weighed = weighable(ranked);
    let idle = |i: usize| {
        i != warm && weighed(&ranked[i]) && starts[i].depth == 0 && !ranked[i].node.model.full
    };
    let costs = (0..ranked.len()).filter(|&i| idle(i)).filter_map(|i| {
        let tps = starts[i].cold_tps?;
        Some((i, stay::prefill_s(p.prompt_tokens, tps)?))
    });
    if let Some(pick) = cheapest(
        ranked,
        costs.filter(|&(_, s)| stay::moves_to_idle(stay_s, s)),
    ) {
        lead_by(ranked, pick, |s| &mut s.rehome);
    }
}

/// How much a node's speed history still counts: half after a minute without a new
/// measurement. A slow node that lost all its traffic is thus tried again in time, rather
/// than being judged for ever on old figures.
fn freshness(measured: Option<Instant>, now: Instant) -> f64 {
    const HALF_LIFE: Duration = Duration::from_secs(60);
    measured.map_or(1.0, |t| {
        0.5f64.powf(now.duration_since(t).as_secs_f64() / HALF_LIFE.as_secs_f64())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::sync::Arc;

    use crate::config::NodeConfig;
    use crate::request::Endpoint;
    use crate::routing::placement::Footprint;
    use crate::routing::view::ModelView;

    const GB: u64 = 1_000_000_000;

    fn chat(model: &str) -> Profile {
        let body = serde_json::json!({
            "model": model,
            "messages": [{ "role": "user", "content": "hello" }],
        });
        Profile::parse(Endpoint::Chat, body.to_string().as_bytes()).unwrap()
    }

    /// An idle, healthy 24 GB node with the model resident and nothing learned yet.
    fn view(id: u16, name: &str) -> NodeView {
        let config = NodeConfig::new(name, &format!("http://127.0.0.1:{}", 9000 + id));
        let settings = Arc::new(config.clone());
        NodeView {
            id,
            settings,
            standby: false,
            success_ratio: 1.0,
            parallel: 1,
            admits: 1,
            resident: true,
            on_disk: true,
            memory_total: Some(24 * GB),
            footprint: Footprint {
                used: 5 * GB,
                idle: 5 * GB,
            },
            loaded_context: None,
            slots_known: true,
            victim_use: None,
            model: ModelView::default(),
        }
    }

    fn request(need: Option<u64>, warm_node: Option<u16>) -> Request {
        Request {
            need,
            warm_node,
            pin_node: warm_node,
            now: Instant::now(),
            pause_s: None,
        }
    }

    /// A new conversation, once corral has seen conversations pause 8 s between turns.
    fn new_conversation_after_pauses() -> Request {
        Request {
            pause_s: Some(8.0),
            ..request(None, None)
        }
    }

    /// [`super::rank`], each candidate with its own copy of its view.
    fn rank(
        p: &Profile,
        r: Request,
        views: &[NodeView],
        w: &Weights,
    ) -> Result<Vec<Candidate<NodeView>>, RouteError> {
        let ranked = super::rank(p, r, views, w)?;
        let owned = |c: Ranked| {
            let view = c.node.clone();
            c.with_node(view)
        };
        Ok(ranked.into_iter().map(owned).collect())
    }

    fn names(ranked: &[Candidate<NodeView>]) -> Vec<&str> {
        ranked.iter().map(|c| c.node.name()).collect()
    }

    #[test]
    fn a_resident_model_beats_a_load_by_the_model_loaded_weight() {
        let w = Weights::default();
        let mut cold = view(0, "cold");
        cold.resident = false;
        cold.footprint = Footprint::default();
        let warm = view(1, "warm");
        let ranked = rank(&chat("m"), request(Some(5 * GB), None), &[cold, warm], &w).unwrap();
        assert_eq!(names(&ranked), ["warm", "cold"]);
        assert!(ranked[0].resident && !ranked[1].resident);
        assert_eq!(ranked[0].scores.model_loaded, w.model_loaded);
        assert_eq!(ranked[1].scores.model_loaded, 0.0);
    }

    #[test]
    fn the_node_holding_the_prefix_leads_until_its_queue_outweighs_it() {
        let w = Weights::default();
        let p = chat("m");
        let (warm, other) = (view(0, "warm"), view(1, "other"));
        let ranked = rank(
            &p,
            request(None, Some(0)),
            &[other.clone(), warm.clone()],
            &w,
        )
        .unwrap();
        assert_eq!(names(&ranked), ["warm", "other"]);
        assert_eq!(ranked[0].scores.session_affinity, w.session_affinity);

        // Four requests running there: the affinity bonus shrinks to a third and the queue
        // costs four times its weight, so the idle node leads.
        let mut busy = warm;
        busy.model.in_flight = 4;
        let ranked = rank(&p, request(None, Some(0)), &[busy, other], &w).unwrap();
        assert_eq!(names(&ranked), ["other", "warm"]);
        let warm_scores = &ranked[1].scores;
        assert!((warm_scores.session_affinity - w.session_affinity / 3.0).abs() < 1e-9);
        assert!((warm_scores.queue_depth + 4.0 * w.queue_depth).abs() < 1e-9);
    }

    #[test]
    fn a_node_too_small_for_the_model_is_left_out_and_none_left_is_too_large() {
        let w = Weights::default();
        let mut small = view(0, "small");
        small.resident = false;
        small.memory_total = Some(8 * GB);
        small.footprint = Footprint::default();
        let mut big = view(1, "big");
        big.resident = false;
        big.footprint = Footprint::default();
        let p = chat("m");
        let need = Some(16 * GB);
        let ranked = rank(&p, request(need, None), &[small.clone(), big], &w).unwrap();
        assert_eq!(names(&ranked), ["big"]);
        let refused = rank(&p, request(need, None), &[small], &w).err();
        assert_eq!(
            refused,
            Some(RouteError::TooLarge {
                model: "m".into(),
                need: 16 * GB
            })
        );
        let none = rank(&p, request(need, None), &[], &w).err();
        assert_eq!(none, Some(RouteError::ModelNotFound("m".into())));
    }

    #[test]
    fn standby_nodes_and_busy_evictions_rank_last_whatever_their_scores() {
        let w = Weights::default();
        let mut down = view(0, "down");
        down.standby = true;
        // Loading here would have to unload a model in use: 20 of 24 GB taken, none idle.
        let mut crowded = view(1, "crowded");
        crowded.resident = false;
        crowded.footprint = Footprint {
            used: 20 * GB,
            idle: 0,
        };
        let mut fresh = view(2, "fresh");
        fresh.resident = false;
        fresh.footprint = Footprint::default();
        // `down` has the best scores (resident), `crowded` and `fresh` tie on signals but
        // `crowded`'s load would evict a busy model.
        let views = [down, crowded, fresh];
        let ranked = rank(&chat("m"), request(Some(8 * GB), None), &views, &w).unwrap();
        assert_eq!(names(&ranked), ["fresh", "crowded", "down"]);
        assert!(ranked[1].evicts_busy && ranked[2].standby);
        assert!(ranked[2].scores.total() > ranked[0].scores.total());
    }

    #[test]
    fn the_slower_node_pays_the_latency_penalty_measured_against_the_fastest() {
        let w = Weights::default();
        let r = request(None, None);
        let now = r.now;
        let mut fast = view(0, "fast");
        fast.model.decode_tps = Some(60.0);
        fast.model.prefill_tps = Some(3000.0);
        fast.model.speed_at = Some(now);
        let mut slow = view(1, "slow");
        slow.model.decode_tps = Some(20.0);
        slow.model.prefill_tps = Some(1000.0);
        slow.model.speed_at = Some(now);
        let ranked = rank(&chat("m"), r, &[slow, fast], &w).unwrap();
        assert_eq!(names(&ranked), ["fast", "slow"]);
        assert_eq!(ranked[0].scores.latency, 0.0);
        assert!(ranked[1].scores.latency < 0.0);
    }

    #[test]
    fn equal_nodes_split_conversations_and_a_conversation_keeps_its_node() {
        let w = Weights::default();
        let views: Vec<NodeView> = (0..3).map(|i| view(i, &format!("n{i}"))).collect();
        let mut firsts = std::collections::HashSet::new();
        for i in 0..30 {
            let p = chat(&format!("model-{i}"));
            let first = rank(&p, request(None, None), &views, &w).unwrap()[0]
                .node
                .id;
            let again = rank(&p, request(None, None), &views, &w).unwrap()[0]
                .node
                .id;
            assert_eq!(first, again);
            firsts.insert(first);
        }
        assert_eq!(firsts.len(), 3, "ties spread over every node");
    }

    /// `view` measured: prefill and decode speeds, its cold rate and service time, and
    /// `live` conversations in a warm room of `room`.
    fn measured(id: u16, name: &str, prefill: f64, live: u32, room: f64, now: Instant) -> NodeView {
        let mut v = view(id, name);
        v.parallel = 4;
        v.admits = 4;
        v.model.prefill_tps = Some(prefill);
        v.model.decode_tps = Some(prefill / 60.0);
        v.model.speed_at = Some(now);
        v.model.cold_tps = Some(prefill);
        v.model.service_s = Some(3.0);
        v.model.live_conversations = live;
        v.model.warm_room = room;
        v
    }

    /// A chat whose history holds an assistant turn, of about `tokens` prompt tokens.
    fn follow_up(model: &str, tokens: usize) -> Profile {
        let body = serde_json::json!({
            "model": model,
            "messages": [
                { "role": "user", "content": "x".repeat(4 * tokens) },
                { "role": "assistant", "content": "ok" },
                { "role": "user", "content": "and then?" },
            ],
        });
        Profile::parse(Endpoint::Chat, body.to_string().as_bytes()).unwrap()
    }

    #[test]
    fn a_lost_follow_up_on_slot_only_nodes_goes_where_it_starts_soonest() {
        let w = Weights::default();
        let r = request(None, None);
        let now = r.now;
        let p = follow_up("m", 8_000);
        assert!(p.follow_up);
        // Fast but queued: 5 requests on 4 slots of 3 s each, 1.5 s of wait, then 2 s of
        // prefill. The other is idle and prefills in 2.7 s.
        let mut fast = measured(0, "fast", 4000.0, 0, 0.0, now);
        fast.model.in_flight = 5;
        let idle = measured(1, "idle", 3000.0, 0, 0.0, now);
        let signals_only = rank(&p, r, &[fast.clone(), idle.clone()], &w).unwrap();
        assert_eq!(
            names(&signals_only),
            ["fast", "idle"],
            "the signals queue it"
        );

        let (mut fast, mut idle) = (fast, idle);
        fast.model.slots_only = true;
        idle.model.slots_only = true;
        let ranked = rank(&p, r, &[fast.clone(), idle.clone()], &w).unwrap();
        assert_eq!(names(&ranked), ["idle", "fast"]);
        assert!(ranked[0].scores.total() > ranked[1].scores.total());

        // Where the idle node prefills in 4 s, it starts sooner on the queued fast one.
        let mut slow = measured(1, "idle", 2000.0, 0, 0.0, now);
        slow.model.slots_only = true;
        let ranked = rank(&p, r, &[fast.clone(), slow], &w).unwrap();
        assert_eq!(names(&ranked), ["fast", "idle"]);

        // A node the other signals rate lower (it failed lately) is not weighed, and then
        // the signals decide alone, as where a host cache may be kept.
        let mut flaky = idle.clone();
        flaky.success_ratio = 0.8;
        let mut flaky_cached = flaky.clone();
        flaky_cached.model.slots_only = false;
        let mut deep = fast.clone();
        deep.model.in_flight = 12;
        let mut deep_cached = deep.clone();
        deep_cached.model.slots_only = false;
        let ranked = rank(&p, r, &[deep, flaky], &w).unwrap();
        let signals = rank(&p, r, &[deep_cached, flaky_cached], &w).unwrap();
        assert_eq!(
            names(&ranked),
            ["idle", "fast"],
            "its queue outweighs the failures"
        );
        assert_eq!(names(&ranked), names(&signals));
        assert_eq!(ranked[0].scores, signals[0].scores);

        // A follow-up whose prefix a node holds is not moved so.
        let warm_on_fast = Request {
            warm_node: Some(0),
            ..r
        };
        let ranked = rank(&p, warm_on_fast, &[fast, idle], &w).unwrap();
        assert_eq!(names(&ranked), ["fast", "idle"]);
    }

    #[test]
    fn a_follow_up_leaves_its_slow_warm_node_for_an_idle_one_where_it_starts_much_sooner() {
        let w = Weights::default();
        let r = request(None, Some(0));
        let now = r.now;
        // About 1,000 prompt tokens, 250 of them after the last reply.
        let turn = |history: usize| {
            let body = serde_json::json!({
                "model": "m",
                "messages": [
                    { "role": "user", "content": "x".repeat(history) },
                    { "role": "assistant", "content": "ok" },
                    { "role": "user", "content": "y".repeat(998) },
                ],
            });
            Profile::parse(Endpoint::Chat, body.to_string().as_bytes()).unwrap()
        };
        let p = turn(3_000);
        assert_eq!(p.new_tokens, 250);
        let slow = measured(0, "slow", 400.0, 1, 5.0, now);
        let fast = measured(1, "fast", 4_000.0, 0, 5.0, now);
        let ranked = rank(&p, r, &[slow.clone(), fast.clone()], &w).unwrap();
        assert_eq!(names(&ranked), ["fast", "slow"]);
        assert!(ranked[0].scores.rehome > 0.0, "in its own field");
        assert!(
            ranked[1].scores.session_affinity > 0.0,
            "warm on the slow one"
        );

        let stays = |views: &[NodeView], p: &Profile| {
            let ranked = rank(p, r, views, &w).unwrap();
            ranked[0].node.name() == "slow" && ranked.iter().all(|c| c.scores.rehome == 0.0)
        };
        // Not where the idle node's slots all hold live conversations, nor where it runs
        // a request, nor where its speed is not measured.
        let mut full = fast.clone();
        full.model.full = true;
        assert!(stays(&[slow.clone(), full], &p));
        let mut busy = fast.clone();
        busy.model.in_flight = 1;
        assert!(stays(&[slow.clone(), busy], &p));
        // Nor where its warm node's slots are all taken: under load the queue and the
        // session affinity weigh waiting against moving (here they keep it).
        let mut slow_full = slow.clone();
        slow_full.model.in_flight = 4;
        assert!(stays(&[slow_full, fast.clone()], &p));
        let mut unmeasured = fast.clone();
        unmeasured.model.cold_tps = None;
        assert!(stays(&[slow.clone(), unmeasured], &p));
        // Not for a node only 2.5 times faster (its 1,000 tokens in 1 s against the slow
        // node's 250 new ones in 0.625 s), nor for a long history: at 4,000 a second,
        // 8,000 tokens take longer than the slow node's 250.
        assert!(stays(
            &[slow.clone(), measured(1, "fast", 1_000.0, 0, 5.0, now)],
            &p
        ));
        assert!(stays(&[slow.clone(), fast.clone()], &turn(31_000)));
        // Nor for a request without an earlier reply: it has no warm node to leave.
        let ranked = rank(&chat("m"), request(None, None), &[slow, fast], &w).unwrap();
        assert!(ranked.iter().all(|c| c.scores.rehome == 0.0));
    }

    #[test]
    fn a_node_not_measured_yet_is_no_faster_than_its_unanswered_requests_allow() {
        let w = Weights::default();
        let r = request(None, None);
        let now = r.now;
        let fast = measured(0, "fast", 4000.0, 0, 5.0, now);
        // Its first prompt has been in prefill for a while: at most 400 tokens a second.
        let mut unmeasured = view(1, "unmeasured");
        unmeasured.model.cold_tps_at_most = Some(400.0);
        let ranked = rank(&chat("m"), r, &[unmeasured.clone(), fast.clone()], &w).unwrap();
        assert_eq!(names(&ranked), ["fast", "unmeasured"]);
        // Ten times slower at least: nine tenths of the latency weight.
        assert!((ranked[1].scores.latency + 0.9 * w.latency).abs() < 1e-9);
        // Nothing known, it is taken as fast as the best.
        unmeasured.model.cold_tps_at_most = None;
        let ranked = rank(&chat("m"), r, &[unmeasured, fast], &w).unwrap();
        assert_eq!(ranked.iter().map(|c| c.scores.latency).sum::<f64>(), 0.0);
    }

    #[test]
    fn a_new_conversation_starts_where_the_warm_room_has_space_not_where_it_is_fastest() {
        let w = Weights::default();
        let r = new_conversation_after_pauses();
        let now = r.now;
        // The fast node keeps 5 conversations warm and serves 5: a sixth would push them
        // out in turn. The slower one, half as fast, has room.
        let full = measured(0, "fast", 4000.0, 5, 5.0, now);
        let roomy = measured(1, "slower", 2000.0, 2, 5.0, now);
        let ranked = rank(&chat("m"), r, &[full.clone(), roomy.clone()], &w).unwrap();
        assert_eq!(names(&ranked), ["slower", "fast"]);
        assert!(ranked[1].scores.latency == 0.0 && ranked[0].scores.latency < 0.0);
        assert!(
            ranked[0].scores.spread > 0.0 && ranked[0].scores.session_affinity == 0.0,
            "the spread, in its own field, lifts it to lead"
        );
        assert!(ranked[0].scores.total() > ranked[1].scores.total());

        // With room on both, the faster start wins as the signals have it.
        let spare = measured(0, "fast", 4000.0, 2, 5.0, now);
        let ranked = rank(&chat("m"), r, &[spare, roomy.clone()], &w).unwrap();
        assert_eq!(names(&ranked), ["fast", "slower"]);

        // A follow-up is not placed anew: its warm node's affinity decides.
        let mut follow_up = request(None, Some(0));
        follow_up.now = now;
        follow_up.pause_s = Some(8.0);
        let ranked = rank(&chat("m"), follow_up, &[full.clone(), roomy.clone()], &w).unwrap();
        assert_eq!(names(&ranked), ["fast", "slower"]);

        // Where nothing is measured yet, the signals decide alone.
        let (mut a, mut b) = (view(0, "a"), view(1, "b"));
        a.model.live_conversations = 9;
        a.model.warm_room = 1.0;
        b.model.warm_room = 9.0;
        let p = chat("m");
        let alone = rank(&p, r, &[a.clone(), b.clone()], &w).unwrap();
        assert!(alone.iter().all(|c| c.scores
            == Scores {
                spread: 0.0,
                ..c.scores
            }));
    }

    #[test]
    fn a_new_conversation_starts_where_most_room_is_spare_among_nodes_equal_but_for_noise() {
        let w = Weights::default();
        let r = new_conversation_after_pauses();
        let now = r.now;
        // Equal nodes, one measured 5% faster: it holds more conversations already.
        let quicker = measured(0, "quicker", 4200.0, 4, 8.0, now);
        let roomier = measured(1, "roomier", 4000.0, 2, 8.0, now);
        let ranked = rank(&chat("m"), r, &[quicker.clone(), roomier.clone()], &w).unwrap();
        assert_eq!(names(&ranked), ["roomier", "quicker"]);
        assert!(ranked[0].scores.spread > 0.0);
        // Twice as fast is no noise: the faster start wins while both have room.
        let fast = measured(0, "fast", 8000.0, 4, 8.0, now);
        let ranked = rank(&chat("m"), r, &[fast, roomier], &w).unwrap();
        assert_eq!(names(&ranked), ["fast", "roomier"]);
    }

    #[test]
    fn a_new_conversation_is_placed_by_its_cost_where_a_node_would_push_a_slot_out() {
        let w = Weights::default();
        let r = new_conversation_after_pauses();
        let now = r.now;
        // Every slot of the fast node holds a conversation served within the keep-alive,
        // so a new one would push one out (the displacement penalty); its warm room says
        // the 3 live ones and a fourth fit. The slow node, ten times slower, has room too.
        let mut fast = measured(0, "fast", 4000.0, 3, 8.0, now);
        fast.model.new_conversation_displaces = true;
        let slow = measured(1, "slow", 400.0, 0, 8.0, now);
        let ranked = rank(&chat("m"), r, &[fast.clone(), slow.clone()], &w).unwrap();
        assert_eq!(names(&ranked), ["fast", "slow"]);
        assert!(ranked[0].scores.total() > ranked[1].scores.total());

        // Where its room is full, the cost sends the conversation to the slow node.
        let mut full = measured(0, "fast", 4000.0, 8, 8.0, now);
        full.model.new_conversation_displaces = true;
        let ranked = rank(&chat("m"), r, &[full, slow], &w).unwrap();
        assert_eq!(names(&ranked), ["slow", "fast"]);
    }

    #[test]
    fn a_new_conversation_does_not_wait_for_a_slot_while_another_node_has_one_free() {
        let w = Weights::default();
        let r = new_conversation_after_pauses();
        let now = r.now;
        // The slower node has warm room and a short forecast wait, but every slot running;
        // the fast one would push its conversations out, but has a slot free.
        let fast = measured(0, "fast", 4000.0, 5, 5.0, now);
        let mut roomy = measured(1, "slower", 2000.0, 2, 5.0, now);
        roomy.model.service_s = Some(0.001);
        roomy.model.in_flight = 4;
        let ranked = rank(&chat("m"), r, &[fast.clone(), roomy.clone()], &w).unwrap();
        assert_eq!(names(&ranked), ["fast", "slower"]);

        // With a slot free on both, the warm room decides again.
        roomy.model.in_flight = 3;
        let ranked = rank(&chat("m"), r, &[fast.clone(), roomy.clone()], &w).unwrap();
        assert_eq!(names(&ranked), ["slower", "fast"]);

        // A free node healing from failures (the other signals rate it a little lower) is
        // still free: the conversation does not queue on the busy one for want of weighing it.
        let mut healing = fast;
        healing.success_ratio = 0.8;
        roomy.model.in_flight = 4;
        let ranked = rank(&chat("m"), r, &[healing, roomy], &w).unwrap();
        assert_eq!(names(&ranked), ["fast", "slower"]);
    }

    #[test]
    fn old_speed_history_counts_less() {
        let now = Instant::now();
        assert_eq!(freshness(None, now), 1.0);
        assert_eq!(freshness(Some(now), now), 1.0);
        let minute_ago = now - Duration::from_secs(60);
        assert!((freshness(Some(minute_ago), now) - 0.5).abs() < 1e-9);
    }

    /// Two nodes with the model whose one slot each runs a request, and one without it.
    fn full_pair_and_an_empty_node() -> Vec<NodeView> {
        let mut views = Vec::new();
        for (id, name) in [(0, "a"), (1, "b")] {
            let mut v = view(id, name);
            v.model.in_flight = 1;
            views.push(v);
        }
        let mut empty = view(2, "empty");
        empty.resident = false;
        empty.footprint = Footprint::default();
        views.push(empty);
        views
    }

    #[test]
    fn a_node_without_the_model_loads_it_while_every_node_with_it_is_full_and_the_wait_unknown() {
        let w = Weights::default();
        let views = full_pair_and_an_empty_node();
        let ranked = rank(&chat("m"), request(Some(5 * GB), None), &views, &w).unwrap();
        assert_eq!(ranked[0].node.name(), "empty");
        assert!(!ranked[0].resident);
        // The lead is its own field, a point past the best other, and the signals are kept.
        let lead = ranked[0].scores.sooner;
        assert!(lead > 0.0);
        assert_eq!(ranked[0].scores.model_loaded, 0.0);
        let best_other = ranked[1].scores.total();
        assert!((ranked[0].scores.total() - (best_other + 1.0)).abs() < 1e-9);
        // A slot free where the model is: nothing loads.
        let mut free = views.clone();
        free[1].model.in_flight = 0;
        let ranked = rank(&chat("m"), request(Some(5 * GB), None), &free, &w).unwrap();
        assert_eq!(ranked[0].node.name(), "b");
        assert!(ranked.iter().all(|c| c.scores.sooner == 0.0));
    }

    #[test]
    fn a_load_goes_ahead_only_when_it_starts_the_request_sooner_than_the_wait() {
        let w = Weights::default();
        // Requests of 2 s, one slot each, a 5 s load measured on the empty node.
        let mut views = full_pair_and_an_empty_node();
        for v in &mut views {
            v.model.service_s = Some(2.0);
            v.model.cold_tps = Some(1_000.0);
        }
        views[2].model.load_s = Some(5.0);
        let place = |views: &[NodeView]| {
            let ranked = rank(&chat("m"), request(Some(5 * GB), None), views, &w).unwrap();
            ranked[0].node.name().to_string()
        };
        // One running on each: the wait is 2 s, shorter than the load.
        assert_ne!(place(&views), "empty");
        // Four waiting behind each: 10 s of wait, so the load is sooner.
        for v in &mut views[..2] {
            v.model.waiting = 4;
        }
        assert_eq!(place(&views), "empty");
        // A load that must unload an idle model counts twice: 10 s, no sooner.
        views[2].memory_total = Some(8 * GB);
        views[2].footprint = Footprint {
            used: 5 * GB,
            idle: 5 * GB,
        };
        assert_ne!(place(&views), "empty");
        // One that would unload a model in use never happens.
        views[2].footprint.idle = 0;
        for v in &mut views[..2] {
            v.model.waiting = 40;
        }
        assert_ne!(place(&views), "empty");
    }

    #[test]
    fn a_load_measured_on_one_node_is_the_estimate_for_the_others() {
        let w = Weights::default();
        let mut views = full_pair_and_an_empty_node();
        for v in &mut views {
            v.model.service_s = Some(2.0);
        }
        // Ten seconds of wait on each node with the model.
        for v in &mut views[..2] {
            v.model.waiting = 4;
        }
        let place = |views: &[NodeView]| {
            let ranked = rank(&chat("m"), request(Some(5 * GB), None), views, &w).unwrap();
            ranked[0].node.name().to_string()
        };
        // The prior (5 s) is sooner; a 30 s load seen on `a` is not.
        assert_eq!(place(&views), "empty");
        views[0].model.load_s = Some(30.0);
        assert_ne!(place(&views), "empty");
    }

    #[test]
    fn a_follow_up_warm_on_a_full_node_counts_its_prefill_there_as_nothing() {
        let w = Weights::default();
        let mut views = full_pair_and_an_empty_node();
        for v in &mut views {
            v.model.service_s = Some(2.0);
            v.model.cold_tps = Some(1_000.0);
        }
        views[2].model.load_s = Some(1.0);
        // 2 s of wait on `a` against 1 s of load plus 4 s of history to prefill elsewhere.
        views[1].model.waiting = 4;
        let mut p = chat("m");
        p.prompt_tokens = 4_000;
        let warm = rank(&p, request(Some(5 * GB), Some(0)), &views, &w).unwrap();
        assert_eq!(warm[0].node.name(), "a");
        // A new conversation of the same length pays its prefill on `a` too: 7 s, so it loads.
        let new = rank(&p, request(Some(5 * GB), None), &views, &w).unwrap();
        assert_eq!(new[0].node.name(), "empty");
    }

    /// What varies between nodes in a generated snapshot.
    #[derive(Clone, Debug)]
    struct Gen {
        standby: bool,
        resident: bool,
        success: f64,
        parallel: usize,
        in_flight: u32,
        waiting: u32,
        /// Prefill rate; decode, cold rate and service time follow from it.
        prefill: Option<f64>,
        service_s: Option<f64>,
        load_s: Option<f64>,
        live: u32,
        room: f64,
        displaces: bool,
        slots_only: bool,
        used_gb: u64,
    }

    fn gen_node() -> impl proptest::strategy::Strategy<Value = Gen> {
        use proptest::prelude::*;
        // Few distinct values, so that nodes often tie and the tie-break is put to work.
        let speeds = (
            proptest::option::of(prop_oneof![Just(1000.0), Just(4000.0)]),
            proptest::option::of(prop_oneof![Just(2.0), Just(8.0)]),
            proptest::option::of(prop_oneof![Just(5.0), Just(30.0)]),
        );
        let room = prop_oneof![Just(0.0), Just(4.0), Just(9.5)];
        let load = (
            0..12u32,
            0..6u32,
            room,
            any::<bool>(),
            any::<bool>(),
            0..30u64,
        );
        let success = prop_oneof![Just(1.0), Just(1.0), Just(0.5)];
        (
            any::<bool>(),
            any::<bool>(),
            success,
            1..5usize,
            0..10u32,
            speeds,
            load,
        )
            .prop_map(
                |(standby, resident, success, parallel, in_flight, speeds, load)| {
                    let (waiting, live, room, displaces, slots_only, used_gb) = load;
                    Gen {
                        standby,
                        resident,
                        success,
                        parallel,
                        in_flight,
                        waiting: waiting % 4,
                        prefill: speeds.0,
                        service_s: speeds.1,
                        load_s: speeds.2,
                        live: live % 8,
                        room,
                        displaces,
                        slots_only,
                        used_gb,
                    }
                },
            )
    }

    fn snapshot(nodes: &[Gen], now: Instant) -> Vec<NodeView> {
        let names = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot"];
        (nodes.iter().zip(0u16..).zip(names))
            .map(|((g, id), name)| {
                let mut v = view(id, name);
                v.standby = g.standby;
                v.resident = g.resident;
                v.success_ratio = g.success;
                (v.parallel, v.admits) = (g.parallel, g.parallel);
                v.footprint.used = g.used_gb * GB;
                v.footprint.idle = g.used_gb * GB / 2;
                let m = &mut v.model;
                (m.in_flight, m.waiting) = (g.in_flight, g.waiting);
                m.prefill_tps = g.prefill;
                m.decode_tps = g.prefill.map(|tps| tps / 60.0);
                m.cold_tps = g.prefill;
                m.speed_at = g.prefill.map(|_| now);
                (m.service_s, m.load_s) = (g.service_s, g.load_s);
                (m.live_conversations, m.warm_room) = (g.live, g.room);
                m.new_conversation_displaces = g.displaces;
                m.slots_only = g.slots_only;
                m.full = g.in_flight as usize >= g.parallel;
                v
            })
            .collect()
    }

    fn order(ranked: &[Candidate<NodeView>]) -> Vec<(String, u64)> {
        (ranked.iter())
            .map(|c| (c.node.name().to_string(), c.scores.total().to_bits()))
            .collect()
    }

    proptest::proptest! {
        /// The whole decision on generated snapshots: the same snapshot ranks the same; the order
        /// is total (standby nodes, then loads that evict a model in use, last; else by total,
        /// highest first); no node is lost. (The order of the nodes in the snapshot is part of
        /// it: where two nodes cost the same in seconds, an adjustment leads the first.)
        #[test]
        fn ranking_a_snapshot_is_total_deterministic_and_reads_only_the_snapshot(
            nodes in proptest::collection::vec(gen_node(), 1..6),
            warm in proptest::option::of(0..6u16),
            continues in proptest::prelude::any::<bool>(),
            need_gb in proptest::option::of(1..30u64),
            pause_s in proptest::option::of(1.0..60.0f64),
            move_cost in 0.0..3.0f64,
        ) {
            let now = Instant::now();
            let w = Weights { move_cost, ..Weights::default() };
            let p = if continues { follow_up("m", 2000) } else { chat("m") };
            let r = Request {
                need: need_gb.map(|gb| gb * GB),
                warm_node: warm.filter(|&id| usize::from(id) < nodes.len()),
                pin_node: warm.filter(|&id| usize::from(id) < nodes.len()),
                now,
                pause_s,
            };
            let views = snapshot(&nodes, now);
            let Ok(first) = rank(&p, r, &views, &w) else {
                // Refused (the model fits no node): refused again.
                proptest::prop_assert!(rank(&p, r, &views, &w).is_err());
                return Ok(());
            };
            // Total: the groups in order, and within each the totals never rise.
            let keys: Vec<(bool, bool)> = first.iter().map(|c| (c.standby, c.evicts_busy)).collect();
            proptest::prop_assert!(keys.is_sorted(), "{keys:?}");
            for pair in first.windows(2) {
                if (pair[0].standby, pair[0].evicts_busy) == (pair[1].standby, pair[1].evicts_busy) {
                    proptest::prop_assert!(pair[0].scores.total() >= pair[1].scores.total());
                }
            }
            let mut names: Vec<&str> = first.iter().map(|c| c.node.name()).collect();
            names.sort_unstable();
            names.dedup();
            proptest::prop_assert_eq!(names.len(), first.len());
            // Deterministic: the same snapshot, or a copy of it, ranks the same. A snapshot
            // is plain data (a view holds no handle on its node), so nothing else can count.
            proptest::prop_assert_eq!(order(&rank(&p, r, &views, &w).unwrap()), order(&first));
            let copy = views.clone();
            proptest::prop_assert_eq!(order(&rank(&p, r, &copy, &w).unwrap()), order(&first));
        }
    }
}
