"""ZeroMQ socket helpers of the mesh: frames, addresses, CURVE keys, and the I/O thread's sockets
to its peers.

A node listening on HOST:PORT has its ROUTER on PORT and its PUB on PORT+1
(`endpoint`). Every socket is made by `make_socket`: linger=0 and the protocol's
frame size limit; with node keys, CURVE (keys.py). `PeerSockets` holds the I/O thread's
control DEALER and SUB per peer. What is read from them becomes messages in inbox.py.
"""

from __future__ import annotations

import logging
import random
import socket
import threading

import zmq
from zmq.utils.monitor import recv_monitor_message

from meshllm.mesh.keys import HANDSHAKE_FAILED, NodeKeys, UnknownPeerKey, handshake_failure
from meshllm.mesh.protocol import MAX_MESSAGE_BYTES

log = logging.getLogger("meshllm.mesh.transport")

RECV_BUDGET = 256  # messages read from one socket per loop turn, so timers still run under load
_SNDMORE = int(zmq.SNDMORE)
_SENDABLE = (bytes, memoryview, zmq.Frame)
SEND_TIMEOUT_S = 10.0  # a compute thread's send blocks at most this long on a full peer queue


def send_frames(sock: zmq.Socket, frames: list, flags: int = 0) -> None:
    """`sock.send_multipart(frames, flags, copy=False)` without its per-frame IntFlag arithmetic
    (`flags` is an int): frames under pyzmq's copy threshold (64 KiB) are copied, larger ones sent
    zero-copy. Every frame is checked to be a buffer before the first is sent, as send_multipart
    does, so a bad frame never leaves a partial message queued on the socket."""
    for i, f in enumerate(frames):
        if not isinstance(f, _SENDABLE):
            try:
                memoryview(f)
            except Exception:
                raise TypeError(f"Frame {i} ({repr(f)[:32]}) does not support the buffer interface.") from None
    send, last = sock.send, len(frames) - 1
    for i in range(last):
        send(frames[i], flags | _SNDMORE, copy=False)
    send(frames[last], flags, copy=False)


# pyzmq's Cython backend sets a received Frame's `more`; its CFFI backend (PyPy, PYZMQ_BACKEND=cffi)
# never does (the class's False stays), so there each frame's RCVMORE is asked for, as recv_multipart does
_FRAME_MORE = zmq.backend.Socket.__module__.startswith("zmq.backend.cython")
_RCVMORE = int(zmq.RCVMORE)


def recv_frames(sock: zmq.Socket, flags: int = 0) -> list[zmq.Frame]:
    """`sock.recv_multipart(flags, copy=False)`, reading each frame's `more` flag (which pyzmq's
    Cython backend sets as it receives it) instead of a getsockopt(RCVMORE) call per frame. The
    parts of a multipart message arrive together, so only the first recv can block or raise
    zmq.Again."""
    recv = sock.recv
    frame = recv(flags, copy=False)
    frames = [frame]
    if not _FRAME_MORE:
        while sock.getsockopt(_RCVMORE):
            frames.append(recv(flags, copy=False))
        return frames
    while frame.more:
        frame = recv(flags, copy=False)
        frames.append(frame)
    return frames


def endpoint(address: str, offset: int = 0) -> str:
    """'HOST:PORT' -> 'tcp://HOST:PORT+offset' (offset 1 is the PUB socket)."""
    host, _, port = address.rpartition(":")
    return f"tcp://{host}:{int(port) + offset}"


LISTEN_PORTS_FROM = 10000  # free_port_pair picks from here up to the kernel's ephemeral range
_handed_out: set[int] = set()  # ports free_port_pair already gave out in this process
_ports_lock = threading.Lock()


