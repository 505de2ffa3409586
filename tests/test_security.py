"""Security: per-node CURVE keys with admission by ZAP, sender binding, wire confidentiality, per-peer
rate limits, the HTTP API's bearer token, key files and the CLI. Real sockets on 127.0.0.1 (and node
processes where the CLI is the subject); every wait is bounded and waits for an event, not a time."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
import zmq

from meshllm.device import device_from_mapping
from meshllm.errors import ConfigError, InputError
from meshllm.mesh.ingress import RateLimit, RateLimiter
from meshllm.mesh.keys import NodeKeys, UnknownPeerKey, generate_key, read_authorized_keys
from meshllm.mesh.membership import PeerState
from meshllm.mesh.node import Node, query_status
from meshllm.mesh.protocol import MsgType, encode, make
from meshllm.mesh.sockets import client_socket, endpoint, free_port_pair
from meshllm.mesh.transport import TOPIC_MESH, Transport, topic
from meshllm.node_config import NodeConfig, load_node
from tests.conftest import REPO, run_cli, spawn, wait_for

DEVICE = {"memory_gb": 8, "compute_tflops": 1, "memory_bandwidth_gbps": 50, "network_mbps": 1000}
DEV = device_from_mapping("inline", DEVICE, "test")
MARKER = "plaintext-marker-7f3a9c"


def addr() -> str:
    return f"127.0.0.1:{free_port_pair()}"




class Keyring:
    """Key files for node ids in a directory, and authorized-keys files listing some of them."""

    def __init__(self, d: Path, ids: list[str]):
        self.d = d
        self.public = {nid: generate_key(d / f"{nid}.key") for nid in ids}

    def key(self, nid: str) -> str:
        return str(self.d / f"{nid}.key")

    def authorized(self, ids: list[str], name: str = "authorized_keys") -> str:
        p = self.d / name
        p.write_text("# test mesh\n" + "".join(f"{nid} {self.public[nid]}\n" for nid in ids))
        return str(p)

    def keys(self, nid: str, auth: str) -> NodeKeys:
        return NodeKeys.load(nid, self.key(nid), auth)


@pytest.fixture
def ring(tmp_path: Path) -> Keyring:
    return Keyring(tmp_path, ["a", "b", "m", "x", "admin"])


@pytest.fixture
def closing() -> Iterator[list]:
    """Transports, nodes and sockets to close after the test, whatever happens."""
    items: list = []
    yield items
    for it in reversed(items):
        if isinstance(it, Node):
            if not it.stopped.is_set():
                it.stop(leave=False)
        elif isinstance(it, Transport):
            it.close_thread_sockets()
            it.close()
        else:
            it.close(linger=0)


def transport(closing: list, nid: str, keys: NodeKeys | None, **kw) -> tuple[Transport, str]:
    a = addr()
    t = Transport(nid, "z", a, keys=keys, **kw)
    closing.append(t)
    return t, a


def node_cfg(nid: str, listen: str, ring: Keyring, auth: str, seeds: tuple[tuple[str, str], ...] = ()) -> NodeConfig:
    return NodeConfig(source="test", id=nid, device=DEV, zone="z", listen=listen, seeds=tuple(a for a, _ in seeds),
                      seed_ids=seeds, mdns=False, heartbeat_interval_s=0.2, failure_timeout_s=1.0, model="tiny",
                      plan_settle_s=60.0, node_key=ring.key(nid), authorized_keys=auth)


def alive(node: Node) -> set[str]:
    return {p.info.id for p in node.members.peers() if p.state is PeerState.ALIVE}


# -- admission -------------------------------------------------------------------------------
def test_a_node_without_admission_cannot_join_and_is_never_heard(ring: Keyring, closing: list, caplog) -> None:
    """a and b list each other; x has its own key pair and a list naming itself, but is not in a's
    or b's list. The mesh forms without it, its handshakes are refused by ZAP (counted), nobody's
    membership ever lists it, and its requests time out. x's own log says that a refused its key
    (it said only that its HELLO was dropped and that its seed did not answer)."""
    caplog.set_level(logging.WARNING, logger="meshllm.mesh.transport")
    mesh_auth = ring.authorized(["a", "b"], "mesh_keys")
    x_auth = ring.authorized(["a", "b", "x"], "x_keys")  # x believes it belongs
    a_addr = addr()
    a = Node(node_cfg("a", a_addr, ring, mesh_auth)).start()
    closing.append(a)
    b = Node(node_cfg("b", addr(), ring, mesh_auth, ((a_addr, "a"),))).start()
    closing.append(b)
    x = Node(node_cfg("x", addr(), ring, x_auth, ((a_addr, "a"),))).start()
    closing.append(x)
    assert wait_for(lambda: alive(a) == {"b"} and alive(b) == {"a"})
    assert wait_for(lambda: a.transport.rejected >= 1)  # x's HELLO: refused in the handshake (ZAP, logged)
    with pytest.raises(TimeoutError):
        x.transport.request(a_addr, make(MsgType.PING), timeout_s=0.5)
    x.transport.close_thread_sockets()
    assert "x" not in {p.info.id for p in a.members.peers()} | {p.info.id for p in b.members.peers()}
    assert x.members.peers() == []  # nothing it sent got an answer
    told = [r.getMessage() for r in caplog.records if "refused the key of 'x'" in r.getMessage()]
    assert len(told) == 1 and f"the node at {a_addr}" in told[0] and ring.public["x"] in told[0], told
    assert a.transport.router.mechanism == zmq.CURVE and a.transport.pub.mechanism == zmq.CURVE


def test_a_running_mesh_reloads_its_authorized_keys(ring: Keyring, closing: list) -> None:
    """The operator adds x to the mesh's authorized-keys file: x joins without anyone restarting.
    A broken file is ignored (the list in force stays). Then x is removed: a and b drop it (its
    messages are refused, its connections closed) and declare it dead."""
    mesh = ring.authorized(["a", "b"], "mesh_keys")
    a_addr = addr()
    a = Node(node_cfg("a", a_addr, ring, mesh)).start()
    closing.append(a)
    b = Node(node_cfg("b", addr(), ring, mesh, ((a_addr, "a"),))).start()
    closing.append(b)
    x = Node(node_cfg("x", addr(), ring, ring.authorized(["a", "b", "x"], "x_keys"), ((a_addr, "a"),))).start()
    closing.append(x)
    assert wait_for(lambda: alive(a) == {"b"} and a.transport.rejected >= 1)  # x is refused
    ring.authorized(["a", "b", "x"], "mesh_keys")
    assert wait_for(lambda: alive(a) == {"b", "x"} and alive(b) == {"a", "x"} and alive(x) == {"a", "b"})
    Path(mesh).write_text("a not-a-key\n")  # a typo: logged, ignored
    assert wait_for(lambda: a.transport.keys._seen == (os.stat(mesh).st_mtime_ns, os.stat(mesh).st_size,
                                                       os.stat(mesh).st_ino), timeout_s=10)
    assert a.transport.keys.admits("x") and alive(a) == {"b", "x"}
    ring.authorized(["a", "b"], "mesh_keys")
    assert wait_for(lambda: "x" not in alive(a) and "x" not in alive(b) and alive(a) == {"b"})
    assert not a.transport.keys.admits("x") and not b.transport.keys.admits("x")
    with pytest.raises(UnknownPeerKey):
        a.transport.keys.peer_at(x.cfg.listen)
    # x's own connections to a's and b's PUB went too: it hears no heartbeat, plan or draft (it
    # read them all for as long as it ran), and a and b, whose subscribers reconnected, stay alive
    assert wait_for(lambda: alive(x) == set(), timeout_s=10), alive(x)
    assert alive(a) == {"b"} and alive(b) == {"a"}


def test_a_node_removed_and_added_again_rejoins(ring: Keyring, closing: list) -> None:
    """b's line is deleted from the mesh's list, then put back: a listed b dead for good (87 s
    and counting, in a run with 2 nodes): neither greeted the other again."""
    keys = ring.authorized(["a", "b"], "mesh_keys")
    a_addr = addr()
    a = Node(node_cfg("a", a_addr, ring, keys)).start()
    closing.append(a)
    b = Node(node_cfg("b", addr(), ring, ring.authorized(["a", "b"], "b_keys"), ((a_addr, "a"),))).start()
    closing.append(b)
    assert wait_for(lambda: alive(a) == {"b"} and alive(b) == {"a"})
    ring.authorized(["a"], "mesh_keys")
    assert wait_for(lambda: alive(a) == set() and alive(b) == set(), timeout_s=10)
    ring.authorized(["a", "b"], "mesh_keys")
    assert wait_for(lambda: alive(a) == {"b"} and alive(b) == {"a"}, timeout_s=15), (alive(a), alive(b))


def test_a_node_refused_before_its_peer_reloaded_its_keys_hears_it_once_admitted(ring: Keyring,
                                                                                closing: list) -> None:
    """x is added to a's list first and learns of b from a; b, which has not reloaded yet, refuses
    x's handshake to its PUB, and libzmq never tries that connection again: x saw b alive (gossip)
    and dead (no heartbeat) by turns for as long as it ran. Once b admits x, x hears b itself."""
    a_addr = addr()
    a = Node(node_cfg("a", a_addr, ring, ring.authorized(["a", "b", "x"], "a_keys"))).start()
    closing.append(a)
    b_keys = ring.authorized(["a", "b"], "b_keys")
    b = Node(node_cfg("b", addr(), ring, b_keys, ((a_addr, "a"),))).start()
    closing.append(b)
    assert wait_for(lambda: alive(a) == {"b"} and alive(b) == {"a"})
    x = Node(node_cfg("x", addr(), ring, ring.authorized(["a", "b", "x"], "x_keys"), ((a_addr, "a"),))).start()
    closing.append(x)
    assert wait_for(lambda: "x" in alive(a) and b.transport.rejected >= 1)  # x's SUB to b: refused by ZAP
    ring.authorized(["a", "b", "x"], "b_keys")
    assert wait_for(lambda: alive(x) == {"a", "b"} and alive(b) == {"a", "x"}, timeout_s=15)
    end = time.monotonic() + 3 * x.cfg.failure_timeout_s  # b stays alive to x: its heartbeats arrive
    while time.monotonic() < end:
        assert "b" in alive(x)
        time.sleep(0.02)


def test_an_unadmitted_subscriber_reads_no_publications(ring: Keyring, closing: list) -> None:
    """A publishes drafts on a topic. Admitted b receives them; a raw SUB with its own key pair that
    even knows a's public key, subscribed to everything, receives nothing."""
    auth = ring.authorized(["a", "b"])
    a, a_addr = transport(closing, "a", ring.keys("a", auth))
    b, _ = transport(closing, "b", ring.keys("b", auth))
    got: list[str] = []
    b.on(MsgType.PING, lambda m, reply: got.append(m.src))
    b.subscribe_topic(topic("draft/0"))
    assert b.pin("a", a_addr, first_hand=True)
    b.subscribe(a_addr)
    for t in (a, b):
        t.start()
    spy = zmq.Context.instance().socket(zmq.SUB)
    closing.append(spy)
    pub, sec = zmq.curve_keypair()
    spy.curve_publickey, spy.curve_secretkey = pub, sec
    spy.curve_serverkey = ring.public["a"].encode()
    spy.setsockopt(zmq.SUBSCRIBE, b"")
    spy.connect(endpoint(a_addr, 1))
    assert wait_for(lambda: (a.publish(make(MsgType.PING), topic("draft/0")), len(got) >= 20)[1])
    assert got[0] == "a"
    assert spy.poll(200) == 0  # 20+ publications later: nothing ever reached the unadmitted SUB
    assert wait_for(lambda: a.rejected >= 1)  # its handshake was refused (and logged)


