//! Ports for servers the tests and benchmarks stop and start again on the same port (a
//! stand-in node's restart, a `redis-server`'s): taken from below the kernel's ephemeral
//! range. Every other listener binds port 0, which the kernel serves from that range only,
//! so while such a server is stopped no other listener takes its port (one did, and a test's
//! restart failed).

use std::collections::HashSet;
use std::hash::{BuildHasher, RandomState};
use std::io;
use std::net::{IpAddr, Ipv4Addr, TcpListener};
use std::sync::{LazyLock, Mutex};

/// The default start of Linux's ephemeral range (`net.ipv4.ip_local_port_range`).
const FIRST_EPHEMERAL: u16 = 32768;
/// How many ports below the ephemeral range are picked from.
const SPAN: u16 = 8192;

/// A free port on `127.0.0.1` below the ephemeral range, never handed out before in this
/// process, picked at random so that processes side by side (a bench beside the tests)
/// rarely try the same one.
pub fn unclaimed_port() -> io::Result<u16> {
    unclaimed_port_on(IpAddr::V4(Ipv4Addr::LOCALHOST))
}

/// [`unclaimed_port`] free on `ip`.
pub fn unclaimed_port_on(ip: IpAddr) -> io::Result<u16> {
    static CLAIMED: LazyLock<Mutex<HashSet<u16>>> = LazyLock::new(Default::default);
    let first_ephemeral = first_ephemeral();
    let span = first_ephemeral.saturating_sub(1024).min(SPAN);
    if span == 0 {
        let e = format!("no ports below the ephemeral range ({first_ephemeral})");
        return Err(io::Error::new(io::ErrorKind::AddrNotAvailable, e));
    }
    let random = RandomState::new();
    let mut claimed = CLAIMED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    for attempt in 0u16..200 {
        let offset = (random.hash_one(attempt) % u64::from(span)) as u16;
        let port = first_ephemeral - 1 - offset;
        if !claimed.contains(&port) && TcpListener::bind((ip, port)).is_ok() {
            claimed.insert(port);
            return Ok(port);
        }
    }
    let e = format!("no free port below {first_ephemeral}");
    Err(io::Error::new(io::ErrorKind::AddrNotAvailable, e))
}

/// The first port of the kernel's ephemeral range, which bind(0) serves from.
pub(super) fn first_ephemeral() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse().ok())
        .unwrap_or(FIRST_EPHEMERAL)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_picked_below_the_ephemeral_range_and_never_twice() {
        let ports: Vec<u16> = (0..50).map(|_| unclaimed_port().unwrap()).collect();
        let below = first_ephemeral();
        assert!(
            ports.iter().all(|&p| (1024..below).contains(&p)),
            "{ports:?}"
        );
        let distinct: HashSet<u16> = ports.iter().copied().collect();
        assert_eq!(distinct.len(), ports.len(), "{ports:?}");
    }
}
