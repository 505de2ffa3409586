"""One replica's serving capacity, per role, for a workload mix (used by the GA and the simulator).

A replica is split twice by the DP: once for prefill (a prompt of the mean input length) and
once for decode (a step at a reference batch). Its capacity in requests/s for each role is
the lower of
- compute: prefill 1 / bottleneck; decode tokens/s / mean output length, where decode runs
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

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from meshllm.partition.cost import (
    BITS_PER_BYTE,
    ModelCosts,
    bytes_per_s,
    decode_iteration_s,
    decode_work,
    flops_per_s,
    pipeline_s,
    prefill_work,
    roofline_at,
    span_work,
    transfer_s,
)
from meshllm.partition.dp import Infeasible, Member, Net, Split, Splitter, Workpoint, candidate_orders

MAX_DECODE_BATCH = 256  # sequences a replica decodes concurrently at most (runtime limit)
DECODE_REF_BATCH = 16  # batch the DP's decode split is optimised for
KV_RESERVE_SEQS = 4  # sequences of KV every stage must hold besides weights (DP memory budget)
TOKEN_ID_BYTES = 4  # a sampled token sent back from the last stage to the first
# What the chunked-prefill scheduler reaches of a mixed replica's compute bound, in the simulator:
# 0.78-0.92 on bench-edge-8b's compute-bound mixed replicas (1.0 where decode memory binds first).
MIXED_COMPUTE_EFFICIENCY = 0.85
FREE_STEP_SLACK = 0.01  # a prefill chunk "rides free" on a decode step it slows by at most 1%


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

    def decode_wp(self) -> Workpoint:
        return Workpoint("decode", DECODE_REF_BATCH, self.decode_ctx, self.kv_tokens)


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
    step1_s: float = 0.0  # decode, mixed: one iteration at batch 1
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


def ring_s(net: Net, seq: Sequence[Member], n_seqs):
    """The link from the last stage back to the first, carrying the sampled token ids of a decode
    step (none for a one-stage replica). Elementwise in `n_seqs`."""
    if len(seq) < 2:
        return 0.0 * np.asarray(n_seqs)
    a, b = seq[-1], seq[0]
    rtt, _ = net.rtt_mbps(a.zone, b.zone)
    return rtt / 2000.0 + transfer_s(np.asarray(n_seqs) * TOKEN_ID_BYTES, hop_mbps(net, a, b))


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
    compute = 1.0 / occupancy
    ports = port_s(mc, seq, split.counts, mix.mean_in, mix.mean_in, 0.0)
    return RoleFit(split, capped(compute, ports), compute * mix.mean_in, 1, compute, occupancy, latency, ship)


def decode_concurrency(mc: ModelCosts, seq: Sequence[Member], counts: Sequence[int], mix: Mix) -> int:
    """Sequences of full mean length whose KV fits in every stage's free memory."""
    p = pipe_arrays(seq, counts)
    free = p["memory"] - mc.stage_weight_bytes(p["n"], p["first"], p["last"])
    fits = np.floor(free / (p["n"] * mc.kv_bytes_per_token * (mix.mean_in + mix.mean_out)))
    return max(0, min(MAX_DECODE_BATCH, int(fits.min())))


def prefill_stage_s(mc: ModelCosts, seq: Sequence[Member], counts: Sequence[int], net: Net,
                    tokens: float) -> tuple[list[float], list[float]]:
    """(seconds per stage, seconds per link) of one prompt of `tokens` tokens."""
    p = pipe_arrays(seq, counts)
    half_rtt, mbps = pipe_hops(p, seq, net)
    stages = roofline_at(*prefill_work(mc, p["n"], tokens, p["last"]), p["flop_s"], p["byte_s"])
    hops = half_rtt + transfer_s(tokens * mc.act_bytes_per_token, mbps)
    return stages.ravel().tolist(), hops.ravel().tolist()


_PIPES: dict[tuple, dict] = {}
PIPE_CACHE = 4096  # pipelines whose arrays are kept (the GA re-costs the same replica many times)
_KIND_COLS: dict[int, tuple[float, float, float, float]] = {}  # Member.kind -> a stage's columns
_HOP_COLS: dict[tuple, tuple] = {}  # (id(net), kind, kind) -> (rtt/2 s, Mb/s, net)


def _kind_cols(m: Member) -> tuple[float, float, float, float]:
    got = _KIND_COLS.get(m.kind)
    if got is None:
        d = m.device
        got = _KIND_COLS[m.kind] = (flops_per_s(d), bytes_per_s(d), d.memory_bytes, d.network_mbps)
    return got


