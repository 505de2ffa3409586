"""Discrete-event simulator of serving a workload on a set of replicas (one heap of timed events).

- Requests arrive at given times (sweep.py draws Poisson traces) with their own lengths.
- Routing: router.py (the same code the live gateway runs). The router is told the prompt's
  length and the workload's mean output length, never a request's own. As the gateway does, a
  request for a prefill replica gets its decode replica on arrival too, and counts in that
  replica's load from then on (so that requests routed meanwhile do not all pick it).
- A replica takes its queued prompts fewest tokens first, with aging (router.prompt_priority,
  the order roles/batcher.py gives its prompt chunks).
- Prefill replicas are pipelines: a micro-batch may enter every `occupancy` seconds (the slowest
  stage or link). As roles/batcher.py fills its micro-batches, one holds the queued prompts in
  order, whole, as many as TOKEN_BUDGET tokens hold (at least one prompt): short prompts share
  a step's weight reads (a longer one runs whole, as one compute-bound step, where the live
  leader chunks it at TOKEN_BUDGET tokens). A micro-batch then runs stage by stage, and its activations cross each link as a real
  transfer on the ports (ports.py: full duplex, shared zone links), so they queue behind KV
  being shipped out of the same port. The first output token comes out of the prefill.
  Back-pressure: a prefill replica starts no prompt while its finished-but-unsent KV would
  overflow its memory.
- KV shipping: as roles/stage.py does, each prefill stage sends the KV of its layers to the
  decode stages holding them as soon as it has computed the prompt, after the prompt's
  activations to the next stage (which are on its critical path); the KV is ready when the
  last stage's has arrived. The decode replica counts it as promised (router.py's
  `kv_pending_tokens`) from routing until the last stage has shipped (the prompt's first
  token, as the live gateway counts it), not only until the first stage starts shipping.
- Decode replicas batch at iteration level (Orca): up to the memory-limited batch; an
  iteration costs `decode_iter_s(batch, mean context)`, in min(stages, batch) micro-batches
  that follow each other through the pipeline, and (as roles/leader.py does) a sequence joins
  the next micro-batch launched, not the next whole iteration: a run can be cut at every
  1/micro of a step. A sequence keeps its progress towards its next token (a fraction of a
  step), so a cut run costs nobody any work. Runs of iterations are one event, cut short when
  a request could join. Their activations
  are booked on the ports when the run ends (work-conserving: they delay KV arriving later).
- Mixed replicas never ship KV; they prefill in chunks that ride along their decode steps
  (chunked prefill, as vLLM and Sarathi-Serve do): each step takes as many prompt tokens as
  the compute a memory-bound step leaves idle (`free_chunk`, more while a backlog drains:
  `chunk_tokens`), from as many queued prompts, in order, as that budget holds (as the live
  leader fills its token budget, roles/leader.py; short prompts no longer take a step each:
  meshllm on demo, failure, multi-tenant and wan sustains 2.3-3x the rate it did), unless at
  least as many prompts wait as sequences decode: then whole prompts at once, as many as the
  budget holds and at least one per stage (every decoding sequence waits the extra step time,
  but fewer requests wait than when the prompts queue).
  A lone prompt beside one decoding sequence goes whichever way adds less waiting
  (`SimReplica.goes_whole`; on bench-edge-8b at its 1 req/s, meshllm's mean wait fell from
  31.6 to 23.4 ms with it). A lone prompt's chunks are even (`SimReplica.lone_chunk`): k steps
  of ceil(left / k) tokens, not the budget's chunks and a last step for the remainder, which
  costs a whole step (bench-edge-8b at its 1 req/s: meshllm's mean wait 28.9 -> 21.5 ms,
  mixed-dp's 37.1 -> 28.2). A prompt starts only when a decode slot is free for it. While the
  slots are full, the prompts in progress take only what rides free (`free_chunk`), never whole
  or a backlog's share: prefilling faster then only left steps that decode alone, memory-bound,
  their compute idle, until the next slot freed. One RTX 4090 alone (bench-edge-8b's profile,
  mixed), flooded with 4000 requests of that cluster's trace at 30 req/s, served them all at
  0.862 of its bound's rate that way, at 0.943 with the rule (its ramp and final drain included).
- Waiting time (README): the prefill queue + port and link queueing (activations and KV) +
  waiting for a decode slot + decode pauses for other requests' prefills. It is what the
  request's end-to-end latency has beyond its own compute and transfers at idle ports.
- ITL: per request, the gaps between its tokens: the first decode gap also holds the KV
  transfer and any slot wait, and a pause lengthens the gap it falls in.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from meshllm.defaults import TOKEN_BUDGET
from meshllm.partition.latency import ROUTE_WAIT_WEIGHT
from meshllm.sim.ports import PortBook
from meshllm.sim.replica import SimReplica
from meshllm.sim.router import ReplicaLoad, Router
from meshllm.sim.state import PromptQueue, RepState, Request

__all__ = ["PromptQueue", "RepState", "Request", "Simulator"]


class Simulator:
    def __init__(self, reps: Sequence[SimReplica], requests: Sequence[Request],
                 route_wait_weight: float = ROUTE_WAIT_WEIGHT, gaps: bool = True):
        self.gaps = gaps  # record each request's gaps between tokens (ITL); a stability run needs none
        self.heap: list = []
        self.seq = 0
        self.now = 0.0
        self.states = {r.id: RepState(r, ReplicaLoad(max(1, r.max_batch())), r.kv_capacity_tokens()) for r in reps}
        self.loads = {rid: st.load for rid, st in self.states.items()}
        self.ports = PortBook(reps[0].inp.net) if reps else None
        self.router = Router(reps, self.ports, route_wait_weight) if reps else None
        self.mean_out = reps[0].inp.mix.mean_out if reps else 0.0
        self.requests = list(requests)
        for r in self.requests:
            self.push(r.arrival, self.on_arrival, r)

    def push(self, t: float, fn, *args) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, fn, args))

    def run(self, max_events: int = 20_000_000) -> list[Request]:
        for _ in range(max_events):
            if not self.heap:
                return self.requests
            self.now, _, fn, args = heapq.heappop(self.heap)
            fn(*args)
        raise RuntimeError(f"simulation did not finish within {max_events} events")

    # -- prefill ------------------------------------------------------------------------------
    def on_arrival(self, req: Request) -> None:
        st = self.states[self.router.pick_prefill(self.loads, req.n_in, self.mean_out, self.now)]
        if st.rep.role == "prefill" and req.n_out > 1:
            req.dst = self.router.pick_decode(st.rep.id, self.loads, req.n_in, self.mean_out, self.now)
            self.states[req.dst].load.waiting += 1
            self.states[req.dst].load.kv_pending_tokens += req.n_in
            st.load.kv_unshipped_tokens += req.n_in
        st.queue.push(req)
        st.load.prefill_queued_s += st.rep.prefill_s(req.n_in)[0]
        st.load.prefill_queued_tokens += req.n_in
        st.load.prefill_queued += 1
        self.kick(st)

    def kick(self, st: RepState) -> None:
        if st.rep.role == "prefill":
            self.try_prefill(st)
        else:
            self.try_iterate(st)

    def try_prefill(self, st: RepState) -> None:
        """The next micro-batch of a prefill replica: queued prompts in order, whole, as many as
        TOKEN_BUDGET tokens hold (at least one), as roles/batcher.py fills its micro-batches."""
        if not st.queue or self.now < st.load.next_prefill_at:
            return
        batch, tokens = [], 0
        while st.queue:
            req = st.queue.peek()
            if batch and tokens + req.n_in > TOKEN_BUDGET:
                break
            if st.pending_kv + tokens > 0 and st.pending_kv + tokens + req.n_in > st.kv_cap:
                break  # back-pressure: wait for KV to leave (on_kv_sent kicks again)
            st.queue.pop()
            batch.append(req)
            tokens += req.n_in
            st.load.prefill_queued_s -= st.rep.prefill_s(req.n_in)[0]  # as on_arrival counted it
            st.load.prefill_queued_tokens -= req.n_in
            st.load.prefill_queued -= 1
            req.prefill_start = self.now
            req.wait_s += self.now - req.arrival
        if not batch:
            return
        lengths = tuple(sorted(r.n_in for r in batch))
        stages, occ, _ = st.rep.prefill_batch(lengths)
        st.load.next_prefill_at = self.now + occ
        self.push(self.now + occ, self.try_prefill, st)
        self.push(self.now + stages[0], self.on_stage, st, batch, lengths, 0)

    def on_stage(self, st: RepState, batch: list[Request], lengths: tuple[int, ...], i: int) -> None:
        """Stage i of a micro-batch's prefill is done: send its activations on (first: the
        prompts' critical path), then ship each prompt's KV; or finish."""
        members = st.rep.members
        if i < len(members) - 1:
            nbytes = sum(lengths) * st.rep.inp.mc.act_bytes_per_token
            end, ideal = self.ports.transfer(members[i], members[i + 1], nbytes, self.now)
            for req in batch:
                req.wait_s += end - ideal
                req.port_wait_s += end - ideal
            self.push(end + st.rep.prefill_batch(lengths)[0][i + 1], self.on_stage, st, batch, lengths, i + 1)
        for req in batch:
            if req.n_out > 1:
                self.ship_stage_kv(st, req, i)
        if i == len(members) - 1:
            for req in batch:
                self.on_prefilled(st, req)

    def ship_stage_kv(self, st: RepState, req: Request, i: int) -> None:
        """Stage i of a prefill replica has computed `req`'s prompt: its KV goes to the decode
        replica chosen on arrival. Waiting: the KV complete later than at idle ports."""
        src = st.rep
        if i == 0:
            st.pending_kv += req.n_in
            req.kv_end, req.kv_ideal, req.kv_alone = self.now, self.now, {}
        dst = self.states[req.dst]
        flows = [f for f in self.router.kv_flows(src, dst.rep, req.n_in) if f[0] is src.members[i]]
        end, ideal = self.ports.transfers(flows, self.now, commit=True, alone=req.kv_alone)
        req.kv_end, req.kv_ideal = max(req.kv_end, end), max(req.kv_ideal, ideal)
        if i == len(src.members) - 1:
            dst.load.kv_pending_tokens -= req.n_in  # all of it on the ports from now on
            st.load.kv_unshipped_tokens -= req.n_in
            req.kv_alone = None
            req.wait_s += req.kv_end - req.kv_ideal
            req.port_wait_s += req.kv_end - req.kv_ideal
            self.push(req.kv_end, self.on_kv_sent, st, dst, req)

    def on_prefilled(self, st: RepState, req: Request) -> None:
        req.first_token = req.last_token = self.now
        if req.n_out <= 1:
            req.done = self.now
            self.try_prefill(st)

    def on_kv_sent(self, src: RepState, dst: RepState, req: Request) -> None:
        src.pending_kv -= req.n_in
        req.kv_ready = self.now
        dst.waiting.append(req)
        self.try_prefill(src)
        self.try_iterate(dst)

    # -- decode ---------------------------------------------------------------------------------
    def try_iterate(self, st: RepState) -> None:
        if st.busy:
            if st.could_join():
                self.cut_chunk(st)
            return
        while st.waiting and len(st.active) < st.load.max_batch:
            req = st.waiting.popleft()
            req.wait_s += self.now - req.kv_ready
            req.slot_wait_s += self.now - req.kv_ready
            st.load.waiting -= 1
            st.activate(req)
        if st.rep.role == "mixed":
            st.start_prompts(self.now)
        st.load.active = len(st.active)
        if st.active or st.prefilling:
            self.run_steps(st)

    def run_steps(self, st: RepState) -> None:
        """Start a run of identical steps (RepState.next_run): until a sequence finishes or a
        prompt is prefilled."""
        step, iters, chunk, base, micro = st.next_run()
        b = len(st.active)
        st.load.tokens_left = st.left / b if b else 0.0
        st.busy, st.chunk = True, (self.now, step, iters, chunk, base, micro)
        self.push(self.now + step * iters, self.on_chunk, st, st.version)

    def cut_chunk(self, st: RepState) -> None:
        """A request could join: end the run at the next micro-batch launch (1/micro of a step)."""
        if not st.chunk:
            return
        start, step, iters, chunk, base, micro = st.chunk
        done = max(1, math.ceil((self.now - start) / step * micro - 1e-9)) / micro
        if done < iters - 1e-9:
            st.version += 1
            st.chunk = (start, step, done, chunk, base, micro)
            self.push(start + step * done, self.on_chunk, st, st.version)

    def on_chunk(self, st: RepState, version: int) -> None:
        if version != st.version:
            return
        start, step, iters, chunk, base, _ = st.chunk
        st.busy, st.chunk = False, ()
        keep, made, floor, gaps = [], 0, math.floor, self.gaps  # the hot loop of the simulator: per sequence per run
        stretch = iters * (step - base) if chunk else 0.0  # the prompt riding along made these steps longer
        # a sequence with no progress towards its next token (part 0.0, most of them) gets these;
        # the same floats as the general case below gives it (0.0 + x and x * 1.0 are x exactly)
        tokens0 = floor(iters + 1e-9) if st.active else 0  # (no sequence decoding: nothing to count)
        first0 = start + step
        last0 = first0 + step * (tokens0 - 1) if tokens0 > 1 else first0
        for item in st.active:
            req, left, part = item
            if part == 0.0:
                tokens, first, last = tokens0, first0, last0
            else:
                tokens = floor(part + iters + 1e-9)  # whole tokens this run completed
                first = start + step * (1.0 - part)
                last = first + step * (tokens - 1) if tokens > 1 else first
            if tokens:
                if gaps:
                    req.gaps.append((first - req.last_token, 1))
                    if tokens > 1:
                        req.gaps.append((step, tokens - 1))
                req.last_token = last
                made += tokens
                left -= tokens
            if chunk:
                req.wait_s += stretch
                req.paused_s += stretch
            if left > 0:
                item[1] = left
                rest = part + iters - tokens
                item[2] = rest if rest > 0.0 else 0.0
                keep.append(item)
            else:  # done: the item leaves `active`
                req.done = req.last_token
                st.context -= req.n_in + req.n_out - left
                st.left -= left
        st.context += made
        st.left -= made
        self.book_activations(st, start, len(st.active) * iters)
        st.active = keep
        if chunk:
            st.advance_prompt(math.floor(iters * chunk + 1e-9), self.now)
        self.try_iterate(st)

    def book_activations(self, st: RepState, start: float, tokens: int) -> None:
        """A decode run's activations between a decode replica's stages, booked from its start."""
        if st.rep.role != "decode":
            return  # a mixed replica's ports carry nothing else; its timing already holds the hops
        nbytes = tokens * st.rep.inp.mc.act_bytes_per_token
        for a, b in zip(st.rep.members, st.rep.members[1:]):
            self.ports.transfer(a, b, nbytes, start)
