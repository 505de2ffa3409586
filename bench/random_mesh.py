"""Devices left out of a random mesh: the planner with and without `form_replicas`.

Run:  python bench/random_mesh.py [--devices 200] [--zones 5] [--seed 1] [--model llama-2-70b]
      [--yaml FILE] [--out bench/results/random_mesh.txt]      (~1 min on 2 cores)

The mesh: devices d000, d001, ... each of a device type drawn by `random.Random(seed)` from
TYPES, in zone z{i % zones}; every pair of zones linked (rtt 1-100 ms, 10 / 100 / 1000 Mb/s,
drawn too; within a zone the default LAN). Such a mesh has many device types per zone and slow
links, unlike the bench clusters. It is planned twice, each in its own pass of the same
planner (`plan_cluster`, the workload's default rate): as it is, and with the last step of the
GA's search that forms new replicas from the devices left out turned off (`fill_unused` replaced
by `fill_singles`, each device left out joining alone; the planner before that step). Prints per
plan: capacity (req/s), replicas, devices left out (by type), the predicted mean wait at the
planned rate, and the planner's time. `--yaml` also writes the cluster file.
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from meshllm.config import parse_cluster, plan_inputs  # noqa: E402
from meshllm.partition import genetic  # noqa: E402
from meshllm.partition.plan import plan_cluster  # noqa: E402

TYPES = ["jetson-orin-nx-16gb", "jetson-agx-orin-64gb", "desktop-rtx-3060-12gb", "mac-mini-m2",
         "raspberry-pi-5-8gb", "intel-nuc-13-i7", "desktop-rtx-4090", "jetson-orin-nano-8gb"]


def random_mesh(devices: int, zones: int, seed: int, model: str) -> dict:
    rng = random.Random(seed)
    nodes = [{"id": f"d{i:03d}", "device": rng.choice(TYPES), "zone": f"z{i % zones}"} for i in range(devices)]
    links = [{"zones": [f"z{a}", f"z{b}"], "rtt_ms": rng.randint(1, 100), "bandwidth_mbps": rng.choice([10, 100, 1000])}
             for a, b in itertools.combinations(range(zones), 2)]
    return {"model": model, "nodes": nodes, "links": links}


def yaml_text(cluster: dict) -> str:
    lines = [f"# python bench/random_mesh.py: a random mesh of {len(cluster['nodes'])} devices",
             f"model: {cluster['model']}", "nodes:"]
    lines += [f"  - {{id: {n['id']}, device: {n['device']}, zone: {n['zone']}}}" for n in cluster["nodes"]]
    lines.append("links:")
    lines += [f"  - {{zones: [{a}, {b}], rtt_ms: {x['rtt_ms']}, bandwidth_mbps: {x['bandwidth_mbps']}}}"
              for x in cluster["links"] for a, b in [x["zones"]]]
    return "\n".join(lines) + "\n"


def planned(cluster: dict, form: bool) -> str:
    inp = plan_inputs(parse_cluster(cluster, "random mesh"))
    kind = {n["id"]: n["device"] for n in cluster["nodes"]}
    fill = genetic.fill_unused
    genetic.fill_unused = fill if form else genetic.fill_singles
    try:
        t0 = time.perf_counter()
        plan = plan_cluster(inp, log=False)
        took = time.perf_counter() - t0
    finally:
        genetic.fill_unused = fill
    idle = Counter(kind[n] for n in plan.unused)
    wait = plan.prediction.get("mean_wait_ms", float("nan")) / 1000
    return (f"{'on' if form else 'off':7s} {plan.capacity_req_s:9.3f} {len(plan.replicas):8d} {len(plan.unused):5d} "
            f"{wait:9.2f} {took:6.1f}  " + ", ".join(f"{k} {v}" for k, v in sorted(idle.items(), key=lambda kv: -kv[1])))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=200)
    ap.add_argument("--zones", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--model", default="llama-2-70b")
    ap.add_argument("--yaml", default=None, help="also write the cluster file here")
    ap.add_argument("--out", default=str(REPO / "bench/results/random_mesh.txt"))
    a = ap.parse_args()
    cluster = random_mesh(a.devices, a.zones, a.seed, a.model)
    if a.yaml:
        Path(a.yaml).write_text(yaml_text(cluster))
    head = (f"random mesh: {a.devices} devices, {a.zones} zones, seed {a.seed}, {a.model}\n"
            f"form_replicas: the devices left out form new replicas together (on: the planner as it is)\n"
            f"{'form':7s} {'req/s':>9s} {'replicas':>8s} {'idle':>5s} {'wait s':>9s} {'plan s':>6s}  idle by type")
    print(head, flush=True)
    rows = []
    for form in (False, True):
        rows.append(planned(cluster, form))
        print(rows[-1], flush=True)
    Path(a.out).write_text(head + "\n" + "\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
