"""The planner's fast latency estimate (partition/latency.py) checked against the simulator, and
the analytic capacity against simulated saturation, on single replicas and small groupings.

Measured (llama-3-8b int4, 512/128-token lognormal requests, 20% and 50% load): TTFT within
~20%; the waiting time of disaggregated replicas within ~35%, of mixed replicas 1.4-3.7x low
(it misses the per-step slow-down of chunked prefill), so their end-to-end latency is 0.72-0.95x
the simulator's (disaggregated: within ~6%); that is why the final choice between candidate
plans is the simulator's (sim/judge.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshllm.config import load_cluster, plan_inputs
from meshllm.partition.grouping import Grouping
from meshllm.partition.inputs import LengthDist
from meshllm.partition.plan import planner_evaluator
from meshllm.shapes import model_args
from meshllm.sim import sweep
from meshllm.sim.metrics import metrics
from meshllm.sim.replica import from_grouping
from tests.conftest import REPO
from tests.planner_fixtures import small_inputs

CASES = {  # replicas (node ids) and their roles
    "mixed NUC": ([["fog-3"]], ("mixed",)),
    "mixed Orin Nano": ([["fog-1"]], ("mixed",)),
    "prefill Orin Nano + decode NUC": ([["fog-1"], ["fog-3"]], ("prefill", "decode")),
    "two mixed Orin Nanos": ([["fog-1"], ["fog-2"]], ("mixed", "mixed")),
}


@pytest.fixture(scope="module")
def setting():
    inp = replace(small_inputs(), args=model_args("llama-3-8b"), dtype="int4",
                  input_tokens=LengthDist(512, "lognormal"), output_tokens=LengthDist(128, "lognormal"))
    return inp, planner_evaluator(inp), sweep.make_trace(inp, 2000, 0)


def grouping(inp, ev, case: str) -> Grouping:
    ids = {m.id: i for i, m in enumerate(inp.members)}
    groups, roles = CASES[case]
    got = [ev.replica([ids[x] for x in g]) for g in groups]
    return Grouping(tuple(c for c, _ in got), roles, tuple(e for _, e in got), 0.0)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("load", [0.2, 0.5])
def test_prediction_tracks_the_simulator(setting, case, load):
    inp, ev, trace = setting
    g = grouping(inp, ev, case)
    reps = from_grouping(inp, g)
    rate = load * sweep.capacity_hint(reps)
    pred, sim = ev.latency(g, rate), metrics(sweep.simulate(reps, trace, rate))
    assert pred.ttft_s * 1000 == pytest.approx(sim["mean_ttft_ms"], rel=0.35)
    wait, e2e = sim["mean_wait_ms"] / 1000, sim["mean_e2e_ms"] / 1000
    if "mixed" in g.roles:
        assert wait / 5 <= pred.wait_s <= wait * 1.25  # low, by a bounded factor
        assert 0.65 * e2e <= pred.e2e_s <= 1.1 * e2e  # ... and so is the end-to-end latency
    else:
        assert pred.wait_s == pytest.approx(wait, rel=0.4)
        assert pred.e2e_s == pytest.approx(e2e, rel=0.15)


def test_analytic_capacity_tracks_simulated_saturation(setting):
    inp, ev, _ = setting
    for case in ("mixed Orin Nano", "prefill Orin Nano + decode NUC"):
        g = grouping(inp, ev, case)
        reps = from_grouping(inp, g)
        cap = sweep.capacity_hint(reps)
        sat = sweep.saturation_rate(reps, inp, 0, 600)
        assert 0.7 * cap <= sat <= 1.15 * cap, (case, cap, sat)


@pytest.mark.parametrize("node", ["cloud-1", "fog-1"])
def test_mixed_backlog_prompts_share_steps(node):
    """clusters/wan.yaml: a mixed replica whose decode step costs far more than its 16-token
    prompts' compute. Under load it prefills a backlog several prompts a step, each paying its
    own compute; the estimate queued them one whole step each (M/G/1 at rho 1.6 on the cloud
    GPU) and predicted an infinite wait at 0.7x capacity, where the simulator waits 0.2 ms.
    Measured: e2e 1.27x (cloud-1) and 1.28x (fog-1) the simulator's at 0.7x (it errs slow: the
    step time is interpolated linearly in the batch)."""
    inp = plan_inputs(load_cluster(REPO / "clusters" / "wan.yaml"))
    ev = planner_evaluator(inp)
    cell, e = ev.replica([[m.id for m in inp.members].index(node)])
    g = Grouping((cell,), ("mixed",), (e,), 0.0)
    reps = from_grouping(inp, g)
    rate = 0.7 * sweep.capacity_hint(reps)
    pred, sim = ev.latency(g, rate), metrics(sweep.simulate(reps, sweep.make_trace(inp, 4000, 0), rate))
    assert 0.0 <= pred.wait_s < pred.e2e_s < 1.5 * sim["mean_e2e_ms"] / 1000
    assert pred.e2e_s >= 0.65 * sim["mean_e2e_ms"] / 1000


@pytest.mark.parametrize("rate", [1e-20, 1e-100, 1e-300])
def test_prediction_at_a_vanishing_rate_is_the_idle_one(rate):
    """split_load's bisection leaves the loads ~2^-50 of the capacity off lam; predict() divides
    by lam, so `--plan --rate 1e-20` predicted a TTFT of 6.7e7 ms (1e-100: 6.7e87) for 87 ms."""
    from meshllm.partition.genetic import evolve_plan
    from meshllm.partition.latency import split_load

    inp = small_inputs()
    ev = planner_evaluator(inp)
    g = evolve_plan(ev, 1.0, seed=0, log=False).best
    idle, tiny = ev.latency(g, 1e-6), ev.latency(g, rate)
    assert tiny.ttft_s == pytest.approx(idle.ttft_s, rel=1e-3)
    assert tiny.e2e_s == pytest.approx(idle.e2e_s, rel=1e-3)
    assert tiny.wait_s <= idle.wait_s + 1e-9
    assert sum(split_load([1.0, 2.0], [5.0, 7.0], rate)) == pytest.approx(rate, rel=1e-9)
