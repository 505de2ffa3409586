"""The leader of a replica: stage 0 plus the scheduler of its micro-batches (Orca-style).

The leader keeps the replica's sequences and, whenever the compute thread is free, builds the
next micro-batch from them (`step`; its `Batcher` chooses the rows): every sequence ready to decode gets one row, then prompt
chunks fill the token budget (chunked prefill, so a long prompt never stalls running decodes),
fewest prompt tokens left first with aging (sim/router.prompt_priority, as the simulator orders them).
Up to one micro-batch per stage is in flight (pipeline parallelism); sequences join and leave
between micro-batches (iteration-level batching), so a new request never waits for an
unrelated long one. The leader runs stage 0 itself, sends the hidden states on, and gets the
chosen tokens back from the last stage in RESULTS.

Phases by replica role (roles/prefill.py and roles/decode.py hold what differs):
- mixed: prefills its own prompts and decodes them; no KV moves.
- prefill: after a prompt's last chunk each stage ships its KV to the decode replica chosen by
  the gateway; the first token goes to the gateway and, with the sequence's settings, to the
  decode replica's leader (HANDOFF). The sequence then leaves this replica.
- decode: a handed-off sequence starts once every stage has acknowledged its KV (KV_ACK).
  The prompt is never recomputed here (`Stage.tokens_computed` proves it).

Speculation (roles/verifier.py): a sequence with a drafter decodes by verifying its drafter's
blocks, one VERIFY span of gamma + 1 rows each; the stages roll their KV back to the committed
length when the next span starts earlier (rejected drafts).

KV admission: a queued sequence starts only while the replica's stages have room for its KV
(`kv_charge`: the slot its longest context needs, prompt + max_tokens within the model's
context; a prefill replica's only its prompt), counted against `kv_room`, the fewest positions
any stage of the replica holds beside its weights (roles/context.py kv_room, from the devices'
profiles). The queue is first come, first served; a sequence that needs more than the whole
room runs alone. Without it a small device decoding many long generations would run out of
memory (TGI's way: reserve the most a request may take, at admission).

A sequence finishes on a stop token, at max_tokens or at the context limit; it is then freed on
every stage (RELEASE). A RELEASE from the gateway aborts it the same way.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from meshllm.config import MAX_GAMMA
from meshllm.defaults import Role
from meshllm.engine.kvcache import slot_capacity
from meshllm.engine.sampling import SamplingParams
from meshllm.engine.speculative import AcceptanceStats, extend_hash
from meshllm.mesh.protocol import Message, MsgType, SpanKind, WireSpan, make
from meshllm.roles.context import PlanContext
from meshllm.roles.stage import Send, Stage, results_of
from meshllm.roles.verifier import WAIT, Block, Verifier
from meshllm.sim.router import prompt_priority

log = logging.getLogger("meshllm.leader")

TOKEN_BUDGET = 256  # rows per micro-batch, decodes first, then prompt chunks (chunked prefill)
MAX_ACTIVE_SEQS = 64  # sequences a replica decodes at once; more wait in its queue
RESULT_TIMEOUT_S = 120.0  # a micro-batch whose RESULTS never come back fails its sequences
KV_TIMEOUT_S = 120.0  # a handed-off sequence whose KV has not all arrived by then fails


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
    hash: int = 0  # hash of `out` (engine/speculative.py): which drafts were drafted after it
    spec: AcceptanceStats = field(default_factory=AcceptanceStats)
    waiting_since: float | None = None  # ready, waiting for its drafter's block since
    last_block_at: float | None = None
    block_interval_s: float | None = None
    kv_charge: int = 0  # KV positions reserved for it on every stage while it runs (Batcher.admit)
    kv_waited: bool = False  # it waited in the queue for KV room

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


class Batcher:
    """The leader's scheduling policy: what goes into its replica's next micro-batch. Every
    sequence ready to decode gets one row (a drafted one, its block to verify), spread over as
    many micro-batches as the pipeline has stages; then prompt chunks fill the TOKEN_BUDGET,
    fewest prompt tokens left first with aging. It works on the leader's sequence table and
    queue (the same objects)."""

    def __init__(self, seqs: dict[int, Seq], queue: list[int], n_stages: int, rid: int = 0,
                 max_context: int = 1 << 30, kv_room: int | None = None):
        self.seqs, self.queue, self.n_stages = seqs, queue, n_stages
        self.rid, self.max_context = rid, max_context
        self.kv_room = kv_room  # KV positions every stage holds (None: not known, no KV limit)
        self.kv_held = 0  # positions reserved by the running sequences
        self.kv_waits = 0  # sequences that waited for KV room
        self.kv_peak = 0  # most positions reserved at once

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
        return sorted(todo, key=lambda s: prompt_priority(s.prompt_len - s.fed, now - s.arrived))

    def _start_queued(self) -> None:
        """Move queued sequences into the running set, in arrival order, while there is room: a
        slot of MAX_ACTIVE_SEQS and, when the replica's KV room is known, room for the sequence's
        KV beside what the running ones reserve (one that needs more than all of it runs alone)."""
        now = time.monotonic()
        queued = set(self.queue)
        running = [s for s in self.seqs.values() if s.id not in queued]
        n, held = len(running), sum(s.kv_charge for s in running)
        while self.queue and n < MAX_ACTIVE_SEQS:
            s = self.seqs[self.queue[0]]
            if self.kv_room is not None and n and held + s.kv_charge > self.kv_room:
                if not s.kv_waited:
                    s.kv_waited = True
                    self.kv_waits += 1
                break
            if self.kv_room is not None and s.kv_charge > self.kv_room:
                log.warning("replica %d: sequence %d needs %d positions of KV, more than the %d its stages "
                            "hold beside their weights: it runs alone", self.rid, s.id, s.kv_charge, self.kv_room)
            self.queue.pop(0)
            s.queued_s += now - s.arrived
            n, held = n + 1, held + s.kv_charge
        self.kv_held, self.kv_peak = held, max(self.kv_peak, held)


class Leader:
    """Scheduler of one replica, on its stage-0 node's compute thread."""

    def __init__(self, stage: Stage, send: Send, max_context: int,
                 on_prefilled: Callable[[PlanContext, Seq, bool], None] | None = None, kv_room: int | None = None):
        self.stage, self.ctx, self._send = stage, stage.ctx, send
        self.rid, self.role = stage.replica.id, stage.replica.role
        self.n_stages = len(stage.replica.stages)
        self.max_context = max_context
        # prefill replicas: hand the sequence off (roles/prefill.py), under the plan in force now
        self.on_prefilled = on_prefilled
        self.seqs: dict[int, Seq] = {}
        self.queue: list[int] = []  # sequences not yet started, in arrival order
        # what goes into the next micro-batch; `kv_room`: KV positions each stage holds (KV admission)
        self.batch = Batcher(self.seqs, self.queue, self.n_stages, self.rid, max_context, kv_room)
        self.in_flight: dict[int, InFlight] = {}
        self._batch_ids = itertools.count(1)
        self.stats = {"micro_batches": 0, "rows": 0, "finished": 0, "aborted": 0}
        # decode replicas: (prefill ms, handoff ms) of recent sequences; handoff = from the prefill
        # replica having the first token to this replica holding all the KV and the token (one host's
        # monotonic clock: meaningful in emulation and benchmarks)
        self.handoffs: deque[tuple[float, float]] = deque(maxlen=64)
        self.verifier: Verifier | None = None  # decode and mixed replicas (roles/host.py sets it)
        self.outbox = Outbox(send)  # TOKENS for the gateways, sent when `step` says

    # -- the scheduler --------------------------------------------------------------------------
    def step(self) -> bool:
        """Launch the next micro-batch if the pipeline has room; True if one was launched. The
        tokens the last results produced (`Outbox`) go out after a launch of decode or verify rows
        only (a gateway in this process would otherwise hold up that short step on the critical
        path of every token), but before a launch that carries prompt rows (a long step: a token
        must not wait for it) and before any launch when a request's first or last token is among
        them (its TTFT or end would otherwise wait for the launch's stage-0 forward; once per
        request, so the pipeline barely notices)."""
        try:
            self._expire()
            if len(self.in_flight) >= self.n_stages:
                return False
            fl, ids = self.batch.build(self.verifier)
            if not fl.spans:
                return False
            long_step = any(sp.kind in (SpanKind.PREFILL, SpanKind.PREFILL_LAST) for sp in fl.spans)
            if long_step or self.outbox.urgent():
                self.outbox.flush()
            self._launch(fl, ids)
            return True
        finally:
            self.outbox.flush()

    def next_wake_s(self) -> float | None:
        """Seconds until the scheduler must look again without any message (a drafter's deadline)."""
        return self.verifier.next_deadline(time.monotonic()) if self.verifier else None

    def _launch(self, fl: InFlight, ids: list[int]) -> None:
        spans = fl.spans
        ship = {s.seq: self.seqs[s.seq].decode_rid for s in spans
                if s.kind is SpanKind.PREFILL_LAST and self.seqs[s.seq].decode_rid != self.rid}
        verify = {seq: (b.tokens, b.q_ids, b.q_p) for seq, b in fl.blocks.items()}
        out = self.stage.compute(torch.tensor(ids, dtype=torch.long), spans)
        self.stats["micro_batches"] += 1
        self.stats["rows"] += len(ids)
        batch = next(self._batch_ids)
        if self.n_stages == 1:
            self.stage.after_batch(spans, ship)
            self._apply(fl, results_of(out, spans, verify))
            return
        self.in_flight[batch] = fl
        wire_verify = [[seq, b.tokens, [] if b.q_ids is None else b.q_ids.tolist(),
                        [] if b.q_p is None else b.q_p.tolist()] for seq, b in fl.blocks.items()]
        self._send(self.ctx.next_stage(self.rid, 0),
                   make(MsgType.ACTIVATIONS, tensors={"hidden": out}, replica=self.rid, batch=batch,
                        plan_version=self.ctx.version, spans=[s.to_wire() for s in spans],
                        ship=[[k, v] for k, v in ship.items()], verify=wire_verify))
        self.stage.after_batch(spans, ship)  # after the micro-batch goes on: the KV is not on its critical path

    # -- results --------------------------------------------------------------------------------
    def on_results(self, msg: Message) -> None:
        fl = self.in_flight.pop(msg["batch"], None)
        if fl is None:
            log.warning("replica %d: results for unknown micro-batch %r", self.rid, msg["batch"])
            return
        self._apply(fl, msg["out"])

    def _apply(self, fl: InFlight, out: list) -> None:
        by_seq = {e[0]: e for e in out if isinstance(e, (list, tuple)) and len(e) == 3 and isinstance(e[0], int)}
        took = time.monotonic() - fl.sent
        for sp in fl.spans:
            s = self.seqs.get(sp.seq)
            if s is None or sp.kind is SpanKind.PREFILL:
                continue  # released meanwhile, or a chunk with no logits
            s.busy = False
            tokens = result_tokens(sp, by_seq.get(sp.seq), fl.blocks.get(sp.seq), self.stage.model.args.vocab_size)
            if tokens is None:
                self.fail(s, "the last stage returned no token")
                continue
            if sp.kind is SpanKind.PREFILL_LAST and s.decode_rid != self.rid:
                self._handoff(s, tokens[0])
                continue
            if sp.kind is SpanKind.VERIFY:
                s.fed = sp.start + len(tokens)  # the KV of rejected drafts is rolled back by the next span
            else:
                tokens = tokens[:1]
            block = fl.blocks.get(s.id)
            if block is not None:  # before the last TOKENS reports it
                self.verifier.record(s, block, *block_counts(s, len(block.tokens), tokens, self.max_context), took)
            n0 = len(s.out)
            finished = self.emit(s, tokens)
            if s.drafter and self.verifier:
                if sp.kind is SpanKind.PREFILL_LAST:
                    if finished is None:
                        self.verifier.started(s)  # a mixed replica's first token: the drafter may start
                else:
                    self.verifier.committed(s, block, s.out[n0:], finished is not None)

    def _handoff(self, s: Seq, token: int) -> None:
        del self.seqs[s.id]
        s.prefill_s = time.monotonic() - (s.launched or s.arrived)
        s.out.append(token)
        finished = finish_reason(s, token, self.max_context)
        self.outbox.tokens(s, [token], finished)
        if self.on_prefilled is not None:
            self.on_prefilled(self.ctx, s, finished is not None)

    def emit(self, s: Seq, tokens: list[int]) -> str | None:
        """New output tokens of `s` (several after a verified block): keep those up to the first stop
        token, max_tokens or the context limit, stream them to the gateway, and finish the sequence
        when done. Returns the finish reason, if it finished."""
        tokens = tokens[:kept(s, tokens, self.max_context)]
        s.out.extend(tokens)
        finished = finish_reason(s, tokens[-1], self.max_context) if tokens else None
        s.hash = extend_hash(s.hash, tokens)
        self.outbox.tokens(s, tokens, finished)
        if finished is not None:
            self.stats["finished"] += 1
            self.drop(s.id)
        return finished

    # -- ending sequences -----------------------------------------------------------------------
    def drop(self, seq: int) -> None:
        """Free a sequence here and on every other stage of this replica (and stop its drafter)."""
        s = self.seqs.pop(seq, None)
        if seq in self.queue:
            self.queue.remove(seq)
        if self.verifier is not None:
            if s is not None and s.drafter:
                self.verifier.verdict(s, -1, [], True)
            self.verifier.forget(seq)
        self.stage.release(seq)
        for st in self.stage.replica.stages[1:]:
            self._send(self.ctx.address(st.node), make(MsgType.RELEASE, seq=seq, reason="finished"))

    def fail(self, s: Seq, why: str) -> None:
        log.error("replica %d: sequence %d failed: %s", self.rid, s.id, why)
        self.stats["aborted"] += 1
        self.outbox.error(s, why)
        self.drop(s.id)

    def abort(self, seq: int) -> None:
        """The gateway gave up on `seq` (client gone, stop string): free it everywhere."""
        if seq in self.seqs:
            self.stats["aborted"] += 1
        self.drop(seq)

    def fail_all(self, why: str) -> None:
        for s in list(self.seqs.values()):
            self.fail(s, why)
        self.outbox.flush()  # this leader may be replaced before it steps again

    def _expire(self) -> None:
        now = time.monotonic()
        for s in [s for s in self.seqs.values() if s.missing_kv and now - s.arrived > KV_TIMEOUT_S]:
            self.fail(s, f"its KV did not arrive in {KV_TIMEOUT_S:g} s")  # it would hold a slot forever
        for batch, fl in list(self.in_flight.items()):
            if now - fl.sent > RESULT_TIMEOUT_S:
                del self.in_flight[batch]
                for sp in fl.spans:
                    if sp.seq in self.seqs:
                        self.fail(self.seqs[sp.seq], f"micro-batch {batch} got no results in {RESULT_TIMEOUT_S:g} s")

    def kv_ready(self, s: Seq) -> None:
        """A handed-off sequence holds its KV everywhere: note how long the handoff took."""
        if s.prefilled_at is not None:
            self.handoffs.append((round(1000 * s.prefill_s, 3), round(1000 * (time.monotonic() - s.prefilled_at), 3)))

    def load(self) -> dict:
        """What the gateway's router and `--status` see of this replica."""
        return {"replica": self.rid, "role": str(self.role), "queued": len(self.queue), "active": self.batch.active(),
                "in_flight": len(self.in_flight), "max_active": MAX_ACTIVE_SEQS, **self.stats,
                "kv_room": self.batch.kv_room, "kv_held": self.batch.kv_held, "kv_peak": self.batch.kv_peak,
                "kv_waits": self.batch.kv_waits,
                "handoffs": list(self.handoffs), **({"spec": self.verifier.load()} if self.verifier else {})}


