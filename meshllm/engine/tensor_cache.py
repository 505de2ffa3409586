"""The GGUF tensors of one model fetched over the mesh, kept on disk for the next start.

A node without the model file fetches its layer range's raw (still quantized) tensors from a
peer (roles/weights_fetch.py) into a directory of this layout:

    <root>/<model name>/index.json      {"format": 1, "model", "fingerprint", "args": {ModelArgs},
                                          "tensors": {name: {"type", "shape", "nbytes"}},
                                          "sha256": {name: hex}}   the verified tensors' hashes
    <root>/<model name>/<tensor>.bin    a complete tensor, verified against its sha256
    <root>/<model name>/<tensor>.part   the first bytes of a tensor being fetched (a contiguous
                                        prefix: its size is where the fetch resumes)

The file's header (everything before the tensor data: its metadata, the tokenizer among them) is
listed as one more entry, HEADER, of raw bytes (its sha256 is the index's fingerprint): a gateway
without the file fetches it for the tokenizer (roles/model_info.py).

`index.json` is the serving peer's directory (validated by `parse_index`, the same check for the
network and for this file), so a node with a complete cache builds its shard with no network at
all. `TensorCache` reads like a `GGUFFile` (`tensors`, `raw`, `dequantize`), and
engine/weights.py loads a shard from it through the same dequantization as from the file.
Raw bytes and JSON only: nothing here is ever unpickled.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import numpy as np

from meshllm.engine.gguf_file import TensorInfo, dequantize_tensor, tensor_nbytes
from meshllm.engine.sources import ModelSource, check_gguf_shapes
from meshllm.shapes import ModelArgs, checked_args

FORMAT = 1
INDEX_FILE = "index.json"
HEADER = "gguf-header"  # the file's header (metadata: the tokenizer) as one more "tensor" of raw bytes
HEADER_TYPE = 24  # GGML I8: one byte per element, so the header's entry is [24, [n], n]
MAX_HEADER_BYTES = 256 << 20  # a GGUF header with a 256k-token vocabulary is ~20 MB
MAX_TENSORS = 100_000
MAX_TENSOR_BYTES = 1 << 40
_TENSOR_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}")  # a file name, never a path
_SHA256 = re.compile(r"[0-9a-f]{64}")


def is_tensor_name(v: Any) -> bool:
    return isinstance(v, str) and _TENSOR_NAME.fullmatch(v) is not None and ".." not in v


def is_sha256(v: Any) -> bool:
    return isinstance(v, str) and _SHA256.fullmatch(v) is not None


def safe_dir_name(model: str) -> str:
    """A model name as one directory name (no separators, no leading dot)."""
    s = re.sub(r"[^A-Za-z0-9_.\-]", "_", model).lstrip(".")
    return s[:120] or "model"


def args_to_wire(args: ModelArgs) -> dict[str, Any]:
    return asdict(args)


def args_from_wire(d: Any) -> ModelArgs:
    """ModelArgs fields from the network (or index.json) -> ModelArgs; ValueError if malformed."""
    if not isinstance(d, dict) or set(d) != {f.name for f in fields(ModelArgs)}:
        raise ValueError(f"args must be a map of exactly the ModelArgs fields, got {sorted(d)[:12] if isinstance(d, dict) else d!r:.80}")
    try:
        return checked_args(d)
    except ValueError as e:
        raise ValueError(f"args.{e}") from None


def parse_index(model: str, fingerprint: Any, args: Any, tensors: Any) -> dict[str, Any]:
    """A model's directory as a peer sent it (WEIGHTS_INDEX) -> the index.json object; ValueError if
    anything is malformed: names that are not plain file names, sizes that do not match their type
    and shape, shapes or counts out of bounds."""
    if not is_sha256(fingerprint):
        raise ValueError(f"fingerprint must be a sha256 hex digest, got {fingerprint!r:.80}")
    a = args_from_wire(args)
    if not isinstance(tensors, dict) or not 0 < len(tensors) <= MAX_TENSORS:
        raise ValueError(f"tensors must be a map of 1 to {MAX_TENSORS} entries")
    out = {}
    for name, entry in tensors.items():
        if not is_tensor_name(name):
            raise ValueError(f"tensor name {name!r:.80} is not a plain name")
        if not (isinstance(entry, (list, tuple)) and len(entry) == 3 and isinstance(entry[1], (list, tuple))):
            raise ValueError(f"tensor {name}: entry must be [type, [shape], nbytes], got {entry!r:.80}")
        gtype, shape, nbytes = entry
        if not (isinstance(gtype, int) and 0 <= gtype < 1024 and 0 < len(shape) <= 4
                and all(isinstance(s, int) and not isinstance(s, bool) and 0 < s < 1 << 40 for s in shape)):
            raise ValueError(f"tensor {name}: bad type {gtype!r:.20} or shape {shape!r:.60}")
        try:
            want = tensor_nbytes(tuple(shape), gtype)
        except (ValueError, KeyError) as e:
            raise ValueError(f"tensor {name}: {e}") from None
        if nbytes != want or not 0 < want <= MAX_TENSOR_BYTES:
            raise ValueError(f"tensor {name}: {nbytes!r:.20} bytes, its type and shape need {want}")
        if name == HEADER and (gtype != HEADER_TYPE or len(shape) != 1 or want > MAX_HEADER_BYTES):
            raise ValueError(f"the file header's entry must be [{HEADER_TYPE}, [n], n] with n <= {MAX_HEADER_BYTES}, "
                             f"got {entry!r:.80}")
        out[name] = {"type": gtype, "shape": list(shape), "nbytes": want}
    # every tensor the model needs, with the shape its metadata implies (a peer's index that did not
    # match its own args failed only at load, after the plan: now it is malformed here)
    check_gguf_shapes(f"{model} (a peer's index)", a, {n: tuple(e["shape"]) for n, e in out.items() if n != HEADER})
    return {"format": FORMAT, "model": model, "fingerprint": fingerprint, "args": args_to_wire(a), "tensors": out}


def file_sha256(path: Path, block: int = 4 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


class TensorCache:
    """One model's fetched tensors on disk. Reads like a GGUFFile; writes a tensor as a `.part`
    prefix that becomes `.bin` only once its sha256 matches."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        self.index: dict[str, Any] | None = None
        path = self.dir / INDEX_FILE
        if path.is_file():
            try:
                d = json.loads(path.read_text())
                idx = parse_index(d["model"], d["fingerprint"], d["args"],
                                  {n: [e["type"], e["shape"], e["nbytes"]] for n, e in d["tensors"].items()})
                idx["sha256"] = {n: h for n, h in d.get("sha256", {}).items() if n in idx["tensors"] and is_sha256(h)}
                self.index = idx
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                self.index = None  # unreadable: fetched again from scratch

    # -- reading (the GGUFFile interface engine/weights.py loads through) ------------------------
    @property
    def args(self) -> ModelArgs:
        return args_from_wire(self.index["args"])

    @property
    def tensors(self) -> dict[str, TensorInfo]:
        """The verified tensors on disk."""
        t = self.index["tensors"] if self.index else {}
        return {n: TensorInfo(n, tuple(e["shape"]), e["type"], 0, e["nbytes"]) for n, e in t.items()
                if self.complete(n)}

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes, shaped (rows, bytes_per_row) (memory-mapped, read-only)."""
        e = self.index["tensors"][name]
        rows = int(np.prod(e["shape"][:-1])) if len(e["shape"]) > 1 else 1
        return np.memmap(self._bin(name), dtype=np.uint8, mode="r").reshape(rows, -1)

    def dequantize(self, name: str, rows: tuple[int, int] | None = None) -> np.ndarray:
        e = self.index["tensors"][name]
        return dequantize_tensor(self.raw(name), TensorInfo(name, tuple(e["shape"]), e["type"], 0, e["nbytes"]), rows)

    def source(self) -> ModelSource:
        return ModelSource(self.index["model"], "cache", self.dir, self.args)

    def header_path(self) -> Path | None:
        """The file's header, fetched and verified (its sha256 is the index's fingerprint), or None."""
        ok = self.index is not None and HEADER in self.index["tensors"] and self.verify(HEADER)
        return self._bin(HEADER) if ok and self.index["sha256"][HEADER] == self.index["fingerprint"] else None

    # -- state -------------------------------------------------------------------------------
    def nbytes(self, name: str) -> int:
        return self.index["tensors"][name]["nbytes"]

    def complete(self, name: str) -> bool:
        """Fetched and verified (its sha256 recorded and a file of its size present)."""
        if self.index is None or name not in self.index["sha256"]:
            return False
        p = self._bin(name)
        return p.is_file() and p.stat().st_size == self.nbytes(name)

    def verify(self, name: str) -> bool:
        """Hash a complete tensor's file again (disk corruption); a mismatch deletes it."""
        if not self.complete(name):
            return False
        if file_sha256(self._bin(name)) == self.index["sha256"][name]:
            return True
        self._bin(name).unlink(missing_ok=True)
        self.index["sha256"].pop(name, None)
        self._save()
        return False

    def part_size(self, name: str) -> int:
        """Bytes of the tensor already fetched (where its fetch resumes); a bad `.part` is dropped."""
        p = self._part(name)
        n = p.stat().st_size if p.is_file() else 0
        if n > self.nbytes(name):
            p.unlink()
            return 0
        return n

    # -- writing -------------------------------------------------------------------------------
    def set_index(self, index: dict[str, Any]) -> None:
        """Adopt a peer's directory (from `parse_index`). A different fingerprint means a different
        file under this name: everything fetched from the old one is deleted."""
        old = self.index
        self.dir.mkdir(parents=True, exist_ok=True)
        if old is not None and old["fingerprint"] != index["fingerprint"]:
            for p in self.dir.iterdir():
                if p.suffix in (".bin", ".part"):
                    p.unlink(missing_ok=True)
            old = None
        keep = {n: h for n, h in (old or {}).get("sha256", {}).items() if n in index["tensors"]}
        self.index = {**index, "sha256": keep}
        self._save()

    def open_part(self, name: str, offset: int):
        """An unbuffered append handle on the tensor's `.part`, truncated to `offset` (its prefix)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        f = open(self._part(name), "ab", buffering=0)  # the fetch loop owns and closes it
        f.truncate(offset)
        return f

    def finish(self, name: str, sha256: str) -> bool:
        """The `.part` is complete: keep it as `.bin` if it hashes to `sha256`, else delete it."""
        part = self._part(name)
        if not part.is_file() or part.stat().st_size != self.nbytes(name) or file_sha256(part) != sha256:
            part.unlink(missing_ok=True)
            return False
        os.replace(part, self._bin(name))
        self.index["sha256"][name] = sha256
        self._save()
        return True

    def discard(self, name: str) -> None:
        self._part(name).unlink(missing_ok=True)

    def _save(self) -> None:
        tmp = self.dir / (INDEX_FILE + ".tmp")
        tmp.write_text(json.dumps(self.index, separators=(",", ":")))
        os.replace(tmp, self.dir / INDEX_FILE)

    def _bin(self, name: str) -> Path:
        return self.dir / f"{name}.bin"

    def _part(self, name: str) -> Path:
        return self.dir / f"{name}.part"
