"""The coordinator: one node plans for the whole mesh and publishes the plan.

Election is deterministic and needs no messages: the coordinator is the live node with the
lowest id (every node runs this module; all but one stay quiet). If it dies, the next-lowest
sees it dead and takes over; plan versions only grow (a new coordinator starts above every
version it has seen or that a live peer's heartbeat says it has seen: after a healed partition
the other side may have planned), so nodes never go back to an older plan. A coordinator that
learns of a plan newer than its own (its peers took it for dead and the next one planned, while
it was stopped or cut off and, to itself, nothing changed) plans again, at most every CATCH_UP_S,
or the mesh would run without it. A peer's HELLO and PEERS say its `plan_seen` too, and a
coordinator's first plan of its life waits (at most FIRST_PLAN_WAIT_S) for the heartbeat of any
live peer it has learned second-hand only: one restarted before its peers saw it dead would
otherwise number its plan from nothing (v1 again), a version every node already holds and
ignores.

A new plan keeps what runs where it can: nodes of one kind (device profile, zone, roles) are
swapped and replicas renumbered so that as many replicas of the plan in force as possible go on
unchanged (partition/stable.py).

When to plan: under `--cluster` every node file lists `expect_nodes`, and the first plan is
made as soon as all of them are alive; otherwise after membership has been quiet for
`plan_settle_s`. Any later change of the live node set (a join, a death, a leave) re-plans
after REPLAN_SETTLE_S. So does a node that says it could not take its part of the newest plan
(`plan_error` in its heartbeat load: its layers or draft could not be built: memory, a bad file):
the next plan leaves it out, in `unused` with that reason, until it restarts (a new incarnation)
or the live set changes otherwise (the cause may have been a peer that died while this node
fetched its layers from it: it is tried again then).
The planner (GA + DP; with `plan_judge`, the simulator's pick: `plan_for`) runs on its own
thread, never on the I/O thread that carries the heartbeats; its inputs are the device profiles,
zones and roles in the peer table plus this node's links, model and serving settings. The plan
is published on PUB (TOPIC_MESH) and re-published every PLAN_REPUBLISH_S, so a slow joiner or a
newcomer gets it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from meshllm.defaults import NODE_ROLES, PLAN_ERROR_REASON, Role
from meshllm.device import device_from_mapping
from meshllm.errors import InputError
from meshllm.mesh.loop import Worker
from meshllm.mesh.membership import Membership, PeerInfo, PeerState
from meshllm.mesh.protocol import MsgType, make
from meshllm.mesh.transport import Transport
from meshllm.node_config import NodeConfig, plan_inputs_for_nodes
from meshllm.partition.inputs import PlanInputs, PlanNode
from meshllm.partition.plan import Plan, PlanInfeasible, plan_cluster
from meshllm.partition.stable import keep_running

log = logging.getLogger("meshllm.coordinator")

NODE_ROLE_NAMES = {str(r) for r in NODE_ROLES}
TICK_S = 0.25
REPLAN_SETTLE_S = 0.5  # after a change of the live set, wait this long for it to settle
PLAN_REPUBLISH_S = 1.0
CATCH_UP_S = 5.0  # at most this often, a peer's newer plan makes the coordinator plan again (two that
# each see the other dead, a one-way cut, would otherwise out-number each other's plans without end)
FIRST_PLAN_WAIT_S = 1.0  # for the plan_seen of peers learned second-hand (their heartbeat), from the last change


def unheard(members: Membership) -> list[str]:
    """The live peers whose `plan_seen` is not known: learned second-hand (gossip), no heartbeat,
    HELLO or PEERS of their own yet (a newer life of a peer starts with none)."""
    return [p.info.id for p in members.peers() if p.state in (PeerState.ALIVE, PeerState.SUSPECT) and not p.load]


def newest_plan_seen(members: Membership) -> int:
    """The newest plan version a live peer's heartbeat (`load.plan_seen`) says it has seen. After
    a healed partition the other side's coordinator may have published versions this node never
    got; a node ignores a plan whose version it already holds, so the next one must be above."""
    seen = [p.load.get("plan_seen") for p in members.peers()
            if p.state in (PeerState.ALIVE, PeerState.SUSPECT) and isinstance(p.load, dict)]
    return max((v for v in seen if isinstance(v, int) and not isinstance(v, bool) and v >= 0), default=0)


class Coordinator:
    def __init__(self, transport: Transport, members: Membership, me: PeerInfo, cfg: NodeConfig,
                 current_version: Callable[[], int], deliver: Callable[[int, dict, dict, str, dict], None],
                 model_args: Callable[[], Any] | None = None,
                 own_error: Callable[[], dict | None] | None = None,
                 current_plan: Callable[[], Plan | None] | None = None,
                 hold: Callable[[], bool] | None = None, model_id: str | None = None):
        self.t, self.members, self.me, self.cfg = transport, members, me, cfg
        self.model_args = model_args  # the model's shape (None: from this node's model file)
        self.current_version, self.deliver = current_version, deliver  # the local RoleHost
        self.own_error = own_error or (lambda: None)  # this node's own plan_error (RoleHost)
        self.current_plan = current_plan or (lambda: None)  # the plan in force here (RoleHost's)
        self.hold = hold or (lambda: False)  # True: plan nothing now (this node's id is in doubt: Gossip)
        self.model_id = model_id or ""  # this node's model file's content_id: every plan carries it
        self.refused: dict[tuple[str, int], tuple[str, frozenset]] = {}  # see `refusals`
        self.worker = Worker(f"planner-{me.id}")
        self.published: tuple[int, dict, dict, dict] | None = None  # (version, plan json, addresses, incarnations)
        self.planned_for: tuple | None = None  # the live set the newest plan was made for
        self.last_error: str | None = None  # why the newest live set got no plan (--status: planner_error)
        self._changed_at = time.monotonic()
        self._seen: tuple = ()
        self._planning = False
        self._last_publish = 0.0
        self._caught_up = -CATCH_UP_S  # when it last re-planned for a peer's newer plan
        transport.every(TICK_S, self._tick)

    def start(self) -> None:
        self.worker.start()

    def close(self) -> None:
        self.worker.close()

    # -- I/O thread ----------------------------------------------------------------------------
    def live(self) -> list[PeerInfo]:
        """This node and every peer not known dead or gone (a suspect peer, often a busy one whose
        heartbeat is late, is not re-planned around until the failure timeout says it is dead)."""
        return [self.me] + [p.info for p in self.members.peers() if p.state in (PeerState.ALIVE, PeerState.SUSPECT)]

    def current(self) -> str:
        """The coordinator as this node sees it: the lowest live id (itself included)."""
        return min(p.id for p in self.live())

    def is_coordinator(self) -> bool:
        return self.current() == self.me.id

    def _plan_errors(self, live: list[PeerInfo]) -> None:
        """Update `refused` from the live nodes' `plan_error` (peers' heartbeat loads, this node's own)."""
        errors = {p.info.id: p.load.get("plan_error") for p in self.members.peers() if isinstance(p.load, dict)}
        errors[self.me.id] = self.own_error()
        before = set(self.refused)
        self.refused = refusals(self.refused, live, errors, self.published[0] if self.published else None)
        for nid, inc in set(self.refused) - before:
            log.warning("%s: %s %s; re-planning without it", self.me.id, nid, self.refused[(nid, inc)][0])

    def _tick(self) -> None:
        live = self.live()
        self._plan_errors(live)
        live = [p for p in live if (p.id, p.incarnation) not in self.refused]
        key = tuple(sorted((p.id, p.incarnation) for p in live))
        now = time.monotonic()
        if key != self._seen:
            self._seen, self._changed_at = key, now
        if not self.is_coordinator() or self.hold():
            return
        ids = {p.id for p in live}
        # a plan is in force once anyone published one (this node's own plans reach its host too):
        # a coordinator that takes over re-plans the live set, not waiting for dead expected nodes
        started = self.current_version() > 0
        if self.cfg.expect_nodes and not set(self.cfg.expect_nodes) <= ids and not started:
            return  # the emulated cluster is still starting
        settle = (0.0 if self.cfg.expect_nodes and not started
                  else REPLAN_SETTLE_S if started else self.cfg.plan_settle_s)
        # a plan newer than this coordinator's own, that a live peer has seen or this node holds: another
        # node planned while this one was not the coordinator (out of its view, or a lower id that has
        # since left: alone again with the live set it last planned for, it never planned again)
        newer = max(newest_plan_seen(self.members), self.current_version())
        if self.published is not None and self.planned_for is not None and not self._planning \
                and newer > self.published[0] and now - self._caught_up >= CATCH_UP_S:
            self._caught_up = now
            log.warning("%s: plan v%d is in force, newer than this coordinator's v%d (another node planned while this "
                        "one was not the coordinator): re-planning", self.me.id, newer, self.published[0])
            self.planned_for = None
        if self.published is None and unheard(self.members) and now - self._changed_at < FIRST_PLAN_WAIT_S:
            return  # this life's first plan numbers itself above what the live peers have seen
        if key != self.planned_for and not self._planning and now - self._changed_at >= settle:
            self._planning = True
            left_out = {nid: why for (nid, _), (why, _) in self.refused.items()}
            current = self.current_plan()
            self.worker.submit(lambda: self._plan(live, key, left_out, current))
        if self.published is not None and now - self._last_publish >= PLAN_REPUBLISH_S:
            self._publish()

    def _publish(self) -> None:
        version, plan, addresses, incarnations = self.published
        self._last_publish = time.monotonic()
        self.t.publish(make(MsgType.PLAN, version=version, coordinator=self.me.id, plan=plan, addresses=addresses,
                            incarnations=incarnations, model_id=self.model_id))

    # -- planner thread ------------------------------------------------------------------------
    def _plan(self, live: list[PeerInfo], key: tuple, left_out: dict[str, str], current: Plan | None = None) -> None:
        """`left_out`: nodes that could not take their part of a plan: in `unused`, with why.
        `current`: the plan in force, whose replicas the new one keeps where it can (stable.py)."""
        try:
            plan = keep_running(plan_for(self.cfg, self.inputs(live)), current, node_kinds(live))
            if left_out:
                plan = dataclasses.replace(plan, unused=plan.unused + tuple(left_out),
                                           reasons={**plan.reasons, **left_out})
        except Exception as e:  # a shortfall; or a planner bug, the disk: this live set gets no plan, the next
            # may (left un-caught, `_planning` stayed set and this coordinator never planned again)
            if isinstance(e, (InputError, ValueError)):
                self.last_error = str(e)
                # before the first plan a shortfall is most often a mesh still gathering: a warning
                first = self.published is None and isinstance(e, PlanInfeasible)
                log.log(logging.WARNING if first else logging.ERROR, "%s: cannot plan for %d live nodes%s: %s",
                        self.me.id, len(live), " (no plan yet: waiting for more nodes to join)" if first else "", e)
            else:
                self.last_error = f"the planner failed: {type(e).__name__}: {e}"
                log.exception("%s: the planner failed for %d live nodes", self.me.id, len(live))
            self.t.call_soon(lambda: self._done(key, None, {}, {}))
            return
        addresses = {p.id: p.address for p in live}  # (those left out need none: they have no part)
        self.t.call_soon(lambda: self._done(key, plan, addresses, {p.id: p.incarnation for p in live}))

    def _done(self, key: tuple, plan: Plan | None, addresses: dict, incarnations: dict) -> None:
        """I/O thread: publish a new plan version (or remember that this live set cannot plan)."""
        self._planning = False
        self.planned_for = key
        if plan is None:
            return
        version = max(self.current_version(), self.published[0] if self.published else 0, newest_plan_seen(self.members)) + 1
        self.published = (version, plan.to_json(), addresses, incarnations)
        self.last_error = None
        log.info("%s: coordinator published plan v%d for %d nodes:\n%s", self.me.id, version, len(addresses),
                 plan.describe())
        self._publish()
        self.deliver(version, plan.to_json(), addresses, self.me.id, incarnations, self.model_id)

    def inputs(self, live: list[PeerInfo]) -> PlanInputs:
        """On the planner thread: the model's shape from `model_args` (a node without the model
        file asks a peer for its index, RoleHost's MeshWeights.args), else from the file."""
        return live_plan_inputs(self.cfg, live, self.model_args() if self.model_args is not None else None)


