"""Local emulation of a whole cluster: one OS process per node on 127.0.0.1.

`python launch.py --cluster CLUSTER.yaml` validates the cluster file, writes one
node file per node (random free loopback ports, the cluster's links, seeds =
the first node, mdns off so concurrent emulations never mix), starts
`python launch.py --node-config NODE.yaml` for each with one compute thread
(OMP_NUM_THREADS=1), waits until every node sees every other alive, reports,
and tears everything down.

No orphans: each node runs in its own process group (killed as a group: SIGTERM,
then SIGKILL after TEARDOWN_GRACE_S), teardown runs from `finally`, atexit and a
SIGTERM handler, and on Linux each child also gets PR_SET_PDEATHSIG so it dies
with the emulator even if the emulator is killed with -9.

Emulated links: every node's transport delays messages from another zone by
rtt/2 + bytes/bandwidth, FIFO per link (see transport.LinkShaper). Emulated
device speed: `Pacer` (below) stretches each measured compute step to the time
the device profile predicts.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from meshllm.config import ClusterConfig, NodeSpec
from meshllm.mesh.node import query_status
from meshllm.mesh.sockets import free_port_pair

log = logging.getLogger("meshllm.emulate")

LAUNCH = Path(__file__).resolve().parent.parent / "launch.py"
FORMATION_TIMEOUT_S = 60.0  # generous: N interpreters start on a small machine
TEARDOWN_GRACE_S = 3.0  # SIGTERM, then SIGKILL
STATUS_POLL_S = 0.1
METRIC_KEYS = ("ttft_ms_mean", "ttft_ms_p99", "itl_ms_mean", "itl_ms_p50", "itl_ms_p99", "output_tokens_per_s",
               "queue_wait_ms_mean", "acceptance_rate", "mean_acceptance_length", "drafted_tokens",
               "accepted_tokens")


class Pacer:
    """Device-speed emulation: make a compute step last as long as the device profile predicts.

    The host CPU is (usually) faster than the emulated device. After a step that
    started at `started_at` (a `clock()` reading), `pace(predicted_s, started_at)`
    sleeps `predicted_s - measured` when that is positive; a step already slower
    than predicted is not stretched (it is counted in `overrun_s`). `predict` is
    injected (e.g. partition/cost.py's roofline time for a stage on a device).
    """

    def __init__(self, predict: Callable[..., float] | None = None, *, enabled: bool = True,
                 clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep):
        self.predict, self.enabled, self.clock, self._sleep = predict, enabled, clock, sleep
        self.steps = 0
        self.measured_s = self.slept_s = self.overrun_s = 0.0

    def pace(self, predicted_s: float, started_at: float) -> float:
        """Sleep the rest of `predicted_s`; returns the seconds slept."""
        measured = self.clock() - started_at
        self.steps += 1
        self.measured_s += measured
        lag = predicted_s - measured
        if lag <= 0 or not self.enabled:
            self.overrun_s += max(0.0, -lag)
            return 0.0
        self._sleep(lag)
        self.slept_s += lag
        return lag

    @contextlib.contextmanager
    def step(self, *args: Any, **kwargs: Any) -> Iterator[None]:
        """`with pacer.step(stage, n_tokens): forward(...)`: paced to `predict(*args, **kwargs)`."""
        assert self.predict is not None, "Pacer.step needs a predict callable"
        started = self.clock()
        yield
        self.pace(self.predict(*args, **kwargs), started)


def node_file(spec: NodeSpec, cfg: ClusterConfig, address: str, seed: str) -> dict[str, Any]:
    device = {k: v for k, v in dataclasses.asdict(spec.device).items()}
    out: dict[str, Any] = {
        "id": spec.id, "device": device, "zone": spec.zone, "listen": address, "seeds": [seed], "mdns": False,
        "model": cfg.model,
        "links": [{"zones": list(ln.zones), "rtt_ms": ln.rtt_ms, "bandwidth_mbps": ln.bandwidth_mbps}
                  for ln in cfg.links],
    }
    if spec.roles:
        out["roles"] = list(spec.roles)
    return out


def _die_with_parent() -> None:
    """preexec_fn: own process group, and SIGKILL when the emulator dies (Linux)."""
    os.setsid()
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class EmulatedCluster:
    """The node processes of one cluster. Use as a context manager; `close()` is idempotent."""

    def __init__(self, cfg: ClusterConfig, workdir: Path | None = None):
        self.cfg = cfg
        self._own_workdir = workdir is None
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="meshllm-cluster-"))
        self.addresses: dict[str, str] = {}
        self.procs: dict[str, subprocess.Popen] = {}

    def __enter__(self) -> EmulatedCluster:
        atexit.register(self.close)
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type: type | None, *exc: object) -> None:
        self.close()
        atexit.unregister(self.close)
        if exc_type is None and self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        elif self._own_workdir:
            log.error("node files and logs kept in %s", self.workdir)

    def start(self) -> None:
        import yaml

        for spec in self.cfg.nodes:
            self.addresses[spec.id] = f"127.0.0.1:{free_port_pair()}"
        seed = self.addresses[self.cfg.nodes[0].id]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        for spec in self.cfg.nodes:
            path = self.workdir / f"{spec.id}.yaml"
            path.write_text(yaml.safe_dump(node_file(spec, self.cfg, self.addresses[spec.id], seed)))
            with open(self.workdir / f"{spec.id}.log", "wb") as logf:
                self.procs[spec.id] = subprocess.Popen(
                    [sys.executable, str(LAUNCH), "--node-config", str(path)], stdin=subprocess.DEVNULL,
                    stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=LAUNCH.parent, preexec_fn=_die_with_parent)
        log.info("started %d node processes (logs in %s)", len(self.procs), self.workdir)

    def log_tail(self, node_id: str, n_chars: int = 1500) -> str:
        p = self.workdir / f"{node_id}.log"
        return p.read_text(errors="replace")[-n_chars:] if p.is_file() else ""

    def wait_formed(self, timeout_s: float = FORMATION_TIMEOUT_S) -> dict[str, dict]:
        """Block until every node sees every other alive; returns each node's status."""
        deadline = time.monotonic() + timeout_s
        ids = [n.id for n in self.cfg.nodes]
        statuses: dict[str, dict] = {}
        while time.monotonic() < deadline:
            self._check_alive()
            for nid in ids:
                with contextlib.suppress(TimeoutError):
                    wait_s = min(1.0, max(0.01, deadline - time.monotonic()))
                    statuses[nid] = query_status(self.addresses[nid], timeout_s=wait_s)
            if len(statuses) == len(ids) and all(_sees_all(statuses[n], ids) for n in ids):
                return statuses
            time.sleep(STATUS_POLL_S)
        missing = {n: sorted(set(ids) - {n} - _alive(statuses.get(n, {}))) for n in ids}
        raise RuntimeError(f"the mesh did not form within {timeout_s:g} s; unseen peers: {missing}")

    def _check_alive(self) -> None:
        for nid, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"node {nid} exited with code {proc.returncode}: {self.log_tail(nid)}")

    def close(self) -> None:
        """SIGTERM every node's process group, then SIGKILL what is left; reap all."""
        live = {nid: p for nid, p in self.procs.items() if p.poll() is None}
        for p in live.values():
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + TEARDOWN_GRACE_S
        for p in live.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs.values():
            _signal_group(p, signal.SIGKILL)  # also any grandchild left in the group
            p.wait()


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, sig)


