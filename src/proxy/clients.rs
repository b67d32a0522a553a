//! Who sent a request, and what that client may still send: its name for usage, its place in
//! the fair order between clients, and its limits (requests in flight or waiting, tokens per
//! minute, per named key; requests per address, `queue.per_client`).

use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hashbrown::HashMap;
use ipnet::IpNet;
use parking_lot::Mutex;
use pingora_http::RequestHeader;

use super::access::client_key;
use crate::config::{ANONYMOUS, ApiKey, Config, Priority};
use crate::fleet::{ClientId, Requester};

/// Who sent a request.
#[derive(Default)]
pub struct Client {
    /// The `api_keys` name, or `anonymous`: the label of its usage, refusals and waits.
    pub name: String,
    /// Its place among the clients sharing the fleet: a named key, else its address.
    pub requester: Requester,
    /// Where it connected from: the connection's peer, or, through a trusted proxy, the
    /// address the proxy forwarded for ([`address`]).
    pub address: Option<IpAddr>,
    /// The named key's limits, if any.
    limits: Limits,
}

#[derive(Clone, Copy, Default)]
struct Limits {
    max_requests: Option<usize>,
    tokens_per_minute: Option<u64>,
}

impl Client {
    /// The client's name as metrics label it: `anonymous` when it has none.
    pub fn label(&self) -> &str {
        match self.name.is_empty() {
            true => ANONYMOUS,
            false => &self.name,
        }
    }
}

/// Why a client's request is refused before it is read.
#[derive(Debug, PartialEq)]
pub enum Refusal {
    /// The address has `queue.per_client` requests in flight or waiting.
    Address(usize),
    /// The key has its `max_requests` in flight or waiting.
    Requests(usize),
    /// The key spent its `tokens_per_minute`; enough is back after this long.
    Tokens(Duration),
}

impl Refusal {
    /// The `reason` label of `corral_client_refused_total`.
    pub fn reason(&self) -> &'static str {
        match self {
            Refusal::Address(_) => "per_client",
            Refusal::Requests(_) => "max_requests",
            Refusal::Tokens(_) => "tokens_per_minute",
        }
    }

    /// When to try again, whole seconds (`Retry-After`).
    pub fn retry_after(&self) -> u64 {
        match self {
            Refusal::Tokens(wait) => wait.as_secs_f64().ceil().max(1.0) as u64,
            _ => 1,
        }
    }

    pub fn message(&self) -> String {
        match self {
            Refusal::Address(n) => {
                format!("this client already has {n} requests in flight or waiting")
            }
            Refusal::Requests(n) => {
                format!("this API key already has {n} requests in flight or waiting")
            }
            Refusal::Tokens(_) => "this API key has used its tokens per minute".to_string(),
        }
    }
}

/// The address of the client that sent `req` over a connection from `peer`: the peer itself,
/// unless it is one of `trusted` proxies; then the nearest address in `X-Forwarded-For` that
/// is not (each proxy appends the address it was reached from), or the farthest one there when
/// every one is trusted. A malformed entry ends the walk: what lies before it cannot be told.
pub fn address(peer: Option<IpAddr>, req: &RequestHeader, trusted: &[IpNet]) -> Option<IpAddr> {
    let is_trusted = |ip: &IpAddr| trusted.iter().any(|net| net.contains(ip));
    let mut client = peer?;
    if !is_trusted(&client) {
        return Some(client);
    }
    let forwarded: Vec<&str> = (req.headers.get_all("x-forwarded-for").iter())
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .collect();
    for hop in forwarded.iter().rev() {
        let Ok(ip) = hop.parse::<IpAddr>() else {
            break;
        };
        client = ip;
        if !is_trusted(&ip) {
            break;
        }
    }
    Some(client)
}

/// Identifies the client of a request: its named key (checked once, in constant time per
/// key), else its address.
pub fn identify(config: &Config, req: &RequestHeader, address: Option<IpAddr>) -> Client {
    let key = match config.api_keys.is_empty() {
        // No key to find: spare every request the header lookups.
        true => None,
        false => client_key(config, req).and_then(ApiKey::named),
    };
    match key {
        Some(named) => Client {
            name: named.name.clone(),
            requester: Requester {
                client: ClientId::Key(named.name.as_str().into()),
                priority: named.priority,
            },
            address,
            limits: Limits {
                max_requests: named.max_requests,
                tokens_per_minute: named.tokens_per_minute,
            },
        },
        None => Client {
            name: ANONYMOUS.to_string(),
            requester: Requester {
                client: address.map_or(ClientId::Unknown, ClientId::Address),
                priority: Priority::Interactive,
            },
            address,
            limits: Limits::default(),
        },
    }
}

/// Requests in flight or waiting per address and per named key, and each key's tokens.
#[derive(Default)]
pub struct ClientBook {
    books: Mutex<Books>,
}

#[derive(Default)]
struct Books {
    per_address: HashMap<IpAddr, usize>,
    per_key: HashMap<String, KeyBook>,
}

#[derive(Default)]
struct KeyBook {
    requests: usize,
    tokens: Option<Bucket>,
}

