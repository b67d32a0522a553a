//! The store's keys and the scripts that keep the slot leases: one sorted set per node and
//! model, of the requests that hold its slots (`replica:run`), scored by when each lease
//! expires. Taking a lease is one script, so two replicas can never both take a node's last
//! slot; a replica renews its leases every beat, so those of one that died expire.

use redis::Script;

/// The names under a key prefix.
#[derive(Clone, Debug)]
pub struct Keys {
    prefix: String,
}

impl Keys {
    pub fn new(prefix: &str) -> Keys {
        Keys {
            prefix: prefix.to_string(),
        }
    }

    /// The channel every replica publishes its events on and listens to.
    pub fn events(&self) -> String {
        format!("{}:events", self.prefix)
    }

    /// The leases of a node's slots for a model.
    pub fn slots(&self, node: &str, model: &str) -> String {
        format!("{}:slots:{node}:{model}", self.prefix)
    }

    /// The requests waiting for a node's slot of a model.
    pub fn waiters(&self, node: &str, model: &str) -> WaiterKeys {
        let base = format!("{}:waiters:{node}:{model}", self.prefix);
        WaiterKeys {
            rank: format!("{base}:rank"),
            until: format!("{base}:until"),
            client: format!("{base}:client"),
        }
    }

    /// Where each client stands in the fair order between clients, as a replica last put it:
    /// client -> rank (lower first).
    pub fn ranks(&self) -> String {
        format!("{}:ranks", self.prefix)
    }

    /// What replies taught about a node.
    pub fn facts(&self, node: &str) -> String {
        format!("{}:facts:{node}", self.prefix)
    }
}

/// The member naming one request's lease.
pub fn member(replica: u64, run: u64) -> String {
    format!("{}{run}", member_prefix(replica))
}

/// The keys of one node's waiters for one model: each waiting request by rank (lower goes
/// first), by when its entry expires unless renewed, and its client.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WaiterKeys {
    pub rank: String,
    pub until: String,
    pub client: String,
}

/// The member naming one waiting request; it never names a lease.
pub fn waiter(replica: u64, request: u64) -> String {
    format!("{}w{request}", member_prefix(replica))
}

/// What every member of one replica's leases starts with.
pub fn member_prefix(replica: u64) -> String {
    format!("{replica:016x}:")
}

/// The replica and run a lease's member names; `None` for one corral did not write.
pub fn parse_member(member: &str) -> Option<(u64, u64)> {
    let (replica, run) = member.split_once(':')?;
    Some((u64::from_str_radix(replica, 16).ok()?, run.parse().ok()?))
}

/// KEYS: the leases, then the waiters' ranks, deadlines and clients ([`WaiterKeys`]), then
/// the clients' ranks ([`Keys::ranks`]). ARGV:
/// member, limit, lease in ms, the replica's member prefix, the waiting request, its rank,
/// its client, how long its entry lasts in ms, then the replica's members that may hold a
/// lease there.
///
/// Drops expired leases and waiters, and the replica's own leases that it gave back since (a
/// release still on its way must not turn away the request the freed slot was handed to).
/// Grants a lease when a slot is free and fewer requests of other clients that rank before
/// this one wait than slots are free, so that a slot goes to the client first in the fair
/// order whichever replica its request waits in (among one client's requests, each replica's
/// own order stands); else enters the request among the waiters, or updates its rank. A
/// waiter ranks by where its client stands now (the clients' ranks, which every call
/// refreshes for its own client), not where it stood when it was entered: a request waiting
/// long would otherwise rank before a client that had less service since. Replies
/// `granted`, or `full` followed by the holders. The store's clock scores the leases and the
/// waiters, so the replicas' clocks need not agree.
const ACQUIRE: &str = r"
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local waiter, rank, client, ttl = ARGV[5], ARGV[6], ARGV[7], ARGV[8]
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
for _, gone in ipairs(redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now)) do
  redis.call('ZREM', KEYS[2], gone)
  redis.call('HDEL', KEYS[4], gone)
