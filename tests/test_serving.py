"""Distributed serving end to end: emulated meshes of real node processes (`--cluster --serve`),
requests through the OpenAI API (the official `openai` client and raw HTTP), every output
compared token for token with the single-process reference (the tie rule of engine/sampling.py).

Plans exercised: two 1-stage replicas (prefill -> decode), and a 2-stage prefill replica that
ships KV to a 3-stage decode replica splitting the layers differently.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json
import re
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.conftest import wait_for
from tests.serving_util import Served, reference, same_up_to_tie, small_device, streaming, write_cluster

pytestmark = pytest.mark.slow

LONG = ("The history of the city begins with a small fishing village on the northern bank of the river. "
        "Over the centuries merchants, monks and soldiers came and went, each leaving roads, walls and "
        "stories behind. ") * 9 + "Summarize this history in one sentence:"
PROMPTS = [  # (text, chat)
    ("The capital of France is", False),
    ("List three prime numbers:", False),
    ("def fibonacci(n):\n", False),
    (LONG, False),
    ("What is the capital of France?", True),
    ("Write a haiku about the sea.", True),
    ("Explain what a transformer is in one sentence.", True),
    (LONG.replace("river", "lake"), True),
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def disagg(tmp_path_factory):
    """Two 1-stage replicas: a prefill replica shipping KV to a decode replica. Its file lists no
    prompts: a served mesh takes its requests from the API (`--serve` refused such a file: exit 2)."""
    d = tmp_path_factory.mktemp("disagg")
    dev = small_device("nuc-like", 8.0)
    path = write_cluster(d / "disagg.yaml", [{"id": "p1", "device": dev, "zone": "fog", "roles": ["prefill"]},
                                             {"id": "d1", "device": dev, "zone": "fog", "roles": ["decode"]}],
                         workload={"input_tokens": {"mean": 32, "dist": "fixed"},
                                   "output_tokens": {"mean": 32, "dist": "fixed"}})
    s = Served(path, d / "serve.log")
    yield s
    assert s.stop() == 0, s.log.read_text()[-2000:]


@pytest.fixture(scope="module")
def pipes(tmp_path_factory):
    """A 2-stage prefill replica and a 3-stage decode replica with different layer splits; two
    gateways (a1's, the one the tests use, and b1's)."""
    d = tmp_path_factory.mktemp("pipes")
    pre, dec = small_device("half", 0.34), small_device("third", 0.26)
    nodes = [{"id": f"a{i}", "device": pre, "zone": "fog", "roles": ["prefill"] + ["gateway"] * (i == 1)}
             for i in (1, 2)]
    nodes += [{"id": f"b{i}", "device": dec, "zone": "fog", "roles": ["decode"] + ["gateway"] * (i == 1)}
              for i in (1, 2, 3)]
    s = Served(write_cluster(d / "pipes.yaml", nodes), d / "serve.log")
    yield s
    assert s.stop() == 0, s.log.read_text()[-2000:]


def plan_of(served: Served) -> dict:
    code, body = served.get("/v1/plan")
    assert code == 200
    return json.loads(body)["plan"]


def ask(client, prompt: str, chat: bool, stream: bool, **kw) -> list[int]:
    """One request through the official openai client; returns the token ids (meshllm extension)."""
    kw = {"model": "smollm2-135m", "max_tokens": MAX_TOKENS, "temperature": 0, **kw}
    if chat:
        res = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], stream=stream, **kw)
    else:
        res = client.completions.create(prompt=prompt, stream=stream, **kw)
    if not stream:
        return res.choices[0].model_extra["token_ids"]
    ids = []
    for chunk in res:
        ids.extend(chunk.choices[0].model_extra.get("token_ids") or [])
    return ids


def openai_client(served: Served):
    import openai

    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", timeout=300, max_retries=0)


@pytest.mark.parametrize("mesh", ["disagg", "pipes"])
def test_eight_concurrent_openai_requests_equal_the_reference(mesh, request, smollm2, smollm2_tokenizer):
    served = request.getfixturevalue(mesh)
    plan = plan_of(served)
    if mesh == "pipes":
        splits = {r["role"]: [tuple(s["layers"]) for s in r["stages"]] for r in plan["replicas"]}
        assert len(splits["prefill"]) == 2 and len(splits["decode"]) == 3 and splits["prefill"] != splits["decode"]
    client = openai_client(served)
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        futs = [pool.submit(ask, client, p, chat, stream=i % 2 == 0) for i, (p, chat) in enumerate(PROMPTS)]
        got = [f.result(timeout=300) for f in futs]
    assert len(smollm2_tokenizer.encode(LONG)) >= 300
    for (p, chat), ids in zip(PROMPTS, got):
        ok, why = same_up_to_tie(ids, reference(smollm2, smollm2_tokenizer, p, MAX_TOKENS, chat))
        assert ok, f"{p[:40]!r} (chat={chat}): {why}"
    if mesh == "pipes":  # KV admission: the decode replica's 0.26 GB stages hold ~336 positions of KV
        # beside their weights, less than one long request's 512-position slot: the gateway held the
        # requests back until the replica had room (so none waited there, holding its prompt's KV)
        decode = next(r for r in plan["replicas"] if r["role"] == "decode")
        lead = mesh_loads(served)[decode["stages"][0]["node"]]["leader"]
        assert 0 < lead["kv_room"] < 512 and lead["kv_waits"] == 0, lead
        assert lead["kv_peak"] <= 512, lead  # a long one's slot, alone


def test_two_gateways_count_each_other_s_kv_claims(pipes, smollm2, smollm2_tokenizer):
    """Each gateway held requests back only against its own requests' KV charges, so two gateways
    could together send a decode replica more than its room (the prompts' KV then waits on its
    stages). A long request through a1's gateway takes the whole room of the 3-stage decode
    replica (a 512-position slot; the room is ~336): once b1's gateway has heard a1's claim (a1's
    heartbeats), b1 holds a short request back until the long one ends, and no sequence waits at
    the decode leader."""
    import copy

    other = copy.copy(pipes)
    other.url = re.search(r"meshllm: another gateway on (http://\S+)", pipes.log.read_text()).group(1)
    decode = next(r for r in plan_of(pipes)["replicas"] if r["role"] == "decode")
    lead_node = decode["stages"][0]["node"]
    before = mesh_loads(pipes)[lead_node]["leader"]
    long_req = {"model": "smollm2-135m", "prompt": LONG, "max_tokens": 100, "temperature": 0}  # a 512 slot
    with cf.ThreadPoolExecutor(1) as pool:
        long_fut = pool.submit(pipes.post, "/v1/completions", long_req, 300)
        # (a1's heartbeat may still carry an earlier test's short claim for a moment: wait for this one's)
        a1 = mesh_loads(other, lambda ls: [decode["id"], 512] in ((ls["a1"].get("gateway") or {}).get("kv_claims") or []),
                        timeout_s=30)["a1"]
        assert a1["gateway"]["kv_claims"] == [[decode["id"], 512]], a1["gateway"]
        code, short = other.post("/v1/completions", {"model": "smollm2-135m", "prompt": "The sky is", "max_tokens": 8,
                                                     "temperature": 0}, 300)
        assert code == 200 and long_fut.done(), short  # it waited for the long one's room
        code, long_out = long_fut.result(timeout=300)
    assert code == 200
    for prompt, n, out in ((LONG, 100, long_out), ("The sky is", 8, short)):
        ok, why = same_up_to_tie(out["choices"][0]["token_ids"], reference(smollm2, smollm2_tokenizer, prompt, n))
        assert ok, f"{prompt!r}: {why}"
    after = mesh_loads(pipes, lambda ls: ls[lead_node]["leader"]["finished"] >= before["finished"] + 2)[lead_node]
    after = after["leader"]
    assert after["finished"] >= before["finished"] + 2 and after["kv_waits"] == before["kv_waits"], (before, after)


def test_requests_at_two_gateways_at_once_ask_the_decode_leader_for_its_kv_room(pipes, smollm2, smollm2_tokenizer):
    """The gateways' claims travel in heartbeats: two requests reaching a1's and b1's gateways in
    the same moment each found the 3-stage decode replica empty, both were sent, and one waited
    at the decode leader with its prompt's KV on the stages (the room is ~336 positions; each
    needs a 512 slot). Now each gateway asks the leader for the room first (KV_RESERVE): one
    gets it, the other is refused and waits at its gateway; nothing waits at the leader."""
    import copy

    other = copy.copy(pipes)
    other.url = re.search(r"meshllm: another gateway on (http://\S+)", pipes.log.read_text()).group(1)
    lead_node = next(r for r in plan_of(pipes)["replicas"] if r["role"] == "decode")["stages"][0]["node"]
    before = mesh_loads(pipes)[lead_node]["leader"]
    prompts = (LONG, LONG.replace("northern", "southern"))
    start = threading.Barrier(2)

    def post(served, prompt: str):
        start.wait(timeout=30)
        return served.post("/v1/completions", {"model": "smollm2-135m", "prompt": prompt, "max_tokens": 60,
                                               "temperature": 0}, 300)

    with cf.ThreadPoolExecutor(2) as pool:
        got = list(pool.map(post, (pipes, other), prompts, timeout=300))
    for prompt, (code, out) in zip(prompts, got):
        assert code == 200, out
        ok, why = same_up_to_tie(out["choices"][0]["token_ids"], reference(smollm2, smollm2_tokenizer, prompt, 60))
        assert ok, f"{prompt[-60:]!r}: {why}"
    after = mesh_loads(pipes, lambda ls: ls[lead_node]["leader"]["finished"] >= before["finished"] + 2)[lead_node]
    after = after["leader"]
    assert after["finished"] >= before["finished"] + 2 and after["kv_waits"] == before["kv_waits"], (before, after)


def test_requests_waiting_for_kv_room_go_first_come_first_served(pipes, smollm2, smollm2_tokenizer):
    """The gateway held requests back while no decode replica had KV room for them, but the first
    to find room went: a request that needs the whole room of the 3-stage decode replica (a
    512-position slot; the room is ~336) could be passed for ever by short ones. In arrival order
    now: A runs; B (a whole room) waits, then two short ones behind it; B runs before them. A
    client that leaves while its request waits frees its place, and the gauges come back to 0."""
    import socket
    from urllib.parse import urlparse

    def done_at(body: dict) -> tuple[float, dict]:
        code, out = pipes.post("/v1/completions", {"model": "smollm2-135m", "temperature": 0, **body}, 300)
        assert code == 200, out
        return time.monotonic(), out

    def in_flight() -> int:
        return json.loads(pipes.get("/health")[1])["in_flight"]

    a = {"prompt": LONG, "max_tokens": 100}  # ~5 s of decoding here: the others arrive meanwhile
    b = {"prompt": LONG.replace("northern", "southern"), "max_tokens": 8}
    cs = [{"prompt": p, "max_tokens": 4} for p in ("The sky is", "One, two,")]
    with cf.ThreadPoolExecutor(4) as pool:
        fa = pool.submit(done_at, a)
        deadline = time.monotonic() + 60
        while in_flight() < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        fb = pool.submit(done_at, b)
        time.sleep(0.5)
        host = urlparse(pipes.url)
        gone = socket.create_connection((host.hostname, host.port), timeout=30)  # waits behind B, then leaves
        body = json.dumps({"model": "smollm2-135m", "prompt": "Bye", "max_tokens": 4}).encode()
        gone.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        time.sleep(0.5)
        assert not fa.done() and in_flight() == 3  # the waiting ones count (max_concurrent bounds them too)
        gone.close()
        fcs = [pool.submit(done_at, c) for c in cs]
        got = [f.result(timeout=300) for f in (fa, fb, *fcs)]
    assert got[0][0] < got[1][0] < min(t for t, _ in got[2:]), [t for t, _ in got]
    for body, (_, out) in zip([a, b, *cs], got):
        ok, why = same_up_to_tie(out["choices"][0]["token_ids"],
                                 reference(smollm2, smollm2_tokenizer, body["prompt"], body["max_tokens"]))
        assert ok, f"{body['prompt'][:30]!r}: {why}"
    deadline = time.monotonic() + 10
    while in_flight() and time.monotonic() < deadline:
        time.sleep(0.1)
    metrics = pipes.get("/metrics")[1].decode()
    for gauge in ("meshllm_requests_running", "meshllm_requests_waiting_first_token"):
        assert re.search(rf"^{gauge} 0\.0$", metrics, re.M), (gauge, [ln for ln in metrics.splitlines() if gauge in ln])
    assert in_flight() == 0


def test_a_request_waiting_for_a_ready_replica_counts_in_flight_and_ends_at_the_drain(smollm2_tokenizer):
    """While the mesh re-planned, a request waiting for a ready replica was not counted in flight:
    any number could wait beyond max_concurrent, and a stopping gateway's drain did not see it
    (it waited its own READY_WAIT_S for the plan, then failed with "no replica is ready"). Now it
    counts, the next request over the limit is refused (429), and when the drain ends it gets 503
    shutting_down at once. (A gateway on fake sockets whose plan no node has loaded.)"""
    import dataclasses
    import urllib.error
    import urllib.request

    from meshllm.mesh.membership import Membership, PeerInfo
    from meshllm.mesh.sockets import free_port_pair
    from meshllm.roles.context import PlanContext
    from meshllm.roles.gateway import READY_WAIT_S, Gateway
    from meshllm.roles.http_api import ApiServer
    from tests.test_fuzz import GW, NODES, FakeTransport, Net, make_plan, node_cfg

    cfg = dataclasses.replace(node_cfg("gw"), max_concurrent=1)
    gw = Gateway(FakeTransport(Net(), "gw", GW), Membership("gw"), PeerInfo("gw", GW, "fog", {}, ("gateway",), 1),
                 cfg)
    gw.ctx = PlanContext(5, make_plan(), dict(NODES), "gw")  # planned, loaded nowhere: no replica is ready
    gw.model.vocab, gw.model.max_context, gw.model.tokenizer = 256, 256, smollm2_tokenizer
    api = ApiServer(gw, f"127.0.0.1:{free_port_pair()}", drain_s=0.5)
    api.start()

    def post() -> tuple[int, dict, float]:
        body = json.dumps({"model": gw.model_name, "prompt": [1, 2, 3], "max_tokens": 4}).encode()
        req = urllib.request.Request(f"http://{api.listen}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        t0 = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read()), time.monotonic() - t0
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read()), time.monotonic() - t0

    with cf.ThreadPoolExecutor(1) as pool:
        try:
            first = pool.submit(post)
            deadline = time.monotonic() + 10
            while gw.in_flight() < 1 and not first.done() and time.monotonic() < deadline:
                time.sleep(0.02)
            assert gw.in_flight() == 1 and not first.done(), first.result() if first.done() else 0  # counted
            code, body, _ = post()
            assert code == 429 and body["error"]["code"] == "overloaded", body
        finally:
            api.close()  # the drain (0.5 s) ends it
        code, body, took = first.result(timeout=30)
    assert code == 503 and body["error"]["code"] == "shutting_down", body
    assert took < READY_WAIT_S and gw.in_flight() == 0, took


def test_admission_gives_a_freed_slot_to_the_client_that_waited():
    """roles/admission.py: the limit first; then a free slot goes to a waiting client (refused
    within WAITING_S) ahead of the asker: one holding fewer requests, or as many and waiting
    longer. A lone client gets every slot, no slot idles while no one waits, and a client that
    stops asking is forgotten."""
    from meshllm.roles.admission import WAITING_S, Admission

    a = Admission(8)
    assert [a.try_admit("flood", 0.0) for _ in range(8)] == [None] * 8  # alone: every slot
    assert "its limit" in a.try_admit("polite", 0.0)  # full: refused, and now waiting
    assert "limit" in a.try_admit("flood", 0.1)
    a.release("flood")  # a slot frees: the flooder, holding 7, does not get it
    assert a.try_admit("flood", 0.2) == ("the free slot is owed to a client that waited first and holds no "
                                         "more than this one's 7")
    assert a.try_admit("polite", 1.0) is None  # the one that waited as Retry-After said gets it
    for _ in range(3):
        a.release("flood")
    assert a.held == {"flood": 4, "polite": 1} and a.total == 5
    assert a.try_admit("flood", 1.1) is None  # it waited, and no one ahead of it waits now
    assert [a.try_admit(c, 1.2) for c in ("x", "y")] == [None, None] and a.total == 8
    assert "limit" in a.try_admit("z", 1.3)  # z waits, holding none
    a.release("x")
    assert "owed to a client" in a.try_admit("x", 1.4)  # as few as z (0), but z waited longer
    assert "owed to a client" in a.try_admit("y", 1.4)
    assert a.try_admit("z", 1.5) is None and a.total == 8
    a.release("y")
    assert a.try_admit("flood", 1.6) is not None  # x waits holding 0 (since 1.4): flood holds 5
    assert a.try_admit("x", 2.0) is None  # x, though the flooder asked first
    for c in ("flood",) * 5 + ("polite", "z", "x"):
        a.release(c)
    assert a.held == {} and a.total == 0
    later = 2.0 + WAITING_S + 0.1  # no one asked for WAITING_S: every waiting client is forgotten
    assert [a.try_admit("flood", later) for _ in range(8)] == [None] * 8 and not a.refused_at and not a.since
    for _ in range(8):
        a.release("flood")


def test_admission_forgets_the_clients_silent_longest_first():
    """A client refused again is remembered from its last refusal: at the cap of waiting clients
    the one silent longest is forgotten, not one that is still asking; and a client silent for
    WAITING_S is forgotten at once after it."""
    from meshllm.roles.admission import WAITING_S, Admission

    a = Admission(1, max_waiting=2)
    assert a.try_admit("holder", 0.0) is None
    for c, t in (("p", 0.1), ("q", 0.2), ("p", 0.3), ("r", 0.4)):  # p asks again: q is the one silent longest
        assert a.try_admit(c, t) is not None
    assert list(a.refused_at) == ["p", "r"] and set(a.since) == {"p", "r"} and a.since["p"] == 0.1
    assert a.try_admit("r", 0.3 + WAITING_S) is not None and list(a.refused_at) == ["p", "r"]  # p: not yet
    assert a.try_admit("r", 0.3 + WAITING_S + 0.01) is not None and list(a.refused_at) == ["r"]
    assert set(a.since) == {"r"}


def test_admission_puts_a_waiting_client_holding_fewer_ahead_of_one_that_waited_longer():
    """The waiting clients are ordered by the requests they hold first, and only then by how long
    they have waited: a client holding none is owed a freed slot before one holding two that was
    refused earlier (either of them may ask first)."""
    from meshllm.roles.admission import Admission

    for first in ("big", "small"):
        a = Admission(3)
        assert [a.try_admit(c, 0.0) for c in ("big", "big", "other")] == [None] * 3
        assert "limit" in a.try_admit("big", 0.1)  # big waits from 0.1, holding 2
        assert "limit" in a.try_admit("small", 0.2)  # small waits from 0.2, holding 0
        a.release("other")
        if first == "big":
            assert "owed to a client" in a.try_admit("big", 0.3)
        assert a.try_admit("small", 0.4) is None and a.held == {"big": 2, "small": 1}


def test_admission_lets_a_client_take_a_slot_while_more_are_free_than_clients_ahead_of_it():
    """Only as many free slots as clients waiting ahead are owed: with two free and one client
    waiting ahead, the asker takes one and the waiting client still finds the other."""
    from meshllm.roles.admission import Admission

    a = Admission(3)
    assert [a.try_admit("x", 0.0) for _ in range(3)] == [None] * 3
    assert "limit" in a.try_admit("w", 0.1)  # w waits, holding none
    a.release("x")
    a.release("x")
    assert a.try_admit("x", 0.2) is None  # 2 free, 1 owed to w
    assert "owed to a client" in a.try_admit("x", 0.3)  # 1 free, owed to w
    assert a.try_admit("w", 0.4) is None and a.held == {"x": 2, "w": 1} and list(a.since) == ["x"]  # x now waits


def test_admission_forgets_a_client_once_admitted_so_it_takes_no_waiting_client_s_place():
    """A client admitted is no longer waiting: at the cap of waiting clients it is not counted,
    so a client refused after it does not push out one still waiting (which keeps its turn)."""
    from meshllm.roles.admission import Admission

    a = Admission(2, max_waiting=2)
    assert [a.try_admit(c, 0.0) for c in ("a", "b")] == [None, None]
    for c, t in (("c", 0.1), ("d", 0.2), ("c", 0.25)):
        assert "limit" in a.try_admit(c, t)
    a.release("a")
    assert a.try_admit("c", 0.3) is None  # c waited first
    assert list(a.refused_at) == ["d"] and set(a.since) == {"d"}
    assert "limit" in a.try_admit("e", 0.4)
    assert list(a.refused_at) == ["d", "e"]  # d still waits, ahead of e
    a.release("b")
    assert "owed to a client" in a.try_admit("e", 0.5)
    assert a.try_admit("d", 0.6) is None


def test_admission_serves_a_client_that_honours_retry_after_beside_one_that_retries_at_once():
    """With as many clients as slots, each client's share is one slot, and a client that sent
    again the moment its request ended got every slot back before one that waited 1 s as told (a
    review: 0 of 40 for that one, live). A simulation of 60 s of 0.5 s requests: each client
    that waits gets its turns."""
    from meshllm.roles.admission import Admission

    for limit in (1, 2, 3):
        a = Admission(limit)
        politeness = {"flood": 0.0, **{f"polite{i}": 1.0 for i in range(limit)}}  # seconds it waits after a 429
        ends: list[tuple[float, str]] = []  # (when a request ends, its client)
        next_try = {c: 0.0 for c in politeness}
        served = dict.fromkeys(politeness, 0)
        t = 0.0
        while t < 60.0:
            for end, c in [e for e in ends if e[0] <= t]:
                ends.remove((end, c))
                a.release(c)
                next_try[c] = t  # each client sends its next request when one ends (one at a time)
            for c in politeness:
                if next_try[c] is not None and next_try[c] <= t:
                    if a.try_admit(c, t) is None:
                        served[c] += 1
                        ends.append((t + 0.5, c))
                        next_try[c] = None
                    else:
                        next_try[c] = t + max(politeness[c], 0.01)
            t = round(t + 0.01, 2)
        polite = [served[c] for c in politeness if c != "flood"]
        assert min(polite) >= 10 and served["flood"] >= 10, (limit, served)


def test_a_client_that_floods_the_gateway_leaves_the_slot_that_frees_to_the_one_that_waits(smollm2_tokenizer):
    """Admission was one count for all clients: a client that sent again at once took every slot
    that freed, and one that honoured Retry-After got none (a review: 80 requests to 0 with 8
    slots). Two clients on two loopback addresses and a gateway with 2 slots, whose requests wait
    for a ready replica (fake sockets, no node has loaded its plan): A holds both, B is refused;
    one of A's leaves, and A's next is refused (its share is 1 while B waits) while B's is taken."""
    import dataclasses
    import socket

    from meshllm.mesh.membership import Membership, PeerInfo
    from meshllm.mesh.sockets import free_port_pair
    from meshllm.roles.context import PlanContext
    from meshllm.roles.gateway import Gateway
    from meshllm.roles.http_api import ApiServer
    from tests.test_fuzz import GW, NODES, FakeTransport, Net, make_plan, node_cfg

    cfg = dataclasses.replace(node_cfg("gw"), max_concurrent=2)
    gw = Gateway(FakeTransport(Net(), "gw", GW), Membership("gw"), PeerInfo("gw", GW, "fog", {}, ("gateway",), 1),
                 cfg)
    gw.ctx = PlanContext(5, make_plan(), dict(NODES), "gw")  # planned, loaded nowhere: requests wait
    gw.model.vocab, gw.model.max_context, gw.model.tokenizer = 256, 256, smollm2_tokenizer
    api = ApiServer(gw, f"127.0.0.1:{free_port_pair()}", drain_s=0.2)
    api.start()
    host, port = api.listen.rsplit(":", 1)
    body = json.dumps({"model": gw.model_name, "prompt": [1, 2, 3], "max_tokens": 4}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    opened: list[socket.socket] = []

    def send(client: str) -> socket.socket:
        sock = socket.create_connection((host, int(port)), timeout=30, source_address=(client, 0))
        opened.append(sock)
        sock.sendall(request)
        return sock

    def answer(sock: socket.socket) -> tuple[int, dict]:
        head, _, rest = sock.recv(65536).partition(b"\r\n\r\n")
        return int(head.split()[1]), json.loads(rest)

    def wait_in_flight(n: int) -> None:
        deadline = time.monotonic() + 10
        while gw.in_flight() != n and time.monotonic() < deadline:
            time.sleep(0.02)
        assert gw.in_flight() == n

    a, b = "127.0.0.2", "127.0.0.3"
    try:
        a1, _ = send(a), send(a)
        wait_in_flight(2)
        code, got = answer(send(b))
        assert code == 429 and "its limit" in got["error"]["message"], got
        a1.close()  # one of A's requests ends (its client left): a slot frees
        wait_in_flight(1)
        code, got = answer(send(a))  # A asks at once: B, refused a moment ago, is owed that slot
        assert code == 429 and got["error"]["code"] == "overloaded" and "owed to a client that waited first" in \
            got["error"]["message"], got
        send(b)
        wait_in_flight(2)
        assert gw.admission.held == {a: 1, b: 1}
    finally:
        for sock in opened:
            sock.close()
        api.close()
    wait_in_flight(0)


def test_a_request_pinned_to_a_decode_replica_the_plan_lacks_fails_at_once(smollm2_tokenizer):
    """A request pinned to a decode replica (`meshllm.decode_replica`) whose node died was resumed
    on the new plan, which had no such replica, and waited RESUME_WAIT_S (60 s) for it before its
    503; a new request pinned to a replica the plan lacks waited READY_WAIT_S. Both fail at once
    now, code replica_not_in_plan; a pin to a replica of the plan that is not ready yet still
    waits for it. (A gateway on fake sockets whose plan no node has loaded.)"""
    import dataclasses

    from meshllm.mesh.membership import Membership, PeerInfo
    from meshllm.roles.context import PlanContext
    from meshllm.roles.gateway import READY_WAIT_S, RESUME_WAIT_S, Gateway
    from meshllm.roles.route_view import PIN_GONE, RequestError, Stream
    from tests.test_fuzz import GW, NODES, FakeTransport, Net, make_plan, node_cfg

    cfg = dataclasses.replace(node_cfg("gw"), time_scale=0.1)
    gw = Gateway(FakeTransport(Net(), "gw", GW), Membership("gw"), PeerInfo("gw", GW, "fog", {}, ("gateway",), 1),
                 cfg)
    gw.ctx = PlanContext(5, make_plan(), dict(NODES), "gw")  # decode targets 1, 2 (mixed) and 3; 0 prefills
    gw.model.vocab, gw.model.max_context, gw.model.tokenizer = 256, 256, smollm2_tokenizer

    async def submit(pin: int) -> tuple[float, RequestError]:
        t0 = time.monotonic()
        with pytest.raises(RequestError) as e:
            await gw.submit([1, 2, 3], 4, 0.0, 0, 1.0, 0, decode_replica=pin)
        return time.monotonic() - t0, e.value

    async def resume(pin: int) -> tuple[float, RequestError]:
        s = Stream(0, asyncio.get_running_loop(), asyncio.Queue(), set(), -1, -1, 3, 4, prompt=[1, 2, 3],
                   settings={"sampling": {}, "mode": "off", "gamma": 4, "adaptive": False, "pin": pin},
                   emitted=[7], next_index=1)
        t0 = time.monotonic()
        with pytest.raises(RequestError) as e:
            await gw._resume(s, "node dg of its replica died")
        return time.monotonic() - t0, e.value

    for pin in (9, 0):  # none, and a prefill replica
        took, err = asyncio.run(submit(pin))
        assert err.code == PIN_GONE and f"decode replica {pin} is not a decode replica of plan v5 (its decode " \
            "replicas: [1, 2, 3])" in str(err) and took < READY_WAIT_S * cfg.time_scale / 2, (took, err)
    took, err = asyncio.run(resume(9))
    assert err.code == PIN_GONE and str(err).startswith("node dg of its replica died; no replica could take the "
                                                        "request again: decode replica 9 is not"), err
    assert took < RESUME_WAIT_S * cfg.time_scale / 4, took
    took, err = asyncio.run(submit(3))  # in the plan, not ready (loaded nowhere): it waits, then a 503
    assert err.code == "unavailable" and took >= READY_WAIT_S * cfg.time_scale * 0.9, (took, err)
    gw.close()


def test_a_request_to_a_gateway_with_no_plan_yet_waits_for_one_then_is_a_503(smollm2_tokenizer):
    """A gateway that has just started (or restarted: `--restart`) serves its API a moment before
    the coordinator's plan reaches it. A request then was an HTTP 500 (an AttributeError on the
    missing plan); now it waits for a plan as it waits through a re-plan (READY_WAIT_S x
    time_scale), and without one is a 503 that says why. (A gateway on fake sockets.)"""
    import dataclasses
    import urllib.error
    import urllib.request

    from meshllm.mesh.membership import Membership, PeerInfo
    from meshllm.mesh.sockets import free_port_pair
    from meshllm.roles.gateway import READY_WAIT_S, Gateway
    from meshllm.roles.http_api import ApiServer
    from tests.test_fuzz import GW, FakeTransport, Net, node_cfg

    cfg = dataclasses.replace(node_cfg("gw"), time_scale=0.2)
    gw = Gateway(FakeTransport(Net(), "gw", GW), Membership("gw"), PeerInfo("gw", GW, "fog", {}, ("gateway",), 1),
                 cfg)
    gw.model.vocab, gw.model.max_context, gw.model.tokenizer = 256, 256, smollm2_tokenizer
    assert gw.ctx is None
    api = ApiServer(gw, f"127.0.0.1:{free_port_pair()}")
    api.start()
    try:
        body = json.dumps({"model": gw.model_name, "prompt": [1, 2, 3], "max_tokens": 4}).encode()
        req = urllib.request.Request(f"http://{api.listen}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        t0 = time.monotonic()
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=60)
        took, err = time.monotonic() - t0, json.loads(e.value.read())["error"]
    finally:
        api.close()
    assert e.value.code == 503 and err["code"] == "unavailable" and "no plan yet" in err["message"], err
    assert took >= READY_WAIT_S * cfg.time_scale * 0.9, took
    assert gw.in_flight() == 0


def test_a_peer_gateway_s_claims_count_only_when_well_formed_live_and_of_this_plan():
    """Heartbeat loads come from the network: a claim that is not [replica, positions] with small
    whole numbers, names no replica of the plan, is of another plan version, or comes from a
    peer not alive, counts for nothing."""
    from types import SimpleNamespace

    from meshllm.roles.kv_book import MAX_CLAIM, KvBook

    def peer(state: str, gw) -> SimpleNamespace:
        return SimpleNamespace(state=SimpleNamespace(value=state), load={"gateway": gw})

    good = {"plan_version": 3, "kv_claims": [[1, 500], [2, 7]]}
    peers = [peer("alive", good), peer("suspect", good), peer("alive", {**good, "plan_version": 2}),
             peer("alive", {"plan_version": 3, "kv_claims": [[1, -5], [1, True], [9, 5], [1, 2.5], [1, MAX_CLAIM + 1],
                                                             "x", [1], [1, 40, 2], [1, 40]]}),
             peer("alive", {"plan_version": 3, "kv_claims": {"1": 5}}), peer("alive", "junk")]
    gw = SimpleNamespace(ctx=SimpleNamespace(version=3, plan=SimpleNamespace(replicas=[SimpleNamespace(id=1),
                                                                                      SimpleNamespace(id=2)])),
                         members=SimpleNamespace(peers=lambda: peers))
    assert KvBook(gw).others() == {1: 540, 2: 7}


def test_the_kv_room_left_counts_every_gateway_s_claims_and_a_request_goes_while_a_ready_replica_holds_it():
    """KvBook.left: each decode replica's room (its leader's figure: this node's own load or its
    node's heartbeat; a non-integer room is no figure) less this gateway's and the other gateways'
    claims, 0 while a leader's refusal holds. room_for: a request goes while a ready decode
    replica has room left for its longest context, or holds nothing at all (it runs alone), or
    no decode replica is ready; else it waits."""
    import threading
    import time as _time
    from types import SimpleNamespace as NS

    from meshllm.defaults import Role
    from meshllm.roles.kv_book import MAX_CLAIM, KvBook

    replicas = [NS(id=1, role=Role.DECODE, stages=[NS(node="me")]), NS(id=2, role=Role.DECODE, stages=[NS(node="d2")]),
                NS(id=3, role=Role.PREFILL, stages=[NS(node="p")]), NS(id=4, role=Role.DECODE, stages=[NS(node="d4")])]
    nodes = {"d2": NS(load={"leader": {"replica": 2, "kv_room": 256}}), "d4": NS(load={"leader": {"replica": 4, "kv_room": True}})}
    claims = [[1, 128], [2, 64]]
    peer_gw = NS(state=NS(value="alive"), load={"gateway": {"plan_version": 3, "kv_claims": claims}})
    ready = {1, 2, 3}
    gw = NS(ctx=NS(version=3, plan=NS(replicas=replicas)), me="me", members=NS(get=nodes.get, peers=lambda: [peer_gw]),
            local_load=lambda: {"leader": {"replica": 1, "kv_room": 512}}, _lock=threading.Lock(),
            _streams={7: NS(kv_charge=128, decode_rid=1), 8: NS(kv_charge=0, decode_rid=2)},
            ready_replicas=lambda: sorted(ready), model=NS(max_context=1 << 20), closing=None)
    book = KvBook(gw)
    try:
        assert book.rooms() == {1: 512, 2: 256} and book.claims() == {1: 128}
        assert book.left() == {1: 256, 2: 192}
        req = NS(prompt=[0] * 100, emitted=[], n_out=100)  # 200 positions: the 256 slot
        assert book.room_for(req)  # replica 1 has 256 left
        ready.discard(1)
        assert not book.room_for(req)  # 2 has 192 left and holds claims: it waits
        big = NS(prompt=[0] * 200, emitted=[0] * 10, n_out=210)  # 410 positions: larger than 2's whole room
        assert not book.room_for(big)
        claims[:] = [[1, 128]]
        assert book.room_for(big)  # 2 holds nothing: it may run there alone
        claims[:] = [[2, 64]]
        book.full[2] = _time.monotonic() + 60  # 2's leader refused room: full for now
        assert book.left() == {1: 384, 2: 0} and not book.room_for(req)
        ready.clear()
        ready.add(3)
        assert book.room_for(req)  # no decode replica ready: no limit known to wait for
        claims[:] = [[2, MAX_CLAIM]]
        assert book.others() == {2: MAX_CLAIM}
    finally:
        book.ask_pool.shutdown(wait=False)


def test_sampling_is_the_references(pipes, smollm2, smollm2_tokenizer):
    for prompt, seed in (("Once upon a time", 7), ("The weather today", 123)):
        code, body = pipes.post("/v1/completions", {"model": "smollm2-135m", "prompt": prompt, "max_tokens": 20,
                                                    "temperature": 0.8, "seed": seed})
        assert code == 200, body
        ref = reference(smollm2, smollm2_tokenizer, prompt, 20, temperature=0.8, seed=seed)
        assert body["choices"][0]["token_ids"] == ref["token_ids"]


def test_a_client_resumes_a_request_after_the_tokens_it_has(pipes, smollm2, smollm2_tokenizer):
    """`meshllm.resume_token_ids`: a client whose gateway died mid-stream sends the request to
    another with the output it has; that gateway goes on after it (the workload client of
    `--cluster` does so, workload.py). Greedy and seeded sampling: the tokens after the resumed
    ones are the reference's, streamed, with their text only, and a resume point inside a
    multi-byte character still gives the whole text once."""
    prompt = "日本語で"  # its output's first token is part of a character (greedy and sampled); the 9th ends one
    for sampling in ({"temperature": 0}, {"temperature": 0.8, "seed": 11}):
        ref = reference(smollm2, smollm2_tokenizer, prompt, 24, **{k: v for k, v in sampling.items()
                                                                  if k != "temperature" or v})
        ids = ref["token_ids"]
        for cut in (1, 9):
            body = {"model": "smollm2-135m", "prompt": prompt, "max_tokens": 24, **sampling,
                    "meshllm": {"resume_token_ids": ids[:cut]}}
            code, got = pipes.post("/v1/completions", body)
            assert code == 200, got
            assert same_up_to_tie(ids[:cut] + got["choices"][0]["token_ids"], ref)[0], (sampling, cut, got)
            assert got["usage"]["completion_tokens"] == len(got["choices"][0]["token_ids"]) == 24 - cut
            events = pipes.post_stream("/v1/completions", body)
            text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
            assert [t for e in events if e.get("choices") for t in e["choices"][0]["token_ids"]] == \
                got["choices"][0]["token_ids"]
            whole = smollm2_tokenizer.decode(ids)
            head = smollm2_tokenizer.decode(ids[:cut]).rstrip("\ufffd")
            assert whole.startswith(head) and head + text == whole, (head, text)
            assert head != smollm2_tokenizer.decode(ids[:cut]) or cut == 9  # cut 1: inside a character
    ref = reference(smollm2, smollm2_tokenizer, "Name a color.", 12, chat=True)  # chat: after the assistant's turn began
    code, got = pipes.post("/v1/chat/completions", {"model": "smollm2-135m", "max_tokens": 12, "temperature": 0,
                                                    "messages": [{"role": "user", "content": "Name a color."}],
                                                    "meshllm": {"resume_token_ids": ref["token_ids"][:5]}})
    assert code == 200 and same_up_to_tie(ref["token_ids"][:5] + got["choices"][0]["token_ids"], ref)[0], got


def test_a_long_generation_through_the_pipeline(pipes, smollm2, smollm2_tokenizer):
    prompt = "Write a long story about a robot who learns to paint."
    code, body = pipes.post("/v1/chat/completions", {"model": "smollm2-135m", "max_tokens": 300, "temperature": 0,
                                                     "messages": [{"role": "user", "content": prompt}]}, timeout=300)
    assert code == 200, body
    ok, why = same_up_to_tie(body["choices"][0]["token_ids"],
                             reference(smollm2, smollm2_tokenizer, prompt, 300, chat=True))
    assert ok, why


def mesh_loads(served: Served, settled=lambda loads: True, timeout_s: float = 10.0) -> dict:
    """Every node's load as the gateway last heard it (heartbeats: up to ~0.5 s old), once `settled`."""
    deadline = time.monotonic() + timeout_s
    while True:
        loads = {k: v["load"] for k, v in json.loads(served.get("/v1/mesh")[1])["nodes"].items()}
        if settled(loads) or time.monotonic() > deadline:
            return loads
        time.sleep(0.3)


def test_kv_shipping_bytes_and_no_recompute(pipes):
    pipes.post("/v1/completions", {"model": "smollm2-135m", "prompt": "Count to five:", "max_tokens": 4})
    plan = plan_of(pipes)
    roles = {s["node"]: r["role"] for r in plan["replicas"] for s in r["stages"]}

    def kv(loads: dict, role: str, key: str) -> int:
        return sum(loads[n]["stage"][key] for n, r in roles.items() if r == role)

    loads = mesh_loads(pipes, lambda ls: kv(ls, "prefill", "kv_bytes_sent") == kv(ls, "decode", "kv_bytes_received"))
    sent, received = kv(loads, "prefill", "kv_bytes_sent"), kv(loads, "decode", "kv_bytes_received")
    first = next(n for n, r in roles.items() if r == "prefill" and loads[n]["stage"]["layers"][0] == 0)
    prefilled = sum(loads[first]["stage"]["tokens"][k] for k in ("prefill", "prefill_last"))
    n_layers, kv_heads, head_dim, fp32 = 30, 3, 64, 4
    assert prefilled > 0 and sent == received
    assert sent / prefilled == 2 * n_layers * kv_heads * head_dim * fp32  # K and V of every layer, once
    recomputed = sum(loads[n]["stage"]["tokens"][k] for n, r in roles.items() if r == "decode"
                     for k in ("prefill", "prefill_last"))
    assert recomputed == 0, "the decode replica never recomputes a prompt"


def test_each_stage_holds_only_its_layers(pipes):
    loads = mesh_loads(pipes)
    per_layer_mb = 14.16  # fp32 weights of one SmolLM2 block
    embed_mb = 49152 * 576 * 4 / 1e6  # the embedding, and again the (tied) LM head on the last stage
    decode = [v["stage"] for v in loads.values() if v.get("stage") and v["stage"]["replica"] == 0] or \
             [v["stage"] for v in loads.values() if v.get("stage")]
    for st in decode:
        a, b = st["layers"]
        want = (b - a) * per_layer_mb + embed_mb * ((a == 0) + (b == 30))
        assert st["weights_mb"] == pytest.approx(want, rel=0.03)
        assert st["weights_mb"] < 0.6 * (30 * per_layer_mb + 2 * embed_mb)
    for v in loads.values():
        assert v["rss_mb"] > 0


def test_continuous_batching_short_request_overtakes_a_long_one(disagg):
    long_req = {"model": "smollm2-135m", "prompt": "Count from one to two hundred: 1, 2, 3, 4,", "max_tokens": 150,
                "temperature": 0}
    short_req = {"model": "smollm2-135m", "prompt": "Hi", "max_tokens": 3, "temperature": 0}
    done: dict[str, float] = {}

    def run(name: str, body: dict) -> None:
        code, res = disagg.post("/v1/completions", body, timeout=300)
        assert code == 200 and res["choices"][0]["finish_reason"] == "length", res
        done[name] = time.monotonic()

    with cf.ThreadPoolExecutor(2) as pool:
        a = pool.submit(run, "long", long_req)
        time.sleep(1.0)  # the long one is decoding
        b = pool.submit(run, "short", short_req)
        a.result(timeout=300)
        b.result(timeout=300)
    assert done["short"] < done["long"], "the short request waited for the long one"


@pytest.mark.parametrize("body,status,code", [
    (b"{not json", 400, "invalid_json"),
    (b"[1, 2]", 400, "invalid_body"),
    (b'{"model": "smollm2-135m", "prompt": "hi \\ud800"}', 400, "invalid_json"),  # a lone surrogate: no text
    ({"model": "smollm2-135m", "prompt": "hi", "max_tokens": "ten"}, 400, "invalid_value"),
    ({"model": "smollm2-135m", "prompt": "hi", "max_tokens": -5}, 400, "invalid_value"),
    ({"model": "smollm2-135m", "prompt": 42}, 400, "invalid_value"),
    ({"model": "gpt-4", "prompt": "hi"}, 404, "model_not_found"),
    ({"model": "smollm2-135m", "prompt": "hi " * 9000}, 400, "context_length_exceeded"),
    ({"model": "smollm2-135m", "prompt": "hi", "temperature": -1}, 400, "invalid_value"),
    ({"model": "smollm2-135m", "messages": "hello"}, 400, "invalid_value"),
    ({"model": "smollm2-135m", "messages": [{"role": ["user"], "content": "hi"}]}, 400, "invalid_value"),  # was a 500
    ({"model": "smollm2-135m", "messages": [{"role": "user", "content": ""}] * 9000}, 400, "context_length_exceeded"),
    ({"model": "smollm2-135m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
     400, "invalid_value"),
    # OpenAI fields this server does not implement are refused, not ignored (the output would not be what was asked)
    ({"model": "smollm2-135m", "prompt": "hi", "presence_penalty": 0.5}, 400, "unsupported_parameter"),
    ({"model": "smollm2-135m", "prompt": "hi", "logprobs": 3}, 400, "unsupported_parameter"),
    ({"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}],
      "response_format": {"type": "json_object"}}, 400, "unsupported_parameter"),
    ({"model": "smollm2-135m", "prompt": "hi", "min_tokens": 8}, 400, "unsupported_parameter"),
    # and fields it does not know at all (a typo, another server's extension) are named, not dropped
    ({"model": "smollm2-135m", "prompt": "hi", "max_token": 4}, 400, "unknown_parameter"),
    ({"model": "smollm2-135m", "prompt": "hi", "stop_token_ids": [13]}, 400, "unknown_parameter"),
    ({"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "prompt": "hi"}, 400,
     "unknown_parameter"),
    ({"model": "smollm2-135m", "prompt": "hi", "max_tokens": 4, "max_completion_tokens": 5}, 400, "invalid_value"),
    ({"model": "smollm2-135m", "prompt": "hi", "stream_options": {"include_usage": True}}, 400, "invalid_value"),
    ({"model": "smollm2-135m", "prompt": "hi", "meshllm": {"resume_token_ids": [1, "2"]}}, 400, "invalid_value"),
    ({"model": "smollm2-135m", "prompt": "hi", "meshllm": {"resume_token_ids": [10 ** 9]}}, 400, "invalid_value"),
    ({"model": "smollm2-135m", "prompt": "hi", "max_tokens": 2, "meshllm": {"resume_token_ids": [5, 6]}}, 400,
     "invalid_value"),  # nothing left to generate
    ({"model": "smollm2-135m", "prompt": "hi", "meshllm": {"resume_token_ids": [5, 2]}}, 400, "invalid_value"),  # EOS
])
def test_bad_input_is_a_4xx_and_the_mesh_keeps_serving(disagg, body, status, code, smollm2, smollm2_tokenizer):
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    with cf.ThreadPoolExecutor(1) as pool:  # another tenant's request in flight meanwhile
        other = pool.submit(disagg.post, "/v1/completions", {"model": "smollm2-135m", "prompt": "The sky is",
                                                             "max_tokens": 12, "temperature": 0})
        got_status, got = disagg.post(path, body)
        assert got_status == status and got["error"]["code"] == code, got
        ok_status, ok = other.result(timeout=120)
    assert ok_status == 200
    assert same_up_to_tie(ok["choices"][0]["token_ids"], reference(smollm2, smollm2_tokenizer, "The sky is", 12))[0]


def test_an_unknown_field_is_named_in_the_400():
    """vLLM's `stop_token_ids` or a typo such as `max_token` were dropped silently: the request ran
    as if they were not there. The 400 names them, and a chat body with `prompt` says why."""
    from types import SimpleNamespace

    from meshllm.roles.api_params import ApiError, parse_params

    gw = SimpleNamespace(model_name="m", model=SimpleNamespace(tokenizer=None, error="no tokenizer in this test"))
    for body, chat, msg in [({"model": "m", "prompt": "hi", "max_token": 4, "stop_token_ids": [2]}, False,
                             "unrecognized request arguments: 'max_token', 'stop_token_ids'"),
                            ({"model": "m", "messages": [], "prompt": "hi"}, True,
                             "unrecognized request argument: 'prompt' (chat takes 'messages')"),
                            ({"model": "m", "messages": []}, False,
                             "unrecognized request argument: 'messages' (/v1/completions takes 'prompt')")]:
        with pytest.raises(ApiError) as e:
            parse_params(body, gw, chat=chat)
        assert (e.value.status, e.value.code, str(e.value)) == (400, "unknown_parameter", msg)
    with pytest.raises(ApiError) as e:  # what it may carry goes past that check (to the tokenizer's 503 here)
        parse_params({"model": "m", "prompt": "hi", "user": "u", "metadata": {}, "store": False,
                      "service_tier": "auto", "min_tokens": 0}, gw, chat=False)
    assert e.value.status == 503


def test_a_meshllm_field_that_is_not_a_mapping_is_a_400_even_when_falsy(smollm2_tokenizer):
    """`"meshllm": 0`, `false`, `""` or `[]` were taken as no extension at all (the request ran with
    the cluster's settings); like `"meshllm": 5` they are a 400 now. `null` still means none."""
    from types import SimpleNamespace

    from meshllm.roles.api_params import ApiError, parse_params

    gw = SimpleNamespace(model_name="m", ctx=None, model=SimpleNamespace(tokenizer=smollm2_tokenizer, max_context=8192,
                                                               vocab=smollm2_tokenizer.vocab_size))
    body = {"model": "m", "prompt": "hi", "max_tokens": 4}
    for bad in (0, False, "", [], 5):
        with pytest.raises(ApiError) as e:
            parse_params({**body, "meshllm": bad}, gw, chat=False)
        assert (e.value.status, e.value.code) == (400, "invalid_value"), bad
    with pytest.raises(ApiError) as e:  # an unknown field is named, as a top-level one is (it was not)
        parse_params({**body, "meshllm": {"gama": 2, "gamma": 2}}, gw, chat=False)
    assert (e.value.status, e.value.code, e.value.param) == (400, "unknown_parameter", "meshllm.gama"), e.value
    assert str(e.value).startswith("unrecognized request argument: 'meshllm.gama'"), e.value
    assert parse_params({**body, "meshllm": None}, gw, chat=False).spec_mode is None
    assert parse_params({**body, "meshllm": {"speculation": "off"}}, gw, chat=False).spec_mode == "off"
    for field, bad in (("gamma", 17), ("decode_replica", -1)):  # named within the extension, as its other fields
        with pytest.raises(ApiError) as e:
            parse_params({**body, "meshllm": {field: bad}}, gw, chat=False)
        assert e.value.param == f"meshllm.{field}" and str(e.value).startswith(f"'meshllm.{field}' must be"), e.value


def test_n_and_best_of_are_not_true_a_missing_seed_is_a_fresh_one_and_a_pinned_replica_exists(smollm2_tokenizer):
    """`"n": true` passed as n=1 (True == 1); a request without a seed was always seeded 0, so two
    sampled requests gave the same text; `meshllm.decode_replica` naming no decode replica of the
    plan waited 15 s for a 503."""
    from types import SimpleNamespace

    from meshllm.roles.api_params import ApiError, parse_params
    from meshllm.roles.context import PlanContext
    from tests.test_fuzz import NODES, make_plan

    ctx = PlanContext(5, make_plan(), dict(NODES), "gw")
    gw = SimpleNamespace(model_name="m", ctx=ctx, model=SimpleNamespace(
        tokenizer=smollm2_tokenizer, max_context=8192, vocab=smollm2_tokenizer.vocab_size))
    body = {"model": "m", "prompt": "hi", "max_tokens": 4}
    for bad, code in [({"n": True}, "invalid_value"), ({"n": 2}, "invalid_value"),
                      ({"best_of": True}, "unsupported_parameter"), ({"presence_penalty": False}, "unsupported_parameter"),
                      ({"logprobs": 0}, "unsupported_parameter")]:  # (0 == False: it passed, and was ignored)
        with pytest.raises(ApiError) as e:
            parse_params({**body, **bad}, gw, chat=False)
        assert (e.value.status, e.value.code) == (400, code), bad
    assert parse_params({**body, "n": 1, "best_of": 1.0}, gw, chat=False).max_tokens == 4
    seeds = {parse_params({**body, "temperature": 1}, gw, chat=False).seed for _ in range(4)}
    assert len(seeds) == 4  # 63 random bits each
    assert parse_params({**body, "seed": 7}, gw, chat=False).seed == 7
    decoders = [r.id for r in ctx.plan.replicas if str(r.role) in ("decode", "mixed")]
    prefill = [r.id for r in ctx.plan.replicas if str(r.role) == "prefill"]
    assert decoders and prefill
    for pin in (prefill[0], 999):
        with pytest.raises(ApiError) as e:
            parse_params({**body, "meshllm": {"decode_replica": pin}}, gw, chat=False)
        assert (e.value.status, e.value.param) == (400, "meshllm.decode_replica") and "has no decode" in str(e.value)
    assert parse_params({**body, "meshllm": {"decode_replica": decoders[0]}}, gw, chat=False).decode_replica == decoders[0]


def test_a_stop_string_inside_a_verified_block_keeps_only_the_tokens_up_to_it(smollm2_tokenizer):
    """A verified draft block brings several tokens at once: with `stop: [", 5"]` the text was
    right but token_ids and usage held the block's tokens after the stop (16 tokens with
    speculation, 14 without). They are cut to what one-by-one decoding gives."""

    from meshllm.roles.text_stream import TextStream

    ids = smollm2_tokenizer.encode(" 1, 2, 3, 4, 5, 6, 7, 8")

    def run(block: int) -> tuple[str, list[int], int]:
        ts, text, n = TextStream(smollm2_tokenizer, (", 5",)), "", 0
        for i in range(0, len(ids), block):
            text += ts.push(ids[i:i + block], False)
            if ts.stopped:
                n += len(ids[i:i + block]) - ts.excess
                break
            n += len(ids[i:i + block])
        return text, ts.ids, n

    one = run(1)
    assert one[0] == " 1, 2, 3, 4" and one[1] == ids[:one[2]]
    for block in (2, 3, 5, 16):
        assert run(block) == one, block


def test_a_resumed_stream_sends_the_text_the_first_one_held_back(smollm2_tokenizer):
    """A stream holds back text that may become a stop string, yet sends its token ids; a client
    resuming with those ids (`meshllm.resume_token_ids`) never got that text: " Paris.\n\nThe
    answer" came back as " Paris. answer". Resumed after any chunk, the client's text is whole."""

    from meshllm.roles.text_stream import TextStream

    ids = smollm2_tokenizer.encode(" Paris.\n\nThe answer is: 🍏🍏 done")
    for stop in (("\n\nThe answer are",), ("\n\nThe answer are", " is: 🍏🍏x"), ()):
        ts = TextStream(smollm2_tokenizer, stop)
        sent = [ts.push([t], False) for t in ids]
        whole = "".join(sent) + ts.push([], True)
        assert whole == smollm2_tokenizer.decode(ids)
        assert any(d == "" for d in sent[1:]) or not stop  # something was held back
        for k in range(1, len(ids)):
            again = TextStream(smollm2_tokenizer, stop, tuple(ids[:k]))
            rest = "".join(again.push([t], False) for t in ids[k:]) + again.push([], True)
            assert "".join(sent[:k]) + rest == whole, (stop, k)


def test_a_long_stream_of_multi_byte_characters_is_never_fixed_mid_character(smollm2_tokenizer):
    """The fixing of a long stream's text (see below) must not cut a character: "🍏a🍎" x 300
    (~2100 tokens, the fruit split over byte tokens) pushed in blocks of 1, 2, 3, 5 and 7 gives
    the whole decode, with no U+FFFD (a mutation that fixed text at any split went unseen)."""
    from meshllm.roles.text_stream import TextStream

    tok = smollm2_tokenizer
    text = "🍏a🍎" * 300
    ids = tok.encode(text)
    assert len(ids) > 1000 and tok.decode(ids) == text
    for n in (1, 2, 3, 5, 7):
        ts = TextStream(tok, ())
        out = "".join(ts.push(ids[i:i + n], i + n >= len(ids)) for i in range(0, len(ids), n))
        assert out == text and "\ufffd" not in out and ts.fixed > 0, n


def test_a_stream_ends_with_the_tail_it_held_back_and_two_stops_in_one_push_cut_at_the_first(smollm2_tokenizer):
    """What a stream holds back because it may become a stop string is sent at its end; where two
    stop strings complete in one push (a verified draft block), the text ends before the first;
    end-of-sequence tokens give no text."""
    from meshllm.roles.text_stream import TextStream

    tok = smollm2_tokenizer
    ids = tok.encode("Hello world.\n")
    ts = TextStream(tok, ("\n\n",))
    assert ts.push(ids, False) == "Hello world." and ts.push([], True) == "\n"  # held, then sent at the end
    ts = TextStream(tok, ("gamma", "beta"))
    assert ts.push(tok.encode(" alpha beta gamma delta"), False) == " alpha " and ts.stopped
    ts = TextStream(tok, ())
    eos = sorted(tok.eos_ids)
    assert ts.push(tok.encode("Paris.") + eos[:1], True) == "Paris."


def test_a_long_stream_decodes_each_token_a_bounded_number_of_times(smollm2_tokenizer):
    """The point of fixing a long stream's text: 4000 tokens pushed one at a time decode each
    token a bounded number of times (a whole decode on every push: ~2000 times each)."""
    from meshllm.roles.text_stream import TEXT_STRIDE, TEXT_TAIL, TextStream

    class Counting:
        def __init__(self, tok):
            self.tok, self.eos_ids, self.decoded = tok, tok.eos_ids, 0

        def decode(self, ids):
            self.decoded += len(ids)
            return self.tok.decode(ids)

    spy = Counting(smollm2_tokenizer)
    ids = smollm2_tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 400)[:4000]
    ts = TextStream(spy, ())
    out = "".join(ts.push([t], k == len(ids) - 1) for k, t in enumerate(ids))
    assert out == smollm2_tokenizer.decode(ids)
    per_token = spy.decoded / len(ids)
    assert per_token < 4 * (TEXT_TAIL + TEXT_STRIDE), per_token


def test_a_long_stream_s_text_is_the_whole_decode_in_any_blocks(smollm2_tokenizer):
    """Each push decoded every token so far (8192 tokens one at a time: 8.6 s of the event loop's
    CPU); now the text before the last TEXT_TAIL.. tokens is fixed once a whole decode confirms
    it. Random token ids (broken UTF-8 mid-text), pushed in blocks of 1..17 past several fixings,
    give the whole decode; a stop string 2000 tokens in cuts where the whole text has it."""
    import random

    from meshllm.roles.text_stream import TEXT_STRIDE, TEXT_TAIL, TextStream

    tok = smollm2_tokenizer
    rnd = random.Random(5)
    ids = [rnd.randrange(tok.vocab_size) for _ in range(2000)] + tok.encode(" so: 🍏 THE END 🍌 more text")
    assert len(ids) > 4 * (TEXT_TAIL + TEXT_STRIDE)
    whole = tok.decode([t for t in ids if t not in tok.eos_ids])
    for stop in ((), ("THE END",)):
        for trial in range(3):
            ts, out, i = TextStream(smollm2_tokenizer, stop), [], 0
            while i < len(ids) and not ts.stopped:
                n = rnd.randint(1, 17)
                out.append(ts.push(ids[i:i + n], i + n >= len(ids)))
                i += n
            assert ts.fixed > len(ids) - 2 * (TEXT_TAIL + TEXT_STRIDE)  # it did fix text as it went
            assert "".join(out) == (whole[:whole.index("THE END")] if stop else whole), (stop, trial)
            if stop:
                assert tok.decode(ts.ids).endswith("THE END") and ts.stopped


def test_a_stop_string_never_matches_half_a_character(smollm2_tokenizer):
    """A stop string holding U+FFFD matched the replacement character of a character whose
    bytes had not all come: "Emoji list: 🍎🍌" stopped at once, output "" (the model writes
    whole apples). It matches only a U+FFFD the text really has, at its end."""

    from meshllm.roles.text_stream import TextStream

    ids = smollm2_tokenizer.encode("🍏🍏🍏")
    assert smollm2_tokenizer.decode(ids[:1]).endswith("\ufffd")  # the test's premise: a character split
    ts = TextStream(smollm2_tokenizer, ("\ufffd",))
    text = "".join(ts.push([t], False) for t in ids)
    assert not ts.stopped and text + ts.push([], True) == "🍏🍏🍏"
    ts = TextStream(smollm2_tokenizer, ("\ufffd",))  # cut off mid-character by max_tokens: that U+FFFD is real
    assert ts.push(ids[:1], True) == "" and ts.stopped


def test_a_bad_integer_field_s_message_gives_its_range_in_whole_numbers():
    """It said "must be an integer in [1, 2.14748e+09]" and "[-9.22337e+18, 9.22337e+18]"."""
    from meshllm.roles.api_params import ApiError, _number

    for body, key, msg in [({"max_tokens": 0}, "max_tokens", "'max_tokens' must be an integer in [1, 2147483648], got 0"),
                           ({"seed": 1.5}, "seed", "'seed' must be an integer in [-9223372036854775808, "
                                                   "9223372036854775807], got 1.5")]:
        with pytest.raises(ApiError) as e:
            _number(body, key, 0, *((1, 1 << 31) if key == "max_tokens" else (-(1 << 63), (1 << 63) - 1)), integer=True)
        assert str(e.value) == msg


def _small_gateway(tokenizer, max_context: int = 64):
    from types import SimpleNamespace

    return SimpleNamespace(model_name="m", ctx=None, model=SimpleNamespace(tokenizer=tokenizer, max_context=max_context,
                                                                           vocab=tokenizer.vocab_size))


@pytest.mark.parametrize("change, chat, param, code", [
    ({"stop": ""}, False, "stop", "invalid_value"),  # "" is found at 0: every response would be empty
    ({"stop": ["a", "b", "c", "d", "e"]}, False, "stop", "invalid_value"),
    ({"stop": ["a", ""]}, False, "stop", "invalid_value"),
    ({"max_tokens": True}, False, "max_tokens", "invalid_value"),
    ({"temperature": True}, False, "temperature", "invalid_value"),
    ({"stream": 1}, False, "stream", "invalid_value"),
    ({"stream": True, "stream_options": {"include_usage": 1}}, False, "stream_options", "invalid_value"),
    ({"stream_options": {"include_usage": True}}, False, "stream_options", "invalid_value"),
    ({"meshllm": {"adaptive": 1}}, False, "meshllm.adaptive", "invalid_value"),
    ({"meshllm": {"speculation": "on"}}, False, "meshllm.speculation", "invalid_value"),
    ({"meshllm": {"resume_token_ids": [-1]}}, False, "meshllm.resume_token_ids", "invalid_value"),
    ({"meshllm": {"resume_token_ids": [5, 6]}, "max_tokens": 2}, False, "meshllm.resume_token_ids", "invalid_value"),
    ({"prompt": [True, False]}, False, "prompt", "invalid_value"),
    ({"prompt": [-1, 5]}, False, "prompt", "invalid_value"),
    ({"prompt": ["a", "b"]}, False, "prompt", "invalid_value"),
    ({"prompt": ""}, False, "prompt", "invalid_value"),  # zero tokens
    ({"prompt": [1] * 64}, False, "prompt", "context_length_exceeded"),  # exactly the context: no room left
    ({"max_tokens": 4, "max_completion_tokens": 5}, False, "max_completion_tokens", "invalid_value"),
    ({"messages": [{"role": "user", "content": "hi"}] * 65}, True, "messages", "context_length_exceeded"),
])
def test_each_request_check_refuses_its_case(smollm2_tokenizer, change: dict, chat: bool, param: str, code: str):
    """The request checks one by one, in process (a mutation review found most of them tested
    only through a mesh, or not at all): each bad field is a 400 naming it."""
    from meshllm.roles.api_params import ApiError, parse_params

    body = {"model": "m", **({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}),
            "max_tokens": 4, **change}
    with pytest.raises(ApiError) as e:
        parse_params(body, _small_gateway(smollm2_tokenizer), chat=chat)
    assert (e.value.status, e.value.param, e.value.code) == (400, param, code), str(e.value)


def test_what_a_request_may_carry_is_taken_and_max_tokens_is_held_to_the_context_left(smollm2_tokenizer):
    from meshllm.roles.api_params import parse_params

    gw = _small_gateway(smollm2_tokenizer)
    got = parse_params({"model": "m", "prompt": [1] * 63, "max_tokens": 100}, gw, chat=False)
    assert got.max_tokens == 1  # the context's last position
    got = parse_params({"model": "m", "prompt": [1] * 10, "max_tokens": 5, "max_completion_tokens": 5,
                        "stop": ["a", "b", "c", "d"], "stream": True, "stream_options": {"include_usage": True},
                        "meshllm": {"resume_token_ids": [7, 8], "adaptive": False, "speculation": "sync"}},
                       gw, chat=False)
    assert (got.max_tokens, got.stop, got.stream, got.include_usage, got.resume, got.adaptive, got.spec_mode) == \
        (5, ("a", "b", "c", "d"), True, True, (7, 8), False, "sync")
    assert parse_params({"model": "m", "prompt": ["hi"]}, gw, chat=False).prompt_ids == smollm2_tokenizer.encode("hi")


def test_top_p_is_taken_in_0_1_and_its_400_says_so(smollm2_tokenizer):
    """The README says top_p is in (0, 1]; the 400 said "[1e-09, 1]" and refused 1e-10."""
    from types import SimpleNamespace

    from meshllm.roles.api_params import ApiError, parse_params

    gw = SimpleNamespace(model_name="m", ctx=None, model=SimpleNamespace(tokenizer=smollm2_tokenizer, max_context=8192,
                                                               vocab=smollm2_tokenizer.vocab_size))
    body = {"model": "m", "prompt": "hi", "max_tokens": 4}
    for bad in (2, 0, 0.0, -1e-300):
        with pytest.raises(ApiError) as e:
            parse_params({**body, "top_p": bad}, gw, chat=False)
        assert (e.value.status, str(e.value)) == (400, f"'top_p' must be a number in (0, 1], got {bad!r}")
    for good in (1e-300, 0.5, 1):
        assert parse_params({**body, "top_p": good}, gw, chat=False).top_p == good


def test_openai_fields_at_their_no_op_values_max_completion_tokens_and_the_usage_chunk(disagg):
    """What current OpenAI clients send, through the official client: max_completion_tokens
    (chat's name for max_tokens: ignored, a chat ran to the end of the context), the developer
    role and content parts, penalties at 0, nulls, and stream_options.include_usage (a last chunk
    with no choices and the usage)."""
    client = openai_client(disagg)
    messages = [{"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hello."}]}]
    res = client.chat.completions.create(model="smollm2-135m", messages=messages, temperature=0,
                                         max_completion_tokens=5, presence_penalty=0, frequency_penalty=0.0,
                                         response_format={"type": "text"}, user="tenant-1",
                                         metadata={"app": "t"}, store=False, parallel_tool_calls=True,
                                         extra_body={"n": None, "stop": None, "logprobs": False, "min_tokens": 0,
                                                     "repetition_penalty": 1.0})
    assert res.usage.completion_tokens <= 5, res
    chunks = list(client.completions.create(model="smollm2-135m", prompt="The sky is", max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    *tokens, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 6, last
    assert sum(len(c.choices[0].model_extra["token_ids"]) for c in tokens) == 6


def test_aiohttp_s_own_errors_are_the_api_s_json_errors(disagg):
    """No such route, a wrong method, a body over the limit: aiohttp answered these in plain
    text ("404: Not Found"), which an OpenAI client cannot parse as an error."""
    from meshllm.roles.http_api import MAX_BODY_BYTES

    for (status, raw), want, code in [(disagg.get("/v1/nope"), 404, "not_found"),
                                       (disagg.get("/v1/completions"), 405, "method_not_allowed")]:
        assert status == want and json.loads(raw)["error"]["code"] == code, raw
    status, got = disagg.post("/v1/completions", b'{"prompt": "' + b"x" * MAX_BODY_BYTES + b'"}')
    assert status == 413 and got["error"]["code"] == "body_too_large", got
    # bodies that were a plain-text 500 (RecursionError, LookupError, a payload error)
    body = json.dumps({"model": "smollm2-135m", "prompt": "hi", "max_tokens": 1}).encode()
    for data, headers, code, says in [
            (b'{"model": "smollm2-135m", "metadata": ' + b"[" * 100000 + b"]" * 100000 + b"}", {}, "invalid_json",
             "too deeply"),
            (body, {"Content-Type": "application/json; charset=foobar"}, "invalid_json", "unknown charset"),
            (body, {"Content-Type": "application/json; charset=base64"}, "invalid_json", "charset"),  # no text codec
            (body, {"Content-Encoding": "gzip"}, "invalid_body", "cannot be read")]:
        req = urllib.request.Request(disagg.url + "/v1/completions", data=data,
                                     headers={"Content-Type": "application/json", **headers})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        err = json.loads(e.value.read())["error"]
        assert e.value.code == 400 and err["code"] == code and says in err["message"], (headers, err)
    assert disagg.get("/health")[0] == 200
    # answered with its 400, the gzip body that is not was also an aiohttp traceback in the gateway's log
    assert "Unhandled exception" not in disagg.node_logs() and "RequestPayloadError" not in disagg.node_logs()
    status, raw = disagg.get("/v1/models/smollm2-135m")  # the OpenAI SDK's models.retrieve
    assert status == 200 and json.loads(raw)["id"] == "smollm2-135m"
    status, raw = disagg.get("/v1/models/gpt-4")
    assert status == 404 and json.loads(raw)["error"]["code"] == "model_not_found"


def test_a_client_that_disconnects_is_released_everywhere(disagg):
    # greedy, and a prompt the model goes on with (it sampled at temperature 1 on "Write a very long
    # poem about rivers.", whose first token is the end of text even greedily: a stream of 2 events)
    with streaming(disagg.url, {"model": "smollm2-135m", "prompt": "Count from one to two hundred: 1, 2, 3, 4,",
                                "temperature": 0, "max_tokens": 400, "stream": True}):
        pass  # a few tokens streamed, then the client goes away
    deadline = time.monotonic() + 30  # the socket is closed: the sequence must go from every node
    while time.monotonic() < deadline:
        nodes = json.loads(disagg.get("/v1/mesh")[1])["nodes"].values()
        busy = [n for n in nodes if (n["load"].get("leader") or {}).get("active", 0)
                or (n["load"].get("stage") or {}).get("kv_cache_bytes", 0)]
        if not busy:
            break
        time.sleep(0.5)
    assert not busy, f"still holding the abandoned sequence: {busy}"


def test_a_non_streaming_client_that_disconnects_is_abandoned_not_an_error(disagg):
    """A client of a whole (non-streaming) response that goes away was counted
    meshllm_requests_total{status="error"} (and logged nothing): error-rate alerts counted it."""
    def count(status: str) -> float:
        m = re.search(rf'^meshllm_requests_total{{status="{status}"}} (\S+)$', disagg.get("/metrics")[1].decode(), re.M)
        return float(m.group(1)) if m else 0.0

    def in_flight() -> int:
        return json.loads(disagg.get("/health")[1])["in_flight"]

    before = {st: count(st) for st in ("abandoned", "error")}
    host, port = disagg.url.removeprefix("http://").split(":")
    data = json.dumps({"model": "smollm2-135m", "prompt": "Count from one to two hundred: 1, 2, 3, 4,",
                       "temperature": 0, "max_tokens": 400}).encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
        assert wait_for(lambda: in_flight() == 1, 30)
    assert wait_for(lambda: in_flight() == 0 and count("abandoned") == before["abandoned"] + 1, 30), \
        (before, count("abandoned"), in_flight())
    assert count("error") == before["error"]


def test_a_prefill_node_gives_its_freed_heap_back_once_idle(disagg):
    """roles/shard.py IdleTrim on a prefill node: its stage allocates, runs, ships and frees a
    prompt's KV inside one compute call, so it never looked as if it held a sequence and never
    gave the freed heap back (the demo's prefill node, also its gateway, grew 1177 -> 1253 MB
    over 28 bursts of 40 requests). Each node's trims are in its load (`heap_trims`)."""
    def trims() -> dict[str, int]:
        nodes = json.loads(disagg.get("/v1/mesh")[1])["nodes"]
        return {nid: n["load"].get("heap_trims", 0) for nid, n in nodes.items()}

    before = trims()
    code, _ = disagg.post("/v1/completions", {"model": "smollm2-135m", "prompt": "One two", "max_tokens": 2})
    assert code == 200
    deadline = time.monotonic() + 30  # idle for TRIM_IDLE_S, then the next snapshot (SNAPSHOT_S)
    while time.monotonic() < deadline and not all(trims()[n] > before[n] for n in ("p1", "d1")):
        time.sleep(0.5)
    after = trims()
    assert after["p1"] > before["p1"] and after["d1"] > before["d1"], (before, after)


def test_metrics_parse_with_prometheus_client(disagg):
    from prometheus_client.parser import text_string_to_metric_families

    disagg.post("/v1/completions", {"model": "smollm2-135m", "prompt": "One two", "max_tokens": 4})
    code, text = disagg.get("/metrics")
    assert code == 200
    fams = {f.name: f for f in text_string_to_metric_families(text.decode())}
    for name in ("meshllm_time_to_first_token_seconds", "meshllm_inter_token_latency_seconds",
                 "meshllm_e2e_request_latency_seconds", "meshllm_requests_running", "meshllm_generation_tokens"):
        assert name in fams, sorted(fams)
    count = next(s.value for s in fams["meshllm_time_to_first_token_seconds"].samples if s.name.endswith("_count"))
    assert count >= 1
    assert json.loads(disagg.get("/health")[1])["status"] == "ok"
    assert json.loads(disagg.get("/v1/models")[1])["data"][0]["id"] == "smollm2-135m"


def test_cluster_cli_runs_its_workload_and_reports_the_brief_json(tmp_path, smollm2, smollm2_tokenizer):
    from tests.conftest import run_cli

    dev = small_device("nuc-like", 8.0)
    path = write_cluster(tmp_path / "c.yaml", [{"id": "p1", "device": dev, "zone": "fog", "roles": ["prefill"]},
                                                {"id": "d1", "device": dev, "zone": "fog", "roles": ["decode"]}],
                         workload={"prompts": ["The capital of France is", "List three prime numbers:"],
                                   "max_tokens": 12, "temperature": 0, "requests": 3})
    r = run_cli("--cluster", str(path), "--json", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert [x["prompt"] for x in out["results"]] == ["The capital of France is", "List three prime numbers:",
                                                      "The capital of France is"]  # requests cycle the prompts
    for res in out["results"]:
        assert {"prompt", "token_ids", "text", "finish_reason", "ttft_ms", "itl_ms"} <= set(res)
        assert res["ttft_ms"] > 0 and len(res["itl_ms"]) == len(res["token_ids"]) - 1
        assert same_up_to_tie(res["token_ids"], reference(smollm2, smollm2_tokenizer, res["prompt"], 12))[0]
    m = out["metrics"]
    for k in ("ttft_ms_mean", "ttft_ms_p99", "itl_ms_mean", "itl_ms_p50", "itl_ms_p99", "output_tokens_per_s",
              "queue_wait_ms_mean"):
        assert isinstance(m[k], (int, float)) and m[k] >= 0, k
    for k in ("acceptance_rate", "mean_acceptance_length", "drafted_tokens", "accepted_tokens"):
        assert m[k] is None  # speculation is off
    assert {r["role"] for r in out["plan"]["replicas"]} == {"prefill", "decode"}
    assert all(v["rss_mb"] > 0 for v in m["nodes"].values())


def test_a_mixed_replica_prefills_its_own_prompts_and_ships_no_kv(tmp_path, smollm2, smollm2_tokenizer):
    """One node holding the whole model is a mixed replica; with a drafter beside it, the same
    replica verifies drafts of the sequences it prefilled itself."""
    nodes = [{"id": "solo", "device": small_device("box", 8.0), "zone": "fog"},
             {"id": "pi", "device": "raspberry-pi-5-8gb", "zone": "edge", "roles": ["drafter"]}]
    path = write_cluster(tmp_path / "mixed.yaml", nodes, speculation={"mode": "async", "gamma": 4},
                         links=[{"zones": ["edge", "fog"], "rtt_ms": 20, "bandwidth_mbps": 100}])
    s = Served(path, tmp_path / "serve.log")
    try:
        plan = plan_of(s)
        assert [r["role"] for r in plan["replicas"]] == ["mixed"] and plan["drafters"] == ["pi"]
        for prompt, mode in (("The capital of France is", "off"), ("List three prime numbers:", "async")):
            code, res = s.post("/v1/completions", {"model": "smollm2-135m", "prompt": prompt, "max_tokens": 20,
                                                   "temperature": 0, "meshllm": {"speculation": mode}})
            assert code == 200, res
            ok, why = same_up_to_tie(res["choices"][0]["token_ids"], reference(smollm2, smollm2_tokenizer, prompt, 20))
            assert ok, why
            assert ("spec" in res["meshllm"]) == (mode == "async")
        loads = mesh_loads(s)
        assert loads["solo"]["stage"]["kv_bytes_sent"] == 0 and loads["solo"]["stage"]["kv_bytes_received"] == 0
    finally:
        assert s.stop() == 0


def test_a_prefill_replica_feeds_a_mixed_replica(tmp_path, smollm2, smollm2_tokenizer):
    """A prefill-only node beside a node that may do both: the plan makes the second a mixed replica
    that also decodes what the prefill replica ships it (partition/replica.py `absorbed`). Under a
    burst the router sends prompts both ways; KV crosses from one to the other, and every output
    equals the reference."""
    dev = small_device("box", 8.0)
    nodes = [{"id": "p1", "device": dev, "zone": "fog", "roles": ["prefill"]},
             {"id": "m1", "device": dev, "zone": "fog"}]
    s = Served(write_cluster(tmp_path / "feed.yaml", nodes), tmp_path / "serve.log")
    try:
        plan = plan_of(s)
        roles = {r["stages"][0]["node"]: r["role"] for r in plan["replicas"]}
        assert roles == {"p1": "prefill", "m1": "mixed"}, plan
        client = openai_client(s)
        prompts = [(LONG.replace("river", w), i % 2 == 1) for i, w in enumerate(("lake", "sea", "bay", "delta",
                                                                                 "creek", "fjord", "canal", "pond"))]
        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            futs = [pool.submit(ask, client, p, chat, stream=i % 2 == 0) for i, (p, chat) in enumerate(prompts)]
            got = [f.result(timeout=300) for f in futs]
        for (p, chat), ids in zip(prompts, got):
            ok, why = same_up_to_tie(ids, reference(smollm2, smollm2_tokenizer, p, MAX_TOKENS, chat))
            assert ok, f"{p[:40]!r} (chat={chat}): {why}"
        loads = mesh_loads(s, lambda ls: ls["m1"]["stage"]["kv_bytes_received"] > 0)
        assert loads["p1"]["stage"]["kv_bytes_sent"] > 0 and loads["m1"]["stage"]["kv_bytes_received"] > 0
        assert loads["m1"]["stage"]["kv_bytes_sent"] == 0  # a mixed replica never ships KV
    finally:
        assert s.stop() == 0


def test_a_long_request_goes_to_the_decode_replica_whose_kv_room_holds_it(tmp_path, smollm2, smollm2_tokenizer):
    """Two decode replicas: one node with 8 GB, and a 2-stage pipeline of faster 0.34 GB nodes
    whose stages hold a few hundred positions of KV beside their weights (the router would
    rather send requests there). A chat without
    max_tokens may run to the whole 8192-token context: the gateway sends such requests only to
    the replica whose KV room holds that (its leader's figure, from the heartbeats); the other
    would run them one at a time."""
    big, small = small_device("box", 8.0), small_device("half", 0.34, gbps=120.0)  # faster decode
    nodes = [{"id": "p1", "device": big, "zone": "fog", "roles": ["prefill"]},
             {"id": "d1", "device": big, "zone": "fog", "roles": ["decode"]},
             {"id": "h1", "device": small, "zone": "edge", "roles": ["decode"]},
             {"id": "h2", "device": small, "zone": "edge", "roles": ["decode"]}]
    links = [{"zones": [a, b], "rtt_ms": rtt, "bandwidth_mbps": 1000}  # a zone apart: not one pipeline of three
             for a, b, rtt in (("fog", "fog", 1), ("edge", "edge", 1), ("fog", "edge", 5))]
    s = Served(write_cluster(tmp_path / "fit.yaml", nodes, links=links), tmp_path / "serve.log")
    try:
        plan = plan_of(s)
        decode = {len(r["stages"]): r["stages"][0]["node"] for r in plan["replicas"] if r["role"] == "decode"}
        assert set(decode) == {1, 2}, plan
        rooms = mesh_loads(s, lambda ls: all("leader" in ls.get(n, {}) for n in decode.values()))
        roomy, tight = rooms[decode[1]]["leader"], rooms[decode[2]]["leader"]
        assert roomy["kv_room"] > 1024 > tight["kv_room"], (roomy, tight)
        prompts = ["What is the capital of France?", "Say hello.", "What is 2+2?", "Name a color."]
        client = openai_client(s)

        def chat(p: str) -> list[int]:
            res = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": p}],
                                                 temperature=0, max_tokens=1000)
            assert res.choices[0].finish_reason == "stop"
            return res.choices[0].model_extra["token_ids"]

        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(chat, prompts, timeout=300))
        for p, ids in zip(prompts, got):
            ok, why = same_up_to_tie(ids, reference(smollm2, smollm2_tokenizer, p, 200, chat=True))
            assert ok, f"{p!r}: {why}"
        loads = mesh_loads(s, lambda ls: ls[decode[1]]["leader"]["finished"] >= len(prompts))
        roomy, tight = loads[decode[1]]["leader"], loads[decode[2]]["leader"]
        assert roomy["finished"] == len(prompts) and tight["finished"] == 0 and tight["kv_waits"] == 0, (roomy, tight)
        assert roomy["kv_peak"] >= 1024
    finally:
        assert s.stop() == 0


def test_a_node_that_refused_a_request_of_this_plan_is_not_ready_until_it_beats_again():
    """A node restarted at its address answers for its earlier life's heartbeats until its peers
    hear from the new one: the gateway saw it ready at the current plan, a request resumed there
    was refused at once (stale_plan: the new life has no plan yet), and so were the next four
    attempts, within a second: the request failed ("gave up after 5 attempts"). A refusal now
    makes the node not ready until a heartbeat after it says it is."""
    from types import SimpleNamespace

    from meshllm.mesh.membership import Membership, PeerInfo
    from meshllm.mesh.protocol import MsgType, make
    from meshllm.roles.context import PlanContext
    from meshllm.roles.gateway import Gateway
    from meshllm.roles.route_view import Stream
    from tests.test_fuzz import GW, NODES, FakeTransport, Net, make_plan, node_cfg

    members = Membership("gw")
    gw = Gateway(FakeTransport(Net(), "gw", GW), members, PeerInfo("gw", GW, "fog", {}, ("gateway",), 1),
                 node_cfg("gw"))
    gw.ctx = PlanContext(5, make_plan(), dict(NODES), "gw")
    for node in NODES:
        if node != "gw":
            members.observe(PeerInfo(node, NODES[node], "fog", {}, ("decode",), 1), time.monotonic(), first_hand=True)
            members.heartbeat(node, 1, time.monotonic(), {"plan_version": 5})
    assert gw.ready_replicas() == [0, 1, 2, 3]
    got: list = []
    gw._streams[77] = Stream(77, SimpleNamespace(call_soon_threadsafe=lambda f, x: f(x)),
                             SimpleNamespace(put_nowait=got.append), set(), 2, 2, 3, 4)
    refusal = make(MsgType.TOKENS, seq=77, token_ids=[], index=0, finished=True, finish_reason="error",
                   refused="stale_plan", error="stale_plan: this node serves plan vNone")
    refusal.src = "mx"
    gw._on_tokens(refusal, None)
    assert got and got[0][2] == "error"  # the attempt is resumed, elsewhere or later
    assert gw.ready_replicas() == [0, 1, 3], "the mixed replica's node refused: not ready"
    members.heartbeat("mx", 1, time.monotonic() + 0.01, {"plan_version": 5})
    assert gw.ready_replicas() == [0, 1, 2, 3]


def test_a_request_whose_session_moved_follows_it_and_resumes_when_that_replica_changes():
    """A decode leader moves sessions to a replica with capacity; the gateway kept the replica it
    had sent the request to, so when the replica the session had moved to died or restarted, the
    re-plan left the request waiting for the 60 s stall timeout (found by `--restart` of the demo's
    fog-3; `--kill` too). The leader that moves a session now tells the gateway (`moved_to`), and
    tokens from another decode replica's leader move the request there as well."""
    import dataclasses
    from types import SimpleNamespace

    from meshllm.mesh.membership import Membership, PeerInfo
    from meshllm.mesh.protocol import MsgType, make
    from meshllm.roles.context import PlanContext
    from meshllm.roles.gateway import Gateway
    from meshllm.roles.route_view import Stream
    from meshllm.shapes import model_args
    from tests.test_fuzz import DEVICE, GW, MODEL, NODES, FakeTransport, Net, make_plan, node_cfg

    members = Membership("gw")
    device = dataclasses.asdict(DEVICE)
    for node in NODES:
        if node != "gw":
            members.observe(PeerInfo(node, NODES[node], "fog", device, (), 1), time.monotonic(), first_hand=True)
    gw = Gateway(FakeTransport(Net(), "gw", GW), members, PeerInfo("gw", GW, "fog", device, ("gateway",), 1),
                 node_cfg("gw"))
    gw.model.args = model_args(MODEL)
    lives = {n: 1 for n in NODES}
    gw.on_plan(PlanContext(5, make_plan(), dict(NODES), "gw", lives))
    got: list = []
    s = Stream(77, SimpleNamespace(call_soon_threadsafe=lambda f, x: f(x)), SimpleNamespace(put_nowait=got.append),
               set(), 0, 1, 3, 8)
    gw._streams[77] = s

    def tokens(src: str, index: int, **extra) -> None:
        msg = make(MsgType.TOKENS, seq=77, token_ids=[] if extra else [5], index=index, finished=False,
                   finish_reason=None, **extra)
        msg.src = src
        gw._on_tokens(msg, None)

    tokens("pa", 0)  # the first token, from the prefill leader
    tokens("dc", 1)  # decoding on replica 1, as sent
    assert s.decode_rid == 1
    tokens("dc", 2, moved_to=3)  # replica 1's leader moved the session to replica 3 and says so
    assert s.decode_rid == 3
    tokens("dc", 2, moved_to=0)  # not a decode replica: nothing moves
    tokens("dd", 2)  # not a leader: nothing moves
    assert s.decode_rid == 3
    tokens("mx", 3)  # tokens from another decode (mixed) replica's leader: it decodes there now
    assert s.decode_rid == 2
    tokens("dg", 4)
    assert s.decode_rid == 3 and [t for t, *_ in got] == [[5]] * 5
    gw.on_plan(dataclasses.replace(gw.ctx, version=6, incarnations={**lives, "dg": 2}))  # dg restarted
    assert got[-1][2] == "error" and "re-planned" in got[-1][3], got[-1]


def test_a_keepalive_from_the_replica_holds_off_the_no_token_timeout():
    """A prompt near the context limit prefills for minutes on slow devices: with no token for the
    gateway's stall timeout (60 s) the request was resumed from scratch, again and again, and
    never served (a 503 after 5 attempts). The leader's empty TOKENS at the index the gateway
    waits for (roles/leader.py, `_keepalive`) now restart that wait; silence still resumes it."""
    import asyncio

    from meshllm.mesh.membership import Membership, PeerInfo
    from meshllm.mesh.protocol import MsgType, make
    from meshllm.roles.context import PlanContext
    from meshllm.roles.gateway import Gateway
    from meshllm.roles.route_view import Stream
    from tests.test_fuzz import GW, NODES, FakeTransport, Net, make_plan, node_cfg

    gw = Gateway(FakeTransport(Net(), "gw", GW), Membership("gw"), PeerInfo("gw", GW, "fog", {}, ("gateway",), 1),
                 node_cfg("gw"))
    gw.ctx = PlanContext(5, make_plan(), dict(NODES), "gw")
    gw.model.vocab = 256
    gw.stall_s = 0.4
    resumed: list[str] = []

    async def resume(s, why: str) -> None:
        resumed.append(why)
        s.queue.put_nowait(([], True, "error", None, s.seq) if len(resumed) > 1 else ([9], True, "length", None, s.seq))

    gw._resume = resume

    def message(index: int, toks: list[int], finished: bool = False, **extra):
        msg = make(MsgType.TOKENS, seq=77, token_ids=toks, index=index, finished=finished,
                   finish_reason="length" if finished else None, **extra)
        msg.src = "pa"
        return msg

    async def run(keepalives: int) -> list:
        loop = asyncio.get_running_loop()
        s = Stream(77, loop, asyncio.Queue(), set(), 0, 1, 3, 8)
        gw._streams[77] = s
        got = []

        async def feed() -> None:
            for _ in range(keepalives):  # 1.2 s of keepalives, three times the stall timeout
                await asyncio.sleep(0.1)
                gw._on_tokens(message(0, []), None)
            gw._on_tokens(message(0, [5, 6], finished=True), None)

        feeder = asyncio.ensure_future(feed())
        async for toks, finish in gw.tokens(s):
            got.append((toks, finish))
        await feeder
        return got

    assert asyncio.run(run(12)) == [([5, 6], "length")] and resumed == []

    async def silent() -> list:  # no keepalive: the stall timeout resumes it
        s = Stream(78, asyncio.get_running_loop(), asyncio.Queue(), set(), 0, 1, 3, 8)
        return [item async for item in gw.tokens(s)]

    assert asyncio.run(silent()) == [([9], "length")] and resumed == ["no token for 0.4 s"]


def test_a_request_waiting_for_a_ready_replica_looks_again_on_news_not_at_the_next_poll(monkeypatch):
    """A request waiting for a ready replica (a new one, or one resumed after a failure) slept
    RESUME_POLL_S between looks, 0.1 s of every resume's pause on average; a plan applied or a
    peer's heartbeat saying which plan it has loaded now wakes it at once (`Gateway.wake`, from
    the I/O thread). With the poll made 60 s, only the wake can end the wait in time."""
    import asyncio

    from meshllm.roles import gateway

    monkeypatch.setattr(gateway, "RESUME_POLL_S", 60.0)
    gw = gateway.Gateway.__new__(gateway.Gateway)  # the waiting alone: no transport, no mesh
    gw._lock, gw._waiting = threading.Lock(), []

    async def wait_and_wake() -> float:
        t0 = time.monotonic()
        waiters = [asyncio.create_task(gw._until_news()) for _ in range(3)]
        while len(gw._waiting) < 3:
            await asyncio.sleep(0.01)
        threading.Thread(target=gw.wake).start()
        await asyncio.wait_for(asyncio.gather(*waiters), 30.0)
        return time.monotonic() - t0

    assert asyncio.run(wait_and_wake()) < 30.0 and gw._waiting == []
    gw.wake()  # nothing waiting: nothing to do


def gateway_with_streams():
    """A Gateway on test_fuzz's plan v5 (no sockets) whose peers are alive, and `stream(seq,
    prefill, decode, emitted)` to give it a request; what each request was told is in `got`."""
    import dataclasses
    from types import SimpleNamespace

    from meshllm.mesh.membership import Membership, PeerInfo
    from meshllm.roles.context import PlanContext
    from meshllm.roles.gateway import Gateway
    from meshllm.roles.route_view import Stream
    from meshllm.shapes import model_args
    from tests.test_fuzz import DEVICE, GW, MODEL, NODES, FakeTransport, Net, make_plan, node_cfg

    members = Membership("gw")
    device = dataclasses.asdict(DEVICE)
    gw = Gateway(FakeTransport(Net(), "gw", GW), members, PeerInfo("gw", GW, "fog", device, ("gateway",), 1),
                 node_cfg("gw"))
    gw.model.args = model_args(MODEL)
    gw.ctx = PlanContext(5, make_plan(), dict(NODES), "gw")
    now = time.monotonic()
    for node in NODES:
        if node != "gw":
            members.observe(PeerInfo(node, NODES[node], "fog", device, ("decode",), 1), now, first_hand=True)
            members.heartbeat(node, 1, now, {"plan_version": 5})
    got: dict[int, list] = {}

    def stream(seq: int, prefill: int, decode: int, emitted: int = 0) -> None:
        got[seq] = []
        gw._streams[seq] = Stream(seq, SimpleNamespace(call_soon_threadsafe=lambda f, x: f(x)),
                                  SimpleNamespace(put_nowait=got[seq].append), set(), prefill, decode, 3, 9,
                                  emitted=[7] * emitted)

    return gw, members, got, stream


def test_a_request_whose_replica_lost_a_node_resumes_at_once_and_an_unplannable_mesh_says_so():
    """The last decode-capable node died: the coordinator could plan nothing, so no PLAN came,
    and the gateway's requests on the dead node's replica waited out the 60 s no-token timeout,
    then 60 s for a replica, and failed saying "the mesh is still planning or loading" (so did new
    requests, after 15 s, and /health said "starting" for ever). Now a node seen dead resumes the
    requests on its replicas at once (a prefill replica only until the attempt's first token),
    once an attempt, and the coordinator's `planner_error` is the reason given."""
    gw, members, got, stream = gateway_with_streams()
    stream(1, 0, 1)  # prefilling on replica 0 (pa, pb) for replica 1 (dc, dd)
    stream(2, 0, 1, emitted=2)  # prefilled: replica 0 no longer matters
    stream(3, 0, 3, emitted=2)  # decoding on replica 3 (dg)
    stream(4, 2, 2)  # the mixed replica (mx)
    gw.on_deaths()
    assert all(v == [] for v in got.values()), "nobody dead: nothing happens"
    members.get("pb").last_heard -= 60
    members.get("dg").last_heard -= 60
    members.tick(time.monotonic())
    gw.on_deaths()
    gw.on_deaths()  # once an attempt
    assert [(seq, [item[3] for item in items]) for seq, items in got.items()] == [
        (1, ["node pb of its replica died"]), (2, []), (3, ["node dg of its replica died"]), (4, [])]
    assert gw.unservable() is None
    gw.local_load = lambda: {"planner_error": "cannot serve smollm2-135m: no replica reaches a positive rate"}
    assert gw.unservable() == "the mesh cannot serve now: cannot serve smollm2-135m: no replica reaches a positive rate"


def test_a_re_plan_resumes_only_requests_that_need_a_changed_replica():
    """A re-plan that changed a prefill replica resumed the requests already decoding on an
    unchanged replica too (a needless recompute and pause: the prompt's KV had left it). As on a
    death, the prefill replica counts only until the attempt's first token."""
    from meshllm.roles.context import PlanContext
    from tests.test_fuzz import NODES, make_plan

    gw, _, got, stream = gateway_with_streams()
    stream(1, 0, 1)  # prefilling on replica 0 (pa, pb) for replica 1 (dc, dd)
    stream(2, 0, 1, emitted=2)  # prefilled: replica 0 no longer matters
    stream(3, 2, 2)  # the mixed replica (mx)
    stream(4, 0, 3, emitted=1)  # decoding on replica 3 (dg), which changes too
    gw._streams[4].seq = 40  # its next attempt has begun meanwhile (a notice read s.seq outside the lock)
    moved = {**NODES, "pb": "127.0.0.1:7199", "dg": "127.0.0.1:7198"}  # pb and dg restarted elsewhere
    gw.on_plan(PlanContext(6, make_plan(), moved, "gw"))
    told = {seq: [(item[3], item[4]) for item in items] for seq, items in got.items()}
    why = "the mesh was re-planned (plan v6) while this request ran"
    assert told == {1: [(why, 1)], 2: [], 3: [], 4: [(why, 4)]}, told  # each about the attempt it was collected as


def test_news_about_an_attempt_already_resumed_costs_no_attempt_and_the_gap_runs_to_the_next_token():
    """Notices queued while a request resumed (its decode leader's death, then three re-plans
    while it waited 5 s for KV room) each resumed it again, up to MAX_ATTEMPTS; and a request
    resumed before its first token recorded its next inter-token intervals as recovery gaps
    (the stall itself never appeared). Now news about an attempt already resumed is dropped,
    and a recovery's gap runs from the last token to the next one (a resume before any token has
    none: that pause is in its TTFT)."""
    import asyncio

    from meshllm.roles.route_view import Stream

    gw, _, _, _ = gateway_with_streams()

    async def dispatch(st: Stream) -> None:  # the mesh takes the request again, as the next attempt
        st.seq += 1

    gw._dispatch = dispatch

    async def run(first_token: bool) -> tuple[Stream, list]:
        s = Stream(11, asyncio.get_running_loop(), asyncio.Queue(), set(), 0, 1, 3, 9)
        got, tokens = [], gw.tokens(s)
        if first_token:
            s.queue.put_nowait(([4], False, None, None, 11))
            got.append(await tokens.__anext__())
            s.emitted.append(4)  # (what _on_tokens commits)
            await asyncio.sleep(0.2)
        for why in ("node dc of its replica died", "the mesh was re-planned (plan v6) while this request ran",
                    "the mesh was re-planned (plan v7) while this request ran"):
            gw._fail(s, why)  # all about attempt 11
        await asyncio.sleep(0)
        s.queue.put_nowait(([5], False, None, None, 12))
        s.queue.put_nowait(([6], True, "stop", None, 12))
        return s, got + [t async for t in tokens]

    s, got = asyncio.run(run(True))
    assert got == [([4], None), ([5], None), ([6], "stop")] and s.attempts == 2, (got, s.attempts)
    assert len(s.gaps_ms) == 1 and s.gaps_ms[0] >= 200, s.gaps_ms  # from token 4 to token 5
    s, got = asyncio.run(run(False))
    assert got == [([5], None), ([6], "stop")] and s.attempts == 2 and s.gaps_ms == [], (got, s.attempts, s.gaps_ms)


def test_a_resumed_request_keeps_the_drafting_figures_of_its_ended_attempts():
    """A request resumed on another replica reported only its last attempt's drafting figures (in
    its `meshllm.spec`, /metrics and `--cluster --json`): each leader sends its session's figures
    so far, and the gateway took the newest as the request's."""
    import asyncio

    from meshllm.mesh.protocol import MsgType, make
    from meshllm.roles.route_view import Stream

    gw, _, _, _ = gateway_with_streams()

    async def dispatch(st: Stream) -> None:  # the mesh takes the request again, as the next attempt
        with gw._lock:
            gw._streams.pop(st.seq, None)
            st.seq += 1
            gw._streams[st.seq] = st

    gw._dispatch = dispatch

    def figures(drafted: int, accepted: int, blocks: int) -> dict:
        return {"drafted": drafted, "accepted": accepted, "blocks": blocks, "per_position": {"1": accepted},
                "offered": {"1": blocks}, "gamma_histogram": {"4": blocks}, "ahead_blocks": 0, "stale_blocks": 0}

    def tokens(seq: int, index: int, ids: list[int], spec: dict, finished: bool = False):
        return make(MsgType.TOKENS, seq=seq, token_ids=ids, index=index, finished=finished,
                    finish_reason="stop" if finished else None, queue_ms=0.0, spec=spec)

    async def run() -> Stream:
        s = Stream(21, asyncio.get_running_loop(), asyncio.Queue(), set(), 0, 1, 3, 9)
        gw._streams[21] = s
        out = gw.tokens(s)
        gw._on_tokens(tokens(21, 0, [4, 5], figures(8, 1, 2)), None)
        assert (await out.__anext__())[0] == [4, 5]
        gw._on_tokens(tokens(21, 2, [6], figures(12, 2, 3)), None)  # the attempt's figures so far
        assert (await out.__anext__())[0] == [6] and s.emitted == [4, 5, 6]
        gw._fail(s, "node dc of its replica died")

        async def rest() -> list:
            return [t async for t in out]
        resumed = asyncio.ensure_future(rest())  # the client reads on: the gateway resumes the request
        while s.seq == 21:
            await asyncio.sleep(0.01)
        gw._on_tokens(tokens(22, 3, [7, 8], figures(4, 3, 1), finished=True), None)
        assert await resumed == [([7, 8], "stop")]
        return s

    s = asyncio.run(asyncio.wait_for(run(), 30))
    assert s.attempts == 2 and s.spec is not None, s
    assert (s.spec["drafted"], s.spec["accepted"], s.spec["blocks"]) == (16, 5, 4), s.spec
    assert s.spec["gamma_histogram"] == {"4": 4} and s.spec["per_position"] == {"1": 5}, s.spec


def test_a_kv_reservation_at_a_leader_seen_dead_fails_at_once():
    """A request routed to a decode replica whose leader had just died (not yet seen dead) waited
    RESERVE_TIMEOUT_S (x time_scale: 10 s at time_scale 2) for an answer that could not come,
    after its peers had seen the death; now it fails the attempt once the leader is seen dead."""
    import asyncio

    from meshllm.roles.kv_book import RESERVE_TIMEOUT_S
    from meshllm.roles.route_view import RequestError, Stream

    gw, members, _, _ = gateway_with_streams()

    def no_answer(address, msg, timeout_s):  # the leader's process is gone: nothing answers
        time.sleep(min(timeout_s, RESERVE_TIMEOUT_S))
        raise TimeoutError(f"no reply from {address} within {timeout_s:g} s")

    gw.t.request = no_answer
    members.get("dc").last_heard -= 60  # replica 1's leader
    members.tick(time.monotonic())

    async def reserve() -> str:
        s = Stream(11, asyncio.get_running_loop(), asyncio.Queue(), set(), 0, 1, 3, 9, kv_charge=12)
        with pytest.raises(RequestError) as e:
            await gw.kv.reserve(s, gw.ctx.leader(1), gw.ctx.version)
        return str(e.value)

    assert asyncio.run(reserve()) == "replica 1's leader dc died"
    gw.kv.ask_pool.shutdown(wait=False)


def test_drafting_figures_that_are_not_finite_or_are_negative_are_left_out_not_a_crash():
    """A leader's figures are another node's input: msgpack carries a float infinity, which int()
    refused with OverflowError, which neither `summed` (each TOKENS of a resumed request) nor the
    count at the finish caught, nor did a negative count, which a Prometheus counter refuses later
    in close_stream: the handler crashed and the stream's leaders were never released."""
    from meshllm.roles.metrics import GatewayMetrics, summed

    good = {"drafted": 4, "accepted": 2, "blocks": 1}
    for bad in ({"drafted": float("inf")}, {"blocks": -1}, {"gamma_histogram": {"4": float("nan")}},
                {"per_position": {"1": -2}}):
        assert summed(good, bad) is bad  # the current attempt's own, as for any malformed figures
        m = GatewayMetrics()
        m.finished("ok", bad)  # not counted, with a warning
        assert m.spec.drafted == 0 and m.spec.blocks == 0


def test_a_wait_cancelled_in_the_step_its_token_comes_is_cancelled():
    """aiohttp cancels a handler once, when its client leaves. asyncio.wait_for (Python < 3.12,
    CPython gh-86296) dropped that cancellation when a token came in the same step, so a
    non-streamed request whose client had left ran to max_tokens for nobody, holding its slot, and
    counted "ok". The gateway's waits (`within`) pass the cancellation on, and time out as before."""
    import asyncio

    from meshllm.roles.gateway import within

    async def main() -> tuple[bool, list]:
        q: asyncio.Queue = asyncio.Queue()
        got: list = []

        async def handler() -> None:
            got.append(await within(q.get(), 10.0))
            got.append("ran on")  # what a swallowed cancellation did

        task = asyncio.ensure_future(handler())
        await asyncio.sleep(0)  # the handler waits for its token
        q.put_nowait("token")
        task.cancel()  # the client left, in the same step
        await asyncio.gather(task, return_exceptions=True)
        with pytest.raises(asyncio.TimeoutError):
            await within(q.get(), 0.01)
        assert await within(asyncio.sleep(0, "now"), 1.0) == "now"
        return task.cancelled(), got

    cancelled, got = asyncio.run(main())
    assert cancelled and "ran on" not in got
