"""Roofline cost model: bytes, FLOPs and seconds for a model shard on a device.

One model for the planner (DP + GA), the simulator and the emulator's pacing: the work of a
step is `prefill_work` / `decode_work` (FLOPs, bytes), its time is `roofline` on a device.

- Prefill of T tokens is compute-bound; decode/verification of a batch of b sequences is a
  roofline: max(FLOPs * b / compute, bytes moved / memory bandwidth).
- A link costs rtt/2 + bytes / bandwidth, where the bandwidth of a transfer is the lowest of
  the zone link and the two devices' network ports (`network_mbps`).
- Ports are full duplex: a device's send (tx) and receive (rx) directions are two servers,
  each at `network_mbps`, shared by all transfers of the device in that direction: the KV it
  ships, and the activations it sends to the next stage / receives from the previous one.
- A link between two different zones is one shared server per direction (the WAN or uplink
  between them); a link within a zone (`zones: [fog, fog]`) is a per-flow cap only, since a
  switch gives every port pair its own path.
- KV shipping (prefill -> decode): each device ships the KV of its own layers.

Calibration. Device profiles give vendor peaks; a runtime achieves a fraction of them.
`python bench/calibrate.py` measures that fraction on this machine (one core of an AMD EPYC
Zen 4 VM, nominal 2.6 GHz, ~3.7 GHz boost, 32 fp32 FLOP/cycle):
- compute: the seven projections of a SmolLM2-1.7B-shaped layer over a 512-token prompt run
  at 92 GFLOP/s on an idle core, 0.78 of the boost-clock peak (a 1024^2 matmul: 0.83); with
  the box shared by other jobs the same matmul gave 44 GFLOP/s (~0.4). Serving engines on
  GPUs report 40-60% of the dense tensor peak in prefill. COMPUTE_EFFICIENCY = 0.5 sits in
  both ranges.
- bandwidth: the same layer at batch 1 (every weight read once) moves 19-20 GB/s, 0.55-0.58
  of a streaming copy on the same core; the VM's DRAM peak is unknown, so no fraction of a
  spec can be measured here. GPU decode kernels reach 70-80% of their memory's peak;
  BANDWIDTH_EFFICIENCY = 0.7 is the usual STREAM-style figure between the two.
Both are module constants, so a deployment can put its own measurements here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from meshllm.device import DeviceProfile
from meshllm.shapes import ModelArgs

COMPUTE_EFFICIENCY = 0.5  # achieved / peak FLOP/s (see module docstring: measured 0.4-0.78 here)
BANDWIDTH_EFFICIENCY = 0.7  # achieved / peak memory bandwidth
# Bytes per weight by served dtype; int4 is group-wise (g64) with an fp16 scale and zero per group.
DTYPE_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "int8": 1.0, "int4": 0.5 + 4.0 / 64}
DRAFT_DTYPE = {"w4a16": "int4", "w8a16": "int8", "fp32": "fp32", "random": "int4"}  # draft quant -> dtype
KV_BYTES = 2.0  # KV cache element (fp16)
ACT_BYTES = 2.0  # hidden state element shipped between stages (fp16)
BITS_PER_BYTE = 8.0


@dataclass(frozen=True)
class ModelCosts:
    """Per-layer and per-token figures of one model at one served dtype."""

    name: str
    n_layers: int
    layer_bytes: float  # weights of one transformer block
    kv_bytes_per_token: float  # K+V of one block for one token
    act_bytes_per_token: float  # hidden state crossing a stage boundary
    layer_flops_per_token: float  # matmul FLOPs of one block (2 per multiply-add)
    attn_flops_per_token_ctx: float  # QK^T + AV FLOPs per token per context position, one block
    embed_bytes: float  # token embedding, held by the first stage
    head_bytes: float  # final norm + LM head, held by the last stage
    head_flops_per_token: float

    @property
    def weight_bytes(self) -> float:
        return self.n_layers * self.layer_bytes + self.embed_bytes + self.head_bytes

    def stage_weight_bytes(self, n_layers: int, first: bool, last: bool) -> float:
        return n_layers * self.layer_bytes + first * self.embed_bytes + last * self.head_bytes


def dtype_bytes(dtype: str) -> float:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


def model_costs(args: ModelArgs, dtype: str = "fp16") -> ModelCosts:
    wb = dtype_bytes(dtype)
    hd = args.head_dim
    q_out, kv_out = args.n_heads * hd, args.n_kv_heads * hd
    attn_params = args.dim * q_out + 2 * args.dim * kv_out + q_out * args.dim
    ffn_params = 3 * args.dim * args.hidden_dim
    layer_params = attn_params + ffn_params
    head_params = args.vocab_size * args.dim
    return ModelCosts(
        name=args.name,
        n_layers=args.n_layers,
        layer_bytes=layer_params * wb + 2 * args.dim * ACT_BYTES,  # + two RMSNorm vectors
        kv_bytes_per_token=2 * kv_out * KV_BYTES,
        act_bytes_per_token=args.dim * ACT_BYTES,
        layer_flops_per_token=2.0 * layer_params,
        attn_flops_per_token_ctx=4.0 * q_out,
        embed_bytes=head_params * wb,
        head_bytes=head_params * wb + args.dim * ACT_BYTES,  # tied embeddings still need a copy here
        head_flops_per_token=2.0 * head_params,
    )


def flops_per_s(device: DeviceProfile) -> float:
    return device.compute_tflops * 1e12 * COMPUTE_EFFICIENCY


def bytes_per_s(device: DeviceProfile) -> float:
    return device.memory_bandwidth_gbps * 1e9 * BANDWIDTH_EFFICIENCY


def roofline(flops, nbytes, device: DeviceProfile):
    """max(FLOPs / compute, bytes / bandwidth) in seconds; works elementwise on numpy arrays."""
    return roofline_at(flops, nbytes, flops_per_s(device), bytes_per_s(device))


def roofline_at(flops, nbytes, flop_s, byte_s):
    """The roofline with achieved FLOP/s and bytes/s given (arrays of stages, in the simulator)."""
    return np.maximum(flops / flop_s, nbytes / byte_s)


def span_work(mc: ModelCosts, n_layers, tokens, context):
    """(FLOPs, bytes) of `tokens` new tokens at the end of a sequence of `context` tokens (them
    included), weights excluded: a prefill chunk, or a whole prompt (tokens = context). Each new
    token attends on average to context - tokens/2 positions; the sequence's KV is read/written
    once. Elementwise over numpy arrays."""
    flops = tokens * n_layers * (mc.layer_flops_per_token + mc.attn_flops_per_token_ctx * (context - tokens / 2))
    return flops, context * n_layers * mc.kv_bytes_per_token


def prefill_work(mc: ModelCosts, n_layers, n_tokens, last=False):
    """(FLOPs, bytes) for a stage of `n_layers` layers to prefill one prompt of `n_tokens` tokens.
    The LM head runs on the last token only (it produces the first output token)."""
    flops, kv = span_work(mc, n_layers, n_tokens, n_tokens)
    return flops + last * mc.head_flops_per_token, mc.stage_weight_bytes(n_layers, False, last) + kv


def decode_work(mc: ModelCosts, n_layers, batch, context, last=False):
    """(FLOPs, bytes) for one decode (or verification) step of `batch` sequences at `context`
    cached tokens: every weight read once, every sequence's KV read once. Elementwise."""
    flops = batch * (n_layers * (mc.layer_flops_per_token + mc.attn_flops_per_token_ctx * context)
                     + last * mc.head_flops_per_token)
    nbytes = mc.stage_weight_bytes(n_layers, False, last) + batch * context * n_layers * mc.kv_bytes_per_token
    return flops, nbytes


