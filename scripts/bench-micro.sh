#!/usr/bin/env bash
# The criterion microbenchmarks: body profile (1 KiB, 128 KiB, 1 MiB), scoring (3, 16, 64
# nodes), affinity lookups and inserts with 1M conversations and their memory.
#
#   scripts/bench-micro.sh [criterion flags]     e.g. --quick, or a filter such as decide
#
# Output goes to target/bench-micro.txt as well as the terminal.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p target
cargo bench --bench profile --bench scoring --bench affinity -- "$@" 2>&1 | tee target/bench-micro.txt
