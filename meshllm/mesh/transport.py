"""The thin ZeroMQ layer of one node, plus link shaping for local emulation.

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
a rate-limited log line; the defaults sit far above what serving sends.

Link shaping (emulation only): with links configured, a message from a node in
zone A to this node in zone B is held back on arrival until
    max(arrival, link_busy_until) + bytes * 8 / bandwidth + rtt / 2
(FIFO per incoming link), so a request/reply over an 80 ms link costs 80 ms.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from meshllm.mesh.keys import Admission, NodeKeys, UnknownPeerKey
from meshllm.mesh.protocol import Message, MsgType, ProtocolError, decode, encode, make
from meshllm.mesh.sockets import Requester, client_socket, endpoint, make_socket, nbytes

log = logging.getLogger("meshllm.mesh.transport")

POLL_MAX_S = 0.1  # the I/O loop wakes at least this often
RECV_BUDGET = 256  # messages read from one socket per loop turn, so timers still run under load
REJECT_LOG_PER_S = 5  # log lines a second per (sender, message type) for rejected messages; the rest are counted
REJECT_LOG_TOTAL_PER_S = 20  # ... and in all
REJECT_LOG_KEYS = 1024  # (sender, message type) pairs tracked at once
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)  # ints: IntFlag ops are slow
RATE_MESSAGES_PER_S = 50_000  # per-peer rate limit: sustained messages a second ...
RATE_BURST = 100_000  # ... and the bucket (a burst taken at once)
RATE_KEYS = 4096  # buckets kept at once (without CURVE a key is a connection, so bounded)
Handler = Callable[[Message, Callable[[Message], None]], None]
TOPIC_MESH = b"mesh\0"  # heartbeats, gossip, plans: every node subscribes


def topic(name: str) -> bytes:
    """A PUB/SUB topic frame. The NUL end makes ZeroMQ's prefix match exact ("draft/1" is not
    "draft/10")."""
    return name.encode() + b"\0"


class LinkShaper:
    """Delays incoming messages as the emulated link from the sender's zone would. Thread-safe."""

    def __init__(self, my_zone: str, links: tuple = (), time_scale: float = 1.0):
        self.my_zone = my_zone
        # src zone -> (one-way delay s, bytes per s); links are symmetric; time_scale K makes every
        # link K times slower (K x the delay, 1/K the bandwidth), as the cluster file asks
        self._links: dict[str, tuple[float, float]] = {}
        for ln in links:
            a, b = ln.zones
            for src, dst in ((a, b), (b, a)):
                if dst == my_zone:
                    self._links[src] = (time_scale * ln.rtt_ms / 2000.0, ln.bandwidth_mbps * 1e6 / 8.0 / time_scale)
        self._busy_until: dict[str, float] = {}
        self._lock = threading.Lock()
        self._cut_until: dict[str, float] = {}  # emulated partitions: src zone -> monotonic end
        self.cut = 0  # messages dropped by a partition

    @property
    def active(self) -> bool:
        return bool(self._links) or bool(self._cut_until)

    def partition(self, zone_a: str, zone_b: str, seconds: float) -> None:
        """Drop everything between the two zones for `seconds` (fault injection; this node's side)."""
        other = zone_b if zone_a == self.my_zone else zone_a if zone_b == self.my_zone else None
        if other is not None:
            with self._lock:
                self._cut_until[other] = time.monotonic() + seconds

    def blocked(self, src_zone: str, now: float) -> bool:
        end = self._cut_until.get(src_zone)
        if end is None:
            return False
        if now >= end:
            with self._lock:
                self._cut_until.pop(src_zone, None)
            return False
        self.cut += 1
        return True

    def due(self, src_zone: str, nbytes: int, now: float) -> float:
        """Monotonic time at which a message of `nbytes` that arrived `now` is delivered."""
        link = self._links.get(src_zone) if src_zone else None
        if link is None:
            return now
        one_way_s, bytes_per_s = link
        with self._lock:
            departed = max(now, self._busy_until.get(src_zone, 0.0)) + nbytes / bytes_per_s
            self._busy_until[src_zone] = departed
        return departed + one_way_s


@dataclass(frozen=True)
class RateLimit:
    """Per-peer token bucket: `messages_per_s` sustained, `burst` at once."""

    messages_per_s: float = RATE_MESSAGES_PER_S
    burst: float = RATE_BURST


