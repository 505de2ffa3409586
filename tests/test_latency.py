"""The planner's fast latency estimate (partition/latency.py) checked against the simulator, and
the analytic capacity against simulated saturation, on single replicas and small groupings.

Measured (llama-3-8b int4, 512/128-token lognormal requests, 20% and 50% load): TTFT within
~20%; the waiting time of disaggregated replicas within ~35%, of mixed replicas 1.4-3.7x low
(it misses the per-step slow-down of chunked prefill), so their end-to-end latency is 0.72-0.95x
the simulator's (disaggregated: within ~6%); that is why the final choice between candidate
plans is the simulator's (sim/judge.py)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from meshllm.config import load_cluster, plan_inputs
from meshllm.partition.dp import Split
from meshllm.partition.grouping import Grouping
from meshllm.partition.inputs import LengthDist
from meshllm.partition.latency import (
    INF,
    Prediction,
    busy_step,
    disaggregated,
    free_at,
    mixed,
    predict,
    split_load,
    step_at,
)
from meshllm.partition.plan import planner_evaluator
from meshllm.partition.replica import Mix, ReplicaEval, RoleFit
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


# Exact checks of the estimate's formulas on hand-built fits (the comparisons with the simulator
# above tolerate 15-40 %, which a dropped term or an off-by-one in Little's law passes).
SPLIT = Split((0,), (32,), 0.0)


def pk(lam: float, s: float, cs2: float) -> float:
    """Pollaczek-Khinchine mean wait of an M/G/1 queue, written out."""
    return lam * s * s * (1 + cs2) / (2 * (1 - lam * s))


def sakasegawa(lam: float, s: float, c: float, cs2: float) -> float:
    """Sakasegawa's P(wait) x the M/M/c-like wait x the Allen-Cunneen factor, written out."""
    rho = lam * s / c
    return rho ** (math.sqrt(2 * (c + 1)) - 1) * s / (c * (1 - rho)) * (1 + cs2) / 2


def little(lam: float, out: float, step1: float, slope: float) -> float:
    """The batch b = lam (out - 1) (step1 + (b - 1) slope) of Little's law, solved exactly."""
    k = lam * (out - 1)
    return k * (step1 - slope) / (1 - k * slope)


def pre_fit(req_s: float, prefill_s: float, ship_s: float) -> RoleFit:
    return RoleFit(SPLIT, req_s, 0.0, 1, req_s, occupancy_s=prefill_s / 2, prefill_s=prefill_s, ship_s=ship_s)


def dec_fit(req_s: float, batch: int, step1_s: float, step_s: float) -> RoleFit:
    return RoleFit(SPLIT, req_s, 0.0, batch, req_s, step_s=step_s, step1_s=step1_s)


def mixed_fit(prefill_s=0.1, step=0.2, free1=100, free_b=100, chunk_s=0.03, req_s=3.0) -> RoleFit:
    return RoleFit(SPLIT, req_s, 0.0, 8, req_s, occupancy_s=0.05, prefill_s=prefill_s, step_s=step, step1_s=step,
                   free1=free1, free_b=free_b, chunk_s=chunk_s)


def test_step_and_free_tokens_interpolate_linearly_in_the_batch():
    """step_at / free_at: linear from batch 1 to the full batch, clamped outside; a batch-1 fit is its step."""
    fit = RoleFit(SPLIT, 1.0, 0.0, 5, 1.0, step_s=0.05, step1_s=0.01, free1=10, free_b=50)
    assert step_at(fit, 3) == pytest.approx(0.01 + 0.5 * 0.04, rel=1e-12)
    assert step_at(fit, 0.5) == 0.01 and step_at(fit, 9) == 0.05
    assert free_at(fit, 2) == pytest.approx(10 + 0.25 * 40, rel=1e-12)
    assert free_at(fit, 0.5) == 10 and free_at(fit, 9) == 50
    one = replace(fit, batch=1)
    assert step_at(one, 7) == 0.05 and free_at(one, 7) == 50.0


