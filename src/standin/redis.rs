//! A real `redis-server` (Debian's package; `.ci/run` installs it) for the tests and
//! benchmarks of replicas sharing state: on a loopback port picked here, saving nothing to
//! disk, stopped by its pid.

use std::collections::HashSet;
use std::hash::{BuildHasher, RandomState};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::{LazyLock, Mutex};
use std::time::{Duration, Instant};

pub struct RedisServer {
    child: Option<Child>,
    port: u16,
}

impl RedisServer {
    /// Starts a server on a free port and waits until it listens (at most 10 s). A port
    /// taken meanwhile is given up for another.
    pub async fn start() -> Result<RedisServer, String> {
        let mut last = String::new();
        for _ in 0..5 {
            let port = unclaimed_port()?;
            let mut server = RedisServer { child: None, port };
            match server.restart().await {
                Ok(()) => return Ok(server),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Starts the server again on the same port, empty (as after a crash or a flush), and
    /// waits until it answers. Fails when another server answers on the port, or this one
    /// exits first (the port was taken).
    pub async fn restart(&mut self) -> Result<(), String> {
        self.stop();
        let url = self.url();
        let mut child = Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &self.port.to_string()])
            .args(["--save", "", "--appendonly", "no", "--loglevel", "warning"])
            .stdout(Stdio::null())
            .spawn()
            .map_err(|e| {
                format!("cannot start redis-server (apt-get install redis-server): {e}")
            })?;
        let pid = child.id();
        let deadline = Instant::now() + Duration::from_secs(10);
        let outcome = loop {
            if let Ok(Some(status)) = child.try_wait() {
                break Err(format!("redis-server at {url} exited: {status}"));
            }
            match answering_pid(&url).await {
                Some(answering) if answering == pid => break Ok(()),
                Some(answering) => {
                    break Err(format!("another server (pid {answering}) answers at {url}"));
                }
                None if Instant::now() > deadline => {
                    break Err(format!("redis-server at {url} did not answer within 10 s"));
                }
                None => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        };
        match outcome {
            Ok(()) => self.child = Some(child),
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        outcome
    }

    /// Kills the server: every connection to it drops.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A free port below the kernel's ephemeral range, never handed out before in this process.
/// Every other listener of the tests and stand-ins binds port 0, which the kernel serves from
/// the ephemeral range only: so while a server is stopped for a restart, no other test's
/// listener takes its port (one did, and the restart failed).
fn unclaimed_port() -> Result<u16, String> {
    static CLAIMED: LazyLock<Mutex<HashSet<u16>>> = LazyLock::new(Default::default);
    let first_ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    // Ports 1024..first_ephemeral, at most the 8192 just below it, picked at random so that
    // processes side by side (a bench beside the tests) rarely try the same one.
    let span = first_ephemeral.saturating_sub(1024).min(8192);
    if span == 0 {
        return Err(format!(
            "no ports below the ephemeral range ({first_ephemeral})"
        ));
    }
    let random = RandomState::new();
    let mut claimed = CLAIMED
        .lock()
        .map_err(|_| "port registry poisoned".to_string())?;
    for attempt in 0u16..200 {
        let offset = (random.hash_one(attempt) % u64::from(span)) as u16;
        let port = first_ephemeral - 1 - offset;
        if !claimed.contains(&port) && TcpListener::bind(("127.0.0.1", port)).is_ok() {
            claimed.insert(port);
            return Ok(port);
        }
    }
    Err(format!("no free port below {first_ephemeral}"))
}

/// The process id of the server answering at `url`, once one does.
async fn answering_pid(url: &str) -> Option<u32> {
    let client = redis::Client::open(url).ok()?;
    let mut conn = client.get_multiplexed_async_connection().await.ok()?;
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query_async(&mut conn)
        .await
        .ok()?;
    let line = info.lines().find_map(|l| l.strip_prefix("process_id:"))?;
    line.trim().parse().ok()
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_picked_below_the_ephemeral_range_and_never_twice() {
        let first_ephemeral: u16 =
            std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
                .map(|r| {
                    r.split_whitespace()
                        .next()
                        .unwrap_or("32768")
                        .parse()
                        .unwrap_or(32768)
                })
                .unwrap_or(32768);
        let ports: Vec<u16> = (0..50).map(|_| unclaimed_port().unwrap()).collect();
        assert!(
            ports.iter().all(|&p| (1024..first_ephemeral).contains(&p)),
            "{ports:?}"
        );
        let distinct: HashSet<u16> = ports.iter().copied().collect();
        assert_eq!(distinct.len(), ports.len(), "{ports:?}");
    }
}
