//! Waking the requests that wait in corral's queue when something changes that could change
//! where they go.
//!
//! A freed slot is handed to one waiter for its model, not to all of them: of the clients
//! waiting, the one first in the fair order ([`super::fair`]: `interactive` before `batch`,
//! then the least service had recently), and of its requests the one waiting warm for that
//! node, else the one waiting longest. A waiter that decides without taking it
//! (its conversation is warm elsewhere, the slot went meanwhile) passes it on to the next, each
//! waiter at most once and only while the node still has room, so a freed slot is neither
//! lost nor fought over. Other news wakes every waiter it concerns: a load or an unload seen
//! for the model, a node coming up or going down, a reload.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use hashbrown::HashMap;
use parking_lot::Mutex;
use tokio::sync::Notify;

use super::fair::{ClientId, FairShare, Member, Standing};
use super::node::Node;
use crate::config::Priority;

#[derive(Default)]
pub struct Wakeups {
    /// One per model that requests look for a slot of now. Weak: a model's entry goes when
    /// its last waiter does, so invented model names leave nothing behind.
    by_model: Mutex<HashMap<String, Weak<Queue>>>,
    /// Fleet-wide news: a node came up or went down, the configuration changed.
    fleet: Notify,
    /// Arrival order of listeners: the lower, the longer it waits.
    next_id: AtomicU64,
    /// Each client's service had, for the order between clients.
    fair: Arc<FairShare>,
}

/// Whom a request is for in the fair order: its client (a named API key, else the client's
/// address) and the client's class.
#[derive(Clone, Debug, Default)]
pub struct Requester {
    pub client: ClientId,
    pub priority: Priority,
}

/// The requests of one model that look for a slot.
struct Queue {
    model: String,
    waiters: Mutex<Vec<Waiter>>,
    /// News for every waiter of the model: a load or an unload seen.
    all: Notify,
    fair: Arc<FairShare>,
}

struct Waiter {
    id: u64,
    requester: Requester,
    /// Deciding or waiting; not while its request runs on a node.
    looking: bool,
    /// The node it waits for, and whether its conversation is warm there.
    best: Option<(u16, bool)>,
    /// A freed slot handed to it and not yet looked at.
    handed: Option<Offer>,
    wake: Arc<Notify>,
}

/// A freed slot on its way to a waiter, with the waiters it was offered to.
struct Offer {
    node: Arc<Node>,
    offered: Vec<u64>,
}

/// A request's place among the waiters for its model; see [`Wakeups::listen`].
pub struct Listener {
    queue: Arc<Queue>,
    id: u64,
    wake: Arc<Notify>,
    /// The request's part in its client's fair share, from arrival to end.
    member: Member,
}

/// A freed slot handed to a request. Unless [`Listener::sent`] finds the request sent to its
/// node, it goes on to the next waiter, also when dropped.
pub struct Handoff {
    queue: Arc<Queue>,
    offer: Option<Offer>,
}

impl Wakeups {
    /// Registers a request among the waiters for `model`; it looks for a slot from its first
    /// [`Listener::news`] on.
    pub fn listen(&self, model: &str, requester: Requester) -> Listener {
        let queue = {
            let mut by_model = self.by_model.lock();
            match by_model.get(model).and_then(Weak::upgrade) {
                Some(queue) => queue,
                None => {
                    by_model.retain(|_, w| w.strong_count() > 0);
                    let queue = Arc::new(Queue {
                        model: model.to_string(),
                        waiters: Mutex::new(Vec::new()),
                        all: Notify::new(),
                        fair: self.fair.clone(),
                    });
                    by_model.insert(model.to_string(), Arc::downgrade(&queue));
                    queue
                }
            }
        };
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let wake = Arc::new(Notify::new());
        let member = self.fair.join(requester.client.clone());
        queue.waiters.lock().push(Waiter {
            id,
            requester,
            looking: false,
            best: None,
            handed: None,
            wake: wake.clone(),
        });
        Listener {
            queue,
            id,
            wake,
            member,
        }
    }

    /// Where `requester` stands in the fair order as one number, lower first, for replicas
    /// to compare their waiting requests by (`shared_state:`): its class, then the service its
    /// client had (which every replica counts alike, [`FairShare::charge`]).
    pub fn rank(&self, requester: &Requester) -> f64 {
        /// Virtual seconds no client reaches: every `batch` request ranks after every
        /// `interactive` one.
        const BATCH: f64 = 1e12;
        let used = self
            .fair
            .standings(|standing| standing(&requester.client).used);
        match requester.priority {
            Priority::Interactive => used,
            Priority::Batch => BATCH + used,
        }
    }

