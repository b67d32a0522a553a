//! The YAML configuration: the fleet, the scoring weights, timeouts and limits.
//!
//! One file serves both Pingora and corral: `corral -c conf/corral.yaml` hands the same file
//! to Pingora's own `ServerConf` (threads, grace periods, pid file...), and corral reads the
//! rest. corral rejects keys it does not know, so a typo fails at start with the key's name
//! instead of being silently ignored.

use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Pingora's own limit on a request head (`MAX_HEADER_SIZE` in pingora-core); corral reads
/// the head first and refuses anything larger, so its limit may not exceed this one.
pub const PINGORA_MAX_HEADER_BYTES: usize = 1_048_575;
/// A request line and `Host` fit; anything smaller would refuse ordinary clients.
const MIN_HEADER_BYTES: usize = 1024;

/// Everything corral reads from its configuration file.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Address the Ollama-compatible proxy listens on.
    pub listen: String,
    /// Address of the Prometheus scrape endpoint; none disables it.
    pub metrics_listen: Option<String>,
    /// Address of the admin API; none disables it. Loopback by default.
    pub admin_listen: Option<String>,
    /// When set, the admin API requires `Authorization: Bearer <admin_token>`.
    pub admin_token: Option<String>,
    /// The Ollama (or OpenAI-compatible) servers behind corral.
    pub nodes: Vec<NodeConfig>,
    pub weights: Weights,
    pub timeouts: Timeouts,
    pub limits: Limits,
    pub health: HealthConfig,
    pub poll: PollConfig,
    pub affinity: AffinityConfig,
    pub breaker: BreakerConfig,
    pub queue: QueueConfig,
    /// Several replicas share what they know through Redis or Valkey; unset, each keeps its
    /// own state in the process.
    pub shared_state: Option<SharedStateConfig>,
    /// Watch the configuration file and reload it when it changes, checking this often.
    /// SIGHUP reloads it in any case.
    #[serde(with = "humantime_serde")]
    pub watch_config: Option<Duration>,
    /// When set, clients must send `Authorization: Bearer <key>` with one of these keys:
    /// plain strings, or `{name, key}` to count usage under the name.
    pub api_keys: Vec<ApiKey>,
    /// Request headers read, in order, for an explicit session key when the body has none.
    pub session_headers: Vec<String>,
    /// Load balancers and reverse proxies in front of corral, by address or network: for a
    /// request one of them forwards, the client is the last address in `X-Forwarded-For`
    /// that is not one of them (else every client would be the balancer).
    #[serde(deserialize_with = "networks")]
    pub trusted_proxies: Vec<ipnet::IpNet>,
    pub embed_fanout: EmbedFanoutConfig,
    pub management: ManagementConfig,
    /// One JSON line per request: `off`, `stdout`, or a file path to append to.
    pub access_log: String,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: "0.0.0.0:11435".into(),
            metrics_listen: Some("127.0.0.1:9435".into()),
            admin_listen: Some("127.0.0.1:9436".into()),
            admin_token: None,
            nodes: Vec::new(),
            weights: Weights::default(),
            timeouts: Timeouts::default(),
            limits: Limits::default(),
            health: HealthConfig::default(),
            poll: PollConfig::default(),
            affinity: AffinityConfig::default(),
            breaker: BreakerConfig::default(),
            queue: QueueConfig::default(),
            shared_state: None,
            watch_config: None,
            api_keys: Vec::new(),
            session_headers: crate::request::session::DEFAULT_SESSION_HEADERS
                .iter()
                .map(|h| h.to_string())
                .collect(),
            trusted_proxies: Vec::new(),
            embed_fanout: EmbedFanoutConfig::default(),
            management: ManagementConfig::default(),
            access_log: "off".into(),
        }
    }
}

