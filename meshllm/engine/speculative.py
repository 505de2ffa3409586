"""Speculative decoding, the pure parts: verifying a draft block, the committed-prefix hash, the
adaptive draft length, and acceptance statistics. No sockets; the clock is passed in.

Verification of one block (Leviathan et al., lossless): the target ran over
[last committed token, d_1 .. d_g]; row i of its logits predicts the token after d_i.
- greedy: accept d_i while it equals the target's argmax; then emit the target's token (the
  correction, or the bonus when all g are accepted);
- sampled: accept d_i while it equals the target's own draw at its output index (the Gumbel-max
  draw from p, the target's distribution after the request's temperature / top-k / top-p, with
  noise seeded by (request seed, output index): engine/sampling.py); then emit that draw. The
  output is the reference's token for token, whatever was drafted, so a block verified twice
  gives the same answer and the same seed the same text.

The committed prefix hash lets a verifier tell whether a block was drafted after exactly the
tokens committed so far (an asynchronous drafter drafts block k+1 before block k's verdict).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from meshllm.engine.sampling import SamplingParams, margins, probs, verify_greedy, verify_sampled

HASH_MOD = (1 << 61) - 1  # a Mersenne prime: the rolling hash stays in 61 bits (msgpack-friendly)
HASH_BASE = 1_000_003


def extend_hash(h: int, tokens: list[int]) -> int:
    """The hash of a token sequence extended by `tokens` (start from 0 for the empty sequence)."""
    for t in tokens:
        h = (h * HASH_BASE + t + 1) % HASH_MOD
    return h


def verify_block(logits: torch.Tensor, draft: list[int], params: SamplingParams, seed: int,
                 index: int) -> tuple[list[int], list[float]]:
    """logits: (g+1, V) for [last committed, d_1..d_g]. Returns (tokens to commit, margins): the
    accepted draft tokens and then the target's own token. `index` is the output index of d_1."""
    marg = margins(logits).tolist()
    d = torch.tensor(draft, dtype=torch.long)
    if params.greedy:
        n, tok = verify_greedy(d, logits)
    else:
        n, tok = verify_sampled(d, probs(logits, params), seed, index)
    return draft[:n] + [tok], marg[:n + 1]


def expected_tokens(alpha: float, gamma: int) -> float:
    """Mean tokens committed per block of `gamma` drafts when each is accepted with prob. alpha
    (i.i.d. model): 1 + alpha + ... + alpha^gamma."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


ASYNC_OUTSTANDING = 2  # blocks in flight per pipelined (asynchronous) session


def sync_block_s(gamma: int, draft_s: float, verify_s: float, rtt_s: float) -> float:
    """Seconds per block when drafting waits for each verdict: draft, round trip, verification."""
    return gamma * draft_s + rtt_s + verify_s


def pipelined_block_s(alpha: float, gamma: int, draft_s: float, verify_s: float, rtt_s: float,
                      outstanding: int = ASYNC_OUTSTANDING, horizon: int = 200, hit: float | None = None,
                      rescue: float = 0.0) -> float:
    """Mean seconds per block of an asynchronous drafter that drafts ahead of its verdicts.

    After a verdict that breaks the pipeline (a miss) the drafter drafts block 1 from the
    corrected token (gamma steps), then guesses that block's bonus token and drafts block 2 after
    the guess (gamma + 1 steps), and so on, with at most `outstanding` blocks awaiting verdicts.
    A verdict is a hit with h = alpha^(gamma+1) (every draft and the guessed bonus right): the
    block already drafted after it stands. Otherwise the blocks in flight are stale and the
    drafter starts over after the draft step it is in (half a step on average). With s_i the send
    time of block i and V_i its verdict:
        s_1 = gamma * T_d;  s_i = max(s_{i-1}, V_{i-outstanding}) + (gamma + 1) * T_d
        V_i = max(s_i + RTT + T_v, V_{i-1} + T_v)
    An epoch ends at its first miss, block J ~ Geometric(1 - h): (E[V_J] + restart) / E[J].
    `hit`: a measured h instead of the i.i.d. one. `rescue`: the share of the other verdicts whose
    correction a proactive branch had drafted after (roles/drafter.py): its block is already on
    its way, so they count as hits too, h' = h + (1 - h) * rescue."""
    h = max(0.0, min(alpha, 0.999)) ** (gamma + 1) if hit is None else hit
    h = min(0.999, h + (1 - h) * rescue)
    c, w = (gamma + 1) * draft_s, rtt_s + verify_s
    s: list[float] = []
    v: list[float] = []
    e_v, p = 0.0, 1.0
    for i in range(horizon):
        if i == 0:
            s.append(gamma * draft_s)
        else:
            s.append(max(s[-1], v[i - outstanding] if i >= outstanding else 0.0) + c)
        v.append(max(s[-1] + w, v[-1] + verify_s) if v else s[-1] + w)
        e_v += p * (1 - h) * v[-1]
        p *= h
        if p < 1e-6:
            break
    drafting_at_miss = min(1.0, c / max(w, 1e-9))
    return (e_v + drafting_at_miss * draft_s / 2) * (1 - h)