class RateLimiter:
    """Token buckets keyed by sender, on the I/O thread only. `allow(key, now)` takes one token."""

    def __init__(self, limit: RateLimit):
        self.limit = limit
        self.dropped = 0  # messages over the limit
        self._buckets: dict[Any, list[float]] = {}  # key -> [tokens, last refill]

    def allow(self, key: Any, now: float) -> bool:
        b = self._buckets.get(key)
        if b is None:
            if len(self._buckets) >= RATE_KEYS:
                self._buckets = {k: v for k, v in self._buckets.items() if v[0] < self.limit.burst}  # idle ones go
                if len(self._buckets) >= RATE_KEYS:
                    self._buckets.clear()
            b = self._buckets[key] = [self.limit.burst, now]
        else:
            b[0] = min(self.limit.burst, b[0] + (now - b[1]) * self.limit.messages_per_s)
            b[1] = now
        if b[0] >= 1.0:
            b[0] -= 1.0
            return True
        self.dropped += 1
        return False


class Rejections:
    """Counts rejected input and logs it, one line per message but at most `per_s` lines a second
    per (sender, message type) and REJECT_LOG_TOTAL_PER_S in all (sender names can be forged): a
    flood of bad messages cannot flood the log. What is held back is summed up in "suppressed"
    lines: when its key logs again, at `flush` (every second, on the I/O thread, which also forgets
    idle keys), or when the table of keys is full. Thread-safe."""

    def __init__(self, who: str, per_s: int = REJECT_LOG_PER_S, clock: Callable[[], float] = time.monotonic):
        self.who, self.per_s, self.clock = who, per_s, clock
        self.count = 0  # every rejected message, logged or not
        self._keys: dict[tuple[str, str], list] = {}  # key -> [window start, lines logged, lines held back]
        self._second = [0.0, 0]  # all keys: [window start, lines logged]
        self._lock = threading.Lock()

    def reject(self, key: tuple[str, str], err: Exception, verb: str = "rejected") -> None:
        """One rejected message from sender key[0] of type key[1] (ProtocolError `err`)."""
        now = self.clock()
        with self._lock:
            self.count += 1
            w = self._keys.get(key)
            if w is None or now - w[0] >= 1.0:
                if w is not None and w[2]:
                    self._summary(w[2], f"{key[1]} from {key[0]!r}")
                if w is None and len(self._keys) >= REJECT_LOG_KEYS:
                    held = sum(x[2] for x in self._keys.values())
                    if held:
                        self._summary(held, f"from {len(self._keys)} senders")
                    self._keys.clear()
                w = self._keys[key] = [now, 0, 0]
            if now - self._second[0] >= 1.0:
                self._second = [now, 0]
            if w[1] >= self.per_s or self._second[1] >= REJECT_LOG_TOTAL_PER_S:
                w[2] += 1
                return
            w[1] += 1
            self._second[1] += 1
        log.warning("%s: %s %s from %r: %s", self.who, verb, key[1], key[0], err)

    def flush(self) -> None:
        now = self.clock()
        with self._lock:
            for key, w in list(self._keys.items()):
                if now - w[0] >= 1.0:
                    if w[2]:
                        self._summary(w[2], f"{key[1]} from {key[0]!r}")
                    del self._keys[key]

    def _summary(self, n: int, what: str) -> None:
        log.warning("%s: suppressed %d similar rejected messages (%s)", self.who, n, what)


def guard(fn: Callable[[], Any], who: str, rejections: Rejections | None = None,
          key: tuple[str, str] = ("?", "?")) -> Exception | None:
    """Run a handler or timer; a failure must not kill its thread (the I/O thread carries the
    heartbeats). Bad input (ProtocolError) is logged in one line (rate-limited by `rejections`,
    per `key` = (sender, message type)), anything else with its traceback; never swallowed.
    Returns the exception, for the caller's answer."""
    try:
        fn()
    except ProtocolError as e:
        if rejections is not None:
            rejections.reject(key, e)
        else:
            log.warning("%s: rejected bad input: %s", who, e)
        return e
    except Exception as e:
        log.exception("%s: handler crashed; the node keeps serving", who)
        return e
    return None


