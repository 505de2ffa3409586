"""Llama-family transformer in plain torch. One implementation for everything.

A `Transformer` is built as a *shard*: layers ``[start, end)``, with the token
embedding when ``start == 0`` and the final norm + LM head when ``end ==
n_layers`` (both overridable). The reference, every pipeline stage and the
draft model are all instances of this one class.

The forward pass is *batched and ragged*: one call extends several sequences,
each by its own number of new tokens at its own position. Tokens are packed
flat, shape (T, ...) with T = sum of the per-sequence token counts, so there is
no padding anywhere; the linear layers run once over all T rows and attention
runs per sequence against that sequence's own KV slot.

Q/K weights use the GGUF (interleaved) RoPE layout: adjacent pairs
(x[2i], x[2i+1]) are rotated together. HF checkpoints are permuted into this
layout at load time (weights.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshllm.engine.kvcache import KVCache
from meshllm.shapes import ModelArgs


@dataclass(frozen=True)
class SeqSpan:
    """One sequence's part of a ragged batch: `n_tokens` new tokens starting at `start_pos`."""

    seq_id: int
    start_pos: int
    n_tokens: int


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rope_tables(args: ModelArgs, n_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables of shape (n_pos, head_dim // 2), fp32."""
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float64) / args.head_dim))
    ang = torch.outer(torch.arange(n_pos, dtype=torch.float64), inv)
    return ang.cos().float(), ang.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs. x: (T, h, hd); cos/sin: (T, hd/2)."""
    xf = x.float().unflatten(-1, (-1, 2))  # (T, h, hd/2, 2)
    x0, x1 = xf[..., 0], xf[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    out = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1)
    return out.flatten(-2).type_as(x)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Causal GQA attention of one sequence. q: (nh, t, hd); k, v: (nkv, L, hd) -> (t, nh*hd).

    Query head h reads KV head h // (nh // nkv). A single new token (decode, the hot path)
    skips SDPA's generic machinery: it attends to every cached position.
    """
    nh, t, hd = q.shape
    nkv = k.shape[0]
    if t == 1:  # fp32 math: CPU bf16 bmm of these tiny shapes is slower than the upcast
        qg = q.reshape(nkv, nh // nkv, hd).float()  # the query heads of one KV group together
        s = (qg @ k.float().transpose(1, 2)) * hd ** -0.5  # (nkv, g, L)
        return (s.softmax(-1) @ v.float()).reshape(1, nh * hd).to(q.dtype)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # (nh, t, hd)
    return o.transpose(0, 1).reshape(t, nh * hd)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads, self.n_kv, self.hd = args.n_heads, args.n_kv_heads, args.head_dim
        # wq, wk, wv fused into one projection (fewer kernel calls per token); see fuse_state_dict
        self.wqkv = nn.Linear(args.dim, (args.n_heads + 2 * self.n_kv) * self.hd, bias=False)
        self.wo = nn.Linear(args.n_heads * self.hd, args.dim, bias=False)

    def forward(self, x: torch.Tensor, ctx: _BatchContext) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.wqkv(x).split([self.n_heads * self.hd, self.n_kv * self.hd, self.n_kv * self.hd], -1)
        q = apply_rope(q.view(T, self.n_heads, self.hd), ctx.cos, ctx.sin)  # (T, nh, hd)
        k = apply_rope(k.view(T, self.n_kv, self.hd), ctx.cos, ctx.sin)  # (T, nkv, hd)
        v = v.view(T, self.n_kv, self.hd)
        out = torch.empty(T, self.n_heads * self.hd, dtype=q.dtype)
        out_g, q_g = out.view(T, self.n_kv, -1, self.hd), q.view(T, self.n_kv, -1, self.hd)
        li, scale = self.layer_id - ctx.cache.start, self.hd ** -0.5
        for span, (lo, hi), mask, slab in zip(ctx.spans, ctx.row_ranges, ctx.masks, ctx.slabs):
            if slab is None:
                kc, vc = ctx.cache.write(self.layer_id, span.seq_id, span.start_pos, k[lo:hi], v[lo:hi])
                # kc, vc: (nkv, L, hd) with L = start_pos + n_tokens
                out[lo:hi] = attend(q[lo:hi].transpose(0, 1), kc, vc, mask)
                continue
            # `attend`'s one-token case for an fp32 row with the fewest torch calls: the slab holds
            # this sequence's K/V for all of the shard's layers (n_local, nkv, L, hd), so a layer
            # costs a select, not a slice chain; the same kernels in the same order as `attend`,
            # so the values are bit-identical (tests/test_model.py)
            kc, vc = slab[0][li], slab[1][li]  # the new position is the last
            kc[:, -1] = k[lo]
            vc[:, -1] = v[lo]
            s = torch.bmm(q_g[lo], kc.transpose(1, 2))  # query heads grouped by their KV head
            s.mul_(scale)
            torch.bmm(s.softmax(-1), vc, out=out_g[lo])
        return self.wo(out)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.hidden = args.hidden_dim
        self.w13 = nn.Linear(args.dim, 2 * args.hidden_dim, bias=False)  # gate (w1) and up (w3), fused
        self.w2 = nn.Linear(args.hidden_dim, args.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).split(self.hidden, -1)
        return self.w2(F.silu(gate) * up)


_FUSED = {"attention.wqkv": ("attention.wq", "attention.wk", "attention.wv"),
          "feed_forward.w13": ("feed_forward.w1", "feed_forward.w3")}


def fuse_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint names (wq/wk/wv, w1/w3) -> this module's fused projections (row concatenation)."""
    out = dict(sd)
    for prefix in {m.group(1) for k in sd if (m := re.match(r"(layers\.\d+)\.", k))}:  # "layers.i"
        for fused, parts in _FUSED.items():
            names = [f"{prefix}.{p}.weight" for p in parts]
            if all(n in out for n in names):
                out[f"{prefix}.{fused}.weight"] = torch.cat([out.pop(n) for n in names])
    return out


def unfuse_state_dict(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """The inverse of fuse_state_dict (for writing checkpoints)."""
    sizes = {"attention.wqkv": [args.n_heads * args.head_dim] + [args.n_kv_heads * args.head_dim] * 2,
             "feed_forward.w13": [args.hidden_dim] * 2}
    out = {}
    for k, v in sd.items():
        fused = next((f for f in _FUSED if k.endswith(f + ".weight")), None)
        if fused is None:
            out[k] = v
            continue
        prefix = k[: -len(fused + ".weight")]
        for part, w in zip(_FUSED[fused], v.split(sizes[fused])):
            out[f"{prefix}{part}.weight"] = w
    return out


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.attention = Attention(args, layer_id)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x: torch.Tensor, ctx: _BatchContext) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), ctx)
        return h + self.feed_forward(self.ffn_norm(h))


