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
import threading
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import msgpack
import numpy as np

from meshllm.mesh.fields import MAX_SEQ_ID, ProtocolError, is_int, is_num

MAGIC = b"MLLM"
VERSION = 3  # 3: sampled verification by the target's own draw; DRAFT without q tensors
PREAMBLE = struct.Struct(">4sBBH")  # magic, version, type, n_tensors
MAX_MESSAGE_BYTES = 512 * 1024 * 1024  # a 1.7B-model KV transfer of a long prompt fits
MAX_HEADER_BYTES = 1024 * 1024
MAX_TENSORS = 16
MAX_NDIM = 8
MAX_PLAN_VERSION = 1 << 53  # plan versions grow by one per plan; far above any real count
RESERVED = {"src", "zone", "rid", "t"}  # header keys every message may carry


class MsgType(IntEnum):
    HELLO = 1  # join request: my id, address, device, roles, incarnation (zone: the header's)
    PEERS = 2  # gossip: the sender's view of the mesh (reply to HELLO, and broadcast)
    HEARTBEAT = 3  # liveness + load, on PUB
    LEAVE = 4  # graceful leave
    STATUS_REQ = 5
    STATUS_REP = 6
    ERROR = 7  # code + message; code "duplicate_id" refuses a newcomer; a reply echoes the request's rid
    PING = 8  # echo request (latency probes, benches)
    PONG = 9
    ACTIVATIONS = 10  # a micro-batch's hidden states, stage i -> stage i+1 of one replica
    KV_TRANSFER = 11  # K and V of one sequence for a layer range (prefill stage -> decode stage)
    DRAFT = 12  # a drafter's block of gamma tokens + their draft probabilities
    VERDICT = 13  # accepted count + correction token for one block
    CAPACITY = 14  # a decode replica's verification capacity, on PUB
    GENERATE_REQ = 15  # gateway -> the leader (stage 0) of a prefill or mixed replica
    TOKENS = 16  # a replica's leader -> gateway: new output tokens of one sequence
    KV_ACK = 17  # decode stage -> its leader: it holds the KV of a sequence for its layers
    RESULTS = 18  # last stage -> leader: the tokens sampled for a micro-batch
    HANDOFF = 19  # prefill leader -> decode leader: a prefilled sequence, its first token, its settings
    RELEASE = 20  # free (or abort) a sequence: gateway -> leader, leader -> its stages
    PLAN = 21  # the coordinator's versioned plan, on PUB (and re-sent to newcomers)
    SESSION = 22  # gateway -> drafter: draft for this sequence, publish on that decode replica's topic
    FAULT = 23  # emulator -> node (emulation only): drop all traffic with a zone for a while
    WEIGHTS_INDEX_REQ = 24  # a node without the model file -> a peer that has it: the model's directory?
    WEIGHTS_INDEX = 25  # its answer: the model's shape and every tensor's GGUF type, shape and size
    WEIGHTS_REQ = 26  # bytes [offset, offset + length) of one tensor, to be sent to `reply_to`
    WEIGHTS_CHUNK = 27  # those raw (still quantized) bytes + the sha256 of the whole tensor
    KV_RESERVE = 28  # gateway -> a decode (or mixed) replica's leader, before it sends a request: KV room?
    KV_GRANT = 29  # its answer, at once: the room is promised to that sequence, or not


class SpanKind(IntEnum):
    """What a span of a micro-batch is for, which says which rows need logits."""

    PREFILL = 0  # a prompt chunk that is not the last: no logits
    PREFILL_LAST = 1  # the last prompt chunk: logits of its last row (the first output token)
    DECODE = 2  # one token: logits of its row
    VERIFY = 3  # last committed token + gamma draft tokens: logits of every row


_STR, _INT, _NUM, _BOOL = str, int, (int, float), bool
_LIST, _MAP = (list, tuple), dict
_OPT_INT, _OPT_STR = (int, type(None)), (str, type(None))