def request_flops(mc: ModelCosts, n_in: float, n_out: float) -> float:
    """Useful FLOPs of one request through the whole model: its prefill (which yields the first
    token) plus n_out - 1 decode steps at contexts n_in + 1 .. n_in + n_out - 1. The physical
    bound of a cluster (sim/bound.py) divides the devices' FLOP/s by this."""
    pre, _ = prefill_work(mc, mc.n_layers, n_in, True)
    steps = max(0.0, n_out - 1)
    mean_ctx = n_in + n_out / 2  # mean of n_in + 1 .. n_in + n_out - 1
    dec, _ = decode_work(mc, mc.n_layers, steps, mean_ctx, True)
    return float(pre + dec)


def stage_prefill_s(mc: ModelCosts, device: DeviceProfile, n_layers: int, n_tokens: float,
                    last: bool = False) -> float:
    """Seconds for one stage to prefill `n_tokens` tokens of one prompt (roofline; compute-bound
    for any realistic prompt)."""
    return roofline(*prefill_work(mc, n_layers, n_tokens, last), device)


def stage_decode_s(mc: ModelCosts, device: DeviceProfile, n_layers: int, batch: float, context: float,
                   last: bool = False) -> float:
    """Seconds for one decode (or verification) step of `batch` sequences at `context` tokens:
    max(FLOPs / compute, (weights + KV read) / bandwidth)."""
    return roofline(*decode_work(mc, n_layers, batch, context, last), device)


