"""The peer table: who is in the mesh and whether they are alive. Pure: the clock is passed in.

Failure detection follows the ZeroMQ guide's Paranoid Pirate pattern: peers
publish a HEARTBEAT every `heartbeat_interval_s`; a peer silent for
SUSPECT_AFTER_MISSES intervals is `suspect`, and one silent for
`failure_timeout_s` is `dead`. A LEAVE makes it `left` at once; a peer whose process is gone
(its connection closed and its port refuses a new one: the transport sees it in ~0.2 s) is
`dead` at once (`gone`): a crash on a host that is up needs no timeout. Time this node itself did
not run (stopped, swapped out; its I/O loop sees the gap between its ticks) is `discount`ed:
it is not the peers' silence.

Each node process picks an incarnation number when it starts (milliseconds since
the epoch), so a restarted node is told apart from its previous life: news about
an older incarnation is ignored, a newer one replaces the entry (rejoin).
Second-hand news (gossip) can add a peer or bring a newer incarnation, but only
first-hand contact (a heartbeat or a HELLO) revives a suspect or dead peer.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from meshllm.defaults import FAILURE_TIMEOUT_S, HEARTBEAT_INTERVAL_S
from meshllm.mesh.fields import is_int

SUSPECT_AFTER_MISSES = 2  # suspect after this many missed heartbeats


class PeerState(str, Enum):
    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"
    LEFT = "left"


@dataclass(frozen=True)
class PeerInfo:
    """What a node says about itself (HELLO) and what gossip repeats."""

    id: str
    address: str  # HOST:PORT of its ROUTER; its PUB is on PORT+1
    zone: str = "default"
    device: dict[str, Any] = field(default_factory=dict)
    roles: tuple[str, ...] = ()
    incarnation: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {"id": self.id, "address": self.address, "zone": self.zone, "device": dict(self.device),
                "roles": list(self.roles), "incarnation": self.incarnation}

    @staticmethod
    def from_wire(d: Any) -> PeerInfo:
        """Raises ValueError on a malformed entry (network data)."""
        ok = (isinstance(d, dict) and isinstance(d.get("id"), str) and isinstance(d.get("address"), str)
              and isinstance(d.get("incarnation"), int) and isinstance(d.get("device", {}), dict)
              and isinstance(d.get("roles", []), list) and isinstance(d.get("zone", ""), str))
        if not ok or not d["id"]:
            raise ValueError(f"malformed peer entry {d!r:.200}")
        return PeerInfo(d["id"], d["address"], d.get("zone", "default"), dict(d.get("device", {})),
                        tuple(str(r) for r in d.get("roles", [])), d["incarnation"])


@dataclass
class Peer:
    info: PeerInfo
    state: PeerState
    last_heard: float  # monotonic seconds of the last first-hand contact (or of the gossip that added it)
    load: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Transition:
    peer: str
    old: PeerState | None  # None: a new peer
    new: PeerState


class Membership:
    """The peer table of one node (the node itself is not in it)."""

    def __init__(self, self_id: str, *, heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S,
                 failure_timeout_s: float = FAILURE_TIMEOUT_S):
        if not 0 < heartbeat_interval_s < failure_timeout_s:
            raise ValueError(f"need 0 < heartbeat_interval_s ({heartbeat_interval_s}) < failure_timeout_s "
                             f"({failure_timeout_s})")
        self.self_id = self_id
        self.heartbeat_interval_s = heartbeat_interval_s
        self.failure_timeout_s = failure_timeout_s
        self.suspect_after_s = min(SUSPECT_AFTER_MISSES * heartbeat_interval_s, failure_timeout_s)
        self._peers: dict[str, Peer] = {}

    # -- queries ----------------------------------------------------------------------------
    def get(self, peer_id: str) -> Peer | None:
        return self._peers.get(peer_id)

    def peers(self) -> list[Peer]:
        return [self._peers[k] for k in sorted(self._peers)]

    def live(self) -> list[Peer]:
        return [p for p in self.peers() if p.state in (PeerState.ALIVE, PeerState.SUSPECT)]

    def addresses_gone(self) -> set[str]:
        """The addresses of the peers known dead or gone (safe to call from another thread)."""
        return {p.info.address for p in list(self._peers.values()) if p.state in (PeerState.DEAD, PeerState.LEFT)}

    def conflicts(self, info: PeerInfo) -> bool:
        """True if `info` claims the id of a different live node (or ours): a duplicate id."""
        if info.id == self.self_id:
            return True
        p = self._peers.get(info.id)
        live = p is not None and p.state in (PeerState.ALIVE, PeerState.SUSPECT)
        return live and p.info.address != info.address

    # -- events -----------------------------------------------------------------------------
    def observe(self, info: PeerInfo, now: float, *, first_hand: bool) -> Transition | None:
        """A HELLO (first-hand) or a gossip entry (second-hand) about `info.id`. A claim to the id
        of a live peer from another address is a duplicate id, whatever its incarnation: the
        holder keeps the id (a PEERS answer from a duplicate that someone greeted, e.g. found by
        mDNS, must not move the peer to the duplicate's address)."""
        if info.id == self.self_id or self.conflicts(info):
            return None
        p = self._peers.get(info.id)
        if p is None or info.incarnation > p.info.incarnation:
            self._peers[info.id] = Peer(info, PeerState.ALIVE, now)
            return Transition(info.id, None if p is None else p.state, PeerState.ALIVE)
        if info.incarnation < p.info.incarnation or not first_hand:
            return None
        p.info = replace(info)
        return self._hear(p, now)

    def note_plan_seen(self, peer_id: str, incarnation: int, seen: Any) -> None:
        """A HELLO or PEERS from the peer itself says the newest plan version it has seen: kept as
        its load's `plan_seen` until its first heartbeat brings the whole load (a coordinator
        numbers its plans above every live peer's; coordinator.py)."""
        p = self._peers.get(peer_id)
        if p is not None and p.info.incarnation == incarnation and not p.load and is_int(seen, 0):
            p.load = {"plan_seen": seen}

    def heartbeat(self, peer_id: str, incarnation: int, now: float, load: dict | None = None) -> Transition | None:
        p = self._peers.get(peer_id)
        if p is None or incarnation != p.info.incarnation:
            return None  # unknown peer or another life of it: it must HELLO first
        if load is not None:
            p.load = load
        return self._hear(p, now)

    def leave(self, peer_id: str, incarnation: int, now: float) -> Transition | None:
        p = self._peers.get(peer_id)
        if p is None or incarnation < p.info.incarnation or p.state is PeerState.LEFT:
            return None
        old, p.state, p.last_heard = p.state, PeerState.LEFT, now
        return Transition(peer_id, old, PeerState.LEFT)

    def tick(self, now: float) -> list[Transition]:
        """Advance failure detection to `now`; returns the state changes."""
        out = []
        for p in self.peers():
            if p.state in (PeerState.DEAD, PeerState.LEFT):
                continue
            silent = now - p.last_heard
            new = (PeerState.DEAD if silent >= self.failure_timeout_s
                   else PeerState.SUSPECT if silent >= self.suspect_after_s else PeerState.ALIVE)
            if new is not p.state:
                out.append(Transition(p.info.id, p.state, new))
                p.state = new
        return out

    def gone(self, peer_id: str, address: str) -> Transition | None:
        """The process at `address` is gone (its connection closed and its port refuses a new one:
        the transport's monitor). A live peer there is dead now, not after the failure timeout; a
        later life of it, or another node at that address, must HELLO to come back."""
        p = self._peers.get(peer_id)
        if p is None or p.info.address != address or p.state not in (PeerState.ALIVE, PeerState.SUSPECT):
            return None
        old, p.state = p.state, PeerState.DEAD
        return Transition(peer_id, old, PeerState.DEAD)

    def discount(self, seconds: float) -> None:
        """This node itself did not run for `seconds` (stopped, swapped out, a VM or a laptop
        paused, its I/O thread starved): that time is not its peers' silence. A node back from
        such a pause longer than the failure timeout declared every peer dead at once."""
        for p in self._peers.values():
            if p.state in (PeerState.ALIVE, PeerState.SUSPECT):
                p.last_heard += seconds

    def _hear(self, p: Peer, now: float) -> Transition | None:
        if p.state is PeerState.LEFT:
            return None  # a stray message after LEAVE; a rejoin comes with a new incarnation
        p.last_heard = now
        if p.state is PeerState.ALIVE:
            return None
        old, p.state = p.state, PeerState.ALIVE
        return Transition(p.info.id, old, PeerState.ALIVE)
