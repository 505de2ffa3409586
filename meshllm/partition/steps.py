"""A pipeline's step times: what the planner (replica.py's role fits) and the simulator (sim/)
cost a prefill, a decode step or a decode step with prompt chunks riding along by, stage by
stage over the devices' rooflines (cost.py) and the links between them.

The per-stage columns of a pipeline (`pipe_arrays`, `pipe_hops`) are cached by its members'
kinds and layer counts: the GA re-costs the same replica many times, the simulator the same
step shapes millions of times. A step of one chunk size is costed in plain floats with the
numpy path's operations in its order (`fused_step_s`), bit for bit the same seconds.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import numpy as np

from meshllm.defaults import TOKEN_BUDGET
from meshllm.partition.cost import (
    BITS_PER_BYTE,
    ModelCosts,
    bytes_per_s,
    decode_iteration_s,
    decode_work,
    flops_per_s,
    prefill_work,
    roofline_at,
    span_work,
    transfer_s,
)
from meshllm.partition.dp import Member, Net

TOKEN_ID_BYTES = 4  # a sampled token sent back from the last stage to the first
FREE_STEP_SLACK = 0.01  # a prefill chunk "rides free" on a decode step it slows by at most 1%


def ring_s(net: Net, seq: Sequence[Member], n_seqs):
    """The link from the last stage back to the first, carrying the sampled token ids of a decode
    step (none for a one-stage replica). Elementwise in `n_seqs`."""
    if len(seq) < 2:
        return 0.0 * np.asarray(n_seqs)
    a, b = seq[-1], seq[0]
    rtt, _ = net.rtt_mbps(a.zone, b.zone)
    return rtt / 2000.0 + transfer_s(np.asarray(n_seqs) * TOKEN_ID_BYTES, hop_mbps(net, a, b))


def prefill_stage_s(mc: ModelCosts, seq: Sequence[Member], counts: Sequence[int], net: Net,
                    tokens: float) -> tuple[list[float], list[float]]:
    """(seconds per stage, seconds per link) of one prompt of `tokens` tokens."""
    p = pipe_arrays(seq, counts)
    half_rtt, mbps = pipe_hops(p, seq, net)
    stages = roofline_at(*prefill_work(mc, p["n"], tokens, p["last"]), p["flop_s"], p["byte_s"])
    hops = half_rtt + transfer_s(tokens * mc.act_bytes_per_token, mbps)
    return stages.ravel().tolist(), hops.ravel().tolist()


def prefill_batch_stage_s(mc: ModelCosts, seq: Sequence[Member], counts: Sequence[int], net: Net,
                          lengths: Sequence[float]) -> tuple[list[float], list[float]]:
    """(seconds per stage, seconds per link) of the prompts of `lengths` prefilled together in one
    micro-batch (roles/batcher.py fills TOKEN_BUDGET rows with several prompts): each stage reads
    its weights once for all of them; each prompt attends to its own tokens only."""
    if len(lengths) == 1:
        return prefill_stage_s(mc, seq, counts, net, lengths[0])
    p = pipe_arrays(seq, counts)
    half_rtt, mbps = pipe_hops(p, seq, net)
    flops, nbytes = 0.0, -(len(lengths) - 1) * mc.stage_weight_bytes(p["n"], False, p["last"])
    for tokens in lengths:
        f, b = prefill_work(mc, p["n"], tokens, p["last"])
        flops, nbytes = flops + f, nbytes + b
    stages = roofline_at(flops, nbytes, p["flop_s"], p["byte_s"])
    hops = half_rtt + transfer_s(sum(lengths) * mc.act_bytes_per_token, mbps)
    return stages.ravel().tolist(), hops.ravel().tolist()


def prompts_per_batch(mean_in: float) -> int:
    """Prompts of `mean_in` tokens that one prefill micro-batch holds (whole prompts, at least one)."""
    return max(1, int(TOKEN_BUDGET // max(1.0, mean_in)))


_KIND = operator.attrgetter("kind")
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
    key = (tuple(map(_KIND, seq)), tuple(counts))
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
    """fused_step_s with numpy columns of stages (and chunk sizes when `chunk` is an array). With a
    scalar chunk it is the reference `_scalar_step_s` must equal bit for bit (tests/test_cost.py)."""
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
    transfer_s, ring_s and decode_iteration_s written out per stage, in their order; the
    weights' `first * embed_bytes` term is 0.0 on a decode step and left out, which is exact)."""
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
            nbytes = (n * mc.layer_bytes + last * mc.head_bytes
                      + kv_read * n * mc.kv_bytes_per_token) + chunk_ctx * n * mc.kv_bytes_per_token / micro
            stages.append(max(flops / flop_s, nbytes / byte_s))
        act = (b + t) * mc.act_bytes_per_token
    else:
        for n, last, flop_s, byte_s in p["rows"]:
            flops = b * (n * per_token + last * mc.head_flops_per_token)
            nbytes = n * mc.layer_bytes + last * mc.head_bytes + kv_read * n * mc.kv_bytes_per_token
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
