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

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from meshllm.kvcache import KVCache


@dataclass(frozen=True)
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    hidden_dim: int  # FFN inner size
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    name: str = field(default="custom", compare=False)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def __post_init__(self) -> None:
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(f"model {self.name}: dim/heads/kv_heads do not divide ({self})")
        if self.head_dim % 2:
            raise ValueError(f"model {self.name}: head_dim must be even for RoPE")


# Named registry (gpt-fast style). Shape-only entries (no weights here) serve the planner
# and simulator; weights.py knows which names have weights on this machine.
transformer_configs: dict[str, ModelArgs] = {
    "smollm2-135m": ModelArgs(576, 30, 9, 3, 49152, 1536, 1e-5, 100000.0, 8192, True),
    "smollm2-1.7b": ModelArgs(2048, 24, 32, 32, 49152, 8192, 1e-5, 130000.0, 8192, True),
    "llama-2-7b": ModelArgs(4096, 32, 32, 32, 32000, 11008, 1e-5, 10000.0, 4096),
    "llama-2-70b": ModelArgs(8192, 80, 64, 8, 32000, 28672, 1e-5, 10000.0, 4096),
    "llama-3-8b": ModelArgs(4096, 32, 32, 8, 128256, 14336, 1e-5, 500000.0, 8192),
    # Tiny random-weight configs for tests of mechanics (like gpt-fast's stories15M).
    "tiny": ModelArgs(64, 4, 4, 2, 320, 128, 1e-5, 10000.0, 256, True),
    "tiny-untied": ModelArgs(48, 6, 6, 2, 300, 96, 1e-6, 500000.0, 256, False),
}
transformer_configs = {k: replace(v, name=k) for k, v in transformer_configs.items()}


def model_args(name: str) -> ModelArgs:
    """Registry lookup; an unknown name lists the valid ones."""
    if name not in transformer_configs:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(transformer_configs))}")
    return transformer_configs[name]


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


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads, self.n_kv, self.hd = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.hd, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv * self.hd, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv * self.hd, bias=False)
        self.wo = nn.Linear(args.n_heads * self.hd, args.dim, bias=False)

    def forward(self, x: torch.Tensor, ctx: _BatchContext) -> torch.Tensor:
        T = x.shape[0]
        q = self.wq(x).view(T, self.n_heads, self.hd)  # (T, nh, hd)
        k = self.wk(x).view(T, self.n_kv, self.hd)  # (T, nkv, hd)
        v = self.wv(x).view(T, self.n_kv, self.hd)
        q, k = apply_rope(q, ctx.cos, ctx.sin), apply_rope(k, ctx.cos, ctx.sin)
        outs = []
        for span, (lo, hi), mask in zip(ctx.spans, ctx.row_ranges, ctx.masks):
            kc, vc = ctx.cache.write(self.layer_id, span.seq_id, span.start_pos, k[lo:hi], v[lo:hi])
            # kc, vc: (nkv, L, hd) with L = start_pos + n_tokens
            qs = q[lo:hi].transpose(0, 1)  # (nh, t, hd)
            o = F.scaled_dot_product_attention(qs, kc, vc, attn_mask=mask, enable_gqa=True)
            outs.append(o.transpose(0, 1).reshape(hi - lo, -1))
        return self.wo(torch.cat(outs) if len(outs) > 1 else outs[0])


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.hidden_dim, bias=False)  # gate
        self.w3 = nn.Linear(args.dim, args.hidden_dim, bias=False)  # up
        self.w2 = nn.Linear(args.hidden_dim, args.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


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
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim) if self.has_embed else None
        self.layers = nn.ModuleList(TransformerBlock(args, i) for i in range(start, end))
        self.norm = RMSNorm(args.dim, args.norm_eps) if self.has_head else None
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False) if self.has_head else None
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None  # fp32 tables, built on first use

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
        return _BatchContext(spans, rows, masks, cos[positions], sin[positions], cache)

    @torch.inference_mode()
    def forward(self, x: torch.Tensor, spans: list[SeqSpan], cache: KVCache,
                logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        """x: token ids (T,) if this shard embeds, else hidden states (T, dim).

        Returns hidden states (T, dim), or logits (R, vocab) if this shard has the
        head, where R = len(logits_rows) (default: all T rows). Each span's cache
        slot must hold exactly `start_pos` tokens; afterwards it holds start_pos + n_tokens.
        """
        ctx = self._context(spans, cache)
        h = (self.tok_embeddings(x) if self.has_embed else x).to(self._act_dtype())
        for layer in self.layers:
            h = layer(h, ctx)
        cache.commit(spans)
        if not self.has_head:
            return h
        if logits_rows is not None:
            h = h[logits_rows]
        return self.output(self.norm(h)).float()

    def _act_dtype(self) -> torch.dtype:
        n = self.layers[0].attention_norm.weight
        return n.dtype


def last_rows(spans: list[SeqSpan]) -> torch.Tensor:
    """Row index of each span's last token in the packed batch (for prefill logits)."""
    ends = torch.tensor([s.n_tokens for s in spans]).cumsum(0)
    return ends - 1