def stage_batch_s(mc: ModelCosts, device: DeviceProfile, n_layers: int, spans: Sequence[tuple[int, int]],
                  first: bool = False, last: bool = False, logit_rows: int = 0) -> float:
    """Seconds for one stage's forward over a ragged batch (what the emulator's Pacer sleeps to).

    spans: (new tokens, context after them) per sequence; a prefill chunk of t tokens from
    position 0 is (t, t), a decode step is (1, c), a verification block is (gamma + 1, c).
    Attention of a span reads on average c - t/2 positions (t/2 for a whole prompt, as in
    stage_prefill_s; c for one decode token, as in stage_decode_s). The LM head runs on
    `logit_rows` rows (last stage only)."""
    work = [span_work(mc, n_layers, t, c) for t, c in spans]
    flops = sum(f for f, _ in work) + last * logit_rows * mc.head_flops_per_token
    nbytes = mc.stage_weight_bytes(n_layers, first, last) + sum(b for _, b in work)
    return float(roofline(flops, nbytes, device))


def prefill_time_s(args: ModelArgs, device: DeviceProfile, n_layers: int, n_tokens: int,
                   dtype: str = "fp16", last: bool = False) -> float:
    """Emulator entry point: seconds for `device` to prefill `n_tokens` through `n_layers` layers."""
    return float(stage_prefill_s(model_costs(args, dtype), device, n_layers, n_tokens, last))


def decode_time_s(args: ModelArgs, device: DeviceProfile, n_layers: int, batch: int, context_len: int,
                  dtype: str = "fp16", last: bool = False) -> float:
    """Emulator entry point: seconds for one decode/verify step of `batch` sequences (each with
    `context_len` cached tokens; a verify pass of gamma tokens is batch = gamma)."""
    return float(stage_decode_s(model_costs(args, dtype), device, n_layers, batch, context_len, last))


def pipeline_s(stage_s: Sequence[float], hop_s: Sequence[float]) -> tuple[float, float]:
    """(occupancy, latency) of one pass through a pipeline: stage i takes stage_s[i], the link
    after it hop_s[i] (k - 1 links). A new item may enter every `occupancy` seconds (the slowest
    stage or link); one item takes `latency` (every stage and link in turn)."""
    occupancy = max(max(stage_s), max(hop_s, default=0.0))
    return float(occupancy), float(sum(stage_s) + sum(hop_s))


def decode_iteration_s(stage_s, hop_s, ring_s, micro: int):
    """Seconds for every sequence of a batch, cut into `micro` micro-batches that follow each
    other through the pipeline, to get one more token. stage_s: one micro-batch on each stage
    (k rows); hop_s: the k - 1 links between stages; ring_s: the link from the last stage back
    to the first (the sampled tokens). Either the slowest stage or link is busy all the time
    (micro x occupancy) or the ring is latency-bound (one micro-batch's round trip). Rows may
    be numpy arrays (one column per batch composition)."""
    stage_s, hop_s = np.asarray(stage_s, dtype=float), np.asarray(hop_s, dtype=float)
    occupancy = np.maximum(stage_s.max(axis=0), hop_s.max(axis=0, initial=0.0))
    return np.maximum(micro * occupancy, stage_s.sum(axis=0) + hop_s.sum(axis=0) + ring_s)


def transfer_s(nbytes: float, mbps: float) -> float:
    """Serialisation time of `nbytes` at `mbps` megabits per second."""
    return nbytes * BITS_PER_BYTE / (mbps * 1e6)


def link_time_s(nbytes: float, rtt_ms: float, bandwidth_mbps: float) -> float:
    """One-way transfer: half the round trip plus serialisation."""
    return rtt_ms / 2000.0 + transfer_s(nbytes, bandwidth_mbps)


def path_mbps(a: DeviceProfile, b: DeviceProfile, link_mbps: float | None) -> float:
    """Bandwidth of one transfer a -> b: the slowest of a's port, b's port and the zone link."""
    bw = min(a.network_mbps, b.network_mbps)
    return bw if link_mbps is None else min(bw, link_mbps)