    /// Another replica's request of `client` started: see [`FairShare::charge_start`].
    pub fn charge_start(&self, client: &ClientId) -> f64 {
        self.fair.charge_start(client)
    }

    /// Another replica's request of `client` ended: see [`FairShare::charge`].
    pub fn charge(&self, client: ClientId, seconds: f64) {
        self.fair.charge(client, seconds);
    }

    /// A slot for `model` freed on `node` (a request ended, or a warm waiter left the slot it
    /// was left): one waiter gets it.
    pub fn slot_freed(&self, model: &str, node: &Arc<Node>) {
        if let Some(queue) = self.queue(model) {
            queue.hand(Offer {
                node: node.clone(),
                offered: Vec::new(),
            });
        }
    }

    /// The model was loaded or unloaded somewhere: every waiter for it looks again.
    pub fn model_changed(&self, model: &str) {
        if let Some(queue) = self.queue(model) {
            queue.all.notify_waiters();
        }
    }

    /// A node was admitted or cut off, or the configuration changed: every waiter looks
    /// again.
    pub fn fleet_changed(&self) {
        self.fleet.notify_waiters();
    }

    fn queue(&self, model: &str) -> Option<Arc<Queue>> {
        self.by_model.lock().get(model).and_then(Weak::upgrade)
    }

    /// Models with a waiter now.
    #[cfg(test)]
    fn models(&self) -> usize {
        self.by_model
            .lock()
            .values()
            .filter(|w| w.strong_count() > 0)
            .count()
    }
}

impl Queue {
    /// Hands the slot to the waiter that should have it, unless the node has no room left
    /// for the model or every looking waiter was offered it (or holds another slot, on a
    /// node other than the one it waits for).
    fn hand(&self, mut offer: Offer) {
        if !offer.node.has_room(&self.model) {
            return;
        }
        let node = offer.node.id;
        let mut waiters = self.waiters.lock();
        let chosen = self.fair.standings(|standing| {
            waiters
                .iter_mut()
                .filter(|w| w.looking && !offer.offered.contains(&w.id))
                .filter(|w| w.handed.is_none() || w.trades_for(node))
                .map(|w| (Place::of(w, standing, node), w))
                .min_by(|(a, _), (b, _)| a.cmp(b))
                .map(|(_, w)| w)
        });
        let Some(waiter) = chosen else {
            return;
        };
        offer.offered.push(waiter.id);
        waiter.wake.notify_waiters();
        // Slots free in bursts when replies end together: a waiter handed one elsewhere a
        // moment ago trades it for one where it waits, and the other goes on.
        let traded = waiter.handed.replace(offer);
        drop(waiters);
        self.pass_on(traded);
    }

    /// Hands on a slot its holder did not take, if any.
    fn pass_on(&self, offer: Option<Offer>) {
        if let Some(offer) = offer {
            self.hand(offer);
        }
    }

    fn with_waiter<R>(&self, id: u64, f: impl FnOnce(&mut Waiter) -> R) -> Option<R> {
        self.waiters.lock().iter_mut().find(|w| w.id == id).map(f)
    }
}

/// How a waiter's client stands, at the instant `standings` were read.
type Standings<'a> = &'a dyn Fn(&ClientId) -> Standing;

impl Waiter {
    /// Its client's place in the fair order between clients: class, then service had.
    fn rank(&self, standing: Standings) -> (Priority, Standing) {
        (self.requester.priority, standing(&self.requester.client))
    }

    /// Holds a slot handed to it on another node than `node`, the one it waits for.
    fn trades_for(&self, node: u16) -> bool {
        let waits_there = self.best.is_some_and(|(best, _)| best == node);
        waits_there && self.handed.as_ref().is_some_and(|o| o.node.id != node)
    }
}

/// A waiter's place in the order a slot freed on a node is handed in: the fair order of its
/// client, then how likely it is to take the slot, then the longest waiting (fields compared
/// in this order).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Place {
    priority: Priority,
    standing: Standing,
    fit: Fit,
    id: u64,
}

/// How a waiter's conversation stands to a node's freed slot, the likeliest taker first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Fit {
    /// It waits for this node, warm there.
    WarmHere,
    /// It is cold wherever it goes, or waits for this node: a free slot now is what it lacks.
    Cold,
    /// It waits warm for another node. Offered last among its client's, since it mostly
    /// declines (a cold prefill here against a short wait there), and every decline costs the
    /// slot a wake and a decision before the next waiter is offered it.
    WarmElsewhere,
}

