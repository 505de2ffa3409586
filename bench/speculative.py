"""Speculative decoding benchmark (issue 9): ITL vs RTT, verifier capacity, one draft server for many.

Run:  python bench/speculative.py [--quick] [--parts engine,a,b,c] [--out bench/results]

Every mesh is emulated on this machine (`meshllm.emulate.EmulatedCluster`: one OS process per node,
ZeroMQ over loopback) with real device profiles: drafters on `raspberry-pi-5-8gb` at the edge
(W4A16 g64 draft), the fp32 target on `jetson-orin-nano-8gb` in the fog (a prefill node and a
decode node; the decode node is the one decode replica), the gateway on the edge. The cluster
file's `time_scale` K makes every device and link K times slower, so that the Pacer, not this busy
2-core host, sets every compute time; each table reports K and the pacers' overrun (the host time
the Pacer could not hide). Requests go through the gateway's OpenAI API (`meshllm.workload`) with
the per-request `meshllm` controls (speculation off/sync/async, adaptive). Printed, in one run:

(engine) in-process, 1 thread: a (gamma+1)-row verification forward vs a 1-row decode step of the
    target (goal <= 1.3x), gamma = 2, 4, 8; acceptance of the W4A16 g64 draft at gamma = 4, greedy.
(a) ITL vs edge<->fog RTT in {0, 20, 50, 100, 200} ms for cloud-only decoding (target on the fog
    decode replica, streamed to the edge), sync drafting, async drafting, async + adaptive gamma,
    beside a model of each mode from the *measured* alpha, T_draft, T_verify and RTT (error <= 15%
    is the goal). Goals: async <= 0.8x sync at 100 ms; moonshot <= 0.6x.
(b) capacity of one decode replica: aggregate output tokens/s vs tenants N in {1, 2, 4, 8, 16, 32},
    batched verification vs one block per forward (`max_verify_batch: 1`), both at the same draft
    length (--gamma-capacity, 2 by default: near what adaptive gamma picks here), goal >= 4x at N = 16;
    and the clients served within an ITL bound (2x the replica's single-client ITL) with drafting
    vs without, goal >= 2x.
(c) StarSD: one draft server, N in {1..8} sessions: its busy fraction and system tokens/s vs N,
    goal: busy fraction >= 0.9 from N = 4.
Writes the printed text to OUT/speculative.txt and OUT/speculative_{itl,capacity,starsd}.png.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import copy
import io
import json
import statistics
import sys
import threading
import time
from contextlib import redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from meshllm.config import parse_cluster, resolve_args  # noqa: E402
from meshllm.device import load_device  # noqa: E402
from meshllm.emulate import EmulatedCluster, http_json  # noqa: E402
from meshllm.engine.speculative import (  # noqa: E402
    choose_gamma,
    expected_tokens,
    pipelined_block_s,
    sync_block_s,
)
from meshllm.partition.cost import model_costs, stage_batch_s  # noqa: E402
from meshllm.roles.drafter import MAX_OUTSTANDING  # noqa: E402
from meshllm.workload import Job, Outcome, run_jobs  # noqa: E402

MODEL = "smollm2-135m"
EDGE, FOG = "raspberry-pi-5-8gb", "jetson-orin-nano-8gb"
GAMMA = 4
RTTS_MS = (0, 20, 50, 100, 200)
MODES = {"cloud-only": {"speculation": "off"}, "sync": {"speculation": "sync", "adaptive": False},
         "async": {"speculation": "async", "adaptive": False}, "async+adaptive": {"speculation": "async", "adaptive": True}}
ITL_PROMPT = "The history of the Roman Empire begins with"
TENANT_PROMPTS = [
    "The history of the Roman Empire begins with", "def quicksort(arr):\n", "Photosynthesis is the process by which",
    "Once upon a time, in a small village,", "The three laws of thermodynamics state that",
    "To bake bread at home, you need", "The capital of Japan is Tokyo, and the capital of France is",
    "In machine learning, overfitting happens when", "The quick brown fox", "Water boils at 100 degrees Celsius because",
    "The first step in writing a good essay is", "A healthy breakfast usually includes",
    "The main causes of the French Revolution were", "To learn a new language quickly,",
    "The solar system consists of", "import numpy as np\n", "The most important rule of cooking is",
    "The Great Wall of China was built", "Electric cars are becoming popular because",
    "The human heart has four chambers:", "In the year 1969, astronauts", "A good password should",
    "The difference between a virus and a bacterium is", "Shakespeare wrote many plays, including",
    "To change a flat tire, first", "The Pacific Ocean is the largest", "Dogs are often called man's best friend because",
    "The theory of evolution explains", "SELECT name FROM users WHERE", "The Eiffel Tower is located in",
    "Rain forms when", "The best way to save money is",
]
TENANTS = (1, 2, 4, 8, 16, 32)
STAR_SESSIONS = (1, 2, 3, 4, 6, 8)
ERROR_GOAL = 0.15


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
        outs = run_jobs(self.url, MODEL, jobs, progress=False)
        bad = [o.error for o in outs if o.error]
        if bad:
            raise RuntimeError(f"{len(bad)} of {len(outs)} requests failed: {bad[0]}")
        return outs

    def loads(self) -> dict:
        return {k: v["load"] for k, v in http_json(self.url + "/v1/mesh")[1]["nodes"].items()}

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


# -- the model ----------------------------------------------------------------------------------------
def alpha_hat(spec: dict, tokens: int) -> float:
    """The per-token acceptance alpha of the i.i.d. model that reproduces a request's tokens per
    block: sum over its blocks of E(alpha, gamma) = the `tokens` it received after the first (gamma
    per block from its gamma histogram; bisection). The verifier's own counts also hold the drafts
    accepted past max_tokens in the last block, which the client never sees."""
    gammas = {int(g): int(n) for g, n in spec["gamma_histogram"].items()}

    def committed(x: float) -> float:
        return sum(n * expected_tokens(x, g) for g, n in gammas.items())

    lo, hi = 0.0, 0.999
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if committed(mid) < tokens else (lo, mid)
    return (lo + hi) / 2


def full_share(spec: dict) -> float:
    """Share of a session's blocks (all of one length) whose every draft was accepted."""
    g = max(int(x) for x in spec["gamma_histogram"])
    return int(spec["per_position"].get(str(g), 0)) / max(1, spec["blocks"])