/// One server of the fleet.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct NodeConfig {
    /// Name reported in `X-Fleet-Node`, metrics and logs.
    pub name: String,
    /// Base URL, e.g. `http://192.168.1.10:11434`.
    pub url: String,
    /// Memory available for models (VRAM, or unified memory). Unknown: models are assumed
    /// to fit and memory fit scores neutral.
    pub memory_gb: Option<f64>,
    /// Request classes this node is meant for: model names (`llama3:70b`), endpoint classes
    /// (`chat`, `generate`, `embed`) or size classes (`small`, `medium`, `large`).
    #[serde(default)]
    pub roles: Vec<String>,
    /// The node's `OLLAMA_NUM_PARALLEL`: how many conversations it keeps warm per model.
    /// Unset (0 here): not known; corral starts from Ollama's default and probes for more
    /// (routing/parallel.rs).
    #[serde(default = "unknown_num_parallel", deserialize_with = "at_least_one")]
    pub num_parallel: usize,
    /// The node's `OLLAMA_MULTIUSER_CACHE`, which decides where a new conversation goes.
    /// Off (Ollama's default): to the idle slot sharing the longest prefix with it, which
    /// is any slot holding a conversation (all prompts share their first tokens), so it
    /// pushes that conversation out even when a slot is empty. On (also how a llama.cpp
    /// server behaves): to an empty slot, else the least recently used one.
    #[serde(default)]
    pub multiuser_cache: bool,
    /// Send a request warm on the node one past its slots, to wait in the node's own queue,
    /// where the node takes 0.1 s or more to begin a request (a CPU node, whose runner's
    /// batch under way takes that long): the request then begins the moment a slot frees.
    /// Off, every request waits in corral, free to go wherever a slot frees first.
    #[serde(default)]
    pub queue_at_node: bool,
    /// For an `https://` node: a PEM file of certificates to trust besides the system's
    /// roots (a lab's self-signed certificate or private CA).
    #[serde(default)]
    pub ca_file: Option<String>,
    /// What kind of server the node is (`ollama`, `ollama-legacy`, `llama-cpp`, `openai`);
    /// `auto`, the default, detects it from `/api/version` and the replies.
    #[serde(default)]
    pub kind: NodeKind,
}

fn unknown_num_parallel() -> usize {
    0
}

/// A `num_parallel` that is set must be at least 1.
fn at_least_one<'de, D: serde::Deserializer<'de>>(d: D) -> Result<usize, D::Error> {
    let n = usize::deserialize(d)?;
    if n == 0 {
        return Err(serde::de::Error::custom("num_parallel: must be at least 1"));
    }
    Ok(n)
}

/// Scoring weights. The first three and `session_affinity` are the published defaults that
/// the worked example in the README depends on.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Weights {
    /// Bonus when the model is resident on the node.
    pub model_loaded: f64,
    /// Maximum bonus for memory fit.
    pub memory_fit: f64,
    /// Penalty per request running or waiting for the model on the node.
    pub queue_depth: f64,
    /// Maximum penalty for a node slower than the fleet's best for the model.
    pub latency: f64,
    /// Bonus when one of the node's roles matches the request.
    pub role_affinity: f64,
    /// Bonus scaled by the node's recent success ratio.
    pub availability: f64,
    /// Maximum bonus when the prompt fits the loaded context comfortably; the same amount
    /// twice over is the penalty for an overflow or a forced reload.
    pub context_fit: f64,
    /// Bonus for the node holding the conversation's warm prefix, divided by `1 + depth/2`.
    pub session_affinity: f64,
    /// Penalty for a node where a new conversation would displace another warm one.
    pub slot_displacement: f64,
    /// Deciding in seconds whether a follow-up waits for its busy warm node: a move is
    /// counted as this many times its cold prefill elsewhere (see routing/stay.rs). 0, the
    /// default, leaves the decision to the signals, as in the README's worked example.
    pub move_cost: f64,
}

