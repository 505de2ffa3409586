"""Where a plan for capacity loses against the bound, and what the judge's turns (step 6 of
meshllm/sim/turns.py) change.

Run:  python bench/capacity_turns.py [--cluster bench-fog-40-8b] [--load 0.92] [--requests 4000]
      (~10 min on 2 cores for bench-fog-40-8b: the judged plan for capacity, then two runs)

meshllm's plan for capacity is built with the simulated judge (its progress on stderr), and the
judge's pick before its turns of decode replicas to mixed is kept beside it. Each is then
simulated on one trace (seed 0) at `load` x the bound, and per device type the useful FLOPs its
devices did (sim/metrics.py's request FLOPs: a request's prefill on the replica that prefilled
it, its decode where it decoded, each split over the stages by their layers) are printed as a
fraction of what they could do over the arrivals' span (`device_flops_cap`): a type below 1
left compute idle, and its share of the bound says what that cost. The span is the arrivals'
(the drain after the last arrival is work of requests that arrived in it), so a type can read
slightly above 1. The figures mean what they say only at a rate the plans sustain, or nearly
(bench-fog-40-8b: 0.92 x the bound is 30.21 req/s, the pick's saturation on this trace 30.00):
above it the backlog's work is counted over the arrivals' span, and every type reads high (on
bench-six-7b, whose plan sustains 0.69 of the bound, the Mac mini of a pipeline reads 2.59 at
0.92; pass a lower --load there).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bound_gap import Placed  # noqa: E402  (the simulator, noting the replica each prompt is routed to)

from meshllm.config import load_cluster, plan_inputs  # noqa: E402
from meshllm.partition.cost import prefill_work, request_flops  # noqa: E402
from meshllm.sim import judge, sweep, turns  # noqa: E402
from meshllm.sim.metrics import bound_rate_per_s, device_flops_cap  # noqa: E402
from meshllm.sim.replica import from_grouping  # noqa: E402


def served(reps, inp, rate: float, n: int, seed: int) -> tuple[dict[str, float], float]:
    """Useful FLOPs per device id over the run of `n` requests at `rate`, and the arrivals' span."""
    sim = Placed(reps, sweep.requests_at(sweep.make_trace(inp, n, seed), rate), gaps=False)
    reqs = sim.run()
    byid, mc, flops = {r.id: r for r in reps}, inp.mc, defaultdict(float)
    for r in reqs:
        p = sim.where[r.rid]
        pre = prefill_work(mc, mc.n_layers, r.n_in, True)[0]
        d = r.dst if byid[p].role == "prefill" and r.n_out > 1 else p
        for rid, f in ((p, pre), (d, request_flops(mc, r.n_in, r.n_out) - pre)):
            total = sum(byid[rid].counts)
            for m, c in zip(byid[rid].members, byid[rid].counts, strict=True):
                flops[m.id] += f * c / total
    return flops, reqs[-1].arrival - reqs[0].arrival


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", default="bench-fog-40-8b")
    ap.add_argument("--load", type=float, default=0.92, help="the rate, as a fraction of the bound")
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    inp = plan_inputs(load_cluster(REPO / "clusters" / f"{a.cluster}.yaml"))
    picks = []
    real = turns.turned_for_capacity

    def kept(inp_, ev, g, *args, **kw):  # the pick before its turns, and after
        got = real(inp_, ev, g, *args, **kw)
        picks.append((g, got))
        return got

    turns.turned_for_capacity = kept
    judge.judged_plan(replace(inp, rate_per_s=0.0), a.seed, log=True)
    if not picks:
        print(f"{a.cluster}: the planner asked no judge (one grouping only)")
        return 0
    before, after = picks[-1]
    bound = bound_rate_per_s(inp, [(x, y) for _, x, y in sweep.make_trace(inp, 2000, a.seed)])
    rate, ctx = a.load * bound, inp.mix.decode_ctx
    index = {m.id: i for i, m in enumerate(inp.members)}
    cap = {m.id: device_flops_cap(inp, index[m.id], ctx) for m in inp.members}
    total = sum(cap.values())
    print(f"## {a.cluster}: bound {bound:.3f} req/s; plans simulated at {rate:.3f} req/s ({a.load:g} x the bound), "
          f"{a.requests} requests, seed {a.seed}")
    for what, g in (("the judge's pick", before), ("with its turns", after)):
        reps = from_grouping(inp, g)
        flops, span = served(reps, inp, rate, a.requests, a.seed)
        print(f"-- {what}: {turns.role_counts(g)}")
        types: dict[str, list] = defaultdict(lambda: [0.0, 0.0, set()])
        for r in reps:
            for m in r.members:
                t = types[m.device.name]
                t[0] += flops[m.id] / span
                t[1] += cap[m.id]
                t[2].add(r.role)
        print(f"   {'device':24s} {'roles':16s} {'share of bound':>14s} {'busy':>6s} {'idle x share':>12s}")
        for name, (done, most, roles) in sorted(types.items(), key=lambda kv: -kv[1][1]):
            print(f"   {name:24s} {'/'.join(sorted(roles)):16s} {most / total:14.3f} {done / most:6.2f} "
                  f"{max(0.0, most - done) / total:12.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
