"""Planner benchmark: meshllm (GA + DP + roles) vs splitwise vs memory-ring, on one simulator.

Run:  python bench/planner.py [--quick] [--out bench/results] [--seed 0]

For each heterogeneous benchmark cluster (clusters/bench-*.yaml: 16, 48 and 200 devices
serving the shapes of llama-3-8b and llama-2-70b) it prints, side by side from one run:
- the saturation rate of each policy (the sweep and stability rule of meshllm/sim_sweep.py);
- at splitwise's highest stable rate: mean / p99 waiting time and mean prefill wait;
- at low load (25% of that rate): the prefill wait, where a Splitwise plan that prefills on
  the fastest GPUs can win;
- the goals: meshllm >= 1.5x splitwise's saturation rate, >= 50% lower mean waiting time at
  splitwise's highest stable rate, >= 2x memory-ring's saturation rate.
Then the planner's time against cluster size (subsets of the 200-device cluster).
PNGs: bench/results/planner_wait_vs_rate.png and bench/results/planner_time_vs_size.png.
`--quick` shortens the runs (fewer requests and rates) for a smoke test.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from meshllm.config import load_cluster, plan_inputs  # noqa: E402
from meshllm.partition.plan import PlanInfeasible, plan_cluster  # noqa: E402
from meshllm.sim import sweep as sim_sweep  # noqa: E402
from meshllm.sim.replica import from_plan, memory_ring, splitwise  # noqa: E402

CLUSTERS = ("bench-edge-8b", "bench-fog-70b", "bench-mesh-200")
POLICIES = ("meshllm", "splitwise", "memory-ring")
CURVE_FRACTIONS = (0.2, 0.4, 0.6, 0.8, 0.9, 1.0, 1.1, 1.25)  # x the larger saturation rate
LOW_LOAD = 0.25  # x splitwise's saturation rate, for the low-load prefill wait
HIGH_LOAD = 0.8  # x splitwise's saturation rate: high load, clear of the stability edge
SIZES = (12, 25, 50, 100, 200)


def policies_for(cfg, seed: int) -> tuple[dict, float]:
    inp = plan_inputs(cfg)
    t0 = time.perf_counter()
    plan = plan_cluster(inp, seed=seed, log=False)
    planner_s = time.perf_counter() - t0
    return {"meshllm": from_plan(inp, plan), "splitwise": splitwise(inp), "memory-ring": memory_ring(inp)}, planner_s


def bench_cluster(name: str, seed: int, n_req: int) -> dict:
    cfg = load_cluster(REPO / "clusters" / f"{name}.yaml")
    pols, planner_s = policies_for(cfg, seed)
    trace = sim_sweep.make_trace(plan_inputs(cfg), n_req, seed)
    sat = {p: sim_sweep.saturation_rate(pols[p], trace) for p in POLICIES}
    r_sw = sat["splitwise"]
    at_sw = {p: sim_sweep.metrics(sim_sweep.simulate(pols[p], trace, r_sw)) for p in POLICIES}
    low = {p: sim_sweep.metrics(sim_sweep.simulate(pols[p], trace, LOW_LOAD * r_sw)) for p in POLICIES}
    high = {p: sim_sweep.metrics(sim_sweep.simulate(pols[p], trace, HIGH_LOAD * r_sw)) for p in POLICIES}
    top = max(sat["meshllm"], r_sw)
    curve = {p: [(f * top, sim_sweep.metrics(sim_sweep.simulate(pols[p], trace, f * top))["mean_wait_ms"])
                 for f in CURVE_FRACTIONS] for p in POLICIES}
    return dict(name=name, model=cfg.model, devices=len(cfg.nodes), planner_s=planner_s, sat=sat, at_sw=at_sw,
                low=low, high=high, curve=curve, replicas={p: len(pols[p]) for p in POLICIES})


def print_cluster(res: dict) -> None:
    print(f"\n## {res['name']}: {res['devices']} devices, {res['model']}, planner {res['planner_s']:.2f} s")
    print("(ms; @sw = at splitwise's saturation rate, @80% / @25% = at that fraction of it)")
    print(f"{'policy':12s} {'replicas':>8s} {'sat req/s':>10s} {'wait@sw':>11s} {'p99@sw':>11s} "
          f"{'wait@80%':>10s} {'prefill@sw':>11s} {'prefill@80%':>11s} {'prefill@25%':>11s}")
    for p in POLICIES:
        a, hi, lo = res["at_sw"][p], res["high"][p], res["low"][p]
        print(f"{p:12s} {res['replicas'][p]:8d} {res['sat'][p]:10.3f} {a['mean_wait_ms']:11.1f} "
              f"{a['p99_wait_ms']:11.1f} {hi['mean_wait_ms']:10.1f} {a['mean_prefill_wait_ms']:11.1f} "
              f"{hi['mean_prefill_wait_ms']:11.1f} {lo['mean_prefill_wait_ms']:11.1f}")
    sat, at = res["sat"], res["at_sw"]
    g1 = sat["meshllm"] / sat["splitwise"]
    g2 = 1 - at["meshllm"]["mean_wait_ms"] / at["splitwise"]["mean_wait_ms"]
    g3 = sat["meshllm"] / max(sat["memory-ring"], 1e-12)
    g2b = 1 - res["high"]["meshllm"]["mean_wait_ms"] / res["high"]["splitwise"]["mean_wait_ms"]
    print(f"goal 1  saturation meshllm / splitwise = {g1:.2f}x (>= 1.5x: {'MET' if g1 >= 1.5 else 'NOT MET'})")
    print(f"goal 2  mean wait at splitwise's max rate: {change(g2)} (>= 50% lower: "
          f"{'MET' if g2 >= 0.5 else 'NOT MET'}); at 80% of it: {change(g2b)}")
    print(f"goal 3  saturation meshllm / memory-ring = {g3:.1f}x (>= 2x: {'MET' if g3 >= 2 else 'NOT MET'})")
    for label, key in (("low load (25%)", "low"), ("80% load", "high"), ("splitwise's max rate", "at_sw")):
        m, s = (res[key][p]["mean_prefill_wait_ms"] for p in ("meshllm", "splitwise"))
        if s < m:
            print(f"note    at {label} splitwise has the lower prefill wait ({s:.1f} vs {m:.1f} ms)")
        m, s = (res[key][p]["mean_wait_ms"] for p in ("meshllm", "splitwise"))
        if s < m:
            print(f"note    at {label} splitwise has the lower mean waiting time ({s:.1f} vs {m:.1f} ms)")


def change(frac_lower: float) -> str:
    return f"{100 * frac_lower:.0f}% lower" if frac_lower >= 0 else f"{-100 * frac_lower:.0f}% HIGHER"


def planner_time_vs_size(seed: int, sizes: tuple[int, ...]) -> list[tuple[int, str, float | None]]:
    base = load_cluster(REPO / "clusters/bench-mesh-200.yaml")
    out = []
    for n in sizes:
        step = len(base.nodes) / n
        nodes = tuple(base.nodes[int(i * step)] for i in range(n))  # every k-th: keeps the mix
        zones = {x.zone for x in nodes}
        links = tuple(ln for ln in base.links if set(ln.zones) <= zones)
        for model in ("llama-3-8b", "llama-2-70b"):
            cfg = replace(base, nodes=nodes, links=links, model=model)
            t0 = time.perf_counter()
            try:
                plan_cluster(plan_inputs(cfg), seed=seed, log=False)
                out.append((n, model, time.perf_counter() - t0))
            except PlanInfeasible:
                out.append((n, model, None))
    return out


def plot(results: list[dict], times: list, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4.2))
    for ax, res in zip(axes if len(results) > 1 else [axes], results):
        for p in POLICIES:
            xs, ys = zip(*res["curve"][p])
            ax.plot(xs, [max(y, 1e-1) for y in ys], marker="o", label=f"{p} (sat {res['sat'][p]:.2f}/s)")
        ax.axvline(res["sat"]["splitwise"], color="grey", ls=":", lw=1)
        ax.set_yscale("log")
        ax.set_xlabel("arrival rate (req/s)")
        ax.set_ylabel("mean waiting time (ms)")
        ax.set_title(f"{res['name']} ({res['devices']} devices, {res['model']})", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "planner_wait_vs_rate.png", dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(5, 3.6))
    for model in ("llama-3-8b", "llama-2-70b"):
        pts = [(n, t) for n, m, t in times if m == model and t is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=model)
    ax.set_xlabel("devices")
    ax.set_ylabel("planner time (s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "planner_time_vs_size.png", dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(REPO / "bench/results"))
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    n_req = 600 if a.quick else sim_sweep.SWEEP_REQUESTS
    clusters = CLUSTERS[:1] if a.quick else CLUSTERS
    results = []
    for name in clusters:
        results.append(bench_cluster(name, a.seed, n_req))
        print_cluster(results[-1])
        sys.stdout.flush()
    times = planner_time_vs_size(a.seed, SIZES[:2] if a.quick else SIZES)
    print("\n## planner time vs cluster size (one process, this machine; GA + DP)")
    print(f"{'devices':>8s} {'model':>12s} {'planner s':>10s}")
    for n, model, t in times:
        print(f"{n:8d} {model:>12s} {('infeasible' if t is None else f'{t:.2f}'):>10s}")
    plot(results, times, out)
    print(f"\nPNGs: {out / 'planner_wait_vs_rate.png'}, {out / 'planner_time_vs_size.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
