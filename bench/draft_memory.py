"""A drafter's peak memory while it builds its W4A16 draft: the whole fp32 target quantized
(what drafters did before weights.load_quantized) side by side with load_quantized (one fp32
layer at a time; the embedding and head a block of rows at a time).

    python bench/draft_memory.py [--model smollm2-135m] [--quant w4a16] [--runs 3]   (~30 s)

Each build runs in a fresh process (the two ways alternate); the figure is the process's peak
resident memory (ru_maxrss) above what it held before the build, the median over runs, beside
the draft's own bytes. Resident memory includes the model file's pages read through mmap (the
kernel drops them under pressure). Results: bench/results/draft_memory.txt.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

BUILD = """
import json, resource, sys, time
sys.path.insert(0, {repo!r})
from meshllm.engine.quant import quantize_model
from meshllm.engine.weights import load_quantized, load_transformer, weight_bytes
way, model, quant = sys.argv[1:4]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
if way == "whole":
    draft = quantize_model(load_transformer(model, pack=False), quant, 64)
else:
    draft = load_quantized(model, quant, 64)
secs = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({{"peak_mb": (peak - before) / 1e3, "draft_mb": weight_bytes(draft) / 1e6, "s": secs}}))
"""


def build(way: str, model: str, quant: str) -> dict:
    out = subprocess.run([sys.executable, "-c", BUILD.format(repo=str(REPO)), way, model, quant],
                         capture_output=True, text=True, timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--quant", default="w4a16", choices=("w4a16", "w8a16"))
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    got: dict[str, list[dict]] = {"whole": [], "by layer": []}
    for _ in range(a.runs):
        for way in got:
            got[way].append(build(way, a.model, a.quant))
    draft = got["by layer"][0]["draft_mb"]
    print(f"{a.model} {a.quant} g64 draft: {draft:.0f} MB; {a.runs} runs each, medians")
    print(f"{'build':10s} {'peak MB above start':>20s} {'x draft':>8s} {'seconds':>8s}")
    med = {}
    for way, runs in got.items():
        med[way] = statistics.median(r["peak_mb"] for r in runs)
        print(f"{way:10s} {med[way]:20.0f} {med[way] / draft:8.2f} {statistics.median(r['s'] for r in runs):8.2f}")
    print(f"ratio     by layer / whole peak = {med['by layer'] / med['whole']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
