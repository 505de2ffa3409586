"""Decode side: a HANDOFF becomes a sequence of this decode replica, which starts decoding once
every stage holds its KV (each stage acknowledges with KV_ACK; acknowledgements may arrive
before the HANDOFF itself, because KV goes stage to stage while the first token takes the
longer way through both leaders)."""

from __future__ import annotations

import time
from collections import OrderedDict

from meshllm.engine.sampling import SamplingParams
from meshllm.engine.speculative import extend_hash
from meshllm.mesh.protocol import Message, ProtocolError, check_int_list, check_sampling, check_seq
from meshllm.roles.leader import Leader, Seq

EARLY_ACKS_MAX = 4096  # acknowledgements held for sequences whose HANDOFF has not come yet
EARLY_ACK_TTL_S = 300.0


class KvAcks:
    """Which stages of this replica still owe a sequence's KV."""

    def __init__(self, leader: Leader):
        self.leader = leader
        self.nodes = frozenset(st.node for st in leader.stage.replica.stages)
        self._early: OrderedDict[int, tuple[float, set[str]]] = OrderedDict()
        self._gone: OrderedDict[int, None] = OrderedDict()  # aborted before their HANDOFF

    def on_handoff(self, msg: Message, vocab: int) -> None:
        seq = check_seq(msg["seq"])
        if seq in self._gone or seq in self.leader.seqs:
            return  # aborted already, or a duplicate
        p_len, max_tokens = msg["prompt_len"], msg["max_tokens"]
        out = check_int_list(msg["tokens"], "tokens", 0, vocab - 1, self.leader.max_context)
        if p_len < 1 or not out or max_tokens <= len(out) or p_len + len(out) >= self.leader.max_context:
            raise ProtocolError(f"seq {seq}: bad HANDOFF (prompt_len {p_len}, {len(out)} tokens, "
                                f"max_tokens {max_tokens})")
        temperature, top_k, top_p, seed = check_sampling(msg["sampling"])
        stop = frozenset(check_int_list(msg["stop_ids"], "stop_ids", 0, vocab - 1, 64))
        s = Seq(seq, [], p_len, max_tokens, SamplingParams(temperature, top_k, top_p), seed, stop,
                str(msg["gateway"]), self.leader.rid, out=list(out), fed=p_len + len(out) - 1,
                drafter=str(msg["drafter"]), hash=extend_hash(0, out))
        at, ms = msg.fields.get("prefilled_at"), msg.fields.get("prefill_ms")
        if isinstance(at, float) and isinstance(ms, (int, float)):
            s.prefilled_at, s.prefill_s = at, ms / 1000
        s.missing_kv = set(self.nodes) - self._early.pop(seq, (0.0, set()))[1]
        self.leader.admit(s)
        if s.drafter and self.leader.verifier is not None:
            self.leader.verifier.started(s)  # drafting overlaps the KV transfer
        if not s.missing_kv:
            self.leader.kv_ready(s)

    def on_ack(self, seq: int, node: str) -> None:
        if node not in self.nodes:
            raise ProtocolError(f"KV_ACK from {node!r}, not a stage of replica {self.leader.rid}")
        s = self.leader.seqs.get(seq)
        if s is not None:
            if node in s.missing_kv:
                s.missing_kv.discard(node)
                if not s.missing_kv:
                    self.leader.kv_ready(s)
            return
        if seq in self._gone:
            return
        now = time.monotonic()
        self._early.setdefault(seq, (now, set()))[1].add(node)
        while self._early and (len(self._early) > EARLY_ACKS_MAX
                               or now - next(iter(self._early.values()))[0] > EARLY_ACK_TTL_S):
            self._early.popitem(last=False)

    def forget(self, seq: int) -> None:
        """An abort before the HANDOFF: drop its acknowledgements and any HANDOFF still coming."""
        self._early.pop(seq, None)
        self._gone[seq] = None
        while len(self._gone) > EARLY_ACKS_MAX:
            self._gone.popitem(last=False)
