"""What happens to a message as it arrives, before its handler runs: the emulated link's delay and
partitions (`LinkShaper`), the per-peer rate limit (`RateLimit`, `RateLimiter`), the accounting
and rate-limited logging of rejected input (`Rejections`), and `guard`, which keeps a failing
handler from killing its thread. No sockets here: inbox.Inbox applies these to what the I/O
thread reads.

Link shaping (emulation only): with links configured, a message from a node in zone A to this
node in zone B is held back on arrival until
    max(arrival, link_busy_until) + bytes * 8 / bandwidth + rtt / 2
(FIFO per incoming link), so a request/reply over an 80 ms link costs 80 ms.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from meshllm.mesh.protocol import ProtocolError

log = logging.getLogger("meshllm.mesh.transport")

REJECT_LOG_PER_S = 5  # log lines a second per (sender, message type) for rejected messages; the rest are counted
REJECT_LOG_TOTAL_PER_S = 20  # ... and in all
REJECT_LOG_KEYS = 1024  # (sender, message type) pairs tracked at once
RATE_MESSAGES_PER_S = 50_000  # per-peer rate limit: sustained messages a second ...
RATE_BURST = 100_000  # ... and the bucket (a burst taken at once)
RATE_KEYS = 4096  # buckets kept at once (without CURVE a key is a connection, so bounded)


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
