"""Scheduling rules of speculative serving, on the real classes with a tiny random model: which
rows a shared draft server steps, what the drafter reports, what a request's last block counts
and which tenant's block a one-block-per-forward verifier takes first."""

from __future__ import annotations

import math

import torch

from meshllm.engine.model import SeqSpan, Transformer
from meshllm.engine.sampling import SamplingParams
from meshllm.engine.speculative import AcceptanceStats
from meshllm.roles.batcher import Seq
from meshllm.roles.branches import Branch
from meshllm.roles.drafter import Drafter, OutBlock, Session
from meshllm.roles.leader import block_counts, kept
from meshllm.roles.pacer import Pacer
from meshllm.roles.verifier import Block, Verifier
from meshllm.shapes import ModelArgs

ARGS = ModelArgs(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=50, hidden_dim=64, max_seq_len=64)


def drafter(pacer: Pacer | None = None) -> Drafter:
    torch.manual_seed(0)
    return Drafter("edge", Transformer(ARGS), lambda *a: None, lambda *a: None, pacer)


def session(seq: int, blocks: int) -> Session:
    s = Session(seq, [1, 2, 3], 32, SamplingParams(), 0, 1, 4, False, "async", "gw")
    s.started, s.fed = True, 3
    s.blocks = [OutBlock(i, 3, 0, [5] * 4, [], 0.0) for i in range(blocks)]
    return s


def rows(sessions: list[Session]) -> list[tuple[Session, None]]:
    return [(s, None) for s in sessions]


def test_lookahead_rows_wait_when_they_would_slow_the_committed_rows():
    d = drafter()
    first, ahead = [session(i, 0) for i in range(2)], [session(10 + i, 1) for i in range(3)]
    # nothing measured yet: every row rides (and the step times are learnt)
    assert d._rows(first + ahead, []) == rows(first + ahead)
    # a compute-bound draft server: 3 rows cost 1.8x two rows; look-ahead rows are deferred
    d.step_s = {2: 0.10, 3: 0.18, 4: 0.25, 5: 0.33}
    assert d._rows(ahead + first, []) == rows(first)
    assert d.stats["lookahead_deferred"] == 3
    # a weight-bound one: a few more rows are nearly free, so they ride
    d.step_s = {2: 0.10, 3: 0.102, 4: 0.105, 5: 0.2}
    assert d._rows(first + ahead, []) == rows(first + ahead[:2])
    # no committed-prefix rows waiting: the look-ahead has the server to itself
    assert d._rows(ahead, []) == rows(ahead)


def test_branch_rows_ride_after_the_lookahead_most_promising_first_within_the_slack():
    d = drafter()
    ahead = [session(10 + i, 1) for i in range(2)]
    low, high = (Branch(-1, [1, 2, 3, 9], 4, 3, 0.05, 4), Branch(-2, [1, 2, 3, 8], 4, 3, 0.4, 4))
    branches = [(ahead[0], low), (ahead[1], high)]
    d.step_s = {1: 0.10, 2: 0.10, 3: 0.104, 4: 0.18}
    assert d._rows(ahead, branches) == rows(ahead) + [(ahead[1], high)]
    # a lone session waiting for its verdicts: its branches use the room of a one-row step
    d.step_s = {1: 0.10, 2: 0.101, 3: 0.2}
    assert d._rows([], branches) == [(ahead[1], high), (ahead[0], low)]
    d.step_s = {1: 0.10, 2: 0.2}
    assert d._rows([], branches) == [(ahead[1], high)]


def test_drafter_load_reports_busy_time_and_its_pacer():
    d = drafter(Pacer(lambda *a: 0.0))
    d.pacer.pace(0.0, d.pacer.clock())
    d.busy_s = 1.5
    load = d.load()
    assert load["busy_s"] == 1.5 and load["pacer"]["steps"] == 1 and "overrun_s" in load["pacer"]
    assert load["pipelined_sessions"] == 0


def seq(i: int, out: list[int], max_tokens: int, stop: frozenset[int] = frozenset()) -> Seq:
    return Seq(i, [1, 2, 3], 3, max_tokens, SamplingParams(), 0, stop, "gw", 1, out=list(out), fed=3, drafter="edge")


