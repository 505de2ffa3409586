"""The leader's scheduler in one process (tiny random model, a recording `send`): what it sends,
and in which order."""

from __future__ import annotations

from meshllm.defaults import Role
from meshllm.engine.sampling import SamplingParams
from meshllm.engine.weights import load_transformer
from meshllm.mesh.protocol import Message, MsgType, make
from meshllm.partition.plan import Plan, Replica
from meshllm.partition.plan import Stage as PlanStage
from meshllm.roles.context import PlanContext
from meshllm.roles.leader import Leader, Seq
from meshllm.roles.stage import Stage

NODES = {"a": "127.0.0.1:7001", "b": "127.0.0.1:7003", "gw": "127.0.0.1:7005"}


def two_stage_leader() -> tuple[Leader, list[tuple[str, Message]]]:
    plan = Plan("tiny", 4, "fp32", (Replica(0, Role.MIXED, (PlanStage("a", (0, 2)), PlanStage("b", (2, 4))),
                                            1.0, 1.0, 1.0),), (), (), 0.0, 1.0)
    ctx = PlanContext(1, plan, dict(NODES), "a")
    sent: list[tuple[str, Message]] = []

    def send(address: str, msg: Message) -> None:
        sent.append((address, msg))

    return Leader(Stage(ctx, load_transformer("tiny", 0, 2), send), send, max_context=256), sent


def seq(sid: int) -> Seq:
    return Seq(sid, [5, 6, 7], 3, 4, SamplingParams(), 0, frozenset(), NODES["gw"], 0)


def results(batch: int, out: list) -> Message:
    return make(MsgType.RESULTS, replica=0, batch=batch, plan_version=1, out=out)


def test_tokens_go_to_the_gateway_after_the_next_micro_batch_is_launched() -> None:
    """Streaming a token before launching the next micro-batch would delay the pipeline by the
    gateway's work (in the same process: its Python holds the GIL during the launch)."""
    leader, sent = two_stage_leader()
    leader.admit(seq(1))
    assert leader.step() and [m.type for _, m in sent] == [MsgType.ACTIVATIONS]  # the prompt
    leader.on_results(results(1, [[1, [9], [1.0]]]))
    assert len(sent) == 1, "results alone send nothing yet"
    assert leader.step()
    assert [(a, m.type) for a, m in sent[1:]] == [(NODES["b"], MsgType.ACTIVATIONS), (NODES["gw"], MsgType.TOKENS)]
    assert sent[2][1]["token_ids"] == [9] and sent[1][1]["spans"][0][1] == 3  # the decode of position 3
    leader.on_results(results(2, [[1, [11], [1.0]]]))
    leader.fail_all("re-planned")  # a leader about to be replaced sends what it holds at once
    assert [m["token_ids"] for _, m in sent[3:] if m.type is MsgType.TOKENS] == [[11], []]
    assert sent[-1][1]["finish_reason"] == "error" and any(m.type is MsgType.RELEASE for _, m in sent[3:])


def test_a_step_with_nothing_to_launch_still_sends_the_tokens() -> None:
    leader, sent = two_stage_leader()
    s = seq(2)
    s.max_tokens = 1
    leader.admit(s)
    leader.step()
    leader.on_results(results(1, [[2, [9], [1.0]]]))  # the first token is the last: nothing follows
    assert not leader.step()
    toks = [m for _, m in sent if m.type is MsgType.TOKENS]
    assert len(toks) == 1 and toks[0]["token_ids"] == [9] and toks[0]["finished"]


def test_tokens_go_out_before_a_launch_that_carries_a_prompt() -> None:
    """A prompt chunk makes a long step: the tokens ready before it do not wait for it."""
    leader, sent = two_stage_leader()
    leader.admit(seq(1))
    leader.step()
    leader.on_results(results(1, [[1, [9], [1.0]]]))
    leader.admit(seq(2))  # its prompt joins the next micro-batch beside seq 1's decode row
    assert leader.step()
    assert [m.type for _, m in sent[1:]] == [MsgType.TOKENS, MsgType.ACTIVATIONS]
    assert sorted(sp[0] for sp in sent[2][1]["spans"]) == [1, 2]