# Required fields per type: name -> accepted python types; and the tensor names, in frame order.
# Sequence ids (`seq`) are non-negative 63-bit integers everywhere.
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
    # spans: [WireSpan.to_wire(), ...] in row order of `hidden` (T, dim);
    # ship: [[seq, decode replica id], ...] sequences whose KV this stage sends on after this batch;
    # verify: [[seq, [draft tokens]], ...] for VERIFY spans, read by the last stage
    MsgType.ACTIVATIONS: ({"replica": _INT, "batch": _INT, "plan_version": _INT, "spans": _LIST,
                           "ship": _LIST, "verify": _LIST}, ("hidden",)),
    # k, v: (n_layers, n_kv_heads, length, head_dim) for layers [start, end) = "layers"
    MsgType.KV_TRANSFER: ({"seq": _INT, "layers": _LIST, "length": _INT, "replica": _INT,
                           "plan_version": _INT}, ("k", "v")),
    # a block of drafts for `seq`, drafted after the committed prefix of length `start` whose hash is
    # `hash` and whose last token is `after`; optional `branch`: true when drafted in a proactive
    # branch (after one of the draft's other choices, roles/branches.py)
    MsgType.DRAFT: ({"tenant": _STR, "seq": _INT, "block": _INT, "start": _INT, "after": _INT, "hash": _INT,
                     "tokens": _LIST, "plan_version": _INT}, ()),
    # the outcome of block `block` (-1: a step without a draft): `tokens` were committed, the
    # committed prefix now has length `context` and hash `hash`; `replica` now verifies the session
    MsgType.VERDICT: ({"tenant": _STR, "seq": _INT, "block": _INT, "accepted": _INT, "tokens": _LIST,
                       "context": _INT, "hash": _INT, "replica": _INT, "finished": _BOOL}, ()),
    MsgType.CAPACITY: ({"node": _STR, "replica": _INT, "free_slots": _INT, "queue": _INT,
                        "plan_version": _INT}, ()),
    # drafter: the node drafting for this sequence ("" without speculation)
    MsgType.GENERATE_REQ: ({"seq": _INT, "prompt_token_ids": _LIST, "max_tokens": _INT, "sampling": _MAP,
                            "stop_ids": _LIST, "decode_replica": _INT, "gateway": _STR, "drafter": _STR,
                            "plan_version": _INT}, ()),
    # index: position in the output of token_ids[0]; queue_ms: the sequence's queueing so far
    MsgType.TOKENS: ({"seq": _INT, "token_ids": _LIST, "index": _INT, "finished": _BOOL,
                      "finish_reason": _OPT_STR}, ()),
    MsgType.KV_ACK: ({"seq": _INT, "node": _STR, "length": _INT, "plan_version": _INT}, ()),
    # out: [[seq, [token ids], [margins]], ...] one entry per span that needed logits
    MsgType.RESULTS: ({"replica": _INT, "batch": _INT, "plan_version": _INT, "out": _LIST}, ()),
    # tokens: the output so far (the first token after a prefill; more when a session migrates)
    MsgType.HANDOFF: ({"seq": _INT, "prompt_len": _INT, "tokens": _LIST, "max_tokens": _INT,
                       "sampling": _MAP, "stop_ids": _LIST, "gateway": _STR, "drafter": _STR,
                       "plan_version": _INT}, ()),
    MsgType.RELEASE: ({"seq": _INT, "reason": _STR}, ()),
    # positions: the most KV the sequence may come to on that replica (roles/batcher.py decode_charge)
    MsgType.KV_RESERVE: ({"seq": _INT, "replica": _INT, "positions": _INT, "plan_version": _INT}, ()),
    MsgType.KV_GRANT: ({"seq": _INT, "granted": _BOOL}, ()),
    # addresses: node id -> HOST:PORT of every node the plan names; incarnations: node id -> the
    # incarnation it was planned for (a node restarted since runs none of the sequences it held)
    # model_id: the coordinator's model file's content (engine/sources.py content_id; "": it has none)
    MsgType.PLAN: ({"version": _INT, "coordinator": _STR, "plan": _MAP, "addresses": _MAP, "incarnations": _MAP,
                    "model_id": _STR},
                   ()),
    # zones: [zone a, zone b]: a node in one drops every message from the other for `seconds`
    MsgType.FAULT: ({"zones": _LIST, "seconds": _NUM}, ()),
    # mode: "async" | "sync"; gamma: the fixed draft length, or the first one when `adaptive`;
    # optional `offset`: output tokens before this attempt (the drafted tokens' output indices follow it)
    MsgType.SESSION: ({"seq": _INT, "prompt_token_ids": _LIST, "max_tokens": _INT, "sampling": _MAP,
                       "stop_ids": _LIST, "decode_replica": _INT, "gamma": _INT, "adaptive": _BOOL, "mode": _STR,
                       "gateway": _STR, "plan_version": _INT}, ()),
    # weights over the mesh (roles/weights_fetch.py). model: a name the serving node announces in its
    # load's `has_model`; fingerprint: sha256 (hex) of the GGUF header; args: ModelArgs fields;
    # directory: {GGUF tensor name: [ggml type, [shape (torch order)], bytes]}
    MsgType.WEIGHTS_INDEX_REQ: ({"model": _STR}, ()),
    MsgType.WEIGHTS_INDEX: ({"model": _STR, "fingerprint": _STR, "args": _MAP, "directory": _MAP}, ()),
    # fetch: the requester's id for this fetch (chunks of an abandoned one are told apart);
    # reply_to: the requester's own address (chunks are sent there from the server's compute thread)
    MsgType.WEIGHTS_REQ: ({"model": _STR, "fingerprint": _STR, "fetch": _INT, "tensor": _STR, "offset": _INT,
                           "length": _INT, "reply_to": _STR}, ()),
    # data: uint8 (length,) = bytes [offset, offset + length) of a tensor of `total` bytes whose bytes hash
    # to `sha256` (hex); an optional "error" (str, data empty) says why the request cannot be served
    MsgType.WEIGHTS_CHUNK: ({"model": _STR, "fetch": _INT, "tensor": _STR, "offset": _INT, "total": _INT,
                             "sha256": _STR}, ("data",)),
}