def test_the_last_block_counts_only_the_drafts_the_output_reaches():
    s = seq(1, [7, 7], max_tokens=4)
    assert kept(s, [9, 9, 9, 9, 9], 64) == 2  # max_tokens: 2 more
    assert kept(seq(2, [], 10, frozenset({4})), [9, 4, 9], 64) == 2  # the stop token ends it
    assert kept(seq(3, [], 10), [9, 9], 64) == 2
    assert kept(seq(3, [], 10), [9, 9, 9], 5) == 2  # the context limit: 3 prompt + 2 = 5
    # mid-request: every draft counts, accepted or not (2 of 4 accepted, then the target's token)
    assert block_counts(seq(4, [7], 20), 4, [9, 9, 5], 64) == (4, 2)
    assert block_counts(seq(5, [7], 20), 4, [5], 64) == (4, 0)
    # the request ends inside the block: 4 drafts all accepted, the output reaches 2 of them
    assert block_counts(s, 4, [9, 9, 9, 9, 9], 64) == (2, 2)
    # ... or ends at the target's own token after 1 accepted draft: 2 drafts reached, 1 accepted
    assert block_counts(seq(6, [7, 7], 4), 4, [9, 5], 64) == (2, 1)
    v = Verifier.__new__(Verifier)
    v.stats, v.verify_ms = AcceptanceStats(), None
    block = Block(0, 3, s.hash, [9, 9, 9, 9], 0.0)
    v.record(s, block, *block_counts(s, len(block.tokens), [9, 9, 9, 9, 9], 64), 0.01)
    assert (s.spec.drafted, s.spec.accepted, s.spec.blocks) == (2, 2, 1)
    assert (v.stats.drafted, v.stats.accepted) == (2, 2)

def test_one_block_per_forward_serves_the_oldest_block_first():
    v = Verifier.__new__(Verifier)
    early, late = seq(1, [5], 10), seq(2, [5], 10)
    v.pending = {1: {}, 2: {}}
    assert v.oldest(early) == math.inf

    def block(s: Seq, received: float):
        return type("B", (), {"start": s.context, "hash": s.hash, "received": received})()

    v.pending[1][0] = block(early, 20.0)
    v.pending[2][0] = block(late, 10.0)
    order = sorted([early, late], key=v.oldest)
    assert [s.id for s in order] == [2, 1]
    # a stale block (drafted after other tokens) does not count
    v.pending[2][0].hash = 12345
    assert v.oldest(late) == math.inf


def test_a_session_counts_its_look_ahead_blocks_that_stood_and_those_that_went_stale():
    """What the ITL model of an adaptive session needs: how many verdicts had a look-ahead block
    behind them (it stood: `ahead`, or its prefix lost: `stale`), per session and in all."""
    from meshllm.mesh.protocol import MsgType, make

    s = seq(1, [5], 10)
    s.drafter = "edge"
    leader = type("L", (), {"seqs": {1: s}, "rid": 0})()
    v = Verifier(leader, lambda *a: None, lambda node: True)

    def draft(no: int, start: int, branch: bool = False) -> None:
        v.on_draft(make(MsgType.DRAFT, tenant="edge", seq=1, block=no, start=start, after=5, hash=s.hash, tokens=[7, 7],
                        plan_version=0, branch=branch), ARGS.vocab_size)

    draft(0, s.context)  # drafted after the committed prefix: not ahead
    draft(1, s.context + 3)  # drafted ahead of block 0's verdict
    draft(2, s.context - 1)  # its prefix is already gone: stale on arrival
    assert [v.pending[1][n].ahead for n in (0, 1)] == [False, True] and 2 not in v.pending[1]
    draft(3, s.context - 1, branch=True)  # a proactive branch that lost: dropped, not stale look-ahead
    draft(4, s.context + 1, branch=True)
    assert 3 not in v.pending[1] and v.pending[1][4].branch and v.stats.stale == 1
    del v.pending[1][4]
    v.record(s, v.pending[1][1], 2, 2, 0.01)
    js = s.spec.to_json()
    assert (js["ahead_blocks"], js["stale_blocks"], js["blocks"]) == (1, 1, 1)
    assert (v.stats.ahead, v.stats.stale) == (1, 1) and v.load()["stale_blocks"] == 1
    total = AcceptanceStats()
    total.merge(js)
    total.merge(js)
    assert (total.ahead, total.stale) == (2, 2)


