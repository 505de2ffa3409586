"""Speculative decoding, the pure parts: verifying a draft block, the committed-prefix hash, the
adaptive draft length, and acceptance statistics. No sockets; the clock is passed in.

Verification of one block (Leviathan et al., lossless): the target ran over
[last committed token, d_1 .. d_g]; row i of its logits predicts the token after d_i.
- greedy: accept d_i while it equals the target's argmax; then emit the target's token (the
  correction, or the bonus when all g are accepted);
- sampled: accept d_i with probability min(1, p(d_i) / q(d_i)); on rejection emit a sample of
  norm(max(0, p - q)); after g acceptances a sample of p. q is the draft's distribution, sent
  sparsely (the drafter samples from that same truncated q, so the rule stays exact), p the
  target's after the request's temperature / top-k / top-p. The draws are seeded by (request
  seed, output index of the block), so a block verified twice gives the same answer.

The committed prefix hash lets a verifier tell whether a block was drafted after exactly the
tokens committed so far (an asynchronous drafter drafts block k+1 before block k's verdict).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import torch

from meshllm.engine.sampling import (
    SamplingParams,
    margins,
    probs,
    token_generator,
    verify_greedy,
    verify_sampled,
)

HASH_MOD = (1 << 61) - 1  # a Mersenne prime: the rolling hash stays in 61 bits (msgpack-friendly)
HASH_BASE = 1_000_003
VERIFY_SALT = 0x5EED  # verification draws use their own generators (not the plain sampling ones)


def extend_hash(h: int, tokens: list[int]) -> int:
    """The hash of a token sequence extended by `tokens` (start from 0 for the empty sequence)."""
    for t in tokens:
        h = (h * HASH_BASE + t + 1) % HASH_MOD
    return h


def dense_q(ids: torch.Tensor, p: torch.Tensor, vocab: int) -> torch.Tensor:
    """Sparse draft distributions (g, K) ids + probs -> dense (g, vocab)."""
    q = torch.zeros(ids.shape[0], vocab, dtype=torch.float32)
    return q.scatter_(1, ids.long(), p.float())


def verify_block(logits: torch.Tensor, draft: list[int], params: SamplingParams, seed: int, index: int,
                 q_ids: torch.Tensor | None = None, q_p: torch.Tensor | None = None) -> tuple[list[int], list[float]]:
    """logits: (g+1, V) for [last committed, d_1..d_g]. Returns (tokens to commit, margins): the
    accepted draft tokens and then the target's own token. `index` is the output index of d_1."""
    marg = margins(logits).tolist()
    d = torch.tensor(draft, dtype=torch.long)
    if params.greedy:
        n, tok = verify_greedy(d, logits)
    else:
        gen = token_generator(seed ^ VERIFY_SALT, index)
        q = dense_q(q_ids, q_p, logits.shape[-1])
        n, tok = verify_sampled(d, q, probs(logits, params), gen)
    return draft[:n] + [tok], marg[:n + 1]


def expected_tokens(alpha: float, gamma: int) -> float:
    """Mean tokens committed per block of `gamma` drafts when each is accepted with prob. alpha
    (i.i.d. model): 1 + alpha + ... + alpha^gamma."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def choose_gamma(alpha: float, draft_s: float, verify_s: float, rtt_s: float, asynchronous: bool,
                 lo: int = 1, hi: int = 12) -> int:
    """The draft length that maximises committed tokens per second for one session.

    Per block: drafting takes gamma * draft_s; the block then needs the round trip and the
    verification. Synchronous drafting pays all of it in series; an asynchronous drafter drafts
    the next block meanwhile, so a block costs the longer of the two (the next block is wasted
    unless this one is fully accepted, which the expected-token count already discounts). The
    optimum grows roughly with log(delay) (SpecEdge / recent work)."""
    best, best_rate = lo, -1.0
    for g in range(lo, hi + 1):
        wait = rtt_s + verify_s
        per_block = g * draft_s + wait if not asynchronous else max(g * draft_s, wait) + draft_s
        rate = expected_tokens(alpha, g) / max(per_block, 1e-9)
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = g, rate
    return best


@dataclass
class AcceptanceStats:
    """Drafted / accepted counts, per-position acceptance and the gamma histogram of one session
    (or of a whole verifier: `merge`)."""

    drafted: int = 0
    accepted: int = 0
    blocks: int = 0
    per_position: Counter = field(default_factory=Counter)  # position i -> blocks accepting d_i
    offered: Counter = field(default_factory=Counter)  # position i -> blocks that drafted a d_i
    gammas: Counter = field(default_factory=Counter)

    def record(self, gamma: int, n_accepted: int) -> None:
        self.blocks += 1
        self.drafted += gamma
        self.accepted += n_accepted
        self.gammas[gamma] += 1
        for i in range(gamma):
            self.offered[i + 1] += 1
            if i < n_accepted:
                self.per_position[i + 1] += 1

    @property
    def rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_length(self) -> float | None:
        """vLLM's mean acceptance length: 1 + accepted / blocks (tokens per verification)."""
        return 1 + self.accepted / self.blocks if self.blocks else None

    def to_json(self) -> dict:
        return {"drafted": self.drafted, "accepted": self.accepted, "blocks": self.blocks,
                "per_position": {str(k): self.per_position[k] for k in sorted(self.offered)},
                "offered": {str(k): self.offered[k] for k in sorted(self.offered)},
                "gamma_histogram": {str(k): v for k, v in sorted(self.gammas.items())}}

    def merge(self, other: dict) -> None:
        """Add another session's `to_json()` (integers only; bad input is ignored by the caller)."""
        self.drafted += int(other.get("drafted", 0))
        self.accepted += int(other.get("accepted", 0))
        self.blocks += int(other.get("blocks", 0))
        for src, dst in ((other.get("per_position", {}), self.per_position), (other.get("offered", {}), self.offered),
                         (other.get("gamma_histogram", {}), self.gammas)):
            for k, v in src.items():
                dst[int(k)] += int(v)


def ewma(old: float | None, new: float, weight: float = 0.2) -> float:
    return new if old is None or math.isnan(old) else (1 - weight) * old + weight * new
