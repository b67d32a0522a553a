//! Fair shares of the fleet's slots between clients: which waiting client a freed slot goes
//! to.
//!
//! Start-time fair queueing over slot time: each client has a virtual time, the service it
//! has been given in seconds of a slot. A request that starts charges its client an estimate
//! (the client's recent mean, else the fleet's) and its end settles the charge to the time it
//! really held the slot, so that a burst of one client's requests moves its virtual time at
//! once rather than when they end. A client that becomes active again starts no lower than
//! the least virtual time among the clients active now: time idle is not saved up to spend
//! later in a burst. A freed slot goes to the waiting client with the least virtual time, and
//! the `interactive` class before `batch`.
//!
//! Slot time, not tokens, is what clients share: a slot held by one conversation is held
//! whether it evaluates a prompt or decodes, and a decoded token costs a slot tens of times
//! a prompt token's time.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hashbrown::HashMap;
use parking_lot::Mutex;

/// Clients remembered while idle, at most; past it the idle ones are forgotten (they come
/// back at the least virtual time of the active ones, as a new client does).
const REMEMBERED: usize = 65_536;

/// Weight of the newest request in a client's mean slot time.
const MEAN_WEIGHT: f64 = 0.2;

/// Who shares the fleet's slots: a named API key, else the client's address.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub enum ClientId {
    Key(Arc<str>),
    Address(IpAddr),
    /// Neither (a client on a Unix socket).
    #[default]
    Unknown,
}

impl From<&str> for ClientId {
    /// The named key `name`.
    fn from(name: &str) -> ClientId {
        ClientId::Key(name.into())
    }
}

impl ClientId {
    /// How other replicas name it (`shared_state:`): `key:NAME` or `addr:IP`.
    pub fn wire(&self) -> Option<String> {
        match self {
            ClientId::Key(name) => Some(format!("key:{name}")),
            ClientId::Address(ip) => Some(format!("addr:{ip}")),
            ClientId::Unknown => None,
        }
    }

    /// The client another replica named with [`ClientId::wire`].
    pub fn from_wire(text: &str) -> Option<ClientId> {
        match text.split_once(':')? {
            ("key", name) => Some(ClientId::Key(name.into())),
            ("addr", ip) => ip.parse().ok().map(ClientId::Address),
            _ => None,
        }
    }
}

#[derive(Default)]
pub struct FairShare {
    book: Mutex<Book>,
}

#[derive(Default)]
struct Book {
    clients: HashMap<ClientId, Account>,
    /// The least virtual time among active clients when one was last active: where a client
    /// starts when it becomes active again while no other is.
    floor: f64,
    /// The fleet's mean slot time per request, for a client with none measured yet.
    typical: Option<f64>,
}

#[derive(Default)]
struct Account {
    /// Service given, in slot seconds, on the shared virtual clock.
    used: f64,
    /// Requests looking for a slot or running.
    active: u32,
    /// Requests running now.
    running: u32,
    /// Mean slot seconds per request.
    mean: Option<f64>,
}

/// Where a client stands in the fair order: lower goes first.
#[derive(Clone, Copy, Debug)]
pub struct Standing {
    /// Virtual time: service given so far.
    pub used: f64,
    /// Requests running now: among equal virtual times, the client with fewer goes first.
    pub running: u32,
}

impl Ord for Standing {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.used.total_cmp(&other.used)).then(self.running.cmp(&other.running))
    }
}

impl PartialOrd for Standing {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Standing {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other).is_eq()
    }
}

impl Eq for Standing {}

/// A request's membership in its client's account, from arrival to end. Dropping it ends
/// the request's part; [`Member::start`] charges a slot's use.
pub struct Member {
    share: Arc<FairShare>,
    client: ClientId,
    /// The estimate charged when the request started, and when, until settled. Locked:
    /// a waiting request lends its listener out while it waits for news.
    charged: Mutex<Option<(f64, Instant)>>,
}

impl FairShare {
    /// A request of `client` arrives: the client is active until every such member drops.
    pub fn join(self: &Arc<Self>, client: ClientId) -> Member {
        let mut book = self.book.lock();
        let floor = book.active_floor().unwrap_or(book.floor);
        if book.clients.len() >= REMEMBERED {
            book.clients.retain(|_, a| a.active > 0);
        }
        let account = book.clients.entry(client.clone()).or_default();
        if account.active == 0 {
            account.used = account.used.max(floor);
        }
        account.active += 1;
        drop(book);
        Member {
            share: self.clone(),
            client,
            charged: Mutex::new(None),
        }
    }

    /// Another replica's request of `client` started (`shared_state:`): the client is charged
    /// the estimate of one request's slot time, as [`Member::start`] charges one of this
    /// replica's, so that every replica's fair order counts what it has from all of them.
    /// Returns the estimate, for [`FairShare::charge`] to settle.
    pub fn charge_start(&self, client: &ClientId) -> f64 {
        let mut book = self.book.lock();
        let typical = book.typical.unwrap_or(0.0);
        let account = book.account(client.clone());
        let estimate = account.mean.unwrap_or(typical);
        account.used += estimate;
        estimate
    }

