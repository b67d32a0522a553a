//! Assembling the Pingora server: the proxy, its background services, and the metrics
//! endpoint, from a validated [`Config`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use pingora_core::server::Server;
use pingora_core::server::configuration::{Opt, ServerConf};
use pingora_core::services::background::background_service;
use pingora_core::services::listening::Service;

use crate::admin::Admin;
use crate::config::Config;
use crate::fleet::{Checker, Fleet, Poller, Rules};
use crate::metrics::{FleetCollector, Metrics};
use crate::proxy::{AccessLog, ClientConnections, Corral};
use crate::reload::Reloader;
use crate::routing::Router;

/// Pingora waits this long after SIGTERM by default (300 s): far too long for a router
/// whose requests are retried by clients anyway. Used unless the config file sets one.
const GRACE_PERIOD_SECONDS: u64 = 10;
const GRACEFUL_SHUTDOWN_TIMEOUT_SECONDS: u64 = 10;
/// The longest the first poll and health check may delay the start.
const FIRST_LOOK: Duration = Duration::from_secs(2);

/// Builds a ready-to-run server. `opt` carries Pingora's command-line flags (`-c`, `-d`,
/// `-t`, `-u`); the configuration file named by `-c` is read by both Pingora and corral.
pub fn build(config: Config, mut opt: Opt) -> Result<Server, String> {
    if !opt.upgrade && !opt.test {
        check_free(&config)?;
    }
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
    let router = Arc::new(Router::new(fleet.clone(), &config));
    let rules = Rules::of(&config);
    let poller = Poller::new(
        fleet.clone(),
        config.poll.interval,
        config.poll.timeout,
        rules,
    );
    let checker = Checker::new(
        fleet.clone(),
        config.health.interval,
        config.poll.timeout,
        rules,
    );
    first_look(&poller, &checker);

    let metrics = Arc::new(Metrics::register().map_err(|e| format!("metrics: {e}"))?);
    // After the first poll: the nodes' models are known.
    metrics.count_fleet(&fleet);
    prometheus::register(Box::new(
        FleetCollector::new(router.clone(), metrics.clone())
            .map_err(|e| format!("metrics: {e}"))?,
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

    if let Some(shared) = router.shared.clone() {
        let syncer = crate::shared::Syncer::new(shared, router.clone());
        let service = crate::shared::Service(Arc::new(syncer));
        server.add_service(background_service("shared state", service));
    }
    server.add_service(background_service("health checks", checker));
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

/// Every address corral listens on must be free, unless it takes the sockets over from a
/// running corral (`-u`): Pingora retries an address in use for half a minute (it expects an
/// old process to let go), while clients reach whatever holds it.
fn check_free(config: &Config) -> Result<(), String> {
    let addresses = [
        ("listen", Some(&config.listen)),
        ("metrics_listen", config.metrics_listen.as_ref()),
        ("admin_listen", config.admin_listen.as_ref()),
    ];
    for (key, address) in addresses {
        let Some(address) = address else { continue };
        // Bound and let go at once: only whether it can be.
        if let Err(e) = std::net::TcpListener::bind(address.as_str()) {
            return Err(format!(
                "{key}: cannot listen on {address}: {e} (another corral or server holds it? \
                 set another address)"
            ));
        }
    }
    Ok(())
}

/// Runs the first poll and health check before the listener accepts anything, so that the
/// first requests are routed on what the nodes say rather than on defaults: nodes that
/// refuse are down, models are known. Bounded by [`FIRST_LOOK`]: a node that does not
/// answer in time keeps its default (up) and is judged by the background tasks.
fn first_look(poller: &Poller, checker: &Checker) {
    let started = Instant::now();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            log::warn!("first poll skipped: {e}");
            return;
        }
    };
    let round = async { tokio::join!(poller.poll_all(), checker.check_all()) };
    match runtime.block_on(async { tokio::time::timeout(FIRST_LOOK, round).await }) {
        Ok(_) => log::info!("first poll and health check took {:?}", started.elapsed()),
        Err(_) => {
            log::warn!("first poll and health check not done within {FIRST_LOOK:?}; starting")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_in_use_is_refused_before_anything_starts() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let config = Config {
            listen: taken.local_addr().unwrap().to_string(),
            metrics_listen: None,
            admin_listen: None,
            ..Config::default()
        };
        let e = check_free(&config).unwrap_err();
        assert!(
            e.starts_with(&format!("listen: cannot listen on {}", config.listen)),
            "{e}"
        );
        drop(taken);
        assert_eq!(check_free(&config), Ok(()));
    }
}
