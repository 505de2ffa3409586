"""The multi-tenant verification orchestrator of a decode (or mixed) replica.

Drafters publish DRAFT blocks on this replica's topic (`draft/<replica id>`); only this replica's
leader subscribes to it. The verifier keeps each tenant's pending blocks and, when the leader
builds a micro-batch, offers for every ready sequence the block drafted after exactly its
committed prefix (same length, same hash): one VERIFY span of gamma + 1 rows per block, many
tenants' blocks in one ragged forward (Orca-style iteration batching). The last stage applies
the acceptance rule (engine/speculative.py) and the leader commits the result; the verifier then
answers the drafter (VERDICT) and records acceptance. Blocks drafted after a prefix that is no
longer the committed one (an asynchronous drafter's guess that lost) are stale and dropped;
duplicates (a resent block) are harmless for the same reason. A drafter's proactive branches
(roles/branches.py) are blocks like any other, drafted after a prefix a verdict may commit; the
ones that lose are dropped the same way but not counted as stale look-ahead.

Fallback: a sequence whose drafter is gone (dead or left, or restarted: a new incarnation knows
nothing of its former life's sessions) is decoded autoregressively at once; one whose drafter is
alive but late waits at most `fallback_s` per step, then takes a plain step (the drafter
resynchronises from the VERDICT of that step); after SILENT_STEPS such steps in a row with no
block from the drafter, the sequence goes on without it. Tenants are isolated: one tenant's blocks,
rejections or silence never touch another's sequence.

Capacity: the leader publishes CAPACITY (free batch slots, queue, recent verification time) on
the `cap` topic; roles/decode.py moves sessions to a replica with room when the load is uneven.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from meshllm.engine.speculative import AcceptanceStats, ewma
from meshllm.mesh.fields import check_int_list, check_seq
from meshllm.mesh.protocol import Message, MsgType, make

log = logging.getLogger("meshllm.verifier")

FALLBACK_MIN_S = 1.0  # x time_scale: the least a ready sequence waits for its drafter's block
FALLBACK_INTERVALS = 4.0  # ... or this many of its recent block intervals, whichever is longer
SILENT_STEPS = 3  # plain steps in a row with no block from the drafter: it drafts for the sequence no more
MAX_PENDING = 16  # blocks kept per tenant, branches included (newest win): a runaway drafter cannot fill the memory
WAIT = object()  # take(): no block yet, keep waiting


@dataclass
class Block:
    no: int
    start: int  # committed length it was drafted after
    hash: int  # ... and that prefix's hash
    tokens: list[int]
    received: float
    ahead: bool = False  # arrived before its prefix was committed: drafted ahead of a verdict
    branch: bool = False  # drafted in a proactive branch (after one of the draft's other choices)


class Verifier:
    def __init__(self, leader, send: Callable[[str, Message], None], alive: Callable[[str], bool],
                 time_scale: float = 1.0, max_batch: int = 0, life: Callable[[str], int | None] = lambda node: None):
        self.leader, self._send, self.alive, self.life = leader, send, alive, life
        self.max_batch = max_batch  # blocks per forward (0: no limit; 1: one at a time, the baseline)
        self.fallback_min_s = FALLBACK_MIN_S * time_scale
        self.pending: dict[int, dict[int, Block]] = {}
        self.stats = AcceptanceStats()
        self.verify_ms: float | None = None
        self.fallbacks = 0  # plain steps of sessions whose drafter was late
        self.orphaned = 0  # sessions whose drafter died (or left) mid-generation

    # -- blocks in --------------------------------------------------------------------------------
    def on_draft(self, msg: Message, vocab: int) -> None:
        seq = check_seq(msg["seq"])
        s = self.leader.seqs.get(seq)
        if s is None or s.drafter != msg["tenant"]:
            return  # not (or no longer) ours: stale, finished, or another tenant's id
        tokens = check_int_list(msg["tokens"], "draft tokens", 0, vocab - 1, 64)
        s.silent_steps = 0  # (a well-formed block, even a stale one: the drafter is there)
        branch = msg.fields.get("branch") is True
        if not tokens or msg["start"] < s.context:
            self._stale(s, branch)
            return
        blocks = self.pending.setdefault(seq, {})
        blocks[msg["block"]] = Block(msg["block"], msg["start"], msg["hash"], tokens, time.monotonic(),
                                     msg["start"] > s.context, branch)
        while len(blocks) > MAX_PENDING:
            del blocks[min(blocks)]

    def _stale(self, s, branch: bool = False) -> None:
        """A block of `s` drafted after a prefix that lost: counted for the session and in all (a
        branch's is not look-ahead: not counted)."""
        if not branch:
            self.stats.stale += 1
            s.spec.stale += 1

    # -- the leader's questions ---------------------------------------------------------------------
    def oldest(self, s) -> float:
        """When the block `take` would verify for `s` arrived (inf without one): the leader serves
        the oldest blocks first, so with max_verify_batch set no tenant waits behind later ones."""
        return min((b.received for b in self.pending.get(s.id, {}).values()
                    if b.start == s.context and b.hash == s.hash), default=math.inf)

    def take(self, s, now: float, taken: int = 0):
        """For a ready speculative sequence: its block (verify it), WAIT, or None (plain step).
        `taken`: blocks already in this micro-batch (with max_batch set, the rest wait)."""
        if self.max_batch and taken >= self.max_batch:
            return WAIT
        blocks = self.pending.get(s.id, {})
        for no in sorted(blocks):
            b = blocks[no]
            if b.start < s.context:
                del blocks[no]
                self._stale(s, b.branch)
            elif b.start == s.context and b.hash == s.hash:
                del blocks[no]
                s.waiting_since = None
                return b
        if (why := self._lost(s)) is not None:  # the session goes on autoregressively
            log.warning("replica %d: seq %d lost its drafter %s (%s); decoding it without drafts", self.leader.rid,
                        s.id, s.drafter, why)
            s.drafter = ""
            self.orphaned += 1
            self.pending.pop(s.id, None)
            return None
        if s.waiting_since is None:
            s.waiting_since = now
        if now - s.waiting_since < self.fallback_s(s):
            return WAIT
        self.fallbacks += 1
        s.silent_steps += 1
        s.waiting_since = None
        return None

    def _lost(self, s) -> str | None:
        """Why `s`'s drafter drafts for it no more (None: it may). A drafter restarted before its
        peers saw it dead is alive but knows nothing of the sessions of its former life, so it
        answers no VERDICT: every step of those sessions waited `fallback_s` to the end of the
        request (~1.1 s a token). The same silence for any other reason ends after SILENT_STEPS."""
        if not self.alive(s.drafter):
            return "dead or gone"
        if s.drafter_life is not None and self.life(s.drafter) not in (None, s.drafter_life):
            return "restarted"
        if s.silent_steps >= SILENT_STEPS:
            return f"no block in its last {s.silent_steps} plain steps"
        return None

    def fallback_s(self, s) -> float:
        return max(self.fallback_min_s, FALLBACK_INTERVALS * (s.block_interval_s or 0.0))

    def next_deadline(self, now: float) -> float | None:
        """Seconds until a waiting sequence falls back (None: none waits)."""
        waits = [s.waiting_since + self.fallback_s(s) - now for s in self.leader.seqs.values()
                 if s.drafter and s.waiting_since is not None]
        return max(0.0, min(waits)) if waits else None

    # -- outcomes -------------------------------------------------------------------------------
    def record(self, s, block: Block, drafted: int, accepted: int, verify_s: float) -> None:
        """A verified block of `s`: of its `drafted` drafts that the output reaches (a request's
        last block may draft past its end), the target accepted `accepted`."""
        now = time.monotonic()
        s.spec.record(drafted, accepted, block.ahead)
        self.stats.record(drafted, accepted, block.ahead)
        self.verify_ms = ewma(self.verify_ms, 1000 * verify_s)
        if s.last_block_at is not None:
            s.block_interval_s = ewma(s.block_interval_s, now - s.last_block_at)
        s.last_block_at = now

    def committed(self, s, block: Block | None, tokens: list[int], finished: bool) -> None:
        """The leader committed `tokens` for `s` (a verified block, or a plain step): tell the drafter."""
        if block is None:  # a step without a block: the drafter gets the whole output to resync
            self.verdict(s, -1, list(s.out), finished)
        else:
            self.verdict(s, block.no, tokens, finished)

    def verdict(self, s, block: int, tokens: list[int], finished: bool) -> None:
        if not s.drafter or self._lost(s) is not None:
            return
        accepted = max(0, len(tokens) - 1) if block >= 0 else 0
        m = make(MsgType.VERDICT, tenant=s.drafter, seq=s.id, block=block, accepted=accepted, tokens=tokens,
                 context=s.context, hash=s.hash, replica=self.leader.rid, finished=finished)
        try:
            self._send(self.leader.ctx.address(s.drafter), m)
        except (KeyError, TimeoutError) as e:  # the drafter is gone: the sequence goes on without it
            log.warning("replica %d: no verdict to %s for seq %d: %s", self.leader.rid, s.drafter, s.id, e)
            s.drafter = ""
        if finished:
            self.pending.pop(s.id, None)

    def started(self, s) -> None:
        """A speculative sequence arrived here: note its drafter's life, and give the drafter the
        whole committed output."""
        s.drafter_life = self.life(s.drafter) if s.drafter else None
        self.verdict(s, -1, list(s.out), False)

    def forget(self, seq: int) -> None:
        self.pending.pop(seq, None)

    def load(self) -> dict:
        return {"acceptance_rate": self.stats.rate, "mean_acceptance_length": self.stats.mean_length,
                "verify_ms": None if self.verify_ms is None else round(self.verify_ms, 3),
                "fallback_steps": self.fallbacks, "orphaned_sessions": self.orphaned,
                **self.stats.to_json()}

