//! A real `redis-server` (Debian's package; `.ci/run` installs it) for the tests and
//! benchmarks of replicas sharing state: on a loopback port picked here, saving nothing to
//! disk, stopped by its pid.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::port::unclaimed_port;

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
            let port = unclaimed_port().map_err(|e| e.to_string())?;
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
