"""Discrete-event simulator: accounting on hand-checkable cases, ports and links, mixed replicas,
the stability rule, the baselines, the bound, the CLI."""

from __future__ import annotations

import json
import random
import re
import statistics
from dataclasses import replace

import pytest

from meshllm.config import load_cluster, plan_inputs
from meshllm.device import DeviceProfile
from meshllm.partition.cost import request_flops
from meshllm.partition.dp import Member
from meshllm.partition.inputs import LengthDist, PlanLink
from meshllm.partition.plan import plan_cluster
from meshllm.sim.baselines import memory_ring, mixed_dp, splitwise
from meshllm.sim.metrics import bound_rate_per_s, metrics, weighted_quantiles
from meshllm.sim.replica import SimReplica, from_plan
from meshllm.sim.simulator import Request, Simulator
from meshllm.sim.sweep import (
    BOUND_RESOLUTION,
    Sweep,
    draw_length,
    make_trace,
    requests_at,
    saturation_rate,
    simulate,
    simulate_policies,
    stable,
)
from tests.conftest import REPO, run_cli
from tests.planner_fixtures import small_inputs

FIELDS = {"mean_wait_ms", "p99_wait_ms", "mean_prefill_wait_ms", "mean_ttft_ms", "ttft_p50_ms", "ttft_p99_ms",
          "itl_p50_ms", "itl_p99_ms", "mean_e2e_ms", "e2e_p50_ms", "e2e_p99_ms", "throughput_tok_s",
          "saturation_rate_per_s", "saturation_of_bound", "replicas", "idle"}


@pytest.fixture(scope="module")
def demo():
    return None, small_inputs()


def replica(inp, rid, role, ids, counts):
    by_id = {m.id: m for m in inp.members}
    return SimReplica(rid, role, tuple(by_id[i] for i in ids), counts, inp)


def test_lone_request_has_no_wait(demo):
    _, inp = demo
    pre = replica(inp, 0, "prefill", ["fog-1"], (30,))
    dec = replica(inp, 1, "decode", ["fog-2"], (30,))
    req = Simulator([pre, dec], [Request(0, 0.0, 100, 10)]).run()[0]
    _, lat = pre.prefill_s(100)
    assert req.wait_s == pytest.approx(0.0, abs=1e-12)
    assert req.first_token == pytest.approx(lat) and req.prefill_start == 0.0
    assert req.kv_ready > req.first_token and req.done > req.kv_ready
    assert sum(n for _, n in req.gaps) == 9  # 10 tokens, the first from the prefill


def test_a_request_s_wait_is_its_queue_its_port_waits_and_its_slot_wait(demo):
    """Under load (300 requests at 30 req/s on a 2-stage prefill and a 2-stage decode replica),
    every request's wait is the sum of its parts: prefill queue, ports (activations between
    stages and KV) and decode slots, each of them met by many requests. Dropping a part from the
    wait (a mutation review: the slot wait, the activations' port wait) under-reported waits
    exactly where the system is saturated."""
    _, inp = demo
    pre = replica(inp, 0, "prefill", ["fog-1", "fog-2"], (15, 15))
    dec = replica(inp, 1, "decode", ["fog-3", "fog-4"], (15, 15))
    rng, t, reqs = random.Random(3), 0.0, []
    for i in range(300):
        t += rng.expovariate(30.0)
        reqs.append(Request(i, t, rng.randint(20, 400), rng.randint(2, 200)))
    out = Simulator([pre, dec], reqs).run()
    assert sum(r.port_wait_s > 0 for r in out) > 100 and sum(r.slot_wait_s > 0 for r in out) > 100
    assert sum(r.prefill_start > r.arrival for r in out) > 50
    for r in out:
        parts = (r.prefill_start - r.arrival) + r.port_wait_s + r.slot_wait_s
        assert r.wait_s == pytest.approx(parts, rel=1e-9, abs=1e-9), r


def test_same_port_direction_makes_the_second_transfer_wait(demo):
    _, inp = demo
    pre = replica(inp, 0, "prefill", ["fog-1"], (30,))
    dec = replica(inp, 1, "decode", ["fog-2"], (30,))
    a, b = Simulator([pre, dec], [Request(0, 0.0, 4000, 2), Request(1, 0.0, 4000, 2)]).run()
    occ, _ = pre.prefill_s(4000)
    assert b.prefill_start == pytest.approx(occ)  # waited for the pipeline slot
    kv_s = 30 * 4000 * inp.mc.kv_bytes_per_token * 8 / 1e9  # 1 Gb/s ports
    port_wait = max(0.0, (a.first_token + kv_s) - b.first_token)
    assert port_wait > 0 and b.port_wait_s == pytest.approx(port_wait, rel=1e-6)
    assert b.wait_s == pytest.approx(occ + port_wait, rel=1e-6)


def test_ports_are_full_duplex(demo):
    """fog-2 receives KV from fog-1 while it sends its own to fog-3: neither waits for the other."""
    _, inp = demo
    reps = [replica(inp, 0, "prefill", ["fog-1"], (30,)), replica(inp, 1, "prefill", ["fog-2"], (30,)),
            replica(inp, 2, "decode", ["fog-3"], (30,)), replica(inp, 3, "decode", ["fog-4"], (30,))]
    sim = Simulator(reps, [])
    flows_in = sim.router.kv_flows(reps[0], reps[1], 4000)  # fog-1 -> fog-2 (rx of fog-2)
    flows_out = sim.router.kv_flows(reps[1], reps[2], 4000)  # fog-2 -> fog-3 (tx of fog-2)
    e1, i1 = sim.ports.transfers(flows_in, 0.0, commit=True)
    e2, i2 = sim.ports.transfers(flows_out, 0.0, commit=True)
    assert e1 == pytest.approx(i1) and e2 == pytest.approx(i2)
    e3, i3 = sim.ports.transfers(flows_out, 0.0, commit=False)  # same direction again: queues
    assert e3 == pytest.approx(e2 + (i3 - 0.0005), rel=1e-6) and e3 > i3


def test_links_between_zones_are_shared_within_a_zone_per_flow(demo):
    _, inp = demo
    inp = replace(inp, links=(PlanLink(("a", "b"), 0.0, 100.0), PlanLink(("a", "a"), 0.0, 100.0)))
    dev = DeviceProfile("d", 8, 10, 100, 10000)  # fast ports: the links are the bottleneck
    m = {x: Member(x, dev, z) for x, z in (("a1", "a"), ("a2", "a"), ("a3", "a"), ("b1", "b"), ("b2", "b"))}
    from meshllm.sim.ports import PortBook

    book = PortBook(inp.net)
    one = 1e6 * 8 / 100e6  # 1 MB over 100 Mb/s
    assert book.transfer(m["a1"], m["b1"], 1e6, 0.0)[0] == pytest.approx(one)
    assert book.transfer(m["a2"], m["b2"], 1e6, 0.0)[0] == pytest.approx(2 * one)  # the a-b link is shared
    assert book.transfer(m["b1"], m["a1"], 1e6, 0.0)[0] == pytest.approx(one)  # the other direction is not
    assert book.transfer(m["a1"], m["a2"], 1e6, 0.0)[0] == pytest.approx(one)
    assert book.transfer(m["a3"], m["a1"], 1e6, 0.0)[0] == pytest.approx(one)  # in a zone: per flow


def test_prefill_activations_cross_ports(demo):
    """A two-stage prefill pipeline sends its activations on the ports: a KV transfer queued on the
    first stage's tx delays them (and their wait is booked)."""
    _, inp = demo
    pre = replica(inp, 0, "prefill", ["fog-1", "fog-2"], (15, 15))
    dec = replica(inp, 1, "decode", ["fog-3"], (30,))
    sim = Simulator([pre, dec], [Request(0, 0.0, 500, 2)])
    sim.ports.free[("fog-1", "tx")] = 5.0  # something queued on fog-1's port for 5 s
    req = sim.run()[0]
    stages, _, lat = pre.prefill_stages(500)
    assert req.port_wait_s == pytest.approx(5.0 - stages[0], rel=1e-6)
    assert req.first_token == pytest.approx(lat + req.port_wait_s, rel=1e-6)


def test_a_replica_takes_the_shortest_queued_prompt_first_with_aging(demo):
    """While a prompt holds the pipeline, a long one and then a shorter one queue: the shorter one
    starts first (router.prompt_priority). If it arrives more than (difference in tokens) /
    PROMPT_AGING_TOKENS_PER_S seconds after the long one, the long one has aged past it."""
    from meshllm.sim.router import PROMPT_AGING_TOKENS_PER_S

    _, inp = demo
    pre = replica(inp, 0, "prefill", ["fog-1"], (30,))
    dec = replica(inp, 1, "decode", ["fog-2"], (30,))
    busy = pre.prefill_s(3000)[0]  # the first prompt holds the pipeline this long
    aged = (3000 - 2900) / PROMPT_AGING_TOKENS_PER_S
    assert aged < 0.8 * busy
    for gap, shorter_first in ((0.2 * aged, True), (1.5 * aged, False)):
        _, long, short = Simulator([pre, dec], [Request(0, 0.0, 3000, 2), Request(1, 0.0, 3000, 2),
                                                Request(2, gap, 2900, 2)]).run()
        assert (short.prefill_start < long.prefill_start) is shorter_first, gap
        assert min(short.prefill_start, long.prefill_start) == pytest.approx(busy)


def test_mixed_replica_chunks_prompts_into_decode_steps(demo):
    _, inp = demo
    ring = replica(inp, 0, "mixed", ["fog-1", "fog-2"], (15, 15))
    reqs = Simulator([ring], [Request(i, 0.05 * i, 50, 40) for i in range(12)]).run()
    assert all(r.done > r.first_token >= r.prefill_start >= r.arrival for r in reqs)
    assert all(r.wait_s >= r.paused_s >= 0 for r in reqs)
    assert sum(n for r in reqs for _, n in r.gaps) == sum(r.n_out - 1 for r in reqs)
    free = ring.free_chunk(6, 80, 50)
    assert free >= 16 and ring.decode_iter_s(6, 80, free, 50) <= ring.decode_iter_s(6, 80) * 1.02


def test_a_mixed_replica_prefills_several_short_prompts_in_one_step(demo):
    """Eight sequences decode when four 12-token prompts arrive (fewer than the batch: chunks).
    A step's prompt budget (at least MIN_CHUNK tokens) takes the chunks of as many prompts as it
    holds, as the live leader does: the four get their first tokens in fewer than four steps.
    (One prompt per step, the old rule, gave each its own step.)"""
    _, inp = demo
    ring = replica(inp, 0, "mixed", ["fog-1"], (30,))
    reqs = [Request(i, 0.0, 12, 400) for i in range(8)] + [Request(8 + i, 1.0, 12, 4) for i in range(4)]
    done = Simulator([ring], reqs).run()
    prompts = [r for r in done if r.rid >= 8]
    assert len({r.first_token for r in prompts}) < len(prompts)
    assert sum(n for r in done for _, n in r.gaps) == sum(r.n_out - 1 for r in done)


def test_whole_prompts_of_a_queue_share_a_step_as_the_prompt_budget_holds(demo):
    """Four sequences decode on a one-stage mixed replica when a burst of forty 12-token prompts
    arrives: more prompts wait than sequences decode, so they go whole, and a whole step takes as
    many as the step's prompt budget holds (at least one per stage). One prompt per step, the
    old rule, gave each its own step: a queue that had formed drained at 12 tokens a step, and
    on clusters/wan.yaml one trace's queue grew without end at 10000 req/s while chunked steps
    kept up with 12500."""
    _, inp = demo
    ring = replica(inp, 0, "mixed", ["fog-1"], (30,))
    reqs = [Request(i, 0.0, 12, 400) for i in range(4)] + [Request(4 + i, 1.0, 12, 4) for i in range(40)]
    done = Simulator([ring], reqs).run()
    burst = [r for r in done if r.rid >= 4]
    assert len({r.first_token for r in burst}) <= len(burst) // 4
    assert all(r.done > r.first_token >= r.prefill_start >= r.arrival for r in done)
    assert sum(n for r in done for _, n in r.gaps) == sum(r.n_out - 1 for r in done)


