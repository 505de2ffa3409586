"""The meshllm wire protocol: message types, frame layout, tensor encoding. No sockets.

A message is one ZeroMQ multipart message (ROUTER/DEALER add their routing frames
in front; the transport strips them before `decode`):

    frame 0   header      PREAMBLE (8 bytes, big-endian) + msgpack map
                          PREAMBLE = MAGIC b"MLLM" | version u8 | type u8 | n_tensors u16
                          the map holds the type's fields, plus
                            "src":  sender node id (str, optional; "" for CLI clients)
                            "zone": sender zone (str, optional; used for link shaping)
                            "rid":  request id (int, optional; a reply echoes it)
                            "t":    [{"dtype": str, "shape": [int, ...]}, ...] one per tensor frame
    frame 1.. tensor      raw C-contiguous bytes of tensor i, native little-endian;
                          bfloat16 travels as its uint16 bit pattern (dtype "bfloat16")

Limits: MAX_MESSAGE_BYTES in all, MAX_HEADER_BYTES for frame 0, MAX_TENSORS frames,
MAX_NDIM dimensions. Anything else is a ProtocolError naming what was wrong; data
from the network is never unpickled. Field types are checked per message type
(SCHEMAS); unknown extra fields are kept, for forward compatibility within a version.

Tensors decode to `TensorBuf` (dtype name, shape, buffer): `.numpy()` and `.torch()`
make zero-copy views, so a node that carries no tensors never imports torch.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import msgpack
import numpy as np

MAGIC = b"MLLM"
VERSION = 1
PREAMBLE = struct.Struct(">4sBBH")  # magic, version, type, n_tensors
MAX_MESSAGE_BYTES = 512 * 1024 * 1024  # a 1.7B-model KV transfer of a long prompt fits
MAX_HEADER_BYTES = 1024 * 1024
MAX_TENSORS = 16
MAX_NDIM = 8
RESERVED = {"src", "zone", "rid", "t"}  # header keys every message may carry


class ProtocolError(ValueError):
    """A frame that is not a valid meshllm message (bad magic, version, type, size, header, tensor)."""


class MsgType(IntEnum):
    HELLO = 1  # join request: my id, address, device, roles, incarnation (zone: the header's)
    PEERS = 2  # gossip: the sender's view of the mesh (reply to HELLO, and broadcast)
    HEARTBEAT = 3  # liveness + load, on PUB
    LEAVE = 4  # graceful leave
    STATUS_REQ = 5
    STATUS_REP = 6
    ERROR = 7  # code + message; code "duplicate_id" refuses a newcomer
    PING = 8  # echo request (latency probes, benches)
    PONG = 9
    ACTIVATIONS = 10  # hidden states between pipeline stages
    KV_TRANSFER = 11  # K and V of one sequence for a layer range (prefill -> decode)
    DRAFT = 12  # a drafter's block of gamma tokens + their draft probabilities
    VERDICT = 13  # accepted count + correction token for one block
    CAPACITY = 14  # a decode replica's verification capacity, on PUB
    GENERATE_REQ = 15  # client -> gateway
    TOKENS = 16  # gateway -> client, streamed


_STR, _INT, _NUM, _BOOL = str, int, (int, float), bool
_LIST, _MAP = (list, tuple), dict
_OPT_INT, _OPT_STR = (int, type(None)), (str, type(None))

# Required fields per type: name -> accepted python types; and the tensor names, in frame order.
SCHEMAS: dict[MsgType, tuple[dict[str, Any], tuple[str, ...]]] = {
    MsgType.HELLO: ({"node": _STR, "incarnation": _INT, "address": _STR, "device": _MAP,
                     "roles": _LIST}, ()),
    MsgType.PEERS: ({"node": _STR, "peers": _LIST}, ()),
    MsgType.HEARTBEAT: ({"node": _STR, "incarnation": _INT, "seq": _INT, "load": _MAP}, ()),
    MsgType.LEAVE: ({"node": _STR, "incarnation": _INT}, ()),
    MsgType.STATUS_REQ: ({}, ()),
    MsgType.STATUS_REP: ({"status": _MAP}, ()),
    MsgType.ERROR: ({"code": _STR, "message": _STR}, ()),
    MsgType.PING: ({}, ()),
    MsgType.PONG: ({}, ()),
    # spans: [[seq_id, start_pos, n_tokens], ...] matching the rows of `hidden` (T, dim)
    MsgType.ACTIVATIONS: ({"plan_version": _INT, "layer": _INT, "spans": _LIST}, ("hidden",)),
    # k, v: (n_layers, n_kv_heads, length, head_dim) for layers [start, end)
    MsgType.KV_TRANSFER: ({"seq_id": _STR, "layers": _LIST, "length": _INT}, ("k", "v")),
    # probs: (gamma, vocab) draft distribution of each drafted token (empty for greedy)
    MsgType.DRAFT: ({"tenant": _STR, "seq_id": _STR, "block": _INT, "start": _INT, "tokens": _LIST},
                    ("probs",)),
    MsgType.VERDICT: ({"tenant": _STR, "seq_id": _STR, "block": _INT, "accepted": _INT,
                       "correction": _OPT_INT}, ()),
    MsgType.CAPACITY: ({"node": _STR, "free_slots": _INT, "queue": _INT, "plan_version": _INT}, ()),
    MsgType.GENERATE_REQ: ({"request_id": _STR, "prompt": _OPT_STR, "prompt_token_ids": _LIST,
                            "max_tokens": _INT, "temperature": _NUM, "seed": _INT}, ()),
    MsgType.TOKENS: ({"request_id": _STR, "token_ids": _LIST, "finished": _BOOL, "finish_reason": _OPT_STR},
                     ()),
}

_TYPES = {int(t): t for t in MsgType}  # a dict lookup: Enum.__call__ is slow on the hot path

# Wire dtype name -> numpy dtype used for the bytes. bfloat16 is carried as uint16.
DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype("<f4"), "float16": np.dtype("<f2"), "bfloat16": np.dtype("<u2"),
    "float64": np.dtype("<f8"), "int64": np.dtype("<i8"), "int32": np.dtype("<i4"), "int16": np.dtype("<i2"),
    "int8": np.dtype("i1"), "uint8": np.dtype("u1"), "bool": np.dtype("?"),
}
_NP_TO_WIRE = {v: k for k, v in DTYPES.items() if k != "bfloat16"}
_NP_TO_WIRE[np.dtype("<u2")] = "uint16"
DTYPES["uint16"] = np.dtype("<u2")


@dataclass(frozen=True)
class TensorBuf:
    """A tensor as it travels: wire dtype name, shape, and a buffer of its bytes (zero-copy)."""

    dtype: str
    shape: tuple[int, ...]
    data: memoryview
    # what `data` views, when it is a whole received frame (e.g. a zmq.Frame): forwarding a tensor
    # re-sends that object, which the socket layer shares by reference instead of tracking a new buffer
    source: Any = field(default=None, compare=False, repr=False)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def numpy(self) -> np.ndarray:
        """A read-only view; bfloat16 comes back as its uint16 bit pattern."""
        return np.frombuffer(self.data, dtype=DTYPES[self.dtype]).reshape(self.shape)

    def torch(self):  # -> torch.Tensor; torch is imported only by nodes that carry tensors
        import torch

        arr = self.numpy()
        if self.dtype == "bfloat16":
            return torch.from_numpy(arr.view(np.int16).copy()).view(torch.bfloat16).reshape(self.shape)
        return torch.from_numpy(arr.copy())


def as_tensorbuf(t: Any) -> TensorBuf:
    """numpy array, torch tensor or TensorBuf -> TensorBuf (C-contiguous, no pickling)."""
    if isinstance(t, TensorBuf):
        return t
    if type(t).__module__.startswith("torch"):
        t_c = t.detach().cpu().contiguous()
        if str(t_c.dtype) == "torch.bfloat16":
            import torch

            arr = t_c.view(torch.int16).numpy().view(np.uint16)
            return TensorBuf("bfloat16", tuple(arr.shape), memoryview(arr).cast("B"))
        t = t_c.numpy()
    if not isinstance(t, np.ndarray):
        raise TypeError(f"cannot send {type(t).__name__} as a tensor (numpy array or torch tensor)")
    arr = np.ascontiguousarray(t)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    name = _NP_TO_WIRE.get(arr.dtype)
    if name is None:
        raise TypeError(f"unsupported tensor dtype {arr.dtype} (supported: {', '.join(sorted(DTYPES))})")
    return TensorBuf(name, tuple(int(s) for s in arr.shape), memoryview(arr).cast("B") if arr.size else
                     memoryview(b""))


@dataclass
class Message:
    type: MsgType
    fields: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, TensorBuf] = field(default_factory=dict)
    src: str = ""
    zone: str = ""
    rid: int = 0

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def make(mtype: MsgType, tensors: dict[str, Any] | None = None, **fields: Any) -> Message:
    """Build a message, checking its fields and tensors against SCHEMAS (raises ProtocolError)."""
    reserved = RESERVED & set(fields)
    if reserved:
        raise ProtocolError(f"{MsgType(mtype).name}: field names {sorted(reserved)} are reserved for the header")
    msg = Message(MsgType(mtype), fields, {k: as_tensorbuf(v) for k, v in (tensors or {}).items()})
    _check_fields(msg.type, msg.fields)
    names = SCHEMAS[msg.type][1]
    if set(msg.tensors) != set(names):
        raise ProtocolError(f"{msg.type.name}: tensors must be {list(names)}, got {sorted(msg.tensors)}")
    return msg


def encode(msg: Message) -> list[bytes | memoryview]:
    """Message -> frames. Tensor frames are zero-copy views of the caller's arrays."""
    names = SCHEMAS[msg.type][1]
    bufs = [as_tensorbuf(msg.tensors[n]) for n in names]
    head: dict[str, Any] = dict(msg.fields)
    head.update(src=msg.src, zone=msg.zone, rid=msg.rid, t=[{"dtype": b.dtype, "shape": list(b.shape)} for b in bufs])
    packed = msgpack.packb(head, use_bin_type=True)
    if len(packed) + PREAMBLE.size > MAX_HEADER_BYTES:
        raise ProtocolError(f"{msg.type.name}: header of {len(packed)} bytes exceeds {MAX_HEADER_BYTES}")
    total = len(packed) + sum(b.nbytes for b in bufs)
    if total > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"{msg.type.name}: message of {total} bytes exceeds MAX_MESSAGE_BYTES={MAX_MESSAGE_BYTES}")
    return [PREAMBLE.pack(MAGIC, VERSION, int(msg.type), len(bufs)) + packed,
            *(b.data if b.source is None else b.source for b in bufs)]


