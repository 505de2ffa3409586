"""Weights over the mesh: fetch throughput over a shaped link, side by side with the link rate.

    python bench/weights.py                      # 100 Mbit/s, 2 ms RTT, 2 runs (~1 min)
    python bench/weights.py --mbps 100 --mbps 20 --runs 1

Each run starts two real nodes with `--node-config` on the embedded SmolLM2 (Q4_1): n1 has the
model file (zone a, the coordinator), n2's `model:` is a path that does not exist (zone b) and an
empty weights cache. Both devices are too small to hold the model alone, so the plan gives each a
stage and n2 fetches its layer range's raw tensors from n1 over the a<->b link, which the
transport shapes to `bandwidth_mbps` (every byte of every chunk is held back by size/bandwidth
at the receiver, FIFO). The figures are n2's own (`--status` load `weights_fetch`): bytes fetched,
the transfer time from its first chunk request to its last chunk, and the ratio of the achieved
rate to the link rate (goal >= 0.8). Results: bench/results/weights.txt.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from meshllm.mesh.node import query_status  # noqa: E402
from meshllm.mesh.sockets import free_port_pair  # noqa: E402

DEVICE = {"name": "small", "memory_gb": 0.4, "compute_tflops": 1, "memory_bandwidth_gbps": 60,
          "network_mbps": 1000, "source": "bench profile: too small for the whole model"}


def start(tmp: Path, nid: str, address: str, **extra) -> subprocess.Popen:
    cfg = {"id": nid, "device": DEVICE, "listen": address, "mdns": False, "model": "smollm2-135m",
           "weights_dtype": "fp32", "speculation": {"mode": "off"}, "plan_settle_s": 1.0, **extra}
    (tmp / f"{nid}.yaml").write_text(yaml.safe_dump(cfg))
    return subprocess.Popen([sys.executable, str(REPO / "launch.py"), "--node-config", str(tmp / f"{nid}.yaml")],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(tmp / f"{nid}.log", "wb"),
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)


def one_run(mbps: float, rtt_ms: float, timeout_s: float = 300) -> dict:
    links = [{"zones": ["a", "b"], "rtt_ms": rtt_ms, "bandwidth_mbps": mbps}]
    a1, a2 = (f"127.0.0.1:{free_port_pair()}" for _ in range(2))
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        procs = [start(tmp, "n1", a1, zone="a", links=links),
                 start(tmp, "n2", a2, zone="b", links=links, seeds=[a1],
                       model=str(tmp / "nowhere" / "SmolLM2-135M-Instruct.Q4_1.gguf"), weights_cache=str(tmp / "c"))]
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    fetch = query_status(a2, 2.0).get("load", {}).get("weights_fetch")
                except (TimeoutError, RuntimeError):
                    fetch = None
                if fetch:
                    return fetch
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    raise RuntimeError(f"n2 fetched nothing:\n{(tmp / 'n2.log').read_text()[-2000:]}")
                time.sleep(0.5)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mbps", type=float, action="append", help="link rate (repeatable; default 100)")
    ap.add_argument("--rtt-ms", type=float, default=2.0)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "weights.txt"))
    a = ap.parse_args()
    lines = ["weights over the mesh: n2 (no model file) fetches its SmolLM2 layer range from n1",
             f"link rtt {a.rtt_ms:g} ms; transfer = first chunk request -> last chunk; goal: ratio >= 0.8",
             "| link | run | layers | bytes fetched | transfer s | achieved | ratio to link |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    print("\n".join(lines), flush=True)
    for mbps in a.mbps or [100.0]:
        for run in range(1, a.runs + 1):
            f = one_run(mbps, a.rtt_ms)
            line = (f"| {mbps:g} Mbit/s | {run} | {f['layers']} | {f['bytes'] / 1e6:.1f} MB | {f['seconds']:.2f} | "
                    f"{f['mbps']:.1f} Mbit/s | {f['mbps'] / mbps:.2f} |")
            lines.append(line)
            print(line, flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
