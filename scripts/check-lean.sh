#!/usr/bin/env bash
# The router as shipped (`--no-default-features`: what the Dockerfile builds) carries neither
# the simulator's server nor the plotting stack. Fails naming the crate that crept in.
set -euo pipefail
cd "$(dirname "$0")/.."

tree=$(cargo tree --locked --no-default-features --edges normal,build --prefix none)
status=0
for crate in axum plotters ttf-noto-sans ab_glyph reqwest; do
  if grep -q "^$crate v" <<<"$tree"; then
    echo "check-lean: the release build depends on $crate:" >&2
    cargo tree --locked --no-default-features --edges normal,build --invert "$crate" >&2
    status=1
  fi
done
[ "$status" -eq 0 ] && echo "check-lean: the release build has no simulator server, no plotting stack and no HTTP client library"
exit "$status"
