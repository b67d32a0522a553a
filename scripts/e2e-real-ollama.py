#!/usr/bin/env python3
"""End-to-end check of corral against real Ollama servers (opt-in; not part of CI).

Usage: scripts/e2e-real-ollama.py CORRAL_URL [MODEL] [NODE_URL,NODE_URL]

Start two real Ollama servers first (see ../shared/real-ollama/: setup.sh, then
start.sh DIR 21101 21102) and corral in front of them (conf/real-ollama.yaml, which tells
corral neither the kind of the nodes nor their runner). The script holds a multi-turn
conversation through corral and checks, from Ollama's own replies, that every follow-up
landed on the node that had its prefix cached (prompt_eval_count small), while a control
request, the same last turn sent straight to the other node, pays the whole prefill. Then
it runs more live conversations than the fleet has slots, turns interleaved, and reports the
prompt tokens evaluated per follow-up and how often corral's prediction (X-Fleet-Affinity
hit or host: warm) matched the node's reply.
"""
import json
import sys
import time
import urllib.request

URL = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:11435"
MODEL = sys.argv[2] if len(sys.argv) > 2 else "smollm2"
# The nodes behind corral, in the order of conf/real-ollama.yaml (real-a, real-b).
NODES = (sys.argv[3] if len(sys.argv) > 3 else "http://127.0.0.1:21101,http://127.0.0.1:21102").split(",")
NODE_NAMES = ["real-a", "real-b"]
# A follow-up whose node evaluated at most this many prompt tokens found its prefix warm.
WARM_MAX_EVALUATED = 64
SYSTEM = "You are a helpful assistant. " + " ".join(
    f"Fact {i}: the fleet has many machines and each one keeps a cache." for i in range(60)
)


def post(url, body, headers=None):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    start = time.monotonic()
    with urllib.request.urlopen(req, timeout=300) as resp:
        data = json.loads(resp.read())
        return data, dict(resp.headers), time.monotonic() - start


def chat(messages, explain=False, base=None):
    body = {"model": MODEL, "messages": messages, "stream": False, "options": {"num_predict": 16}}
    return post(f"{base or URL}/api/chat", body, {"X-Fleet-Explain": "1"} if explain else None)


def interleaved(n):
    """n conversations, more than the fleet has slots, their turns interleaved. A follow-up
    that corral calls warm (hit: in a slot; host: in the node's host-memory prompt cache)
    should find its prefix in the node's cache, one it calls a miss should not."""
    failures = 0
    agreed = checked = 0
    evaluated = []
    chats = []
    for i in range(n):
        system = f"You are assistant number {i}. " + " ".join(
            f"Note {j} for assistant {i}: keep answers short." for j in range(40)
        )
        chats.append([{"role": "system", "content": system}, {"role": "user", "content": "Hi!"}])
    started = time.monotonic()
    for turn in range(3):
        for i, messages in enumerate(chats):
            reply, headers, secs = chat(messages)
            affinity = headers.get("X-Fleet-Affinity")
            count = reply.get("prompt_eval_count", 10**9)
            cached = count <= WARM_MAX_EVALUATED
            print(
                f"conversation {i} turn {turn}: node={headers.get('X-Fleet-Node')} "
                f"affinity={affinity} prompt_eval_count={count} time={secs:.2f}s"
            )
            if turn > 0:
                evaluated.append(count)
                checked += 1
                predicted_warm = affinity in ("hit", "host")
                if affinity == "hit" and not cached:
                    print("  FAIL: corral called it a hit, and the node paid a full prefill")
                    failures += 1
                agreed += int(predicted_warm == cached)
            messages.append(reply["message"])
            messages.append({"role": "user", "content": f"And then? ({turn})"})
    evaluated.sort()
    print(
        f"interleaved, {n} live conversations on 4 slots: prompt tokens evaluated per follow-up "
        f"mean {sum(evaluated) / len(evaluated):.0f}, median {evaluated[len(evaluated) // 2]}; "
        f"corral's prediction agreed with the node on {agreed} of {checked} follow-ups; "
        f"wall {time.monotonic() - started:.1f}s"
    )
    return failures


def main():
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello, who are you?"}]
    failures = 0
    first_node = None
    for turn in range(4):
        reply, headers, secs = chat(messages, explain=(turn == 0))
        node = headers.get("X-Fleet-Node")
        print(
            f"turn {turn}: node={node} score={headers.get('X-Fleet-Score')} "
            f"affinity={headers.get('X-Fleet-Affinity')} prompt_eval_count={reply.get('prompt_eval_count')} "
            f"time={secs:.2f}s"
        )
        if turn == 0:
            print("  explain:", headers.get("X-Fleet-Explain"))
            first_node = node
        else:
            if node != first_node or headers.get("X-Fleet-Affinity") != "hit":
                print("  FAIL: the follow-up left the node holding its prefix")
                failures += 1
            if reply.get("prompt_eval_count", 10**9) > 64:
                print("  FAIL: the follow-up paid a full prefill")
                failures += 1
        last_messages = list(messages)
        messages.append(reply["message"])
        messages.append({"role": "user", "content": f"Tell me more, part {turn + 1}."})
    # Control: the last follow-up again, straight to the node that did not serve the
    # conversation. It has never seen it, so it must pay the whole prefill.
    other = NODES[1 - NODE_NAMES.index(first_node)] if first_node in NODE_NAMES else None
    if other:
        reply, _, secs = chat(last_messages, base=other)
        count = reply.get("prompt_eval_count", 0)
        print(f"control on the other node ({other}): prompt_eval_count={count} time={secs:.2f}s")
        if count <= WARM_MAX_EVALUATED:
            print("  FAIL: the control did not pay the whole prefill")
            failures += 1
    failures += interleaved(3)
    failures += interleaved(6)
    tags = json.loads(urllib.request.urlopen(f"{URL}/api/tags", timeout=10).read())
    ps = json.loads(urllib.request.urlopen(f"{URL}/api/ps", timeout=10).read())
    print("tags:", [m["name"] for m in tags["models"]], "ps:", [m["name"] for m in ps["models"]])
    if not tags["models"]:
        failures += 1
    print("OK" if failures == 0 else f"{failures} FAILURES")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
