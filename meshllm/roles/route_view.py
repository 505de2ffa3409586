"""What a gateway knows of its requests and of the replicas it routes them to: `Stream`, one
request followed across its attempts; `RouterView`, the plan's replicas as the simulator's
router sees them (meshllm/sim/router.py), with what this gateway has in flight on each and the
KV it has shipped between them; `RequestError`, a request the mesh cannot serve now.
roles/gateway.py moves requests through the mesh with them."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

from meshllm.defaults import DECODE_TARGETS
from meshllm.roles.batcher import MAX_ACTIVE_SEQS
from meshllm.sim.ports import PortBook
from meshllm.sim.replica import SimReplica
from meshllm.sim.router import ReplicaLoad, Router

ROUTERS_KEPT = 64  # routers (one per set of ready replicas) a RouterView keeps until the next plan


PIN_GONE = "replica_not_in_plan"  # RequestError code: a request pinned to a replica the plan lacks


class RequestError(Exception):
    """A request the mesh cannot serve now (no replica ready, mesh re-planned, stalled); `code`:
    the API error's code ("shutting_down": this gateway is stopping, another one can take it)."""

    def __init__(self, message: str, code: str = "unavailable"):
        super().__init__(message)
        self.code = code


@dataclass
class Stream:
    """One request as the gateway follows it, across every attempt (a failed replica's requests
    resume on the new plan from their committed tokens)."""

    seq: int
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    leaders: set[str]  # addresses of the leaders that may hold it (for RELEASE)
    prefill_rid: int
    decode_rid: int
    n_in: int
    n_out: int
    prompt: list[int] = field(default_factory=list)
    settings: dict = field(default_factory=dict)  # sampling, speculation: what an attempt needs
    emitted: list[int] = field(default_factory=list)  # committed output so far, in order
    attempts: int = 1
    gaps_ms: list[float] = field(default_factory=list)  # recovery gaps of resumed attempts
    last_token_at: float | None = None
    gap_from: float | None = None  # a resume's pause began here (its last token, or its start): until the next token
    started: float = field(default_factory=time.monotonic)
    next_index: int = 0
    offset_at_dispatch: int = 0  # output tokens committed when the current attempt started
    pending: dict[int, tuple[list[int], bool, str | None]] = field(default_factory=dict)
    first_at: float | None = None
    queue_ms: float = 0.0
    spec: dict | None = None  # the request's acceptance figures (speculative decoding), every attempt's
    spec_before: dict | None = None  # those of its attempts before the current one (a resume starts afresh)
    drafter: str = ""
    kv_charge: int = 0  # KV positions its attempt may come to on its decode replica (roles/batcher.py)
    dead_seen: int = 0  # the attempt (seq) already told that a node of its replicas died (Gateway.on_deaths)

    def replicas(self) -> set[int]:
        """The replicas its attempt still needs: the decode replica, and the prefill replica until
        the attempt's first token (then the prompt's KV has gone to the decode replica)."""
        prefilled = len(self.emitted) > self.offset_at_dispatch
        return {self.decode_rid} if prefilled else {self.prefill_rid, self.decode_rid}


def kv_fit(ready: set[int], roles: dict[int, str], left: dict[int, int], positions: int,
           rooms: dict[int, int] | None = None) -> set[int]:
    """The ready replicas to route a request among whose decode needs `positions` KV positions: a
    decode or mixed replica whose KV room left (`left`: its leader's figure less the requests it
    holds) cannot hold that is left out while another decode or mixed replica can (there it would
    wait at the leader for the room). When none can, one holding no request (its room left is its
    whole room, `rooms`) takes it: a request larger than every room runs there alone, at once."""
    rooms = rooms or {}
    for holds in (lambda rid: left.get(rid, positions) >= positions, lambda rid: left.get(rid) == rooms.get(rid)):
        fits = {rid for rid in ready if roles.get(rid) not in DECODE_TARGETS or holds(rid)}
        if any(roles.get(rid) in DECODE_TARGETS for rid in fits):
            return fits
    return ready


