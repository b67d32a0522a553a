#!/usr/bin/env bash
# The routing-quality replay: four workloads through random, round-robin, least-connections,
# sticky-hash and corral on one simulated fleet, in one run (a few minutes on 2 cores).
#
#   scripts/bench-replay.sh [extra corral-bench replay flags]
#
# Writes target/bench-replay/replay.{json,md} and the charts to docs/img/. Flags are passed
# on, e.g. --workload long-chat --conversations 24 --seed 7 (see corral-bench replay --help).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${SKIP_BUILD:-}" != 1 ]]; then
    cargo build --release --bins
fi
target/release/corral-bench replay --out target/bench-replay --plots docs/img "$@"
