"""Replica grouping by a genetic algorithm (deap), with prefill / decode / mixed roles (E2LLM, seed 003).

Chromosome: one gene per eligible device, the index of its replica or NONE (grouping.py turns
it into replicas with roles and a capacity). Two phases, one deap loop:
1. capacity: fitness = the request rate the grouping sustains (mixed replicas + min(prefill
   pool, decode pool), each replica's rates from the DP split, compute and ports);
2. latency: from phase 1's population, fitness = (min(capacity, CAPACITY_FLOOR x the best
   capacity found), -cost) compared lexicographically, where cost = predicted e2e +
   WAIT_WEIGHT x predicted mean wait at the planned rate (latency.py): among the groupings
   that keep capacity within 3% of the best, the one whose users wait least. Without a rate,
   the planned rate is NO_RATE_LOAD x the best capacity.
Each phase ends with a bounded first-improvement local search (single-gene moves and swaps) of
its best individual; phase 1 also tries each replica of its best alone (a lone replica is mixed).
Last, every device left out that would add capacity joins where it adds the most, unless that
raises the predicted cost by more than FILL_COST_SLACK, and the devices still left out form new
replicas together, zone by zone, where that adds capacity on the same terms (`fill_unused`);
plan.py says why each device still left out is (unused.py).

Search: the population is seeded with greedy packings (devices by memory, compute or type,
closing a replica at 1.05 / 1.5 / 2.5 x the model's memory), the whole cluster as one
replica and the fastest devices alone; tournament selection, two-point crossover and a
mutation that moves genes, merges or dissolves replicas; elitism; a phase stops after its
stall limit. Replica evaluations are cached by the multiset of (device profile, zone), since
members with the same key are interchangeable; this is what makes 200-device clusters
plannable in seconds. Deterministic for a seed: deap draws from the global `random`, which is
seeded here and restored afterwards.
"""

from __future__ import annotations

import itertools
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from deap import base, creator, tools

from meshllm.partition.grouping import NONE, Evaluator, Grouping, all_mixed, pack, type_genes, type_order
from meshllm.partition.latency import WAIT_WEIGHT

POP_SIZE = 40
POP_SMALL, SMALL_CLUSTER = 80, 40  # larger population for clusters of <= 40 devices (cheap)
MAX_GENERATIONS = 150
STALL_GENERATIONS = 30  # phase 1 stops after this many generations without improvement
LATENCY_GENERATIONS, LATENCY_STALL = 60, 15  # phase 2
CX_PROB, MUT_PROB, GENE_PROB = 0.5, 0.6, 0.05
ELITE = 2
PACK_SLACK = (1.05, 1.5, 2.5)  # replica memory / model memory targets of the greedy seeds
SOLO_SEEDS = 4  # seeds with one of the fastest devices alone
PROGRESS_EVERY_S = 2.0  # progress lines on stderr for long runs
POLISH_EVALS = 1500  # fitness evaluations of each final local search
CAPACITY_FLOOR = 0.97  # phase 2 keeps capacity >= this x the best capacity found
NO_RATE_LOAD = 0.7  # without a workload rate, plan for this fraction of the best capacity
RUNNERS_UP = 1  # latency-phase individuals offered to a judge besides its pick
FILL_COST_SLACK = 0.01  # a device that adds capacity joins unless the predicted cost rises more than this

if not hasattr(creator, "MeshFitness2"):
    creator.create("MeshFitness2", base.Fitness, weights=(1.0, 1.0))
    creator.create("MeshIndividual2", list, fitness=creator.MeshFitness2)

Score = Callable[[Sequence[int]], tuple[float, float]]


def seed_population(ev: Evaluator, rng: random.Random, size: int) -> list[list[int]]:
    n = len(ev.members)
    orders = [sorted(range(n), key=lambda i: -ev.members[i].device.memory_gb),
              sorted(range(n), key=lambda i: -ev.members[i].device.compute_tflops),
              sorted(range(n), key=lambda i: (ev.members[i].key, i))]
    seeds = [pack(ev, o, s) for o in orders for s in PACK_SLACK] + [[0] * n, type_genes(ev)]
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