class Outbox:
    """TOKENS messages for the gateways, held until `flush` (`Leader.step` says when)."""

    def __init__(self, send: Send):
        self._send = send
        self.items: list[tuple[str, Message]] = []

    def tokens(self, s: Seq, tokens: list[int], finished: str | None) -> None:
        """`s`'s new output `tokens` (the last ones of `s.out`), and its finish reason if it ended."""
        extra = {"spec": s.spec.to_json()} if finished is not None and s.spec.blocks else {}
        m = make(MsgType.TOKENS, seq=s.id, token_ids=tokens, index=s.offset + len(s.out) - len(tokens),
                 finished=finished is not None, finish_reason=finished, queue_ms=round(1000 * s.queued_s, 3),
                 **extra)
        s.queued_s = 0.0
        self.items.append((s.gateway, m))

    def error(self, s: Seq, why: str) -> None:
        self.items.append((s.gateway, make(MsgType.TOKENS, seq=s.id, token_ids=[], index=s.offset + len(s.out),
                                           finished=True, finish_reason="error", error=why)))

    def urgent(self) -> bool:
        """A request's first or last token is waiting (its TTFT or its end must not wait)."""
        return any(m["index"] == 0 or m["finished"] for _, m in self.items)

    def flush(self) -> None:
        """Send what waits, in order."""
        out, self.items = self.items, []
        for address, m in out:
            self._send(address, m)


