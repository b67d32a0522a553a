#!/usr/bin/env bash
# Checks corral's Prometheus endpoint end to end, on loopback only:
#
#   1. starts `corral demo` for its three simulated Ollama nodes, a stand-in node that resets
#      every generation request (to cause retries and upstream errors), and a corral in front
#      of all four with metrics and admin API on free 127.0.0.1 ports;
#   2. sends traffic with curl: chat, a stream, a follow-up, an OpenAI-style chat and its
#      follow-up, a generate, a cold load that is retried on another node, an unknown model;
#   3. scrapes /metrics, runs `promtool check metrics` on the scrape, and checks that every
#      metric family docs/metrics.md documents is there, with the label values the Grafana
#      dashboard filters on.
#
# Exits non-zero on any problem; stops every process it started. Needs cargo (or CORRAL_BIN),
# curl and python3; fetches promtool from Debian's prometheus package when it is missing
# (the binary only: no Prometheus server is installed or started).
#
#   scripts/check-metrics.sh            # builds target/debug/corral first
#   CORRAL_BIN=target/release/corral scripts/check-metrics.sh
set -euo pipefail
cd "$(dirname "$0")/.."

work=$(mktemp -d "${TMPDIR:-/tmp}/corral-check-metrics.XXXXXX")
pids=()

cleanup() {
  local pid
  for pid in "${pids[@]}"; do
    kill "$pid" 2>/dev/null || true
  done
  for pid in "${pids[@]}"; do
    # Bounded: corral's grace period is 0 here; anything still alive after 5 s is killed.
    for _ in $(seq 50); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    kill -9 "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  if [[ "${KEEP_WORK:-}" == 1 ]]; then
    echo "check-metrics: kept $work"
  else
    rm -rf "$work"
  fi
}
trap cleanup EXIT