@dataclass(frozen=True)
class WireSpan:
    """One sequence's part of a micro-batch as it travels in ACTIVATIONS: `n` tokens from position
    `start`; `index` is the output index of the token its logits choose (per-token seeding);
    sampling parameters ride along so the last stage samples exactly as the reference does."""

    seq: int
    start: int
    n: int
    kind: SpanKind
    index: int = 0
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def to_wire(self) -> list:
        return [self.seq, self.start, self.n, int(self.kind), self.index, self.temperature, self.top_k,
                self.top_p, self.seed]

    @staticmethod
    def from_wire(x: Any) -> WireSpan:
        if not isinstance(x, (list, tuple)) or len(x) != 9:
            raise ProtocolError(f"span must be a list of 9 fields, got {x!r:.80}")
        seq, start, n, kind, index, temp, top_k, top_p, seed = x
        if not (is_int(seq, 0, MAX_SEQ_ID) and is_int(start, 0) and is_int(n, 1) and is_int(index, 0)
                and is_int(top_k, 0) and is_int(seed) and kind in _KINDS and is_num(temp, 0.0)
                and is_num(top_p, 0.0, 1.0) and top_p > 0):  # (top_p 0 would leave no token to sample)
            raise ProtocolError(f"bad span {x!r:.120}")
        return WireSpan(seq, start, n, SpanKind(kind), index, float(temp), top_k, float(top_p), seed)


_KINDS = {int(k) for k in SpanKind}


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
    if not RESERVED.isdisjoint(fields):
        reserved = RESERVED & set(fields)
        raise ProtocolError(f"{MsgType(mtype).name}: field names {sorted(reserved)} are reserved for the header")
    msg = Message(mtype if type(mtype) is MsgType else MsgType(mtype), fields,
                  {k: as_tensorbuf(v) for k, v in tensors.items()} if tensors else {})
    _check_fields(msg.type, msg.fields)
    if msg.tensors.keys() != _TENSOR_SETS[msg.type]:
        names = _TENSOR_NAMES[msg.type]
        raise ProtocolError(f"{msg.type.name}: tensors must be {list(names)}, got {sorted(msg.tensors)}")
    return msg


