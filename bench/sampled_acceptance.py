"""Sampled speculative decoding: how often the verifier takes a draft token, per rule (in process).

Run:  python bench/sampled_acceptance.py [--prompts 8] [--tokens 48] [--seeds 32] [--out bench/results]

The mesh verifies a sampled block by the rule of engine/sampling.py: a draft token stands only
where it equals the target's own draw at its output index (Gumbel-max, noise seeded by the
request's seed and the index), so the output is `--reference --seed S`'s token for token. The
drafter draws its tokens with that same noise (roles/drafter.py, the Gumbel-max coupling). This
script measures, along the target's sampled output for several prompts and temperatures, with
p the target's distribution and q the W4A16 g64 draft's (its 32 most likely tokens, as the
drafter draws among them), the per-token acceptance of:
  - rejection sampling (accept x with probability min(1, p(x)/q(x))): sum(min(p, q)) in
    expectation; lossless in distribution only (the same seed gives other text as drafts differ);
  - the exact-match rule with a coupled draft (what the mesh does): the share of (position, seed)
    pairs where the draft's draw and the target's draw, with the same noise, agree;
  - the exact-match rule with an independent draft draw: sum(p * q) in expectation (why the
    drafter shares the noise).
Writes the table to OUT/sampled_acceptance.txt.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = "smollm2-135m"
PROMPTS = ["Once upon a time", "The history of the Roman Empire begins with", "def quicksort(arr):\n",
           "Photosynthesis is the process by which", "My favourite recipe for a rainy day is",
           "The three laws of motion say that", "Dear team, this week we", "In the year 2050, cities will"]
TEMPERATURES = (0.6, 0.8, 1.0)
Q_TOP_K = 32  # as roles/drafter.py


def measure(n_prompts: int, n_tokens: int, n_seeds: int) -> dict:
    import torch

    from meshllm.engine.generate import GenerationOptions, generate
    from meshllm.engine.model import SeqSpan
    from meshllm.engine.quant import quantize_model
    from meshllm.engine.sampling import SamplingParams, gumbel, probs, token_generator
    from meshllm.engine.tokenizer import load_tokenizer
    from meshllm.engine.weights import load_transformer, resolve_model

    torch.set_num_threads(1)
    target = load_transformer(MODEL)
    draft = quantize_model(copy.deepcopy(target), "w4a16", 64)
    tok = load_tokenizer(resolve_model(MODEL))
    out = {}
    for temp in TEMPERATURES:
        params = SamplingParams(temperature=temp)
        rej = coupled = indep = 0.0
        positions = 0
        for k, prompt in enumerate(PROMPTS[:n_prompts]):
            ids = tok.encode(prompt)
            seq = generate(target, ids, GenerationOptions(max_tokens=n_tokens, temperature=temp, seed=k)).token_ids
            full = torch.tensor(ids + seq)
            rows = torch.arange(len(ids) - 1, len(ids) + len(seq) - 1)  # row r predicts output token r - len(ids) + 1
            with torch.inference_mode():
                tc, dc = target.new_cache(), draft.new_cache()
                tc.allocate(0, len(full))
                dc.allocate(0, len(full))
                p_all = probs(target(full, [SeqSpan(0, 0, len(full))], tc, logits_rows=rows), params)
                q_all = probs(draft(full, [SeqSpan(0, 0, len(full))], dc, logits_rows=rows), params)
            for i in range(len(seq)):
                p, q = p_all[i], q_all[i]
                top = q.topk(Q_TOP_K)
                qt = torch.zeros_like(q).scatter_(0, top.indices, top.values / top.values.sum())
                rej += float(torch.minimum(p, qt).sum())
                indep += float((p * qt).sum())
                for s in range(n_seeds):
                    g = gumbel((1, p.shape[-1]), token_generator(s, i))[0]
                    want = int((p.log() + g).argmax())
                    got = int(top.indices[int((qt[top.indices].log() + g[top.indices]).argmax())])
                    coupled += (got == want) / n_seeds
                positions += 1
        out[temp] = {"positions": positions, "rejection": rej / positions, "coupled": coupled / positions,
                     "independent": indep / positions}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--seeds", type=int, default=32, help="noise draws per position for the coupled rule")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args()
    t0 = time.time()
    res = measure(a.prompts, a.tokens, a.seeds)
    lines = [f"# python bench/sampled_acceptance.py --prompts {a.prompts} --tokens {a.tokens} --seeds {a.seeds}",
             f"# {MODEL} fp32 target, W4A16 g64 draft (its top {Q_TOP_K}); per-token acceptance along the "
             "target's sampled output",
             "temperature  positions  rejection sum(min(p,q))  exact match, coupled draft  exact match, independent draft"]
    for temp, r in res.items():
        lines.append(f"{temp:11.1f}  {r['positions']:9d}  {r['rejection']:23.3f}  {r['coupled']:26.3f}  "
                     f"{r['independent']:30.3f}")
    lines.append(f"# {time.time() - t0:.0f} s")
    text = "\n".join(lines)
    print(text)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sampled_acceptance.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
