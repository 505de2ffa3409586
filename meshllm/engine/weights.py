"""Model files -> shard state dicts and shards (where the files are and their shapes: sources.py).

Only the tensors a shard needs are read: GGUF and safetensors are memory-mapped
and a stage holding layers 10-20 never touches the other layers' bytes.
Q/K are kept in GGUF's interleaved RoPE layout; HF checkpoints are permuted
into it here. A GGUF model's tensors come from its file or, on a node that
fetched them over the mesh (roles/weights_fetch.py), from the tensor cache
(engine/tensor_cache.py): the same raw bytes, the same dequantization, the same
state dict.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from meshllm.engine.model import Transformer, fuse_state_dict, pack_linear_weights
from meshllm.engine.sources import (  # noqa: F401  (re-exported: weights.py is the loading API)
    _GGUF_LAYER,
    _HF_LAYER,
    EMBEDDED,
    INSTALL_HINT,
    LLAMA_ARCHS,
    TEST_CONFIGS,
    ModelSource,
    _gguf_args,
    _hf_args,
    _wanted,
    embedded_gguf_path,
    gguf_reader,
    gguf_shard_names,
    resolve_model,
    resolve_model_args,
)
from meshllm.errors import LoadCancelled, ModelFileError


# -- GGUF ------------------------------------------------------------------------------------
def tensor_reader(src: ModelSource):
    """Where a GGUF model's tensors are read from: its file, or the tensors fetched over the mesh.
    Both answer `tensors` (name -> TensorInfo) and `dequantize(name)` the same way."""
    if src.kind == "cache":
        from meshllm.engine.tensor_cache import TensorCache

        return TensorCache(src.path)
    return gguf_reader(src.path)


def _stopped(stop: Callable[[], bool] | None) -> None:
    """Between two tensors of a load: LoadCancelled if `stop()` says so."""
    if stop is not None and stop():
        raise LoadCancelled("the load was stopped")


def _gguf_state(src: ModelSource, start: int, end: int, embed: bool, head: bool,
                skip: dict | tuple = (), stop: Callable[[], bool] | None = None) -> dict[str, torch.Tensor]:
    reader = tensor_reader(src)
    have = reader.tensors
    sd = {}
    for ours, name in gguf_shard_names(src.args, start, end, embed, head).items():
        if ours in skip:
            continue
        _stopped(stop)
        if name not in have:
            raise ModelFileError(f"{src.path}: tensor {name!r} missing")
        sd[ours] = torch.from_numpy(reader.dequantize(name))
    return sd


# -- HF safetensors ----------------------------------------------------------------------------
def hf_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF rotate-half Q/K rows -> GGUF interleaved pairs (what llama.cpp's converter does)."""
    out, inp = w.shape
    return w.reshape(n_heads, 2, out // n_heads // 2, inp).transpose(1, 2).reshape(out, inp)


def interleaved_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    out, inp = w.shape
    return w.reshape(n_heads, out // n_heads // 2, 2, inp).transpose(1, 2).reshape(out, inp)


def _hf_handles(src: ModelSource) -> dict:
    """Checkpoint tensor name -> the open safetensors file that holds it."""
    from safetensors import safe_open

    handles = {}
    for f in sorted(src.path.glob("*.safetensors")):
        h = safe_open(str(f), framework="pt")
        for k in h.keys():
            handles[k] = h
    return handles


def _hf_names(src: ModelSource, handles: dict, start: int, end: int, embed: bool, head: bool) -> dict[str, str]:
    """Our state-dict name -> the checkpoint's, for shard [start, end) (a tied head: the embedding)."""
    head_name = "lm_head.weight" if "lm_head.weight" in handles else "model.embed_tokens.weight"
    want = _wanted(start, end, embed, head, "model.layers.{i}.{name}.weight", _HF_LAYER,
                   ("model.embed_tokens.weight", "model.norm.weight", head_name))
    for key in want.values():
        if key not in handles:
            raise ModelFileError(f"{src.path}: tensor {key!r} missing")
    return want


def _hf_state(src: ModelSource, start: int, end: int, embed: bool, head: bool,
              skip: dict | tuple = (), stop: Callable[[], bool] | None = None) -> dict[str, torch.Tensor]:
    a = src.args
    handles = _hf_handles(src)
    sd = {}
    for ours, key in _hf_names(src, handles, start, end, embed, head).items():
        if ours in skip:
            continue
        _stopped(stop)
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
                     head: bool | None = None, pack: bool = True,
                     stop: Callable[[], bool] | None = None) -> Transformer:
    """Build the shard [start, end) of a model and load only its weights. `pack=False` leaves the
    linears unpacked for a model about to be quantized (packing them for oneDNN is wasted there:
    it was ~0.85 s of a drafter's ~2.7 s start). `stop`, asked before each tensor is read: when it
    says so, LoadCancelled (what was read is freed)."""
    src = resolve_model(spec) if isinstance(spec, str) else spec
    with torch.device("meta"):
        model = Transformer(src.args, start, end, embed, head)
    if src.kind == "random":
        sd = _random_state(model)
    else:
        sd = _file_state(src, model.start, model.end, model.has_embed, model.has_head, stop=stop)
    model.load_state_dict(fuse_state_dict(sd), strict=False, assign=True)
    _check_loaded(src, model)
    model = model.to(dtype).eval()
    if pack:
        model = pack_linear_weights(model)
    del sd
    release_freed_memory()
    return model


def _file_state(src: ModelSource, start: int, end: int, embed: bool, head: bool,
                skip: dict | tuple = (), stop: Callable[[], bool] | None = None) -> dict[str, torch.Tensor]:
    """The fp32 tensors of layers [start, end) (named from 0, as a shard of them names them), and
    of the embedding / final norm and head if asked, read from a model file or the tensor cache
    (the tensors named in `skip`, our names, left out)."""
    if src.kind == "hf":
        return _hf_state(src, start, end, embed, head, skip, stop)
    return _gguf_state(src, start, end, embed, head, skip, stop)  # "gguf" or "cache"


def _check_loaded(src: ModelSource, model: Transformer) -> None:
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ModelFileError(f"{src.name}: weights missing for {missing[:3]}")


def _renumber(key: str, first: int) -> str:
    """A shard's state-dict name (its layers counted from 0) -> the whole model's."""
    m = re.match(r"layers\.(\d+)\.", key)
    return f"layers.{int(m.group(1)) + first}.{key[m.end():]}" if m else key


class FileRows:
    """A 2-D tensor of a model file, read (and dequantized) to fp32 only a block of rows at a
    time, as it is sliced (quant.by_rows): of a GGUF model (its file or the tensor cache,
    `reader`) or of an HF checkpoint (`reader`: the open safetensors file that holds it)."""

    def __init__(self, reader, name: str) -> None:
        self.reader, self.name = reader, name
        self.hf = not hasattr(reader, "tensors")
        self.shape = tuple(reader.get_slice(name).get_shape() if self.hf else reader.tensors[name].shape)

    def __getitem__(self, rows: slice) -> torch.Tensor:
        a, b, _ = rows.indices(self.shape[0])
        if self.hf:
            return self.reader.get_slice(self.name)[a:b].float()
        return torch.from_numpy(self.reader.dequantize(self.name, (a, b)))


def load_quantized(spec: str | ModelSource, quant: str, group_size: int,
                   stop: Callable[[], bool] | None = None) -> Transformer:
    """The whole model as a W4A16 / W8A16 draft (engine/quant.py), quantized as it loads: each
    layer read in fp32, quantized and its fp32 copy freed before the next; the embedding and
    LM head (the largest tensors) a block of rows at a time. A drafter's peak
    memory is the draft plus one fp32 layer, not the whole fp32 target (4 bytes a weight: ~32 GB
    for llama-3-8b, whose W4A16 draft the planner places on an 8 GB device). Bit for bit the draft
    `quantize_model` makes of `load_transformer(spec, pack=False)`. A random test model is drawn
    whole (it is small). `stop`: as load_transformer's."""
    from meshllm.engine.quant import ACT_DTYPE, by_rows, quantize_model, quantize_weight

    src = resolve_model(spec) if isinstance(spec, str) else spec
    if src.kind == "random":
        return quantize_model(load_transformer(src, pack=False), quant, group_size)
    n = src.args.n_layers
    with torch.device("meta"):
        model = Transformer(src.args)
    if src.kind == "hf":
        handles = _hf_handles(src)
        names = _hf_names(src, handles, 0, 0, True, True)
        rows = {k: FileRows(handles[names[k]], names[k]) for k in ("tok_embeddings.weight", "output.weight")}
    else:
        reader = tensor_reader(src)
        names = gguf_shard_names(src.args, n, n, True, True)
        rows = {k: FileRows(reader, names[k]) for k in ("tok_embeddings.weight", "output.weight")}
    embedding = by_rows(lambda w: {"w": w.to(ACT_DTYPE)}, rows["tok_embeddings.weight"])["w"]
    model.tok_embeddings.weight = torch.nn.Parameter(embedding, requires_grad=False)
    model.output = quantize_weight(rows["output.weight"], quant, group_size)
    in_rows = {k: r.name for k, r in rows.items()}  # read a block of rows at a time: left out below
    for start, end in [(0, 0)] + [(i, i + 1) for i in range(n)] + [(n, n)]:
        sd = {_renumber(k, start): v.float() for k, v in
              _file_state(src, start, end, start == end == 0, start == end == n, skip=in_rows, stop=stop).items()}
        model.load_state_dict(fuse_state_dict(sd), strict=False, assign=True)
        del sd
        quantize_model(model, quant, group_size)  # the piece just loaded; the rest is still meta
    release_freed_memory()
    _check_loaded(src, model)
    return model.eval()


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
