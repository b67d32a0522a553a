#!/usr/bin/env python3
"""Routing quality per node kind, corral not told the kind: corral-bench replay over stand-ins
that follow one real server's rule each, at 1x and 2x as many live conversations as the
fleet has slots, several seeds; prints median [min-max] per cell, then where corral stands
against issue 9's goals in each cell (when baselines ran beside it).

Usage: scripts/bench-kinds.py [--bench PATH] [--seeds 5] [--kinds ollama,ollama-legacy,llama-cpp,openai]
                              [--move-cost 2] [--policies corral,hash-by-slots,...] [--time-scale 10]
                              [--loads 1,2] [--slots-untold] [--keep DIR]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

from benchstats import cell
import tempfile

POLICIES = ["corral", "hash-by-slots", "least-per-slot", "random-resident"]
SLOTS = 12  # the replay fleet's slots for the chat model (4 + 4 + 2 + 2)


def run(bench, kind, live, seed, out, move_cost, time_scale, slots_untold, keep):
    cmd = [
        bench, "replay", "--workload", "long-chat", "--conversations", "24",
        "--concurrency", str(live), "--turns", "4", "--prompt-tokens", "8000",
        "--node-kind", kind, "--cache-ram-tokens", "40000",
        "--policy", ",".join(POLICIES), "--seed", str(seed), "--out", out, "--no-plots",
        "--move-cost", str(move_cost), "--time-scale", str(time_scale),
    ] + (["--slots-untold"] if slots_untold else [])
    env = dict(os.environ)
    if keep:
        # Every turn of every policy as CSV, and the run's report, for later analysis.
        kept = f"{keep}/{kind}-{live}-seed{seed}"
        os.makedirs(kept, exist_ok=True)
        env["CORRAL_BENCH_TRACE"] = kept
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    if keep:
        shutil.copy(f"{out}/replay.json", kept)
    with open(f"{out}/replay.json") as f:
        report = json.load(f)
    return report["workloads"][0]["policies"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", default="target/release/corral-bench")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--kinds", default="ollama,ollama-legacy,llama-cpp,openai")
    ap.add_argument("--move-cost", type=float, default=0.0, help="corral's weights.move_cost")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--time-scale", type=float, default=40.0,
                    help="real durations divided by this; lower is slower and less sensitive to the machine's load")
    ap.add_argument("--loads", default="1,2", help="live conversations per slot, e.g. 2 for only 2x")
    ap.add_argument("--slots-untold", action="store_true",
                    help="leave the nodes' num_parallel out of corral's configuration")
    ap.add_argument("--keep", help="keep each run's replay.json and per-turn traces under this folder")
    args = ap.parse_args()
    POLICIES[:] = args.policies.split(",")
    print("| kind | live / slots | policy | follow-up warm % | follow-up TTFT p50 ms | p90 ms | first-turn TTFT p50 ms | mean TTFT, all turns, ms | follow-ups moved | corral's prediction agrees | wrong predictions (claim->node@turn) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    cells = []  # (kind, load, {policy: medians}, agreed, checked) for the goals table
    for kind in args.kinds.split(","):
        for live in [int(n) * SLOTS for n in args.loads.split(",")]:
            rows = {p: {"warm": [], "p50": [], "p90": [], "first": [], "mean": [], "moved": [], "agree": [0, 0], "wrong": {},
                        "early": 0}
                    for p in POLICIES}
            for seed in range(1, args.seeds + 1):
                with tempfile.TemporaryDirectory() as out:
                    for p in run(args.bench, kind, live, seed, out, args.move_cost, args.time_scale,
                                 args.slots_untold, args.keep):
                        r = rows[p["policy"]]
                        w = p["follow_up_warm"]
                        r["warm"].append(100.0 * w["cached_tokens"] / max(1, w["prompt_tokens"]))
                        r["p50"].append(p["ttft_follow_up_ms"]["p50"])
                        r["p90"].append(p["ttft_follow_up_ms"]["p90"])
                        r["first"].append(p["ttft_first_ms"]["p50"])
                        r["mean"].append(p["ttft_mean_ms"])
                        r["moved"].append(p["follow_ups_moved"])
                        r["agree"][0] += p["predictions_agreed"]
                        r["agree"][1] += p["predictions_checked"]
                        r["early"] += p.get("wrong_before_a_limit_was_shown", 0)
                        for case, n in p.get("prediction_cases", {}).items():
                            claim, verdict = case.split("@")[0].split("->")
                            if (claim in ("hit", "host")) != (verdict == "warm"):
                                r["wrong"][case] = r["wrong"].get(case, 0) + n
                print(f"{kind} {live} seed {seed} done", file=sys.stderr)
            for p in POLICIES:
                r = rows[p]
                agree = (f"{r['agree'][0]}/{r['agree'][1]} ({100.0 * r['agree'][0] / r['agree'][1]:.0f}%)"
                         if r["agree"][1] else "")
                wrong = ", ".join(f"{k} {v}" for k, v in sorted(r["wrong"].items()))
                if wrong:
                    wrong += f"; {r['early']} before any reply showed a limit"
                print(f"| {kind} | {live // SLOTS}x | {p} | {cell(r['warm'], '{:.1f}')} | "
                      f"{cell(r['p50'], '{:.1f}')} | {cell(r['p90'], '{:.1f}')} | {cell(r['first'], '{:.1f}')} | "
                      f"{cell(r['mean'], '{:.1f}')} | {cell(r['moved'], '{:.0f}')} | {agree} | {wrong} |")
            medians = {p: {m: statistics.median(rows[p][m]) for m in ("warm", "p50", "p90")}
                       for p in POLICIES if rows[p]["warm"]}
            agreed, checked = rows["corral"]["agree"] if "corral" in rows else (0, 0)
            cells.append((kind, live // SLOTS, medians, agreed, checked))
            sys.stdout.flush()
    print_goals(cells)


def print_goals(cells):
    """Issue 9's goals per cell, each measure against the best baseline on that measure: warm
    share within 2 points, follow-up TTFT p50 and p90 within 10%, prediction agreement of at
    least 90% (per load, and per kind over the loads run)."""
    if not any("corral" in m and len(m) > 1 for _, _, m, _, _ in cells):
        return
    print()
    print("| kind | load | warm share | TTFT p50 | TTFT p90 | agreement at this load |")
    print("| --- | --- | --- | --- | --- | --- |")
    verdict = lambda ok: "met" if ok else "**missed**"
    per_kind = {}
    for kind, load, m, agreed, checked in cells:
        if "corral" not in m or len(m) < 2:
            continue
        c = m["corral"]
        base = {p: v for p, v in m.items() if p != "corral"}
        warm = max(base, key=lambda p: base[p]["warm"])
        p50 = min(base, key=lambda p: base[p]["p50"])
        p90 = min(base, key=lambda p: base[p]["p90"])
        cols = [
            f"{c['warm']:.1f} vs {base[warm]['warm']:.1f} ({warm}): "
            f"{verdict(c['warm'] >= base[warm]['warm'] - 2)}",
        ]
        for q, best in (("p50", p50), ("p90", p90)):
            ratio = c[q] / base[best][q] - 1
            cols.append(f"{c[q]:.1f} vs {base[best][q]:.1f} ms ({best}, {ratio:+.0%}): "
                        f"{verdict(ratio <= 0.10)}")
        cols.append(f"{agreed}/{checked} ({agreed / checked:.0%}): {verdict(agreed >= 0.9 * checked)}"
                    if checked else "")
        print(f"| {kind} | {load}x | " + " | ".join(cols) + " |")
        k = per_kind.setdefault(kind, [0, 0])
        k[0] += agreed
        k[1] += checked
    print()
    for kind, (agreed, checked) in per_kind.items():
        if checked:
            print(f"- {kind}: prediction agrees on {agreed}/{checked} follow-ups over the loads run "
                  f"({agreed / checked:.1%}): {verdict(agreed >= 0.9 * checked)}")


if __name__ == "__main__":
    main()