def choose_drafting(alpha: float, draft_s: float, verify_s: float, rtt_s: float, asynchronous: bool,
                    lo: int = 1, hi: int = 12, rescue: float = 0.0) -> tuple[int, bool]:
    """(draft length, pipeline?) that maximise committed tokens per second for one session.

    Synchronous drafting pays drafting, round trip and verification in series. An asynchronous
    session may also draft ahead of its verdicts, but a look-ahead block stands only if the block
    before it is fully accepted and its bonus guessed right, so pipelining pays only when round
    trips are long against drafting and acceptance is high (or when its branches often rescue a
    miss: `rescue`); otherwise the session drafts as a synchronous one would (it stays free to
    pipeline again when its estimates change)."""
    best, best_rate = (lo, False), -1.0
    for g in range(lo, hi + 1):
        e = expected_tokens(alpha, g)
        options = [(sync_block_s(g, draft_s, verify_s, rtt_s), False)]
        if asynchronous:
            options.append((pipelined_block_s(alpha, g, draft_s, verify_s, rtt_s, rescue=rescue), True))
        for secs, pipe in options:
            rate = e / max(secs, 1e-9)
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = (g, pipe), rate
    return best


def choose_gamma(alpha: float, draft_s: float, verify_s: float, rtt_s: float, asynchronous: bool,
                 lo: int = 1, hi: int = 12) -> int:
    """The draft length of `choose_drafting` (grows roughly with log(delay), as in SpecEdge)."""
    return choose_drafting(alpha, draft_s, verify_s, rtt_s, asynchronous, lo, hi)[0]


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
    ahead: int = 0  # verified blocks that arrived before their prefix was committed (look-ahead that stood)
    stale: int = 0  # blocks dropped because their prefix lost (look-ahead that did not stand)

    def record(self, gamma: int, n_accepted: int, ahead: bool = False) -> None:
        self.blocks += 1
        self.ahead += int(ahead)
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
                "gamma_histogram": {str(k): v for k, v in sorted(self.gammas.items())},
                "ahead_blocks": self.ahead, "stale_blocks": self.stale}

    def merge(self, other: dict) -> None:
        """Add another session's `to_json()` (non-negative integers only: anything else raises
        TypeError, ValueError or AttributeError, and bad input is ignored by the caller)."""
        self.drafted += _count(other.get("drafted", 0))
        self.accepted += _count(other.get("accepted", 0))
        self.blocks += _count(other.get("blocks", 0))
        self.ahead += _count(other.get("ahead_blocks", 0))
        self.stale += _count(other.get("stale_blocks", 0))
        for src, dst in ((other.get("per_position", {}), self.per_position), (other.get("offered", {}), self.offered),
                         (other.get("gamma_histogram", {}), self.gammas)):
            for k, v in src.items():
                dst[int(k)] += _count(v)


def _count(v: Any) -> int:
    """A figure of another node's `to_json()`: a float infinity (msgpack carries one) would raise
    OverflowError, which no caller catches, and a negative count would later make a Prometheus
    counter raise in the gateway's close_stream; both are ValueError here."""
    try:
        n = int(v)
    except OverflowError:
        raise ValueError(f"figure {v!r} is not finite") from None
    if n < 0:
        raise ValueError(f"figure {v!r} is negative")
    return n


# -- proactive branches (roles/drafter.py) ----------------------------------------------------------
MIN_BRANCH_SCORE = 0.01  # a branch's estimated chance of being the one that stands
BRANCH_CHOICES = 2  # a branch starts from the draft's 2nd or 3rd choice at a position
Choices = tuple[float, tuple[tuple[int, float], ...]]  # p(drafted token), ((token, p) of the next choices)


def choices(logits: torch.Tensor, drafted: int) -> Choices:
    """The probability of the token drafted from one row, and the draft's next BRANCH_CHOICES
    choices with theirs (never the drafted token itself, whatever order a tie puts it in)."""
    probs = torch.softmax(logits[0].float(), -1)
    top = probs.topk(2 + BRANCH_CHOICES)
    others = [(t, p) for t, p in zip(top.indices.tolist(), top.values.tolist()) if t != drafted]
    return float(probs[drafted]), tuple(others[:BRANCH_CHOICES])


def best_branch(stream: list[Choices], tried, last: int) -> tuple[float, int, int] | None:
    """The most promising branch point of a drafted stream: (score, stream index i, token r) with
    r one of the draft's next choices at i, scored P(every earlier stream token stands) x p(r) from
    the draft's own probabilities; `tried(i, r)` excludes branches already made, `last` is the
    last index with room for a branch's block; None below MIN_BRANCH_SCORE."""
    best, chain = None, 1.0
    for i, (p1, others) in enumerate(stream[:max(0, last + 1)]):
        for r, p in others:
            if chain * p >= MIN_BRANCH_SCORE and (best is None or chain * p > best[0]) and not tried(i, r):
                best = (chain * p, i, r)
        chain *= p1
    return best


def ewma(old: float | None, new: float, weight: float = 0.2) -> float:
    return new if old is None or math.isnan(old) else (1 - weight) * old + weight * new
