"""The shared router (meshllm/sim/router.py): what the simulator and the live gateway both call."""

from __future__ import annotations

import heapq

import pytest

from meshllm.sim.ports import PortBook
from meshllm.sim.replica import SimReplica
from meshllm.sim.router import ReplicaLoad, Router, pick_decode, pick_prefill
from meshllm.sim.simulator import Request, Simulator
from tests.planner_fixtures import small_inputs


@pytest.fixture(scope="module")
def inp():
    return small_inputs()


def rep(inp, rid, role, node):
    by_id = {m.id: m for m in inp.members}
    return SimReplica(rid, role, (by_id[node],), (30,), inp)


def loads_for(reps):
    return {r.id: ReplicaLoad(max_batch=r.max_batch()) for r in reps}


def test_prefill_goes_where_it_starts_first(inp):
    reps = [rep(inp, 0, "prefill", "fog-1"), rep(inp, 1, "prefill", "fog-2"), rep(inp, 2, "decode", "fog-3")]
    loads = loads_for(reps)
    assert pick_prefill(reps, loads, 16, 32, 0.0) == 0  # equal devices: the lower id
    loads[0].prefill_queued_s = 5.0
    assert pick_prefill(reps, loads, 16, 32, 0.0) == 1
    loads[1].next_prefill_at = 9.0  # busy until t = 9
    assert pick_prefill(reps, loads, 16, 32, 0.0) == 0


def test_decode_goes_where_a_slot_is_free(inp):
    reps = [rep(inp, 0, "prefill", "fog-1"), rep(inp, 1, "decode", "fog-2"), rep(inp, 2, "decode", "fog-3")]
    loads = loads_for(reps)
    fast = min((1, 2), key=lambda i: reps[i].decode_iter_s(1, 48))
    slow = 3 - fast
    assert pick_decode(0, reps, loads, 16, 32, 0.0) == fast
    loads[fast].active, loads[fast].waiting, loads[fast].tokens_left = loads[fast].max_batch, 50, 30.0
    assert pick_decode(0, reps, loads, 16, 32, 0.0) == slow  # the fast one is full, with a queue


def test_mixed_and_disaggregated_compare_like_with_like(inp):
    """Both are scored to the request's last token: an idle mixed replica on the same device type
    as an idle prefill + decode pair wins (no KV to ship); with a full decode batch, a prompt
    there would pause every sequence, so the pair wins."""
    reps = [rep(inp, 0, "mixed", "fog-1"), rep(inp, 1, "prefill", "fog-2"), rep(inp, 2, "decode", "fog-1")]
    router = Router(reps, PortBook(inp.net))
    loads = loads_for(reps)
    assert router.pick_prefill(loads, 16, 32, 0.0) == 0
    loads[0].active, loads[0].tokens_left = loads[0].max_batch - 1, 30.0
    loads[0].prefill_queued, loads[0].prefill_queued_tokens = 3, 48
    assert router.pick_prefill(loads, 16, 32, 0.0) == 1


def test_port_queues_steer_kv(inp):
    reps = [rep(inp, 0, "prefill", "fog-1"), rep(inp, 1, "decode", "fog-2"), rep(inp, 2, "decode", "fog-4")]
    ports = PortBook(inp.net)
    router = Router(reps, ports)
    loads = loads_for(reps)
    first = router.pick_decode(0, loads, 2000, 32, 0.0)
    ports.free[(reps[first].members[0].id, "rx")] = 100.0  # its port is busy for 100 s
    assert router.pick_decode(0, loads, 2000, 32, 0.0) != first


def test_kv_promised_to_a_decode_replica_counts_in_its_port_queue(inp):
    """KV of requests routed to a decode replica but still prefilling elsewhere is not on its
    ports yet; the router counts it there, so the next request goes to the other replica. The
    simulator promises it on routing and hands it to the ports when shipping starts."""
    reps = [rep(inp, 0, "prefill", "fog-1"), rep(inp, 1, "decode", "fog-2"), rep(inp, 2, "decode", "fog-4")]
    router = Router(reps, PortBook(inp.net))
    loads = loads_for(reps)
    first = router.pick_decode(0, loads, 2000, 32, 0.0)
    assert router.pending_rx_s(reps[first], loads[first]) == 0.0
    loads[first].kv_pending_tokens = 200_000  # ~100 prompts' KV on its way
    assert router.pending_rx_s(reps[first], loads[first]) > 1.0
    assert router.pick_decode(0, loads, 2000, 32, 0.0) != first
    sim = Simulator(reps[:2], [])
    req = Request(0, 0.0, 100, 10)
    sim.on_arrival(req)
    assert sim.loads[1].kv_pending_tokens == 100  # promised on routing
    sim.run()
    assert sim.loads[1].kv_pending_tokens == 0 and req.done > 0  # on the ports once shipped


