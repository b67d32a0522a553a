# syntax=docker/dockerfile:1
# corral: a cache-aware load balancer for Ollama fleets.
#
#   docker build -t corral .
#   docker run --rm -p 11435:11435 -v "$PWD/conf:/etc/corral:ro" corral
#
# The configuration is mounted, not built in: the default command reads
# /etc/corral/corral.yaml. Inside a container every listen address that must be reached from
# outside it (listen, metrics_listen, admin_listen) has to be 0.0.0.0: see docs/deploy.md and
# deploy/corral.yaml.

# --- build -------------------------------------------------------------------------------
FROM rust:1.95-bookworm AS builder

# pingora-core builds zlib-ng with cmake.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends cmake \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /src
# The whole workspace (less .dockerignore): Cargo checks every target the manifest declares,
# benches included, even when it builds one binary.
COPY . .
# --no-default-features: the router alone, without the demo's simulated nodes (the `demo`
# feature) and corral-bench's plotting stack (`bench`); scripts/check-lean.sh checks that.
# The caches keep the registry and target/ between builds (BuildKit); the binary is copied
# out of the cached target/ in the same step.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --no-default-features --bin corral \
    && install -m 0755 target/release/corral /usr/local/bin/corral

# --- run ---------------------------------------------------------------------------------
FROM debian:bookworm-slim

# ca-certificates: nodes may be https:// URLs.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 corral \
    && useradd --system --uid 10001 --gid corral --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin corral \
    && mkdir -p /etc/corral

COPY --from=builder /usr/local/bin/corral /usr/local/bin/corral

# Numeric, so that runtimes which check for a non-root user can tell without the image's
# /etc/passwd.
USER 10001:10001
# 11435 the Ollama-compatible proxy, 9435 Prometheus metrics, 9436 the admin API.
EXPOSE 11435 9435 9436

# The proxy answers GET / with 200 "Ollama is running", as Ollama does. bash's /dev/tcp
# keeps curl out of the image. Adjust the port if the config's `listen` uses another.
HEALTHCHECK --interval=30s --timeout=5s --start-period=10s --retries=3 \
    CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/11435 && printf 'GET / HTTP/1.0\\r\\n\\r\\n' >&3 && grep -q 'Ollama is running' <&3"]

# SIGTERM stops accepting and lets requests in flight finish for grace_period_seconds.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/corral"]
CMD ["-c", "/etc/corral/corral.yaml"]
