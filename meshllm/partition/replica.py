"""One replica's serving capacity, per role, for a workload mix (used by the GA and the simulator).

A replica is split twice by the DP: once for prefill (a prompt of the mean input length) and
once for decode (a step at a reference batch). Its capacity in requests/s for each role is
the lower of
- compute: prefill k / bottleneck of a micro-batch of k mean prompts (k = TOKEN_BUDGET // mean,
  at least 1); decode tokens/s / mean output length, where decode runs
  min(stages, N) micro-batches through the pipeline and N (the concurrent sequences) is what
  every stage's free memory holds at full sequence length;
- ports (full duplex, cost.py): per request, a device sends (tx) the activations of its stage
  to the next one plus, on a prefill replica, the KV of its own layers, and receives (rx) the
  activations of the previous stage plus, on a decode replica, the KV of its layers.
A mixed replica does both phases itself: no KV crosses a port, and prompts are prefilled in
chunks riding along its decode steps (the compute a memory-bound step leaves idle), so it is
bound by its decode or by all the useful FLOPs, whichever is lower; on the decode split.
Links between zones are counted per replica here; the simulator shares them between replicas.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from meshllm.partition.cost import (
    ModelCosts,
    decode_work,
    pipeline_s,
    prefill_work,
    transfer_s,
)
from meshllm.partition.dp import Infeasible, Member, Net, Split, Splitter, Workpoint, candidate_orders
from meshllm.partition.steps import (
    decode_step_s,
    free_chunk_tokens,
    pipe_arrays,
    prefill_batch_stage_s,
    prefill_stage_s,
    prompts_per_batch,
)

# sequences a replica decodes concurrently at most, where their KV fits (vLLM's default max_num_seqs), in
# the planner and the simulator; the live leader admits MAX_ACTIVE_SEQS (roles/batcher.py: its CPU
# micro-batches hold TOKEN_BUDGET rows) and the live router counts the smaller of the two
MAX_DECODE_BATCH = 256
DECODE_REF_BATCH = 16  # batch the DP's decode split is optimised for
KV_RESERVE_SEQS = 4  # sequences of KV every stage must hold besides weights (DP memory budget)
# What the chunked-prefill scheduler reaches of a mixed replica's compute bound, in the simulator:
# 0.78-0.92 on bench-edge-8b's compute-bound mixed replicas (1.0 where decode memory binds first).
MIXED_COMPUTE_EFFICIENCY = 0.85


@dataclass(frozen=True)
class Mix:
    """The workload's mean lengths (tokens)."""

    mean_in: float
    mean_out: float

    @property
    def kv_tokens(self) -> float:
        return KV_RESERVE_SEQS * (self.mean_in + self.mean_out)

    @property
    def decode_ctx(self) -> float:
        """Mean context of a decode step: the prompt plus half the output."""
        return self.mean_in + self.mean_out / 2

    def prefill_wp(self) -> Workpoint:
        return Workpoint("prefill", self.mean_in, self.mean_in, self.kv_tokens)

    def decode_wp(self, reserve: int = KV_RESERVE_SEQS) -> Workpoint:
        """The decode split's workpoint, keeping KV room for `reserve` mean sequences on every stage."""
        return Workpoint("decode", DECODE_REF_BATCH, self.decode_ctx, reserve * (self.mean_in + self.mean_out))


@dataclass(frozen=True)
class RoleFit:
    split: Split
    req_s: float  # requests/s this replica sustains in the role (compute and ports)
    tok_s: float  # prompt tokens/s (prefill) or output tokens/s (decode, mixed), compute only
    batch: int  # decode concurrency (prefill: 1)
    compute_req_s: float  # requests/s from compute alone (no ports)
    occupancy_s: float = 0.0  # prefill, mixed: a new mean prompt may enter every this many seconds
    prefill_s: float = 0.0  # prefill, mixed: one mean prompt through the whole pipeline (its TTFT part)
    ship_s: float = 0.0  # prefill: shipping one mean prompt's KV out (the slowest port)
    step_s: float = 0.0  # decode, mixed: one iteration at `batch`
    step1_s: float = 0.0  # decode, mixed: one iteration at batch 1 (-1: not found yet, `with_free_tokens`)
    free1: int = -1  # mixed: prompt tokens that ride along an iteration at batch 1 for free (-1: not found yet)
    free_b: int = -1  # mixed: the same at `batch`
    chunk_s: float = 0.0  # mixed: a mean prompt's compute on the busiest stage when chunked with others
    # (a backlog's prompts share steps: no per-step fixed cost, no pipeline fill)


