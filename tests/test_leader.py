"""The leader's scheduler in one process (tiny random model, a recording `send`): what it sends,
and in which order."""

from __future__ import annotations

import time

import pytest

from meshllm.defaults import Role
from meshllm.engine.kvcache import slot_capacity
from meshllm.engine.sampling import SamplingParams
from meshllm.engine.weights import load_transformer
from meshllm.mesh.protocol import Message, MsgType, SpanKind, make
from meshllm.partition.plan import Plan, Replica
from meshllm.partition.plan import Stage as PlanStage
from meshllm.roles.batcher import TOKEN_BUDGET, Seq
from meshllm.roles.context import PlanContext
from meshllm.roles.leader import Leader
from meshllm.roles.stage import Stage

NODES = {"a": "127.0.0.1:7001", "b": "127.0.0.1:7003", "gw": "127.0.0.1:7005"}


def two_stage_leader(kv_room: int | None = None, time_scale: float = 1.0,
                     prefill_tok_s: float = 1.0) -> tuple[Leader, list[tuple[str, Message]]]:
    plan = Plan("tiny", 4, "fp32", (Replica(0, Role.MIXED, (PlanStage("a", (0, 2)), PlanStage("b", (2, 4))),
                                            prefill_tok_s, 1.0, 1.0),), (), (), 0.0, 1.0)
    ctx = PlanContext(1, plan, dict(NODES), "a")
    sent: list[tuple[str, Message]] = []

    def send(address: str, msg: Message) -> None:
        sent.append((address, msg))

    return Leader(Stage(ctx, load_transformer("tiny", 0, 2), send), send, max_context=256, kv_room=kv_room,
                  time_scale=time_scale), sent


