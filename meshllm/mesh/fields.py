"""Checks of field values that come from the network: sequence ids, sampling parameters, integer
lists, node addresses. Each returns the value or raises ProtocolError naming the field; the wire
protocol (protocol.py) and the roles that read its messages use them. No sockets.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Any

MAX_SEQ_ID = (1 << 63) - 1
MAX_TEMPERATURE = 2.0  # the OpenAI API's range: the HTTP API and the CLI refuse more (the wire takes any >= 0)
_SAMPLING = ("temperature", "top_k", "top_p", "seed")


TOMBSTONES = 4096  # released sequence ids a role remembers


class Tombstones:
    """The ids of the last TOMBSTONES sequences a role released, so that a message for one that
    comes after its release is dropped: late KV, or a request's first message (SESSION,
    GENERATE_REQ) that its RELEASE overtook (a gateway sends them from different threads, each on
    its own socket, so they are not ordered)."""

    def __init__(self, limit: int = TOMBSTONES):
        self.limit, self._ids = limit, OrderedDict()

    def add(self, seq: int) -> None:
        self._ids[seq] = None
        self._ids.move_to_end(seq)
        while len(self._ids) > self.limit:
            self._ids.popitem(last=False)

    def __contains__(self, seq: object) -> bool:
        return seq in self._ids


class ProtocolError(ValueError):
    """A frame that is not a valid meshllm message (bad magic, version, type, size, header, tensor)."""


def is_int(v: Any, lo: int | None = None, hi: int | None = None) -> bool:
    return (isinstance(v, int) and not isinstance(v, bool) and (lo is None or v >= lo)
            and (hi is None or v <= hi))


def is_num(v: Any, lo: float | None = None, hi: float | None = None) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and (lo is None or v >= lo)
            and (hi is None or v <= hi))


def check_seq(v: Any, what: str = "seq") -> int:
    """A sequence id from the network: a non-negative 63-bit integer, else ProtocolError."""
    if not is_int(v, 0, MAX_SEQ_ID):
        raise ProtocolError(f"{what} must be an integer in [0, 2^63), got {v!r:.40}")
    return v


def check_offset(fields: dict, seq: int) -> int:
    """A request's optional `offset` (output tokens before this attempt): a non-negative integer, 0 if absent."""
    offset = fields.get("offset", 0)
    if not is_int(offset, 0):
        raise ProtocolError(f"seq {seq}: offset must be a non-negative integer")
    return offset


def check_sampling(m: Any) -> tuple[float, int, float, int]:
    """A GENERATE/HANDOFF `sampling` map -> (temperature, top_k, top_p, seed), else ProtocolError."""
    if not isinstance(m, dict) or set(m) != set(_SAMPLING):
        raise ProtocolError(f"sampling must be a map with exactly {sorted(_SAMPLING)}")
    t, k, p, seed = m["temperature"], m["top_k"], m["top_p"], m["seed"]
    if not (is_num(t, 0.0) and is_int(k, 0) and is_num(p, 0.0, 1.0) and p > 0 and is_int(seed)):
        raise ProtocolError(f"bad sampling parameters {m!r:.120}")
    return float(t), k, float(p), seed


def sampling_map(temperature: float, top_k: int, top_p: float, seed: int) -> dict[str, Any]:
    return {"temperature": float(temperature), "top_k": int(top_k), "top_p": float(top_p), "seed": int(seed)}


def check_int_list(v: Any, what: str, lo: int = 0, hi: int | None = None, max_len: int | None = None) -> list[int]:
    """A list of bounded integers from the network (token ids, layer ranges), else ProtocolError."""
    if not isinstance(v, (list, tuple)) or (max_len is not None and len(v) > max_len):
        raise ProtocolError(f"{what} must be a list of at most {max_len} integers")
    if not all(is_int(x, lo, hi) for x in v):
        raise ProtocolError(f"{what} holds a value outside [{lo}, {hi}]")
    return list(v)


NODE_PORT_MAX = 65534  # a node's ROUTER port: its PUB socket takes PORT + 1
_ADDRESS = re.compile(r"(?:[A-Za-z0-9_.-]+|\[[0-9A-Fa-f:.]+\]):[0-9]{1,5}")


def is_address(v: Any) -> bool:
    """HOST:PORT as the sockets take it (a host name, IPv4 or [IPv6], a port in [1, 65534]: PUB is PORT+1)."""
    return (isinstance(v, str) and len(v) <= 255 and _ADDRESS.fullmatch(v) is not None
            and 0 < int(v.rpartition(":")[2]) <= NODE_PORT_MAX)


def check_address(v: Any, what: str = "address") -> str:
    """A node address from the network (where replies and tokens go), else ProtocolError: anything
    else would fail later, inside the sockets, far from the message that brought it."""
    if not is_address(v):
        raise ProtocolError(f"{what} must be HOST:PORT, got {v!r:.60}")
    return v
