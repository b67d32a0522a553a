//! One JSON line per request, written off the request path by a thread of its own.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};

use serde::Serialize;

/// Lines waiting to be written. Past this, lines are dropped and counted rather than
/// making requests wait on a slow disk.
const BACKLOG: usize = 8192;

pub struct AccessLog {
    sender: Option<SyncSender<String>>,
    dropped: AtomicU64,
}

/// The fields of one access-log line.
#[derive(Default, Serialize)]
pub struct Entry<'a> {
    pub time: String,
    pub client: Option<String>,
    pub method: &'a str,
    pub endpoint: &'a str,
    pub model: Option<&'a str>,
    /// The client's `api_keys` name, or `anonymous`.
    pub key_name: Option<&'a str>,
    pub node: Option<&'a str>,
    pub score: Option<f64>,
    pub affinity: Option<&'a str>,
    pub cold_load: bool,
    pub retries: usize,
    pub status: u16,
    pub bytes: usize,
    /// Time waited in corral for a slot, before the request was sent to its node.
    pub wait_ms: Option<f64>,
    /// From sending the request to the node to the reply's first byte.
    pub ttfb_ms: Option<f64>,
    pub duration_ms: f64,
    /// Prompt tokens of the reply, and those the node served from cache, as measured.
    pub prompt_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    /// The node's verdict on its cache (`warm`, `cold`, `unknown`), to set against
    /// `affinity`, corral's prediction.
    pub cache: Option<&'a str>,
}

/// The `time` of an entry written now.
pub fn now() -> String {
    humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string()
}

impl AccessLog {
    /// `off`, `stdout`, or the path of a file to append to.
    pub fn open(target: &str) -> Result<AccessLog, String> {
        let sink: Box<dyn Write + Send> = match target {
            "off" => {
                return Ok(AccessLog {
                    sender: None,
                    dropped: AtomicU64::new(0),
                });
            }
            "stdout" => Box::new(std::io::stdout()),
            path => Box::new(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .map_err(|e| format!("access_log: cannot open {path}: {e}"))?,
            ),
        };
        let (sender, receiver) = sync_channel(BACKLOG);
        std::thread::Builder::new()
            .name("access-log".into())
            .spawn(move || write_lines(receiver, sink))
            .map_err(|e| format!("access_log: cannot start its writer: {e}"))?;
        Ok(AccessLog {
            sender: Some(sender),
            dropped: AtomicU64::new(0),
        })
    }

    pub fn enabled(&self) -> bool {
        self.sender.is_some()
    }

    pub fn write(&self, entry: &Entry) {
        let Some(sender) = &self.sender else { return };
        let Ok(line) = serde_json::to_string(entry) else {
            return;
        };
        if let Err(TrySendError::Full(_)) = sender.try_send(line) {
            let dropped = self.dropped.fetch_add(1, Ordering::Relaxed) + 1;
            if dropped.is_power_of_two() {
                log::warn!("access log is behind: {dropped} lines dropped so far");
            }
        }
    }
}

/// Writes lines as they come, flushing whenever the backlog is empty.
fn write_lines(receiver: Receiver<String>, sink: Box<dyn Write + Send>) {
    let mut out = std::io::BufWriter::new(sink);
    while let Ok(line) = receiver.recv() {
        let _ = writeln!(out, "{line}");
        while let Ok(more) = receiver.try_recv() {
            let _ = writeln!(out, "{more}");
        }
        let _ = out.flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_json_lines_to_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("access.log");
        let log = AccessLog::open(path.to_str().unwrap()).unwrap();
        assert!(log.enabled());
        let entry = Entry {
            time: "2026-01-01T00:00:00Z".into(),
            client: Some("127.0.0.1:5".into()),
            method: "POST",
            endpoint: "/api/chat",
            model: Some("m:latest"),
            key_name: Some("team-a"),
            node: Some("a"),
            score: Some(85.0),
            affinity: Some("hit"),
            cold_load: false,
            retries: 0,
            status: 200,
            bytes: 10,
            wait_ms: Some(0.0),
            ttfb_ms: Some(1.5),
            duration_ms: 2.0,
            prompt_tokens: Some(120),
            cached_tokens: Some(100),
            cache: Some("warm"),
        };
        log.write(&entry);
        drop(log);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            if let Some(line) = text.lines().next() {
                let v: serde_json::Value = serde_json::from_str(line).unwrap();
                assert_eq!(v["node"], "a");
                assert_eq!(v["affinity"], "hit");
                assert_eq!(v["key_name"], "team-a");
                assert_eq!(v["cache"], "warm");
                assert_eq!(v["cached_tokens"], 100);
                break;
            }
            assert!(std::time::Instant::now() < deadline, "line never written");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(!AccessLog::open("off").unwrap().enabled());
    }
}