@dataclass(frozen=True)
class ReplicaEval:
    members: tuple[Member, ...]
    prefill: RoleFit | None
    decode: RoleFit | None
    reason: str = ""
    mixed: RoleFit | None = None  # both phases on one split; req_s time-shares them

    @property
    def ok(self) -> bool:
        return self.prefill is not None and self.decode is not None

    @property
    def prefill_req_s(self) -> float:
        return self.prefill.req_s if self.prefill else 0.0

    @property
    def decode_req_s(self) -> float:
        return self.decode.req_s if self.decode else 0.0

    @property
    def mixed_req_s(self) -> float:
        return self.mixed.req_s if self.mixed else 0.0


def ordered(members: Sequence[Member], split: Split) -> list[Member]:
    return [members[i] for i in split.order]


def port_s(mc: ModelCosts, seq: Sequence[Member], counts: Sequence[int], tokens: float,
           kv_tx: float, kv_rx: float) -> float:
    """Seconds the busiest port direction needs per request: activations of `tokens` tokens to the
    next stage (tx) and from the previous one (rx), plus kv_tx / kv_rx tokens of KV of each
    device's own layers."""
    p, act = pipe_arrays(seq, counts), tokens * mc.act_bytes_per_token
    tx = act * (1.0 - p["last"]) + kv_tx * p["n"] * mc.kv_bytes_per_token
    rx = act * (1.0 - p["first"]) + kv_rx * p["n"] * mc.kv_bytes_per_token
    return max(0.0, float(transfer_s(np.maximum(tx, rx), p["port"]).max()))


def capped(rate: float, seconds: float) -> float:
    return min(rate, 1.0 / seconds) if seconds > 0 else rate


def prefill_fit(mc: ModelCosts, members: Sequence[Member], split: Split, net: Net, mix: Mix) -> RoleFit:
    seq = ordered(members, split)
    occupancy, latency = pipeline_s(*prefill_stage_s(mc, seq, split.counts, net, mix.mean_in))
    p = pipe_arrays(seq, split.counts)
    ship = float(transfer_s(p["n"] * mix.mean_in * mc.kv_bytes_per_token, p["port"]).max())
    k = prompts_per_batch(mix.mean_in)  # short prompts share a micro-batch's weight reads (sim/simulator.py)
    compute = 1.0 / occupancy if k == 1 else k / pipeline_s(*prefill_batch_stage_s(
        mc, seq, split.counts, net, [mix.mean_in] * k))[0]
    ports = port_s(mc, seq, split.counts, mix.mean_in, mix.mean_in, 0.0)
    return RoleFit(split, capped(compute, ports), compute * mix.mean_in, 1, compute, occupancy, latency, ship)


def decode_concurrency(mc: ModelCosts, seq: Sequence[Member], counts: Sequence[int], mix: Mix) -> int:
    """Sequences of full mean length whose KV fits in every stage's free memory."""
    p = pipe_arrays(seq, counts)
    free = p["memory"] - mc.stage_weight_bytes(p["n"], p["first"], p["last"])
    fits = np.floor(free / (p["n"] * mc.kv_bytes_per_token * (mix.mean_in + mix.mean_out)))
    return max(0, min(MAX_DECODE_BATCH, int(fits.min())))


def decode_tok_s(mc: ModelCosts, seq: Sequence[Member], counts: Sequence[int], net: Net, mix: Mix,
                 n_seq: int) -> float:
    """Output tokens/s with n_seq sequences in min(stages, n_seq) micro-batches."""
    if n_seq < 1:
        return 0.0
    return n_seq / decode_step_s(mc, seq, counts, net, n_seq, mix.decode_ctx)


def decode_fit(mc: ModelCosts, members: Sequence[Member], split: Split, net: Net, mix: Mix,
               step1: bool = True) -> RoleFit:
    """The decode role on `split` (`step1`: also its step at batch 1, which only the latency
    estimate needs; without it step1_s is -1 until `with_free_tokens`)."""
    seq = ordered(members, split)
    n_seq = decode_concurrency(mc, seq, split.counts, mix)
    if n_seq < 1:
        return RoleFit(split, 0.0, 0.0, 0, 0.0)
    step = decode_step_s(mc, seq, split.counts, net, n_seq, mix.decode_ctx)
    tok_s = n_seq / step
    req = tok_s / mix.mean_out
    ports = port_s(mc, seq, split.counts, mix.mean_out, 0.0, mix.mean_in)
    step1_s = decode_step_s(mc, seq, split.counts, net, 1, mix.decode_ctx) if step1 else -1.0
    return RoleFit(split, capped(req, ports), tok_s, n_seq, req, step_s=step, step1_s=step1_s)


