"""The baselines, each built as its operator would run it, on the same cost model, DP, router
and simulator as meshllm (only the plan differs). Each returns a `Policy`: its replicas and,
for every stage-capable device it leaves idle, why.

Every baseline keeps the nodes' `roles:` limits (a node limited to one phase is never mixed).

- splitwise (Patel et al., ISCA 2024): machines of one type form a replica (the fewest that
  hold the model with the DP split, a type's leftover devices joining its replicas, which then
  hold more KV; or, where it rates higher, as many per replica as maximise the type's decode
  rate: KV room for bigger decode batches); the prefill / decode pool split is searched for the
  workload: every count of prefill replicas per type is tried and the split with the highest
  min(prefill, decode) capacity wins, rates port-aware (KV shipping over each device's port). May not: mix device
  types in a replica, or serve both phases on one replica (all prefill or all decode: with a
  single replica it cannot run at all). Idle: types that cannot hold the model on their own.
- mixed-dp (vLLM-style data parallel): per-type replicas, as many devices each as maximise the
  type's mixed rate (from the fewest that hold the model up: a memory-starved type gains KV
  room, ten 8 GB Orin Nanos serve llama-3-8b as two replicas of five, not three of 3-4), each serving both phases
  with the simulator's chunked prefill (the scheduler meshllm's mixed replicas use), no KV
  shipping, each on whichever of its decode and prefill layer splits rates higher mixed (as its
  operator would pick a pipeline split). May not: disaggregate, or mix device types in a
  replica. Idle: as splitwise.
- memory-ring (exo): every stage-capable device in one pipeline (file order; at most one per
  layer), layers proportional to memory, both phases on the one replica. May not: run more
  than one replica. Idle: devices beyond one per layer (the smallest).
- random: a random grouping (seeded) + DP + the planner's role rule.
- greedy: devices packed in type order (fastest types first) until a replica holds the
  model, + DP + the planner's role rule: no search; what the GA's gain is measured against.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from meshllm.partition.dp import Member, Splitter, shortfall_reason
from meshllm.partition.genetic import random_genes
from meshllm.partition.grouping import Evaluator, greedy_genes
from meshllm.partition.inputs import PlanInputs
from meshllm.partition.plan import planner_evaluator
from meshllm.partition.replica import ReplicaEval, best_mixed, evaluate_replica
from meshllm.sim.replica import SimReplica, from_grouping, sim_replica

RANDOM_TRIES = 100  # random groupings drawn until one has a usable replica
TIE = 0.01  # capacities this close are a tie (splitwise_pools)
MAX_SPLITS = 20_000  # prefill-count combinations the Splitwise search tries exhaustively at most


@dataclass
class Policy:
    replicas: list[SimReplica]
    idle: dict[str, str] = field(default_factory=dict)  # stage-capable node left idle -> why


def by_type(inp: PlanInputs) -> dict[str, list[Member]]:
    """Stage-capable devices by type (and by the role their `roles:` force, if any)."""
    forced = dict(zip((m.id for m in inp.members), inp.forced))
    out: dict[str, list[Member]] = {}
    for m in sorted(inp.members, key=lambda m: (m.device.name, forced[m.id] or "", m.zone)):
        out.setdefault(m.device.name + (f" ({forced[m.id]} only)" if forced[m.id] else ""), []).append(m)
    return out


def unforced(inp: PlanInputs) -> tuple[PlanInputs, dict[str, str]]:
    """The inputs without the nodes whose `roles:` allow one phase only (a mixed replica does both)."""
    keep = tuple(n for n in inp.nodes if n.id not in {m.id for m, f in zip(inp.members, inp.forced) if f})
    idle = {m.id: f"its roles allow {f} only; a mixed replica does both" for m, f in zip(inp.members, inp.forced) if f}
    return replace(inp, nodes=keep), idle


def spread(ms: list[Member], n: int) -> list[list[Member]]:
    """`ms` in `n` replicas of len(ms) // n devices, the leftovers spread over the first ones."""
    k = len(ms) // n
    groups = [ms[i * k:(i + 1) * k] for i in range(n)]
    for j, m in enumerate(ms[n * k:]):
        groups[j % n].append(m)
    return groups


