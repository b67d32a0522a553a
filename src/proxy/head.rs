//! Client connections, and the request head read before Pingora parses it.
//!
//! Pingora answers a head it cannot read (too large, malformed) with its own empty 400,
//! before any `ProxyHttp` hook runs, and bounds only each single read of a head, not the
//! whole. So corral runs the connection loop itself, as `pingora_proxy::http_proxy` is
//! made for: each head is read here with corral's size and time limits, refused with a
//! JSON error like every other error corral gives, and handed to Pingora whole, from
//! where the request goes on as before.

use std::mem::MaybeUninit;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::BytesMut;
use pingora_core::apps::{HttpPersistentSettings, HttpServerApp, ServerApp};
use pingora_core::protocols::Stream;
use pingora_core::protocols::http::ServerSession;
use pingora_core::protocols::l4::stream::Stream as L4Stream;
use pingora_core::server::ShutdownWatch;
use pingora_proxy::HttpProxy;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::timeout;

use super::access_log::{self, AccessLog};
use super::corral::Corral;
use crate::metrics::Metrics;
use crate::routing::Router;

/// The first read of a head: Pingora's own initial header buffer. Ordinary heads fit, and
/// the body bytes read with them are few, since they are read again from the rewind buffer.
const FIRST_READ: usize = 4096;
/// Pingora's `MAX_HEADERS`: httparse needs room for every header of a head Pingora accepts.
const MAX_HEADERS: usize = 256;
/// How long an idle kept-alive connection waits for its next request: Pingora's default.
const KEEPALIVE: Duration = Duration::from_secs(60);
/// After a refusal, how long the rest of a request is read and dropped, so that the
/// client reads the answer instead of a reset (the kernel resets a connection closed
/// with unread bytes).
const LINGER: Duration = Duration::from_secs(1);

/// The proxy's listening app: reads request heads, hands them to Pingora's HTTP proxy.
pub struct ClientConnections {
    proxy: Arc<HttpProxy<Corral>>,
    router: Arc<Router>,
    metrics: Arc<Metrics>,
    access_log: Arc<AccessLog>,
}

impl ClientConnections {
    pub fn new(
        proxy: HttpProxy<Corral>,
        router: Arc<Router>,
        metrics: Arc<Metrics>,
        access_log: Arc<AccessLog>,
    ) -> ClientConnections {
        ClientConnections {
            proxy: Arc::new(proxy),
            router,
            metrics,
            access_log,
        }
    }

    /// Answers a refused head, counts it and logs it, then closes the connection.
    async fn refuse(&self, mut stream: Stream, refusal: Refusal, started: Instant) {
        // A malformed head has no trustworthy path: Ollama's shape.
        let body = super::respond::error_body(
            crate::request::ErrorShape::Ollama,
            refusal.status,
            &refusal.message,
        );
        let reason = http::StatusCode::from_u16(refusal.status)
            .ok()
            .and_then(|s| s.canonical_reason())
            .unwrap_or("");
        let mut reply = format!(
            "HTTP/1.1 {} {reason}\r\nContent-Type: application/json; charset=utf-8\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n",
            refusal.status,
            body.len()
        )
        .into_bytes();
        reply.extend_from_slice(&body);
        let written = stream.write_all(&reply).await.and(stream.flush().await);
        if written.is_ok() {
            let _ = stream.shutdown().await;
            linger(&mut stream).await;
        }

        let status = refusal.status.to_string();
        self.metrics
            .requests
            .with_label_values(&["none", "none", "other", &status])
            .inc();
        if self.access_log.enabled() {
            let (method, target) = request_line(&refusal.head);
            let client = stream
                .get_socket_digest()
                .and_then(|d| d.peer_addr().map(|a| a.to_string()));
            self.access_log.write(&access_log::Entry {
                time: access_log::now(),
                client,
                method: &method,
                endpoint: &target,
                status: refusal.status,
                duration_ms: started.elapsed().as_secs_f64() * 1000.0,
                ..Default::default()
            });
        }
    }
}