def decode(frames: list[Any]) -> Message:
    """Frames (bytes, memoryview or zmq.Frame) -> Message. Raises only ProtocolError."""
    if not frames:
        raise ProtocolError("empty message: no frames")
    views = [_view(f) for f in frames]
    total = sum(v.nbytes for v in views)
    if total > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {total} bytes exceeds MAX_MESSAGE_BYTES={MAX_MESSAGE_BYTES}")
    mtype, n_tensors, head = _decode_header(views[0])
    if n_tensors != len(views) - 1:
        raise ProtocolError(f"{mtype.name}: preamble says {n_tensors} tensor frames, got {len(views) - 1}")
    src, zone, rid, specs = head.pop("src", ""), head.pop("zone", ""), head.pop("rid", 0), head.pop("t", [])
    if not isinstance(src, str) or not isinstance(zone, str) or not isinstance(rid, int) or isinstance(rid, bool):
        raise ProtocolError(f"{mtype.name}: src/zone must be strings and rid an integer")
    names = SCHEMAS[mtype][1]
    if not isinstance(specs, list) or len(specs) != n_tensors or n_tensors != len(names):
        raise ProtocolError(f"{mtype.name}: expects {len(names)} tensors, header describes "
                            f"{len(specs) if isinstance(specs, list) else specs!r}, frames {n_tensors}")
    tensors = {n: _decode_tensor(mtype, n, s, v, f)
               for n, s, v, f in zip(names, specs, views[1:], frames[1:], strict=True)}
    _check_fields(mtype, head)
    return Message(mtype, head, tensors, src, zone, rid)


