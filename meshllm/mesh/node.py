"""One mesh node in one process: composes transport, membership, discovery and roles.

`run_node(cfg)` is what `python launch.py --node-config NODE.yaml` runs: it joins
the mesh (seeds and/or mDNS), heartbeats, answers `--status`, takes part in the
coordinator election, applies every plan (loading its own layer range, roles/host.py),
runs the OpenAI-compatible gateway if its node file has `gateway: {listen: HOST:PORT}`,
and on SIGINT or SIGTERM tells its peers it is leaving and exits 0. A node refused
for a duplicate id exits 1. A node that may compute imports torch before it joins (about
1.4 s here; `roles.host.preload_compute`): on the compute thread, once a plan came, the import
stalled the I/O thread's heartbeats. The module itself imports no torch (`--status` stays fast).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from meshllm.errors import InputError
from meshllm.mesh.agent import MeshAgent
from meshllm.mesh.discovery import SERVICE_TYPE, Gossip, MdnsDiscovery
from meshllm.mesh.ingress import LinkShaper
from meshllm.mesh.keys import AUTH_RELOAD_S, HANDSHAKE_FAILED, NodeKeys, handshake_failure
from meshllm.mesh.membership import Membership, PeerInfo
from meshllm.mesh.protocol import MsgType, ProtocolError, decode, encode, make
from meshllm.mesh.sockets import client_socket
from meshllm.mesh.transport import Transport
from meshllm.node_config import NodeConfig
from meshllm.roles.coordinator import Coordinator
from meshllm.roles.host import RoleHost, preload_compute

log = logging.getLogger("meshllm.mesh.node")

EXIT_OK, EXIT_REFUSED = 0, 1


def self_info(cfg: NodeConfig) -> PeerInfo:
    device = {k: v for k, v in dataclasses.asdict(cfg.device).items() if k != "source"}
    return PeerInfo(cfg.id, cfg.advertise_address, cfg.zone, device, tuple(cfg.roles or ()),
                    incarnation=time.time_ns() // 1_000_000)


class Node:
    """A started node. `stop()` leaves the mesh and closes every socket."""

    def __init__(self, cfg: NodeConfig):
        self.cfg = cfg
        self.me = self_info(cfg)
        self.refused: str | None = None
        self.stopped = threading.Event()
        self.members = Membership(cfg.id, heartbeat_interval_s=cfg.heartbeat_interval_s,
                                  failure_timeout_s=cfg.failure_timeout_s)
        keys = (NodeKeys.load(cfg.id, cfg.node_key, cfg.authorized_keys, cfg.source) if cfg.node_key
                else NodeKeys.cluster(cfg.id, cfg.cluster_key, cfg.source) if cfg.cluster_key else None)
        self.transport = Transport(cfg.id, cfg.zone, cfg.listen, LinkShaper(cfg.zone, cfg.links, cfg.time_scale),
                                   keys=keys, rate=cfg.rate_limit)
        self.transport.local_address = cfg.advertise_address
        self._pin_seeds()
        if keys is not None:
            self.transport.every(AUTH_RELOAD_S, self._reload_keys)
        self.host = RoleHost(self.transport, cfg, self.members)
        self.gateway = self.api = None  # built below, after the mesh agent, if the node file has `gateway:`
        self._up: set[str] = set()  # the parts start() has started: stop() stops those
        self.mesh = MeshAgent(self.transport, self.members, self.me, self._serving,
                              lambda: self.host.ctx.plan.to_json() if self.host.ctx is not None else None)
        self.transport.on_peer_gone = self.mesh.peer_gone
        self.mesh.on_gone.append(self.host.gateway_gone)  # its requests' sequences are released at once
        self.gossip = Gossip(self.transport, self.members, self.me, cfg.seeds, self.mesh.on_change, self._refuse,
                             lambda: self.host.max_seen, cfg.failure_timeout_s + 2 * cfg.heartbeat_interval_s)
        self.mesh.greet = self.gossip.greet
        self.mdns = MdnsDiscovery(self.me, self._mdns_found, self._refuse) if cfg.mdns else None
        self.coordinator = Coordinator(self.transport, self.members, self.me, cfg, lambda: self.host.max_seen,
                                       self.host.offer, self.host.weights.args, lambda: self.host.plan_error,
                                       lambda: self.host.ctx.plan if self.host.ctx is not None else None,
                                       self.gossip.in_doubt, self.host.model_id)
        self.host.coordinator_of = self.coordinator.current
        # a plan applied here is said at once, not at the next heartbeat (up to 0.5 s later): gateways
        # wait for a replica's nodes to say they serve a new plan before they resume a request there
        self.host.listeners.append(lambda ctx: self.transport.call_soon(self.mesh.beat))
        if cfg.fault_injection:  # emulation only: the emulator cuts links between zones on request
            self.transport.on(MsgType.FAULT, self._on_fault)
        if cfg.gateway:
            from meshllm.roles.gateway import Gateway  # lazy: aiohttp, the tokenizer
            from meshllm.roles.http_api import ApiServer

            self.gateway = Gateway(self.transport, self.members, self.me, cfg)
            self.gateway.local_load = self.mesh.load
            self.host.listeners.append(self.gateway.on_plan)
            self.mesh.on_beat = self.gateway.wake
            self.api = ApiServer(self.gateway, cfg.gateway, cfg.api_token, cfg.drain_s)

    def start(self) -> Node:
        preload_compute(self.cfg)  # before the I/O thread heartbeats: importing torch stalls it
        if self.gateway is not None:
            self.gateway.model.load(self.cfg.model, self.host.weights)  # a bad model path fails here, before joining
            self.api.start()
            self._up.add("api")
            log.info("%s: gateway serving the OpenAI API on http://%s", self.me.id, self.cfg.gateway)
        self._up.add("host")  # (its start may fail half way: its close copes)
        self.host.start()
        self._up.add("coordinator")
        self.coordinator.start()
        self.transport.start()
        self._up.add("transport")
        if self.gateway is not None:
            self.gateway.model.start()  # a gateway without the model file fetches the tokenizer now
        if self.mdns is not None:
            self.mdns.start()
            self._up.add("mdns")
        log.info("%s: listening on %s (zone %s, incarnation %d)", self.me.id, self.me.address, self.me.zone,
                 self.me.incarnation)
        return self

    def stop(self, leave: bool = True) -> None:
        """Stop what start() started (a start that failed half way, e.g. on a bad tokenizer file,
        had its error hidden by a RuntimeError from joining threads that never started)."""
        if "api" in self._up:
            self.api.close()
            self.gateway.close()
        if leave and self.refused is None and "transport" in self._up:
            self.mesh.leave()
        self.transport.close()
        if "coordinator" in self._up:
            self.coordinator.close()
        if "host" in self._up:
            self.host.close()
        if "mdns" in self._up:
            self.mdns.close()
        self.stopped.set()

    def busy(self) -> list[str]:
        """The threads still in a job after stop() (a layer load or a plan search can take longer
        than a Worker's CLOSE_WAIT_S)."""
        workers = (self.host.worker, self.host.weights.worker, self.coordinator.worker)
        return [w.name for w in workers if w.busy()]

    def _serving(self) -> dict[str, Any]:
        """What heartbeats and `--status` say of this node's roles and load: its part in the plan,
        and its gateway if it runs one (the API's address, requests in flight, its limit)."""
        st = self.host.figures.status()
        if self.coordinator.last_error and self.coordinator.is_coordinator():
            st = {**st, "load": {**st["load"], "planner_error": self.coordinator.last_error}}
        if self.gateway is None:
            return st
        ctx = self.gateway.ctx
        gw = {"listen": self.cfg.gateway, "in_flight": self.gateway.in_flight(),
              "max_concurrent": self.cfg.max_concurrent,
              # its requests' KV claims on decode replicas, which the other gateways count (roles/gateway.py)
              "plan_version": ctx.version if ctx is not None else -1,
              "kv_claims": sorted([rid, n] for rid, n in self.gateway.kv.claims().items())}
        return {**st, "roles": [*st["roles"], "gateway"], "load": {**st["load"], "gateway": gw}}

    def _pin_seeds(self) -> None:
        for address, seed_id in self.cfg.seed_ids:  # CURVE: a seed's key is its id's in the authorized keys
            self.transport.pin(seed_id, address, first_hand=True)

    def _reload_keys(self) -> None:
        """A changed authorized-keys file (keys.py): close what leads to removed nodes, and their
        connections to this node's PUB; a seed re-keyed in the file is pinned again."""
        changes = self.transport.keys.refresh()
        if changes is None:
            return
        for address in changes[2]:
            self.transport.forget(address)
        if changes[1] or changes[2]:  # a removed (or re-keyed) node's own connection to our PUB goes too
            self.transport.cut_subscribers()
        self._pin_seeds()

    def _refuse(self, why: str) -> None:
        log.error("%s: %s; this node will not join", self.me.id, why)
        self.refused = why  # run_node sees it and stops

    def _on_fault(self, msg, reply) -> None:
        zones = msg["zones"]
        if len(zones) != 2 or not all(isinstance(z, str) for z in zones) or not 0 < msg["seconds"] <= 3600:
            raise ProtocolError(f"FAULT: bad partition {zones!r:.60} for {msg['seconds']!r} s")
        log.warning("%s: emulated partition between %s and %s for %.1f s", self.me.id, zones[0], zones[1],
                    msg["seconds"])
        self.transport.shaper.partition(zones[0], zones[1], float(msg["seconds"]))
        reply(make(MsgType.PONG))

    def _mdns_found(self, name: str, address: str) -> None:
        log.debug("%s: mdns found %s at %s", self.me.id, name, address)
        node_id = name.removesuffix("." + SERVICE_TYPE)
        if self.transport.pin(node_id, address, first_hand=False):  # CURVE: an admitted id's key, or nothing
            self.transport.call_soon(lambda: self.gossip.greet(address))


def raise_open_files_limit() -> int:
    """Lift this process's soft limit on open files to its hard limit (what Go programs do at
    start): a node holds a socket per peer and per API client, and the usual soft limit of 1024
    let ~1100 idle HTTP connections lock every client out of the gateway. Returns the limit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as e:
            log.warning("cannot raise the open files limit from %d to %d: %s", soft, want, e)
    return soft


def run_node(cfg: NodeConfig) -> int:
    """Run until SIGINT/SIGTERM (exit 0) or a duplicate-id refusal (exit 1)."""
    raise_open_files_limit()
    stop = threading.Event()
    node = Node(cfg)  # binds the sockets: a port in use fails here, before any signal handling
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        node.start()
        while not stop.is_set() and node.refused is None:
            stop.wait(0.2)
    finally:
        node.stop(leave=True)
        for s, h in previous.items():
            signal.signal(s, h)
    if node.refused is not None:
        log.error("%s: refused to join the mesh: %s", cfg.id, node.refused)
        code = EXIT_REFUSED
    else:
        log.info("%s: left the mesh", cfg.id)
        code = EXIT_OK
    if busy := node.busy():  # the interpreter's exit under a thread inside torch aborts (exit 134)
        log.warning("%s: %s still busy (loading layers or planning); exiting without waiting for it",
                    cfg.id, ", ".join(busy))
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def split_target(target: str) -> tuple[str | None, str]:
    """'[ID@]HOST:PORT' -> (ID or None, 'HOST:PORT')."""
    node_id, at, address = target.rpartition("@")
    return (node_id or None) if at else None, address


def _ask(target: str, msg, keys: NodeKeys | None) -> _Asked:
    """A DEALER to the node at '[ID@]HOST:PORT' with `msg` sent. With per-node CURVE keys (`keys`,
    default from $MESHLLM_NODE_KEY and $MESHLLM_AUTHORIZED_KEYS) the node's id must be given: its
    public key is pinned. With $MESHLLM_CLUSTER_KEY it need not."""
    keys = keys if keys is not None else NodeKeys.from_env()
    node_id, address = split_target(target)
    if keys is not None and not keys.shared:  # (with a cluster key any node's key is the one the CLI holds)
        if node_id is None or not keys.pin(node_id, address, first_hand=True):
            raise InputError(f"{target}: a mesh with CURVE needs the node's id as ID@HOST:PORT, with ID in "
                             "the authorized keys")
    sock, peer, mon = client_socket(zmq.Context.instance(), zmq.DEALER, address, keys,
                                    watch=HANDSHAKE_FAILED if keys is not None else 0)
    sock.send_multipart(encode(msg))
    return _Asked(sock, mon, peer, address, keys)


class _Asked:
    """A DEALER with one request sent; with CURVE, a failed handshake ends the wait at once
    (InputError: a key refused, or a node there that is not the one named) instead of a timeout."""

    def __init__(self, sock: zmq.Socket, mon: zmq.Socket | None, peer: str | None, address: str,
                 keys: NodeKeys | None):
        self.sock, self.mon, self.peer, self.address, self.keys = sock, mon, peer, address, keys
        self.poller = zmq.Poller()
        self.poller.register(sock, zmq.POLLIN)
        if mon is not None:
            self.poller.register(mon, zmq.POLLIN)

    def poll(self, timeout_ms: int) -> bool:
        """Whether a reply came within `timeout_ms`."""
        ready = dict(self.poller.poll(timeout_ms))
        if self.mon is not None and self.mon in ready:
            event = recv_monitor_message(self.mon)["event"]
            if event & HANDSHAKE_FAILED and self.keys is not None:
                raise InputError(handshake_failure(event, self.peer, self.address, self.keys))
        return self.sock in ready

    def close(self) -> None:
        if self.mon is not None:
            self.sock.disable_monitor()
            self.mon.close(linger=0)
        self.sock.close(linger=0)


def query_status(target: str, timeout_s: float = 3.0, keys: NodeKeys | None = None) -> dict[str, Any]:
    """Ask the node at '[ID@]HOST:PORT' for its view of the mesh (the `--status` JSON object).
    A mesh with CURVE needs `keys` (or $MESHLLM_NODE_KEY and $MESHLLM_AUTHORIZED_KEYS) and the ID."""
    asked = _ask(target, make(MsgType.STATUS_REQ), keys)
    sock = asked.sock
    try:
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not asked.poll(int(left * 1000) + 1):
                continue
            try:
                reply = decode(sock.recv_multipart())
            except ProtocolError as e:
                raise RuntimeError(f"{target} answered with a malformed message: {e}") from None
            if reply.type is MsgType.STATUS_REP:
                return reply["status"]
        raise TimeoutError(f"no status reply from {target} within {timeout_s:g} s (is a node running there? "
                           "a mesh with CURVE also needs MESHLLM_NODE_KEY, MESHLLM_AUTHORIZED_KEYS and ID@HOST:PORT, "
                           "or MESHLLM_CLUSTER_KEY with a cluster key)")
    finally:
        asked.close()


def send_control(target: str, msg, timeout_s: float = 3.0, keys: NodeKeys | None = None) -> None:
    """Send one message to the node at '[ID@]HOST:PORT' and wait for its answer (emulator control)."""
    asked = _ask(target, msg, keys)
    try:
        deadline = time.monotonic() + timeout_s
        while not asked.poll(int(max(0.0, deadline - time.monotonic()) * 1000)):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{target} did not answer {msg.type.name} within {timeout_s:g} s")
        asked.sock.recv_multipart()
    finally:
        asked.close()


def format_status(st: dict[str, Any]) -> str:
    """A human-readable table of a `--status` reply."""
    stage = st.get("load", {}).get("stage")
    plan = st.get("plan") if isinstance(st.get("plan"), dict) else {}
    replicas = [r for r in plan.get("replicas", []) if isinstance(r, dict) and isinstance(r.get("stages"), list)]
    where = ""
    if stage:  # layer ranges are half-open, as the plan's; stages counted from 1, as the logs do
        start, end = stage["layers"]
        of = next((f"/{len(r['stages'])}" for r in replicas if r.get("id") == stage["replica"]), "")
        where = f"  replica {stage['replica']} stage {stage['index'] + 1}{of} layers [{start}, {end})"
    seen = st.get("load", {}).get("plan_seen")  # a newer plan received: loading, or refused (below)
    newer = f" (v{seen} received, not serving it yet)" if isinstance(seen, int) and seen > st["plan_version"] else ""
    lines = [f"node {st['node']}  plan v{st['plan_version']}{newer}  roles {','.join(st['roles']) or '-'}{where}"]
    for r in replicas:  # the whole plan, as this node serves it: each node's role and layers
        parts = [f"{s.get('node')} [{s['layers'][0]}, {s['layers'][1]})" for s in r["stages"]
                 if isinstance(s, dict) and isinstance(s.get("layers"), list) and len(s["layers"]) == 2]
        lines.append(f"  plan: replica {r.get('id')} {r.get('role')}: {' -> '.join(parts)}")
    for key in ("drafters", "unused"):
        if plan.get(key):
            lines.append(f"  plan: {key} {', '.join(map(str, plan[key]))}")
    err = st.get("load", {}).get("plan_error")
    if isinstance(err, dict):  # it could not take its part of that plan
        lines.append(f"  could not take its part of plan v{err.get('plan_version')}: {err.get('error')}")
    lead = st.get("load", {}).get("leader")
    if isinstance(lead, dict):  # the replica's scheduler: its sequences and their KV against what the stages hold
        room = lead.get("kv_room")
        kv = f"KV {lead.get('kv_held', 0)} of {room} positions" if room is not None else "KV not limited"
        lines.append(f"  leader: {lead.get('active', 0)} running, {lead.get('queued', 0)} queued, {kv}, "
                     f"{lead.get('kv_waits', 0)} waited for KV room, {lead.get('kv_denied', 0)} reservations refused")
    gw = st.get("load", {}).get("gateway")
    if isinstance(gw, dict):  # requests in flight (those waiting for KV room too), their KV claims per replica
        got = gw.get("kv_claims")
        claims = ", ".join(f"replica {c[0]} {c[1]}" for c in (got if isinstance(got, list) else [])
                           if isinstance(c, list) and len(c) == 2) or "none"
        lines.append(f"  gateway: {gw.get('listen')}, {gw.get('in_flight', 0)} in flight of "
                     f"{gw.get('max_concurrent')}, KV claims (positions): {claims}")
    lines.append(f"{'PEER':<16}{'STATE':<9}{'ADDRESS':<22}{'ZONE':<10}DEVICE")
    for p in st["peers"]:
        dev = p["device"].get("name", "?") if isinstance(p["device"], dict) else p["device"]
        lines.append(f"{p['id']:<16}{p['state']:<9}{p['address']:<22}{p.get('zone', ''):<10}{dev}")
    return "\n".join(lines)
