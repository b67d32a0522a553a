#!/usr/bin/env bash
# The README's quick start, run as written: `cargo run -- demo` must start the router in
# front of the simulated fleet, and a chat sent to it must come back routed. Listens on the
# demo's own port (11435) on loopback and stops the demo on exit.
set -euo pipefail
cd "$(dirname "$0")/.."

# Build first, so that the wait below times the start, not the compiler.
cargo build --locked -q --bin corral
LOG=$(mktemp /tmp/corral-quickstart.XXXXXX)
cargo run --locked -q -- demo >"$LOG" 2>&1 &
DEMO=$!
trap 'kill $DEMO 2>/dev/null || true; wait $DEMO 2>/dev/null || true; rm -f "$LOG"' EXIT

ready=0
for _ in $(seq 1 300); do
    if grep -q "router on http://127.0.0.1:11435" "$LOG" &&
        (exec 3<>/dev/tcp/127.0.0.1/11435) 2>/dev/null; then
        ready=1
        break
    fi
    if ! kill -0 $DEMO 2>/dev/null; then
        echo "check-quickstart: 'cargo run -- demo' exited:" >&2
        cat "$LOG" >&2
        exit 1
    fi
    sleep 0.2
done
if [ "$ready" -ne 1 ]; then
    echo "check-quickstart: the demo was not listening on 127.0.0.1:11435 after 60 s:" >&2
    cat "$LOG" >&2
    exit 1
fi

# The README's first request, through bash's /dev/tcp so that no client tool is needed.
BODY='{"model":"llama3:8b","messages":[{"role":"user","content":"Hello"}],"stream":false}'
exec 4<>/dev/tcp/127.0.0.1/11435
printf 'POST /api/chat HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s' \
    "${#BODY}" "$BODY" >&4
REPLY=$(timeout 30 cat <&4 || true)
exec 4>&-
if ! grep -q "^HTTP/1.1 200" <<<"$REPLY" || ! grep -qi "^X-Fleet-Node: " <<<"$REPLY"; then
    echo "check-quickstart: the demo did not route the README's request:" >&2
    echo "$REPLY" >&2
    exit 1
fi
echo "check-quickstart: OK: 'cargo run -- demo' routed the README's request to $(grep -i '^X-Fleet-Node: ' <<<"$REPLY" | tr -d '\r' | cut -d' ' -f2)"
