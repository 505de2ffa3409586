"""Discrete-event simulator of serving a workload on a set of replicas (one heap of timed events).

- Requests arrive at given times (sweep.py draws Poisson traces) with their own lengths.
- Routing: router.py (the same code the live gateway runs). The router is told the prompt's
  length and the workload's mean output length, never a request's own. As the gateway does, a
  request for a prefill replica gets its decode replica on arrival too, and counts in that
  replica's load from then on (so that requests routed meanwhile do not all pick it).
- A replica takes its queued prompts fewest tokens first, with aging (router.prompt_priority,
  the order roles/batcher.py gives its prompt chunks).
- Prefill replicas are pipelines: a prompt may enter every `occupancy` seconds (the slowest
  stage or link); it then runs stage by stage, and its activations cross each link as a real
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
- Waiting time (BRIEF): the prefill queue + port and link queueing (activations and KV) +
  waiting for a decode slot + decode pauses for other requests' prefills. It is what the
  request's end-to-end latency has beyond its own compute and transfers at idle ports.
- ITL: per request, the gaps between its tokens: the first decode gap also holds the KV
  transfer and any slot wait, and a pause lengthens the gap it falls in.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from meshllm.partition.latency import ROUTE_WAIT_WEIGHT
from meshllm.sim.ports import PortBook
from meshllm.sim.replica import SimReplica
from meshllm.sim.router import ReplicaLoad, Router, prompt_rank


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
    port_wait_s: float = 0.0  # part of wait_s: queueing on ports and links (activations, KV)
    slot_wait_s: float = 0.0  # part of wait_s: KV arrived, no decode slot free
    last_token: float = math.nan
    gaps: list = field(default_factory=list)  # (seconds between two of its tokens, how many such gaps)
    dst: int = -1  # the decode replica its KV goes to (a prefill replica's request)
    kv_end: float = 0.0  # when the KV its stages shipped so far is complete ...
    kv_ideal: float = 0.0  # ... and when it would be had no other request's transfer been queued
    kv_alone: dict | None = None  # its own KV transfers so far, on otherwise idle ports


class PromptQueue:
    """The prompts waiting at a replica, taken in router.prompt_priority order (ties: arrival).
    That order does not change with time (router.prompt_rank), so a heap keeps it: a scan of the
    queue per prompt taken made overloaded sweep runs quadratic (over half of `--simulate`'s time)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Request]] = []
        self._count = 0

    def push(self, req: Request) -> None:
        heapq.heappush(self._heap, (prompt_rank(req.n_in, req.arrival), self._count, req))
        self._count += 1

    def peek(self) -> Request:
        return self._heap[0][2]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[2]

    def __len__(self) -> int:
        return len(self._heap)


@dataclass
class RepState:
    """One replica in the simulation: its queues and batch, and the scheduling that is its own
    (which prompts start, what its next run of steps is, a prompt's progress). The Simulator
    owns the clock, the events and the ports."""

    rep: SimReplica
    load: ReplicaLoad
    kv_cap: float
    queue: PromptQueue = field(default_factory=PromptQueue)  # prompts waiting for prefill
    waiting: deque = field(default_factory=deque)  # KV arrived, waiting for a decode slot
    active: list = field(default_factory=list)  # [request, tokens left, progress towards the next one]
    context: int = 0  # over `active`: the tokens in their KV (prompt + generated), summed
    left: int = 0  # over `active`: the tokens still to generate, summed
    pending_kv: float = 0.0  # tokens of prefilled KV not yet shipped
    busy: bool = False
    chunk: tuple = ()  # (start, step, iterations, prompt tokens per step, step without them) in flight
    version: int = 0
    prefilling: list = field(default_factory=list)  # mixed: [request, prompt tokens done] in progress

    def activate(self, req: Request) -> None:
        """`req` starts decoding here: its first token is out, n_out - 1 to go."""
        self.active.append([req, req.n_out - 1, 0.0])
        self.context += req.n_in + 1
        self.left += req.n_out - 1

    def decode_context(self) -> float:
        b = len(self.active)
        return self.context / b if b else 0.0

    def could_join(self) -> bool:
        """A request waits for this replica's run to end: a decode slot or a prompt to start."""
        if self.slots_full():
            return False
        return bool(self.waiting) or (not self.prefilling and bool(self.queue))

    def slots_full(self) -> bool:
        """No decode slot is left for another prompt (the memory-limited batch is reached)."""
        return len(self.active) + len(self.prefilling) >= self.load.max_batch

    def prompt_budget(self, head: int) -> int:
        """Prompt tokens a mixed replica's next decode step takes (SimReplica.chunk_tokens), from
        as many prompts as it needs, the next one `head` tokens long; only what rides free
        (`free_chunk`) while the slots are full (module docstring)."""
        backlog = self.load.prefill_queued_tokens
        if self.slots_full():
            return self.rep.free_chunk(len(self.active), self.decode_context(), max(head, backlog))
        return self.rep.chunk_tokens(len(self.active), self.decode_context(), max(head, backlog), backlog,
                                     self.load.prefill_queued)

    def start_prompts(self, now: float) -> None:
        """Mixed: prompts riding along the decode steps in chunks, as many as the step's prompt
        budget holds (`prompt_budget`; as roles/leader.py fills its token budget with several
        prompts' chunks); or, when at least as many prompts wait as sequences decode, whole
        prompts, at least as many as the pipeline has stages and more while the budget holds
        (a lone prompt starts alone either way; next_run decides whether it goes whole). One
        prompt per stage and step, the old rule, drained a queue of short prompts at one
        prompt a step: on clusters/wan.yaml one trace's queue, once formed, grew without end
        at 10000 req/s while chunked steps kept up with 12500 (meshllm's saturation there rose
        from 0.84 to about 1.0 of the bound)."""
        whole = self.load.prefill_queued >= len(self.active)
        budget = self.prompt_budget(self.queue.peek().n_in) if self.queue else 0
        taken = sum(r.n_in - done for r, done in self.prefilling)  # prompt tokens left of those started
        while self.queue and not self.slots_full() and (
                len(self.prefilling) < (len(self.rep.members) if whole else 1) or taken < budget):
            req = self.queue.pop()
            taken += req.n_in
            self.load.prefill_queued_s -= self.rep.prefill_s(req.n_in)[0]
            req.prefill_start = now
            req.wait_s += now - req.arrival
            self.prefilling.append([req, 0])

    def next_run(self) -> tuple[float, float, float, float, int]:
        """The next run of identical steps, until a sequence finishes or a prompt is prefilled:
        (seconds a step, steps, prompt tokens a step, a step's seconds without them, micro-batches)."""
        b = len(self.active)
        ctx = self.decode_context()
        base = self.rep.decode_iter_s(b, ctx) if b else 0.0
        iters = min((left - part for _, left, part in self.active), default=math.inf)
        chunk, pos, prompts = 0, 0.0, 0
        micro = max(1, min(len(self.rep.members), b))  # micro-batches of a step (steps.fused_step_s)
        lefts = [r.n_in - done for r, done in self.prefilling]
        whole = not self.slots_full() and self.load.prefill_queued >= b and (len(lefts) > 1 or (lefts and self.rep.goes_whole(
            b, ctx, self.load.prefill_queued, lefts[0], self.load.prefill_queued_tokens)))
        heads = 0.0  # prompts ending in a step: their first token's LM head
        if whole:
            chunk, iters, prompts, micro = sum(lefts), 1, len(lefts), 1  # a whole prompt's step is not cut
            pos = chunk / 2 + sum(x * x for x in lefts) / (2 * chunk)  # attention of separate prompts
            heads = len(lefts)
        elif len(lefts) > 1:  # chunks of several prompts, in order, fill the budget: one step
            chunk = min(sum(lefts), self.prompt_budget(lefts[0]))
            parts, rest = [], chunk
            for (_, done), left in zip(self.prefilling, lefts):
                parts.append((min(left, rest), done, left))
                rest -= parts[-1][0]
            parts = [part for part in parts if part[0] > 0]
            iters, prompts = 1, len(parts)
            pos = chunk / 2 + sum(n * (done + n / 2) for n, done, _ in parts) / chunk  # separate spans
            heads = sum(1 for n, _, left in parts if n == left)
        elif self.prefilling:
            req, done = self.prefilling[0]
            chunk = self.rep.lone_chunk(b, ctx, lefts[0], done, self.prompt_budget(req.n_in))
            steps = math.ceil(lefts[0] / chunk)
            iters, pos = min(iters, steps), done + chunk
            heads = 1.0 / iters if steps <= iters else 0.0  # the run's last step ends the prompt
        if chunk and not b and len(self.prefilling) == 1 and self.prefilling[0][1] == 0:
            step, micro = self.rep.prefill_s(chunk)[1], 1  # a whole prompt alone (its head included)
        else:
            step = self.rep.decode_iter_s(b, ctx, chunk, pos, prompts) + heads * self.rep.head_s()
        return step, iters, chunk, base, micro

    def advance_prompt(self, tokens: int, now: float) -> None:
        """`tokens` more prompt tokens are prefilled (in order); a finished prompt decodes here."""
        keep = []
        for item in self.prefilling:
            req = item[0]
            got = min(tokens, req.n_in - item[1])
            item[1] += got
            tokens -= got
            self.load.prefill_queued_tokens -= got
            if item[1] < req.n_in:
                keep.append(item)
                continue
            self.load.prefill_queued -= 1
            req.first_token = req.last_token = req.decode_start = now
            req.wait_s += max(0.0, now - req.prefill_start - self.rep.prefill_s(req.n_in)[1])  # chunking
            if req.n_out <= 1:
                req.done = now
            else:
                self.activate(req)
        self.prefilling = keep


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
        if not st.queue or self.now < st.load.next_prefill_at:
            return
        req = st.queue.peek()
        if st.pending_kv > 0 and st.pending_kv + req.n_in > st.kv_cap:
            return  # back-pressure: wait for KV to leave (on_kv_sent kicks again)
        st.queue.pop()
        stages, occ, _ = st.rep.prefill_stages(req.n_in)
        st.load.prefill_queued_s -= occ
        st.load.prefill_queued_tokens -= req.n_in
        st.load.prefill_queued -= 1
        req.prefill_start = self.now
        req.wait_s += self.now - req.arrival
        st.load.next_prefill_at = self.now + occ
        self.push(self.now + occ, self.try_prefill, st)
        self.push(self.now + stages[0], self.on_stage, st, req, 0)

    def on_stage(self, st: RepState, req: Request, i: int) -> None:
        """Stage i of `req`'s prefill is done: send its activations on (first: the prompt's
        critical path), then ship its KV; or finish."""
        members = st.rep.members
        if i < len(members) - 1:
            nbytes = req.n_in * st.rep.inp.mc.act_bytes_per_token
            end, ideal = self.ports.transfer(members[i], members[i + 1], nbytes, self.now)
            req.wait_s += end - ideal
            req.port_wait_s += end - ideal
            self.push(end + st.rep.prefill_stages(req.n_in)[0][i + 1], self.on_stage, st, req, i + 1)
        if req.n_out > 1:
            self.ship_stage_kv(st, req, i)
        if i == len(members) - 1:
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
            req.done = req.decode_start = self.now
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
            req.decode_start = self.now
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