def test_kv_a_prefill_replica_has_yet_to_send_counts_in_its_port_queue(inp):
    """The KV of the prompts routed to a prefill replica (queued or in its pipeline) is not on its
    ports yet but leaves before a new prompt's: the router counts it, so a prompt goes to the other
    prefill replica once one has more KV to send than its compute hides. The simulator counts a
    prompt's tokens there from routing until its last stage ships."""
    reps = [rep(inp, 0, "prefill", "fog-1"), rep(inp, 1, "prefill", "fog-3"), rep(inp, 2, "decode", "fog-2")]
    router = Router(reps, PortBook(inp.net))
    loads = loads_for(reps)
    member, kv = reps[0].members[0], 30 * inp.mc.kv_bytes_per_token  # its 30 layers' KV a token
    assert router.tx_wait_s(member, kv, loads[0], 0.0, 0.5) == 0.0
    assert router.pick_prefill(loads, 2000, 32, 0.0) == 0  # equal devices: the lower id
    loads[0].kv_unshipped_tokens = 200_000  # ~100 prompts' KV still to leave its port
    assert router.tx_wait_s(member, kv, loads[0], 0.0, 0.5) > 1.0
    assert router.pick_prefill(loads, 2000, 32, 0.0) == 1
    sim = Simulator(reps[::2], [])
    req = Request(0, 0.0, 100, 10)
    sim.on_arrival(req)
    assert sim.loads[0].kv_unshipped_tokens == 100  # counted on routing
    sim.run()
    assert sim.loads[0].kv_unshipped_tokens == 0 and req.done > 0  # shipped


def test_the_gateway_books_shipped_kv_on_the_ports_it_routes_with(inp):
    """At a request's first token its prompt's KV leaves the prefill replica: the gateway books
    it on its PortBook (as the simulator books a shipment), and routes the next request with that
    PortBook, so a decode replica whose port is busy receiving is passed over."""
    from meshllm.roles.gateway import RouterView, Stream

    reps = [rep(inp, 0, "prefill", "fog-1"), rep(inp, 1, "prefill", "fog-3"), rep(inp, 2, "decode", "fog-2"),
            rep(inp, 3, "decode", "fog-4")]
    view = RouterView()
    view.replan({r.id: r for r in reps}, inp, set())
    ready = {0, 1, 2, 3}
    pre, dec = view.route(ready, 2000, 32)
    s = Stream(7, None, None, set(), pre, dec, 200_000, 10)  # a long prompt's KV: its ports stay busy
    view.ship(s)
    assert view.ports.wait_s(reps[pre].members[0].id, "tx", view.clock()) > 1.0
    assert view.ports.wait_s(reps[dec].members[0].id, "rx", view.clock()) > 1.0
    assert view.route(ready, 2000, 32) == (1 - pre, 5 - dec)  # the other prefill and the other decode replica


def test_a_request_pinned_to_a_decode_replica_is_prefilled_by_a_mixed_one_while_no_prefill_replica_is(inp):
    """A request pinned (`decode_replica`) to a decode replica took its prompt from prefill
    replicas only: while the one prefill replica's node restarted, pinned requests waited for it
    (recovery gaps of 6-13 s) though a mixed replica was ready. A prefill replica stays first."""
    from meshllm.roles.gateway import RequestError, RouterView

    reps = [rep(inp, 0, "mixed", "fog-1"), rep(inp, 1, "prefill", "fog-3"), rep(inp, 2, "decode", "fog-2")]
    view = RouterView()
    view.replan({r.id: r for r in reps}, inp, set())
    assert view.route({0, 1, 2}, 2000, 32, pin=2) == (1, 2)
    assert view.route({0, 2}, 2000, 32, pin=2) == (0, 2)  # was "no replica is ready"
    assert view.route({0, 2}, 2000, 32, pin=0) == (0, 0)  # a mixed pin prefills its own
    assert view.route({0, 2}, 2000, 32) == (0, 0)  # unpinned: a mixed replica never ships
    with pytest.raises(RequestError, match="no replica is ready"):
        view.route({2}, 2000, 32, pin=2)


