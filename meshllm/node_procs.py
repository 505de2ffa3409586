"""The emulator's node processes: forks of one fork server that has imported torch once.

A node is its own OS process that runs `launch.py --node-config NODE.yaml` (`run_node`: the CLI's
`main`), with one compute thread (OMP_NUM_THREADS=1), its own process group, its log as stdout and
stderr, pinned to a CPU if asked. It is made by multiprocessing's fork server, started once per
emulator process with the modules of NODE_PRELOAD imported: N nodes do not import torch N times
over (~1.5 s of CPU each; on 2 cores the demo's six nodes formed their mesh in ~4.9 s, now ~2 s).

No orphans: on Linux each node gets PR_SET_PDEATHSIG, so it dies when its parent, the fork server,
exits, which it does when the emulator exits or is killed with -9 (its "alive" pipe closes; each node
closes its own copy of that pipe's write end, which multiprocessing hands it, or the server would
wait for the nodes); a node checks after the prctl that the server and the emulator are still there.
`NodeProcess` gives the emulator the calls of subprocess.Popen it makes (poll, wait, pid, returncode).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

# what every node imports before it listens (~1.5 s of CPU, most of it torch): imported once, in the
# fork server that makes the node processes, instead of once per node
NODE_PRELOAD = ("torch", "numpy", "zmq", "zeroconf", "yaml", "meshllm.launch", "meshllm.roles.host")
NODE_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # one compute thread
_LOCK = threading.Lock()  # the environment is the fork server's only while it starts


def fork_server() -> multiprocessing.context.ForkServerContext:
    """Node processes come from multiprocessing's fork server, started (once per emulator process)
    with NODE_ENV and the modules of NODE_PRELOAD imported: each node is a fork of it, its own OS
    process, that runs `launch.py --node-config` (`run_node`). Nothing has computed in the fork
    server (no thread pool of torch's has started), so a fork of it is as clean as a new interpreter."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(NODE_PRELOAD))
    with _LOCK:
        saved = {k: os.environ.get(k) for k in NODE_ENV}
        os.environ.update(NODE_ENV)  # the fork server's own environment: its imports see one thread
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return ctx



def die_with_emulator(server: int) -> None:
    """In a node process: SIGKILL when its parent, the fork server `server` (which exits with the
    emulator), dies (Linux). A server or emulator gone before the prctl leaves no death signal to
    come, so the node then exits at once (prctl(2))."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        emulator = multiprocessing.parent_process()
        if os.getppid() != server or (emulator is not None and not emulator.is_alive()):
            os._exit(1)


def run_node(name: str, argv: list[str], log_path: str, cwd: str, env: dict[str, str], cpu: int | None) -> None:
    """A node process (made by the fork server): its own process group, dies with the emulator,
    pinned to `cpu` if given (before any thread starts, so every thread of the node inherits it),
    named after the node, stdout and stderr appended to its log (which start_node made); then
    `launch.py ARGV`."""
    server = os.getppid()
    os.setsid()
    # multiprocessing hands each process the write end of the fork server's "emulator alive" pipe (so
    # that it could ask the server for processes too); the server exits when every copy is closed, so
    # a node that kept it would keep the server, and so itself (its death signal is the server's
    # exit), alive after the emulator is killed
    fs = multiprocessing.forkserver._forkserver
    if getattr(fs, "_forkserver_alive_fd", None) is not None:
        os.close(fs._forkserver_alive_fd)
        fs._forkserver_alive_fd = None
    die_with_emulator(server)
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15])  # PR_SET_NAME: `ps` and `top` show the node's id
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)  # start_node made (or emptied) it
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    from meshllm.launch import main

    sys.exit(main(argv))


@contextlib.contextmanager
def signals_held():
    """SIGINT and SIGTERM wait (blocked) until the block ends, then their handlers run."""
    held = {signal.SIGINT, signal.SIGTERM}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class NodeProcess:
    """One node's process, with the calls of subprocess.Popen that the emulator makes."""

    def __init__(self, proc: multiprocessing.process.BaseProcess):
        self.proc = proc

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.exitcode

    def poll(self) -> int | None:
        return self.proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"node process {self.pid}", timeout or 0.0)
        return self.proc.exitcode


def start_node(name: str, argv: list[str], log_path: Path, cwd: Path, env: dict[str, str],
               cpu: int | None, append: bool = False) -> NodeProcess:
    """A node process running `launch.py ARGV`, named `name` (call it with signals_held, so that an
    interrupt cannot come between the start and the caller listing it). Its log exists when this
    returns (emptied unless `append`), even if the node is stopped before it runs a line."""
    with open(log_path, "a" if append else "w"):
        pass
    proc = fork_server().Process(target=run_node, name=f"meshllm node {name}",
                                 args=(name, argv, str(log_path), str(cwd), env, cpu))
    proc.start()
    return NodeProcess(proc)
