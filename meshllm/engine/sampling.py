"""Logits -> tokens, and the speculative acceptance rules. Pure functions.

Greedy is argmax (ties -> lowest id, torch's rule). Sampling applies
temperature, then top-k, then top-p, and draws by the Gumbel-max rule,
argmax(log p + G), with the noise G from a torch.Generator seeded from (request
seed, index of the token in the output): `token_generator`. So a token depends
only on its logits, the seed and its index, never on how the tokens before it
were batched, split across stages, drafted or recovered after a failure: the
mesh reproduces the reference's sampled output exactly.

Speculative verification, lossless and identical:
- greedy: accept draft tokens while they equal the target's argmax; the first
  mismatch is replaced by the target's token; if all γ match, the target's
  token after the block is a bonus.
- sampled: the same rule on the target's own seeded draws: accept draft tokens
  while they equal the token the target draws at that index (what it would
  emit without a draft), then emit that draw. The output is the reference's,
  token for token, for every draft. (Rejection sampling, accept x with
  probability min(1, p(x)/q(x)), is lossless only in distribution: the same
  seed gave different text as drafts and their timing differed.) A drafter
  that draws its tokens with the same noise (roles/drafter.py) proposes the
  target's draw wherever its distribution is close: the Gumbel-max coupling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = all
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio multiplier: spreads (seed, index) over 63 bits


def token_generator(seed: int, index: int) -> torch.Generator:
    """The generator for output token `index` of a request seeded with `seed`."""
    return torch.Generator().manual_seed(((seed * _SEED_MIX) ^ (index + 1) * 0xBF58476D1CE4E5B9) % (1 << 63))


TIE = 1e-3  # the identity rule: a first divergence where the reference's margin is below this is a numerical tie


def same_up_to_tie(got: list[int], want: list[int], want_margins: list[float]) -> tuple[bool, str]:
    """The identity rule: equal token lists, or equal up to a first divergence at a numerical
    tie (the reference's top-1 minus top-2 logit there below TIE); and why."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            m = want_margins[i]
            return m < TIE, f"diverged at {i} (margin {m:.2e}): {a} vs {b}"
    if len(got) != len(want):
        return False, f"lengths differ: {len(got)} vs {len(want)}"
    return True, "identical"


def margins(logits: torch.Tensor) -> torch.Tensor:
    """Top-1 minus top-2 logit per row: (R, V) -> (R,). The evidence for numerical ties."""
    top2 = logits.float().topk(2, dim=-1).values
    return top2[..., 0] - top2[..., 1]


def probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """(R, V) logits -> (R, V) probabilities after temperature, top-k and top-p."""
    x = logits.float() / max(p.temperature, 1e-6)
    if p.top_k and p.top_k < x.shape[-1]:
        kth = x.topk(p.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, idx = x.sort(dim=-1, descending=True)
        cum = sorted_x.softmax(-1).cumsum(-1)
        drop = cum - sorted_x.softmax(-1) >= p.top_p  # keep the smallest prefix reaching top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(-1, idx, sorted_x)
    return x.softmax(-1)


def gumbel(shape: tuple[int, ...], gen: torch.Generator | None) -> torch.Tensor:
    """Standard Gumbel noise, -log(-log U): argmax(log p + G) is a draw from p."""
    return -torch.log(-torch.log(torch.rand(shape, generator=gen)))


def gumbel_max(prob: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    """(R, V) probabilities -> (R,) draws, argmax(log p + G) with the noise from `gen`."""
    return (prob.log() + gumbel(tuple(prob.shape), gen)).argmax(-1)


def sample(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None = None) -> torch.Tensor:
    """(R, V) -> (R,) token ids (sampled: the Gumbel-max draw, noise from `gen`)."""
    return logits.argmax(-1) if p.greedy else gumbel_max(probs(logits, p), gen)


def seeded_token(prob: torch.Tensor, seed: int, index: int) -> int:
    """(V,) probabilities -> output token `index` of a request seeded `seed`: the one draw of
    the reference (choose_tokens), of every last stage and of the sampled verification."""
    return int(gumbel_max(prob[None], token_generator(seed, index))[0])


def verify_greedy(draft: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """draft: (γ,) ids; target_logits: (γ+1, V), row i predicts the token after draft[:i].

    Returns (n_accepted, next_token): the output extends by draft[:n_accepted] + [next_token].
    """
    tgt = target_logits.argmax(-1)
    match = (tgt[: draft.shape[0]] == draft).int()
    n = int(match.cumprod(0).sum())
    return n, int(tgt[n])


def verify_sampled(draft: torch.Tensor, target_probs: torch.Tensor, seed: int, index: int) -> tuple[int, int]:
    """draft: (γ,) ids of output tokens index .. index+γ-1; target_probs: (γ+1, V), row i the
    target's distribution after draft[:i]. Returns (n_accepted, next_token): the drafts that
    equal the target's own seeded draws, then its draw at the first one that does not (or the
    bonus after all γ), so the output extends exactly as the reference's does."""
    g = draft.shape[0]
    for i in range(g):
        tok = seeded_token(target_probs[i], seed, index + i)
        if tok != int(draft[i]):
            return i, tok
    return g, seeded_token(target_probs[g], seed, index + g)


def greedy_tokens(logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """(R, V) logits -> (argmax, margin) per row, from one top-2 pass (this sits on the critical
    path of every decode step). Where the top two are equal (a tie) or the row is not finite, the
    token is argmax's, so ties still go to the lowest id. A margin that is not finite means a row
    with NaN or infinity at its top."""
    values, ids = logits.float().topk(2, dim=-1)
    marg = (values[:, 0] - values[:, 1]).tolist()
    toks = ids[:, 0].tolist()
    for r, m in enumerate(marg):
        if not m > 0:
            toks[r] = int(logits[r].argmax())
    return toks, marg


def choose_tokens(logits: torch.Tensor, p: SamplingParams, seed: int, first_index: int) -> tuple[list[int], list[float]]:
    """(R, V) logits of consecutive output positions -> (tokens, margins); row i is output token
    `first_index + i`, sampled with its own generator. The one sampling path of the reference and
    of every last stage of the mesh."""
    if p.greedy:
        return greedy_tokens(logits)
    marg, pr = margins(logits).tolist(), probs(logits, p)
    return [seeded_token(pr[i], seed, first_index + i) for i in range(logits.shape[0])], marg