def encode(msg: Message) -> list[bytes | memoryview]:
    """Message -> frames. Tensor frames are zero-copy views of the caller's arrays."""
    names = _TENSOR_NAMES[msg.type]
    bufs = [as_tensorbuf(msg.tensors[n]) for n in names]
    head: dict[str, Any] = dict(msg.fields)
    head.update(src=msg.src, zone=msg.zone, rid=msg.rid, t=[{"dtype": b.dtype, "shape": list(b.shape)} for b in bufs])
    packed = _packer().pack(head)
    if len(packed) + _PREAMBLE_SIZE > MAX_HEADER_BYTES:
        raise ProtocolError(f"{msg.type.name}: header of {len(packed)} bytes exceeds {MAX_HEADER_BYTES}")
    total = len(packed)
    frames: list[bytes | memoryview] = [_pack_preamble(MAGIC, VERSION, msg.type, len(bufs)) + packed]
    for b in bufs:
        total += b.data.nbytes
        frames.append(b.data if b.source is None else b.source)
    if total > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"{msg.type.name}: message of {total} bytes exceeds MAX_MESSAGE_BYTES={MAX_MESSAGE_BYTES}")
    return frames


_local = threading.local()  # one msgpack Packer per thread (a Packer is not thread-safe; packb makes one a call)


def _packer() -> msgpack.Packer:
    try:
        return _local.packer
    except AttributeError:
        _local.packer = msgpack.Packer(use_bin_type=True)
        return _local.packer


def decode(frames: list[Any]) -> Message:
    """Frames (bytes, memoryview or zmq.Frame) -> Message. Raises only ProtocolError."""
    if not frames:
        raise ProtocolError("empty message: no frames")
    views = [_view(f) for f in frames]
    total = 0
    for v in views:
        total += v.nbytes
    if total > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {total} bytes exceeds MAX_MESSAGE_BYTES={MAX_MESSAGE_BYTES}")
    mtype, n_tensors, head = _decode_header(views[0])
    if n_tensors != len(views) - 1:
        raise ProtocolError(f"{mtype.name}: preamble says {n_tensors} tensor frames, got {len(views) - 1}")
    src, zone, rid, specs = head.pop("src", ""), head.pop("zone", ""), head.pop("rid", 0), head.pop("t", [])
    if not isinstance(src, str) or not isinstance(zone, str) or not isinstance(rid, int) or isinstance(rid, bool):
        raise ProtocolError(f"{mtype.name}: src/zone must be strings and rid an integer")
    names = _TENSOR_NAMES[mtype]
    if not isinstance(specs, list) or len(specs) != n_tensors or n_tensors != len(names):
        raise ProtocolError(f"{mtype.name}: expects {len(names)} tensors, header describes "
                            f"{len(specs) if isinstance(specs, list) else specs!r}, frames {n_tensors}")
    tensors = {}
    for i, name in enumerate(names, 1):  # i: the tensor's frame
        tensors[name] = _decode_tensor(mtype, name, specs[i - 1], views[i], frames[i])
    _check_fields(mtype, head)
    return Message(mtype, head, tensors, src, zone, rid)


def _view(f: Any) -> memoryview:
    try:
        return memoryview(f).cast("B")  # bytes, memoryview, and pyzmq's zmq.Frame: each is a buffer itself
    except TypeError:
        pass
    buf = getattr(f, "buffer", f)  # a zmq.Frame that is not (pyzmq's CFFI backend) exposes .buffer
    try:
        return memoryview(buf).cast("B")
    except TypeError as e:
        raise ProtocolError(f"frame is not a byte buffer: {type(f).__name__}") from e


