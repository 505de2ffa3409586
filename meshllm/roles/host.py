"""What this node does under the current plan: it applies each new PLAN and builds this node's
roles: its stage and, on a replica's first node, the replica's leader (with the verifier of a
decode or mixed replica), or, on a drafter, its draft server.

All data-plane messages (ACTIVATIONS, RESULTS, KV_TRANSFER, KV_ACK, GENERATE_REQ, HANDOFF,
RELEASE, DRAFT, VERDICT, SESSION, CAPACITY) run on one compute `Worker`, each handed to its
role by roles/dispatch.py (messages of another plan version are dropped there, logged once
per version); the leader's scheduler (or the drafter's loop) is that worker's background step,
so a micro-batch is launched whenever no message is waiting. PLAN arrives on the I/O thread and
is applied on the compute thread: in-flight sequences of the old plan fail with a clear error
(recovering them is the reliability issue's job), the node keeps its shard when its layers did
not change, and otherwise loads only its own layer range.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from meshllm.defaults import DECODE_TARGETS, STAGE_ROLES, Role
from meshllm.errors import InputError, LoadCancelled, ModelFileError
from meshllm.mesh.loop import Worker
from meshllm.mesh.membership import Membership, PeerState
from meshllm.mesh.protocol import (
    MAX_PLAN_VERSION,
    Message,
    MsgType,
    ProtocolError,
)
from meshllm.mesh.transport import Transport, topic
from meshllm.node_config import NodeConfig
from meshllm.partition.cost import DRAFT_DTYPE, model_costs
from meshllm.partition.plan import Plan, PlanError
from meshllm.roles.context import PlanContext
from meshllm.roles.dispatch import DataPlane
from meshllm.roles.pacer import pacer_factory
from meshllm.roles.shard import IdleTrim, ShardHolder, rss_mb
from meshllm.roles.weights_fetch import MeshWeights

log = logging.getLogger("meshllm.host")

SNAPSHOT_S = 0.5  # how stale the figures in heartbeats and --status may be


def draft_topic(rid: int) -> str:
    """The pub/sub topic a decode replica's drafters publish their blocks on."""
    return f"draft/{rid}"


def own_model_id(spec: str) -> str | None:
    """This node's model file's content_id; None without a file here (it fetches the peers')."""
    from meshllm.engine.sources import content_id, resolve_model

    try:
        return content_id(resolve_model(spec))
    except (ModelFileError, InputError):
        return None


