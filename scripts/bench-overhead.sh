#!/usr/bin/env bash
# Proxy overhead on loopback, in one run: an in-memory Ollama-shaped backend reached
# directly, through nginx, through a bare Pingora pass-through (Pingora's own proxy loop with
# a fixed peer: the floor for any Pingora-based proxy) and through corral, for 1 KiB and
# 128 KiB chat bodies and for a streamed reply; then how long streamed chunks take to cross
# each proxy. The proxies run with 1 and then 2 worker threads; each measurement is repeated
# in ROUNDS rounds, the targets' order rotating every round, and the report gives medians
# and spreads.
#
#   scripts/bench-overhead.sh [OUT_DIR]        (default: target/bench-overhead)
#
# Writes OUT_DIR/overhead.csv (raw figures), OUT_DIR/overhead.md (tables, corral/nginx
# ratios, goals) and docs/img/overhead.png. Environment knobs:
#   DURATION=5  seconds per throughput run      LAT_DURATION=3  seconds per 1-connection run
#   CONNS=32    connections for throughput     SKIP_BUILD=1    use the binaries already built
#   ROUNDS=3    alternating rounds             THREADS="1 2"   proxy worker counts to run
#   PLOT=path   where the chart goes (default docs/img/overhead.png)
#   CORRAL=path, BENCH=path   binaries to run instead of target/release/ (to compare builds)
#
# Placement on the 2-core machines this runs on: with one thread the proxy under test gets
# CPU 0 to itself and the backend and the load generator share CPU 1; with two threads the
# proxy may use both CPUs (and competes with them). nginx runs as many workers as the others
# have threads.
# Every server listens on 127.0.0.1 only and is stopped when the script exits.
set -euo pipefail

cd "$(dirname "$0")/.."
OUT=${1:-target/bench-overhead}
DURATION=${DURATION:-5}
LAT_DURATION=${LAT_DURATION:-3}
ROUNDS=${ROUNDS:-3}
THREADS=${THREADS:-"1 2"}
CONNS=${CONNS:-32}
PLOT=${PLOT:-docs/img/overhead.png}
mkdir -p "$OUT" "$(dirname "$PLOT")"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d /tmp/corral-overhead.XXXXXX)
chmod 755 "$WORK" # nginx's worker runs as an unprivileged user
source scripts/bench-common.sh

