"""Workload traces, metrics, the saturation sweep and the policy comparison of `--simulate`.

Stability rule (for `saturation_rate_per_s`): a run of SWEEP_REQUESTS Poisson arrivals at
rate r is unstable when its backlog keeps growing. The backlog at time t is the number of
requests that have arrived but are still queued (waiting for a prefill, or between their
prefill and their admission to a decode batch, KV transfer included). With `mid` and `late`
the backlog averaged over BACKLOG_SAMPLES instants around 50% and in the last 10% of the
arrival window, the run is stable iff

    late <= STABLE_GROWTH x mid + STABLE_NOISE x N   and   late <= STABLE_MAX x N.

Above capacity c the backlog grows linearly, about N (1 - c / r) t / T, so late / mid tends
to 1.8 and the rule accepts rates up to ~1.07 c. Below capacity it levels off: with
heterogeneous replicas the earliest-finish router holds a standing queue at the fast
replicas rather than start a request on a slow one, and a standing queue is stable. The
sweep doubles the rate from the policy's analytic capacity estimate until a run is unstable
(or halves it until one is stable), then bisects BISECT_STEPS times; the result is the
highest stable rate found.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

from meshllm.partition.inputs import LengthDist, PlanInputs
from meshllm.partition.plan import plan_cluster
from meshllm.sim.replica import (
    SimReplica,
    decode_rate,
    from_plan,
    memory_ring,
    prefill_rate,
    random_policy,
    splitwise,
)
from meshllm.sim.simulator import Request, Simulator

SWEEP_REQUESTS = 2000
STABLE_GROWTH = 1.3
STABLE_NOISE = 0.02  # of the requests in the run
STABLE_MAX = 0.5
BACKLOG_SAMPLES = 5
MAX_DOUBLINGS = 12
BISECT_STEPS = 5
LOGNORMAL_SIGMA = 0.6  # shape of lognormal lengths (mean is the file's mean)
MAX_LENGTH_FACTOR = 8  # lengths are clipped to [1, factor x mean]
REPORT_REQUESTS = 400  # requests simulated at the file's rate when `requests` is 0 and rate > 0
POLICIES = ("meshllm", "splitwise", "memory-ring", "random")


def draw_length(rng: random.Random, d: LengthDist) -> int:
    if d.dist == "fixed":
        x = d.mean
    elif d.dist == "uniform":
        x = rng.uniform(1, 2 * d.mean - 1)
    else:
        x = rng.lognormvariate(math.log(d.mean) - LOGNORMAL_SIGMA ** 2 / 2, LOGNORMAL_SIGMA)
    return int(min(max(1, round(x)), MAX_LENGTH_FACTOR * d.mean))


def make_trace(inp: PlanInputs, n: int, seed: int) -> list[tuple[float, int, int]]:
    """(unit-rate arrival time, input tokens, output tokens) per request; scale by 1/rate."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(1.0)
        out.append((t, draw_length(rng, inp.input_tokens), draw_length(rng, inp.output_tokens)))
    return out


def requests_at(trace: Sequence[tuple[float, int, int]], rate: float) -> list[Request]:
    return [Request(i, t / rate if rate > 0 else 0.0, n_in, n_out) for i, (t, n_in, n_out) in enumerate(trace)]


def simulate(reps: Sequence[SimReplica], trace: Sequence[tuple[float, int, int]], rate: float) -> list[Request]:
    return Simulator(reps, requests_at(trace, rate)).run()


def metrics(reqs: Sequence[Request]) -> dict:
    waits = sorted(r.wait_s for r in reqs)
    span = max(r.done for r in reqs) - min(r.arrival for r in reqs)
    p99 = waits[min(len(waits) - 1, math.ceil(0.99 * len(waits)) - 1)]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {
        "mean_wait_ms": round(1000 * mean(waits), 3),
        "p99_wait_ms": round(1000 * p99, 3),
        "mean_prefill_wait_ms": round(1000 * mean([r.prefill_start - r.arrival for r in reqs]), 3),
        "mean_ttft_ms": round(1000 * mean([r.first_token - r.arrival for r in reqs]), 3),
        "throughput_tok_s": round(sum(r.n_out for r in reqs) / span, 3) if span > 0 else None,
    }


