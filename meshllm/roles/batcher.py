"""What goes into a replica's next micro-batch, and which queued sequences start (roles/leader.py
launches it): the sequences (`Seq`), the micro-batches in flight (`InFlight`) and the `Batcher`.

Every sequence ready to decode gets one row (a drafted one, its block to verify), then prompt
chunks fill the token budget (chunked prefill, so a long prompt never stalls running decodes),
fewest prompt tokens left first with aging (sim/router.prompt_priority, as the simulator orders
them).

KV admission: a queued sequence starts only while the replica's stages have room for its KV
(`kv_charge`: the slot its longest context needs, prompt + max_tokens within the model's
context; a prefill replica's only its prompt), counted against `kv_room`, the fewest positions
any stage of the replica holds beside its weights (roles/context.py kv_room, from the devices'
profiles). The queue is first come, first served; a sequence that needs more than the whole
room runs alone. Without it a small device decoding many long generations would run out of
memory (TGI's way: reserve the most a request may take, at admission).
The gateway applies the same charge before it sends a request (roles/kv_book.py KvBook.room_for),
since a decode replica receives a prompt's KV before the sequence starts here; the gateways
count each other's requests by the claims their heartbeats carry (KvBook.others). Those claims
are up to a heartbeat old, so before it sends a request the gateway also asks the decode
replica's leader for the room (KV_RESERVE, answered at once on the leader's I/O thread:
`KvGrants`): the leader grants it only while the running and queued sequences and the rooms
granted before leave it, so requests reaching several gateways at once cannot together send a
replica more than it holds.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from meshllm.config import MAX_GAMMA
from meshllm.defaults import TOKEN_BUDGET
from meshllm.engine.kvcache import slot_capacity
from meshllm.engine.sampling import SamplingParams
from meshllm.engine.speculative import AcceptanceStats
from meshllm.mesh.protocol import SpanKind, WireSpan
from meshllm.roles.verifier import WAIT, Block, Verifier
from meshllm.sim.router import PROMPT_AGING_TOKENS_PER_S, prompt_priority

log = logging.getLogger("meshllm.leader")

GRANT_TTL_S = 120.0  # x time_scale: a granted room whose sequence has not come by then is given back (its gateway died)
MAX_GRANTS = 4096  # rooms promised at once at most (what the network asks for: bounded memory)
MAX_ACTIVE_SEQS = 64  # sequences a replica decodes at once; more wait in its queue


@dataclass
class Seq:
    id: int
    prompt: list[int]  # tokens still to prefill here ([] for a handed-off sequence)
    prompt_len: int
    max_tokens: int
    params: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    gateway: str  # address of the gateway that streams its tokens
    decode_rid: int  # replica that decodes it (this one when mixed)
    out: list[int] = field(default_factory=list)  # output tokens so far (of this attempt)
    offset: int = 0  # output tokens before this attempt (a request resumed after a failure)
    fed: int = 0  # positions sent into the pipeline
    busy: bool = False  # a span whose logits we need is in flight
    missing_kv: set[str] = field(default_factory=set)  # decode: stages that have not acknowledged KV
    arrived: float = field(default_factory=time.monotonic)
    queued_s: float = 0.0  # time waiting to be scheduled, reported to the gateway
    launched: float | None = None  # monotonic time its first prompt chunk entered the pipeline
    prefill_s: float = 0.0  # prompt in -> first token out (prefill replicas), for the handoff figures
    prefilled_at: float | None = None  # decode replicas: when the prefill replica had the first token
    drafter: str = ""  # node drafting for it ("" without speculation)
    drafter_life: int | None = None  # that node's incarnation when the sequence came here (Verifier.started)
    silent_steps: int = 0  # plain steps taken since its drafter's last block (Verifier.take)
    hash: int = 0  # hash of `out` (engine/speculative.py): which drafts were drafted after it
    spec: AcceptanceStats = field(default_factory=AcceptanceStats)
    spec_sent: int = 0  # spec.blocks when its figures last went to the gateway (Outbox.tokens)
    waiting_since: float | None = None  # ready, waiting for its drafter's block since
    last_block_at: float | None = None
    block_interval_s: float | None = None
    kv_charge: int = 0  # KV positions reserved for it on every stage while it runs (Batcher.admit)
    kv_waited: bool = False  # it waited in the queue for KV room
    alive_at: float = field(default_factory=time.monotonic)  # last word to its gateway (a token or a keepalive)

    @property
    def context(self) -> int:
        return self.prompt_len + len(self.out)

    def ready_to_decode(self) -> bool:
        return not self.busy and not self.missing_kv and self.out and self.fed == self.context - 1

    def next_chunk(self, budget: int) -> list[int]:
        return self.prompt[self.fed:self.fed + budget] if self.fed < self.prompt_len else []


@dataclass
class InFlight:
    spans: list[WireSpan]
    sent: float
    blocks: dict[int, Block] = field(default_factory=dict)  # VERIFY spans: seq -> its block


class KvGrants:
    """The KV room a decode (or mixed) replica's leader has promised to requests still on their
    way (a gateway's KV_RESERVE before it sends one), beside what its sequences hold. Thread-safe:
    rooms are granted on the I/O thread, taken and given back on the compute thread."""

    def __init__(self, kv_room: int | None, ttl_s: float = GRANT_TTL_S):
        self.kv_room, self.ttl_s = kv_room, ttl_s
        self.committed = 0  # positions of the sequences here (running, or queued without a grant)
        self.granted: dict[int, tuple[int, float]] = {}  # seq -> (positions, when it lapses)
        self.denied = 0  # reservations refused
        self._lock = threading.Lock()

    def grant(self, seq: int, positions: int, now: float | None = None) -> bool:
        """Promise `seq` room for `positions`: while the sequences here and the earlier grants leave
        that much, or when the replica holds nothing and has promised nothing (a request larger than
        the whole room runs alone). A second ask for the same sequence replaces its first."""
        if self.kv_room is None:
            return True  # no KV limit known: nothing to promise
        now = time.monotonic() if now is None else now
        with self._lock:
            self._lapse(now)
            self.granted.pop(seq, None)
            out = sum(p for p, _ in self.granted.values())
            ok = len(self.granted) < MAX_GRANTS and (self.committed + out + positions <= self.kv_room
                                                     or self.committed + out == 0)
            if ok:
                self.granted[seq] = (positions, now + self.ttl_s)
            else:
                self.denied += 1
            return ok

    def promised(self, but: Collection[int]) -> int:
        """Positions promised to sequences other than those in `but`."""
        with self._lock:
            self._lapse(time.monotonic())
            return sum(p for k, (p, _) in self.granted.items() if k not in but)

    def settle(self, started: Collection[int], held: int, queued: Iterable[tuple[int, int]]) -> None:
        """After the leader started `started`: their rooms are now part of `held` (the running
        sequences' charges); the queued sequences (id, charge) without a grant count too. In one
        step, so a grant on the I/O thread never sees a room both given back and not yet held."""
        with self._lock:
            for seq in started:
                self.granted.pop(seq, None)
            self.committed = held + sum(c for q, c in queued if q not in self.granted)

    def take(self, seq: int) -> None:
        """`seq` ended (or was aborted before it came): the room promised to it is free."""
        with self._lock:
            self.granted.pop(seq, None)

    def clear(self) -> None:
        with self._lock:
            self.granted.clear()

    def _lapse(self, now: float) -> None:
        for k in [k for k, (_, until) in self.granted.items() if until <= now]:
            del self.granted[k]


class Batcher:
    """The leader's scheduling policy: what goes into its replica's next micro-batch. Every
    sequence ready to decode gets one row (a drafted one, its block to verify), spread over as
    many micro-batches as the pipeline has stages; then prompt chunks fill the TOKEN_BUDGET,
    fewest prompt tokens left first with aging. It works on the leader's sequence table and
    queue (the same objects)."""

    def __init__(self, seqs: dict[int, Seq], queue: list[int], n_stages: int, rid: int = 0,
                 max_context: int = 1 << 30, kv_room: int | None = None, time_scale: float = 1.0,
                 aging: float = PROMPT_AGING_TOKENS_PER_S):
        self.seqs, self.queue, self.n_stages = seqs, queue, n_stages
        self.aging = aging / time_scale  # prompt tokens a second of waiting counts for (sim/router.prompt_aging)
        self.rid, self.max_context = rid, max_context
        self.kv_room = kv_room  # KV positions every stage holds (None: not known, no KV limit)
        self.kv_held = 0  # positions reserved by the running sequences
        self.kv_waits = 0  # sequences that waited for KV room
        self.kv_peak = 0  # most positions reserved at once
        self.grants = KvGrants(kv_room, GRANT_TTL_S * time_scale)  # room promised to requests on their way

    def admit(self, s: Seq) -> None:
        s.kv_charge = kv_charge(s, self.rid, self.max_context)
        self.seqs[s.id] = s
        self.queue.append(s.id)

    def active(self) -> int:
        return sum(1 for s in self.seqs.values() if s.id not in self.queue)

    def build(self, verifier: Verifier | None) -> tuple[InFlight, list[int]]:
        """The next micro-batch's spans and token ids (empty when nothing is ready); `verifier`:
        the replica's, if it verifies drafts."""
        fl, ids = InFlight([], time.monotonic()), []
        self._start_queued()
        ready = [s for s in self.seqs.values() if s.id not in self.queue and s.ready_to_decode()]
        if verifier is not None:  # oldest draft blocks first; plain steps (key 0) before them
            ready.sort(key=lambda s: verifier.oldest(s) if s.drafter else 0.0)
        per_batch = max(1, math.ceil(len(ready) / self.n_stages))  # spread over the pipeline
        for s in ready:
            if len(fl.spans) >= per_batch or len(ids) >= TOKEN_BUDGET:
                break
            block = verifier.take(s, fl.sent, len(fl.blocks)) if s.drafter and verifier else None
            if block is WAIT:
                continue
            tokens = [s.out[-1]] + (block.tokens if block else [])
            fl.spans.append(span_of(s, len(tokens), SpanKind.VERIFY if block else SpanKind.DECODE))
            if block:
                fl.blocks[s.id] = block
            ids.extend(tokens)
            s.busy, s.fed = True, s.fed + len(tokens)
        budget = TOKEN_BUDGET - len(ids)
        for s in self._prompts(fl.sent):
            chunk = s.next_chunk(budget)
            if not chunk:
                continue
            if s.launched is None:
                s.launched = time.monotonic()
            last = s.fed + len(chunk) == s.prompt_len
            fl.spans.append(span_of(s, len(chunk), SpanKind.PREFILL_LAST if last else SpanKind.PREFILL))
            ids.extend(chunk)
            s.fed += len(chunk)
            s.busy = last
            budget -= len(chunk)
            if budget <= 0:
                break
        return fl, ids

    def _prompts(self, now: float) -> list[Seq]:
        """Running sequences with prompt tokens left, in the order they get the step's prompt budget
        (the simulator's order: sim/router.prompt_priority)."""
        todo = [s for s in self.seqs.values() if s.fed < s.prompt_len and not s.busy and s.id not in self.queue]
        return sorted(todo, key=lambda s: prompt_priority(s.prompt_len - s.fed, now - s.arrived, self.aging))

    def _start_queued(self) -> None:
        """Move queued sequences into the running set, in arrival order, while there is room: a
        slot of MAX_ACTIVE_SEQS and, when the replica's KV room is known, room for the sequence's
        KV beside what the running ones reserve and the room granted to others still on their way
        (one that needs more than all of it runs alone)."""
        now = time.monotonic()
        queued = set(self.queue)
        running = [s for s in self.seqs.values() if s.id not in queued]
        n, held, started = len(running), sum(s.kv_charge for s in running), set()
        while self.queue and n < MAX_ACTIVE_SEQS:
            s = self.seqs[self.queue[0]]
            if (self.kv_room is not None and n
                    and held + self.grants.promised(started | {s.id}) + s.kv_charge > self.kv_room):
                if not s.kv_waited:
                    s.kv_waited = True
                    self.kv_waits += 1
                break
            if self.kv_room is not None and s.kv_charge > self.kv_room:
                log.warning("replica %d: sequence %d needs %d positions of KV, more than the %d its stages "
                            "hold beside their weights: it runs alone", self.rid, s.id, s.kv_charge, self.kv_room)
            self.queue.pop(0)
            started.add(s.id)
            s.queued_s += now - s.arrived
            n, held = n + 1, held + s.kv_charge
        self.kv_held, self.kv_peak = held, max(self.kv_peak, held)
        self.grants.settle(started, held, ((q, self.seqs[q].kv_charge) for q in self.queue))


def span_of(s: Seq, n: int, kind: SpanKind) -> WireSpan:
    p = s.params
    return WireSpan(s.id, s.fed, n, kind, s.offset + len(s.out), p.temperature, p.top_k, p.top_p, s.seed)


def kv_charge(s: Seq, rid: int, max_context: int) -> int:
    """KV positions `s` may hold on replica `rid`, as the stages' slots allocate them: its prompt
    and first token where another replica decodes it; else `decode_charge`."""
    if s.decode_rid != rid:
        return slot_capacity(s.prompt_len + 1)
    return decode_charge(s.prompt_len, s.max_tokens, bool(s.drafter), max_context)


def decode_charge(prompt_len: int, max_tokens: int, drafted: bool, max_context: int) -> int:
    """KV positions a sequence decoded on a replica may come to, as its slots allocate them: its
    longest context, prompt + max_tokens within the model's (+ a block of drafts that a verify
    span writes past it)."""
    return slot_capacity(min(prompt_len + max_tokens + (MAX_GAMMA + 1 if drafted else 0), max_context))
