"""Prefill memory: what a node's memory grows by over prompts of many lengths, with oneDNN's kernel
caches at torch's default size and at meshllm's (`meshllm/engine/__init__.py`), side by side.

Run:  python bench/prefill_memory.py [--lengths 20 500 4] [--walk 400] [--json]

Why: every row count a packed linear layer meets compiles a kernel per weight shape, and oneDNN
(and ideep, torch's layer above it) keep up to 1024 of them each: a prefill node serving prompts
of many lengths grew by hundreds of MB that the idle trim could not give back. Each setting runs
in its own process (the caches are sized once per process), on one thread, and prints:
- RSS growth after one prefill of each prompt length (`[17] * n`), and after `malloc_trim` (what
  an idle node gives back: the rest is held by the caches);
- time per prefill, and per decode step of a batch whose size walks at random over 1..64 rows
  (the row counts a decode replica meets, which the cache must keep hot);
- whether both settings chose the same tokens (the kernels are rebuilt the same: they must).
Then the ratios meshllm / torch-default of each figure.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CACHE_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
TORCH_DEFAULT = "1024"


def rss_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def child(lengths: range, walk: int) -> dict:
    sys.path.insert(0, str(REPO))
    import torch

    from meshllm.engine.generate import GenerationOptions, generate
    from meshllm.engine.model import SeqSpan
    from meshllm.engine.weights import load_transformer, release_freed_memory

    torch.set_num_threads(1)
    model = load_transformer("smollm2-135m")
    opts = GenerationOptions(max_tokens=1)
    generate(model, [17] * 8, opts)
    release_freed_memory()
    base = rss_mb()
    t0, tokens = time.perf_counter(), []
    for n in lengths:
        tokens += generate(model, [17] * n, opts).token_ids
    prefill_s = (time.perf_counter() - t0) / len(lengths)
    grown = rss_mb() - base
    release_freed_memory()
    kept = rss_mb() - base
    rng, rows, cache, steps = random.Random(0), 8, model.new_cache(), []
    for s in range(64):
        cache.allocate(s, walk + 2)
    with torch.inference_mode():
        for _ in range(walk):
            rows = min(64, max(1, rows + rng.choice((-3, -2, -1, 1, 2, 3))))
            t = time.perf_counter()
            out = model(torch.full((rows,), 17), [SeqSpan(s, cache.length(s), 1) for s in range(rows)], cache)
            steps.append(time.perf_counter() - t)
            tokens.append(int(out[-1].argmax()))
    steps.sort()
    return {"caches": os.environ.get(CACHE_VARS[0]), "rss_growth_mb": round(grown, 1),
            "rss_kept_after_trim_mb": round(kept, 1), "prefill_ms": round(prefill_s * 1e3, 2),
            "decode_step_ms_median": round(steps[len(steps) // 2] * 1e3, 3), "tokens": tokens}


def run(size: str, args: argparse.Namespace) -> dict:
    env = {**os.environ, **{v: size for v in CACHE_VARS}}
    cmd = [sys.executable, __file__, "--child", "--lengths", *map(str, args.lengths), "--walk", str(args.walk)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs=3, default=[20, 500, 4], metavar=("FIRST", "END", "STEP"))
    ap.add_argument("--walk", type=int, default=400, help="decode steps of the random walk over batch sizes")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(range(*args.lengths), args.walk)))
        return
    sys.path.insert(0, str(REPO))
    from meshllm.engine import KERNEL_CACHE_SIZE

    n = len(range(*args.lengths))
    print(f"{n} prompt lengths {args.lengths[0]}..{args.lengths[1] - 1}; caches of {TORCH_DEFAULT} "
          f"(torch's default) and {KERNEL_CACHE_SIZE} (meshllm's), one process each", file=sys.stderr)
    theirs, ours = run(TORCH_DEFAULT, args), run(KERNEL_CACHE_SIZE, args)
    same = theirs.pop("tokens") == ours.pop("tokens")
    ratios = {k: round(ours[k] / theirs[k], 3) if theirs[k] else None for k in ours if k != "caches"}
    result = {"lengths": args.lengths, "walk": args.walk, "torch_default": theirs, "meshllm": ours,
              "ratio_meshllm_over_default": ratios, "same_tokens": same}
    if args.json:
        print(json.dumps(result))
        return
    for name, r in (("torch default", theirs), ("meshllm", ours)):
        print(f"{name:>14} ({r['caches']:>4} kernels): grew {r['rss_growth_mb']:7.1f} MB, kept "
              f"{r['rss_kept_after_trim_mb']:7.1f} MB after the trim; prefill {r['prefill_ms']:7.2f} ms, "
              f"decode step (1..64 rows) {r['decode_step_ms_median']:6.3f} ms")
    print("ratios meshllm / default: " + ", ".join(f"{k} {v}" for k, v in ratios.items()))
    print(f"same tokens in both: {same}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
