#!/usr/bin/env python3
"""corral against a client-side hash of the conversation (corral-bench's sticky-hash: unweighted,
as a client would do it), cell by cell: corral-bench replay over stand-ins that follow one real
server's rule each, corral told neither the kind nor (with --slots-untold) the slots. For each
cell prints median [min-max] over the seeds of the follow-ups' warm share, their TTFT p50 and
p90, the mean TTFT over all turns, the workload's wall time and the errors, then each corral
build against the hash: every time at most 1.1x the hash's, warm share at least the hash's minus
0.02 (0.05 on the old runner), no errors.

Usage: scripts/bench-hash.py [--bench PATH] [--corral NAME=PATH ...] [--seeds 5]
                             [--kinds ollama,ollama-legacy,llama-cpp,openai] [--loads 1,2]
                             [--workload long-chat] [--cold-start] [--slots-untold] [--time-scale 10]
                             [--equal-nodes] [--cache-ram-tokens N] [--move-cost X]
                             [--no-cache-idle-slots] [--shape "REPLAY ARGS"] [--json FILE]

--shape replaces the workload's size with corral-bench replay's own arguments, for a workload
outside the issue's matrix: e.g. agents' tool-call loops, "--conversations 24 --turns 8
--think-secs 1 --prompt-tokens 4000 --followup-tokens 300"; with --turns 1 there are no
follow-ups, and only the mean TTFT, wall time and errors are judged.

--json appends one line per cell to FILE: the cell's settings and every policy's per-seed
figures (medians alone hide a seed's loss), for analysis or a plot.

--corral names a corral binary to run in place of the one beside corral-bench (repeat it to set
builds side by side, e.g. before=/tmp/old/corral after=target/release/corral); each runs in
turn with the hash for every seed, so they share the machine's state.

Beside the medians, the warm-share column gives each build's difference from the hash seed by
seed, its mean and standard error: a rerun of one seed can move by several points (the order in
which turns reach the nodes decides what their host caches push out), so a median over five
seeds can miss a 2-point bound by chance; the paired difference says how sure the verdict is.
"""
import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile

from benchstats import cell

SLOTS = 12  # the chat model's slots: the replay fleet's 4 + 4 + 2 + 2, or 3 equal nodes x 4
HASH = "sticky-hash"
MEASURES = [  # (key, column, format, lower is better)
    ("warm", "follow-up warm %", "{:.1f}", False),
    ("p50", "follow-up TTFT p50 ms", "{:.0f}", True),
    ("p90", "p90 ms", "{:.0f}", True),
    ("mean", "mean TTFT ms", "{:.0f}", True),
    ("wall", "wall s", "{:.2f}", True),
    ("errors", "errors", "{:.0f}", True),
    ("idle", "nodes that served nothing", "{:.0f}", True),
]
WORKLOAD_ARGS = {  # the long-chat cell of scripts/bench-kinds.py; the others at their defaults
    "long-chat": ["--conversations", "24", "--turns", "4", "--prompt-tokens", "8000"],
}
CACHE_RAM_TOKENS = 40000  # each node's host prompt cache: --cache-ram-tokens's default


def replay(args, kind, live, seed, policy, corral=None):
    with tempfile.TemporaryDirectory() as out:
        cmd = [args.bench, "replay", "--workload", args.workload, "--concurrency", str(live),
               "--node-kind", kind, "--policy", policy, "--seed", str(seed), "--out", out,
               "--no-plots", "--time-scale", str(args.time_scale)]
        cmd += args.shape.split() if args.shape is not None else WORKLOAD_ARGS.get(args.workload, [])
        cmd += ["--slots-untold"] if args.slots_untold else []
        cmd += ["--cold-start"] if args.cold_start else []
        cmd += ["--equal-nodes"] if args.equal_nodes else []
        cmd += ["--cache-ram-tokens", str(args.cache_ram_tokens)]
        cmd += ["--move-cost", str(args.move_cost)] if args.move_cost else []
        cmd += ["--no-cache-idle-slots"] if args.no_cache_idle_slots else []
        cmd += ["--corral", corral] if corral else []
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(f"{out}/replay.json") as f:
            p = json.load(f)["workloads"][0]["policies"][0]
    w = p["follow_up_warm"]
    return {
        "warm": 100.0 * w["cached_tokens"] / max(1, w["prompt_tokens"]),
        # None where the workload has no follow-ups (one turn each).
        "p50": none_as_nan(p["ttft_follow_up_ms"]["p50"]),
        "p90": none_as_nan(p["ttft_follow_up_ms"]["p90"]),
        "mean": p["ttft_mean_ms"],
        "wall": p["elapsed_s"],
        "errors": p["errors"] + p.get("unsent", 0),
        "idle": sum(1 for n in p["turns_per_node"] if n == 0),
    }


