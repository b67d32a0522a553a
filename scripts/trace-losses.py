#!/usr/bin/env python3
"""Where a replay's follow-ups lost their warm share: reads the per-turn traces that
`CORRAL_BENCH_TRACE=DIR corral-bench replay ...` writes (DIR/<workload>-seed<S>-<policy>.csv)
and sorts every follow-up by whether it stayed on its conversation's last node or moved, what
corral announced (`X-Fleet-Affinity`: hit, host, miss; empty for the baselines) and how much
of its prompt the node found cached:

    full  more than 97% (all but the new turn)
    part  more than half (a shared system prompt, or an older turn)
    some  more than 2%
    none  nothing

For each group: the follow-ups in it and the prompt tokens the node evaluated beyond what it
found cached, in tokens and in points of the run's warm share. The largest losses come first.

Usage: scripts/trace-losses.py DIR/long-chat-seed1-corral.csv [more.csv ...]
"""
import collections
import csv
import sys


def follow_ups(path):
    """(moved, affinity, prompt tokens, cached tokens) of every follow-up that was answered."""
    with open(path) as f:
        rows = [r for r in csv.DictReader(f) if r["error"].lower() != "true"]
    node_of = {(int(r["conversation"]), int(r["turn"])): r["node"] for r in rows}
    out = []
    for r in rows:
        conversation, turn = int(r["conversation"]), int(r["turn"])
        if turn == 0 or r["cached_tokens"] == "":
            continue
        moved = node_of.get((conversation, turn - 1)) != r["node"]
        out.append((moved, r["affinity"], int(r["prompt_tokens"]), int(r["cached_tokens"])))
    return out


def level(prompt, cached):
    share = cached / max(1, prompt)
    if share > 0.97:
        return "full"
    if share > 0.5:
        return "part"
    if share > 0.02:
        return "some"
    return "none"


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for path in sys.argv[1:]:
        turns = follow_ups(path)
        prompt = sum(t[2] for t in turns)
        cached = sum(t[3] for t in turns)
        print(f"{path}: follow-ups {len(turns)}, warm {100.0 * cached / max(1, prompt):.1f}%")
        groups = collections.defaultdict(lambda: [0, 0])
        for moved, affinity, p, c in turns:
            key = ("moved" if moved else "stayed", affinity or "-", level(p, c))
            groups[key][0] += 1
            groups[key][1] += p - c
        for (where, affinity, found), (n, lost) in sorted(groups.items(), key=lambda g: -g[1][1]):
            points = 100.0 * lost / max(1, prompt)
            print(f"  {where:6} {affinity:5} {found:4}  {n:3} follow-ups, {lost:7} tokens evaluated"
                  f" ({points:.1f} points)")


if __name__ == "__main__":
    main()
