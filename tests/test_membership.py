"""Membership with a fake clock: join, missed heartbeats -> suspect -> dead, leave, rejoin."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from types import SimpleNamespace

import pytest

from meshllm.defaults import FAILURE_TIMEOUT_S
from meshllm.mesh.membership import Membership, PeerInfo, PeerState


def info(pid: str = "b", inc: int = 1, address: str = "127.0.0.1:7702") -> PeerInfo:
    return PeerInfo(pid, address, "fog", {"memory_gb": 8.0}, ("decode",), inc)


def table(**kw) -> Membership:
    return Membership("a", heartbeat_interval_s=0.5, failure_timeout_s=2.5, **kw)


def test_default_failure_detection_is_at_most_3_s() -> None:
    assert FAILURE_TIMEOUT_S <= 3.0
    assert Membership("a").failure_timeout_s <= 3.0


def test_join_then_heartbeats_keep_alive() -> None:
    m = table()
    tr = m.observe(info(), 0.0, first_hand=True)
    assert tr is not None and tr.old is None and tr.new is PeerState.ALIVE
    for k in range(1, 20):
        assert m.heartbeat("b", 1, k * 0.5, {"queue": k}) is None
        assert m.tick(k * 0.5 + 0.1) == []
    assert m.get("b").state is PeerState.ALIVE and m.get("b").load == {"queue": 19}


def test_missed_heartbeats_suspect_then_dead() -> None:
    m = table()
    m.observe(info(), 0.0, first_hand=True)
    assert m.tick(0.9) == []
    [tr] = m.tick(1.0)  # two intervals of silence
    assert (tr.old, tr.new) == (PeerState.ALIVE, PeerState.SUSPECT)
    assert m.tick(2.4) == []
    [tr] = m.tick(2.5)
    assert (tr.old, tr.new) == (PeerState.SUSPECT, PeerState.DEAD)
    assert m.tick(100.0) == [] and m.live() == []


def test_suspect_recovers_on_heartbeat() -> None:
    m = table()
    m.observe(info(), 0.0, first_hand=True)
    m.tick(1.2)
    tr = m.heartbeat("b", 1, 1.3)
    assert tr is not None and (tr.old, tr.new) == (PeerState.SUSPECT, PeerState.ALIVE)


def test_clean_leave_is_immediate_and_sticky() -> None:
    m = table()
    m.observe(info(), 0.0, first_hand=True)
    tr = m.leave("b", 1, 0.1)
    assert tr is not None and tr.new is PeerState.LEFT
    assert m.heartbeat("b", 1, 0.2) is None  # a heartbeat already in flight does not revive it
    assert m.observe(info(), 0.3, first_hand=True) is None
    assert m.tick(10.0) == [] and m.get("b").state is PeerState.LEFT


def test_rejoin_after_restart_with_new_incarnation() -> None:
    m = table()
    m.observe(info(inc=1), 0.0, first_hand=True)
    m.tick(3.0)
    assert m.get("b").state is PeerState.DEAD
    assert m.heartbeat("b", 2, 3.1) is None  # a new life must HELLO first
    tr = m.observe(info(inc=2), 3.2, first_hand=False)  # even gossip of a newer incarnation is news
    assert tr is not None and (tr.old, tr.new) == (PeerState.DEAD, PeerState.ALIVE)
    assert m.get("b").info.incarnation == 2
    assert m.heartbeat("b", 1, 3.3) is None  # the old life is ignored
    assert m.leave("b", 1, 3.4) is None and m.get("b").state is PeerState.ALIVE


def test_gossip_does_not_revive_a_dead_peer() -> None:
    m = table()
    m.observe(info(), 0.0, first_hand=True)
    m.tick(3.0)
    assert m.observe(info(), 3.1, first_hand=False) is None
    assert m.get("b").state is PeerState.DEAD
    tr = m.observe(info(), 3.2, first_hand=True)  # but it talking to us does
    assert tr is not None and tr.new is PeerState.ALIVE


def test_duplicate_id_conflicts() -> None:
    m = table()
    m.observe(info(), 0.0, first_hand=True)
    assert m.conflicts(info("a", address="h:1"))  # our own id
    assert m.conflicts(info("b", inc=5, address="127.0.0.1:9999"))  # a live peer's id elsewhere
    assert not m.conflicts(info("b", inc=5))  # the same node restarted at its address
    assert not m.conflicts(info("c"))
    m.tick(3.0)
    assert not m.conflicts(info("b", inc=5, address="127.0.0.1:9999"))  # the old one is dead: take over


def test_a_duplicate_never_takes_a_live_peers_id() -> None:
    """A newer incarnation of a live peer's id from another address (a duplicate's own PEERS
    entry, first-hand, or gossip of it) leaves the holder where it is; once the holder is dead
    the id is free again."""
    m = table()
    m.observe(info(inc=1), 0.0, first_hand=True)
    assert m.observe(info(inc=9, address="127.0.0.1:9999"), 0.1, first_hand=True) is None
    assert m.observe(info(inc=9, address="127.0.0.1:9999"), 0.2, first_hand=False) is None
    assert m.get("b").info.address == "127.0.0.1:7702" and m.get("b").info.incarnation == 1
    assert m.heartbeat("b", 1, 0.4) is None and m.get("b").state is PeerState.ALIVE
    m.tick(3.0)
    tr = m.observe(info(inc=9, address="127.0.0.1:9999"), 3.1, first_hand=True)
    assert tr is not None and m.get("b").info.address == "127.0.0.1:9999"


def test_self_is_never_a_peer_and_timeouts_are_configurable() -> None:
    m = Membership("a", heartbeat_interval_s=0.1, failure_timeout_s=0.4)
    assert m.observe(info("a"), 0.0, first_hand=True) is None and m.peers() == []
    m.observe(info(), 0.0, first_hand=True)
    assert [t.new for t in m.tick(0.25)] == [PeerState.SUSPECT]
    assert [t.new for t in m.tick(0.4)] == [PeerState.DEAD]
    with pytest.raises(ValueError, match="heartbeat_interval_s"):
        Membership("a", heartbeat_interval_s=1.0, failure_timeout_s=0.5)


def test_peer_info_from_wire_rejects_malformed_entries() -> None:
    assert PeerInfo.from_wire(info().to_wire()) == info()
    for bad in [None, {}, {"id": "", "address": "h:1", "incarnation": 1}, {"id": "b", "address": 3, "incarnation": 1},
                {"id": "b", "address": "h:1", "incarnation": "1"}, {"id": "b", "address": "h:1", "incarnation": 1,
                                                                      "device": []}]:
        with pytest.raises(ValueError):
            PeerInfo.from_wire(bad)


def test_mdns_binds_the_advertised_address_interface_only():
    """A node on a LAN and a VPN announces itself on the LAN alone: zeroconf binds the advertised
    address's interface when it is one of this host's; an address that is not (a NAT's) falls
    back to every interface."""
    from meshllm.mesh.discovery import local_ipv4, mdns_interfaces

    local = local_ipv4()
    assert "127.0.0.1" in local
    assert mdns_interfaces("127.0.0.1", local) == ["127.0.0.1"]
    lan = {"127.0.0.1", "192.168.1.10", "10.8.0.2"}  # a LAN and a VPN address
    assert mdns_interfaces("192.168.1.10", lan) == ["192.168.1.10"]
    assert mdns_interfaces("203.0.113.7", lan) is None


def test_a_coordinator_numbers_its_plan_above_what_live_peers_have_seen() -> None:
    """After a healed partition the other side's coordinator may have published v2, which this
    side never got; a node ignores a version it already holds, so the next plan must be above
    the newest version any live peer's heartbeat says it has seen (dead peers and garbage ignored)."""
    from meshllm.roles.coordinator import newest_plan_seen

    m = table()
    assert newest_plan_seen(m) == 0
    for pid, port in (("b", 7702), ("c", 7703), ("d", 7704), ("e", 7705)):
        m.observe(info(pid, address=f"127.0.0.1:{port}"), 0.0, first_hand=True)
    m.heartbeat("b", 1, 0.5, {"plan_seen": 2})
    m.heartbeat("c", 1, 0.5, {"plan_seen": "9"})
    m.heartbeat("d", 1, 0.5, {"plan_seen": True})
    assert newest_plan_seen(m) == 2
    m.heartbeat("e", 1, 0.5, {"plan_seen": 7})
    assert newest_plan_seen(m) == 7
    for k in range(1, 8):  # e falls silent and is declared dead; the others keep beating
        for pid in "bcd":
            m.heartbeat(pid, 1, 0.5 + k * 0.5, {"plan_seen": 2} if pid == "b" else {})
        m.tick(0.5 + k * 0.5 + 0.1)
    assert m.get("e").state is PeerState.DEAD and newest_plan_seen(m) == 2


def test_a_node_that_could_not_take_its_part_of_the_newest_plan_is_planned_without_until_the_live_set_changes() -> None:
    """The coordinator's `refusals`: a live node whose plan_error is for its newest plan (or a later
    one) is left out, with why, until it restarts (a new incarnation) or the live set changes
    otherwise (its cause may have been a peer that died while it fetched from it); an error from
    an older plan (a newer plan may not have reached it yet), malformed errors, and errors before
    any plan of this coordinator's are not."""
    from meshllm.roles.coordinator import refusals

    a, b, c = info("a", address="127.0.0.1:7701"), info("b"), info("c", address="127.0.0.1:7703")
    err = {"b": {"plan_version": 3, "error": "MemoryError: "}, "c": {"plan_version": 2, "error": "old"}}
    assert refusals({}, [a, b, c], err, None) == {}
    got = refusals({}, [a, b, c], err, 3)
    assert {k: why for k, (why, _) in got.items()} == {("b", 1): "could not take its part of plan v3: MemoryError: "}
    assert refusals(got, [a, b, c], {}, 4) == got  # its error cleared (it has no part in v4): still left out
    assert refusals(got, [a, info("b", inc=2), c], {}, 4) == {}  # restarted: planned with again
    assert refusals(got, [a, c], {}, 4) == {}  # gone
    assert refusals(got, [a, b], {}, 4) == {}  # another node left: b is tried again
    assert refusals(got, [a, b, c, info("d", address="127.0.0.1:7704")], {}, 4) == {}  # or one joined
    bad = {"a": {"plan_version": True}, "b": {"plan_version": "9"}, "c": ["plan_version", 9]}
    assert refusals({}, [a, b, c], bad, 1) == {}
    assert refusals({}, [a], {"a": {"plan_version": 5, "error": "x" * 1000}}, 5)[("a", 1)][0].endswith("x" * 300)


def test_a_node_restarted_before_it_was_seen_dead_changes_its_replica() -> None:
    """A crash and a supervisor's restart inside the failure timeout: the peer comes back at the
    same address with a new incarnation, never seen dead. The coordinator re-plans (its live set
    is keyed by incarnation), and the plan says which life of each node it was made for: a
    replica with a restarted stage is not "unchanged" (its sequences died with the old process;
    they were kept and waited out the gateway's 60 s stall timeout), one with a restarted drafter
    beside it is."""
    from meshllm.defaults import Role
    from meshllm.partition.plan import Plan, Replica, Stage
    from meshllm.roles.context import PlanContext

    m = table()
    m.observe(info(inc=1), 0.0, first_hand=True)
    tr = m.observe(info(inc=2), 1.0, first_hand=True)  # the same address, 1 s later: never suspect
    assert tr is not None and (tr.old, tr.new) == (PeerState.ALIVE, PeerState.ALIVE)
    assert m.get("b").info.incarnation == 2
    reps = (Replica(0, Role.MIXED, (Stage("a", (0, 2)), Stage("b", (2, 4))), 1.0, 1.0, 1.0),
            Replica(1, Role.DECODE, (Stage("c", (0, 4)),), 1.0, 1.0, 1.0))
    plan = Plan("tiny", 4, "fp32", reps, ("d",), (), 0.0, 1.0)
    addresses = {n: f"127.0.0.1:{7700 + i}" for i, n in enumerate("abcd")}
    before = PlanContext(3, plan, addresses, "a", {"a": 5, "b": 1, "c": 5, "d": 5})
    after = PlanContext(4, plan, addresses, "a", {"a": 5, "b": 2, "c": 5, "d": 6})  # b and the drafter d restarted
    assert not after.unchanged(before, 0) and after.unchanged(before, 1)
    assert after.unchanged(PlanContext(3, plan, addresses, "a", {"a": 5, "b": 2, "c": 5, "d": 5}), 0)


def test_a_heartbeat_from_a_newer_life_of_a_peer_greets_it() -> None:
    """A restarted seed knows no one (its peers greeted its earlier life), and its peers take its
    new life's heartbeats for no one's until it says HELLO: it stayed alone until they declared
    its earlier life dead (2.5 s) and greeted it again. A heartbeat from a newer incarnation of a
    known peer now makes this node greet it at once; an old or the same life's does not."""
    from types import SimpleNamespace

    from meshllm.mesh.agent import MeshAgent
    from meshllm.mesh.protocol import MsgType, make

    m = table()
    m.observe(info(inc=1), 0.0, first_hand=True)
    t = SimpleNamespace(on=lambda *a, **k: None, every=lambda *a, **k: None)
    agent = MeshAgent(t, m, info("a", 1, "127.0.0.1:7701"))
    greeted: list[str] = []
    agent.greet = greeted.append
    for inc in (1, 0, 2):
        agent._on_heartbeat(make(MsgType.HEARTBEAT, node="b", incarnation=inc, seq=1, load={}), lambda r: None)
    agent._on_heartbeat(make(MsgType.HEARTBEAT, node="zz", incarnation=9, seq=1, load={}), lambda r: None)
    assert greeted == ["127.0.0.1:7702"]


def test_a_peer_whose_process_is_gone_is_dead_at_once_and_only_at_its_address() -> None:
    m = table()
    m.observe(info(), 0.0, first_hand=True)
    assert m.gone("b", "127.0.0.1:9999") is None, "another address: not that peer's process"
    tr = m.gone("b", "127.0.0.1:7702")
    assert tr is not None and (tr.old, tr.new) == (PeerState.ALIVE, PeerState.DEAD) and m.live() == []
    assert m.gone("b", "127.0.0.1:7702") is None and m.gone("zz", "127.0.0.1:7702") is None
    tr = m.observe(info(inc=2), 0.5, first_hand=True)  # its next life says HELLO
    assert tr is not None and tr.new is PeerState.ALIVE


def test_time_this_node_did_not_run_is_not_its_peers_silence() -> None:
    """A node stopped (SIGSTOP, swapped out, a paused VM) for longer than the failure timeout
    took every peer for dead at its first tick back, before their queued heartbeats were read.
    Its failure detector sees the gap between its own ticks and does not count it; a peer silent
    that long while this node ran is still dead."""
    from meshllm.mesh.agent import MeshAgent

    m = table()
    t = SimpleNamespace(on=lambda *a, **k: None, every=lambda *a, **k: None)
    agent = MeshAgent(t, m, info("a", 1, "127.0.0.1:7701"))
    changes: list = []
    agent.on_change = changes.append
    now = time.monotonic()
    m.observe(info(), now - 4.0, first_hand=True)  # heard just before this node stopped for 4 s
    agent._ticked = now - 4.0
    agent._tick()
    assert changes == [] and m.get("b").state is PeerState.ALIVE
    m.observe(info("c", address="127.0.0.1:7703"), time.monotonic() - 4.0, first_hand=True)
    agent._tick()  # this node ran all along: c's silence is c's
    assert [(tr.peer, tr.new) for tr in changes] == [("c", PeerState.DEAD)]
    m.get("b").last_heard -= 4.0
    assert [(tr.peer, tr.new) for tr in m.tick(time.monotonic())] == [("b", PeerState.DEAD)]


@contextlib.contextmanager
def coordinator_a(m: Membership):
    """Node a's Coordinator over the peer table `m`, planning inline (a fixed one-replica plan);
    yields it and the list of the plan versions it publishes."""
    from meshllm.mesh.membership import PeerInfo as Info
    from meshllm.node_config import parse_node
    from meshllm.roles import coordinator as co

    dev = {"name": "box", "memory_gb": 8, "compute_tflops": 1, "memory_bandwidth_gbps": 60, "network_mbps": 1000}
    cfg = parse_node({"id": "a", "device": dev, "zone": "fog", "listen": "127.0.0.1:7701", "model": "smollm2-135m",
                      "expect_nodes": ["a", "b", "c"]}, "test")
    t = SimpleNamespace(every=lambda *a, **k: None, publish=lambda *a, **k: None, call_soon=lambda f: f())
    got: list = []
    c = co.Coordinator(t, m, Info("a", "127.0.0.1:7701", "fog", dev, (), 5), cfg, lambda: 0,
                       lambda *a: got.append(a[0]), model_args=lambda: None)
    c.worker = SimpleNamespace(submit=lambda f: f())  # plan inline
    c.inputs = lambda live: None
    from meshllm.defaults import Role
    from meshllm.partition.plan import Plan, Replica, Stage

    plan = Plan("tiny", 4, "fp32", (Replica(0, Role.MIXED, (Stage("b", (0, 4)),), 1.0, 1.0, 1.0),), (), (), 0.0, 1.0)
    co_plan_for, co.plan_for = co.plan_for, lambda cfg, inp: plan
    try:
        yield c, got
    finally:
        co.plan_for = co_plan_for


def test_a_shortfall_before_the_first_plan_is_a_warning_and_after_it_an_error(caplog) -> None:
    """A coordinator waiting for its first peers logged "cannot plan for 1 live nodes" at ERROR."""
    from meshllm.partition.plan import PlanInfeasible
    from meshllm.roles import coordinator as co

    def short(cfg, inp):
        raise PlanInfeasible("all stage-capable nodes together: 3 GB short")

    m = table()
    with coordinator_a(m) as (c, got), caplog.at_level(logging.WARNING, logger=co.log.name):
        plan_for, co.plan_for = co.plan_for, short
        c._plan(c.live(), ("k", 1), {})
        c.published = (1, {}, {}, {})  # a plan in force: a shortfall now is a mesh that lost nodes
        c._plan(c.live(), ("k", 2), {})
        co.plan_for = plan_for
    got = [(r.levelno, r.getMessage()) for r in caplog.records if "cannot plan" in r.getMessage()]
    assert got == [(logging.WARNING, "a: cannot plan for 1 live nodes (no plan yet: waiting for more nodes to join): "
                    "all stage-capable nodes together: 3 GB short"),
                   (logging.ERROR, "a: cannot plan for 1 live nodes: all stage-capable nodes together: 3 GB short")]
    assert c.last_error == "all stage-capable nodes together: 3 GB short"


def test_a_coordinator_s_first_plan_waits_for_every_live_peer_s_heartbeat() -> None:
    """A coordinator restarted before its peers saw it dead learns them from PEERS, before any
    heartbeat, and planned at once from plan_seen 0: v1, a version every node already held and
    ignored (two different plans v1). Peers say their plan_seen in HELLO and PEERS, and the first
    plan of a life waits for the word of every live peer (their heartbeats, FIRST_PLAN_WAIT_S at
    most), then numbers itself above what they have seen."""
    from meshllm.roles import coordinator as co

    m = table()
    with coordinator_a(m) as (c, got):
        for pid, port in (("b", 7702), ("c", 7703)):
            m.observe(info(pid, address=f"127.0.0.1:{port}"), time.monotonic(), first_hand=False)
        assert co.unheard(m) == ["b", "c"]
        c._tick()
        assert got == [], "no plan before the peers say what they have seen"
        m.note_plan_seen("b", 1, 7)  # b's own HELLO (or PEERS) says it
        m.note_plan_seen("c", 0, 9)  # another life's word: not c's
        assert co.unheard(m) == ["c"]
        c._tick()
        assert got == []
        m.heartbeat("c", 1, time.monotonic(), {"plan_seen": 3})
        c._tick()
        assert got == [8], "above every version a live peer has seen"


def test_a_coordinator_that_learns_of_a_newer_plan_than_its_own_plans_again() -> None:
    """The coordinator stopped past the failure timeout: the next lowest id planned without it
    (v9) and, back with the same incarnation and the same live set to itself, it ignored that
    plan and never planned again; the mesh ran without it. A peer's plan_seen above this
    coordinator's newest plan now makes it plan again, above it."""
    from meshllm.roles import coordinator as co

    m = table()
    with coordinator_a(m) as (c, got):
        for pid, port in (("b", 7702), ("c", 7703)):
            m.observe(info(pid, address=f"127.0.0.1:{port}"), time.monotonic(), first_hand=True)
            m.heartbeat(pid, 1, time.monotonic(), {"plan_seen": 0})
        c._tick()
        c._tick()
        assert got == [1]
        m.heartbeat("b", 1, time.monotonic(), {"plan_seen": 1})
        c._tick()
        assert got == [1], "its own plan: nothing to do"
        m.heartbeat("c", 1, time.monotonic(), {"plan_seen": 9})
        c._tick()
        assert got == [1, 10]
        m.heartbeat("b", 1, time.monotonic(), {"plan_seen": 12})
        c._tick()
        assert got == [1, 10], "at most once in CATCH_UP_S: two coordinators that see each other dead take turns"
        c._caught_up -= co.CATCH_UP_S
        c._tick()
        assert got == [1, 10, 13]


def test_a_coordinator_alone_again_after_another_planned_plans_again() -> None:
    """b coordinated alone (v2); a, a lower id, came back and planned (v3); a left again: b was the
    coordinator of the live set it had last planned for, saw nothing to do, and kept v3 with a
    gone node's replica for good (/health 503). A plan in force newer than its own makes it plan."""
    from meshllm.roles import coordinator as co

    m = table()
    with coordinator_a(m) as (c, got):
        held = [0]
        c.current_version = lambda: max([held[0], *got])
        c.cfg = dataclasses.replace(c.cfg, expect_nodes=())
        settle = lambda: setattr(c, "_changed_at", c._changed_at - 60)  # noqa: E731 (the live set long settled)
        c._tick()
        settle()
        c._tick()
        assert got == [1], "alone: its own plan"
        m.observe(info("0", address="127.0.0.1:7700"), time.monotonic(), first_hand=True)
        m.heartbeat("0", 1, time.monotonic(), {"plan_seen": 1})
        assert not c.is_coordinator()
        held[0] = 2  # node 0 coordinates now, and its plan reached this node
        c._tick()
        m.leave("0", 1, time.monotonic())
        assert c.is_coordinator()
        c._caught_up -= co.CATCH_UP_S
        c._tick()
        settle()
        c._tick()
        assert got == [1, 3], "the plan in force (v2) is not this coordinator's: it plans above it"
        c._tick()
        assert got == [1, 3]


def test_a_seed_that_never_answers_is_reported_once_until_it_does(monkeypatch, caplog) -> None:
    """A node whose seed is down or mistyped retried in silence ("listening", then a plan of its
    own): nothing in its log named the seed. After SEED_SILENT_WARN_S it says so, once, and
    again only after the seed answered and went silent anew."""
    import logging

    from meshllm.mesh import discovery
    from tests.test_fuzz import FakeTransport, Net

    monkeypatch.setattr(discovery, "SEED_SILENT_WARN_S", 0.0)
    me = PeerInfo("n", "127.0.0.1:7700", "fog", {}, (), 1)
    members = Membership("n")
    g = discovery.Gossip(FakeTransport(Net(), "n", me.address), members, me, ("127.0.0.1:9",),
                         lambda tr: None, lambda why: None)
    with caplog.at_level(logging.WARNING, logger="meshllm.mesh"):
        g._retry_seeds()
        g._retry_seeds()
        said = [r.getMessage() for r in caplog.records if "127.0.0.1:9" in r.getMessage()]
        assert len(said) == 1 and "has not answered" in said[0] and "a mesh of its own" in said[0], said
        members.observe(PeerInfo("s", "127.0.0.1:9", "fog", {}, (), 1), time.monotonic(), first_hand=True)
        g._retry_seeds()  # it answered: counted silent again from now on
        assert len([r for r in caplog.records if "127.0.0.1:9" in r.getMessage()]) == 1
        members.leave("s", 1, time.monotonic())  # it left: silent once more
        g._retry_seeds()
        said = [r.getMessage() for r in caplog.records if "127.0.0.1:9" in r.getMessage()]
        assert len(said) == 2 and "a mesh of its own" in said[1], said


def test_a_planner_that_fails_unexpectedly_leaves_the_coordinator_planning() -> None:
    """Only InputError / ValueError were caught on the planner thread: any other exception (a
    planner bug, a full disk) left `_planning` set, and the coordinator never planned again,
    silently. Now that live set gets no plan, the error is kept for --status, and the next
    membership change plans again."""
    from meshllm.roles import coordinator as co

    m = table()
    with coordinator_a(m) as (c, got):
        for pid, port in (("b", 7702), ("c", 7703)):
            m.observe(info(pid, address=f"127.0.0.1:{port}"), time.monotonic(), first_hand=True)
            m.heartbeat(pid, 1, time.monotonic(), {"plan_seen": 0})
        working = co.plan_for

        def broken(cfg, inp):
            raise KeyError("a planner bug")

        co.plan_for = broken
        c._tick()
        assert got == [] and not c._planning and "KeyError" in c.last_error
        co.plan_for = working
        c._tick()
        assert got == [], "the same live set: not re-planned in a loop"
        m.observe(info("d", address="127.0.0.1:7704"), time.monotonic(), first_hand=True)
        m.heartbeat("d", 1, time.monotonic(), {"plan_seen": 0})
        c._changed_at -= 60
        c._tick()
        c._changed_at -= 60
        c._tick()
        assert got == [1] and c.last_error is None


def test_a_heartbeat_interval_must_be_shorter_than_the_failure_timeout() -> None:
    """A heartbeat interval equal to the failure timeout would take a peer for dead between two of
    its own heartbeats: it is refused, as a longer one is."""
    with pytest.raises(ValueError, match="heartbeat_interval_s"):
        Membership("a", heartbeat_interval_s=1.0, failure_timeout_s=1.0)
    with pytest.raises(ValueError, match="heartbeat_interval_s"):
        Membership("a", heartbeat_interval_s=0.0, failure_timeout_s=1.0)


def test_suspicion_comes_no_later_than_the_failure_timeout() -> None:
    """With a heartbeat interval over half the failure timeout, a peer is suspect after the
    failure timeout at most (the agent discounts a stall of this node that long: MeshAgent._tick),
    not after two intervals, which would come after it is already dead."""
    m = Membership("a", heartbeat_interval_s=1.5, failure_timeout_s=2.0)
    assert m.suspect_after_s == 2.0
    m.observe(info(), 0.0, first_hand=True)
    assert m.tick(1.9) == [] and [t.new for t in m.tick(2.0)] == [PeerState.DEAD]


def test_a_suspect_peer_is_live_and_a_peer_that_left_is_gone() -> None:
    """live(): alive and suspect peers (a suspect one may still answer); addresses_gone(): the
    addresses of the dead and of those that left (LEAVE), which the transport stops dialling."""
    m = table()
    for pid, port in (("b", 7702), ("c", 7703), ("d", 7704), ("e", 7705)):
        m.observe(info(pid, address=f"127.0.0.1:{port}"), 0.0, first_hand=True)
    for pid in ("b", "c"):
        m.heartbeat(pid, 1, 1.0)
    m.heartbeat("b", 1, 2.0)
    m.leave("c", 1, 2.0)
    assert {t.peer: t.new for t in m.tick(2.1)} == {"d": PeerState.SUSPECT, "e": PeerState.SUSPECT}
    m.gone("e", "127.0.0.1:7705")
    assert [p.info.id for p in m.live()] == ["b", "d"] and m.get("d").state is PeerState.SUSPECT
    assert m.addresses_gone() == {"127.0.0.1:7703", "127.0.0.1:7705"}


def test_a_peer_seen_gone_stays_dead_at_the_next_tick() -> None:
    """A peer whose process is gone is dead at once, though it was heard a moment ago: failure
    detection's next tick does not take its recent silence for life and revive it."""
    m = table()
    m.observe(info(), 0.0, first_hand=True)
    m.gone("b", "127.0.0.1:7702")
    assert m.tick(0.1) == [] and m.tick(1.5) == [] and m.get("b").state is PeerState.DEAD and m.live() == []


def test_the_plan_a_peer_has_seen_does_not_replace_the_load_its_heartbeat_brought() -> None:
    """note_plan_seen keeps a HELLO's plan_seen only until the peer's first heartbeat: a later
    HELLO or PEERS does not overwrite the whole load that heartbeat carries."""
    m = table()
    m.observe(info(), 0.0, first_hand=True)
    m.note_plan_seen("b", 1, 4)
    assert m.get("b").load == {"plan_seen": 4}
    m.heartbeat("b", 1, 0.5, {"plan_version": 5, "queue": 2})
    m.note_plan_seen("b", 1, 3)
    assert m.get("b").load == {"plan_version": 5, "queue": 2}
    m.note_plan_seen("b", 2, 9)  # another life of it: not this one's
    assert m.get("b").load == {"plan_version": 5, "queue": 2}


def test_a_dead_peer_that_says_hello_from_a_new_address_is_found_there() -> None:
    """First-hand news of the same life of a peer replaces what is known of it: a peer taken for
    dead that greets this node from another address (its host's address changed) is alive there,
    while gossip of that address changes nothing."""
    m = table()
    m.observe(info(), 0.0, first_hand=True)
    m.tick(3.0)
    assert m.observe(info(address="127.0.0.1:8802"), 3.1, first_hand=False) is None
    assert m.get("b").info.address == "127.0.0.1:7702"
    tr = m.observe(info(address="127.0.0.1:8802"), 3.2, first_hand=True)
    assert tr is not None and (tr.old, tr.new) == (PeerState.DEAD, PeerState.ALIVE)
    assert m.get("b").info.address == "127.0.0.1:8802" and m.addresses_gone() == set()