# -- sender binding --------------------------------------------------------------------------
def test_an_admitted_node_cannot_pose_as_another(ring: Keyring, closing: list) -> None:
    """m is admitted. Through its own authenticated connection it tells a that b left, once with
    src "b" and once with its own src but node "b": both are dropped as forged and b stays alive
    at a. The same LEAVE about itself is obeyed, so the path works and only the forgery is refused.
    A forged LEAVE on m's PUB is dropped the same way."""
    auth = ring.authorized(["a", "b", "m"])
    a_addr, m_addr = addr(), addr()
    a = Node(node_cfg("a", a_addr, ring, auth)).start()
    closing.append(a)
    b = Node(node_cfg("b", addr(), ring, auth, ((a_addr, "a"),))).start()
    closing.append(b)
    m = Node(node_cfg("m", m_addr, ring, auth, ((a_addr, "a"),))).start()
    closing.append(m)
    assert wait_for(lambda: alive(a) == {"b", "m"})
    inc_b = a.members.get("b").info.incarnation

    keys = ring.keys("m", auth)
    keys.pin("a", a_addr, first_hand=True)
    dealer, peer, _ = client_socket(zmq.Context.instance(), zmq.DEALER, a_addr, keys)
    closing.append(dealer)
    assert peer == "a"
    for src, node in (("b", "b"), ("m", "b")):
        forged = make(MsgType.LEAVE, node=node, incarnation=inc_b)
        forged.src = src
        dealer.send_multipart(encode(forged))
    dealer.send_multipart(encode(make(MsgType.STATUS_REQ)))  # answered after the two LEAVEs were handled
    assert dealer.poll(10_000)
    assert a.transport.inbox.forged == 2
    assert a.members.get("b").state is PeerState.ALIVE  # the victim's state is unchanged

    m.transport.publish(make(MsgType.LEAVE, node="b", incarnation=inc_b))  # src is stamped "m"
    assert wait_for(lambda: a.transport.inbox.forged >= 3)  # on its SUB to m, a knows the publisher is m
    assert a.members.get("b").state is PeerState.ALIVE

    honest = make(MsgType.LEAVE, node="m", incarnation=a.members.get("m").info.incarnation)
    honest.src = "m"
    dealer.send_multipart(encode(honest))
    assert wait_for(lambda: a.members.get("m").state is PeerState.LEFT)
    assert a.members.get("b").state is PeerState.ALIVE


