"""Discrete-event simulator: accounting on hand-checkable cases, stability rule, policies, CLI."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from meshllm.config import load_cluster, plan_inputs
from meshllm.device import DeviceProfile
from meshllm.partition.dp import Member
from meshllm.partition.inputs import LengthDist
from meshllm.partition.plan import plan_cluster
from meshllm.sim.replica import SimReplica, from_plan, memory_ring, splitwise
from meshllm.sim.simulator import Request, Simulator
from meshllm.sim.sweep import draw_length, make_trace, simulate, simulate_policies, stable
from tests.conftest import REPO, run_cli

FIELDS = {"mean_wait_ms", "p99_wait_ms", "mean_prefill_wait_ms", "mean_ttft_ms", "throughput_tok_s",
          "saturation_rate_per_s"}


@pytest.fixture(scope="module")
def demo():
    cfg = load_cluster(REPO / "clusters/demo.yaml")
    return cfg, plan_inputs(cfg)


def replica(inp, rid, role, ids, counts):
    by_id = {m.id: m for m in inp.members}
    return SimReplica(rid, role, tuple(by_id[i] for i in ids), counts, inp)


def test_lone_request_has_no_wait(demo):
    _, inp = demo
    pre = replica(inp, 0, "prefill", ["fog-1"], (30,))
    dec = replica(inp, 1, "decode", ["fog-2"], (30,))
    req = Simulator([pre, dec], [Request(0, 0.0, 100, 10)]).run()[0]
    occ, lat = pre.prefill_s(100)
    assert req.wait_s == pytest.approx(0.0, abs=1e-12)
    assert req.first_token == pytest.approx(lat) and req.prefill_start == 0.0
    assert req.kv_ready > req.first_token and req.done > req.kv_ready


def test_shared_port_makes_the_second_transfer_wait(demo):
    _, inp = demo
    pre = replica(inp, 0, "prefill", ["fog-1"], (30,))
    dec = replica(inp, 1, "decode", ["fog-2"], (30,))
    a, b = Simulator([pre, dec], [Request(0, 0.0, 4000, 2), Request(1, 0.0, 4000, 2)]).run()
    occ, _ = pre.prefill_s(4000)
    assert b.prefill_start == pytest.approx(occ)  # waited for the pipeline slot
    kv_s = 30 * 4000 * inp.mc.kv_bytes_per_token * 8 / 1e9  # 1 Gb/s ports
    port_wait = max(0.0, (a.first_token + kv_s) - b.first_token)
    assert b.wait_s == pytest.approx(occ + port_wait, rel=1e-6)


def test_mixed_replica_batches_and_accounts_pauses(demo):
    _, inp = demo
    ring = replica(inp, 0, "mixed", ["fog-1", "fog-2"], (15, 15))
    reqs = Simulator([ring], [Request(i, 0.01 * i, 50, 20) for i in range(6)]).run()
    assert all(r.done > r.first_token > r.arrival for r in reqs)
    assert any(r.paused_s > 0 for r in reqs) and all(r.wait_s >= r.paused_s for r in reqs)


def test_lengths_and_trace(demo):
    rng = random.Random(0)
    assert {draw_length(rng, LengthDist(7, "fixed")) for _ in range(10)} == {7}
    xs = [draw_length(rng, LengthDist(200, "lognormal")) for _ in range(4000)]
    assert sum(xs) / len(xs) == pytest.approx(200, rel=0.08)
    ys = [draw_length(rng, LengthDist(50, "uniform")) for _ in range(4000)]
    assert 1 <= min(ys) and max(ys) <= 99 and sum(ys) / len(ys) == pytest.approx(50, rel=0.05)
    _, inp = demo
    inp = replace(inp, input_tokens=LengthDist(10, "fixed"), output_tokens=LengthDist(5, "fixed"))
    tr = make_trace(inp, 3000, 1)
    assert tr == make_trace(inp, 3000, 1) and {(a, b) for _, a, b in tr} == {(10, 5)}
    assert tr[-1][0] / 3000 == pytest.approx(1.0, rel=0.06)


def test_stability_rule_separates_low_and_overload(demo):
    cfg, inp = demo
    reps = from_plan(inp, plan_cluster(inp, log=False))
    trace = make_trace(inp, 600, 0)
    assert stable(simulate(reps, trace, 20.0))
    assert not stable(simulate(reps, trace, 5000.0))


def test_baseline_builders(demo):
    _, inp = demo
    sw = splitwise(inp)
    assert {r.role for r in sw} == {"prefill", "decode"}
    top = max(sw, key=lambda r: sum(m.device.compute_tflops for m in r.members))
    assert top.role == "prefill" and len({m.device.name for r in sw for m in r.members if r is top}) == 1
    for r in sw:
        assert len({m.device.name for m in r.members}) == 1 and sum(r.counts) == 30
    (ring,) = memory_ring(inp)
    assert ring.role == "mixed" and sum(ring.counts) == 30 and len(ring.members) == len(inp.members)
    mem = {m.id: m.device.memory_gb for m in ring.members}
    biggest = max(ring.members, key=lambda m: mem[m.id])
    assert ring.counts[ring.members.index(biggest)] == max(ring.counts)


def test_simulate_policies_schema_and_determinism():
    cfg = load_cluster(REPO / "clusters/failure.yaml")
    a = simulate_policies(plan_inputs(cfg), rate=20.0, seed=3, sweep_requests=300)
    assert {"meshllm", "splitwise", "memory-ring"} <= set(a["policies"])
    for name, got in a["policies"].items():
        assert got is not None and set(got) == FIELDS, name
        assert got["saturation_rate_per_s"] > 0 and got["mean_wait_ms"] >= 0
    assert simulate_policies(plan_inputs(cfg), rate=20.0, seed=3, sweep_requests=300) == a


def test_simulate_cli_json():
    p = run_cli("--simulate", "clusters/wan.yaml", "--json", "--rate", "50")
    assert p.returncode == 0, p.stderr
    obj = json.loads(p.stdout)
    assert obj["policies"]["meshllm"]["saturation_rate_per_s"] > 0


def test_device_slower_means_longer(demo):
    _, inp = demo
    fast = DeviceProfile("f", 8, 10, 100, 1000)
    slow = DeviceProfile("s", 8, 1, 10, 1000)
    r_fast = SimReplica(0, "mixed", (Member("a", fast, "fog"),), (30,), inp)
    r_slow = SimReplica(0, "mixed", (Member("a", slow, "fog"),), (30,), inp)
    assert r_slow.prefill_s(100)[1] > r_fast.prefill_s(100)[1]
    assert r_slow.decode_iter_s(4, 100) > r_fast.decode_iter_s(4, 100)
