#!/usr/bin/env bash
# CPU time per request of corral and of a bare Pingora pass-through, which a shared machine
# disturbs much less than it disturbs throughput: each proxy runs with 1 worker thread pinned
# to CPU 0, the bench backend and wrk share CPU 1, and for each target in turn wrk drives
# DURATION seconds of requests while the proxy's CPU time (user + system time of
# /proc/<pid>/stat, in clock ticks: 10 ms at 100 Hz, under 1% of a 3 s run) is read before
# and after. Per request =
# CPU time / requests served. Targets run in a rotated order each round; the report gives
# medians and min-max over the rounds, and Pingora's CPU per request over corral's (the
# throughput ratio a proxy bound by its own CPU would reach).
#
#   scripts/bench-cpu.sh [OUT_DIR]                         (default: target/bench-cpu)
#
# Environment knobs:
#   DURATION=3  seconds per measurement   ROUNDS=3  rounds   CONNS=32  wrk connections
#   SCENARIOS="1k 128k stream"            CORRAL=path, BENCH=path (default target/release/)
#   BASE=path   a second corral binary measured alongside (e.g. the build before a change)
#   OTHERS="name=path ..."  more corral binaries measured alongside, under those names
#   BASE_BENCH=path  a second corral-bench whose bare Pingora is measured alongside, as
#               pingora-base (e.g. one built on another allocator)
# Writes OUT_DIR/cpu.csv. Builds nothing: build the release binaries first. Every server
# listens on 127.0.0.1 only and is stopped when the script exits.
set -euo pipefail

cd "$(dirname "$0")/.."
OUT=${1:-target/bench-cpu}
DURATION=${DURATION:-3}
ROUNDS=${ROUNDS:-3}
CONNS=${CONNS:-32}
SCENARIOS=${SCENARIOS:-"1k 128k stream"}
BENCH=${BENCH:-target/release/corral-bench}
CORRAL=${CORRAL:-target/release/corral}
BASE=${BASE:-}
BASE_BENCH=${BASE_BENCH:-}
OTHERS=${OTHERS:-}
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/corral-cpu.XXXXXX)
source scripts/bench-common.sh

for tool in wrk taskset; do
    command -v $tool >/dev/null || { echo "bench-cpu: needs $tool (apt-get install wrk util-linux)" >&2; exit 1; }
done
[[ -x $BENCH && -x $CORRAL ]] || { echo "bench-cpu: build first: cargo build --release --bins" >&2; exit 1; }

# Nanoseconds of CPU the process has used, all threads, user and system (fields 14 and 15 of
# /proc/<pid>/stat, counted after the command name, which may hold spaces).
TICK_NS=$((1000000000 / $(getconf CLK_TCK)))
cpu_ns() {
    local stat
    stat=$(cat /proc/"$1"/stat)
    read -r -a f <<<"${stat##*) }"
    echo $(((f[11] + f[12]) * TICK_NS))
}

free_ports $((5 + $(wc -w <<<"$OTHERS")))
write_scenarios

start_backend 1 "${PORTS[0]}"
declare -A PID URL
RUST_LOG=warn start_on_cpu 0 "$BENCH" bare-pingora --listen "127.0.0.1:${PORTS[1]}" \
    --upstream "127.0.0.1:${PORTS[0]}" --threads 1
PID[pingora]=$LAST_PID URL[pingora]="http://127.0.0.1:${PORTS[1]}"
TARGETS=(pingora)
if [[ -n $BASE_BENCH ]]; then
    RUST_LOG=warn start_on_cpu 0 "$BASE_BENCH" bare-pingora --listen "127.0.0.1:${PORTS[4]}" \
        --upstream "127.0.0.1:${PORTS[0]}" --threads 1
    PID[pingora-base]=$LAST_PID URL[pingora-base]="http://127.0.0.1:${PORTS[4]}"
    TARGETS+=(pingora-base)
fi

# start_corral NAME BINARY PORT
start_corral() {
    local name=$1 binary=$2 port=$3
    corral_config "$WORK/$name.yaml" "$name" "$port" "${PORTS[0]}" 1
    RUST_LOG=warn start_on_cpu 0 "$binary" -c "$WORK/$name.yaml"
    PID[$name]=$LAST_PID URL[$name]="http://127.0.0.1:$port"
    TARGETS+=("$name")
}
start_corral corral "$CORRAL" "${PORTS[2]}"
[[ -n $BASE ]] && start_corral base "$BASE" "${PORTS[3]}"
port_index=5
for other in $OTHERS; do
    start_corral "${other%%=*}" "${other#*=}" "${PORTS[port_index]}"
    port_index=$((port_index + 1))
done
for t in "${TARGETS[@]}"; do wait_port "${URL[$t]##*:}"; done
sleep 2 # two polls: corral has seen the backend's model
for t in "${TARGETS[@]}"; do check_chat "$t" "${URL[$t]}"; done

CSV="$OUT/cpu.csv"
echo "scenario,target,round,requests,rps,errors,cpu_ms,us_per_request" >"$CSV"
for round in $(seq 1 "$ROUNDS"); do
    shift_by=$((round % ${#TARGETS[@]}))
    order=("${TARGETS[@]:shift_by}" "${TARGETS[@]:0:shift_by}")
    for scenario in $SCENARIOS; do
        for t in "${order[@]}"; do
            taskset -c 1 wrk -t1 -c"$CONNS" -d1s -s "$WORK/$scenario.lua" "${URL[$t]}/api/chat" >/dev/null
            before=$(cpu_ns "${PID[$t]}")
            line=$(taskset -c 1 wrk -t1 -c"$CONNS" -d"${DURATION}s" --timeout 10s \
                -s "$WORK/$scenario.lua" "${URL[$t]}/api/chat" | grep '^RESULT')
            after=$(cpu_ns "${PID[$t]}")
            read -r _ requests rps _ _ _ errors <<<"$line"
            awk -v s="$scenario" -v t="$t" -v r="$round" -v n="$requests" -v rps="$rps" \
                -v e="$errors" -v ns=$((after - before)) 'BEGIN {
                printf "%s,%s,%s,%d,%.0f,%d,%.1f,%.2f\n", s, t, r, n, rps, e, ns / 1e6, ns / 1e3 / n }' |
                tee -a "$CSV"
        done
    done
done

echo
echo "CPU per request (us), median of $ROUNDS rounds [min-max]; pingora/target = bare Pingora's CPU per request"
echo "over the target's, of the medians (and of the minima, the rounds least disturbed by other work)"
awk -F, 'NR > 1 { v[$1 "," $2] = v[$1 "," $2] " " $8 }
END {
    for (k in v) {
        n = split(substr(v[k], 2), a, " ")
        for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (a[j] < a[i]) { x = a[i]; a[i] = a[j]; a[j] = x }
        med[k] = (n % 2) ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
        lo[k] = a[1]; hi[k] = a[n]
    }
    for (k in med) {
        split(k, p, ",")
        ratio = "-"
        if (p[2] !~ /^pingora/) {
            ratio = sprintf("%.2f (min %.2f)", med[p[1] ",pingora"] / med[k], lo[p[1] ",pingora"] / lo[k])
            if ((p[1] ",pingora-base") in med)
                ratio = ratio sprintf("; pingora-base/target %.2f (min %.2f)", med[p[1] ",pingora-base"] / med[k], lo[p[1] ",pingora-base"] / lo[k])
        }
        printf "%-7s %-13s %8.1f  [%.1f-%.1f]  pingora/target %s\n", p[1], p[2], med[k], lo[k], hi[k], ratio
    }
}' "$CSV" | sort