def model_cloud_s(t_step: float) -> float:
    """Cloud-only: one target decode step per token; streaming to the edge adds a constant delay, not a gap."""
    return t_step


def model_sync_s(alpha: float, gamma: int, t_draft: float, t_verify: float, rtt: float) -> float:
    """Sync drafting, seconds per token: each block costs gamma draft steps, the round trip and one
    verification, and commits E = (1 - alpha^(gamma+1)) / (1 - alpha) tokens on average."""
    return (gamma * t_draft + rtt + t_verify) / expected_tokens(alpha, gamma)


def async_epoch(alpha: float, gamma: int, t_draft: float, t_verify: float, rtt: float, hit: float | None = None,
                outstanding: int = MAX_OUTSTANDING["async"]) -> tuple[float, float]:
    """Async drafting as the drafter does it, as (seconds, tokens) per block: the runtime's own
    model (engine/speculative.py pipelined_block_s, which adaptive gamma also uses)."""
    return (pipelined_block_s(alpha, gamma, t_draft, t_verify, rtt, outstanding, hit=hit),
            expected_tokens(alpha, gamma))


def model_async_s(alpha: float, gammas: dict[int, int], t_draft: float, t_verify: float, rtt: float,
                  hit: float | None = None, adaptive: bool = False) -> float:
    """Async drafting, seconds per token; `gammas`: blocks per draft length (adaptive gamma), each
    length modelled as above and mixed by its share of the blocks; `hit`: measured h (one length).
    `adaptive`: a length's blocks are pipelined only where the drafter's own rule says the
    look-ahead pays (engine/speculative.py choose_drafting: it sees the verification inside its
    measured round trip), else drafted as a synchronous session would."""
    n = sum(gammas.values())
    per = {}
    for g in gammas:
        pipe = not adaptive or (pipelined_block_s(alpha, g, t_draft, 0.0, rtt + t_verify)
                                < sync_block_s(g, t_draft, 0.0, rtt + t_verify))
        per[g] = (async_epoch(alpha, g, t_draft, t_verify, rtt, hit if len(gammas) == 1 else None) if pipe
                  else (sync_block_s(g, t_draft, t_verify, rtt), expected_tokens(alpha, g)))
    return sum(gammas[g] / n * per[g][0] for g in gammas) / sum(gammas[g] / n * per[g][1] for g in gammas)


# -- (engine) in-process figures -------------------------------------------------------------------------
def bench_engine(repeats: int, n_prompts: int, n_tokens: int) -> dict:
    """Verification cost vs a decode step on the target (1 thread, ragged SeqSpan forward), and the
    W4A16 g64 draft's acceptance at gamma = 4 (greedy: the committed output is the target's own
    greedy continuation, so d_i is accepted iff it equals the next target token)."""
    import torch

    from meshllm.engine.generate import GenerationOptions, generate
    from meshllm.engine.model import SeqSpan
    from meshllm.engine.quant import quantize_model
    from meshllm.engine.tokenizer import load_tokenizer
    from meshllm.engine.weights import load_transformer, resolve_model

    torch.set_num_threads(1)
    target = load_transformer(MODEL)
    tok = load_tokenizer(resolve_model(MODEL))
    ctx = tok.encode(TENANT_PROMPTS[0] + " " + TENANT_PROMPTS[3] + " " + TENANT_PROMPTS[7])
    cache = target.new_cache()
    cache.allocate(0, len(ctx) + 32)
    target(torch.tensor(ctx), [SeqSpan(0, 0, len(ctx))], cache)

    def forward_s(rows: int) -> float:
        cache.truncate(0, len(ctx))
        ids = torch.randint(0, 1000, (rows,))
        t0 = time.perf_counter()
        with torch.inference_mode():
            target(ids, [SeqSpan(0, len(ctx), rows)], cache)  # logits for every row, as a verification needs
        return time.perf_counter() - t0

    gammas = (2, 4, 8)
    times: dict[int, list[float]] = {r: [] for r in (1,) + tuple(g + 1 for g in gammas)}
    for _ in range(2):
        forward_s(1)
    for _ in range(repeats):  # interleaved, so load changes hit every size alike
        for r in times:
            times[r].append(forward_s(r))
    one = statistics.median(times[1])
    verify = {g: {"ms": 1000 * statistics.median(times[g + 1]), "ratio": statistics.median(times[g + 1]) / one}
              for g in gammas}

    draft = quantize_model(copy.deepcopy(target), "w4a16", 64)
    blocks = accepted = 0
    for p in TENANT_PROMPTS[:n_prompts]:
        ids = tok.encode(p)
        ref = generate(target, ids, GenerationOptions(max_tokens=n_tokens)).token_ids
        c = draft.new_cache()
        c.allocate(0, len(ids) + len(ref) + GAMMA + 2)
        n, fed = 1, 0  # ref[:n] committed (the first token comes from the target's prefill)
        while n < len(ref):
            cur = ids + ref[:n]
            d = []
            with torch.inference_mode():
                for _ in range(GAMMA):
                    x = cur[fed:]
                    logits = draft(torch.tensor(x), [SeqSpan(0, fed, len(x))], c, logits_rows=torch.tensor([len(x) - 1]))
                    fed = len(cur)
                    d.append(int(logits.argmax(-1)[0]))
                    cur = cur + d[-1:]
            a = 0
            while a < GAMMA and n + a < len(ref) and d[a] == ref[n + a]:
                a += 1
            blocks += 1
            accepted += a
            fed = len(ids) + n + min(a, GAMMA - 1)  # the draft KV that matches the committed tokens
            c.truncate(0, fed)
            n += a + 1  # the accepted drafts and the target's own token
    return {"verify": verify, "decode_1row_ms": 1000 * one, "repeats": repeats,
            "acceptance": {"prompts": n_prompts, "tokens": n_tokens, "blocks": blocks, "accepted": accepted,
                           "mean_acceptance_length": 1 + accepted / blocks, "acceptance_rate": accepted / (GAMMA * blocks)}}


