"""A gateway's KV admission (roles/batcher.py says why): what each decode (or mixed) replica may
still hold. `KvBook` reads the replicas' KV rooms from their leaders' heartbeats, the claims of
this gateway's requests (the most KV each may come to on its decode replica: `Stream.kv_charge`)
and those the other gateways' heartbeats carry, says whether a request may be sent now, and
holds the others back in arrival order (`wait_for_room`). Before a request is sent it asks the
decode replica's leader for the room (`reserve`, KV_RESERVE: the claims are up to a heartbeat
old; roles/batcher.py KvGrants answers). roles/gateway.py sends and routes with it;
mesh/node.py puts `claims()` in this node's heartbeats."""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from meshllm.defaults import DECODE_TARGETS
from meshllm.mesh.inbox import RemoteError
from meshllm.mesh.protocol import MsgType, make
from meshllm.roles.batcher import decode_charge
from meshllm.roles.route_view import RequestError, Stream

if TYPE_CHECKING:
    from meshllm.roles.gateway import Gateway

MAX_CLAIM = 1 << 40  # KV positions: a peer gateway's claim on a replica above this is malformed
POLL_S = 0.2  # how often a held request looks for room
RESERVE_TIMEOUT_S = 5.0  # x time_scale: a decode leader that does not answer KV_RESERVE in this long
DEAD_LEADER_CHECK_S = 0.25  # meanwhile, how often it looks whether that leader was seen dead
FULL_S = 1.0  # a replica whose leader refused room counts as full this long (about a heartbeat)
ASK_THREADS = 4  # KV_RESERVE requests waiting for their answers at once


class KvDenied(RequestError):
    """The decode replica's leader has no room for the request now: it waits for room again."""


