"""Workload traces, the stability rule, the saturation sweep and the policy comparison of `--simulate`.

Stability rule (for `saturation_rate_per_s`): a rate is sustained only if waiting does not
grow with the run's length. The first 2N requests of the trace are simulated at the rate; with
W(N) the mean wait of the first N and W(2N) that of all 2N, the rate is stable iff

    W(2N) <= (1 + STABLE_GROWTH) x W(N) + STABLE_NOISE x S,

S being the mean service time of a request (its latency with no queue), and if, while the
second N arrive, at most STABLE_BACKLOG x N more requests arrive than complete. Above
capacity the wait grows linearly with time, so W(2N) ~ 2 W(N), and the requests in the system
pile up; below it both level off after a warm-up. (The second test is needed where a replica
works faster as its queue grows, e.g. a mixed replica that prefills whole prompts once many
wait: there the wait can grow slower than linearly while the backlog still grows.) A third
test rejects a long-wait plateau: the mean wait W(2N) must stay within STABLE_WAIT_SERVICES
service times of an idle system (`Sweep.service`). Mixed replicas that prefill whole prompts
once many wait can settle in a second steady state far past their capacity at short waits:
mixed-dp on bench-edge-8b kept a 38 s mean wait at 18 req/s, 14 idle service times, with
W(2N) = W(N) (its highest rate with short waits, 15.4 req/s, waits 2.6 s, under one service
time; every policy's saturation in the planner bench waited at most ~1.05 service times).
No operator calls such a rate sustained. N is at least `sweep_requests`, and large enough
that the first N span WINDOW_SERVICES service times, so that a decode backlog (a request
holds a decode slot for most of its latency) has time to show. The sweep steps the rate by STEP_FACTOR from the
policy's analytic capacity until a run is unstable (or down until one is stable), then
bisects BISECT_STEPS times. The highest of a dozen noisy verdicts is biased upwards, so the
result is then confirmed on a run CONFIRM_SCALE x as long, stepping down by CONFIRM_STEP until
one holds (after CONFIRM_STEPS, the sweep is redone on the longer runs). Near a plan's true
capacity a finite run cannot tell a small overload from a critical load: over a run of T
seconds at rate lambda, Poisson arrivals alone move the wait by ~sqrt(T / lambda), while an
overload of e adds e x T. On the fast SmolLM2 clusters (N of a few thousand, T of a few
seconds) the resolution is thus ~2% (BOUND_RESOLUTION): without the confirmation, plans that
keep every device busy came out at up to 1.02x the physical bound (metrics.py), which no plan
can beat; with it, at most 0.972x on any of the planner bench's traces (bench/results/planner.txt),
and a result up to BOUND_RESOLUTION above the bound means "at the bound".
"""

from __future__ import annotations

import functools
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from meshllm.partition.dp import Split
from meshllm.partition.inputs import PlanInputs
from meshllm.partition.latency import ROUTE_WAIT_WEIGHT
from meshllm.partition.plan import PlanInfeasible
from meshllm.partition.plan import rounded as plan_rounded  # (sweep has its own `rounded`)
from meshllm.partition.replica import decode_fit, mixed_fit, prefill_fit
from meshllm.sim import pool
from meshllm.sim.baselines import BASELINES, Policy, random_policy
from meshllm.sim.metrics import bound_rate_per_s, metrics
from meshllm.sim.replica import SimReplica, from_plan, replicas_key
from meshllm.sim.simulator import Request, Simulator

