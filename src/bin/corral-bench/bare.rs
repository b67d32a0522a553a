//! `corral-bench bare-pingora`: the floor any Pingora-based proxy stands on. Pingora's own
//! proxy loop with one fixed peer and nothing else: no body read, no scoring, no metrics.
//! scripts/bench-overhead.sh measures corral against it in the same run, so what corral adds
//! over Pingora is told apart from what Pingora costs against nginx.

use std::net::SocketAddr;

use async_trait::async_trait;
use pingora_core::Result;
use pingora_core::server::Server;
use pingora_core::server::configuration::{Opt, ServerConf};
use pingora_core::upstreams::peer::HttpPeer;
use pingora_proxy::{ProxyHttp, Session};

struct PassThrough {
    upstream: SocketAddr,
}

#[async_trait]
impl ProxyHttp for PassThrough {
    type CTX = ();

    fn new_ctx(&self) {}

    async fn upstream_peer(&self, _session: &mut Session, _ctx: &mut ()) -> Result<Box<HttpPeer>> {
        Ok(Box::new(HttpPeer::new(self.upstream, false, String::new())))
    }
}

/// Serves until the process is killed.
pub fn serve(listen: SocketAddr, upstream: SocketAddr, threads: usize) -> Result<(), String> {
    let conf = ServerConf {
        threads: threads.max(1),
        grace_period_seconds: Some(0),
        graceful_shutdown_timeout_seconds: Some(1),
        ..ServerConf::default()
    };
    let mut server = Server::new_with_opt_and_conf(Opt::default(), conf);
    server.bootstrap();
    let mut proxy =
        pingora_proxy::http_proxy_service(&server.configuration, PassThrough { upstream });
    proxy.add_tcp(&listen.to_string());
    server.add_service(proxy);
    server.run_forever()
}
