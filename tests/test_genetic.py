"""GA replica grouping: near the exhaustive optimum on small instances, beats random groupings
and greedy packing on larger ones, deterministic, respects `roles:` limits; the role rule with
prefill / decode / mixed replicas; the latency phase; 200 devices x 80 layers planned."""

from __future__ import annotations

import random

import pytest

from meshllm.device import load_device
from meshllm.partition.cost import model_costs
from meshllm.partition.dp import Member, Net
from meshllm.partition.genetic import CAPACITY_FLOOR, all_groupings, evolve, evolve_plan, random_genes
from meshllm.partition.grouping import NONE, Evaluator, assign_roles, greedy_genes
from meshllm.partition.latency import WAIT_WEIGHT
from meshllm.partition.replica import Mix
from meshllm.shapes import model_args

PROFILES = ["raspberry-pi-5-8gb", "jetson-orin-nano-8gb", "jetson-orin-nx-16gb", "intel-nuc-13-i7",
            "mac-mini-m2", "desktop-rtx-3060-12gb", "desktop-rtx-4090", "jetson-agx-orin-64gb"]
NET = Net({frozenset(("fog",)): (0.5, 1000.0), frozenset(("edge", "fog")): (20.0, 300.0)})


def evaluator(rng: random.Random, n: int, model: str, forced=None) -> Evaluator:
    members = [Member(f"n{i}", load_device(rng.choice(PROFILES)), rng.choice(["fog", "fog", "edge"]))
               for i in range(n)]
    mix = Mix(rng.choice([128, 512, 2048]), rng.choice([32, 128, 512]))
    return Evaluator(model_costs(model_args(model)), members, NET, mix, forced or [None] * n, (0.43, 0.43))


def test_assign_roles_max_min_with_mixed():
    # a prefill-heavy, a decode-heavy and a balanced replica; mixed rates low: pure pools win
    fit, roles = assign_roles([(10.0, 1.0, 0.5), (1.0, 10.0, 0.5), (4.0, 4.0, 0.5)], [None] * 3)
    assert roles == ["prefill", "decode", "mixed"] and fit == pytest.approx(10.5)
    # the surplus of the larger pool turns mixed when that adds capacity
    fit, roles = assign_roles([(10.0, 1.0, 0.5), (1.0, 10.0, 0.5), (1.0, 10.0, 3.0)], [None] * 3)
    assert roles == ["prefill", "decode", "mixed"] and fit == pytest.approx(13.0)
    # slow ports: all mixed beats shipping KV
    fit, roles = assign_roles([(1.0, 1.0, 5.0), (1.0, 1.0, 5.0)], [None, None])
    assert roles == ["mixed", "mixed"] and fit == pytest.approx(10.0)
    # forced roles are kept and never mixed
    fit, roles = assign_roles([(10.0, 1.0, 0.5), (1.0, 10.0, 0.5)], ["decode", None])
    assert roles == ["decode", "prefill"] and fit == pytest.approx(1.0)
    assert assign_roles([(3.0, 4.0, 2.0)], [None]) == (2.0, ["mixed"])  # a lone replica is mixed


def test_a_prefill_pool_can_feed_mixed_replicas():
    """A prompt prefilled elsewhere costs a mixed replica 1/decode of its time instead of 1/mixed:
    a small prefill pool feeding two mixed replicas (5 + 2 + 2 - 5 x 2/10 = 8) beats the same pool
    feeding one decode replica beside a mixed one (2 + min(5, 10) = 7)."""
    from meshllm.partition.capacity import capacity

    rates = [(5.0, 1.0, 0.5), (2.0, 10.0, 2.0), (2.0, 10.0, 2.0)]
    assert capacity(rates, ["prefill", "decode", "mixed"])[0] == pytest.approx(7.0)
    cap, crossing, ship = capacity(rates, ["prefill", "mixed", "mixed"])
    assert cap == pytest.approx(8.0) and crossing == pytest.approx(5.0) and ship == {1: 5.0}
    fit, roles = assign_roles(rates, [None] * 3)
    assert roles == ["prefill", "mixed", "mixed"] and fit == pytest.approx(8.0)
    # a mixed replica whose own rate is its decode rate gains nothing by decoding others' prompts
    assert capacity([(5.0, 1.0, 0.5), (2.0, 10.0, 10.0)], ["prefill", "mixed"])[0] == pytest.approx(10.0)