def test_the_simulator_routes_with_this_router(inp):
    reps = [rep(inp, 0, "prefill", "fog-1"), rep(inp, 1, "decode", "fog-2")]
    sim = Simulator(reps, [])
    assert type(sim.router) is Router and sim.loads[0] is sim.states[0].load


def test_the_gateway_counts_a_request_at_its_decode_replica_from_routing_on(inp):
    """The live gateway's view for the router: a request prefilled on another replica counts in
    its decode replica's `waiting` as soon as it is routed there (requests routed during its
    prefill must see it, as in the simulator), then as decoding from its first token."""
    from meshllm.roles.gateway import RouterView, Stream

    reps = [rep(inp, 0, "prefill", "fog-1"), rep(inp, 1, "decode", "fog-3")]
    gw = RouterView()
    gw.replan({r.id: r for r in reps}, inp, set())
    gw.loads = {0: ReplicaLoad(max_batch=4), 1: ReplicaLoad(max_batch=2)}
    streams = [Stream(i, None, None, set(), 0, 1, 100, 10) for i in range(3)]
    for s in streams:
        gw.book(s, "prefill", +1)
    assert (gw.loads[1].active, gw.loads[1].waiting) == (0, 3) and gw.loads[0].prefill_queued == 3
    assert gw.loads[1].kv_pending_tokens == 300  # their prompts' KV is still to come
    assert gw.loads[0].kv_unshipped_tokens == 300  # ... out of the prefill replica
    sim = Simulator(reps, [])  # the simulator books the same way on arrival
    sim.on_arrival(Request(0, 0.0, 100, 10))
    assert sim.loads[1].waiting == 1
    for s in streams:  # first tokens: prefill done, decoding (2 slots, 1 beyond them)
        gw.book(s, "prefill", -1)
        gw.book(s, "decode", +1)
    assert (gw.loads[1].active, gw.loads[1].waiting) == (2, 1) and gw.loads[0].prefill_queued == 0
    assert gw.loads[1].kv_pending_tokens == 0 and gw.loads[0].kv_unshipped_tokens == 0
    for s in streams:
        gw.book(s, "decode", -1)
    assert (gw.loads[1].active, gw.loads[1].waiting) == (0, 0)


def zoned_inputs():
    """One prefill device and two decode devices of one type, one of them across a 20 Mb/s zone
    link (fast ports on every device: the link is the bottleneck)."""
    from meshllm.config import parse_cluster, plan_inputs

    return plan_inputs(parse_cluster({
        "model": "smollm2-135m", "weights_dtype": "fp32",
        "nodes": [{"id": "p", "device": "intel-nuc-13-i7", "zone": "fog"},
                  {"id": "near", "device": "intel-nuc-13-i7", "zone": "fog"},
                  {"id": "far", "device": "intel-nuc-13-i7", "zone": "cloud"}],
        "links": [{"zones": ["fog", "cloud"], "rtt_ms": 1, "bandwidth_mbps": 20},
                  {"zones": ["fog", "fog"], "rtt_ms": 1, "bandwidth_mbps": 1000}],
        "workload": {"prompts": ["a"], "max_tokens": 32, "arrival_rate_per_s": 0,
                     "input_tokens": {"mean": 16, "dist": "fixed"}, "output_tokens": {"mean": 32, "dist": "fixed"}},
    }, "test_router.py"))


