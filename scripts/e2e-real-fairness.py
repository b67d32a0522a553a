#!/usr/bin/env python3
"""A person's chat beside a key running many agent conversations, on real Ollama servers
through corral (opt-in; not part of CI).

Two keys in corral's configuration (conf/real-ollama-keys.yaml): `person` and `agent`. The
agent runs --agents conversations at once, each a long task and --agent-turns turns sent as
soon as a reply ends; 2 s in, the person runs one conversation of --person-turns short turns,
a second's pause between them. Three cases, alternating run by run, every run with prompts no
earlier run used: the person alone; both under their own keys; both under one key (the person
sends the agent's key: one client, as corral served them before it shared slots between
clients). Prints the person's time to first token per case, and the agent's wall time.

Usage: start two servers (../shared/real-ollama/start.sh DIR 21101 21102) and corral
(target/release/corral -c conf/real-ollama-keys.yaml), then
    scripts/e2e-real-fairness.py [--runs 2] [--agents 8] [--corral URL]
"""
import argparse
import json
import os
import statistics
import threading
import time
import urllib.request

INVOCATION = os.urandom(4).hex()
PERSON_KEY, AGENT_KEY = "real-person", "real-agent"


def stream_chat(base, key, messages):
    """One streamed /api/chat under `key`: (reply message, seconds to the first chunk)."""
    body = {"model": "smollm2", "messages": messages, "stream": True,
            "options": {"num_predict": 16}}
    req = urllib.request.Request(f"{base}/api/chat", data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    req.add_header("Authorization", f"Bearer {key}")
    start = time.monotonic()
    first, content = None, []
    with urllib.request.urlopen(req, timeout=900) as resp:
        for line in resp:
            if not line.strip():
                continue
            if first is None:
                first = time.monotonic() - start
            content.append(json.loads(line).get("message", {}).get("content", ""))
    return {"role": "assistant", "content": "".join(content)}, first


def conversation(base, key, opening, turns, pause, ttfts):
    messages = [{"role": "user", "content": opening}]
    for turn in range(turns):
        reply, first = stream_chat(base, key, messages)
        ttfts.append(first)
        messages += [reply, {"role": "user", "content": f"Turn {turn}: and then?"}]
        time.sleep(pause)


def run_case(base, case, tag, args):
    person_ttfts, agent_ttfts = [], []
    agents = []
    started = time.monotonic()
    if case != "person alone":
        task = "Refactor this module and explain every step. " * 40
        for a in range(args.agents):
            opening = f"[{tag} agent {a}] {task}"
            t = threading.Thread(target=conversation, args=(
                base, AGENT_KEY, opening, args.agent_turns, 0.0, agent_ttfts))
            t.start()
            agents.append(t)
        time.sleep(2.0)
    person_key = AGENT_KEY if case == "both, one key" else PERSON_KEY
    conversation(base, person_key, f"[{tag} person] What should I cook tonight?",
                 args.person_turns, 1.0, person_ttfts)
    for t in agents:
        t.join()
    wall = time.monotonic() - started if agents else None
    return person_ttfts, wall


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corral", default="http://127.0.0.1:11435")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--agent-turns", type=int, default=3)
    ap.add_argument("--person-turns", type=int, default=3)
    args = ap.parse_args()
    cases = ["person alone", "both, own keys", "both, one key"]
    print(f"{args.agents} agent conversations x {args.agent_turns} turns beside a person's "
          f"{args.person_turns} turns, through {args.corral}")
    print()
    print("| run | case | person TTFT each turn (s) | person mean (s) | agent wall (s) |")
    print("| --- | --- | --- | --- | --- |")
    means = {c: [] for c in cases}
    for run in range(1, args.runs + 1):
        for case in cases:
            tag = f"{INVOCATION}-{run}-{case.split(',')[-1].strip().replace(' ', '')}"
            ttfts, wall = run_case(args.corral, case, tag, args)
            means[case].append(statistics.mean(ttfts))
            each = ", ".join(f"{t:.2f}" for t in ttfts)
            wall_text = f"{wall:.1f}" if wall is not None else "-"
            print(f"| {run} | {case} | {each} | {statistics.mean(ttfts):.2f} | {wall_text} |",
                  flush=True)
    print()
    for case in cases:
        print(f"{case}: person's mean TTFT {min(means[case]):.2f}-{max(means[case]):.2f} s")


if __name__ == "__main__":
    main()