def seq(sid: int, max_tokens: int = 4, prompt_len: int = 3) -> Seq:
    prompt = [5, 6, 7] * (prompt_len // 3) + [5] * (prompt_len % 3)
    return Seq(sid, prompt, prompt_len, max_tokens, SamplingParams(), 0, frozenset(), NODES["gw"], 0)


def results(batch: int, out: list) -> Message:
    return make(MsgType.RESULTS, replica=0, batch=batch, plan_version=1, out=out)


def test_tokens_go_to_the_gateway_after_the_next_micro_batch_is_launched() -> None:
    """Streaming a token before launching the next micro-batch would delay the pipeline by the
    gateway's work (in the same process: its Python holds the GIL during the launch). A request's
    first token goes before it: the request's TTFT would otherwise wait for a stage-0 forward."""
    leader, sent = two_stage_leader()
    leader.batch.admit(seq(1))
    assert leader.step() and [m.type for _, m in sent] == [MsgType.ACTIVATIONS]  # the prompt
    leader.on_results(results(1, [[1, [9], [1.0]]]))
    assert len(sent) == 1, "results alone send nothing yet"
    assert leader.step()
    assert [(a, m.type) for a, m in sent[1:]] == [(NODES["gw"], MsgType.TOKENS), (NODES["b"], MsgType.ACTIVATIONS)]
    assert sent[1][1]["token_ids"] == [9] and sent[2][1]["spans"][0][1] == 3  # the first token; decode of position 3
    leader.on_results(results(2, [[1, [11], [1.0]]]))  # a token in the middle of the output
    assert leader.step()
    assert [(a, m.type) for a, m in sent[3:]] == [(NODES["b"], MsgType.ACTIVATIONS), (NODES["gw"], MsgType.TOKENS)]
    assert sent[4][1]["token_ids"] == [11] and sent[4][1]["index"] == 1
    leader.on_results(results(3, [[1, [12], [1.0]]]))
    leader.fail_all("re-planned")  # a leader about to be replaced sends what it holds at once
    assert [m["token_ids"] for _, m in sent[5:] if m.type is MsgType.TOKENS] == [[12], []]
    assert sent[-1][1]["finish_reason"] == "error" and any(m.type is MsgType.RELEASE for _, m in sent[5:])


def test_a_last_token_goes_out_before_the_next_launch() -> None:
    """The token that ends a request is not held behind the next micro-batch of the others."""
    leader, sent = two_stage_leader()
    short, long = seq(1), seq(2)
    short.max_tokens = 2
    leader.batch.admit(short)
    leader.batch.admit(long)
    assert leader.step()  # both prompts
    leader.on_results(results(1, [[1, [9], [1.0]], [2, [19], [1.0]]]))
    assert leader.step()  # their first tokens, then both decodes
    n = len(sent)
    leader.on_results(results(2, [[1, [10], [1.0]], [2, [20], [1.0]]]))  # seq 1 ends (max_tokens 2)
    assert leader.step()  # seq 2's next decode
    later = [m for _, m in sent[n:] if m.type is not MsgType.RELEASE]
    kinds = [(m.type, m.fields.get("seq")) for m in later]
    last = next(m for m in later if m.type is MsgType.TOKENS and m["seq"] == 1)
    assert last["finished"] and kinds.index((MsgType.TOKENS, 1)) < kinds.index((MsgType.ACTIVATIONS, None))


def test_a_step_with_nothing_to_launch_still_sends_the_tokens() -> None:
    leader, sent = two_stage_leader()
    s = seq(2)
    s.max_tokens = 1
    leader.batch.admit(s)
    leader.step()
    leader.on_results(results(1, [[2, [9], [1.0]]]))  # the first token is the last: nothing follows
    assert not leader.step()
    toks = [m for _, m in sent if m.type is MsgType.TOKENS]
    assert len(toks) == 1 and toks[0]["token_ids"] == [9] and toks[0]["finished"]


def test_a_short_prompt_is_not_queued_behind_a_long_one() -> None:
    """The step's prompt budget goes to the prompt with the fewest tokens left first (the
    simulator's order, sim/router.prompt_priority): a 20-token prompt admitted after a 240-token
    one is prefilled whole in the first micro-batch; the long one takes what the budget leaves."""
    leader, sent = two_stage_leader()
    long, short = seq(1), seq(2)
    long.prompt, long.prompt_len = [5] * 240, 240
    short.prompt, short.prompt_len = [6] * 20, 20
    leader.batch.admit(long)
    leader.batch.admit(short)
    assert leader.step()
    spans = {sp[0]: sp for sp in sent[0][1]["spans"]}
    assert spans[2][2] == 20 and spans[2][3] == SpanKind.PREFILL_LAST  # all of the short prompt
    assert spans[1][2] == TOKEN_BUDGET - 20 and spans[1][3] == SpanKind.PREFILL


def test_a_long_prompt_on_a_slow_replica_does_not_age_past_every_new_short_one() -> None:
    """Aging at a fixed 1000 prompt tokens a second of waiting: on the demo's prefill node (~150
    tokens/s here) a 4000-token prompt outranked a 1-token request 3 s after it came, which then
    waited 25 s for the whole prefill. A replica ages its prompts at a tenth of its predicted
    prefill speed (at most the simulator's constant): a 240-token prompt that waited 5 s on a
    150 tokens/s replica still lets a 20-token one go first; on a fast replica it goes first."""
    from meshllm.sim.router import PROMPT_AGING_TOKENS_PER_S, prompt_aging

    assert prompt_aging(150.0) == 15.0 and prompt_aging(1e6) == PROMPT_AGING_TOKENS_PER_S
    for prefill_tok_s, first in ((150.0, 2), (20000.0, 1)):
        leader, sent = two_stage_leader(prefill_tok_s=prefill_tok_s)
        long, short = seq(1), seq(2)
        long.prompt, long.prompt_len, long.arrived = [5] * 240, 240, time.monotonic() - 5.0
        short.prompt, short.prompt_len = [6] * 20, 20
        leader.batch.admit(long)
        leader.batch.admit(short)
        assert leader.step()
        assert sent[0][1]["spans"][0][0] == first, prefill_tok_s


def test_tokens_go_out_before_a_launch_that_carries_a_prompt() -> None:
    """A prompt chunk makes a long step: the tokens ready before it do not wait for it."""
    leader, sent = two_stage_leader()
    leader.batch.admit(seq(1))
    leader.step()
    leader.on_results(results(1, [[1, [9], [1.0]]]))
    leader.step()  # seq 1's first token, then its first decode
    leader.on_results(results(2, [[1, [11], [1.0]]]))  # a middle token: it would wait for a decode launch
    leader.batch.admit(seq(2))  # its prompt joins the next micro-batch beside seq 1's decode row
    assert leader.step()
    assert [m.type for _, m in sent[3:]] == [MsgType.TOKENS, MsgType.ACTIVATIONS]
    assert sent[3][1]["token_ids"] == [11] and sorted(sp[0] for sp in sent[4][1]["spans"]) == [1, 2]


def test_a_prefill_stage_sends_the_micro_batch_on_before_it_ships_the_kv() -> None:
    """A prompt's activations (and the last stage's RESULTS, its first token) are on the request's
    critical path; the KV it ships to the decode replica is not, so it goes after them."""
    plan = Plan("tiny", 4, "fp32", (Replica(0, Role.PREFILL, (PlanStage("a", (0, 2)), PlanStage("b", (2, 4))),
                                            1.0, 1.0, 1.0),
                                    Replica(1, Role.DECODE, (PlanStage("c", (0, 4)),), 1.0, 1.0, 1.0)), (), (), 0.0, 1.0)
    nodes = dict(NODES, c="127.0.0.1:7007")
    sent_a: list[tuple[str, Message]] = []
    sent_b: list[tuple[str, Message]] = []
    ctx_a, ctx_b = PlanContext(1, plan, nodes, "a"), PlanContext(1, plan, nodes, "b")
    leader = Leader(Stage(ctx_a, load_transformer("tiny", 0, 2), lambda a, m: sent_a.append((a, m))),
                    lambda a, m: sent_a.append((a, m)), max_context=256)
    s = seq(1)
    s.decode_rid = 1
    leader.batch.admit(s)
    assert leader.step()
    assert [(a, m.type) for a, m in sent_a] == [(nodes["b"], MsgType.ACTIVATIONS), (nodes["c"], MsgType.KV_TRANSFER)]
    assert sent_a[1][1]["layers"] == [0, 2]
    last = Stage(ctx_b, load_transformer("tiny", 2, 4), lambda a, m: sent_b.append((a, m)))
    last.on_activations(sent_a[0][1])
    assert [(a, m.type) for a, m in sent_b] == [(nodes["a"], MsgType.RESULTS), (nodes["c"], MsgType.KV_TRANSFER)]
    assert sent_b[1][1]["layers"] == [2, 4]


def test_a_sequence_starts_only_when_its_kv_fits_beside_the_running_ones() -> None:
    """KV admission: each running sequence reserves the slot its longest context needs (prompt +
    max_tokens, on the cache's capacity ladder); a queued one waits, first come first served,
    until a finished one frees room; one larger than the whole room runs alone."""
    leader, sent = two_stage_leader(kv_room=320)
    assert slot_capacity(3 + 4) == 64 and slot_capacity(3 + 100) == 128 and slot_capacity(1500) == 1536
    leader.batch.admit(seq(1, max_tokens=100))  # 128 positions
    leader.batch.admit(seq(2, max_tokens=100))  # 128: 256 held
    leader.batch.admit(seq(3, max_tokens=100))  # would make 384 > 320: waits
    leader.batch.admit(seq(4))  # 64 would fit, but it came after 3
    assert leader.step()
    assert leader.queue == [3, 4] and leader.batch.kv_held == 256 and leader.batch.kv_waits == 1
    assert {sp[0] for sp in sent[-1][1]["spans"]} == {1, 2}
    leader.abort(1)
    leader.step()
    assert leader.queue == [] and leader.batch.kv_held == 128 + 128 + 64 and leader.batch.kv_waits == 1
    load = leader.load()
    assert (load["kv_room"], load["kv_held"], load["kv_peak"], load["kv_waits"]) == (320, 320, 320, 1)
    for sid in (2, 3, 4):
        leader.abort(sid)
    leader.batch.admit(seq(5, max_tokens=250))  # alone: 256 of KV for 3 + 250 positions
    leader.batch.admit(seq(6, max_tokens=250))  # 256 more: 512 > 320, it runs only after 5
    leader.batch.admit(seq(7, prompt_len=250, max_tokens=1))
    leader.batch.build(None)  # (two micro-batches are in flight: `step` would not launch)
    assert leader.queue == [6, 7] and leader.batch.kv_held == 256


def test_the_leader_grants_kv_room_to_requests_on_their_way_only_while_it_has_it() -> None:
    """KV_RESERVE (roles/batcher.py KvGrants): a gateway asks the decode leader for a request's
    room before sending it. Granted while the sequences here and the earlier grants leave it (or
    when the replica holds and has promised nothing: it runs alone); a granted sequence starts
    when it comes, an unreserved one waits behind the room promised to others; an abort, the
    sequence's start or GRANT_TTL_S gives the room back; with no known room nothing is kept."""
    from meshllm.roles.batcher import GRANT_TTL_S, KvGrants

    leader, _ = two_stage_leader(kv_room=320)
    g = leader.batch.grants
    assert g.grant(10, 128) and g.grant(11, 128)  # 256 promised
    assert not g.grant(12, 128) and g.denied == 1  # 384 > 320
    assert g.grant(11, 64) and g.grant(12, 128)  # 11 asks again, for less: 320
    leader.batch.admit(seq(10, max_tokens=100))  # 128, granted
    leader.batch.admit(seq(1, max_tokens=100))  # 128, not granted: 128 + 64 + 128 promised to others
    leader.batch.build(None)
    assert leader.queue == [1] and leader.batch.kv_held == 128 and 10 not in g.granted and g.committed == 256
    leader.abort(12)  # the gateway gave up on 12 before it came
    leader.batch.build(None)
    assert leader.queue == [] and leader.batch.kv_held == 256 and g.committed == 256
    assert not g.grant(13, 128)  # 256 held + 64 promised to 11
    leader.abort(11)
    assert g.grant(13, 64)
    for sid in (10, 1, 13):
        leader.abort(sid)
    leader.batch.build(None)  # (the step after a RELEASE counts what is left)
    assert g.committed == 0 and g.granted == {}
    assert g.grant(20, 128) and g.grant(21, 128)
    leader.batch.admit(seq(20, max_tokens=100))
    leader.batch.admit(seq(21, max_tokens=100))
    leader.batch.build(None)  # both start in one step: 20's room is not counted twice for 21
    assert leader.queue == [] and leader.batch.kv_held == 256 and g.granted == {}
    alone = KvGrants(300)
    assert alone.grant(1, 512) and not alone.grant(2, 8)  # nothing held or promised: it runs alone
    assert alone.grant(2, 8, now=time.monotonic() + GRANT_TTL_S + 1)  # 1 never came: its room lapsed
    unknown = KvGrants(None)
    assert unknown.grant(1, 10**9) and unknown.granted == {}


def test_a_sequence_larger_than_the_room_runs_alone_and_a_prefill_replica_reserves_only_the_prompt() -> None:
    leader, _ = two_stage_leader(kv_room=150)
    leader.batch.admit(seq(1, max_tokens=200))  # 256 > 150: alone
    leader.batch.admit(seq(2))
    leader.step()
    assert leader.queue == [2] and leader.batch.kv_held == 256
    leader.abort(1)
    handed_off = seq(3, max_tokens=200)
    handed_off.decode_rid = 9  # another replica decodes it: here only its prompt and first token
    leader.batch.admit(handed_off)
    leader.batch.build(None)
    assert leader.queue == [] and leader.batch.kv_held == 64 + 64


def test_a_prefill_replica_counts_the_prompts_it_hands_off() -> None:
    """`--status` and /v1/mesh showed a prefill leader that had handed off dozens of prompts as
    `finished: 0`: only a request that ends on the replica counted. Handoffs count now; a request
    that asked for one token ends on the prefill replica, and counts as finished there."""
    plan = Plan("tiny", 4, "fp32", (Replica(0, Role.PREFILL, (PlanStage("a", (0, 2)), PlanStage("b", (2, 4))),
                                            1.0, 1.0, 1.0), Replica(1, Role.DECODE, (PlanStage("c", (0, 4)),),
                                                                    1.0, 1.0, 1.0)), (), (), 0.0, 1.0)
    ctx = PlanContext(1, plan, {**NODES, "c": "127.0.0.1:7007"}, "a")
    sent: list = []
    leader = Leader(Stage(ctx, load_transformer("tiny", 0, 2), lambda a, m: sent.append(m)),
                    lambda a, m: sent.append(m), max_context=256)
    for sid, max_tokens in ((1, 200), (2, 1)):
        s = seq(sid, max_tokens=max_tokens)
        s.decode_rid = 1  # the decode replica decodes it
        leader.batch.admit(s)
    leader.step()
    leader.on_results(results(1, [[1, [9], [1.0]], [2, [9], [1.0]]]))
    load = leader.load()
    assert (load["handed_off"], load["finished"], load["aborted"]) == (1, 1, 0), load


def test_without_a_known_room_nothing_waits_for_kv() -> None:
    leader, _ = two_stage_leader()
    for sid in range(1, 6):
        leader.batch.admit(seq(sid, max_tokens=250))
    leader.step()
    assert leader.queue == [] and leader.load()["kv_room"] is None and leader.batch.kv_waits == 0


def test_a_decode_replica_with_sequences_waiting_offers_no_free_slot() -> None:
    """The capacity a decode replica publishes for session moves: slots left while nothing waits;
    none while a sequence waits in its queue (for KV room), so no session is moved there to wait."""
    from meshllm.roles.decode import Balancer

    leader, _ = two_stage_leader(kv_room=128)
    published: list[Message] = []
    balancer = Balancer(leader, lambda a, m: None, published.append)
    leader.batch.admit(seq(1, max_tokens=100))
    leader.batch.build(None)
    balancer.publish_capacity()
    leader.batch.admit(seq(2, max_tokens=100))  # 128 + 128 > 128: waits
    leader.batch.build(None)
    balancer.publish_capacity()
    assert [(m["free_slots"], m["queue"], m["active"], m["kv_free"]) for m in published] == \
        [(63, 0, 1, 0), (0, 1, 1, 0)]
    leader.abort(1)
    leader.batch.build(None)
    balancer.publish_capacity()
    assert published[-1]["kv_free"] == 0 and published[-1]["active"] == 1  # 2 runs now


def test_a_session_moves_only_to_a_decode_replica_whose_kv_room_has_space_for_it() -> None:
    """Session moves between decode replicas (roles/decode.py Balancer): the busier replica moves a
    session to the idlest one with free slots only when the session's KV charge fits in the KV that
    replica's room has left (its CAPACITY's kv_free); a replica that did not say is not limited."""
    from meshllm.roles.decode import Balancer

    reps = tuple(Replica(rid, Role.DECODE, (PlanStage(n, (0, 4)),), 1.0, 1.0, 1.0) for rid, n in ((0, "a"), (1, "b")))
    ctx = PlanContext(1, Plan("tiny", 4, "fp32", reps, (), (), 0.0, 1.0), dict(NODES), "a")
    sent: list[tuple[str, Message]] = []
    leader = Leader(Stage(ctx, load_transformer("tiny", 0, 4), lambda a, m: sent.append((a, m))),
                    lambda a, m: sent.append((a, m)), max_context=256)
    balancer = Balancer(leader, lambda a, m: sent.append((a, m)), lambda m: None)
    for sid in (1, 2, 3):  # 128 positions each (3 + 100 tokens)
        s = seq(sid, max_tokens=100)
        s.out, s.fed = [9], 3
        leader.batch.admit(s)
    leader.batch.build(None)
    for s in leader.seqs.values():
        s.busy = False

    def capacity(**kv) -> None:
        msg = make(MsgType.CAPACITY, node="b", replica=1, free_slots=60, queue=0, plan_version=1, active=0, **kv)
        msg.src = "b"
        balancer.on_capacity(msg)
        balancer._checked = 0.0
        balancer.rebalance()

    capacity(kv_free=100)  # less than a session's 128: none moves
    assert balancer.moved_out == 0 and len(leader.seqs) == 3
    capacity(kv_free=128)
    assert balancer.moved_out == 1 and len(leader.seqs) == 2
    assert [m["seq"] for a, m in sent if m.type is MsgType.HANDOFF and a == NODES["b"]] == [1]


def test_the_leader_s_timeouts_scale_with_an_emulated_mesh_s_time_scale():
    """The gateway's waits were scaled by time_scale, the leader's were not: on a mesh emulated 10x
    slower, a KV handoff or a micro-batch that took 130 s of that slow time failed its sequences,
    a KV grant lapsed before its (slowly prefilled) sequence came, and a stage's KV_ACK that came
    310 s before its HANDOFF was forgotten (the sequence then waited for that KV until it failed)."""
    from meshllm.roles import leader as leader_mod
    from meshllm.roles.batcher import GRANT_TTL_S
    from meshllm.roles.decode import EARLY_ACK_TTL_S, KvAcks

    for time_scale, fails in ((1.0, True), (10.0, False)):
        lead, _ = two_stage_leader(kv_room=1000, time_scale=time_scale)
        s = seq(1)
        s.missing_kv, s.arrived = {"b"}, time.monotonic() - leader_mod.KV_TIMEOUT_S - 10
        lead.seqs[s.id] = s
        lead._expire()
        assert (s.id not in lead.seqs) == fails, time_scale
        assert lead.batch.grants.ttl_s == GRANT_TTL_S * time_scale
        acks = KvAcks(lead)  # a stage's KV_ACK before its HANDOFF is held x time_scale too
        acks.on_ack(7, "b", 3)
        acks._early[7] = (time.monotonic() - EARLY_ACK_TTL_S - 10, acks._early[7][1])
        acks.on_ack(8, "b", 3)
        assert (7 not in acks._early) == fails, time_scale


def test_a_sequence_waiting_for_its_first_token_tells_its_gateway_it_is_alive():
    """A long prompt prefills in chunks for minutes on slow devices; the gateway's 60 s no-token
    timeout restarted it from scratch. Each returned micro-batch lets every sequence that has had
    no token for KEEPALIVE_S send an empty TOKENS at the index it waits for (at most once a
    second a leader); a sequence with output, or one heard from lately, sends none."""
    from meshllm.roles import leader as leader_mod

    leader, sent = two_stage_leader()
    long, short = seq(1, prompt_len=250), seq(2, prompt_len=200)
    leader.batch.admit(long)
    leader.batch.admit(short)
    assert leader.step()  # all of the short prompt, the first chunk of the long one
    assert [(sp[0], sp[3]) for sp in sent[0][1]["spans"]] == [(2, SpanKind.PREFILL_LAST), (1, SpanKind.PREFILL)]
    stale = time.monotonic() - leader_mod.KEEPALIVE_S - 1
    long.alive_at = short.alive_at = stale
    leader.on_results(results(1, [[2, [9], [1.0]]]))  # the short one's first token; no token of the long one
    assert leader.step()
    tokens = [(m["seq"], m["token_ids"], m["index"], m["finished"]) for _, m in sent if m.type is MsgType.TOKENS]
    assert tokens == [(2, [9], 0, False), (1, [], 0, False)]  # a token, and a keepalive
    assert sent[-1][1].type is MsgType.ACTIVATIONS and long.alive_at > stale
    long.alive_at = short.alive_at = stale
    leader.on_results(results(2, [[2, [10], [1.0]], [1, [11], [1.0]]]))  # within a second of the last look
    leader.step()
    assert [m["token_ids"] for _, m in sent if m.type is MsgType.TOKENS][2:] == [[10], [11]]  # tokens only


def test_a_handoff_with_a_bad_offset_is_refused_not_taken_as_zero():
    """HANDOFF read its optional `offset` leniently (a negative or non-integer one became 0, the
    sampling position and TOKENS index of a resumed attempt then wrong without a word) where the
    prefill leader and the drafter refuse it (mesh/fields.check_offset): one check for all."""
    from meshllm.mesh.fields import sampling_map
    from meshllm.mesh.protocol import ProtocolError
    from meshllm.roles.decode import KvAcks

    lead, _ = two_stage_leader(kv_room=1000)
    acks = KvAcks(lead)

    def handoff(seq_id, **extra):
        return make(MsgType.HANDOFF, seq=seq_id, prompt_len=4, tokens=[5], max_tokens=8,
                    sampling=sampling_map(0, 0, 1.0, 0), stop_ids=[], gateway="127.0.0.1:9", drafter="",
                    plan_version=1, **extra)

    for i, bad in enumerate((-1, "3", True, 2.5)):
        with pytest.raises(ProtocolError, match="offset must be a non-negative integer"):
            acks.on_handoff(handoff(20 + i, offset=bad), 100)
        assert 20 + i not in lead.seqs
    acks.on_handoff(handoff(30, offset=7), 100)
    assert lead.seqs[30].offset == 7
    acks.on_handoff(handoff(31), 100)
    assert lead.seqs[31].offset == 0


def test_a_handoff_s_drafting_figures_are_taken_and_bad_ones_dropped():
    """A moved session's HANDOFF carries its drafting figures so far (roles/decode.py migrate): the
    new leader goes on from them; malformed ones (another node's bug) are dropped, not fatal."""
    from meshllm.mesh.fields import sampling_map
    from meshllm.roles.decode import KvAcks

    lead, _ = two_stage_leader(kv_room=1000)
    acks = KvAcks(lead)

    def handoff(seq_id, **extra):
        return make(MsgType.HANDOFF, seq=seq_id, prompt_len=4, tokens=[5, 6], max_tokens=8,
                    sampling=sampling_map(0, 0, 1.0, 0), stop_ids=[], gateway="127.0.0.1:9", drafter="",
                    plan_version=1, **extra)

    spec = {"drafted": 6, "accepted": 3, "blocks": 2, "per_position": {"1": 2, "2": 1, "3": 0, "4": 0}, "offered": {"1": 2,
            "2": 2, "3": 1, "4": 1}, "gamma_histogram": {"2": 1, "4": 1}, "ahead_blocks": 1, "stale_blocks": 2}
    acks.on_handoff(handoff(40, spec=spec), 100)
    assert lead.seqs[40].spec.to_json() == spec
    for i, bad in enumerate(("x", {"drafted": "many"}, {"per_position": {"a": 1}}, [1, 2],
                             {"drafted": float("inf")}, {"blocks": -3}, {"gamma_histogram": {"4": float("-inf")}})):
        acks.on_handoff(handoff(50 + i, spec=bad), 100)
        assert lead.seqs[50 + i].spec.blocks == 0 and lead.seqs[50 + i].spec.drafted == 0
    acks.on_handoff(handoff(60), 100)
    assert lead.seqs[60].spec.blocks == 0


def leader_with_two_gateways():
    """A leader running sequence 1 for the gateway NODES["gw"] and 2 for another one, alive."""
    lead, sent = two_stage_leader()
    lead.batch.admit(seq(1))
    other = seq(2)
    other.gateway = "127.0.0.1:7999"
    lead.batch.admit(other)
    assert lead.step()
    sent.clear()
    return lead, sent


def test_a_sequence_released_because_its_gateway_was_seen_dead_tells_that_gateway():
    """A gateway node paused past the failure timeout (SIGSTOP, a swap storm): the re-plan kept
    the replica, whose leader released the gateway's sequences without a word; back, the gateway
    waited 60 s for tokens that never came (3 of 14 requests took 73 s). The leader now sends the
    gateway an error TOKENS for each: one that was only paused resumes them at once."""
    from types import SimpleNamespace

    from meshllm.roles.host import RoleHost

    lead, sent = leader_with_two_gateways()
    old = lead.ctx
    new = PlanContext(2, old.plan, dict(NODES), "a")
    host = SimpleNamespace(ctx=old, stage=lead.stage, leader=lead, me="a",
                           members=SimpleNamespace(addresses_gone=lambda: {NODES["gw"]}))
    RoleHost._carry_over(host, old, new)
    errors = [(a, m["seq"], m["finish_reason"], m["error"]) for a, m in sent if m.type is MsgType.TOKENS]
    assert errors == [(NODES["gw"], 1, "error", "released in plan v2: its gateway was seen dead")]
    assert 1 not in lead.seqs and 2 in lead.seqs


def test_a_gateway_that_leaves_or_dies_has_its_sequences_released_at_once():
    """A gateway stopped past its drain ended its requests and left; its replicas decoded their
    sequences for nobody (30 s and counting, up to max_tokens) when no re-plan followed (the node
    had been the mesh's only prefill node: nothing left to plan with). Now a peer seen gone
    (left or dead) has its sequences released at once, whatever the plan does."""
    from types import SimpleNamespace

    from meshllm.mesh.agent import MeshAgent
    from meshllm.mesh.membership import PeerState, Transition
    from meshllm.roles.host import RoleHost

    lead, sent = leader_with_two_gateways()
    host = SimpleNamespace(leader=lead, me="a", worker=SimpleNamespace(submit=lambda fn: fn()))
    host._release_orphans = lambda gone, why: RoleHost._release_orphans(host, gone, why)
    agent = SimpleNamespace(members=SimpleNamespace(get=lambda nid: SimpleNamespace(info=SimpleNamespace(
        address=NODES["gw"]))), me=SimpleNamespace(id="a"), t=SimpleNamespace(forget=lambda a: None),
        on_gone=[lambda address: RoleHost.gateway_gone(host, address)])
    MeshAgent.on_change(agent, Transition("gw", PeerState.ALIVE, PeerState.LEFT))
    errors = [(a, m["seq"], m["finish_reason"], m["error"]) for a, m in sent if m.type is MsgType.TOKENS]
    assert errors == [(NODES["gw"], 1, "error", "released: its gateway left or was seen dead")]
    assert 1 not in lead.seqs and 2 in lead.seqs


def test_drafting_figures_go_with_every_tokens_message_after_a_verified_block():
    """They went only with a sequence's last TOKENS: a request its gateway ended on a stop string
    (the leader never sends that last one) lost all of them, in its response and in /metrics."""
    from meshllm.roles.leader import Outbox

    sent: list = []
    out, s = Outbox(lambda a, m: sent.append(m)), seq(1, max_tokens=20)
    s.out = [9]
    out.tokens(s, [9], None)  # before any block
    s.spec.record(4, 3)
    s.out += [1, 2, 3, 4]
    out.tokens(s, [1, 2, 3, 4], None)
    s.out += [5]
    out.tokens(s, [5], None)  # no new block
    s.spec.record(4, 0)
    s.out += [6]
    out.tokens(s, [6], "stop")
    out.flush()
    assert [m.fields.get("spec", {}).get("blocks") for m in sent] == [None, 1, None, 2]
    assert sent[1]["spec"]["drafted"] == 4 and sent[1]["spec"]["accepted"] == 3


def test_a_kv_grant_counts_what_is_held_and_promised_once_each() -> None:
    """KvGrants.grant: a second ask for a sequence replaces its first (not counted twice); a
    queued sequence that holds a grant is counted by its grant, not again as committed; a
    request larger than the room is granted alone only while nothing is held as well as
    nothing promised; a grant lapses exactly at its TTL."""
    from meshllm.roles.batcher import KvGrants

    g = KvGrants(300, ttl_s=10.0)
    assert g.grant(1, 200, now=0.0) and g.grant(1, 200, now=0.0) and g.granted == {1: (200, 10.0)}
    g.settle((), 0, [(1, 200)])  # 1 came and waits in the queue with its grant
    assert g.committed == 0 and g.grant(2, 100, now=0.0)  # 200 promised + 100 = 300
    g.clear()
    g.settle((), 200, [])  # 200 held by running sequences, nothing promised
    assert not g.grant(3, 400, now=0.0)  # larger than the room: not while something is held
    g.settle((), 0, [])
    assert g.grant(3, 400, now=0.0) and not g.grant(4, 8, now=9.99)
    assert g.grant(4, 8, now=10.0)  # 3 never came: its room lapsed at its TTL


def test_a_leader_promises_at_most_max_grants_rooms_at_once(monkeypatch) -> None:
    """MAX_GRANTS bounds the rooms promised at once (network input: bounded memory), whatever room
    is left."""
    from meshllm.roles import batcher
    from meshllm.roles.batcher import KvGrants

    monkeypatch.setattr(batcher, "MAX_GRANTS", 2)
    g = KvGrants(10**6)
    assert g.grant(1, 1, now=0.0) and g.grant(2, 1, now=0.0) and not g.grant(3, 1, now=0.0)
    assert g.grant(2, 5, now=0.0)  # asking again for one already granted is no new grant


def test_decode_rows_spread_over_the_stages_within_the_token_budget(monkeypatch) -> None:
    """Batcher.build: ready sequences' decode rows are spread over the pipeline's micro-batches,
    ceil(ready / stages) a batch, and no batch carries more rows than TOKEN_BUDGET; a sequence
    whose KV a stage has not acknowledged is not ready."""
    from meshllm.roles import batcher
    from meshllm.roles.batcher import Batcher

    def ready_seq(sid: int) -> Seq:
        s = seq(sid)
        s.out, s.fed = [9], 3
        return s

    seqs: dict = {}
    b = Batcher(seqs, [], n_stages=2)
    for sid in (1, 2, 3):
        b.admit(ready_seq(sid))
    b.admit(ready_seq(4))
    seqs[4].missing_kv = {"b"}
    fl, ids = b.build(None)
    assert [sp.seq for sp in fl.spans] == [1, 2] and ids == [9, 9]  # 3 ready over 2 stages: 2, then 1
    fl, _ = b.build(None)
    assert [sp.seq for sp in fl.spans] == [3] and b.build(None)[0].spans == []  # 4 waits for its KV
    monkeypatch.setattr(batcher, "TOKEN_BUDGET", 2)
    b = Batcher({}, [], n_stages=1)
    for sid in (1, 2, 3):
        b.admit(ready_seq(sid))
    fl, ids = b.build(None)
    assert [sp.seq for sp in fl.spans] == [1, 2] and len(ids) == 2


def test_a_prompt_chunk_is_the_last_only_when_it_ends_the_prompt(monkeypatch) -> None:
    """Chunked prefill: a chunk that leaves prompt tokens is PREFILL; the one that reaches the
    prompt's end is PREFILL_LAST (its logits give the first token)."""
    from meshllm.roles import batcher
    from meshllm.roles.batcher import Batcher

    monkeypatch.setattr(batcher, "TOKEN_BUDGET", 4)
    b = Batcher({}, [], n_stages=1)
    b.admit(seq(1, prompt_len=5))
    fl, ids = b.build(None)
    assert [(sp.n, sp.kind) for sp in fl.spans] == [(4, SpanKind.PREFILL)] and not b.seqs[1].busy
    fl, ids = b.build(None)
    assert [(sp.n, sp.kind) for sp in fl.spans] == [(1, SpanKind.PREFILL_LAST)] and b.seqs[1].busy


def test_the_prompt_with_fewest_tokens_left_gets_the_budget_first() -> None:
    """Prompt chunks go fewest prompt tokens *left* first: a long prompt nearly prefilled comes
    before a shorter one not started (at equal waits)."""
    from meshllm.roles.batcher import Batcher

    b = Batcher({}, [], n_stages=1)
    long, short = seq(1, prompt_len=100), seq(2, prompt_len=50)
    long.fed = 90
    short.arrived = long.arrived
    for s in (long, short):
        b.seqs[s.id] = s
    assert [s.id for s in b._prompts(long.arrived)] == [1, 2]


def test_at_most_max_active_seqs_run_and_their_queueing_time_and_kv_peak_are_kept(monkeypatch) -> None:
    """_start_queued: no more than MAX_ACTIVE_SEQS sequences run at once (the rest wait in the
    queue); a started sequence's time in the queue is added to its queued_s (reported to its
    gateway); kv_peak keeps the most KV ever held, not what is held now."""
    from meshllm.roles import batcher
    from meshllm.roles.batcher import Batcher

    monkeypatch.setattr(batcher, "MAX_ACTIVE_SEQS", 2)
    b = Batcher({}, [], n_stages=1, kv_room=10_000)
    for sid in (1, 2, 3):
        b.admit(seq(sid))
    b.seqs[1].arrived -= 5.0
    b.build(None)
    assert b.queue == [3] and b.seqs[1].queued_s >= 5.0 and b.kv_held == b.kv_peak == 128
    del b.seqs[1], b.seqs[2]
    b.build(None)
    assert b.queue == [] and b.kv_held == 64 and b.kv_peak == 128


def test_a_sequence_s_kv_charge_covers_its_whole_longest_context() -> None:
    """kv_charge / decode_charge, on the slot ladder: a handed-off prompt holds its prompt and the
    first token (64 prompt tokens need the 128 slot); a drafted sequence, a verify block of
    MAX_GAMMA + 1 past prompt + max_tokens; and never more than the model's context."""
    from meshllm.config import MAX_GAMMA
    from meshllm.roles.batcher import decode_charge, kv_charge

    handed = seq(1, prompt_len=64)
    handed.decode_rid = 9
    assert kv_charge(handed, 0, 256) == slot_capacity(65) == 128
    assert decode_charge(64 - MAX_GAMMA - 1 - 10, 10, True, 1 << 30) == 64
    assert decode_charge(64 - MAX_GAMMA - 10, 10, True, 1 << 30) == 128
    assert decode_charge(100, 1000, False, 256) == 256