def test_a_client_pins_the_server_it_meant(ring: Keyring, closing: list) -> None:
    """An admitted m listening at an address its client believes is b's cannot answer for b: the
    handshake against b's key fails, so no reply from m is ever taken for b's."""
    auth = ring.authorized(["a", "b", "m"])
    m, m_addr = transport(closing, "m", ring.keys("m", auth))
    m.on(MsgType.PING, lambda msg, reply: reply(make(MsgType.PONG)))
    a, _ = transport(closing, "a", ring.keys("a", auth))
    for t in (m, a):
        t.start()
    assert a.pin("m", m_addr, first_hand=True)
    assert a.request(m_addr, make(MsgType.PING), timeout_s=10).src == "m"
    assert a.pin("b", m_addr, first_hand=True)  # e.g. a lie that b lives at m's address
    with pytest.raises(TimeoutError):
        a.request(m_addr, make(MsgType.PING), timeout_s=0.5)
    with pytest.raises(UnknownPeerKey):
        a.request(addr(), make(MsgType.PING), timeout_s=0.5)  # no pinned key: refused before dialing
    assert not a.pin("nobody", m_addr, first_hand=True)  # ids outside the list are never pinned


# -- the wire --------------------------------------------------------------------------------
class TcpTap:
    """A TCP relay 127.0.0.1:PORT -> target that records every byte in both directions."""

    def __init__(self, target: str):
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", free_port_pair()))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.captured = bytearray()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        pairs: dict[socket.socket, socket.socket] = {}
        self.listener.settimeout(0.05)
        while not self._stop.is_set():
            try:
                client, _ = self.listener.accept()
                server = socket.create_connection(self.target)
                pairs[client], pairs[server] = server, client
            except TimeoutError:
                pass
            if not pairs:
                continue
            ready, _, _ = select.select(list(pairs), [], [], 0.05)
            for s in ready:
                data = s.recv(65536)
                if data:
                    self.captured += data
                    pairs[s].sendall(data)
                else:
                    other = pairs.pop(s)
                    pairs.pop(other, None)
                    s.close()
                    other.close()
        for s in pairs:
            s.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.listener.close()