def _ephemeral_start() -> int:
    """The first port the kernel gives outgoing connections (Linux; 32768 elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_pair(host: str = "127.0.0.1", tries: int = 200) -> int:
    """A port P such that P and P+1 are free on `host` now (ROUTER and PUB of one node).

    Chosen below the kernel's ephemeral range, so no outgoing connection (whose local port the
    kernel picks from that range) can take P between now and the node binding it, and never
    handed out twice by this process (an emulated mesh asks for one pair per node at once)."""
    hi = _ephemeral_start() - 2
    rng = random.SystemRandom()
    for _ in range(tries):
        with socket.socket() as a, socket.socket() as b:
            try:
                if hi > LISTEN_PORTS_FROM + 1000:
                    port = rng.randrange(LISTEN_PORTS_FROM, hi)
                    a.bind((host, port))
                else:  # no room below the ephemeral range: let the kernel choose
                    a.bind((host, 0))
                    port = a.getsockname()[1]
                    if port >= 65535:
                        continue
                b.bind((host, port + 1))
            except OSError:
                continue
            with _ports_lock:
                if {port, port + 1} & _handed_out:
                    continue
                _handed_out.update((port, port + 1))
            return port
    raise RuntimeError(f"no two adjacent free ports on {host} after {tries} tries")


def make_socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    """A socket with linger=0 and the frame size limit: libzmq disconnects a peer that sends a frame
    over MAX_MESSAGE_BYTES before it is ever delivered (the whole message's size, header and
    tensor count are checked by protocol.decode). CURVE is set by the caller (keys.NodeKeys)."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    return sock


def client_socket(ctx: zmq.Context, kind: int, address: str, keys: NodeKeys | None, offset: int = 0,
                  watch: int = 0) -> tuple[zmq.Socket, str | None, zmq.Socket | None]:
    """A DEALER (offset 0) or SUB (offset 1) connected to the node at `address`; with `keys`, CURVE
    pinned to that node's public key. Returns (socket, the peer's node id or None without CURVE,
    a monitor socket of the `watch` events, made before the connection so that none is missed, or
    None). Raises keys.UnknownPeerKey when no node id is pinned for the address."""
    peer = keys.peer_at(address) if keys is not None else None  # raises before a socket exists
    sock = make_socket(ctx, kind)
    if keys is not None:
        keys.client(sock, address)
    mon = sock.get_monitor_socket(watch) if watch else None
    sock.connect(endpoint(address, offset))
    return sock, peer, mon


def nbytes(frames: list) -> int:
    return sum(len(f) for f in frames)