SWEEP_REQUESTS = 2000  # N of the stability rule, at least
STABLE_GROWTH = 0.25
STABLE_NOISE = 0.05
STABLE_BACKLOG = 0.05  # of the second half's arrivals: how many more may arrive than depart in it
STABLE_WAIT_SERVICES = 5.0  # mean wait at most this many idle service times (no long-wait plateau)
WINDOW_SERVICES = 10  # the first N requests' arrivals span at least this many service times
MAX_SWEEP_REQUESTS = 6_000  # N at most (bounds a run's cost)
CONFIRM_SCALE = 2  # the sweep's result is confirmed on a run this many times longer,
CONFIRM_STEP = 1.02  # stepping down by this factor while it is not stable,
CONFIRM_STEPS = 5  # at most this many times; then the sweep is done again on the longer runs
BOUND_RESOLUTION = 0.02  # near the physical bound a sweep's result is this precise (module docstring)
STEP_FACTOR = 1.5
MAX_STEPS = 16
BISECT_STEPS = 6
REPORT_REQUESTS = 400  # requests simulated at the file's rate when `requests` is 0 and rate > 0
POLICIES = ("meshllm", "splitwise", "mixed-dp", "memory-ring", "random", "greedy")

Trace = Sequence[tuple[float, int, int]]


def make_trace(inp: PlanInputs, n: int, seed: int) -> list[tuple[float, int, int]]:
    """(unit-rate arrival time, input tokens, output tokens) per request; scale by 1/rate. A longer
    trace of the same seed starts with the shorter one."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(1.0)
        out.append((t, inp.input_tokens.draw(rng), inp.output_tokens.draw(rng)))
    return out


def draw_length(rng: random.Random, d) -> int:
    return d.draw(rng)


def requests_at(trace: Trace, rate: float) -> list[Request]:
    return [Request(i, t / rate if rate > 0 else 0.0, n_in, n_out) for i, (t, n_in, n_out) in enumerate(trace)]


def simulate(reps: Sequence[SimReplica], trace: Trace, rate: float,
             route_wait_weight: float = ROUTE_WAIT_WEIGHT, gaps: bool = True) -> list[Request]:
    """The requests of `trace` at `rate`, served (gaps=False: without their token gaps, which
    only the ITL figures need)."""
    return Simulator(reps, requests_at(trace, rate), route_wait_weight, gaps).run()


def service_s(reqs: Sequence[Request]) -> float:
    """Mean latency beyond waiting: the requests' own compute and transfers."""
    return sum(r.done - r.arrival - r.wait_s for r in reqs) / len(reqs)


def stable(reqs: Sequence[Request], idle_service_s: float = math.inf) -> bool:
    """The documented stability rule, on a run of 2N requests in arrival order; `idle_service_s`:
    the mean service time with no queue (the plateau test)."""
    n = len(reqs) // 2
    w_n = sum(r.wait_s for r in reqs[:n]) / n
    w_2n = sum(r.wait_s for r in reqs) / len(reqs)
    if w_2n > (1 + STABLE_GROWTH) * w_n + STABLE_NOISE * service_s(reqs):
        return False
    if w_2n > STABLE_WAIT_SERVICES * idle_service_s:
        return False
    t_mid, t_end = reqs[n - 1].arrival, reqs[-1].arrival
    done = sum(1 for r in reqs if t_mid < r.done <= t_end)
    return len(reqs) - n - done <= STABLE_BACKLOG * (len(reqs) - n)


def capacity_hint(reps: Sequence[SimReplica]) -> float:
    """The planner's analytic requests/s of a policy's replicas (replica.py), the sweep's start."""
    rates = {"prefill": 0.0, "decode": 0.0, "mixed": 0.0}
    for r in reps:
        split = Split(tuple(range(len(r.members))), r.counts, 0.0)
        fit = {"prefill": prefill_fit, "decode": decode_fit, "mixed": mixed_fit}[r.role]
        got = fit(r.inp.mc, r.members, split, r.inp.net, r.inp.mix)
        rates[r.role] += got.req_s if got else 0.0
    return min(rates["prefill"], rates["decode"]) + rates["mixed"]


