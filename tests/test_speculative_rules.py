"""The speculative decoding rules, in isolation: block verification (greedy and sampled: the
reference's own tokens whatever was drafted), the target distribution (chi-square at N >= 1e5,
including a two-step Markov model whose rejected second drafts exercise the rollback), the
coupled draft's acceptance, acceptance statistics and the adaptive draft length."""

from __future__ import annotations

import torch
from scipy.stats import chisquare

from meshllm.engine.sampling import SamplingParams, choose_tokens, seeded_token, verify_sampled
from meshllm.engine.speculative import (
    AcceptanceStats,
    choose_drafting,
    choose_gamma,
    expected_tokens,
    extend_hash,
    pipelined_block_s,
    sync_block_s,
    verify_block,
)
from meshllm.mesh.protocol import SpanKind, WireSpan
from meshllm.roles.stage import results_of

GREEDY = SamplingParams()
N = 100_000


def onehot_logits(ids: list[int], vocab: int = 10) -> torch.Tensor:
    """Logits whose argmax at row i is ids[i] (margin 5)."""
    x = torch.zeros(len(ids), vocab)
    x[torch.arange(len(ids)), torch.tensor(ids)] = 5.0
    return x


def test_greedy_all_accepted_gives_the_bonus():
    tokens, marg = verify_block(onehot_logits([3, 4, 5, 6]), [3, 4, 5], GREEDY, 0, 0)
    assert tokens == [3, 4, 5, 6] and len(marg) == 4


def test_greedy_early_rejection_gives_the_correction():
    assert verify_block(onehot_logits([3, 9, 5, 6]), [3, 4, 5], GREEDY, 0, 0)[0] == [3, 9]
    assert verify_block(onehot_logits([7, 4, 5, 6]), [3, 4, 5], GREEDY, 0, 0)[0] == [7]


def test_empty_block_is_a_plain_step():
    assert verify_block(onehot_logits([8]), [], GREEDY, 0, 0)[0] == [8]


def test_mixed_gamma_in_one_batch_matches_one_block_at_a_time():
    """Tenants' blocks of different lengths verified from one ragged batch of logits."""
    blocks = {11: ([3, 4], [3, 4, 1]), 12: ([2, 2, 2, 2], [2, 9, 0, 0, 0]), 13: ([], [6])}
    spans = [WireSpan(seq, 10, len(d) + 1, SpanKind.VERIFY, 5) for seq, (d, _) in blocks.items()]
    logits = torch.cat([onehot_logits(t) for _, t in blocks.values()])
    out = results_of(logits, spans, {seq: d for seq, (d, _) in blocks.items()})
    assert [e[1] for e in out] == [[3, 4, 1], [2, 9], [6]]
    for (seq, (d, t)), e in zip(blocks.items(), out):
        assert e[0] == seq and e[1] == verify_block(onehot_logits(t), d, GREEDY, 0, 5)[0]


def test_sampled_verification_is_reproducible_for_a_seed_and_index():
    logits = torch.randn(4, 10)
    p = SamplingParams(temperature=0.9)
    a = verify_block(logits, [1, 2, 3], p, seed=7, index=12)
    assert a == verify_block(logits, [1, 2, 3], p, seed=7, index=12)


def test_sampled_verification_commits_the_reference_s_tokens_whatever_was_drafted():
    """The rejection rule (accept x with probability min(1, p/q)) is lossless in distribution
    only: ten requests with one seed gave two texts as their drafts differed. A verified block
    now commits exactly what the target alone emits with that seed (choose_tokens, the
    reference's and every last stage's path) along the accepted drafts: for a draft of its
    own draws (all accepted, and the bonus), of the draft's, or of random tokens."""
    gen = torch.Generator().manual_seed(3)
    for trial in range(300):
        g, vocab = 1 + trial % 5, 7 + trial % 40
        params = SamplingParams(temperature=0.7 + (trial % 3) * 0.3, top_k=(0, 5)[trial % 2],
                                top_p=(1.0, 0.9)[trial % 3 == 0])
        logits = torch.randn(g + 1, vocab, generator=gen) * 2
        seed, index = trial * 7919, trial % 50
        own, _ = choose_tokens(logits, params, seed, index)  # row i as if the drafts before it were taken
        for draft in (own[:g], torch.randint(0, vocab, (g,), generator=gen).tolist(),
                      own[:g - 1] + [(own[g - 1] + 1) % vocab]):
            tokens, _ = verify_block(logits, draft, params, seed, index)
            n = len(tokens) - 1
            assert draft[:n] == tokens[:n] == own[:n] and tokens[n] == own[n], (trial, draft, tokens, own)
            assert n == g or draft[n] != own[n]
        assert len(verify_block(logits, own[:g], params, seed, index)[0]) == g + 1  # all taken, and the bonus