    /// Another replica's request of `client` ended (`shared_state:`): its service had grows
    /// by `seconds`, the slot time it held less what its start was charged (which may be
    /// less than nothing).
    pub fn charge(&self, client: ClientId, seconds: f64) {
        self.book.lock().account(client).used += seconds;
    }

    /// Where `client` stands now; a client not active stands where it would start.
    #[cfg(test)]
    pub fn standing(&self, client: &ClientId) -> Standing {
        self.book.lock().standing(client)
    }

    /// Runs `f` with where each client stands, all read at one instant.
    pub fn standings<R>(&self, f: impl FnOnce(&dyn Fn(&ClientId) -> Standing) -> R) -> R {
        let book = self.book.lock();
        f(&|client| book.standing(client))
    }
}

impl Book {
    /// `client`'s account, which starts where a client becoming active starts when it is
    /// not active here.
    fn account(&mut self, client: ClientId) -> &mut Account {
        let floor = self.active_floor().unwrap_or(self.floor);
        if self.clients.len() >= REMEMBERED {
            self.clients.retain(|_, a| a.active > 0);
        }
        let account = self.clients.entry(client).or_default();
        if account.active == 0 {
            account.used = account.used.max(floor);
        }
        account
    }

    fn standing(&self, client: &ClientId) -> Standing {
        match self.clients.get(client) {
            Some(a) if a.active > 0 => Standing {
                used: a.used,
                running: a.running,
            },
            other => Standing {
                used: (self.active_floor().unwrap_or(self.floor))
                    .max(other.map_or(0.0, |a| a.used)),
                running: 0,
            },
        }
    }

    fn active_floor(&self) -> Option<f64> {
        self.clients
            .values()
            .filter(|a| a.active > 0)
            .map(|a| a.used)
            .min_by(f64::total_cmp)
    }
}

impl Member {
    /// The request was sent to a node: its client is charged the estimate of one request's
    /// slot time until [`Member::settle`] (or the drop) charges what it took.
    pub fn start(&self) {
        let mut book = self.share.book.lock();
        let typical = book.typical.unwrap_or(0.0);
        if let Some(account) = book.clients.get_mut(&self.client) {
            let estimate = account.mean.unwrap_or(typical);
            account.used += estimate;
            account.running += 1;
            *self.charged.lock() = Some((estimate, Instant::now()));
        }
    }

    /// The request's attempt on a node ended: the charge becomes the time it held the slot.
    pub fn settle(&self) {
        let since = self.charged.lock().map(|(_, since)| since);
        if let Some(since) = since {
            self.settle_held(since.elapsed());
        }
    }

    fn settle_held(&self, held: Duration) {
        let Some((estimate, _)) = self.charged.lock().take() else {
            return;
        };
        let held = held.as_secs_f64();
        let mut book = self.share.book.lock();
        let typical = book.typical.map_or(held, |t| mean(t, held));
        book.typical = Some(typical);
        if let Some(account) = book.clients.get_mut(&self.client) {
            account.used += held - estimate;
            account.running = account.running.saturating_sub(1);
            account.mean = Some(account.mean.map_or(held, |m| mean(m, held)));
        }
    }
}

fn mean(old: f64, new: f64) -> f64 {
    old + MEAN_WEIGHT * (new - old)
}

