"""The planner benchmark's bound (bench/planner.py): each cap of meshllm/sim/metrics.py on a
cluster's trace, its line in planner.txt, and `python bench/planner.py --bounds`, which recomputes
them in a finished run's planner.json / planner.txt where the bound itself did not move."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from meshllm.config import load_cluster, plan_inputs  # noqa: E402
from meshllm.sim import sweep  # noqa: E402
from meshllm.sim.metrics import (  # noqa: E402
    bound_rate_per_s,
    decode_memory_rate_per_s,
    flops_rate_per_s,
    prefill_rate_per_s,
)


def bound_line(res: dict) -> str:
    caps = {"all FLOPs at the devices' compute": res["bound_flops"],
            "decode at its devices' memory-bound best step": res["bound_decode_memory"],
            "the prompts' FLOPs at the compute of the devices that may prefill": res["bound_prefill"]}
    return "bound   " + "; ".join(f"{k}: {v:.3f} req/s ({v / res['bound']:.2f}x)" for k, v in caps.items())


def bound_caps(name: str, seed: int) -> dict:
    """The bound of cluster `name` and each of its caps (metrics.py), on bench_cluster's trace."""
    inp = plan_inputs(load_cluster(REPO / "clusters" / f"{name}.yaml"))
    lengths = [(a, b) for _, a, b in sweep.make_trace(inp, 2000, seed)]
    return dict(bound=bound_rate_per_s(inp, lengths), bound_decode_memory=decode_memory_rate_per_s(inp, lengths),
                bound_flops=flops_rate_per_s(inp, lengths), bound_prefill=prefill_rate_per_s(inp, lengths))


def refresh_bounds(out: Path, seed: int, chosen: list[str]) -> int:
    """Recompute the bound's caps of `chosen` (all, if empty) in OUT/planner.json and their `bound`
    lines in OUT/planner.txt, leaving every simulated figure: for a change to a cap that does not
    bind. Exit 1, changing nothing, where the bound itself moved (its ratios need a re-run), where
    planner.txt does not hold the JSON's `bound` line exactly once, or a chosen cluster has none."""
    saved = json.loads((out / "planner.json").read_text())
    txt = out / "planner.txt"
    lines = txt.read_text().splitlines() if txt.exists() else []
    moved, unmatched = [], []
    missing = sorted(set(chosen) - {r["name"] for r in saved["clusters"] if "bound_flops" in r})
    for res in saved["clusters"]:
        if chosen and res["name"] not in chosen or "bound_flops" not in res:
            continue
        got = bound_caps(res["name"], seed)
        if abs(got["bound"] - res["bound"]) > 1e-9 * res["bound"]:
            moved.append(f"{res['name']} ({res['bound']:.3f} -> {got['bound']:.3f} req/s)")
            continue
        old = bound_line(res)
        if txt.exists() and lines.count(old) != 1:  # the txt is not this JSON's run: its line would stay stale
            unmatched.append(f"{res['name']} ({lines.count(old)} times)")
            continue
        res.update(got)
        new = bound_line(res)
        print(f"{res['name']}: {new}")
        lines = [new if x == old else x for x in lines]
    if missing:
        print("no bound's caps in planner.json for " + ", ".join(missing), file=sys.stderr)
    if unmatched:
        print("planner.txt holds the JSON's `bound` line not once for " + ", ".join(unmatched), file=sys.stderr)
    if moved:
        print("the bound itself moved on " + ", ".join(moved) + ": re-run those clusters", file=sys.stderr)
    if missing or unmatched or moved:
        return 1
    (out / "planner.json").write_text(json.dumps(saved, indent=1, default=str))
    if lines:
        txt.write_text("\n".join(lines) + "\n")
    return 0