def type_replicas(inp: PlanInputs, ms: list[Member],
                  score: Callable[[ReplicaEval], float] | None = None) -> tuple[list[ReplicaEval], str]:
    """Replicas of one device type: as many as fit (the fewest devices that hold the model each,
    leftovers spread over them); with `score`, the replica count (from that many down to one)
    whose replicas score highest in sum, as an operator sizes a pipeline for KV room."""
    splitters = (Splitter(inp.mc, inp.net, inp.mix.prefill_wp()), Splitter(inp.mc, inp.net, inp.mix.decode_wp()))
    for k in range(1, min(len(ms), inp.mc.n_layers) + 1):
        if evaluate_replica(inp.mc, ms[:k], inp.net, inp.mix, splitters).ok:
            break
    else:
        return [], shortfall_reason(inp.mc, ms, inp.mix.prefill_wp())
    best: tuple[float, list[ReplicaEval]] | None = None
    for n in range(len(ms) // k, 0 if score else len(ms) // k - 1, -1):
        groups = spread(ms, n)
        if best is not None and max(map(len, groups)) > inp.mc.n_layers:
            break
        evs = [evaluate_replica(inp.mc, g, inp.net, inp.mix, splitters) for g in groups]
        evs = [e if e.ok else evaluate_replica(inp.mc, g[:k], inp.net, inp.mix, splitters)
               for e, g in zip(evs, groups)]
        total = sum(map(score, evs)) if score and all(e.ok for e in evs) else -1.0
        if best is None or total > best[0]:
            best = (total, evs)
    return best[1], ""


def per_type(inp: PlanInputs, score: Callable[[ReplicaEval], float] | None = None,
             ) -> tuple[dict[str, list[ReplicaEval]], dict[str, str]]:
    """Replicas per device type (sized by `score`: `type_replicas`), and why the devices of the
    types that cannot hold it are idle."""
    reps, idle = {}, {}
    for name, ms in by_type(inp).items():
        evs, why = type_replicas(inp, ms, score)
        if evs:
            reps[name] = evs
            used = {m.id for e in evs for m in e.members}
            idle.update({m.id: f"{name}: its replica is full" for m in ms if m.id not in used})
        else:
            idle.update({m.id: f"one device type per replica, and {len(ms)} x {name} cannot hold the model: {why}"
                         for m in ms})
    return reps, idle


def splitwise_roles(evs: list[ReplicaEval], forced: list[str | None]) -> list[str]:
    """The prefill / decode split of `evs` with the highest min(prefill, decode) capacity, port-aware:
    exhaustive over how many replicas of each class (same members' type and count) prefill when
    that is at most MAX_SPLITS combinations, else every cut of the prefill/decode-ratio ranking."""
    classes: dict[tuple, list[int]] = {}
    for i, e in enumerate(evs):
        classes.setdefault((e.members[0].device.name, len(e.members), forced[i] or ""), []).append(i)
    keys = sorted(classes)
    rate = [(evs[classes[k][0]].prefill_req_s, evs[classes[k][0]].decode_req_s, len(classes[k])) for k in keys]
    choice = [range(c + 1) if not k[2] else [c if k[2] == "prefill" else 0] for k, (_, _, c) in zip(keys, rate)]
    if np.prod([len(x) for x in choice], dtype=float) <= MAX_SPLITS:
        cands = itertools.product(*choice)
    else:
        order = sorted(range(len(keys)), key=lambda j: -rate[j][0] / max(rate[j][1], 1e-12))
        flat = [j for j in order for _ in range(rate[j][2])]
        cands = (tuple(flat[:m].count(j) for j in range(len(keys))) for m in range(len(flat) + 1))
    best, best_x = -1.0, (0,) * len(keys)
    for x in cands:
        pre = sum(xi * p for xi, (p, _, _) in zip(x, rate))
        dec = sum((c - xi) * d for xi, (_, d, c) in zip(x, rate))
        if min(pre, dec) > best:
            best, best_x = min(pre, dec), x
    roles = ["decode"] * len(evs)
    for k, n_pre in zip(keys, best_x):
        for i in classes[k][:n_pre]:
            roles[i] = "prefill"
    return roles


def splitwise_pools(inp: PlanInputs) -> tuple[list[ReplicaEval], list[str], float, dict[str, str]]:
    """Tuned Splitwise's replicas, their roles, its capacity (the lesser pool's, port-aware; -1
    where it cannot form both pools) and why devices are idle. Each type's replicas are the
    fewest devices that hold the model, or sized for decode's KV room (`type_replicas` scored by
    decode rate); of the two, the one whose searched pool split rates higher, the sized one on a
    tie within TIE (the model books no KV room for a prefill pipeline's prompts in flight: with
    mesh-200's twelve RTX 4090s decoding, its thirty RTX 3060s prefill 4.81 req/s as two
    replicas and as one by the model, 2.85 and 4.82 in the simulator)."""
    forced_of = dict(zip((m.id for m in inp.members), inp.forced))
    best: tuple[list[ReplicaEval], list[str], float, dict[str, str]] | None = None
    for score in (None, lambda e: e.decode_req_s):
        reps, idle = per_type(inp, score)
        evs = [e for n in sorted(reps) for e in reps[n]]
        roles = splitwise_roles(evs, [forced_of[e.members[0].id] for e in evs])
        cap = -1.0
        if len(set(roles)) == 2:
            cap = min(sum(e.prefill_req_s for e, r in zip(evs, roles) if r == "prefill"),
                      sum(e.decode_req_s for e, r in zip(evs, roles) if r == "decode"))
        if best is None or cap > best[2] * (1 - TIE):
            best = (evs, roles, cap, idle)
    return best


def splitwise(inp: PlanInputs) -> Policy:
    evs, roles, cap, idle = splitwise_pools(inp)
    if cap < 0:
        return Policy([], {m.id: "splitwise needs a prefill and a decode replica" for m in inp.members})
    return Policy([sim_replica(inp, i, ev.members, role, ev) for i, (role, ev) in enumerate(zip(roles, evs))], idle)


def mixed_dp_replicas(inp: PlanInputs) -> tuple[list[ReplicaEval], dict[str, str]]:
    """mixed-dp's replicas (of `unforced` inputs): one device type each, each on whichever of its
    splits rates higher mixed (`best_mixed`), and why the other devices are idle."""
    def mixed_rate(ev: ReplicaEval) -> float:
        return best_mixed(inp.mc, ev, inp.net, inp.mix).mixed_req_s

    reps, idle = per_type(inp, mixed_rate)
    return [best_mixed(inp.mc, e, inp.net, inp.mix) for n in sorted(reps) for e in reps[n]], idle


def mixed_dp(inp: PlanInputs) -> Policy:
    inp, idle = unforced(inp)
    evs, more = mixed_dp_replicas(inp)
    out = [sim_replica(inp, i, ev.members, "mixed", ev) for i, ev in enumerate(evs)]
    return Policy(out, {**idle, **more})


def memory_ring(inp: PlanInputs) -> Policy:
    inp, idle = unforced(inp)
    keep = sorted(inp.members, key=lambda m: -m.device.memory_gb)[:inp.mc.n_layers]
    members = [m for m in inp.members if m in keep]  # file order
    idle.update({m.id: f"one pipeline holds at most one device per layer ({inp.mc.n_layers})"
                 for m in inp.members if m not in keep})
    if not members:
        return Policy([], idle)
    mem = np.array([m.device.memory_gb for m in members])
    extra = inp.mc.n_layers - len(members)
    share = mem / mem.sum() * extra
    counts = np.floor(share).astype(int)
    for i in np.argsort(-(share - counts), kind="stable")[: extra - counts.sum()]:
        counts[i] += 1
    ring = SimReplica(0, "mixed", tuple(members), tuple(int(c) + 1 for c in counts), inp)
    if ring.kv_capacity_tokens() < inp.mix.kv_tokens:  # the planner's rule for a replica that holds the model
        idle.update({m.id: f"the ring (layers by memory) leaves a stage no KV room for {inp.mix.kv_tokens:.0f} "
                           f"tokens" for m in members})
        return Policy([], idle)
    return Policy([ring], idle)


def grouping_policy(inp: PlanInputs, ev: Evaluator, genes: Sequence[int]) -> Policy:
    g = ev.decode(genes)
    used = {inp.members[i].id for grp in g.groups for i in grp}
    idle = {m.id: "not in a usable replica of this grouping" for m in inp.members if m.id not in used}
    return Policy(from_grouping(inp, g) if g.fitness > 0 else [], idle)


def random_policy(inp: PlanInputs, seed: int) -> Policy:
    rng = random.Random(seed)
    ev = planner_evaluator(inp)
    for _ in range(RANDOM_TRIES):
        genes = random_genes(rng, len(inp.members))
        if ev.fitness(genes) > 0:
            return grouping_policy(inp, ev, genes)
    return Policy([], {})


def greedy(inp: PlanInputs) -> Policy:
    ev = planner_evaluator(inp)
    return grouping_policy(inp, ev, greedy_genes(ev))


BASELINES = {"splitwise": splitwise, "mixed-dp": mixed_dp, "memory-ring": memory_ring, "greedy": greedy}