@pytest.mark.parametrize("case", range(5))
def test_ga_within_3_percent_of_exhaustive(case):
    rng = random.Random(100 + case)
    ev = evaluator(rng, 6 + case % 3, rng.choice(["llama-2-7b", "llama-3-8b"]))
    best = max(ev.fitness(g) for g in all_groupings(len(ev.members)))
    got = evolve(ev, seed=case, log=False).fitness
    assert best > 0
    assert got >= 0.97 * best, (got, best)


def test_ga_beats_random_groupings_and_greedy_packing_on_larger_instances():
    for case in range(2):
        rng = random.Random(7 + case)
        ev = evaluator(rng, 30, "llama-2-70b" if case else "llama-3-8b")
        rand_best = max(ev.fitness(random_genes(rng, len(ev.members))) for _ in range(100))
        got = evolve(ev, seed=case, log=False).fitness
        assert got > rand_best, (got, rand_best)
        assert got >= ev.fitness(greedy_genes(ev)), "greedy packing is in the search space"


def test_latency_phase_keeps_capacity_and_lowers_the_predicted_cost():
    rng = random.Random(21)
    ev = evaluator(rng, 16, "llama-3-8b")
    cap = evolve(ev, seed=1, log=False)
    rate = 0.5 * cap.fitness
    found = evolve_plan(ev, rate, seed=1, log=False)
    got = found.best
    assert found.candidates[0] is got and len(found.candidates) >= 2 and found.rate == rate
    assert got.fitness >= CAPACITY_FLOOR * cap.fitness * (1 - 1e-9)
    assert got.prediction is not None and got.prediction.rate_per_s == rate
    assert got.prediction.cost(WAIT_WEIGHT) <= ev.latency(cap, rate).cost(WAIT_WEIGHT) * (1 + 1e-9)
    assert 0 <= got.prediction.wait_s < got.prediction.e2e_s and got.prediction.ttft_s < got.prediction.e2e_s


def test_ga_is_deterministic_for_a_seed():
    a = evolve(evaluator(random.Random(3), 12, "llama-3-8b"), seed=5, log=False)
    b = evolve(evaluator(random.Random(3), 12, "llama-3-8b"), seed=5, log=False)
    assert a.groups == b.groups and a.roles == b.roles and a.fitness == b.fitness
    random.seed(99)  # a state that a seeded run does not end in (the runs above may all end in one)
    state = random.getstate()
    evolve(evaluator(random.Random(3), 12, "llama-3-8b"), seed=5, log=False)
    assert random.getstate() == state  # the global RNG is restored


def test_forced_roles_are_respected():
    rng = random.Random(11)
    n = 10
    forced = ["prefill" if i < 3 else None for i in range(n)]
    ev = evaluator(rng, n, "llama-2-7b", forced)
    g = evolve(ev, seed=0, log=False)
    assert g.fitness > 0
    for group, role in zip(g.groups, g.roles):
        if any(i < 3 for i in group):
            assert role == "prefill"