impl Default for Weights {
    fn default() -> Self {
        Weights {
            model_loaded: 50.0,
            memory_fit: 20.0,
            queue_depth: 6.0,
            latency: 15.0,
            role_affinity: 10.0,
            availability: 10.0,
            context_fit: 5.0,
            session_affinity: 20.0,
            slot_displacement: 8.0,
            move_cost: 0.0,
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct Timeouts {
    /// TCP connect to a node; past it the next-best node is tried.
    #[serde(with = "humantime_serde")]
    pub connect: Duration,
    /// From sending the request to the reply's first byte. Must cover a cold model load
    /// plus the prefill of the longest prompt.
    #[serde(with = "humantime_serde")]
    pub first_byte: Duration,
    /// Longest silence allowed between two chunks of a reply.
    #[serde(with = "humantime_serde")]
    pub idle: Duration,
    /// Time allowed to receive a request's head (request line and headers), counted from
    /// its first byte; on a new connection also the wait for that first byte.
    #[serde(with = "humantime_serde")]
    pub header_read: Duration,
    /// Time allowed to receive a client's whole request body.
    #[serde(with = "humantime_serde")]
    pub body_read: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            connect: Duration::from_secs(2),
            first_byte: Duration::from_secs(600),
            idle: Duration::from_secs(120),
            header_read: Duration::from_secs(30),
            body_read: Duration::from_secs(60),
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Largest request head (request line and headers) accepted (431 past it).
    pub max_header_bytes: usize,
    /// Largest request body accepted (413 past it).
    pub max_body_bytes: usize,
    /// How many other nodes to try when a node refuses the connection.
    pub max_retries: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_header_bytes: 64 * 1024,
            max_body_bytes: 64 * 1024 * 1024,
            max_retries: 2,
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct HealthConfig {
    /// How often Pingora's active health check probes `GET /` on every node.
    #[serde(with = "humantime_serde")]
    pub interval: Duration,
    /// Consecutive failures that mark a node down, and successes that bring it back.
    pub consecutive_failures: usize,
    pub consecutive_successes: usize,
}

impl Default for HealthConfig {
    fn default() -> Self {
        HealthConfig {
            interval: Duration::from_secs(5),
            consecutive_failures: 1,
            consecutive_successes: 1,
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct PollConfig {
    /// How often each node's `/api/ps` and `/api/tags` are read.
    #[serde(with = "humantime_serde")]
    pub interval: Duration,
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
}

impl Default for PollConfig {
    fn default() -> Self {
        PollConfig {
            interval: Duration::from_secs(2),
            timeout: Duration::from_secs(2),
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct AffinityConfig {
    /// Most prefixes remembered; the least recently used are forgotten first.
    pub capacity: usize,
    /// How long a prefix stays warm after its last use: Ollama's `keep_alive`.
    #[serde(with = "humantime_serde")]
    pub ttl: Duration,
}

impl Default for AffinityConfig {
    fn default() -> Self {
        AffinityConfig {
            capacity: 1_000_000,
            ttl: Duration::from_secs(300),
        }
    }
}

/// Passive failure detection per node.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct BreakerConfig {
    /// Consecutive failures (refused, timed out, reset, broken replies, 5xx) that cut a node off.
    pub failures: u32,
    /// How long a cut-off node gets no requests before one probe is let through.
    #[serde(with = "humantime_serde")]
    pub cooldown: Duration,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig {
            failures: 3,
            cooldown: Duration::from_secs(10),
        }
    }
}

/// The router-side queue: at most `num_parallel` requests run on a node per model; the
/// rest wait in corral, where they can still go to whichever node frees up first.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct QueueConfig {
    /// Requests waiting at once, fleet-wide; past it, 503.
    pub max_waiting: usize,
    /// Longest a request waits for a slot; past it, 503.
    #[serde(with = "humantime_serde")]
    pub max_wait: Duration,
    /// Requests one client address may have in flight or waiting; past it, 429. None: no limit.
    pub per_client: Option<usize>,
}

impl Default for QueueConfig {
    fn default() -> Self {
        QueueConfig {
            max_waiting: 1024,
            max_wait: Duration::from_secs(120),
            per_client: None,
        }
    }
}

/// The store replicas share state through: any RESP server (Redis, Valkey).
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct SharedStateConfig {
    /// `redis://[:password@]host:port[/db]`, or `rediss://` for TLS.
    pub url: String,
    /// Prepended to every key and channel, so that several fleets can share one server.
    pub key_prefix: String,
    /// Longest a request waits on the store; past it the replica decides on its own state.
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
    /// How long a replica's slot leases and its word on runs outlive it: a replica that dies
    /// leaves no counts behind after this.
    #[serde(with = "humantime_serde")]
    pub lease: Duration,
}

impl SharedStateConfig {
    fn validate(&self) -> Result<(), String> {
        redis::parse_redis_url(&self.url)
            .filter(|url| matches!(url.scheme(), "redis" | "rediss"))
            .ok_or_else(|| {
                format!(
                    "shared_state.url: '{}' is not a redis:// or rediss:// URL",
                    self.url
                )
            })?;
        if self.timeout.is_zero() || self.lease < Duration::from_secs(1) {
            return Err("shared_state: timeout must be above zero and lease at least 1s".into());
        }
        Ok(())
    }
}

impl Default for SharedStateConfig {
    fn default() -> Self {
        SharedStateConfig {
            url: String::new(),
            key_prefix: "corral".into(),
            timeout: Duration::from_millis(2),
            lease: Duration::from_secs(10),
        }
    }
}

/// Pull, push, create, copy and delete change one node. Off unless enabled here; when
/// enabled, a request must name its node (`X-Fleet-Target`) and carry the admin token
/// (`X-Fleet-Admin-Token`).
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ManagementConfig {
    pub enabled: bool,
}

/// Where a node is reached, from its URL. A host name is resolved again on every poll
/// (`NodeTarget::resolve`), so a node that moves, such as a recreated container, is
/// followed, and a node whose name does not resolve yet is only down, not an error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeTarget {
    /// Host name or IP address, also for the `Host` header and TLS SNI.
    pub host: String,
    pub port: u16,
    pub tls: bool,
}

impl NodeTarget {
    /// The address, when the host is an IP address and needs no resolving.
    pub fn fixed(&self) -> Option<SocketAddr> {
        let ip: IpAddr = self.host.parse().ok()?;
        Some(SocketAddr::new(ip, self.port))
    }

    /// Resolves the host with the system resolver, off the async threads. The first
    /// address is used, as a connection to the node would.
    pub async fn resolve(&self) -> Result<SocketAddr, String> {
        if let Some(addr) = self.fixed() {
            return Ok(addr);
        }
        tokio::net::lookup_host((self.host.as_str(), self.port))
            .await
            .map_err(|e| format!("cannot resolve '{}': {e}", self.host))?
            .next()
            .ok_or_else(|| format!("'{}' resolves to no address", self.host))
    }

    /// As [`NodeTarget::resolve`], blocking: for the start, before any runtime runs.
    pub fn resolve_blocking(&self) -> Result<SocketAddr, String> {
        if let Some(addr) = self.fixed() {
            return Ok(addr);
        }
        (self.host.as_str(), self.port)
            .to_socket_addrs()
            .map_err(|e| format!("cannot resolve '{}': {e}", self.host))?
            .next()
            .ok_or_else(|| format!("'{}' resolves to no address", self.host))
    }
}

impl Config {
    /// Reads and validates a configuration file. Keys that belong to Pingora's own
    /// `ServerConf` are left to Pingora.
    pub fn load(path: &Path) -> Result<Config, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read config {}: {e}", path.display()))?;
        Config::from_yaml(&text).map_err(|e| format!("config {}: {e}", path.display()))
    }

    pub fn from_yaml(text: &str) -> Result<Config, String> {
        let mut doc: serde_yaml::Value = serde_yaml::from_str(text).map_err(|e| e.to_string())?;
        if doc.is_null() {
            doc = serde_yaml::Value::Mapping(Default::default());
        }
        let serde_yaml::Value::Mapping(map) = &mut doc else {
            return Err("the top level must be a mapping of keys".into());
        };
        for key in pingora_keys() {
            map.remove(key.as_str());
        }
        let config: Config = serde_path_to_error::deserialize(doc).map_err(|e| {
            // The path ends at the bad key itself (`weights.model_loded: unknown field ...`);
            // it is "." for an error in the document as a whole.
            match e.path().to_string().as_str() {
                "." => e.inner().to_string(),
                path => format!("{path}: {}", e.inner()),
            }
        })?;
        config.validate()?;
        Ok(config)
    }

    /// Checks what serde cannot: values that parse but make no sense.
    pub fn validate(&self) -> Result<(), String> {
        parse_listen("listen", &self.listen)?;
        if let Some(a) = &self.metrics_listen {
            parse_listen("metrics_listen", a)?;
        }
        if let Some(a) = &self.admin_listen {
            parse_listen("admin_listen", a)?;
        }
        let mut names = std::collections::HashSet::new();
        for (i, node) in self.nodes.iter().enumerate() {
            let at = format!("nodes[{i}]");
            if node.name.trim().is_empty() {
                return Err(format!("{at}.name: must not be empty"));
            }
            if !names.insert(node.name.as_str()) {
                return Err(format!("{at}.name: '{}' is used twice", node.name));
            }
            // Every reply names its node in `X-Fleet-Node`.
            if http::HeaderValue::from_str(&node.name).is_err() {
                return Err(format!(
                    "{at}.name: '{}' has characters an HTTP header cannot carry",
                    node.name.escape_debug()
                ));
            }
            node.target().map_err(|e| format!("{at}.url: {e}"))?;
            if let Some(gb) = node.memory_gb
                && !(gb.is_finite() && gb > 0.0)
            {
                return Err(format!("{at}.memory_gb: must be a positive number"));
            }
            if let Some(path) = &node.ca_file {
                if !node.url.starts_with("https://") {
                    return Err(format!("{at}.ca_file: only for an https:// url"));
                }
                crate::tls::roots_with(Path::new(path))
                    .map_err(|e| format!("{at}.ca_file: {e}"))?;
            }
        }
        if let Some(shared) = &self.shared_state {
            shared.validate()?;
        }
        let w = &self.weights;
        for (key, value) in [
            ("model_loaded", w.model_loaded),
            ("memory_fit", w.memory_fit),
            ("queue_depth", w.queue_depth),
            ("latency", w.latency),
            ("role_affinity", w.role_affinity),
            ("availability", w.availability),
            ("context_fit", w.context_fit),
            ("session_affinity", w.session_affinity),
            ("slot_displacement", w.slot_displacement),
            ("move_cost", w.move_cost),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                return Err(format!(
                    "weights.{key}: must be a non-negative number (penalties are subtracted)"
                ));
            }
        }
        let t = &self.timeouts;
        for (key, value) in [
            ("connect", t.connect),
            ("first_byte", t.first_byte),
            ("idle", t.idle),
            ("header_read", t.header_read),
            ("body_read", t.body_read),
        ] {
            if value.is_zero() {
                return Err(format!("timeouts.{key}: must be longer than zero"));
            }
        }
        if !(MIN_HEADER_BYTES..=PINGORA_MAX_HEADER_BYTES).contains(&self.limits.max_header_bytes) {
            return Err(format!(
                "limits.max_header_bytes: must be between {MIN_HEADER_BYTES} and \
                 {PINGORA_MAX_HEADER_BYTES} (Pingora reads no larger head)"
            ));
        }
        if self.limits.max_body_bytes == 0 {
            return Err("limits.max_body_bytes: must be at least 1".into());
        }
        if self.health.interval.is_zero() || self.poll.interval.is_zero() {
            return Err("health.interval and poll.interval: must be longer than zero".into());
        }
        validate_api_keys(&self.api_keys)?;
        for (i, name) in self.session_headers.iter().enumerate() {
            if http::HeaderName::from_bytes(name.as_bytes()).is_err() {
                return Err(format!(
                    "session_headers[{i}]: '{name}' is not a header name"
                ));
            }
        }
        if self.embed_fanout.chunk_size == 0 {
            return Err("embed_fanout.chunk_size: must be at least 1".into());
        }
        if self.management.enabled && self.admin_token.is_none() {
            return Err("management.enabled: needs admin_token to be set".into());
        }
        if self.breaker.failures == 0 {
            return Err("breaker.failures: must be at least 1".into());
        }
        if self.queue.per_client == Some(0) {
            return Err("queue.per_client: must be at least 1 (or omitted)".into());
        }
        if self.watch_config.is_some_and(|d| d.is_zero()) {
            return Err("watch_config: must be longer than zero".into());
        }
        if self.access_log.trim().is_empty() {
            return Err("access_log: use off, stdout or a file path".into());
        }
        if self.affinity.capacity == 0 {
            return Err("affinity.capacity: must be at least 1".into());
        }
        Ok(())
    }
}

impl NodeConfig {
    pub fn new(name: &str, url: &str) -> NodeConfig {
        NodeConfig {
            name: name.into(),
            url: url.into(),
            memory_gb: None,
            roles: Vec::new(),
            num_parallel: unknown_num_parallel(),
            multiuser_cache: false,
            queue_at_node: false,
            ca_file: None,
            kind: NodeKind::Auto,
        }
    }

    /// Parses the node's URL.
    pub fn target(&self) -> Result<NodeTarget, String> {
        let uri: http::Uri = self
            .url
            .parse()
            .map_err(|e| format!("'{}' is not a URL: {e}", self.url))?;
        let tls = match uri.scheme_str() {
            Some("http") => false,
            Some("https") => true,
            _ => {
                return Err(format!(
                    "'{}' must start with http:// or https://",
                    self.url
                ));
            }
        };
        if !matches!(uri.path(), "" | "/") {
            return Err(format!(
                "'{}' must not have a path: nodes are addressed at their root",
                self.url
            ));
        }
        let host = uri
            .host()
            .ok_or_else(|| format!("'{}' has no host", self.url))?
            .trim_matches(|c| c == '[' || c == ']')
            .to_string();
        let port = uri.port_u16().unwrap_or(if tls { 443 } else { 80 });
        Ok(NodeTarget { host, port, tls })
    }

    pub fn memory_bytes(&self) -> Option<u64> {
        self.memory_gb.map(|gb| (gb * 1e9) as u64)
    }
}

fn parse_listen(key: &str, value: &str) -> Result<SocketAddr, String> {
    value
        .parse()
        .map_err(|_| format!("{key}: '{value}' is not an address like 127.0.0.1:11435"))
}

/// The top-level keys of Pingora's `ServerConf`, read from its serialized default so that
/// the list follows Pingora's version.
fn pingora_keys() -> Vec<String> {
    let conf = pingora_core::server::configuration::ServerConf::default();
    match serde_yaml::to_value(conf) {
        Ok(serde_yaml::Value::Mapping(map)) => map
            .keys()
            .filter_map(|k| k.as_str().map(str::to_string))
            .collect(),
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_file_gives_defaults() {
        let c = Config::from_yaml("").expect("defaults are valid");
        assert_eq!(c.listen, "0.0.0.0:11435");
        assert_eq!(c.weights, Weights::default());
        assert_eq!(c.limits.max_body_bytes, 64 * 1024 * 1024);
    }

    #[test]
    fn pingora_keys_pass_through() {
        let c = Config::from_yaml(
            "version: 1\nthreads: 2\ngrace_period_seconds: 5\nlisten: 127.0.0.1:1\n",
        )
        .expect("pingora keys are accepted");
        assert_eq!(c.listen, "127.0.0.1:1");
    }

    #[test]
    fn unknown_key_is_named() {
        let err = Config::from_yaml("listne: 1.2.3.4:5").unwrap_err();
        assert!(err.contains("listne"), "{err}");
        let err = Config::from_yaml("weights:\n  model_loded: 3\n").unwrap_err();
        assert!(
            err.starts_with("weights.model_loded: unknown field `model_loded`, expected one of"),
            "{err}"
        );
    }

    #[test]
    fn bad_value_is_named_by_its_path() {
        let err = Config::from_yaml(
            "nodes:\n  - {name: a, url: 'http://127.0.0.1:1'}\n  - {name: b, url: 'http://127.0.0.1:2', memory_gb: lots}\n",
        )
        .unwrap_err();
        assert!(err.starts_with("nodes[1].memory_gb: invalid type"), "{err}");
        let err = Config::from_yaml("queue:\n  max_wait: soon\n").unwrap_err();
        assert!(err.starts_with("queue.max_wait: "), "{err}");
    }

    #[test]
    fn bad_node_is_named() {
        let err = Config::from_yaml("nodes:\n  - name: a\n    url: ftp://x:1\n").unwrap_err();
        assert!(err.contains("nodes[0].url"), "{err}");
        let err = Config::from_yaml("nodes:\n  - name: a\n").unwrap_err();
        assert!(err.contains("url"), "{err}");
        let err = Config::from_yaml(
            "nodes:\n  - {name: a, url: 'http://127.0.0.1:1'}\n  - {name: a, url: 'http://127.0.0.1:2'}\n",
        )
        .unwrap_err();
        assert!(err.contains("nodes[1].name"), "{err}");
        let err = Config::from_yaml(
            "nodes:\n  - {name: a, url: 'http://127.0.0.1:1', num_parallel: 0}\n",
        )
        .unwrap_err();
        assert!(err.contains("num_parallel"), "{err}");
        let err =
            Config::from_yaml("nodes:\n  - {name: \"a\\nb\", url: 'http://x:1'}\n").unwrap_err();
        assert!(
            err.contains("nodes[0].name") && err.contains("HTTP header"),
            "{err}"
        );
    }

    #[test]
    fn durations_are_human() {
        let c = Config::from_yaml("timeouts:\n  connect: 250ms\n  first_byte: 10m\n").unwrap();
        assert_eq!(c.timeouts.connect, Duration::from_millis(250));
        assert_eq!(c.timeouts.first_byte, Duration::from_secs(600));
        let err = Config::from_yaml("timeouts:\n  idle: 0s\n").unwrap_err();
        assert!(err.contains("timeouts.idle"), "{err}");
    }

    #[test]
    fn header_limit_stays_within_what_pingora_reads() {
        let c = Config::from_yaml("limits:\n  max_header_bytes: 1048575\n").unwrap();
        assert_eq!(c.limits.max_header_bytes, PINGORA_MAX_HEADER_BYTES);
        for too in ["1048576", "100"] {
            let err =
                Config::from_yaml(&format!("limits:\n  max_header_bytes: {too}\n")).unwrap_err();
            assert!(err.contains("limits.max_header_bytes"), "{err}");
        }
    }

    #[test]
    fn node_url_is_parsed_and_resolved_later() {
        let t = NodeConfig::new("a", "http://127.0.0.1:11434")
            .target()
            .unwrap();
        assert_eq!(t.fixed(), Some("127.0.0.1:11434".parse().unwrap()));
        assert!(!t.tls);
        let t = NodeConfig::new("a", "https://[::1]").target().unwrap();
        assert_eq!((t.host.as_str(), t.port, t.tls), ("::1", 443, true));
        assert_eq!(t.resolve_blocking(), Ok("[::1]:443".parse().unwrap()));
        assert!(
            NodeConfig::new("a", "http://127.0.0.1:1/api")
                .target()
                .is_err()
        );
        // A name that does not resolve (RFC 6761 reserves .invalid) is not a config error:
        // the node is down until it resolves.
        let c = Config::from_yaml("nodes:\n  - {name: a, url: 'http://gpu.invalid:11434'}\n")
            .expect("an unresolvable node is valid");
        let t = c.nodes[0].target().unwrap();
        assert_eq!(t.fixed(), None);
        let err = t.resolve_blocking().unwrap_err();
        assert!(err.contains("cannot resolve 'gpu.invalid'"), "{err}");
    }
}

#[cfg(test)]
mod shipped {
    #[test]
    fn shipped_example_is_valid() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("conf/corral.yaml");
        let c = super::Config::load(&path).expect("conf/corral.yaml is valid");
        assert_eq!(c.nodes.len(), 3);
        assert_eq!(c.weights, super::Weights::default());
    }
}

/// The configured kind of a node; `auto` (the default) detects it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum NodeKind {
    #[default]
    Auto,
    /// Ollama 0.30 or later: llama-server runner, host prompt cache.
    Ollama,
    /// Ollama before 0.30: its own runner, slots only.
    OllamaLegacy,
    /// A llama.cpp server used directly.
    LlamaCpp,
    /// Another OpenAI-compatible server reporting cached tokens.
    Openai,
}

impl NodeKind {
    pub fn as_str(self) -> &'static str {
        match self {
            NodeKind::Auto => "unknown",
            NodeKind::Ollama => "ollama",
            NodeKind::OllamaLegacy => "ollama-legacy",
            NodeKind::LlamaCpp => "llama-cpp",
            NodeKind::Openai => "openai",
        }
    }
}

/// A client API key, plain or named. A named key's name labels its usage in metrics and the
/// access log; requests with a plain key, or none, count as `anonymous`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(untagged)]
pub enum ApiKey {
    Plain(String),
    Named(NamedKey),
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct NamedKey {
    pub name: String,
    pub key: String,
    /// Requests the key may have in flight or waiting at once; past it, 429.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_requests: Option<usize>,
    /// Tokens the fleet may work on for the key per minute (prompt tokens evaluated, not
    /// served from cache, plus completion tokens, as measured from replies); past it, 429.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_minute: Option<u64>,
    #[serde(default)]
    pub priority: Priority,
}

/// Which waiting requests a freed slot goes to first: every `interactive` one before any
/// `batch` one; within a class, the client that has had the least service recently.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq, PartialOrd, Ord)]
#[serde(rename_all = "lowercase")]
pub enum Priority {
    #[default]
    Interactive,
    Batch,
}

/// The label of requests made without a named key.
pub const ANONYMOUS: &str = "anonymous";

impl ApiKey {
    pub fn secret(&self) -> &str {
        match self {
            ApiKey::Plain(key) => key,
            ApiKey::Named(named) => &named.key,
        }
    }

    pub fn name(&self) -> &str {
        match self {
            ApiKey::Plain(_) => ANONYMOUS,
            ApiKey::Named(named) => &named.name,
        }
    }

    /// The key's limits and class: a plain key has none (its requests count per address).
    pub fn named(&self) -> Option<&NamedKey> {
        match self {
            ApiKey::Plain(_) => None,
            ApiKey::Named(named) => Some(named),
        }
    }
}

impl From<&str> for ApiKey {
    fn from(key: &str) -> ApiKey {
        ApiKey::Plain(key.to_string())
    }
}

/// `trusted_proxies`: networks (`10.0.0.0/8`) or single addresses (`10.0.0.5`).
fn networks<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<ipnet::IpNet>, D::Error> {
    use serde::de::Error;
    let texts = Vec::<String>::deserialize(d)?;
    (texts.iter())
        .map(|text| {
            (text.parse::<ipnet::IpNet>())
                .or_else(|_| text.parse::<IpAddr>().map(ipnet::IpNet::from))
                .map_err(|_| D::Error::custom(format!("'{text}' is not an address or a network")))
        })
        .collect()
}

fn validate_api_keys(keys: &[ApiKey]) -> Result<(), String> {
    let mut names = std::collections::HashSet::new();
    for (i, key) in keys.iter().enumerate() {
        if key.secret().trim().is_empty() {
            return Err(format!("api_keys[{i}]: the key must not be empty"));
        }
        if let ApiKey::Named(named) = key {
            let name = named.name.trim();
            if name.is_empty() || name == ANONYMOUS {
                return Err(format!(
                    "api_keys[{i}].name: must be set and not '{ANONYMOUS}'"
                ));
            }
            if !names.insert(name) {
                return Err(format!("api_keys[{i}].name: '{name}' is used twice"));
            }
            if named.max_requests == Some(0) {
                return Err(format!(
                    "api_keys[{i}].max_requests: must be at least 1 (or omitted)"
                ));
            }
            if named.tokens_per_minute == Some(0) {
                return Err(format!(
                    "api_keys[{i}].tokens_per_minute: must be at least 1 (or omitted)"
                ));
            }
        }
    }
    Ok(())
}

/// Splitting embedding batches across the nodes that hold the model.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct EmbedFanoutConfig {
    /// Inputs per request sent to one node; a batch with more is split. 0 is refused.
    pub chunk_size: usize,
    /// Most nodes one batch is spread over.
    pub max_nodes: usize,
}

impl Default for EmbedFanoutConfig {
    fn default() -> Self {
        EmbedFanoutConfig {
            chunk_size: 32,
            max_nodes: 8,
        }
    }
}