# -- (a) ITL vs RTT -------------------------------------------------------------------------------------
@dataclass
class ModeRun:
    mode: str
    itl_ms: float
    spec: dict | None
    tokens: int = 0
    tries: int = 1  # 2: the first try was not paced (host overrun) and was repeated
    t_step_s: float | None = None  # cloud-only: mean target step (pacer)
    t_draft_s: float | None = None
    t_verify_s: float | None = None
    alpha: float | None = None
    model_ms: float | None = None
    pacer: dict = field(default_factory=dict)


def run_itl_mesh(k: float, rtt_ms: float, tokens: int, repeats: int, star: dict | None, log,
                 barrier: threading.Barrier | None = None) -> dict:
    """One RTT: every mode on one mesh, interleaved `repeats` times; (c) afterwards when asked.
    `barrier`: the meshes of one wave measure only once all of them are up (a mesh that is loading
    its models takes this host's CPU from the others' pacing)."""
    m = Mesh(cluster_doc(k, rtt_ms, 1))
    try:
        m.__enter__()
    except BaseException:
        if barrier is not None:
            barrier.abort()
        raise
    with contextlib.ExitStack() as stack:
        stack.push(m.__exit__)
        if barrier is not None:
            barrier.wait()
        clock = stack.enter_context(DrafterClock(m))
        log(f"(a) measuring: RTT {rtt_ms} ms, K {k:g}")
        m.run([Job(ITL_PROMPT + " Then", 4, ext=MODES["cloud-only"])])  # warm-up, no drafter session
        runs: dict[str, list[ModeRun]] = {mode: [] for mode in MODES}
        paced_draft = k * predicted(1.0)["draft_s"]
        for _ in range(repeats):
            for mode, ext in MODES.items():
                for attempt in (1, 2):  # a try the host could not pace is repeated once
                    r = measure_mode(m, clock, mode, ext, tokens)
                    r.tries = attempt
                    if not overran(r.pacer) and (r.t_draft_s or 0) <= 1.15 * paced_draft:
                        break
                runs[mode].append(r)
        out = {"rtt_ms": rtt_ms, "k": k, "runs": runs}
        if star is not None:
            out["starsd"] = run_starsd(m, clock, star, log)
    return out


def measure_mode(m: Mesh, clock: DrafterClock, mode: str, ext: dict, tokens: int) -> ModeRun:
    """One request in `mode`; its ITL, acceptance, the decode replica's pacing and the measured T_d, T_v."""
    before = m.settled()
    o = m.run([Job(ITL_PROMPT, tokens, ext=ext)])[0]
    after = m.settled()
    r = ModeRun(mode, mean_itl_ms(o), o.spec, len(o.token_ids), pacer=pacer_delta(pacer(before), pacer(after)))
    step = r.pacer["measured_s"] + r.pacer["slept_s"]
    if mode == "cloud-only":
        r.t_step_s = step / max(1, r.pacer["steps"])
    else:
        r.t_verify_s = after["fog-d"]["leader"]["spec"]["verify_ms"] / 1000.0
        arr = arrivals(o)
        w = clock.window(arr[0], arr[-1])  # after the drafter's prompt step
        r.t_draft_s = w[1] / w[2] if w and w[2] else None
    return r


def fill_models(res: dict, pred: dict) -> None:
    """Each run's model from its own measured figures (T_draft: measured, else known pacing)."""
    rtt = res["k"] * res["rtt_ms"] / 1000.0
    for mode, runs in res["runs"].items():
        for r in runs:
            if mode == "cloud-only":
                r.model_ms = 1000 * model_cloud_s(r.t_step_s)
                continue
            r.alpha = alpha_hat(r.spec, r.tokens - 1)
            td = r.t_draft_s or res["k"] * pred["draft_s"]
            if mode == "sync":
                r.model_ms = 1000 * model_sync_s(r.alpha, GAMMA, td, r.t_verify_s, rtt)
            else:
                gh = {int(g): int(n) for g, n in r.spec["gamma_histogram"].items()}
                hit = full_share(r.spec) * r.alpha if len(gh) == 1 else None
                r.model_ms = 1000 * model_async_s(r.alpha, gh, td, r.t_verify_s, rtt, hit, mode == "async+adaptive")


