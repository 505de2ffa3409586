"""Discrete-event simulator of serving a workload on a plan, and the policy comparison.

Model (one heap of timed events):
- Requests arrive as a Poisson process (rate 0: all at t=0) with input/output lengths drawn
  from the workload's distributions (sweep.py). Every policy sees the same trace.
- Router (same for all policies): a request goes to the prefill replica with the earliest
  estimated finish (queued work + its own prefill + the time its ports need to ship the KV);
  a finished prefill goes to the decode replica with the earliest estimated finish (KV
  transfer over the ports as they are booked now + decode backlog + its own decode).
- Prefill replicas are pipelines: a prompt may enter every `occupancy` seconds (bottleneck
  stage) and finishes after `latency`; the first output token comes out of the prefill.
  Back-pressure: a prefill replica starts no prompt while its finished-but-unsent KV would
  overflow its memory (KV of prompts still in the pipeline is covered by the DP's KV budget).
- KV shipping: every prefill stage sends the KV of its layers to the decode stages holding
  them. Each device's port (`network_mbps`) is a FIFO server shared by all its transfers, in
  and out; a transfer takes bytes / port rate on the sender's and on the receiver's port,
  each queued independently (the switch buffers), is no faster than bytes / zone-link rate
  (a per-flow limit), and is complete when all of these are done, plus rtt/2.
- Decode replicas batch at iteration level (Orca): sequences join at iteration boundaries up
  to the memory-limited batch; an iteration costs `decode_iter_s(batch, mean context)`.
  Runs of iterations are one event, cut short when a request could join.
- Mixed replicas (memory-ring, or a plan without a prefill/decode pair) run queued prefills
  first at each iteration boundary (vLLM's default), pausing their decodes.
- Waiting time (BRIEF): prefill queue + port queueing + waiting for a decode slot + decode
  pauses for other requests' prefills. Prefill wait: before the prefill starts.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from meshllm.partition.cost import transfer_s
from meshllm.sim.replica import SimReplica


@dataclass
class Request:
    rid: int
    arrival: float
    n_in: int
    n_out: int
    prefill_start: float = math.nan
    first_token: float = math.nan
    kv_ready: float = math.nan
    decode_start: float = math.nan  # admitted to a decode batch
    done: float = math.nan
    wait_s: float = 0.0
    paused_s: float = 0.0  # part of wait_s: decode paused by other requests' prefills (mixed)


@dataclass
class RepState:
    rep: SimReplica
    max_batch: int
    kv_cap: float
    queue: deque = field(default_factory=deque)  # prompts waiting for prefill
    waiting: deque = field(default_factory=deque)  # KV arrived, waiting for a decode slot
    active: list = field(default_factory=list)  # [request, tokens left]
    next_start: float = 0.0  # prefill pipeline: earliest entry of the next prompt
    queued_occ: float = 0.0
    pending_kv: float = 0.0  # tokens of prefilled KV not yet shipped
    busy: bool = False
    chunk: tuple = ()  # (start, step, iterations) of the decode run in flight
    version: int = 0


class PortBook:
    """Every device's network port as a FIFO server (seconds booked up to `free[node]`)."""

    def __init__(self, mc):
        self.mc = mc
        self.free: dict[str, float] = {}  # node -> when its port's queued transfers end
        self._routes: dict[tuple, list] = {}

    def routes(self, src: SimReplica, dst: SimReplica) -> list[tuple]:
        """KV transfers src -> dst: (from, to, bytes per token, s/byte on each port, s/byte on
        the zone link, rtt/2 seconds). Cached per replica pair."""
        key = (src.id, dst.id)
        got = self._routes.get(key)
        if got is None:
            got = []
            for (ms, (a, b)) in zip(src.members, src.ranges()):
                for (md, (c, e)) in zip(dst.members, dst.ranges()):
                    overlap = min(b, e) - max(a, c)
                    if overlap <= 0 or ms.id == md.id:
                        continue
                    rtt, link = src.inp.net.rtt_mbps(ms.zone, md.zone)
                    got.append((ms.id, md.id, overlap * self.mc.kv_bytes_per_token, transfer_s(1, ms.device.network_mbps),
                                transfer_s(1, md.device.network_mbps), transfer_s(1, link) if link else 0.0,
                                rtt / 2000.0))
            self._routes[key] = got
        return got

    def ship(self, src: SimReplica, dst: SimReplica, tokens: int, now: float, commit: bool) -> tuple[float, float]:
        """Queue the KV transfers (booked only if `commit`); returns (end, end had no other
        transfer been queued; computed only if `commit`)."""
        booked: dict[str, float] = {}
        alone: dict[str, float] = {}
        end = ideal = now
        for a, b, per_token, s_a, s_b, s_link, half_rtt in self.routes(src, dst):
            nbytes = per_token * tokens
            floor = now + nbytes * s_link + half_rtt
            t = max(self.book(booked, a, nbytes * s_a, now), self.book(booked, b, nbytes * s_b, now))
            end = max(end, t + half_rtt, floor)
            if commit:
                t = max(self.book(alone, a, nbytes * s_a, now, False), self.book(alone, b, nbytes * s_b, now, False))
                ideal = max(ideal, t + half_rtt, floor)
        if commit:
            self.free.update(booked)
        return end, ideal

    def book(self, overlay: dict, node: str, serial: float, now: float, shared: bool = True) -> float:
        """Queue `serial` seconds on `node`'s port in `overlay` (over the real bookings if
        `shared`); returns when that slice ends."""
        busy = overlay.get(node, self.free.get(node, 0.0) if shared else 0.0)
        overlay[node] = end = max(now, busy) + serial
        return end

    def wait_s(self, node: str, now: float) -> float:
        return max(self.free.get(node, 0.0) - now, 0.0)


