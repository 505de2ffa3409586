"""A new plan, told in the terms of the plan in force: pure.

The planner sees nodes of one kind (the same device profile, zone and roles) as interchangeable,
so which of two such nodes gets a stage, and the numbers of the replicas, are accidents of its
search. Across a re-plan they are not: a replica keeps serving its sequences only if it keeps its
id, role, nodes and layers (roles/context.py `PlanContext.unchanged`). When a node that had been
seen dead came back, the plan made for it moved the decode stage back from the spare that had
taken it over to the returned node (its twin), and every sequence there was resumed a second
time. `keep_running` swaps nodes of one kind, and renumbers replicas, so that the new plan keeps
as many of the plan in force's replicas as it can; what the plan does (which kinds of nodes run
which stages) is unchanged, so are its predictions.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Mapping
from dataclasses import replace

from meshllm.partition.plan import Plan, Replica, Stage


def _slots(plan: Plan) -> dict[str, tuple]:
    """node -> what it does in `plan`: (role, n stages, stage index, layers), or a job outside
    every replica."""
    out: dict[str, tuple] = {n: ("drafter",) for n in plan.drafters}
    out.update({n: ("unused",) for n in plan.unused})
    for r in plan.replicas:
        for i, s in enumerate(r.stages):
            out[s.node] = (str(r.role), len(r.stages), i, s.layers)
    return out


def _relabel(plan: Plan, to: Mapping[str, str]) -> Plan:
    def m(n: str) -> str:
        return to.get(n, n)

    reps = tuple(replace(r, stages=tuple(Stage(m(s.node), s.layers) for s in r.stages)) for r in plan.replicas)
    return replace(plan, replicas=reps, drafters=tuple(m(n) for n in plan.drafters),
                   unused=tuple(m(n) for n in plan.unused), reasons={m(n): why for n, why in plan.reasons.items()})


def _shape(r: Replica) -> tuple:
    return str(r.role), r.stages


def _renumber(plan: Plan, current: Plan) -> tuple[Plan, int]:
    """Each replica of `plan` that the plan in force runs as it is gets that replica's id; the
    others the smallest ids left. Returns the plan and how many replicas it keeps."""
    ids = {_shape(r): r.id for r in current.replicas}
    kept = {k: ids[_shape(r)] for k, r in enumerate(plan.replicas) if _shape(r) in ids}
    free = (i for i in range(len(plan.replicas) + len(current.replicas)) if i not in kept.values())
    reps = [replace(r, id=kept[k] if k in kept else next(free)) for k, r in enumerate(plan.replicas)]
    return replace(plan, replicas=tuple(sorted(reps, key=lambda r: r.id))), len(kept)


def keep_running(plan: Plan, current: Plan | None, kind: Mapping[str, Hashable]) -> Plan:
    """`plan` with nodes of one `kind` swapped, and its replicas renumbered, to keep as many of
    `current`'s replicas as it can (each node of one kind takes, where it can, the slot it holds
    in `current`; a node whose kind is not known is not swapped). Without a plan in force, `plan`."""
    if current is None:
        return plan
    new, cur = _slots(plan), _slots(current)
    by_kind: dict[Hashable, list[str]] = defaultdict(list)
    for n in sorted(new):
        if n in kind:
            by_kind[kind[n]].append(n)
    to: dict[str, str] = {}  # the node that holds a slot in `plan` -> the node that takes it
    for nodes in by_kind.values():
        open_slots, takers = list(nodes), list(nodes)
        for who in list(takers):  # a node keeps its current slot: first its own in `plan`, else a twin's
            want = cur.get(who)
            if want is None:
                continue
            holder = who if who in open_slots and new[who] == want else \
                next((h for h in open_slots if new[h] == want), None)
            if holder is not None:
                to[holder] = who
                open_slots.remove(holder)
                takers.remove(who)
        for holder in list(open_slots):  # the rest: each keeps its own slot where it is free
            if holder in takers:
                to[holder] = holder
                open_slots.remove(holder)
                takers.remove(holder)
        to.update(zip(open_slots, takers))
    swapped, kept = _renumber(_relabel(plan, to), current)
    as_is, kept_as_is = _renumber(plan, current)
    return swapped if kept >= kept_as_is else as_is
