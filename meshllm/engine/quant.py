"""Weight-only quantization: W4A16 (group-wise asymmetric int4) and W8A16 (per-channel int8).

A state-dict transform (`quantize_int4` / `quantize_int8`) plus module swaps
(`Int4Linear`, `Int8Linear`, `quantize_model`), as in gpt-fast's quantize.py.

int4 storage is real 4-bit: two weights per byte. The canonical layout packs
q[:, 2j] in the low nibble and q[:, 2j+1] in the high nibble of byte j. With the
CPU kernel (`torch.ops.aten._weight_int4pack_mm_for_cpu`) the module holds the
kernel's own packed layout instead (also N x K/2 bytes), never both. The
dequantize-then-matmul path is the fallback and the test oracle.

Dequantization: w = q * scale + min for q in [0, 15] (canonical); the kernel
uses (q - 8) * scale + zero, so zero = min + 8 * scale. Activations run in
bf16 (the "A16"); scales and zeros are bf16 too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshllm.engine.model import PackedLinear, RMSNorm

ACT_DTYPE = torch.bfloat16


def _has_op(name: str) -> bool:
    return hasattr(torch.ops.aten, name)


HAS_INT4_KERNEL = _has_op("_weight_int4pack_mm_for_cpu") and _has_op("_convert_weight_to_int4pack_for_cpu")
HAS_INT8_KERNEL = _has_op("_weight_int8pack_mm")


# -- int4: pure tensor functions -----------------------------------------------------------
def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """(N, K) ints in [0, 15] -> (N, K/2) uint8."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_nibbles(p: torch.Tensor) -> torch.Tensor:
    """(N, K/2) uint8 -> (N, K) uint8 in [0, 15]."""
    return torch.stack((p & 0x0F, p >> 4), dim=-1).flatten(-2)


ROW_BLOCK = 1 << 22  # weights per block of rows a weight is quantized in (a multiple of 64 rows)


