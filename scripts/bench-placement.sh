#!/usr/bin/env bash
# Model placement (issue 11): the placement workload (two 24 GB nodes and one 8 GB node,
# three models, conversations arriving together, corral told only each node's memory)
# through the four baselines, corral, and corral one conversation at a time, for five seeds,
# with a table of the spread (a few minutes on 2 cores).
#
#   scripts/bench-placement.sh [extra corral-bench replay flags]
#
# Writes target/bench-placement/replay.{json,md}. BIN_DIR picks the binaries (default
# target/release, built first unless SKIP_BUILD=1).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${BIN_DIR:-target/release}
if [[ "${SKIP_BUILD:-}" != 1 ]]; then
    cargo build --release --bins
fi
"$bin/corral-bench" replay --corral "$bin/corral" --workload placement \
    --policy random,round-robin,least-connections,sticky-hash,corral,corral-one-at-a-time \
    --seeds 1,2,3,4,5 --out target/bench-placement --no-plots "$@"
