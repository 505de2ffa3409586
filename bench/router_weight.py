"""Router wait weight: how the wait goal of issue 8 moves with the router's one knob.

Run:  python bench/router_weight.py [--clusters bench-edge-8b,bench-fog-40-8b,bench-fog-70b,bench-mesh-200]
      [--weights 10,30,100,300] [--requests 2000] [--seed 0]     (~22 min on 2 cores, 14 without bench-mesh-200)

The router (meshllm/sim/router.py) scores a candidate by estimated finish + ROUTE_WAIT_WEIGHT x
its estimated waiting; every policy of bench/planner.py shares it with the default weight. Here,
per bench cluster and at the loads bench/planner.py reported (50 % and 70 % of tuned
Splitwise's saturation, and the cluster file's own rate, read from bench/results/planner.json),
meshllm (planned for the rate with the simulated judge, as bench/planner.py does) and tuned
Splitwise are simulated on one trace with each weight. Printed per load: mean wait, TTFT p50
and mean e2e of both at each weight; meshllm's wait / Splitwise's at the same weight; and the
same ratio when each operator picks its own best weight by the judge's cost (mean e2e +
WAIT_WEIGHT x mean wait, meshllm/partition/latency.py), as an operator tuning the router for
that cost would.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from meshllm.config import load_cluster, plan_inputs  # noqa: E402
from meshllm.partition.latency import ROUTE_WAIT_WEIGHT, WAIT_WEIGHT  # noqa: E402
from meshllm.sim import sweep  # noqa: E402
from meshllm.sim.metrics import metrics  # noqa: E402

LOADS = ("splitwise@0.5", "splitwise@0.7", "file")
POLICIES = ("meshllm", "splitwise")


def loads_of(name: str, results: Path) -> dict[str, float]:
    """The rates bench/planner.py reported for `name` (its last run's planner.json)."""
    doc = json.loads(results.read_text())
    for c in doc["clusters"]:
        if c["name"] == name:
            return {k: c["loads"][k][0] for k in LOADS if k in c["loads"]}
    raise SystemExit(f"{name}: not in {results} (run bench/planner.py first)")


def cost(m: dict) -> float:
    return m["mean_e2e_ms"] + WAIT_WEIGHT * m["mean_wait_ms"]


def at_load(inp, rate: float, weights: list[float], n: int, seed: int) -> dict[str, dict[float, dict]]:
    pols = sweep.build_policies(inp, seed, POLICIES, rate)
    trace = sweep.make_trace(inp, n, seed)
    return {name: {w: metrics(sweep.simulate(p.replicas, trace, rate, w)) for w in weights}
            for name, p in pols.items()}


def report(load: str, rate: float, got: dict[str, dict[float, dict]]) -> None:
    print(f"-- {load} = {rate:.3f} req/s: weight  meshllm wait / ttft50 / e2e (ms)   "
          f"splitwise wait / ttft50 / e2e (ms)   wait ratio")
    mine, theirs = got["meshllm"], got["splitwise"]
    for w in mine:
        a, b = mine[w], theirs[w]
        mark = " (default)" if w == ROUTE_WAIT_WEIGHT else ""
        print(f"   {w:6g}  {a['mean_wait_ms']:8.1f} {a['ttft_p50_ms']:8.1f} {a['mean_e2e_ms']:9.0f}      "
              f"{b['mean_wait_ms']:8.1f} {b['ttft_p50_ms']:8.1f} {b['mean_e2e_ms']:9.0f}      "
              f"x{a['mean_wait_ms'] / b['mean_wait_ms']:.2f}{mark}")
    wa = min(mine, key=lambda w: cost(mine[w]))
    wb = min(theirs, key=lambda w: cost(theirs[w]))
    print(f"   each operator's own weight (lowest e2e + {WAIT_WEIGHT:g} x wait): meshllm {wa:g}, splitwise {wb:g}: "
          f"wait x{mine[wa]['mean_wait_ms'] / theirs[wb]['mean_wait_ms']:.2f}")


def load_parser(doc: str, clusters: str) -> argparse.ArgumentParser:
    """The options of a script that reruns bench/planner.py's loads: clusters, trace length, results."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--clusters", default=clusters)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--results", default=str(REPO / "bench" / "results" / "planner.json"))
    return ap


def main() -> None:
    ap = load_parser(__doc__, "bench-edge-8b,bench-fog-40-8b,bench-fog-70b,bench-mesh-200")
    ap.add_argument("--weights", default="10,30,100,300")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    weights = [float(x) for x in a.weights.split(",")]
    for name in a.clusters.split(","):
        inp = plan_inputs(load_cluster(REPO / "clusters" / f"{name}.yaml"))
        print(f"## {name}", flush=True)
        for load, rate in loads_of(name, Path(a.results)).items():
            report(load, rate, at_load(inp, rate, weights, a.requests, a.seed))
            sys.stdout.flush()


if __name__ == "__main__":
    main()
