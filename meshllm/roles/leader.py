"""The leader of a replica: stage 0 plus the scheduler of its micro-batches (Orca-style).

The leader keeps the replica's sequences and, whenever the compute thread is free, builds the
next micro-batch from them (`step`; its `Batcher`, roles/batcher.py, chooses the rows and
which queued sequences start: KV admission). Up to one micro-batch per stage is in flight (pipeline parallelism); sequences join and leave
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

A sequence finishes on a stop token, at max_tokens or at the context limit; it is then freed on
every stage (RELEASE). A RELEASE from the gateway aborts it the same way.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable

import torch

from meshllm.engine.speculative import extend_hash
from meshllm.mesh.protocol import Message, MsgType, SpanKind, WireSpan, make
from meshllm.roles.batcher import MAX_ACTIVE_SEQS, Batcher, InFlight, Seq
from meshllm.roles.context import PlanContext
from meshllm.roles.stage import Send, Stage, results_of
from meshllm.roles.verifier import Block, Verifier
from meshllm.sim.router import prompt_aging

log = logging.getLogger("meshllm.leader")

RESULT_TIMEOUT_S = 120.0  # x time_scale: a micro-batch whose RESULTS never come back fails its sequences
KV_TIMEOUT_S = 120.0  # x time_scale: a handed-off sequence whose KV has not all arrived by then fails
# x time_scale: a sequence with no output yet (queued, or its long prompt prefilling) tells its gateway
# it is alive this often, an empty TOKENS (a prompt of 8k tokens prefills for minutes on slow devices;
# the gateway's 60 s no-token timeout restarted it from scratch, for ever)
KEEPALIVE_S = 10.0


class Leader:
    """Scheduler of one replica, on its stage-0 node's compute thread."""

    def __init__(self, stage: Stage, send: Send, max_context: int,
                 on_prefilled: Callable[[PlanContext, Seq, bool], None] | None = None, kv_room: int | None = None,
                 time_scale: float = 1.0):
        self.stage, self.ctx, self._send = stage, stage.ctx, send
        self.rid, self.role = stage.replica.id, stage.replica.role
        self.n_stages = len(stage.replica.stages)
        self.max_context = max_context
        self.time_scale = time_scale  # emulation: devices this many times slower, so are its timeouts
        # prefill replicas: hand the sequence off (roles/prefill.py), under the plan in force now
        self.on_prefilled = on_prefilled
        self.seqs: dict[int, Seq] = {}
        self.queue: list[int] = []  # sequences not yet started, in arrival order
        # what goes into the next micro-batch; `kv_room`: KV positions each stage holds (KV admission)
        self.batch = Batcher(self.seqs, self.queue, self.n_stages, self.rid, max_context, kv_room, time_scale,
                             prompt_aging(stage.replica.prefill_tok_s))
        self.in_flight: dict[int, InFlight] = {}
        self._batch_ids = itertools.count(1)
        # finished: requests that ended here; handed_off: prompts this replica prefilled for another to decode
        self.stats = {"micro_batches": 0, "rows": 0, "finished": 0, "handed_off": 0, "aborted": 0}
        # decode replicas: (prefill ms, handoff ms) of recent sequences; handoff = from the prefill
        # replica having the first token to this replica holding all the KV and the token (one host's
        # monotonic clock: meaningful in emulation and benchmarks)
        self.handoffs: deque[tuple[float, float]] = deque(maxlen=64)
        self.verifier: Verifier | None = None  # decode and mixed replicas (roles/host.py sets it)
        self.outbox = Outbox(send)  # TOKENS for the gateways, sent when `step` says
        self._keepalive_at = 0.0

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
        verify = {seq: b.tokens for seq, b in fl.blocks.items()}
        out = self.stage.compute(torch.tensor(ids, dtype=torch.long), spans)
        self.stats["micro_batches"] += 1
        self.stats["rows"] += len(ids)
        batch = next(self._batch_ids)
        if self.n_stages == 1:
            self.stage.after_batch(spans, ship)
            self._apply(fl, results_of(out, spans, verify))
            return
        self.in_flight[batch] = fl
        wire_verify = [[seq, b.tokens] for seq, b in fl.blocks.items()]
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
        self._keepalive()

    def _handoff(self, s: Seq, token: int) -> None:
        del self.seqs[s.id]
        s.prefill_s = time.monotonic() - (s.launched or s.arrived)
        s.out.append(token)
        finished = finish_reason(s, token, self.max_context)
        self.outbox.tokens(s, [token], finished)
        self.stats["finished" if finished is not None else "handed_off"] += 1  # (one token asked: it ends here)
        if self.on_prefilled is not None:
            self.on_prefilled(self.ctx, s, finished is not None)

    def _keepalive(self) -> None:
        """A micro-batch came back, so this replica works: each sequence that has waited
        KEEPALIVE_S for its first token (queued behind others, or a long prompt in chunks) tells
        its gateway so, with an empty TOKENS at the index it waits for."""
        now, every = time.monotonic(), KEEPALIVE_S * self.time_scale
        if now - self._keepalive_at < min(1.0, every / 2):
            return
        self._keepalive_at = now
        for s in self.seqs.values():
            if not s.out and now - s.alive_at >= every:
                s.alive_at = now
                self.outbox.keepalive(s)

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
        self.batch.grants.take(seq)  # aborted before it came: the room promised to it is free
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
        self.batch.grants.clear()
        self.outbox.flush()  # this leader may be replaced before it steps again

    def _expire(self) -> None:
        now, kv_s, result_s = time.monotonic(), KV_TIMEOUT_S * self.time_scale, RESULT_TIMEOUT_S * self.time_scale
        for s in [s for s in self.seqs.values() if s.missing_kv and now - s.arrived > kv_s]:
            self.fail(s, f"its KV did not arrive in {kv_s:g} s")  # it would hold a slot forever
        for batch, fl in list(self.in_flight.items()):
            if now - fl.sent > result_s:
                del self.in_flight[batch]
                for sp in fl.spans:
                    if sp.seq in self.seqs:
                        self.fail(self.seqs[sp.seq], f"micro-batch {batch} got no results in {result_s:g} s")

    def kv_ready(self, s: Seq) -> None:
        """A handed-off sequence holds its KV everywhere: note how long the handoff took."""
        if s.prefilled_at is not None:
            self.handoffs.append((round(1000 * s.prefill_s, 3), round(1000 * (time.monotonic() - s.prefilled_at), 3)))

    def load(self) -> dict:
        """What the gateway's router and `--status` see of this replica."""
        return {"replica": self.rid, "role": str(self.role), "queued": len(self.queue), "active": self.batch.active(),
                "in_flight": len(self.in_flight), "max_active": MAX_ACTIVE_SEQS, **self.stats,
                "kv_room": self.batch.kv_room, "kv_held": self.batch.kv_held, "kv_peak": self.batch.kv_peak,
                "kv_waits": self.batch.kv_waits, "kv_denied": self.batch.grants.denied,
                "handoffs": list(self.handoffs), **({"spec": self.verifier.load()} if self.verifier else {})}


