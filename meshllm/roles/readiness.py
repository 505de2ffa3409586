"""What of the current plan a gateway may route to: each node's loaded plan version, from its
heartbeats (or this node's own), the replicas every node of which has it, and why none will be
(the coordinator's `planner_error`). It reads only the membership, the plan and this node's
load, never the requests (roles/gateway.py, which mixes it in).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from meshllm.mesh.membership import Membership
from meshllm.node_config import NodeConfig
from meshllm.roles.context import PlanContext
from meshllm.roles.model_info import ModelInfo


class Readiness:
    """Mixed into Gateway, whose __init__ sets these attributes (and its plan handling keeps them
    current)."""

    me: str
    members: Membership
    cfg: NodeConfig
    model: ModelInfo
    ctx: PlanContext | None
    local_version: int  # the plan version this node itself has loaded
    local_load: Callable[[], dict[str, Any]]  # this node's own heartbeat load
    _refused: dict[str, float]  # node -> when it refused a request of this gateway's plan

    def dead_nodes(self) -> set[str]:
        """The nodes this node's membership has seen dead (or leave)."""
        return {p.info.id for p in self.members.peers() if p.state.value in ("dead", "left")}

    def unservable(self) -> str | None:
        """Why no replica will be ready, where the coordinator says it cannot plan the live nodes
        (not "still planning or loading": an operator's health check must tell the two apart)."""
        why = self.planner_error()
        return None if why is None or self.ready() else f"the mesh cannot serve now: {why}"

    def planner_error(self) -> str | None:
        """Why the coordinator could not plan the live nodes (its heartbeat's `planner_error`;
        this node's own if it is the coordinator), or None."""
        loads = [self.local_load()] + [p.load for p in self.members.peers() if p.state.value == "alive"]
        return next((ld["planner_error"] for ld in loads
                     if isinstance(ld, dict) and isinstance(ld.get("planner_error"), str)), None)

    def node_version(self, node: str) -> int:
        """The plan version `node` has loaded, as its last heartbeat says (-1: none, or it refused a
        request of ours since: a node restarted at its address, which its peers have not yet heard
        from, answers for its earlier life's heartbeats; resumed requests would be refused there
        at once, each an attempt, until the request failed)."""
        if node == self.me:
            return self.local_version
        p = self.members.get(node)
        if p is None or p.state.value != "alive" or p.last_heard <= self._refused.get(node, -math.inf):
            return -1
        v = p.load.get("plan_version")
        return v if isinstance(v, int) else -1

    def ready_replicas(self) -> list[int]:
        ctx = self.ctx
        if ctx is None:
            return []
        return [r.id for r in ctx.plan.replicas if all(self.node_version(s.node) == ctx.version for s in r.stages)]

    def ready(self) -> bool:
        """Serving: every replica of the current plan is loaded, and so is every drafter when
        speculation is on (requests are routed to what is ready before that)."""
        ctx = self.ctx
        if ctx is None or not ctx.plan.replicas or self.model.tokenizer is None:
            return False
        ready = set(self.ready_replicas())
        drafters = ctx.plan.drafters if self.cfg.speculation.mode != "off" else ()
        return ready == {r.id for r in ctx.plan.replicas} and all(
            self.node_version(d) == ctx.version for d in drafters)