#[async_trait]
impl ServerApp for ClientConnections {
    async fn process_new(
        self: &Arc<Self>,
        mut stream: Stream,
        shutdown: &ShutdownWatch,
    ) -> Option<Stream> {
        if !(*stream).as_any().is::<L4Stream>() {
            // Not a socket corral can rewind (see `rewind`): Pingora reads the heads.
            return self.proxy.process_new(stream, shutdown).await;
        }
        let mut kept_alive = false;
        let mut persistent: Option<HttpPersistentSettings> = None;
        loop {
            let config = self.router.config();
            let limits = HeadLimits {
                max_bytes: config.limits.max_header_bytes,
                time: config.timeouts.header_read,
            };
            drop(config);
            // A new connection gets the head's time to begin; a kept-alive one, the
            // keep-alive time.
            let wait = if kept_alive { KEEPALIVE } else { limits.time };
            let started = Instant::now();
            match read_head(&mut stream, &limits, wait, shutdown).await {
                Head::Read(bytes) => stream = rewind(stream, &bytes)?,
                Head::Closed => return None,
                Head::Refused(refusal) => {
                    self.refuse(stream, refusal, started).await;
                    return None;
                }
            }

            // From here as Pingora's own HTTP/1 loop (`impl ServerApp for HttpServerApp`).
            let mut session = ServerSession::new_http1(stream);
            let keepalive = (!*shutdown.borrow()).then_some(KEEPALIVE.as_secs());
            session.set_keepalive(keepalive);
            if let Some(settings) = persistent.take() {
                settings.apply_to_session(&mut session);
            }
            let reused = self.proxy.process_new_http(session, shutdown).await?;
            (stream, persistent) = reused.consume();
            kept_alive = true;
        }
    }

    async fn cleanup(&self) {
        self.proxy.http_cleanup().await;
    }
}

struct HeadLimits {
    max_bytes: usize,
    /// For the whole head, from its first byte.
    time: Duration,
}

enum Head {
    /// A whole head, and whatever of the body came with it.
    Read(BytesMut),
    /// The client closed the connection or sent nothing: there is no one to answer.
    Closed,
    Refused(Refusal),
}

struct Refusal {
    status: u16,
    message: String,
    /// What was read of the head, for the access log.
    head: BytesMut,
}

