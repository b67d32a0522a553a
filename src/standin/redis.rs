//! A real `redis-server` (Debian's package; `.ci/run` installs it) for the tests and
//! benchmarks of replicas sharing state: on a loopback port picked here, saving nothing to
//! disk, stopped by its pid.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct RedisServer {
    child: Option<Child>,
    port: u16,
}

impl RedisServer {
    /// Starts a server on a free port and waits until it listens (at most 10 s).
    pub async fn start() -> Result<RedisServer, String> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| format!("no free port: {e}"))?
            .port();
        let mut server = RedisServer { child: None, port };
        server.restart().await?;
        Ok(server)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Starts the server again on the same port, empty (as after a crash or a flush).
    pub async fn restart(&mut self) -> Result<(), String> {
        self.stop();
        let child = Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &self.port.to_string()])
            .args(["--save", "", "--appendonly", "no", "--loglevel", "warning"])
            .stdout(Stdio::null())
            .spawn()
            .map_err(|e| {
                format!("cannot start redis-server (apt-get install redis-server): {e}")
            })?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while tokio::net::TcpStream::connect(("127.0.0.1", self.port))
            .await
            .is_err()
        {
            if Instant::now() > deadline {
                return Err("redis-server did not listen within 10 s".into());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    /// Kills the server: every connection to it drops.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}
