"""The planner's judge: the search's candidate groupings, each run through the simulator, the
best one picked (`plan_cluster(inp, judge=simulated_judge)`).

The analytic model (partition/replica.py, latency.py) steers the GA through thousands of
groupings; it errs where the simulator's dynamics matter (deep mixed pipelines, a chunked-prefill
scheduler that cannot keep every stage busy), and the GA exploits such errors. So the last word
goes to the simulator itself, on a handful of candidates, on a trace of its own (JUDGE_SEED, not
the one results are reported on):
1. each candidate's saturation rate, by the stability rule of sweep.py on runs of 2 x 600 to
   2 x 1200 requests with 4 bisections (~2.5% resolution), cached per grouping;
2. eligible: the operator's own groupings (the search's one-device-type-per-replica candidates,
   whose best saturation is the floor), and the others that sustain JUDGE_MARGIN more than
   that floor (the estimates are this noisy); all at least HEADROOM x the planned rate. Of
   those, the lowest cost at the planned rate
   wins (mean e2e + WAIT_WEIGHT x mean wait over JUDGE_REQUESTS requests, the planner's cost).
   If none is eligible, the highest saturation wins.
"""

from __future__ import annotations

from collections.abc import Sequence

from meshllm.partition.grouping import Grouping
from meshllm.partition.inputs import PlanInputs
from meshllm.partition.latency import WAIT_WEIGHT
from meshllm.sim import sweep
from meshllm.sim.replica import from_grouping

JUDGE_REQUESTS = 400
JUDGE_SWEEP_REQUESTS = 600
JUDGE_BISECT_STEPS = 4
JUDGE_WINDOW, JUDGE_MAX_REQUESTS = 10, 1200  # as the reported sweep, shorter: it only compares candidates
JUDGE_SEED = 7919  # a trace of its own, not the one the results are reported on
HEADROOM = 1.25  # an eligible plan sustains at least this x the planned rate
JUDGE_MARGIN = 0.05  # a plan of its own must out-sustain the operator's groupings by this much
_SATURATION: dict[tuple, float] = {}  # (inputs, grouping) -> saturation, across calls (the bench re-plans)


def run_cost(reps, trace, rate: float) -> float:
    reqs = sweep.simulate(reps, trace, rate)
    return sum(r.done - r.arrival + WAIT_WEIGHT * r.wait_s for r in reqs) / len(reqs)


def saturation(inp: PlanInputs, g: Grouping, reps, requests: int = JUDGE_SWEEP_REQUESTS) -> float:
    key = (inp.source, inp.args.name, inp.dtype, tuple(node.id for node in inp.nodes), inp.input_tokens,
           inp.output_tokens, g.groups, g.roles, requests)
    got = _SATURATION.get(key)
    if got is None:
        most = max(requests, JUDGE_MAX_REQUESTS * requests // JUDGE_SWEEP_REQUESTS)
        s = sweep.Sweep(reps, inp, JUDGE_SEED, requests, JUDGE_WINDOW, most)
        got = _SATURATION[key] = s.saturation(JUDGE_BISECT_STEPS)
    return got


def simulated_judge(inp: PlanInputs, candidates: Sequence[Grouping], rate: float,
                    floor_from: Sequence[int] = (), sweep_requests: int = JUDGE_SWEEP_REQUESTS) -> int:
    """Index of the winner; `floor_from`: the candidates whose saturation eligible ones must match;
    `sweep_requests`: N of the saturation runs (smaller for quick runs)."""
    trace = sweep.make_trace(inp, JUDGE_REQUESTS, JUDGE_SEED)
    sat = [saturation(inp, g, from_grouping(inp, g), sweep_requests) for g in candidates]
    floor = max([sat[i] for i in floor_from], default=0.0)
    need = [floor if i in floor_from else floor * (1 + JUDGE_MARGIN) for i in range(len(sat))]
    eligible = [i for i, s in enumerate(sat) if s >= max(need[i], HEADROOM * rate) * (1 - 1e-9)]
    if not eligible:
        return max(range(len(sat)), key=lambda i: (sat[i], -i))
    if rate <= 0 or len(eligible) == 1:
        return max(eligible, key=lambda i: (sat[i], -i))
    return min((run_cost(from_grouping(inp, candidates[i]), trace, rate), i) for i in eligible)[1]