end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
local own, live = ARGV[4], {}
for i = 9, #ARGV do live[ARGV[i]] = true end
for _, holder in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if string.sub(holder, 1, #own) == own and not live[holder] then
    redis.call('ZREM', KEYS[1], holder)
  end
end
if client ~= '' then
  redis.call('HSET', KEYS[5], client, rank)
  redis.call('PEXPIRE', KEYS[5], ARGV[3])
end
local holders = redis.call('ZRANGE', KEYS[1], 0, -1)
local free = tonumber(ARGV[2]) - #holders
if free > 0 then
  local ahead = 0
  local waiting = redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES')
  for i = 1, #waiting, 2 do
    local other = waiting[i]
    local whose = redis.call('HGET', KEYS[4], other)
    if other ~= waiter and whose ~= client then
      local now_rank = whose and tonumber(redis.call('HGET', KEYS[5], whose))
      if (now_rank or tonumber(waiting[i + 1])) < tonumber(rank) then
        ahead = ahead + 1
      end
    end
  end
  if ahead < free then
    redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
    redis.call('PEXPIRE', KEYS[1], ARGV[3])
    redis.call('ZREM', KEYS[2], waiter)
    redis.call('ZREM', KEYS[3], waiter)
    redis.call('HDEL', KEYS[4], waiter)
    return {'granted'}
  end
end
redis.call('ZADD', KEYS[2], rank, waiter)
redis.call('ZADD', KEYS[3], now + tonumber(ttl), waiter)
redis.call('HSET', KEYS[4], waiter, client)
for i = 2, 4 do redis.call('PEXPIRE', KEYS[i], ttl) end
table.insert(holders, 1, 'full')
return holders
";

/// KEYS: the waiters' ranks, deadlines and clients, then the clients' ranks; ARGV: the waiting
/// request, its rank, its client, how long its entry lasts in ms. Enters the request among the
/// waiters for a node's slot, or updates its rank, and its client's. Sent with EVAL (in a
/// pipeline, and small): it needs no loading.
pub const ENTER: &str = r"
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[4]), ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
for i = 1, 3 do redis.call('PEXPIRE', KEYS[i], ARGV[4]) end
if ARGV[3] ~= '' then
  redis.call('HSET', KEYS[4], ARGV[3], ARGV[2])
  redis.call('PEXPIRE', KEYS[4], ARGV[4])
end
return 1
";

/// KEYS: lease sets; `ARGV[1]` lease in ms, then one member per key. Pushes back the expiry of
/// leases still held (`XX`: a lease already expired and dropped is not taken again).
const RENEW: &str = r"
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local lease = tonumber(ARGV[1])
for i, key in ipairs(KEYS) do
  redis.call('ZADD', key, 'XX', now + lease, ARGV[i + 1])
  redis.call('PEXPIRE', key, lease)
end
return #KEYS
";

pub struct Scripts {
    pub acquire: Script,
    pub renew: Script,
}

impl Default for Scripts {
    fn default() -> Self {
        Scripts {
            acquire: Script::new(ACQUIRE),
            renew: Script::new(RENEW),
        }
    }
}

/// What the acquire script replied.
#[derive(Debug, PartialEq, Eq)]
pub enum Reply {
    Granted,
    /// Every slot is held: by these (replica, run).
    Full(Vec<(u64, u64)>),
}

