"""The threads of a node's transport: `Worker`, a compute thread fed by a queue (data-plane
handlers and a scheduler's background step run there), and `IOLoop`, the bookkeeping of the one
I/O thread (timers, calls handed over from other threads with a wake-up pipe, and deliveries held
back for an emulated link). No sockets here: transport.py owns them.
"""

from __future__ import annotations

import heapq
import itertools
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from meshllm.mesh.ingress import guard

POLL_MAX_S = 0.1  # the I/O loop wakes at least this often
CLOSE_WAIT_S = 5.0  # how long closing a Worker waits for the job it is running (a layer load, a plan search)


class Worker:
    """A compute thread fed by a queue. Data-plane handlers registered with it run here, in
    arrival order, never on the I/O thread. `step` (optional) is background work run whenever
    the queue is empty, e.g. a scheduler's next forward pass; it returns True while it has more.
    `busy_poll_s` > 0: with nothing to do, poll the queue that long before sleeping on it (the
    next micro-batch of a pipeline is taken at once, not after a wake-up from idle; each poll
    lets the other threads run), then sleep as usual."""

    def __init__(self, name: str, step: Callable[[], bool] | None = None,
                 wake_after: Callable[[], float | None] | None = None, busy_poll_s: float = 0.0):
        self.name, self._step, self._wake_after = name, step, wake_after  # wake_after: s until `step`
        # must run again even if no message comes (None: only a message wakes it)
        self.busy_poll_s = busy_poll_s
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

    def close(self, timeout_s: float | None = None) -> None:
        self._stopping = True
        self._q.put(None)
        if self._thread.is_alive() and not self.in_worker():
            self._thread.join(timeout=CLOSE_WAIT_S if timeout_s is None else timeout_s)

    def busy(self) -> bool:
        """Still running a job after close(): the process must not run the interpreter's exit
        under it (torch, mid-operation in a thread then, aborts the process: exit 134)."""
        return self._thread.is_alive() and not self.in_worker()

    def _run(self) -> None:
        want_step = self._step is not None
        while not self._stopping:
            try:
                fn = self._q.get_nowait() if want_step else self._next()
            except queue.Empty:  # nothing queued (or a deadline passed): one unit of background work
                want_step = self._run_step()
                continue
            if fn is None:
                return
            guard(fn, self.name)
            want_step = self._step is not None  # drain every queued event, then step

    def _next(self) -> Callable[[], None] | None:
        """The next queued call: polled for up to busy_poll_s, then waited for (queue.Empty when
        the scheduler's deadline comes first)."""
        timeout = self._idle_timeout()
        if self.busy_poll_s > 0:
            start = time.monotonic()
            spin = self.busy_poll_s if timeout is None else min(self.busy_poll_s, timeout)
            while time.monotonic() - start < spin:
                try:
                    return self._q.get_nowait()
                except queue.Empty:
                    time.sleep(0)  # let the I/O thread have the GIL
            if timeout is not None:
                timeout -= time.monotonic() - start
                if timeout <= 0:
                    raise queue.Empty
        return self._q.get(block=True, timeout=timeout)

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
        os.set_blocking(self._wake_w, False)  # a full pipe (a wake-up pending anyway) must not block the caller

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