impl Place {
    fn of(w: &Waiter, standing: Standings, node: u16) -> Place {
        let (priority, standing) = w.rank(standing);
        let fit = match w.best {
            Some((best, true)) if best == node => Fit::WarmHere,
            Some((_, true)) => Fit::WarmElsewhere,
            _ => Fit::Cold,
        };
        Place {
            priority,
            standing,
            fit,
            id: w.id,
        }
    }
}

impl Listener {
    /// The request's number, unique in this process.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Completes on news for this request: a slot handed to it, its model loaded or
    /// unloaded, fleet-wide news, sent after this call. Call it before looking at the fleet,
    /// so that news in between is not lost; from then on the request counts as looking.
    pub fn news<'a>(&'a self, wakeups: &'a Wakeups) -> impl Future<Output = ()> + 'a {
        let mut handed = Box::pin(self.wake.notified());
        let mut model = Box::pin(self.queue.all.notified());
        let mut fleet = Box::pin(wakeups.fleet.notified());
        handed.as_mut().enable();
        model.as_mut().enable();
        fleet.as_mut().enable();
        self.queue.with_waiter(self.id, |w| w.looking = true);
        async move {
            tokio::select! {
                _ = handed => {}
                _ = model => {}
                _ = fleet => {}
            }
        }
    }

    /// The slot handed to the request since it last looked, if any: take it before deciding,
    /// and give it to [`Listener::sent`] or [`Listener::waits`] after.
    pub fn take_handoff(&self) -> Option<Handoff> {
        let offer = self.queue.with_waiter(self.id, |w| w.handed.take())??;
        Some(Handoff {
            queue: self.queue.clone(),
            offer: Some(offer),
        })
    }

    /// Every slot free on `node` for the model is handed to another waiter: this request
    /// must not take one, or the waiter it was handed to finds it gone (a new request, or a
    /// waiter looking again on its own, would jump the queue).
    pub fn leaves_to_others(&self, node: &Node) -> bool {
        let handed = self
            .queue
            .waiters
            .lock()
            .iter()
            .filter(|w| w.id != self.id)
            .filter(|w| w.handed.as_ref().is_some_and(|o| o.node.id == node.id))
            .count();
        handed > 0 && handed >= node.free_slots(&self.queue.model)
    }

    /// Whether a request waits warm for `node` whose client comes before or with this
    /// request's in the fair order: a cold request leaves such a request the slot it waits
    /// for, and takes one a client further back waits for.
    pub fn warm_waiter_first(&self, node: u16) -> bool {
        self.with_waiters_first(|mut first| {
            // `any` through the reference: the trait object cannot call it itself.
            Iterator::any(&mut first, |w| w.looking && w.best == Some((node, true)))
        })
    }

    /// Per node, the requests waiting for it that a slot freed there goes to before this one
    /// (the order of [`Place`]: another client's ahead in the fair order, its own client's
    /// warm there or waiting longer): what it would wait behind there. Not every waiter of its
    /// own client: then the one handed a freed slot would see that slot's node as full as
    /// the others and wait on, and the slot would pass from waiter to waiter.
    pub fn waiting_ahead(&self) -> Vec<(u16, u32)> {
        let waiters = self.queue.waiters.lock();
        let Some(me) = waiters.iter().find(|w| w.id == self.id) else {
            return Vec::new();
        };
        self.queue.fair.standings(|standing| {
            let mut ahead: Vec<(u16, u32)> = Vec::new();
            for w in waiters.iter().filter(|w| w.id != self.id) {
                let Some((node, _)) = w.best else { continue };
                if Place::of(w, standing, node) > Place::of(me, standing, node) {
                    continue;
                }
                match ahead.iter_mut().find(|(n, _)| *n == node) {
                    Some((_, count)) => *count += 1,
                    None => ahead.push((node, 1)),
                }
            }
            ahead
        })
    }

    /// Runs `f` over the other waiters whose client comes before or with this request's in
    /// the fair order (none once the request has left).
    fn with_waiters_first<R>(&self, f: impl FnOnce(&mut dyn Iterator<Item = &Waiter>) -> R) -> R {
        let waiters = self.queue.waiters.lock();
        let me = waiters.iter().find(|w| w.id == self.id);
        self.queue.fair.standings(|standing| {
            let mine = me.map(|me| me.rank(standing));
            let mut first = waiters
                .iter()
                .filter(|w| w.id != self.id && mine.is_some_and(|mine| w.rank(standing) <= mine));
            f(&mut first)
        })
    }

