"""Prefill side: a GENERATE_REQ becomes a sequence of this replica; after its last prompt chunk,
the prefill replica hands it to the decode replica the gateway chose.

The KV itself was pushed by every stage as soon as it finished the last chunk (roles/stage.py);
what goes to the decode replica's leader here is the first token and the sequence's settings
(HANDOFF). If the first token already ends the sequence, the decode replica frees the KV it was
sent instead (RELEASE to each of its stages; they drop KV that arrives after it).
"""

from __future__ import annotations

import time

from meshllm.defaults import DECODE_TARGETS
from meshllm.engine.sampling import SamplingParams
from meshllm.mesh.fields import (
    check_address,
    check_int_list,
    check_offset,
    check_sampling,
    check_seq,
    sampling_map,
)
from meshllm.mesh.protocol import Message, MsgType, ProtocolError, make
from meshllm.roles.batcher import Seq
from meshllm.roles.context import PlanContext
from meshllm.roles.stage import Send

MAX_PROMPT_IDS = 1 << 20  # a prompt longer than any context is refused before it is stored


def seq_from_generate(msg: Message, ctx: PlanContext, my_rid: int, vocab: int, max_context: int) -> Seq:
    """Validate a GENERATE_REQ addressed to this replica's leader and build its sequence."""
    seq = check_seq(msg["seq"])
    ids = check_int_list(msg["prompt_token_ids"], "prompt_token_ids", 0, vocab - 1, MAX_PROMPT_IDS)
    if not ids or len(ids) >= max_context:
        raise ProtocolError(f"seq {seq}: prompt of {len(ids)} tokens; the context holds {max_context}")
    if not isinstance(msg["max_tokens"], int) or msg["max_tokens"] < 1:
        raise ProtocolError(f"seq {seq}: max_tokens must be a positive integer")
    temperature, top_k, top_p, seed = check_sampling(msg["sampling"])
    stop = frozenset(check_int_list(msg["stop_ids"], "stop_ids", 0, vocab - 1, 64))
    check_address(msg["gateway"], "gateway")
    rid = msg["decode_replica"]
    if rid != my_rid and not (ctx.has_replica(rid) and ctx.replica(rid).role in DECODE_TARGETS):
        raise ProtocolError(f"seq {seq}: decode replica {rid} is not a decode or mixed replica of plan v{ctx.version}")
    offset = check_offset(msg.fields, seq)
    return Seq(seq, ids, len(ids), msg["max_tokens"], SamplingParams(temperature, top_k, top_p), seed, stop,
               str(msg["gateway"]), rid, drafter=str(msg["drafter"]), offset=offset)


def handoff(ctx: PlanContext, send: Send, s: Seq, finished: bool) -> None:
    """After the first token: give the sequence to its decode replica, or free its KV there."""
    if finished:
        for st in ctx.replica(s.decode_rid).stages:
            send(ctx.address(st.node), make(MsgType.RELEASE, seq=s.id, reason="finished at its first token"))
        return
    p = s.params
    send(ctx.leader(s.decode_rid),
         make(MsgType.HANDOFF, seq=s.id, prompt_len=s.prompt_len, tokens=list(s.out), max_tokens=s.max_tokens,
              sampling=sampling_map(p.temperature, p.top_k, p.top_p, s.seed), stop_ids=sorted(s.stop_ids),
              gateway=s.gateway, drafter=s.drafter, plan_version=ctx.version, offset=s.offset,
              prefill_ms=round(1000 * s.prefill_s, 3),
              prefilled_at=time.monotonic()))