def by_rows(fn, w, *args) -> dict[str, torch.Tensor]:
    """fn(w, *args) for a function of each output row alone (a dict of row-aligned tensors), in
    blocks of about ROW_BLOCK weights: its fp32 temporaries stay a few blocks in size, not a few
    times the weight (the LM head of llama-3-8b is 2.1 GB in fp32), and the result is the same.
    `w`: a 2-D tensor, or anything with a `shape` whose row slices are tensors (a weight read
    from the model file a block at a time: weights.FileRows)."""
    N, K = w.shape
    rows = row_block(K)
    if N <= rows:
        return fn(w[0:N], *args)
    parts = [fn(w[a:a + rows], *args) for a in range(0, N, rows)]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def row_block(k: int) -> int:
    """Rows of `k` weights in a block of by_rows: about ROW_BLOCK weights, a multiple of 64 rows."""
    return max(64, ROW_BLOCK // max(1, k) // 64 * 64)


def quantize_int4(w: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """Round-to-nearest asymmetric int4 per group of `group_size` input columns.

    w: (N, K) -> packed (N, K/2) uint8, scales and mins (N, K/group_size) bf16.
    """
    N, K = w.shape
    if K % group_size or K % 2:
        raise ValueError(f"in_features {K} is not a multiple of group_size {group_size}")
    return by_rows(_quantize_int4_rows, w, group_size)


def _quantize_int4_rows(w: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    w = w.contiguous()
    N, K = w.shape
    wg = w.float().reshape(N, K // group_size, group_size)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scales = ((hi - lo) / 15).clamp(min=1e-8).to(ACT_DTYPE)
    mins = lo.to(ACT_DTYPE)
    q = ((wg - mins.float()[..., None]) / scales.float()[..., None]).round().clamp(0, 15)
    return {"packed": pack_nibbles(q.reshape(N, K)), "scales": scales, "mins": mins}


def _kernel_pack(packed: torch.Tensor) -> dict[str, torch.Tensor]:
    """Canonical nibbles -> the CPU int4 kernel's own layout (row by row; it unpacks to int32)."""
    return {"packed": torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_nibbles(packed).int(), 2)}


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int) -> torch.Tensor:
    q = unpack_nibbles(packed).float()  # (N, K)
    N, K = q.shape
    w = q.reshape(N, K // group_size, group_size) * scales.float()[..., None] + mins.float()[..., None]
    return w.reshape(N, K)


def quantize_int8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Symmetric per-output-channel int8: (N, K) -> int8 (N, K), scales (N,) bf16."""
    return by_rows(_quantize_int8_rows, w)


def _quantize_int8_rows(w: torch.Tensor) -> dict[str, torch.Tensor]:
    w = w.contiguous()
    scales = (w.float().abs().amax(-1) / 127).clamp(min=1e-8).to(ACT_DTYPE)
    q = (w.float() / scales.float()[:, None]).round().clamp(-127, 127).to(torch.int8)
    return {"weight": q, "scales": scales}


# -- modules ----------------------------------------------------------------------------
class Int4Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, group_size: int, use_kernel: bool = HAS_INT4_KERNEL):
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.use_kernel = use_kernel and HAS_INT4_KERNEL
        n_groups = in_features // group_size
        self.register_buffer("packed", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
        if self.use_kernel:  # (K/g, N, 2): scale, zero as the kernel wants them
            self.register_buffer("scales_and_zeros", torch.zeros(n_groups, out_features, 2, dtype=ACT_DTYPE))
        else:
            self.register_buffer("scales", torch.zeros(out_features, n_groups, dtype=ACT_DTYPE))
            self.register_buffer("mins", torch.zeros(out_features, n_groups, dtype=ACT_DTYPE))

    @classmethod
    def from_quantized(cls, q: dict[str, torch.Tensor], group_size: int, use_kernel: bool = HAS_INT4_KERNEL):
        N, half_k = q["packed"].shape
        m = cls(half_k * 2, N, group_size, use_kernel)
        if m.use_kernel:
            m.packed = by_rows(_kernel_pack, q["packed"])["packed"]
            zeros = q["mins"].float() + 8 * q["scales"].float()
            m.scales_and_zeros = torch.stack((q["scales"].float().t(), zeros.t()), -1).to(ACT_DTYPE).contiguous()
        else:
            m.packed, m.scales, m.mins = q["packed"], q["scales"], q["mins"]
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(ACT_DTYPE)
        if self.use_kernel:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, self.scales_and_zeros)
        else:
            w = dequantize_int4(self.packed, self.scales, self.mins, self.group_size)
            y = F.linear(x2.float(), w).to(ACT_DTYPE)
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)


class Int8Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, use_kernel: bool = HAS_INT8_KERNEL):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.use_kernel = use_kernel and HAS_INT8_KERNEL
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.zeros(out_features, dtype=ACT_DTYPE))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(ACT_DTYPE)
        if self.use_kernel:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.weight, self.scales)
        else:
            y = F.linear(x2.float(), self.weight.float() * self.scales.float()[:, None]).to(ACT_DTYPE)
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)


def quantize_linear(lin: nn.Linear | PackedLinear, quant: str, group_size: int, use_kernel: bool = True) -> nn.Module:
    return quantize_weight(lin.weight.data, quant, group_size, use_kernel)


def quantize_weight(w, quant: str, group_size: int, use_kernel: bool = True) -> nn.Module:
    """The quantized linear layer of weight `w` (out, in): a tensor, or row blocks (`by_rows`)."""
    if quant == "w4a16":
        return Int4Linear.from_quantized(quantize_int4(w, group_size), group_size, use_kernel and HAS_INT4_KERNEL)
    if quant == "w8a16":
        q = quantize_int8(w)
        m = Int8Linear(w.shape[1], w.shape[0], use_kernel and HAS_INT8_KERNEL)
        m.weight, m.scales = q["weight"], q["scales"]
        return m
    raise ValueError(f"unknown quantization {quant!r}; known: w4a16, w8a16")


def quantize_model(model: nn.Module, quant: str = "w4a16", group_size: int = 64, use_kernel: bool = True) -> nn.Module:
    """Swap every nn.Linear (attention, FFN, LM head) for its quantized version, in place;
    norms and embeddings move to bf16 so the whole draft runs with 16-bit activations. Modules
    whose weights are still on the meta device are left as they are."""
    if quant not in ("w4a16", "w8a16"):
        raise ValueError(f"unknown draft quantization {quant!r}; known: w4a16, w8a16")
    for name, child in list(model.named_children()):
        if any(t.is_meta for t in child.parameters(recurse=False)):
            continue  # not loaded yet (weights.load_quantized loads and quantizes a piece at a time)
        if isinstance(child, (nn.Linear, PackedLinear)):
            setattr(model, name, quantize_linear(child, quant, group_size, use_kernel))
        elif isinstance(child, (nn.Embedding, RMSNorm)):
            child.to(ACT_DTYPE)
        else:
            quantize_model(child, quant, group_size, use_kernel)
    return model


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes held by the linear layers' weights (+ scales) of a model, float or quantized."""
    total = 0
    for m in model.modules():
        if isinstance(m, (nn.Linear, PackedLinear)):
            total += m.weight.nbytes
        elif isinstance(m, (Int4Linear, Int8Linear)):
            total += sum(b.nbytes for b in m.buffers())
    return total