# -- (b) capacity ---------------------------------------------------------------------------------------
def tenant_jobs(n: int, tokens: int, ext: dict) -> list[Job]:
    return [Job(TENANT_PROMPTS[i % len(TENANT_PROMPTS)], tokens, ext=ext) for i in range(n)]


def run_capacity(k: float, rtt_ms: float, n_drafters: int, tenants: tuple, tokens: dict, log,
                 gamma: int = GAMMA) -> dict:
    """Batched verification (and plain decoding, for the ITL bound) on one mesh, then one block per
    forward on a second mesh (max_verify_batch: 1) with the same tenants, prompts and draft length."""
    out: dict = {"k": k, "rtt_ms": rtt_ms, "drafters": n_drafters, "gamma": gamma, "batched": {}, "one": {}, "plain": {}}
    for label, mvb in (("batched", 0), ("one", 1)):
        with Mesh(cluster_doc(k, rtt_ms, n_drafters, mvb, gamma)) as m:
            log(f"(b) mesh up: {label}, {n_drafters} drafters, K {k:g}")
            m.run(tenant_jobs(1, 4, MODES["cloud-only"]))  # warm-up
            runs = [("plain", MODES["cloud-only"])] if label == "batched" else []
            runs.insert(0, (label, MODES["async"]))
            for key, ext in runs:
                for n in tenants:
                    m_tokens = tokens[key](n)
                    before = m.settled()
                    t0 = time.monotonic()
                    outs = m.run(tenant_jobs(n, m_tokens, ext))
                    wall = time.monotonic() - t0
                    after = m.settled()
                    rate, window = steady_rate(outs)
                    sp = after["fog-d"]["leader"].get("spec") or {}
                    sp0 = before["fog-d"]["leader"].get("spec") or {}
                    pd = pacer_delta(pacer(before), pacer(after))
                    out[key][n] = {"tok_s": rate, "paced_step_ms": 1000 * (pd["measured_s"] + pd["slept_s"]) / max(1, pd["steps"]), "window_s": window, "wall_s": wall, "tokens": m_tokens,
                                   "itl_ms": statistics.fmean(decode_itl_ms(o) for o in outs),
                                   "pacer": pd,
                                   "blocks": sp.get("blocks", 0) - sp0.get("blocks", 0),
                                   "accepted": sp.get("accepted", 0) - sp0.get("accepted", 0),
                                   "micro_batches": after["fog-d"]["leader"]["micro_batches"]
                                   - before["fog-d"]["leader"]["micro_batches"],
                                   "fallback": sp.get("fallback_steps", 0) - sp0.get("fallback_steps", 0)}
                    log(f"(b) {key} N={n}: {rate:.2f} tok/s, ITL {out[key][n]['itl_ms']:.0f} ms, wall {wall:.1f} s")
    return out


# -- (c) StarSD -----------------------------------------------------------------------------------------
def run_starsd(m: Mesh, clock: DrafterClock, cfg: dict, log) -> dict:
    """N sessions at once on the one drafter of mesh `m`, each mode: the drafter's busy fraction while
    all N are decoding (from its busy time), and the system's output tokens/s in that window."""
    out: dict = {}
    for mode in cfg["modes"]:
        out[mode] = {}
        for n in cfg["sessions"]:
            tries = 0
            while True:  # a try the host could not pace is repeated once
                tries += 1
                before = m.settled()
                outs = m.run(tenant_jobs(n, cfg["tokens"], MODES[mode]))
                after = m.settled()
                if tries == 2 or not overran(pacer_delta(pacer(before), pacer(after))):
                    break
            arr = [arrivals(o) for o in outs]
            t_a = max(a[0] for a in arr) + 0.5  # every session started (its prompt prefilled, drafting)
            t_b = min(a[-1] for a in arr)  # before the first one ends
            w = clock.window(t_a, t_b)
            rate, window = steady_rate(outs)
            out[mode][n] = {"busy_fraction": w[1] / w[0] if w else None, "busy_window_s": w[0] if w else None,
                            "tok_s": rate, "window_s": window, "pacer": pacer_delta(pacer(before), pacer(after)),
                            "steps": w[2] if w else None, "tries": tries}
            log(f"(c) {mode} N={n}: busy {out[mode][n]['busy_fraction']}, {rate:.2f} tok/s")
    return out


# -- report ---------------------------------------------------------------------------------------------
def predicted(k: float) -> dict:
    """The pacing targets (partition/cost.py, times K) of the steps these benchmarks take."""
    args = resolve_args(MODEL)
    d, t = model_costs(args, "int4"), model_costs(args, "fp32")
    edge, fog = load_device(EDGE), load_device(FOG)
    n = args.n_layers
    return {"draft_s": stage_batch_s(d, edge, n, [(1, 40)], True, True, 1),
            "verify_s": stage_batch_s(t, fog, n, [(GAMMA + 1, 40)], True, True, GAMMA + 1),
            "decode_s": stage_batch_s(t, fog, n, [(1, 40)], True, True, 1),
            "verify32_s": stage_batch_s(t, fog, n, [(GAMMA + 1, 40)] * 32, True, True, 32 * (GAMMA + 1)),
            "draft_batch_s": {b: stage_batch_s(d, edge, n, [(1, 40)] * b, True, True, b) for b in (1, 2, 4, 8)}}


