#!/usr/bin/env python3
"""End-to-end check of corral against real Ollama servers (opt-in; not part of CI).

Usage: scripts/e2e-real-ollama.py CORRAL_URL [MODEL]

Start two real Ollama servers first (see ../shared/real-ollama/: setup.sh, then
start.sh DIR 21101 21102) and corral in front of them (conf/real-ollama.yaml). The script
holds a multi-turn conversation through corral and checks, from Ollama's own replies, that
every follow-up landed on the node that had its prefix cached (prompt_eval_count small),
while a control conversation sent straight to the other node pays the whole prefill.
"""
import json
import sys
import time
import urllib.request

URL = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:11435"
MODEL = sys.argv[2] if len(sys.argv) > 2 else "smollm2"
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


def chat(messages, explain=False):
    body = {"model": MODEL, "messages": messages, "stream": False, "options": {"num_predict": 16}}
    return post(f"{URL}/api/chat", body, {"X-Fleet-Explain": "1"} if explain else None)


def interleaved(n):
    """n conversations, more than one node has slots for, their turns interleaved. A
    follow-up that corral calls a hit must find its prefix in the node's cache; one it
    calls a miss may still find it there, when the node keeps more than its slots (a
    llama.cpp server keeps recent prompts in host memory), which the summary counts."""
    failures = 0
    agreed = warmer = 0
    chats = []
    for i in range(n):
        system = f"You are assistant number {i}. " + " ".join(
            f"Note {j} for assistant {i}: keep answers short." for j in range(40)
        )
        chats.append([{"role": "system", "content": system}, {"role": "user", "content": "Hi!"}])
    for turn in range(3):
        for i, messages in enumerate(chats):
            reply, headers, secs = chat(messages)
            affinity = headers.get("X-Fleet-Affinity")
            cached = reply.get("prompt_eval_count", 10**9) <= 64
            print(
                f"conversation {i} turn {turn}: node={headers.get('X-Fleet-Node')} "
                f"affinity={affinity} prompt_eval_count={reply.get('prompt_eval_count')} "
                f"time={secs:.2f}s"
            )
            if turn > 0:
                if affinity == "hit" and not cached:
                    print("  FAIL: corral called it a hit, and the node paid a full prefill")
                    failures += 1
                elif (affinity == "hit") == cached:
                    agreed += 1
                else:
                    warmer += 1
            messages.append(reply["message"])
            messages.append({"role": "user", "content": f"And then? ({turn})"})
    print(
        f"interleaved: X-Fleet-Affinity agreed with the node's cache on {agreed} of "
        f"{2 * n} follow-ups; {warmer} were warmer than corral's model of the node's slots"
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
        messages.append(reply["message"])
        messages.append({"role": "user", "content": f"Tell me more, part {turn + 1}."})
    failures += interleaved(3)
    tags = json.loads(urllib.request.urlopen(f"{URL}/api/tags", timeout=10).read())
    ps = json.loads(urllib.request.urlopen(f"{URL}/api/ps", timeout=10).read())
    print("tags:", [m["name"] for m in tags["models"]], "ps:", [m["name"] for m in ps["models"]])
    if not tags["models"]:
        failures += 1
    print("OK" if failures == 0 else f"{failures} FAILURES")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
