#!/usr/bin/env python3
"""Two corral replicas in front of real Ollama servers, sharing a redis-server and each on its
own, against one corral alone (opt-in; not part of CI).

Usage: start two servers (../shared/real-ollama/start.sh DIR 21101 21102), then
    scripts/e2e-real-replicas.py [--corral target/release/corral] [--runs 2]

Every case starts one corral or two replicas from conf/real-ollama.yaml (neither the nodes' kind nor
their runner told; ports changed) and, for the shared case, a redis-server on a free loopback
port (`shared_state`). --conversations conversations of --turns turns, --live at once, each
with its own ~2,000-character system prompt (the kit workload of issue 38); every turn goes
to the next replica, as a round-robin balancer in front of them would send it. The cases
alternate run by run, and no run reuses another's prompts. Printed per case: prompt tokens the
nodes evaluated per follow-up (this Ollama's prompt_eval_count counts only evaluated tokens:
a warm follow-up evaluates its new turn only), corral's X-Fleet-Affinity on follow-ups, mean
time to first token, wall time and errors. Every process it starts is stopped by its pid.
"""
import argparse
import collections
import json
import os
import re
import socket
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.request

INVOCATION = os.urandom(4).hex()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url, what, seconds=30):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except Exception:
            time.sleep(0.2)
    raise SystemExit(f"{what} did not answer at {url} within {seconds} s")


class Processes:
    """Processes started here, stopped by pid on exit."""

    def __init__(self):
        self.procs = []

    def start(self, args, log):
        p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=log)
        self.procs.append(p)
        return p

    def stop(self):
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []


def replica_config(base, port, store):
    text = base
    text = re.sub(r"^listen: .*$", f"listen: 127.0.0.1:{port}", text, flags=re.M)
    text = re.sub(r"^metrics_listen: .*$", "metrics_listen: null", text, flags=re.M)
    text = re.sub(r"^admin_listen: .*$", "admin_listen: null", text, flags=re.M)
    text = re.sub(r"^pid_file: .*$", f"pid_file: /tmp/corral-e2e-{port}.pid", text, flags=re.M)
    text = re.sub(r"^upgrade_sock: .*$", f"upgrade_sock: /tmp/corral-e2e-{port}.sock", text,
                  flags=re.M)
    if store:
        text += f"\nshared_state:\n  url: {store}\n"
    return text


def start_case(procs, corral, count, shared, workdir, log):
    """Starts the store (when shared) and `count` replicas; returns their URLs."""
    store = None
    if shared:
        port = free_port()
        procs.start(["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                     "--appendonly", "no"], log)
        store = f"redis://127.0.0.1:{port}"
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit("redis-server did not listen")
                time.sleep(0.1)
    with open(os.path.join(ROOT, "conf", "real-ollama.yaml")) as f:
        base = f.read()
    urls = []
    for _ in range(count):
        port = free_port()
        path = os.path.join(workdir, f"corral-{port}.yaml")
        with open(path, "w") as f:
            f.write(replica_config(base, port, store))
        procs.start([corral, "-c", path], log)
        urls.append(f"http://127.0.0.1:{port}")
    for url in urls:
        wait_up(f"{url}/", "corral")
    # A few polls: both replicas know the nodes' models, and the shared ones each other.
    time.sleep(3)
    return urls


def stream_chat(base, messages):
    """One streamed /api/chat: (reply message, seconds to first chunk, evaluated, affinity)."""
    body = {"model": "smollm2", "messages": messages, "stream": True,
            "options": {"num_predict": 16}}
    req = urllib.request.Request(f"{base}/api/chat", data=json.dumps(body).encode(),
                                 method="POST")
    req.add_header("Content-Type", "application/json")
    start = time.monotonic()
    first, content, evaluated = None, [], None
    with urllib.request.urlopen(req, timeout=900) as resp:
        affinity = resp.headers.get("X-Fleet-Affinity")
        for line in resp:
            if not line.strip():
                continue
            if first is None:
                first = time.monotonic() - start
            chunk = json.loads(line)
            content.append(chunk.get("message", {}).get("content", ""))
            if chunk.get("done"):
                evaluated = chunk.get("prompt_eval_count")
    return {"role": "assistant", "content": "".join(content)}, first, evaluated, affinity


def run_case(urls, args, tag):
    results = {"ttft": [], "evaluated": [], "affinity": collections.Counter(), "errors": 0}
    lock = threading.Lock()
    gate = threading.Semaphore(args.live)

    def conversation(c):
        with gate:
            system = f"[{INVOCATION} {tag} conversation {c}] You are a careful assistant. " + \
                " ".join(f"Rule {j}: answer briefly and kindly." for j in range(55))
            messages = [{"role": "system", "content": system}]
            for t in range(args.turns):
                messages.append({"role": "user", "content": f"Question {t}: what next?"})
                try:
                    reply, ttft, evaluated, affinity = stream_chat(
                        urls[(c + t) % len(urls)], messages)
                except Exception as e:  # noqa: BLE001 -- counted and reported
                    print(f"  {tag} conversation {c} turn {t}: {e}")
                    with lock:
                        results["errors"] += 1
                    return
                with lock:
                    results["ttft"].append(ttft or 0.0)
                    if t > 0:
                        if evaluated is not None:
                            results["evaluated"].append(evaluated)
                        results["affinity"][affinity] += 1
                messages.append(reply)

    started = time.monotonic()
    threads = [threading.Thread(target=conversation, args=(c,))
               for c in range(args.conversations)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results["wall"] = time.monotonic() - started
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corral", default=os.path.join(ROOT, "target", "release", "corral"))
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--live", type=int, default=6)
    args = ap.parse_args()
    for node in ("http://127.0.0.1:21101/", "http://127.0.0.1:21102/"):
        wait_up(node, "a real Ollama server (../shared/real-ollama/start.sh)", 5)
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        log = open(os.path.join(workdir, "processes.log"), "w")
        for run in range(args.runs):
            cases = [("one corral", 1, False), ("two, store", 2, True), ("two, apart", 2, False)]
            if run % 2:
                cases.reverse()
            for name, count, shared in cases:
                procs = Processes()
                try:
                    urls = start_case(procs, args.corral, count, shared, workdir, log)
                    r = run_case(urls, args, f"run {run} {name}")
                finally:
                    procs.stop()
                per_follow_up = statistics.mean(r["evaluated"]) if r["evaluated"] else float("nan")
                row = (run + 1, name, per_follow_up, dict(r["affinity"]),
                       statistics.mean(r["ttft"]) if r["ttft"] else float("nan"), r["wall"],
                       r["errors"])
                rows.append(row)
                print("run {} {:13} evaluated/follow-up {:6.1f}  affinity {}  mean TTFT {:5.2f} s"
                      "  wall {:5.1f} s  errors {}".format(*row), flush=True)
    print()
    print("| run | corral | prompt tokens evaluated per follow-up | follow-up affinity |"
          " mean TTFT s | wall s | errors |")
    print("| --- | --- | ---: | --- | ---: | ---: | ---: |")
    for row in rows:
        print("| {} | {} | {:.1f} | {} | {:.2f} | {:.1f} | {} |".format(*row))


if __name__ == "__main__":
    main()