@pytest.mark.parametrize("curve", [True, False])
def test_traffic_on_the_wire_is_not_plaintext(ring: Keyring, closing: list, curve: bool) -> None:
    """Requests and replies through a recording TCP relay: with CURVE the captured bytes hold neither
    the message text nor the protocol magic; without it (the control) they hold both."""
    auth = ring.authorized(["a", "b"])
    b, b_addr = transport(closing, "b", ring.keys("b", auth) if curve else None)
    b.on(MsgType.PING, lambda m, reply: reply(make(MsgType.PONG, echo=m.fields["note"])))
    a, _ = transport(closing, "a", ring.keys("a", auth) if curve else None)
    tap = TcpTap(b_addr)
    try:
        for t in (a, b):
            t.start()
        a.pin("b", tap.address, first_hand=True)
        for _ in range(3):
            r = a.request(tap.address, make(MsgType.PING, note=MARKER), timeout_s=10)
            assert r.fields["echo"] == MARKER and r.src == "b"
    finally:
        tap.close()
    assert len(tap.captured) > 3 * len(MARKER)
    assert (MARKER.encode() in tap.captured) is not curve
    assert (b"MLLM" in tap.captured) is not curve
    assert (b"CURVE" in tap.captured) is curve  # the ZMTP greeting names the mechanism in clear
    assert b.router.mechanism == (zmq.CURVE if curve else zmq.NULL)


def test_every_socket_has_the_frame_size_limit(ring: Keyring, closing: list) -> None:
    from meshllm.mesh.protocol import MAX_MESSAGE_BYTES

    auth = ring.authorized(["a", "b"])
    a, a_addr = transport(closing, "a", ring.keys("a", auth))
    b, _ = transport(closing, "b", ring.keys("b", auth))
    b.pin("a", a_addr, first_hand=True)
    b.subscribe(a_addr)
    b.send(a_addr, make(MsgType.PING))  # before start: queued for the I/O thread's DEALER
    for t in (a, b):
        t.start()
    assert wait_for(lambda: len(b.peers.subs) == 1 and len(b.peers.dealers) == 1)
    socks = [a.router, a.pub, *b.peers.subs.values(), *b.peers.dealers.values()]
    assert all(s.getsockopt(zmq.MAXMSGSIZE) == MAX_MESSAGE_BYTES for s in socks)
    assert all(s.mechanism == zmq.CURVE for s in socks)


# -- rate limits -----------------------------------------------------------------------------
def test_the_rate_limiter_is_a_token_bucket_per_peer() -> None:
    rl = RateLimiter(RateLimit(messages_per_s=10, burst=5))
    assert [rl.allow("f", 0.0) for _ in range(7)] == [True] * 5 + [False] * 2
    assert rl.allow("g", 0.0)  # another peer has its own bucket
    assert not rl.allow("f", 0.05)  # half a token
    assert rl.allow("f", 0.1) and not rl.allow("f", 0.1)
    assert [rl.allow("f", 10.0) for _ in range(6)] == [True] * 5 + [False]  # the bucket never exceeds burst
    assert rl.dropped == 5


def test_a_flood_from_one_peer_is_dropped_while_another_is_served(ring: Keyring, closing: list) -> None:
    auth = ring.authorized(["a", "b", "m"])
    a, a_addr = transport(closing, "a", ring.keys("a", auth), rate=RateLimit(messages_per_s=50, burst=50))
    seen: dict[str, int] = {}

    def ping(msg, reply) -> None:
        seen[msg.src] = seen.get(msg.src, 0) + 1
        reply(make(MsgType.PONG))

    a.on(MsgType.PING, ping)
    flooder, _ = transport(closing, "m", ring.keys("m", auth))
    other, _ = transport(closing, "b", ring.keys("b", auth))
    for t in (a, flooder, other):
        t.start()
        t.pin("a", a_addr, first_hand=True)
    n = 2000
    for _ in range(n):
        flooder.send(a_addr, make(MsgType.PING))
    assert wait_for(lambda: seen.get("m", 0) + a.limiter.dropped >= n)
    assert a.limiter.dropped > 0 and seen["m"] < n
    assert other.request(a_addr, make(MsgType.PING), timeout_s=10).type is MsgType.PONG  # b is still served
    assert seen["b"] == 1


