"""ZeroMQ socket helpers of the mesh: addresses, CURVE keys, and the per-thread request client.

A node listening on HOST:PORT has its ROUTER on PORT and its PUB on PORT+1
(`endpoint`). Every socket is made by `make_socket`: linger=0, the protocol's
message size limit and, with a cluster key, CURVE. `Requester` gives each
calling thread its own DEALER per peer (ZeroMQ sockets are not thread-safe), so
a compute thread can make blocking requests without going through the I/O thread.
"""

from __future__ import annotations

import hashlib
import itertools
import socket
import threading
import time
from collections.abc import Callable
from typing import Protocol

import zmq

from meshllm.mesh.protocol import MAX_MESSAGE_BYTES, Message, MsgType, encode

SEND_TIMEOUT_S = 10.0  # a compute thread's send blocks at most this long on a full peer queue


def endpoint(address: str, offset: int = 0) -> str:
    """'HOST:PORT' -> 'tcp://HOST:PORT+offset' (offset 1 is the PUB socket)."""
    host, _, port = address.rpartition(":")
    return f"tcp://{host}:{int(port) + offset}"


def free_port_pair(host: str = "127.0.0.1", tries: int = 50) -> int:
    """A port P such that P and P+1 are free on `host` now (ROUTER and PUB of one node)."""
    for _ in range(tries):
        with socket.socket() as a, socket.socket() as b:
            a.bind((host, 0))
            port = a.getsockname()[1]
            if port >= 65535:
                continue
            try:
                b.bind((host, port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no two adjacent free ports on {host} after {tries} tries")


class CurveKeys:
    """CURVE encryption from a shared `cluster_key` file. Every node derives the same server key
    pair from the file (SHA-256 of its bytes as the secret); clients use a fresh key pair and must
    know the server public key, so only holders of the file can connect or read traffic."""

    def __init__(self, secret: bytes):
        from zmq.utils import z85

        self.server_secret = z85.encode(hashlib.sha256(secret).digest())
        self.server_public = zmq.curve_public(self.server_secret)

    @staticmethod
    def from_file(path: str | None) -> CurveKeys | None:
        if path is None:
            return None
        if not zmq.has("curve"):
            raise OSError("cluster_key needs libzmq built with CURVE support")
        with open(path, "rb") as f:
            return CurveKeys(f.read())

    def apply(self, sock: zmq.Socket, server: bool) -> None:
        if server:
            sock.curve_secretkey, sock.curve_server = self.server_secret, True
        else:
            sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
            sock.curve_serverkey = self.server_public


def make_socket(ctx: zmq.Context, kind: int, curve: CurveKeys | None = None) -> zmq.Socket:
    """A socket with linger=0, the message size limit and, with a cluster key, CURVE."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    if curve is not None:
        curve.apply(sock, server=kind in (zmq.ROUTER, zmq.PUB))
    return sock


def nbytes(frames: list) -> int:
    return sum(len(f) for f in frames)


class Shaper(Protocol):
    def due(self, src_zone: str, nbytes: int, now: float) -> float: ...


class RemoteError(RuntimeError):
    """A peer answered a request with ERROR (code, message)."""

    def __init__(self, code: str, message: str):
        self.code = code
        super().__init__(f"{code}: {message}")


class Requester:
    """Blocking requests and sends from any thread, each thread on its own DEALER per peer."""

    def __init__(self, ctx: zmq.Context, curve: CurveKeys | None, stamp: Callable[[Message], None],
                 decode: Callable[[list], Message | None], shaper: Shaper):
        self.ctx, self.curve, self._stamp, self._decode, self._shaper = ctx, curve, stamp, decode, shaper
        self._rid = itertools.count(1)
        self._local = threading.local()

    def send(self, address: str, msg: Message) -> None:
        """Fire-and-forget; blocks (at most SEND_TIMEOUT_S) while the peer's queue is full."""
        self._stamp(msg)
        try:
            self._socket(address).send_multipart(encode(msg), copy=False)
        except zmq.Again:
            raise TimeoutError(f"{address} accepted no {msg.type.name} for {SEND_TIMEOUT_S:g} s") from None

    def request(self, address: str, msg: Message, timeout_s: float) -> Message:
        """Send `msg` and wait for the reply carrying its request id. Raises TimeoutError."""
        sock = self._socket(address)
        msg.rid = next(self._rid)
        self._stamp(msg)
        sock.send_multipart(encode(msg), copy=False)
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            sock.setsockopt(zmq.RCVTIMEO, int(left * 1000) + 1)  # a blocking recv wakes faster than poll
            try:
                frames = sock.recv_multipart(copy=False)
            except zmq.Again:
                continue
            arrived = time.monotonic()
            reply = self._decode(frames)
            if reply is None or reply.rid != msg.rid:
                continue  # malformed, or a late reply to an earlier timed-out request
            delay = self._shaper.due(reply.zone, nbytes(frames), arrived) - time.monotonic()
            if delay > 0:
                time.sleep(delay)  # the emulated link of the reply
            if reply.type is MsgType.ERROR and msg.type is not MsgType.ERROR:
                raise RemoteError(str(reply.fields.get("code")), str(reply.fields.get("message")))
            return reply
        raise TimeoutError(f"no reply from {address} to {msg.type.name} in {timeout_s:.1f} s")

    def close_thread_sockets(self) -> None:
        """Close the DEALERs the calling thread opened."""
        for s in getattr(self._local, "dealers", {}).values():
            s.close(linger=0)
        self._local.dealers = {}

    def _socket(self, address: str) -> zmq.Socket:
        socks = getattr(self._local, "dealers", None)
        if socks is None:
            socks = self._local.dealers = {}
        sock = socks.get(address)
        if sock is None:
            sock = socks[address] = make_socket(self.ctx, zmq.DEALER, self.curve)
            sock.setsockopt(zmq.SNDTIMEO, int(SEND_TIMEOUT_S * 1000))
            sock.connect(endpoint(address))
        return sock