def test_the_sampled_rule_outputs_exactly_p():
    """The first committed token follows the target distribution whatever the draft proposes
    (chi-square over N seeds): the Gumbel-max draw is a draw from p."""
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.05, 0.30, 0.25, 0.15, 0.20, 0.05])
    q = torch.tensor([0.30, 0.10, 0.10, 0.30, 0.05, 0.15])
    draws = torch.multinomial(q, N, replacement=True, generator=gen).tolist()
    target = p.repeat(2, 1)
    out = torch.zeros(6)
    for seed, x in enumerate(draws):
        n, tok = verify_sampled(torch.tensor([x]), target, seed, 0)
        out[x if n == 1 else tok] += 1
    assert chisquare(out.numpy(), (p * N).numpy()).pvalue > 1e-3


def test_a_draft_drawn_with_the_target_s_noise_is_accepted_far_more_often():
    """The drafter draws its token with the noise the target draws that index with (the
    Gumbel-max coupling, roles/drafter.py): where q is close to p it proposes the target's own
    draw. Its acceptance is at least (1 - TV) / (1 + TV) and near sum(min(p, q)), well above an
    independent draw's sum(p * q)."""
    gen = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.randn(50, generator=gen) * 2, -1)
    q = torch.softmax(torch.log(p) + 0.5 * torch.randn(50, generator=gen), -1)  # a draft close to the target
    n = 20_000
    coupled = sum(seeded_token(q, s, 4) == seeded_token(p, s, 4) for s in range(n)) / n
    overlap, tv = float(torch.minimum(p, q).sum()), 1 - float(torch.minimum(p, q).sum())
    assert coupled >= (1 - tv) / (1 + tv) - 0.01 and coupled > float((p * q).sum()) + 0.2, (coupled, overlap)


def test_a_two_step_markov_model_keeps_the_target_joint_through_rollbacks():
    """Draft two tokens from a draft chain Q, verify against the target chain P: the committed
    first two tokens must follow P's joint law (rejections at the second draft roll it back)."""
    gen = torch.Generator().manual_seed(1)
    v = 4
    P = torch.softmax(torch.randn(v + 1, v, generator=gen) * 1.5, -1)  # row v: the first token's law
    Q = torch.softmax(torch.randn(v + 1, v, generator=gen) * 1.5, -1)
    counts = torch.zeros(v, v)
    rejected_second = 0
    for seed in range(N):
        d1 = int(torch.multinomial(Q[v], 1, generator=gen))
        d2 = int(torch.multinomial(Q[d1], 1, generator=gen))
        n, tok = verify_sampled(torch.tensor([d1, d2]), torch.stack([P[v], P[d1], P[d2]]), seed, 0)
        seq = [d1, d2][:n] + [tok]
        if len(seq) < 2:  # only the correction committed: the next block starts after it
            seq.append(seeded_token(P[seq[0]], seed, 1))
        rejected_second += n == 1
        counts[seq[0], seq[1]] += 1
    joint = P[v][:, None] * P[:v]
    assert rejected_second > N // 20, "the test must exercise rollbacks after an accepted first draft"
    assert chisquare(counts.flatten().numpy(), (joint.flatten() * N).numpy()).pvalue > 1e-3


def test_acceptance_stats_follow_vllm_definitions():
    st = AcceptanceStats()
    st.record(4, 4)
    st.record(4, 1)
    st.record(2, 0)
    assert st.drafted == 10 and st.accepted == 5 and st.blocks == 3
    assert st.rate == 0.5 and st.mean_length == 1 + 5 / 3
    assert st.per_position[1] == 2 and st.per_position[2] == 1 and st.offered[3] == 2
    merged = AcceptanceStats()
    merged.merge(st.to_json())
    merged.merge(st.to_json())
    assert merged.drafted == 20 and merged.gammas[4] == 4