def test_kv_promised_across_a_zone_link_counts_on_that_link():
    """KV promised to a decode replica behind a zone link crosses that link, all of its layers
    on the one link (where each port takes only its stage's share): the router counts it there,
    so while it waits, the KV of the next prompts goes to the replica on this side of the link.
    Without it, every prompt routed while others prefilled saw the link idle: on bench-mesh-200
    the KV of a fog pipeline queued ~10 s a request for the cloud A100s' 500 Mb/s link."""
    zin = zoned_inputs()
    by_id = {m.id: m for m in zin.members}
    reps = [SimReplica(i, role, (by_id[n],), (30,), zin) for i, (role, n) in enumerate(
        [("prefill", "p"), ("decode", "far"), ("decode", "near")])]
    router = Router(reps, PortBook(zin.net))
    loads = loads_for(reps)
    near = loads[2]
    near.active, near.waiting, near.tokens_left = near.max_batch, 50, 30.0  # full, with a queue: far wins
    assert router.pick_decode(0, loads, 64, 32, 0.0) == 1
    loads[1].kv_pending_tokens = 2000  # ~30 prompts' KV promised to the far one
    port_only, on_link = router.pending_rx_s(reps[1], loads[1]), router.pending_rx_s(reps[1], loads[1], reps[0])
    kv_bytes = 2000 * 30 * zin.mc.kv_bytes_per_token
    assert on_link == pytest.approx(kv_bytes * 8 / 20e6, rel=1e-6) and on_link > 10 * port_only
    assert router.pick_decode(0, loads, 64, 32, 0.0) == 2
    assert router.best_decode_rest(reps[0], loads, 32, 0.0) > router.decode_cost(reps[2], loads[2], 32)[0]


def test_kv_stays_promised_until_the_last_stage_has_shipped_it(inp):
    """A prefill pipeline's stages ship their KV as each finishes the prompt; the decode replica's
    promise (`kv_pending_tokens`) holds until the last stage's KV is on the ports (the prompt's
    first token, when the live gateway drops it too), not from the first stage on, when most of
    the KV is neither booked on a port nor promised."""
    by_id = {m.id: m for m in inp.members}
    reps = [SimReplica(0, "prefill", (by_id["fog-1"], by_id["fog-2"]), (15, 15), inp),
            SimReplica(1, "decode", (by_id["fog-3"],), (30,), inp)]
    req = Request(0, 0.0, 500, 10)
    sim = Simulator(reps, [req])
    stages_done = 0
    while sim.heap:
        sim.now, _, fn, args = heapq.heappop(sim.heap)
        fn(*args)
        stages_done += fn.__name__ == "on_stage"
        prefilled = req.first_token == req.first_token  # not NaN
        assert sim.loads[1].kv_pending_tokens == (0 if prefilled else 500), (fn.__name__, stages_done)
    assert stages_done == 2 and req.done > 0


def test_the_gateway_keeps_one_router_per_set_of_ready_replicas_until_the_next_plan(inp):
    """The gateway routes every request with the router of its ready replicas, kept (with the
    KV flows it has worked out) until a replica's readiness changes or a new plan arrives."""
    from meshllm.roles.gateway import RouterView

    reps = [rep(inp, 0, "prefill", "fog-1"), rep(inp, 1, "decode", "fog-2"), rep(inp, 2, "decode", "fog-4")]
    view = RouterView()
    view.replan({r.id: r for r in reps}, inp, set())
    assert view.route({0, 1, 2}, 2000, 32) == view.route({0, 1, 2}, 2000, 32)
    router = view.router_for(reps)
    assert router is view.router_for(reps) and router.ports is view.ports and router._flows
    assert view.route({0, 1}, 2000, 32) == (0, 1) and view.router_for(reps[:2]) is not router
    view.replan({r.id: r for r in reps}, inp, set())
    assert view.router_for(reps) is not router and view.router_for(reps).ports is view.ports


def test_a_request_goes_to_a_replica_whose_kv_room_holds_it_while_one_can() -> None:
    """KV admission at the gateway: a decode or mixed replica whose KV room (its leader's figure)
    cannot hold the request's longest context is left out while another can; prefill replicas
    and replicas whose room is not known stay; when none can hold it, all stay (it runs alone)."""
    from meshllm.roles.route_view import kv_fit

    roles = {0: "decode", 1: "prefill", 2: "decode", 3: "mixed"}
    rooms = {0: 600_000, 2: 7461, 3: 4000}
    assert kv_fit({0, 1, 2, 3}, roles, rooms, 8192) == {0, 1}
    assert kv_fit({0, 1, 2, 3}, roles, rooms, 4096) == {0, 1, 2}
    assert kv_fit({0, 1, 2, 3}, roles, rooms, 512) == {0, 1, 2, 3}
    assert kv_fit({1, 2, 3}, roles, rooms, 8192) == {1, 2, 3}  # none holds it: unchanged
    assert kv_fit({1, 2, 3}, roles, {2: 7461}, 8192) == {1, 3}  # 3's room is not known