def backlog(reqs: Sequence[Request], t: float) -> int:
    """Requests queued at time t: arrived, prefill not started; or prefilled, not yet decoding."""
    return sum(1 for r in reqs if r.arrival <= t < r.prefill_start or r.first_token <= t < r.decode_start)


def stable(reqs: Sequence[Request]) -> bool:
    """The documented stability rule (module docstring)."""
    first, last = min(r.arrival for r in reqs), max(r.arrival for r in reqs)
    at = lambda frac: first + (last - first) * frac  # noqa: E731
    mean_backlog = lambda lo, hi: sum(backlog(reqs, at(lo + (hi - lo) * i / (BACKLOG_SAMPLES - 1)))  # noqa: E731
                                      for i in range(BACKLOG_SAMPLES)) / BACKLOG_SAMPLES
    mid, late = mean_backlog(0.45, 0.55), mean_backlog(0.9, 1.0)
    n = len(reqs)
    return late <= STABLE_GROWTH * mid + STABLE_NOISE * n and late <= STABLE_MAX * n


def capacity_hint(reps: Sequence[SimReplica]) -> float:
    """Analytic requests/s of a policy's replicas (compute only), the sweep's starting point."""
    pre = sum(prefill_rate(r) for r in reps if r.role == "prefill")
    dec = sum(decode_rate(r) for r in reps if r.role == "decode")
    mixed = sum(1.0 / (1.0 / prefill_rate(r) + 1.0 / decode_rate(r)) for r in reps if r.role == "mixed")
    return (min(pre, dec) if pre and dec else 0.0) + mixed


def saturation_rate(reps: Sequence[SimReplica], trace: Sequence[tuple[float, int, int]]) -> float:
    ok: Callable[[float], bool] = lambda r: stable(simulate(reps, trace, r))  # noqa: E731
    rate = max(capacity_hint(reps), 1e-3)
    lo, hi = 0.0, None
    if ok(rate):
        for _ in range(MAX_DOUBLINGS):
            lo, rate = rate, rate * 2
            if not ok(rate):
                hi = rate
                break
    else:
        for _ in range(MAX_DOUBLINGS):
            hi, rate = rate, rate / 2
            if ok(rate):
                lo = rate
                break
    if hi is None or lo == 0.0:
        return lo
    for _ in range(BISECT_STEPS):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def build_policies(inp: PlanInputs, seed: int, names: Sequence[str] = POLICIES) -> dict:
    builders = {
        "meshllm": lambda: from_plan(inp, plan_cluster(inp, seed=seed)),
        "splitwise": lambda: splitwise(inp),
        "memory-ring": lambda: memory_ring(inp),
        "random": lambda: random_policy(inp, seed),
    }
    return {name: builders[name]() for name in names}


def report(reps: Sequence[SimReplica], inp: PlanInputs, rate: float, seed: int,
           sweep_requests: int = SWEEP_REQUESTS) -> dict | None:
    """BRIEF fields at `rate`, plus the saturation rate from a sweep (None: no usable replica)."""
    if not reps:
        return None
    n = inp.requests or (inp.n_prompts if rate == 0 and inp.n_prompts else REPORT_REQUESTS)
    out = metrics(simulate(reps, make_trace(inp, n, seed), rate))
    out["saturation_rate_per_s"] = round(saturation_rate(reps, make_trace(inp, sweep_requests, seed)), 4)
    return out


def simulate_policies(inp: PlanInputs, rate: float | None = None, seed: int = 0,
                      names: Sequence[str] = POLICIES, sweep_requests: int = SWEEP_REQUESTS) -> dict:
    """The `--simulate` JSON: every policy on the same trace, router and simulator."""
    rate = inp.rate_per_s if rate is None else rate
    policies = build_policies(inp, seed, names)
    return {"policies": {name: report(reps, inp, rate, seed, sweep_requests) for name, reps in policies.items()},
            "rate_per_s": rate}