@dataclass
class _BatchContext:
    spans: list[SeqSpan]
    row_ranges: list[tuple[int, int]]
    masks: list[torch.Tensor | None]  # per span: (t, L) bool, None when t == 1
    cos: torch.Tensor  # (T, hd/2)
    sin: torch.Tensor
    cache: KVCache
    # per span: for one fp32 token, its K and V slabs for all local layers (n_local, nkv,
    # start_pos + 1, hd), room for the new position made (Attention.forward); else None
    slabs: list[tuple[torch.Tensor, torch.Tensor] | None]


class Transformer(nn.Module):
    """Layers [start, end) of a Llama-family model; see the module docstring."""

    def __init__(self, args: ModelArgs, start: int = 0, end: int | None = None,
                 embed: bool | None = None, head: bool | None = None):
        super().__init__()
        end = args.n_layers if end is None else end
        if not 0 <= start < end <= args.n_layers:
            raise ValueError(f"bad layer range [{start}, {end}) for {args.n_layers} layers")
        self.args, self.start, self.end = args, start, end
        self.has_embed = start == 0 if embed is None else embed
        self.has_head = end == args.n_layers if head is None else head
        self.tok_embeddings = None
        if self.has_embed:  # on the meta device (a shard to load into) without an init draw: normal_
            # there goes through torch._refs and imports torch._dynamo, 1.2-1.9 s of every node's start
            meta = torch.empty(0).is_meta
            weight = torch.empty(args.vocab_size, args.dim) if meta else None
            self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim, _weight=weight)
        self.layers = nn.ModuleList(TransformerBlock(args, i) for i in range(start, end))
        self.norm = RMSNorm(args.dim, args.norm_eps) if self.has_head else None
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False) if self.has_head else None
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None  # fp32 tables, built on first use

    def sub_shard(self, start: int, end: int) -> Transformer:
        """Layers [start, end) of this shard as a shard of their own, sharing the weights (no copy):
        a node that holds more than its new stage needs (a warm spare, a shrunk stage) serves it
        without reading the model file again. Drop this shard afterwards to free the rest."""
        if not self.start <= start < end <= self.end:
            raise ValueError(f"[{start}, {end}) is not inside this shard's [{self.start}, {self.end})")
        if start == 0 and not self.has_embed or end == self.args.n_layers and not self.has_head:
            raise ValueError("the sub-shard needs an embedding or a head this shard does not hold")
        with torch.device("meta"):
            sub = Transformer(self.args, start, end)
        sub.layers = nn.ModuleList(self.layers[start - self.start:end - self.start])
        sub.tok_embeddings = self.tok_embeddings if sub.has_embed else None
        sub.norm, sub.output = (self.norm, self.output) if sub.has_head else (None, None)
        sub._rope = self._rope
        return sub.eval()

    @classmethod
    def joined(cls, parts: list[Transformer]) -> Transformer:
        """Consecutive shards (each one's end the next one's start) as one shard, sharing their
        weights (no copy): the embedding of the first, the head of the last."""
        first, last = parts[0], parts[-1]
        if any(p.end != q.start for p, q in zip(parts, parts[1:])):
            raise ValueError(f"shards {[(p.start, p.end) for p in parts]} are not consecutive")
        with torch.device("meta"):
            out = cls(first.args, first.start, last.end, first.has_embed, last.has_head)
        out.layers = nn.ModuleList(layer for p in parts for layer in p.layers)
        out.tok_embeddings = first.tok_embeddings
        out.norm, out.output = last.norm, last.output
        out._rope = next((p._rope for p in parts if p._rope is not None), None)
        return out.eval()

    def new_cache(self, dtype: torch.dtype | None = None) -> KVCache:
        dtype = dtype or next(self.parameters()).dtype
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            dtype = torch.float32  # quantized shards keep float activations
        return KVCache(self.start, self.end, self.args.n_kv_heads, self.args.head_dim, dtype)

    def _context(self, spans: list[SeqSpan], cache: KVCache) -> _BatchContext:
        rows, masks, pos, lo = [], [], [], 0
        for s in spans:
            if s.n_tokens < 1:
                raise ValueError(f"sequence {s.seq_id}: a span needs at least one token")
            if s.start_pos + s.n_tokens > self.args.max_seq_len:
                raise ValueError(f"sequence {s.seq_id}: position {s.start_pos + s.n_tokens} "
                                 f"exceeds max_seq_len {self.args.max_seq_len}")
            rows.append((lo, lo + s.n_tokens))
            lo += s.n_tokens
            p = torch.arange(s.start_pos, s.start_pos + s.n_tokens)
            pos.append(p)
            total = s.start_pos + s.n_tokens
            masks.append(None if s.n_tokens == 1 else torch.arange(total)[None, :] <= p[:, None])
        positions = torch.cat(pos)
        if self._rope is None:
            self._rope = rope_tables(self.args, self.args.max_seq_len)
        cos, sin = self._rope
        fp32 = cache.dtype == torch.float32
        slabs = [cache.decode_slab(s.seq_id, s.start_pos) if fp32 and s.n_tokens == 1 else None for s in spans]
        return _BatchContext(spans, rows, masks, cos[positions], sin[positions], cache, slabs)

    @torch.inference_mode()
    def forward(self, x: torch.Tensor, spans: list[SeqSpan], cache: KVCache,
                logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        """x: token ids (T,) if this shard embeds, else hidden states (T, dim).

        Returns hidden states (T, dim), or logits (R, vocab) if this shard has the
        head, where R = len(logits_rows) (default: all T rows). Each span's cache
        slot must hold exactly `start_pos` tokens; afterwards it holds start_pos + n_tokens.
        """
        ctx = self._context(spans, cache)
        h = (self.tok_embeddings(x) if self.has_embed else x).to(self.act_dtype)
        for layer in self.layers:
            h = layer(h, ctx)
        cache.commit(spans)
        if not self.has_head:
            return h
        if logits_rows is not None:
            h = h[logits_rows]
        return self.output(self.norm(h)).float()

    @property
    def act_dtype(self) -> torch.dtype:
        """dtype of the hidden states between layers (and between pipeline stages)."""
        return self.layers[0].attention_norm.weight.dtype


HAS_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
PACK_BATCH_HINT = 32  # rows the oneDNN weight layout is tuned for; measured best for 1..64 rows here


class PackedLinear(nn.Module):
    """A bias-free linear layer whose weight is held once, in oneDNN's blocked layout.

    Why: MKL's fp32 GEMM is slow at small row counts on the CPUs measured here (a 5-row step of
    SmolLM2 cost 2.4x a 1-row step), so batched decode and draft verification would not pay.
    oneDNN with a prepacked weight runs 1 row as fast as the best GEMV layout and 8 rows in about
    1.2x the time of 1 (bench/engine.py). Same values as the dense weight; `weight` unpacks them
    on demand (quantization, checkpoints), and state dicts carry the dense tensor."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_BATCH_HINT)

    @property
    def weight(self) -> torch.Tensor:
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.packed, None, "none", [], "")
        return y.reshape(*shape[:-1], self.out_features)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.weight

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        w = state_dict.get(prefix + "weight")
        if w is not None:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.to(self.packed.dtype).contiguous(),
                                                                 PACK_BATCH_HINT)

    def __deepcopy__(self, memo: dict) -> PackedLinear:  # oneDNN tensors have no storage to copy
        return PackedLinear(self.weight)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.packed.dtype}"


def pack_linear_weights(model: nn.Module) -> nn.Module:
    """Swap every float nn.Linear (no bias) for a PackedLinear, in place (no-op without oneDNN)."""
    if not HAS_ONEDNN:
        return model
    for name, child in list(model.named_children()):
        if (isinstance(child, nn.Linear) and child.bias is None
                and child.weight.dtype in (torch.float32, torch.bfloat16)):
            setattr(model, name, PackedLinear(child.weight))
        else:
            pack_linear_weights(child)
    return model


def last_rows(spans: list[SeqSpan]) -> torch.Tensor:
    """Row index of each span's last token in the packed batch (for prefill logits)."""
    ends = torch.tensor([s.n_tokens for s in spans]).cumsum(0)
    return ends - 1