class RoleHost:
    def __init__(self, transport: Transport, cfg: NodeConfig, members: Membership | None = None):
        self.t, self.cfg, self.members = transport, cfg, members
        self.me, self.model_spec = cfg.id, cfg.model
        self.model_id = own_model_id(cfg.model)  # its file's content (None: no file here)
        self.weights = MeshWeights(transport, cfg, members)  # serves the model file's tensors, or fetches them
        self.pacer_factory = pacer_factory(cfg, self.weights.args) if cfg.pace else None  # (layers, dtype) -> Pacer
        self.worker = Worker(f"compute-{self.me}", self._step, self._wake_after, cfg.busy_poll_ms / 1000.0)
        self.drafter = None
        self._draft_topic: bytes | None = None
        self._epoch = 0  # plan version at which the current roles were built
        self.balancer = None  # decode replicas' leaders: capacity and session moves (roles/decode.py)
        self.ctx: PlanContext | None = None
        self.offered = 0  # newest plan version received (applied or being applied)
        self.newest: PlanContext | None = None  # ... and that plan
        self.max_seen = 0  # newest plan version seen from anyone (a new coordinator starts above it)
        self.coordinator_of: Callable[[], str] | None = None  # who this node obeys (set by the Node)
        self.ready_version = 0  # plan version whose stage is loaded and serving
        self.plan_error: dict[str, Any] | None = None  # why this node could not take its part of a plan
        self.stage = self.leader = self.acks = None
        self.shard = ShardHolder(self.me, cfg, self.weights)  # the weights held for this node's part
        self.trim = IdleTrim()  # freed heap back to the OS when no sequence is held
        self.listeners: list[Callable[[PlanContext], None]] = []  # e.g. the gateway
        self.data = DataPlane(self)  # every data-plane message, handed to the role that takes it
        self.figures = HostFigures(self)  # what heartbeats and --status say of this node
        transport.on(MsgType.PLAN, self._on_plan)

    def start(self) -> None:
        self.worker.start()
        self.weights.start()

    def close(self) -> None:
        self.worker.close()
        self.weights.close()

    # -- plans ----------------------------------------------------------------------------------
    def _on_plan(self, msg: Message, reply: Callable) -> None:
        """I/O thread: a PLAN from the coordinator (it is re-published every second)."""
        if not 0 < msg["version"] <= MAX_PLAN_VERSION:  # a huge one would freeze this node's plans
            raise ProtocolError(f"PLAN version {msg['version']} outside [1, {MAX_PLAN_VERSION}]")
        self.offer(msg["version"], msg["plan"], msg["addresses"], str(msg["coordinator"]), msg["incarnations"],
                   msg["model_id"])

    def offer(self, version: int, plan_json: Any, addresses: Any, coordinator: str, incarnations: Any,
              model_id: str = "") -> None:
        """Take a newer plan (from the network, or from this node's own coordinator) and apply it
        on the compute thread. Only the coordinator this node sees (the lowest live id) is obeyed:
        after a healed partition the other side's coordinator's plans are ignored. Malformed
        plans are a ProtocolError."""
        if isinstance(version, int):
            self.max_seen = max(self.max_seen, version)
        if version <= self.offered:
            return
        if self.coordinator_of is not None and coordinator != self.coordinator_of():
            log.info("%s: ignoring plan v%s from %s (the coordinator here is %s)", self.me, version, coordinator,
                     self.coordinator_of())
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
        if not isinstance(incarnations, dict) or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in incarnations.values()):
            raise ProtocolError(f"PLAN v{version}: incarnations must map node ids to integers")
        ctx = PlanContext(version, plan, addresses, self.me, {str(k): v for k, v in incarnations.items()})
        self.newest, self.offered = ctx, version  # (in this order: a load that sees the version sees its plan)
        log.info("%s: plan v%d from %s: %s", self.me, version, coordinator, describe(ctx, self.me))
        refuse = None
        if model_id and self.model_id and model_id != self.model_id:  # (a node with no file takes the peers')
            refuse = (f"its model file ({self.model_spec}: content {self.model_id}) is not the one of coordinator "
                      f"{coordinator} (content {model_id}): its part would give another model's output")
        self.worker.submit(lambda: self._apply_or_report(ctx, refuse))

    def _apply_or_report(self, ctx: PlanContext, refuse: str | None = None) -> None:
        """Compute thread: `apply(ctx)`. A node that cannot take its part (its layers or its draft could
        not be built: memory, a bad file, ...; `refuse`: its model is not the coordinator's) says so
        in its status (`plan_error`, until a plan applies), so the emulator and operators see it at
        once, not as a mesh that never serves; the coordinator plans without it."""
        if refuse is not None:
            self.plan_error = {"plan_version": ctx.version, "error": refuse}
            log.error("%s: refuses its part of plan v%d: %s", self.me, ctx.version, refuse)
            return
        try:
            self.apply(ctx)
        except LoadCancelled:
            log.info("%s: plan v%d came while it loaded its part of plan v%d: that load stopped", self.me,
                     self.offered, ctx.version)
        except Exception as e:
            self.plan_error = {"plan_version": ctx.version, "error": f"{type(e).__name__}: {e}"}
            log.exception("%s: could not take its part of plan v%d", self.me, ctx.version)
        else:
            self.plan_error = None

    def apply(self, ctx: PlanContext) -> None:
        """Compute thread: serve `ctx` from now on. A replica whose nodes and layers did not change
        keeps its sequences (only those handed to a replica that changed fail); anything else
        fails its in-flight sequences with a clear error and is rebuilt."""
        if ctx.version < self.offered:
            return  # an even newer plan is queued behind this one
        old, mine = self.ctx, ctx.mine
        if self.stage is not None and mine is not None and old is not None and old.mine is not None \
                and old.mine[1] == mine[1] and ctx.unchanged(old, mine[0].id):
            self._carry_over(old, ctx)
        elif self.drafter is not None and self.me in ctx.plan.drafters:
            self.ctx = ctx
            self.drafter.replan(lambda rid: ctx.unchanged(old, rid))
        else:
            if self.leader is not None:
                self.leader.fail_all(f"the mesh was re-planned (plan v{ctx.version}); retry the request")
            self.ctx, self.stage, self.leader, self.acks, self.drafter = ctx, None, None, None, None
            self.balancer = None
            self._epoch = ctx.version
            self._listen_drafts(None)
            if mine is not None:
                self._build_stage(ctx, *mine)
            elif self._part(ctx) == ("draft",):
                self._build_drafter()
            else:
                self.shard.warm_spare(ctx.version, self._superseded(ctx))
        self.ready_version = ctx.version
        self.figures.refresh(force=True)
        for fn in self.listeners:
            fn(ctx)

    def _superseded(self, ctx: PlanContext) -> Callable[[], bool]:
        """Asked by a load of weights for `ctx` before each tensor: has a newer plan come (the I/O
        thread's `offer` takes it) that gives this node another part? Its apply, queued on this
        thread, then comes next. A newer plan that gives it the same part (another replica
        changed) lets the load go on: the newer plan then finds those weights held."""
        part = self._part(ctx)
        return lambda: self.offered > ctx.version and self._part(self.newest) != part

    def _part(self, ctx: PlanContext) -> tuple:
        """The weights `ctx` has this node hold: its stage's layers, the draft, or a warm spare."""
        mine = ctx.mine
        if mine is not None:
            return ("layers", tuple(mine[0].stages[mine[1]].layers))
        return ("draft",) if self.me in ctx.plan.drafters and self.cfg.speculation.mode != "off" else ("spare",)

    def _carry_over(self, old: PlanContext, ctx: PlanContext) -> None:
        """Keep this replica serving under the new plan version."""
        self.ctx = self.stage.ctx = ctx
        if self.leader is not None:
            self.leader.ctx = ctx
            gone = self.members.addresses_gone() if self.members is not None else set()
            RoleHost._release_orphans(self, gone, f"released in plan v{ctx.version}: its gateway was seen dead")
            for s in list(self.leader.seqs.values()):
                if s.decode_rid != self.leader.rid and not ctx.unchanged(old, s.decode_rid):
                    self.leader.fail(s, f"its decode replica changed in plan v{ctx.version}; retry the request")
            self.leader.outbox.flush()
        log.info("%s: plan v%d keeps replica %d as it was", self.me, ctx.version, self.stage.replica.id)

    def gateway_gone(self, address: str) -> None:
        """Any thread: the node at `address` left or was seen dead. The sequences it was the gateway
        of are released now (on the compute thread), not at the next plan: a gateway that left
        after its drain, with no re-plan to follow (its prefill replica gone, none left to plan
        with), had its replicas decode them for nobody up to max_tokens."""
        self.worker.submit(lambda: self._release_orphans({address}, "released: its gateway left or was seen dead"))

    def _release_orphans(self, gone: set[str], why: str) -> None:
        """Compute thread: fail the leader's sequences whose gateway is at an address in `gone`."""
        if self.leader is None:
            return
        for s in list(self.leader.seqs.values()):
            if s.gateway in gone:  # nobody streams its tokens any more (a client sends it again elsewhere)
                log.info("%s: releasing sequence %d: its gateway %s is gone", self.me, s.id, s.gateway)
                # and it is told so, in case it was only paused (SIGSTOP, a swap storm): back, it
                # resumes the request at once, where it waited out its 60 s stall timeout
                self.leader.fail(s, why)
        self.leader.outbox.flush()

    def _build_stage(self, ctx: PlanContext, replica, index: int) -> None:
        from meshllm.roles.decode import KvAcks  # lazy: torch
        from meshllm.roles.leader import Leader
        from meshllm.roles.prefill import handoff
        from meshllm.roles.stage import Stage
        from meshllm.roles.verifier import Verifier

        layers = replica.stages[index].layers
        model = self.shard.load(layers, self._superseded(ctx))
        pacer = self.pacer_factory(layers, self.cfg.weights_dtype) if self.pacer_factory else None
        self.stage = Stage(ctx, model, self.send, pacer)
        if index == 0:
            self.leader = Leader(self.stage, self.send, model.args.max_seq_len,
                                 lambda ctx, s, finished: handoff(ctx, self.send, s, finished),
                                 self._kv_room(ctx, replica.id), self.cfg.time_scale)
            self.acks = KvAcks(self.leader)
            if replica.role in DECODE_TARGETS:
                self.leader.verifier = Verifier(self.leader, self.send, self.alive, self.cfg.time_scale,
                                                self.cfg.speculation.max_verify_batch, self.life)
                self._listen_drafts(replica.id)
            if replica.role == Role.DECODE:
                from meshllm.roles.decode import CAPACITY_TOPIC, Balancer

                self.balancer = Balancer(self.leader, self.send, lambda m: self.t.publish(m, topic(CAPACITY_TOPIC)),
                                         self.alive)
                self.t.subscribe_topic(topic(CAPACITY_TOPIC))

    def _kv_room(self, ctx: PlanContext, rid: int) -> int | None:
        """KV positions every stage of replica `rid` holds beside its weights, by the stages' device
        profiles (this node's own, the others' as they announced them); None if one is not known."""
        from meshllm.device import device_from_mapping
        from meshllm.errors import ConfigError

        devices = {self.me: self.cfg.device}
        for st in ctx.replica(rid).stages:
            p = self.members.get(st.node) if self.members is not None and st.node != self.me else None
            if p is not None and p.info.device:
                try:
                    devices[st.node] = device_from_mapping(st.node, dict(p.info.device), f"peer {st.node}")
                except ConfigError as e:  # its HELLO passed the wire checks, not a profile's: say why
                    log.warning("%s: replica %d: stage %s announced a device profile that does not parse (%s)",
                                self.me, rid, st.node, e)
        per_layer = self.stage.cache.token_bytes() / (self.stage.layers[1] - self.stage.layers[0])
        room = ctx.kv_room(rid, devices, lambda n: n * per_layer, model_costs(self.stage.model.args, ctx.plan.dtype))
        if room is None:
            log.warning("%s: replica %d: a stage's device is not known; its KV is not limited", self.me, rid)
            return None
        log.info("%s: replica %d: KV room for %d positions (%s binds)", self.me, rid, *room)
        return room[0]

    def _build_drafter(self) -> None:
        """Hold the draft and serve drafts with it."""
        from meshllm.roles.branches import BRANCH_KV_SHARE
        from meshllm.roles.drafter import Drafter

        model = self.shard.draft(self._superseded(self.ctx))
        pacer = self.pacer_factory((0, model.args.n_layers), DRAFT_DTYPE[self.cfg.draft.quant]) \
            if self.pacer_factory else None
        self.drafter = Drafter(self.me, model, self.send, self._publish_draft, pacer, self.cfg.time_scale,
                               BRANCH_KV_SHARE * self.cfg.device.memory_bytes)

    def _publish_draft(self, msg: Message, rid: int) -> None:
        msg.fields["plan_version"] = self.ctx.version if self.ctx else 0
        self.t.publish(msg, topic(draft_topic(rid)))

    def _listen_drafts(self, rid: int | None) -> None:
        """Subscribe to this decode replica's draft topic (and drop the previous plan's)."""
        if self._draft_topic is not None:
            self.t.subscribe_topic(self._draft_topic, False)
        self._draft_topic = None if rid is None else topic(draft_topic(rid))
        if self._draft_topic is not None:
            self.t.subscribe_topic(self._draft_topic)

    def life(self, node: str) -> int | None:
        """`node`'s incarnation as this node knows it (None: unknown, or this node itself)."""
        if not node or node == self.me or self.members is None:
            return None
        p = self.members.get(node)
        return None if p is None else p.info.incarnation

    def alive(self, node: str) -> bool:
        if not node:
            return False
        if node == self.me or self.members is None:
            return True
        p = self.members.get(node)
        return p is not None and p.state is PeerState.ALIVE

    # -- data plane (compute thread) ------------------------------------------------------------
    def send(self, address: str, msg: Message) -> None:
        self.t.send(address, msg)

    def _step(self) -> bool:
        self.figures.refresh()
        st = self.stage
        self.trim.tick(st is not None and len(st.cache) > 0 or self.drafter is not None and bool(self.drafter.sessions),
                       sum(st.tokens_computed.values()) if st is not None else 0)
        if self.leader is not None:
            if self.balancer is not None:
                self.balancer.rebalance()
            return self.leader.step()
        return self.drafter.step() if self.drafter is not None else False

    def _wake_after(self) -> float | None:
        """Wake at the next role deadline, and at least every SNAPSHOT_S while serving."""
        role = self.leader or self.drafter
        t = role.next_wake_s() if role is not None else None
        return SNAPSHOT_S if t is None else min(t, SNAPSHOT_S)


