"""The emulated meshes of bench/speculative.py: the cluster file of a run, a mesh process group
with its API, the pacer and drafter-load readings, and what a request's outcome measures (ITL,
arrival times, a steady output rate). Split out of bench/speculative.py (measurement and report
stay there)."""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mesh_client import node_loads, run_ok  # noqa: E402
from speculative_report import EDGE, FOG, GAMMA, MODEL  # noqa: E402

from meshllm.config import parse_cluster  # noqa: E402
from meshllm.emulate import EmulatedCluster, http_json  # noqa: E402
from meshllm.workload import Job, Outcome  # noqa: E402

ITL_PROMPT = "The history of the Roman Empire begins with"


# -- the emulated meshes -------------------------------------------------------------------------------
def cluster_doc(k: float, rtt_ms: float, n_drafters: int, max_verify_batch: int = 0, gamma: int = GAMMA) -> dict:
    """Edge drafters (the first also runs the gateway, so tokens stream to the edge), a fog prefill
    node and a fog decode node (the decode replica that verifies every tenant's blocks)."""
    nodes = [{"id": f"edge-{i}", "device": EDGE, "zone": "edge", "roles": ["drafter", "gateway"] if i == 1 else ["drafter"]}
             for i in range(1, n_drafters + 1)]
    nodes += [{"id": "fog-p", "device": FOG, "zone": "fog", "roles": ["prefill"]},
              {"id": "fog-d", "device": FOG, "zone": "fog", "roles": ["decode"]}]
    return {"model": MODEL, "weights_dtype": "fp32", "time_scale": k, "nodes": nodes,
            "draft": {"quant": "w4a16", "group_size": 64},
            "speculation": {"mode": "async", "gamma": gamma, "adaptive": False, "max_verify_batch": max_verify_batch},
            "links": [{"zones": ["edge", "fog"], "rtt_ms": rtt_ms, "bandwidth_mbps": 100},
                      {"zones": ["fog", "fog"], "rtt_ms": 1, "bandwidth_mbps": 1000}],
            "workload": {"prompts": [ITL_PROMPT], "max_tokens": 16, "input_tokens": {"mean": 16, "dist": "fixed"},
                         "output_tokens": {"mean": 32, "dist": "fixed"}}}


class Mesh:
    """One emulated cluster, serving; asserts the layout (one decode replica on fog-d, the drafters)."""

    def __init__(self, doc: dict):
        self.doc = doc
        self.k = doc["time_scale"]
        self.em = EmulatedCluster(parse_cluster(doc, "bench/speculative"))
        self.first_session: float | None = None  # when the first drafted request was sent (drafter's `since`)
        self._settled: dict | None = None  # the figures after the last run (nothing ran since)

    def __enter__(self) -> Mesh:
        self.em.__enter__()
        try:
            self.em.wait_formed()
            self.em.wait_serving()
            self.url = f"http://{self.em.gateway}"
            self.check_plan()
        except BaseException:
            self.em.__exit__(*sys.exc_info())
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.em.__exit__(*exc)

    def check_plan(self) -> None:
        plan = http_json(self.url + "/v1/plan")[1]["plan"]
        layout = sorted((r["role"], tuple(s["node"] for s in r["stages"])) for r in plan["replicas"])
        want = [("decode", ("fog-d",)), ("prefill", ("fog-p",))]
        drafters = sorted(n["id"] for n in self.doc["nodes"] if n["roles"][0] == "drafter")
        if layout != want or sorted(plan["drafters"]) != drafters:
            raise RuntimeError(f"unexpected plan: replicas {layout}, drafters {plan['drafters']}")

    def run(self, jobs: list[Job]) -> list[Outcome]:
        if self.first_session is None and any(j.ext and j.ext.get("speculation") != "off" for j in jobs):
            self.first_session = time.monotonic()
        self._settled = None
        return run_ok(self.url, MODEL, jobs)

    def loads(self) -> dict:
        return node_loads(self.url)

    def settled(self) -> dict:
        """Every node's figures once the heartbeats carry the end of the last run (they refresh
        every 0.5 s): read until two reads a heartbeat apart agree on the decode replica's counters."""
        if self._settled is not None:
            return self._settled
        prev = None
        for _ in range(12):
            cur = self.loads()
            key = json.dumps([cur.get("fog-d", {}).get("stage"), cur.get("fog-d", {}).get("leader", {}).get("spec")])
            if key == prev:
                self._settled = cur
                return cur
            prev = key
            time.sleep(0.6)
        return cur