def test_busy_step_is_littles_law_over_the_decoding_tokens():
    """A request holds a decode slot for mean_out - 1 steps (the first token comes with the prefill):
    batch = lam (out - 1) step(batch), capped at the fit's batch."""
    flat = dec_fit(1.0, 64, 0.02, 0.02)
    assert busy_step(flat, 2.0, Mix(100, 11)) == (pytest.approx(2.0 * 10 * 0.02, rel=1e-12), 0.02)
    assert busy_step(flat, 1000.0, Mix(100, 11)) == (64, 0.02)  # saturated
    slope = 1e-5  # step grows with the batch; a weak slope so that the fixed point converges in 4 rounds
    fit = dec_fit(1.0, 16, 0.05, 0.05 + 15 * slope)
    b = little(0.8, 41, 0.05, slope)
    assert 1 < b < 16
    batch, step = busy_step(fit, 0.8, Mix(100, 41))
    assert batch == pytest.approx(b, rel=1e-9) and step == pytest.approx(0.05 + (b - 1) * slope, rel=1e-12)


def test_disaggregated_wait_ttft_and_e2e_add_up_exactly():
    """Prefill pool as M/G/c in units of its mean server, TTFT adding the pipeline latency (fastest at
    low load, capacity-weighted under load); per prefill replica an M/D/1 KV port; the decode pool an
    M/G/c of its slots; e2e = TTFT + shipping + KV wait + decode wait + the decode itself."""
    lam, mix, cs2_in, cs2_out = 2.0, Mix(200, 41), 0.5, 0.8
    slope = 1e-5
    pre = [pre_fit(4.0, 0.1, 0.05), pre_fit(1.0, 0.3, 0.2)]
    dec = [dec_fit(3.0, 4, 0.02, 0.02), dec_fit(3.0, 4, 0.05, 0.05 + 3 * slope)]
    wait, ttft, e2e = disaggregated(pre, dec, lam, mix, cs2_in, cs2_out)

    w_pre = sakasegawa(lam, 2 / 5, 2, cs2_in)  # 2 servers of mean rate 2.5 req/s
    lat = 0.6 * 0.1 + 0.4 * (0.8 * 0.1 + 0.2 * 0.3)  # rho 0.4: 60 % the fastest, 40 % capacity-weighted
    w_kv = 0.8 * pk(1.6, 0.05, 0.0) + 0.2 * pk(0.4, 0.2, 0.0)  # each port gets its replica's share
    ship = 0.8 * 0.05 + 0.2 * 0.2
    w_dec = sakasegawa(lam, 8 / 6, 8, cs2_out)  # 8 slots, 6 req/s
    b2 = little(lam * 0.5, 41, 0.05, slope)  # each decode replica gets its share of the rate
    assert 1 < b2 < 4
    run = 0.5 * 40 * 0.02 + 0.5 * 40 * (0.05 + (b2 - 1) * slope)
    assert ttft == pytest.approx(w_pre + lat, rel=1e-9)
    assert wait == pytest.approx(w_pre + w_kv + w_dec, rel=1e-9)
    assert e2e == pytest.approx(w_pre + lat + ship + w_kv + w_dec + run, rel=1e-9)


