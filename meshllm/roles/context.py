"""What a node's roles need to know about the plan they serve: one frozen object per plan version.

`PlanContext` answers the questions every role asks (which replica is mine, where does my
activation go next, which stages of a decode replica hold layers [a, b), who leads a replica)
from the Plan and the node addresses known when the plan was applied. Pure: no sockets.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from meshllm.defaults import DECODE_TARGETS
from meshllm.device import DeviceProfile
from meshllm.partition.cost import ModelCosts
from meshllm.partition.dp import kv_room_tokens
from meshllm.partition.plan import Plan, Replica


@dataclass(frozen=True)
class PlanContext:
    version: int
    plan: Plan
    addresses: dict[str, str]  # node id -> HOST:PORT of its ROUTER, for every node in the plan
    me: str
    incarnations: dict[str, int] = field(default_factory=dict)  # node id -> the life it was planned for

    def replica(self, rid: int) -> Replica:
        for r in self.plan.replicas:
            if r.id == rid:
                return r
        raise KeyError(f"plan v{self.version} has no replica {rid}")

    def has_replica(self, rid: int) -> bool:
        return any(r.id == rid for r in self.plan.replicas)

    def decoders(self) -> list[int]:
        """The ids of the replicas that decode (decode or mixed): those a request may be pinned to."""
        return [r.id for r in self.plan.replicas if r.role in DECODE_TARGETS]

    @property
    def mine(self) -> tuple[Replica, int] | None:
        """(my replica, my stage index), or None when this node holds no stage."""
        return self.plan.replica_of(self.me)

    def address(self, node: str) -> str:
        try:
            return self.addresses[node]
        except KeyError:
            raise KeyError(f"plan v{self.version}: no address for node {node!r}") from None

    def leader(self, rid: int) -> str:
        """Address of the replica's first stage, which schedules its batches."""
        return self.address(self.replica(rid).stages[0].node)

    def next_stage(self, rid: int, index: int) -> str:
        return self.address(self.replica(rid).stages[index + 1].node)

    def holders(self, rid: int, layers: tuple[int, int]) -> list[tuple[str, tuple[int, int]]]:
        """(node, overlap) for every stage of replica `rid` whose layers overlap `layers`: where
        the KV of those layers goes (the two replicas may split the layers differently)."""
        a, b = layers
        out = []
        for s in self.replica(rid).stages:
            lo, hi = max(a, s.layers[0]), min(b, s.layers[1])
            if lo < hi:
                out.append((s.node, (lo, hi)))
        return out

    def unchanged(self, other: PlanContext | None, rid: int) -> bool:
        """Does replica `rid` have the same role, nodes (the same lives of them) and layer split in
        `other`? Such a replica keeps serving its sequences across a re-plan (e.g. one that only
        drops a dead drafter). A node restarted in between (a new incarnation at the same address,
        before its peers saw it dead) lost what it held: its replica changed."""
        if other is None or not self.has_replica(rid) or not other.has_replica(rid):
            return False
        a, b = self.replica(rid), other.replica(rid)
        same_nodes = all(self.addresses.get(s.node) == other.addresses.get(s.node)
                         and self.incarnations.get(s.node) == other.incarnations.get(s.node) for s in a.stages)
        return a.role == b.role and a.stages == b.stages and same_nodes

    def kv_room(self, rid: int, devices: Mapping[str, DeviceProfile], token_bytes: Callable[[int], float],
                mc: ModelCosts) -> tuple[int, str] | None:
        """(positions, node): the fewest positions of KV a stage of replica `rid` holds beside its
        weights (partition/dp.py kv_room_tokens), and that stage's node; None when a stage's device
        is not known. `token_bytes(n)`: the KV bytes of one position over n layers."""
        rooms = []
        for s in self.replica(rid).stages:
            dev = devices.get(s.node)
            if dev is None:
                return None
            rooms.append((kv_room_tokens(mc, dev, s.layers, token_bytes(s.layers[1] - s.layers[0])), s.node))
        return min(rooms)
