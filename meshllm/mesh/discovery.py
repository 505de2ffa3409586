"""How nodes find each other: a `seeds:` list plus peer-list gossip, and mDNS/DNS-SD.

Seeds and gossip. A node sends HELLO (its id, address, zone, device, roles,
incarnation) to each seed until one answers, retrying with capped exponential
backoff. The answer is PEERS: the seed's own entry plus every live peer it
knows. Every node also broadcasts PEERS on its PUB every GOSSIP_INTERVAL_S, and
says HELLO directly to each peer it learns of, so one seed is enough and a
newcomer is known to all within about one round trip.

Duplicate ids. A node that receives a HELLO claiming its own id, or the id of a
live peer at another address, answers ERROR code "duplicate_id" and logs it; the
newcomer logs the refusal and stops (exit code 1). The node that started first
(smaller incarnation) keeps the id, whoever greets whom: a newcomer greeted by
the older holder (mDNS finds both ways) refuses itself, and a refusal naming a
holder younger than us is ignored. zeroconf's own name probe is a third check.
The holder may be this node's own former life, killed or on a host that hung, not
yet seen dead (a node restarted at another address: a container's new IP, another
port): so for the failure timeout and two heartbeats after its start (`wait_s`) a
newcomer takes a peer's refusal as "not yet", says so once, and greets its seeds again
every JOIN_RETRY_MIN_S; once its former life is seen dead it joins. A holder still
alive then refuses it for good, as does a holder that greets it (alive, then). (It
used to stop at the first refusal: the restart failed, and the node stayed out.)

Left out. A node greets a live peer whose PEERS broadcast does not list it (at this address),
at most every GOSSIP_INTERVAL_S / 2 a peer. With mDNS only, a node restarted at another
address had no seeds to greet again: a peer that found it, greeted it and refused it stayed
alive in its table, and that peer, once it saw the former life dead, knew nothing of the new
one: the node stayed out for good, though it had the peer's plans. The same greeting heals a
view that lost a live node one way (a peer that declared it dead hears it again).

mDNS. With `mdns: true` a node registers `<id>._meshllm._tcp.local.` (address,
port, and a TXT record with id/zone) with zeroconf and browses the same type;
each service found is greeted with a HELLO, so the seed path above does the rest.
It binds the advertise address's interface only (127.0.0.1 in local emulation), so a node on a
LAN and a VPN is announced on the LAN alone; if that address is none of this host's (behind a
NAT), zeroconf uses every interface, with a warning (`mdns_interfaces`).

With CURVE (keys.py) every peer learned is pinned to its node id's public key before any
socket dials it: a seed is `ID@HOST:PORT`, a HELLO or a PEERS entry about its own sender is
first-hand, other gossip entries and mDNS names only fill gaps, and ids outside the
authorized keys are ignored.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections.abc import Callable

from meshllm.device import device_from_mapping
from meshllm.mesh.fields import check_address
from meshllm.mesh.membership import Membership, PeerInfo, PeerState, Transition
from meshllm.mesh.protocol import Message, MsgType, ProtocolError, make
from meshllm.mesh.transport import Transport

log = logging.getLogger("meshllm.mesh.discovery")

GOSSIP_INTERVAL_S = 1.0
JOIN_RETRY_MIN_S = 0.25  # first HELLO retry to an unanswered seed
JOIN_RETRY_MAX_S = 4.0  # backoff cap
SEED_SILENT_WARN_S = 10.0  # a seed silent this long is reported (once until it answers): a typo, a down node
SERVICE_TYPE = "_meshllm._tcp.local."
MDNS_RESOLVE_TIMEOUT_MS = 3000
MDNS_LISTEN_FIRST_S = 0.3  # browse this long before registering our own name


def check_peer(info: PeerInfo) -> PeerInfo:
    """A peer as a HELLO or gossip describes it: an id, an address the sockets take, a device
    profile the planner takes (else ValueError: it would fail later, in every node it reaches)."""
    if not info.id:
        raise ValueError("empty node id")
    check_address(info.address)
    device_from_mapping(info.id, info.device, f"the device of {info.id!r}")
    return info


class Gossip:
    """HELLO/PEERS handling and seed joining. Runs on the transport's I/O thread."""

    def __init__(self, transport: Transport, members: Membership, me: PeerInfo, seeds: tuple[str, ...],
                 on_change: Callable[[Transition], None], on_refused: Callable[[str], None],
                 plan_seen: Callable[[], int] = lambda: 0, wait_s: float = 0.0):
        self.t, self.members, self.me = transport, members, me
        self.refuse_after = time.monotonic() + wait_s  # till then a refusal may name our own former life
        self._told_waiting = False
        self.on_change, self.on_refused = on_change, on_refused
        self.plan_seen = plan_seen  # the newest plan version this node has seen: said in HELLO and PEERS
        now = time.monotonic()
        # seed address -> [next attempt (monotonic s), current backoff (s)]
        self._seeds = {s: [now, JOIN_RETRY_MIN_S] for s in seeds if s != me.address}
        self._silent_since = {s: now for s in self._seeds}  # seed -> since when it has not answered (None: reported)
        self._left_out: dict[str, float] = {}  # live peer -> when we last greeted it for leaving us out
        self._refused: set[tuple[str, str, int]] = set()  # newcomers refused (id, address, incarnation): logged once
        self._told_twin: set[tuple[str, str]] = set()  # (peer, address) that gossiped another node with our id
        transport.on(MsgType.HELLO, self._on_hello)
        transport.on(MsgType.PEERS, self._on_peers)
        transport.on(MsgType.ERROR, self._on_error)
        transport.every(JOIN_RETRY_MIN_S, self._retry_seeds)
        transport.every(GOSSIP_INTERVAL_S, self._broadcast)

    def hello_msg(self) -> Message:
        m = self.me
        return make(MsgType.HELLO, node=m.id, incarnation=m.incarnation, address=m.address,
                    device=dict(m.device), roles=list(m.roles), plan_seen=self.plan_seen())

    def greet(self, address: str) -> None:
        """Say HELLO to `address` (I/O thread)."""
        if address != self.me.address:
            self.t.send(address, self.hello_msg())

    def peers_msg(self) -> Message:
        entries = [self.me.to_wire()] + [p.info.to_wire() for p in self.members.live()]
        return make(MsgType.PEERS, node=self.me.id, peers=entries, plan_seen=self.plan_seen())

    def _retry_seeds(self) -> None:
        now = time.monotonic()
        for addr, slot in self._seeds.items():
            if self._knows_address(addr):
                self._silent_since[addr] = now
                continue
            since = self._silent_since.get(addr)
            if since is not None and now - since >= SEED_SILENT_WARN_S:  # else an operator sees nothing at all
                self._silent_since[addr] = None
                alone = "" if self.members.live() else "; meanwhile this node is a mesh of its own"
                log.warning("%s: seed %s has not answered for %.0f s (is a node listening there, are the host and "
                            "port right, can this machine reach it?); still trying every %g s%s", self.me.id, addr,
                            now - since, JOIN_RETRY_MAX_S, alone)
            if now >= slot[0]:
                self.greet(addr)
                slot[1] = min(slot[1] * 2, JOIN_RETRY_MAX_S)
                slot[0] = now + slot[1]

    def _knows_address(self, address: str) -> bool:
        return any(p.info.address == address for p in self.members.live())

    def _broadcast(self) -> None:
        if self.members.live():
            self.t.publish(self.peers_msg())

    def _on_hello(self, msg: Message, reply: Callable[[Message], None]) -> None:
        info = PeerInfo(msg["node"], msg["address"], msg.zone, dict(msg["device"]),
                        tuple(str(r) for r in msg["roles"]), msg["incarnation"])
        try:
            check_peer(info)
        except ValueError as e:
            raise ProtocolError(f"HELLO: {e}") from None
        if self.members.conflicts(info):
            holder = self.me if info.id == self.me.id else self.members.get(info.id).info
            if holder is self.me and info.incarnation < self.me.incarnation:
                # it was here first (e.g. it found us by mDNS): we are the newcomer
                self.on_refused(f"node id {info.id!r} is already used by the node at {info.address}")
                return
            if (info.id, info.address, info.incarnation) not in self._refused:  # (it retries: ~7 lines in 3 s)
                if len(self._refused) >= 256:
                    self._refused.clear()
                self._refused.add((info.id, info.address, info.incarnation))
                log.error("%s: refusing newcomer at %s: node id %r is already used by the node at %s",
                          self.me.id, info.address, info.id, holder.address)
            reply(make(MsgType.ERROR, code="duplicate_id", holder_incarnation=holder.incarnation,
                       message=f"node id {info.id!r} is already used by the node at {holder.address}"))
            return
        self._learn(info, first_hand=True)
        self.members.note_plan_seen(info.id, info.incarnation, msg.fields.get("plan_seen"))
        reply(self.peers_msg())

    def _on_peers(self, msg: Message, reply: Callable[[Message], None]) -> None:
        listed = False  # this node, at its address, is among the sender's live peers
        for entry in msg["peers"]:
            try:
                info = check_peer(PeerInfo.from_wire(entry))
            except ValueError as e:
                log.warning("%s: ignoring a gossip entry from %r: %s", self.me.id, msg.src, e)
                continue
            if info.id == self.me.id:
                listed = listed or info.address == self.me.address
                if info.address != self.me.address and (msg.src, info.address) not in self._told_twin:
                    if len(self._told_twin) >= 64:  # from the network: keep it bounded
                        self._told_twin.clear()
                    self._told_twin.add((msg.src, info.address))
                    log.warning("%s: %r gossips another node with my id at %s", self.me.id, msg.src, info.address)
                continue
            self._learn(info, first_hand=info.id == msg.src)
            if info.id == msg.src:
                self.members.note_plan_seen(info.id, info.incarnation, msg.fields.get("plan_seen"))
        if not listed:
            self._greet_left_out(msg.src)

    def _greet_left_out(self, peer_id: str) -> None:
        """A live peer's gossip leaves this node out: greet it (module docstring, "Left out")."""
        p = self.members.get(peer_id)
        if p is None or p.state not in (PeerState.ALIVE, PeerState.SUSPECT):
            return
        now = time.monotonic()
        if now - self._left_out.get(peer_id, -1e9) < GOSSIP_INTERVAL_S / 2:
            return
        if len(self._left_out) >= 4 * len(self.members.live()) + 16:  # peers come and go: keep it bounded
            self._left_out.clear()
        self._left_out[peer_id] = now
        self.greet(p.info.address)

    def _on_error(self, msg: Message, reply: Callable[[Message], None]) -> None:
        older = msg.fields.get("holder_incarnation")
        if msg["code"] == "duplicate_id" and isinstance(older, int) and older > self.me.incarnation:
            log.warning("%s: %r calls us a duplicate, but the other holder started later: ignored", self.me.id,
                        msg.src)
        elif msg["code"] == "duplicate_id":
            why = f"refused by {msg.src!r}: {msg['message']}"
            if not self._maybe_former_life(why):
                self.on_refused(why)
        else:
            log.warning("%s: error from %r: %s: %s", self.me.id, msg.src, msg["code"], msg["message"])

    def in_doubt(self) -> bool:
        """A peer refused this node's id, and it waits to learn whether that was its former life:
        it must not plan a mesh of its own meanwhile (a duplicate planned itself and started
        loading the whole model before it was refused)."""
        return (self._told_waiting and not self.members.live()  # until a peer takes it, or the refusal
                and time.monotonic() < self.refuse_after + JOIN_RETRY_MAX_S)  # stands (then it stops)

    def _maybe_former_life(self, why: str) -> bool:
        """Within `refuse_after`, a refusal may name this node's former life not yet seen dead
        (module docstring): say so once, greet the seeds again soon, and go on waiting."""
        now = time.monotonic()
        if now >= self.refuse_after:
            return False
        if not self._told_waiting:
            log.warning("%s: %s; if that is this node's former life, its peers will see it dead: trying again "
                        "for up to %.1f s", self.me.id, why, self.refuse_after - now)
            self._told_waiting = True
        for slot in self._seeds.values():
            slot[0], slot[1] = min(slot[0], now + JOIN_RETRY_MIN_S), JOIN_RETRY_MIN_S
        return True

    def _learn(self, info: PeerInfo, first_hand: bool) -> None:
        if not self.t.pin(info.id, info.address, first_hand):  # CURVE: only admitted ids, pinned to their key
            log.debug("%s: ignoring %s at %s: not in the authorized keys, or that address is known as another "
                      "node", self.me.id, info.id, info.address)
            return
        tr = self.members.observe(info, time.monotonic(), first_hand=first_hand)
        if tr is None:
            return
        if tr.new is PeerState.ALIVE:
            self.t.subscribe(info.address)
            if not first_hand:
                self.greet(info.address)  # so it learns of us at once, not at its next gossip
        self.on_change(tr)