class PeerSockets:
    """The I/O thread's own sockets to its peers: a control DEALER per peer address (HELLO, LEAVE;
    replies to this node come back on it) and a SUB per peer's PUB, subscribed to `topics`. Each is
    registered on the I/O thread's `poller`; with CURVE each is pinned to its peer's key, and one
    whose pin changed since it was made (another node now listens there) is closed and made
    afresh. Each SUB is watched by a monitor socket (`monitors`, on the poller too): a peer whose
    connection closed and whose port then refuses a new one has lost its process (`refused`).
    Used by the I/O thread only."""

    def __init__(self, ctx: zmq.Context, keys: NodeKeys | None, poller: zmq.Poller, who: str,
                 topics: set[bytes]):
        self.ctx, self.keys, self.poller, self.who = ctx, keys, poller, who
        self.topics = set(topics)
        self.dealers: dict[str, zmq.Socket] = {}
        self.subs: dict[str, zmq.Socket] = {}  # peer address -> SUB connected to its PUB
        self.owner: dict[zmq.Socket, tuple[str, str | None, bool]] = {}  # DEALER/SUB -> (address, id, is SUB)
        # a SUB's monitor socket (and with CURVE a DEALER's) -> (the peer address, is it a SUB's)
        self.monitors: dict[zmq.Socket, tuple[str, bool]] = {}
        self._told: set[tuple[str, int]] = set()  # (address, event): a failed handshake said once
        self._retries: dict[str, int] = {}  # address -> reconnects scheduled since its SUB lost its connection
        self.refused_subs: set[str] = set()  # SUBs whose handshake the peer's ZAP refused: to close

    def dealer(self, address: str) -> zmq.Socket | None:
        """The DEALER to `address` (None, logged, if no key is pinned for it)."""
        sock = self._fresh(self.dealers, address)
        if sock is None:
            try:
                # with CURVE a refused handshake is silent on this side but for a monitor
                watch = HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED if self.keys is not None else 0
                sock, peer, mon = client_socket(self.ctx, zmq.DEALER, address, self.keys, watch=watch)
            except UnknownPeerKey as e:
                log.warning("%s: not sent: %s", self.who, e)
                return None
            self.dealers[address], self.owner[sock] = sock, (address, peer, False)
            self.poller.register(sock, zmq.POLLIN)
            self._watch(mon, address, False)
        return sock

    def _watch(self, mon: zmq.Socket | None, address: str, sub: bool) -> None:
        if mon is not None:
            self.monitors[mon] = (address, sub)
            self.poller.register(mon, zmq.POLLIN)

    def subscribe(self, address: str) -> None:
        """A SUB to the peer's PUB, unless one with the current pin exists."""
        if self._fresh(self.subs, address) is not None:
            return
        try:
            sock, peer, mon = client_socket(self.ctx, zmq.SUB, address, self.keys, offset=1,
                                            watch=zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
                                            | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        except UnknownPeerKey as e:
            log.warning("%s: not subscribed: %s", self.who, e)
            return
        for t in self.topics:
            sock.setsockopt(zmq.SUBSCRIBE, t)
        self.subs[address], self.owner[sock] = sock, (address, peer, True)
        self.poller.register(sock, zmq.POLLIN)
        self._watch(mon, address, True)

    def refused(self, mon: zmq.Socket) -> str | None:
        """Read a SUB's monitor events: the peer's address if its connection closed and a new one
        was then refused (libzmq schedules a reconnect at once, then again after a refused try,
        ~0.1-0.2 s later: the port is closed, the process that held it is gone), once per loss; else
        None. A peer that stopped running, or whose host or link went away, closes nothing: the
        failure timeout finds it. A DEALER's monitor (with CURVE) only logs a failed handshake, once
        until one succeeds: the refused node's own log said nothing of it, only that no one answered."""
        (address, sub), gone = self.monitors[mon], False
        while True:
            try:
                event = recv_monitor_message(mon, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return address if gone else None
            if not sub:
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self._told = {t for t in self._told if t[0] != address}
                elif event & HANDSHAKE_FAILED and (address, event) not in self._told and self.keys is not None:
                    self._told.add((address, event))
                    peer = self.owner[self.dealers[address]][1] if address in self.dealers else None
                    log.warning("%s: %s", self.who, handshake_failure(event, peer, address, self.keys))
            elif event == zmq.EVENT_DISCONNECTED:
                self._retries[address] = 0
            elif event == zmq.EVENT_CONNECTED:
                self._retries.pop(address, None)
            elif event == zmq.EVENT_CONNECT_RETRIED and address in self._retries:
                self._retries[address] += 1
                gone = gone or self._retries[address] == 2
            elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:  # libzmq never tries this SUB again
                self.refused_subs.add(address)

    def drop_sub(self, address: str) -> None:
        """Close the SUB to a peer that refused its handshake (it may admit this node later: the
        next subscribe(), when the peer is next seen alive, connects afresh)."""
        log.info("%s: %s refused this node's key; subscribing again when it is seen alive", self.who, address)
        self._drop(self.subs, address)

    def forget(self, address: str) -> None:
        """Close the SUB and the DEALER to a peer (the next send or subscription connects afresh)."""
        self._drop(self.subs, address)
        self._drop(self.dealers, address)

    def set_topic(self, topic_frame: bytes, on: bool) -> None:
        (self.topics.add if on else self.topics.discard)(topic_frame)
        for sock in self.subs.values():
            sock.setsockopt(zmq.SUBSCRIBE if on else zmq.UNSUBSCRIBE, topic_frame)

    def close(self) -> None:
        for address in list(self.subs):
            self._drop(self.subs, address)
        for address in list(self.dealers):
            self._drop(self.dealers, address)
        self.owner.clear()

    def _fresh(self, socks: dict[str, zmq.Socket], address: str) -> zmq.Socket | None:
        """socks[address] unless its CURVE pin changed since it was made (then it is closed)."""
        sock = socks.get(address)
        if sock is not None and self.keys is not None:
            try:
                current = self.keys.peer_at(address)
            except UnknownPeerKey:
                current = None
            if current != self.owner[sock][1]:
                self._drop(socks, address)
                return None
        return sock

    def _drop(self, socks: dict[str, zmq.Socket], address: str) -> None:
        sock = socks.pop(address, None)
        if sock is not None:
            self.poller.unregister(sock)
            self.owner.pop(sock, None)
            sub = socks is self.subs
            for mon in [m for m, (a, is_sub) in self.monitors.items() if a == address and is_sub == sub]:
                sock.disable_monitor()
                self.poller.unregister(mon)
                del self.monitors[mon]
                mon.close(linger=0)
            if sub:
                self._retries.pop(address, None)
            sock.close(linger=0)
