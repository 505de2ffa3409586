"""How long a node takes to load the embedded model, and the dequantization beside the gguf package's.

Run:  python bench/load.py [--repeats 3] [--out bench/results/load.txt]      (~30 s)

Each repeat runs in a fresh process (nothing cached or imported yet, as a node starts), on one
torch thread: the time of `load_transformer("smollm2-135m")` (the whole model: every node of a
one-stage replica, every drafter before it quantizes), whether it imported torch._dynamo, and
the resident memory after it. Then, in one process, every tensor of the model file dequantized
by the `gguf` package's numpy code and by ours (`gguf_file.dequantize_tensor`), side by side, and
checked bit for bit. Best of the repeats.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
import torch
torch.set_num_threads(1)
from meshllm.engine.weights import load_transformer
t1 = time.perf_counter()
model = load_transformer("smollm2-135m")
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "dynamo": "torch._dynamo" in sys.modules,
                  "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def dequant_side_by_side() -> tuple[float, float, int]:
    import time

    import numpy as np
    import torch
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from meshllm.engine.gguf_file import dequantize_tensor
    from meshllm.engine.weights import resolve_model, tensor_reader

    torch.set_num_threads(1)
    reader = tensor_reader(resolve_model("smollm2-135m"))
    theirs = ours = 0.0
    for name, t in reader.tensors.items():
        raw = reader.raw(name)
        a = time.perf_counter()
        want = np.array(dequantize(raw, GGMLQuantizationType(t.ggml_type)), dtype=np.float32).reshape(t.shape)
        b = time.perf_counter()
        got = dequantize_tensor(raw, t)
        c = time.perf_counter()
        if not np.array_equal(got.view(np.uint32), want.view(np.uint32)):
            raise SystemExit(f"{name}: our dequantization differs from the gguf package's")
        theirs, ours = theirs + b - a, ours + c - b
    return theirs, ours, len(reader.tensors)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    runs = []
    for i in range(args.repeats):
        p = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, capture_output=True, text=True, check=True)
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
        print(f"load run {i + 1}: {runs[-1]}", file=sys.stderr)
    best = min(runs, key=lambda r: r["load_s"])
    deq = [dequant_side_by_side() for _ in range(args.repeats)]
    theirs, ours, n = min(d[0] for d in deq), min(d[1] for d in deq), deq[0][2]
    lines = [
        "loading SmolLM2-135M (Q4_1 GGUF, the embedded model) in a fresh process, one torch thread; best of "
        f"{args.repeats}",
        f"import torch + meshllm {best['import_s']:.2f} s; load_transformer (whole model) {best['load_s']:.2f} s; "
        f"torch._dynamo imported: {'yes' if best['dynamo'] else 'no'}; peak resident {best['max_rss_mb']:.0f} MB",
        f"dequantizing all {n} tensors: gguf package {theirs:.3f} s, ours {ours:.3f} s, "
        f"{theirs / ours:.1f}x faster, bit for bit equal",
    ]
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
