//! Listening and connections, managed by hand rather than with `axum::serve`, because the
//! stand-in must be able to die on command: `stop` closes the listener (new connects are
//! refused) and aborts every open connection mid-response, and `restart` listens again on the
//! same port. Each connection is one task, tracked so it can be aborted.

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::Request;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::Service;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use parking_lot::Mutex;
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::Notify;
use tokio::task::JoinHandle;

/// Lets a handler close the connection it is served on (used to end a hung request).
/// Inserted into every request's extensions.
#[derive(Clone, Debug, Default)]
pub struct ConnControl(Arc<Notify>);

impl ConnControl {
    pub fn close(&self) {
        self.0.notify_one();
    }

    async fn closed(&self) {
        self.0.notified().await;
    }
}

/// The listener and connections of one node.
#[derive(Debug)]
pub struct Server {
    addr: SocketAddr,
    router: Router,
    acceptor: Mutex<Option<JoinHandle<()>>>,
    conns: Arc<Connections>,
}

impl Server {
    /// Binds `addr` and starts accepting. Port 0 picks one below the kernel's ephemeral range
    /// ([`super::port`]), so that no listener bound meanwhile takes it while the node is
    /// stopped for a restart.
    pub async fn start(router: Router, addr: SocketAddr) -> io::Result<Server> {
        let listener = match addr.port() {
            0 => bind_unclaimed(addr)?,
            _ => bind(addr)?,
        };
        let server = Server {
            addr: listener.local_addr()?,
            router,
            acceptor: Mutex::new(None),
            conns: Arc::new(Connections::default()),
        };
        server.accept_on(listener);
        Ok(server)
    }

    /// The bound address, with the actual port.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Closes the listener and aborts every connection; returns once all are gone.
    pub async fn stop(&self) {
        let acceptor = self.acceptor.lock().take();
        if let Some(acceptor) = acceptor {
            acceptor.abort();
            let _ = acceptor.await;
        }
        for conn in self.conns.abort_all() {
            let _ = conn.await;
        }
    }

    /// Listens again on the same port. Does nothing if already listening.
    pub async fn restart(&self) -> io::Result<()> {
        if self.acceptor.lock().is_some() {
            return Ok(());
        }
        self.accept_on(bind(self.addr)?);
        Ok(())
    }

    fn accept_on(&self, listener: TcpListener) {
        let task = tokio::spawn(accept_loop(
            listener,
            self.router.clone(),
            Arc::clone(&self.conns),
        ));
        *self.acceptor.lock() = Some(task);
    }

    /// Synchronous teardown for `Drop`: aborts without waiting.
    pub fn abort(&self) {
        if let Some(acceptor) = self.acceptor.lock().take() {
            acceptor.abort();
        }
        self.conns.abort_all();
    }
}

/// [`bind`] on a port of [`super::port::unclaimed_port_on`]; another one if something else
/// took it meanwhile.
fn bind_unclaimed(addr: SocketAddr) -> io::Result<TcpListener> {
    let mut last = None;
    for _ in 0..5 {
        let port = super::port::unclaimed_port_on(addr.ip())?;
        match bind(SocketAddr::new(addr.ip(), port)) {
            Ok(listener) => return Ok(listener),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| io::Error::other("no port")))
}

/// A listening socket with `SO_REUSEADDR`, so a restart can take the port back while the
/// aborted connections sit in TIME_WAIT.
fn bind(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(1024)
}

async fn accept_loop(listener: TcpListener, router: Router, conns: Arc<Connections>) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => conns.spawn(stream, router.clone()),
            Err(e) => {
                // Out of file descriptors and the like: back off instead of spinning.
                log::warn!("stand-in accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

/// Open connections, each a task that removes itself when done.
#[derive(Debug, Default)]
struct Connections {
    next_id: AtomicU64,
    live: Mutex<HashMap<u64, JoinHandle<()>>>,
}

impl Connections {
    fn spawn(self: &Arc<Self>, stream: TcpStream, router: Router) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let conns = Arc::clone(self);
        // Holding the lock while spawning guarantees the insert happens before the task can
        // remove its own entry.
        let mut live = self.live.lock();
        let task = tokio::spawn(async move {
            serve_connection(stream, router).await;
            conns.live.lock().remove(&id);
        });
        live.insert(id, task);
    }

    /// Aborts every connection and hands back their handles to await.
    fn abort_all(&self) -> Vec<JoinHandle<()>> {
        let handles: Vec<_> = self.live.lock().drain().map(|(_, h)| h).collect();
        for handle in &handles {
            handle.abort();
        }
        handles
    }
}

/// Serves HTTP/1.1 on one connection until the client leaves or a handler closes it.
async fn serve_connection(stream: TcpStream, router: Router) {
    // Tokens are small writes that must leave at once, not wait for Nagle.
    let _ = stream.set_nodelay(true);
    let control = ConnControl::default();
    let closer = control.clone();
    let tower = TowerToHyperService::new(router);
    let service = hyper::service::service_fn(move |mut req: Request<Incoming>| {
        req.extensions_mut().insert(control.clone());
        tower.call(req)
    });
    let conn = http1::Builder::new().serve_connection(TokioIo::new(stream), service);
    tokio::select! {
        result = conn => {
            if let Err(e) = result {
                log::debug!("stand-in connection ended: {e}");
            }
        }
        () = closer.closed() => {}
    }
}