class Outbox:
    """TOKENS messages for the gateways, held until `flush` (`Leader.step` says when)."""

    def __init__(self, send: Send):
        self._send = send
        self.items: list[tuple[str, Message]] = []

    def tokens(self, s: Seq, tokens: list[int], finished: str | None) -> None:
        """`s`'s new output `tokens` (the last ones of `s.out`), and its finish reason if it ended."""
        # the drafting figures so far, whenever a block was verified since they last went: a gateway
        # that ends the request early (a stop string) has them (they came only with the last token)
        extra = {}
        if s.spec.blocks and (finished is not None or s.spec.blocks != s.spec_sent):
            extra, s.spec_sent = {"spec": s.spec.to_json()}, s.spec.blocks
        m = make(MsgType.TOKENS, seq=s.id, token_ids=tokens, index=s.offset + len(s.out) - len(tokens),
                 finished=finished is not None, finish_reason=finished, queue_ms=round(1000 * s.queued_s, 3),
                 **extra)
        s.queued_s = 0.0
        s.alive_at = time.monotonic()
        self.items.append((s.gateway, m))

    def keepalive(self, s: Seq) -> None:
        """No token yet, but `s` is queued or prefilling here (not stalled)."""
        self.items.append((s.gateway, make(MsgType.TOKENS, seq=s.id, token_ids=[], index=s.offset + len(s.out),
                                           finished=False, finish_reason=None)))

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

