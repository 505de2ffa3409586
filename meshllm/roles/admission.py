"""The gateway's admission: at most `limit` requests in flight, and the slots that free go first
to the clients that waited for them.

Pure logic (no I/O; the clock is passed in). A client is what the API can tell apart without
trusting the client: its address. A refused client (the API's 429 with Retry-After) waits from
its first refusal until it is admitted, or until it has not asked for `WAITING_S`. A request is
refused when

- the gateway already holds `limit` requests (`gateway.max_concurrent`), or
- the free slots are no more than the waiting clients ahead of its client: those that hold fewer
  requests than it does, or as many and have waited longer (a client not waiting comes after
  every waiting one that holds as many). Each of them is owed the next free slot.

Without the second rule a client that sent again at once took every slot that freed, and one
that honoured `Retry-After: 1` found none (a review measured 80 requests to 0 with 8 slots; and,
with as many clients as slots, 0 of 40 for the one that waited). With it, a slot that frees goes
to the client that waited, and among clients that all want more, the one that holds the fewest:
their shares even out. While no one waits, any client may take every free slot; a slot owed to
a client that does not come back is free again `WAITING_S` after its last refusal.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

WAITING_S = 5.0  # a refused client waits this long after its last refusal (Retry-After is 1 s)
MAX_WAITING = 65536  # waiting clients remembered, at most (the longest silent are forgotten first)


class Admission:
    """Requests in flight per client, and the clients waiting for a slot; thread-safe."""

    def __init__(self, limit: int, waiting_s: float = WAITING_S, max_waiting: int = MAX_WAITING):
        self.limit, self.waiting_s, self.max_waiting = limit, waiting_s, max_waiting
        self.held: dict[str, int] = {}  # client -> requests it holds (none at 0: bounded by `limit`)
        self.refused_at: OrderedDict[str, float] = OrderedDict()  # waiting client -> last refusal, oldest first
        self.since: dict[str, float] = {}  # waiting client -> its first refusal since it was last admitted
        self.total = 0
        self._lock = threading.Lock()

    def try_admit(self, client: str, now: float) -> str | None:
        """Take a slot for `client` (None), or say why not (the slot is not taken)."""
        with self._lock:
            self._forget(now)
            free = self.limit - self.total
            why = None
            if free <= 0:
                why = f"this gateway has {self.total} requests in flight, its limit (gateway.max_concurrent)"
            elif ahead := self._ahead(client, free):
                why = (f"{'the free slot is' if free == 1 else f'the {free} free slots are'} owed to "
                       f"{'a client' if ahead == 1 else f'{ahead} clients'} that waited first and "
                       f"{'holds' if ahead == 1 else 'hold'} no more than this one's {self.held.get(client, 0)}")
            if why is not None:
                self.since.setdefault(client, now)
                self.refused_at[client] = now
                self.refused_at.move_to_end(client)
                while len(self.refused_at) > self.max_waiting:
                    self.since.pop(self.refused_at.popitem(last=False)[0], None)
                return why
            self.refused_at.pop(client, None)
            self.since.pop(client, None)
            self.held[client] = self.held.get(client, 0) + 1
            self.total += 1
            return None

    def _ahead(self, client: str, free: int) -> int:
        """The waiting clients ahead of `client`, counted up to `free` (0: it may take a slot now)."""
        mine = (self.held.get(client, 0), self.since.get(client, float("inf")))
        n = 0
        for w, since in self.since.items():
            if w != client and (self.held.get(w, 0), since) < mine:
                n += 1
                if n >= free:
                    return n
        return 0

    def release(self, client: str) -> None:
        """A request of `client`'s has ended (its response is over)."""
        with self._lock:
            n = self.held[client] - 1
            if n:
                self.held[client] = n
            else:
                del self.held[client]
            self.total -= 1

    def _forget(self, now: float) -> None:
        while self.refused_at and now - next(iter(self.refused_at.values())) > self.waiting_s:
            self.since.pop(self.refused_at.popitem(last=False)[0], None)