# -- HTTP API token ----------------------------------------------------------------------------
class _Gateway:
    """What /v1/models and /health read of a gateway."""

    model_name, ctx = "smollm2-135m", None

    def ready(self) -> bool:
        return False

    def ready_replicas(self) -> list:
        return []

    def in_flight(self) -> int:
        return 0

    def unservable(self) -> str | None:
        return None


def _get(url: str, token: str | None) -> tuple[int, dict]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token is not None else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_http_api_requires_its_bearer_token() -> None:
    from meshllm.roles.http_api import ApiServer

    token = "s3cret-token-0123456789"
    listen = addr()
    api = ApiServer(_Gateway(), listen, token)
    api.start()
    try:
        url = f"http://{listen}"
        for bad in (None, "wrong-token-0123456789", token + "x", ""):
            code, body = _get(url + "/v1/models", bad)
            assert code == 401 and body["error"]["code"] == "invalid_api_key", (bad, body)
        code, body = _get(url + "/v1/models", token)
        assert code == 200 and body["data"][0]["id"] == "smollm2-135m"
        assert _get(url + "/health", None)[0] == 503  # open to probes (503: nothing loaded here)
    finally:
        api.close()
    # why the mesh cannot serve names its model, nodes and roles: only a client with the token sees it
    gw = _Gateway()
    gw.unservable = lambda: "the live mesh of 1 nodes: cannot serve model.gguf: no node may decode"
    api = ApiServer(gw, listen, token)
    api.start()
    try:
        for shown, want in ((None, "send the API token to see why"), ("wrong-token-0123456789", "to see why"),
                            (token, "no node may decode")):
            code, body = _get(f"http://{listen}/health", shown)
            assert code == 503 and want in body["error"] and body["status"] == "unavailable", (shown, body)
            assert shown == token or "model.gguf" not in json.dumps(body), body
    finally:
        api.close()
    api = ApiServer(gw, listen, None)  # no token wanted: everyone sees why
    api.start()
    try:
        assert "no node may decode" in _get(f"http://{listen}/health", None)[1]["error"]
    finally:
        api.close()


def test_idle_and_trickling_api_connections_are_closed() -> None:
    """A connection that sent nothing, or only part of a request's headers (slowloris), was held
    for an hour (aiohttp's default keep-alive), and with the usual soft limit of 1024 open files
    ~1100 of them locked every client out of the gateway. Now HTTP_IDLE_S after it opened (1 s
    here), and a body trickled in is a 408 after BODY_IDLE_FACTOR x that; a client that sends
    its request meanwhile is served as before."""
    from meshllm.roles.http_api import ApiServer

    listen = addr()
    api = ApiServer(_Gateway(), listen, idle_s=1.0)
    api.start()
    host, port = listen.split(":")
    try:
        silent = socket.create_connection((host, int(port)), 5)
        trickle = socket.create_connection((host, int(port)), 5)
        trickle.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        t0 = time.monotonic()
        for sock in (silent, trickle):
            sock.settimeout(10)
            if sock is trickle:
                time.sleep(0.5)
                sock.sendall(b"X-More: 1\r\n")  # bytes keep coming, the headers never end
            assert sock.recv(100) == b""  # closed by the gateway
            sock.close()
        assert time.monotonic() - t0 < 8
        slow_body = socket.create_connection((host, int(port)), 5)  # headers whole, the body trickled
        slow_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100\r\n\r\n{\"model\": ")
        slow_body.settimeout(30)
        t0 = time.monotonic()
        got = slow_body.recv(4096)
        assert 3.5 < time.monotonic() - t0 < 10  # BODY_IDLE_FACTOR x idle_s
        while b"request_timeout" not in got and (chunk := slow_body.recv(4096)):
            got += chunk  # (aiohttp closes the connection <= 10 s later, after its lingering read)
        slow_body.close()
        assert got.startswith(b"HTTP/1.1 408") and b"request_timeout" in got, got[:300]
        assert _get(f"http://{listen}/v1/models", None)[0] == 200
    finally:
        api.close()


def test_a_client_gone_mid_body_is_not_an_error_in_the_log(caplog) -> None:
    """A client that closed its connection half way through its body was logged as an ERROR with
    two chained tracebacks (ConnectionResetError), 29 of them after ~500 requests with drops."""
    from meshllm.roles.http_api import ApiServer

    listen = addr()
    api = ApiServer(_Gateway(), listen)
    api.start()
    host, port = listen.split(":")
    try:
        with caplog.at_level(logging.DEBUG):
            for _ in range(3):
                sock = socket.create_connection((host, int(port)), 5)
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 100\r\n\r\n{\"model\": ")
                sock.close()
            time.sleep(1.0)  # the handlers see the connections closed
            assert _get(f"http://{listen}/v1/models", None)[0] == 200  # serving as before
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert errors == [], [r.getMessage() for r in errors]
    finally:
        api.close()


