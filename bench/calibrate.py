"""Calibrate the cost model's efficiency factors against this machine.

Run:  python bench/calibrate.py [--threads 1]

Measures what torch achieves on this CPU for the two roofline terms of cost.py:
- compute: a square fp32 matmul, and the seven projections of one SmolLM2-1.7B-shaped layer
  (dim 2048, FFN 8192) over a 512-token prompt (the prefill regime), in GFLOP/s, as a
  fraction of the nominal peak (clock x FLOP/cycle; 32 fp32 FLOP/cycle = two 256-bit FMA
  pipes; pass --ghz / --flop-per-cycle for another machine);
- bandwidth: a large tensor copy (read + write) and the same layer at batch 1 (the decode
  regime: every weight read once), in GB/s; the decode figure over the copy figure is the
  fraction of achievable bandwidth a matvec-bound layer gets.
See meshllm/partition/cost.py's docstring for how these set COMPUTE_EFFICIENCY and
BANDWIDTH_EFFICIENCY (measured here: 0.78 of the 3.7 GHz boost peak for a layer's prefill on
an idle core, ~0.4 when the box is shared; decode at 0.55-0.58 of the copy rate).
"""

from __future__ import annotations

import argparse
import sys
import time

FLOP_PER_CYCLE_FP32 = 32  # 2 FMA pipes x 8 fp32 lanes x 2 FLOP
MATMUL_N = 1024
LAYER_DIM, LAYER_FFN, PROMPT = 2048, 8192, 512  # SmolLM2-1.7B layer shape, prompt tokens
COPY_BYTES = 256 * 2**20
REPEATS = 10


def best_of(fn, repeats: int = REPEATS) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def layer_rates(torch) -> tuple[float, float]:
    """(GFLOP/s over a prompt, GB/s of weights at batch 1) for one layer's projections."""
    d, f = LAYER_DIM, LAYER_FFN
    ws = [torch.randn(d, d) for _ in range(4)] + [torch.randn(f, d), torch.randn(f, d), torch.randn(d, f)]
    params = sum(w.numel() for w in ws)

    def run(x):
        for w in ws[:4]:
            torch.nn.functional.linear(x, w)
        h = torch.nn.functional.linear(x, ws[4]) * torch.nn.functional.linear(x, ws[5])
        torch.nn.functional.linear(h, ws[6])

    prompt, one = torch.randn(PROMPT, d), torch.randn(1, d)
    t_prompt = best_of(lambda: run(prompt), 3)
    t_one = best_of(lambda: run(one), 5)
    return 2 * params * PROMPT / t_prompt / 1e9, 4 * params / t_one / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ghz", type=float, default=None, help="clock for the peak (default: psutil)")
    ap.add_argument("--flop-per-cycle", type=int, default=FLOP_PER_CYCLE_FP32)
    a = ap.parse_args()
    import psutil
    import torch

    torch.set_num_threads(a.threads)
    x, y = torch.randn(MATMUL_N, MATMUL_N), torch.randn(MATMUL_N, MATMUL_N)
    gflops = 2 * MATMUL_N ** 3 / best_of(lambda: x @ y) / 1e9
    src = torch.empty(COPY_BYTES // 4)
    dst = torch.empty_like(src)
    gbps = 2 * COPY_BYTES / best_of(lambda: dst.copy_(src)) / 1e9
    layer_gflops, layer_gbps = layer_rates(torch)
    freq = psutil.cpu_freq()
    ghz = a.ghz or ((freq.max or freq.current) / 1000 if freq else float("nan"))
    peak = a.threads * ghz * a.flop_per_cycle
    print(f"threads {a.threads}, clock {ghz:.2f} GHz, fp32 peak {peak:.1f} GFLOP/s")
    print(f"matmul {MATMUL_N}^2 fp32: {gflops:.1f} GFLOP/s = {gflops / peak:.2f} of peak")
    print(f"layer prefill ({PROMPT} tokens): {layer_gflops:.1f} GFLOP/s = {layer_gflops / peak:.2f} of peak")
    print(f"copy {COPY_BYTES >> 20} MiB: {gbps:.1f} GB/s read+write")
    print(f"layer decode (batch 1): {layer_gbps:.1f} GB/s of weights = {layer_gbps / gbps:.2f} of the copy rate")
    return 0


if __name__ == "__main__":
    sys.exit(main())
