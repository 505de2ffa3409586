"""The data plane of a node: one handler per message type, run on the node's compute Worker
(ACTIVATIONS, RESULTS, KV_TRANSFER, KV_ACK, GENERATE_REQ, HANDOFF, RELEASE, DRAFT, VERDICT,
SESSION, CAPACITY), each handing its message to the role the current plan gives this node
(RoleHost, roles/host.py, builds those roles and holds them). Messages of another plan version
are dropped (logged once per version); a message for a role this node does not run is a
ProtocolError, answered to its sender.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from meshllm.defaults import DECODE_TARGETS
from meshllm.mesh.fields import check_seq, is_address
from meshllm.mesh.protocol import Message, MsgType, ProtocolError, make
from meshllm.roles.context import PlanContext

if TYPE_CHECKING:
    from meshllm.roles.host import RoleHost

log = logging.getLogger("meshllm.host")


class DataPlane:
    def __init__(self, host: RoleHost):
        self.h = host
        self._stale_logged: set[int] = set()
        for mtype, fn in ((MsgType.ACTIVATIONS, self._on_activations), (MsgType.RESULTS, self._on_results),
                          (MsgType.KV_TRANSFER, self._on_kv), (MsgType.KV_ACK, self._on_kv_ack),
                          (MsgType.GENERATE_REQ, self._on_generate), (MsgType.HANDOFF, self._on_handoff),
                          (MsgType.RELEASE, self._on_release), (MsgType.DRAFT, self._on_draft),
                          (MsgType.VERDICT, self._on_verdict), (MsgType.SESSION, self._on_session),
                          (MsgType.CAPACITY, self._on_capacity)):
            host.t.on(mtype, fn, host.worker)
        host.t.on(MsgType.KV_RESERVE, self._on_reserve)  # on the I/O thread: answered at once, never behind compute

    def _current(self, msg: Message) -> bool:
        """A message of a plan version this node's roles still serve (built at `_epoch`, kept since)."""
        h = self.h
        v = msg.fields.get("plan_version")
        if h.ctx is not None and isinstance(v, int) and h._epoch <= v <= h.ctx.version:
            return True
        if v not in self._stale_logged:
            if len(self._stale_logged) >= 64:  # versions from the network: keep the memory bounded
                self._stale_logged.clear()
            self._stale_logged.add(v)
            log.warning("%s: dropping %s of plan v%s (serving v%s)", h.me, msg.type.name, v,
                        h.ctx.version if h.ctx else None)
        return False

    def _need(self, what: str, msg: Message):
        h = self.h
        obj = getattr(h, what)
        if obj is None:
            raise ProtocolError(f"{msg.type.name} for a {what} this node does not run under plan "
                                f"v{h.ctx.version if h.ctx else None}")
        return obj

    def _on_activations(self, msg: Message, reply: Callable) -> None:
        if self._current(msg):
            self._need("stage", msg).on_activations(msg)

    def _on_results(self, msg: Message, reply: Callable) -> None:
        if self._current(msg):
            self._need("leader", msg).on_results(msg)

    def _on_kv(self, msg: Message, reply: Callable) -> None:
        h = self.h
        if h.acks is not None and isinstance(msg["seq"], int):
            h.acks.check_length(msg["seq"], msg["length"])  # before the import
        if self._current(msg) and self._need("stage", msg).on_kv_transfer(msg):
            leader_node = h.stage.replica.stages[0].node
            if leader_node == h.me:
                h.acks.on_ack(msg["seq"], h.me, msg["length"])
            else:
                h.send(h.ctx.address(leader_node), make_ack(msg["seq"], h.me, msg["length"], h.ctx))

    def _on_kv_ack(self, msg: Message, reply: Callable) -> None:
        h = self.h
        if self._current(msg):
            node = msg["node"]
            if node == h.me or node != msg.src:  # this node's own stage acknowledges in-process
                raise ProtocolError(f"KV_ACK for {node!r} from {msg.src!r}")
            self._need("acks", msg).on_ack(check_seq(msg["seq"]), node, msg["length"])

    def _on_generate(self, msg: Message, reply: Callable) -> None:
        from meshllm.roles.prefill import seq_from_generate

        h = self.h
        if not self._current(msg):
            self._refuse(msg, "stale_plan")
            return
        leader = self._need("leader", msg)
        args = h.stage.model.args
        s = seq_from_generate(msg, h.ctx, leader.rid, args.vocab_size, args.max_seq_len)
        if h.stage.released(s.id):  # its RELEASE (the client went away) overtook it: no one waits for it
            log.info("%s: seq %d was released before its GENERATE_REQ came; not running it", h.me, s.id)
            return
        if s.id in leader.seqs or s.id in h.stage.cache:  # a second Seq would break its KV's batches
            raise ProtocolError(f"seq {s.id} is already running on replica {leader.rid}")
        leader.batch.admit(s)

    def _on_handoff(self, msg: Message, reply: Callable) -> None:
        h = self.h
        if self._current(msg):
            self._need("acks", msg).on_handoff(msg, h.stage.model.args.vocab_size)

    def _on_draft(self, msg: Message, reply: Callable) -> None:
        h = self.h
        if self._current(msg) and h.leader is not None and h.leader.verifier is not None:
            h.leader.verifier.on_draft(msg, h.stage.model.args.vocab_size)

    def _on_verdict(self, msg: Message, reply: Callable) -> None:
        h = self.h
        if h.drafter is not None:
            h.drafter.on_verdict(msg)

    def _on_session(self, msg: Message, reply: Callable) -> None:
        h = self.h
        if not self._current(msg):
            return
        self._need("drafter", msg).on_session(msg, h.shard.model.args.vocab_size)

    def _on_capacity(self, msg: Message, reply: Callable) -> None:
        h = self.h
        if h.balancer is not None and self._current(msg):
            h.balancer.on_capacity(msg)

    def _on_reserve(self, msg: Message, reply: Callable) -> None:
        """A gateway asks for KV room on this node's decode (or mixed) replica before it sends a
        request there (roles/batcher.py KvGrants)."""
        h = self.h
        leader, ctx, seq, positions = h.leader, h.ctx, check_seq(msg["seq"]), msg["positions"]
        if leader is None or ctx is None or msg["plan_version"] != ctx.version or msg["replica"] != leader.rid:
            raise ProtocolError(f"KV_RESERVE for replica {msg['replica']!r:.20} of plan v{msg['plan_version']!r:.20}: "
                                f"this node leads no such replica (plan v{ctx.version if ctx else None})")
        if str(leader.role) not in DECODE_TARGETS or type(positions) is not int or not 0 < positions <= 1 << 40:
            raise ProtocolError(f"KV_RESERVE of {positions!r:.20} positions on {leader.role} replica {leader.rid}")
        reply(make(MsgType.KV_GRANT, seq=seq, granted=leader.batch.grants.grant(seq, positions)))

    def _on_release(self, msg: Message, reply: Callable) -> None:
        h = self.h
        seq = check_seq(msg["seq"])
        ship_to, length = msg.fields.get("ship_to"), msg.fields.get("length")
        if h.stage is not None and h.leader is None and (ship_to is not None or length is not None):
            if not (type(ship_to) is int and type(length) is int and length >= 1  # bool is no replica id
                    and h.ctx.has_replica(ship_to) and h.ctx.replica(ship_to).role == "decode"):
                raise ProtocolError(f"RELEASE of seq {seq}: cannot move {length!r:.20} positions to replica "
                                    f"{ship_to!r:.20}")
            h.stage.migrate_out(seq, ship_to, length)  # the session moves to another replica
            return
        if h.drafter is not None:
            h.drafter.end(seq)
        if h.leader is not None:
            if seq not in h.leader.seqs:
                h.acks.forget(seq)  # its HANDOFF may still be on the way
            h.leader.abort(seq)
        elif h.stage is not None:
            h.stage.release(seq)

    def _refuse(self, msg: Message, code: str) -> None:
        """Tell the gateway at once that a request cannot be taken (it retries or fails it)."""
        h = self.h
        gw = msg.fields.get("gateway")
        if is_address(gw) and isinstance(msg.fields.get("seq"), int):
            h.send(gw, make(MsgType.TOKENS, seq=msg["seq"], token_ids=[], index=0, finished=True,
                            finish_reason="error", refused=code, error=f"{code}: this node serves plan "
                                                                      f"v{h.ctx.version if h.ctx else None}"))


def make_ack(seq: int, node: str, length: int, ctx: PlanContext) -> Message:
    return make(MsgType.KV_ACK, seq=seq, node=node, length=length, plan_version=ctx.version)