def test_a_node_lifts_its_open_files_limit_to_the_hard_limit() -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(256, soft)
    code = ("import resource; from meshllm.mesh.node import raise_open_files_limit; "
            "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], raise_open_files_limit(), "
            "resource.getrlimit(resource.RLIMIT_NOFILE)[0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard)))
    before, said, after = map(int, out.stdout.split())
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    assert (before, said, after) == (low, want, want), out.stderr


# -- configuration and CLI -------------------------------------------------------------------
def test_key_files_and_node_file_keys_are_checked(ring: Keyring, tmp_path: Path) -> None:
    auth = ring.authorized(["a", "b"])
    assert set(read_authorized_keys(auth, "t", "authorized_keys")) == {"a", "b"}
    assert os.stat(ring.key("a")).st_mode & 0o077 == 0  # the secret key is private to its owner
    base = {"id": "a", "device": DEVICE, "listen": "127.0.0.1:7700", "node_key": ring.key("a"),
            "authorized_keys": auth, "seeds": ["b@127.0.0.1:7800"]}
    p = tmp_path / "n.yaml"
    p.write_text(yaml.safe_dump(base))
    n = load_node(p)
    assert n.seeds == ("127.0.0.1:7800",) and n.seed_ids == (("127.0.0.1:7800", "b"),)
    garbage = tmp_path / "garbage.key"
    garbage.write_text("not a key\n")
    garbage.chmod(0o600)
    dup = tmp_path / "dup_keys"
    dup.write_text(f"a {ring.public['a']}\na {ring.public['b']}\n")
    short = tmp_path / "short_token"
    short.write_text("abc\n")
    short.chmod(0o600)
    # `* KEY` was read as a cluster key's line: its holder joined a per-node-key mesh as any node id it chose
    star = tmp_path / "star_keys"
    star.write_text(f"a {ring.public['a']}\n* {ring.public['b']}\n")
    open_key = tmp_path / "open.key"  # a secret that others may read: refused, as ssh refuses one
    open_key.write_text(Path(ring.key("a")).read_text())
    open_key.chmod(0o644)
    open_token = tmp_path / "open_token"
    open_token.write_text("x" * 32 + "\n")
    open_token.chmod(0o640)
    for bad, field in [({"node_key": str(garbage)}, "node_key"), ({"node_key": ring.key("b")}, "authorized_keys"),
                       ({"authorized_keys": str(dup)}, "authorized_keys"), ({"seeds": ["127.0.0.1:7800"]}, "seeds"),
                       ({"authorized_keys": str(star)}, ("authorized_keys: ", "line 2: '*' is not a node id")),
                       ({"node_key": str(open_key)}, ("node_key: ", "others may read (mode 0644)", "chmod 600")),
                       ({"gateway": {"listen": "127.0.0.1:8000", "api_token": str(open_token)}},
                        ("gateway.api_token: ", "others may read (mode 0640)")),
                       ({"gateway": {"listen": "127.0.0.1:8000", "api_token": ""}},
                        "gateway.api_token: must be the path of a token file, got ''"),
                       ({"gateway": {"listen": "127.0.0.1:8000", "api_token": 5}}, "gateway.api_token: must be the path"),
                       ({"gateway": {"listen": "127.0.0.1:8000", "api_token": str(short)}}, "at least 16 characters"),
                       ({"seeds": ["x@127.0.0.1:7800"]}, "seeds"), ({"node_key": None}, "node_key"),
                       ({"rate_limit": {"messages_per_s": 0}}, "rate_limit"),
                       ({"gateway": {"listen": "127.0.0.1:8000", "max_concurrent": 0}}, "gateway.max_concurrent"),
                       ({"gateway": {"listen": "127.0.0.1:8000", "drain_s": -1}}, "gateway.drain_s"),
                       ({"gateway": {"listen": "127.0.0.1:8000", "drain_s": float("inf")}}, "gateway.drain_s"),
                       ({"gateway": {"listen": "127.0.0.1:8000", "api_token": str(short)}}, "gateway.api_token"),
                       # not a regular file (/dev/zero was read for ever), a folder, not UTF-8: each its own error
                       ({"node_key": "/dev/zero"}, "node_key: '/dev/zero': not a regular file"),
                       ({"authorized_keys": str(tmp_path)}, f"authorized_keys: '{tmp_path}': is a directory"),
                       ({"node_key": sys.executable}, f"node_key: '{sys.executable}': not a text file"),
                       ({"gateway": {"listen": "127.0.0.1:8000", "api_token": "/dev/zero"}},
                        "gateway.api_token: '/dev/zero': not a regular file")]:
        p.write_text(yaml.safe_dump({k: v for k, v in {**base, **bad}.items() if v is not None}))
        with pytest.raises(ConfigError) as err:
            load_node(p)
        assert all(part in str(err.value) for part in ((field,) if isinstance(field, str) else field)), err.value
    with pytest.raises(Exception, match="already exists"):
        generate_key(ring.key("a"))  # never overwritten
    r = run_cli("--node-config", str(p), timeout=60)  # the last bad file (/dev/zero): exit 2 at once, one line
    assert r.returncode == 2 and "api_token" in r.stderr and "Traceback" not in r.stderr


def test_cli_keygen_and_status_of_a_curve_mesh(tmp_path: Path) -> None:
    """`--keygen` makes the keys; two node processes form a CURVE mesh; `--status` needs a listed
    key and the node's id (exit 2 without the id), and answers with them."""
    pub = {}
    for nid in ("k0", "k1", "admin"):
        r = run_cli("--keygen", str(tmp_path / f"{nid}.key"), "--json", timeout=60)
        assert r.returncode == 0, r.stderr
        pub[nid] = json.loads(r.stdout)["public_key"]
    auth = tmp_path / "authorized_keys"
    auth.write_text("".join(f"{nid} {pk}\n" for nid, pk in pub.items()))
    port = free_port_pair()
    procs = []
    try:
        for nid, seeds in (("k0", []), ("k1", [f"k0@127.0.0.1:{port}"])):
            cfg = {"id": nid, "device": DEVICE, "zone": "z", "listen": f"127.0.0.1:{port if nid == 'k0' else free_port_pair()}",
                   "seeds": seeds, "mdns": False, "model": "tiny", "node_key": str(tmp_path / f"{nid}.key"),
                   "authorized_keys": str(auth)}
            path = tmp_path / f"{nid}.yaml"
            path.write_text(yaml.safe_dump(cfg))
            procs.append(spawn([sys.executable, str(REPO / "launch.py"), "--node-config", str(path)],
                               cwd=REPO, stdout=open(tmp_path / f"{nid}.log", "w"), stderr=subprocess.STDOUT,
                               start_new_session=True))
        admin = NodeKeys.load("admin", str(tmp_path / "admin.key"), str(auth))

        def peers() -> list[str]:
            try:
                st = query_status(f"k0@127.0.0.1:{port}", timeout_s=0.5, keys=admin)
            except TimeoutError:
                return []
            return [p["id"] for p in st["peers"] if p["state"] == "alive"]

        assert wait_for(peers, 60.0) and peers() == ["k1"], (tmp_path / "k1.log").read_text()[-2000:]
        with pytest.raises(TimeoutError):
            query_status(f"127.0.0.1:{port}", timeout_s=0.5)  # no key: no answer
        env = {"MESHLLM_NODE_KEY": str(tmp_path / "admin.key"), "MESHLLM_AUTHORIZED_KEYS": str(auth)}
        r = run_cli("--status", f"127.0.0.1:{port}", "--json", env=env, timeout=60)
        assert r.returncode == 2 and "ID@HOST:PORT" in r.stderr
        r = run_cli("--status", f"k0@127.0.0.1:{port}", "--json", env=env, timeout=60)
        assert r.returncode == 0 and json.loads(r.stdout)["node"] == "k0"
        # the wrong id (k0 listens there), and a key k0 does not list: each an exit 2 that says so, at
        # once (both were a timeout and exit 1: with CURVE the handshake fails and no reply comes)
        r = run_cli("--status", f"k1@127.0.0.1:{port}", "--json", "--timeout", "30", env=env, timeout=60)
        assert r.returncode == 2 and "does not hold the key of 'k1'" in r.stderr, r.stderr
        r = run_cli("--keygen", str(tmp_path / "intruder.key"), timeout=60)  # `PK=$(... --keygen F)`: the key alone
        intruder = {"public_key": r.stdout.strip()}
        assert r.returncode == 0 and r.stdout.count("\n") == 1 and "wrote the secret key" in r.stderr, r
        mine = tmp_path / "intruder_keys"  # the intruder's own list names it and k0
        mine.write_text(auth.read_text() + f"intruder {intruder['public_key']}\n")
        r = run_cli("--status", f"k0@127.0.0.1:{port}", "--json", "--timeout", "30", timeout=60,
                    env={"MESHLLM_NODE_KEY": str(tmp_path / "intruder.key"), "MESHLLM_AUTHORIZED_KEYS": str(mine)})
        assert r.returncode == 2 and "refused the key of 'intruder'" in r.stderr, r.stderr
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, 9)
            p.wait(timeout=30)