def test_mixed_prompts_ride_free_along_decode_steps():
    """Low load: a prompt is prefilled at the rate the steps leave free (free tokens / step, here
    interpolated at batch 2 of 8), an M/G/1 queue of such stretched prefills; its wait is the queue
    plus the stretch beyond the prompt alone."""
    fit = mixed_fit(free1=50, free_b=150)
    wait, ttft, e2e = mixed(fit, 1.0, Mix(200, 11), 0.5)
    stretched = 200 / ((50 + 100 / 7) / 0.2)  # batch 1 x 10 x 0.2 = 2
    queue = pk(1.0, stretched, 0.5)
    assert stretched * 1.0 < 0.7
    assert (wait, ttft, e2e) == pytest.approx((queue + stretched - 0.1, queue + stretched, queue + stretched + 2.0),
                                              rel=1e-9)
    # a prompt never prefills faster than alone: at 0.5 req/s (batch 1) 50 free tokens / 0.2 s would take 0.8 s
    wait, ttft, e2e = mixed(replace(fit, prefill_s=1.0), 0.5, Mix(200, 11), 0.5)
    queue = pk(0.5, 1.0, 0.5)
    assert (wait, ttft, e2e) == pytest.approx((queue, queue + 1.0, queue + 1.0 + 2.0), rel=1e-9)


def test_mixed_prompt_compute_beyond_the_free_tokens_pauses_decoding():
    """Below one sequence decoding nothing rides free: the prompt's compute (chunk_s per prompt) is
    excess that pauses decoding by excess / (1 - excess) of the decode time."""
    fit = mixed_fit(step=0.02)
    wait, ttft, e2e = mixed(fit, 1.0, Mix(200, 11), 0.5)
    queue, run, excess = pk(1.0, 0.1, 0.5), 10 * 0.02, 0.03
    pause = excess / (1 - excess) * run
    assert (wait, ttft, e2e) == pytest.approx((queue + pause, queue + 0.1, queue + 0.1 + run + pause), rel=1e-9)
    # compute of exactly one second per second: saturated
    assert mixed(mixed_fit(step=0.02, chunk_s=0.5), 2.0, Mix(200, 11), 0.5) == (INF, INF, INF)


@pytest.mark.parametrize("chunk_s", [0.03, 0.0])
def test_mixed_backlog_queues_each_prompts_own_compute(chunk_s):
    """Long prompts (stretched 2 s at 1 req/s): a backlog, prefilled at full speed several a step,
    queued as M/G/1 of each prompt's own compute (chunk_s, else occupancy_s); the prompt tokens beyond
    the free ones pause decoding."""
    fit = mixed_fit(prefill_s=0.5, chunk_s=chunk_s)
    per = chunk_s or 0.05
    wait, ttft, e2e = mixed(fit, 1.0, Mix(1000, 11), 0.5)
    queue, run = pk(1.0, per, 0.5), 10 * 0.2
    excess = (1000 - 100 / 0.2) * per / 1000
    pause = excess / (1 - excess) * run
    assert (wait, ttft, e2e) == pytest.approx((queue + pause, queue + 0.5, queue + 0.5 + run + pause), rel=1e-9)
    assert mixed(mixed_fit(prefill_s=0.5, chunk_s=0.6), 2.0, Mix(1000, 11), 0.5) == (INF, INF, INF)  # rho 1.2
    # the backlog starts at lam x stretched = 0.7: here 375 prompt tokens at 500 free tokens/s, 0.75
    wait, ttft, e2e = mixed(fit, 1.0, Mix(375, 11), 0.5)
    queue = pk(1.0, per, 0.5)
    assert (wait, ttft, e2e) == pytest.approx((queue, queue + 0.5, queue + 0.5 + run), rel=1e-9)


def test_split_load_levels_the_classes_costs():
    """Each class loaded to rho = 1 - c / L for a common level L: at 1 req/s only the cheap class
    (L = 1.25), at 8 req/s both (12 - 19 / L = 8, L = 4.75)."""
    assert split_load([1.0, 2.0], [5.0, 7.0], 1.0) == pytest.approx([1.0, 0.0], abs=1e-12)
    assert split_load([1.0, 2.0], [5.0, 7.0], 8.0) == pytest.approx([5 * (1 - 1 / 4.75), 7 * (1 - 2 / 4.75)],
                                                                     rel=1e-9)
    assert split_load([3.0], [2.0], 1.5) == pytest.approx([1.5], rel=1e-12)


