"""One replica's serving capacity, per role, for a workload mix (used by the GA and the simulator).

A replica is split twice by the DP: once for prefill (a prompt of the mean input length) and
once for decode (a step at a reference batch). Its capacity in requests/s for each role is
the lower of
- compute: prefill 1 / bottleneck; decode tokens/s / mean output length, where decode runs
  min(stages, N) micro-batches through the pipeline and N (the concurrent sequences) is what
  every stage's free memory holds at full sequence length;
- ports: every device's `network_mbps` carries its own activations plus the KV of its own
  layers (shipped out after prefill, received before decode), per request.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from meshllm.partition.cost import ModelCosts, stage_decode_s, transfer_s
from meshllm.partition.dp import Infeasible, Member, Net, Split, Splitter, Workpoint

MAX_DECODE_BATCH = 256  # sequences a replica decodes concurrently at most (runtime limit)
DECODE_REF_BATCH = 16  # batch the DP's decode split is optimised for
KV_RESERVE_SEQS = 4  # sequences of KV every stage must hold besides weights (DP memory budget)


@dataclass(frozen=True)
class Mix:
    """The workload's mean lengths (tokens)."""

    mean_in: float
    mean_out: float

    @property
    def kv_tokens(self) -> float:
        return KV_RESERVE_SEQS * (self.mean_in + self.mean_out)

    def prefill_wp(self) -> Workpoint:
        return Workpoint("prefill", self.mean_in, self.mean_in, self.kv_tokens)

    def decode_wp(self) -> Workpoint:
        return Workpoint("decode", DECODE_REF_BATCH, self.mean_in + self.mean_out / 2, self.kv_tokens)


@dataclass(frozen=True)
class RoleFit:
    split: Split
    req_s: float  # requests/s this replica sustains in the role
    tok_s: float  # prompt tokens/s (prefill) or output tokens/s (decode), compute only
    batch: int  # decode concurrency (prefill: 1)
    compute_req_s: float  # requests/s from compute alone (no ports)


@dataclass(frozen=True)
class ReplicaEval:
    members: tuple[Member, ...]
    prefill: RoleFit | None
    decode: RoleFit | None
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.prefill is not None and self.decode is not None

    @property
    def prefill_req_s(self) -> float:
        return self.prefill.req_s if self.prefill else 0.0

    @property
    def decode_req_s(self) -> float:
        return self.decode.req_s if self.decode else 0.0


def ordered(members: Sequence[Member], split: Split) -> list[Member]:
    return [members[i] for i in split.order]


def prefill_fit(mc: ModelCosts, members: Sequence[Member], split: Split, net: Net, mix: Mix) -> RoleFit:
    seq = ordered(members, split)
    port_s = 0.0
    for i, (m, n) in enumerate(zip(seq, split.counts, strict=True)):
        act = mix.mean_in * mc.act_bytes_per_token * ((i > 0) + (i < len(seq) - 1))
        kv = n * mix.mean_in * mc.kv_bytes_per_token
        port_s = max(port_s, transfer_s(act + kv, m.device.network_mbps))
    compute = 1.0 / split.bottleneck_s
    return RoleFit(split, min(compute, 1.0 / port_s) if port_s else compute, compute * mix.mean_in, 1, compute)


def decode_concurrency(mc: ModelCosts, seq: Sequence[Member], counts: Sequence[int], mix: Mix) -> int:
    """Sequences of full mean length whose KV fits in every stage's free memory."""
    n_seq = MAX_DECODE_BATCH
    for i, (m, n) in enumerate(zip(seq, counts, strict=True)):
        free = m.device.memory_bytes - mc.stage_weight_bytes(n, i == 0, i == len(seq) - 1)
        n_seq = min(n_seq, math.floor(free / (n * mc.kv_bytes_per_token * (mix.mean_in + mix.mean_out))))
    return max(0, n_seq)


def decode_tok_s(mc: ModelCosts, seq: Sequence[Member], counts: Sequence[int], net: Net, mix: Mix,
                 n_seq: int) -> float:
    """Output tokens/s with n_seq sequences in min(stages, n_seq) micro-batches."""
    if n_seq < 1:
        return 0.0
    micro = min(len(seq), n_seq)
    b = n_seq / micro
    ctx = mix.mean_in + mix.mean_out / 2
    k = len(seq)
    stages = [stage_decode_s(mc, m.device, n, b, ctx, i == k - 1) for i, (m, n) in enumerate(zip(seq, counts))]
    hops = [net.hop_s(a, c, b * mc.act_bytes_per_token) for a, c in zip(seq, seq[1:] + seq[:1])]
    bottleneck = max(stages + hops[:-1])
    latency = sum(stages) + sum(hops)
    return micro * b / max(micro * bottleneck, latency)


def decode_fit(mc: ModelCosts, members: Sequence[Member], split: Split, net: Net, mix: Mix) -> RoleFit:
    seq = ordered(members, split)
    n_seq = decode_concurrency(mc, seq, split.counts, mix)
    tok_s = decode_tok_s(mc, seq, split.counts, net, mix, n_seq)
    port_s = 0.0
    for i, (m, n) in enumerate(zip(seq, split.counts, strict=True)):
        act = mix.mean_out * mc.act_bytes_per_token * ((i > 0) + (i < len(seq) - 1))
        port_s = max(port_s, transfer_s(act + n * mix.mean_in * mc.kv_bytes_per_token, m.device.network_mbps))
    req = tok_s / mix.mean_out
    return RoleFit(split, min(req, 1.0 / port_s) if port_s else req, tok_s, n_seq, req)


def evaluate_replica(mc: ModelCosts, members: Sequence[Member], net: Net, mix: Mix,
                     splitters: tuple[Splitter, Splitter] | None = None) -> ReplicaEval:
    """Split `members` for both roles and rate them (`splitters`: shared caches, prefill/decode)."""
    members = tuple(members)
    sp, sd = splitters or (Splitter(mc, net, mix.prefill_wp()), Splitter(mc, net, mix.decode_wp()))
    pre, dec = sp.split(members), sd.split(members)
    if isinstance(pre, Infeasible) or isinstance(dec, Infeasible):
        reason = pre.reason if isinstance(pre, Infeasible) else dec.reason  # type: ignore[union-attr]
        return ReplicaEval(members, None, None, reason)
    dfit = decode_fit(mc, members, dec, net, mix)
    if dfit.batch < 1:
        return ReplicaEval(members, None, None, "no memory left for the KV of one sequence")
    return ReplicaEval(members, prefill_fit(mc, members, pre, net, mix), dfit)


def mixed_req_s(ev: ReplicaEval) -> float:
    """A replica doing both phases itself (no KV shipping): time-shares prefill and decode."""
    if ev.prefill is None or ev.decode is None or ev.prefill.compute_req_s <= 0 or ev.decode.compute_req_s <= 0:
        return 0.0
    return 1.0 / (1.0 / ev.prefill.compute_req_s + 1.0 / ev.decode.compute_req_s)