class Sweep:
    """Stability runs of one policy on one long trace (cached per rate)."""

    def __init__(self, reps: Sequence[SimReplica], inp: PlanInputs, seed: int, sweep_requests: int,
                 window: float = WINDOW_SERVICES, n_max: int = MAX_SWEEP_REQUESTS, confirm: bool = True):
        self.reps, self.inp, self.seed, self.n_min = reps, inp, seed, sweep_requests
        self.window, self.n_max, self.confirm = window, n_max, confirm
        hint = max(capacity_hint(reps), 1e-6)
        probe = simulate(reps, make_trace(inp, 50, seed + 1), hint / 100)
        self.service = service_s(probe)
        self.hint = hint
        self.trace = make_trace(inp, 2 * n_max * (CONFIRM_SCALE if confirm else 1), seed)

    def n_at(self, rate: float) -> int:
        return int(min(self.n_max, max(self.n_min, math.ceil(rate * self.window * self.service))))

    def ok(self, rate: float, scale: int = 1) -> bool:
        n = scale * self.n_at(rate)
        return stable(simulate(self.reps, self.trace[:2 * n], rate, gaps=False), self.service)

    def saturation(self, bisect_steps: int = BISECT_STEPS) -> float:
        lo = self.search(self.hint, 1, bisect_steps)
        if not self.confirm or lo == 0.0:
            return lo
        for _ in range(CONFIRM_STEPS):  # the highest rate of many short runs may be a lucky one
            if self.ok(lo, CONFIRM_SCALE):
                return lo
            lo /= CONFIRM_STEP
        return self.search(lo, CONFIRM_SCALE, bisect_steps)

    def search(self, rate: float, scale: int, bisect_steps: int) -> float:
        """Step from `rate` by STEP_FACTOR until stability changes, then bisect: the highest
        stable rate found, on runs `scale` x the stability rule's length."""
        ok: Callable[[float], bool] = functools.partial(self.ok, scale=scale)
        lo, hi = 0.0, None
        if ok(rate):
            for _ in range(MAX_STEPS):
                lo, rate = rate, rate * STEP_FACTOR
                if not ok(rate):
                    hi = rate
                    break
        else:
            for _ in range(MAX_STEPS):
                hi, rate = rate, rate / STEP_FACTOR
                if ok(rate):
                    lo = rate
                    break
        if hi is None or lo == 0.0:
            return lo
        for _ in range(bisect_steps):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if ok(mid) else (lo, mid)
        return lo


def saturation_rate(reps: Sequence[SimReplica], inp: PlanInputs, seed: int = 0,
                    sweep_requests: int = SWEEP_REQUESTS) -> float:
    return Sweep(reps, inp, seed, sweep_requests).saturation() if reps else 0.0


def saturation_rates(jobs: Sequence[tuple]) -> list[float]:
    """`saturation_rate(*job)` of each job (replicas, inputs, seed, sweep_requests), in the pool's
    processes (sim/pool.py): each sweep is deterministic, so the figures are those run one by one."""
    return pool.pmap(_saturation_rate, list(jobs))


def _saturation_rate(job: tuple) -> float:
    return saturation_rate(*job)


def meshllm_policy(inp: PlanInputs, rate: float, seed: int, sweep_requests: int = SWEEP_REQUESTS) -> Policy:
    from meshllm.sim.judge import judged_plan  # the judge imports this module
    from meshllm.sim.trials import JUDGE_SWEEP_REQUESTS

    plan = judged_plan(replace(inp, rate_per_s=rate), seed, sweep_requests=min(sweep_requests, JUDGE_SWEEP_REQUESTS))
    return Policy(from_plan(inp, plan), {n: plan.reasons.get(n, "") for n in plan.unused + plan.drafters
                                         if n in {m.id for m in inp.members}})


def build_policies(inp: PlanInputs, seed: int, names: Sequence[str] = POLICIES, rate: float | None = None,
                   sweep_requests: int = SWEEP_REQUESTS) -> dict:
    rate = inp.rate_per_s if rate is None else rate
    out = {}
    for name in names:
        if name == "meshllm":
            try:
                out[name] = meshllm_policy(inp, rate, seed, sweep_requests)
            except PlanInfeasible:
                out[name] = Policy([], {})
        elif name == "random":
            out[name] = random_policy(inp, seed)
        else:
            out[name] = BASELINES[name](inp)
    return out