class MdnsDiscovery:
    """Register this node with zeroconf and greet every `_meshllm._tcp` service found."""

    def __init__(self, me: PeerInfo, on_found: Callable[[str, str], None], on_conflict: Callable[[str], None]):
        self.me, self.on_found, self.on_conflict = me, on_found, on_conflict
        self._names: queue.Queue[str | None] = queue.Queue()
        self._zc = None
        self._info = None
        self._browser = None
        self._my_name = f"{me.id}.{SERVICE_TYPE}"
        self._worker = threading.Thread(target=self._run, name=f"mdns-{me.id}", daemon=True)

    def start(self) -> None:
        self._worker.start()

    def _run(self) -> None:
        try:
            self._serve()
        except OSError as e:  # no usable multicast interface, socket errors
            log.error("%s: mDNS discovery stopped: %s; seeds and gossip still work", self.me.id, e)

    def _serve(self) -> None:
        from zeroconf import IPVersion, NonUniqueNameException, ServiceBrowser, ServiceInfo, Zeroconf

        host, _, port = self.me.address.rpartition(":")
        ip = socket.gethostbyname(host)
        ifaces = mdns_interfaces(ip, local_ipv4())
        if ifaces is None:
            log.warning("%s: the advertised address %s is none of this host's; mDNS announces on every interface",
                        self.me.id, ip)
        self._zc = Zeroconf(interfaces=ifaces, ip_version=IPVersion.V4Only) if ifaces else Zeroconf()
        self._browser = ServiceBrowser(self._zc, SERVICE_TYPE, handlers=[self._on_service])
        info = ServiceInfo(SERVICE_TYPE, self._my_name, addresses=[socket.inet_aton(ip)], port=int(port),
                           properties={"id": self.me.id, "zone": self.me.zone})
        self._drain(MDNS_LISTEN_FIRST_S)  # greet who is already there: a duplicate id is refused by HELLO
        try:
            self._zc.register_service(info, allow_name_change=False)
            self._info = info
        except NonUniqueNameException:
            self.on_conflict(f"node id {self.me.id!r} is already announced on mDNS by another live node")
        self._drain(None)

    def _drain(self, for_s: float | None) -> None:
        """Resolve found services for `for_s` seconds (None: until close)."""
        end = None if for_s is None else time.monotonic() + for_s
        while end is None or (left := end - time.monotonic()) > 0:
            try:
                name = self._names.get(timeout=None if end is None else left)
            except queue.Empty:
                return
            if name is None:
                self._names.put(None)  # keep the stop mark for the outer drain
                return
            self._resolve(name)

    def _on_service(self, zeroconf, service_type: str, name: str, state_change) -> None:
        if state_change.name in ("Added", "Updated"):
            self._names.put(name)

    def _resolve(self, name: str) -> None:
        info = self._zc.get_service_info(SERVICE_TYPE, name, timeout=MDNS_RESOLVE_TIMEOUT_MS)
        if info is None or not info.parsed_addresses():
            log.debug("%s: mdns could not resolve %s", self.me.id, name)
            return
        address = f"{info.parsed_addresses()[0]}:{info.port}"
        if address != self.me.address:
            self.on_found(name, address)

    def close(self) -> None:
        self._names.put(None)
        if self._worker.is_alive():
            self._worker.join(timeout=5.0)
        if self._zc is not None:
            if self._info is not None:
                self._zc.unregister_service(self._info)
            self._zc.close()


def local_ipv4() -> set[str]:
    """This host's IPv4 addresses, loopback included."""
    import psutil

    return {a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET}


def mdns_interfaces(ip: str, local: set[str]) -> list[str] | None:
    """The interfaces mDNS binds: the advertised address's own if it is one of this host's (`local`),
    else None (every interface: the advertised address is a NAT's, say)."""
    return [ip] if ip in local else None
