"""Decode side: a HANDOFF becomes a sequence of this decode replica, which starts decoding once
every stage holds its KV (each stage acknowledges with KV_ACK; acknowledgements may arrive
before the HANDOFF itself, because KV goes stage to stage while the first token takes the
longer way through both leaders)."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

from meshllm.defaults import Role
from meshllm.engine.sampling import SamplingParams
from meshllm.engine.speculative import AcceptanceStats, extend_hash
from meshllm.mesh.fields import (
    check_address,
    check_int_list,
    check_offset,
    check_sampling,
    check_seq,
    sampling_map,
)
from meshllm.mesh.protocol import Message, MsgType, ProtocolError, make
from meshllm.roles.batcher import MAX_ACTIVE_SEQS, Seq
from meshllm.roles.leader import Leader

log = logging.getLogger("meshllm.decode")

EARLY_ACKS_MAX = 4096  # acknowledgements held for sequences whose HANDOFF has not come yet
EARLY_ACK_TTL_S = 300.0  # x time_scale: longer than any HANDOFF takes to follow its stages' KV_ACKs


class KvAcks:
    """Which stages of this replica still owe a sequence's KV."""

    def __init__(self, leader: Leader):
        self.leader = leader
        self.nodes = frozenset(st.node for st in leader.stage.replica.stages)
        self._early: OrderedDict[int, tuple[float, set[str]]] = OrderedDict()
        self._gone: OrderedDict[int, None] = OrderedDict()  # aborted before their HANDOFF
        self.ttl_s = EARLY_ACK_TTL_S * leader.time_scale

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
        check_address(msg["gateway"], "gateway")
        offset = check_offset(msg.fields, seq)
        s = Seq(seq, [], p_len, max_tokens, SamplingParams(temperature, top_k, top_p), seed, stop,
                str(msg["gateway"]), self.leader.rid, out=list(out), fed=p_len + len(out) - 1,
                drafter=str(msg["drafter"]), hash=extend_hash(0, out))
        s.offset = offset
        spec = msg.fields.get("spec")  # a moved session's drafting figures so far (Balancer.migrate)
        if isinstance(spec, dict):
            try:
                s.spec.merge(spec)
            except (TypeError, ValueError, AttributeError) as e:
                s.spec = AcceptanceStats()  # another node's malformed figures: dropped, not fatal
                log.warning("seq %d: HANDOFF's drafting figures are malformed (%s); dropped", seq, type(e).__name__)
        at, ms = msg.fields.get("prefilled_at"), msg.fields.get("prefill_ms")
        if isinstance(at, float) and isinstance(ms, (int, float)):
            s.prefilled_at, s.prefill_s = at, ms / 1000
        early = self._early.pop(seq, (0.0, {}))[1]
        s.missing_kv = set(self.nodes) - {node for node, length in early.items() if length == s.fed}
        self.leader.batch.admit(s)
        if at is None:
            self.leader.stats["migrated_in"] = self.leader.stats.get("migrated_in", 0) + 1
        if s.drafter and self.leader.verifier is not None:
            self.leader.verifier.started(s)  # drafting overlaps the KV transfer
        if not s.missing_kv:
            self.leader.kv_ready(s)

    def check_length(self, seq: int, length: int) -> None:
        """KV for a sequence waiting here must hold exactly the positions it was handed off with: a
        sequence started on shorter KV would fail every micro-batch it joins (and its neighbours')."""
        s = self.leader.seqs.get(seq)
        if s is not None and (not s.missing_kv or length != s.fed):
            raise ProtocolError(f"seq {seq}: KV of {length} positions, the sequence needs "
                                f"{s.fed if s.missing_kv else 'none'}")

    def on_ack(self, seq: int, node: str, length: int) -> None:
        if node not in self.nodes:
            raise ProtocolError(f"KV_ACK from {node!r}, not a stage of replica {self.leader.rid}")
        s = self.leader.seqs.get(seq)
        if s is not None:
            if node in s.missing_kv:
                self.check_length(seq, length)
                s.missing_kv.discard(node)
                if not s.missing_kv:
                    self.leader.kv_ready(s)
            return
        if seq in self._gone:
            return
        now = time.monotonic()
        self._early.setdefault(seq, (now, {}))[1][node] = length
        while self._early and (len(self._early) > EARLY_ACKS_MAX
                               or now - next(iter(self._early.values()))[0] > self.ttl_s):
            self._early.popitem(last=False)

    def forget(self, seq: int) -> None:
        """An abort before the HANDOFF: drop its acknowledgements and any HANDOFF still coming."""
        self._early.pop(seq, None)
        self._gone[seq] = None
        while len(self._gone) > EARLY_ACKS_MAX:
            self._gone.popitem(last=False)


CAPACITY_TOPIC = "cap"
MIGRATE_CHECK_S = 1.0
MIGRATE_GAP = 2  # move a session when this replica decodes this many more than one with free slots
CAPACITY_TTL_S = 5.0  # a replica that stopped publishing its capacity is not a target


