"""Replica grouping by a genetic algorithm (deap), with prefill/decode roles (E2LLM, seed 003).

Chromosome: one gene per eligible device, the index of its replica or -1 (not in a replica).
Fitness: the request rate the grouping sustains for the workload mix, min(prefill capacity,
decode capacity), where every replica's per-role capacity comes from replica.py (DP split,
compute and KV shipping over ports). Roles: rank replicas by prefill-rate / decode-rate and
choose the split point that maximises the min (`assign_roles`). A single usable replica does
both phases itself (no KV shipping).

Search: the population is seeded with greedy packings (devices by memory, compute or type,
closing a replica at 1.05 / 1.5 / 2.5 x the model's memory), the whole cluster as one
replica and the fastest devices alone; tournament selection, two-point crossover and a
mutation that moves genes, merges or dissolves replicas; elitism; it stops after
STALL_GENERATIONS without improvement. The best individual, and each of its replicas kept
alone, is then polished by a bounded first-improvement local search (single-gene moves and
swaps). Replica evaluations are cached by the multiset of (device profile, zone),
since members with the same key are interchangeable; this is what makes 200-device clusters
plannable in seconds. Deterministic for a seed: deap draws from the global `random`, which is
seeded here and restored afterwards.
"""

from __future__ import annotations

import itertools
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from deap import base, creator, tools

from meshllm.partition.cost import ModelCosts
from meshllm.partition.dp import Member, Net, Splitter
from meshllm.partition.replica import Mix, ReplicaEval, evaluate_replica, mixed_req_s

POP_SIZE = 40
POP_SMALL, SMALL_CLUSTER = 80, 40  # larger population for clusters of <= 40 devices (cheap)
MAX_GENERATIONS = 150
STALL_GENERATIONS = 30  # stop after this many generations without improvement
CX_PROB, MUT_PROB, GENE_PROB = 0.5, 0.6, 0.05
ELITE = 2
PACK_SLACK = (1.05, 1.5, 2.5)  # replica memory / model memory targets of the greedy seeds
SOLO_SEEDS = 4  # seeds with one of the fastest devices alone
PROGRESS_EVERY_S = 2.0  # progress lines on stderr for long runs
NONE = -1
POLISH_EVALS = 1500  # fitness evaluations of the final local search

if not hasattr(creator, "MeshFitness"):
    creator.create("MeshFitness", base.Fitness, weights=(1.0,))
    creator.create("MeshIndividual", list, fitness=creator.MeshFitness)


@dataclass(frozen=True)
class Grouping:
    groups: tuple[tuple[int, ...], ...]  # member indices of each usable replica
    roles: tuple[str, ...]  # "prefill" | "decode" per replica
    evals: tuple[ReplicaEval, ...]
    fitness: float  # sustainable requests/s


def assign_roles(rates: Sequence[tuple[float, float]], forced: Sequence[str | None]) -> tuple[float, list[str]]:
    """(prefill req/s, decode req/s) per replica -> (min(prefill, decode) capacity, roles)."""
    if len(rates) == 1 and forced[0] is None:
        return 0.0, ["decode"]  # caller uses the mixed capacity
    fixed_p = sum(p for (p, _), f in zip(rates, forced, strict=True) if f == "prefill")
    fixed_d = sum(d for (_, d), f in zip(rates, forced, strict=True) if f == "decode")
    free = sorted((i for i, f in enumerate(forced) if f is None),
                  key=lambda i: (-rates[i][0] / max(rates[i][1], 1e-12), i))
    best, best_m = -1.0, 0
    for m in range(len(free) + 1):
        p = fixed_p + sum(rates[i][0] for i in free[:m])
        d = fixed_d + sum(rates[i][1] for i in free[m:])
        if min(p, d) > best:
            best, best_m = min(p, d), m
    roles = [f or "decode" for f in forced]
    for i in free[:best_m]:
        roles[i] = "prefill"
    return best, roles