def span_of(s: Seq, n: int, kind: SpanKind) -> WireSpan:
    p = s.params
    return WireSpan(s.id, s.fed, n, kind, s.offset + len(s.out), p.temperature, p.top_k, p.top_p, s.seed)


def finish_reason(s: Seq, last: int, max_context: int, extra: int = 0) -> str | None:
    """Why `s` ends with `last` (`extra` tokens after its current output), if it does."""
    if last in s.stop_ids:
        return "stop"
    if len(s.out) + extra >= s.max_tokens or s.context + extra >= max_context:
        return "length"
    return None


def kept(s: Seq, tokens: list[int], max_context: int) -> int:
    """How many of `tokens` `s` keeps: up to the first stop token, max_tokens or the context limit."""
    for i, t in enumerate(tokens):
        if finish_reason(s, t, max_context, i + 1) is not None:
            return i + 1
    return len(tokens)


def block_counts(s: Seq, drafted: int, tokens: list[int], max_context: int) -> tuple[int, int]:
    """(drafts counted, drafts accepted) of a verified block of `drafted` drafts that committed
    `tokens` (the accepted drafts, then the target's own token). When the request ends inside
    the block, drafts past its last kept token are not counted: the output never reaches them."""
    n = kept(s, tokens, max_context)
    accepted = len(tokens) - 1
    if n and finish_reason(s, tokens[n - 1], max_context, n) is not None:
        return min(drafted, n), min(accepted, n)
    return drafted, accepted


def result_tokens(sp: WireSpan, entry: list | None, block: Block | None, vocab: int) -> list[int] | None:
    """The tokens a RESULTS entry gives a span, or None if they cannot be its result: none, not
    token ids, or, for a VERIFY span, not its block's accepted drafts + one token (a wrong count
    would move the sequence past the KV its stages hold)."""
    toks = entry[1] if entry is not None else None
    if not isinstance(toks, list) or not toks or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in toks):
        return None
    if sp.kind is SpanKind.VERIFY and (block is None or len(toks) > sp.n or toks[:-1] != block.tokens[:len(toks) - 1]):
        return None
    return list(toks)


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


def is_phase(role: Role, phase: Role) -> bool:
    return role == Role.MIXED or role == phase
