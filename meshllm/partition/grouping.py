"""Groupings: which devices form which replica, with which role, and what that is worth.

A grouping is a chromosome (genetic.py): one gene per stage-capable device, the index of its
replica or NONE. `Evaluator.decode` turns it into replicas (DP split and per-role rates from
replica.py, cached by the multiset of interchangeable devices) and gives them roles:

Roles (`assign_roles`): a grouping's capacity (`capacity`) is what its mixed replicas serve
plus min(prefill pool, decode pool) of the others, plus what mixed replicas gain by decoding
the prefill pool's excess: a prompt prefilled elsewhere and shipped to a mixed replica costs
it 1/decode-rate of its time instead of 1/mixed-rate (`absorbed`, the best trades first).
Replicas are ranked by prefill-rate / decode-rate; for each cut of that ranking into a
prefill and a decode pool, the replicas of the larger pool that it does not need (its
surplus) are turned mixed, the ones that give the most mixed capacity per unit of pool
capacity first, and then any whose mixed rate exceeds what the pools lose; the same cut with
every replica after it mixed (a prefill pool feeding mixed replicas) is tried too. The best
wins (tried: the best cut without mixed replicas and CUT_NEIGHBOURS cuts either side of it);
so does "all mixed" when that is better (slow ports make shipping KV cost more than it
saves). A lone replica is mixed. A replica holding a node
whose `roles:` allow only prefill (or decode) keeps that role.

A replica that could serve under MIN_REPLICA_SHARE of what the grouping's replicas could serve
in all (each at its best role's rate) is not formed (`droppable`): the router would send it
work only once every other queue held more than its own service time (hours, for a device
whose profile says it barely computes), and its devices stay free to draft. The smallest go
first, and only while those dropped add up to under that share, and only if the grouping then
keeps all but that share of its capacity (a replica that is its role's whole pool, e.g. the
one a node's `roles:` let prefill, is the grouping's bottleneck, not negligible).

Shared zone links cap a grouping's capacity (links.py). `assign_roles` rates the ports only:
where a link caps its pick (KV shipped across a slow link) and every free replica mixed
sustains more, `decode` takes every replica mixed; `options` offers the capped pick too, which
at a rate may wait less (the GA's latency phase rates both: `rated`). `Evaluator.latency` predicts the
grouping's mean wait, TTFT and e2e at a rate (latency.py), the busiest shared link an M/D/1
queue for everyone.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

from meshllm.partition.capacity import capacity, role_rates, trade_order
from meshllm.partition.cost import ModelCosts
from meshllm.partition.dp import Member, Net, Splitter
from meshllm.partition.latency import WAIT_WEIGHT, Prediction, predict
from meshllm.partition.links import LinkLoad
from meshllm.partition.queueing import md1_wait
from meshllm.partition.replica import Mix, ReplicaEval, evaluate_replica, with_free_tokens

NONE = -1
ROLES_CACHE = 100_000  # groupings whose roles and capacity an Evaluator keeps
CUT_NEIGHBOURS = 2  # cuts either side of the best pure prefill/decode cut whose surplus is turned mixed
MIN_REPLICA_SHARE = 1e-4  # of the grouping's best-role rates summed: below it, a replica is not formed


@dataclass(frozen=True)
class Grouping:
    groups: tuple[tuple[int, ...], ...]  # member indices of each usable replica
    roles: tuple[str, ...]  # "prefill" | "decode" | "mixed" per replica
    evals: tuple[ReplicaEval, ...]
    fitness: float  # sustainable requests/s (the capacity, shared zone links included)
    prediction: Prediction | None = None  # at the planned rate, when the planner made one
    link_req_s: float = math.inf  # requests/s the shared zone links let through (links.py)


def droppable(rates: Sequence[tuple[float, float, float]]) -> list[int]:
    """The replicas (by index) not to form: the smallest negligible ones, while those dropped add
    up to under MIN_REPLICA_SHARE of all the best-role rates (one by one, each under it, many
    could add up to a real share of the capacity)."""
    best = [max(r) for r in rates]
    room = MIN_REPLICA_SHARE * sum(best)
    out, acc = [], 0.0
    for k in sorted(range(len(rates)), key=lambda k: (best[k], k)):
        if acc + best[k] >= room:
            break
        acc += best[k]
        out.append(k)
    return out


def surplus_keys(rates) -> tuple[list[tuple[float, int]], list[tuple[float, int]]]:
    """Per replica, the order in which `_convert_surplus` turns a larger prefill (first list) or
    decode pool (second) mixed: the most mixed rate per rate given up first."""
    return ([(-r[2] / max(r[0], 1e-12), i) for i, r in enumerate(rates)],
            [(-r[2] / max(r[1], 1e-12), i) for i, r in enumerate(rates)])


def _convert_surplus(rates, roles: list[str], p: float, d: float, side: list[int],
                     keys: tuple[list, list]) -> float:
    """Turn replicas of the larger pool mixed while that adds capacity; returns the capacity
    (`keys`: `surplus_keys(rates)`)."""
    big = 0 if p > d else 1
    side = sorted(side, key=keys[big].__getitem__)
    mixed = 0.0
    for i in side:
        r, h = rates[i][big], rates[i][2]
        np_, nd = (p - r, d) if big == 0 else (p, d - r)
        if h + min(np_, nd) > min(p, d):
            p, d, mixed = np_, nd, mixed + h
            roles[i] = "mixed"
    return mixed + min(p, d)


def assign_roles(rates: Sequence[tuple[float, float, float]],
                 forced: Sequence[str | None]) -> tuple[float, list[str]]:
    """(prefill, decode, mixed req/s) per replica -> (capacity, roles); see the module docstring."""
    n = len(rates)
    if n == 1 and forced[0] is None:
        return rates[0][2], ["mixed"]
    if len(forced) != n:
        raise ValueError(f"{n} replicas but {len(forced)} forced roles")
    if forced.count(None) == n:  # nothing forced (the usual case): no pass over the replicas
        fixed_p = fixed_d = 0
    else:
        fixed_p = sum(r[0] for r, f in zip(rates, forced, strict=True) if f == "prefill")
        fixed_d = sum(r[1] for r, f in zip(rates, forced, strict=True) if f == "decode")
    free = sorted((i for i in range(n) if forced[i] is None), key=lambda i: (-rates[i][0] / max(rates[i][1], 1e-12), i))
    trades = trade_order(rates)
    base = [f or "decode" for f in forced]
    every_mixed = [r if forced[i] else "mixed" for i, r in enumerate(base)]
    best = (capacity(rates, every_mixed, trades)[0], every_mixed)
    pre_sum = [0.0]
    for i in free:
        pre_sum.append(pre_sum[-1] + rates[i][0])
    dec_sum = [0.0]
    for i in reversed(free):
        dec_sum.append(dec_sum[-1] + rates[i][1])
    pools = [(fixed_p + pre_sum[m], fixed_d + dec_sum[len(free) - m]) for m in range(len(free) + 1)]
    top = max(range(len(pools)), key=lambda m: (min(pools[m]), -m))
    keys = surplus_keys(rates)
    for m in range(max(0, top - CUT_NEIGHBOURS), min(len(pools), top + CUT_NEIGHBOURS + 1)):
        p, d = pools[m]
        if p <= 0 or d <= 0:
            continue
        roles = list(base)
        for i in free[:m]:
            roles[i] = "prefill"
        feeding = list(roles)  # the same prefill pool feeding mixed replicas instead of a decode pool
        for i in free[m:]:
            feeding[i] = "mixed"
        _convert_surplus(rates, roles, p, d, free[:m] if p > d else free[m:], keys)
        for option in (roles, feeding):
            cap = capacity(rates, option, trades)[0]
            if cap > best[0] * (1 + 1e-12):
                best = (cap, option)
    return best


class Evaluator:
    """Scores chromosomes; caches replica evaluations by member-key multiset."""

    def __init__(self, mc: ModelCosts, members: Sequence[Member], net: Net, mix: Mix,
                 forced: Sequence[str | None], cs2: tuple[float, float] = (0.0, 0.0)):
        self.mc, self.members, self.net, self.mix = mc, list(members), net, mix
        self.forced = list(forced)  # per member: "prefill" / "decode" if its roles allow only that
        self.cs2 = cs2  # squared coefficients of variation of the input and output lengths
        self.cache: dict[tuple, ReplicaEval] = {}
        self.free_cache: dict[tuple, ReplicaEval] = {}
        self.links = LinkLoad(mc, self.members, net, mix)
        self.splitters = (Splitter(mc, net, mix.prefill_wp()), Splitter(mc, net, mix.decode_wp()))
        ranked = sorted(range(len(self.members)), key=lambda i: (self.members[i].key, i))
        self.rank = [0] * len(self.members)
        for r, i in enumerate(ranked):
            self.rank[i] = r
        self.by_rank = ranked  # member indices in canonical order
        # a chromosome's labels in canonical order, in one C call (a tuple even for one member)
        self.labels_by_rank = operator.itemgetter(*ranked) if len(ranked) > 1 else \
            (lambda genes: tuple(genes[i] for i in ranked))
        kinds = {k: n for n, k in enumerate(sorted({m.key for m in self.members}))}
        self.kind = [kinds[m.key] for m in self.members]  # small int per interchangeable class
        self.any_forced = any(f is not None for f in self.forced)
        # (replica kind tuples, forced roles) -> (roles, capacity, link bound): a grouping's roles and
        # capacity depend on its replicas' evaluations only, and those on the kinds
        self.roles_cache: dict[tuple, tuple[tuple[str, ...], float, float]] = {}
        # member indices (canonical) -> (kind key, evaluation, its role rates): a chromosome's
        # replicas mostly recur unchanged from its parents'
        self.by_canon: dict[tuple[int, ...], tuple[tuple[int, ...], ReplicaEval, tuple[float, float, float]]] = {}

    def replica(self, idx: Sequence[int]) -> tuple[tuple[int, ...], ReplicaEval]:
        """(member indices in the evaluation's canonical order, evaluation)."""
        canon = tuple(sorted(idx, key=self.rank.__getitem__))
        return canon, self.evaluation(canon)[1]

    def evaluation(self, canon: tuple[int, ...]) -> tuple[tuple[int, ...], ReplicaEval]:
        """(kind key, evaluation) of the replica of `canon` (member indices in canonical order)."""
        key = tuple(map(self.kind.__getitem__, canon))
        ev = self.cache.get(key)
        if ev is None:
            ev = evaluate_replica(self.mc, [self.members[i] for i in canon], self.net, self.mix, self.splitters)
            self.cache[key] = ev
        return key, ev

    def group_role(self, idx: Sequence[int]) -> str | None | bool:
        want = {self.forced[i] for i in idx} - {None}
        return False if len(want) > 1 else (want.pop() if want else None)

    def decode(self, genes: Sequence[int]) -> Grouping:
        """The grouping of a chromosome, its roles chosen for capacity."""
        return self.options(genes)[0]

    def options(self, genes: Sequence[int]) -> tuple[Grouping, ...]:
        """The grouping of a chromosome under each role assignment worth asking about at a rate:
        `decode`'s first (`assigned`)."""
        labels = self.labels_by_rank(genes)
        # positions by label, a stable sort: each replica's members come out in canonical order
        by_label = itertools.groupby(sorted(range(len(labels)), key=labels.__getitem__), key=labels.__getitem__)
        groups, evals, forced, keys, rates = [], [], [], [], []
        for label, pos in by_label:
            if label == NONE:
                continue
            canon = tuple(map(self.by_rank.__getitem__, pos))
            got = self.by_canon.get(canon)
            if got is None:
                if len(self.by_canon) >= ROLES_CACHE:
                    self.by_canon.clear()
                key, ev = self.evaluation(canon)
                got = self.by_canon[canon] = (key, ev, role_rates((ev,))[0])
            key, ev, rate = got
            role = self.group_role(canon) if self.any_forced else None
            if ev.ok and role is not False:
                groups.append(canon)
                evals.append(ev)
                forced.append(role)
                keys.append(key)
                rates.append(rate)
        if not groups:
            return (Grouping((), (), (), 0.0),)
        g = self.assigned(groups, evals, forced, keys, rates)
        drop = set(droppable(rates)) if len(groups) > 1 else set()
        if drop:
            kept = [k for k in range(len(groups)) if k not in drop]
            h = self.assigned(*([xs[k] for k in kept] for xs in (groups, evals, forced, keys, rates)))
            if h[0].fitness >= g[0].fitness * (1 - MIN_REPLICA_SHARE):
                return h
        return g

    def rated(self, genes: Sequence[int], rate: float, floor: float) -> tuple[tuple[float, float], Grouping]:
        """The latency phase's score of a chromosome, (min(capacity, floor), -predicted cost at
        `rate`, or -inf below the floor or at or above capacity), compared lexicographically, and
        the option of `options` that scores best (the first of equals)."""
        best = None
        for g in self.options(genes):
            if g.fitness < floor or rate >= g.fitness:
                score = (min(g.fitness, floor), -math.inf)
            else:
                score = (floor, -self.latency(g, rate).cost(WAIT_WEIGHT))
            if best is None or score > best[0]:
                best = (score, g)
        return best

    def assigned(self, groups, evals, forced, keys, rates) -> tuple[Grouping, ...]:
        """The grouping of these replicas (decode's lists) under the roles `assign_roles` picks,
        capacity first (cached). `assign_roles` rates the ports only: where a shared zone link
        caps its pick (KV shipped across a slow link) and every free replica mixed sustains more,
        that comes first, and the pick second (at a rate it may still wait less)."""
        sig = (tuple(keys), tuple(forced))
        got = self.roles_cache.get(sig)
        if got is None:
            fit, roles = assign_roles(rates, forced)
            opts = [self.with_links(Grouping(tuple(groups), tuple(roles), tuple(evals), fit), rates)]
            if opts[0].fitness < fit and any(r != "mixed" and f is None for r, f in zip(roles, forced, strict=True)) \
                    and all(e.mixed is not None for e, f in zip(evals, forced, strict=True) if f is None):
                every_mixed = tuple(f or "mixed" for f in forced)
                alt = self.with_links(Grouping(tuple(groups), every_mixed, tuple(evals),
                                               capacity(rates, every_mixed)[0]), rates)
                if alt.fitness > opts[0].fitness * (1 + 1e-12):
                    opts.insert(0, alt)
            if len(self.roles_cache) >= ROLES_CACHE:
                self.roles_cache.clear()
            got = self.roles_cache[sig] = tuple((g.roles, g.fitness, g.link_req_s) for g in opts)
        return tuple(Grouping(tuple(groups), roles, tuple(evals), fit, None, link) for roles, fit, link in got)

    def formed(self, g: Grouping) -> Grouping:
        """`g` (roles given, e.g. a baseline's) without the replicas `decode` would not form."""
        if len(g.groups) < 2:
            return g
        rates = role_rates(g.evals)
        drop = set(droppable(rates))
        if not drop:
            return g
        kept = [k for k in range(len(g.groups)) if k not in drop]
        roles = tuple(g.roles[k] for k in kept)
        h = self.with_links(Grouping(tuple(g.groups[k] for k in kept), roles, tuple(g.evals[k] for k in kept),
                                     capacity([rates[k] for k in kept], roles)[0]))
        return h if h.fitness >= g.fitness * (1 - MIN_REPLICA_SHARE) else g

    def with_links(self, g: Grouping, rates: Sequence[tuple[float, float, float]] | None = None) -> Grouping:
        """`g` with its capacity capped by the shared zone links (a no-op without such links;
        `rates`: `role_rates(g.evals)`, if already listed)."""
        if not self.links.active or not g.groups:
            return g
        cap, cap_pd, ship = capacity(role_rates(g.evals) if rates is None else rates, g.roles)
        bound = self.links.bound(g.evals, g.roles, cap_pd, cap, ship)
        return Grouping(g.groups, g.roles, g.evals, min(g.fitness, bound), g.prediction, bound)

    def fitness(self, genes: Sequence[int]) -> float:
        """Capacity in requests/s."""
        return self.decode(genes).fitness

    def latency(self, g: Grouping, rate: float) -> Prediction:
        pred = predict([self.completed(e) for e in g.evals], g.roles, rate, self.mix, *self.cs2)
        if math.isfinite(g.link_req_s):  # the busiest shared link as one more queue for everyone
            extra = md1_wait(rate, 1.0 / g.link_req_s) if rate < g.link_req_s else math.inf
            pred = Prediction(pred.wait_s + extra, pred.ttft_s, pred.e2e_s + extra, min(pred.capacity_req_s,
                              g.link_req_s), rate)
        return pred

    def completed(self, ev: ReplicaEval) -> ReplicaEval:
        """`ev` with what only the latency estimate needs (replica.with_free_tokens: the decode step
        at batch 1, the mixed fit's free prompt tokens), once per replica and split."""
        # the splits too: the judge's variants of a replica (`on_prefill_split`) share its members
        key = (tuple(m.key for m in ev.members), ev.decode and ev.decode.split, ev.mixed and ev.mixed.split)
        got = self.free_cache.get(key)
        if got is None:
            got = self.free_cache[key] = with_free_tokens(self.mc, ev, self.net, self.mix)
        return got


def pack(ev: Evaluator, order: Sequence[int], slack: float) -> list[int]:
    """Greedy packing: walk `order`, closing a replica once its memory reaches slack x the model's."""
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


def type_order(ev: Evaluator) -> list[int]:
    """Devices grouped by type (interchangeable members together), fastest types first."""
    return sorted(range(len(ev.members)), key=lambda i: (-ev.members[i].device.compute_tflops, ev.members[i].key, i))


def type_genes(ev: Evaluator, slack: float = 1.05) -> list[int]:
    """Replicas of one device type each (how an operator groups machines), packed per type; the
    devices of a type left over join its replicas in turn (they then hold more KV)."""
    genes, label = [NONE] * len(ev.members), 0
    for kind in sorted(set(ev.kind)):
        idx = [i for i in range(len(ev.members)) if ev.kind[i] == kind]
        part = pack(ev, idx, slack)
        used = sorted({part[i] for i in idx if part[i] != NONE})
        rest = [i for i in idx if part[i] == NONE]
        for i in idx:
            if part[i] != NONE:
                genes[i] = label + used.index(part[i])
        for j, i in enumerate(rest if used else []):
            genes[i] = label + j % len(used)
        label += len(used)
    return genes


def all_mixed(ev: Evaluator, g: Grouping) -> Grouping | None:
    """The same replicas, every one mixed (None if one cannot be: no mixed fit, or a node's
    `roles:` allow it one phase only; the judge took such a plan on demo.yaml, every replica
    mixed against the node files, while the baselines kept them)."""
    if not g.groups or any(e.mixed is None for e in g.evals):
        return None
    if ev.any_forced and any(ev.group_role(canon) is not None for canon in g.groups):
        return None
    return ev.with_links(Grouping(g.groups, ("mixed",) * len(g.groups), g.evals, sum(e.mixed_req_s for e in g.evals)))


def greedy_genes(ev: Evaluator, slack: float = 1.05) -> list[int]:
    """The no-search baseline: type-ordered packing (what the GA's gain is measured against)."""
    return pack(ev, type_order(ev), slack)