class Router:
    """Earliest estimated finish, the same for every policy (only the plan differs)."""

    def __init__(self, ports: PortBook):
        self.ports = ports

    def prefill_estimate(self, st: RepState, req: Request, now: float) -> float:
        """Queue + own prefill + shipping its KV out of this replica's ports (or, on a mixed
        replica, + its decode)."""
        occ, lat = st.rep.prefill_s(req.n_in)
        start = max(now, st.next_start) + st.queued_occ
        if st.rep.role == "mixed":
            return start + lat + self.backlog_s(st, req)
        kv = self.ports.mc.kv_bytes_per_token * req.n_in
        ship = max(self.ports.wait_s(m.id, now) + transfer_s(n * kv, m.device.network_mbps)
                   for m, n in zip(st.rep.members, st.rep.counts))
        return start + lat + ship

    def decode_estimate(self, src: RepState, dst: RepState, req: Request, now: float) -> float:
        end, _ = self.ports.ship(src.rep, dst.rep, req.n_in, now, commit=False)
        return end + self.backlog_s(dst, req)

    @staticmethod
    def backlog_s(st: RepState, req: Request) -> float:
        """Estimated time until `req` finishes decoding on `st` if it joined now."""
        ctx = st.rep.inp.mix.mean_in + st.rep.inp.mix.mean_out / 2
        load = len(st.active) + len(st.waiting) + 1
        step = st.rep.decode_iter_s(min(load, st.max_batch), ctx)
        left = sum(x[1] for x in st.active) / max(1, len(st.active))
        queued = max(0, load - st.max_batch) / st.max_batch * left
        return (queued + req.n_out) * step


