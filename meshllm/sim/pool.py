"""Independent simulator runs in parallel processes: the judge's trials (sim/trials.py).

Each run is deterministic, so the results are those of the same runs one after another in this
process; only the wall time changes (a `--plan --judge` or a coordinator's `plan_judge` on a
machine with many cores). Workers: MESHLLM_SIM_JOBS if set, else the CPUs this process may use;
with 1, or in a daemonic process (which may have no children), the runs stay in this process.
The pool is made on first use and kept for the next batch; its processes start with `spawn`
(a node process has threads, which `fork` would copy mid-lock) and end at exit. As with any
`spawn` pool, a script that plans with the judge must keep its top-level work under
`if __name__ == "__main__":` (each worker imports the script); if a worker cannot start, the
runs stay in this process from then on. A process that made a pool closes it when it exits, a
multiprocessing worker too (which would otherwise wait for ever on the pool's workers).
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import multiprocessing.util
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

log = logging.getLogger("meshllm.sim")

_pool: ProcessPoolExecutor | None = None
_broken = False  # a worker could not start or died: no pool again in this process
PARENT_POLL_S = 0.5  # a worker checks this often that the process that made the pool is alive


def workers() -> int:
    """How many processes run simulations at once (MESHLLM_SIM_JOBS, else the usable CPUs)."""
    given = os.environ.get("MESHLLM_SIM_JOBS", "").strip()
    if given:
        try:
            return max(1, int(given))
        except ValueError:
            log.warning("MESHLLM_SIM_JOBS=%r is not a whole number: using the CPUs", given)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def pmap(fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
    """[fn(x) for x in items], in the pool's processes when there are several items and workers;
    `fn` must be a module-level function and the items picklable."""
    global _pool, _broken
    n = workers()
    if n <= 1 or len(items) <= 1 or _broken or multiprocessing.current_process().daemon:
        return [fn(x) for x in items]
    if _pool is None:
        _pool = ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn"), initializer=_watch_parent,
                                    initargs=(os.getpid(),))
        atexit.register(close)
        # a multiprocessing worker (a bench's cluster process) runs no atexit handlers: it joins its
        # children first, and the pool's workers would wait on their queue for ever (a hang at exit)
        multiprocessing.util.Finalize(None, close, exitpriority=100)  # before its queues close (10)
    try:
        return list(_pool.map(fn, items))
    except BrokenProcessPool as e:  # a worker could not start (an unguarded script?) or was killed
        log.warning("the simulation pool broke (%s); the simulations run in this process from now on (a "
                    "script that plans with the judge keeps its work under if __name__ == '__main__')", e)
        _broken = True
        close()
        return [fn(x) for x in items]


def _watch_parent(parent: int) -> None:
    """A worker leaves when the process that made the pool is gone, even killed with -9 (an idle
    worker would wait on its queue for ever: an orphan)."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(0)

    threading.Thread(target=watch, name="sim-pool-parent", daemon=True).start()


def close() -> None:
    global _pool
    if _pool is not None:
        _pool.shutdown(wait=True, cancel_futures=True)
        _pool = None