# -- one cluster key -------------------------------------------------------------------------------
def cluster_cfg(nid: str, listen: str, key: str, seeds: tuple[str, ...] = ()) -> NodeConfig:
    return NodeConfig(source="test", id=nid, device=DEV, zone="z", listen=listen, seeds=seeds, mdns=False,
                      heartbeat_interval_s=0.2, failure_timeout_s=1.0, model="tiny", plan_settle_s=60.0,
                      cluster_key=key)


def test_a_cluster_key_admits_its_holders_and_refuses_any_other_key(tmp_path: Path, closing: list,
                                                                    monkeypatch) -> None:
    """`cluster_key:` (one key file on every node): a and b hold it and form a mesh from a plain
    HOST:PORT seed, on CURVE sockets; x holds another key and is never admitted nor listed;
    `--status` answers a holder of the key (no node id needed) and no one else."""
    generate_key(tmp_path / "cluster.key")
    generate_key(tmp_path / "other.key")
    key, other = str(tmp_path / "cluster.key"), str(tmp_path / "other.key")
    a_addr = addr()
    a = Node(cluster_cfg("a", a_addr, key)).start()
    closing.append(a)
    b = Node(cluster_cfg("b", addr(), key, (a_addr,))).start()
    closing.append(b)
    x = Node(cluster_cfg("x", addr(), other, (a_addr,))).start()
    closing.append(x)
    assert wait_for(lambda: alive(a) == {"b"} and alive(b) == {"a"})
    # x's handshakes fail (they are made for another server key); a client that knows the cluster's
    # public key but holds another secret key gets as far as ZAP, which refuses it
    outsider = NodeKeys.cluster("", other)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    closing.append(sock)
    sock.curve_secretkey, sock.curve_publickey = outsider.secret, outsider.public
    sock.curve_serverkey = NodeKeys.cluster("", key).public
    sock.connect(endpoint(a_addr, 0))
    sock.send_multipart(encode(make(MsgType.PING)))
    assert wait_for(lambda: a.transport.rejected >= 1)
    assert not sock.poll(300)
    assert "x" not in {p.info.id for p in a.members.peers()} | {p.info.id for p in b.members.peers()}
    assert x.members.peers() == []
    assert a.transport.router.mechanism == zmq.CURVE and a.transport.pub.mechanism == zmq.CURVE
    monkeypatch.setenv("MESHLLM_CLUSTER_KEY", key)  # what `--status` reads
    assert query_status(a_addr, timeout_s=5.0)["node"] == "a"
    monkeypatch.setenv("MESHLLM_CLUSTER_KEY", other)
    with pytest.raises(InputError, match=f"the node at {a_addr} failed: it does not hold this cluster key"):
        query_status(a_addr, timeout_s=30.0)  # at once: not a timeout (it was one, as if no node ran there)


