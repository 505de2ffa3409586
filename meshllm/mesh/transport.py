"""The thin ZeroMQ layer of one node (its threads: loop.py; what it applies to arriving
messages, link shaping for local emulation included: ingress.py).

Sockets of a node listening on HOST:PORT:
    ROUTER  bound on tcp://HOST:PORT     point-to-point requests, replies and the data plane
    PUB     bound on tcp://HOST:PORT+1   broadcasts; every PUB message starts with a topic frame
                                         (TOPIC_MESH: heartbeats, gossip, plans; topic(name) for
                                         the rest, e.g. a decode replica's drafts), so a node
                                         receives only the topics it subscribed to
    SUB     one per peer, connected to its PUB (so each publication's sender is known)
    DEALER  one per peer address for the I/O thread's own requests (HELLO, LEAVE), and one
            per peer and calling thread for `request`/`send` from compute threads (sockets.py)

One I/O thread owns ROUTER, PUB, SUB and the control DEALERs. It runs the
control handlers (which must not block: heartbeats, gossip, status are answered
here, so a long forward pass never looks like a death) and the timers. Data-plane
handlers are registered with a `Worker` (a compute thread fed by a queue): the
I/O thread only decodes and enqueues them. Other threads hand the I/O thread
work with `call_soon` (a deque plus a wake-up pipe). Every socket has linger=0.
Rejected input (a malformed frame, a message a handler refuses with ProtocolError) is
dropped, counted (`rejected`) and logged, at most REJECT_LOG_PER_S lines a second per
(sender, message type), then one "suppressed K" line (`Rejections`). A handler that fails answers its caller
with ERROR carrying the request id (code "bad_request" for a ProtocolError,
"internal" with a logged traceback for anything else), so no caller waits for a
timeout. Data-plane sends from compute threads block while the peer's queue is
full, at most SEND_TIMEOUT_S, then raise; they are never dropped silently.

Security (keys.py). With `keys`, every socket uses CURVE with this node's own key pair:
ROUTER and PUB admit only clients in the authorized keys (ZAP), DEALERs and SUBs pin the
peer's key. Each received message is attributed to a node: the ZAP User-Id on the ROUTER,
the pinned peer on a SUB or DEALER. A message whose `src` (unless empty, as from the CLI)
or `node` field names another node is dropped and logged ("forged"): no node can speak
for another. Per-peer rate limit (`RateLimit`, both modes): a token bucket per sender
(its node id with CURVE, else its connection) drops what exceeds it, before decoding, with
a rate-limited log line; the defaults sit far above what serving sends. Link shaping
(emulation only) holds a message back on arrival for as long as its link would take.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import zmq

from meshllm.mesh.ingress import LinkShaper, RateLimit, RateLimiter, Rejections, guard
from meshllm.mesh.keys import Admission, NodeKeys, UnknownPeerKey
from meshllm.mesh.loop import IOLoop, Worker
from meshllm.mesh.protocol import Message, MsgType, ProtocolError, decode, encode, make
from meshllm.mesh.sockets import Requester, client_socket, endpoint, make_socket, nbytes

log = logging.getLogger("meshllm.mesh.transport")

RECV_BUDGET = 256  # messages read from one socket per loop turn, so timers still run under load
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)  # ints: IntFlag ops are slow
Handler = Callable[[Message, Callable[[Message], None]], None]
TOPIC_MESH = b"mesh\0"  # heartbeats, gossip, plans: every node subscribes


def topic(name: str) -> bytes:
    """A PUB/SUB topic frame. The NUL end makes ZeroMQ's prefix match exact ("draft/1" is not
    "draft/10")."""
    return name.encode() + b"\0"


class Transport:
    """Sockets + I/O thread of one node. Start with `start()`, stop with `close()`."""

    def __init__(self, node_id: str, zone: str, listen: str, shaper: LinkShaper | None = None,
                 ctx: zmq.Context | None = None, keys: NodeKeys | None = None, rate: RateLimit = RateLimit()):
        self.node_id, self.zone, self.keys = node_id, zone, keys
        self.local_address: str | None = None  # the address peers reach this node at (send() to it stays local)
        self.shaper = shaper or LinkShaper(zone)
        self.ctx = ctx or zmq.Context.instance()
        self.dropped = 0  # malformed messages dropped
        self.forged = 0  # messages dropped for naming another node than their authenticated sender
        self.loop = IOLoop(node_id)
        self.rejections = Rejections(node_id)  # malformed frames and messages a handler refused
        self.loop.every(1.0, self.rejections.flush)
        self.limiter = RateLimiter(rate)
        self.client = Requester(self.ctx, keys, self._stamp, self._decode, self.shaper)
        self._handlers: dict[MsgType, tuple[Handler, Worker | None]] = {}
        self._dealers: dict[str, zmq.Socket] = {}
        self._subs: dict[str, zmq.Socket] = {}  # peer address -> SUB connected to its PUB
        self._peer_of: dict[zmq.Socket, tuple[str, str | None, bool]] = {}  # DEALER/SUB -> (address, id, is SUB)
        self._topics: set[bytes] = {TOPIC_MESH}
        self._poller = zmq.Poller()
        self._stop = threading.Event()
        self._closed = False
        # ZAP before any CURVE server socket exists: no handshake runs unchecked
        self.admission = Admission(self.ctx, keys, self._refused) if keys is not None else None
        self.router, self.pub = make_socket(self.ctx, zmq.ROUTER), make_socket(self.ctx, zmq.PUB)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a vanished peer raises, not vanishes
        for sock, offset in ((self.router, 0), (self.pub, 1)):
            if keys is not None:
                keys.server(sock, self.admission.domain)
            try:
                sock.bind(endpoint(listen, offset))
            except zmq.ZMQError as e:
                for s in (self.router, self.pub):
                    s.close(linger=0)
                if self.admission is not None:
                    self.admission.close()
                self.loop.close()
                raise OSError(f"cannot listen on {endpoint(listen, offset)} (ROUTER on PORT, PUB on PORT+1): "
                              f"{e}") from None
        self.loop.thread = threading.Thread(target=self._run, name=f"mesh-io-{node_id}", daemon=True)

    # -- setup --------------------------------------------------------------------------------
    def on(self, mtype: MsgType, handler: Handler, worker: Worker | None = None) -> None:
        """Run `handler(msg, reply)` for each `mtype` message: on the I/O thread (control plane;
        must not block), or on `worker`'s thread (data plane). `reply` is thread-safe. One handler
        per type: a second registration is a bug and raises."""
        if mtype in self._handlers:
            raise ValueError(f"{self.node_id}: a handler for {mtype.name} is already registered")
        self._handlers[mtype] = (handler, worker)

    def every(self, interval_s: float, fn: Callable[[], None]) -> None:
        self.loop.every(interval_s, fn)

    def start(self) -> None:
        self.loop.thread.start()

    def close(self) -> None:
        """Stop the I/O thread; it closes the sockets it owns as it exits (never under its feet)."""
        self._stop.set()
        self.loop.wake()
        if self.loop.thread.is_alive():
            self.loop.thread.join(timeout=5.0)
            if self.loop.thread.is_alive():
                log.error("%s: the I/O thread did not stop within 5 s; it will close its sockets itself",
                          self.node_id)
                return
        elif not self._closed:
            self._close_sockets()

    def _close_sockets(self) -> None:
        if self._closed:
            return
        self._closed = True
        for s in (self.router, self.pub, *self._subs.values(), *self._dealers.values()):
            s.close(linger=0)
        self._dealers.clear()
        self._subs.clear()
        self._peer_of.clear()
        if self.admission is not None:
            self.admission.close()
        self.loop.close()

    # -- any thread -------------------------------------------------------------------------
    @property
    def rejected(self) -> int:
        """Messages refused so far: malformed frames, and messages a handler refused (ProtocolError)."""
        return self.rejections.count

    def call_soon(self, fn: Callable[[], None]) -> None:
        self.loop.call_soon(fn)

    def publish(self, msg: Message, topic_frame: bytes = TOPIC_MESH) -> None:
        """Broadcast on this node's PUB under a topic; only subscribers of that topic receive it."""
        self.loop.call_soon(lambda: self._send(self.pub, msg, topic_frame))

    def send(self, address: str, msg: Message) -> None:
        """Fire-and-forget to a peer's ROUTER. From the I/O thread it goes out on the control DEALER
        (replies reach this node's handlers); from any other thread on that thread's own DEALER,
        blocking while the peer's queue is full (at most SEND_TIMEOUT_S, then TimeoutError). A
        message a compute thread sends to this node itself (`local_address`, e.g. a leader's tokens
        to the gateway beside it) skips the sockets: see `_deliver_local`."""
        if self.loop.in_loop() or not self.loop.thread.is_alive():
            self.loop.call_soon(lambda: self._send(self._dealer(address), msg))
        elif address == self.local_address:
            self._deliver_local(msg)
        else:
            self.client.send(address, msg)

    def _deliver_local(self, msg: Message) -> None:
        """Hand a message to this node's own handler as if it had arrived: encoded and decoded again
        (the handler gets its own copy, checked as any message is), no socket, no I/O-thread wake-up
        for a data-plane handler. Such sends are never answered, as with any `send`."""
        self._stamp(msg)
        copy = self._decode([bytes(f) for f in encode(msg)])
        if copy is None:
            return
        if self._handlers.get(copy.type, (None, None))[1] is None:
            self.loop.call_soon(lambda: self._dispatch(copy, None))  # control plane: the I/O thread
        else:
            self._dispatch(copy, None)  # enqueued on its worker from this thread

    def request(self, address: str, msg: Message, timeout_s: float) -> Message:
        """Blocking request/reply from a non-I/O thread. Raises TimeoutError, or RemoteError when
        the peer answers ERROR."""
        assert not self.loop.in_loop(), "the I/O thread must never block"
        return self.client.request(address, msg, timeout_s)

    def close_thread_sockets(self) -> None:
        self.client.close_thread_sockets()

    def subscribe(self, address: str) -> None:
        """Connect a SUB socket to a peer's PUB (what arrives is filtered by topic)."""
        self.loop.defer(lambda: self._sub(address, True))

    def subscribe_topic(self, topic_frame: bytes, on: bool = True) -> None:
        self.loop.defer(lambda: self._topic(topic_frame, on))

    def pin(self, node_id: str, address: str, first_hand: bool) -> bool:
        """With CURVE: the node at `address` is `node_id` (keys.NodeKeys.pin); False if that is not
        accepted (an id outside the authorized keys, or second-hand news against a pin). Without
        CURVE: True."""
        return self.keys is None or self.keys.pin(node_id, address, first_hand)

    def forget(self, address: str) -> None:
        """Drop the SUB connection and the control DEALER to a peer that left."""
        self.loop.defer(lambda: self._sub(address, False))

    # -- I/O thread -------------------------------------------------------------------------
    def _stamp(self, msg: Message) -> None:
        msg.src, msg.zone = self.node_id, self.zone

    def _send(self, sock: zmq.Socket, msg: Message, first: bytes | None = None) -> None:
        """Send on a socket the I/O thread owns; `first` is the ROUTER identity or the PUB topic."""
        if sock is None:
            return  # a DEALER to a peer whose key is unknown (logged by _dealer)
        self._stamp(msg)
        frames = encode(msg)
        try:
            sock.send_multipart(([first] if first is not None else []) + frames, _NOBLOCK, copy=False)
        except zmq.Again:
            log.warning("%s: send queue full, dropped control message %s", self.node_id, msg.type.name)
            if sock in self._peer_of:  # a DEALER with no connection: libzmq gives up on a peer whose
                self._sub(self._peer_of[sock][0], False)  # CURVE handshake refused us; the next send or
                # subscription connects afresh (the peer may have admitted this node since)
        except zmq.ZMQError as e:
            log.warning("%s: cannot send %s: %s", self.node_id, msg.type.name, e)

    def _dealer(self, address: str) -> zmq.Socket | None:
        """The I/O thread's DEALER to `address` (None, logged, if no key is pinned for it)."""
        sock = self._fresh(self._dealers, address)
        if sock is None:
            try:
                sock, peer = client_socket(self.ctx, zmq.DEALER, address, self.keys)
            except UnknownPeerKey as e:
                log.warning("%s: not sent: %s", self.node_id, e)
                return None
            self._dealers[address], self._peer_of[sock] = sock, (address, peer, False)
            self._poller.register(sock, zmq.POLLIN)
        return sock

    def _fresh(self, socks: dict[str, zmq.Socket], address: str) -> zmq.Socket | None:
        """socks[address] unless its CURVE pin changed since it was made (then it is closed)."""
        sock = socks.get(address)
        if sock is not None and self.keys is not None:
            try:
                current = self.keys.peer_at(address)
            except UnknownPeerKey:
                current = None
            if current != self._peer_of[sock][1]:
                self._drop(socks, address)
                return None
        return sock

    def _drop(self, socks: dict[str, zmq.Socket], address: str) -> None:
        sock = socks.pop(address, None)
        if sock is not None:
            self._poller.unregister(sock)
            self._peer_of.pop(sock, None)
            sock.close(linger=0)

    def _sub(self, address: str, on: bool) -> None:
        if not on:
            self._drop(self._subs, address)
            self._drop(self._dealers, address)
            return
        if self._fresh(self._subs, address) is not None:
            return
        try:
            sock, peer = client_socket(self.ctx, zmq.SUB, address, self.keys, offset=1)
        except UnknownPeerKey as e:
            log.warning("%s: not subscribed: %s", self.node_id, e)
            return
        for t in self._topics:
            sock.setsockopt(zmq.SUBSCRIBE, t)
        self._subs[address], self._peer_of[sock] = sock, (address, peer, True)
        self._poller.register(sock, zmq.POLLIN)

    def _topic(self, topic_frame: bytes, on: bool) -> None:
        (self._topics.add if on else self._topics.discard)(topic_frame)
        for sock in self._subs.values():
            sock.setsockopt(zmq.SUBSCRIBE if on else zmq.UNSUBSCRIBE, topic_frame)

    def _refused(self, z85_key: bytes) -> None:
        """ZAP refused a client key (called on the authenticator's thread)."""
        self.rejections.reject(("?", "CURVE handshake"), ProtocolError(
            f"public key {z85_key.decode(errors='replace')[:12]}... is not in the authorized keys"), "refused")

    def _decode(self, frames: list) -> Message | None:
        try:
            return decode(frames)
        except ProtocolError as e:
            self.dropped += 1
            self.rejections.reject(("?", "a malformed message"), e, "dropped")
            return None

    def _run(self) -> None:
        self._poller.register(self.router, zmq.POLLIN)
        self._poller.register(self.loop.wake_fd, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                for sock, _ in self._poller.poll(self.loop.timeout_ms()):
                    if sock == self.loop.wake_fd:
                        self.loop.drain_wake()
                    else:
                        self._receive(sock)
                self.loop.run_due(lambda item: self._dispatch(*item))
        finally:
            self._close_sockets()

    def _receive(self, sock: zmq.Socket) -> None:
        """Read up to RECV_BUDGET ready messages from `sock`: attribute each to its sender, apply the
        sender's rate limit, decode, drop forgeries; hold back those on an emulated link."""
        from_router = sock is self.router
        address, peer, from_sub = (None, None, False) if from_router else self._peer_of[sock]
        for _ in range(RECV_BUDGET):
            if sock.closed or not sock.getsockopt(_EVENTS) & _POLLIN:  # cheaper than a recv raising Again
                return
            try:
                frames = sock.recv_multipart(_NOBLOCK, copy=False)
            except zmq.Again:  # EVENTS can report a message that a SUB filter then discards
                return
            arrived = time.monotonic()
            ident, body = (frames[0].bytes, frames[1:]) if from_router else (None, frames[1:] if from_sub else frames)
            if not body:
                continue
            who = self._sender(body[0]) if from_router else peer
            if self.keys is not None and who is None:
                self.forged += 1
                self.rejections.reject(("?", "a message"), ProtocolError("no authenticated sender"), "dropped")
                continue
            if not self.limiter.allow(who or ident or address, arrived):
                self.rejections.reject((who or "?", "a message"), ProtocolError(
                    f"over the rate limit of {self.limiter.limit.messages_per_s:g}/s"), "dropped")
                continue
            msg = self._decode(body)
            if msg is None:
                continue
            if who is not None and (msg.src not in ("", who) or msg.fields.get("node", who) != who):
                self.forged += 1
                self.rejections.reject((who, msg.type.name), ProtocolError(
                    f"claims to come from {msg.src or msg.fields.get('node')!r:.40}"), "dropped forged")
                continue
            if who is not None:
                msg.src = who  # an empty src (a CLI client) is filled in with who it really is
            if self.shaper.active and self.shaper.blocked(msg.zone, arrived):
                continue  # an emulated partition: the message is lost
            due = self.shaper.due(msg.zone, nbytes(body), arrived) if self.shaper.active else arrived
            if due > arrived:
                self.loop.hold(due, (msg, ident))
            else:
                self._dispatch(msg, ident)

    def _sender(self, frame: zmq.Frame) -> str | None:
        """The node id ZAP authenticated for a ROUTER message (None without CURVE)."""
        if self.keys is None:
            return None
        try:
            return self.keys.who(frame.get("User-Id"))
        except zmq.ZMQError:  # no User-Id: not a ZAP-checked connection
            return None

    def _dispatch(self, msg: Message, ident: bytes | None) -> None:
        entry = self._handlers.get(msg.type)
        if entry is None:
            log.debug("%s: no handler for %s from %r", self.node_id, msg.type.name, msg.src)
            return
        handler, worker = entry

        def reply(r: Message, _rid: int = msg.rid) -> None:
            if ident is None:
                return  # a broadcast or a reply: nothing to answer
            r.rid = _rid
            self.loop.call_soon(lambda: self._send(self.router, r, ident))

        def run() -> None:
            err = guard(lambda: handler(msg, reply), self.node_id, self.rejections, (msg.src, msg.type.name))
            if err is not None and msg.type is not MsgType.ERROR:
                code = "bad_request" if isinstance(err, ProtocolError) else "internal"
                reply(make(MsgType.ERROR, code=code, message=f"{msg.type.name}: {type(err).__name__}: {err}"))

        if worker is None:
            run()
        else:
            worker.submit(run)