/// Tokens a key may still spend: refilled evenly over the minute up to `tokens_per_minute`,
/// spent after each reply by what it measured. A reply larger than what is left leaves the
/// key in debt, which refusing its requests until it is repaid keeps to the rate.
struct Bucket {
    left: f64,
    at: Instant,
}

impl Bucket {
    fn refill(&mut self, per_minute: u64, now: Instant) {
        let rate = per_minute as f64 / 60.0;
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.left = (self.left + elapsed * rate).min(per_minute as f64);
        self.at = now;
    }

    /// How long until the key may send again, if it may not now.
    fn wait(&self, per_minute: u64) -> Option<Duration> {
        (self.left <= 0.0).then(|| {
            let rate = per_minute as f64 / 60.0;
            Duration::from_secs_f64((1.0 - self.left) / rate)
        })
    }
}

/// A request counted against its client's limits until dropped.
pub struct Admission {
    book: Arc<ClientBook>,
    address: Option<IpAddr>,
    key: Option<String>,
}

impl ClientBook {
    /// Counts the request against its client's limits, or says why it may not be sent.
    /// `per_address`: `queue.per_client`.
    pub fn admit(
        self: &Arc<Self>,
        client: &Client,
        per_address: Option<usize>,
    ) -> Result<Admission, Refusal> {
        // A named key is counted even without limits, so that one added by a reload holds
        // at once; a client without a key counts only against `queue.per_client`.
        let named = matches!(client.requester.client, ClientId::Key(_));
        let per_address = per_address.zip(client.address);
        if !named && per_address.is_none() {
            return Ok(Admission {
                book: self.clone(),
                address: None,
                key: None,
            });
        }
        let now = Instant::now();
        let mut books = self.books.lock();
        if let Some((limit, ip)) = per_address
            && books.per_address.get(&ip).is_some_and(|&n| n >= limit)
        {
            return Err(Refusal::Address(limit));
        }
        if named {
            let key = books.per_key.entry_ref(client.name.as_str()).or_default();
            if let Some(limit) = client.limits.max_requests
                && key.requests >= limit
            {
                return Err(Refusal::Requests(limit));
            }
            if let Some(per_minute) = client.limits.tokens_per_minute {
                let bucket = key.tokens.get_or_insert(Bucket {
                    left: per_minute as f64,
                    at: now,
                });
                bucket.refill(per_minute, now);
                if let Some(wait) = bucket.wait(per_minute) {
                    return Err(Refusal::Tokens(wait));
                }
            }
            key.requests += 1;
        }
        if let Some((_, ip)) = per_address {
            *books.per_address.entry(ip).or_default() += 1;
        }
        Ok(Admission {
            book: self.clone(),
            address: per_address.map(|(_, ip)| ip),
            key: named.then(|| client.name.clone()),
        })
    }