class Evaluator:
    """Scores chromosomes; caches replica evaluations by member-key multiset."""

    def __init__(self, mc: ModelCosts, members: Sequence[Member], net: Net, mix: Mix,
                 forced: Sequence[str | None]):
        self.mc, self.members, self.net, self.mix = mc, list(members), net, mix
        self.forced = list(forced)  # per member: "prefill" / "decode" if its roles allow only that
        self.cache: dict[tuple, ReplicaEval] = {}
        self.splitters = (Splitter(mc, net, mix.prefill_wp()), Splitter(mc, net, mix.decode_wp()))
        ranked = sorted(range(len(self.members)), key=lambda i: (self.members[i].key, i))
        self.rank = [0] * len(self.members)
        for r, i in enumerate(ranked):
            self.rank[i] = r
        kinds = {k: n for n, k in enumerate(sorted({m.key for m in self.members}))}
        self.kind = [kinds[m.key] for m in self.members]  # small int per interchangeable class

    def replica(self, idx: Sequence[int]) -> tuple[tuple[int, ...], ReplicaEval]:
        """(member indices in the evaluation's canonical order, evaluation)."""
        canon = tuple(sorted(idx, key=self.rank.__getitem__))
        key = tuple(self.kind[i] for i in canon)
        ev = self.cache.get(key)
        if ev is None:
            ev = evaluate_replica(self.mc, [self.members[i] for i in canon], self.net, self.mix, self.splitters)
            self.cache[key] = ev
        return canon, ev

    def group_role(self, idx: Sequence[int]) -> str | None | bool:
        want = {self.forced[i] for i in idx} - {None}
        return False if len(want) > 1 else (want.pop() if want else None)

    def decode(self, genes: Sequence[int]) -> Grouping:
        by_label: dict[int, list[int]] = {}
        for i, g in enumerate(genes):
            if g != NONE:
                by_label.setdefault(g, []).append(i)
        groups, evals, forced = [], [], []
        for label in sorted(by_label):
            canon, ev = self.replica(by_label[label])
            role = self.group_role(canon)
            if ev.ok and role is not False:
                groups.append(canon)
                evals.append(ev)
                forced.append(role)
        if not groups:
            return Grouping((), (), (), 0.0)
        fit, roles = assign_roles([(e.prefill_req_s, e.decode_req_s) for e in evals], forced)
        if len(groups) == 1 and forced[0] is None:
            fit = mixed_req_s(evals[0])
        return Grouping(tuple(groups), tuple(roles), tuple(evals), fit)

    def fitness(self, genes: Sequence[int]) -> float:
        return self.decode(genes).fitness


def pack(ev: Evaluator, order: Sequence[int], slack: float) -> list[int]:
    """Greedy seed: walk `order`, closing a replica once its memory reaches slack x the model's."""
    need = (ev.mc.weight_bytes + ev.mc.n_layers * ev.mix.kv_tokens * ev.mc.kv_bytes_per_token) * slack
    genes, label, acc = [NONE] * len(ev.members), 0, 0.0
    for i in order:
        genes[i] = label
        acc += ev.members[i].device.memory_bytes
        if acc >= need:
            label, acc = label + 1, 0.0
    if acc:  # the last, incomplete replica
        genes = [NONE if g == label else g for g in genes]
    return genes


def seed_population(ev: Evaluator, rng: random.Random, size: int) -> list[list[int]]:
    n = len(ev.members)
    orders = [sorted(range(n), key=lambda i: -ev.members[i].device.memory_gb),
              sorted(range(n), key=lambda i: -ev.members[i].device.compute_tflops),
              sorted(range(n), key=lambda i: (ev.members[i].key, i))]
    seeds = [pack(ev, o, s) for o in orders for s in PACK_SLACK] + [[0] * n]
    for i in orders[1][:SOLO_SEEDS]:  # the fastest devices alone: one mixed replica may win
        seeds.append([0 if j == i else NONE for j in range(n)])
    while len(seeds) < size:
        order = list(range(n))
        rng.shuffle(order)
        seeds.append(pack(ev, order, rng.choice(PACK_SLACK)))
    return seeds[:size]


def mutate(genes: list[int], max_label: int) -> tuple[list[int]]:
    """Move genes (at least one) to another replica, a fresh one or none; sometimes merge two."""
    labels = sorted(set(genes) - {NONE})
    fresh = next((x for x in range(max_label) if x not in labels), NONE)
    picks = [i for i in range(len(genes)) if random.random() < GENE_PROB] or [random.randrange(len(genes))]
    for i in picks:
        genes[i] = random.choice(labels + [fresh, NONE]) if labels else fresh
    if len(labels) >= 2 and random.random() < 0.2:  # merge two replicas
        a, b = random.sample(labels, 2)
        genes[:] = [a if g == b else g for g in genes]
    elif len(labels) >= 2 and random.random() < 0.1:  # dissolve one replica
        a = random.choice(labels)
        genes[:] = [NONE if g == a else g for g in genes]
    return (genes,)