def test_adaptive_gamma_grows_with_the_delay_and_the_acceptance():
    g = [choose_gamma(0.75, 0.01, 0.02, rtt, asynchronous=False) for rtt in (0.0, 0.02, 0.1, 0.4)]
    assert g == sorted(g) and g[-1] > g[0]
    assert choose_gamma(0.95, 0.01, 0.02, 0.1, False) > choose_gamma(0.3, 0.01, 0.02, 0.1, False)
    assert expected_tokens(0.0, 5) == 1 and expected_tokens(1.0, 5) == 6


def test_async_pipelines_only_when_the_lookahead_pays():
    """The bench's case (alpha 0.71, draft 7.7 ms, verify 13.7 ms, RTT 100 ms): a look-ahead block
    stands with h = alpha^(gamma+1), so the old cost (as if it always stood) climbed to gamma 12,
    which the epoch model prices far above a short draft."""
    alpha, d, v, rtt = 0.71, 0.0077, 0.0137, 0.1
    g, pipe = choose_drafting(alpha, d, v, rtt, asynchronous=True)
    per_token = {gg: pipelined_block_s(alpha, gg, d, v, rtt) / expected_tokens(alpha, gg) for gg in (3, 12)}
    assert per_token[3] < per_token[12]
    assert g <= 6
    # with high acceptance and a long round trip drafting ahead is worth it ...
    assert choose_drafting(0.97, 0.002, 0.01, 0.2, asynchronous=True)[1] is True
    # ... with poor acceptance and no round trip to hide it is not (the look-ahead is nearly
    # always thrown away, and the drafter is mid-step when the verdict comes)
    assert choose_drafting(0.3, 0.0077, 0.0137, 0.0, asynchronous=True)[1] is False
    # a synchronous session never pipelines; h = 1 makes the pipeline's period the drafting time
    assert choose_drafting(0.97, 0.002, 0.01, 0.2, asynchronous=False)[1] is False
    assert pipelined_block_s(0.5, 4, 0.01, 0.0, 0.0, hit=0.0) > sync_block_s(4, 0.01, 0.0, 0.0)


def test_prefix_hash_is_order_sensitive():
    assert extend_hash(0, [1, 2]) != extend_hash(0, [2, 1])
    assert extend_hash(extend_hash(0, [1]), [2]) == extend_hash(0, [1, 2])


def test_branches_that_rescue_broken_verdicts_count_as_hits_and_make_pipelining_pay():
    alpha, g, d, v, rtt = 0.71, 4, 0.093, 0.166, 1.2
    h = alpha ** (g + 1)
    assert pipelined_block_s(alpha, g, d, v, rtt, rescue=0.0) == pipelined_block_s(alpha, g, d, v, rtt)
    assert pipelined_block_s(alpha, g, d, v, rtt, rescue=0.4) == pipelined_block_s(alpha, g, d, v, rtt,
                                                                                  hit=h + (1 - h) * 0.4)
    assert pipelined_block_s(alpha, g, d, v, rtt, rescue=0.4) < 0.85 * pipelined_block_s(alpha, g, d, v, rtt)
    # a round trip about one draft step long: plain pipelining does not pay, rescued verdicts make it pay
    assert choose_drafting(alpha, 0.1, 0.0, 0.12, True)[1] is False
    assert choose_drafting(alpha, 0.1, 0.0, 0.12, True, rescue=0.5)[1] is True


def test_the_best_branch_point_weighs_a_choice_by_the_chance_that_the_stream_reaches_it():
    from meshllm.engine.speculative import best_branch

    stream = [(0.9, ((5, 0.05),)), (0.5, ((6, 0.4), (7, 0.1))), (0.6, ((8, 0.35),))]
    assert best_branch(stream, lambda i, r: False, 10) == (0.9 * 0.4, 1, 6)
    assert best_branch(stream, lambda i, r: (i, r) == (1, 6), 10) == (0.9 * 0.5 * 0.35, 2, 8)
    assert best_branch(stream, lambda i, r: False, 0) == (0.05, 0, 5)  # no room past index 0
    assert best_branch(stream, lambda i, r: False, -1) is None
    assert best_branch([(1.0, ((3, 0.001),))], lambda i, r: False, 5) is None  # below MIN_BRANCH_SCORE
