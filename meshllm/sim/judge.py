"""The planner's judge: the search's candidate groupings, each run through the simulator on a
short trace, the best one picked (`plan_cluster(inp, judge=simulated_judge)`).

The analytic latency model (partition/latency.py) steers the GA through thousands of groupings;
it errs where the simulator's dynamics matter (deep mixed pipelines, queues that speed a replica
up). So the last word goes to the simulator itself, on a handful of candidates: each is run at
the planned rate and at a high load (`high`, a fraction of the best capacity found), both on
JUDGE_REQUESTS requests; cost = mean e2e + WAIT_WEIGHT x mean wait (the router's score). Among
the candidates within HIGH_SLACK of the lowest cost at high load (the ones that cope with load
best: this protects the saturation rate), the lowest cost at the planned rate wins.
"""

from __future__ import annotations

from collections.abc import Sequence

from meshllm.partition.grouping import Grouping
from meshllm.partition.inputs import PlanInputs
from meshllm.partition.latency import WAIT_WEIGHT
from meshllm.sim.replica import from_grouping
from meshllm.sim.sweep import make_trace, simulate

JUDGE_REQUESTS = 400
JUDGE_SEED = 7919  # a trace of its own, not the one the results are reported on
HIGH_SLACK = 0.05


def run_cost(reps, trace, rate: float) -> float:
    reqs = simulate(reps, trace, rate)
    return sum(r.done - r.arrival + WAIT_WEIGHT * r.wait_s for r in reqs) / len(reqs)


def simulated_judge(inp: PlanInputs, candidates: Sequence[Grouping], rate: float, high: float) -> int:
    trace = make_trace(inp, JUDGE_REQUESTS, JUDGE_SEED)
    costs = []
    for g in candidates:
        reps = from_grouping(inp, g)
        costs.append((run_cost(reps, trace, high), run_cost(reps, trace, rate)))
    floor = min(c[0] for c in costs) * (1 + HIGH_SLACK)
    return min((c[1], i) for i, c in enumerate(costs) if c[0] <= floor)[1]