def test_a_request_larger_than_every_room_goes_to_an_empty_replica_not_a_busy_one() -> None:
    """The gateway lets a request larger than every decode replica's KV room through when one of
    them holds no request (KvBook.room_for: it runs there alone); routing must then send it to
    that empty replica, not to a busy one where it would wait at the leader behind the others."""
    from meshllm.roles.route_view import kv_fit

    roles = {0: "decode", 1: "prefill", 2: "decode", 3: "mixed"}
    rooms = {0: 6000, 2: 7461, 3: 4000}
    left = {0: 1000, 2: 7461, 3: 3000}  # 2 holds nothing; 0 and 3 are busy
    assert kv_fit({0, 1, 2, 3}, roles, left, 8192, rooms) == {1, 2}
    assert kv_fit({0, 1, 3}, roles, left, 8192, rooms) == {0, 1, 3}  # no empty one ready: unchanged
    assert kv_fit({0, 1, 2, 3}, roles, left, 2000, rooms) == {1, 2, 3}  # room left for it: as before
    assert kv_fit({0, 1, 2, 3}, roles, left, 3000, rooms) == {1, 2, 3}  # 3's room left holds it: not only the empty one


def test_what_the_candidates_of_one_pick_share_leaves_every_score_exactly_as_alone():
    """pick_prefill computes each decode replica's share of the scores once (decode_targets) and
    each prefill replica's best decode finish once per set of zone links its KV crosses (memo):
    on bench-mesh-200 (zone links) and tuned Splitwise's replicas, stopped mid-run with loads,
    promised KV and booked ports, every candidate's score is bit for bit its score alone, with
    each decode replica in turn the one the others' queues make best."""
    from meshllm.config import load_cluster, plan_inputs
    from meshllm.sim.baselines import splitwise
    from meshllm.sim.sweep import make_trace, requests_at
    from tests.conftest import REPO

    zin = plan_inputs(load_cluster(REPO / "clusters" / "bench-mesh-200.yaml"))
    reps = splitwise(zin).replicas
    assert {r.role for r in reps} >= {"prefill", "decode"} and len({m.zone for r in reps for m in r.members}) > 1
    sim = Simulator(reps, requests_at(make_trace(zin, 300, 0), 6.0))
    with pytest.raises(RuntimeError):
        sim.run(max_events=3_000)  # stopped mid-run
    router, loads = sim.router, sim.loads
    for rid, load in loads.items():  # and more KV promised than a short run leaves
        load.kv_pending_tokens += 300 * (1 + rid % 3)
    decoders = [r.id for r in reps if r.role == "decode"]
    shared = 0
    for best in decoders:
        for rid in decoders:
            loads[rid].waiting += 0 if rid == best else 100_000
        targets, memo, n = router.decode_targets(loads, 256.0, sim.now), {}, 0
        for r in reps:
            if r.role == "prefill":
                alone = router.prefill_score(r, loads, 700, 256.0, sim.now)
                assert router.prefill_score(r, loads, 700, 256.0, sim.now, True, targets, memo) == alone, (best, r.id)
                assert router.best_decode_rest(r, loads, 256.0, sim.now) == defined(router, r, loads, sim.now)
                n += 1
        shared += n - len(memo)
        for rid in decoders:
            loads[rid].waiting -= 0 if rid == best else 100_000
    assert shared > 0, "no two prefill replicas shared their decode figures: the memo was not exercised"


def defined(router: Router, src: SimReplica, loads, now: float, n_out: float = 256.0) -> float:
    """best_decode_rest as its docstring defines it, term by term for each decode replica."""
    from meshllm.sim.ports import RX

    best = float("inf")
    for rep in router.reps.values():
        if rep.role in ("decode", "mixed"):
            rest, slot_wait = router.decode_cost(rep, loads[rep.id], n_out)
            rx = max(max(router.ports.wait_s(m.id, RX, now) for m in rep.members),
                     router.ports.link_wait_s(router.kv_links(src, rep), now))
            rx += router.pending_rx_s(rep, loads[rep.id], src)
            best = min(best, rest + (1 + router.w) * rx + router.w * slot_wait)
    return best