class Simulator:
    def __init__(self, reps: Sequence[SimReplica], requests: Sequence[Request]):
        self.heap: list = []
        self.seq = 0
        self.now = 0.0
        self.states = [RepState(r, max(1, r.max_batch()), r.kv_capacity_tokens()) for r in reps]
        self.pre = [s for s in self.states if s.rep.role in ("prefill", "mixed")]
        self.dec = [s for s in self.states if s.rep.role == "decode"]
        self.ports = PortBook(reps[0].inp.mc if reps else None)
        self.router = Router(self.ports)
        self.requests = list(requests)
        for r in self.requests:
            self.push(r.arrival, self.on_arrival, r)

    def push(self, t: float, fn, *args) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, fn, args))

    def run(self, max_events: int = 5_000_000) -> list[Request]:
        for _ in range(max_events):
            if not self.heap:
                return self.requests
            self.now, _, fn, args = heapq.heappop(self.heap)
            fn(*args)
        raise RuntimeError(f"simulation did not finish within {max_events} events")

    # -- prefill ------------------------------------------------------------------------------
    def on_arrival(self, req: Request) -> None:
        st = min(self.pre, key=lambda s: (self.router.prefill_estimate(s, req, self.now), s.rep.id))
        st.queue.append(req)
        st.queued_occ += st.rep.prefill_s(req.n_in)[0]
        self.kick(st)

    def kick(self, st: RepState) -> None:
        if st.rep.role == "prefill":
            self.try_prefill(st)
        else:
            self.try_iterate(st)

    def try_prefill(self, st: RepState) -> None:
        if not st.queue or self.now < st.next_start:
            return
        req = st.queue[0]
        if st.pending_kv > 0 and st.pending_kv + req.n_in > st.kv_cap:
            return  # back-pressure: wait for KV to leave (on_kv_sent kicks again)
        st.queue.popleft()
        occ, lat = st.rep.prefill_s(req.n_in)
        st.queued_occ -= occ
        req.prefill_start = self.now
        req.wait_s += self.now - req.arrival
        st.next_start = self.now + occ
        self.push(self.now + occ, self.try_prefill, st)
        self.push(self.now + lat, self.on_prefilled, st, req)

    def on_prefilled(self, st: RepState, req: Request) -> None:
        req.first_token = self.now
        if req.n_out <= 1:
            req.done = req.decode_start = self.now
            self.try_prefill(st)
            return
        dst = min(self.dec, key=lambda d: (self.router.decode_estimate(st, d, req, self.now), d.rep.id))
        st.pending_kv += req.n_in
        end, ideal = self.ports.ship(st.rep, dst.rep, req.n_in, self.now, commit=True)
        req.wait_s += end - ideal
        self.push(end, self.on_kv_sent, st, dst, req)

    def on_kv_sent(self, src: RepState, dst: RepState, req: Request) -> None:
        src.pending_kv -= req.n_in
        req.kv_ready = self.now
        dst.waiting.append(req)
        self.try_prefill(src)
        self.try_iterate(dst)

    # -- decode -------------------------------------------------------------------------------
    def try_iterate(self, st: RepState) -> None:
        if st.busy:
            if len(st.active) < st.max_batch and (st.waiting or st.queue):
                self.cut_chunk(st)
            return
        while st.waiting and len(st.active) < st.max_batch:
            req = st.waiting.popleft()
            req.wait_s += self.now - req.kv_ready
            req.decode_start = self.now
            st.active.append([req, req.n_out - 1])
        if st.rep.role == "mixed" and st.queue and len(st.active) < st.max_batch:
            self.mixed_prefill(st)
        elif st.active:
            ctx = sum(r.n_in + r.n_out - left for r, left in st.active) / len(st.active)
            step = st.rep.decode_iter_s(len(st.active), ctx)
            iters = min(left for _, left in st.active)
            st.busy, st.chunk = True, (self.now, step, iters)
            self.push(self.now + step * iters, self.on_chunk, st, st.version)

    def cut_chunk(self, st: RepState) -> None:
        """A request could join: end the decode run at the next iteration boundary."""
        if not st.chunk:
            return
        start, step, iters = st.chunk
        done = max(1, math.ceil((self.now - start) / step - 1e-9))
        if done < iters:
            st.version += 1
            st.chunk = (start, step, done)
            self.push(start + step * done, self.on_chunk, st, st.version)

    def on_chunk(self, st: RepState, version: int) -> None:
        if version != st.version:
            return
        _, _, iters = st.chunk
        st.busy, st.chunk = False, ()
        keep = []
        for item in st.active:
            item[1] -= iters
            if item[1] <= 0:
                item[0].done = self.now
            else:
                keep.append(item)
        st.active = keep
        self.try_iterate(st)

    def mixed_prefill(self, st: RepState) -> None:
        """Run queued prompts (as many as free slots) through the pipeline back to back."""
        batch = []
        while st.queue and len(st.active) + len(batch) < st.max_batch:
            batch.append(st.queue.popleft())
        times = [st.rep.prefill_s(r.n_in) for r in batch]
        duration = sum(o for o, _ in times) + max(lat - o for o, lat in times)
        for r, (occ, _) in zip(batch, times):
            st.queued_occ -= occ
            r.prefill_start = self.now
            r.wait_s += self.now - r.arrival
        for item in st.active:
            item[0].wait_s += duration  # paused by other requests' prefills
            item[0].paused_s += duration
        st.busy, st.chunk = True, ()
        self.push(self.now + duration, self.on_mixed_prefilled, st, batch)

    def on_mixed_prefilled(self, st: RepState, batch: list[Request]) -> None:
        st.busy = False
        for r in batch:
            r.first_token = r.decode_start = self.now
            if r.n_out <= 1:
                r.done = self.now
            else:
                st.active.append([r, r.n_out - 1])
        self.try_iterate(st)
