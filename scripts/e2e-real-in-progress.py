#!/usr/bin/env python3
"""More conversations in progress than a fleet of real Ollama servers has slots, sent at once,
through corral and through the baselines a careful user would pick (opt-in; not part of CI).

The workload issue 9 measured on the real-Ollama kit: 8 conversations of 3 turns, 6 of them in
progress at any time (6 clients, each holding one conversation until it ends, then taking the
next), on 2 servers with 2 slots each. Every request streams from /api/chat; the client times
its first token and reads `prompt_eval_count` from the final chunk (the kit's Ollama counts only
the prompt tokens it evaluated, so a warm follow-up shows a small count), and splits each
follow-up's time to first token by the node's own clock (`total_duration`,
`prompt_eval_duration`): before the node, at the node before its prompt, its prompt.

Policies, alternating run by run so the machine's drift falls on all of them alike:
- corral: every request to corral (conf/real-ollama.yaml), which is not told the nodes' kind;
- hash: conversation i always to node i mod 2 (a client-side hash that splits them evenly,
  the best a hash can do here);
- random: each request to a node drawn at random (seeded).

Each run uses conversations no earlier run used (of this invocation or an earlier one: the
prompts carry a random tag), so no run finds another's prompts cached. The tag names the
policy by a digit, so every policy's prompts have the same length.

With --fresh every run starts on servers with no model loaded (each node is told to unload it,
`keep_alive: 0`, as Ollama does by itself after `keep_alive` idle): the first requests decide
where the model loads. Without it the model is loaded on every node before the first run.

At the end, corral against the hash (issue 38's goals): wall time and mean TTFT over all turns at
most 1.1x the hash's, prompt tokens evaluated per follow-up at most the hash's + 10%.

With --shared-system N the conversations share N system prompts, as users of one assistant
or agents of one kind do (conversations 2k and 2k+1 the k-th, modulo N, so that the hash puts
every prompt on both servers alike); each still asks its own first question.

Usage: start two servers (../shared/real-ollama/start.sh DIR 21101 21102) and corral
(target/debug/corral -c conf/real-ollama.yaml), then
    scripts/e2e-real-in-progress.py [--runs 2] [--fresh] [--corral URL] [--nodes URL,URL]
        [--shared-system N] [--via NAME=URL --policies corral,NAME,hash,random]
"""
import argparse
import json
import os
import queue
import random
import statistics
import threading
import time
import urllib.request

# A follow-up whose node evaluated at most this many prompt tokens found its prefix warm: a
# warm one evaluates its new tokens (the last reply and question, about 75), a cold one the
# whole conversation (600 and more).
WARM_MAX_EVALUATED = 200