def refusals(refused: dict[tuple[str, int], tuple[str, frozenset]], live: list[PeerInfo], errors: dict[str, Any],
             newest: int | None) -> dict[tuple[str, int], tuple[str, frozenset]]:
    """The live nodes, (id, incarnation), to plan without -> (why, the live set then): those whose
    `plan_error` (`errors`: id -> {plan_version, error}) is for the coordinator's newest plan
    (`newest`) or a later one (an error from an older plan may be one a newer plan has not reached
    yet, or fixed), and those refused before while the live set stays as it was then (a node that
    restarts, or any join, death or leave, gives it another try: its cause may have gone)."""
    now_live = frozenset((p.id, p.incarnation) for p in live)
    out = {k: got for k, got in refused.items() if got[1] == now_live}
    for p in live:
        err = errors.get(p.id)
        version = err.get("plan_version") if isinstance(err, dict) else None
        if newest is not None and isinstance(version, int) and not isinstance(version, bool) and version >= newest \
                and (p.id, p.incarnation) not in out:
            out[(p.id, p.incarnation)] = (f"{PLAN_ERROR_REASON} v{version}: {str(err.get('error'))[:300]}", now_live)
    return out


def node_kinds(live: list[PeerInfo]) -> dict[str, str]:
    """node -> its kind for the planner: nodes with the same device profile, zone and roles are
    interchangeable in its cost model (links are per zone pair)."""
    return {p.id: json.dumps([p.device, p.zone, sorted(p.roles)], sort_keys=True, default=str) for p in live}


