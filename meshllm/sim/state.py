"""What the simulator (simulator.py) keeps per request and per replica: a request's timeline,
a replica's prompt queue (fewest tokens first, with aging) and its decode state (active
sequences, prompts in progress, the chunking rules of mixed replicas, the next run of steps).
The model these follow is simulator.py's docstring."""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

from meshllm.sim.replica import SimReplica
from meshllm.sim.router import ReplicaLoad, prompt_rank


@dataclass
class Request:
    rid: int
    arrival: float
    n_in: int
    n_out: int
    prefill_start: float = math.nan
    first_token: float = math.nan
    kv_ready: float = math.nan
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
            req.first_token = req.last_token = now
            req.wait_s += max(0.0, now - req.prefill_start - self.rep.prefill_s(req.n_in)[1])  # chunking
            if req.n_out <= 1:
                req.done = now
            else:
                self.activate(req)
        self.prefilling = keep