# --- tools, from the package registries ----------------------------------------------------
need_apt=()
command -v nginx >/dev/null || need_apt+=(nginx)
command -v wrk >/dev/null || need_apt+=(wrk)
command -v taskset >/dev/null || need_apt+=(util-linux)
if ((${#need_apt[@]})); then
    echo "installing ${need_apt[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi
NGINX=$(command -v nginx)

if [[ "${SKIP_BUILD:-}" != 1 ]]; then
    cargo build --release --bins
fi
BENCH=${BENCH:-target/release/corral-bench}
CORRAL=${CORRAL:-target/release/corral}
[[ -x $BENCH && -x $CORRAL ]] || { echo "build corral first: cargo build --release --bins" >&2; exit 1; }

free_ports 4
BACKEND_PORT=${PORTS[0]} NGINX_PORT=${PORTS[1]} PINGORA_PORT=${PORTS[2]} CORRAL_PORT=${PORTS[3]}
write_scenarios

# start_proxies THREADS: nginx, bare Pingora and corral, each with THREADS workers.
PROXY_PIDS=()
start_proxies() {
    local threads=$1 cpu=0
    ((threads > 1)) && cpu=0-1
    PROXY_PIDS=()
    mkdir -p "$WORK/nginx/logs"
    cat >"$WORK/nginx/nginx.conf" <<EOF
worker_processes $threads;
daemon off;
pid $WORK/nginx/nginx.pid;
error_log $WORK/nginx/logs/error.log warn;
events { worker_connections 4096; }
http {
    access_log off;
    client_body_temp_path $WORK/nginx/body;
    proxy_temp_path $WORK/nginx/proxy;
    fastcgi_temp_path $WORK/nginx/fastcgi;
    uwsgi_temp_path $WORK/nginx/uwsgi;
    scgi_temp_path $WORK/nginx/scgi;
    upstream ollama {
        server 127.0.0.1:$BACKEND_PORT;
        keepalive 64;
    }
    server {
        listen 127.0.0.1:$NGINX_PORT;
        # Bodies up to 64 MiB, held in memory up to 1 MiB (no temporary files for 128 KiB),
        # replies streamed as they come: how nginx is set up in front of Ollama.
        client_max_body_size 64m;
        client_body_buffer_size 1m;
        location / {
            proxy_pass http://ollama;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 600s;
        }
    }
}
EOF
    start_on_cpu "$cpu" "$NGINX" -p "$WORK/nginx" -c "$WORK/nginx/nginx.conf"
    PROXY_PIDS+=("$LAST_PID")
    RUST_LOG=warn start_on_cpu "$cpu" $BENCH bare-pingora --listen "127.0.0.1:$PINGORA_PORT" \
        --upstream "127.0.0.1:$BACKEND_PORT" --threads "$threads"
    PROXY_PIDS+=("$LAST_PID")
    corral_config "$WORK/corral.yaml" corral "$CORRAL_PORT" "$BACKEND_PORT" "$threads"
    RUST_LOG=warn start_on_cpu "$cpu" $CORRAL -c "$WORK/corral.yaml"
    PROXY_PIDS+=("$LAST_PID")
    wait_port "$NGINX_PORT"
    wait_port "$PINGORA_PORT"
    wait_port "$CORRAL_PORT"
    sleep 2 # two polls: corral has seen the backend's model
    # Every target must answer a chat before anything is measured.
    for t in "${TARGETS[@]}"; do check_chat "$t" "${URL[$t]}"; done
}

stop_proxies() {
    for pid in "${PROXY_PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${PROXY_PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
}

# --- servers -------------------------------------------------------------------------------
start_backend 1 "$BACKEND_PORT"

declare -A URL=(
    [direct]="http://127.0.0.1:$BACKEND_PORT"
    [nginx]="http://127.0.0.1:$NGINX_PORT"
    [pingora]="http://127.0.0.1:$PINGORA_PORT"
    [corral]="http://127.0.0.1:$CORRAL_PORT"
)
TARGETS=(direct nginx pingora corral)

# --- measurements --------------------------------------------------------------------------
CSV="$OUT/overhead.csv"
echo "kind,scenario,target,threads,round,rps,p50_ms,p90_ms,p99_ms,errors" >"$CSV"

# wrk_run KIND SCENARIO TARGET CONNS SECONDS THREADS ROUND
wrk_run() {
    local kind=$1 scenario=$2 target=$3 conns=$4 secs=$5 threads=$6 round=$7
    local line
    line=$(on_cpu 1 wrk -t1 -c"$conns" -d"${secs}s" --timeout 10s -s "$WORK/$scenario.lua" \
        "${URL[$target]}/api/chat" | grep '^RESULT') || { echo "wrk failed on $target" >&2; exit 1; }
    read -r _ _ rps p50 p90 p99 errors <<<"$line"
    echo "$kind,$scenario,$target,$threads,$round,$rps,$p50,$p90,$p99,$errors" | tee -a "$CSV"
}

for threads in $THREADS; do
    start_proxies "$threads"
    for round in $(seq 1 "$ROUNDS"); do
        # The targets in a rotated order each round, so that no target always runs first.
        shift_by=$((round % ${#TARGETS[@]}))
        order=("${TARGETS[@]:shift_by}" "${TARGETS[@]:0:shift_by}")
        for scenario in 1k 128k stream; do
            for t in "${order[@]}"; do
                on_cpu 1 wrk -t1 -c"$CONNS" -d1s -s "$WORK/$scenario.lua" "${URL[$t]}/api/chat" >/dev/null # warm-up
                wrk_run throughput "$scenario" "$t" "$CONNS" "$DURATION" "$threads" "$round"
                wrk_run latency "$scenario" "$t" 1 "$LAT_DURATION" "$threads" "$round"
            done
        done
        # Streamed chunks 2 ms apart, 20 replies of 50 chunks: delivery delay per chunk.
        for t in "${order[@]}"; do
            line=$(on_cpu 1 $BENCH stream-probe --url "${URL[$t]}" --target "$t" --requests 20 \
                --chunks 50 --interval-us 2000)
            # stream-probe prints kind,scenario,target,...: threads and round go after target.
            IFS=, read -r kind scenario target rest <<<"$line"
            echo "$kind,$scenario,$target,$threads,$round,$rest" | tee -a "$CSV"
        done
    done
    stop_proxies
done

# --- report --------------------------------------------------------------------------------
{
    echo "Machine: $(nproc) CPUs, $(lscpu | sed -n 's/^Model name: *//p'), $(free -g | awk '/^Mem:/ {print $2}') GiB;"
    echo "$($NGINX -v 2>&1), $(wrk -v 2>&1 | head -1 | cut -d' ' -f1-2), corral $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    echo
    $BENCH overhead-report --csv "$CSV" --plot "$PLOT"
} | tee "$OUT/overhead.md"
