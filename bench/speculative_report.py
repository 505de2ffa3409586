"""What bench/speculative.py's runs mean: the record of one run (`ModeRun`), the analytic model of
each mode built only from measured figures (alpha, T_draft, T_verify, RTT), the printed tables and
the plots. Nothing here starts a mesh: `python bench/speculative.py --from-json ...` re-reports
saved runs through it.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from meshllm.config import resolve_args  # noqa: E402
from meshllm.device import load_device  # noqa: E402
from meshllm.engine.speculative import (  # noqa: E402
    choose_gamma,
    expected_tokens,
    pipelined_block_s,
    sync_block_s,
)
from meshllm.partition.cost import model_costs, stage_batch_s  # noqa: E402
from meshllm.roles.drafter import MAX_OUTSTANDING  # noqa: E402

MODEL = "smollm2-135m"
EDGE, FOG = "raspberry-pi-5-8gb", "jetson-orin-nano-8gb"
GAMMA = 4
MODES = {"cloud-only": {"speculation": "off"}, "sync": {"speculation": "sync", "adaptive": False},
         "async": {"speculation": "async", "adaptive": False}, "async+adaptive": {"speculation": "async", "adaptive": True}}
ERROR_GOAL = 0.15


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
    branches: dict | None = None  # the drafter's proactive branches: forked, adopted (hits), misses
    pacer: dict = field(default_factory=dict)


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
                outstanding: int = MAX_OUTSTANDING["async"], rescue: float = 0.0) -> tuple[float, float]:
    """Async drafting as the drafter does it, as (seconds, tokens) per block: the runtime's own
    model (engine/speculative.py pipelined_block_s, which adaptive gamma also uses)."""
    return (pipelined_block_s(alpha, gamma, t_draft, t_verify, rtt, outstanding, hit=hit, rescue=rescue),
            expected_tokens(alpha, gamma))


def model_async_s(alpha: float, gammas: dict[int, int], t_draft: float, t_verify: float, rtt: float,
                  hit: float | None = None, adaptive: bool = False, pipelined: float | None = None,
                  rescue: float = 0.0) -> float:
    """Async drafting, seconds per token; `gammas`: blocks per draft length (adaptive gamma), each
    length modelled as above and mixed by its share of the blocks; `hit`: measured h (one length).
    `adaptive`: a length's blocks are pipelined only where the drafter's own rule says the
    look-ahead pays (engine/speculative.py choose_drafting: it sees the verification inside its
    measured round trip), else drafted as a synchronous session would; `pipelined`, when measured
    (the share of the session's verdicts that had a look-ahead block behind them: the rule decides
    on running estimates, early ones included), replaces that rule: each block costs that share of
    a pipelined block and the rest of a synchronous one. `rescue`: the measured share of broken
    verdicts that a proactive branch turned into hits. An async session branches whether or not
    it pipelines, and without look-ahead every verdict breaks its stream: a rescued one is
    followed by a block already at the verifier (one verification), the rest by a synchronous
    block."""
    n = sum(gammas.values())
    per = {}
    for g in gammas:
        piped = async_epoch(alpha, g, t_draft, t_verify, rtt, hit if len(gammas) == 1 else None, rescue=rescue)
        plain = ((1 - rescue) * sync_block_s(g, t_draft, t_verify, rtt) + rescue * t_verify, expected_tokens(alpha, g))
        if pipelined is not None:
            per[g] = (pipelined * piped[0] + (1 - pipelined) * plain[0], plain[1])
            continue
        pipe = not adaptive or (pipelined_block_s(alpha, g, t_draft, 0.0, rtt + t_verify, rescue=rescue)
                                < sync_block_s(g, t_draft, 0.0, rtt + t_verify))
        per[g] = piped if pipe else plain
    return sum(gammas[g] / n * per[g][0] for g in gammas) / sum(gammas[g] / n * per[g][1] for g in gammas)


def rescue_share(r: ModeRun) -> float:
    """Share of the verdicts that broke an async stream whose correction a branch had drafted a
    whole block after, already published (the model's hit; a branch still drafting when its
    verdict came saves only part of a block's drafting, and is not counted)."""
    b = r.branches or {}
    tried = b.get("branch_hits", 0) + b.get("branch_misses", 0)
    return b.get("branch_hits_ready", b.get("branch_hits", 0)) / tried if tried else 0.0


def pipelined_share(r: ModeRun) -> float | None:
    """Share of a session's verdicts that came while it drafted ahead (the drafter counts them:
    `pipelined_verdicts` / `verdicts`); from runs saved before it did, look-ahead blocks that stood
    (`ahead_blocks`) or were dropped as stale, over its verified blocks (None: not reported)."""
    b = r.branches or {}
    if b.get("verdicts"):
        return b["pipelined_verdicts"] / b["verdicts"]
    spec = r.spec or {}
    if "ahead_blocks" not in spec or not spec.get("blocks"):
        return None
    return min(1.0, (spec["ahead_blocks"] + spec.get("stale_blocks", 0)) / spec["blocks"])


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
                adaptive = mode == "async+adaptive"
                r.model_ms = 1000 * model_async_s(r.alpha, gh, td, r.t_verify_s, rtt, hit, adaptive,
                                                  pipelined_share(r) if adaptive else None, rescue_share(r))


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
          "block (per token for cloud-only) that the model does not explain; rescued: broken verdicts whose "
          "correction a proactive branch had drafted after (async): its block already out + still drafting, of "
          "all broken verdicts (the model counts the first as hits)")
    head = f"    {'RTT ms':>6} | {'mode':<15} {'ITL':>7} {'model':>7} {'err':>6} {'alpha':>5} {'E[tok]':>6} " \
           f"{'T_d':>6} {'T_v':>6} {'gammas':<14} {'rescued':>7} {'overrun':>7} {'gap/blk':>7}"
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
            hits = sum((r.branches or {}).get("branch_hits", 0) for r in runs)
            broke = hits + sum((r.branches or {}).get("branch_misses", 0) for r in runs)
            ready = sum((r.branches or {}).get("branch_hits_ready", 0) for r in runs)
            resc = f"{ready}+{hits - ready}/{broke}" if broke else "-"
            print(f"    {res['rtt_ms']:>6} | {mode:<15} {itl:>7.1f} {mod:>7.1f} {100 * err:>+5.1f}% {alpha:>5} {etok:>6} "
                  f"{td:>6} {tv:>6} {gh:<14} {resc:>7} {overrun_text(p):>7}{rep}{gap:>7.1f}")
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
            rho = statistics.fmean(rescue_share(r) for r in res["runs"]["async"])
            with_branches = model_async_s(alpha, {GAMMA: 1}, td, tv, rtt, rescue=rho)
            need = next((x / 100 for x in range(0, 101) if model_async_s(alpha, {GAMMA: 1}, td, tv, rtt, rescue=x / 100)
                         <= 0.6 * sync), None)
            print(f"    proactive branches rescued {100 * rho:.0f}% of the broken verdicts with a whole block (async): the model gives "
                  f"{with_branches / sync:.2f}x sync at gamma={GAMMA}; 0.6x needs "
                  + (f"{100 * need:.0f}% rescued" if need is not None else "more than rescues can give"))
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
