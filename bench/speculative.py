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
import tempfile
import threading
import time
from contextlib import redirect_stdout
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from speculative_mesh import (  # noqa: E402
    ITL_PROMPT,
    DrafterClock,
    Mesh,
    arrivals,
    cluster_doc,
    decode_itl_ms,
    mean_itl_ms,
    overran,
    pacer,
    pacer_delta,
    steady_rate,
)
from speculative_report import (  # noqa: E402
    EDGE,
    FOG,
    GAMMA,
    MODEL,
    MODES,
    ModeRun,
    fill_models,
    plot_capacity,
    plot_itl,
    plot_starsd,
    predicted,
    report_capacity,
    report_engine,
    report_itl,
    report_itl_goals,
    report_starsd,
)

from meshllm.workload import Job  # noqa: E402

RTTS_MS = (0, 20, 50, 100, 200)
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


# -- the model ----------------------------------------------------------------------------------------
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
        d0, d1 = (x.get("edge-1", {}).get("drafter") or {} for x in (before, after))
        r.branches = {key: d1.get(key, 0) - d0.get(key, 0) for key in ("branches", "branch_hits", "branch_hits_ready", "branch_misses",
                                                                "verdicts", "pipelined_verdicts")}
    return r


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


# -- main -----------------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run: fewer RTTs, tenants and tokens (~5 min)")
    ap.add_argument("--parts", default="engine,a,b,c")
    ap.add_argument("--k-itl", type=float, default=12.0, help="time_scale of (a) and (c)")
    ap.add_argument("--k-capacity", type=float, default=25.0, help="time_scale of (b)")
    ap.add_argument("--rtt-capacity", type=float, default=20.0, help="edge<->fog RTT (ms) of (b) and (c)")
    ap.add_argument("--gamma-capacity", type=int, default=2,
                    help="draft length of (b), the same in both verification modes: 2, near what adaptive gamma "
                         "settles on here (a Pi 5 draft step costs about 0.57 of an Orin Nano verification)")
    ap.add_argument("--rtts", default=None, help="(a)'s edge<->fog RTTs in ms, comma-separated "
                    f"(default {','.join(map(str, RTTS_MS))})")
    ap.add_argument("--parallel", type=int, default=3, help="(a) meshes per wave (they start, then measure, together)")
    ap.add_argument("--out", default=None, help="where the report, JSON and plots go (default bench/results; "
                    "with --quick a new temporary folder, so a smoke run never replaces a full run's results)")
    ap.add_argument("--from-json", default=None, metavar="A.json[,B.json]",
                    help="measure nothing: report (and plot) the runs saved in these files, later ones "
                         "replacing earlier ones part by part (e.g. a full run, then a rerun of --parts a)")
    return ap.parse_args()


def main() -> None:
    a = parse_args()
    parts = set(a.parts.split(","))
    if a.out:
        out = Path(a.out)
    elif a.quick:
        out = Path(tempfile.mkdtemp(prefix="meshllm-speculative-quick-"))
    else:
        out = Path(__file__).resolve().parent / "results"
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t_start:6.0f} s] {msg}", file=sys.stderr, flush=True)

    if a.from_json:
        results, parts = saved_results(a.from_json.split(","))
    else:
        results = measure(a, parts, log)
    text = report(a, results, parts, out, time.monotonic() - t_start)
    print(text, end="")
    (out / "speculative.txt").write_text(text)
    (out / "speculative.json").write_text(json.dumps(results, default=lambda o: o.__dict__, indent=1))
    print(f"(written to {out})", file=sys.stderr)


def measure(a: argparse.Namespace, parts: set[str], log) -> dict:
    """Run the parts asked for (engine, a, b, c) and return their raw results."""
    rtts = tuple(float(r) for r in a.rtts.split(",")) if a.rtts else (0, 100) if a.quick else RTTS_MS
    itl_tokens, repeats = (16, 1) if a.quick else (32, 1)
    star = {"modes": ("async", "sync"), "sessions": (1, 4) if a.quick else STAR_SESSIONS, "tokens": 16 if a.quick else 20}
    tenants = (1, 4) if a.quick else TENANTS
    results: dict = {}
    if "engine" in parts:
        log("(engine) verification cost and draft acceptance, in process")
        results["engine"] = bench_engine(5 if a.quick else 15, 2 if a.quick else 8, 16 if a.quick else 64)
    if "a" in parts or "c" in parts:
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
    if "b" in parts:
        # one block per forward takes N x tokens / E forwards: fewer tokens per tenant as N grows
        tokens = {"batched": lambda n: 12 if a.quick else 20, "plain": lambda n: 12 if a.quick else 16,
                  "one": lambda n: 12 if a.quick else {1: 20, 2: 20, 4: 16, 8: 12}.get(n, 8)}
        results["capacity"] = run_capacity(a.k_capacity, a.rtt_capacity, 2 if a.quick else 8, tenants, tokens, log,
                                           a.gamma_capacity)
    return results


def report(a: argparse.Namespace, results: dict, parts: set[str], out: Path, wall_s: float) -> str:
    """The printed report of `results` (plots written to `out`)."""
    text = io.StringIO()
    with redirect_stdout(text):
        print(f"bench/speculative.py{' --quick' if a.quick else ''}: SmolLM2-135M, drafters {EDGE} (W4A16 g64), "
              f"target {FOG} (fp32); " + (f"re-reported from {', '.join(shown_path(p) for p in a.from_json.split(','))}"
                                          if a.from_json
                                          else f"wall {wall_s:.0f} s on this host"))
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
    return text.getvalue()


def shown_path(path: str) -> str:
    """`path` relative to the repository if it lies inside it (a report names no scratch folder)."""
    p = Path(path).resolve()
    repo = Path(__file__).resolve().parent.parent
    return str(p.relative_to(repo)) if p.is_relative_to(repo) else p.name


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
