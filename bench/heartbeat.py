"""Heartbeat stalls: how long importing torch holds the GIL, and what a mesh's peers saw of it.

Run:  python bench/heartbeat.py [--nodes 6] [--runs 2] [--out bench/results/heartbeat.txt]   (~3 min)

1. In fresh processes, a thread ticking every 10 ms (as the I/O thread sends heartbeats) beside
   `import torch` on another thread (as the compute thread imported it when the first plan
   came): the longest gap between two ticks, one process alone and `--nodes` at once (an
   emulated mesh on this machine's cores).
2. `clusters/failure.yaml` emulated `--runs` times (every node a real process; the code as it
   is): seconds until the mesh formed and until it served, and how many times a node's peers
   marked it suspect (the nodes' logs: "alive -> suspect", one missed second of heartbeats)
   from start to serving. Before `preload_compute` (roles/host.py) nodes imported torch after
   the first plan; compare with the same script at an older commit.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TICKER = r"""
import json, threading, time
gaps, stop = [], False
def tick():
    last = time.monotonic()
    while not stop:
        time.sleep(0.01)
        now = time.monotonic()
        gaps.append(now - last)
        last = now
th = threading.Thread(target=tick, daemon=True)
th.start()
time.sleep(0.2)
t0 = time.monotonic()
import torch
t1 = time.monotonic()
stop = True
th.join()
print(json.dumps({"import_s": t1 - t0, "max_gap_s": max(gaps)}))
"""


def import_stalls(n: int) -> list[dict]:
    procs = [subprocess.Popen([sys.executable, "-c", TICKER], stdout=subprocess.PIPE, text=True) for _ in range(n)]
    return [json.loads(p.communicate(timeout=300)[0]) for p in procs]


def mesh_run() -> dict:
    from meshllm.config import load_cluster
    from meshllm.emulate import EmulatedCluster

    cfg = load_cluster(REPO / "clusters" / "failure.yaml")
    with tempfile.TemporaryDirectory(prefix="meshllm-heartbeat-") as tmp:
        t0 = time.monotonic()
        with EmulatedCluster(cfg, Path(tmp)) as cluster:
            cluster.wait_formed()
            formed = time.monotonic() - t0
            cluster.wait_serving()
            serving = time.monotonic() - t0
            suspects = sum(p.read_text(errors="replace").count("alive -> suspect") for p in Path(tmp).glob("*.log"))
    return {"formed_s": formed, "serving_s": serving, "suspect": suspects}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=6)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    lines = []

    def emit(s: str) -> None:
        lines.append(s)
        print(s, flush=True)

    for n in (1, a.nodes):
        got = import_stalls(n)
        emit(f"import torch, {n} process(es) at once: {max(g['import_s'] for g in got):.2f} s, longest gap of a "
             f"10 ms ticker thread {max(g['max_gap_s'] for g in got):.3f} s")
    for i in range(a.runs):
        r = mesh_run()
        emit(f"clusters/failure.yaml run {i + 1}: formed after {r['formed_s']:.1f} s, serving after "
             f"{r['serving_s']:.1f} s, peers marked a node suspect {r['suspect']} times")
    if a.out:
        Path(a.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