def test_replicas_of_the_same_device_kinds_reuse_a_groupings_roles_and_capacity():
    """A grouping's roles and capacity depend only on its replicas' device kinds: swapping twins
    between replicas is served from the Evaluator's cache, and agrees with a fresh evaluation."""
    twins = ["desktop-rtx-4090", "desktop-rtx-3060-12gb", "jetson-agx-orin-64gb"]
    members = [Member(f"n{i}", load_device(twins[i // 2]), "fog") for i in range(6)]

    def fresh() -> Evaluator:
        return Evaluator(model_costs(model_args("llama-3-8b")), members, NET, Mix(512, 128), [None] * 6)

    ev = fresh()
    a = ev.decode([0, 1, 0, 1, 0, 1])
    assert len(a.groups) == 2 and a.fitness > 0 and len(ev.roles_cache) == 1
    b = ev.decode([1, 0, 1, 0, 1, 0])  # each device swapped with its twin
    assert len(ev.roles_cache) == 1  # a hit
    assert [sorted(g) for g in b.groups] == [[1, 3, 5], [0, 2, 4]] and (b.roles, b.fitness) == (a.roles, a.fitness)
    c = fresh().decode([1, 0, 1, 0, 1, 0])
    assert (c.groups, c.roles, c.fitness, c.link_req_s) == (b.groups, b.roles, b.fitness, b.link_req_s)
    forced = Evaluator(ev.mc, members, NET, ev.mix, ["prefill"] + [None] * 5)
    forced.decode([0, 1, 0, 1, 0, 1])
    d = forced.decode([1, 0, 1, 0, 1, 0])  # the same kinds, but a forced role moved: no hit
    assert len(forced.roles_cache) == 2 and d.roles[1] == "prefill"


@pytest.mark.slow
def test_200_devices_80_layers_plan():
    """The 200-device llama-2-70b bench cluster plans end to end: both GA phases, DP and reasons.
    Its time (the issue's <= 10 s budget) is measured by bench/planner.py, not asserted here."""
    from meshllm.config import load_cluster, plan_inputs
    from meshllm.partition.plan import plan_cluster
    from tests.conftest import REPO

    inp = plan_inputs(load_cluster(REPO / "clusters/bench-mesh-200.yaml"))
    assert inp.args.n_layers == 80 and len(inp.nodes) == 200
    plan = plan_cluster(inp, log=False)
    assert plan.replicas and plan.capacity_req_s > 0


SLOW_ZONES = {
    "model": "llama-3-8b",
    "nodes": [
        {"id": "a1", "device": "desktop-rtx-3060-12gb", "zone": "A"},
        {"id": "a2", "device": "desktop-rtx-3060-12gb", "zone": "A"},
        {"id": "b1", "device": "jetson-orin-nx-16gb", "zone": "B"},
        {"id": "b2", "device": "mac-mini-m2", "zone": "B"},
        {"id": "c1", "device": "intel-nuc-13-i7", "zone": "C"},
        {"id": "c2", "device": "jetson-agx-orin-64gb", "zone": "C"},
    ],
    "links": [{"zones": ["A", "B"], "rtt_ms": 200, "bandwidth_mbps": 1},
              {"zones": ["B", "C"], "rtt_ms": 300, "bandwidth_mbps": 0.5},
              {"zones": ["A", "C"], "rtt_ms": 500, "bandwidth_mbps": 0.1}],
    "workload": {"arrival_rate_per_s": 0.5, "input_tokens": {"mean": 512}, "output_tokens": {"mean": 128}},
}


def slow_link_evaluator(cluster: dict, where: dict[str, int]):
    """(inputs, evaluator, genes) for a cluster file's dict; `where`: node id -> replica label (NONE if absent)."""
    from meshllm.config import parse_cluster, plan_inputs
    from meshllm.partition.plan import planner_evaluator

    inp = plan_inputs(parse_cluster(cluster, "test"))
    ev = planner_evaluator(inp)
    return inp, ev, [where.get(m.id, NONE) for m in ev.members]


def test_roles_that_ship_kv_over_a_slow_zone_link_lose_to_every_replica_mixed():
    """assign_roles rates the ports only; the shared zone links cap its pick afterwards. Here it
    made the two zones' pairs prefill for mixed replicas in the third zone, across links of 0.1-1
    Mb/s: capacity 0.0003 req/s with the Jetson AGX Orin as a replica of its own, so the plan left
    that device (the zone's strongest) out at 2.60 req/s, where every replica mixed serves 4.57."""
    from meshllm.partition.plan import plan_cluster

    inp, ev, genes = slow_link_evaluator(SLOW_ZONES, {"a1": 0, "a2": 0, "b1": 1, "b2": 1, "c1": 2, "c2": 3})
    every_mixed, port_pick = ev.options(genes)
    assert every_mixed.roles == ("mixed",) * 4 and every_mixed.fitness > 4
    assert "prefill" in port_pick.roles and port_pick.fitness < 0.001  # capped by the links
    assert ev.decode(genes) == every_mixed
    plan = plan_cluster(inp, log=False)
    assert "c2" in {s.node for r in plan.replicas for s in r.stages}
    assert plan.capacity_req_s >= every_mixed.fitness * (1 - 1e-9)


IDLE_ZONE = {"model": "llama-2-70b",
             "nodes": [{"id": "a1", "device": "cloud-a100-80gb", "zone": "A"},
                       {"id": "a2", "device": "cloud-a100-80gb", "zone": "A"}]
             + [{"id": f"b{i}", "device": "desktop-rtx-4090", "zone": "B"} for i in range(1, 8)],
             "links": [{"zones": ["A", "B"], "rtt_ms": 50, "bandwidth_mbps": 10}],
             "workload": {"arrival_rate_per_s": 0.5, "input_tokens": {"mean": 512}, "output_tokens": {"mean": 128}}}


def test_devices_left_out_form_a_replica_together_where_no_single_move_adds_capacity():
    """Two A100s in zone A are a replica; seven RTX 4090s in zone B, 10 Mb/s away, are left out.
    None holds llama-2-70b alone and none adds capacity to the A100s' replica across the link, so
    single-device moves leave all seven out (on a random 200-device mesh that left 132 devices
    idle, 19 RTX 4090s among them, at 11.36 req/s where these passes reach 16.18); together
    they are a replica of their own."""
    from meshllm.partition.genetic import fill_unused

    _, ev, genes = slow_link_evaluator(IDLE_ZONE, {"a1": 0, "a2": 0})
    filled = fill_unused(ev, genes, 0.5)
    assert [g == NONE for g in genes] == [False, False] + [True] * 7
    assert filled[2:] == [filled[2]] * 7 and filled[2] not in (NONE, 0)
    assert ev.fitness(filled) > 1.5 * ev.fitness(genes)
    # devices in a replica that cannot be formed (two RTX 4090s cannot hold the model) count as left out
    stuck = [0, 0, 1, 1] + [NONE] * 5
    assert ev.fitness(stuck) == ev.fitness(genes) and ev.decode(stuck).groups == ev.decode(genes).groups
    assert ev.fitness(fill_unused(ev, stuck, 0.5)) == pytest.approx(ev.fitness(filled))


def random_roles_cluster(seed: int) -> dict:
    """40 llama-3-8b devices in 3 zones joined by 0.1-10 Mb/s links, a third with `roles:`."""
    import itertools

    rng = random.Random(seed)
    types = ["desktop-rtx-4090", "jetson-orin-nx-16gb", "mac-mini-m2", "raspberry-pi-4-4gb", "raspberry-pi-3b-1gb",
             "jetson-orin-nano-8gb"]
    nodes = []
    for i in range(40):
        roles = rng.choice([["prefill"], ["decode"], ["drafter"], ["prefill", "decode"]]) if rng.random() < 0.3 else None
        nodes.append({"id": f"d{i:03d}", "device": rng.choice(types), "zone": f"z{i % 3}", **({"roles": roles} if roles else {})})
    links = [{"zones": [f"z{a}", f"z{b}"], "rtt_ms": rng.randint(1, 100), "bandwidth_mbps": rng.choice([0.1, 1, 10])}
             for a, b in itertools.combinations(range(3), 2)]
    return {"model": "llama-3-8b", "nodes": nodes, "links": links,
            "workload": {"input_tokens": {"mean": 512}, "output_tokens": {"mean": 128}}}


def test_forming_replicas_never_ends_below_what_single_moves_reach():
    """Devices in a replica too small to be formed count as left out; single moves may complete
    such a replica, so they come first: taking those devices out first ended 0.3 % below the
    single moves alone on this cluster (no pack of the left-out devices was that replica)."""
    from meshllm.partition.genetic import fill_singles, fill_unused

    _, ev, _ = slow_link_evaluator(random_roles_cluster(2), {})
    genes = [9, 7, 5, 0, 11, 1, 8, -1, 0, -1, 7, -1, 5, 3, -1, 7, 11, -1, 7, 8, 8, 3, -1, -1, -1, 1, 11, 2, 1, 2, 7,
             -1, 3, 1, -1, 3, 4]  # what the search handed fill_unused here
    rate, floor = 7.937778792407685, 10.999493469479221
    assert ev.fitness(fill_unused(ev, genes, rate, floor)) >= ev.fitness(fill_singles(ev, genes, rate, floor)) > 11.1


def test_a_device_left_out_says_what_the_devices_left_out_could_do_together():
    from meshllm.config import parse_cluster, plan_inputs
    from meshllm.partition.plan import plan_cluster
    from meshllm.partition.unused import member_reason

    _, ev, genes = slow_link_evaluator(IDLE_ZONE, {"a1": 0, "a2": 0})
    assert member_reason(ev, ev.decode(genes), genes, 2).endswith(
        "; a new replica of it with 6 other devices left out adds capacity (4.719 vs 3.009 req/s)")
    four = dict(IDLE_ZONE, nodes=IDLE_ZONE["nodes"][:6])  # 4 x 22.5 GB: short of the model's 138.79 GB
    plan = plan_cluster(plan_inputs(parse_cluster(four, "test")), log=False)
    assert plan.unused == ("b1", "b2", "b3", "b4")
    assert plan.reasons["b1"].endswith("; no new replica can be packed from the 4 devices left out (90.00 GB together; "
                                       "one is packed to 1.05 x the model's need, of nodes whose roles allow one phase)")
    # prefill-only and decode-only nodes never make one replica: 7 x 22.5 GB, but 3 + 4 by role
    split = dict(IDLE_ZONE, nodes=[dict(n, roles=["prefill"] if n["id"] in ("b1", "b2", "b3") else ["decode"])
                                   if n["id"].startswith("b") else n for n in IDLE_ZONE["nodes"]])
    plan = plan_cluster(plan_inputs(parse_cluster(split, "test")), log=False)
    assert set(plan.unused) == {f"b{i}" for i in range(1, 8)}
    assert plan.reasons["b1"].endswith("; no new replica can be packed from the 7 devices left out (157.50 GB together; "
                                       "one is packed to 1.05 x the model's need, of nodes whose roles allow one phase)")


def test_at_a_rate_the_link_capped_roles_are_still_offered_where_they_wait_less():
    """Two pipelines, each an RTX 4090 in zone A and a Mac mini in zone B (100 Mb/s between):
    every replica mixed sustains 2.38 req/s, one prefilling for the other only 1.51 (the link caps
    the KV it ships), but at 0.3 req/s that one's users wait far less. The capacity phase takes
    the first; the latency phase rates both and keeps the cheaper one that holds its floor."""
    cluster = {"model": "llama-3-8b",
               "nodes": [{"id": "a1", "device": "desktop-rtx-4090", "zone": "A"},
                         {"id": "a2", "device": "desktop-rtx-4090", "zone": "A"},
                         {"id": "b1", "device": "mac-mini-m2", "zone": "B"},
                         {"id": "b2", "device": "mac-mini-m2", "zone": "B"}],
               "links": [{"zones": ["A", "B"], "rtt_ms": 20, "bandwidth_mbps": 100}],
               "workload": {"arrival_rate_per_s": 0.3, "input_tokens": {"mean": 512}, "output_tokens": {"mean": 128}}}
    _, ev, genes = slow_link_evaluator(cluster, {"a1": 0, "a2": 1, "b1": 0, "b2": 1})
    every_mixed, port_pick = ev.options(genes)
    assert every_mixed.roles == ("mixed", "mixed") and sorted(port_pick.roles) == ["mixed", "prefill"]
    assert every_mixed.fitness > 2.3 and 1.4 < port_pick.fitness < 1.6 and ev.decode(genes) == every_mixed
    costs = [ev.latency(g, 0.3).cost(WAIT_WEIGHT) for g in (every_mixed, port_pick)]
    assert costs[1] < 0.5 * costs[0]
    score, picked = ev.rated(genes, 0.3, 1.0)
    assert picked == port_pick and score == (1.0, -costs[1])
    score, picked = ev.rated(genes, 0.3, 2.0)  # a floor the port pick does not hold
    assert picked == every_mixed and score == (2.0, -costs[0])


def test_better_is_lexicographic_with_a_float_noise_tolerance():
    """Capacity first (a lower one never wins on cost), then -cost; differences of float noise
    (~1e-12 relative) are no improvement in either."""
    from meshllm.partition.genetic import better

    assert better((2.0, -5.0), (1.0, 0.0)) and not better((1.0, 0.0), (2.0, -5.0))
    assert not better((0.5, 10.0), (1.0, 0.0))  # a lower capacity loses, however cheap
    assert better((1.0, -1.0), (1.0, -2.0)) and not better((1.0, -2.0), (1.0, -1.0))
    assert not better((1.0 + 1e-12, 0.0), (1.0, 0.0))
    assert not better((1.0, -1.0 + 1e-12), (1.0, -1.0))


def test_seeded_seeds_the_global_rng_and_restores_it():
    """deap draws from the global `random`: `seeded` seeds it, whatever its state before, and puts
    the caller's state back afterwards."""
    from meshllm.partition.genetic import seeded

    random.seed(123)
    a = seeded(5, lambda rng: (random.random(), rng.random()))
    after = random.random()
    random.seed(456)
    state = random.getstate()
    assert seeded(5, lambda rng: (random.random(), rng.random())) == a
    assert random.getstate() == state
    random.seed(123)
    assert random.random() == after  # the seeded run did not advance the caller's RNG


def test_run_ga_keeps_its_elite_and_returns_the_population_best_first():
    """One chromosome scores 1, all others 0: elitism keeps it through every generation, and the
    population comes back sorted by fitness, best first."""
    from meshllm.partition.genetic import Memo, run_ga

    target = [0, 1, 2, 3, 4, 5, 6, 7]
    score = Memo(lambda genes: (1.0 if list(genes) == target else 0.0, -float(sum(g == NONE for g in genes))))
    rng = random.Random(0)
    pop = [list(target)] + [[rng.randrange(-1, 4) for _ in range(8)] for _ in range(19)]
    random.seed(0)
    out = run_ga(score, pop, 8, 40, 40, False, "test")
    assert out[0] == target and len(out) == 20
    fits = [score(g) for g in out]
    assert fits == sorted(fits, reverse=True)


def test_neighbours_move_single_genes_and_swap_pairs():
    """The local search's moves: each gene to another replica, a fresh one or none, then swaps of two
    genes in different replicas."""
    from meshllm.partition.genetic import neighbours

    moves = list(neighbours([0, 1, NONE]))
    assert ((0, 1),) in moves and ((0, 2),) in moves and ((0, NONE),) in moves and ((2, 0),) in moves
    assert ((0, 0),) not in moves
    assert ((0, 1), (1, 0)) in moves and ((1, NONE), (2, 1)) in moves and len(moves) == 3 * 3 + 3


def test_without_a_rate_the_plan_is_made_for_a_share_of_its_own_capacity():
    """`evolve_plan(rate=0)` (no workload rate): the latency phase plans for NO_RATE_LOAD x the
    best capacity found, and says so in `Search.rate`; a given rate is planned for as it is."""
    from meshllm.partition.genetic import NO_RATE_LOAD

    ev = evaluator(random.Random(4), 8, "llama-3-8b")
    none = evolve_plan(ev, 0.0, seed=1, log=False)
    assert none.capacity > 0 and none.rate == pytest.approx(NO_RATE_LOAD * none.capacity, rel=1e-12)
    assert none.best.prediction.rate_per_s == pytest.approx(none.rate, rel=1e-12)
    assert evolve_plan(ev, 0.25 * none.capacity, seed=1, log=False).rate == 0.25 * none.capacity


def test_a_left_out_device_that_adds_capacity_but_raises_the_predicted_cost_stays_out():
    """fill_singles places a left-out device only where the predicted cost at the rate rises by at
    most FILL_COST_SLACK. At 0.43 req/s the Mac mini joins the Orin NX's replica (more capacity,
    the same cost); the RTX 3060 would add 6 % more capacity in the Orin Nano's but nearly triple
    the predicted cost, so it stays out (placed anyway, the cost goes from 11.2 s to 30.9 s)."""
    from meshllm.partition.genetic import FILL_COST_SLACK, fill_singles, predicted_cost
    from meshllm.partition.grouping import Evaluator

    devs = [("jetson-agx-orin-64gb", "fog"), ("desktop-rtx-4090", "fog"), ("jetson-orin-nano-8gb", "fog"),
            ("mac-mini-m2", "edge"), ("jetson-orin-nx-16gb", "fog"), ("desktop-rtx-3060-12gb", "fog")]
    members = [Member(f"n{i}", load_device(d), z) for i, (d, z) in enumerate(devs)]
    ev = Evaluator(model_costs(model_args("llama-3-8b")), members, NET, Mix(128, 512), [None] * 6, (0.43, 0.43))
    genes, rate = [0, 1, 3, NONE, 2, NONE], 0.43
    got = fill_singles(ev, genes, rate)
    assert got == [0, 1, 3, 2, 2, NONE]
    assert ev.fitness(got) > ev.fitness(genes)
    assert predicted_cost(ev, got, rate) <= predicted_cost(ev, genes, rate) * (1 + FILL_COST_SLACK)
    placed = got[:5] + [got[2]]  # the RTX 3060 into the Orin Nano's replica
    assert ev.fitness(placed) > ev.fitness(got) * 1.05
    assert predicted_cost(ev, placed, rate) > 2 * predicted_cost(ev, got, rate)