def report(pol: Policy, inp: PlanInputs, rate: float, seed: int, bound: float,
           sweep_requests: int = SWEEP_REQUESTS, capacity: Policy | None = None) -> dict | None:
    """The README's fields at `rate`, the saturation rate from a sweep and its fraction of the bound
    (None: the policy has no usable replica); `capacity`: the policy whose saturation is
    reported, if not `pol` (meshllm's plan made for the highest rate)."""
    if not pol.replicas:
        return None
    n = inp.requests or (inp.n_prompts if rate == 0 and inp.n_prompts else REPORT_REQUESTS)
    out = metrics(simulate(pol.replicas, make_trace(inp, n, seed), rate))
    sat = saturation_rate((capacity or pol).replicas, inp, seed, sweep_requests)
    out["saturation_rate_per_s"] = rounded(sat)
    out["saturation_of_bound"] = round(sat / bound, 4) if bound > 0 else None
    out["replicas"] = len(pol.replicas)
    out["idle"] = dict(pol.idle)
    return out


def simulate_policies(inp: PlanInputs, rate: float | None = None, seed: int = 0,
                      names: Sequence[str] = POLICIES, sweep_requests: int = SWEEP_REQUESTS,
                      log: bool = False) -> dict:
    """The `--simulate` JSON: every policy on the same trace, router and simulator. meshllm plans
    for `rate` (the lowest cost there, with headroom), and its saturation is that of the plan it
    makes when asked for the highest rate (no rate given), as its operator would run it for
    either; the baselines' builders do not depend on the rate. `log`: a progress line on stderr
    per step (seconds on the example clusters, many minutes on 200 devices)."""
    t0 = time.perf_counter()

    def progress(what: str) -> None:
        if log:
            print(f"simulate: {what}, {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)

    rate = inp.rate_per_s if rate is None else rate
    bound = bound_rate_per_s(inp, [(a, b) for _, a, b in make_trace(inp, max(sweep_requests, 1000), seed)])
    policies = build_policies(inp, seed, names, rate, sweep_requests)
    progress(f"built {', '.join(policies)} (meshllm planned for "
             f"{f'{rate:g} req/s' if rate > 0 else 'capacity'} with the simulator as its judge)")
    capacity = (build_policies(inp, seed, ("meshllm",), 0.0, sweep_requests)["meshllm"]
                if "meshllm" in names and rate > 0 else None)
    if capacity is not None:
        progress("meshllm planned for capacity")
    out = {}
    # policies with the same replicas (on one node, every baseline is that node alone) run once:
    # each run is deterministic, so the figures are those each would have had
    keyed = {name: (replicas_key(pol.replicas), replicas_key(capacity.replicas)
                    if name == "meshllm" and capacity is not None else None) for name, pol in policies.items()}
    jobs = {}
    for name, pol in policies.items():
        jobs.setdefault(keyed[name], (pol, inp, rate, seed, bound, sweep_requests,
                                      capacity if name == "meshllm" else None))
    progress(f"simulating the {len(policies)} policies ({len(jobs)} different) and their saturation sweeps "
             f"({pool.workers()} at once)")
    done = dict(zip(jobs, pool.pmap(_report, list(jobs.values()))))
    for name, pol in policies.items():
        got = done[keyed[name]]
        out[name] = None if got is None else {**got, "idle": dict(pol.idle)}
        progress(f"{name}: " + ("no usable replica" if out[name] is None else
                                f"saturation {out[name]['saturation_rate_per_s']:g} req/s "
                                f"({out[name]['saturation_of_bound']} of the bound)"))
    return {"policies": out, "rate_per_s": rate, "bound_rate_per_s": rounded(bound)}


def rounded(rate: float) -> float:
    """A rate to 4 decimals, or to 4 significant digits below 0.001 req/s (4 decimals made a
    cluster that sustains 4.2e-05 req/s print "saturation 0 req/s (0.8228 of the bound)")."""
    return plan_rounded(rate, 4)


def _report(job: tuple) -> dict | None:
    """`report` of one policy (module-level: it runs in a pool process, sim/pool.py)."""
    return report(*job)
