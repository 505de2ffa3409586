"""A new plan keeps the replicas of the plan in force where nodes of one kind allow it
(partition/stable.py): the planner's choice among twin nodes, and its replica numbers, must not
move sequences that could go on."""

from __future__ import annotations

from dataclasses import replace

from meshllm.config import load_cluster, plan_inputs
from meshllm.defaults import Role
from meshllm.partition.plan import Plan, Replica, Stage, plan_cluster
from meshllm.partition.stable import keep_running
from meshllm.roles.context import PlanContext
from tests.conftest import REPO


def kept(new: Plan, current: Plan) -> set[int]:
    """The replicas of `current` that go on unchanged under `new` (PlanContext.unchanged)."""
    addresses = {n: f"127.0.0.1:{7700 + i}" for i, n in enumerate(sorted(
        {s.node for p in (new, current) for r in p.replicas for s in r.stages} | set(new.unused) | set(current.unused)))}
    a, b = PlanContext(2, new, addresses, "x"), PlanContext(1, current, addresses, "x")
    return {r.id for r in current.replicas if a.unchanged(b, r.id)}


def same_work(new: Plan, current: Plan) -> set[int]:
    """The replicas of `current` whose role and stages `new` has too, under any number."""
    work = {(r.role, r.stages) for r in new.replicas}
    return {r.id for r in current.replicas if (r.role, r.stages) in work}


def test_a_node_seen_dead_and_back_moves_no_replica_of_the_plans_between():
    """clusters/failure.yaml: fog-2 and fog-3 decode. fog-2 seen dead: the plan without it
    numbered fog-3's decode replica 2 (it was 3), which would restart that replica's sequences
    for nothing (fog-4 turns mixed: a new role, which does restart its). Told in the terms of the
    plan in force, a re-plan changes no replica that could go on, and what each plan does is the
    planner's; fog-2 back, the same."""
    cfg = load_cluster(REPO / "clusters" / "failure.yaml")
    kinds = {n.id: (n.device.name, n.zone, n.roles) for n in cfg.nodes}
    full = plan_cluster(plan_inputs(cfg), seed=0, log=False)
    without = plan_cluster(plan_inputs(replace(cfg, nodes=tuple(n for n in cfg.nodes if n.id != "fog-2"))),
                           seed=0, log=False)
    going_on = same_work(without, full)
    assert len(going_on) >= 2 and kept(without, full) < going_on, "the planner's own numbering moves a replica"
    v2 = keep_running(without, full, {n: k for n, k in kinds.items() if n != "fog-2"})
    assert kept(v2, full) == going_on
    v3 = keep_running(full, v2, kinds)
    assert kept(v3, v2) == same_work(full, v2)
    for got, planned in ((v2, without), (v3, full)):  # the same plan, told otherwise
        assert sorted((r.role, tuple((kinds[s.node], s.layers) for s in r.stages)) for r in got.replicas) == \
            sorted((r.role, tuple((kinds[s.node], s.layers) for s in r.stages)) for r in planned.replicas)
        assert (got.capacity_req_s, got.prediction, sorted(got.drafters)) == \
            (planned.capacity_req_s, planned.prediction, sorted(planned.drafters))


def test_nodes_of_other_kinds_are_never_swapped_and_pipelines_keep_their_stage_order():
    def rep(rid, role, *nodes):
        return Replica(rid, role, tuple(Stage(n, (4 * i, 4 * i + 4)) for i, n in enumerate(nodes)), 1.0, 1.0, 1.0)

    current = Plan("m", 8, "fp32", (rep(0, Role.MIXED, "a", "b"), rep(1, Role.DECODE, "c", "d")), (), ("e",), 0.0, 1.0)
    new = Plan("m", 8, "fp32", (rep(0, Role.DECODE, "e", "d"), rep(1, Role.MIXED, "a", "b")), (), ("c",), 0.0, 1.0)
    kinds = {"a": "pi", "b": "pi", "c": "orin", "d": "orin", "e": "orin"}
    got = keep_running(new, current, kinds)
    assert [(r.id, r.role, [s.node for s in r.stages]) for r in got.replicas] == \
        [(0, Role.MIXED, ["a", "b"]), (1, Role.DECODE, ["c", "d"])] and got.unused == ("e",)
    assert keep_running(new, current, {**kinds, "e": "nuc"}).unused == ("c",), "e is no twin of c"
    assert keep_running(new, None, kinds) is new


def test_the_mesh_has_healed_when_a_twin_holds_a_node_s_place():
    from meshllm.faults import short_of

    kinds = {"fog-2": "orin", "fog-3": "orin", "fog-4": "nuc"}
    assert short_of({"fog-2", "fog-4"}, {"fog-3", "fog-4"}, kinds) == set()
    assert short_of({"fog-2", "fog-3"}, {"fog-3"}, kinds) == {"fog-2"}
    assert short_of({"fog-2", "fog-4"}, {"fog-2"}, kinds) == {"fog-4"}
    assert short_of({"edge-1"}, set(), kinds) == {"edge-1"}, "a node of no known kind is its own"


def test_a_node_of_no_known_kind_stays_and_new_replicas_take_the_smallest_free_ids():
    """A node missing from `kind` (its profile not heard yet) is never swapped, and does not stop
    its twins' swaps; a replica the plan in force does not have takes the smallest id left (a
    mutation review: neither was tested)."""
    def rep(rid, role, *nodes):
        return Replica(rid, role, tuple(Stage(n, (4 * i, 4 * i + 4)) for i, n in enumerate(nodes)), 1.0, 1.0, 1.0)

    current = Plan("m", 8, "fp32", (rep(3, Role.MIXED, "a", "b"), rep(5, Role.DECODE, "c", "d")), (), ("x",), 0.0, 1.0)
    # the planner put the twins c and x the other way round, and adds a replica on e (no kind known)
    new = Plan("m", 8, "fp32", (rep(0, Role.MIXED, "a", "b"), rep(1, Role.DECODE, "x", "d"),
                                rep(2, Role.DECODE, "e", "f")), (), ("c",), 0.0, 1.0)
    kinds = {"a": "pi", "b": "pi", "c": "orin", "d": "orin", "x": "orin", "f": "orin"}
    got = keep_running(new, current, kinds)
    assert [(r.id, r.role, [s.node for s in r.stages]) for r in got.replicas] == \
        [(0, Role.DECODE, ["e", "f"]), (3, Role.MIXED, ["a", "b"]), (5, Role.DECODE, ["c", "d"])], got.replicas
    assert got.unused == ("x",)
