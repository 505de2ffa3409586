"""The workload client of `--cluster` (meshllm/workload.py) against fake gateways on 127.0.0.1, in
this process and in well under a second each: gateways that stream a fixed answer token by token,
die mid-stream (kill -9: the stream cut, the port closed), come back on the same port (a
restart), or were never there (connection refused). What is checked is what the client makes of
it: the request survives, goes on after the tokens it has, and its ITL, resumes and recovery gaps
are counted as the README defines them."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time

import pytest

from meshllm import workload
from meshllm.workload import Job, Outcome, Unreachable, recovery_figures, run_jobs

ANSWER = list(range(100, 112))  # the token ids every fake gateway answers with (greedy: always the same)


def free_port() -> int:
    """A port nothing listens on (a gateway that is dead: connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeGateway:
    """The streaming half of a gateway's OpenAI API in a thread of its own: ANSWER's tokens after
    those the request resumes from (`meshllm.resume_token_ids`), an event every `every_s`.
    `die_after`: its first stream is cut after that many tokens and its port closed (kill -9);
    `back_after_s`: it listens on the same port again that much later (a restart)."""

    def __init__(self, die_after: int | None = None, back_after_s: float | None = None, every_s: float = 0.01):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.die_after, self.back_after_s, self.every_s = die_after, back_after_s, every_s
        self.bodies: list[dict] = []  # every request's body, in order
        self.loop = asyncio.new_event_loop()
        self.server: asyncio.Server | None = None
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._listen(), self.loop).result(10)

    async def _listen(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    def _die(self, writer: asyncio.StreamWriter) -> None:
        self.server.close()  # refused from now on
        writer.transport.abort()  # the stream cut mid-body (a reset)
        if self.back_after_s is not None:
            self.loop.call_later(self.back_after_s, lambda: self.loop.create_task(self._listen()))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        body = json.loads(await reader.readexactly(int(re.search(rb"(?i)content-length: *(\d+)", head)[1])))
        self.bodies.append(body)
        have = (body.get("meshllm") or {}).get("resume_token_ids", [])
        assert have == ANSWER[:len(have)], have
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                     b"Connection: close\r\n\r\n")
        for j in range(len(have), len(ANSWER)):
            if j == self.die_after:
                self.die_after = None
                return self._die(writer)
            end = "length" if j == len(ANSWER) - 1 else None
            ev = {"choices": [{"index": 0, "text": f" {ANSWER[j]}", "token_ids": [ANSWER[j]], "finish_reason": end}]}
            self._chunk(writer, f"data: {json.dumps(ev)}\n\n")
            await writer.drain()
            await asyncio.sleep(self.every_s)
        self._chunk(writer, "data: [DONE]\n\n")
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    @staticmethod
    def _chunk(writer: asyncio.StreamWriter, text: str) -> None:
        data = text.encode()
        writer.write(b"%x\r\n%s\r\n" % (len(data), data))

    def close(self) -> None:
        if self.server is not None:
            self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture
def gateways():
    made: list[FakeGateway] = []

    def make(**kw) -> FakeGateway:
        made.append(FakeGateway(**kw))
        return made[-1]

    yield make
    for g in made:
        g.close()


def send(urls: str | list[str]) -> Outcome:
    (out,) = run_jobs(urls, "m", [Job("p", len(ANSWER))], progress=False)
    return out


# defect 1: a gateway restart while no other gateway is reachable lost every request in flight


def test_a_request_outlives_the_restart_of_its_only_gateway(gateways):
    """One gateway, restarted mid-stream: the request used to fail at once (a cut stream, no
    other gateway: ClientPayloadError); now it waits until the gateway listens again and goes on
    there after the tokens it has."""
    gw = gateways(die_after=4, back_after_s=0.6)
    out = send(gw.url)
    assert out.error is None, out.error
    assert out.token_ids == ANSWER and out.finish_reason == "length"
    assert gw.bodies[-1]["meshllm"]["resume_token_ids"] == ANSWER[:4]  # resumed, not sent whole
    assert out.attempts == 2 and out.resumed_after == [4], out.to_json()
    assert len(out.recovery_gaps_ms) == 1 and out.recovery_gaps_ms[0] >= 600, out.recovery_gaps_ms


def test_a_request_waits_for_a_restarted_gateway_while_the_other_is_dead(gateways):
    """`--kill fog-1@1 --restart fog-4@3` on failure.yaml: the first gateway dead, the second
    restarted. The request spent its four tries on the two refusing ports within a millisecond
    and failed; refused connections now use up none of them, and it waits for the restart."""
    dead, gw = f"http://127.0.0.1:{free_port()}", gateways(die_after=5, back_after_s=0.8)
    t0 = time.monotonic()
    out = send([dead, gw.url])
    assert out.error is None, out.error
    assert out.token_ids == ANSWER
    assert out.attempts == 2 and out.resumed_after == [5], out.to_json()  # the refusals were no failover
    assert time.monotonic() - t0 >= 0.8


