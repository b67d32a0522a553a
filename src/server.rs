//! Assembling the Pingora server: the proxy, its background services, and the metrics
//! endpoint, from a validated [`Config`].

use std::sync::Arc;

use futures::FutureExt;
use pingora_core::server::Server;
use pingora_core::server::configuration::{Opt, ServerConf};
use pingora_core::services::background::background_service;
use pingora_core::services::listening::Service;

use crate::admin::Admin;
use crate::config::Config;
use crate::fleet::{Fleet, Poller};
use crate::metrics::{FleetCollector, Metrics};
use crate::proxy::{AccessLog, ClientConnections, Corral};
use crate::reload::Reloader;
use crate::routing::Router;

/// Pingora waits this long after SIGTERM by default (300 s): far too long for a router
/// whose requests are retried by clients anyway. Used unless the config file sets one.
const GRACE_PERIOD_SECONDS: u64 = 10;
const GRACEFUL_SHUTDOWN_TIMEOUT_SECONDS: u64 = 10;

/// Builds a ready-to-run server. `opt` carries Pingora's command-line flags (`-c`, `-d`,
/// `-t`, `-u`); the configuration file named by `-c` is read by both Pingora and corral.
pub fn build(config: Config, mut opt: Opt) -> Result<Server, String> {
    let mut server_conf = match &opt.conf {
        Some(_) => ServerConf::load_yaml_with_opt_override(&opt).map_err(|e| e.to_string())?,
        None => ServerConf::new_with_opt_override(&opt).unwrap_or_default(),
    };
    server_conf
        .grace_period_seconds
        .get_or_insert(GRACE_PERIOD_SECONDS);
    server_conf
        .graceful_shutdown_timeout_seconds
        .get_or_insert(GRACEFUL_SHUTDOWN_TIMEOUT_SECONDS);
    // The file is read; Pingora would only warn that it ignores the path.
    let config_path = opt.conf.take();
    let mut server = Server::new_with_opt_and_conf(opt, server_conf);
    server.bootstrap();

    let fleet = Arc::new(Fleet::new(&config)?);
    // Static discovery resolves at once; it only registers the nodes with the checks.
    fleet
        .start()
        .now_or_never()
        .unwrap_or_else(|| Err("node discovery did not complete".into()))?;
    let router = Arc::new(Router::new(fleet.clone(), &config));

    let metrics = Arc::new(Metrics::register().map_err(|e| format!("metrics: {e}"))?);
    prometheus::register(Box::new(
        FleetCollector::new(router.clone()).map_err(|e| format!("metrics: {e}"))?,
    ))
    .map_err(|e| format!("metrics: {e}"))?;
    let access_log = Arc::new(AccessLog::open(&config.access_log)?);
    let proxy = pingora_proxy::http_proxy(
        &server.configuration,
        Corral::new(router.clone(), metrics.clone(), access_log.clone()),
    );
    let connections = ClientConnections::new(proxy, router.clone(), metrics, access_log);
    let mut proxy = Service::new("corral proxy".into(), connections);
    proxy.add_tcp(&config.listen);
    server.add_service(proxy);

    server.add_service(background_service("health checks", fleet.health_service()));
    let poller = Poller::new(
        fleet.clone(),
        config.poll.interval,
        config.poll.timeout,
        config.breaker.cooldown,
    );
    server.add_service(background_service("fleet poller", poller));

    if let Some(path) = config_path {
        let reloader = Reloader::new(path.into(), router.clone());
        server.add_service(background_service("config reload", reloader));
    }
    if let Some(addr) = &config.admin_listen {
        let admin = Admin::new(router);
        let mut service = Service::new("corral admin".into(), admin);
        service.add_tcp(addr);
        server.add_service(service);
    }
    if let Some(addr) = &config.metrics_listen {
        let mut metrics = pingora_prometheus::prometheus_http_service();
        metrics.add_tcp(addr);
        server.add_service(metrics);
    }
    Ok(server)
}