def _hop_cols(net: Net, a: Member, b: Member) -> tuple:
    key = (id(net), a.kind, b.kind)
    got = _HOP_COLS.get(key)
    if got is None or got[2] is not net:
        if len(_HOP_COLS) >= PIPE_CACHE:
            _HOP_COLS.clear()
        got = _HOP_COLS[key] = (net.rtt_mbps(a.zone, b.zone)[0] / 2000.0, hop_mbps(net, a, b), net)
    return got


def pipe_arrays(seq: Sequence[Member], counts: Sequence[int]) -> dict:
    """Per-stage numpy columns of a pipeline (layers, first and last flags, FLOP/s, bytes/s,
    memory bytes, port Mb/s), so a step is costed for all stages and chunk sizes at once. Cached
    by the members' kinds (what the columns depend on); `pipe_hops` adds the links."""
    key = (tuple(m.kind for m in seq), tuple(counts))
    got = _PIPES.get(key)
    if got is None:
        if len(_PIPES) >= PIPE_CACHE:
            _PIPES.clear()
        k = len(seq)
        dev = np.array([_kind_cols(m) for m in seq], dtype=float)
        flags = np.zeros((k, 2))
        flags[0, 0] = flags[-1, 1] = 1.0
        got = _PIPES[key] = {
            "n": np.array(counts, dtype=float).reshape(k, 1), "first": flags[:, :1], "last": flags[:, 1:],
            "flop_s": dev[:, 0:1], "byte_s": dev[:, 1:2], "memory": dev[:, 2:3], "port": dev[:, 3:4], "hops": {},
            "rows": [(float(c), float(i == k - 1), f, b) for i, (c, (f, b, _, _)) in enumerate(zip(counts, dev.tolist()))]}
    return got


def pipe_hops(p: dict, seq: Sequence[Member], net: Net) -> tuple[np.ndarray, np.ndarray]:
    """The per-link columns (rtt/2 seconds, Mb/s) of pipeline `p` (pipe_arrays) of `seq` on `net`,
    cached in `p` per net (the net is kept with them, so its id is not reused meanwhile)."""
    got = p["hops"].get(id(net))
    if got is None or got[2] is not net:
        cols = np.array([_hop_cols(net, a, c)[:2] for a, c in zip(seq, seq[1:])], dtype=float).reshape(-1, 2)
        got = p["hops"][id(net)] = (cols[:, :1], cols[:, 1:], net)
    return got[0], got[1]


def pipe_hop_lists(p: dict, seq: Sequence[Member], net: Net) -> tuple:
    """`pipe_hops` as plain floats, with the ring link (last stage -> first: rtt/2 seconds, Mb/s;
    Mb/s 0 for a one-stage pipeline, which has none), cached in `p` per net."""
    got = p["hops"].get(("lists", id(net)))
    if got is None or got[4] is not net:
        half_rtt, mbps = pipe_hops(p, seq, net)
        ring = (net.rtt_mbps(seq[-1].zone, seq[0].zone)[0] / 2000.0, hop_mbps(net, seq[-1], seq[0])) \
            if len(seq) > 1 else (0.0, 0.0)
        got = p["hops"][("lists", id(net))] = (half_rtt.ravel().tolist(), mbps.ravel().tolist(), *ring, net)
    return got


def fused_step_s(mc: ModelCosts, seq: Sequence[Member], counts: Sequence[int], net: Net, batch: float,
                 context: float, chunk=0.0, chunk_ctx=0.0, prompts: int = 0):
    """Seconds for each of `batch` decoding sequences to get one token, in min(stages, batch +
    prompts) micro-batches, while `chunk` tokens of `prompts` prompts (attending as one span
    ending at `chunk_ctx`) ride along, split over the micro-batches (chunked prefill, Sarathi /
    vLLM). `chunk` / `chunk_ctx` may be numpy arrays (one step time per chunk size).

    A scalar chunk (the simulator's and the router's millions of calls) is costed stage by stage
    in plain floats (`_scalar_step_s`), with the numpy path's operations in its order and its
    pairwise sums, so both give the same seconds bit for bit (tested): numpy's per-call overhead
    on arrays of a few stages was ~45 % of a saturation sweep."""
    k, p = len(seq), pipe_arrays(seq, counts)
    micro = max(1, min(k, math.ceil(batch) + prompts))
    if np.ndim(chunk) == 0:
        return _scalar_step_s(mc, p, pipe_hop_lists(p, seq, net), batch, context, float(chunk), float(chunk_ctx),
                              micro)
    return _array_step_s(mc, p, seq, net, batch, context, chunk, chunk_ctx, micro)


