"""A small, fast GGUF reader: metadata + memory-mapped tensor data.

`gguf.GGUFReader` builds numpy views for every metadata string and takes ~5 s
on SmolLM2's 49k-token vocabulary; this parser reads the same header with
`struct` in ~0.1 s. Dequantization: the types llama.cpp's small models ship in
(F32, F16, Q4_0, Q4_1, Q8_0) by torch, with the same fp32 operations in the same
order as the `gguf` package (bit for bit, tested), 3.5x faster than its numpy (0.78 ->
0.22 s for SmolLM2-135M Q4_1 on one core, bench/load.py: every node of a mesh loads its
layers this way); every other type by `gguf.quants.dequantize`.

Layout (GGUF v2/v3, little-endian): "GGUF", u32 version, u64 n_tensors,
u64 n_kv; n_kv x (string key, u32 type, value); n_tensors x (string name,
u32 n_dims, u64 dims[n_dims] (ne0 first), u32 ggml_type, u64 offset); then
tensor data at the next multiple of `general.alignment` (default 32).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshllm.errors import ModelFileError

MAX_NESTING = 8  # metadata arrays of arrays: llama.cpp's own files nest one level
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
       7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: (rows, ..., ne0)
    ggml_type: int
    offset: int  # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    def __init__(self, path: str | Path, header_only: bool = False):
        """`header_only`: the file holds the header alone (fetched over the mesh for its metadata:
        tensor_cache.HEADER); the tensor directory is read, no tensor's bytes are expected."""
        self.path, self.header_only = Path(path), header_only
        try:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as e:
            raise ModelFileError(f"{path}: cannot open: {e}") from None
        if bytes(self._mm[:4]) != b"GGUF":
            raise ModelFileError(f"{path}: not a GGUF file (bad magic)")
        self._buf = memoryview(self._mm)
        self._pos = 4
        try:
            self._parse()
        except ModelFileError:
            raise  # it names the file already
        except (struct.error, IndexError, ValueError, UnicodeDecodeError, OverflowError) as e:
            raise ModelFileError(f"{path}: truncated or corrupt GGUF header ({e})") from None

    # -- parsing ------------------------------------------------------------------------
    def _read(self, fmt: str):
        v = struct.unpack_from(fmt, self._buf, self._pos)[0]
        self._pos += struct.calcsize(fmt)
        return v

    def _str(self) -> str:
        n = self._read("<Q")
        s = bytes(self._buf[self._pos:self._pos + n]).decode("utf-8")
        if len(s.encode()) != n:
            raise ValueError("string runs past the end of the file")
        self._pos += n
        return s

    def _value(self, vtype: int, depth: int = 0):
        if vtype == _STRING:
            return self._str()
        if vtype in _SCALARS:
            return self._read(_SCALARS[vtype])
        if vtype == _ARRAY:
            itype, n = self._read("<I"), self._read("<Q")
            if itype in _NP:
                arr = np.frombuffer(self._buf, dtype=_NP[itype], count=n, offset=self._pos)
                self._pos += arr.nbytes
                return arr.tolist()
            if depth >= MAX_NESTING:  # 100,000 levels deep was a RecursionError
                raise ValueError(f"metadata arrays nested more than {MAX_NESTING} deep")
            return [self._value(itype, depth + 1) for _ in range(n)]
        raise ValueError(f"unknown metadata value type {vtype}")

    def _parse(self) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        version = self._read("<I")
        if version not in (2, 3):
            raise ModelFileError(f"{self.path}: GGUF version {version} is not supported (2, 3)")
        n_tensors, n_kv = self._read("<Q"), self._read("<Q")
        self.fields: dict[str, object] = {}
        for _ in range(n_kv):
            key = self._str()
            self.fields[key] = self._value(self._read("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._str()
            dims = [self._read("<Q") for _ in range(self._read("<I"))]
            infos.append((name, tuple(reversed(dims)), self._read("<I"), self._read("<Q")))
        align = self.fields.get("general.alignment", 32)
        if not isinstance(align, int) or isinstance(align, bool) or align <= 0 or align % 8:
            raise ValueError(f"general.alignment must be a positive multiple of 8, got {align!r:.40}")
        data_start = self.data_start = (self._pos + align - 1) // align * align  # header = bytes before it
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, gtype, off in infos:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(gtype)]
            n = math.prod(shape)  # Python ints: np.prod wrapped 2^32 x 2^32 round to 0 bytes
            info = TensorInfo(name, shape, gtype, data_start + off, n // block * size)
            if not self.header_only and info.offset + info.nbytes > len(self._mm):
                raise ModelFileError(f"{self.path}: tensor {name} runs past the end of the file (truncated?)")
            self.tensors[name] = info

    # -- tensors --------------------------------------------------------------------------
    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes, shaped (rows, bytes_per_row) (memory-mapped, read-only)."""
        t = self.tensors[name]
        rows = math.prod(t.shape[:-1]) if len(t.shape) > 1 else 1
        return self._mm[t.offset:t.offset + t.nbytes].reshape(rows, -1)

    def dequantize(self, name: str, rows: tuple[int, int] | None = None) -> np.ndarray:
        """fp32 array in torch order (rows, ..., ne0); of a 2-D tensor's `rows` [a, b) only if given."""
        return dequantize_tensor(self.raw(name), self.tensors[name], rows)

    def header_bytes(self) -> memoryview:
        """The metadata and tensor directory (everything before the tensor data)."""
        return self._buf[:self.data_start]


def tensor_nbytes(shape: tuple[int, ...], ggml_type: int) -> int:
    """Bytes of a tensor of `shape` (torch order) stored as `ggml_type`; ValueError if they do not fit
    its blocks (an unknown type, or a row that is not a whole number of blocks)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    if not shape or shape[-1] % block:
        raise ValueError(f"shape {shape} is not whole {GGMLQuantizationType(ggml_type).name} blocks of {block}")
    return math.prod(shape) // block * size


# the types dequantized here: ggml type id -> bytes per block of 32 weights (F32, F16: per weight)
_FAST = {0: 4, 1: 2, 2: 18, 3: 20, 8: 34}  # F32, F16, Q4_0, Q4_1, Q8_0


def dequantize_tensor(raw: np.ndarray, t: TensorInfo, rows: tuple[int, int] | None = None) -> np.ndarray:
    """A tensor's raw bytes shaped (rows, bytes_per_row), from a GGUF file or the mesh's tensor cache
    -> a writable fp32 array in torch order (rows, ..., ne0). With `rows` = (a, b), a 2-D tensor's
    rows [a, b) only (a row is whole blocks: the same values as those rows of the whole)."""
    if rows is not None:
        if len(t.shape) != 2:
            raise ValueError(f"{t.name}: rows of a {len(t.shape)}-D tensor")
        a, b = rows
        raw = raw[a:b]
        t = TensorInfo(t.name, (raw.shape[0], t.shape[1]), t.ggml_type, 0, raw.nbytes)
    if t.ggml_type in _FAST:
        return _dequantize_fast(raw, t)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    arr = dequantize(raw, GGMLQuantizationType(t.ggml_type))
    return np.array(arr, dtype=np.float32).reshape(t.shape)  # a writable copy


def _dequantize_fast(raw: np.ndarray, t: TensorInfo) -> np.ndarray:
    """F32, F16, Q4_0, Q4_1, Q8_0 as gguf.quants computes them (fp32: the scale d times the
    quant, plus the minimum m for Q4_1; a block's low nibbles are its first 16 weights)."""
    import torch

    b = torch.from_numpy(np.array(raw, dtype=np.uint8).reshape(-1))  # a copy of the bytes: writable
    kind = t.ggml_type
    if kind == 0:
        out = b.view(torch.float32)
    elif kind == 1:
        out = b.view(torch.float16).float()
    else:
        b = b.view(-1, _FAST[kind])
        d = b[:, 0:2].contiguous().view(torch.float16).float()
        if kind == 8:
            out = b[:, 2:].contiguous().view(torch.int8).float().mul_(d)
        else:
            qs = b[:, 4:] if kind == 3 else b[:, 2:]
            q = torch.cat((qs & 0x0F, qs >> 4), dim=1)
            if kind == 2:
                out = (q.to(torch.int8) - 8).float().mul_(d)
            else:
                out = q.float().mul_(d).add_(b[:, 2:4].contiguous().view(torch.float16).float())
    return out.reshape(t.shape).numpy()