def test_a_node_file_s_cluster_key_is_checked(tmp_path: Path) -> None:
    generate_key(tmp_path / "cluster.key")
    (tmp_path / "shared.key").write_text((tmp_path / "cluster.key").read_text())
    (tmp_path / "shared.key").chmod(0o604)
    garbage = tmp_path / "garbage.key"
    garbage.write_text("not a key\n")
    garbage.chmod(0o600)
    base = {"id": "a", "device": DEVICE, "listen": "127.0.0.1:7700", "cluster_key": str(tmp_path / "cluster.key"),
            "seeds": ["127.0.0.1:7800"]}
    p = tmp_path / "n.yaml"
    p.write_text(yaml.safe_dump(base))
    n = load_node(p)
    assert n.cluster_key == base["cluster_key"] and n.seeds == ("127.0.0.1:7800",) and n.node_key is None
    for bad, why in [({"cluster_key": str(garbage)}, "cluster_key: .* is not a meshllm key file"),
                     ({"cluster_key": ""}, "cluster_key: must be a file path"),
                     ({"cluster_key": str(tmp_path / "shared.key")}, r"cluster_key: .*others may read \(mode 0604\)"),
                     ({"node_key": str(tmp_path / "cluster.key")}, "cluster_key: give cluster_key, or node_key")]:
        p.write_text(yaml.safe_dump({**base, **bad}))
        with pytest.raises(ConfigError, match=why):
            load_node(p)


# -- the emulator, end to end ------------------------------------------------------------------
@pytest.mark.slow
def test_a_cluster_with_curve_and_an_api_token_serves_the_reference(tmp_path, smollm2, smollm2_tokenizer) -> None:
    """`--cluster` with `security: {curve: true, api_token: true}`: per-node keys in the run
    directory, KV and tokens over CURVE between a prefill and a decode node, the client sending
    the token; output equals the reference."""
    from tests.serving_util import reference, same_up_to_tie, small_device, write_cluster

    dev = small_device("nuc-like", 8.0)
    path = write_cluster(tmp_path / "c.yaml", [{"id": "p1", "device": dev, "zone": "fog", "roles": ["prefill"]},
                                                {"id": "d1", "device": dev, "zone": "fog", "roles": ["decode"]}],
                         workload={"prompts": ["The capital of France is"], "max_tokens": 8, "temperature": 0},
                         security={"curve": True, "api_token": True})
    r = run_cli("--cluster", str(path), "--json", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    (res,) = out["results"]
    ok, why = same_up_to_tie(res["token_ids"], reference(smollm2, smollm2_tokenizer, res["prompt"], 8))
    assert ok, why
    assert set(out["metrics"]["nodes"]) == {"p1", "d1"}  # the emulator's status queries went through CURVE


def test_topics_reach_a_per_peer_sub_whenever_subscribed(ring: Keyring, closing: list) -> None:
    """Per-peer SUB sockets: the mesh topic (set before the peer was added) and a topic subscribed
    after it both arrive."""
    auth = ring.authorized(["a", "b"])
    a, a_addr = transport(closing, "a", ring.keys("a", auth))
    b, _ = transport(closing, "b", ring.keys("b", auth))
    got: list[str] = []
    b.on(MsgType.PING, lambda m, reply: got.append(m.fields["topic"]))
    b.pin("a", a_addr, first_hand=True)
    b.subscribe(a_addr)
    for t in (a, b):
        t.start()
    b.subscribe_topic(topic("late"))
    assert wait_for(lambda: (a.publish(make(MsgType.PING, topic="mesh"), TOPIC_MESH),
                             a.publish(make(MsgType.PING, topic="late"), topic("late")),
                             {"mesh", "late"} <= set(got))[-1])