    /// The request was sent to `node`: it stops looking until it looks again, and its client
    /// is charged for a slot until [`Listener::ended`]. A slot handed to it on another node
    /// goes on to the next waiter.
    pub fn sent(&self, node: u16, handoff: Option<Handoff>) {
        self.member.start();
        if let Some(mut handoff) = handoff
            && handoff.offer.as_ref().is_some_and(|o| o.node.id == node)
        {
            handoff.offer = None;
        }
        let late = self.queue.with_waiter(self.id, |w| {
            w.looking = false;
            w.best = None;
            w.handed.take()
        });
        self.queue.pass_on(late.flatten());
    }

    /// The request's attempt on the node it was sent to ended: its client is charged the
    /// time it held the slot.
    pub fn ended(&self) {
        self.member.settle();
    }

    /// The request waits for `node`, `warm` if its conversation is warm there: the waiter a
    /// slot freed there goes to first among its client's. A slot handed to it goes on to the
    /// next waiter.
    pub fn waits(&self, node: u16, warm: bool, handoff: Option<Handoff>) {
        self.queue
            .with_waiter(self.id, |w| w.best = Some((node, warm)));
        drop(handoff);
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        let handed = {
            let mut waiters = self.queue.waiters.lock();
            let gone = waiters.iter().position(|w| w.id == self.id);
            gone.and_then(|i| waiters.swap_remove(i).handed)
        };
        self.queue.pass_on(handed);
    }
}

impl Handoff {
    /// The node whose slot this is.
    pub fn node_name(&self) -> &str {
        self.offer.as_ref().map_or("", |o| o.node.name())
    }

    /// Whether the slot is on node `id`.
    pub fn is_on(&self, id: u16) -> bool {
        self.offer.as_ref().is_some_and(|o| o.node.id == id)
    }
}

