"""Decode-step benchmark: what one forward of n one-token rows costs against one row, on one core.

Run:  python bench/decode_step.py [--steps 16] [--rounds 3] [--profile] [--hints dense 1 8 16 32 64]

This is the in-process ceiling of batched decode (bench/pipeline.py (b) prints the same ratio
for 64 steps beside the mesh's): n x t(1 row) / t(n rows). Printed for n = 8 and 32, in
alternating rounds of
- "batched": one-token fp32 rows attend through their K/V slab (`KVCache.decode_slab`, the
  engine's path);
- "per-span": the same forward with each row attending through `attend` one span at a time
  (the path the slab replaced for such rows; the values are bit-identical, tests/test_model.py).
With --profile, the torch profiler's top ops of 8-row steps on the batched path (where the
time goes: on the CPUs measured so far, the linear layers).
With --hints, the same step times for each weight layout of the linear layers on a randomly
initialised model of the same shape: "dense" (plain nn.Linear, MKL) or `PackedLinear` packed by
oneDNN for the row count given (the engine uses `PACK_BATCH_HINT`), 2 rounds of 8 steps each.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from meshllm.engine import model as engine_model  # noqa: E402
from meshllm.engine.model import SeqSpan, Transformer  # noqa: E402
from meshllm.engine.weights import load_transformer  # noqa: E402
from meshllm.shapes import model_args  # noqa: E402

PROMPT = list(range(100, 114))  # 14 token ids: every row starts from the same short prompt
ROWS = (1, 8, 32)


def step_ms(model, n: int, steps: int) -> float:
    """Mean ms of `steps` greedy one-token forwards of n sequences (after one warm-up step)."""
    cache, toks = model.new_cache(), []
    for s in range(n):
        cache.allocate(s, len(PROMPT) + steps + 2)
        toks.append(int(model(torch.tensor(PROMPT), [SeqSpan(s, 0, len(PROMPT))], cache)[-1].argmax()))
    for i in range(steps + 1):
        if i == 1:
            t0 = time.perf_counter()
        x = model(torch.tensor(toks), [SeqSpan(s, cache.length(s), 1) for s in range(n)], cache)
        toks = x.argmax(-1).tolist()
    return 1000 * (time.perf_counter() - t0) / steps


def per_span_context():
    """Transformer._context without the K/V slabs: every row attends through `attend`."""
    batched = engine_model.Transformer._context

    def context(self, spans, cache):
        ctx = batched(self, spans, cache)
        ctx.slabs = [None] * len(spans)
        return ctx

    return batched, context


def hint_sweep(hints: list[str]) -> None:
    """Step times of each weight layout, on random weights of SmolLM2-135M's shape."""
    torch.manual_seed(0)
    base = Transformer(model_args("smollm2-135m")).eval().requires_grad_(False)
    for hint in hints:
        model = copy.deepcopy(base)
        if hint != "dense":
            engine_model.PACK_BATCH_HINT = int(hint)
            engine_model.pack_linear_weights(model)
        med = {n: statistics.median(step_ms(model, n, 8) for _ in range(2)) for n in ROWS}
        print(f"layout {hint:>5}: step ms " + ", ".join(f"{n} rows {med[n]:.1f}" for n in ROWS)
              + "; one forward of n rows does the work of " + ", ".join(
                  f"{n * med[1] / med[n]:.2f} (n={n})" for n in ROWS[1:]) + " forwards of 1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--hints", nargs="*", default=None, metavar="LAYOUT",
                    help="also sweep the linear layers' weight layout: dense, or a oneDNN row hint")
    a = ap.parse_args()
    torch.set_num_threads(1)
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, one thread on one core")
    model = load_transformer("smollm2-135m")
    batched, per_span = per_span_context()
    times: dict[str, dict[int, list[float]]] = {"batched": {n: [] for n in ROWS}, "per-span": {n: [] for n in ROWS}}
    for _ in range(a.rounds):
        for name, ctx in (("batched", batched), ("per-span", per_span)):
            engine_model.Transformer._context = ctx
            for n in ROWS:
                times[name][n].append(step_ms(model, n, a.steps))
    engine_model.Transformer._context = batched
    for name, t in times.items():
        med = {n: statistics.median(v) for n, v in t.items()}
        print(f"{name:>9}: step ms " + ", ".join(f"{n} rows {med[n]:.1f}" for n in ROWS)
              + "; one forward of n rows does the work of " + ", ".join(
                  f"{n * med[1] / med[n]:.2f} (n={n})" for n in ROWS[1:]) + " forwards of 1")
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as p:
            step_ms(model, 8, a.steps // 2)
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=10))
    if a.hints:
        hint_sweep(a.hints)


if __name__ == "__main__":
    main()
