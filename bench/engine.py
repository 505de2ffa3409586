"""Engine benchmark: decode speed of the fp32 target and the W4A16 draft, draft quality.

Run:  python bench/engine.py [--tokens 64] [--prompts 8] [--threads 1 2] [--json] [--png FILE]

Prints, in one run on the same machine (ratios, not lone absolute times):
- decode tokens/s of the target (fp32, and bf16 for comparison) and of the W4A16 g64 draft
  at each thread count,
  and of llama.cpp (llama-cpp-python) on the same GGUF file when it is importable;
- the ratios ours / llama.cpp at the same thread count;
- greedy top-1 agreement of the draft with the target over N prompts x T tokens
  (teacher-forced along the target's own greedy continuation).
Decode speed is the median over 3 repeats of T single-token steps after a prefill.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from meshllm.engine.generate import GenerationOptions, decode_one_token, generate, prefill  # noqa: E402
from meshllm.engine.model import SeqSpan  # noqa: E402
from meshllm.engine.tokenizer import load_tokenizer  # noqa: E402
from meshllm.engine.weights import embedded_gguf_path, load_quantized, load_transformer, resolve_model  # noqa: E402

PROMPTS = [
    "The history of the Roman Empire begins with",
    "def quicksort(arr):\n",
    "Photosynthesis is the process by which",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics state that",
    "To bake bread at home, you need",
    "The capital of Japan is Tokyo, and the capital of France is",
    "In machine learning, overfitting happens when",
    "The quick brown fox",
    "Water boils at 100 degrees Celsius because",
]


def ours_decode_tok_s(model, prompt_ids: list[int], n_tokens: int, repeats: int = 3) -> float:
    rates = []
    for _ in range(repeats):
        cache = model.new_cache()
        cache.allocate(0, len(prompt_ids) + n_tokens + 1)
        logits = prefill(model, cache, 0, prompt_ids)
        tok = int(logits.argmax(-1)[0])
        t0 = time.perf_counter()
        for _ in range(n_tokens):
            tok = int(decode_one_token(model, cache, 0, tok).argmax(-1)[0])
        rates.append(n_tokens / (time.perf_counter() - t0))
    return statistics.median(rates)


def llamacpp_decode_tok_s(prompt_ids: list[int], n_tokens: int, threads: int, repeats: int = 3) -> float | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    import numpy as np

    llm = Llama(model_path=str(embedded_gguf_path()), n_threads=threads, n_threads_batch=threads, n_ctx=512,
                verbose=False)
    rates = []
    for _ in range(repeats):
        llm.reset()
        llm.eval(prompt_ids)
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        t0 = time.perf_counter()
        for _ in range(n_tokens):
            llm.eval([tok])
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        rates.append(n_tokens / (time.perf_counter() - t0))
    return statistics.median(rates)


def draft_agreement(target, draft, tok, n_prompts: int, n_tokens: int) -> float:
    agree = total = 0
    for p in PROMPTS[:n_prompts]:
        ids = tok.encode(p)
        cont = generate(target, ids, GenerationOptions(max_tokens=n_tokens)).token_ids
        seq = torch.tensor(ids + cont)
        outs = []
        for m in (target, draft):
            c = m.new_cache()
            c.allocate(0)
            outs.append(m(seq, [SeqSpan(0, 0, len(seq))], c)[len(ids) - 1:-1].argmax(-1))
        agree += int((outs[0] == outs[1]).sum())
        total += len(cont)
    return agree / total


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [("target_fp32_tok_s", "target fp32"), ("target_bf16_tok_s", "target bf16"),
            ("draft_w4a16_tok_s", "draft W4A16 g64"), ("llamacpp_tok_s", "llama.cpp Q4_1")]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / len(keys)
    for j, (k, label) in enumerate(keys):
        xs = [i + j * width for i in range(len(rows))]
        ax.bar(xs, [r.get(k) or 0 for r in rows], width, label=label)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))], [f"{r['threads']} thread(s)" for r in rows])
    ax.set_ylabel("decode tokens/s")
    ax.set_title("SmolLM2-135M decode, one run on this machine (bench/engine.py)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--png", default=None, help="write a bar chart of decode tokens/s to this file")
    a = ap.parse_args()
    tok = load_tokenizer(resolve_model("smollm2-135m"))
    target = load_transformer("smollm2-135m")
    draft = load_quantized(resolve_model("smollm2-135m"), "w4a16", a.group_size)  # as a drafter builds it
    # the "bf16 where that is as fast" option, as `--reference --dtype bfloat16` loads it (a copy
    # of the packed fp32 target cast to bf16 kept its fp32 oneDNN weights: no kernel took both)
    target_bf16 = load_transformer("smollm2-135m", dtype=torch.bfloat16)
    prompt = tok.encode(PROMPTS[0])
    rows = []
    for t in a.threads:
        torch.set_num_threads(t)
        row = {"threads": t, "target_fp32_tok_s": ours_decode_tok_s(target, prompt, a.tokens),
               "target_bf16_tok_s": ours_decode_tok_s(target_bf16, prompt, a.tokens),
               "draft_w4a16_tok_s": ours_decode_tok_s(draft, prompt, a.tokens),
               "llamacpp_tok_s": llamacpp_decode_tok_s(prompt, a.tokens, t)}
        if row["llamacpp_tok_s"]:
            row["target_vs_llamacpp"] = row["target_fp32_tok_s"] / row["llamacpp_tok_s"]
            row["draft_vs_llamacpp"] = row["draft_w4a16_tok_s"] / row["llamacpp_tok_s"]
            row["bf16_vs_llamacpp"] = row["target_bf16_tok_s"] / row["llamacpp_tok_s"]
        rows.append(row)
        print(f"threads={t}: " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                           for k, v in row.items() if k != "threads"), file=sys.stderr)
    torch.set_num_threads(max(a.threads))
    agreement = draft_agreement(target, draft, tok, a.prompts, a.tokens)
    if a.png:
        plot(rows, a.png)
    result = {"decode": rows, "draft_top1_agreement": agreement, "prompts": a.prompts, "tokens": a.tokens,
              "group_size": a.group_size}
    if a.json:
        print(json.dumps(result))
        return
    print(f"{'threads':>7} {'target fp32':>12} {'target bf16':>12} {'draft w4a16':>12} {'llama.cpp':>10} "
          f"{'fp32/lcpp':>10} {'bf16/lcpp':>10} {'draft/lcpp':>11}   (decode tokens/s)")
    nan = float("nan")
    for r in rows:
        lc = r["llamacpp_tok_s"]
        print(f"{r['threads']:>7} {r['target_fp32_tok_s']:>12.1f} {r['target_bf16_tok_s']:>12.1f} "
              f"{r['draft_w4a16_tok_s']:>12.1f} {(f'{lc:.1f}' if lc else 'n/a'):>10} "
              f"{r.get('target_vs_llamacpp', nan):>10.2f} {r.get('bf16_vs_llamacpp', nan):>10.2f} "
              f"{r.get('draft_vs_llamacpp', nan):>11.2f}")
    print(f"draft (W4A16 g{a.group_size}) greedy top-1 agreement with the target: {agreement:.3f} "
          f"over {a.prompts} prompts x {a.tokens} tokens")


if __name__ == "__main__":
    main()
