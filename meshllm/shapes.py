"""Model shapes: `ModelArgs` and the named registry (gpt-fast style). Pure: no torch.

The planner and simulator work from shapes alone, so shape-only entries of real models
(`llama-3-8b`, `llama-2-70b`, ...) live here beside the models that have weights on this
machine (engine/weights.py knows which) and the tiny test configs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from meshllm.defaults import GROUP_SIZES


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


_ARG_INTS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "hidden_dim", "max_seq_len")
_ARG_FLOATS = ("norm_eps", "rope_theta")


def checked_args(d: dict) -> ModelArgs:
    """ModelArgs from a model's metadata (a GGUF file's, an HF config.json's, a peer's index),
    every field checked; ValueError naming the first bad one (a head count of 0 was a
    ZeroDivisionError, a string dim a TypeError deep in the model)."""
    for k in _ARG_INTS:
        if k in d and not (isinstance(d[k], int) and not isinstance(d[k], bool) and 0 < d[k] < 1 << 31):
            raise ValueError(f"{k} must be a positive integer, got {d[k]!r:.40}")
    for k in _ARG_FLOATS:
        v = d.get(k, 1.0)
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0):
            raise ValueError(f"{k} must be a positive number, got {v!r:.40}")
    if not isinstance(d.get("tie_embeddings", False), bool) or not isinstance(d.get("name", ""), str):
        raise ValueError("tie_embeddings must be true or false and name a string")
    floats = {k: float(d[k]) for k in _ARG_FLOATS if k in d}
    return ModelArgs(**{**d, **floats})


def draft_group_problem(args: ModelArgs, group_size: int) -> str | None:
    """Why a W4A16 draft of this model cannot quantize in groups of `group_size` input columns (None:
    it can): every linear layer's inputs (the model's dim, the FFN's inner size) split into whole groups."""
    if args.dim % group_size == 0 and args.hidden_dim % group_size == 0:
        return None
    fits = [str(g) for g in GROUP_SIZES if args.dim % g == 0 and args.hidden_dim % g == 0]
    return (f"{group_size} does not divide {args.name}'s dim {args.dim} and FFN size {args.hidden_dim} (the inputs "
            f"of its linear layers); " + (f"it may be {', '.join(fits)}" if fits else "none of the group sizes does"))


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