class HostFigures:
    """What heartbeats and `--status` say of a node's part in the plan: a snapshot of its roles'
    figures, taken on the compute thread (reading their live structures from the I/O thread
    would race with it) at most every SNAPSHOT_S."""

    def __init__(self, host: RoleHost):
        self.host = host
        self._snapshot: dict[str, Any] = {}
        self._snapshot_at = 0.0

    def load(self) -> dict[str, Any]:
        """This node's serving figures, from any thread: the compute thread's latest snapshot."""
        h = self.host
        return {**self._snapshot, "plan_version": h.ready_version, "plan_seen": h.max_seen,
                "rss_mb": round(rss_mb(), 1), "heap_trims": h.trim.trims, **h.weights.announce(),
                **({"plan_error": h.plan_error} if h.plan_error else {})}

    def refresh(self, force: bool = False) -> None:
        """Compute thread: snapshot the figures (at most every SNAPSHOT_S) and, on a decode
        replica's leader, publish its capacity."""
        now = time.monotonic()
        if not force and now - self._snapshot_at < SNAPSHOT_S:
            return
        self._snapshot_at = now
        h, out = self.host, {}
        if h.stage is not None:
            st = h.stage
            out["stage"] = {"replica": st.replica.id, "index": st.index, "layers": list(st.layers),
                            "weights_mb": round(h.shard.weights_mb, 1),
                            "kv_bytes_sent": st.kv_bytes_sent, "kv_bytes_received": st.kv_bytes_received,
                            "tokens": {k.name.lower(): v for k, v in st.tokens_computed.items()},
                            "kv_cache_bytes": st.cache.nbytes()}
            if st.pacer is not None:
                out["stage"]["pacer"] = st.pacer.summary()
        if h.leader is not None:
            out["leader"] = h.leader.load()
            if h.balancer is not None:
                h.balancer.publish_capacity()
        if h.drafter is not None:
            out["drafter"] = h.drafter.load()
        if h.weights.stats is not None:
            out["weights_fetch"] = h.weights.stats
        self._snapshot = out

    def status(self) -> dict[str, Any]:
        """What `--status` and the heartbeats say of this node's part in the plan."""
        return {"plan_version": self.host.ready_version, "roles": self.roles(), "load": self.load()}

    def roles(self) -> list[str]:
        ctx = self.host.ctx
        if ctx is None:
            return []
        mine = ctx.mine
        if mine is not None:
            return [str(mine[0].role)]
        return ["drafter"] if self.host.me in ctx.plan.drafters else []


def preload_compute(cfg: NodeConfig) -> bool:
    """Import torch and the roles that compute, now, if this node may hold a stage or draft. A node
    calls it before it joins: imported later, on the compute thread when the first plan came,
    torch held the GIL long enough to stall the I/O thread's heartbeats (0.25 s alone, 0.85 s with
    six nodes on two cores: peers marked the nodes of an emulated clusters/failure.yaml suspect
    21-24 times a run; bench/heartbeat.py). False for a node whose `roles:` allow no computing."""
    if cfg.roles is not None and not {Role.DRAFTER, *STAGE_ROLES} & set(cfg.roles):
        return False
    import meshllm.roles.drafter  # noqa: F401  (torch, the engine and every compute role)
    import meshllm.roles.leader  # noqa: F401
    import meshllm.roles.prefill  # noqa: F401
    return True


def describe(ctx: PlanContext, me: str) -> str:
    """This node's part in a plan, for the log."""
    mine = ctx.mine
    if mine is None:
        return "drafter" if me in ctx.plan.drafters else "no stage"
    r, i = mine
    start, end = r.stages[i].layers
    return f"{r.role} replica {r.id}, stage {i + 1}/{len(r.stages)}, layers [{start}, {end})"