def _view(f: Any) -> memoryview:
    buf = getattr(f, "buffer", f)  # zmq.Frame exposes .buffer
    try:
        return memoryview(buf).cast("B")
    except TypeError as e:
        raise ProtocolError(f"frame is not a byte buffer: {type(f).__name__}") from e


def _decode_header(v: memoryview) -> tuple[MsgType, int, dict]:
    if v.nbytes < PREAMBLE.size:
        raise ProtocolError(f"header frame of {v.nbytes} bytes is shorter than the {PREAMBLE.size}-byte preamble")
    if v.nbytes > MAX_HEADER_BYTES:
        raise ProtocolError(f"header frame of {v.nbytes} bytes exceeds MAX_HEADER_BYTES={MAX_HEADER_BYTES}")
    magic, version, tcode, n_tensors = PREAMBLE.unpack_from(v)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r}): not a meshllm message")
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version} (this node speaks {VERSION})")
    mtype = _TYPES.get(tcode)
    if mtype is None:
        raise ProtocolError(f"unknown message type {tcode}")
    if n_tensors > MAX_TENSORS:
        raise ProtocolError(f"{mtype.name}: {n_tensors} tensor frames exceeds MAX_TENSORS={MAX_TENSORS}")
    try:
        head = msgpack.unpackb(v[PREAMBLE.size:], raw=False, strict_map_key=True, max_ext_len=0)
    except (ValueError, TypeError, msgpack.UnpackException, msgpack.ExtraData, RecursionError) as e:
        raise ProtocolError(f"{mtype.name}: header is not valid msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(head, dict):
        raise ProtocolError(f"{mtype.name}: header must be a msgpack map, got {type(head).__name__}")
    return mtype, n_tensors, head


def _decode_tensor(mtype: MsgType, name: str, spec: Any, v: memoryview, frame: Any) -> TensorBuf:
    where = f"{mtype.name}: tensor {name!r}"
    if not isinstance(spec, dict) or not isinstance(spec.get("dtype"), str) or not isinstance(spec.get("shape"), list):
        raise ProtocolError(f"{where}: descriptor must be a map with 'dtype' (str) and 'shape' (list)")
    dtype, shape = spec["dtype"], spec["shape"]
    if dtype not in DTYPES:
        raise ProtocolError(f"{where}: unknown dtype {dtype!r} (known: {', '.join(sorted(DTYPES))})")
    if len(shape) > MAX_NDIM or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s for s in shape):
        raise ProtocolError(f"{where}: shape {shape!r} must be at most {MAX_NDIM} non-negative integers")
    count = 1
    for s in shape:
        count *= s
        if count > MAX_MESSAGE_BYTES:
            raise ProtocolError(f"{where}: shape {shape!r} is larger than MAX_MESSAGE_BYTES")
    expected = count * DTYPES[dtype].itemsize
    if expected != v.nbytes:
        raise ProtocolError(f"{where}: {dtype}{shape} needs {expected} bytes, frame has {v.nbytes}")
    return TensorBuf(dtype, tuple(shape), v, frame)


def _check_fields(mtype: MsgType, fields: dict) -> None:
    for name, types in SCHEMAS[mtype][0].items():
        if name not in fields:
            raise ProtocolError(f"{mtype.name}: missing field {name!r}")
        val = fields[name]
        bad_bool = isinstance(val, bool) and bool not in (types if isinstance(types, tuple) else (types,))
        if bad_bool or not isinstance(val, types):
            raise ProtocolError(f"{mtype.name}: field {name!r} has type {type(val).__name__}")