def pacer(loads: dict, node: str = "fog-d") -> dict:
    return dict(loads[node]["stage"]["pacer"])


def overran(p: dict, limit: float = 0.10) -> bool:
    """The host could not keep up: the pacer's overrun is over `limit` of the paced time."""
    return p["overrun_s"] > limit * (p["measured_s"] + p["slept_s"])


def pacer_delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in ("steps", "measured_s", "slept_s", "overrun_s")}


class DrafterClock:
    """The busy time of the drafter on the gateway node, recovered from its `busy_fraction`.

    The drafter reports busy_fraction = busy_s / (t_snapshot - since) (since: its first session),
    refreshed at most every 0.5 s. Polling /v1/mesh often (the gateway reads its own node's latest
    snapshot directly) gives each snapshot's time to within half a poll, so busy_s at every snapshot
    is f * (t - since); a difference of two such values (the busy time in a window) depends on
    `since` only through (f_b - f_a) * error(since), a few ms."""

    POLL_S = 0.1

    def __init__(self, mesh: Mesh, node: str = "edge-1"):
        self.mesh, self.node = mesh, node
        self.samples: list[tuple[float, float, int]] = []  # (snapshot time, busy_s, steps)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> DrafterClock:
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        last, t_prev = None, time.monotonic()
        while not self._stop.is_set():
            code, view = http_json(self.mesh.url + "/v1/mesh", timeout_s=5.0)
            t = time.monotonic()
            d = (view.get("nodes", {}).get(self.node, {}).get("load", {}) or {}).get("drafter") if code == 200 else None
            if d and d.get("busy_fraction") is not None and self.mesh.first_session is not None:
                key = (d["busy_fraction"], d["steps"])
                if key != last:
                    t_snap = (t_prev + t) / 2 if last is not None else t
                    self.samples.append((t_snap, d["busy_fraction"] * (t_snap - self.mesh.first_session), d["steps"]))
                    last = key
            t_prev = t
            self._stop.wait(self.POLL_S)

    def window(self, t_a: float, t_b: float) -> tuple[float, float, int] | None:
        """(seconds, busy seconds, draft steps) between the first snapshot after t_a and the last before t_b."""
        inside = [s for s in self.samples if t_a <= s[0] <= t_b]
        if len(inside) < 2:
            return None
        a, b = inside[0], inside[-1]
        return b[0] - a[0], b[1] - a[1], b[2] - a[2]


# -- timing figures from the client -------------------------------------------------------------------
def arrivals(o: Outcome) -> list[float]:
    """Monotonic arrival time of each token at the client."""
    t = o.sent + o.ttft_ms / 1000.0
    out = [t]
    for gap in o.itl_ms:
        t += gap / 1000.0
        out.append(t)
    return out


def mean_itl_ms(o: Outcome) -> float:
    return statistics.fmean(o.itl_ms)


def decode_itl_ms(o: Outcome) -> float:
    """Mean gap after the second token: the first gap holds the prefill -> decode handoff, which
    for N sessions handed off at once is a queue of N KV transfers, not decoding."""
    return statistics.fmean(o.itl_ms[1:] or o.itl_ms)


def steady_rate(outs: list[Outcome]) -> tuple[float, float]:
    """Aggregate tokens/s while every tenant is decoding: from the first token arrival after every
    tenant has its first token to the last arrival before half of them have finished (tokens that
    arrive in that interval / its length); (tokens/s, window s). Whole run if that is empty."""
    arr = [arrivals(o) for o in outs]
    t_a = max(a[0] for a in arr)
    t_half = sorted(a[-1] for a in arr)[(len(arr) - 1) // 2]
    events = sorted(t for a in arr for t in a)
    inside = [t for t in events if t_a <= t <= t_half]
    if len(set(inside)) >= 3:
        start, end = inside[0], inside[-1]
        return sum(1 for t in events if start < t <= end) / (end - start), end - start
    start, end = min(o.sent for o in outs), max(a[-1] for a in arr)
    return sum(len(a) for a in arr) / (end - start), end - start