impl Drop for Handoff {
    fn drop(&mut self) {
        self.queue.pass_on(self.offer.take());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::NodeConfig;
    use futures::FutureExt;

    fn node(id: u16) -> Arc<Node> {
        let config = NodeConfig::new(&format!("n{id}"), "http://127.0.0.1:9");
        Arc::new(Node::new(id, config).unwrap())
    }

    fn listen(w: &Wakeups, model: &str) -> Listener {
        w.listen(model, Requester::default())
    }

    /// `N` requests for `m`, oldest first, each looking for a slot.
    fn looking<const N: usize>(w: &Wakeups) -> [Listener; N] {
        std::array::from_fn(|_| {
            let l = listen(w, "m");
            drop(l.news(w));
            l
        })
    }

    fn handed_node(l: &Listener) -> Option<u16> {
        let handoff = l.take_handoff()?;
        handoff.offer.as_ref().map(|o| o.node.id)
    }

    #[test]
    fn load_news_for_one_model_wakes_only_its_waiters_and_fleet_news_wakes_all() {
        let w = Wakeups::default();
        let a = listen(&w, "a");
        let b = listen(&w, "b");
        let wait_a = a.news(&w);
        let wait_b = b.news(&w);
        tokio::pin!(wait_a, wait_b);
        // Registered at once: news sent before the first poll is not lost.
        w.model_changed("a");
        assert!(wait_a.as_mut().now_or_never().is_some(), "a woken");
        assert!(wait_b.as_mut().now_or_never().is_none(), "b not");
        w.fleet_changed();
        assert!(
            wait_b.as_mut().now_or_never().is_some(),
            "fleet news wakes b"
        );
    }

    #[test]
    fn a_model_without_waiters_leaves_no_entry() {
        let w = Wakeups::default();
        drop(listen(&w, "invented"));
        let _kept = listen(&w, "real");
        assert_eq!(w.models(), 1);
        w.model_changed("invented");
        w.slot_freed("invented", &node(0));
    }

    #[test]
    fn a_freed_slot_wakes_one_waiter_the_oldest() {
        let w = Wakeups::default();
        let n = node(0);
        let (old, young) = (listen(&w, "m"), listen(&w, "m"));
        let (for_old, for_young) = (old.news(&w), young.news(&w));
        tokio::pin!(for_old, for_young);
        old.waits(1, false, None);
        young.waits(0, false, None);
        w.slot_freed("m", &n);
        assert!(for_old.as_mut().now_or_never().is_some(), "the oldest");
        assert!(for_young.as_mut().now_or_never().is_none(), "only one");
        assert_eq!(handed_node(&old), Some(0));
    }

    #[test]
    fn a_freed_slot_goes_first_to_a_waiter_warm_on_its_node() {
        let w = Wakeups::default();
        let n = node(3);
        let (old, warm_elsewhere, warm) = (listen(&w, "m"), listen(&w, "m"), listen(&w, "m"));
        let news = [old.news(&w), warm_elsewhere.news(&w), warm.news(&w)];
        old.waits(3, false, None);
        warm_elsewhere.waits(1, true, None);
        warm.waits(3, true, None);
        w.slot_freed("m", &n);
        let woken: Vec<bool> = news
            .into_iter()
            .map(|f| Box::pin(f).now_or_never().is_some())
            .collect();
        assert_eq!(woken, [false, false, true]);
    }

    #[test]
    fn a_waiter_warm_on_another_node_is_offered_a_slot_after_cold_ones() {
        let w = Wakeups::default();
        let n = node(0);
        let [warm_elsewhere, cold] = looking::<2>(&w);
        warm_elsewhere.waits(1, true, None);
        cold.waits(1, false, None);
        w.slot_freed("m", &n);
        assert_eq!(handed_node(&warm_elsewhere), None, "though older");
        let slot = cold.take_handoff().expect("the cold one");
        // Declined, it goes on to the one warm elsewhere: a slot is not left idle.
        cold.waits(1, false, Some(slot));
        assert_eq!(handed_node(&warm_elsewhere), Some(0));
    }

    #[test]
    fn a_declined_slot_goes_on_to_each_waiter_once() {
        let w = Wakeups::default();
        let n = node(0);
        let (a, b) = (listen(&w, "m"), listen(&w, "m"));
        let (_for_a, for_b) = (a.news(&w), b.news(&w));
        tokio::pin!(for_b);
        w.slot_freed("m", &n);
        // a decides to wait for another node: b is offered the slot.
        a.waits(1, true, a.take_handoff());
        assert!(for_b.as_mut().now_or_never().is_some());
        // b declines too: a was offered it already, so it goes nowhere.
        b.waits(1, true, b.take_handoff());
        assert!(a.take_handoff().is_none() && b.take_handoff().is_none());
    }

    #[test]
    fn a_request_sent_elsewhere_or_gone_passes_the_slot_on() {
        let w = Wakeups::default();
        let n = node(0);
        let [a, b, c] = looking::<3>(&w);
        w.slot_freed("m", &n);
        // a went to node 1: b gets the slot on node 0.
        let declined = a.take_handoff().expect("a's");
        // What `corral_handoffs_total` tells taken from declined by.
        assert!(declined.is_on(0) && !declined.is_on(1));
        a.sent(1, Some(declined));
        let handoff = b.take_handoff().expect("passed on to b");
        // b takes it: nothing goes further.
        b.sent(0, Some(handoff));
        assert!(c.take_handoff().is_none());
        // A slot handed to a request that leaves without looking at it goes on.
        w.slot_freed("m", &n);
        let [d] = looking::<1>(&w);
        drop(c);
        assert!(d.take_handoff().is_some(), "c had it and left: d gets it");
    }

    #[test]
    fn a_slot_handed_to_one_waiter_is_left_to_it_by_the_others() {
        let w = Wakeups::default();
        let n = node(0);
        let [old, young] = looking::<2>(&w);
        w.slot_freed("m", &n);
        assert!(young.leaves_to_others(&n), "the slot is the oldest's");
        assert!(!old.leaves_to_others(&n), "its own");
        let handoff = old.take_handoff();
        old.sent(0, handoff);
        // Another free slot, not handed to anyone yet, is anyone's to take.
        assert!(!young.leaves_to_others(&n));
    }

    #[test]
    fn a_slot_is_not_handed_on_once_taken_by_another_request() {
        let w = Wakeups::default();
        let n = node(0);
        let [a, b] = looking::<2>(&w);
        w.slot_freed("m", &n);
        // Another request took the node's only slot meanwhile.
        n.books(|books| books.models.entry_ref("m").or_default().in_flight = 1);
        a.waits(0, false, a.take_handoff());
        assert!(b.take_handoff().is_none(), "no room: nothing to hand on");
    }

    fn of(w: &Wakeups, client: &str, priority: Priority) -> Listener {
        let requester = Requester {
            client: client.into(),
            priority,
        };
        let l = w.listen("m", requester);
        drop(l.news(w));
        l
    }

    #[test]
    fn a_freed_slot_goes_to_the_client_that_has_had_less() {
        let w = Wakeups::default();
        let n = node(0);
        // The agent has a request running; both wait, the agent's longer.
        let running = of(&w, "agent", Priority::Interactive);
        running.sent(1, None);
        let agent = of(&w, "agent", Priority::Interactive);
        let person = of(&w, "person", Priority::Interactive);
        w.slot_freed("m", &n);
        let _held = person.take_handoff().expect("the person's");
        assert!(agent.take_handoff().is_none());
    }

    #[test]
    fn a_freed_slot_goes_to_interactive_clients_before_batch() {
        let w = Wakeups::default();
        let n = node(0);
        let batch = of(&w, "jobs", Priority::Batch);
        let interactive = of(&w, "chat", Priority::Interactive);
        // The interactive client has had more: its class still goes first.
        let running = of(&w, "chat", Priority::Interactive);
        running.sent(1, None);
        w.slot_freed("m", &n);
        let _held = interactive
            .take_handoff()
            .expect("the interactive client's");
        assert!(batch.take_handoff().is_none());
    }

    #[test]
    fn warm_goes_first_within_a_client_not_across_clients() {
        let w = Wakeups::default();
        let n = node(0);
        let running = [0, 1].map(|_| of(&w, "agent", Priority::Interactive));
        running.iter().for_each(|r| r.sent(1, None));
        let agent_warm = of(&w, "agent", Priority::Interactive);
        agent_warm.waits(0, true, None);
        let person_cold = of(&w, "person", Priority::Interactive);
        let person_warm = of(&w, "person", Priority::Interactive);
        person_warm.waits(0, true, None);
        w.slot_freed("m", &n);
        let held = person_warm.take_handoff().expect("the person's, and warm");
        assert!(agent_warm.take_handoff().is_none() && person_cold.take_handoff().is_none());
        person_warm.sent(0, Some(held));
        // A cold request leaves a slot to a warm one of its own client, not of one that has
        // had more.
        let person_warm2 = of(&w, "person", Priority::Interactive);
        person_warm2.waits(0, true, None);
        assert!(
            person_cold.warm_waiter_first(0),
            "its own client's warm turn"
        );
        drop(person_warm2);
        assert!(
            !person_cold.warm_waiter_first(0),
            "only the agent's is left"
        );
        assert!(!agent_warm.warm_waiter_first(0), "not itself");
    }

    #[test]
    fn only_waiters_first_in_the_fair_order_count_as_ahead() {
        let w = Wakeups::default();
        let running = of(&w, "agent", Priority::Interactive);
        running.sent(1, None);
        let agents = [0, 1, 2].map(|_| of(&w, "agent", Priority::Interactive));
        agents.iter().for_each(|a| a.waits(0, false, None));
        let person = of(&w, "person", Priority::Interactive);
        person.waits(0, false, None);
        // The agent has a request running: none of its waiters goes before the person.
        assert_eq!(person.waiting_ahead(), []);
        // Each agent request waits behind the person and its own client's older ones.
        assert_eq!(agents[0].waiting_ahead(), [(0, 1)]);
        assert_eq!(agents[2].waiting_ahead(), [(0, 3)]);
        // And behind a younger one warm there, to which a slot freed there goes first.
        let agent_warm = of(&w, "agent", Priority::Interactive);
        agent_warm.waits(0, true, None);
        assert_eq!(agents[0].waiting_ahead(), [(0, 2)]);
        assert_eq!(agent_warm.waiting_ahead(), [(0, 1)], "only the person");
        let batch = of(&w, "jobs", Priority::Batch);
        batch.waits(1, false, None);
        assert_eq!(batch.waiting_ahead(), [(0, 5)], "every interactive waiter");
        assert_eq!(person.waiting_ahead(), []);
    }

    #[test]
    fn a_waiter_handed_a_slot_elsewhere_trades_it_for_one_where_it_waits() {
        let w = Wakeups::default();
        let (a, b) = (node(0), node(1));
        let [first, second] = looking::<2>(&w);
        first.waits(1, true, None);
        // A slot frees on node 0 and then one on node 1, before `first` looked at the first.
        w.slot_freed("m", &a);
        w.slot_freed("m", &b);
        let handoff = first.take_handoff().expect("a slot for first");
        assert_eq!(
            handoff.offer.as_ref().map(|o| o.node.id),
            Some(1),
            "where it waits"
        );
        assert_eq!(handed_node(&second), Some(0), "the other goes on");
    }
}
