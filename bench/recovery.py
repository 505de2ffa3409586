"""Recovery gaps: node deaths mid-generation through the public CLI, per kind of node.

Run:  python bench/recovery.py [--seeds 3] [--out bench/results/recovery.txt]

For each kind of node of clusters/failure.yaml (a decode stage fog-2, the coordinator edge-1 --
the lowest id, also a drafter --, the prefill/decode node fog-4, the drafter edge-2, and fog-1,
a prefill node that runs the gateway the client talks to first: the client sends its requests
to the second gateway, on fog-4) and each
seed, `launch.py --cluster clusters/failure.yaml --json --kill NODE@S` kills that node with
kill -9 at a seeded random moment 0.5-3 s after the workload's first request; then, per seed,
the decode stage fog-2 and 0.7 s later the coordinator (before it has re-planned, so the next
coordinator must); then one run with a partition between the zones that heals; then, per seed,
`--restart NODE@S` of the decode stage and of the first gateway's node (kill -9 and started again
at once from its node file, as a supervisor restarts a crashed service: its peers see a new
incarnation at the same address before they would have seen it dead); then, per seed,
`--pause NODE@S1-S2` (SIGSTOP for PAUSE_S, then SIGCONT: a node that does not run for a while)
of the decode stage alone, and of the coordinator with the decode stage 0.5 s later. `--only
KIND` runs the rows of one kind (kill, takeover, partition, restart, pause). Printed per run:
requests, resumed requests, whether every output equals the single-process reference (up to
engine/sampling.py's tie rule), and the recovery gaps (the longest pause between two tokens a client saw across a
resume); for a partition or a pause, how long after its end the mesh used every node again. Goal: every gap <= 5 s with the
default failure detection (heartbeat 0.5 s, dead after 2.5 s). Bounded: each run has a timeout.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from meshllm.engine.generate import GenerationOptions, generate  # noqa: E402
from meshllm.engine.sampling import same_up_to_tie  # noqa: E402
from meshllm.engine.tokenizer import load_tokenizer  # noqa: E402
from meshllm.engine.weights import load_transformer, resolve_model  # noqa: E402

CLUSTER = ROOT / "clusters" / "failure.yaml"
MAX_TOKENS = 32
GOAL_S = 5.0
RUN_TIMEOUT_S = 900
TAKEOVER_AFTER_S = 0.7  # under the failure timeout (2.5 s): the next coordinator must re-plan for both
VICTIMS = {"decode stage": "fog-2", "coordinator": "edge-1", "prefill/decode node": "fog-4", "drafter": "edge-2",
           "first gateway (prefill)": "fog-1"}
RESTARTED = {"decode stage": "fog-2", "first gateway (prefill)": "fog-1"}
KINDS = ("kill", "takeover", "partition", "restart", "pause")
PAUSE_S = 3.5  # longer than the failure timeout: the peers see the node die and come back as the same life
PAUSED = {"decode stage": ("fog-2",), "coordinator, then the decode stage": ("edge-1", "fog-2")}


LINES: list[str] = []  # what was printed, for --out


def emit(line: str) -> None:
    LINES.append(line)
    print(line, flush=True)


class Reference:
    """What `--reference` computes (greedy, fp32), in this process, once per prompt."""

    def __init__(self) -> None:
        self.model = load_transformer("smollm2-135m")
        self.tok = load_tokenizer(resolve_model("smollm2-135m"))
        self.cache: dict[str, tuple[list[int], list[float]]] = {}

    def same(self, prompt: str, got: list[int]) -> bool:
        """The identity rule: equal, or equal up to a first divergence at a numerical tie."""
        if prompt not in self.cache:
            r = generate(self.model, self.tok.encode(prompt), GenerationOptions(MAX_TOKENS), self.tok.eos_ids)
            self.cache[prompt] = (r.token_ids, r.margins)
        return same_up_to_tie(got, *self.cache[prompt])[0]


def run(faults: list[str]) -> dict:
    cmd = [sys.executable, str(ROOT / "launch.py"), "--cluster", str(CLUSTER), "--json",
           "--max-tokens", str(MAX_TOKENS), *faults]
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=ROOT)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(faults)}: exit {r.returncode}: {r.stderr[-2000:]}")
    out = json.loads(r.stdout)
    out["wall_s"] = time.monotonic() - t0
    return out


def summarize(label: str, out: dict, ref: Reference) -> dict:
    results = out["results"]
    errors = [res for res in results if "error" in res]
    equal = sum(1 for res in results if "error" not in res and ref.same(res["prompt"], res["token_ids"]))
    gaps = [g / 1000 for res in results for g in res.get("recovery_gaps_ms", [])]
    row = dict(label=label, faults=out["faults"], requests=len(results), errors=len(errors), equal=equal,
               resumed=out["metrics"].get("resumed_requests", 0), gaps_s=sorted(gaps), wall_s=out["wall_s"])
    gap = f"max {max(gaps):.2f} s, median {statistics.median(gaps):.2f} s" if gaps else "no request paused"
    healed = [f.get("healed_after_s", "not watched") for f in out["faults"][-1:] if f["kind"] in ("partition", "pause")]
    heal = "".join(f"; every node in use again {h} s after the {out['faults'][-1]['kind']} ended" if isinstance(h, float)
                   else f"; mesh healed: {h or 'NOT within the bound'}" for h in healed)
    emit(f"{label:38s} requests {row['requests']:2d}  errors {row['errors']}  equal to reference "
         f"{equal}/{len(results)}  resumed {row['resumed']:2d}  gaps: {gap}{heal}")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None, help="write every run's figures here")
    ap.add_argument("--only", choices=KINDS, default=None, help="run the rows of this kind only")
    a = ap.parse_args()
    kinds = (a.only,) if a.only else KINDS
    ref = Reference()
    rows = []
    emit(f"recovery: {CLUSTER.relative_to(ROOT)}, {MAX_TOKENS} tokens per request, kill -9 at a seeded moment "
         f"0.5-3 s into the workload")
    for kind, node in VICTIMS.items() if "kill" in kinds else ():
        for seed in range(1, a.seeds + 1):
            at = round(random.Random(f"{node}/{seed}").uniform(0.5, 3.0), 2)
            rows.append(summarize(f"kill {kind} {node}@{at}", run(["--kill", f"{node}@{at}"]), ref))
    for seed in range(1, a.seeds + 1) if "takeover" in kinds else ():  # the coordinator dies before it re-planned
        at = round(random.Random(f"takeover/{seed}").uniform(0.5, 3.0), 2)
        later = round(at + TAKEOVER_AFTER_S, 2)
        rows.append(summarize(f"kill fog-2@{at}, coordinator @{later}",
                              run(["--kill", f"fog-2@{at}", "--kill", f"edge-1@{later}"]), ref))
    if "partition" in kinds:
        rows.append(summarize("partition edge:fog@0.5-4 (heals)", run(["--partition", "edge:fog@0.5-4"]), ref))
    for kind, node in RESTARTED.items() if "restart" in kinds else ():
        for seed in range(1, a.seeds + 1):
            at = round(random.Random(f"restart/{node}/{seed}").uniform(0.5, 3.0), 2)
            rows.append(summarize(f"restart {kind} {node}@{at}", run(["--restart", f"{node}@{at}"]), ref))
    for kind, nodes in PAUSED.items() if "pause" in kinds else ():
        for seed in range(1, a.seeds + 1):
            at = round(random.Random(f"pause/{kind}/{seed}").uniform(0.5, 3.0), 2)
            faults = [x for k, n in enumerate(nodes)
                      for x in ("--pause", f"{n}@{at + 0.5 * k:.2f}-{at + 0.5 * k + PAUSE_S:.2f}")]
            rows.append(summarize(f"pause {kind} {'+'.join(nodes)}@{at} {PAUSE_S} s", run(faults), ref))
    gaps = [g for r in rows for g in r["gaps_s"]]
    lost = sum(r["errors"] for r in rows)
    wrong = sum(r["requests"] - r["errors"] - r["equal"] for r in rows)
    emit(f"all runs: {sum(r['requests'] for r in rows)} requests, {lost} failed, {wrong} differ from the reference; "
         f"recovery gap max {max(gaps, default=0):.2f} s, median {statistics.median(gaps) if gaps else 0:.2f} s "
         f"over {len(gaps)} resumes (goal <= {GOAL_S:.0f} s: {'met' if max(gaps, default=0) <= GOAL_S else 'NOT met'})")
    if a.out:
        Path(a.out).write_text("\n".join(LINES) + "\n")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
