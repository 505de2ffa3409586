"""The gateway's admission: at most `limit` requests in flight, shared out fairly between clients.

Pure logic (no I/O; the clock is passed in). A client is what the API can tell apart without
trusting the client: its address. A request is refused (the API's 429 with Retry-After) when

- the gateway already holds `limit` requests (`gateway.max_concurrent`), or
- its client already holds its fair share, `ceil(limit / claimants)`, and the free slots are
  all owed to waiting clients. The claimants are the clients holding a request, the clients
  refused within the last `WAITING_S` (they were told to come back: they wait), and this one;
  a waiting client is owed its share less what it holds.

Without the second rule a client that sent again at once took every slot that freed, and one that
honoured `Retry-After: 1` found none: a review measured 80 requests to 0 with 8 slots. With it, a
flooding client is held to half the slots while one other client waits, and slots that free go to
the one that waits. A lone client still gets every slot, and so does any client while no other
waits (no slot idles for a client that is not asking). A slot kept for a client that does not
come back is free again `WAITING_S` after its last refusal.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict

WAITING_S = 5.0  # a refused client counts as waiting this long (Retry-After is 1 s: a few retries' worth)
MAX_WAITING = 65536  # clients remembered as waiting, at most (the oldest are forgotten first)


class Admission:
    """Requests in flight per client, and the clients refused lately; thread-safe."""

    def __init__(self, limit: int, waiting_s: float = WAITING_S, max_waiting: int = MAX_WAITING):
        self.limit, self.waiting_s, self.max_waiting = limit, waiting_s, max_waiting
        self.held: dict[str, int] = {}  # client -> requests it holds (none at 0: bounded by `limit`)
        self.refused_at: OrderedDict[str, float] = OrderedDict()  # client -> its last refusal, oldest first
        self.total = 0
        self._lock = threading.Lock()

    def try_admit(self, client: str, now: float) -> str | None:
        """Take a slot for `client` (None), or say why not (the slot is not taken)."""
        with self._lock:
            self._forget(now)
            why = None
            if self.total >= self.limit:
                why = f"this gateway has {self.total} requests in flight, its limit (gateway.max_concurrent)"
            else:
                share = math.ceil(self.limit / len(self.held.keys() | self.refused_at.keys() | {client}))
                if self.held.get(client, 0) >= share:  # the free slots it may take: those no waiting client is owed
                    waiting = [w for w in self.refused_at if w != client]
                    owed = sum(max(0, share - self.held.get(w, 0)) for w in waiting)
                    if self.limit - self.total <= owed:
                        why = (f"this client holds {self.held[client]} of this gateway's {self.total} requests "
                               f"in flight, its fair share ({share} of {self.limit}) while {len(waiting)} other "
                               f"client{'s' * (len(waiting) > 1)} wait{'s' * (len(waiting) == 1)} for a slot")
            if why is not None:
                self.refused_at[client] = now
                self.refused_at.move_to_end(client)
                while len(self.refused_at) > self.max_waiting:
                    self.refused_at.popitem(last=False)
                return why
            self.refused_at.pop(client, None)
            self.held[client] = self.held.get(client, 0) + 1
            self.total += 1
            return None

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
            self.refused_at.popitem(last=False)