def _array_step_s(mc: ModelCosts, p: dict, seq: Sequence[Member], net: Net, batch: float, context: float,
                  chunk, chunk_ctx, micro: int):
    """fused_step_s with numpy columns of stages (and chunk sizes when `chunk` is an array)."""
    half_rtt, mbps = pipe_hops(p, seq, net)
    scalar = np.ndim(chunk) == 0
    if scalar and chunk == 0:  # a plain decode step: the same sums with the chunk's zeros left out
        b = batch / micro
        flops, nbytes = decode_work(mc, p["n"], b, context, p["last"])
        stages = roofline_at(flops, nbytes, p["flop_s"], p["byte_s"])
        hops = half_rtt + transfer_s(b * mc.act_bytes_per_token, mbps)
        return float(decode_iteration_s(stages, hops, ring_s(net, seq, b), micro)[0])
    b, t = batch / micro, np.atleast_1d(np.asarray(chunk, dtype=float)).reshape(1, -1) / micro
    flops, nbytes = decode_work(mc, p["n"], b, context, p["last"])
    f2, b2 = span_work(mc, p["n"], t, np.asarray(chunk_ctx, dtype=float).reshape(1, -1))
    stages = roofline_at(flops + f2, nbytes + np.where(t > 0, b2 / micro, 0.0), p["flop_s"], p["byte_s"])
    hops = half_rtt + transfer_s((b + t) * mc.act_bytes_per_token, mbps)  # (k - 1, chunks)
    out = decode_iteration_s(stages, hops, ring_s(net, seq, b), micro)
    return float(out[0]) if scalar else out


def numpy_sum(xs: Sequence[float]) -> float:
    """The sum numpy gives for a float64 column (`a.sum(axis=0)` of shape (n, 1)): pairwise, with
    eight accumulators from eight values on, so a plain-float path matches it bit for bit."""
    n = len(xs)
    if n < 8:
        res = 0.0
        for x in xs:
            res += x
        return res
    if n > 128:  # numpy's block size: halves, at a multiple of eight
        half = n // 2
        half -= half % 8
        return numpy_sum(xs[:half]) + numpy_sum(xs[half:])
    r = list(xs[:8])
    i, end = 8, n - n % 8
    while i < end:
        for j in range(8):
            r[j] += xs[i + j]
        i += 8
    res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]))
    for x in xs[i:]:
        res += x
    return res


def _scalar_step_s(mc: ModelCosts, p: dict, hops: tuple, batch: float, context: float, chunk: float,
                   chunk_ctx: float, micro: int) -> float:
    """_array_step_s for one chunk size, in plain floats (decode_work, span_work, roofline_at,
    transfer_s, ring_s and decode_iteration_s written out per stage, in their order)."""
    half_rtt, mbps, ring_half_rtt, ring_mbps, _ = hops
    b = batch / micro
    per_token = mc.layer_flops_per_token + mc.attn_flops_per_token_ctx * context
    kv_read = b * context
    bits = BITS_PER_BYTE
    stages = []
    if chunk:
        t = chunk / micro
        span = mc.layer_flops_per_token + mc.attn_flops_per_token_ctx * (chunk_ctx - t / 2)
        for n, last, flop_s, byte_s in p["rows"]:
            flops = b * (n * per_token + last * mc.head_flops_per_token) + t * n * span
            nbytes = (n * mc.layer_bytes + False * mc.embed_bytes + last * mc.head_bytes
                      + kv_read * n * mc.kv_bytes_per_token) + chunk_ctx * n * mc.kv_bytes_per_token / micro
            stages.append(max(flops / flop_s, nbytes / byte_s))
        act = (b + t) * mc.act_bytes_per_token
    else:
        for n, last, flop_s, byte_s in p["rows"]:
            flops = b * (n * per_token + last * mc.head_flops_per_token)
            nbytes = n * mc.layer_bytes + False * mc.embed_bytes + last * mc.head_bytes + kv_read * n * mc.kv_bytes_per_token
            stages.append(max(flops / flop_s, nbytes / byte_s))
        act = b * mc.act_bytes_per_token
    links = [h + act * bits / (m * 1e6) for h, m in zip(half_rtt, mbps)]
    ring = ring_half_rtt + b * TOKEN_ID_BYTES * bits / (ring_mbps * 1e6) if ring_mbps else 0.0
    occupancy = max(max(stages), max(links, default=0.0))
    return max(micro * occupancy, numpy_sum(stages) + numpy_sum(links) + ring)


