# Shared by scripts/bench-overhead.sh and scripts/bench-cpu.sh (sourced, not run): servers
# started pinned and stopped on exit, free loopback ports, the request bodies and wrk scripts
# of the three scenarios, and corral's configuration in front of the bench backend.
#
# The sourcing script sets WORK (a scratch directory, removed on exit) and BENCH (corral-bench)
# first. Every server listens on 127.0.0.1 only.

# Servers started in the background; stopped when the script exits.
PIDS=()

bench_cleanup() {
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
    rm -rf "$WORK"
}
trap bench_cleanup EXIT

# Runs a command pinned to a CPU where there is more than one.
on_cpu() {
    local cpu=$1
    shift
    if (($(nproc) > 1)); then taskset -c "$cpu" "$@"; else "$@"; fi
}

# Starts a server in the background, pinned, and remembers its PID for the cleanup. The
# subshell execs taskset, which execs the server: LAST_PID is the server itself.
start_on_cpu() {
    local cpu=$1
    shift
    if (($(nproc) > 1)); then
        (exec taskset -c "$cpu" "$@" >/dev/null) &
    else
        (exec "$@" >/dev/null) &
    fi
    LAST_PID=$!
    PIDS+=("$LAST_PID")
}

wait_port() {
    local port=$1
    for _ in $(seq 1 200); do
        if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then return 0; fi
        sleep 0.05
    done
    echo "nothing listens on port $port" >&2
    exit 1
}

# free_ports N: N distinct free loopback ports, in PORTS.
free_ports() {
    PORTS=()
    while ((${#PORTS[@]} < $1)); do
        local p
        p=$($BENCH free-port)
        [[ " ${PORTS[*]} " == *" $p "* ]] || PORTS+=("$p")
    done
}

# The scenarios' bodies ($WORK/<scenario>.json) and wrk scripts ($WORK/<scenario>.lua): 1k
# and 128k chat bodies, and a 1 KiB chat whose reply is streamed. Each wrk run ends with one
# line that is easy to parse:
#   RESULT <requests> <requests/s> <p50 ms> <p90 ms> <p99 ms> <errors>
write_scenarios() {
    $BENCH make-body --bytes 1024 >"$WORK/1k.json"
    $BENCH make-body --bytes 131072 >"$WORK/128k.json"
    $BENCH make-body --bytes 1024 --stream >"$WORK/stream.json"
    local scenario
    for scenario in 1k 128k stream; do
        cat >"$WORK/$scenario.lua" <<EOF
local f = assert(io.open("$WORK/$scenario.json", "rb"))
wrk.method = "POST"
wrk.body = f:read("*a")
f:close()
wrk.headers["Content-Type"] = "application/json"
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("RESULT %d %.2f %.4f %.4f %.4f %d\n", summary.requests,
    summary.requests / (summary.duration / 1e6),
    latency:percentile(50) / 1000, latency:percentile(90) / 1000,
    latency:percentile(99) / 1000,
    e.connect + e.read + e.write + e.status + e.timeout))
end
EOF
    done
}

# start_backend CPU PORT: the in-memory Ollama-shaped backend, one thread.
start_backend() {
    start_on_cpu "$1" "$BENCH" backend --listen "127.0.0.1:$2" --threads 1 --chunks 16
    wait_port "$2"
}

# corral_config FILE NAME PORT BACKEND_PORT THREADS: corral in front of the bench backend
# alone, its pid file and upgrade socket under WORK named after NAME.
corral_config() {
    local file=$1 name=$2 port=$3 backend=$4 threads=$5
    cat >"$file" <<EOF
version: 1
threads: $threads
grace_period_seconds: 0
graceful_shutdown_timeout_seconds: 1
pid_file: $WORK/$name.pid
upgrade_sock: $WORK/$name.sock
listen: 127.0.0.1:$port
metrics_listen: null
admin_listen: null
poll:
  interval: 1s
health:
  interval: 1s
nodes:
  - name: backend
    url: http://127.0.0.1:$backend
    memory_gb: 24
    # The in-memory backend has no slots to wait for: let corral send it every request at
    # once, as nginx does, instead of queueing past Ollama's usual 4 in flight.
    num_parallel: 64
EOF
}

# check_chat NAME URL: fails unless the target answers a 1 KiB chat with 200.
check_chat() {
    local code
    code=$(curl -s -o /dev/null -w '%{http_code}' -H 'Content-Type: application/json' \
        --data-binary "@$WORK/1k.json" "$2/api/chat")
    [[ $code == 200 ]] || { echo "$1 answered $code to a chat" >&2; exit 1; }
}