class Balancer:
    """A decode replica's leader publishes its capacity (CAPACITY on the `cap` topic: free slots,
    and the KV positions its room has left when known) and, when it carries clearly more sessions
    than another decode replica with free slots, moves one whose KV fits there:
    each of its stages ships the session's KV (the committed positions only) to the stages of the
    other replica holding those layers, and the leader hands the session over (HANDOFF with its
    whole output). The other replica tells the session's drafter, which publishes on the new
    replica's topic from then on. KV moves instead of a re-prefill: on the links measured here
    shipping a session's KV costs a small fraction of recomputing it (bench/speculative.py)."""

    def __init__(self, leader: Leader, send, publish, alive=lambda node: True):
        self.leader, self._send, self._publish, self.alive = leader, send, publish, alive
        self.peers: dict[int, tuple[float, int, int]] = {}  # replica -> (heard at, active, free slots)
        self._checked = 0.0
        self.moved_out = 0

    def publish_capacity(self) -> None:
        lead = self.leader
        active = lead.batch.active()
        free = 0 if lead.queue else max(0, MAX_ACTIVE_SEQS - active)  # a queue waits for slots or KV room
        room = lead.batch.kv_room  # KV positions not reserved (roles/batcher.py), when the room is known
        kv = {} if room is None else {"kv_free": max(0, room - lead.batch.kv_held)}
        self._publish(make(MsgType.CAPACITY, node=lead.stage.ctx.me, replica=lead.rid,
                           free_slots=free, queue=len(lead.queue),
                           plan_version=lead.ctx.version, active=active, **kv))

    def on_capacity(self, msg: Message) -> None:
        rid, ctx = msg["replica"], self.leader.ctx
        if rid != self.leader.rid and ctx.has_replica(rid) and ctx.replica(rid).role == Role.DECODE \
                and msg["node"] == msg.src == ctx.replica(rid).stages[0].node:  # from that replica's leader
            active, kv = msg.fields.get("active"), msg.fields.get("kv_free")
            kv = kv if isinstance(kv, int) and not isinstance(kv, bool) else None
            self.peers[rid] = (time.monotonic(), max(0, active) if isinstance(active, int) else 0,
                               msg["free_slots"], kv)

    def rebalance(self) -> None:
        now = time.monotonic()
        if now - self._checked < MIGRATE_CHECK_S:
            return
        self._checked = now
        ctx = self.leader.ctx
        live = [(active, rid, free, kv) for rid, (at, active, free, kv) in self.peers.items()
                if now - at < CAPACITY_TTL_S and free > 0 and ctx.has_replica(rid)
                and all(self.alive(st.node) for st in ctx.replica(rid).stages)]
        if not live:
            return
        active, rid, free, kv = min(live, key=lambda x: x[:2])
        movable = [s for s in self.leader.seqs.values() if s.id not in self.leader.queue and not s.busy
                   and not s.missing_kv and s.out and (kv is None or s.kv_charge <= kv)]  # its KV fits there
        if self.leader.batch.active() - active >= MIGRATE_GAP and movable:
            self.migrate(movable[0], rid)
            self.peers[rid] = (self.peers[rid][0], active + 1, free - 1,
                               None if kv is None else kv - movable[0].kv_charge)

    def migrate(self, s: Seq, rid: int) -> None:
        lead, ctx = self.leader, self.leader.ctx
        del lead.seqs[s.id]
        if lead.verifier is not None:
            lead.verifier.forget(s.id)
        for st in lead.stage.replica.stages[1:]:
            self._send(ctx.address(st.node), make(MsgType.RELEASE, seq=s.id, reason="migrate", ship_to=rid,
                                                  length=s.fed))
        lead.stage.migrate_out(s.id, rid, s.fed)
        p = s.params
        self._send(ctx.leader(rid), make(
            MsgType.HANDOFF, seq=s.id, prompt_len=s.prompt_len, tokens=list(s.out), max_tokens=s.max_tokens,
            sampling=sampling_map(p.temperature, p.top_k, p.top_p, s.seed), stop_ids=sorted(s.stop_ids),
            gateway=s.gateway, drafter=s.drafter, plan_version=ctx.version, offset=s.offset,
            **({"spec": s.spec.to_json()} if s.spec.blocks or s.spec.stale else {})))  # the request's figures go on
        # the gateway follows the session (a re-plan that changes replica `rid` resumes the request)
        self._send(s.gateway, make(MsgType.TOKENS, seq=s.id, token_ids=[], index=s.offset + len(s.out),
                                   finished=False, finish_reason=None, moved_to=rid))
        self.moved_out += 1
        lead.stats["migrated_out"] = self.moved_out
        log.info("replica %d: session %d moved to replica %d (%d tokens so far)", lead.rid, s.id, rid, len(s.out))