def mixed_compute_req_s(mc: ModelCosts, seq: Sequence[Member], counts: Sequence[int], mix: Mix) -> float:
    """Requests/s of a mixed replica whose compute is fully used (chunked prefill fills the decode
    steps' idle compute): the busiest stage's FLOPs per request at its achieved FLOP/s."""
    p = pipe_arrays(seq, counts)
    pre, _ = prefill_work(mc, p["n"], mix.mean_in, p["last"])
    dec, _ = decode_work(mc, p["n"], max(0.0, mix.mean_out - 1), mix.decode_ctx, p["last"])
    return 1.0 / max(0.0, float(((pre + dec) / p["flop_s"]).max()))


def chunked_prompt_s(mc: ModelCosts, seq: Sequence[Member], counts: Sequence[int], mix: Mix) -> float:
    """Seconds a mean prompt adds to the busiest stage of a mixed replica when it is chunked with
    others into full steps (its FLOPs at the achieved FLOP/s, at the capacity's efficiency): the
    marginal cost a backlog pays per prompt, without the fixed cost of a step of its own."""
    p = pipe_arrays(seq, counts)
    pre, _ = prefill_work(mc, p["n"], mix.mean_in, p["last"])
    return float((pre / p["flop_s"]).max()) / MIXED_COMPUTE_EFFICIENCY


def mixed_fit(mc: ModelCosts, members: Sequence[Member], split: Split, net: Net, mix: Mix,
              fits: tuple[RoleFit, RoleFit] | None = None) -> RoleFit | None:
    """Both phases on `split`, no KV crosses a port (only activations). Prompts are prefilled in
    chunks that ride along the decode steps: the replica is bound by its decode (memory) or by
    its compute (all the useful FLOPs), whichever is lower. `fits`: its prefill and decode fits
    on this split, if already computed. The free tokens are left for `with_free_tokens`."""
    pre, dec = fits or (prefill_fit(mc, members, split, net, mix), decode_fit(mc, members, split, net, mix))
    if dec.batch < 1:
        return None
    seq = ordered(members, split)
    compute = min(dec.compute_req_s, MIXED_COMPUTE_EFFICIENCY * mixed_compute_req_s(mc, seq, split.counts, mix))
    ports = port_s(mc, seq, split.counts, mix.mean_in + mix.mean_out, 0.0, 0.0)
    return RoleFit(split, capped(compute, ports), dec.tok_s, dec.batch, compute, pre.occupancy_s, pre.prefill_s,
                   step_s=dec.step_s, step1_s=dec.step1_s,
                   chunk_s=min(pre.occupancy_s, chunked_prompt_s(mc, seq, split.counts, mix)))


def with_step1(mc: ModelCosts, members: Sequence[Member], fit: RoleFit | None, net: Net, mix: Mix) -> RoleFit | None:
    """`fit` with its decode step at batch 1 found, where it was left out."""
    if fit is None or fit.step1_s >= 0:
        return fit
    seq = ordered(members, fit.split)
    return replace(fit, step1_s=decode_step_s(mc, seq, fit.split.counts, net, 1, mix.decode_ctx))


def with_free_tokens(mc: ModelCosts, ev: ReplicaEval, net: Net, mix: Mix) -> ReplicaEval:
    """`ev` with what only the latency estimate needs (the capacity search does without): the
    decode and mixed fits' step at batch 1, and the mixed fit's free prompt tokens per step (at
    batch 1 and full)."""
    ev = replace(ev, decode=with_step1(mc, ev.members, ev.decode, net, mix),
                 mixed=with_step1(mc, ev.members, ev.mixed, net, mix))
    f = ev.mixed
    if f is None or f.free1 >= 0:
        return ev
    seq = ordered(ev.members, f.split)
    free1 = free_chunk_tokens(mc, seq, f.split.counts, net, 1, mix.decode_ctx, mix.mean_in)
    free_b = free_chunk_tokens(mc, seq, f.split.counts, net, f.batch, mix.decode_ctx, mix.mean_in)
    return replace(ev, mixed=replace(f, free1=free1, free_b=free_b))


