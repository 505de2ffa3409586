"""The mesh role every node runs: heartbeats, failure detection, graceful leave, status.

All of it runs on the transport's I/O thread, never on a compute thread, so a
long forward pass cannot make a node look dead (ZeroMQ guide, Paranoid Pirate).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from meshllm.mesh.membership import Membership, PeerInfo, PeerState, Transition
from meshllm.mesh.protocol import Message, MsgType, make
from meshllm.mesh.transport import Transport

log = logging.getLogger("meshllm.mesh")

LEAVE_FLUSH_S = 0.2  # time for LEAVE messages to reach the wire before the sockets close


class MeshAgent:
    def __init__(self, transport: Transport, members: Membership, me: PeerInfo,
                 serving: Callable[[], dict[str, Any]] | None = None,
                 plan_view: Callable[[], dict[str, Any] | None] | None = None):
        self.t, self.members, self.me = transport, members, me
        self._serving = serving or (lambda: {"plan_version": 0, "roles": list(me.roles), "load": {}})
        self._plan_view = plan_view or (lambda: None)  # the plan this node serves (--status), not in heartbeats
        self._seq = 0
        self._started = time.monotonic()
        self.greet: Callable[[str], None] | None = None  # say HELLO to an address (Gossip.greet)
        self.on_beat: Callable[[], None] | None = None  # a heartbeat changed a peer's state or loaded plan
        self.on_gone: list[Callable[[str], None]] = []  # a peer (its address) left or was seen dead
        transport.on(MsgType.HEARTBEAT, self._on_heartbeat)
        transport.on(MsgType.LEAVE, self._on_leave)
        transport.on(MsgType.STATUS_REQ, self._on_status)
        transport.on(MsgType.PING, lambda msg, reply: reply(make(MsgType.PONG)))
        transport.every(members.heartbeat_interval_s, self.beat)
        self._tick_s = min(0.1, members.heartbeat_interval_s / 2)
        self._ticked: float | None = None  # the last failure-detection tick (its first comes when the loop runs)
        transport.every(self._tick_s, self._tick)

    def on_change(self, tr: Transition) -> None:
        """Log a peer state change and release the sockets of peers that left."""
        peer = self.members.get(tr.peer)
        where = peer.info.address if peer else "?"
        log.info("%s: peer %s (%s) %s -> %s", self.me.id, tr.peer, where, tr.old.value if tr.old else "new",
                 tr.new.value)
        if tr.new is PeerState.LEFT and peer is not None:
            self.t.forget(peer.info.address)
        if tr.new in (PeerState.LEFT, PeerState.DEAD) and peer is not None:
            for fn in self.on_gone:
                fn(peer.info.address)

    def load(self) -> dict[str, Any]:
        return {"uptime_s": round(time.monotonic() - self._started, 3), "pid": os.getpid(), "heartbeat_seq": self._seq,
                "dropped_messages": self.t.inbox.dropped, **self._serving()["load"]}

    def status(self) -> dict[str, Any]:
        peers = [{"id": p.info.id, "state": p.state.value, "address": p.info.address, "device": p.info.device,
                  "zone": p.info.zone, "roles": list(p.info.roles), "incarnation": p.info.incarnation}
                 for p in self.members.peers()]
        serving = self._serving()
        return {"node": self.me.id, "address": self.me.address, "zone": self.me.zone, "device": self.me.device,
                "incarnation": self.me.incarnation, "peers": peers, "plan_version": serving["plan_version"],
                "roles": serving["roles"], "load": self.load(), "plan": self._plan_view()}

    def leave(self) -> None:
        """Tell every peer we are leaving (PUB and a direct message each), from any thread."""
        def send_all() -> None:
            msg = make(MsgType.LEAVE, node=self.me.id, incarnation=self.me.incarnation)
            self.t.publish(msg)
            for p in self.members.live():
                self.t.send(p.info.address, make(MsgType.LEAVE, node=self.me.id, incarnation=self.me.incarnation))
        self.t.call_soon(send_all)
        time.sleep(LEAVE_FLUSH_S)

    # -- I/O thread -------------------------------------------------------------------------
    def beat(self) -> None:
        """I/O thread: publish a heartbeat (every heartbeat interval, and at once when this node
        applies a plan)."""
        self._seq += 1
        self.t.publish(make(MsgType.HEARTBEAT, node=self.me.id, incarnation=self.me.incarnation, seq=self._seq,
                            load=self.load()))

    def _tick(self) -> None:
        now = time.monotonic()
        stalled, self._ticked = now - (self._ticked or now) - self._tick_s, now
        if stalled >= self.members.suspect_after_s:  # this node did not run: its peers' silence is not theirs
            log.warning("%s: this node did not run for %.1f s (stopped, swapped out, or its I/O thread starved): "
                        "that time does not count as its peers' silence", self.me.id, stalled)
            self.members.discount(stalled)
        for tr in self.members.tick(now):
            self.on_change(tr)

    def peer_gone(self, address: str) -> None:
        """I/O thread: the transport saw the process at `address` go (Transport.on_peer_gone)."""
        for p in self.members.live():
            if p.info.address == address and (tr := self.members.gone(p.info.id, address)) is not None:
                log.info("%s: peer %s (%s) closed its connection and refuses a new one: its process is gone",
                         self.me.id, p.info.id, address)
                self.on_change(tr)

    def _on_heartbeat(self, msg: Message, reply: Callable[[Message], None]) -> None:
        before = self.members.get(msg["node"])
        loaded = before.load.get("plan_version") if before is not None else None
        tr = self.members.heartbeat(msg["node"], msg["incarnation"], time.monotonic(), msg["load"])
        after = self.members.get(msg["node"])
        if self.on_beat is not None and (tr is not None or (after is not None and after.load.get("plan_version") != loaded)):
            self.on_beat()  # only news: a peer's state or the plan it has loaded changed
        if tr is not None:
            self.on_change(tr)
            return
        p = self.members.get(msg["node"])
        if p is not None and self.greet is not None and msg["incarnation"] > p.info.incarnation:
            # a newer life of a peer, restarted at its address before we saw it dead: greet it (it
            # learns of us, and we of it, at once; a restarted seed knew no one until its peers
            # declared its earlier life dead, 2.5 s, and greeted it again)
            self.greet(p.info.address)

    def _on_leave(self, msg: Message, reply: Callable[[Message], None]) -> None:
        tr = self.members.leave(msg["node"], msg["incarnation"], time.monotonic())
        if tr is not None:
            self.on_change(tr)

    def _on_status(self, msg: Message, reply: Callable[[Message], None]) -> None:
        reply(make(MsgType.STATUS_REP, status=self.status()))