class RouterView:
    """What the gateway's router knows of the plan's replicas: their timing (`reps`), what this
    gateway has in flight on each (`loads`, kept by `book`), and the KV it has shipped between
    them, booked on a model of the plan's ports (`ship`). Thread-safe: requests are routed from
    the HTTP thread, tokens booked from the I/O thread."""

    def __init__(self, time_scale: float = 1.0):
        self.time_scale = time_scale
        self.reps: dict[int, SimReplica] = {}  # the plan's replicas as the router sees them
        self.ports: PortBook | None = None  # the KV this gateway's requests ship, booked on the plan's ports
        self.loads: dict[int, ReplicaLoad] = {}  # replica -> what this gateway has in flight there
        self._decoding: dict[int, int] = {}  # decode replica -> this gateway's sequences decoding there
        self._routed: dict[int, int] = {}  # decode replica -> sequences routed there, still prefilling elsewhere
        self._routers: dict[tuple[int, ...], Router] = {}  # ready replicas -> their router (its KV flows cached)
        self._lock = threading.Lock()

    def replan(self, reps: dict[int, SimReplica], inp, keep: set[int]) -> None:
        """A new plan: its replicas; what is in flight on those in `keep` (unchanged) is kept."""
        with self._lock:
            self.reps, self.ports, self._routers = reps, PortBook(inp.net), {}
            self.loads = {rid: self.loads[rid] if rid in keep and rid in self.loads else
                          ReplicaLoad(max_batch=max(1, min(r.max_batch(), MAX_ACTIVE_SEQS))) for rid, r in reps.items()}
            self._decoding = {rid: n for rid, n in self._decoding.items() if rid in keep}
            self._routed = {rid: n for rid, n in self._routed.items() if rid in keep}

    def clock(self) -> float:
        """The router's clock: emulated device seconds."""
        return time.monotonic() / self.time_scale

    def route(self, ready: set[int], n_in: int, n_out: int, pin: int | None = None) -> tuple[int, int]:
        """(prefill replica, decode replica) for a request, by the simulator's earliest-finish
        router over the `ready` replicas; the same id twice for a mixed replica. `pin` asks for a
        decode replica (operators, benchmarks); it must be a ready decode or mixed replica."""
        with self._lock:
            if pin is not None and (pin not in ready or self.reps.get(pin) is None
                                    or self.reps[pin].role not in DECODE_TARGETS):
                raise RequestError(f"decode replica {pin} is not a ready decode replica of this plan")
            reps = [r for rid, r in self.reps.items() if rid in ready]
            if pin is not None and self.reps[pin].role == "mixed":
                return pin, pin
            if pin is not None and any(r.role == "prefill" for r in reps):
                # a pinned decode replica takes its prompts from a prefill replica; with none ready
                # (its node restarting) a mixed one prefills and ships, rather than the request waiting
                reps = [r for r in reps if r.role != "mixed"]
            if not any(r.role in DECODE_TARGETS for r in reps):
                reps = []  # a prefill replica needs a decode (or mixed) one to ship to
            if not any(r.role in ("prefill", "mixed") for r in reps):
                raise RequestError("no replica is ready (the mesh is still planning or loading)")
            router = self.router_for(reps)
            now = self.clock()
            pre = router.pick_prefill(self.loads, n_in, n_out, now)
            if pin is not None:
                return pre, pin
            if router.reps[pre].role == "mixed":
                return pre, pre
            return pre, router.pick_decode(pre, self.loads, n_in, n_out, now)

    def ship(self, s: Stream) -> None:
        """A sequence prefilled on another replica has its first token: its prompt's KV leaves the
        prefill replica's stages now. Book it on the ports, as the simulator does, so that the next
        requests see the decode replica's ports busy (until now it counted as promised KV)."""
        with self._lock:
            src, dst = self.reps.get(s.prefill_rid), self.reps.get(s.decode_rid)
            if src is None or dst is None or src is dst:
                return
            flows = self.router_for(list(self.reps.values())).kv_flows(src, dst, s.n_in)
            self.ports.transfers(flows, self.clock(), commit=True)

    def router_for(self, reps: list[SimReplica]) -> Router:
        """The router over `reps` (some of the plan's replicas), on this plan's ports: kept per set
        of replicas until the next plan, so its per-pair KV flows are worked out once, not per
        request (a 12-stage pipeline shipping to a 30-stage one has 41 flows a pair). The caller
        holds the lock."""
        key = tuple(r.id for r in reps)
        got = self._routers.get(key)
        if got is None:
            if len(self._routers) >= ROUTERS_KEPT:  # ready sets come and go with failures: bounded
                self._routers.clear()
            got = self._routers[key] = Router(reps, self.ports)
        return got

    def book(self, s: Stream, phase: str, sign: int) -> None:
        """Keep the router's view: prompts queued for prefill, sequences decoding (and their
        remaining tokens), per replica. A sequence prefilled on another replica counts in its
        decode replica's `waiting` from the moment it is routed there, and its prompt's KV in that
        replica's `kv_pending_tokens` (its ports will receive it) and in its prefill replica's
        `kv_unshipped_tokens` (its ports will send it) until its first token, so requests routed
        while it prefills do not all pick the same decode replica, nor a prefill replica whose
        ports have more KV to send than it can (the simulator does the same)."""
        with self._lock:
            pre, dec = self.loads.get(s.prefill_rid), self.loads.get(s.decode_rid)
            if phase == "prefill":
                if pre is not None and s.prefill_rid in self.reps:
                    occupancy = self.reps[s.prefill_rid].prefill_s(s.n_in)[0]
                    pre.prefill_queued_s = max(0.0, pre.prefill_queued_s + sign * occupancy)
                    pre.prefill_queued = max(0, pre.prefill_queued + sign)  # a mixed replica's score needs these
                    pre.prefill_queued_tokens = max(0, pre.prefill_queued_tokens + sign * s.n_in)
                if dec is not None and s.decode_rid != s.prefill_rid:
                    self._routed[s.decode_rid] = max(0, self._routed.get(s.decode_rid, 0) + sign)
                    dec.kv_pending_tokens = max(0, dec.kv_pending_tokens + sign * s.n_in)  # its KV is still to come
                    if pre is not None:  # ... out of the prefill replica's ports
                        pre.kv_unshipped_tokens = max(0, pre.kv_unshipped_tokens + sign * s.n_in)
            elif phase == "decode" and dec is not None:
                self._decoding[s.decode_rid] = self._decoding.get(s.decode_rid, 0) + sign
                dec.tokens_left = s.n_out / 2  # mean remaining of a sequence in the batch
            if dec is not None:
                n = self._decoding.get(s.decode_rid, 0)
                dec.active = min(n, dec.max_batch)
                dec.waiting = max(0, n - dec.max_batch) + self._routed.get(s.decode_rid, 0)