def overrun_text(p: dict) -> str:
    paced = p["measured_s"] + p["slept_s"]
    return f"{100 * p['overrun_s'] / paced:.1f}%" if paced > 0 else "n/a"


def met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def report_engine(e: dict) -> None:
    print("(engine) in-process, 1 thread, SmolLM2-135M fp32 target: a (gamma+1)-row verification forward "
          f"vs a 1-row decode step ({e['decode_1row_ms']:.1f} ms), median of {e['repeats']} interleaved")
    for g, v in e["verify"].items():
        print(f"    gamma={g}: {g + 1} rows {v['ms']:.1f} ms = {v['ratio']:.2f}x a decode step  "
              f"(goal <= 1.3x: {met(v['ratio'] <= 1.3)})")
    a = e["acceptance"]
    print(f"    W4A16 g64 draft, gamma={GAMMA}, greedy, {a['prompts']} prompts x {a['tokens']} tokens: mean acceptance "
          f"length {a['mean_acceptance_length']:.2f} (expected ~3), acceptance rate {a['acceptance_rate']:.3f} "
          f"over {a['blocks']} blocks")


def report_itl(rows: list[dict], pred: dict, k: float) -> dict:
    print(f"(a) ITL (ms, client side, mean over the request) vs edge<->fog RTT; K = {k:g} (every device and link "
          f"{k:g}x slower; the ms below are emulated ms x K);")
    print(f"    pacing: draft step {1000 * k * pred['draft_s']:.1f} ms (Pi 5, int4), verification of {GAMMA + 1} rows "
          f"{1000 * k * pred['verify_s']:.1f} ms, decode step {1000 * k * pred['decode_s']:.1f} ms (Orin Nano, fp32); "
          f"gamma = {GAMMA}")
    print("    model: from each run's alpha (the i.i.d. per-token acceptance that gives its tokens per block, E[tok]), "
          "share of fully accepted blocks (async), T_draft (the drafter's busy time / steps), T_verify (the "
          "verifier's verify_ms) and RTT x K; cloud-only: the decode replica's mean paced step; gap/blk: ms per "
          "block (per token for cloud-only) that the model does not explain")
    head = f"    {'RTT ms':>6} | {'mode':<15} {'ITL':>7} {'model':>7} {'err':>6} {'alpha':>5} {'E[tok]':>6} " \
           f"{'T_d':>6} {'T_v':>6} {'gammas':<14} {'overrun':>7} {'gap/blk':>7}"
    print(head)
    summary: dict = {}
    for res in rows:
        for mode, runs in res["runs"].items():
            itl = statistics.fmean(r.itl_ms for r in runs)
            mod = statistics.fmean(r.model_ms for r in runs)
            err = (itl - mod) / mod
            p = {kk: sum(r.pacer[kk] for r in runs) for kk in runs[0].pacer}
            r0 = runs[0]
            gh = ",".join(f"{g}:{n}" for g, n in (r0.spec or {}).get("gamma_histogram", {}).items()) or "-"
            alpha = f"{statistics.fmean(r.alpha for r in runs):.2f}" if r0.alpha is not None else "-"
            etok = f"{statistics.fmean((r.tokens - 1) / r.spec['blocks'] for r in runs):.2f}" if r0.spec else "-"
            td = f"{1000 * statistics.fmean(r.t_draft_s for r in runs if r.t_draft_s):.0f}" \
                if any(r.t_draft_s for r in runs) else "-"
            tv = f"{1000 * statistics.fmean(r.t_verify_s for r in runs):.0f}" if r0.t_verify_s else \
                f"{1000 * statistics.fmean(r.t_step_s for r in runs):.0f}"
            gap = statistics.fmean((r.itl_ms - r.model_ms) * (r.tokens - 1) / (r.spec or {}).get("blocks", r.tokens - 1)
                                   for r in runs)  # ms per block (per step for cloud-only) the model does not explain
            rep = "*" if any(r.tries > 1 for r in runs) else " "
            print(f"    {res['rtt_ms']:>6} | {mode:<15} {itl:>7.1f} {mod:>7.1f} {100 * err:>+5.1f}% {alpha:>5} {etok:>6} "
                  f"{td:>6} {tv:>6} {gh:<14} {overrun_text(p):>7}{rep}{gap:>7.1f}")
            summary.setdefault(res["rtt_ms"], {})[mode] = {"itl_ms": itl, "model_ms": mod, "err": err}
        print("    " + "-" * (len(head) - 4))
    return summary


