"""What this node does under the current plan: it applies each new PLAN and routes the data
plane to its stage and, on a replica's first node, to the replica's leader.

All data-plane messages (ACTIVATIONS, RESULTS, KV_TRANSFER, KV_ACK, GENERATE_REQ, HANDOFF,
RELEASE) run on one compute `Worker`; the leader's scheduler is that worker's background step,
so a micro-batch is launched whenever no message is waiting. PLAN arrives on the I/O thread and
is applied on the compute thread: in-flight sequences of the old plan fail with a clear error
(recovering them is the reliability issue's job), the node keeps its shard when its layers did
not change, and otherwise loads only its own layer range. Messages of another plan version are
dropped (logged once per version).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from meshllm.mesh.protocol import Message, MsgType, ProtocolError, check_seq, make
from meshllm.mesh.transport import Transport, Worker
from meshllm.partition.plan import Plan, PlanError
from meshllm.roles.context import PlanContext

log = logging.getLogger("meshllm.host")


class RoleHost:
    def __init__(self, transport: Transport, me: str, model: str, pacer_factory: Callable | None = None):
        self.t, self.me, self.model_spec = transport, me, model
        self.pacer_factory = pacer_factory  # (ctx, stage index, layers) -> Pacer | None
        self.worker = Worker(f"compute-{me}", self._step)
        self.ctx: PlanContext | None = None
        self.offered = 0  # newest plan version received (applied or being applied)
        self.ready_version = 0  # plan version whose stage is loaded and serving
        self.stage = self.leader = self.acks = None
        self._shard_key: tuple | None = None
        self._model = None
        self._weights_mb = 0.0
        self._stale_logged: set[int] = set()
        self.listeners: list[Callable[[PlanContext], None]] = []  # e.g. the gateway
        for mtype, fn in ((MsgType.ACTIVATIONS, self._on_activations), (MsgType.RESULTS, self._on_results),
                          (MsgType.KV_TRANSFER, self._on_kv), (MsgType.KV_ACK, self._on_kv_ack),
                          (MsgType.GENERATE_REQ, self._on_generate), (MsgType.HANDOFF, self._on_handoff),
                          (MsgType.RELEASE, self._on_release)):
            transport.on(mtype, fn, self.worker)
        transport.on(MsgType.PLAN, self._on_plan)

    def start(self) -> None:
        self.worker.start()

    def close(self) -> None:
        self.worker.close()

    # -- plans ----------------------------------------------------------------------------------
    def _on_plan(self, msg: Message, reply: Callable) -> None:
        """I/O thread: a PLAN from the coordinator (it is re-published every second)."""
        self.offer(msg["version"], msg["plan"], msg["addresses"], str(msg["coordinator"]))

    def offer(self, version: int, plan_json: Any, addresses: Any, coordinator: str) -> None:
        """Take a newer plan (from the network, or from this node's own coordinator) and apply it
        on the compute thread. Malformed plans are a ProtocolError."""
        if version <= self.offered:
            return
        try:
            plan = Plan.from_json(plan_json)
        except PlanError as e:
            raise ProtocolError(f"PLAN v{version} from {coordinator!r}: {e}") from None
        if not isinstance(addresses, dict):
            raise ProtocolError(f"PLAN v{version}: addresses must be a map")
        addresses = {str(k): str(v) for k, v in addresses.items()}
        missing = {s.node for r in plan.replicas for s in r.stages} - set(addresses)
        if missing:
            raise ProtocolError(f"PLAN v{version}: no address for {sorted(missing)}")
        self.offered = version
        ctx = PlanContext(version, plan, addresses, self.me)
        log.info("%s: plan v%d from %s: %s", self.me, version, coordinator, self._describe(ctx))
        self.worker.submit(lambda: self.apply(ctx))

    def apply(self, ctx: PlanContext) -> None:
        """Compute thread: serve `ctx` from now on."""
        if ctx.version < self.offered:
            return  # an even newer plan is queued behind this one
        if self.leader is not None:
            self.leader.fail_all(f"the mesh was re-planned (plan v{ctx.version}); retry the request")
        self.ctx, self.stage, self.leader, self.acks = ctx, None, None, None
        mine = ctx.mine
        if mine is not None:
            self._build_stage(ctx, *mine)
        self.ready_version = ctx.version
        for fn in self.listeners:
            fn(ctx)

    def _build_stage(self, ctx: PlanContext, replica, index: int) -> None:
        from meshllm.roles.decode import KvAcks  # lazy: torch
        from meshllm.roles.leader import Leader
        from meshllm.roles.prefill import handoff
        from meshllm.roles.stage import Stage

        layers = replica.stages[index].layers
        model = self._load_shard(layers)
        pacer = self.pacer_factory(ctx, index, layers) if self.pacer_factory else None
        self.stage = Stage(ctx, model, self.send, pacer)
        if index == 0:
            self.leader = Leader(self.stage, self.send, model.args.max_seq_len,
                                 lambda s, finished: handoff(ctx, self.send, s, finished))
            self.acks = KvAcks(self.leader)

    def _load_shard(self, layers: tuple[int, int]):
        key = (self.model_spec, layers)
        if key != self._shard_key:
            from meshllm.engine.weights import load_transformer, weight_bytes

            t0 = time.perf_counter()
            self._model = None  # free the old shard before loading the new one
            self._model = load_transformer(self.model_spec, *layers)
            self._shard_key = key
            self._weights_mb = weight_bytes(self._model) / 1e6
            log.info("%s: loaded layers [%d, %d) of %s in %.1f s (resident %.0f MB)", self.me, *layers,
                     self.model_spec, time.perf_counter() - t0, rss_mb())
        return self._model

    def _describe(self, ctx: PlanContext) -> str:
        mine = ctx.mine
        if mine is None:
            return "drafter" if self.me in ctx.plan.drafters else "no stage"
        r, i = mine
        return f"{r.role} replica {r.id}, stage {i + 1}/{len(r.stages)}, layers {list(r.stages[i].layers)}"

    # -- data plane (compute thread) ------------------------------------------------------------
    def send(self, address: str, msg: Message) -> None:
        self.t.send(address, msg)

    def _current(self, msg: Message) -> bool:
        v = msg.fields.get("plan_version")
        if self.ctx is not None and v == self.ctx.version:
            return True
        if v not in self._stale_logged:
            self._stale_logged.add(v)
            log.warning("%s: dropping %s of plan v%s (serving v%s)", self.me, msg.type.name, v,
                        self.ctx.version if self.ctx else None)
        return False

    def _need(self, what: str, msg: Message):
        obj = getattr(self, what)
        if obj is None:
            raise ProtocolError(f"{msg.type.name} for a {what} this node does not run under plan "
                                f"v{self.ctx.version if self.ctx else None}")
        return obj

    def _on_activations(self, msg: Message, reply: Callable) -> None:
        if self._current(msg):
            self._need("stage", msg).on_activations(msg)

    def _on_results(self, msg: Message, reply: Callable) -> None:
        if self._current(msg):
            self._need("leader", msg).on_results(msg)

    def _on_kv(self, msg: Message, reply: Callable) -> None:
        if self._current(msg) and self._need("stage", msg).on_kv_transfer(msg):
            leader_node = self.stage.replica.stages[0].node
            if leader_node == self.me:
                self.acks.on_ack(msg["seq"], self.me)
            else:
                self.send(self.ctx.address(leader_node), make_ack(msg["seq"], self.me, msg["length"], self.ctx))

    def _on_kv_ack(self, msg: Message, reply: Callable) -> None:
        if self._current(msg):
            self._need("acks", msg).on_ack(check_seq(msg["seq"]), str(msg["node"]))

    def _on_generate(self, msg: Message, reply: Callable) -> None:
        from meshllm.roles.prefill import seq_from_generate

        if not self._current(msg):
            self._refuse(msg, "stale_plan")
            return
        leader = self._need("leader", msg)
        args = self.stage.model.args
        leader.admit(seq_from_generate(msg, self.ctx, leader.rid, args.vocab_size, args.max_seq_len))

    def _on_handoff(self, msg: Message, reply: Callable) -> None:
        if self._current(msg):
            self._need("acks", msg).on_handoff(msg, self.stage.model.args.vocab_size)

    def _on_release(self, msg: Message, reply: Callable) -> None:
        seq = check_seq(msg["seq"])
        if self.leader is not None:
            if seq not in self.leader.seqs:
                self.acks.forget(seq)  # its HANDOFF may still be on the way
            self.leader.abort(seq)
        elif self.stage is not None:
            self.stage.release(seq)

    def _refuse(self, msg: Message, code: str) -> None:
        """Tell the gateway at once that a request cannot be taken (it retries or fails it)."""
        gw = msg.fields.get("gateway")
        if isinstance(gw, str) and isinstance(msg.fields.get("seq"), int):
            self.send(gw, make(MsgType.TOKENS, seq=msg["seq"], token_ids=[], index=0, finished=True,
                               finish_reason="error", error=f"{code}: this node serves plan "
                                                            f"v{self.ctx.version if self.ctx else None}"))

    def _step(self) -> bool:
        return self.leader.step() if self.leader is not None else False

    # -- reporting -------------------------------------------------------------------------------
    def load(self) -> dict[str, Any]:
        out: dict[str, Any] = {"plan_version": self.ready_version, "rss_mb": round(rss_mb(), 1)}
        if self.stage is not None:
            st = self.stage
            out["stage"] = {"replica": st.replica.id, "index": st.index, "layers": list(st.layers),
                            "weights_mb": round(self._weights_mb, 1),
                            "kv_bytes_sent": st.kv_bytes_sent, "kv_bytes_received": st.kv_bytes_received,
                            "tokens": {k.name.lower(): v for k, v in st.tokens_computed.items()},
                            "kv_cache_bytes": st.cache.nbytes()}
            if st.pacer is not None:
                out["stage"]["pacer"] = {"steps": st.pacer.steps, "slept_s": round(st.pacer.slept_s, 3),
                                         "overrun_s": round(st.pacer.overrun_s, 3)}
        if self.leader is not None:
            out["leader"] = self.leader.load()
        return out

    def status(self) -> dict[str, Any]:
        """What `--status` and the heartbeats say of this node's part in the plan."""
        return {"plan_version": self.ready_version, "roles": self.roles(), "load": self.load()}

    def roles(self) -> list[str]:
        if self.ctx is None:
            return []
        mine = self.ctx.mine
        if mine is not None:
            return [str(mine[0].role)]
        return ["drafter"] if self.me in self.ctx.plan.drafters else []


def make_ack(seq: int, node: str, length: int, ctx: PlanContext) -> Message:
    return make(MsgType.KV_ACK, seq=seq, node=node, length=length, plan_version=ctx.version)


def rss_mb() -> float:
    """This process's resident memory in MB (psutil; /proc fallback)."""
    try:
        import psutil

        return psutil.Process(os.getpid()).memory_info().rss / 1e6
    except ImportError:  # pragma: no cover - psutil is a dependency
        return 0.0
