"""The planner's fast latency estimate: mean waiting time, TTFT and end-to-end latency of a
grouping (replicas with roles) at an arrival rate, from queueing approximations (queueing.py).

The router sends work where it finishes first, which keeps every part of the plan about
equally loaded, so each class of replicas runs at the same utilisation rho = lambda / capacity:
- disaggregated (prefill pool + decode pool, capacity min(P, D)):
  - prefill: an M/G/c queue of the prefill replicas counted in units of their mean server
    (Sakasegawa + Allen-Cunneen), with the prompt-length variability; TTFT adds the pipeline
    latency, that of the fastest replica at low load, the capacity-weighted mean under load;
  - KV shipping: per prefill replica, its slowest port is an M/D/1 queue;
  - decode: an M/G/c queue whose servers are the decode slots (the memory-limited batches),
    each held for a request's decode; the decode itself runs at the batch the load implies
    (Little), its step time interpolated between batch 1 and the full batch;
- each mixed replica: prompts are prefilled in chunks riding along its decode steps, stretched
  to the compute those steps leave idle (an M/G/1 queue of such stretched prefills); under a
  backlog several prompts share a step, each costing only its own compute (`RoleFit.chunk_s`,
  not a step's fixed cost: with that, a GPU serving 16-token prompts queued as if one prompt a
  step and came out at inf wait at 0.7x its capacity); prompt tokens beyond the idle compute
  slow every decoding sequence, which counts as their wait.
The simulator is the judge; tests/test_latency.py checks this estimate against it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from meshllm.partition.capacity import capacity, role_rates
from meshllm.partition.queueing import md1_wait, mg1_wait, mgc_wait_approx
from meshllm.partition.replica import Mix, ReplicaEval, RoleFit

INF = math.inf
WAIT_WEIGHT = 100.0  # planner and judge: cost = e2e + this x wait (waiting first, e2e breaks ties)
ROUTE_WAIT_WEIGHT = 10.0  # the router's score, e2e + this x wait: higher keeps waits lower at low load
# but packs the low-wait replicas to the edge at high load (on bench-mesh-200 a plan saturates at
# 9.5 / 8.7 / 5.2 req/s with 1 / 10 / 100)


@dataclass(frozen=True)
class Prediction:
    wait_s: float  # mean waiting time (README: every moment not computing or transferring)
    ttft_s: float  # mean time to first token
    e2e_s: float  # mean end-to-end latency
    capacity_req_s: float
    rate_per_s: float = 0.0  # the rate it is for

    def cost(self, wait_weight: float) -> float:
        """What the planner minimises (the router's score, averaged): e2e + weight x wait."""
        return self.e2e_s + wait_weight * self.wait_s


def step_at(fit: RoleFit, batch: float) -> float:
    """Decode iteration seconds at `batch` sequences: linear between batch 1 and the full batch
    (the roofline is convex in the batch, so this errs on the slow side)."""
    if fit.batch <= 1:
        return fit.step_s
    frac = min(1.0, max(0.0, (batch - 1) / (fit.batch - 1)))
    return fit.step1_s + frac * (fit.step_s - fit.step1_s)


def busy_step(fit: RoleFit, lam: float, mix: Mix) -> tuple[float, float]:
    """(sequences decoding, step seconds) of a replica decoding `lam` requests/s: Little's law,
    batch = lam x (mean output - 1) x step(batch), solved by a few fixed-point rounds."""
    assert fit.step1_s >= 0, "a fit without its batch-1 step (replica.with_free_tokens completes it)"
    batch = min(fit.batch, lam * mix.mean_out * fit.step1_s)
    for _ in range(4):
        batch = min(fit.batch, lam * (mix.mean_out - 1) * step_at(fit, batch))
    return batch, step_at(fit, batch)


def disaggregated(pre: Sequence[RoleFit], dec: Sequence[RoleFit], lam: float, mix: Mix,
                  cs2_in: float, cs2_out: float) -> tuple[float, float, float]:
    """(wait, ttft, e2e) of the prefill + decode pools at `lam` requests/s."""
    p_cap, d_cap = sum(f.req_s for f in pre), sum(f.req_s for f in dec)
    rho_p = lam / p_cap
    w_pre = mgc_wait_approx(lam, len(pre) / p_cap, len(pre), cs2_in)
    share = [f.req_s / p_cap for f in pre]
    lat = (1 - rho_p) * min(f.prefill_s for f in pre) + rho_p * sum(s * f.prefill_s for s, f in zip(share, pre))
    w_kv = sum(s * md1_wait(lam * s, f.ship_s) for s, f in zip(share, pre))
    ship = sum(s * f.ship_s for s, f in zip(share, pre))
    slots = sum(f.batch for f in dec)
    w_dec = mgc_wait_approx(lam, slots / d_cap, slots, cs2_out)
    run = sum(f.req_s / d_cap * (mix.mean_out - 1) * busy_step(f, lam * f.req_s / d_cap, mix)[1] for f in dec)
    ttft = w_pre + lat
    return w_pre + w_kv + w_dec, ttft, ttft + ship + w_kv + w_dec + run


def free_at(fit: RoleFit, batch: float) -> float:
    """Prompt tokens that ride free along a step at `batch` (linear between batch 1 and full)."""
    if fit.batch <= 1:
        return float(fit.free_b)
    frac = min(1.0, max(0.0, (batch - 1) / (fit.batch - 1)))
    return fit.free1 + frac * (fit.free_b - fit.free1)


def mixed(fit: RoleFit, lam: float, mix: Mix, cs2_in: float) -> tuple[float, float, float]:
    """(wait, ttft, e2e) of one mixed replica at `lam` requests/s: prompts ride free along the
    decode steps (stretched by the step's idle compute); the part of the prompt tokens that does
    not fit there slows every decoding sequence (counted as their wait)."""
    batch, step = busy_step(fit, lam, mix)
    alone = fit.prefill_s
    free_rate = free_at(fit, batch) / step if batch >= 1 else 0.0  # prompt tokens/s riding free
    stretched = max(alone, mix.mean_in / free_rate) if free_rate > 0 else alone
    per_prompt = fit.chunk_s or fit.occupancy_s  # a prompt's compute when chunked with others
    if lam * stretched < 0.7:
        queue = mg1_wait(lam, stretched, cs2_in)
    else:  # a backlog: the replica prefills at full speed, several prompts per step (chunks grow
        # with its queue), each costing its own compute, not a step's fixed cost
        queue, stretched = mg1_wait(lam, per_prompt, cs2_in), alone
    excess = max(0.0, lam * mix.mean_in - free_rate) * per_prompt / mix.mean_in  # s/s of compute
    if excess >= 1 or queue == INF:
        return INF, INF, INF
    run = (mix.mean_out - 1) * step
    pause = excess / (1 - excess) * run
    ttft = queue + stretched
    return queue + stretched - alone + pause, ttft, ttft + run + pause


def split_load(costs: Sequence[float], caps: Sequence[float], lam: float) -> list[float]:
    """The router's split of `lam` over classes of unloaded cost c_i and capacity h_i: each class
    is loaded while its cost, ~ c_i / (1 - rho_i), is below a common level L, i.e.
    rho_i = max(0, 1 - c_i / L); L is found by bisection so that the loads add up to `lam`."""
    def total(level: float) -> float:
        return sum(h * max(0.0, 1 - c / level) for c, h in zip(costs, caps))
    lo, hi = min(costs), min(costs) * 2
    while total(hi) < lam:
        hi *= 2
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if total(mid) < lam else (lo, mid)
    loads = [h * max(0.0, 1 - c / hi) for c, h in zip(costs, caps)]
    # the level is found to ~2^-50 of itself, so the loads to ~2^-50 of the capacity: at a rate
    # far below that (--rate 1e-20) they summed to ~1e-15 req/s, which predict() divides by the
    # rate (a TTFT of 6.7e7 ms for 87 ms); scaled to add up to lam exactly
    got = sum(loads)
    return [x * lam / got for x in loads] if got > 0 else loads


def predict(evals: Sequence[ReplicaEval], roles: Sequence[str], lam: float, mix: Mix,
            cs2_in: float, cs2_out: float) -> Prediction:
    """Mean wait / TTFT / e2e of the grouping at `lam` requests/s (inf at or above capacity,
    or where a class's own queue model saturates first). Load goes where the router would send
    it (`split_load`): a slow replica gets none at low load."""
    pre = [e.prefill for e, r in zip(evals, roles) if r == "prefill" and e.prefill]
    dec = [e.decode for e, r in zip(evals, roles) if r == "decode" and e.decode]
    cap, pd_cap, ship = capacity(role_rates(evals), roles)
    mixes = []  # a mixed replica decoding prompts of the prefill pool: that share joins the decode pool
    for i, (e, r) in enumerate(zip(evals, roles)):
        if r != "mixed" or not e.mixed:
            continue
        s = ship.get(i, 0.0)
        if s > 0 and e.decode:
            dec.append(replace(e.decode, req_s=s, batch=max(1, round(e.decode.batch * s / e.decode.req_s))))
        own = e.mixed.req_s * (1.0 - s / e.decode_req_s) if s > 0 else e.mixed.req_s
        if own > 0:
            mixes.append(replace(e.mixed, req_s=own))
    pd_cap = pd_cap if pre and dec else 0.0
    if lam >= cap or cap <= 0:
        return Prediction(INF, INF, INF, cap, lam)
    classes = [(f.req_s, lambda x, f=f: mixed(f, x, mix, cs2_in)) for f in mixes]
    if pd_cap > 0:
        classes.append((pd_cap, lambda x: disaggregated(pre, dec, x, mix, cs2_in, cs2_out)))
    idle = [fn(1e-9 * h) for h, fn in classes]
    costs = [c[2] + WAIT_WEIGHT * c[0] for c in idle]
    if lam <= 0:
        return Prediction(*min(idle, key=lambda x: x[2] + WAIT_WEIGHT * x[0]), cap, lam)
    loads = split_load(costs, [h for h, _ in classes], lam)
    parts = [(x, fn(x)) for x, (_, fn) in zip(loads, classes) if x > 0]
    tot = [sum(x * p[i] for x, p in parts) / lam for i in range(3)]
    return Prediction(tot[0], tot[1], tot[2], cap, lam)