def test_a_prefill_replica_prefills_queued_short_prompts_in_one_micro_batch(demo):
    """As roles/batcher.py fills a micro-batch's TOKEN_BUDGET rows with the prompts of several
    sequences, a prefill replica takes the queued prompts whole, in order, as many as the budget
    holds: forty 12-token prompts queued behind one go in micro-batches of 21 and 19 (two, not
    forty, one after the other), each reading the stage's weights once. One prompt per micro-batch, the old rule,
    capped clusters/failure.yaml's prefill Jetson at 301 req/s where its port ships 580."""
    from meshllm.defaults import TOKEN_BUDGET
    from meshllm.partition.steps import prefill_batch_stage_s, prefill_stage_s, prompts_per_batch

    _, inp = demo
    pre = replica(inp, 0, "prefill", ["fog-1"], (30,))
    dec = replica(inp, 1, "decode", ["fog-2"], (30,))
    done = Simulator([pre, dec], [Request(0, 0.0, 12, 4)] + [Request(i, 1e-3, 12, 4) for i in range(1, 41)]).run()
    k = prompts_per_batch(12)
    assert k == TOKEN_BUDGET // 12 == 21
    one = pre.prefill_s(12)[0]
    _, occ, lat = pre.prefill_batch((12,) * k)
    starts = sorted({r.prefill_start for r in done})
    assert starts == pytest.approx([0.0, one, one + occ])
    assert [sum(r.prefill_start == t for r in done) for t in starts] == [1, k, 40 - k]
    assert occ < 2 * one < k * one  # the weights read once for all
    assert all(r.first_token == pytest.approx(one + lat) for r in done if r.prefill_start == starts[1])
    assert all(r.done > r.first_token for r in done)
    # a prompt over the budget goes alone, whole; one prompt costs what it costs alone, to the bit
    long = Simulator([pre, dec], [Request(0, 0.0, 300, 4), Request(1, 0.0, 300, 4)]).run()
    assert long[0].prefill_start != long[1].prefill_start
    mc, net = inp.mc, inp.net
    assert prefill_batch_stage_s(mc, pre.members, (30,), net, [12]) == prefill_stage_s(mc, pre.members, (30,), net, 12)
    # the planner's prefill capacity counts the same micro-batches
    from meshllm.partition.replica import Mix, evaluate_replica

    fit = evaluate_replica(mc, pre.members, net, Mix(12, 4)).prefill
    assert fit.compute_req_s == pytest.approx(k / occ)
    assert fit.occupancy_s == pytest.approx(pre.prefill_s(12)[0])  # one prompt alone: its latency figures
    assert evaluate_replica(mc, pre.members, net, Mix(300, 4)).prefill.compute_req_s == pytest.approx(
        1 / pre.prefill_s(300)[0])


def test_a_chunk_between_cache_buckets_costs_between_theirs(demo):
    """Step times are cached at chunks of multiples of CHUNK_BUCKET and interpolated between
    them: a compute-bound chunk halfway between two multiples costs more than the lower one
    (rounding down made them equal, so prompt tokens rode along for free) and less than the
    upper one."""
    from meshllm.sim.replica import CHUNK_BUCKET

    _, inp = demo
    ring = replica(inp, 0, "mixed", ["fog-1", "fog-2"], (15, 15))
    ctx = inp.mix.decode_ctx
    lo = 1000 // CHUNK_BUCKET * CHUNK_BUCKET
    hi, mid = lo + CHUNK_BUCKET, lo + CHUNK_BUCKET // 2
    step = [ring.decode_iter_s(4, ctx, chunk, lo / 2) for chunk in (lo, mid, hi)]
    assert step[0] < step[1] < step[2]


def test_a_stability_run_without_token_gaps_serves_exactly_the_same(demo):
    """The sweep's stability runs skip recording each token gap (only the ITL figures need them;
    millions of them made a bench-edge-8b sweep 1.8x slower): every other figure is unchanged."""
    _, inp = demo
    reps = from_plan(inp, plan_cluster(inp, log=False))
    trace = make_trace(inp, 300, 0)
    full, bare = simulate(reps, trace, 2.0), simulate(reps, trace, 2.0, gaps=False)
    assert sum(len(r.gaps) for r in full) > 0 and all(r.gaps == [] for r in bare)
    strip = lambda reqs: [replace(r, gaps=[]) for r in reqs]  # noqa: E731
    assert strip(full) == strip(bare)


def test_the_sweep_confirms_its_result_on_a_longer_run(demo):
    """The highest rate many short runs call stable is confirmed on a run CONFIRM_SCALE x as
    long, stepping down until one holds: the result never rises, and the longer run at the
    result is stable."""
    from meshllm.sim import sweep as sim_sweep

    _, inp = demo
    reps = from_plan(inp, plan_cluster(inp, log=False))
    short = Sweep(reps, inp, 0, 300, confirm=False)
    long = Sweep(reps, inp, 0, 300)
    got_short, got = short.saturation(), long.saturation()
    assert 0 < got <= got_short
    assert long.ok(got, sim_sweep.CONFIRM_SCALE)


def test_a_mixed_replica_prefills_whole_only_when_that_waits_less(demo):
    """A long prompt reaching a 3-stage mixed replica that decodes one sequence rides along its
    steps in chunks: pausing that sequence for the whole prefill would add more waiting than the
    prompt's own chunking delay (the old rule, "whole once as many prompts wait as sequences
    decode", paused it for all of it). With nothing decoding, or a queue of prompts, it goes whole."""
    _, inp = demo
    ring = replica(inp, 0, "mixed", ["fog-1", "fog-2", "fog-3"], (10, 10, 10))
    ctx = inp.mix.decode_ctx
    assert not ring.goes_whole(1, ctx, 1, 1000, 1000)
    assert ring.goes_whole(0, ctx, 1, 1000, 1000)  # nothing decodes: nobody pauses
    assert ring.goes_whole(1, ctx, 2, 1000, 2000)  # a queue drains faster whole
    assert not ring.goes_whole(3, ctx, 2, 1000, 2000)  # fewer prompts than sequences: chunks
    lone = Simulator([ring], [Request(0, 0.0, 1000, 2)]).run()[0]
    decoding, prompt = Simulator([ring], [Request(0, 0.0, 20, 3000), Request(1, 5.0, 1000, 2)]).run()
    _, lat = ring.prefill_s(1000)
    assert prompt.first_token - prompt.arrival > lone.first_token  # chunked: later than alone ...
    assert decoding.paused_s + prompt.wait_s < lat  # ... but both together wait less than one whole pause
    assert decoding.paused_s < 0.5 * lat  # whole, it would pause all of lat