def report_itl_goals(summary: dict, rows: list[dict], k: float) -> None:
    print("    *: the first try of this row was not paced (decode replica overrun > 10%, or draft steps > 1.15x "
          "their pacing: this host was starved) and was repeated once; the row shows the repeat")
    worst = max((abs(v["err"]), rtt, mode) for rtt, ms in summary.items() for mode, v in ms.items())
    print(f"    model error: worst {100 * worst[0]:.1f}% ({worst[2]} at {worst[1]} ms); goal within {100 * ERROR_GOAL:.0f}%: "
          f"{met(worst[0] <= ERROR_GOAL)}")
    if 100 in summary:
        s = summary[100]
        ra, rad = s["async"]["itl_ms"] / s["sync"]["itl_ms"], s["async+adaptive"]["itl_ms"] / s["sync"]["itl_ms"]
        best = min(ra, rad)
        print(f"    RTT 100 ms: async / sync = {ra:.2f}x, async+adaptive / sync = {rad:.2f}x  (goal <= 0.8x: "
              f"{met(best <= 0.8)}; moonshot <= 0.6x: {met(best <= 0.6)})")
        res = next(r for r in rows if r["rtt_ms"] == 100)
        runs = res["runs"]["sync"]
        alpha = statistics.fmean(r.alpha for r in runs)
        td = statistics.fmean(r.t_draft_s for r in runs if r.t_draft_s) if any(r.t_draft_s for r in runs) else None
        tv = statistics.fmean(r.t_verify_s for r in runs)
        if td:
            rtt = k * 0.1
            sync = model_sync_s(alpha, GAMMA, td, tv, rtt)
            best_g = min(range(1, 13), key=lambda g: model_async_s(alpha, {g: 1}, td, tv, rtt))
            best_async = model_async_s(alpha, {best_g: 1}, td, tv, rtt)
            print(f"    model at alpha {alpha:.2f}: the best plain-pipelined async (gamma={best_g}) is "
                  f"{best_async / sync:.2f}x sync; 0.6x would need most blocks' verdicts to be hits "
                  f"(h = alpha^(gamma+1) = {alpha ** (GAMMA + 1):.2f} here)")
            g = choose_gamma(min(alpha, 0.98), td, 0.0, rtt + tv, True)
            crude = (max(g * td, rtt + tv) + td) / expected_tokens(alpha, g)
            print(f"    adaptive gamma: choose_gamma (engine/speculative.py) picks gamma={g} from these figures, "
                  f"believing {1000 * crude:.0f} ms/token; the epoch model gives "
                  f"{1000 * model_async_s(alpha, {g: 1}, td, tv, rtt):.0f} ms/token at gamma={g} and "
                  f"{1000 * best_async:.0f} at gamma={best_g}")
    cloud_wins = [rtt for rtt, ms in summary.items()
                  if ms["cloud-only"]["itl_ms"] < min(v["itl_ms"] for m, v in ms.items() if m != "cloud-only")]
    print(f"    cloud-only has the lowest ITL at RTT {', '.join(str(r) for r in cloud_wins) or 'none'} ms")


def report_capacity(c: dict, pred: dict) -> dict:
    k = c["k"]
    print(f"(b) one decode replica (Orin Nano, fp32), async drafting gamma={c.get('gamma', GAMMA)} from {c['drafters']} Pi 5 drafters "
          f"(sessions spread evenly), RTT {c['rtt_ms']} ms, K = {k:g}; pacing: verification of 32 blocks "
          f"{1000 * k * pred['verify32_s']:.0f} ms vs 1 block {1000 * k * pred['verify_s']:.0f} ms")
    print("    output tokens/s, steady window (all tenants decoding, until half have finished); ITL: per client, "
          "mean gap after its second token (ms); paced step: the decode replica's mean paced forward (ms)")
    print(f"    {'N':>3} | {'batched':>8} {'1/forward':>9} {'ratio':>6} | {'blocks/fwd':>10} {'overrun':>7} "
          f"{'1/fwd overrun':>13} | {'ITL draft':>9} {'ITL plain':>9} {'paced step':>10} {'plain tok/s':>11} {'overrun':>7}")
    for n in c["batched"]:
        b, o, p = c["batched"][n], c["one"][n], c["plain"][n]
        bpf = b["blocks"] / max(1, b["micro_batches"])
        print(f"    {n:>3} | {b['tok_s']:>8.2f} {o['tok_s']:>9.2f} {b['tok_s'] / o['tok_s']:>5.2f}x | {bpf:>10.2f} "
              f"{overrun_text(b['pacer']):>7} {overrun_text(o['pacer']):>13} | {b['itl_ms']:>9.0f} {p['itl_ms']:>9.0f} "
              f"{p['paced_step_ms']:>10.0f} {p['tok_s']:>11.2f} {overrun_text(p['pacer']):>7}")
    r16 = c["batched"][16]["tok_s"] / c["one"][16]["tok_s"] if 16 in c["batched"] else None
    if r16 is not None:
        print(f"    N=16: batched / one block per forward = {r16:.2f}x  (goal >= 4x: {met(r16 >= 4)})")
        for n in (16, 32):
            p = c["batched"].get(n, {}).get("pacer")
            if p and p["overrun_s"] > 0.05 * (p["measured_s"] + p["slept_s"]):
                print(f"    batched N={n} ran with {overrun_text(p)} pacer overrun: this host could not finish its "
                      f"{n}-block verification forwards in the paced time, which lowers the batched figure")
    out = {"ratio16": r16}
    top = max(c["batched"])
    for label, bound_of in (("the replica's single-client plain ITL", lambda key: 2 * c["plain"][1]["itl_ms"]),
                            ("each mode's own single-client ITL", lambda key: 2 * c[key][1]["itl_ms"])):
        served = {}
        for key in ("batched", "plain"):
            bound = bound_of(key)
            ok = [n for n in sorted(c[key]) if c[key][n]["itl_ms"] <= bound]
            served[key] = max(n for n in ok if all(m in ok for m in sorted(c[key]) if m <= n)) if 1 in ok else 0
        tail = {key: f"{served[key]}" + ("+" if served[key] == top else "") for key in served}
        print(f"    clients within 2x {label}: drafting {tail['batched']}, plain {tail['plain']}"
              + (" (the sweep's end: the bound was not reached)" if top in served.values() else ""))
        out[label] = served
    return out