class Worker:
    """A compute thread fed by a queue. Data-plane handlers registered with it run here, in
    arrival order, never on the I/O thread. `step` (optional) is background work run whenever
    the queue is empty, e.g. a scheduler's next forward pass; it returns True while it has more."""

    def __init__(self, name: str, step: Callable[[], bool] | None = None,
                 wake_after: Callable[[], float | None] | None = None):
        self.name, self._step, self._wake_after = name, step, wake_after  # wake_after: s until `step`
        # must run again even if no message comes (None: only a message wakes it)
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._stopping = False

    def start(self) -> Worker:
        self._thread.start()
        return self

    def submit(self, fn: Callable[[], None]) -> None:
        self._q.put(fn)

    def in_worker(self) -> bool:
        return threading.current_thread() is self._thread

    def close(self, timeout_s: float = 5.0) -> None:
        self._stopping = True
        self._q.put(None)
        if self._thread.is_alive() and not self.in_worker():
            self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        want_step = self._step is not None
        while not self._stopping:
            try:
                fn = self._q.get(block=True, timeout=self._idle_timeout()) if not want_step else self._q.get_nowait()
            except queue.Empty:  # nothing queued (or a deadline passed): one unit of background work
                want_step = self._run_step()
                continue
            if fn is None:
                return
            guard(fn, self.name)
            want_step = self._step is not None  # drain every queued event, then step

    def _idle_timeout(self) -> float | None:
        if self._wake_after is None:
            return None
        box: list[float | None] = [1.0]  # if the callback fails (logged by guard): look again in 1 s

        def ask() -> None:
            box[0] = self._wake_after()

        guard(ask, self.name)
        return None if box[0] is None else max(0.001, box[0])

    def _run_step(self) -> bool:
        more = [False]

        def run() -> None:
            more[0] = bool(self._step())

        return guard(run, self.name) is None and more[0]  # a failed step does not spin


class IOLoop:
    """The bookkeeping of one I/O thread: timers, calls from other threads, held deliveries."""

    def __init__(self, who: str):
        self.who = who
        self.thread: threading.Thread | None = None
        self._timers: list[list] = []  # [next_due, interval_s, fn]
        self._calls: deque[Callable[[], None]] = deque()
        self._held: list[tuple] = []  # heap of (due, seq, item) waiting for their emulated link
        self._seq = itertools.count()
        self.wake_fd, self._wake_w = os.pipe()
        os.set_blocking(self.wake_fd, False)

    def in_loop(self) -> bool:
        return threading.current_thread() is self.thread

    def every(self, interval_s: float, fn: Callable[[], None]) -> None:
        self._timers.append([time.monotonic(), interval_s, fn])

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the I/O thread (at once if called from it)."""
        if self.in_loop():
            fn()
        else:
            self._calls.append(fn)
            self.wake()

    def defer(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the I/O thread after the current turn: for changes to the sockets (connect,
        disconnect, close), never made while a receive loop is reading them."""
        self._calls.append(fn)
        self.wake()

    def hold(self, due: float, item: Any) -> None:
        heapq.heappush(self._held, (due, next(self._seq), item))

    def wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # the pipe is full (a wake-up is pending anyway) or closed at shutdown

    def drain_wake(self) -> None:
        try:
            while os.read(self.wake_fd, 4096):
                pass
        except BlockingIOError:
            pass  # drained

    def timeout_ms(self) -> int:
        now = time.monotonic()
        nxt = now + POLL_MAX_S
        if self._timers:
            nxt = min(nxt, min(t[0] for t in self._timers))
        if self._held:
            nxt = min(nxt, self._held[0][0])
        return max(0, int((nxt - now) * 1000) + 1) if nxt > now else 0

    def run_due(self, deliver: Callable[[Any], None]) -> None:
        """Run queued calls, deliver held items whose time has come, fire due timers."""
        while self._calls:
            guard(self._calls.popleft(), self.who)
        now = time.monotonic()
        while self._held and self._held[0][0] <= now:
            deliver(heapq.heappop(self._held)[2])
        for t in self._timers:
            if t[0] <= now:
                t[0] = now + t[1]
                guard(t[2], self.who)

    def close(self) -> None:
        os.close(self.wake_fd)
        os.close(self._wake_w)


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
