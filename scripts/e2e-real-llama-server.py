#!/usr/bin/env python3
"""End-to-end check of corral against two plain llama-server processes (llama.cpp) through
the OpenAI chat endpoint (opt-in; not part of CI). The sibling of scripts/e2e-real-ollama.py.

Usage: scripts/e2e-real-llama-server.py [--llama-server PATH] [--model PATH] [--corral PATH]
                                        [--cache-ram MIB] [--live 3,6]

Starts two llama-servers on 127.0.0.1:21201 and :21202 (-np 2: two slots each; -t 1: one
inference thread each; host prompt cache at its default) and corral in front of them
(conf/real-llama-server.yaml: neither the kind nor the slots given), and stops all three at
the end. Every request is a streamed /v1/chat/completions with usage; tokens evaluated come
from llama.cpp's own `timings.prompt_n` (tokens served from cache: `timings.cache_n`).

1. One conversation of four turns through corral: every follow-up must land on the node that
   holds its prefix (X-Fleet-Affinity hit) and evaluate few tokens.
2. Control: the last turn sent straight to the other node, which must pay the whole prefill.
3. More live conversations than the fleet has slots (--live: 3 and 6 on 4 slots), turns interleaved:
   tokens evaluated per follow-up through corral, and through a client-side hash of the
   conversation (each conversation always on one node) as the baseline; how often corral's
   prediction (hit or host: warm) matched the node's `cache_n`. With a small host prompt cache
   (--cache-ram, in MiB; llama-server's default is 8192) and enough live conversations, the
   caches cannot keep every conversation, and corral must learn how many they keep.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
NODES = ["http://127.0.0.1:21201", "http://127.0.0.1:21202"]
NODE_NAMES = ["llama-a", "llama-b"]
CORRAL = "http://127.0.0.1:21210"
ADMIN = "http://127.0.0.1:21212"
MODEL = "smollm2"  # llama-server serves its one model whatever the name
# A follow-up whose node evaluated at most this many prompt tokens found its prefix warm.
WARM_MAX_EVALUATED = 64
SYSTEM = "You are a helpful assistant. " + " ".join(
    f"Fact {i}: the fleet has many machines and each one keeps a cache." for i in range(60)
)


def get_json(url):
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def chat(messages, base=CORRAL):
    """A streamed chat turn: (reply message, headers, timings, seconds)."""
    body = {
        "model": MODEL,
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 16,
    }
    req = urllib.request.Request(
        f"{base}/v1/chat/completions", data=json.dumps(body).encode(), method="POST"
    )
    req.add_header("Content-Type", "application/json")
    start = time.monotonic()
    content, timings, usage = [], {}, {}
    with urllib.request.urlopen(req, timeout=600) as resp:
        headers = dict(resp.headers)
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            for choice in event.get("choices", []):
                content.append((choice.get("delta") or {}).get("content") or "")
            timings = event.get("timings", timings)
            usage = event.get("usage") or usage
    if "prompt_n" not in timings:
        # Not a llama-server: fall back to usage (prompt less cached tokens).
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        timings = {"prompt_n": usage.get("prompt_tokens", 0) - cached, "cache_n": cached}
    reply = {"role": "assistant", "content": "".join(content)}
    return reply, headers, timings, time.monotonic() - start


def interleaved(n, policy):
    """n conversations, their turns interleaved; policy "corral" or "hash" (conversation i
    always sent straight to node i % 2)."""
    failures = 0
    agreed = checked = 0
    evaluated = []
    chats = []
    for i in range(n):
        # Distinct per run, so no run finds an earlier run's prompts cached.
        system = f"Run {n}-{policy}: you are assistant number {i}. " + " ".join(
            f"Note {j} for assistant {i}: keep answers short." for j in range(40)
        )
        chats.append([{"role": "system", "content": system}, {"role": "user", "content": "Hi!"}])
    started = time.monotonic()
    ttfts = []
    for turn in range(3):
        for i, messages in enumerate(chats):
            base = CORRAL if policy == "corral" else NODES[i % 2]
            reply, headers, timings, secs = chat(messages, base)
            affinity = headers.get("X-Fleet-Affinity")
            count = timings.get("prompt_n", 10**9)
            cached = count <= WARM_MAX_EVALUATED
            print(
                f"  {policy} conversation {i} turn {turn}: node={headers.get('X-Fleet-Node', base)} "
                f"affinity={affinity} prompt_n={count} cache_n={timings.get('cache_n')} time={secs:.2f}s"
            )
            if turn > 0:
                evaluated.append(count)
                ttfts.append(secs)
                if policy == "corral":
                    checked += 1
                    if affinity == "hit" and not cached:
                        print("  FAIL: corral called it a hit, and the node paid a full prefill")
                        failures += 1
                    agreed += int((affinity in ("hit", "host")) == cached)
            messages.append(reply)
            messages.append({"role": "user", "content": f"And then? ({turn})"})
    evaluated.sort()
    ttfts.sort()
    agreement = f"; corral's prediction agreed with the node on {agreed} of {checked} follow-ups" if checked else ""
    print(
        f"interleaved, {policy}, {n} live conversations on 4 slots: prompt tokens evaluated per "
        f"follow-up mean {sum(evaluated) / len(evaluated):.0f}, median {evaluated[len(evaluated) // 2]}; "
        f"follow-up time p50 {ttfts[len(ttfts) // 2]:.2f}s{agreement}; wall {time.monotonic() - started:.1f}s"
    )
    return failures


def one_conversation():
    failures = 0
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello, who are you?"}]
    first_node = None
    last_messages = None
    for turn in range(4):
        reply, headers, timings, secs = chat(messages)
        node = headers.get("X-Fleet-Node")
        affinity = headers.get("X-Fleet-Affinity")
        print(
            f"turn {turn}: node={node} affinity={affinity} prompt_n={timings.get('prompt_n')} "
            f"cache_n={timings.get('cache_n')} time={secs:.2f}s"
        )
        if turn == 0:
            first_node = node
        else:
            if node != first_node or affinity != "hit":
                print("  FAIL: the follow-up left the node holding its prefix")
                failures += 1
            if timings.get("prompt_n", 10**9) > WARM_MAX_EVALUATED:
                print("  FAIL: the follow-up paid a full prefill")
                failures += 1
        last_messages = list(messages)
        messages.append(reply)
        messages.append({"role": "user", "content": f"Tell me more, part {turn + 1}."})
    # Control: the last follow-up again, straight to the node that did not serve the
    # conversation. It has never seen it, so it must pay the whole prefill.
    if first_node in NODE_NAMES:
        other = NODES[1 - NODE_NAMES.index(first_node)]
        _, _, timings, secs = chat(last_messages, base=other)
        print(
            f"control on the other node ({other}): prompt_n={timings.get('prompt_n')} "
            f"cache_n={timings.get('cache_n')} time={secs:.2f}s"
        )
        if timings.get("prompt_n", 0) <= WARM_MAX_EVALUATED:
            print("  FAIL: the control did not pay the whole prefill")
            failures += 1
    else:
        print(f"  FAIL: no node named in X-Fleet-Node ({first_node})")
        failures += 1
    return failures


def wait_until(what, check, seconds=60):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"timed out waiting until {what}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-server", default="/tmp/real-ollama/build/bin/llama-server")
    ap.add_argument("--model", default="/tmp/real-ollama/model.gguf")
    ap.add_argument("--corral", default=os.path.join(ROOT, "target/debug/corral"))
    ap.add_argument("--logs", default="/tmp/e2e-real-llama-server")
    ap.add_argument("--cache-ram", type=int, help="each llama-server's host prompt cache, MiB")
    ap.add_argument("--live", default="3,6",
                    help="live conversations of the interleaved runs; the hash runs the largest")
    args = ap.parse_args()
    lives = [int(n) for n in args.live.split(",")]
    os.makedirs(args.logs, exist_ok=True)
    procs = []
    try:
        for i, url in enumerate(NODES):
            port = url.rsplit(":", 1)[1]
            log = open(os.path.join(args.logs, f"llama-{port}.log"), "w")
            procs.append(subprocess.Popen(
                [args.llama_server, "-m", args.model, "--host", "127.0.0.1", "--port", port,
                 "-np", "2", "-t", "1", "-c", "8192"]
                + (["--cache-ram", str(args.cache_ram)] if args.cache_ram is not None else []),
                stdout=log, stderr=subprocess.STDOUT))
        for url in NODES:
            wait_until(f"{url} is healthy", lambda: get_json(f"{url}/health").get("status") == "ok")
        log = open(os.path.join(args.logs, "corral.log"), "w")
        procs.append(subprocess.Popen(
            [args.corral, "-c", os.path.join(ROOT, "conf/real-llama-server.yaml")],
            stdout=log, stderr=subprocess.STDOUT))
        wait_until("corral has read both nodes' slots", lambda: all(
            n.get("slots_shown") for n in get_json(f"{ADMIN}/fleet")["nodes"]))
        for n in get_json(f"{ADMIN}/fleet")["nodes"]:
            print(f"{n['name']}: kind {n['kind']}, slots shown {n['slots_shown']} "
                  f"(configured num_parallel {n['num_parallel']})")
        failures = one_conversation()
        for n, policy in [(n, "corral") for n in lives] + [(max(lives), "hash")]:
            failures += interleaved(n, policy)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
    print("OK" if failures == 0 else f"{failures} FAILURES")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
