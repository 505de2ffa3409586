"""Pure tests of sampling and the speculative acceptance rules."""

from __future__ import annotations

import math

import pytest
import torch

from meshllm.engine.sampling import (
    SamplingParams,
    greedy_tokens,
    margins,
    probs,
    sample,
    verify_greedy,
    verify_sampled,
)


def test_greedy_and_margins():
    lg = torch.tensor([[1.0, 3.0, 2.5], [0.0, -1.0, 4.0]])
    assert sample(lg, SamplingParams()).tolist() == [1, 2]
    torch.testing.assert_close(margins(lg), torch.tensor([0.5, 4.0]))


def test_greedy_tokens_from_one_top2_pass_equal_argmax_and_margins():
    g = torch.Generator().manual_seed(0)
    lg = torch.randn(64, 49152, generator=g)
    lg[3, 7] = lg[3, 11] = lg[3].max() + 1  # an exact tie: argmax's lowest id, margin 0
    toks, marg = greedy_tokens(lg)
    assert toks == lg.argmax(-1).tolist() and toks[3] == 7 and marg[3] == 0.0
    assert marg == margins(lg).tolist()
    bad = torch.zeros(3, 10)
    bad[0, 4], bad[1, 2], bad[2, 5] = float("nan"), float("inf"), float("-inf")
    _, m = greedy_tokens(bad)
    assert not math.isfinite(m[0]) and not math.isfinite(m[1]), "NaN or +inf at the top shows in the margin"
    assert m[2] == 0.0, "a -inf that is not at the top changes nothing"


def test_seeded_sampling_is_deterministic_and_respects_top_k_top_p():
    lg = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=0.8, top_k=5)
    a = [int(sample(lg, p, torch.Generator().manual_seed(7))) for _ in range(3)]
    assert len(set(a)) == 1
    top5 = set(lg.topk(5).indices[0].tolist())
    g = torch.Generator().manual_seed(1)
    assert all(int(sample(lg, p, g)) in top5 for _ in range(200))
    pr = probs(lg, SamplingParams(temperature=1.0, top_p=0.5))[0]
    kept = (pr > 0).sum().item()
    sorted_p = lg.softmax(-1)[0].sort(descending=True).values
    need = int((sorted_p.cumsum(0) < 0.5).sum()) + 1
    assert kept == need
    torch.testing.assert_close(pr.sum(), torch.tensor(1.0))


def test_verify_greedy():
    V = 10
    tgt = torch.full((4, V), -5.0)
    for i, t in enumerate([3, 4, 7, 9]):
        tgt[i, t] = 5.0
    assert verify_greedy(torch.tensor([3, 4, 7]), tgt) == (3, 9)  # all accepted + bonus
    assert verify_greedy(torch.tensor([3, 5, 7]), tgt) == (1, 4)  # correction at the first mismatch
    assert verify_greedy(torch.tensor([0, 4, 7]), tgt) == (0, 3)


def test_verify_sampled_is_lossless_in_distribution():
    """The first emitted token follows the target distribution p whatever the draft is."""
    V = 4
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([0.7, 0.1, 0.1, 0.1])
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(V)
    n = 20000
    for seed in range(n):
        x = torch.multinomial(q, 1, generator=g)
        k, nxt = verify_sampled(x, p, seed, 0)
        counts[int(x[0]) if k == 1 else nxt] += 1
    freq = counts / n
    assert (freq - p[0]).abs().max() < 0.015, freq


def test_a_sampled_token_is_the_gumbel_max_draw_of_its_seed_and_index():
    """sample() for one row and seeded_token() are the one draw (the reference's, the last
    stage's, the verifier's): argmax(log p + G) with G from token_generator(seed, index)."""
    from meshllm.engine.sampling import choose_tokens, gumbel, seeded_token, token_generator

    lg = torch.randn(3, 30, generator=torch.Generator().manual_seed(2))
    p = SamplingParams(temperature=0.8, top_p=0.95)
    pr = probs(lg, p)
    toks, _ = choose_tokens(lg, p, 11, 5)
    for i in range(3):
        want = int((pr[i].log() + gumbel((1, 30), token_generator(11, 5 + i))[0]).argmax())
        assert toks[i] == seeded_token(pr[i], 11, 5 + i) == want == int(sample(lg[i:i + 1], p, token_generator(11, 5 + i)))
        assert pr[i, want] > 0


def test_token_generator_depends_only_on_seed_and_index():
    from meshllm.engine.sampling import token_generator

    draw = lambda s, i: torch.rand(4, generator=token_generator(s, i))  # noqa: E731
    assert torch.equal(draw(7, 3), draw(7, 3))
    assert not torch.equal(draw(7, 3), draw(7, 4)) and not torch.equal(draw(7, 3), draw(8, 3))
    assert not torch.equal(draw(0, 0), draw(1, 0))


def test_the_identity_rule_tells_a_short_or_long_output_from_the_reference():
    """`same_up_to_tie` is the oracle of every end-to-end identity test: a mesh output that stops
    early or runs on, equal as far as it goes, must not pass as identical."""
    from meshllm.engine.sampling import same_up_to_tie

    want, margins_ = [5, 6, 7], [1.0, 1.0, 1.0]
    assert same_up_to_tie([5, 6, 7], want, margins_) == (True, "identical")
    assert same_up_to_tie([5, 6], want, margins_) == (False, "lengths differ: 2 vs 3")
    assert same_up_to_tie([5, 6, 7, 8], want, margins_) == (False, "lengths differ: 4 vs 3")
    assert same_up_to_tie([], want, margins_)[0] is False
    assert same_up_to_tie([5, 9], want, [1.0, 5e-4, 1.0])[0]  # a divergence at a numerical tie
    assert not same_up_to_tie([5, 9], want, [1.0, 2e-3, 1.0])[0]


def test_top_k_keeps_exactly_k_tokens_and_top_p_the_smallest_prefix_reaching_it():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])
    for k in range(1, 6):
        pr = probs(logits, SamplingParams(1.0, k, 1.0))
        assert (pr > 0).sum().item() == k and torch.isclose(pr.sum(), torch.tensor(1.0)), (k, pr)
        assert (pr[0, :k] > 0).all()  # the k largest
    one = probs(logits, SamplingParams(1.0, 1, 1.0))
    assert one[0, 0].item() == 1.0
    soft = logits.softmax(-1)[0]
    for n in range(1, 6):  # top_p just above the mass of the first n: those n and no more
        pr = probs(logits, SamplingParams(1.0, 0, float(soft[:n].sum()) + 1e-4 if n < 6 else 1.0))
        assert (pr > 0).sum().item() == min(6, n + 1), (n, pr)
    assert (probs(logits, SamplingParams(1.0, 0, 1e-9)) > 0).sum().item() == 1  # the top token, never none


def test_the_prefix_hash_counts_token_0_and_a_count_of_minus_one_is_refused():
    """Token 0 is a real token: a prefix with it hashes apart from one without. And a negative
    figure from another node is refused, -1 as much as -3."""
    from meshllm.engine.speculative import _count, extend_hash

    assert extend_hash(0, [0]) != 0 and extend_hash(0, [0, 5]) != extend_hash(0, [5])
    assert extend_hash(extend_hash(0, [3]), [0, 0]) == extend_hash(0, [3, 0, 0]) != extend_hash(0, [3, 0])
    assert _count(0) == 0 and _count(7.0) == 7
    for bad in (-1, -3, float("inf")):
        with pytest.raises(ValueError):
            _count(bad)