def test_a_sequence_goes_on_without_a_restarted_or_silent_drafter():
    """A drafter restarted before its peers saw it dead is alive, but its new life knows nothing of
    the sessions of the old one and answers no VERDICT: each step of those sessions waited the
    whole fallback (~1.1 s a token) to the request's end. Now a new incarnation ends the session's
    drafting at once, and SILENT_STEPS plain steps in a row with no block from a drafter do too."""
    from meshllm.mesh.protocol import MsgType, make
    from meshllm.roles.verifier import SILENT_STEPS, WAIT

    lives = {"edge": 100}
    s, quiet = seq(1, [5], 10), seq(2, [5], 10)
    s.drafter = quiet.drafter = "edge"
    leader = type("L", (), {"seqs": {1: s, 2: quiet}, "rid": 0, "ctx": None})()
    verdicts = []
    v = Verifier(leader, lambda addr, m: verdicts.append(m), lambda node: True, life=lives.get)
    v.verdict = lambda *a: verdicts.append(a)  # (no plan context here to address a VERDICT)
    for x in (s, quiet):
        v.started(x)
    assert s.drafter_life == 100 and v.take(s, 0.0) is WAIT
    lives["edge"] = 200  # restarted: alive all along as far as the membership goes
    assert v.take(s, 0.1) is None and s.drafter == "" and v.orphaned == 1  # plain steps from now on
    quiet.drafter_life = 200  # (as if it came after the restart: only silence ends its drafting)
    t = 0.0
    for step in range(SILENT_STEPS):
        assert v.take(quiet, t) is WAIT and quiet.drafter == "edge"
        t += v.fallback_s(quiet)
        assert v.take(quiet, t) is None and quiet.drafter == "edge" and v.fallbacks == step + 1
        if step == 0:  # a block (even a stale one) says the drafter is there: the count starts again
            v.on_draft(make(MsgType.DRAFT, tenant="edge", seq=2, block=0, start=quiet.context - 1, after=5,
                            hash=quiet.hash, tokens=[7], plan_version=0), ARGS.vocab_size)
            assert quiet.silent_steps == 0
    assert quiet.silent_steps == SILENT_STEPS - 1
    assert v.take(quiet, t) is WAIT
    t += v.fallback_s(quiet)
    assert v.take(quiet, t) is None and quiet.silent_steps == SILENT_STEPS
    assert v.take(quiet, t) is None and quiet.drafter == "" and v.orphaned == 2


def test_a_node_knows_its_peers_lives_from_its_membership_table():
    from types import SimpleNamespace

    from meshllm.mesh.membership import PeerState
    from meshllm.roles.host import RoleHost

    h = RoleHost.__new__(RoleHost)
    h.me, h.members = "fog", None
    assert h.life("edge") is None
    peers = {"edge": SimpleNamespace(info=SimpleNamespace(incarnation=7), state=PeerState.ALIVE)}
    h.members = SimpleNamespace(get=peers.get)
    assert (h.life("edge"), h.life("fog"), h.life("gone"), h.life("")) == (7, None, None, None)
    assert h.alive("edge") and not h.alive("gone")