impl Drop for Member {
    fn drop(&mut self) {
        self.settle();
        let mut book = self.share.book.lock();
        let floor = book.active_floor();
        if let Some(account) = book.clients.get_mut(&self.client) {
            account.active = account.active.saturating_sub(1);
        }
        if let Some(floor) = floor {
            book.floor = floor;
        }
        // Forget an idle client that is owed nothing and owes nothing: it would come back at
        // the floor anyway.
        let floor = book.active_floor().unwrap_or(book.floor);
        if let Some(account) = book.clients.get(&self.client)
            && account.active == 0
            && account.used <= floor
        {
            book.clients.remove(&self.client);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn share() -> Arc<FairShare> {
        Arc::new(FairShare::default())
    }

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    #[test]
    fn a_client_that_used_less_stands_first() {
        let s = share();
        let agent = s.join("agent".into());
        let person = s.join("person".into());
        agent.start();
        agent.settle_held(secs(3.0));
        assert!(s.standing(&"person".into()) < s.standing(&"agent".into()));
        drop(person);
    }

    #[test]
    fn a_started_request_is_charged_at_once_and_settled_to_what_it_took() {
        let s = share();
        let first = s.join("a".into());
        first.start();
        first.settle_held(secs(2.0));
        // The next one is charged the client's mean (2 s) while it runs...
        let second = s.join("a".into());
        second.start();
        assert_eq!(s.standing(&"a".into()).used, 4.0);
        assert_eq!(s.standing(&"a".into()).running, 1);
        // ...and settled to the 1 s it took.
        second.settle_held(secs(1.0));
        assert_eq!(s.standing(&"a".into()).used, 3.0);
        assert_eq!(s.standing(&"a".into()).running, 0);
        drop(first);
    }

    #[test]
    fn a_new_client_is_charged_the_fleets_typical_request() {
        let s = share();
        let a = s.join("a".into());
        a.start();
        a.settle_held(secs(2.0));
        let b = s.join("b".into());
        b.start();
        assert_eq!(
            s.standing(&"b".into()).used,
            2.0 + 2.0,
            "joined at the floor, charged 2 s"
        );
        drop(a);
    }

    #[test]
    fn among_equal_virtual_times_the_client_running_fewer_goes_first() {
        let s = share();
        let (agent, person) = (s.join("agent".into()), s.join("person".into()));
        // Nothing measured: no estimate to charge, but the running request counts.
        agent.start();
        assert!(s.standing(&"person".into()) < s.standing(&"agent".into()));
        drop(person);
    }

    #[test]
    fn time_idle_is_not_saved_up_for_a_burst() {
        let s = share();
        let agent = s.join("agent".into());
        {
            let person = s.join("person".into());
            person.start();
            person.settle_held(secs(1.0));
        }
        // The agent alone uses 100 s of slots while the person is away.
        for _ in 0..50 {
            let m = s.join("agent".into());
            m.start();
            m.settle_held(secs(2.0));
        }
        let agent_used = s.standing(&"agent".into()).used;
        // The person comes back no lower than the agent: it gets its share from now on,
        // not 100 s of slots in a row.
        let _person = s.join("person".into());
        assert_eq!(s.standing(&"person".into()).used, agent_used);
        drop(agent);
    }

    #[test]
    fn an_idle_client_owed_nothing_is_forgotten() {
        let s = share();
        let keep = s.join("busy".into());
        drop(s.join("visitor".into()));
        assert!(
            !s.book
                .lock()
                .clients
                .contains_key(&ClientId::from("visitor"))
        );
        drop(keep);
    }

    #[test]
    fn service_another_replica_gave_counts_here() {
        let s = share();
        let (agent, person) = (s.join("agent".into()), s.join("person".into()));
        s.charge("agent".into(), 5.0);
        assert_eq!(s.standing(&"agent".into()).used, 5.0);
        assert!(s.standing(&"person".into()) < s.standing(&"agent".into()));
        drop((agent, person));
        // A client not active here is charged from where it would start.
        let busy = s.join("busy".into());
        busy.start();
        busy.settle_held(secs(3.0));
        s.charge("elsewhere".into(), 1.0);
        assert_eq!(s.standing(&"elsewhere".into()).used, 3.0 + 1.0);
        drop(busy);
    }

    #[test]
    fn a_request_another_replica_started_counts_from_its_start_as_it_does_there() {
        // Two replicas' books, which have seen the same requests end.
        let (here, there) = (share(), share());
        let mut active = Vec::new();
        for s in [&here, &there] {
            let (agent, person) = (s.join("agent".into()), s.join("person".into()));
            agent.start();
            agent.settle_held(secs(2.0));
            active.extend([agent, person]);
        }
        // The agent starts a request there; here it is heard of.
        let started = there.join("agent".into());
        started.start();
        let estimate = here.charge_start(&"agent".into());
        let agent = ClientId::from("agent");
        assert_eq!(here.standing(&agent).used, there.standing(&agent).used);
        // It held its slot 3 s: both settle to the same service had.
        started.settle_held(secs(3.0));
        here.charge(agent.clone(), 3.0 - estimate);
        assert_eq!(here.standing(&agent).used, there.standing(&agent).used);
        assert_eq!(here.standing(&agent).used, 2.0 + 3.0);
        drop(active);
    }

    #[test]
    fn clients_keep_their_name_between_replicas() {
        let ip: std::net::IpAddr = "10.0.0.7".parse().unwrap();
        for client in [ClientId::from("team-a"), ClientId::Address(ip)] {
            let wire = client.wire().unwrap();
            assert_eq!(ClientId::from_wire(&wire), Some(client));
        }
        assert_eq!(ClientId::Unknown.wire(), None);
        assert_eq!(ClientId::from_wire("addr:not-an-ip"), None);
        assert_eq!(ClientId::from_wire("team-a"), None);
    }

    #[test]
    fn a_request_dropped_while_running_gives_its_slot_back() {
        let s = share();
        let keep = s.join("a".into());
        let m = s.join("a".into());
        m.start();
        drop(m);
        assert_eq!(s.standing(&"a".into()).running, 0);
        drop(keep);
    }
}