class KvBook:
    def __init__(self, gw: Gateway):
        self.gw = gw
        self.waiting: deque[Stream] = deque()  # requests held back for KV room, in arrival order
        self.full: dict[int, float] = {}  # replica -> until when it counts as full (its leader refused room)
        # KV_RESERVE waits for its answer: not on the gateway's send thread (a leader slow to
        # answer would hold up every other request's GENERATE_REQ behind it)
        self.ask_pool = ThreadPoolExecutor(ASK_THREADS, thread_name_prefix="gw-reserve")

    async def wait_for_room(self, s: Stream, again: bool = False) -> None:
        """Back-pressure: `s` waits here, not on a replica's stages, while no decode replica has KV
        room left for it, first come first served (a request that needs a whole replica is not
        passed for ever by smaller ones). A request pinned to a replica does not wait. `again`:
        the leader refused the room `s` was sent for; it waits at the head of the line."""
        if s.settings["pin"] is not None:
            return
        self.waiting.appendleft(s) if again else self.waiting.append(s)
        try:
            while not (self.waiting[0] is s and self.room_for(s)):
                if self.gw.closing:
                    raise RequestError(self.gw.closing, "shutting_down")
                await asyncio.sleep(POLL_S)
        finally:
            self.waiting.remove(s)

    def rooms(self) -> dict[int, int]:
        """Each replica's KV room in positions, as its leader last said (its node's heartbeat, or
        this node's own load); a replica whose leader has not said is left out."""
        gw, out = self.gw, {}
        for r in gw.ctx.plan.replicas if gw.ctx is not None else ():
            node = r.stages[0].node
            peer = gw.members.get(node) if node != gw.me else None
            load = gw.local_load() if node == gw.me else peer.load if peer is not None else {}
            lead = load.get("leader") if isinstance(load, dict) else None
            room = lead.get("kv_room") if isinstance(lead, dict) and lead.get("replica") == r.id else None
            if isinstance(room, int) and not isinstance(room, bool):
                out[r.id] = room
        return out

    def claims(self) -> dict[int, int]:
        """What this gateway's requests may come to on each decode replica, in KV positions (its
        heartbeats carry it, so that the other gateways count it too)."""
        held: Counter[int] = Counter()
        with self.gw._lock:
            for st in self.gw._streams.values():
                if st.kv_charge:
                    held[st.decode_rid] += st.kv_charge
        return dict(held)

    def others(self) -> Counter[int]:
        """What the other live gateways' requests may come to on each decode replica of this plan,
        as their last heartbeats said (a stale or malformed claim counts for nothing)."""
        ctx, out = self.gw.ctx, Counter()
        if ctx is None:
            return out
        rids = {r.id for r in ctx.plan.replicas}
        for p in self.gw.members.peers():
            load = p.load.get("gateway") if p.state.value == "alive" and isinstance(p.load, dict) else None
            if not isinstance(load, dict) or load.get("plan_version") != ctx.version:
                continue
            claims = load.get("kv_claims")
            for item in claims if isinstance(claims, list) else ():
                if (isinstance(item, list) and len(item) == 2 and all(type(x) is int for x in item)
                        and item[0] in rids and 0 <= item[1] <= MAX_CLAIM):
                    out[item[0]] += item[1]
        return out

    def left(self, rooms: dict[int, int] | None = None) -> dict[int, int]:
        """Each replica's KV room less what the requests of this gateway and of the others (as their
        heartbeats say) decoding there may come to (a replica holding none: its whole room)."""
        held = self.others()
        held.update(self.claims())
        now = time.monotonic()
        return {rid: 0 if self.full.get(rid, 0.0) > now else room - held[rid]
                for rid, room in (self.rooms() if rooms is None else rooms).items()}

    async def reserve(self, s: Stream, leader: str, version: int) -> None:
        """Ask the leader of `s`'s decode replica for its KV room before `s` is sent (KV_RESERVE:
        the heartbeats' claims are up to a heartbeat old, and other gateways may be sending at this
        moment). Raises KvDenied (the replica counts as full for FULL_S), or RequestError when the
        leader does not answer. The room is given back when the sequence ends or is released (`s`
        is already among the gateway's streams, so a client gone meanwhile releases it)."""
        gw = self.gw
        msg = make(MsgType.KV_RESERVE, seq=s.seq, replica=s.decode_rid, positions=s.kv_charge, plan_version=version)
        ctx = gw.ctx
        node = ctx.replica(s.decode_rid).stages[0].node if ctx is not None and ctx.has_replica(s.decode_rid) else ""
        asked = s.loop.run_in_executor(self.ask_pool, gw.t.request, leader, msg, RESERVE_TIMEOUT_S * gw.time_scale)
        try:
            while not (await asyncio.wait({asked}, timeout=DEAD_LEADER_CHECK_S))[0]:
                if node in gw.dead_nodes():  # not RESERVE_TIMEOUT_S (x time_scale) for an answer that cannot come
                    raise RequestError(f"replica {s.decode_rid}'s leader {node} died")
            rep = asked.result()
        except (TimeoutError, OSError, RemoteError) as e:
            raise RequestError(f"replica {s.decode_rid} did not answer for KV room: {e}") from None
        finally:  # left before its answer (a dead leader, a client gone): its end is nobody's news
            asked.add_done_callback(lambda f: f.cancelled() or f.exception())
        if rep.type is not MsgType.KV_GRANT or rep.fields.get("seq") != s.seq:
            raise RequestError(f"replica {s.decode_rid} answered KV_RESERVE with {rep.type.name}")
        if rep.fields.get("granted") is not True:
            self.full[s.decode_rid] = time.monotonic() + FULL_S * gw.time_scale
            raise KvDenied(f"replica {s.decode_rid} has no KV room for {s.kv_charge} positions now")

    def room_for(self, s: Stream) -> bool:
        """May `s` be sent now: some ready decode (or mixed) replica has KV room left for it, or
        holds no request of any gateway (one larger than a whole room runs there alone), or none
        says its room (no limit known). (A pinned request does not ask: `wait_for_room`.)"""
        gw = self.gw
        if gw.ctx is None:
            return True
        rooms, ready = self.rooms(), set(gw.ready_replicas())
        left = self.left(rooms)
        charge = decode_charge(len(s.prompt) + len(s.emitted), s.n_out - len(s.emitted), False,
                               gw.model.max_context)
        targets = [r.id for r in gw.ctx.plan.replicas if r.id in ready and str(r.role) in DECODE_TARGETS]
        return not targets or any(rid not in left or left[rid] >= charge or left[rid] == rooms[rid]
                                  for rid in targets)