def test_predict_averages_the_classes_by_their_load():
    """Two equal mixed replicas share the load equally; at or above capacity inf; at rate 0 the idle one."""
    fit = mixed_fit(free1=50, free_b=150)
    evals = [ReplicaEval((), None, None, mixed=fit)] * 2
    got = predict(evals, ["mixed", "mixed"], 2.0, Mix(200, 11), 0.5, 0.0)
    stretched = 200 / ((50 + 100 / 7) / 0.2)
    queue = pk(1.0, stretched, 0.5)
    assert (got.wait_s, got.ttft_s, got.e2e_s) == pytest.approx(
        (queue + stretched - 0.1, queue + stretched, queue + stretched + 2.0), rel=1e-9)
    assert (got.capacity_req_s, got.rate_per_s) == (6.0, 2.0)
    full = predict(evals, ["mixed", "mixed"], 6.0, Mix(200, 11), 0.5, 0.0)
    assert (full.wait_s, full.ttft_s, full.e2e_s, full.capacity_req_s) == (INF, INF, INF, 6.0)
    idle = predict(evals, ["mixed", "mixed"], 0.0, Mix(200, 11), 0.5, 0.0)
    assert (idle.wait_s, idle.ttft_s, idle.e2e_s) == pytest.approx(mixed(fit, 3e-9, Mix(200, 11), 0.5), rel=1e-9)


def test_predict_a_mixed_replica_decoding_the_prefill_pools_prompts():
    """A prefill replica (2 req/s) feeding a mixed one (decode 10, mixed 3 req/s): the mixed replica
    decodes all 2 req/s as a decode replica of req_s 2 and batch round(8 x 2 / 10) = 2, and serves
    3 x (1 - 2 / 10) = 2.4 req/s of its own; capacity 4.4, split between the two classes."""
    mix, lam = Mix(200, 11), 4.0
    pre = pre_fit(2.0, 0.1, 0.05)
    dec = dec_fit(10.0, 8, 0.02, 0.03)
    own = mixed_fit(req_s=3.0)
    evals = [ReplicaEval((), pre, None), ReplicaEval((), None, dec, mixed=own)]
    got = predict(evals, ["prefill", "mixed"], lam, mix, 0.5, 0.7)
    assert got.capacity_req_s == pytest.approx(4.4, rel=1e-12)
    d2, m2 = replace(dec, req_s=2.0, batch=2), replace(own, req_s=2.4)
    classes = [lambda x: mixed(m2, x, mix, 0.5), lambda x: disaggregated([pre], [d2], x, mix, 0.5, 0.7)]
    idle = [fn(1e-9 * h) for h, fn in zip((2.4, 2.0), classes)]
    loads = split_load([c[2] + 100 * c[0] for c in idle], [2.4, 2.0], lam)
    assert all(x > 0 for x in loads) and math.isfinite(got.e2e_s)
    parts = [fn(x) for x, fn in zip(loads, classes)]
    want = [sum(x * p[i] for x, p in zip(loads, parts)) / lam for i in range(3)]
    assert (got.wait_s, got.ttft_s, got.e2e_s) == pytest.approx(want, rel=1e-9)
    # at rate 0: the idle prediction of the class the router prefers (lowest e2e + 100 x wait)
    zero = predict(evals, ["prefill", "mixed"], 0.0, mix, 0.5, 0.7)
    costs = [c[2] + 100 * c[0] for c in idle]
    assert costs[0] != pytest.approx(costs[1], rel=1e-3)
    assert (zero.wait_s, zero.ttft_s, zero.e2e_s) == pytest.approx(idle[costs.index(min(costs))], rel=1e-9)


def test_prediction_cost_is_e2e_plus_weighted_wait():
    """What the planner minimises: e2e + weight x wait (not TTFT)."""
    assert Prediction(0.5, 1.0, 3.0, 4.0).cost(10.0) == pytest.approx(3.0 + 10.0 * 0.5, rel=1e-12)