def test_a_request_gives_up_when_no_gateway_comes_back(gateways, monkeypatch):
    """Bounded: with no gateway listening again, the request fails after UNREACHABLE_S (x
    time_scale) of waiting, with the tokens it had and a word why."""
    monkeypatch.setattr(workload, "UNREACHABLE_S", 1.0)
    dead, gw = f"http://127.0.0.1:{free_port()}", gateways(die_after=2)
    t0 = time.monotonic()
    out = send([gw.url, dead])
    assert out.error is not None and "no gateway answered" in out.error, out.error
    assert out.token_ids == ANSWER[:2]
    assert 0.7 <= time.monotonic() - t0 < 5


def test_the_wait_for_a_gateway_backs_off_scaled_and_bounded(monkeypatch):
    """A round of refusals (every gateway once) is followed by a wait: 0.25 s doubling to 2 s, x
    time_scale; the waits of a spell end at UNREACHABLE_S x time_scale and before the deadline."""
    slept: list[float] = []

    async def fake_sleep(s: float) -> None:
        slept.append(s)

    monkeypatch.setattr(workload.asyncio, "sleep", fake_sleep)

    async def tries(n_urls: int, scale: float, deadline_s: float) -> int:
        w, n = Unreachable(n_urls, scale, time.monotonic() + deadline_s), 0
        while await w.refused(0, "http://127.0.0.1:1"):
            n += 1
            assert n < 10_000, "unbounded"
        return n + 1

    n = asyncio.run(tries(2, 3.0, 1e6))
    assert slept[:5] == [0.75, 1.5, 3.0, 6.0, 6.0] and len(slept) == n // 2 - 1, (n, slept)
    assert sum(slept) <= workload.UNREACHABLE_S * 3 < sum(slept) + 6.0
    slept.clear()
    asyncio.run(tries(1, 1.0, 2.0))  # the request's deadline comes first
    assert slept == [0.25, 0.5, 1.0], slept


# defect 2: ITL left out the pause at a client failover to another gateway


def test_itl_has_every_gap_the_failover_pause_included(gateways):
    """`--kill fog-1@2` on failure.yaml: request 0 had 30 tokens and 28 ITL entries (the gap
    across the failover to fog-4 was left out). Now tokens - 1 gaps, that one its recovery gap."""
    first, second = gateways(die_after=5, every_s=0.02), gateways()
    out = send([first.url, second.url])
    assert out.error is None and out.token_ids == ANSWER, out.to_json()
    assert out.resumed_after == [5] and len(out.recovery_gaps_ms) == 1
    assert len(out.itl_ms) == len(out.token_ids) - 1, out.itl_ms
    assert out.itl_ms[4] == out.recovery_gaps_ms[0], (out.itl_ms, out.recovery_gaps_ms)


# defect 3: requests that never started, or failed, were counted resumed and in the recovery gaps


def test_a_request_without_output_is_sent_again_not_resumed(gateways):
    """Refused by a dead gateway, or cut before its first token: sent again whole to the next
    gateway. It was counted resumed (attempts 2, resumed_after_tokens [0]) with a "recovery gap"
    equal to its TTFT; the README counts a request resumed when it goes on after output it has."""
    dead, cut, live = f"http://127.0.0.1:{free_port()}", gateways(die_after=0), gateways()
    for urls in ([dead, live.url], [cut.url, live.url]):
        out = send(urls)
        assert out.error is None and out.token_ids == ANSWER, out.to_json()
        assert out.attempts == 1 and out.resumed_after == [] and out.recovery_gaps_ms == [], out.to_json()
        assert "attempts" not in out.to_json() and "resumed_after_tokens" not in out.to_json()
        assert len(out.itl_ms) == len(ANSWER) - 1
    assert "meshllm" not in live.bodies[-1], "nothing to resume from"


def test_recovery_figures_come_from_the_requests_that_completed():
    """With 9 of 9 requests failed the report said resumed_requests 9, recovery_gap_ms_max 495."""
    failed = Outcome("p", token_ids=[1, 2], attempts=3, recovery_gaps_ms=[495.0], error="ClientConnectorError")
    done = Outcome("p", token_ids=[1, 2, 3], attempts=2, recovery_gaps_ms=[120.0], finish_reason="length")
    plain = Outcome("p", token_ids=[1, 2, 3], finish_reason="length")
    assert recovery_figures([failed, done, plain]) == {"resumed_requests": 1, "recovery_gap_ms_max": 120.0}
    assert recovery_figures([failed]) == {"resumed_requests": 0, "recovery_gap_ms_max": None}


def test_the_speculation_metrics_have_the_same_keys_null_without_speculation():
    """README: the speculation fields are null when it is off; three of them were missing."""
    on = workload.speculation([{"drafted": 8, "accepted": 5, "blocks": 2, "per_position": {"0": 2, "1": 2, "2": 1},
                                "offered": {"0": 2, "1": 2, "2": 2, "3": 2}, "gamma_histogram": {"4": 2}}])
    assert on["acceptance_by_position"] and on["draft_blocks"] == 2
    off = workload.speculation([])
    assert set(off) == set(on) and all(v is None for v in off.values())
