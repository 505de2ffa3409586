"""The shared router (meshllm/sim/router.py): what the simulator and the live gateway both call."""

from __future__ import annotations

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