def test_a_forked_kv_slot_holds_a_copy_of_the_prefix_and_is_its_own():
    cache = Transformer(ARGS).new_cache()
    cache.allocate(0, 8)
    k = torch.randn(ARGS.n_layers, ARGS.n_kv_heads, 6, ARGS.dim // ARGS.n_heads)
    cache.import_seq(0, k, k + 1)
    cache.fork(0, -1, 4, capacity=16)
    assert cache.length(-1) == 4 and cache.length(0) == 6
    fk, fv = cache.export(-1)
    assert torch.equal(fk, k[:, :, :4]) and torch.equal(fv, k[:, :, :4] + 1)
    cache.truncate(-1, 2)  # the branch moves on; the source does not
    assert cache.length(0) == 6 and torch.equal(cache.export(0)[0], k)


def started_drafter(mode: str = "async") -> tuple[Drafter, Session, list]:
    """A drafter with one greedy session whose first verdict came; `sent`: the DRAFT messages."""
    from meshllm.engine.speculative import extend_hash
    from meshllm.mesh.fields import sampling_map
    from meshllm.mesh.protocol import MsgType, make

    sent: list = []
    torch.manual_seed(0)
    d = Drafter("edge", Transformer(ARGS), lambda *a: None, lambda m, rid: sent.append(m), None)
    d.on_session(make(MsgType.SESSION, seq=7, prompt_token_ids=[1, 2, 3], max_tokens=24,
                      sampling=sampling_map(0.0, 0, 1.0, 0), stop_ids=[], decode_replica=1, gamma=3, adaptive=False,
                      mode=mode, gateway="127.0.0.1:1", plan_version=1), ARGS.vocab_size)
    d.on_verdict(make(MsgType.VERDICT, tenant="edge", seq=7, block=-1, accepted=0, tokens=[4], context=4,
                      hash=extend_hash(0, [4]), replica=1, finished=False))
    return d, d.sessions[7], sent


def test_a_sampled_draft_is_drawn_with_the_noise_of_its_output_index_after_a_resume(monkeypatch):
    """The drafter draws a sampled token with the noise the target draws that output index with
    (the coupling that makes the target's exact-match rule accept it). A resumed attempt's
    SESSION carries its offset (the output before it): the drafter's indices were shifted by it,
    so the coupling was lost for the rest of the request."""
    from meshllm.engine.speculative import extend_hash
    from meshllm.mesh.fields import sampling_map
    from meshllm.mesh.protocol import MsgType, make
    from meshllm.roles import drafter as drafter_mod

    drawn: list[tuple[int, int]] = []
    real = drafter_mod.token_generator
    monkeypatch.setattr(drafter_mod, "token_generator", lambda seed, index: drawn.append((seed, index)) or real(seed, index))
    torch.manual_seed(0)
    d = Drafter("edge", Transformer(ARGS), lambda *a: None, lambda m, rid: None, None)
    d.on_session(make(MsgType.SESSION, seq=7, prompt_token_ids=[1, 2, 3], max_tokens=24,
                      sampling=sampling_map(0.8, 0, 1.0, 5), stop_ids=[], decode_replica=1, gamma=3, adaptive=False,
                      mode="sync", gateway="127.0.0.1:1", plan_version=1, offset=10), ARGS.vocab_size)
    d.on_verdict(make(MsgType.VERDICT, tenant="edge", seq=7, block=-1, accepted=0, tokens=[4], context=4,
                      hash=extend_hash(0, [4]), replica=1, finished=False))
    for _ in range(6):
        d.step()
    assert drawn[:3] == [(5, 11), (5, 12), (5, 13)]  # output token 10 was [4]: the drafts are 11, 12, 13


def test_an_async_session_drafts_branches_after_its_runner_up_tokens_and_adopts_the_one_that_comes_true():
    from meshllm.engine.speculative import extend_hash
    from meshllm.mesh.protocol import MsgType, make

    d, s, sent = started_drafter()
    for _ in range(40):  # block 0, its look-ahead, and branches from the draft's 2nd / 3rd choices
        d.step()
        if any(br.block is not None for br in s.branches):
            break
    br = next(br for br in s.branches if br.block is not None)
    i = br.base - 1 - 4  # the stream position it branches at
    assert br.tokens[:br.base - 1] == s.tokens[:br.base - 1] and br.tokens[br.base - 1] != s.stream[i]
    assert br.tokens[br.base - 1] in [r for r, _ in s.runner[i][1]]
    msg = next(m for m in sent if m["block"] == br.block.no)  # published like any block, after its own prefix
    assert (msg["start"], msg["after"], msg["tokens"]) == (br.base, br.tokens[br.base - 1], br.tokens[br.base:])
    assert msg.fields.get("branch") is True
    assert msg["hash"] == extend_hash(0, br.tokens[3:br.base])
    # the verdict of block 0: the first i drafts stood, then the target's token is that runner-up
    b0 = s.blocks[0]
    tokens = (s.stream + [0])[:i] + [br.tokens[br.base - 1]] if i <= len(b0.tokens) else None
    assert tokens is not None
    d.on_verdict(make(MsgType.VERDICT, tenant="edge", seq=7, block=b0.no, accepted=i, tokens=tokens,
                      context=4 + len(tokens), hash=extend_hash(extend_hash(0, [4]), tokens), replica=1, finished=False))
    assert d.stats["branch_hits"] == 1 and s.slot == br.slot and s.branches == []
    assert s.tokens == br.tokens and s.blocks == [br.block]
    assert sorted(d.cache.seq_ids()) == [s.slot]  # every other branch and the old stream's slot are freed
    # the adopted KV is right: the next draft equals a fresh forward over the whole sequence
    fresh = Transformer(ARGS)
    fresh.load_state_dict(d.model.state_dict())
    while len(s.stream) == len(br.tokens) - br.base:
        d.step()
    c = fresh.new_cache()
    c.allocate(0, 64)
    ids = br.tokens
    want = int(fresh(torch.tensor(ids), [SeqSpan(0, 0, len(ids))], c)[-1].argmax())
    assert s.stream[len(br.tokens) - br.base] == want


def test_sync_sessions_draft_no_branches():
    d, s, sent = started_drafter("sync")
    for _ in range(12):
        d.step()
    assert s.blocks and not s.branches and d.stats["branches"] == 0


def test_a_draft_length_that_shrinks_mid_block_still_publishes_every_complete_block():
    d, s, sent = started_drafter("sync")
    d.step()
    d.step()  # two drafts of a gamma-3 block
    assert not s.blocks and len(s.stream) == 2
    s.gamma = 1  # adaptive gamma shrank meanwhile
    d.step()
    assert [b.tokens for b in s.blocks] == [s.stream[0:1], s.stream[2:3]]  # each after its guessed bonus


def test_branch_choices_never_repeat_the_drafted_token_even_in_a_tie():
    from meshllm.engine.speculative import BRANCH_CHOICES, choices

    logits = torch.full((1, 50), -10.0)
    logits[0, 7] = logits[0, 3] = 2.0  # a tie: argmax drafts 3, topk may list 7 first
    logits[0, 9], logits[0, 11] = 1.0, 0.5
    p1, others = choices(logits, 3)
    assert [t for t, _ in others] == [7, 9][:BRANCH_CHOICES] and abs(p1 - others[0][1]) < 1e-6


def test_a_session_forks_no_more_branches_than_it_drafts_at_once():
    from meshllm.roles.branches import BRANCHES_DRAFTING

    d, s, sent = started_drafter()
    d._rows = lambda mains, branches: [(m, None) for m in mains]  # a server with no room for branch rows
    for _ in range(12):
        d.step()
    assert s.blocks and len(s.branches) == BRANCHES_DRAFTING and all(br.block is None for br in s.branches)
    assert sorted(d.cache.seq_ids()) == sorted([s.slot] + [br.slot for br in s.branches])


def test_branch_kv_slots_stay_within_the_drafters_memory_budget():
    """Every fork copies a session-sized KV slot: the branches of all sessions together hold at most
    the drafter's budget (BRANCH_KV_SHARE of the device's memory on a node); a fork that would
    go over it is not made, and a branch freed gives its bytes back."""
    d, s, sent = started_drafter()
    one = d.cache.slot_bytes(s.capacity(d.model.args.max_seq_len))
    d.branches.budget = one  # room for exactly one branch slot
    d._rows = lambda mains, branches: [(m, None) for m in mains]  # branches wait: they are not drafted
    for _ in range(12):
        d.step()
        assert d.branches.held_bytes() <= one and len(s.branches) <= 1
    assert len(s.branches) == 1 and d.stats["branches_over_budget"] > 0
    assert d.branches.held_bytes() == one == d.cache.slot_bytes(s.capacity(d.model.args.max_seq_len))
    d.branches.drop(s)
    assert d.branches.held_bytes() == 0 and sorted(d.cache.seq_ids()) == [s.slot]
    d.branches.budget = 0  # no room at all: no fork
    for _ in range(6):
        d.step()
    assert s.branches == [] and d.stats["branches"] == 1


def test_a_session_with_gamma_out_of_range_is_refused() -> None:
    """A SESSION's gamma outside 1..16 was replaced with the node file's default without a word
    (the gateway never sends one: it is a malformed message); now it is refused like any other
    bad field, and no session is opened."""
    import pytest

    from meshllm.mesh.fields import sampling_map
    from meshllm.mesh.protocol import MsgType, ProtocolError, make

    d = Drafter("edge", Transformer(ARGS), lambda *a: None, lambda m, rid: None, None)
    for gamma in (0, 17, -3):
        with pytest.raises(ProtocolError, match=f"gamma {gamma}"):
            d.on_session(make(MsgType.SESSION, seq=9, prompt_token_ids=[1, 2, 3], max_tokens=24,
                              sampling=sampling_map(0.0, 0, 1.0, 0), stop_ids=[], decode_replica=1, gamma=gamma,
                              adaptive=False, mode="async", gateway="127.0.0.1:1", plan_version=1), ARGS.vocab_size)
        assert 9 not in d.sessions
