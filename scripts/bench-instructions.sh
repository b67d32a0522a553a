#!/usr/bin/env bash
# Instructions per request of corral and of a bare Pingora pass-through, counted by
# valgrind's callgrind: a count, not a time, so it comes out the same however busy the shared
# machine is (to about 1%), and a change to the request path can be judged by it where CPU
# time per request (scripts/bench-cpu.sh) swings by a fifth between rounds.
#
# Each proxy runs under callgrind with 1 worker thread, counting switched off; wrk warms it up,
# counting is switched on for DURATION seconds of requests from 8 connections, then off, and
# the count is divided by the requests wrk saw answered. What callgrind does not show: time in
# the kernel (the same system calls for both proxies), cache misses, and the real cost of large
# copies (glibc's memcpy copies big blocks with `rep movsb`, which callgrind counts once per
# byte: the 128 KiB figures overstate copying, for both proxies alike).
#
#   scripts/bench-instructions.sh [OUT_DIR]          (default: target/bench-instructions)
#
# Environment knobs:
#   DURATION=15  seconds counted per target and scenario
#   SCENARIOS="1k 128k stream"     CORRAL=path, BENCH=path (default target/release/)
#   BASE=path    a second corral binary counted alongside (e.g. the build before a change)
# Writes OUT_DIR/instructions.csv and callgrind's profiles (callgrind_annotate reads them).
# Builds nothing: build the release binaries first. Installs valgrind with apt-get when it is
# missing. Every server listens on 127.0.0.1 only and is stopped when the script exits.
set -euo pipefail

cd "$(dirname "$0")/.."
OUT=${1:-target/bench-instructions}
DURATION=${DURATION:-15}
SCENARIOS=${SCENARIOS:-"1k 128k stream"}
BENCH=${BENCH:-target/release/corral-bench}
CORRAL=${CORRAL:-target/release/corral}
BASE=${BASE:-}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d /tmp/corral-instructions.XXXXXX)
source scripts/bench-common.sh

if ! command -v valgrind >/dev/null || ! command -v wrk >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq valgrind wrk >/dev/null
fi
[[ -x $BENCH && -x $CORRAL ]] || { echo "bench-instructions: build first: cargo build --release --bins" >&2; exit 1; }

free_ports 4
write_scenarios
start_backend 1 "${PORTS[0]}"

# measure NAME PORT SCENARIO COMMAND...: one target under callgrind for one scenario.
measure() {
    local name=$1 port=$2 scenario=$3
    shift 3
    local profile="$OUT/$name-$scenario.callgrind"
    rm -f "$profile"*
    RUST_LOG=warn start_on_cpu 0 valgrind --tool=callgrind --instr-atstart=no \
        --callgrind-out-file="$profile" --log-file="$OUT/$name-$scenario.log" "$@" \
        2>"$OUT/$name-$scenario.stderr"
    local pid=$LAST_PID
    for _ in $(seq 1 600); do
        (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
        sleep 0.1
    done
    sleep 3 # corral's first polls under valgrind: it has seen the backend's model
    local url="http://127.0.0.1:$port/api/chat"
    taskset -c 1 wrk -t1 -c8 -d3s --timeout 30s -s "$WORK/$scenario.lua" "$url" >/dev/null
    callgrind_control -i on "$pid" >/dev/null 2>&1
    local line
    line=$(taskset -c 1 wrk -t1 -c8 -d"${DURATION}s" --timeout 30s -s "$WORK/$scenario.lua" "$url" |
        grep '^RESULT')
    callgrind_control -i off "$pid" >/dev/null 2>&1
    callgrind_control -d "$pid" >/dev/null 2>&1
    sleep 1
    kill "$pid"
    wait "$pid" 2>/dev/null || true
    local requests errors instructions
    read -r _ requests _ _ _ _ errors <<<"$line"
    # The dump holds what was counted between the switches; the file written at exit, the
    # rest (start-up, warm-up), is dropped.
    instructions=$(callgrind_annotate "$profile".1 2>/dev/null | awk '/PROGRAM TOTALS/ && !seen { gsub(",", "", $1); print $1; seen = 1 }')
    rm -f "$profile"
    mv "$profile".1 "$profile"
    echo "$scenario,$name,$requests,$errors,$instructions,$((instructions / requests))" | tee -a "$CSV"
}

CSV="$OUT/instructions.csv"
echo "scenario,target,requests,errors,instructions,per_request" >"$CSV"
corral_config "$WORK/corral.yaml" corral "${PORTS[2]}" "${PORTS[0]}" 1
corral_config "$WORK/base.yaml" base "${PORTS[3]}" "${PORTS[0]}" 1
for scenario in $SCENARIOS; do
    measure pingora "${PORTS[1]}" "$scenario" "$BENCH" bare-pingora \
        --listen "127.0.0.1:${PORTS[1]}" --upstream "127.0.0.1:${PORTS[0]}" --threads 1
    measure corral "${PORTS[2]}" "$scenario" "$CORRAL" -c "$WORK/corral.yaml"
    if [[ -n $BASE ]]; then
        measure base "${PORTS[3]}" "$scenario" "$BASE" -c "$WORK/base.yaml"
    fi
done

echo
echo "Instructions per request (callgrind, 1 thread, wrk -c8 for ${DURATION}s); target/pingora:"
awk -F, 'NR > 1 { n[$1 "," $2] = $6 }
END {
    for (k in n) {
        split(k, p, ",")
        printf "%-7s %-8s %9d  %.2fx bare Pingora\n", p[1], p[2], n[k], n[k] / n[p[1] ",pingora"]
    }
}' "$CSV" | sort