impl Reply {
    pub fn parse(reply: &[String]) -> Option<Reply> {
        match reply.split_first()? {
            (first, []) if first == "granted" => Some(Reply::Granted),
            (first, holders) if first == "full" => Some(Reply::Full(
                holders.iter().filter_map(|m| parse_member(m)).collect(),
            )),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_name_replica_and_run() {
        let m = member(0xabc, 42);
        assert_eq!(m, "0000000000000abc:42");
        assert_eq!(parse_member(&m), Some((0xabc, 42)));
        assert_eq!(parse_member("someone-else"), None);
    }

    #[test]
    fn replies_parse() {
        let s = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(Reply::parse(&s(&["granted"])), Some(Reply::Granted));
        let full = Reply::parse(&s(&["full", &member(1, 2), "junk"]));
        assert_eq!(full, Some(Reply::Full(vec![(1, 2)])));
        assert_eq!(Reply::parse(&s(&[])), None);
        assert_eq!(Reply::parse(&s(&["granted", "x"])), None);
    }

    #[test]
    fn keys_sit_under_the_prefix() {
        let keys = Keys::new("lab");
        assert_eq!(keys.slots("gpu", "llama3:8b"), "lab:slots:gpu:llama3:8b");
        assert_eq!(keys.events(), "lab:events");
        assert_eq!(keys.facts("gpu"), "lab:facts:gpu");
    }

    /// One call of the acquire script for a node of one slot: (replica, run) takes a lease,
    /// else its request `waiter` waits with `rank` for `client`.
    async fn acquire(
        conn: &mut redis::aio::MultiplexedConnection,
        (replica, run): (u64, u64),
        waiter: u64,
        rank: f64,
        client: &str,
    ) -> Reply {
        let keys = Keys::new("t");
        let waiters = keys.waiters("n0", "m");
        let scripts = Scripts::default();
        let mut call = scripts.acquire.key(keys.slots("n0", "m"));
        (call.key(&waiters.rank).key(&waiters.until))
            .key(&waiters.client)
            .key(keys.ranks());
        call.arg(member(replica, run)).arg(1).arg(10_000);
        call.arg(member_prefix(replica))
            .arg(super::waiter(replica, waiter));
        call.arg(rank)
            .arg(client)
            .arg(10_000)
            .arg(member(replica, run));
        let reply: Vec<String> = call.invoke_async(conn).await.expect("the script runs");
        Reply::parse(&reply).expect("a reply the script gives")
    }

    /// `client` stands at `rank`, as another call of one of its requests wrote it.
    async fn stands(conn: &mut redis::aio::MultiplexedConnection, client: &str, rank: f64) {
        let ranks = Keys::new("t").ranks();
        let written: redis::RedisResult<()> = redis::cmd("HSET")
            .arg(ranks)
            .arg(client)
            .arg(rank)
            .query_async(conn)
            .await;
        written.expect("HSET");
    }

    /// The lease `member` is given back.
    async fn give_back(conn: &mut redis::aio::MultiplexedConnection, member: String) {
        let slots = Keys::new("t").slots("n0", "m");
        let removed: redis::RedisResult<()> = redis::cmd("ZREM")
            .arg(slots)
            .arg(member)
            .query_async(conn)
            .await;
        removed.expect("ZREM");
    }

    // A real redis-server runs the script: it comes with the stand-ins (the `demo` feature).
    #[cfg(feature = "demo")]
    #[tokio::test]
    async fn a_waiter_ranks_by_where_its_client_stands_now_not_when_it_was_entered() {
        let server = crate::standin::RedisServer::start()
            .await
            .expect("redis-server");
        let client = redis::Client::open(server.url()).expect("a url");
        let mut conn = client
            .get_multiplexed_async_connection()
            .await
            .expect("connects");
        // Replica 3's filler holds the one slot; replica 1's agent request waits, entered when
        // the agent stood at 1.0.
        assert_eq!(
            acquire(&mut conn, (3, 1), 1, 0.0, "key:filler").await,
            Reply::Granted
        );
        let agent = acquire(&mut conn, (1, 1), 1, 1.0, "key:agent").await;
        assert_eq!(agent, Reply::Full(vec![(3, 1)]));
        // The agent's service grows meanwhile: its next call elsewhere says it stands at 10.
        stands(&mut conn, "key:agent", 10.0).await;
        give_back(&mut conn, member(3, 1)).await;
        // Replica 2: a person standing at 5 goes before the agent, who has had more since.
        let person = acquire(&mut conn, (2, 1), 1, 5.0, "key:person").await;
        assert_eq!(person, Reply::Granted);

        // And where the agent still stands before the person, the person waits.
        give_back(&mut conn, member(2, 1)).await;
        stands(&mut conn, "key:agent", 3.0).await;
        let person = acquire(&mut conn, (2, 2), 2, 5.0, "key:person").await;
        assert_eq!(person, Reply::Full(vec![]));
    }
}