def plan_for(cfg: NodeConfig, inp: PlanInputs) -> Plan:
    """The coordinator's planner: GA + DP, and with the node file's `plan_judge` the simulator's
    pick among the search's candidates and the baselines' groupings (sim/judge.py: the plan
    `--simulate` reports as meshllm; seconds on a small mesh, minutes on hundreds of nodes)."""
    if cfg.plan_judge:
        from meshllm.sim.judge import judged_plan

        return judged_plan(inp)
    return plan_cluster(inp, log=False)


def live_plan_inputs(cfg: NodeConfig, infos: list[PeerInfo], args=None) -> PlanInputs:
    """PlanInputs for the nodes of the peer table (device profiles, zones and roles as they
    announced them), with this node's model, links and serving settings; `args`: the model's
    shape, when this node has no model file (else it is read from the file)."""
    nodes = []
    for p in infos:
        dev = device_from_mapping(str(p.device.get("name", p.id)), dict(p.device), f"peer {p.id}")
        roles = tuple(Role(str(r)) for r in p.roles if str(r) in NODE_ROLE_NAMES) or None
        nodes.append(PlanNode(p.id, dev, p.zone, roles))
    return plan_inputs_for_nodes(cfg, tuple(nodes), source=f"the live mesh of {len(nodes)} nodes", args=args)