def stream_chat(base, model, messages, explain=False):
    """One streamed /api/chat: (reply message, final chunk, response headers, seconds to the
    first chunk, seconds in all). With `explain`, corral says how it scored every node."""
    body = {"model": model, "messages": messages, "stream": True, "options": {"num_predict": 16}}
    req = urllib.request.Request(f"{base}/api/chat", data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    if explain:
        req.add_header("X-Fleet-Explain", "1")
    start = time.monotonic()
    first = None
    content = []
    final = {}
    with urllib.request.urlopen(req, timeout=600) as resp:
        headers = dict(resp.headers)
        for line in resp:
            if not line.strip():
                continue
            if first is None:
                first = time.monotonic() - start
            chunk = json.loads(line)
            content.append(chunk.get("message", {}).get("content", ""))
            if chunk.get("done"):
                final = chunk
    message = {"role": "assistant", "content": "".join(content)}
    return message, final, headers, first, time.monotonic() - start


# Makes this invocation's prompts unlike any earlier invocation's, which the nodes may still
# hold in their caches.
INVOCATION = os.urandom(4).hex()


def conversation(run, policy_index, i, shared_system=0):
    # The policy enters the tag as a digit, not its name: names tokenize to different lengths,
    # and a longer prompt would slow one policy's first turns (by 35 to 55 tokens each when
    # "corral" and "hash" were in the tag).
    run_tag = f"run {INVOCATION}-{run}-{policy_index}"
    # With shared system prompts, conversations 2k and 2k+1 open with prompt k mod N of their
    # run (so the hash's i mod 2 gives each server every prompt alike), and each says who it
    # is in its first question.
    prompt = (i // 2) % shared_system if shared_system else 0
    tag = f"{run_tag} prompt {prompt}" if shared_system else f"{run_tag} conversation {i}"
    system = f"You are assistant {tag}. " + " ".join(
        f"Note {j} for {tag}: keep answers short and plain." for j in range(36)
    )
    question = f"Hi! I am user {i:02}. Who are you?" if shared_system else "Hi! Who are you?"
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def follow_up(turn):
    return {
        "role": "user",
        "content": f"Thank you. Now question {turn}: " + " ".join(
            f"what does word {k} of your last answer mean?" for k in range(5)
        ),
    }


def unload(args):
    """Has every node unload the model, and waits until none lists it and corral has polled."""
    for node in args.nodes:
        body = {"model": args.model, "keep_alive": 0}
        req = urllib.request.Request(f"{node}/api/generate", data=json.dumps(body).encode(), method="POST")
        req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=60) as resp:
            resp.read()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        listed = []
        for node in args.nodes:
            with urllib.request.urlopen(f"{node}/api/ps", timeout=10) as resp:
                listed += json.loads(resp.read()).get("models") or []
        if not listed:
            # corral polls every second in conf/real-ollama.yaml: let it see the unloads.
            time.sleep(2.5)
            return
        time.sleep(0.2)
    raise SystemExit("the nodes did not unload the model within 60 s")


def run_policy(args, run, policy, rng):
    """Runs the workload once; returns one record per turn."""
    todo = queue.Queue()
    for i in range(args.conversations):
        todo.put(i)
    records = []
    lock = threading.Lock()
    errors = []

    def target(i):
        if policy == "corral":
            return args.corral
        if policy in args.via:
            return args.via[policy]
        if policy == "hash":
            return args.nodes[i % len(args.nodes)]
        with lock:
            return rng.choice(args.nodes)

    def client():
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            messages = conversation(run, args.policies.index(policy), i, args.shared_system)
            for turn in range(args.turns):
                base = target(i)
                sent = time.monotonic()
                try:
                    message, final, headers, ttft, secs = stream_chat(
                        base, args.model, messages, explain=policy == "corral" or policy in args.via)
                except Exception as e:  # noqa: BLE001 - reported, and the run fails
                    with lock:
                        errors.append(f"{policy} conversation {i} turn {turn}: {e}")
                    return
                node = headers.get("X-Fleet-Node") or base
                with lock:
                    records.append({
                        "conversation": i,
                        "turn": turn,
                        "node": node,
                        "affinity": headers.get("X-Fleet-Affinity"),
                        "explain": headers.get("X-Fleet-Explain"),
                        # None when the reply has no count (Ollama leaves a zero out,
                        # `omitempty` in api/types.go): not counted either way.
                        "evaluated": final.get("prompt_eval_count"),
                        "ttft": ttft,
                        "secs": secs,
                        "sent": sent - started,
                        # Ollama's own clock, from the request reaching its handler to the
                        # last chunk: what the client waited beyond it was spent before the
                        # node (in corral, or on the way).
                        "node_secs": final.get("total_duration", 0) / 1e9,
                        "prompt_secs": final.get("prompt_eval_duration", 0) / 1e9,
                        "load_secs": final.get("load_duration", 0) / 1e9,
                        "eval_secs": final.get("eval_duration", 0) / 1e9,
                    })
                messages.append(message)
                messages.append(follow_up(turn + 1))

    started = time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(args.in_progress)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - started
    for e in errors:
        print("  ERROR:", e)
    return records, wall, len(errors)


def before_node(record):
    return max(0.0, record["secs"] - record["node_secs"])


def summary(records, wall):
    follow = [r for r in records if r["turn"] > 0]
    evaluated = [r["evaluated"] for r in follow if r["evaluated"] is not None]
    ttft = sorted(r["ttft"] for r in follow)
    p90 = ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))]
    warm = sum(e <= WARM_MAX_EVALUATED for e in evaluated)
    out = {
        "evaluated_mean": statistics.mean(evaluated) if evaluated else float("nan"),
        "uncounted": len(follow) - len(evaluated),
        "warm": warm,
        "follow_ups": len(follow),
        "ttft_p50": statistics.median(ttft),
        "ttft_p90": p90,
        "wall": wall,
        "ttft_mean": statistics.mean(ttft),
        "ttft_mean_all": statistics.mean(r["ttft"] for r in records),
        "first_p50": statistics.median(r["ttft"] for r in records if r["turn"] == 0),
        # Where a follow-up's first token was spent, on average: before its node's clock
        # started (waiting in corral, or on the way), at the node before its prompt was
        # evaluated (the node's own queue, or other slots' prompts filling its batches), and
        # in its prompt evaluation.
        "before_node": statistics.mean(before_node(r) for r in follow),
        "at_node": statistics.mean(r["ttft"] - before_node(r) - r["prompt_secs"] for r in follow),
        "prompt_secs": statistics.mean(r["prompt_secs"] for r in follow),
    }
    predicted = [r for r in follow if r["affinity"] is not None]
    if predicted:
        out["agreed"] = sum(
            (r["affinity"] in ("hit", "host")) == (r["evaluated"] <= WARM_MAX_EVALUATED)
            for r in predicted
            if r["evaluated"] is not None
        )
    homes = {}
    for r in records:
        if r["turn"] == 0:
            homes[r["node"]] = homes.get(r["node"], 0) + 1
    out["first_turns"] = homes
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corral", default="http://127.0.0.1:11435")
    ap.add_argument("--nodes", default="http://127.0.0.1:21101,http://127.0.0.1:21102",
                    type=lambda s: s.split(","))
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--in-progress", type=int, default=6)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--policies", default="corral,hash,random", type=lambda s: s.split(","))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--fresh", action="store_true", help="start every run with no model loaded")
    ap.add_argument("--json", help="write every turn's record here")
    ap.add_argument("--shared-system", type=int, default=0, metavar="N",
                    help="conversations share N system prompts (2k and 2k+1 the k-th, mod N)")
    ap.add_argument("--via", action="append", default=[], metavar="NAME=URL",
                    help="another policy: every request to URL (another corral build)")
    args = ap.parse_args()
    args.via = dict(v.split("=", 1) for v in args.via)

    if not args.fresh:
        # Load the model on every node first, so that no policy pays the load.
        for node in args.nodes:
            stream_chat(node, args.model, [{"role": "user", "content": "Hi"}])

    rng = random.Random(args.seed)
    results = {p: [] for p in args.policies}
    dump = []
    failures = 0
    for run in range(args.runs):
        for policy in args.policies:
            if args.fresh:
                unload(args)
            records, wall, errors = run_policy(args, run, policy, rng)
            failures += errors
            s = summary(records, wall)
            results[policy].append(s)
            dump.append({"run": run, "policy": policy, "wall": wall, "turns": records})
            counted = s["follow_ups"] - s["uncounted"]
            agreed = f", prediction agreed {s['agreed']}/{counted}" if "agreed" in s else ""
            if s["uncounted"]:
                agreed += f", {s['uncounted']} follow-ups without a prompt_eval_count (left out)"
            print(
                f"run {run} {policy}: follow-ups evaluated {s['evaluated_mean']:.0f} tokens on "
                f"average, {s['warm']}/{s['follow_ups']} warm; follow-up TTFT p50 "
                f"{s['ttft_p50']:.2f} s, p90 {s['ttft_p90']:.2f} s; wall {wall:.1f} s{agreed}; "
                f"first turns {s['first_turns']}, their TTFT p50 {s['first_p50']:.2f} s; "
                f"mean TTFT over all turns {s['ttft_mean_all']:.2f} s; mean follow-up TTFT {s['ttft_mean']:.2f} s = "
                f"{s['before_node']:.2f} s before the node + {s['at_node']:.2f} s there before "
                f"its prompt + {s['prompt_secs']:.2f} s prompt evaluation",
                flush=True,
            )
    print()
    print("| policy | prompt tokens evaluated per follow-up | follow-ups warm | "
          "follow-up TTFT p50 / p90 | mean follow-up TTFT | first-turn TTFT p50 | mean TTFT, all turns | wall |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")

    def span(values, fmt):
        lo, hi = min(values), max(values)
        return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}-{fmt.format(hi)}"

    for policy, runs in results.items():
        print(
            f"| {policy} | {span([r['evaluated_mean'] for r in runs], '{:.0f}')} | "
            f"{span([r['warm'] for r in runs], '{}')} of {runs[0]['follow_ups']} | "
            f"{span([r['ttft_p50'] for r in runs], '{:.1f}')} s / "
            f"{span([r['ttft_p90'] for r in runs], '{:.1f}')} s | "
            f"{span([r['ttft_mean'] for r in runs], '{:.1f}')} s | "
            f"{span([r['first_p50'] for r in runs], '{:.1f}')} s | "
            f"{span([r['ttft_mean_all'] for r in runs], '{:.1f}')} s | "
            f"{span([r['wall'] for r in runs], '{:.0f}')} s |"
        )
    if "corral" in results and "hash" in results:
        mean = lambda policy, key: statistics.mean(r[key] for r in results[policy])
        verdict = lambda ok: "met" if ok else "MISSED"
        print()
        for key, what, limit in (("wall", "wall time", 1.1), ("ttft_mean_all", "mean TTFT", 1.1)):
            ratio = mean("corral", key) / mean("hash", key)
            print(f"- {what}: corral {mean('corral', key):.1f} s vs hash {mean('hash', key):.1f} s "
                  f"({ratio:.2f}x, at most {limit}x): {verdict(ratio <= limit)}")
        c, h = mean("corral", "evaluated_mean"), mean("hash", "evaluated_mean")
        print(f"- prompt tokens per follow-up: corral {c:.0f} vs hash {h:.0f} (at most +10%): "
              f"{verdict(c <= 1.1 * h)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dump, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