def hop_mbps(net: Net, a: Member, b: Member) -> float:
    rtt, mbps = net.rtt_mbps(a.zone, b.zone)
    return min(a.device.network_mbps, b.device.network_mbps, mbps or math.inf)


def decode_step_s(mc: ModelCosts, seq: Sequence[Member], counts: Sequence[int], net: Net, batch: float,
                  context: float) -> float:
    """Seconds for each of `batch` sequences to get one token, in min(stages, batch) micro-batches."""
    return fused_step_s(mc, seq, counts, net, batch, context)


def free_chunk_tokens(mc: ModelCosts, seq: Sequence[Member], counts: Sequence[int], net: Net, batch: float,
                      context: float, prompt: float, start: float | None = None) -> int:
    """Most prompt tokens (<= `prompt`, from position `start`, default the prompt's middle) that
    ride along a decode step of `batch` sequences making it
    at most FREE_STEP_SLACK slower (reading the prompt's own KV costs a little): the compute a
    memory-bound step leaves idle (0 without a decode batch). The step time grows with the chunk:
    a grid of powers of two, then a finer grid between the last that fits and the next."""
    if batch < 1 or prompt < 1:
        return 0
    base = decode_step_s(mc, seq, counts, net, batch, context) * (1 + FREE_STEP_SLACK)
    lo, hi = 0.0, float(prompt)
    for grid in (np.unique(np.r_[0, 2.0 ** np.arange(int(math.log2(prompt)) + 1), prompt]), None):
        if grid is None:  # refine between the last power of two that fits and the next
            grid = np.linspace(lo, hi, 17)
        times = fused_step_s(mc, seq, counts, net, batch, context, grid, (prompt / 2 if start is None else start) + grid)
        fits = np.nonzero(times <= base)[0]
        if fits.size == 0:
            return int(lo)
        j = int(fits[-1])
        if j == len(grid) - 1:
            return int(grid[j])
        lo, hi = float(grid[j]), float(grid[j + 1])
    return int(lo)


def decode_tok_s(mc: ModelCosts, seq: Sequence[Member], counts: Sequence[int], net: Net, mix: Mix,
                 n_seq: int) -> float:
    """Output tokens/s with n_seq sequences in min(stages, n_seq) micro-batches."""
    if n_seq < 1:
        return 0.0
    return n_seq / decode_step_s(mc, seq, counts, net, n_seq, mix.decode_ctx)


def decode_fit(mc: ModelCosts, members: Sequence[Member], split: Split, net: Net, mix: Mix) -> RoleFit:
    seq = ordered(members, split)
    n_seq = decode_concurrency(mc, seq, split.counts, mix)
    if n_seq < 1:
        return RoleFit(split, 0.0, 0.0, 0, 0.0)
    step = decode_step_s(mc, seq, split.counts, net, n_seq, mix.decode_ctx)
    tok_s = n_seq / step
    req = tok_s / mix.mean_out
    ports = port_s(mc, seq, split.counts, mix.mean_out, 0.0, mix.mean_in)
    step1 = decode_step_s(mc, seq, split.counts, net, 1, mix.decode_ctx)
    return RoleFit(split, capped(req, ports), tok_s, n_seq, req, step_s=step, step1_s=step1)


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


def with_free_tokens(mc: ModelCosts, ev: ReplicaEval, net: Net, mix: Mix) -> ReplicaEval:
    """`ev` with its mixed fit's free prompt tokens per step found (at batch 1 and full), which
    only the latency estimate needs (the capacity search does without)."""
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
    dfit = decode_fit(mc, members, dec, net, mix)
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
    mixed = mixed_fit(mc, members, dec, net, mix, (prefill_fit(mc, members, dec, net, mix), dfit))
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


def best_mixed(mc: ModelCosts, ev: ReplicaEval, net: Net, mix: Mix) -> ReplicaEval:
    """`ev` mixed on whichever of its decode and prefill splits rates higher (mixed-dp's replicas,
    as an operator would pick the pipeline split of a replica that serves both phases)."""
    alt = on_prefill_split(mc, ev, net, mix)
    return alt if alt is not None and (ev.mixed is None or alt.mixed_req_s > ev.mixed_req_s) else ev
