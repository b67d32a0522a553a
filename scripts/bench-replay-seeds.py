#!/usr/bin/env python3
"""The routing-quality replay (scripts/bench-replay.sh's four workloads through the five
policies) over several seeds: prints median [min-max] per workload and policy, and how many
seeds met each of issue 4's goals.

Usage: scripts/bench-replay-seeds.py [--bench PATH] [--seeds 1,2,3,4,5] [--out DIR] [--reuse]

Each seed's report is written to OUT/seed-S/replay.{json,md} (default OUT:
target/bench-replay-seeds); --reuse reads a seed's report already there instead of running
it again. One seed of all four workloads takes about 7 minutes on 2 cores.
"""
import argparse
import json
import os
import subprocess
import sys

from benchstats import cell

POLICIES = ["random", "round-robin", "least-connections", "sticky-hash", "corral"]


def report(bench, seed, out, reuse):
    path = f"{out}/seed-{seed}"
    if not (reuse and os.path.exists(f"{path}/replay.json")):
        os.makedirs(path, exist_ok=True)
        print(f"seed {seed} ...", file=sys.stderr)
        subprocess.run([bench, "replay", "--seed", str(seed), "--out", path, "--no-plots"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(f"{path}/replay.json") as f:
        return json.load(f)


def share(w):
    return 100.0 * w["cached_tokens"] / w["prompt_tokens"] if w["prompt_tokens"] else 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", default="target/release/corral-bench")
    ap.add_argument("--seeds", default="1,2,3,4,5")
    ap.add_argument("--out", default="target/bench-replay-seeds")
    ap.add_argument("--reuse", action="store_true", help="read reports already in OUT")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    reports = [report(args.bench, s, args.out, args.reuse) for s in seeds]

    # workload -> policy -> list of that policy's result, one per seed
    runs = {}
    for r in reports:
        for w in r["workloads"]:
            for p in w["policies"]:
                runs.setdefault(w["spec"]["kind"], {}).setdefault(p["policy"], []).append(p)

    print(f"Seeds {args.seeds}; median [min-max] over the seeds; TTFT in simulated ms.\n")
    for kind, by_policy in runs.items():
        print(f"#### {kind}\n")
        print("| policy | follow-up warm % | first-turn warm % | follow-up TTFT p50 | p90 | first-turn TTFT p50 "
              "| cold loads | turns/s | errors (all seeds) | corral's prediction agrees |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for policy in POLICIES:
            ps = by_policy.get(policy)
            if not ps:
                continue
            agree = ""
            checked = sum(p["predictions_checked"] for p in ps)
            if checked:
                agreed = sum(p["predictions_agreed"] for p in ps)
                agree = f"{agreed}/{checked} ({100.0 * agreed / checked:.0f}%)"
            errors = sum(p["errors"] + p["unsent"] for p in ps)
            print(f"| {policy} | {cell([share(p['follow_up_warm']) for p in ps], '{:.1f}')} "
                  f"| {cell([share(p['first_turn_warm']) for p in ps], '{:.1f}')} "
                  f"| {cell([p['ttft_follow_up_ms']['p50'] for p in ps], '{:.1f}')} "
                  f"| {cell([p['ttft_follow_up_ms']['p90'] for p in ps], '{:.0f}')} "
                  f"| {cell([p['ttft_first_ms']['p50'] for p in ps], '{:.1f}')} "
                  f"| {cell([p['cold_loads'] for p in ps], '{:.0f}')} "
                  f"| {cell([p['turns_per_s'] for p in ps], '{:.2f}')} | {errors} | {agree} |")
        print()

    # Issue 4's goals, judged seed by seed.
    print("Issue 4's goals, seed by seed:\n")

    def per_seed(kind, test):
        return sum(1 for r in reports for w in r["workloads"]
                   if w["spec"]["kind"] == kind and test({p["policy"]: p for p in w["policies"]}))

    n = len(reports)
    goals = [
        ("long-chat", "follow-up warm share at least sticky-hash's",
         lambda p: share(p["corral"]["follow_up_warm"]) >= share(p["sticky-hash"]["follow_up_warm"])),
        ("long-chat", "follow-up warm share at least twice random's",
         lambda p: share(p["corral"]["follow_up_warm"]) >= 2 * share(p["random"]["follow_up_warm"])),
        ("long-chat", "follow-up TTFT p50 at least 3x better than random's",
         lambda p: 3 * p["corral"]["ttft_follow_up_ms"]["p50"] <= p["random"]["ttft_follow_up_ms"]["p50"]),
        ("model-mix", "fewer cold loads than every baseline",
         lambda p: all(p["corral"]["cold_loads"] < q["cold_loads"] for k, q in p.items() if k != "corral")),
    ]
    for kind, what, test in goals:
        if kind in runs and all(k in runs[kind] for k in POLICIES):
            print(f"- {kind}: {what}: met on {per_seed(kind, test)} of {n} seeds")


if __name__ == "__main__":
    main()