def report_starsd(s: dict, k: float, rtt_ms: float, pred: dict) -> None:
    print(f"(c) StarSD: one Pi 5 draft server, N sessions at once, RTT {rtt_ms} ms, K = {k:g}; pacing of a draft step "
          "at batch 1/2/4/8: " + "/".join(f"{1000 * k * v:.0f}" for v in pred["draft_batch_s"].values()) + " ms")
    print("    busy fraction of the drafter while all N sessions decode (its busy time / wall time), system output tokens/s")
    modes = list(s)
    print(f"    {'N':>3} | " + " | ".join(f"{m + ' busy':>11} {m + ' tok/s':>12}" for m in modes))
    for n in next(iter(s.values())):
        cells = []
        for m in modes:
            r = s[m][n]
            bf = f"{r['busy_fraction']:.2f}" if r["busy_fraction"] is not None else "n/a"
            rep = "*" if r.get("tries", 1) > 1 else " "
            cells.append(f"{bf:>11} {r['tok_s']:>11.2f}{rep}")
        print(f"    {n:>3} | " + " | ".join(cells))
    for m in modes:
        from4 = [r["busy_fraction"] for n, r in s[m].items() if n >= 4]
        ok = bool(from4) and all(b is not None and b >= 0.9 for b in from4)
        print(f"    {m}: busy fraction >= 0.9 from N = 4: {met(ok)} (min {min(b or 0 for b in from4):.2f})")
    print("    *: repeated once, the first try's decode replica overran its pacing by > 10%")


