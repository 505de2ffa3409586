"""Messages in and requests out: `Inbox` makes what the I/O thread reads from a socket into
messages (ingress.py's rules: attribution, rate limits, forgery, emulated links), and
`Requester` gives each calling thread its own DEALER per peer (ZeroMQ sockets are not
thread-safe), so a compute thread can make blocking requests without going through the I/O
thread.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import zmq

from meshllm.mesh.ingress import LinkShaper, RateLimiter, Rejections
from meshllm.mesh.keys import ANY_NODE, NodeKeys
from meshllm.mesh.protocol import Message, MsgType, ProtocolError, decode, encode
from meshllm.mesh.sockets import RECV_BUDGET, SEND_TIMEOUT_S, client_socket, nbytes, recv_frames, send_frames

log = logging.getLogger("meshllm.mesh.transport")
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)  # ints: IntFlag ops are slow


class Inbox:
    """What the I/O thread reads from a socket, made into messages for the node's handlers: each
    is attributed to its sender (the ZAP User-Id on the ROUTER, the pinned peer on a SUB or
    DEALER), held to the sender's rate limit, decoded, and dropped if forged (its `src` or `node`
    names another node) or lost in an emulated partition; an emulated link holds it back."""

    def __init__(self, who: str, keys: NodeKeys | None, shaper: LinkShaper, limiter: RateLimiter,
                 rejections: Rejections):
        self.who, self.keys, self.shaper, self.limiter, self.rejections = who, keys, shaper, limiter, rejections
        self.dropped = 0  # malformed messages dropped
        self.forged = 0  # messages dropped for naming another node than their authenticated sender

    def decode(self, frames: list) -> Message | None:
        try:
            return decode(frames)
        except ProtocolError as e:
            self.dropped += 1
            self.rejections.reject(("?", "a malformed message"), e, "dropped")
            return None

    def refused(self, z85_key: bytes) -> None:
        """ZAP refused a client key (called on the authenticator's thread)."""
        self.rejections.reject(("?", "CURVE handshake"), ProtocolError(
            f"public key {z85_key.decode(errors='replace')[:12]}... is not in the authorized keys"), "refused")

    def receive(self, sock: zmq.Socket, peer: tuple[str, str | None, bool] | None,
                deliver: Callable[[Message, bytes | None], None], hold: Callable[[float, Any], None]) -> None:
        """Read up to RECV_BUDGET ready messages from `sock` (`peer`: None for the ROUTER, else the
        (address, node id, is SUB) it is connected to) and `deliver(msg, ROUTER identity)` each, or
        `hold(due, (msg, identity))` it for an emulated link."""
        address, known, from_sub = peer if peer is not None else (None, None, False)
        for i in range(RECV_BUDGET):
            # the poll found the socket readable; after a message, EVENTS says whether another waits
            # (a getsockopt is cheaper than a recv raising Again)
            if sock.closed or (i and not sock.getsockopt(_EVENTS) & _POLLIN):
                return
            try:
                frames = recv_frames(sock, _NOBLOCK)
            except zmq.Again:  # EVENTS can report a message that a SUB filter then discards
                return
            arrived = time.monotonic()
            ident, body = (frames[0].bytes, frames[1:]) if peer is None else (None, frames[1:] if from_sub else frames)
            if not body:
                continue
            who = self._sender(body[0]) if peer is None else known
            msg = self._admit(body, who, ident or address, arrived)
            if msg is None:
                continue
            due = self.shaper.due(msg.zone, nbytes(body), arrived) if self.shaper.active else arrived
            if due > arrived:
                hold(due, (msg, ident))
            else:
                deliver(msg, ident)

    def _admit(self, body: list, who: str | None, conn: Any, arrived: float) -> Message | None:
        """The message in `body` from `who` (None: unknown without CURVE; `conn` keys its rate
        limit then), or None if it is refused (counted and logged)."""
        if self.keys is not None and who is None:
            self.forged += 1
            self.rejections.reject(("?", "a message"), ProtocolError("no authenticated sender"), "dropped")
            return None
        if who == ANY_NODE:  # a cluster key's holder: the key names no node, the message says who sent it
            who = None
        if not self.limiter.allow(who or conn, arrived):
            self.rejections.reject((who or "?", "a message"), ProtocolError(
                f"over the rate limit of {self.limiter.limit.messages_per_s:g}/s"), "dropped")
            return None
        msg = self.decode(body)
        if msg is None:
            return None
        if who is not None and (msg.src not in ("", who) or msg.fields.get("node", who) != who):
            self.forged += 1
            self.rejections.reject((who, msg.type.name), ProtocolError(
                f"claims to come from {msg.src or msg.fields.get('node')!r:.40}"), "dropped forged")
            return None
        if who is not None:
            msg.src = who  # an empty src (a CLI client) is filled in with who it really is
        if self.shaper.active and self.shaper.blocked(msg.zone, arrived):
            return None  # an emulated partition: the message is lost
        return msg

    def _sender(self, frame: zmq.Frame) -> str | None:
        """The node id ZAP authenticated for a ROUTER message (None without CURVE)."""
        if self.keys is None:
            return None
        try:
            return self.keys.who(frame.get("User-Id"))
        except zmq.ZMQError:  # no User-Id: not a ZAP-checked connection
            return None


class Shaper(Protocol):
    def due(self, src_zone: str, nbytes: int, now: float) -> float: ...


class RemoteError(RuntimeError):
    """A peer answered a request with ERROR (code, message)."""

    def __init__(self, code: str, message: str):
        self.code = code
        super().__init__(f"{code}: {message}")


class Requester:
    """Blocking requests and sends from any thread, each thread on its own DEALER per peer."""

    def __init__(self, ctx: zmq.Context, keys: NodeKeys | None, stamp: Callable[[Message], None],
                 decode: Callable[[list], Message | None], shaper: Shaper):
        self.ctx, self.keys, self._stamp, self._decode, self._shaper = ctx, keys, stamp, decode, shaper
        self._rid = itertools.count(1)
        self._local = threading.local()

    def send(self, address: str, msg: Message) -> None:
        """Fire-and-forget; blocks (at most SEND_TIMEOUT_S) while the peer's queue is full."""
        self._stamp(msg)
        sock, _ = self._socket(address)
        try:
            send_frames(sock, encode(msg))
        except zmq.Again:
            raise TimeoutError(f"{address} accepted no {msg.type.name} for {SEND_TIMEOUT_S:g} s") from None

    def request(self, address: str, msg: Message, timeout_s: float) -> Message:
        """Send `msg` and wait for the reply carrying its request id. Raises TimeoutError."""
        sock, peer = self._socket(address)
        msg.rid = next(self._rid)
        self._stamp(msg)
        send_frames(sock, encode(msg))
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            sock.setsockopt(zmq.RCVTIMEO, int(left * 1000) + 1)  # a blocking recv wakes faster than poll
            try:
                frames = recv_frames(sock)
            except zmq.Again:
                continue
            arrived = time.monotonic()
            reply = self._decode(frames)
            if reply is None or reply.rid != msg.rid:
                continue  # malformed, or a late reply to an earlier timed-out request
            if peer is not None and reply.src not in ("", peer):
                continue  # cannot happen over CURVE pinned to `peer`'s key, short of a bug: never trusted
            delay = self._shaper.due(reply.zone, nbytes(frames), arrived) - time.monotonic()
            if delay > 0:
                time.sleep(delay)  # the emulated link of the reply
            if reply.type is MsgType.ERROR and msg.type is not MsgType.ERROR:
                raise RemoteError(str(reply.fields.get("code")), str(reply.fields.get("message")))
            return reply
        raise TimeoutError(f"no reply from {address} to {msg.type.name} in {timeout_s:.1f} s")

    def close_thread_sockets(self) -> None:
        """Close the DEALERs the calling thread opened."""
        for s, _ in getattr(self._local, "dealers", {}).values():
            s.close(linger=0)
        self._local.dealers = {}

    def _socket(self, address: str) -> tuple[zmq.Socket, str | None]:
        """This thread's DEALER to `address` and the node id its CURVE key is pinned to (a new
        socket when the pin changed, e.g. another node now listens there)."""
        socks = getattr(self._local, "dealers", None)
        if socks is None:
            socks = self._local.dealers = {}
        entry = socks.get(address)
        if entry is not None and self.keys is not None and entry[1] != self.keys.peer_at(address):
            entry[0].close(linger=0)
            entry = None
        if entry is None:
            entry = socks[address] = client_socket(self.ctx, zmq.DEALER, address, self.keys)[:2]
            entry[0].setsockopt(zmq.SNDTIMEO, int(SEND_TIMEOUT_S * 1000))
        return entry