def better(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Lexicographic, with a relative tolerance so float noise is no improvement."""
    if a[0] > b[0] * (1 + 1e-9) + 1e-12:
        return True
    return a[0] >= b[0] * (1 - 1e-9) and a[1] > b[1] + 1e-9 * abs(b[1]) + 1e-12


def polish(score: Score, genes: list[int], max_evals: int = POLISH_EVALS) -> tuple[list[int], tuple]:
    """First-improvement local search over `neighbours` (bounded), applied to a phase's best."""
    best = score(genes)
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
            f = score(genes)
            if better(f, best):
                best, improved = f, True
                break
            for i, g in old:
                genes[i] = g
    return genes, best


class Memo:
    """A score with a cache: the GA revisits the same chromosomes often."""

    def __init__(self, fn: Score):
        self.fn, self.cache = fn, {}

    def __call__(self, genes: Sequence[int]) -> tuple[float, float]:
        key = tuple(genes)
        got = self.cache.get(key)
        if got is None:
            got = self.cache[key] = self.fn(genes)
        return got


def run_ga(score: Score, pop: list[list[int]], n_genes: int, generations: int, stall_limit: int,
           log: bool, label: str) -> list[list[int]]:
    """The deap loop: returns the final population, best first."""
    pop = [creator.MeshIndividual2(g) for g in pop]
    for ind in pop:
        ind.fitness.values = score(ind)
    best, stall, t0 = tools.selBest(pop, 1)[0].fitness.values, 0, time.monotonic()
    last_log = t0
    for gen in range(generations):
        off = [creator.MeshIndividual2(x) for x in tools.selTournament(pop, len(pop) - ELITE, tournsize=3)]
        for a, b in zip(off[::2], off[1::2]):
            if len(a) > 1 and random.random() < CX_PROB:  # two-point crossover needs two genes
                tools.cxTwoPoint(a, b)
        for ind in off:
            if random.random() < MUT_PROB:
                mutate(ind, n_genes)
            ind.fitness.values = score(ind)
        pop = tools.selBest(pop, ELITE) + off
        top = tools.selBest(pop, 1)[0].fitness.values
        stall = 0 if better(top, best) else stall + 1
        best = max(best, top)
        if log and time.monotonic() - last_log > PROGRESS_EVERY_S:
            last_log = time.monotonic()
            print(f"planner: {label} generation {gen}, best {best[0]:.3f}, {best[1]:.3f}, "
                  f"{last_log - t0:.1f} s", file=sys.stderr)
        if stall >= stall_limit:
            break
    return [list(x) for x in tools.selBest(pop, len(pop))]


def capacity_score(ev: Evaluator) -> Memo:
    return Memo(lambda genes: (ev.fitness(genes), 0.0))


def latency_score(ev: Evaluator, rate: float, floor: float) -> Memo:
    return Memo(lambda genes: ev.rated(genes, rate, floor)[0])


def seeded(seed: int, fn: Callable[[random.Random], Grouping]) -> Grouping:
    """Run `fn` with the global RNG (deap's) seeded, restoring it afterwards."""
    state = random.getstate()
    random.seed(seed)
    try:
        return fn(random.Random(seed))
    finally:
        random.setstate(state)


def evolve(ev: Evaluator, seed: int = 0, pop_size: int | None = None, generations: int = MAX_GENERATIONS,
           log: bool = True) -> Grouping:
    """Phase 1 only: the grouping of highest capacity found (deterministic for `seed`)."""
    if not ev.members:
        return Grouping((), (), (), 0.0)
    return seeded(seed, lambda rng: ev.decode(_capacity_phase(ev, rng, pop_size, generations, log)[0][0]))


def _capacity_phase(ev: Evaluator, rng: random.Random, pop_size: int | None, generations: int,
                    log: bool) -> tuple[list[list[int]], float]:
    n = len(ev.members)
    size = pop_size or (POP_SMALL if n <= SMALL_CLUSTER else POP_SIZE)
    score = capacity_score(ev)
    pop = run_ga(score, seed_population(ev, rng, size), n, generations, STALL_GENERATIONS, log, "capacity")
    best = max(single_replica_variants(pop[0]), key=lambda g: score(g)[0])
    best, (cap, _) = polish(score, best)
    return [best] + pop[1:], cap


@dataclass(frozen=True)
class Search:
    """What the planner's search found: its pick, the candidates a judge may choose from instead
    (the pick first), the best capacity found, the rate the latency phase planned for, and which
    candidates are the groupings an operator would run (one device type per replica)."""

    best: Grouping
    candidates: tuple[Grouping, ...]
    capacity: float
    rate: float
    standard: tuple[int, ...] = ()


def evolve_plan(ev: Evaluator, rate: float, seed: int = 0, log: bool = True) -> Search:
    """Both phases: capacity, then the lowest predicted cost at `rate` (0: NO_RATE_LOAD x capacity)
    among groupings within CAPACITY_FLOOR of the best capacity. The pick carries its prediction;
    the candidates add the capacity phase's best, the runners-up of the latency phase and the
    groupings an operator would try (one device type per replica, all mixed; greedy packing)."""
    if not ev.members:
        return Search(Grouping((), (), (), 0.0), (), 0.0, rate)

    def run(rng: random.Random) -> Search:
        pop, cap = _capacity_phase(ev, rng, None, MAX_GENERATIONS, log)
        if cap <= 0:
            return Search(ev.decode(pop[0]), (), cap, rate)
        lam = rate if rate > 0 else NO_RATE_LOAD * cap
        floor = CAPACITY_FLOOR * cap
        score = latency_score(ev, lam, floor)
        phase1 = pop[0]
        pop = run_ga(score, pop, len(ev.members), LATENCY_GENERATIONS, LATENCY_STALL, log, "latency")
        genes, _ = polish(score, pop[0])
        genes = fill_unused(ev, genes, lam, floor, log)
        ups = [g for g in pop[1:] if score(g)[0] >= score(genes)[0]][:RUNNERS_UP]
        packs = [pack(ev, type_order(ev), slack) for slack in PACK_SLACK[:2]]
        typed_genes = type_genes(ev)
        # the latency phase's picks with the roles it rated at the rate, the others' for capacity; then
        # each one's other roles (`Evaluator.options`: a judge may find the link-capped ones wait less)
        cands = ([ev.rated(genes, lam, floor)[1], ev.decode(phase1)] + [ev.rated(g, lam, floor)[1] for g in ups]
                 + [ev.decode(g) for g in packs])
        cands += [o for g in [genes, phase1, *ups, *packs, typed_genes] for o in ev.options(g)[1:]]
        typed = ev.decode(typed_genes)  # one device type per replica: what an operator runs
        standard = [typed] + [m for m in (all_mixed(ev, typed),) if m is not None]
        unique = list({(c.groups, c.roles): c for c in cands + standard if c.fitness > 0}.values())
        keys = {(c.groups, c.roles) for c in standard}
        with_pred = tuple(Grouping(c.groups, c.roles, c.evals, c.fitness, ev.latency(c, lam), c.link_req_s)
                          for c in unique)
        return Search(with_pred[0], with_pred, cap, lam,
                      tuple(i for i, c in enumerate(unique) if (c.groups, c.roles) in keys))
    return seeded(seed, run)


def fill_unused(ev: Evaluator, genes: list[int], rate: float, floor: float = 0.0, log: bool = False) -> list[int]:
    """Every device that adds capacity is used: single devices join (`fill_singles`, which may also
    complete a replica too small to be formed), then the devices still left out, and those of
    replicas still not formed (`usable`), form new replicas together where that adds capacity
    (`form_replicas`: devices that cannot hold the model alone, and add nothing to the replicas
    there are, may together be a replica), then single devices again. Each step only adds
    capacity, so the result serves at least what single moves alone reach."""
    first = fill_singles(ev, genes, rate, floor, log)
    formed = form_replicas(ev, usable(ev, first), rate, floor)
    return first if formed == first else fill_singles(ev, formed, rate, floor, log)


def usable(ev: Evaluator, genes: Sequence[int]) -> list[int]:
    """`genes` with NONE for every device whose replica is not formed (short of memory, or too
    small to matter: `Evaluator.options`), so that those devices count as left out."""
    used = {i for group in ev.decode(genes).groups for i in group}
    return [g if i in used else NONE for i, g in enumerate(genes)]


def predicted_cost(ev: Evaluator, genes: Sequence[int], rate: float, floor: float = 0.0) -> float:
    """The predicted cost at `rate`, under the roles the latency phase rates best (`Evaluator.rated`)."""
    return ev.latency(ev.rated(genes, rate, floor)[1], rate).cost(WAIT_WEIGHT)


def idle_packs(ev: Evaluator, genes: Sequence[int]) -> list[list[int]]:
    """New replicas worth trying from the devices outside the replicas: per zone, and over all zones
    (the last), the idle devices in order of compute or of memory, greedily packed to PACK_SLACK x
    the model's memory (`pack`, its first replica); each a list of member indices, no two equal.
    Where nodes' `roles:` allow one phase only, a pack holds the prefill-only or the decode-only
    ones, never both (such a replica cannot be formed)."""
    idle = [i for i, g in enumerate(genes) if g == NONE]
    zones = sorted({ev.members[i].zone for i in idle})
    keys = (lambda i: (-ev.members[i].device.compute_tflops, i), lambda i: (-ev.members[i].device.memory_gb, i))
    phases = sorted({ev.forced[i] for i in idle} - {None}) or [None]
    out: dict[tuple[int, ...], None] = {}
    for zone, phase in itertools.product([*zones, None] if len(zones) > 1 else zones, phases):
        pool = [i for i in idle if (zone is None or ev.members[i].zone == zone) and ev.forced[i] in (None, phase)]
        for key in keys:
            order = sorted(pool, key=key)
            for slack in PACK_SLACK:
                group = tuple(i for i, p in enumerate(pack(ev, order, slack)) if p == 0)
                if group:
                    out.setdefault(group)
    return [list(g) for g in out]


def form_replicas(ev: Evaluator, genes: list[int], rate: float, floor: float = 0.0) -> list[int]:
    """Replicas formed from the devices outside the replicas (`idle_packs`), one at a time, the one
    that adds the most capacity first, among those that do not raise the predicted cost at `rate`
    by more than FILL_COST_SLACK; until none adds capacity."""
    genes = list(genes)
    while True:
        cap0, cost0 = ev.fitness(genes), predicted_cost(ev, genes, rate, floor)
        fresh = max(genes, default=NONE) + 1
        trials = []
        for group in idle_packs(ev, genes):
            trial = list(genes)
            for i in group:
                trial[i] = fresh
            trials.append((ev.fitness(trial), trial))
        for cap, trial in sorted(trials, key=lambda t: -t[0]):
            if cap <= cap0 * (1 + 1e-6):
                return genes
            if predicted_cost(ev, trial, rate, floor) <= cost0 * (1 + FILL_COST_SLACK):
                genes = trial
                break
        else:
            return genes


def fill_singles(ev: Evaluator, genes: list[int], rate: float, floor: float = 0.0, log: bool = False) -> list[int]:
    """Each device outside the replicas, fastest first, takes the move (into a replica, or alone)
    that adds the most capacity among those that do not raise the predicted cost at `rate` by
    more than FILL_COST_SLACK (each grouping's roles as the latency phase rates them,
    `Evaluator.rated` at `floor`). Its work grows with left-out devices x replicas: with `log`, a
    progress line every PROGRESS_EVERY_S (a 1000-device cluster spends minutes here)."""
    genes = list(genes)
    left = [i for i in sorted(range(len(genes)), key=lambda i: -ev.members[i].device.compute_tflops)
            if genes[i] == NONE]
    t0 = last = time.monotonic()
    for k, i in enumerate(left):
        if log and time.monotonic() - last > PROGRESS_EVERY_S:
            last = time.monotonic()
            print(f"planner: placing left-out devices, {k}/{len(left)} tried, {last - t0:.1f} s", file=sys.stderr)
        g0 = ev.decode(genes)
        cost0 = predicted_cost(ev, genes, rate, floor)
        labels = sorted(set(genes) - {NONE})
        fresh = next(x for x in range(len(genes) + 1) if x not in labels)
        moves = sorted(((ev.fitness(genes[:i] + [g] + genes[i + 1:]), g) for g in labels + [fresh]), reverse=True)
        for cap, g in moves:
            if cap <= g0.fitness * (1 + 1e-6):
                break
            trial = genes[:i] + [g] + genes[i + 1:]
            if predicted_cost(ev, trial, rate, floor) <= cost0 * (1 + FILL_COST_SLACK):
                genes = trial
                break
    return genes


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