def _alive(status: dict) -> set[str]:
    return {p["id"] for p in status.get("peers", []) if p["state"] == "alive"}


def _sees_all(status: dict, ids: list[str]) -> bool:
    return set(ids) - {status["node"]} <= _alive(status)


def run_cluster(cfg: ClusterConfig, args: Any = None) -> dict[str, Any]:
    """Emulate `cfg`, wait for the mesh, report it (serving lands with the serving issues)."""
    from meshllm.config import plan_inputs
    from meshllm.partition.plan import plan_cluster

    timeout_s = getattr(args, "timeout", None) or FORMATION_TIMEOUT_S
    plan = plan_cluster(plan_inputs(cfg), seed=getattr(args, "seed", 0) or 0)  # infeasible -> exit 2 before any spawn
    log.info("plan: %d replica(s), %d drafter(s), planned in %.2f s", len(plan.replicas), len(plan.drafters),
             plan.planner_s)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        t0 = time.monotonic()
        with EmulatedCluster(cfg) as cluster:
            statuses = cluster.wait_formed(timeout_s)
            formed_s = time.monotonic() - t0
            log.info("mesh of %d nodes formed in %.2f s", len(cfg.nodes), formed_s)
            return mesh_report(cfg, cluster, statuses, formed_s, plan.to_json())
    finally:
        signal.signal(signal.SIGTERM, previous)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # unwinds through the `with`, which tears the cluster down


def mesh_report(cfg: ClusterConfig, cluster: EmulatedCluster, statuses: dict[str, dict],
                formed_s: float, plan: dict[str, Any] | None = None) -> dict[str, Any]:
    nodes = [{"id": n.id, "zone": n.zone, "device": n.device.name, "address": cluster.addresses[n.id],
              "pid": cluster.procs[n.id].pid, "peers": sorted(_alive(statuses[n.id]))} for n in cfg.nodes]
    return {
        "results": [],
        "metrics": {k: None for k in METRIC_KEYS},
        "plan": plan,
        "mesh": {"nodes": nodes, "formation_s": round(formed_s, 3),
                 "links": [{"zones": list(ln.zones), "rtt_ms": ln.rtt_ms, "bandwidth_mbps": ln.bandwidth_mbps}
                           for ln in cfg.links]},
        "note": "mesh and plan only: serving the workload (results, metrics) lands with the serving issues",
    }
