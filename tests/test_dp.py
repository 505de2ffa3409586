"""DP layer split: equals brute force (all orders, all contiguous splits) and respects memory."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from meshllm.device import DeviceProfile
from meshllm.partition.cost import link_time_s, model_costs, stage_decode_s, stage_prefill_s
from meshllm.partition.dp import (
    Infeasible,
    Member,
    Net,
    Split,
    Workpoint,
    min_bottleneck_split,
    split_replica,
    threshold_split,
)
from meshllm.shapes import ModelArgs

N_INSTANCES = 220


def compositions(n_layers: int, k: int) -> np.ndarray:
    """All ways to cut n_layers into k non-empty contiguous stages, as (C, k) counts."""
    rows = []
    for cuts in itertools.combinations(range(1, n_layers), k - 1):
        edges = (0, *cuts, n_layers)
        rows.append([b - a for a, b in zip(edges, edges[1:])])
    return np.array(rows, dtype=int)


def brute_force(mc, members, net, wp) -> float:
    """Independent reference: every order x every split, costs straight from cost.py."""
    k, n_layers = len(members), mc.n_layers
    comps = compositions(n_layers, k)
    best = np.inf
    for order in itertools.permutations(range(k)):
        seq = [members[i] for i in order]
        table = np.full((k, n_layers + 1), np.inf)
        for p, m in enumerate(seq):
            first, last = p == 0, p == k - 1
            for n in range(1, n_layers + 1):
                mem = mc.stage_weight_bytes(n, first, last) + n * wp.kv_tokens * mc.kv_bytes_per_token
                if mem <= m.device.memory_bytes:
                    table[p, n] = (stage_prefill_s(mc, m.device, n, wp.tokens, last) if wp.phase == "prefill"
                                   else stage_decode_s(mc, m.device, n, wp.tokens, wp.context, last))
        links = []
        for a, b in zip(seq, seq[1:]):
            rtt, bw = net.rtt_mbps(a.zone, b.zone)
            mbps = min(a.device.network_mbps, b.device.network_mbps, bw or np.inf)
            links.append(link_time_s(wp.tokens * mc.act_bytes_per_token, rtt, mbps))
        per = table[np.arange(k)[None, :], comps].max(axis=1)
        best = min(best, max(per.min(), max(links, default=0.0)))
    return best


def random_instance(rng: random.Random):
    n_layers = rng.randint(1, 16)
    k = rng.randint(1, min(6, n_layers))
    args = ModelArgs(dim=64, n_layers=n_layers, n_heads=4, n_kv_heads=2, vocab_size=rng.choice([64, 320, 2000]),
                     hidden_dim=128, name="rand")
    mc = model_costs(args, rng.choice(["fp16", "int4", "fp32"]))
    wp = (Workpoint("prefill", rng.randint(1, 600), 0, rng.choice([0, 64, 512]))
          if rng.random() < 0.5 else Workpoint("decode", rng.randint(1, 32), rng.randint(1, 900), rng.choice([0, 256])))
    need = mc.weight_bytes + n_layers * wp.kv_tokens * mc.kv_bytes_per_token
    members = []
    for i in range(k):
        dev = DeviceProfile(f"dev{rng.randint(0, 3)}", memory_gb=need * rng.uniform(0.15, 1.2) / 1e9,
                            compute_tflops=rng.choice([0.02, 0.5, 10, 100]),
                            memory_bandwidth_gbps=rng.choice([5, 50, 1000]), network_mbps=rng.choice([10, 1000]))
        members.append(Member(f"n{i}", dev, rng.choice(["a", "b"])))
    net = Net({frozenset(("a", "b")): (rng.choice([1, 80]), rng.choice([50, 1000]))})
    return mc, members, net, wp


def check_memory(mc, members, split: Split, wp) -> None:
    k = len(split.counts)
    assert sum(split.counts) == mc.n_layers and min(split.counts) >= 1
    for p, (i, n) in enumerate(zip(split.order, split.counts)):
        mem = mc.stage_weight_bytes(n, p == 0, p == k - 1) + n * wp.kv_tokens * mc.kv_bytes_per_token
        assert mem <= members[i].device.memory_bytes


def test_dp_equals_brute_force_on_random_instances():
    rng = random.Random(1234)
    feasible = 0
    for _ in range(N_INSTANCES):
        mc, members, net, wp = random_instance(rng)
        want = brute_force(mc, members, net, wp)
        got = split_replica(mc, members, net, wp, exact_max=6)
        if not np.isfinite(want):
            assert isinstance(got, Infeasible) and got.reason
            continue
        feasible += 1
        assert isinstance(got, Split)
        assert got.bottleneck_s == pytest.approx(want, rel=1e-9)
        check_memory(mc, members, got, wp)
    assert feasible >= N_INSTANCES // 3  # the instances exercise both outcomes


def test_threshold_search_equals_dp_on_random_tables():
    rng = np.random.default_rng(7)
    for _ in range(300):
        k, n_layers = rng.integers(1, 9), rng.integers(1, 25)
        if k > n_layers:
            continue
        table = np.cumsum(rng.uniform(0, 1, (k, n_layers)), axis=1) + rng.uniform(0, 2, (k, 1))
        cap = rng.integers(0, n_layers + 1, k)
        for i in range(k):
            table[i, cap[i]:] = np.inf
        links = list(rng.uniform(0, 1.5, k - 1))
        a, b = min_bottleneck_split(table, links), threshold_split(table, links)
        assert (a is None) == (b is None)
        if a is not None:
            assert a[0] == b[0]  # exactly: the splitter ranks orders by the cheap one, then runs the DP
            assert sum(b[1]) == n_layers and all(table[i, c - 1] <= b[0] for i, c in enumerate(b[1]))


def test_a_link_slower_than_every_stage_is_the_split_s_bottleneck():
    """Both splitters report the slowest link where it is slower than every stage (the random
    tables above draw links that never are: a mutation dropping them went unseen)."""
    table = np.cumsum(np.full((3, 9), 0.1), axis=1)
    for links in ([5.0, 0.2], [0.2, 7.5]):
        for split in (min_bottleneck_split, threshold_split):
            got = split(table, links)
            assert got is not None and got[0] == max(links) and sum(got[1]) == 9, (split.__name__, links, got)


def test_long_replica_uses_heuristic_order_and_fits():
    mc = model_costs(ModelArgs(dim=512, n_layers=40, n_heads=8, n_kv_heads=8, vocab_size=1000, hidden_dim=1024))
    wp = Workpoint("decode", 8, 300, 100)
    devs = [DeviceProfile(f"t{i % 3}", mc.weight_bytes / 6e9, 1 + i % 3, 50, 1000) for i in range(12)]
    members = [Member(f"n{i}", d, "z") for i, d in enumerate(devs)]
    got = split_replica(mc, members, Net({}), wp)
    assert isinstance(got, Split) and len(got.counts) == 12
    check_memory(mc, members, got, wp)


def test_infeasible_reason_names_device_and_shortfall():
    mc = model_costs(ModelArgs(dim=256, n_layers=4, n_heads=4, n_kv_heads=4, vocab_size=100, hidden_dim=512))
    tiny = DeviceProfile("tiny", mc.weight_bytes / 10e9, 1, 1, 1)
    got = split_replica(mc, [Member("pi-1", tiny, "z"), Member("pi-2", tiny, "z")], Net({}),
                        Workpoint("prefill", 10, 10, 0))
    assert isinstance(got, Infeasible)
    assert "pi-1" in got.reason and "short" in got.reason and "GB" in got.reason


def test_a_reason_names_a_few_devices_and_counts_the_rest():
    """A pack of 46 left-out devices made its reason a line of 46 ids."""
    mc = model_costs(ModelArgs(dim=256, n_layers=64, n_heads=4, n_kv_heads=4, vocab_size=100, hidden_dim=512))
    tiny = DeviceProfile("tiny", mc.weight_bytes / 100e9, 1, 1, 1)
    members = [Member(f"pi-{i}", tiny, "z") for i in range(46)]
    got = split_replica(mc, members, Net({}), Workpoint("prefill", 10, 10, 0))
    assert isinstance(got, Infeasible) and "short" in got.reason
    assert "pi-0, pi-1, pi-2, pi-3, pi-4, pi-5 and 40 more have" in got.reason and "pi-6" not in got.reason
    two = split_replica(mc, members[:2], Net({}), Workpoint("prefill", 10, 10, 0))
    assert "devices pi-0, pi-1 have" in two.reason


def test_a_member_pickled_in_one_process_gets_its_kind_in_the_other(monkeypatch):
    """`Member.kind` numbers interchangeable devices per process: a member unpickled elsewhere
    (a process pool's result) must not carry its old number, which names another device there."""
    import pickle

    from meshllm.partition import dp

    fast = Member("gpu", DeviceProfile("fast", 24, 80, 1000, 2500), "z")
    assert fast.kind == dp._KINDS[fast.key]
    data = pickle.dumps(fast)
    slow = Member("pi", DeviceProfile("slow", 8, 1, 10, 1000), "z")
    monkeypatch.setattr(dp, "_KINDS", {slow.key: fast.kind})  # the other process: that number is a Pi's
    there = pickle.loads(data)
    assert there == fast and there.kind != slow.kind
    assert there.kind == dp._KINDS[fast.key]
