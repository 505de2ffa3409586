"""Replicas as the simulator (and the router) see them: members in pipeline order, their layer
counts, and timing from the planner's own functions (partition/steps.py over cost.py; no
formula is re-derived here), cached per prompt length / (batch, context bucket) and shared by
the replicas of one shape (`PlanInputs.step_caches`).
`from_plan` builds them from a Plan, `from_grouping` from a GA grouping.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from meshllm.defaults import DECODE_TARGETS
from meshllm.partition.cost import flops_per_s, pipeline_s
from meshllm.partition.dp import Infeasible, Member
from meshllm.partition.grouping import Grouping
from meshllm.partition.inputs import PlanInputs
from meshllm.partition.plan import Plan
from meshllm.partition.replica import ReplicaEval, decode_concurrency
from meshllm.partition.steps import free_chunk_tokens, fused_step_s, prefill_batch_stage_s

CTX_BUCKET = 64  # tokens: step times are cached per context rounded to this (attention is a small term)
CHUNK_BUCKET = 16  # tokens: step times are cached at prompt chunks of multiples of this, interpolated between
MIN_CHUNK = 16  # prompt tokens per step a mixed replica prefills at least (progress on a compute-bound step)
LONE_DRAIN_STEPS = 16  # ... and at least 1/LONE_DRAIN_STEPS of a lone prompt's tokens,
DRAIN_STEPS = 4  # or 1/DRAIN_STEPS of the queued prompt tokens when more prompts wait (the backlog drains)
EVEN_STEPS_FEWER = 2  # a lone prompt's chunks: steps tried below the budget's count (lone_chunk)


@dataclass
class SimReplica:
    """One replica: members in pipeline order with their layer counts."""

    id: int
    role: str  # "prefill" | "decode" | "mixed"
    members: tuple[Member, ...]
    counts: tuple[int, ...]
    inp: PlanInputs
    cache: dict = field(init=False, repr=False, compare=False)
    plain: dict = field(init=False, repr=False, compare=False)  # decode steps alone: (batch, context bucket) -> s

    def __post_init__(self) -> None:
        # the step times depend on the members' keys (device, zone), the counts and `inp` only
        shape = (tuple(m.key for m in self.members), tuple(self.counts))
        self.cache = self.inp.step_caches.setdefault(shape, {})
        self.plain = self.cache.setdefault("plain", {})  # the simulator's commonest question, asked fast

    @property
    def ids(self) -> list[str]:
        return [m.id for m in self.members]

    def ranges(self) -> list[tuple[int, int]]:
        out, pos = [], 0
        for c in self.counts:
            out.append((pos, pos + c))
            pos += c
        return out

    def prefill_stages(self, tokens: int) -> tuple[list[float], float, float]:
        """(seconds per stage, occupancy, latency) of one prompt: a new prompt may enter every
        `occupancy` seconds, and one takes `latency` through all stages and links."""
        return self.prefill_batch((tokens,))

    def prefill_batch(self, lengths: tuple[int, ...]) -> tuple[list[float], float, float]:
        """prefill_stages of the prompts of `lengths` (sorted) prefilled together in one micro-batch."""
        key = ("p", lengths)
        got = self.cache.get(key)
        if got is None:
            stages, hops = prefill_batch_stage_s(self.inp.mc, self.members, self.counts, self.inp.net, lengths)
            got = self.cache[key] = (stages, *pipeline_s(stages, hops))
        return got

    def prefill_s(self, tokens: int) -> tuple[float, float]:
        """(occupancy, latency) of one prompt."""
        _, occ, lat = self.prefill_stages(tokens)
        return occ, lat

    def decode_iter_s(self, batch: int, context: float, chunk: int = 0, chunk_ctx: float = 0.0,
                      prompts: int = 0) -> float:
        """Seconds for every one of `batch` sequences to get one more token (pipelined
        micro-batches), with `chunk` prompt tokens riding along (mixed replicas): in the decode
        micro-batches, or, if `prompts` > 0, as that many more sequences. A chunk between two
        multiples of CHUNK_BUCKET costs the straight line between theirs (above the step time,
        which is convex in the chunk: a maximum of linear terms)."""
        if not chunk:
            key = (batch, int(context) // CTX_BUCKET)
            got = self.plain.get(key)
            if got is None:
                got = self.plain[key] = self.step_s(batch, context, 0, 0.0, 0)
            return got
        lo = chunk // CHUNK_BUCKET * CHUNK_BUCKET
        if lo == chunk:
            return self.step_s(batch, context, chunk, chunk_ctx, prompts)
        below = self.step_s(batch, context, lo, chunk_ctx, prompts)
        above = self.step_s(batch, context, lo + CHUNK_BUCKET, chunk_ctx, prompts)
        return below + (above - below) * (chunk - lo) / CHUNK_BUCKET

    def step_s(self, batch: int, context: float, chunk: int, chunk_ctx: float, prompts: int) -> float:
        """decode_iter_s at a chunk of a multiple of CHUNK_BUCKET tokens, cached."""
        prompts = prompts if chunk else 0
        key = ("d", batch, int(context) // CTX_BUCKET, chunk, int(chunk_ctx) // CTX_BUCKET if chunk else 0, prompts)
        got = self.cache.get(key)
        if got is None:
            ctx = (key[2] + 0.5) * CTX_BUCKET
            cctx = max(chunk, (key[4] + 0.5) * CTX_BUCKET) if chunk else 0.0
            got = self.cache[key] = fused_step_s(self.inp.mc, self.members, self.counts, self.inp.net, batch, ctx,
                                                 chunk, cctx, prompts)
        return got

    def head_s(self) -> float:
        """Seconds the last stage spends on the LM head for one token at its compute: what a
        prompt that ends inside a fused decode step adds to it (its first output token;
        span_work leaves the head out). At most that much: a memory-bound step may hide it."""
        got = self.cache.get("head")
        if got is None:
            got = self.cache["head"] = self.inp.mc.head_flops_per_token / flops_per_s(self.members[-1].device)
        return got

    def free_chunk(self, batch: int, context: float, prompt: int) -> int:
        """Prompt tokens that ride along a decode step of `batch` sequences (almost) for free, found
        for a prompt of the workload's mean length; at least MIN_CHUNK, at most `prompt`."""
        key = ("f", batch, int(context) // CTX_BUCKET)
        got = self.cache.get(key)
        if got is None:
            mean_in = max(1, round(self.inp.mix.mean_in))
            got = self.cache[key] = free_chunk_tokens(self.inp.mc, self.members, self.counts, self.inp.net, batch,
                                                      (key[2] + 0.5) * CTX_BUCKET, 4 * mean_in, mean_in / 2)
        return max(MIN_CHUNK, min(got, prompt))

    def chunk_tokens(self, batch: int, context: float, prompt: int, backlog: int, queued: int = 1) -> int:
        """Prompt tokens a mixed replica prefills per decode step (the simulator's policy, which
        the router predicts): what rides free, or a share of the `backlog` of queued prompt tokens
        if that is more: 1/LONE_DRAIN_STEPS of it for a lone prompt, 1/DRAIN_STEPS when `queued`
        prompts wait in all, since every step a backlog lasts then delays them all. (One share for
        both: 1/8 lowered the wait on bench-fog-40-8b but raised it at bench-edge-8b's own low
        rate, where a prompt is mostly alone. With a lone share of 1/16, a backlog share of 1/8
        waited 73.3 / 107.3 ms on bench-fog-40-8b at 50 % / 70 % of Splitwise's saturation
        (0.53x / 0.50x Splitwise's), 1/4 57.3 / 86.2 ms (0.42x / 0.40x; bench/planner.py, each
        plan judged afresh for its rate), and a share shrinking with the queue,
        1/max(2, 16 // queued), 68.4 / 99.0 ms; 1/4 kept bench-edge-8b at 21.0 ms at its own rate
        (21.1 before). Its cost is a longer TTFT p50 on bench-fog-40-8b at 50 %, 185 -> 232 ms,
        still a third of Splitwise's.) The simulator passes the prompt tokens still to prefill,
        measured again at the start of every run of steps, so a lone prompt's chunks shrink as it
        progresses and it takes more than LONE_DRAIN_STEPS steps (a share of its whole length
        instead did not lower meshllm's waits and raised mixed-dp's)."""
        share = DRAIN_STEPS if queued > 1 else LONE_DRAIN_STEPS
        return max(self.free_chunk(batch, context, prompt), -(-backlog // share))

    def lone_chunk(self, batch: int, context: float, left: int, done: int, budget: int) -> int:
        """Prompt tokens per step for a lone prompt with `left` tokens to go (`done` prefilled)
        beside `batch` decoding sequences, given the step's prompt `budget`: the prompt goes in
        k steps of ceil(left / k) tokens, k the budget's ceil(left / budget) or up to
        EVEN_STEPS_FEWER fewer, whichever adds the least waiting (the prompt done later than
        alone, and each decoding sequence's steps made longer). The budget's own chunks leave a
        last step with a remainder that costs a whole step: on bench-edge-8b's RTX 4090 a
        512-token prompt went in 5 steps (124 tokens ride a 21.5 ms step free) and was done
        110 ms after it started, 23 ms later than alone; in 4 steps of 128 tokens, 89 ms."""
        k0 = -(-left // max(1, budget))
        if k0 <= 1:
            return min(left, budget)
        base = self.decode_iter_s(batch, context)

        def waiting(k: int) -> float:  # k steps: the prompt's time, and what the steps add to each sequence's
            step = self.decode_iter_s(batch, context, -(-left // k), done + -(-left // k))
            return k * step + batch * k * (step - base)

        return -(-left // min(range(k0, max(1, k0 - EVEN_STEPS_FEWER) - 1, -1), key=waiting))

    def join_wait_s(self, batch: int, context: float) -> float:
        """Mean wait of a prompt that reaches a mixed replica decoding `batch` sequences: it starts
        with the next micro-batch launched, and min(stages, batch) launch per step."""
        return self.decode_iter_s(batch, context) / (2 * min(len(self.members), batch)) if batch else 0.0

    def goes_whole(self, batch: int, context: float, queued: int, head: int, backlog: int) -> bool:
        """Whether a mixed replica decoding `batch` sequences prefills its next prompt (`head`
        tokens, `queued` prompts waiting with it, `backlog` prompt tokens in all) whole in one step
        rather than in chunks riding along its decode steps. Whole once as many prompts wait as
        sequences decode (the queue drains faster), except a lone prompt beside one decoding
        sequence: it goes whichever way adds less waiting. Whole, the sequence pauses for the
        prompt's prefill; in chunks, the prompt is done later than alone and each step is a
        little longer. (Comparing the two with a queue too slowed its drain at high load until
        whole prompts took over: a second, long-waiting steady state that the stability rule
        accepted, mixed-dp on bench-edge-8b at 19.8 req/s with a 36 s mean wait.)"""
        if batch < 1:
            return True
        if queued < batch or queued > 1:
            return queued >= batch
        lat = self.prefill_s(head)[1]
        chunk = self.lone_chunk(batch, context, head, 0, self.chunk_tokens(batch, context, head, backlog, queued))
        steps = -(-head // chunk)
        base = self.decode_iter_s(batch, context)
        step = self.decode_iter_s(batch, context, chunk, head / 2 + chunk / 2)
        return batch * lat < max(0.0, steps * step - lat) + batch * steps * (step - base)

    def kv_capacity_tokens(self) -> float:
        """KV tokens (whole model depth) that fit beside the weights, limited by the fullest stage."""
        mc, k = self.inp.mc, len(self.members)
        return float(min((m.device.memory_bytes - mc.stage_weight_bytes(n, i == 0, i == k - 1))
                         / (n * mc.kv_bytes_per_token) for i, (m, n) in enumerate(zip(self.members, self.counts))))

    def max_batch(self) -> int:
        return decode_concurrency(self.inp.mc, self.members, self.counts, self.inp.mix)


def from_plan(inp: PlanInputs, plan: Plan) -> list[SimReplica]:
    by_id = {m.id: m for m in inp.members}
    out = []
    for r in plan.replicas:
        members = tuple(by_id[s.node] for s in r.stages)
        out.append(SimReplica(r.id, str(r.role), members, tuple(e - s for s, e in (x.layers for x in r.stages)), inp))
    return mixed_if_alone(out)


def mixed_if_alone(reps: list[SimReplica]) -> list[SimReplica]:
    """Prefill replicas with no decode or mixed replica to ship to, and decode replicas with no
    prefill replica to feed them, serve both phases themselves."""
    roles = {r.role for r in reps}
    alone = set()
    if "prefill" in roles and not roles & set(DECODE_TARGETS):
        alone.add("prefill")
    if "decode" in roles and "prefill" not in roles:
        alone.add("decode")
    for r in reps:
        if r.role in alone:
            r.role = "mixed"
    return reps


def from_grouping(inp: PlanInputs, g: Grouping) -> list[SimReplica]:
    return mixed_if_alone([sim_replica(inp, rid, [inp.members[c] for c in canon], role, ev)
                           for rid, (canon, role, ev) in enumerate(zip(g.groups, g.roles, g.evals, strict=True))])


def sim_replica(inp: PlanInputs, rid: int, members: Sequence[Member], role: str, ev: ReplicaEval) -> SimReplica:
    """The replica of `members` (in the order `ev` rated them: a grouping's evaluation may be
    one made for other devices of the same types) as `ev` rates it in `role`, on that role's split."""
    fit = {"prefill": ev.prefill, "decode": ev.decode, "mixed": ev.mixed}[role]
    assert fit is not None and not isinstance(fit.split, Infeasible)
    return SimReplica(rid, role, tuple(members[i] for i in fit.split.order), fit.split.counts, inp)


def describe(reps: Sequence[SimReplica]) -> str:
    return "; ".join(f"{r.role}:{'+'.join(m.device.name for m in r.members)}" for r in reps)


def replicas_key(reps) -> tuple:
    """What makes two sets of replicas the same plan: each replica's role, nodes in order and
    layer counts (the judge and `--simulate` run each such plan once)."""
    return tuple(sorted((r.role, tuple(r.ids), tuple(r.counts)) for r in reps))
