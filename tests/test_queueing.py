"""The simulator against queueing theory (Poisson arrivals: M/M/1, M/D/1, M/M/c), the textbook
formulas themselves, and the planner's fast approximation against the exact M/M/c result."""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import replace

import pytest

from meshllm.device import DeviceProfile
from meshllm.partition.dp import Member
from meshllm.partition.inputs import LengthDist
from meshllm.partition.queueing import erlang_c, md1_wait, mg1_wait, mgc_wait_approx, mm1_wait, mmc_wait
from meshllm.shapes import model_args
from meshllm.sim import router, simulator
from meshllm.sim.replica import SimReplica
from meshllm.sim.simulator import Request, Simulator
from tests.planner_fixtures import small_inputs

N_REQUESTS = 60_000  # the mean wait's relative standard error is ~2% at rho = 0.5 (checked over seeds)
# A compute-bound device and llama-3-8b shapes: a prefill's time is linear in its tokens to within
# 0.3% (attention is tiny next to the projections at 100 tokens), so exponential prompt lengths
# give exponential service times.
DEVICE = DeviceProfile("compute-bound", memory_gb=1000, compute_tflops=100, memory_bandwidth_gbps=1e6,
                       network_mbps=1e6)


def prefill_servers(c: int, dist: str) -> list[SimReplica]:
    base = small_inputs()
    inp = replace(base, args=model_args("llama-3-8b"), dtype="fp16", input_tokens=LengthDist(100, dist),
                  output_tokens=LengthDist(1, "fixed"))  # one output token: the prefill is the whole job
    return [SimReplica(i, "prefill", (Member(f"s{i}", DEVICE, "z"),), (32,), inp) for i in range(c)]


@pytest.fixture
def fcfs(monkeypatch):
    """The textbook formulas are for first-come-first-served queues with one job in service:
    infinite aging makes the replicas' prompt order (router.prompt_priority) first come, first
    served, and a micro-batch budget of no tokens makes a prefill replica take one prompt at a
    time (not the queued prompts that TOKEN_BUDGET holds, which shortens the queue)."""
    monkeypatch.setattr(router, "PROMPT_AGING_TOKENS_PER_S", 1e12)
    monkeypatch.setattr(simulator, "TOKEN_BUDGET", 0)


def run(servers: list[SimReplica], rho: float, seed: int, out: list | None = None) -> tuple[float, float, float, float]:
    """(mean wait in the prefill queue, arrival rate, E[S], squared CV of S) of a Poisson run;
    `out` receives the requests."""
    rng = random.Random(seed)
    lengths = [servers[0].inp.input_tokens.draw(rng) for _ in range(N_REQUESTS)]
    service = [servers[0].prefill_s(n)[1] for n in lengths]
    mean_s = sum(service) / len(service)
    cs2 = sum(s * s for s in service) / len(service) / mean_s ** 2 - 1
    lam, t, reqs = rho * len(servers) / mean_s, 0.0, []
    for i, n in enumerate(lengths):
        t += rng.expovariate(lam)
        reqs.append(Request(i, t, n, 1))
    done = Simulator(servers, reqs).run()
    if out is not None:
        out.extend(done)
    return sum(r.prefill_start - r.arrival for r in done) / len(done), lam, mean_s, cs2


def test_formulas_on_known_values():
    assert erlang_c(1, 0.5) == pytest.approx(0.5)  # M/M/1: P(wait) = rho
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)
    assert mmc_wait(0.5, 1.0, 1) == pytest.approx(mm1_wait(0.5, 1.0)) == pytest.approx(1.0)
    assert md1_wait(0.5, 1.0) == pytest.approx(0.5) and mg1_wait(0.5, 1.0, 1.0) == pytest.approx(1.0)
    assert mm1_wait(1.0, 1.0) == float("inf") and mgc_wait_approx(3.0, 1.0, 3, 1.0) == float("inf")


@pytest.mark.parametrize("rho", [0.5, 0.7])
def test_simulator_matches_mm1(rho, fcfs):
    wait, lam, mean_s, cs2 = run(prefill_servers(1, "exponential"), rho, seed=0)
    assert cs2 == pytest.approx(1.0, abs=0.03)  # exponential service, as built
    assert wait == pytest.approx(mm1_wait(lam, mean_s), rel=0.05)


@pytest.mark.parametrize("rho", [0.5, 0.7])
def test_simulator_matches_md1(rho, fcfs):
    wait, lam, mean_s, cs2 = run(prefill_servers(1, "fixed"), rho, seed=1)
    assert cs2 == pytest.approx(0.0, abs=1e-9)
    assert wait == pytest.approx(md1_wait(lam, mean_s), rel=0.05)


def test_simulator_matches_mmc_with_the_routers_least_work_choice(fcfs):
    """Three identical servers: the router sends each prompt where it starts first, which is the
    FCFS M/M/c queue (Erlang C)."""
    wait, lam, mean_s, _ = run(prefill_servers(3, "exponential"), 0.7, seed=2)
    assert wait == pytest.approx(mmc_wait(lam, mean_s, 3), rel=0.05)


@pytest.mark.parametrize("rho", [0.5, 0.7])
def test_shortest_first_matches_the_mg1_formula(rho, monkeypatch):
    """Without aging the prompt order is non-preemptive shortest-job-first. Its M/G/1 mean wait
    for a job of size x is W0 / ((1 - rho(<x)) (1 - rho(<=x))), W0 = lambda E[S^2] / 2, rho(<x) the
    load of smaller jobs (Phipps 1956; equal sizes are served in arrival order); averaged over
    the run's own jobs, it is well below the FCFS M/M/1 wait, as is the simulator's."""
    monkeypatch.setattr(router, "PROMPT_AGING_TOKENS_PER_S", 0.0)
    monkeypatch.setattr(simulator, "TOKEN_BUDGET", 0)  # one job in service (fcfs)
    done: list = []
    servers = prefill_servers(1, "exponential")
    wait, lam, mean_s, _ = run(servers, rho, seed=3, out=done)
    count = Counter(r.n_in for r in done)
    service = {n: servers[0].prefill_s(n)[1] for n in count}
    w0 = lam * sum(service[n] ** 2 * k for n, k in count.items()) / len(done) / 2
    load_below, load_upto, acc = {}, {}, 0.0
    for n in sorted(count):
        load_below[n] = acc
        acc += lam * service[n] * count[n] / len(done)
        load_upto[n] = acc
    expected = sum(w0 / ((1 - load_below[r.n_in]) * (1 - load_upto[r.n_in])) for r in done) / len(done)
    assert wait == pytest.approx(expected, rel=0.05)
    assert wait < 0.8 * mm1_wait(lam, mean_s)


def test_fast_approximation_tracks_erlang_c():
    for c in (1, 2, 4, 8, 16, 64):
        for rho in (0.3, 0.5, 0.7, 0.9):
            exact, approx = mmc_wait(rho * c, 1.0, c), mgc_wait_approx(rho * c, 1.0, c, 1.0)
            assert abs(approx - exact) <= 0.02 + 0.1 * exact, (c, rho, exact, approx)


def test_a_pool_of_no_servers_waits_for_ever():
    from meshllm.partition.queueing import mgc_wait_approx

    assert mgc_wait_approx(1.0, 0.1, 0, 1.0) == math.inf and mgc_wait_approx(1.0, 0.1, -1, 1.0) == math.inf
    assert mgc_wait_approx(1.0, 0.1, 2, 1.0) < 0.01
