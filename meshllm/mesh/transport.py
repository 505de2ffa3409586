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

from meshllm.mesh.inbox import Inbox, Requester
from meshllm.mesh.ingress import LinkShaper, RateLimit, RateLimiter, Rejections, guard
from meshllm.mesh.keys import Admission, NodeKeys
from meshllm.mesh.loop import IOLoop, Worker
from meshllm.mesh.protocol import Message, MsgType, ProtocolError, encode, make
from meshllm.mesh.sockets import PeerSockets, endpoint, make_socket, send_frames

log = logging.getLogger("meshllm.mesh.transport")

_NOBLOCK = int(zmq.NOBLOCK)  # an int: IntFlag ops are slow
Handler = Callable[[Message, Callable[[Message], None]], None]
REBIND_WAIT_S = 1.0  # cut_subscribers: how long the PUB may wait for libzmq to free its port
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
        self.loop = IOLoop(node_id)
        self.rejections = Rejections(node_id)  # malformed frames and messages a handler refused
        self.loop.every(1.0, self.rejections.flush)
        self.limiter = RateLimiter(rate)
        self.inbox = Inbox(node_id, keys, self.shaper, self.limiter, self.rejections)  # .dropped, .forged
        self.client = Requester(self.ctx, keys, self._stamp, self.inbox.decode, self.shaper)
        self._handlers: dict[MsgType, tuple[Handler, Worker | None]] = {}
        self._poller = zmq.Poller()
        self.peers = PeerSockets(self.ctx, keys, self._poller, node_id, {TOPIC_MESH})
        self._stop = threading.Event()
        self._closed = False
        self.on_peer_gone: Callable[[str], None] | None = None  # I/O thread: the process at an address is gone
        # ZAP before any CURVE server socket exists: no handshake runs unchecked
        self.admission = Admission(self.ctx, keys, self.inbox.refused) if keys is not None else None
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
        self.peers.close()
        for s in (self.router, self.pub):
            s.close(linger=0)
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
            self.loop.call_soon(lambda: self._send(self.peers.dealer(address), msg))
        elif address == self.local_address:
            self._deliver_local(msg)
        else:
            self.client.send(address, msg)

    def _deliver_local(self, msg: Message) -> None:
        """Hand a message to this node's own handler as if it had arrived: encoded and decoded again
        (the handler gets its own copy, checked as any message is), no socket, no I/O-thread wake-up
        for a data-plane handler. Such sends are never answered, as with any `send`."""
        self._stamp(msg)
        copy = self.inbox.decode([bytes(f) for f in encode(msg)])
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
        self.loop.defer(lambda: self.peers.subscribe(address))

    def subscribe_topic(self, topic_frame: bytes, on: bool = True) -> None:
        self.loop.defer(lambda: self.peers.set_topic(topic_frame, on))

    def pin(self, node_id: str, address: str, first_hand: bool) -> bool:
        """With CURVE: the node at `address` is `node_id` (keys.NodeKeys.pin); False if that is not
        accepted (an id outside the authorized keys, or second-hand news against a pin). Without
        CURVE: True."""
        return self.keys is None or self.keys.pin(node_id, address, first_hand)

    def forget(self, address: str) -> None:
        """Drop the SUB connection and the control DEALER to a peer that left."""
        self.loop.defer(lambda: self.peers.forget(address))

    def cut_subscribers(self) -> None:
        """Close every connection to this node's PUB: its subscribers reconnect at once (libzmq,
        ~0.1 s) and pass ZAP again, so a node whose key was removed reads no more publications
        (plans, heartbeats, drafts) over the connection it had. What is published meanwhile is
        lost to all, as a heartbeat or a draft may be: plans are published again, heartbeats go on."""
        self.loop.defer(self._rebind_pub)

    def _rebind_pub(self) -> None:
        where = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.pub.unbind(where)  # closes the connections it accepted; libzmq frees the port a moment later
        deadline = time.monotonic() + REBIND_WAIT_S
        while True:
            try:
                self.pub.bind(where)
                break
            except zmq.ZMQError as e:
                if e.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    log.error("%s: cannot listen on %s again after closing its subscribers' connections: %s",
                              self.node_id, where, e)
                    return
                time.sleep(0.001)
        log.info("%s: closed every connection to its PUB (a key was removed); its subscribers reconnect",
                 self.node_id)

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
            send_frames(sock, [first, *frames] if first is not None else frames, _NOBLOCK)
        except zmq.Again:
            log.warning("%s: send queue full, dropped control message %s", self.node_id, msg.type.name)
            if sock in self.peers.owner:  # a DEALER with no connection: libzmq gives up on a peer whose
                self.peers.forget(self.peers.owner[sock][0])  # CURVE handshake refused us; the next send
                # or subscription connects afresh (the peer may have admitted this node since)
        except zmq.ZMQError as e:
            log.warning("%s: cannot send %s: %s", self.node_id, msg.type.name, e)

    def _run(self) -> None:
        self._poller.register(self.router, zmq.POLLIN)
        self._poller.register(self.loop.wake_fd, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                for sock, _ in self._poller.poll(self.loop.timeout_ms()):
                    if sock == self.loop.wake_fd:
                        self.loop.drain_wake()
                    elif sock in self.peers.monitors:
                        gone = self.peers.refused(sock)
                        if gone is not None and self.on_peer_gone is not None:
                            guard(lambda gone=gone: self.on_peer_gone(gone), self.node_id)
                        while self.peers.refused_subs:
                            self.loop.defer(lambda a=self.peers.refused_subs.pop(): self.peers.drop_sub(a))
                    else:
                        self.inbox.receive(sock, None if sock is self.router else self.peers.owner[sock],
                                           self._dispatch, self.loop.hold)
                self.loop.run_due(lambda item: self._dispatch(*item))
        finally:
            self._close_sockets()

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
