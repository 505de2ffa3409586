"""Replicas as the simulator sees them: stages, vectorised timing from the cost model, and the
four policies' plans (`meshllm`, `splitwise`, `memory-ring`, `random`) built on one footing.

Policies (issue 4):
- meshllm: the planner (GA grouping + DP split + max-min roles).
- splitwise: replicas per device type - the fewest same-type devices that hold the model with
  an even layer split, as many replicas per type as the devices allow; the type with the most
  compute per replica prefills, the others decode. With a single type, its replicas get the
  same max-min role rule as meshllm (Splitwise splits one machine pool into two).
- memory-ring: exo-style, every stage-capable device in one pipeline (file order), layers
  proportional to memory, prefill and decode mixed on the one replica.
- random: a random grouping (seeded) + DP + the same role rule.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from meshllm.partition.cost import bytes_per_s, flops_per_s, path_mbps
from meshllm.partition.dp import Member, memory_cap_layers
from meshllm.partition.genetic import Evaluator, Grouping, assign_roles, random_genes
from meshllm.partition.inputs import PlanInputs
from meshllm.partition.plan import Plan
from meshllm.partition.replica import MAX_DECODE_BATCH

RANDOM_TRIES = 100  # random groupings drawn until one has a usable replica


@dataclass
class SimReplica:
    """One replica: members in pipeline order with their layer counts; timing is vectorised."""

    id: int
    role: str  # "prefill" | "decode" | "mixed"
    members: tuple[Member, ...]
    counts: tuple[int, ...]
    inp: PlanInputs
    arrays: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        mc, k = self.inp.mc, len(self.members)
        n = np.array(self.counts, dtype=float)
        last = np.zeros(k)
        last[-1] = 1.0
        first = np.zeros(k)
        first[0] = 1.0
        hop_rtt, hop_mbps = [], []
        for a, b in zip(self.members, self.members[1:] + self.members[:1]):
            rtt, mbps = self.inp.net.rtt_mbps(a.zone, b.zone)
            hop_rtt.append(rtt / 2000.0)
            hop_mbps.append(path_mbps(a.device, b.device, mbps))
        self.arrays = dict(
            n=n, last=last, flops=np.array([flops_per_s(m.device) for m in self.members]),
            bw=np.array([bytes_per_s(m.device) for m in self.members]),
            weights=n * mc.layer_bytes + first * mc.embed_bytes + last * mc.head_bytes,
            mem=np.array([m.device.memory_bytes for m in self.members]),
            hop_s=np.array(hop_rtt), hop_bps=np.array(hop_mbps) * 1e6 / 8,
            ranges=[(int(e - c), int(e)) for c, e in zip(self.counts, np.cumsum(self.counts))])

    @property
    def ids(self) -> list[str]:
        return [m.id for m in self.members]

    def ranges(self) -> list[tuple[int, int]]:
        return self.arrays["ranges"]

    def prefill_s(self, tokens: float) -> tuple[float, float]:
        """(occupancy, latency) of one prompt: a new prompt may enter every `occupancy` seconds."""
        a, mc = self.arrays, self.inp.mc
        flops = tokens * a["n"] * (mc.layer_flops_per_token + mc.attn_flops_per_token_ctx * tokens / 2)
        flops = flops + a["last"] * mc.head_flops_per_token
        t = np.maximum(flops / a["flops"], (a["weights"] + tokens * a["n"] * mc.kv_bytes_per_token) / a["bw"])
        hops = a["hop_s"][:-1] + tokens * mc.act_bytes_per_token / a["hop_bps"][:-1]
        return float(max(t.max(), hops.max(initial=0.0))), float(t.sum() + hops.sum())

    def decode_iter_s(self, batch: int, context: float) -> float:
        """Seconds for every one of `batch` sequences to get one more token (pipelined micro-batches)."""
        a, mc = self.arrays, self.inp.mc
        micro = min(len(self.members), batch)
        b = batch / micro
        flops = b * (a["n"] * (mc.layer_flops_per_token + mc.attn_flops_per_token_ctx * context)
                     + a["last"] * mc.head_flops_per_token)
        t = np.maximum(flops / a["flops"], (a["weights"] + b * context * a["n"] * mc.kv_bytes_per_token) / a["bw"])
        hops = a["hop_s"] + b * mc.act_bytes_per_token / a["hop_bps"]
        return float(max(micro * max(t.max(), hops[:-1].max(initial=0.0)), t.sum() + hops.sum()))

    def kv_capacity_tokens(self) -> float:
        """KV tokens (whole model depth) that fit beside the weights, limited by the fullest stage."""
        a = self.arrays
        return float(((a["mem"] - a["weights"]) / (a["n"] * self.inp.mc.kv_bytes_per_token)).min())

    def max_batch(self) -> int:
        per_seq = self.inp.mix.mean_in + self.inp.mix.mean_out
        return int(max(0, min(MAX_DECODE_BATCH, self.kv_capacity_tokens() // per_seq)))


def from_plan(inp: PlanInputs, plan: Plan) -> list[SimReplica]:
    by_id = {m.id: m for m in inp.members}
    out = []
    for r in plan.replicas:
        members = tuple(by_id[s.node] for s in r.stages)
        out.append(SimReplica(r.id, r.role, members, tuple(e - s for s, e in (x.layers for x in r.stages)), inp))
    return mixed_if_alone(out)


def mixed_if_alone(reps: list[SimReplica]) -> list[SimReplica]:
    """Without a prefill replica (or a decode one), every replica serves both phases."""
    roles = {r.role for r in reps}
    if roles != {"prefill", "decode"}:
        for r in reps:
            r.role = "mixed"
    return reps


def from_grouping(inp: PlanInputs, g: Grouping) -> list[SimReplica]:
    out = []
    for rid, (canon, role, ev) in enumerate(zip(g.groups, g.roles, g.evals, strict=True)):
        fit = ev.prefill if role == "prefill" else ev.decode
        assert fit is not None
        members = tuple(inp.members[canon[i]] for i in fit.split.order)
        out.append(SimReplica(rid, role, members, fit.split.counts, inp))
    return mixed_if_alone(out)


def even_counts(n_layers: int, k: int) -> tuple[int, ...]:
    return tuple(n_layers // k + (i < n_layers % k) for i in range(k))


def fits_even(inp: PlanInputs, m: Member, k: int) -> bool:
    counts = even_counts(inp.mc.n_layers, k)
    return all(memory_cap_layers(inp.mc, m.device, i == 0, i == k - 1, inp.mix.kv_tokens) >= c
               for i, c in enumerate(counts))


def splitwise(inp: PlanInputs) -> list[SimReplica]:
    by_type: dict[str, list[Member]] = {}
    for m in inp.members:
        by_type.setdefault(m.device.name, []).append(m)
    groups: list[tuple[str, float, list[SimReplica]]] = []
    for name, ms in sorted(by_type.items()):
        k = next((k for k in range(1, min(len(ms), inp.mc.n_layers) + 1) if fits_even(inp, ms[0], k)), None)
        if k is None:
            continue
        reps = [SimReplica(0, "decode", tuple(ms[i * k:(i + 1) * k]), even_counts(inp.mc.n_layers, k), inp)
                for i in range(len(ms) // k)]
        groups.append((name, k * ms[0].device.compute_tflops, reps))
    if not groups:
        return []
    reps = [r for _, _, rs in groups for r in rs]
    if len(groups) == 1:
        _, roles = assign_roles([(prefill_rate(r), decode_rate(r)) for r in reps], [None] * len(reps))
        for r, role in zip(reps, roles):
            r.role = role
    else:
        top = max(groups, key=lambda g: (g[1], g[0]))
        for r in top[2]:
            r.role = "prefill"
    for i, r in enumerate(reps):
        r.id = i
    return mixed_if_alone(reps)


def prefill_rate(r: SimReplica) -> float:
    return 1.0 / r.prefill_s(r.inp.mix.mean_in)[0] / 1.0


def decode_rate(r: SimReplica) -> float:
    b = max(1, r.max_batch())
    return b / r.decode_iter_s(b, r.inp.mix.mean_in + r.inp.mix.mean_out / 2) / r.inp.mix.mean_out


def memory_ring(inp: PlanInputs) -> list[SimReplica]:
    members = sorted(inp.members, key=lambda m: -m.device.memory_gb)[:inp.mc.n_layers]
    members = [m for m in inp.members if m in members]  # file order
    if not members:
        return []
    mem = np.array([m.device.memory_gb for m in members])
    extra = inp.mc.n_layers - len(members)
    share = mem / mem.sum() * extra
    counts = np.floor(share).astype(int)
    for i in np.argsort(-(share - counts), kind="stable")[: extra - counts.sum()]:
        counts[i] += 1
    return [SimReplica(0, "mixed", tuple(members), tuple(int(c) + 1 for c in counts), inp)]


def random_policy(inp: PlanInputs, seed: int) -> list[SimReplica]:
    rng = random.Random(seed)
    ev = Evaluator(inp.mc, inp.members, inp.net, inp.mix, inp.forced)
    for _ in range(RANDOM_TRIES):
        g = ev.decode(random_genes(rng, len(inp.members)))
        if g.fitness > 0:
            return from_grouping(inp, g)
    return []


def describe(reps: Sequence[SimReplica]) -> str:
    return "; ".join(f"{r.role}:{'+'.join(m.device.name for m in r.members)}" for r in reps)