def evaluate_replica(mc: ModelCosts, members: Sequence[Member], net: Net, mix: Mix,
                     splitters: tuple[Splitter, Splitter] | None = None) -> ReplicaEval:
    """Split `members` for both roles and rate them (`splitters`: shared caches, prefill/decode)."""
    members = tuple(members)
    sp, sd = splitters or (Splitter(mc, net, mix.prefill_wp()), Splitter(mc, net, mix.decode_wp()))
    orders = candidate_orders(members)
    pre, dec = sp.split(members, orders=orders), sd.split(members, orders=orders)
    if isinstance(pre, Infeasible) or isinstance(dec, Infeasible):
        reason = pre.reason if isinstance(pre, Infeasible) else dec.reason  # type: ignore[union-attr]
        return ReplicaEval(members, None, None, reason)
    dfit = decode_fit(mc, members, dec, net, mix, step1=False)  # batch 1: in `with_free_tokens`
    if dfit.batch < 1:
        return ReplicaEval(members, None, None, "no memory left for the KV of one sequence")
    pfit = prefill_fit(mc, members, pre, net, mix)
    # mixed on the decode split: its capacity is decode- or compute-bound, and that split balances
    # the weights (memory) and the layers (compute) of the pipeline alike. (The prefill split too,
    # where it rates higher, lowered the GA's plans for capacity in the simulator, bench-edge-8b
    # 17.33 -> 15.92 req/s and bench-fog-40-8b 27.46 -> 25.82 (bench/planner.py at 677c0a8): the
    # model overrates some of those replicas, four Orin Nanos mixed on 8 + 8 + 8 + 8 layers
    # 1.74 req/s against 1.43 in the simulator's sweep of that replica alone.
    # The judge tries it on the replicas it turns mixed, and mixed-dp runs it where it rates higher:
    # `on_prefill_split`.)
    same = (pre.order, pre.counts) == (dec.order, dec.counts)  # one split for both: its prefill fit is pfit
    mixed = mixed_fit(mc, members, dec, net, mix, (pfit if same else prefill_fit(mc, members, dec, net, mix), dfit))
    return ReplicaEval(members, pfit, dfit, mixed=mixed)


def on_prefill_split(mc: ModelCosts, ev: ReplicaEval, net: Net, mix: Mix) -> ReplicaEval | None:
    """`ev` with its mixed fit on its prefill split; None where that is its decode split or holds
    no sequence's KV. Two RTX 3060s: 16 + 16 layers leave KV room for 70 sequences, the decode
    split's 17 + 15 for 56 (mixed 2.32 against 2.25 req/s; prefilling for a Jetson AGX Orin at
    1 req/s, the pair turned mixed cost 17 s a request in the simulator on 16 + 16, 62 s on 17 + 15)."""
    if not ev.ok or (ev.prefill.split.order, ev.prefill.split.counts) == (ev.decode.split.order, ev.decode.split.counts):
        return None
    split = ev.prefill.split
    dfit = decode_fit(mc, ev.members, split, net, mix)
    fit = mixed_fit(mc, ev.members, split, net, mix, (ev.prefill, dfit)) if dfit.batch >= 1 else None
    return None if fit is None else replace(ev, mixed=fit)


def with_kv_room(mc: ModelCosts, ev: ReplicaEval, net: Net, mix: Mix, reserve: int) -> ReplicaEval | None:
    """`ev` with its decode and mixed fits on the DP's decode split that keeps KV room for
    `reserve` mean sequences on every stage (the DP keeps KV_RESERVE_SEQS); None where that split
    does not fit or is the one `ev` both decodes and serves mixed on. The DP optimises a step at
    DECODE_REF_BATCH, so a pipeline of unequal devices puts the layers where that step is fastest
    and leaves the batch to what the tightest stage's memory holds: on bench-mesh-200, 2 A100 + 3 RTX 4090 as planned
    (24 + 24 + 11 + 11 + 10 layers) hold 127 sequences and sustain 3.00 req/s alone in the
    simulator, with room for 256 (27 + 27 + 9 + 9 + 8) 3.95 (bench/bound_gap.py --replicas), where
    the analytic model rates it lower (its mixed fit bound by the A100s' compute). The judge
    decides on the evidence (sim/turns.py, step 7)."""
    if not ev.ok:
        return None
    split = Splitter(mc, net, mix.decode_wp(reserve)).split(ev.members)
    if isinstance(split, Infeasible) or all((split.order, split.counts) == (f.split.order, f.split.counts)
                                            for f in (ev.decode, ev.mixed) if f is not None):
        return None
    dfit = decode_fit(mc, ev.members, split, net, mix)
    if dfit.batch < 1:
        return None
    return replace(ev, decode=dfit, mixed=mixed_fit(mc, ev.members, split, net, mix,
                                                    (prefill_fit(mc, ev.members, split, net, mix), dfit)))


def best_mixed(mc: ModelCosts, ev: ReplicaEval, net: Net, mix: Mix) -> ReplicaEval:
    """`ev` mixed on whichever of its decode and prefill splits rates higher (mixed-dp's replicas,
    as an operator would pick the pipeline split of a replica that serves both phases)."""
    alt = on_prefill_split(mc, ev, net, mix)
    return alt if alt is not None and (ev.mixed is None or alt.mixed_req_s > ev.mixed_req_s) else ev