def neighbours(genes: list[int]):
    """Single-gene moves (to another replica, a fresh one, none), then swaps of two genes."""
    labels = sorted(set(genes) - {NONE})
    fresh = next((x for x in range(len(genes)) if x not in labels), NONE)
    for i in range(len(genes)):
        for g in labels + [fresh, NONE]:
            if g != genes[i]:
                yield ((i, g),)
    for i, j in itertools.combinations(range(len(genes)), 2):
        if genes[i] != genes[j]:
            yield ((i, genes[j]), (j, genes[i]))


def polish(ev: Evaluator, genes: list[int], max_evals: int = POLISH_EVALS) -> tuple[list[int], float]:
    """First-improvement local search over `neighbours` (bounded), applied to the GA's best."""
    best = ev.fitness(genes)
    evals, improved = 0, True
    while improved and evals < max_evals:
        improved = False
        for move in neighbours(genes):
            if evals >= max_evals:
                break
            old = [(i, genes[i]) for i, _ in move]
            for i, g in move:
                genes[i] = g
            evals += 1
            f = ev.fitness(genes)
            if f > best * (1 + 1e-9):
                best, improved = f, True
                break
            for i, g in old:
                genes[i] = g
    return genes, best


def evolve(ev: Evaluator, seed: int = 0, pop_size: int | None = None, generations: int = MAX_GENERATIONS,
           log: bool = True) -> Grouping:
    """Run the GA; returns the best grouping found (deterministic for `seed`)."""
    n = len(ev.members)
    if n == 0:
        return Grouping((), (), (), 0.0)
    pop_size = pop_size or (POP_SMALL if n <= SMALL_CLUSTER else POP_SIZE)
    state = random.getstate()
    random.seed(seed)
    try:
        return _evolve(ev, random.Random(seed), pop_size, generations, log)
    finally:
        random.setstate(state)


def _evolve(ev: Evaluator, rng: random.Random, pop_size: int, generations: int, log: bool) -> Grouping:
    pop = [creator.MeshIndividual(g) for g in seed_population(ev, rng, pop_size)]
    for ind in pop:
        ind.fitness.values = (ev.fitness(ind),)
    best, stall, t0, last_log = tools.selBest(pop, 1)[0].fitness.values[0], 0, time.monotonic(), time.monotonic()
    for gen in range(generations):
        off = [creator.MeshIndividual(x) for x in tools.selTournament(pop, len(pop) - ELITE, tournsize=3)]
        for a, b in zip(off[::2], off[1::2]):
            if random.random() < CX_PROB:
                tools.cxTwoPoint(a, b)
        for ind in off:
            if random.random() < MUT_PROB:
                mutate(ind, len(ev.members))
            ind.fitness.values = (ev.fitness(ind),)
        pop = tools.selBest(pop, ELITE) + off
        top = tools.selBest(pop, 1)[0].fitness.values[0]
        stall = 0 if top > best * (1 + 1e-9) else stall + 1
        best = max(best, top)
        if log and time.monotonic() - last_log > PROGRESS_EVERY_S:
            last_log = time.monotonic()
            print(f"planner: generation {gen}, best {best:.3f} req/s, {len(ev.cache)} replica shapes, "
                  f"{last_log - t0:.1f} s", file=sys.stderr)
        if stall >= STALL_GENERATIONS:
            break
    best_genes = max(single_replica_variants(list(tools.selBest(pop, 1)[0])), key=ev.fitness)
    genes, _ = polish(ev, best_genes)
    return ev.decode(genes)


def single_replica_variants(genes: list[int]) -> list[list[int]]:
    """`genes` and, for each of its replicas, that replica alone: a lone replica serves both
    phases without KV shipping, a step the GA's small moves rarely take."""
    out = [genes]
    for label in sorted(set(genes) - {NONE}):
        out.append([g if g == label else NONE for g in genes])
    return out


def random_genes(rng: random.Random, n: int) -> list[int]:
    """A random grouping: a random number of replicas, each device in one of them or none."""
    r = rng.randint(1, max(1, n))
    return [rng.randrange(-1, r) for _ in range(n)]


def all_groupings(n: int):
    """Every grouping of n devices (set partitions, plus 'none'), as gene lists; for tests."""
    def rec(i: int, genes: list[int], used: int):
        if i == n:
            yield list(genes)
            return
        for g in itertools.chain((NONE,), range(used + 1)):
            genes.append(g)
            yield from rec(i + 1, genes, max(used, g + 1))
            genes.pop()
    yield from rec(0, [], 0)