def _decode_header(v: memoryview) -> tuple[MsgType, int, dict]:
    if v.nbytes < _PREAMBLE_SIZE:
        raise ProtocolError(f"header frame of {v.nbytes} bytes is shorter than the {PREAMBLE.size}-byte preamble")
    if v.nbytes > MAX_HEADER_BYTES:
        raise ProtocolError(f"header frame of {v.nbytes} bytes exceeds MAX_HEADER_BYTES={MAX_HEADER_BYTES}")
    magic, version, tcode, n_tensors = _unpack_preamble(v)
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
        head = _unpackb(v[_PREAMBLE_SIZE:], raw=False, strict_map_key=True, max_ext_len=0)
    except (ValueError, TypeError, msgpack.UnpackException, msgpack.ExtraData, RecursionError) as e:
        raise ProtocolError(f"{mtype.name}: header is not valid msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(head, dict):
        raise ProtocolError(f"{mtype.name}: header must be a msgpack map, got {type(head).__name__}")
    return mtype, n_tensors, head


def _decode_tensor(mtype: MsgType, name: str, spec: Any, v: memoryview, frame: Any) -> TensorBuf:
    # the error text (`_where`) is built only for an error: this runs for every tensor received
    dtype, shape = (spec.get("dtype"), spec.get("shape")) if isinstance(spec, dict) else (None, None)
    if not isinstance(dtype, str) or not isinstance(shape, list):
        raise ProtocolError(f"{_where(mtype, name)}: descriptor must be a map with 'dtype' (str) and 'shape' (list)")
    itemsize = _ITEMSIZE.get(dtype)
    if itemsize is None:
        raise ProtocolError(f"{_where(mtype, name)}: unknown dtype {dtype!r} (known: {', '.join(sorted(DTYPES))})")
    if len(shape) > MAX_NDIM:
        raise ProtocolError(f"{_where(mtype, name)}: shape {shape!r} must be at most {MAX_NDIM} non-negative integers")
    for s in shape:
        if not isinstance(s, int) or isinstance(s, bool) or s < 0:
            raise ProtocolError(f"{_where(mtype, name)}: shape {shape!r} must be at most {MAX_NDIM} non-negative "
                                "integers")
    count = 1
    for s in shape:
        count *= s
        if count > MAX_MESSAGE_BYTES:
            raise ProtocolError(f"{_where(mtype, name)}: shape {shape!r} is larger than MAX_MESSAGE_BYTES")
    expected = count * itemsize
    if expected != v.nbytes:
        raise ProtocolError(f"{_where(mtype, name)}: {dtype}{shape} needs {expected} bytes, frame has {v.nbytes}")
    return TensorBuf(dtype, tuple(shape), v, frame)


def _where(mtype: MsgType, name: str) -> str:
    return f"{mtype.name}: tensor {name!r}"


def _check_fields(mtype: MsgType, fields: dict) -> None:
    for name, types, bool_ok in _FIELD_CHECKS[mtype]:
        if name not in fields:
            raise ProtocolError(f"{mtype.name}: missing field {name!r}")
        val = fields[name]
        if not isinstance(val, types) or (not bool_ok and isinstance(val, bool)):
            raise ProtocolError(f"{mtype.name}: field {name!r} has type {type(val).__name__}")


# Per-message lookups, made once from the tables above (decode and encode run for every message).
_PREAMBLE_SIZE = PREAMBLE.size
_pack_preamble, _unpack_preamble = PREAMBLE.pack, PREAMBLE.unpack_from
_unpackb = msgpack.unpackb
_ITEMSIZE = {name: dt.itemsize for name, dt in DTYPES.items()}
_TENSOR_NAMES = {mtype: names for mtype, (_, names) in SCHEMAS.items()}
_TENSOR_SETS = {mtype: frozenset(names) for mtype, names in _TENSOR_NAMES.items()}
# (field name, accepted types, whether a bool is accepted): bool is an int to isinstance, so an int field must
# refuse it explicitly
_FIELD_CHECKS = {mtype: tuple((name, types, bool in (types if isinstance(types, tuple) else (types,)))
                              for name, types in spec.items()) for mtype, (spec, _) in SCHEMAS.items()}
