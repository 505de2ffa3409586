"""Local emulation of a whole cluster: one OS process per node on 127.0.0.1.

`EmulatedCluster` (which `python launch.py --cluster CLUSTER.yaml` runs, cluster_run.py)
writes one node file per node (random free loopback ports, the cluster's links, seeds =
the first node, mdns off so concurrent emulations never mix), starts one OS process per
node that runs `launch.py --node-config NODE.yaml` with one compute thread
(OMP_NUM_THREADS=1), waits until every node sees every other alive and the
gateway serves, and tears everything down. The node processes are forks of one fork server
that has imported torch and the node's modules once (node_procs.py).

No orphans: each node runs in its own process group (killed as a group: SIGTERM,
then SIGKILL after TEARDOWN_GRACE_S), teardown runs from `finally`, atexit and a
SIGTERM handler, and each node dies with the emulator even if the emulator is killed with -9
(node_procs.py). Nothing in flight is cut by a
plain stop: a gateway with requests in flight is stopped first and drains them while the
rest of the mesh still serves (a second Ctrl-C stops at once).

Security (`security:` in the cluster file): with `curve: true` the emulator makes a key pair
per node (and one for itself, id `emulator`, to ask for status) and an authorized-keys file
in the run directory, and every node runs CURVE with its own key, seeded as ID@HOST:PORT;
with `api_token: true` the gateway requires a bearer token, which the emulator's client sends.

Emulated links: every node's transport delays messages from another zone by
rtt/2 + bytes/bandwidth, FIFO per link (see ingress.LinkShaper). Emulated
device speed: every stage's `Pacer` (roles/pacer.py) stretches each measured
compute step to the time the device profile predicts, times the cluster's time_scale.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from meshllm.config import ClusterConfig, NodeSpec
from meshllm.defaults import EMULATED_BUSY_POLL_MS, GATEWAY_DRAIN_S, PLAN_ERROR_REASON, STAGE_ROLES, Role
from meshllm.errors import InputError
from meshllm.mesh.keys import NodeKeys, generate_key
from meshllm.mesh.node import query_status
from meshllm.mesh.sockets import free_port_pair
from meshllm.node_procs import NODE_ENV, NodeProcess, signals_held, start_node

log = logging.getLogger("meshllm.emulate")
INTERRUPTED = threading.Event()  # set by cluster_run's SIGINT / SIGTERM handler (raise_interrupt)

LAUNCH = Path(__file__).resolve().parent.parent / "launch.py"
FORMATION_TIMEOUT_S = 60.0  # generous: N interpreters start on a small machine
READY_TIMEOUT_S = 300.0  # every stage imports torch and loads its layers (2 cores, many processes)
TEARDOWN_GRACE_S = 3.0  # SIGTERM, then SIGKILL
STATUS_POLL_S = 0.1


EMULATOR_ID = "emulator"  # the emulator's own CURVE identity (status queries, fault injection)


def node_file(spec: NodeSpec, cfg: ClusterConfig, address: str, seed: str, gateway: str | None = None,
              own_cpu: bool = False, judge: bool = False) -> dict[str, Any]:
    """The node file the emulator writes for one node of the cluster file. `own_cpu`: the node's
    process is pinned to a CPU no other node shares, so its compute thread may busy-poll;
    `judge`: the coordinator plans with the simulator as its judge (`--cluster --judge`)."""
    device = {k: v for k, v in dataclasses.asdict(spec.device).items()}
    wl = cfg.workload
    out: dict[str, Any] = {
        "id": spec.id, "device": device, "zone": spec.zone, "listen": address, "seeds": [seed], "mdns": False,
        "model": cfg.model,
        "links": [{"zones": list(ln.zones), "rtt_ms": ln.rtt_ms, "bandwidth_mbps": ln.bandwidth_mbps}
                  for ln in cfg.links],
        "draft": dataclasses.asdict(cfg.draft), "speculation": dataclasses.asdict(cfg.speculation),
        "weights_dtype": cfg.weights_dtype,
        "workload": {"arrival_rate_per_s": wl.arrival_rate_per_s, "requests": wl.requests,
                     "input_tokens": dataclasses.asdict(wl.input_tokens),
                     "output_tokens": dataclasses.asdict(wl.output_tokens)},
        "expect_nodes": [n.id for n in cfg.nodes], "pace": True, "time_scale": cfg.time_scale,
        "fault_injection": True,
    }
    if spec.roles:
        out["roles"] = [str(r) for r in spec.roles]
    if own_cpu:
        out["busy_poll_ms"] = EMULATED_BUSY_POLL_MS
    if judge:
        out["plan_judge"] = True
    if gateway:
        out["gateway"] = {"listen": gateway}
    return out


def gateway_nodes(cfg: ClusterConfig) -> list[str]:
    """The nodes that run the emulated mesh's gateways: every one whose roles name `gateway`
    (the first is the one clients use first), else the first that may hold a stage, else the
    first node."""
    named = [n.id for n in cfg.nodes if n.roles is not None and Role.GATEWAY in n.roles]
    if named:
        return named
    for want in (lambda n: n.roles is None or bool(set(n.roles) & set(STAGE_ROLES)), lambda n: True):
        for n in cfg.nodes:
            if want(n):
                return [n.id]
    raise AssertionError("a cluster has at least one node")


class EmulatedCluster:
    """The node processes of one cluster. Use as a context manager; `close()` is idempotent."""

    def __init__(self, cfg: ClusterConfig, workdir: Path | None = None, cpus: list[int] | None = None,
                 judge: bool = False):
        self.cfg, self.judge = cfg, judge  # judge: the coordinator's plan is the simulator's pick
        # cpus: pin node i's process to cpus[i % len(cpus)] (benchmarks: each emulated device keeps
        # its core, as separate devices would; unpinned, the OS moves processes between cores)
        self.cpus = cpus
        self._own_workdir = workdir is None
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="meshllm-cluster-"))
        self.addresses: dict[str, str] = {}
        self.procs: dict[str, NodeProcess] = {}
        # the OpenAI API of the emulated mesh, on each gateway node (HOST:PORT by node id)
        self.gateways = {nid: f"127.0.0.1:{free_port_pair()}" for nid in gateway_nodes(cfg)}
        self.keys: NodeKeys | None = None  # with security.curve: the emulator's own identity
        self.api_headers: dict[str, str] = {}  # with security.api_token: the bearer token the gateway wants

    def __enter__(self) -> EmulatedCluster:
        atexit.register(self.close)
        try:
            self.start()
        except BaseException as e:
            self.__exit__(type(e))  # no `with` body runs, so no __exit__ comes: the secrets go here
            raise
        return self

    def __exit__(self, exc_type: type | None, *exc: object) -> None:
        ok = exc_type is None
        try:
            self.close()
        except BaseException:  # a second Ctrl-C in the teardown (it left every key in /tmp)
            ok = False
            raise
        finally:
            atexit.unregister(self.close)
            with signals_held():  # not cut short by a third
                self._clean(ok)

    def _clean(self, ok: bool) -> None:
        """A clean end removes the run directory; a failure or an interrupt keeps the logs for a
        look, never the secrets (keys, the API token)."""
        if not self._own_workdir:
            return
        if ok:
            shutil.rmtree(self.workdir, ignore_errors=True)
        else:
            shutil.rmtree(self.workdir / "keys", ignore_errors=True)
            (self.workdir / "api_token").unlink(missing_ok=True)
            log.error("node files and logs kept in %s (its keys and API token deleted)", self.workdir)

    def start(self) -> None:
        import yaml

        for spec in self.cfg.nodes:
            self.addresses[spec.id] = f"127.0.0.1:{free_port_pair()}"
        seed = self.target(self.cfg.nodes[0].id) if self.cfg.security.curve else self.addresses[self.cfg.nodes[0].id]
        secure, token_file = self._security_files()
        for i, spec in enumerate(self.cfg.nodes):
            gw = self.gateways.get(spec.id)
            nf = node_file(spec, self.cfg, self.addresses[spec.id], seed, gw, self.own_cpu(i), self.judge)
            nf.update(secure.get(spec.id, {}))
            if gw and token_file:
                nf["gateway"]["api_token"] = token_file
            (self.workdir / f"{spec.id}.yaml").write_text(yaml.safe_dump(nf))
            self._start_node(i)
        log.info("started %d node processes (logs in %s)", len(self.procs), self.workdir)

    def _start_node(self, i: int, again: bool = False) -> None:
        """Start node i from its node file (`again`: after a kill; its log goes on)."""
        nid = self.cfg.nodes[i].id
        with signals_held():  # an interrupt in the middle would leave a process started, not listed
            self.procs[nid] = start_node(nid, ["--node-config", str(self.workdir / f"{nid}.yaml")],
                                         self.workdir / f"{nid}.log", LAUNCH.parent, {**os.environ, **NODE_ENV},
                                         self.cpus[i % len(self.cpus)] if self.cpus else None, append=again)

    def _security_files(self) -> tuple[dict[str, dict], str | None]:
        """Keys (0600) and the authorized-keys file in the run directory, per `security:`; returns the
        node-file keys to add per node id, and the API token file (or None)."""
        out: dict[str, dict] = {}
        token_file = None
        sec = self.cfg.security
        if sec.curve:
            kdir = self.workdir / "keys"
            kdir.mkdir(mode=0o700, exist_ok=True)
            ids = [n.id for n in self.cfg.nodes] + [EMULATOR_ID]
            public = {nid: generate_key(kdir / f"{nid}.key") for nid in ids}
            auth = kdir / "authorized_keys"
            auth.write_text("".join(f"{nid} {pk}\n" for nid, pk in public.items()))
            for nid in ids:
                out[nid] = {"node_key": str(kdir / f"{nid}.key"), "authorized_keys": str(auth)}
            self.keys = NodeKeys.load(EMULATOR_ID, str(kdir / f"{EMULATOR_ID}.key"), str(auth), "the emulator")
        if sec.api_token:
            import secrets

            token = secrets.token_urlsafe(32)
            path = self.workdir / "api_token"
            path.touch(mode=0o600)
            path.write_text(token + "\n")
            token_file = str(path)
            self.api_headers = {"Authorization": f"Bearer {token}"}
        return out, token_file

    def own_cpu(self, i: int) -> bool:
        """Node i is pinned to a CPU that no other node is pinned to."""
        if not self.cpus:
            return False
        pinned = [self.cpus[j % len(self.cpus)] for j in range(len(self.cfg.nodes))]
        return pinned.count(pinned[i]) == 1

    def target(self, node_id: str) -> str:
        """How the emulator dials a node: ID@HOST:PORT (the id pins its CURVE key)."""
        return f"{node_id}@{self.addresses[node_id]}"

    def status(self, node_id: str, timeout_s: float) -> dict[str, Any]:
        """The node's `--status` object (TimeoutError if it does not answer)."""
        return query_status(self.target(node_id), timeout_s=timeout_s, keys=self.keys)

    def log_tail(self, node_id: str, n_chars: int = 1500) -> str:
        """The end of a node's log: at most `n_chars`, from the start of a line (a cut one is left
        out, unless it is all there is). A node's bad-input exit logs one line: a message with
        its tail after ": " stays one line then."""
        p = self.workdir / f"{node_id}.log"
        text = p.read_text(errors="replace").rstrip("\n") if p.is_file() else ""
        if len(text) > n_chars:
            text = text[-n_chars:]
            text = text.partition("\n")[2] or text
        return text

    def how_exited(self, node_id: str) -> str:
        """"exited with code N", or "was killed by SIGKILL" for a process a signal ended."""
        code = self.procs[node_id].returncode
        if code is not None and code < 0:
            with contextlib.suppress(ValueError):
                return f"was killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"

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
                    statuses[nid] = self.status(nid, wait_s)
            if len(statuses) == len(ids) and all(_sees_all(statuses[n], ids) for n in ids):
                return statuses
            time.sleep(STATUS_POLL_S)
        missing = {n: sorted(set(ids) - {n} - alive_peers(statuses.get(n, {}))) for n in ids}
        raise RuntimeError(f"the mesh did not form within {timeout_s:g} s; unseen peers: {missing}")

    @property
    def gateway_node(self) -> str:
        """The gateway node the emulator talks to: the first whose process is alive."""
        dead = self.dead()
        return next((nid for nid in self.gateways if nid not in dead), next(iter(self.gateways)))

    @property
    def gateway(self) -> str:
        """HOST:PORT of that node's API."""
        return self.gateways[self.gateway_node]

    def gateway_urls(self) -> list[str]:
        """Every gateway's API (http://HOST:PORT), the one clients use first first."""
        return [f"http://{a}" for a in self.gateways.values()]

    def wait_serving(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Block until every gateway says every replica of the plan is loaded."""
        deadline, last, waiting = time.monotonic() + timeout_s, {}, list(self.gateways)
        while time.monotonic() < deadline:
            self._check_alive()
            while waiting:
                code, last = http_json(f"http://{self.gateways[waiting[0]]}/health", timeout_s=2.0,
                                       headers=self.api_headers)
                if code != 200:
                    break
                waiting.pop(0)
            if not waiting:
                self._raise_left_out()
                return
            self._raise_plan_errors()
            time.sleep(STATUS_POLL_S * 3)
        raise RuntimeError(f"the mesh did not start serving within {timeout_s:g} s (gateway {waiting[0]}'s "
                           f"health: {last}); its log: {self.log_tail(waiting[0])}")

    def _raise_plan_errors(self) -> None:
        """RuntimeError if a node says it could not take its part of the plan (the mesh would not
        serve: this says why at once, not after READY_TIMEOUT_S)."""
        code, mesh = http_json(f"http://{self.gateway}/v1/mesh", timeout_s=2.0, headers=self.api_headers)
        nodes = mesh.get("nodes") if code == 200 and isinstance(mesh, dict) else None
        for nid, n in (nodes if isinstance(nodes, dict) else {}).items():
            err = (n.get("load") or {}).get("plan_error") if isinstance(n, dict) else None
            if isinstance(err, dict):
                raise RuntimeError(f"node {nid} could not take its part of plan v{err.get('plan_version')}: "
                                   f"{err.get('error')}; its log: {self.log_tail(nid, 600)}")

    def _raise_left_out(self) -> None:
        """RuntimeError if the plan being served leaves a node out because it could not take its
        part of an earlier plan (the coordinator re-plans without it, and may do so before this
        sees the node's error): an emulation serves the cluster of its file, or says why not."""
        code, got = http_json(f"http://{self.gateway}/v1/plan", timeout_s=2.0, headers=self.api_headers)
        plan = got.get("plan") if code == 200 and isinstance(got, dict) else None
        reasons = plan.get("unused_reasons") if isinstance(plan, dict) else None
        for nid, why in (reasons if isinstance(reasons, dict) else {}).items():
            if str(why).startswith(PLAN_ERROR_REASON):
                raise RuntimeError(f"node {nid} {why}; the mesh serves plan v{got.get('version')} without it; "
                                   f"its log: {self.log_tail(nid, 600)}")

    def dead(self) -> set[str]:
        return {nid for nid, p in self.procs.items() if p.poll() is not None}

    def _check_alive(self) -> None:
        raise_if_interrupted()
        for nid, proc in self.procs.items():
            if proc.poll() is not None:
                why = f"node {nid} {self.how_exited(nid)}; its log ends: {self.log_tail(nid)}"
                # exit 2 is the node's own bad input (a model or tokenizer file it cannot read): the run's too
                raise InputError(why) if proc.returncode == 2 else RuntimeError(why)

    def kill(self, node_id: str) -> None:
        """SIGKILL one node's whole process group (a fault; see faults.py)."""
        _signal_group(self.procs[node_id], signal.SIGKILL)

    def restart(self, node_id: str) -> None:
        """SIGKILL one node's process group and start the node again at once from the same node
        file (a fault: a supervisor's restart, sooner than its peers' failure detection)."""
        self.kill(node_id)
        self.procs[node_id].wait(timeout=TEARDOWN_GRACE_S)
        self._start_node([n.id for n in self.cfg.nodes].index(node_id), again=True)

    def pause(self, node_id: str) -> None:
        """SIGSTOP one node's process group (a fault: a node that does not run for a while, a swap
        storm or a paused VM); `resume` continues it."""
        _signal_group(self.procs[node_id], signal.SIGSTOP)

    def resume(self, node_id: str) -> None:
        _signal_group(self.procs[node_id], signal.SIGCONT)

    def close(self) -> None:
        """SIGTERM every node's process group, then SIGKILL what is left; reap all. A gateway with
        requests in flight is stopped first, the rest of the mesh still up: it drains them (its
        GATEWAY_DRAIN_S) before it leaves; Ctrl-C again stops at once."""
        self._drain_gateways()
        live = {nid: p for nid, p in self.procs.items() if p.poll() is None}
        for p in live.values():
            _signal_group(p, signal.SIGTERM)
            _signal_group(p, signal.SIGCONT)  # a stopped one (`pause`) handles its SIGTERM only once continued
        deadline = time.monotonic() + TEARDOWN_GRACE_S
        for p in live.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs.values():
            _signal_group(p, signal.SIGKILL)  # also any grandchild left in the group
            p.wait()

    def _drain_gateways(self) -> None:
        """Stop the gateway nodes whose API has requests in flight and wait for them to leave."""
        busy = {}
        for nid, address in self.gateways.items():
            if self.procs.get(nid) is not None and self.procs[nid].poll() is None:
                n = http_json(f"http://{address}/health", timeout_s=1.0, headers=self.api_headers)[1].get("in_flight")
                if n:
                    busy[nid] = n
        if not busy:
            return
        log.info("draining %d request(s) on %s (up to %g s; Ctrl-C again to stop now)", sum(busy.values()),
                 ", ".join(busy), GATEWAY_DRAIN_S)
        for nid in busy:
            _signal_group(self.procs[nid], signal.SIGTERM)
        deadline = time.monotonic() + GATEWAY_DRAIN_S + TEARDOWN_GRACE_S
        try:
            for nid in busy:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.procs[nid].wait(timeout=max(0.0, deadline - time.monotonic()))
        except KeyboardInterrupt:
            log.warning("stopping now: the requests in flight are cut")


def _signal_group(p: NodeProcess, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, sig)


def alive_peers(status: dict) -> set[str]:
    return {p["id"] for p in status.get("peers", []) if p["state"] == "alive"}


def _sees_all(status: dict, ids: list[str]) -> bool:
    return set(ids) - {status["node"]} <= alive_peers(status)


def raise_interrupt(signum: int, frame: object) -> None:
    INTERRUPTED.set()
    raise KeyboardInterrupt  # unwinds through the `with`, which tears the cluster down


def raise_if_interrupted() -> None:
    """Raise a KeyboardInterrupt that was swallowed: a signal that lands while subprocess forks runs
    the handler inside logging's at-fork hook, where Python only prints the exception."""
    if INTERRUPTED.is_set():
        raise KeyboardInterrupt


def http_json(url: str, timeout_s: float = 10.0, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    """GET a JSON document; (status, body), (0, {}) when nothing answers."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        with contextlib.suppress(ValueError):
            return e.code, json.loads(e.read())
        return e.code, {}
    except (urllib.error.URLError, OSError, ValueError):
        return 0, {}