def test_a_tie_goes_to_the_lower_replica_id_and_kv_does_not_ship_within_a_device(inp):
    """Ties go to the lower replica id (pick_decode as pick_prefill); a prefill stage and a decode
    stage on the same device hold their KV there: no flow between them."""
    by_id = {m.id: m for m in inp.members}
    twins = [rep(inp, 0, "prefill", "fog-1"), SimReplica(1, "decode", (by_id["fog-3"],), (30,), inp),
             SimReplica(2, "decode", (by_id["fog-3"],), (30,), inp)]
    assert pick_decode(0, twins, loads_for(twins), 100, 10, 0.0) == 1
    router = Router(twins, PortBook(inp.net))
    assert router.kv_flows(twins[0], rep(inp, 3, "decode", "fog-1"), 100) == []
    assert router.kv_flows(twins[0], twins[1], 100)


def test_a_request_waits_for_a_decode_slot_only_beyond_the_batch_and_a_mixed_replica_s_prompts_hold_slots(inp):
    """decode_cost: a request that finds max_batch - 1 sequences there takes the last slot at once;
    one that finds the batch full waits for a slot; on a mixed replica the prompts queued for
    prefill will hold slots too."""
    for role in ("decode", "mixed"):
        r = rep(inp, 1, role, "fog-3")
        router = Router([rep(inp, 0, "prefill", "fog-1"), r], PortBook(inp.net))
        b = r.max_batch()
        assert router.decode_cost(r, ReplicaLoad(max_batch=b, active=b - 1, tokens_left=10.0), 10)[1] == 0.0
        assert router.decode_cost(r, ReplicaLoad(max_batch=b, active=b, tokens_left=10.0), 10)[1] > 0.0
    queued = ReplicaLoad(max_batch=b, active=b - 1, prefill_queued=1, tokens_left=10.0)
    assert router.decode_cost(r, queued, 10)[1] > 0.0  # (r: the mixed one)


def test_a_prompt_s_kv_waits_for_its_port_only_past_its_prefill_and_that_wait_counts_twice(inp):
    """tx_wait_s: the KV of a prompt ready at `at` waits for what is booked on its port (and the
    KV of the prompts ahead of it) only beyond `at`. In a prefill replica's score that wait comes
    in the shipping time and again, weighted, in the waiting term: a busy port raises the score by
    exactly (1 + w) x the wait."""
    from meshllm.partition.cost import transfer_s

    reps = [rep(inp, 0, "prefill", "fog-1"), rep(inp, 1, "decode", "fog-2")]
    ports = PortBook(inp.net)
    router = Router(reps, ports)
    loads = loads_for(reps)
    member, kv = reps[0].members[0], 30 * inp.mc.kv_bytes_per_token
    idle = router.prefill_score(reps[0], loads, 100, 32, 2.0, ships=False)
    ports.free[(member.id, "tx")] = 10.0  # its port is busy until t = 10
    assert router.tx_wait_s(member, kv, loads[0], 2.0, 5.0) == pytest.approx(5.0, rel=1e-12)  # 8 s booked, 3 hidden
    assert router.tx_wait_s(member, kv, loads[0], 2.0, 12.0) == 0.0
    _, lat = reps[0].prefill_s(100)
    wait = 10.0 - (2.0 + lat)  # the prompt is ready at now + its prefill latency
    assert wait > 0
    busy = router.prefill_score(reps[0], loads, 100, 32, 2.0, ships=False)
    assert busy - idle == pytest.approx((1 + router.w) * wait, rel=1e-9)
    loads[0].kv_unshipped_tokens = 1000  # the KV of prompts ahead, not on the port yet
    ahead = transfer_s(kv * 1000, member.device.network_mbps)
    assert router.tx_wait_s(member, kv, loads[0], 2.0, 5.0) == pytest.approx(5.0 + ahead, rel=1e-12)