def none_as_nan(value):
    return math.nan if value is None else value


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", default="target/release/corral-bench")
    ap.add_argument("--corral", action="append", default=[],
                    help="NAME=PATH of a corral binary (repeatable); default: the one beside corral-bench")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--kinds", default="ollama,ollama-legacy,llama-cpp,openai")
    ap.add_argument("--loads", default="1,2", help="live conversations per slot")
    ap.add_argument("--workload", default="long-chat")
    ap.add_argument("--cold-start", action="store_true", help="every node starts with no model loaded")
    ap.add_argument("--slots-untold", action="store_true", help="leave num_parallel out of corral's config")
    ap.add_argument("--time-scale", type=float, default=10.0)
    ap.add_argument("--move-cost", type=float, default=0.0,
                    help="corral's weights.move_cost (0, its default: off)")
    ap.add_argument("--no-cache-idle-slots", action="store_true",
                    help="llama-server stand-ins do not copy idle slots into their host cache")
    ap.add_argument("--equal-nodes", action="store_true",
                    help="three equal nodes instead of four of different speeds")
    ap.add_argument("--shape", help="replay arguments that replace the workload's size")
    ap.add_argument("--json", help="append each cell's per-seed figures to this file, one JSON line a cell")
    ap.add_argument("--cache-ram-tokens", type=int, default=CACHE_RAM_TOKENS,
                    help=f"each node's host prompt cache, in tokens (default {CACHE_RAM_TOKENS})")
    args = ap.parse_args()
    builds = [tuple(c.split("=", 1)) for c in args.corral] or [("corral", None)]
    names = [name for name, _ in builds] + [HASH]

    print(f"workload {args.workload}, cold start {args.cold_start}, slots untold {args.slots_untold}, "
          f"equal nodes {args.equal_nodes}, host cache {args.cache_ram_tokens} tokens"
          f"{', idle slots not copied' if args.no_cache_idle_slots else ''}"
          f"{f', shape {args.shape}' if args.shape is not None else ''}, seeds 1-{args.seeds}, time scale {args.time_scale}")
    print()
    print("| kind | load | policy | " + " | ".join(m[1] for m in MEASURES) + " |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in MEASURES) + " |")
    verdicts = []
    for kind in args.kinds.split(","):
        for load in [int(n) for n in args.loads.split(",")]:
            rows = {name: {m[0]: [] for m in MEASURES} for name in names}
            for seed in range(1, args.seeds + 1):
                runs = [(name, "corral", path) for name, path in builds] + [(HASH, HASH, None)]
                warm = []
                for name, policy, path in runs:
                    got = replay(args, kind, load * SLOTS, seed, policy, path)
                    for key, values in rows[name].items():
                        values.append(got[key])
                    warm.append(f"{name} warm {got['warm']:.1f} p50 {got['p50']:.0f}")
                print(f"{kind} {load}x seed {seed} done: {', '.join(warm)}", file=sys.stderr)
            for name in names:
                cols = " | ".join(cell(rows[name][key], fmt) for key, _, fmt, _ in MEASURES)
                print(f"| {kind} | {load}x | {name} | {cols} |")
            sys.stdout.flush()
            if args.json:
                save_cell(args, kind, load, rows)
            verdicts += [(kind, load, name, goals(kind, rows[name], rows[HASH])) for name, _ in builds]
    print()
    print("| kind | load | build | warm share | p50 | p90 | mean TTFT | wall | errors |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for kind, load, name, cols in verdicts:
        print(f"| {kind} | {load}x | {name} | " + " | ".join(cols) + " |")


def save_cell(args, kind, load, rows):
    """One JSON line: the cell's settings, then each policy's figures seed by seed (NaN as null)."""
    clean = lambda v: None if isinstance(v, float) and math.isnan(v) else v
    line = {
        "workload": args.workload, "kind": kind, "load": load, "slots_untold": args.slots_untold,
        "cold_start": args.cold_start, "equal_nodes": args.equal_nodes,
        "cache_ram_tokens": args.cache_ram_tokens, "shape": args.shape,
        "time_scale": args.time_scale,
        "policies": {name: {key: [clean(v) for v in values] for key, values in measures.items()}
                     for name, measures in rows.items()},
    }
    with open(args.json, "a") as f:
        f.write(json.dumps(line) + "\n")


def goals(kind, mine, hashed):
    """Each measure's median against the hash's, with its verdict."""
    med = lambda values: statistics.median(values)
    verdict = lambda ok: "met" if ok else "**missed**"
    slack = 5.0 if kind == "ollama-legacy" else 2.0
    cols = [f"{med(mine['warm']):.1f} vs {med(hashed['warm']):.1f}: "
            f"{verdict(med(mine['warm']) >= med(hashed['warm']) - slack)} "
            f"(per seed {paired(mine['warm'], hashed['warm'])})"]
    for key in ("p50", "p90", "mean", "wall"):
        ratio = med(mine[key]) / max(1e-9, med(hashed[key]))
        cols.append("no follow-ups" if math.isnan(ratio) else f"{ratio:.2f}x: {verdict(ratio <= 1.1)}")
    cols.append(f"{sum(mine['errors']):.0f}: {verdict(sum(mine['errors']) == 0)}")
    return cols


def paired(mine, theirs):
    """The mean difference seed by seed, with its standard error where there are two or more."""
    diffs = [m - t for m, t in zip(mine, theirs)]
    mean = statistics.mean(diffs)
    if len(diffs) < 2:
        return f"{mean:+.1f}"
    return f"{mean:+.1f} ± {statistics.stdev(diffs) / len(diffs) ** 0.5:.1f}"


if __name__ == "__main__":
    main()
