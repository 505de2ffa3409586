"""Single-process generation: the reference oracle every mesh test compares against.

`prefill` and `decode_one_token` are short free functions over the one shard
Transformer (here holding all layers), in the manner of gpt-fast's generate.py.
`python launch.py --reference --prompt TEXT [--chat] [--json]` runs `reference_main`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from meshllm.engine.kvcache import KVCache
from meshllm.engine.model import SeqSpan, Transformer, last_rows
from meshllm.engine.sampling import SamplingParams, choose_tokens
from meshllm.errors import InputError

log = logging.getLogger("meshllm.engine.generate")


@dataclass(frozen=True)
class GenerationOptions:
    max_tokens: int = 48
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    chat: bool = False

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p)


@dataclass
class GenResult:
    prompt_token_ids: list[int]
    token_ids: list[int]
    margins: list[float]
    finish_reason: str  # "length" | "stop"


def prefill(model: Transformer, cache: KVCache, seq_id: int, ids: list[int]) -> torch.Tensor:
    """Run the prompt; returns the logits (1, V) after its last token."""
    spans = [SeqSpan(seq_id, cache.length(seq_id), len(ids))]
    return model(torch.tensor(ids), spans, cache, logits_rows=last_rows(spans))


def decode_one_token(model: Transformer, cache: KVCache, seq_id: int, token: int) -> torch.Tensor:
    return model(torch.tensor([token]), [SeqSpan(seq_id, cache.length(seq_id), 1)], cache)


def generate(model: Transformer, prompt_ids: list[int], opts: GenerationOptions,
             eos_ids: set[int] = frozenset()) -> GenResult:
    if not prompt_ids:
        raise InputError("the prompt encodes to zero tokens")
    room = model.args.max_seq_len - len(prompt_ids)
    if room < 1:
        raise InputError(f"prompt of {len(prompt_ids)} tokens exceeds the context of {model.args.max_seq_len}")
    budget = min(opts.max_tokens, room)  # (a --max-tokens of 10**9 asked for 23 TB of KV cache)
    cache = model.new_cache()
    cache.allocate(0, len(prompt_ids) + budget)
    logits = prefill(model, cache, 0, prompt_ids)
    out, marg = [], []
    while True:
        (tok,), (m,) = choose_tokens(logits, opts.sampling, opts.seed, len(out))
        out.append(tok)
        marg.append(m)
        if tok in eos_ids or len(out) == budget:
            return GenResult(list(prompt_ids), out, marg, "stop" if tok in eos_ids else "length")
        logits = decode_one_token(model, cache, 0, tok)


def available_bytes() -> float | None:
    """MemAvailable of /proc/meminfo (what can be allocated without swapping), None elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024.0 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def check_room(args, dtype: str) -> None:
    """InputError when the whole model cannot fit this host's available memory: the reference
    loads all of it in one process (a 70b model ended in a MemoryError traceback, exit 1)."""
    from meshllm.partition.cost import model_costs

    mc = model_costs(args, dtype)
    need = mc.weight_bytes  # (as held: a draft's quantized layers; its fp32 load may peak above it)
    have = available_bytes()
    if have is not None and need > have:
        raise InputError(f"--reference loads the whole model in this process: {args.name} needs ~{need / 1e9:.1f} GB "
                         f"({dtype} weights), this host has {have / 1e9:.1f} GB available (a smaller --dtype, a "
                         "draft, or a bigger host; the mesh splits it across nodes)")


def load_for_reference(model_spec: str, draft: str | None, group_size: int, dtype: str):
    """(model, tokenizer) for the reference: the target, or its quantized draft."""
    from meshllm.defaults import GROUP_SIZES
    from meshllm.engine.tokenizer import load_tokenizer
    from meshllm.engine.weights import load_quantized, load_transformer, resolve_model
    from meshllm.shapes import draft_group_problem

    if draft not in (None, "w4a16", "w8a16"):
        raise InputError(f"--draft {draft!r} is not a draft; known: w4a16, w8a16 (without --draft: the target)")
    if group_size not in GROUP_SIZES:
        raise InputError(f"--group-size must be one of {', '.join(map(str, GROUP_SIZES))}, got {group_size}")
    src = resolve_model(model_spec)
    if draft == "w4a16" and (problem := draft_group_problem(src.args, group_size)):
        raise InputError(f"--group-size {problem}")
    check_room(src.args, "int4" if draft == "w4a16" else "int8" if draft else "fp32" if dtype == "float32" else "bf16")
    tok = load_tokenizer(src)
    t0 = time.perf_counter()
    if draft:
        model = load_quantized(src, draft, group_size)  # as a drafter builds it
    else:
        model = load_transformer(src, dtype=torch.float32 if dtype == "float32" else torch.bfloat16)
    log.info("loaded %s%s in %.1f s", src.name, f" ({draft} g{group_size} draft)" if draft else "",
             time.perf_counter() - t0)
    return model, tok


def reference_main(model_spec: str, prompts: list[str], opts: GenerationOptions, draft: str | None = None,
                   group_size: int = 64, dtype: str = "float32") -> tuple[dict, str]:
    """Run the reference; returns (the README's JSON object, human-readable text)."""
    model, tok = load_for_reference(model_spec, draft, group_size, dtype)
    results = []
    for p in prompts:
        text = tok.render_chat([{"role": "user", "content": p}]) if opts.chat else p
        r = generate(model, tok.encode(text), opts, tok.eos_ids)
        shown = [t for t in r.token_ids if t not in tok.eos_ids]
        results.append({"prompt_token_ids": r.prompt_token_ids, "token_ids": r.token_ids, "margins": r.margins,
                        "text": tok.decode(shown), "finish_reason": r.finish_reason})
    obj = results[0] if len(results) == 1 else {"results": results}
    return obj, "\n---\n".join(r["text"] for r in results)