    /// A reply of the client's measured `tokens` worked on: spent from its key's tokens per
    /// minute, if it has such a limit.
    pub fn spend(&self, client: &Client, tokens: u64) {
        let Some(per_minute) = client.limits.tokens_per_minute else {
            return;
        };
        let now = Instant::now();
        let mut books = self.books.lock();
        let key = books.per_key.entry_ref(client.name.as_str()).or_default();
        let bucket = key.tokens.get_or_insert(Bucket {
            left: per_minute as f64,
            at: now,
        });
        bucket.refill(per_minute, now);
        bucket.left -= tokens as f64;
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        let mut books = self.book.books.lock();
        if let Some(ip) = self.address
            && let Some(count) = books.per_address.get_mut(&ip)
        {
            *count = count.saturating_sub(1);
            if *count == 0 {
                books.per_address.remove(&ip);
            }
        }
        if let Some(key) = &self.key
            && let Some(book) = books.per_key.get_mut(key.as_str())
        {
            book.requests = book.requests.saturating_sub(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(yaml: &str) -> Config {
        let config: Config = serde_yaml::from_str(yaml).unwrap();
        config.validate().unwrap();
        config
    }

    fn request(key: &str) -> RequestHeader {
        let mut r = RequestHeader::build("POST", b"/api/chat", None).unwrap();
        r.insert_header("authorization", format!("Bearer {key}"))
            .unwrap();
        r
    }

    const ADDRESS: Option<IpAddr> = Some(IpAddr::V4(std::net::Ipv4Addr::LOCALHOST));

    fn forwarded(hops: &[&str]) -> RequestHeader {
        let mut r = RequestHeader::build("POST", b"/api/chat", None).unwrap();
        for value in hops {
            r.append_header("x-forwarded-for", *value).unwrap();
        }
        r
    }

    #[test]
    fn behind_a_trusted_proxy_the_client_is_the_nearest_untrusted_forwarded_address() {
        let c = config("trusted_proxies: [10.0.0.0/8, 192.168.1.5]");
        let trusted = &c.trusted_proxies;
        let ip = |s: &str| Some(s.parse::<IpAddr>().unwrap());
        let balancer = ip("10.0.0.2");
        // A client spoofing an address before the real hop does not pass for it.
        let req = forwarded(&["1.2.3.4, 203.0.113.9", "192.168.1.5"]);
        assert_eq!(address(balancer, &req, trusted), ip("203.0.113.9"));
        // Every hop trusted: the farthest one.
        let req = forwarded(&["10.1.1.1, 192.168.1.5"]);
        assert_eq!(address(balancer, &req, trusted), ip("10.1.1.1"));
        // No header, or a peer that is no proxy: the peer.
        assert_eq!(address(balancer, &forwarded(&[]), trusted), balancer);
        let stranger = ip("203.0.113.50");
        let req = forwarded(&["1.2.3.4"]);
        assert_eq!(address(stranger, &req, trusted), stranger);
        assert_eq!(address(stranger, &req, &[]), stranger);
        // A malformed hop ends the walk at the last address read.
        let req = forwarded(&["203.0.113.9, garbage, 10.3.3.3"]);
        assert_eq!(address(balancer, &req, trusted), ip("10.3.3.3"));
        assert_eq!(address(None, &req, trusted), None);
    }

    #[test]
    fn trusted_proxies_must_be_addresses_or_networks() {
        let err = Config::from_yaml("trusted_proxies: [10.0.0.0/8, balancer]\n").unwrap_err();
        assert!(
            err.contains("trusted_proxies") && err.contains("'balancer' is not an address"),
            "{err}"
        );
    }

    #[test]
    fn a_named_key_is_its_own_client_and_others_go_by_address() {
        let c = config("api_keys: [plain, {name: agent, key: ka, priority: batch}]");
        let agent = identify(&c, &request("ka"), ADDRESS);
        assert_eq!(agent.name, "agent");
        assert_eq!(agent.requester.client, ClientId::from("agent"));
        assert_eq!(agent.requester.priority, Priority::Batch);
        let plain = identify(&c, &request("plain"), ADDRESS);
        assert_eq!(plain.name, "anonymous");
        assert_eq!(plain.requester.client, ClientId::Address(ADDRESS.unwrap()));
        assert_eq!(plain.requester.priority, Priority::Interactive);
        let open = identify(&Config::default(), &request("anything"), None);
        assert_eq!(open.requester.client, ClientId::Unknown);
    }

    #[test]
    fn a_key_at_its_requests_is_refused_until_one_ends() {
        let c = config("api_keys: [{name: a, key: ka, max_requests: 2}, {name: b, key: kb}]");
        let book = Arc::new(ClientBook::default());
        let a = identify(&c, &request("ka"), ADDRESS);
        let first = book.admit(&a, None).unwrap();
        let _second = book.admit(&a, None).unwrap();
        let refused = book.admit(&a, None).err().unwrap();
        assert_eq!(refused, Refusal::Requests(2));
        assert_eq!(refused.reason(), "max_requests");
        // Another key is not held back by it.
        let b = identify(&c, &request("kb"), ADDRESS);
        assert!(book.admit(&b, None).is_ok());
        drop(first);
        assert!(book.admit(&a, None).is_ok());
    }

    #[test]
    fn an_address_at_queue_per_client_is_refused() {
        let book = Arc::new(ClientBook::default());
        let anyone = identify(&Config::default(), &request("x"), ADDRESS);
        let _held = book.admit(&anyone, Some(1)).unwrap();
        let refused = book.admit(&anyone, Some(1)).err().unwrap();
        assert_eq!(refused, Refusal::Address(1));
        let nowhere = identify(&Config::default(), &request("x"), None);
        assert!(
            book.admit(&nowhere, Some(1)).is_ok(),
            "no address: no limit"
        );
    }

    #[test]
    fn a_key_that_spent_its_tokens_waits_for_them_to_come_back() {
        let c = config("api_keys: [{name: a, key: ka, tokens_per_minute: 600}]");
        let book = Arc::new(ClientBook::default());
        let a = identify(&c, &request("ka"), ADDRESS);
        drop(book.admit(&a, None).unwrap());
        // A reply of 900 tokens: 300 in debt, back at 10 tokens a second.
        book.spend(&a, 900);
        let Err(Refusal::Tokens(wait)) = book.admit(&a, None) else {
            panic!("refused for its tokens");
        };
        assert!(
            (29.0..=30.2).contains(&wait.as_secs_f64()),
            "about 30 s: {wait:?}"
        );
        assert_eq!(
            Refusal::Tokens(Duration::from_secs_f64(29.5)).retry_after(),
            30
        );
        // Without a limit, spending changes nothing.
        let open = identify(&Config::default(), &request("x"), ADDRESS);
        book.spend(&open, 1_000_000);
        assert!(book.admit(&open, None).is_ok());
    }

    #[test]
    fn tokens_come_back_at_the_rate_up_to_a_minutes_worth() {
        let mut bucket = Bucket {
            left: -60.0,
            at: Instant::now(),
        };
        let later = bucket.at + Duration::from_secs(3);
        bucket.refill(1200, later);
        assert!((bucket.left - 0.0).abs() < 1e-9, "{}", bucket.left);
        assert!(bucket.wait(1200).is_some(), "not yet above zero");
        bucket.refill(1200, later + Duration::from_secs(3600));
        assert_eq!(bucket.left, 1200.0);
        assert!(bucket.wait(1200).is_none());
    }
}