/// Reads until `buf` holds a whole request head, within the limits. Waits up to
/// `first_byte_wait` for the head to begin, and stops waiting when the server shuts down.
async fn read_head(
    stream: &mut Stream,
    limits: &HeadLimits,
    first_byte_wait: Duration,
    shutdown: &ShutdownWatch,
) -> Head {
    let mut buf = BytesMut::with_capacity(FIRST_READ);
    let mut shutdown = shutdown.clone();
    let first = tokio::select! {
        // A head already sent is read even when the shutdown has begun, as Pingora does.
        biased;
        read = timeout(first_byte_wait, stream.read_buf(&mut buf)) => read,
        _ = shutdown.wait_for(|down| *down) => return Head::Closed,
    };
    if !matches!(first, Ok(Ok(n)) if n > 0) {
        return Head::Closed;
    }
    let deadline = tokio::time::Instant::now() + limits.time;
    let refused = |status, message, head| {
        Head::Refused(Refusal {
            status,
            message,
            head,
        })
    };
    loop {
        match parse(&buf, limits.max_bytes) {
            Parsed::Complete => return Head::Read(buf),
            Parsed::Partial if buf.len() <= limits.max_bytes => {}
            Parsed::Partial => return refused(431, too_large(limits.max_bytes), buf),
            Parsed::Invalid(status, message) => return refused(status, message, buf),
        }
        // Grow by doubling: few reads for a large head, memory bounded by the limit.
        buf.reserve(buf.len().max(FIRST_READ));
        match tokio::time::timeout_at(deadline, stream.read_buf(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => {}
            Ok(_) => return Head::Closed,
            Err(_) => {
                let message = format!(
                    "request head not received within {}",
                    humantime::format_duration(limits.time)
                );
                return refused(408, message, buf);
            }
        }
    }
}

/// Puts the bytes of a head back in front of the stream, for Pingora to read. `None` if the
/// stream is not the socket type that can rewind, which `process_new` checked first.
fn rewind(stream: Stream, bytes: &[u8]) -> Option<Stream> {
    let mut socket = stream.into_any().downcast::<L4Stream>().ok()?;
    socket.rewind(bytes);
    Some(socket)
}

#[derive(Debug, PartialEq)]
enum Parsed {
    Complete,
    Partial,
    Invalid(u16, String),
}

/// Judges the bytes read so far with httparse, as Pingora parses them after.
fn parse(buf: &[u8], max_bytes: usize) -> Parsed {
    // Uninitialized: the parse runs for every request, and 256 headers are 8 KiB to zero.
    let mut headers = [const { MaybeUninit::<httparse::Header>::uninit() }; MAX_HEADERS];
    let mut request = httparse::Request::new(&mut []);
    let parsed = httparse::ParserConfig::default().parse_request_with_uninit_headers(
        &mut request,
        buf,
        &mut headers,
    );
    match parsed {
        Ok(httparse::Status::Complete(len)) if len > max_bytes => {
            Parsed::Invalid(431, too_large(max_bytes))
        }
        // Pingora refuses CONNECT with its own empty 405; Ollama has no use for it either.
        Ok(httparse::Status::Complete(_)) if request.method == Some("CONNECT") => {
            Parsed::Invalid(405, "CONNECT is not supported".into())
        }
        Ok(httparse::Status::Complete(_)) => Parsed::Complete,
        Ok(httparse::Status::Partial) => Parsed::Partial,
        Err(httparse::Error::TooManyHeaders) => Parsed::Invalid(
            431,
            format!("request has more than {MAX_HEADERS} header fields"),
        ),
        Err(e) => Parsed::Invalid(400, format!("malformed request head: {e}")),
    }
}

fn too_large(max_bytes: usize) -> String {
    format!("request head larger than limits.max_header_bytes ({max_bytes} bytes)")
}

/// Reads and drops what the client still sends, for at most [`LINGER`].
async fn linger(stream: &mut Stream) {
    let mut sink = vec![0u8; 16 * 1024];
    let _ = timeout(LINGER, async {
        while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {}
    })
    .await;
}

/// The method and path of a head's request line, as far as they can be read.
fn request_line(head: &[u8]) -> (String, String) {
    let line = head.split(|&b| b == b'\n').next().unwrap_or_default();
    let mut words = line.split(|&b| b == b' ').filter(|w| !w.is_empty());
    let mut word = |max: usize| {
        let word = words.next().unwrap_or_default();
        String::from_utf8_lossy(&word[..word.len().min(max)]).into_owned()
    };
    let method = word(16);
    let target = word(256);
    let path = target.split('?').next().unwrap_or_default().to_string();
    (method, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_whole_head_is_complete_and_a_cut_one_partial() {
        let head = b"POST /api/chat HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}";
        assert_eq!(parse(head, 1024), Parsed::Complete);
        assert_eq!(parse(&head[..30], 1024), Parsed::Partial);
        assert_eq!(
            parse(b"GET / HTTP/1.1\nHost: x\n\n", 1024),
            Parsed::Complete
        );
    }

    #[test]
    fn connect_is_refused_with_405() {
        let head = b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n";
        assert!(matches!(parse(head, 1024), Parsed::Invalid(405, _)));
    }

    #[test]
    fn a_head_over_the_limit_is_431_even_when_whole() {
        let head = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n";
        assert_eq!(parse(head, head.len()), Parsed::Complete);
        assert!(matches!(
            parse(head, head.len() - 1),
            Parsed::Invalid(431, _)
        ));
    }

    #[test]
    fn too_many_headers_is_431_and_a_malformed_head_400() {
        let mut head = b"GET / HTTP/1.1\r\n".to_vec();
        for i in 0..=MAX_HEADERS {
            head.extend_from_slice(format!("X-{i}: y\r\n").as_bytes());
        }
        head.extend_from_slice(b"\r\n");
        assert!(matches!(parse(&head, 1 << 20), Parsed::Invalid(431, _)));

        let Parsed::Invalid(400, message) = parse(b"GET / HTTP/1.1\r\nBad Name: v\r\n\r\n", 1024)
        else {
            panic!("a space in a header name is malformed");
        };
        assert!(message.contains("header name"), "{message}");
        assert!(matches!(
            parse(b"GET /a b HTTP/1.1\r\n\r\n", 1024),
            Parsed::Invalid(400, _)
        ));
    }

    #[test]
    fn the_request_line_is_read_for_the_log_as_far_as_it_goes() {
        let line = |head: &[u8]| request_line(head);
        assert_eq!(
            line(b"GET /api/tags?x=1 HTTP/1.1\r\nHost"),
            ("GET".into(), "/api/tags".into())
        );
        assert_eq!(line(b"POST /api/ch"), ("POST".into(), "/api/ch".into()));
        assert_eq!(line(b""), (String::new(), String::new()));
    }
}