fail() {
  echo "check-metrics: FAIL: $*" >&2
  for log in "$work"/*.log; do
    [[ -s "$log" ]] || continue
    echo "--- $log (last lines)" >&2
    tail -n 20 "$log" >&2
  done
  exit 1
}

step() { echo "check-metrics: $*"; }

for tool in curl python3; do
  command -v "$tool" >/dev/null 2>&1 || fail "$tool is required"
done

# --- promtool -----------------------------------------------------------------------------
promtool=$(command -v promtool || true)
if [[ -z "$promtool" ]]; then
  promtool="${CARGO_TARGET_DIR:-target}/tools/promtool"
  if [[ ! -x "$promtool" ]]; then
    step "promtool not found: extracting it from Debian's prometheus package"
    mkdir -p "$work/deb"
    if ! (cd "$work/deb" && apt-get download prometheus >/dev/null 2>&1); then
      [[ $(id -u) == 0 ]] || fail "promtool missing; install it (apt-get install prometheus) and retry"
      apt-get update -qq >/dev/null
      (cd "$work/deb" && apt-get download prometheus >/dev/null) || fail "apt-get download prometheus failed"
    fi
    dpkg-deb -x "$work"/deb/prometheus_*.deb "$work/deb/root"
    mkdir -p "$(dirname "$promtool")"
    install -m 0755 "$work/deb/root/usr/bin/promtool" "$promtool"
  fi
fi
step "using $("$promtool" --version 2>&1 | head -n 1)"

# --- corral binary ------------------------------------------------------------------------
if [[ -n "${CORRAL_BIN:-}" ]]; then
  corral=$CORRAL_BIN
else
  step "building corral (debug)"
  cargo build --locked --quiet --bin corral || fail "cargo build failed"
  corral="${CARGO_TARGET_DIR:-target}/debug/corral"
fi
[[ -x "$corral" ]] || fail "no corral binary at $corral"

# --- ports --------------------------------------------------------------------------------
read -r demo_port proxy_port metrics_port admin_port flaky_port < <(python3 -c '
import socket
socks = [socket.socket() for _ in range(5)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*[s.getsockname()[1] for s in socks])
')

wait_http() { # url, what
  local deadline=$((SECONDS + 30))
  until curl -fsS --max-time 2 -o /dev/null "$1" 2>/dev/null; do
    ((SECONDS < deadline)) || fail "$2 did not answer at $1 within 30 s"
    sleep 0.2
  done
}

# --- the simulated fleet: `corral demo` -----------------------------------------------------
cat >"$work/demo.yaml" <<EOF
threads: 1
grace_period_seconds: 0
graceful_shutdown_timeout_seconds: 1
pid_file: $work/demo.pid
upgrade_sock: $work/demo.sock
metrics_listen: null
admin_listen: null
EOF
RUST_LOG=warn "$corral" -c "$work/demo.yaml" demo --listen "127.0.0.1:$demo_port" \
  >"$work/demo.out" 2>"$work/demo.log" &
pids+=($!)
wait_http "http://127.0.0.1:$demo_port/" "corral demo"
# Its banner lists the nodes: "  desktop  http://127.0.0.1:PORT  24 GB, 4 slots".
mapfile -t fleet < <(awk '$2 ~ /^http:\/\/127\.0\.0\.1:[0-9]+$/ { print $1, $2, $3, $5 }' "$work/demo.out")
((${#fleet[@]} == 3)) || fail "expected 3 demo nodes in the banner, got: ${fleet[*]:-none}"

# --- a node that passes health checks and lists a model, then resets every POST ------------
cat >"$work/flaky.py" <<'EOF'
import json, socket, struct, sys, threading

MODEL = {"name": "qwen2.5:14b", "model": "qwen2.5:14b", "size": 9000000000,
         "size_vram": 9000000000, "expires_at": "2099-01-01T00:00:00Z", "context_length": 8192}
BODIES = {
    "/": (b"Ollama is running", "text/plain"),
    "/api/version": (json.dumps({"version": "0.0.0-flaky"}).encode(), "application/json"),
    "/api/tags": (json.dumps({"models": [MODEL]}).encode(), "application/json"),
    "/api/ps": (json.dumps({"models": [MODEL]}).encode(), "application/json"),
}

def serve(conn):
    with conn:
        conn.settimeout(10)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return
            data += chunk
        method, path = data.split(b" ", 2)[:2]
        if method in (b"GET", b"HEAD") and path.decode() in BODIES:
            body, ctype = BODIES[path.decode()]
            head = (f"HTTP/1.1 200 OK\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                    "Connection: close\r\n\r\n").encode()
            conn.sendall(head + (body if method == b"GET" else b""))
        elif method == b"POST":
            # Reset before any byte of a reply: corral must retry on the next node.
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        else:
            conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

server = socket.create_server(("127.0.0.1", int(sys.argv[1])))
while True:
    c, _ = server.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
EOF
python3 "$work/flaky.py" "$flaky_port" >"$work/flaky.log" 2>&1 &
pids+=($!)
wait_http "http://127.0.0.1:$flaky_port/" "the flaky node"

# --- corral under test ----------------------------------------------------------------------
{
  cat <<EOF
threads: 1
grace_period_seconds: 0
graceful_shutdown_timeout_seconds: 1
pid_file: $work/corral.pid
upgrade_sock: $work/corral.sock
listen: 127.0.0.1:$proxy_port
metrics_listen: 127.0.0.1:$metrics_port
admin_listen: 127.0.0.1:$admin_port
poll:
  interval: 200ms
  timeout: 1s
health:
  interval: 1s
nodes:
EOF
  for line in "${fleet[@]}"; do
    read -r name url gb slots <<<"$line"
    printf '  - name: %s\n    url: %s\n    memory_gb: %s\n    num_parallel: %s\n' \
      "$name" "$url" "$gb" "${slots:-2}"
  done
  printf '  - name: flaky\n    url: http://127.0.0.1:%s\n    num_parallel: 2\n' "$flaky_port"
} >"$work/corral.yaml"
RUST_LOG=warn "$corral" -c "$work/corral.yaml" >"$work/corral.out" 2>"$work/corral.log" &
pids+=($!)
proxy="http://127.0.0.1:$proxy_port"
wait_http "$proxy/" "corral"
wait_http "http://127.0.0.1:$metrics_port/metrics" "corral's metrics endpoint"
sleep 1 # a few polls: every node's models known

# --- traffic ------------------------------------------------------------------------------
# post PATH BODY EXPECTED_STATUS NAME: the reply's headers land in $work/NAME.headers.
post() {
  local path=$1 body=$2 want=$3 name=$4 got
  got=$(curl -sS --max-time 60 -o "$work/$name.body" -D "$work/$name.headers" \
    -w '%{http_code}' -H 'Content-Type: application/json' -d "$body" "$proxy$path") ||
    fail "$name: curl failed"
  [[ "$got" == "$want" ]] || fail "$name: status $got, expected $want: $(head -c 300 "$work/$name.body")"
  step "$name: $got $(tr -d '\r' <"$work/$name.headers" | grep -i '^x-fleet-' | tr '\n' ' ')"
}
fleet_header() { tr -d '\r' <"$work/$1.headers" | awk -v h="$2" 'tolower($1) == tolower(h) ":" { print $2 }'; }

post /api/chat '{"model":"llama3:8b","stream":false,"messages":[{"role":"user","content":"Why is the sky blue?"}]}' 200 chat
post /api/chat '{"model":"llama3:8b","stream":true,"messages":[{"role":"user","content":"Tell me a story about a corral."}]}' 200 stream
post /api/chat '{"model":"llama3:8b","stream":false,"messages":[{"role":"user","content":"Why is the sky blue?"},{"role":"assistant","content":"Rayleigh scattering."},{"role":"user","content":"And sunsets?"}]}' 200 follow-up
[[ "$(fleet_header follow-up X-Fleet-Affinity)" == hit ]] ||
  fail "the follow-up was not an affinity hit (X-Fleet-Affinity: $(fleet_header follow-up X-Fleet-Affinity))"
post /v1/chat/completions '{"model":"llama3:8b","messages":[{"role":"user","content":"Name three rivers."}]}' 200 openai
post /v1/chat/completions '{"model":"llama3:8b","messages":[{"role":"user","content":"Name three rivers."},{"role":"assistant","content":"Nile, Amazon, Yangtze."},{"role":"user","content":"And lakes?"}]}' 200 openai-follow-up
post /api/generate '{"model":"llama3:8b","stream":false,"prompt":"Once upon a time"}' 200 generate
# qwen2.5:14b is resident only on the flaky node, which resets the connection: the request
# is retried on a demo node that must load it first (a cold load, and a load in the reply).
post /api/chat '{"model":"qwen2.5:14b","stream":false,"messages":[{"role":"user","content":"Hello"}]}' 200 retried-cold-load
[[ "$(fleet_header retried-cold-load X-Fleet-Retries)" == 1 ]] ||
  fail "the request to the flaky node was not retried once (X-Fleet-Retries: $(fleet_header retried-cold-load X-Fleet-Retries))"
post /api/chat '{"model":"no-such-model:1b","messages":[{"role":"user","content":"Hello"}]}' 404 unknown-model

# The admin API, briefly.
admin="http://127.0.0.1:$admin_port"
# 200 with "ok" in the body (plain text or {"status":"ok"}).
curl -fsS --max-time 5 "$admin/healthz" | grep -q ok || fail "admin GET /healthz did not answer 200 ok"
curl -fsS --max-time 5 "$admin/fleet" | python3 -m json.tool >/dev/null || fail "admin GET /fleet is not JSON"
curl -fsS --max-time 5 -H 'Content-Type: application/json' \
  -d '{"model":"llama3:8b","messages":[{"role":"user","content":"Why is the sky blue?"}]}' \
  "$admin/explain" >"$work/explain.body" || fail "admin POST /explain failed"
step "admin: /healthz, /fleet and /explain answer"

# --- scrape and check -----------------------------------------------------------------------
sleep 1 # one more poll and health check
scrape="$work/metrics.txt"
curl -fsS --max-time 10 -D "$work/metrics.headers" -o "$scrape" "http://127.0.0.1:$metrics_port/metrics" ||
  fail "scraping /metrics failed"
step "scraped $(grep -vc '^#' "$scrape") samples"

step "promtool check metrics:"
if ! "$promtool" check metrics <"$scrape"; then
  fail "promtool check metrics reported problems (above)"
fi
step "promtool check metrics: no problems"

# The Prometheus config that docker-compose.yml mounts.
"$promtool" check config deploy/prometheus.yml >/dev/null ||
  fail "promtool check config deploy/prometheus.yml failed"
step "promtool check config deploy/prometheus.yml: valid"

missing=()
# family: a sample of it must be in the scrape (histograms by their _bucket series).
for family in \
  corral_requests_total corral_affinity_total corral_cold_loads_total corral_model_loads_total \
  corral_prompt_tokens_total corral_prompt_tokens_estimated_total corral_retries_total \
  corral_upstream_errors_total corral_node_up corral_in_flight corral_queue_depth \
  corral_resident_models corral_model_resident corral_affinity_entries corral_node_success_ratio \
  corral_handoffs_total; do
  grep -Eq "^$family(\{| )" "$scrape" || missing+=("$family")
done
for family in corral_request_duration_seconds corral_time_to_first_token_seconds corral_queue_wait_seconds \
  corral_winning_score; do
  grep -Eq "^${family}_bucket\{" "$scrape" || missing+=("$family (histogram)")
  grep -Eq "^# TYPE $family histogram$" "$scrape" || missing+=("$family: TYPE histogram")
done
# Label values the dashboard's queries select on.
expect() { # description, extended regexp over the scrape
  grep -Eq "$2" "$scrape" || missing+=("$1")
}
expect 'corral_affinity_total{result="hit"}' '^corral_affinity_total\{.*result="hit".*\} [1-9]'
expect 'corral_affinity_total{result="new"}' '^corral_affinity_total\{.*result="new".*\} [1-9]'
expect 'corral_prompt_tokens_total{kind="evaluated"}' '^corral_prompt_tokens_total\{.*kind="evaluated".*\} [1-9]'
expect 'corral_prompt_tokens_total{kind="cached"}' '^corral_prompt_tokens_total\{.*kind="cached".*\} [1-9]'
expect 'corral_requests_total{node="none",status="404"}' '^corral_requests_total\{.*node="none".*status="404".*\} [1-9]'
expect 'corral_requests_total{endpoint="/api/chat"}' '^corral_requests_total\{endpoint="/api/chat",.*status="200".*\} [1-9]'
expect 'corral_retries_total{node="flaky"}' '^corral_retries_total\{.*node="flaky".*\} [1-9]'
expect 'corral_upstream_errors_total{node="flaky"}' '^corral_upstream_errors_total\{.*node="flaky".*\} [1-9]'
expect 'corral_cold_loads_total{model="qwen2.5:14b"}' '^corral_cold_loads_total\{.*model="qwen2.5:14b".*\} [1-9]'
expect 'corral_model_loads_total{model="qwen2.5:14b"}' '^corral_model_loads_total\{.*model="qwen2.5:14b".*\} [1-9]'
expect 'corral_node_up{node="flaky"} 1' '^corral_node_up\{node="flaky"\} 1$'
expect 'corral_model_resident{node="flaky"}' '^corral_model_resident\{.*node="flaky".*\} 1$'
expect 'corral_winning_score_count > 0' '^corral_winning_score_count [1-9]'

if ((${#missing[@]})); then
  printf '  missing: %s\n' "${missing[@]}" >&2
  fail "${#missing[@]} expected series missing from the scrape (KEEP_WORK=1 keeps it in $work/metrics.txt)"
fi
step "OK: every documented metric family is exported and passes promtool"