# -- plots ----------------------------------------------------------------------------------------------
def plot_itl(summary: dict, path: Path, k: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    rtts = sorted(summary)
    for mode, color in zip(MODES, ("#264653", "#e76f51", "#2a9d8f", "#e9c46a")):
        ax.plot(rtts, [summary[r][mode]["itl_ms"] / k for r in rtts], "o-", color=color, label=f"{mode} measured")
        ax.plot(rtts, [summary[r][mode]["model_ms"] / k for r in rtts], "x--", color=color, alpha=0.7,
                label=f"{mode} model")
    ax.set_xlabel("edge <-> fog RTT (ms)")
    ax.set_ylabel("ITL (emulated ms = measured / K)")
    ax.set_title(f"ITL vs RTT (K = {k:g}), SmolLM2-135M, Pi 5 draft, Orin Nano target")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot_capacity(c: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = c["k"]
    ns = sorted(c["batched"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label, color in (("batched", "drafting, batched verification", "#2a9d8f"),
                              ("one", "drafting, one block per forward", "#e76f51"),
                              ("plain", "no drafting (plain decode)", "#264653")):
        ax1.plot(ns, [c[key][n]["tok_s"] * k for n in ns], "o-", color=color, label=label)
        if key != "one":  # its clients run fewer tokens (N x tokens / E forwards) and are served in arrival order
            ax2.plot(ns, [c[key][n]["itl_ms"] / k for n in ns], "o-", color=color, label=label)
    ax2.axhline(2 * c["plain"][1]["itl_ms"] / k, color="black", lw=1, ls=":", label="2x single-client plain ITL")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("tenants N")
    ax1.set_ylabel("output tokens per emulated s")
    ax1.set_title("aggregate throughput, one decode replica")
    ax2.set_ylabel("mean ITL (emulated ms)")
    ax2.set_title("ITL per client")
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot_starsd(s: dict, path: Path, k: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, color in zip(s, ("#2a9d8f", "#e76f51")):
        ns = sorted(s[mode])
        ax1.plot(ns, [s[mode][n]["busy_fraction"] or 0 for n in ns], "o-", color=color, label=mode)
        ax2.plot(ns, [s[mode][n]["tok_s"] * k for n in ns], "o-", color=color, label=mode)
    ax1.axhline(0.9, color="black", lw=1, ls=":", label="goal 0.9 (N >= 4)")
    ax1.set_ylim(0, 1.05)
    ax1.set_ylabel("draft server busy fraction")
    ax2.set_ylabel("system output tokens per emulated s")
    for ax in (ax1, ax2):
        ax.set_xlabel("sessions on one draft server")
        ax.legend(fontsize=8)
    ax1.set_title("StarSD: one Pi 5 draft server")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# -- main -----------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run: fewer RTTs, tenants and tokens (~5 min)")
    ap.add_argument("--parts", default="engine,a,b,c")
    ap.add_argument("--k-itl", type=float, default=12.0, help="time_scale of (a) and (c)")
    ap.add_argument("--k-capacity", type=float, default=25.0, help="time_scale of (b)")
    ap.add_argument("--rtt-capacity", type=float, default=20.0, help="edge<->fog RTT (ms) of (b) and (c)")
    ap.add_argument("--gamma-capacity", type=int, default=2,
                    help="draft length of (b), the same in both verification modes: 2, near what adaptive gamma "
                         "settles on here (a Pi 5 draft step costs about 0.57 of an Orin Nano verification)")
    ap.add_argument("--parallel", type=int, default=3, help="(a) meshes per wave (they start, then measure, together)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--from-json", default=None, metavar="A.json[,B.json]",
                    help="measure nothing: report (and plot) the runs saved in these files, later ones "
                         "replacing earlier ones part by part (e.g. a full run, then a rerun of --parts a)")
    a = ap.parse_args()
    parts = set(a.parts.split(","))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t_start:6.0f} s] {msg}", file=sys.stderr, flush=True)

    rtts = (0, 100) if a.quick else RTTS_MS
    itl_tokens, repeats = (16, 1) if a.quick else (32, 1)
    star = {"modes": ("async", "sync"), "sessions": (1, 4) if a.quick else STAR_SESSIONS, "tokens": 16 if a.quick else 20}
    tenants = (1, 4) if a.quick else TENANTS
    results: dict = {}
    if a.from_json:
        results, parts = saved_results(a.from_json.split(","))
    if "engine" in parts and not a.from_json:
        log("(engine) verification cost and draft acceptance, in process")
        results["engine"] = bench_engine(5 if a.quick else 15, 2 if a.quick else 8, 16 if a.quick else 64)
    if ("a" in parts or "c" in parts) and not a.from_json:
        star_rtt = a.rtt_capacity if a.rtt_capacity in rtts else rtts[0]
        todo = sorted(rtts if "a" in parts else (star_rtt,), key=lambda r: (r != star_rtt, -r))
        done = {}
        for i in range(0, len(todo), max(1, a.parallel)):  # waves of meshes: all up, then all measure
            wave = todo[i:i + max(1, a.parallel)]
            barrier = threading.Barrier(len(wave))
            with cf.ThreadPoolExecutor(len(wave)) as pool:
                futs = {r: pool.submit(run_itl_mesh, a.k_itl, r, itl_tokens, repeats,
                                       star if ("c" in parts and r == star_rtt) else None, log, barrier) for r in wave}
                done.update({r: f.result() for r, f in futs.items()})
        results["itl"] = [done[r] for r in sorted(done)]
    if "b" in parts and not a.from_json:
        # one block per forward takes N x tokens / E forwards: fewer tokens per tenant as N grows
        tokens = {"batched": lambda n: 12 if a.quick else 20, "plain": lambda n: 12 if a.quick else 16,
                  "one": lambda n: 12 if a.quick else {1: 20, 2: 20, 4: 16, 8: 12}.get(n, 8)}
        results["capacity"] = run_capacity(a.k_capacity, a.rtt_capacity, 2 if a.quick else 8, tenants, tokens, log,
                                           a.gamma_capacity)

    text = io.StringIO()
    with redirect_stdout(text):
        print(f"bench/speculative.py{' --quick' if a.quick else ''}: SmolLM2-135M, drafters {EDGE} (W4A16 g64), "
              f"target {FOG} (fp32); " + (f"re-reported from {a.from_json}" if a.from_json
                                          else f"wall {time.monotonic() - t_start:.0f} s on this host"))
        if "engine" in results:
            report_engine(results["engine"])
        if "itl" in results:
            pred = predicted(1.0)
            for res in results["itl"]:
                fill_models(res, pred)
            if "a" in parts:
                summary = report_itl(results["itl"], pred, a.k_itl)
                report_itl_goals(summary, results["itl"], a.k_itl)
                plot_itl(summary, out / "speculative_itl.png", a.k_itl)
        if "capacity" in results:
            report_capacity(results["capacity"], predicted(1.0))
            plot_capacity(results["capacity"], out / "speculative_capacity.png")
        star_res = next((r for r in results.get("itl", []) if "starsd" in r), None)
        if star_res is not None:
            report_starsd(star_res["starsd"], a.k_itl, star_res["rtt_ms"], predicted(1.0))
            plot_starsd(star_res["starsd"], out / "speculative_starsd.png", a.k_itl)
    print(text.getvalue(), end="")
    (out / "speculative.txt").write_text(text.getvalue())
    (out / "speculative.json").write_text(json.dumps(results, default=lambda o: o.__dict__, indent=1))


def saved_results(paths: list[str]) -> tuple[dict, set[str]]:
    """The results of earlier runs (their speculative.json), merged part by part: a later file's
    engine / ITL / capacity figures replace an earlier one's; (c), measured on (a)'s RTT-20 mesh,
    is kept from whichever file has it."""
    results: dict = {}
    star = None
    def int_keys(v):  # JSON made the integer keys (gamma, N) strings
        if isinstance(v, dict):
            return {(int(k) if isinstance(k, str) and k.lstrip("-").isdigit() else k): int_keys(x) for k, x in v.items()}
        return [int_keys(x) for x in v] if isinstance(v, list) else v

    for path in paths:
        got = json.loads(Path(path).read_text())
        for key in ("engine", "capacity"):
            if key in got:
                got[key] = int_keys(got[key])
        for res in got.get("itl", []):
            res["runs"] = {mode: [ModeRun(**r) for r in runs] for mode, runs in res["runs"].items()}
            if "starsd" in res:
                res["starsd"] = int_keys(res["starsd"])
                star = res
        results.update(got)
    if star is not None and not any("starsd" in r for r in results.get("itl", [])):
        for res in results["itl"]:
            if res["rtt_ms"] == star["rtt_ms"]:
                res["starsd"] = star["starsd"]
    parts = {"engine"} & set(results) | ({"a", "c"} if "itl" in results else set()) | (
        {"b"} if "capacity" in results else set())
    return results, parts


if __name__ == "__main__":
    main()