def test_the_router_expects_a_prompt_to_wait_for_the_next_micro_batch_launch(demo):
    """`join_wait_s`, the wait the router counts for a prompt reaching a busy mixed replica, is
    what the simulator makes it wait: short prompts arriving at random while 1 or 3 sequences
    decode start at the next micro-batch launch (min(stages, batch) per step)."""
    _, inp = demo
    for ids in (["fog-1"], ["fog-1", "fog-2"], ["fog-1", "fog-2", "fog-3"]):
        rep = replica(inp, 0, "mixed", ids, tuple(30 // len(ids) for _ in ids))
        for b in (1, 3):
            rng, t = random.Random(1), 0.5
            reqs = [Request(i, 0.0, 20, 4000) for i in range(b)]
            for i in range(b, b + 200):
                t += rng.expovariate(4.0)
                reqs.append(Request(i, t, 8, 1))
            out = Simulator([rep], reqs).run()
            pre = statistics.fmean(r.prefill_start - r.arrival for r in out[b:])
            ctx = 20 + t / 2 / rep.decode_iter_s(b, 500)  # the decoding sequences' mean context meanwhile
            assert 0.8 < pre / rep.join_wait_s(b, ctx) < 1.7, (ids, b)
    assert rep.join_wait_s(0, 100) == 0.0  # an idle replica starts a prompt at once


def test_a_sequence_joins_the_next_micro_batch_not_the_next_iteration(demo):
    """A 3-stage decode replica running 3 sequences launches a micro-batch every third of a step
    (roles/leader.py): a request whose KV lands mid-step waits at most that long for a slot, and
    the cut run costs the running sequences no tokens."""
    _, inp = demo
    pre = replica(inp, 0, "prefill", ["fog-4"], (30,))
    dec = replica(inp, 1, "decode", ["fog-1", "fog-2", "fog-3"], (10, 10, 10))
    step = dec.decode_iter_s(3, 140)
    waits = []
    for k in range(12):  # the newcomer's KV lands at 12 phases of the running iteration
        reqs = [Request(i, 0.001 * i, 100, 400) for i in range(3)] + [Request(3, 2.0 + k * step / 12, 100, 5)]
        out = Simulator([pre, dec], reqs).run()
        waits.append(out[3].slot_wait_s)
        assert all(sum(n for _, n in r.gaps) == r.n_out - 1 for r in out)  # every token once
        assert all(r.done >= r.last_token >= r.first_token for r in out)
    assert max(waits) <= step / 3 * 1.05
    assert max(waits) > step / 6  # it does wait for a launch (the phases cover the step)


def test_a_prefill_replica_ships_kv_to_a_mixed_replica(demo):
    """When the mixed replica is busy with prompts, the router prefills elsewhere and ships the KV to
    it; the mixed replica decodes those sequences beside its own."""
    _, inp = demo
    pre = replica(inp, 0, "prefill", ["fog-3"], (30,))
    mix = replica(inp, 1, "mixed", ["fog-4"], (30,))
    reqs = Simulator([pre, mix], [Request(i, 0.01 * i, 400, 20) for i in range(12)]).run()
    shipped = [r for r in reqs if r.kv_ready == r.kv_ready and r.kv_ready > 0]  # kv_ready is NaN unless shipped
    assert shipped and len(shipped) < len(reqs)  # both ways
    assert all(r.done > r.kv_ready >= r.first_token for r in shipped)
    assert all(sum(n for _, n in r.gaps) == r.n_out - 1 for r in reqs)


def test_mixed_replica_never_ships_kv(demo):
    _, inp = demo
    reps = [replica(inp, 0, "mixed", ["fog-1"], (30,)), replica(inp, 1, "mixed", ["fog-2"], (30,))]
    sim = Simulator(reps, [Request(i, 0.01 * i, 200, 20) for i in range(20)])
    sim.run()
    assert not any(k[1] in ("tx", "rx") for k in sim.ports.free)  # no KV, no activations (one stage)


def test_lengths_and_trace(demo):
    rng = random.Random(0)
    assert {draw_length(rng, LengthDist(7, "fixed")) for _ in range(10)} == {7}
    xs = [draw_length(rng, LengthDist(200, "lognormal")) for _ in range(4000)]
    assert sum(xs) / len(xs) == pytest.approx(200, rel=0.08)
    ys = [draw_length(rng, LengthDist(50, "uniform")) for _ in range(4000)]
    assert 1 <= min(ys) and max(ys) <= 99 and sum(ys) / len(ys) == pytest.approx(50, rel=0.05)
    zs = [draw_length(rng, LengthDist(100, "exponential")) for _ in range(8000)]
    assert sum(zs) / len(zs) == pytest.approx(100, rel=0.05)
    _, inp = demo
    inp = replace(inp, input_tokens=LengthDist(10, "fixed"), output_tokens=LengthDist(5, "fixed"))
    tr = make_trace(inp, 3000, 1)
    assert tr == make_trace(inp, 3000, 1) and {(a, b) for _, a, b in tr} == {(10, 5)}
    assert tr[-1][0] / 3000 == pytest.approx(1.0, rel=0.06)
    assert make_trace(inp, 6000, 1)[:3000] == tr  # a longer trace starts with the shorter one


def test_stability_rule_separates_low_and_overload(demo):
    _, inp = demo
    reps = from_plan(inp, plan_cluster(inp, log=False))
    trace = make_trace(inp, 1200, 0)
    assert stable(simulate(reps, trace, 20.0))
    assert not stable(simulate(reps, trace, 5000.0))


def test_stability_rule_rejects_a_long_wait_plateau():
    # a steady state whose wait neither grows nor backs up, but is 10 idle service times long
    # (mixed-dp on bench-edge-8b kept 38 s at 18 req/s, 14 service times): not sustained
    reqs = [Request(i, 0.1 * i, 8, 4, done=0.1 * i + 11.0, wait_s=10.0) for i in range(400)]
    assert stable(reqs)  # growth and backlog tests alone accept it
    assert not stable(reqs, idle_service_s=1.0)
    assert stable(reqs, idle_service_s=2.5)  # 4 service times: a queue an operator may run at


def test_metrics_percentiles():
    assert weighted_quantiles([(3.0, 1), (1.0, 98), (2.0, 1)], (0.5, 0.99, 1.0)) == [1.0, 2.0, 3.0]
    r = Request(0, 0.0, 10, 3, prefill_start=0.5, first_token=1.0, done=3.0, wait_s=0.5, gaps=[(1.0, 2)])
    m = metrics([r])
    assert m["mean_ttft_ms"] == 1000 and m["mean_e2e_ms"] == 3000 and m["itl_p50_ms"] == 1000


def test_baseline_builders(demo):
    _, inp = demo
    sw = splitwise(inp)
    assert {r.role for r in sw.replicas} == {"prefill", "decode"}
    for r in sw.replicas:
        assert len({m.device.name for m in r.members}) == 1 and sum(r.counts) == 30
    used = {m.id for r in sw.replicas for m in r.members}
    assert used | set(sw.idle) == {m.id for m in inp.members}  # idle ones say why
    dp = mixed_dp(inp)
    assert {r.role for r in dp.replicas} == {"mixed"} and len(dp.replicas) == len(sw.replicas)
    ring = memory_ring(inp)
    (rep,) = ring.replicas
    assert rep.role == "mixed" and sum(rep.counts) == 30 and len(rep.members) == len(inp.members)
    mem = {m.id: m.device.memory_gb for m in rep.members}
    biggest = max(rep.members, key=lambda m: mem[m.id])
    assert rep.counts[rep.members.index(biggest)] == max(rep.counts)


def test_memory_ring_runs_no_ring_that_cannot_hold_the_model():
    """clusters/impossible.yaml (llama-2-70b on 17 GB): memory-ring split its 80 layers over the
    three boards (57 GB of weights on an 8 GB Pi) and `--simulate` reported it sustaining
    0.0006 req/s. A ring with no KV room for the planner's reserve is no usable replica, and
    each device says why; every other cluster's ring still runs (demo's nodes' roles allow one
    phase each: no mixed ring there, as before)."""
    inp = plan_inputs(load_cluster(REPO / "clusters" / "impossible.yaml"))
    ring = memory_ring(inp)
    assert ring.replicas == [] and set(ring.idle) == {"pi-1", "pi-2", "nano-1"}
    assert all("no KV room" in why for why in ring.idle.values())
    for path in sorted((REPO / "clusters").glob("*.yaml")):
        if path.name != "impossible.yaml":
            got = memory_ring(plan_inputs(load_cluster(path)))
            assert len(got.replicas) == 1 or all("its roles" in w for w in got.idle.values()), path.name


def test_bound_is_compute_over_request_flops(demo):
    _, inp = demo
    lengths = [(16, 32)] * 10
    got = bound_rate_per_s(inp, lengths)
    total = sum(m.device.compute_tflops for m in inp.members) * 1e12 * 0.5
    assert got == pytest.approx(total / request_flops(inp.mc, 16, 32))  # small model: every device holds it


def test_bound_is_capped_by_memory_bandwidth_where_decode_is_memory_bound(demo):
    """Chunked prefill overlaps a memory-bound decode step, so the bound is the lower of all the
    FLOPs at the devices' compute and the decode FLOPs at each device's best decode step; at a
    bandwidth of 1 MB/s the second binds, and its best step is the largest batch that fits
    beside one layer."""
    from meshllm.partition.replica import MAX_DECODE_BATCH
    from meshllm.sim.metrics import decode_flops_cap, decode_memory_rate_per_s, flops_rate_per_s

    _, inp = demo
    lengths = [(16, 32)] * 10
    assert bound_rate_per_s(inp, lengths) == flops_rate_per_s(inp, lengths) < decode_memory_rate_per_s(inp, lengths)
    slow = replace(inp, nodes=tuple(replace(n, device=replace(n.device, memory_bandwidth_gbps=1e-3))
                                    for n in inp.nodes))
    got = bound_rate_per_s(slow, lengths)
    assert got == decode_memory_rate_per_s(slow, lengths) < 1e-3 * flops_rate_per_s(slow, lengths)
    mc, ctx, dev = slow.mc, slow.mix.decode_ctx, slow.members[0].device
    rates = []
    for head in (0, 1):  # one layer, with the LM head or without
        batch = min(MAX_DECODE_BATCH, (dev.memory_bytes - mc.layer_bytes - head * mc.head_bytes)
                    // (ctx * mc.kv_bytes_per_token))
        flops = batch * (mc.layer_flops_per_token + mc.attn_flops_per_token_ctx * ctx + head * mc.head_flops_per_token)
        step = (mc.layer_bytes + head * mc.head_bytes + batch * ctx * mc.kv_bytes_per_token) / (
            dev.memory_bandwidth_gbps * 1e9 * 0.7)
        rates.append(flops / step)
    assert decode_flops_cap(slow, 0, ctx) == pytest.approx(max(rates))


def test_decode_memory_bound_admits_the_roofline_s_own_decode_step():
    """The decode-memory rate divides the devices' decode caps, the FLOPs of their best steps, by
    a request's decode FLOPs of the same kind. Counting the LM head's FLOPs per request (7 % of a
    llama-3-8b token) against steps that left out the head's weights and FLOPs put the bound
    below the rate of a plain decode step the simulator costs, head included: on one device of
    1 TB at 100 000 TFLOP/s, mixed-dp's saturation came out at 1.107 of the bound (501 k decode
    tokens/s allowed, a 256-sequence step at the bound's context does 522 k). The caps' steps
    may hold the head now, and the requests' decode FLOPs count it."""
    from meshllm.config import parse_cluster
    from meshllm.partition.replica import MAX_DECODE_BATCH
    from meshllm.partition.steps import fused_step_s
    from meshllm.sim.metrics import decode_memory_rate_per_s, flops_rate_per_s

    dev = {"memory_gb": 1000, "compute_tflops": 100000, "memory_bandwidth_gbps": 100000, "network_mbps": 1000000}
    inp = plan_inputs(parse_cluster({"model": "llama-3-8b", "nodes": [{"id": "x", "zone": "z", "device": dev}]},
                                    "fast"))
    lengths = [(a, b) for _, a, b in make_trace(inp, 1000, 0)]
    bound = bound_rate_per_s(inp, lengths)
    assert bound == min(decode_memory_rate_per_s(inp, lengths), flops_rate_per_s(inp, lengths))
    rep = SimReplica(0, "mixed", inp.members, (inp.mc.n_layers,), inp)
    assert rep.max_batch() == MAX_DECODE_BATCH
    step = fused_step_s(inp.mc, inp.members, rep.counts, inp.net, MAX_DECODE_BATCH, inp.mix.decode_ctx)
    decode_tokens = sum(n_out - 1 for _, n_out in lengths) / len(lengths)  # per request
    assert MAX_DECODE_BATCH / step < bound * decode_tokens
    assert MAX_DECODE_BATCH / step < decode_memory_rate_per_s(inp, lengths) * decode_tokens  # the cap alone too


def test_simulate_policies_schema_and_determinism():
    cfg = load_cluster(REPO / "clusters/failure.yaml")
    a = simulate_policies(plan_inputs(cfg), rate=20.0, seed=3, sweep_requests=300)
    assert {"meshllm", "splitwise", "mixed-dp", "memory-ring"} <= set(a["policies"])
    assert a["bound_rate_per_s"] > 0
    for name, got in a["policies"].items():
        assert got is not None and set(got) == FIELDS, name
        assert 0 < got["saturation_rate_per_s"] <= a["bound_rate_per_s"] * (1 + BOUND_RESOLUTION)
        assert got["mean_wait_ms"] >= 0
    quick = ("splitwise", "mixed-dp")  # deterministic for a seed (two of them: a run costs seconds)
    assert simulate_policies(plan_inputs(cfg), rate=20.0, seed=3, names=quick, sweep_requests=300)["policies"] == {
        k: a["policies"][k] for k in quick}


@pytest.mark.slow
def test_a_tiny_saturation_is_not_rounded_to_zero():
    """`--simulate` printed "saturation 0 req/s (0.8228 of the bound)" for a cluster that sustains
    4.2e-05 req/s: rates had 4 decimals."""
    from meshllm.sim.sweep import rounded

    assert rounded(4.2123e-05) == 4.212e-05 and rounded(18.23914) == 18.2391 and rounded(0.0) == 0.0
    assert rounded(0.0012345) == 0.0012


def test_simulate_cli_json():
    p = run_cli("--simulate", "clusters/wan.yaml", "--json", "--rate", "50")
    assert p.returncode == 0, p.stderr
    obj = json.loads(p.stdout)
    assert obj["policies"]["meshllm"]["saturation_rate_per_s"] > 0 and obj["bound_rate_per_s"] > 0
    # progress on stderr, one line per policy's sweep (stdout stays one JSON object)
    assert all(f"simulate: {name}: saturation" in p.stderr for name in obj["policies"]), p.stderr


def test_device_slower_means_longer(demo):
    _, inp = demo
    fast = DeviceProfile("f", 8, 10, 100, 1000)
    slow = DeviceProfile("s", 8, 1, 10, 1000)
    r_fast = SimReplica(0, "mixed", (Member("a", fast, "fog"),), (30,), inp)
    r_slow = SimReplica(0, "mixed", (Member("a", slow, "fog"),), (30,), inp)
    assert r_slow.prefill_s(100)[1] > r_fast.prefill_s(100)[1]
    assert r_slow.decode_iter_s(4, 100) > r_fast.decode_iter_s(4, 100)


def test_replicas_of_one_shape_share_their_step_times_and_others_do_not(demo):
    """Step times depend on the members' devices and zones, the split and the inputs only: twin
    replicas (another id, another role, other nodes of the same kinds) share one cache, so the
    judge's candidates and the baselines do not recompute them; any other shape has its own."""
    from meshllm.partition.steps import fused_step_s

    _, inp = demo
    twin = DeviceProfile("t", 8, 10, 100, 1000)
    a = SimReplica(0, "mixed", (Member("a", twin, "fog"), Member("b", twin, "edge")), (20, 10), inp)
    b = SimReplica(3, "decode", (Member("c", twin, "fog"), Member("d", twin, "edge")), (20, 10), inp)
    others = [SimReplica(0, "mixed", (Member("a", twin, "fog"), Member("b", twin, "edge")), (10, 20), inp),
              SimReplica(0, "mixed", (Member("a", twin, "fog"), Member("b", twin, "fog")), (20, 10), inp),
              SimReplica(0, "mixed", (Member("b", twin, "edge"), Member("a", twin, "fog")), (20, 10), inp),
              SimReplica(0, "mixed", (Member("a", replace(twin, memory_bandwidth_gbps=50), "fog"),
                                      Member("b", twin, "edge")), (20, 10), inp)]
    assert a.cache is b.cache and all(o.cache is not a.cache for o in others)
    assert len({id(o.cache) for o in others}) == len(others)
    got = a.decode_iter_s(4, 100.0)
    assert b.decode_iter_s(4, 100.0) == got and len(b.plain) == 1 and b.plain is a.plain  # computed once
    assert others[3].decode_iter_s(4, 100.0) > got  # slower memory: not served from the twin's cache
    assert got == fused_step_s(inp.mc, a.members, a.counts, inp.net, 4, 96.0, 0, 0.0, 0)  # its context bucket's middle
    assert SimReplica(0, "mixed", a.members, a.counts, replace(inp, rate_per_s=1.0)).cache is not a.cache


def one_at_a_time(saturation):
    """A stand-in for trials.saturations from one for trials.saturation (a test's own figures)."""
    return lambda inp, runs: [saturation(inp, *run) for run in runs]


def test_the_judge_s_trials_run_in_processes_with_the_same_figures(monkeypatch):
    """sim/pool.py: the judge's independent saturation sweeps run in a pool of processes; each
    figure is the one the same sweep gives in this process, and the cache answers a repeat."""
    from meshllm.sim import pool, trials

    inp = plan_inputs(load_cluster(REPO / "clusters" / "mesh-six.yaml"))
    runs = [(None, b(inp).replicas, 200, trials.JUDGE_SEED + k) for b in (mixed_dp, splitwise) for k in range(2)]
    monkeypatch.setattr(trials, "_SATURATION", {})
    monkeypatch.setenv("MESHLLM_SIM_JOBS", "2")
    try:
        apart = trials.saturations(inp, runs)
        assert pool._pool is not None, "several runs and two workers: a pool"
    finally:
        pool.close()
    here = [trials._saturation((inp, *run[1:])) for run in runs]
    assert apart == here and len(set(here)) > 1
    monkeypatch.setenv("MESHLLM_SIM_JOBS", "1")
    assert trials.saturations(inp, runs[::-1]) == here[::-1] and pool._pool is None  # from the cache


def test_the_simulation_pool_leaves_no_process_when_its_parent_is_killed(tmp_path):
    """sim/pool.py's workers wait on their queue; with the process that made them killed (-9) they
    would wait for ever. Each watches its parent and leaves."""
    import os
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "plans.py"
    script.write_text("import sys, time\n"
                      f"sys.path.insert(0, {str(REPO)!r})\n"
                      "from meshllm.sim import pool\n"
                      "def slow(x):\n    time.sleep(60)\n    return x\n"
                      "if __name__ == '__main__':\n    print('started', flush=True)\n    pool.pmap(slow, [1, 2])\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "MESHLLM_SIM_JOBS": "2"})

    def workers() -> list[str]:  # the pool's processes: children running multiprocessing's spawn_main
        out = subprocess.run(["pgrep", "-f", "-P", str(proc.pid), "spawn_main"], capture_output=True, text=True)
        return out.stdout.split()

    try:
        assert proc.stdout.readline().strip() == "started"
        deadline = time.monotonic() + 60
        while len(workers()) < 2:
            assert time.monotonic() < deadline, "no pool workers started"
            time.sleep(0.2)
        pids = workers()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 15
    while any(os.path.exists(f"/proc/{p}") for p in pids):
        assert time.monotonic() < deadline, f"pool workers {pids} outlived their parent"
        time.sleep(0.2)


def test_planner_bench_merge_replaces_the_re_run_clusters_in_place(tmp_path):
    """The README's planner figures come from runs of some clusters merged into the full run; the
    merge was a script outside the repository. `bench/planner.py --merge DIR`: the re-run's
    clusters replace those of the same name in planner.json and planner.txt, in place; the
    others, the time table (without --merge-times) and the closing line stay."""
    import json
    import subprocess
    import sys

    saved = json.loads((REPO / "bench/results/planner.json").read_text())
    out, run = tmp_path / "out", tmp_path / "run"
    out.mkdir()
    run.mkdir()
    names = [c["name"] for c in saved["clusters"]][:3]
    txt = "".join(f"## {n}: old figures\nold\n" for n in names) + "(all clusters: 1 s)\n## planner time: old\n"
    (out / "planner.json").write_text(json.dumps(saved))
    (out / "planner.txt").write_text(txt)
    redone = {**saved["clusters"][1], "bound": -1.0}
    (run / "planner.json").write_text(json.dumps({"clusters": [redone], "times": ["new"]}))
    (run / "planner.txt").write_text(f"## {names[1]}: new figures\nnew\n(all clusters: 2 s)\n## planner time: new\n")
    bench = [sys.executable, str(REPO / "bench/planner.py"), "--merge", str(run), "--out", str(out)]
    done = subprocess.run(bench, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    got = json.loads((out / "planner.json").read_text())
    assert got["clusters"] == saved["clusters"][:1] + [redone] + saved["clusters"][2:] and got["times"] == saved["times"]
    assert (out / "planner.txt").read_text() == txt.replace(f"## {names[1]}: old figures\nold", f"## {names[1]}: new figures\nnew")
    redone["name"] = "nosuch"  # a cluster the full run does not have: nothing merged
    (run / "planner.json").write_text(json.dumps({"clusters": [redone], "times": []}))
    done = subprocess.run(bench, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "nosuch not in" in done.stderr
    assert json.loads((out / "planner.json").read_text()) == got


def test_planner_bench_bounds_recomputes_the_caps_in_place_and_refuses_where_the_bound_moved(tmp_path):
    """`bench/planner.py --bounds` rewrites a stale non-binding cap in planner.json and its `bound`
    line in planner.txt, leaving every other line; where the bound itself moved it changes
    nothing and exits 1 (the saturations' ratios need a re-run)."""
    import json
    import subprocess
    import sys

    saved = json.loads((REPO / "bench/results/planner.json").read_text())
    wan = next(r for r in saved["clusters"] if r["name"] == "wan")
    true_caps = {k: wan[k] for k in ("bound", "bound_decode_memory", "bound_flops", "bound_prefill")}
    wan["bound_decode_memory"] = 99999.0
    stale = ("bound   all FLOPs at the devices' compute: 13592.772 req/s (1.00x); decode at its devices' "
             "memory-bound best step: 99999.000 req/s (7.36x); the prompts' FLOPs at the compute of the "
             "devices that may prefill: 46590.146 req/s (3.43x)")
    others = ["## wan: 6 devices", "policy  meshllm 1.0"]
    (tmp_path / "planner.json").write_text(json.dumps(saved))
    (tmp_path / "planner.txt").write_text("\n".join([others[0], stale, others[1]]) + "\n")
    bench = [sys.executable, str(REPO / "bench/planner.py"), "--bounds", "--out", str(tmp_path), "--clusters", "wan"]
    done = subprocess.run(bench, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    got = next(r for r in json.loads((tmp_path / "planner.json").read_text())["clusters"] if r["name"] == "wan")
    assert {k: got[k] for k in true_caps} == pytest.approx(true_caps, rel=1e-9)
    lines = (tmp_path / "planner.txt").read_text().splitlines()
    assert lines[0] == others[0] and lines[2] == others[1] and "19192.110 req/s (1.41x)" in lines[1]
    got["bound"] = 1.0  # as if the bound itself had moved since the run
    before = json.dumps({"clusters": [got], "times": []})
    (tmp_path / "planner.json").write_text(before)
    done = subprocess.run(bench, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "the bound itself moved on wan" in done.stderr
    assert (tmp_path / "planner.json").read_text() == before
    got["bound"] = true_caps["bound"]  # a txt that is not this JSON's run: refused, not left stale
    got["bound_decode_memory"] = 88888.0
    before = json.dumps({"clusters": [got], "times": []})
    (tmp_path / "planner.json").write_text(before)
    done = subprocess.run(bench, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "not once for wan (0 times)" in done.stderr
    assert (tmp_path / "planner.json").read_text() == before
    done = subprocess.run(bench[:-1] + ["nosuch"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "nosuch" in done.stderr


def test_a_multiprocessing_worker_that_made_a_simulation_pool_exits(tmp_path):
    """bench/planner.py plans each cluster in a ProcessPoolExecutor worker; with more than one
    simulation worker per cluster (any machine with more cores than --jobs) the judge made a pool
    there, and the worker, which runs no atexit handler, joined the pool's processes at exit while
    they waited on their queue: the benchmark hung after its last cluster. The pool is closed by
    multiprocessing's own exit hook now, before its queues close."""
    import os
    import signal
    import subprocess
    import sys

    script = tmp_path / "bench_like.py"
    script.write_text("import sys\n"
                      f"sys.path.insert(0, {str(REPO)!r})\n"
                      "from concurrent.futures import ProcessPoolExecutor\n"
                      "def cluster(_):\n    import time\n    from meshllm.sim import pool\n"
                      "    return pool.pmap(time.sleep, [0.3] * 4)\n"  # both workers busy, then idle at exit
                      "if __name__ == '__main__':\n"
                      "    with ProcessPoolExecutor(1) as ex:\n        print(list(ex.map(cluster, [0])), flush=True)\n"
                      "    print('done', flush=True)\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "MESHLLM_SIM_JOBS": "2"}, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the hung worker and its pool's processes too
        out, err = proc.communicate()
        raise AssertionError(f"the worker did not exit: {out!r}") from None
    r = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert r.returncode == 0 and r.stdout.split() == ["[[None,", "None,", "None,", "None]]", "done"], \
        (r.stdout, r.stderr[-2000:])


def test_judge_offers_the_baselines_own_groupings():
    """The judge's candidates include mixed-dp's and tuned Splitwise's replicas exactly as the
    baselines build them, so the plan can always be what the best of those operators runs."""
    from meshllm.partition.plan import planner_evaluator
    from meshllm.sim.judge import operator_groupings
    from meshllm.sim.replica import from_grouping

    inp = plan_inputs(load_cluster(REPO / "clusters" / "bench-edge-8b.yaml"))
    got = [from_grouping(inp, g) for g in operator_groupings(inp, planner_evaluator(inp))]
    want = [mixed_dp(inp).replicas, splitwise(inp).replicas]

    def shape(reps):
        return [(r.role, tuple(m.id for m in r.members), tuple(r.counts)) for r in reps]
    assert [shape(r) for r in got] == [shape(r) for r in want]


@pytest.mark.slow
@pytest.mark.timeout(900)  # the judge confirms up to three plans on four long traces: minutes on 2 cores
def test_judged_plan_sustains_at_least_the_best_baseline():
    """On bench-edge-8b a short judge run once picked a grouping that saturated 13% below
    mixed-dp on this trace (15.9 vs 18.3 req/s at 2000 requests); the plan's saturation on the
    same trace and sweep as the baselines' must be at least theirs."""
    from meshllm.sim.sweep import meshllm_policy, saturation_rates

    inp = plan_inputs(load_cluster(REPO / "clusters" / "bench-edge-8b.yaml"))
    builds = (lambda i: meshllm_policy(i, 0.0, 0), mixed_dp, splitwise)  # meshllm: the plan for capacity
    mine, *theirs = saturation_rates([(build(inp).replicas, inp, 0) for build in builds])
    for build, sat in zip(builds[1:], theirs):
        assert mine >= sat * (1 - 1e-9), build.__name__


def test_judge_holds_capacity_to_the_baselines_only_when_planning_for_capacity():
    """With no rate given a plan must out-sustain the baselines' groupings; with a rate given,
    capacity is only a constraint (HEADROOM x the rate), and the cost at the rate decides: at
    4.2 req/s on bench-mesh-200 the saturation floor kept out plans with prefill replicas that
    wait less there than mixed-dp's grouping."""
    from meshllm.sim.judge import HEADROOM, JUDGE_MARGIN, eligible_for

    sat = [9.1, 9.0, 8.0, 9.0 * (1 + JUDGE_MARGIN), 4.0]  # candidates 1 and 2: the baselines' groupings
    assert eligible_for(sat, [1, 2], 3.0, given=False) == [1, 3]
    assert eligible_for(sat, [1, 2], 3.0, given=True) == [0, 1, 2, 3, 4]
    assert eligible_for(sat, [1, 2], 4.0 / HEADROOM * 1.01, given=True) == [0, 1, 2, 3]


def fake_reps(n: int) -> list:
    """Replicas as pick() tells candidates apart (role, nodes, layer counts): n different ones."""
    from types import SimpleNamespace

    return [[SimpleNamespace(role="mixed", ids=[f"n{i}"], counts=[30])] for i in range(n)]


def test_judge_confirms_a_plan_of_its_own_on_runs_as_long_as_the_reported_sweep(monkeypatch):
    """Shorter confirming runs (N 1200) hid a decode backlog: on bench-mesh-200 they put a plan
    with five prefill replicas 11% above mixed-dp's grouping, which at N = 2000 was 4% below it.
    A plan of the search's own that leads on the short runs is confirmed on all four traces, with
    runs as long as the reported sweep's. One that is a baseline's grouping (the same replicas:
    the demo's search finds mixed-dp's) is not confirmed against itself: a 1-node cluster spent
    two minutes of `--plan --judge` on that, and its plan is the same without it."""
    from types import SimpleNamespace

    from meshllm.partition.plan import plan_cluster
    from meshllm.sim import judge, sweep, trials

    calls = []
    real = trials.saturations

    def recorded(inp, runs):
        calls.extend((requests, seed) for _, _, requests, seed in runs)
        return real(inp, runs) if not isinstance(inp, SimpleNamespace) else [1.0 for _ in runs]

    monkeypatch.setattr(trials, "saturations", recorded)
    judge.pick(SimpleNamespace(rate_per_s=0.0), [0, 1], fake_reps(2), [2.0, 1.0], range(1, 2), [1], 0.0,
               trials.JUDGE_SWEEP_REQUESTS)
    confirming = {(n, seed) for n, seed in calls if seed in trials.CAPACITY_SEEDS}
    assert confirming and min(n for n, _ in confirming) >= sweep.SWEEP_REQUESTS
    # on all four traces (full sweeps on them tie bench-fog-40-8b's plan with mixed-dp's sized grouping; on two it led by 4 %)
    assert {seed for _, seed in confirming} == set(trials.CAPACITY_SEEDS) and len(trials.CAPACITY_SEEDS) == 4
    calls.clear()
    plan = plan_cluster(plan_inputs(load_cluster(REPO / "clusters" / "demo.yaml")), seed=0, log=False,
                        judge=judge.simulated_judge)
    assert not [c for c in calls if c[1] in trials.CAPACITY_SEEDS] and len(plan.replicas) == 3


def test_for_capacity_the_judge_confirms_up_to_three_of_its_own_before_a_baselines_grouping(monkeypatch):
    """On bench-edge-8b (mixed replicas draining a backlog in 4 steps) the two candidates the
    short runs ranked first lost the paired test against mixed-dp's grouping on the four long
    traces, and with two confirmed at most the judge fell back on it (17.04 req/s, 0.892 of the
    bound), though the third wins on the evidence (17.88 req/s, 0.936, in the benchmark's
    sweep). The judge's own figures: the third is confirmed, and a fourth is not tried."""
    from types import SimpleNamespace

    from meshllm.sim import judge, trials

    assert judge.CONFIRM_TOP == 3
    theirs = [15.68, 17.515, 17.515, 17.515]  # mixed-dp's grouping on the four long traces
    long_runs = {0: [15.853, 16.814, 16.814, 16.814], 1: [15.544, 17.001, 17.001, 17.001],
                 2: [17.631, 18.12, 18.61, 18.61], 3: [18.0, 19.0, 19.0, 19.0], 4: theirs, 5: theirs}
    tried = []

    def saturations(inp, runs):
        tried.extend(g for g, _, _, _ in runs)
        return [long_runs[g][trials.CAPACITY_SEEDS.index(seed)] for g, _, _, seed in runs]

    monkeypatch.setattr(trials, "saturations", saturations)
    short = [16.814, 16.515, 15.345, 15.0, 13.377, 8.998]  # candidates 4 and 5: the baselines' groupings
    ops = range(4, 6)

    def picked() -> int:  # for capacity (no rate), the judge's short-run figures above
        return judge.pick(SimpleNamespace(rate_per_s=0.0), list(range(6)), fake_reps(6), short, ops, list(ops), 0.0,
                          600)[0]

    assert picked() == 2 and 3 not in tried
    monkeypatch.setattr(judge, "CONFIRM_TOP", 2)  # as before: the baseline's grouping
    assert picked() == 4


def test_a_plan_of_its_own_replaces_the_baselines_grouping_only_on_the_evidence():
    """For capacity, the search's pick must out-sustain the best baseline grouping by more than
    the noise of the judge's traces. The judge's figures (req/s on its four traces): on
    bench-fog-40-8b the pick led mixed-dp's sized grouping by 1% summed, within one standard
    error, and lost to it by 1.4% on the benchmark's traces; on bench-edge-8b it led on all four."""
    from meshllm.sim.trials import wins_on_evidence

    fog_pick, fog_mixed_dp = [27.280, 28.731, 28.731, 29.602], [25.106, 27.388, 29.956, 30.812]
    assert sum(fog_pick) > sum(fog_mixed_dp) and not wins_on_evidence(fog_pick, fog_mixed_dp)
    assert wins_on_evidence([17.141, 17.631, 18.120, 19.100], [16.014, 17.515, 17.515, 18.016])
    assert wins_on_evidence(fog_mixed_dp, fog_mixed_dp)  # the same runs: nothing to choose
    assert not wins_on_evidence([x * 0.999 for x in fog_mixed_dp], fog_mixed_dp)
    assert wins_on_evidence([x + 0.5 for x in fog_mixed_dp], fog_mixed_dp)  # a steady lead, however small


def test_at_a_rate_the_baselines_groupings_are_eligible_by_runs_as_long_as_their_sweep(monkeypatch):
    """On bench-mesh-200 at 6.86 req/s (70% of mixed-dp's saturation) the judge's 600-request runs
    put mixed-dp's grouping at 6.50 req/s, below HEADROOM x the rate, and shut it out: meshllm
    waited 7.4 s where mixed-dp waits 2.5 s. On 2000 requests it sustains 9.06 (its reported
    sweep: 9.80). So with a rate given, each baseline grouping's eligibility is judged on runs as
    long as the reported sweep's, on the judge's trace (multi-tenant.yaml: 4 req/s)."""
    from meshllm.partition.plan import planner_evaluator
    from meshllm.sim import judge, sweep, trials

    calls = []
    real = trials.saturations

    def recorded(inp, runs):
        calls.extend((requests, seed, g.groups, g.roles) for g, _, requests, seed in runs)
        return real(inp, runs)

    monkeypatch.setattr(trials, "saturations", recorded)
    inp = plan_inputs(load_cluster(REPO / "clusters" / "multi-tenant.yaml"))
    ops = judge.operator_groupings(inp, planner_evaluator(inp))
    assert ops and inp.rate_per_s > 0
    plan_cluster(inp, seed=0, log=False, judge=judge.simulated_judge)
    long = {(g, r) for n, seed, g, r in calls if n >= sweep.SWEEP_REQUESTS and seed == trials.JUDGE_SEED}
    assert all((o.groups, o.roles) in long for o in ops)
    calls.clear()  # for capacity the floor is the baselines' groupings' saturation on runs as short as the rest's
    plan_cluster(replace(inp, rate_per_s=0.0), seed=0, log=False, judge=judge.simulated_judge)
    assert not any(n >= sweep.SWEEP_REQUESTS and seed == trials.JUDGE_SEED for n, seed, _, _ in calls)


PAIR_AND_ORIN = """model: llama-3-8b
nodes:
  - {id: gpu-1, device: desktop-rtx-3060-12gb, zone: fog%s}
  - {id: gpu-2, device: desktop-rtx-3060-12gb, zone: fog%s}
  - {id: agx-1, device: jetson-agx-orin-64gb, zone: fog}
workload:
  arrival_rate_per_s: 1.0
  input_tokens: {mean: 512, dist: lognormal}
  output_tokens: {mean: 128, dist: lognormal}
"""


def pair_and_orin(forced: str = ""):
    """Two RTX 3060s prefilling for a Jetson AGX Orin that decodes, at 1 req/s (bench-fog-40-8b's
    devices): the grouping, its evaluator and inputs."""
    import yaml

    from meshllm.config import parse_cluster
    from meshllm.partition.plan import planner_evaluator
    from meshllm.sim import turns

    inp = plan_inputs(parse_cluster(yaml.safe_load(PAIR_AND_ORIN % (forced, forced)), "pair_and_orin.yaml"))
    ev = planner_evaluator(inp)
    return inp, ev, turns.with_roles(ev, ev.decode([0, 0, 1]), ("prefill", "decode"), inp.rate_per_s)


def test_the_judge_turns_a_replica_mixed_when_that_costs_less_at_the_rate():
    """Issue 8 step 5: the search leaves replicas prefilling that serve better doing both (on
    bench-fog-40-8b it left the RTX 3060 pair prefilling for the RTX 4090's port). Here the pair
    prefilling for an Orin costs e2e + 100 x wait = 45 s a request at 1 req/s; turned mixed it costs
    17 s (the Orin turns mixed with it: no KV would reach it as a decode replica), and the plan's
    capacity and prediction are the new roles'. The pair is tried mixed on its decode split (17 + 15
    layers: 62 s) and on its prefill split (16 + 16: KV room for 70 sequences, not 56), which wins."""
    from meshllm.partition.capacity import capacity, role_rates
    from meshllm.sim import trials, turns
    from meshllm.sim.replica import from_grouping

    inp, ev, g = pair_and_orin()
    rate, trace = inp.rate_per_s, make_trace(inp, trials.JUDGE_REQUESTS, trials.JUDGE_SEED)
    pair = g.evals[0]
    assert pair.mixed.split.counts == pair.decode.split.counts == (17, 15) != pair.prefill.split.counts
    got = turns.refine_roles(inp, ev, g, rate)
    assert got.roles == ("mixed", "mixed") and got.evals[0].mixed.split.counts == (16, 16)  # no idle decoder
    before, after = (trials.run_cost(from_grouping(inp, x), trace, rate) for x in (g, got))
    assert after < 0.5 * before
    assert got.fitness == pytest.approx(capacity(role_rates(got.evals), got.roles)[0])
    assert got.prediction is not None and got.prediction != g.prediction


FAST_AND_ORIN = """model: llama-3-8b
nodes:
  - {id: gpu-1, device: desktop-rtx-4090, zone: fog}
  - {id: agx-1, device: jetson-agx-orin-64gb, zone: fog}
workload:
  arrival_rate_per_s: 3.0
  input_tokens: {mean: 512, dist: lognormal}
  output_tokens: {mean: 128, dist: lognormal}
"""


def test_the_judge_turns_a_mixed_replica_prefill_when_that_costs_less_within_the_ttft_slack(monkeypatch):
    """Issue 8 step 5, the other way: an RTX 4090 and a Jetson AGX Orin both mixed at 3 req/s cost
    8.34 s a request (e2e + 100 x wait, the judge's trace); the Orin prefilling and shipping its
    prompts' KV to the RTX 4090, which decodes them beside its own, 6.70 s (no decode of the Orin's
    is paused by a prompt, and the 4090's compute, idle in its memory-bound steps, takes them), at
    a TTFT p50 of 148 against 112 ms, within TTFT_SLACK (1.5). On bench-mesh-200 at 70 % of
    Splitwise's saturation the same turn of the RTX 4090 and Mac mini pipelines cuts the mean wait
    of mixed-dp's grouping from 2.04 to 1.25 s. With no slack for the TTFT the turn is not made."""
    import yaml

    from meshllm.config import parse_cluster
    from meshllm.partition.plan import planner_evaluator
    from meshllm.sim import trials, turns
    from meshllm.sim.replica import from_grouping

    inp = plan_inputs(parse_cluster(yaml.safe_load(FAST_AND_ORIN), "fast_and_orin.yaml"))
    ev = planner_evaluator(inp)
    rate, trace = inp.rate_per_s, make_trace(inp, trials.JUDGE_REQUESTS, trials.JUDGE_SEED)
    g = turns.with_roles(ev, ev.decode([0, 1]), ("mixed", "mixed"), rate)
    orin = [i for i, canon in enumerate(g.groups) if inp.members[canon[0]].id == "agx-1"]
    got = turns.refine_roles(inp, ev, g, rate)
    assert got.roles[orin[0]] == "prefill" and got.roles.count("mixed") == 1
    (before, ttft0), (after, ttft1) = (trials.run_cost_ttft(from_grouping(inp, x), trace, rate) for x in (g, got))
    assert after < 0.9 * before and ttft0 < ttft1 <= turns.TTFT_SLACK * ttft0
    assert got.prediction is not None and got.prediction != g.prediction
    monkeypatch.setattr(turns, "TTFT_SLACK", 1.0)
    assert turns.refine_roles(inp, ev, g, rate).roles == ("mixed", "mixed")


def test_a_refined_baseline_grouping_is_held_to_runs_as_long_as_its_eligibility(monkeypatch):
    """A baseline's grouping is eligible at a rate by runs as long as the reported sweep's (step
    3); refined, its capacity check must use runs as long: on bench-mesh-200 at 6.45 req/s the
    short runs put mixed-dp's grouping at 6.2 req/s (9.3 on 2 x 2000), so every turn of it was
    refused for want of 1.25 x the rate."""
    import yaml

    from meshllm.config import parse_cluster
    from meshllm.sim import judge, trials, turns

    inp = plan_inputs(parse_cluster(yaml.safe_load(FAST_AND_ORIN), "fast_and_orin.yaml"))
    seen = []
    monkeypatch.setattr(turns, "refine_roles", lambda inp, ev, g, rate, n, log=False: seen.append(n) or g)
    judge.simulated_judge(inp, [], inp.rate_per_s)  # the baselines' groupings only
    assert seen == [round(trials.JUDGE_SWEEP_REQUESTS * trials.CONFIRM_SCALE)]


def test_mixed_dp_runs_a_replica_on_the_split_that_rates_higher_mixed():
    """Two RTX 3060s: the decode split (17 + 15 layers) leaves KV room for fewer sequences than
    the prefill split (16 + 16), which rates higher mixed; mixed-dp, as its operator would, runs
    the pair on 16 + 16 (the planner's own replicas keep the decode split: the judge tries both)."""
    inp, _, _ = pair_and_orin()
    pair = mixed_dp(replace(inp, nodes=inp.nodes[:2])).replicas
    assert [r.counts for r in pair] == [(16, 16)]


def test_the_latency_estimate_completes_each_split_of_a_replica_on_its_own():
    """The capacity search leaves out what only the latency estimate needs (the decode step at
    batch 1: step1_s -1); `Evaluator.completed` finds it, and the mixed fit's free prompt tokens,
    per split: the RTX 3060 pair mixed on its prefill split (16 + 16, the judge's variant) is
    not handed the completion of its decode split (17 + 15), which has the same members."""
    from meshllm.partition.replica import decode_fit, on_prefill_split

    inp, ev, g = pair_and_orin()
    plain = g.evals[0]
    assert plain.decode.step1_s == -1.0 and plain.mixed.step1_s == -1.0
    alt = on_prefill_split(inp.mc, plain, inp.net, inp.mix)
    assert alt is not None and alt.mixed.split.counts == (16, 16) != plain.mixed.split.counts
    a, b = ev.completed(plain), ev.completed(alt)
    assert b.mixed.split == alt.mixed.split and a.mixed.split == plain.mixed.split
    assert b.mixed.free1 >= 0 and a.mixed.free1 >= 0
    full = decode_fit(inp.mc, plain.members, plain.decode.split, inp.net, inp.mix)
    assert a.decode.step1_s == a.mixed.step1_s == full.step1_s > 0
    assert b.mixed.step1_s == decode_fit(inp.mc, alt.members, alt.mixed.split, inp.net, inp.mix).step1_s


def test_the_judge_keeps_roles_that_a_node_forces_and_refines_only_at_a_rate(monkeypatch):
    """A replica whose nodes allow only prefill stays prefill (the Orin may still turn mixed);
    planning for capacity (no rate) does not refine at all (a turn is judged by the cost at the
    rate; the pick and at most REFINE_TOP - 1 more candidates are refined)."""
    from meshllm.partition.plan import plan_cluster
    from meshllm.sim import judge, turns

    inp, ev, g = pair_and_orin(", roles: [prefill]")
    assert turns.refine_roles(inp, ev, g, inp.rate_per_s).roles[0] == "prefill"
    calls = []
    monkeypatch.setattr(turns, "refine_roles", lambda inp, ev, g, rate, *a, **k: calls.append(rate) or g)
    inp, _, _ = pair_and_orin()
    plan_cluster(replace(inp, rate_per_s=0.0), seed=0, log=False, judge=judge.simulated_judge)
    assert calls == []
    plan_cluster(inp, seed=0, log=False, judge=judge.simulated_judge)
    assert 1 <= len(calls) <= judge.REFINE_TOP and all(rate == inp.rate_per_s for rate in calls)


def test_each_prefill_stage_ships_its_kv_when_it_is_done(demo):
    """As roles/stage.py does: the first stage's KV leaves while the second stage computes, after
    its activations; the decode replica is chosen on arrival (as the gateway does), and a
    request's own transfers queueing behind each other are no wait."""
    _, inp = demo
    pre = replica(inp, 0, "prefill", ["fog-1", "fog-2"], (15, 15))
    dec = replica(inp, 1, "decode", ["fog-4"], (30,))  # a 1 Gb/s port: both stages' KV queue on its rx
    req = Simulator([pre, dec], [Request(0, 0.0, 500, 4)]).run()[0]
    assert req.dst == 1
    half = 15 * 500 * inp.mc.kv_bytes_per_token * 8 / 1e9  # one stage's KV over a 1 Gb/s port
    stages, _, _ = pre.prefill_stages(500)
    assert req.wait_s == pytest.approx(0.0, abs=1e-12)
    # all the KV after the prefill would be complete at first_token + 2 x half; the first
    # stage's went out when that stage was done
    assert req.kv_ready == pytest.approx(stages[0] + 2 * half, abs=1e-3)
    assert req.kv_ready < req.first_token + 2 * half - 0.5 * stages[1]


def test_a_mixed_replica_drains_a_backlog_of_prompts_faster_than_a_lone_prompt(demo, monkeypatch):
    """Chunks ride along decode steps at 1/LONE_DRAIN_STEPS of a lone prompt per step, but at
    1/DRAIN_STEPS of the backlog once more prompts wait: each step the backlog lasts delays them
    all. Six sequences decode when a burst of four long prompts arrives (fewer than the batch, so
    they go in chunks): the whole waiting (the prompts' and the decodes' pauses) is lower than at
    the lone prompt's pace."""
    from meshllm.sim import replica as sim_replica

    assert sim_replica.DRAIN_STEPS < sim_replica.LONE_DRAIN_STEPS
    _, inp = demo
    ring = replica(inp, 0, "mixed", ["fog-1", "fog-2"], (15, 15))
    ctx = inp.mix.decode_ctx
    assert ring.chunk_tokens(6, ctx, 800, 800, 1) < ring.chunk_tokens(6, ctx, 800, 3200, 4) >= 3200 // sim_replica.DRAIN_STEPS

    def waited() -> float:
        ring.cache.clear()
        reqs = [Request(i, 0.0, 20, 3000) for i in range(6)] + [Request(6 + i, 2.0, 800, 4) for i in range(4)]
        return sum(r.wait_s for r in Simulator([ring], reqs).run())

    drained = waited()
    monkeypatch.setattr(sim_replica, "DRAIN_STEPS", sim_replica.LONE_DRAIN_STEPS)
    assert drained < waited()


def test_running_context_and_tokens_left_match_the_active_sequences(demo, monkeypatch):
    """The replica's running sums (the decode context and the tokens left, read at every run of
    steps) equal a count over its active sequences whenever a run starts, on a mixed and on a
    disaggregated pair, with random lengths; and they are back to zero when all are done."""
    _, inp = demo
    real, seen = Simulator.run_steps, []

    def checked(self, st):
        seen.append(len(st.active))
        assert st.context == sum(r.n_in + r.n_out - left for r, left, _ in st.active)
        assert st.left == sum(left for _, left, _ in st.active)
        return real(self, st)

    monkeypatch.setattr(Simulator, "run_steps", checked)
    rng = random.Random(5)
    reqs = [(0.01 * i * rng.random(), rng.randint(1, 90), rng.randint(1, 60)) for i in range(60)]
    for reps in ([replica(inp, 0, "mixed", ["fog-1", "fog-2"], (15, 15))],
                 [replica(inp, 0, "prefill", ["fog-3"], (30,)), replica(inp, 1, "decode", ["fog-4"], (30,))]):
        sim = Simulator(reps, [Request(i, t, n_in, n_out) for i, (t, n_in, n_out) in enumerate(reqs)])
        done = sim.run()
        assert all(r.done >= r.arrival for r in done)
        assert all(st.context == st.left == 0 and not st.active for st in sim.states.values())
    assert max(seen) > 1  # runs with several sequences were checked


def test_prompt_queue_takes_prompts_in_priority_order_at_any_time():
    """PromptQueue (a heap on router.prompt_rank) gives the order a scan by prompt_priority at the
    moment of taking gives (ties by arrival), whenever prompts are taken and added."""
    from meshllm.sim.router import prompt_priority
    from meshllm.sim.simulator import PromptQueue

    rng = random.Random(3)
    q, scan, now, rid = PromptQueue(), [], 0.0, 0
    for _ in range(400):
        now += rng.expovariate(20.0)
        for _ in range(rng.randrange(3)):
            req = Request(rid, now - rng.random() * 0.5, rng.choice([8, 64, 512, 513, 2048]), 4)
            rid += 1
            q.push(req)
            scan.append(req)
        for _ in range(rng.randrange(3)):
            if not scan:
                break
            want = min(scan, key=lambda r: (prompt_priority(r.n_in, now - r.arrival), scan.index(r)))
            scan.remove(want)
            assert q.peek() is want and q.pop() is want
        assert len(q) == len(scan)


def test_a_lone_prompt_goes_in_even_chunks_not_a_last_step_for_a_remainder():
    """A prompt a little over four free chunks long reaches an RTX 4090 mixed replica (llama-3-8b)
    that decodes three sequences: it rides along 4 steps of a quarter of it each, not 4 free
    chunks and a 5th step for the remainder (a whole step for a few tokens). It is done about
    four steps after it starts (the budget's chunks: five), and it and the decoding sequences
    together wait less than the budget's chunks would have made them."""
    import yaml

    from meshllm.config import parse_cluster

    doc = {"model": "llama-3-8b", "nodes": [{"id": "gpu", "device": "desktop-rtx-4090", "zone": "fog"}]}
    inp = plan_inputs(parse_cluster(yaml.safe_load(yaml.safe_dump(doc)), "one_4090.yaml"))
    rep = replica(inp, 0, "mixed", ["gpu"], (32,))
    ctx, b = inp.mix.decode_ctx, 3
    free = rep.free_chunk(b, ctx, 100_000)
    n = 4 * free + 8
    budget = rep.chunk_tokens(b, ctx, n, n, 1)
    assert budget == free and -(-n // budget) == 5
    chunk = rep.lone_chunk(b, ctx, n, 0, budget)
    assert chunk == -(-n // 4)
    base, step = rep.decode_iter_s(b, ctx), rep.decode_iter_s(b, ctx, chunk, chunk)
    assert step < 1.05 * base  # a few tokens over the free chunk cost little
    reqs = [Request(i, 0.0, 64, 400) for i in range(b)] + [Request(b, 1.0, n, 2)]
    *decoding, prompt = Simulator([rep], reqs).run()
    took = prompt.first_token - prompt.prefill_start
    assert took == pytest.approx(4 * step, rel=0.02) and took < 4.5 * base
    _, lat = rep.prefill_s(n)
    chunked = prompt.wait_s - (prompt.prefill_start - prompt.arrival) + sum(r.paused_s for r in decoding)
    budget_steps = 5 * rep.decode_iter_s(b, ctx, budget, budget)
    assert chunked < budget_steps - lat


def test_an_unused_device_s_reason_says_which_way_the_predicted_cost_goes():
    """A device left out of a grouping that would lower the analytic cost at the rate (the AGX
    Orin beside an RTX 3060 pair serving 1 req/s mixed) is not said to raise it: the reason gives
    the two costs in the direction they go (it said "rises from 71.950 s to 63.054 s" for a
    device the simulated judge's pick left out of bench-fog-40-8b)."""
    import re

    from meshllm.partition.grouping import NONE
    from meshllm.partition.unused import member_reason

    inp, ev, _ = pair_and_orin()
    genes = [0, 0, NONE]
    g = ev.decode(genes)
    g = replace(g, prediction=ev.latency(g, inp.rate_per_s))
    why = member_reason(ev, g, genes, 2)
    way, a, b = re.search(r"(rises|falls) from ([\d.]+) s to ([\d.]+) s", why).groups()
    assert (float(b) > float(a)) == (way == "rises")
    assert way == "falls" and "leaves it out" in why


def test_an_unused_device_s_best_move_is_one_it_can_make():
    """bench-six-7b's Raspberry Pis cannot hold llama-2-7b alone, and joining a replica slows it:
    the reason said "at its best (alone) the plan serves 2.563 req/s, 2.563 without it", a move
    that does not exist, rated as adding nothing. It now names the best replica to join and what
    the plan would serve there, and says why alone is no move."""
    from meshllm.partition.plan import plan_cluster

    plan = plan_cluster(plan_inputs(load_cluster(REPO / "clusters" / "bench-six-7b.yaml")), seed=0, log=False)
    for pi in ("pi5-1", "pi5-2"):
        why = plan.reasons[pi]
        assert "(alone)" not in why and "at its best (replica " in why and "GB short" in why, why
        with_it, without = map(float, re.search(r"serves ([\d.]+) req/s, ([\d.]+) without it", why).groups())
        assert with_it < without == round(plan.capacity_req_s, 3)


def test_an_unused_device_s_reason_rates_the_plan_as_the_search_does_after_a_re_split():
    """The judge re-rates a plan whose pipeline it re-splits for KV room (step 7): the RTX 3060
    pair's split for 64 sequences is worth 2.323 req/s analytically, the DP's 2.251. The reason an
    Orin is left out compared its moves, rated on the DP's splits, with the re-rated plan (4.501 vs
    2.323 req/s, and the costs likewise): it now rates both sides the search's way, so it reads
    the same for the grouping as searched and as re-split."""
    from meshllm.partition.grouping import NONE
    from meshllm.partition.replica import with_kv_room
    from meshllm.partition.unused import member_reason
    from meshllm.sim import turns

    inp, ev, _ = pair_and_orin()
    genes = [0, 0, NONE]
    g = ev.decode(genes)
    roomy = with_kv_room(inp.mc, g.evals[0], inp.net, inp.mix, 64)
    assert roomy is not None
    re_split = turns.with_roles(ev, replace(g, evals=(roomy,)), g.roles, inp.rate_per_s)
    assert re_split.fitness > 1.02 * g.fitness  # the judge's re-rating differs from the search's
    why = member_reason(ev, re_split, genes, 2)
    assert f"vs {g.fitness:.3f} req/s" in why
    assert why == member_reason(ev, replace(g, prediction=ev.latency(g, inp.rate_per_s)), genes, 2)


def test_a_mixed_replica_whose_slots_are_full_prefills_only_what_rides_free():
    """Flooded, the RTX 4090 of bench-edge-8b alone (mixed) keeps its memory-limited batch full: a
    prompt starts only when a sequence ends. Prefilling it faster than its free share of each step
    (whole, or a backlog's share) left steps that decode alone, memory-bound, until the next slot
    freed: 1200 requests at 30 req/s were served at 0.845 of the bound's rate (the ramp and the
    final drain included). Only what rides free while the slots are full: 0.902."""
    from meshllm.sim.simulator import RepState

    cfg = load_cluster(REPO / "clusters" / "bench-edge-8b.yaml")
    inp = plan_inputs(replace(cfg, nodes=tuple(n for n in cfg.nodes if n.device.name == "desktop-rtx-4090")))
    trace = make_trace(inp, 1200, 0)
    reps = mixed_dp(inp).replicas
    sim = Simulator(reps, requests_at(trace, 30.0), gaps=False)
    st: RepState = sim.states[reps[0].id]
    rate = len(trace) / max(r.done for r in sim.run())
    bound = bound_rate_per_s(inp, [(a, b) for _, a, b in trace])
    assert rate >= 0.88 * bound, (rate, bound)
    st.active = [[None, 10, 0.0]] * st.load.max_batch  # full: the budget is what rides free
    st.context = 600 * st.load.max_batch
    assert st.prompt_budget(512) == reps[0].free_chunk(st.load.max_batch, 600, 512)


def type_inputs(cluster: str, *types: str):
    cfg = load_cluster(REPO / "clusters" / f"{cluster}.yaml")
    return plan_inputs(replace(cfg, nodes=tuple(n for n in cfg.nodes if n.device.name in types)))


def test_mixed_dp_sizes_a_memory_starved_type_s_replicas_for_kv_room():
    """bench-fog-40-8b's ten 8 GB Orin Nanos hold llama-3-8b three at a time, with KV room left
    for 22 sequences; mixed-dp, as an operator would, runs them as two replicas of five (KV for
    130 each), not three of 3-4: in the simulator 4.09 against 2.56 req/s (2000 requests)."""
    from meshllm.sim.baselines import per_type

    inp = type_inputs("bench-fog-40-8b", "jetson-orin-nano-8gb")
    sized = mixed_dp(inp).replicas
    assert sorted(len(r.members) for r in sized) == [5, 5]
    (fewest,) = per_type(inp)[0].values()
    assert sorted(len(e.members) for e in fewest) == [3, 3, 4]
    old = [SimReplica(i, "mixed", tuple(e.members[j] for j in e.mixed.split.order), e.mixed.split.counts, inp)
           for i, e in enumerate(fewest)]
    assert saturation_rate(sized, inp, 0, 1000) > 1.3 * saturation_rate(old, inp, 0, 1000)


def test_splitwise_sizes_its_replicas_for_decode_where_that_rates_higher():
    """bench-mesh-200's thirty RTX 3060s hold llama-2-70b eleven at a time with KV room for a
    handful of sequences: tuned Splitwise makes them one replica of thirty (twelve RTX 4090s
    beside them decode), as its operator would, not two of fifteen (4.82 against 2.85 req/s in
    the simulator, 1000 requests); on bench-edge-8b the fewest devices per replica rate higher
    and stay."""
    from meshllm.sim.baselines import per_type

    sw = splitwise(type_inputs("bench-mesh-200", "desktop-rtx-3060-12gb", "desktop-rtx-4090"))
    assert sorted((r.role, len(r.members)) for r in sw.replicas) == [("decode", 12), ("prefill", 30)]
    edge = plan_inputs(load_cluster(REPO / "clusters" / "bench-edge-8b.yaml"))
    fewest = [e.members for evs in per_type(edge)[0].values() for e in evs]
    assert sorted(len(r.members) for r in splitwise(edge).replicas) == sorted(map(len, fewest))


PAIRS_ORINS_NUC = """model: llama-3-8b
nodes:
  - {id: gpu-1, device: desktop-rtx-3060-12gb, zone: fog}
  - {id: gpu-2, device: desktop-rtx-3060-12gb, zone: fog}
  - {id: gpu-3, device: desktop-rtx-3060-12gb, zone: fog}
  - {id: gpu-4, device: desktop-rtx-3060-12gb, zone: fog}
  - {id: agx-1, device: jetson-agx-orin-64gb, zone: fog}
  - {id: agx-2, device: jetson-agx-orin-64gb, zone: fog}
  - {id: nuc-1, device: intel-nuc-13-i7, zone: fog}
"""


def test_for_capacity_the_judge_turns_a_kind_of_decode_replica_mixed_on_the_evidence(monkeypatch):
    """Issue 8, step 6 of sim/turns.py: on bench-fog-40-8b the pick's two Jetson AGX Orins decoded
    at 0.58 of their compute (memory-bound steps) for ten prefill replicas, 0.910 of the
    bound; turned mixed, 0.970. The decode replicas on the same device types turn together, each
    kind tried on the judge's four long traces (one trace did not tell: on the judge's own the
    turn sustained less); the one that sustains most is taken if it leads the plan so far on the
    evidence and by TURN_GAIN in all. Saturations here are stand-ins keyed by roles (the judge's
    logic is under test; the next test runs the simulator)."""
    import yaml

    from meshllm.config import parse_cluster
    from meshllm.partition.plan import planner_evaluator
    from meshllm.sim import trials, turns

    inp = plan_inputs(parse_cluster(yaml.safe_load(PAIRS_ORINS_NUC), "pairs_orins_nuc.yaml"))
    ev = planner_evaluator(inp)
    p, d, m = "prefill", "decode", "mixed"
    pick = turns.with_roles(ev, ev.decode([0, 0, 1, 1, 2, 3, 4]), (p, p, d, d, d))
    assert turns.decode_kinds(inp, ev, pick) == [[2, 3], [4]]  # the Orins (more compute), the NUC
    runs = {(p, p, d, d, d): [10.0, 10.1, 9.9, 10.0],
            (p, p, m, m, d): [11.0, 11.2, 10.9, 11.1],  # the Orins turned
            (p, p, d, d, m): [10.2, 10.3, 10.1, 10.2],  # the NUC turned: leads too, by less
            (p, p, m, m, m): [11.05, 11.25, 10.95, 11.15]}  # both: under TURN_GAIN more than the Orins alone

    def saturation(inp, g, reps, requests=trials.JUDGE_SWEEP_REQUESTS, seed=trials.JUDGE_SEED):
        assert requests >= trials.sweep.SWEEP_REQUESTS  # runs as long as the reported sweep's
        return runs[g.roles][trials.CAPACITY_SEEDS.index(seed)]

    monkeypatch.setattr(trials, "saturations", one_at_a_time(saturation))
    got = turns.turned_for_capacity(inp, ev, pick, 0.0)
    assert got.roles == (p, p, m, m, d)
    assert got.fitness == pytest.approx(turns.capacity(turns.role_rates(got.evals), got.roles)[0])
    runs[p, p, m, m, d] = [11.5, 9.0, 10.5, 10.0]  # more in all, within the traces' noise
    runs[p, p, d, d, m] = runs[p, p, d, d, d]  # the same runs: no gain
    assert turns.turned_for_capacity(inp, ev, pick, 0.0) is pick


def test_for_capacity_an_orin_decoding_for_a_pair_sustains_more_turned_mixed():
    """The same step in the simulator: the Jetson AGX Orin decoding for an RTX 3060 pair
    (bench-fog-40-8b's devices) is turned mixed for capacity, and the plan sustains more on the
    reported sweep's trace than the pick."""
    from meshllm.sim import turns
    from meshllm.sim.replica import from_grouping

    inp, ev, g = pair_and_orin()
    inp = replace(inp, rate_per_s=0.0)
    got = turns.turned_for_capacity(inp, ev, g, 0.0)
    assert got.roles == ("prefill", "mixed")
    before, after = (saturation_rate(from_grouping(inp, x), inp, 0) for x in (g, got))
    assert after > before


A100S_AND_4090S = """model: llama-2-70b
nodes:
  - {id: a100-1, device: cloud-a100-80gb, zone: cloud}
  - {id: a100-2, device: cloud-a100-80gb, zone: cloud}
  - {id: gpu4090-1, device: desktop-rtx-4090, zone: cloud}
  - {id: gpu4090-2, device: desktop-rtx-4090, zone: cloud}
  - {id: gpu4090-3, device: desktop-rtx-4090, zone: cloud}
"""


def a100s_and_4090s():
    """bench-mesh-200's mixed replica of 2 A100s + 3 RTX 4090s (llama-2-70b) as the only one, for
    capacity: inputs, evaluator, grouping."""
    import yaml

    from meshllm.config import parse_cluster
    from meshllm.partition.plan import planner_evaluator
    from meshllm.sim import turns

    inp = replace(plan_inputs(parse_cluster(yaml.safe_load(A100S_AND_4090S), "a100s_and_4090s.yaml")), rate_per_s=0.0)
    ev = planner_evaluator(inp)
    return inp, ev, turns.with_roles(ev, ev.decode([0] * 5), ("mixed",))


def test_a_pipeline_re_split_for_kv_room_holds_more_sequences():
    """The DP's decode split keeps KV room for KV_RESERVE_SEQS sequences and puts the layers where
    a step at the reference batch is fastest: 24 + 24 layers on the A100s, 11 + 11 + 10 on the RTX
    4090s, whose memory then holds 127 sequences. Re-split for room for 256 (`with_kv_room`), the
    A100s take more layers and the batch is 256; for the reserve the DP keeps, nothing changes."""
    from meshllm.partition.replica import KV_RESERVE_SEQS, with_kv_room

    inp, _, g = a100s_and_4090s()
    e = g.evals[0]
    assert (e.mixed.split.counts, e.mixed.batch) == ((24, 24, 11, 11, 10), 127)
    assert with_kv_room(inp.mc, e, inp.net, inp.mix, KV_RESERVE_SEQS) is None
    alt = with_kv_room(inp.mc, e, inp.net, inp.mix, 256)
    assert alt.mixed.split == alt.decode.split and alt.mixed.split.counts == (27, 27, 9, 9, 8)
    assert alt.mixed.batch == alt.decode.batch == 256
    assert alt.prefill == e.prefill and alt.members == e.members


@pytest.mark.slow
def test_for_capacity_the_judge_re_splits_a_pipeline_for_kv_room_on_the_evidence():
    """Issue 8, step 7 of sim/turns.py: the pipeline alone sustains more re-split for KV room on the
    judge's trace, so the plan with it is run on the judge's four long traces, leads there, and
    is taken; it sustains more on the reported sweep's trace too (4.22 -> 4.96 req/s on runs of
    1000 requests). The runs are half the judge's length here (the test's time)."""
    from meshllm.sim import turns
    from meshllm.sim.replica import from_grouping

    inp, ev, g = a100s_and_4090s()
    got = turns.kv_room_for_capacity(inp, ev, g, 0.0, 300)
    assert got.evals[0].mixed.split.counts == (27, 27, 9, 9, 8) and got.roles == ("mixed",)
    before, after = (saturation_rate(from_grouping(inp, x), inp, 0, 1000) for x in (g, got))
    assert after > before


def test_for_capacity_a_re_split_that_gains_alone_is_taken_only_on_the_plans_evidence(monkeypatch):
    """Step 7's screen (the replica alone) only nominates: the plan with the re-split must lead on
    the four long traces by the paired test and TURN_GAIN in all. Saturations here are stand-ins
    keyed by the replica's layer counts and the run's length (the judge's logic is under test;
    the test before runs the simulator)."""
    from meshllm.sim import trials, turns

    inp, ev, g = a100s_and_4090s()
    planned, roomy = (24, 24, 11, 11, 10), (27, 27, 9, 9, 8)
    alone = {planned: 3.0, roomy: 3.0 * (1 + turns.KV_ROOM_GAIN) + 0.01}
    long_runs = {planned: [4.0, 4.2, 4.1, 4.3], roomy: [4.5, 3.8, 4.6, 3.9]}  # more in all, within the noise

    def saturation(inp, g, reps, requests=trials.JUDGE_SWEEP_REQUESTS, seed=trials.JUDGE_SEED):
        (counts,) = [tuple(r.counts) for r in reps]
        if requests < trials.sweep.SWEEP_REQUESTS:  # the screen: the judge's short run on its own trace
            assert seed == trials.JUDGE_SEED
            return alone.get(counts, 0.0)
        return long_runs[counts][trials.CAPACITY_SEEDS.index(seed)]

    monkeypatch.setattr(trials, "saturations", one_at_a_time(saturation))
    assert [i for _, i, _ in turns.kv_room_gainers(inp, g, trials.JUDGE_SWEEP_REQUESTS)] == [0]
    assert turns.kv_room_for_capacity(inp, ev, g, 0.0) is g
    long_runs[roomy] = [4.4, 4.6, 4.5, 4.7]  # leads on every trace
    assert turns.kv_room_for_capacity(inp, ev, g, 0.0).evals[0].mixed.split.counts == roomy
    alone[roomy] = 3.0 * (1 + turns.KV_ROOM_GAIN)  # not enough alone: never run on the long traces
    assert turns.kv_room_gainers(inp, g, trials.JUDGE_SWEEP_REQUESTS) == []
    assert turns.kv_room_for_capacity(inp, ev, g, 0.0) is g


def test_the_bound_keeps_each_device_to_the_phases_its_roles_allow():
    """A device that its `roles:` keep to decode cannot spend its compute on prompts: it does
    decode FLOPs at most at its best decode step, and its layers' at most as fast as its port
    brings in their KV. One kept to prefill decodes nothing and ships its layers' KV out of its
    port. On the fixture with one prefill device and three decode ones (clusters/demo.yaml's
    shape), the bound falls below the one of the same devices free to run both phases."""
    from meshllm.partition.cost import flops_per_s, prefill_work
    from meshllm.sim.metrics import (
        decode_flops_cap,
        decode_memory_rate_per_s,
        device_flops_cap,
        flops_rate_per_s,
        prefill_rate_per_s,
    )

    free = small_inputs()
    kept = {"fog-1": ["prefill"], "fog-2": ["decode"], "fog-3": ["decode"], "fog-4": ["decode"]}
    inp = replace(free, nodes=tuple(replace(n, roles=tuple(kept[n.id])) if n.id in kept else n for n in free.nodes))
    assert inp.forced == ("prefill", "decode", "decode", "decode")
    lengths = [(16, 32)] * 10
    mc, ctx = inp.mc, inp.mix.decode_ctx
    pre = prefill_work(mc, mc.n_layers, 16, True)[0]
    pre_layers = pre - mc.head_flops_per_token
    dec = request_flops(mc, 16, 32) - pre  # the decode steps' FLOPs, the LM head's with them
    dec_layers = dec - 31 * mc.head_flops_per_token
    kv = 16 * mc.n_layers * mc.kv_bytes_per_token  # shipped per request
    port = [m.device.network_mbps * 1e6 / 8 for m in inp.members]
    decoding = [min(device_flops_cap(inp, i, ctx), decode_flops_cap(inp, i, ctx)) for i in (1, 2, 3)]
    layers = [min(d, port[i] * dec_layers / kv) for i, d in zip((1, 2, 3), decoding)]
    prefilling = flops_per_s(inp.members[0].device)
    assert decode_memory_rate_per_s(inp, lengths) == pytest.approx(min(sum(decoding) / dec, sum(layers) / dec_layers))
    assert decode_memory_rate_per_s(inp, lengths) < decode_memory_rate_per_s(free, lengths)
    assert prefill_rate_per_s(inp, lengths) == pytest.approx(
        min(prefilling / pre, min(prefilling, port[0] * pre_layers / kv) / pre_layers))
    assert flops_rate_per_s(inp, lengths) == pytest.approx((prefilling + sum(decoding)) / request_flops(mc, 16, 32))
    assert bound_rate_per_s(inp, lengths) == min(flops_rate_per_s(inp, lengths), decode_memory_rate_per_s(inp, lengths),
                                                 prefill_rate_per_s(inp, lengths)) < bound_rate_per_s(free, lengths)
    # a port binds: the prefill device's at a tenth of its line rate caps the prompts' rate
    slow = replace(inp, nodes=tuple(replace(n, device=replace(n.device, network_mbps=n.device.network_mbps / 10))
                                    if n.id == "fog-1" else n for n in inp.nodes))
    assert prefill_rate_per_s(slow, lengths) == pytest.approx(port[0] / 10 / kv)
    assert prefill_rate_per_s(slow, lengths) < prefill_rate_per_s(inp, lengths)
    # with no `roles:`, the bound is all FLOPs: neither the prompts' own rate nor a port binds
    assert bound_rate_per_s(free, lengths) == flops_rate_per_s(free, lengths) < prefill_rate_per_s(free, lengths)
    assert flops_rate_per_s(free, lengths) == pytest.approx(
        sum(device_flops_cap(free, i, ctx) for i in range(4)) / request_flops(mc, 16, 32))


def test_a_decode_only_stage_with_the_lm_head_is_not_capped_by_the_whole_model_s_kv():
    """A decode pipeline of a slow NUC (25 layers) and an RTX 4090 (5 layers and the LM head) on a
    40 Mb/s port, both kept to decode: the 4090's port brings in the KV of its 5 layers only, and
    its head's FLOPs ship no KV. A port cap of the whole request's decode FLOPs per byte of all its
    layers' KV put the bound at 2.01 req/s where the simulator serves 2.32 (found by a review);
    the port now caps the layers' FLOPs only."""
    from meshllm.config import parse_cluster

    c = {"model": "smollm2-135m", "weights_dtype": "fp32",
         "nodes": [{"id": "p", "device": "desktop-rtx-4090", "zone": "f", "roles": ["prefill"]},
                   {"id": "g", "zone": "f", "roles": ["decode"], "device": {
                       "name": "gpu-slow-port", "memory_gb": 24, "compute_tflops": 165, "memory_bandwidth_gbps": 1008,
                       "network_mbps": 40, "source": "test profile"}},
                   {"id": "n", "zone": "f", "roles": ["decode"], "device": {
                       "name": "slow-cpu", "memory_gb": 32, "compute_tflops": 0.03, "memory_bandwidth_gbps": 76,
                       "network_mbps": 2500, "source": "test profile"}}],
         "workload": {"prompts": ["a"], "input_tokens": {"mean": 512, "dist": "fixed"},
                      "output_tokens": {"mean": 32, "dist": "fixed"}}}
    inp = plan_inputs(parse_cluster(c, "inline.yaml"))
    by = {m.id: m for m in inp.members}
    reps = [SimReplica(0, "prefill", (by["p"],), (30,), inp), SimReplica(1, "decode", (by["n"], by["g"]), (25, 5), inp)]
    n = 1500
    done = Simulator(reps, [Request(i, i * 1e-5, 512, 32) for i in range(n)]).run()
    served = n / max(r.done for r in done)  # a flood: its ramp and drain included, below the sustained rate
    bound = bound_rate_per_s(inp, [(512, 32)] * 10)
    assert served <= bound * (1 + BOUND_RESOLUTION), (served, bound)


def test_no_policy_sustains_more_than_the_bound_where_roles_keep_devices_to_one_phase():
    """On clusters/demo.yaml the decode-only devices' memory-bound steps bind, far below all the
    FLOPs of its devices freed of their `roles:` (which put the bound at 10.7x every policy's
    saturation there)."""
    from meshllm.sim.metrics import decode_memory_rate_per_s

    cfg = load_cluster(REPO / "clusters/demo.yaml")
    inp = plan_inputs(cfg)
    lifted = replace(inp, nodes=tuple(replace(n, roles=None) if n.id.startswith("fog") else n for n in inp.nodes))
    lengths = [(a, b) for _, a, b in make_trace(inp, 1000, 0)]
    assert bound_rate_per_s(inp, lengths) == decode_memory_rate_per_s(inp, lengths) < 0.2 * bound_rate_per_s(lifted, lengths)
    # the NUC decodes at most as fast as the simulator's full step of it alone, LM head included
    # (left out of the steps and the requests, the bound put it 26 % higher: 50.4 req/s)
    from meshllm.sim.metrics import device_caps, per_request

    nuc = [m.id for m in inp.members].index("fog-2")
    alone = SimReplica(0, "decode", (inp.members[nuc],), (inp.mc.n_layers,), inp)
    step = alone.decode_iter_s(alone.max_batch(), inp.mix.decode_ctx)
    assert device_caps(inp, lengths)[nuc]["dec"] / per_request(inp, lengths)["dec"] == pytest.approx(
        alone.max_batch() / step / (32 - 1), rel=1e-3)
    got = simulate_policies(inp, rate=5.0, seed=0, names=("splitwise",), sweep_requests=300)
    sat = got["policies"]["splitwise"]["saturation_rate_per_s"]
    assert 0.5 * got["bound_rate_per_s"] < sat <= got["bound_rate_per_s"] * (1 + BOUND_RESOLUTION)
