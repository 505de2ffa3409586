"""A pipeline stage: layers [start, end) of the target on this node, its KV cache, its pacing.

Every node that holds a stage runs one `Stage` on its compute thread:
- ACTIVATIONS (from the previous stage): run its layers over the ragged micro-batch; forward
  the hidden states to the next stage, or, on the last stage, choose the tokens of the rows
  that need logits (`engine.sampling.choose_tokens`, the reference's sampling) and send RESULTS
  to the replica's leader (stage 0, roles/leader.py), which runs `compute` itself.
- After the last prompt chunk of a sequence on a prefill replica (`ship`), export this stage's
  KV of that sequence and push it at once to the stages of the decode replica holding those
  layers (re-sharded by layer index), then free the slot (Splitwise's overlapped transfer).
- KV_TRANSFER (on a decode replica): import, and once this stage holds all its layers of the
  sequence, KV_ACK to its leader.
- RELEASE: free the sequence's slot; a tombstone drops KV that is still on its way.

Everything from the network is checked first (ProtocolError: the sender gets ERROR, the node
keeps serving). Compute time is stretched by the Pacer to the device profile's prediction.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

import torch

from meshllm.defaults import DECODE_TARGETS
from meshllm.engine.model import SeqSpan, Transformer
from meshllm.engine.sampling import SamplingParams, choose_tokens, greedy_tokens
from meshllm.engine.speculative import verify_block
from meshllm.mesh.fields import Tombstones, check_int_list, check_seq
from meshllm.mesh.protocol import Message, MsgType, ProtocolError, SpanKind, WireSpan, make
from meshllm.roles.context import PlanContext
from meshllm.roles.pacer import Pacer

log = logging.getLogger("meshllm.stage")

Send = Callable[[str, Message], None]


def logit_rows(spans: Sequence[WireSpan]) -> list[int]:
    """Packed-row indices whose logits a micro-batch needs, span by span."""
    rows, lo = [], 0
    for s in spans:
        if s.kind in (SpanKind.PREFILL_LAST, SpanKind.DECODE):
            rows.append(lo + s.n - 1)
        elif s.kind is SpanKind.VERIFY:
            rows.extend(range(lo, lo + s.n))
        lo += s.n
    return rows


def results_of(logits: torch.Tensor, spans: Sequence[WireSpan], verify: dict[int, list[int]] | None = None,
               skip: set[int] = frozenset()) -> list[list]:
    """RESULTS entries [seq, tokens, margins] from the logits of `logit_rows(spans)`, in order.
    A VERIFY span's tokens are the ones its block commits (accepted drafts + the target's token);
    `verify` maps its sequence to its draft tokens (engine/speculative.py). Spans whose
    index is in `skip` (strays: Stage._check_spans) get no entry."""
    out, r = [], 0
    for i, s in enumerate(spans):
        n = 0 if s.kind is SpanKind.PREFILL else (s.n if s.kind is SpanKind.VERIFY else 1)
        if n and i not in skip:
            chosen = _choose(logits[r:r + n], s, verify)
            if chosen is not None:  # else: non-finite logits, that sequence fails
                out.append([s.seq, chosen[0], [round(m, 6) for m in chosen[1]]])
        r += n
    return out


def _choose(logits: torch.Tensor, s: WireSpan, verify: dict[int, list[int]] | None) -> tuple[list, list] | None:
    """(tokens, margins) of one span's logit rows, or None if the rows are not finite. Greedy decode
    rows take the one top-2 pass (their finiteness shows in the margins); the rest check first."""
    params = SamplingParams(s.temperature, s.top_k, s.top_p)
    if params.greedy and s.kind is not SpanKind.VERIFY:
        toks, marg = greedy_tokens(logits)
        return (toks, marg) if all(math.isfinite(m) for m in marg) else None
    if not bool(torch.isfinite(logits).all()):
        return None
    if s.kind is SpanKind.VERIFY:
        draft = (verify or {}).get(s.seq)
        if draft is None or len(draft) != logits.shape[0] - 1:
            raise ProtocolError(f"seq {s.seq}: a VERIFY span of {logits.shape[0]} rows without its "
                                f"{logits.shape[0] - 1} drafts")
        return verify_block(logits, draft, params, s.seed, s.index)
    return choose_tokens(logits, params, s.seed, s.index)


def parse_verify(x: object, vocab: int) -> dict[int, list[int]]:
    """ACTIVATIONS' `verify` list of [seq, draft tokens] -> seq -> draft tokens."""
    if not isinstance(x, (list, tuple)):
        raise ProtocolError("verify must be a list")
    out = {}
    for e in x:
        if not isinstance(e, (list, tuple)) or len(e) != 2:
            raise ProtocolError(f"bad verify entry {e!r:.60}")
        out[check_seq(e[0])] = check_int_list(e[1], "draft tokens", 0, vocab - 1, 64)
    return out


def check_verify(spans: Sequence[WireSpan], verify: dict[int, list[int]]) -> None:
    """Every VERIFY span comes with its drafts (one fewer than its rows)."""
    for s in spans:
        if s.kind is SpanKind.VERIFY:
            draft = verify.get(s.seq)
            if draft is None or len(draft) != s.n - 1:
                raise ProtocolError(f"seq {s.seq}: a VERIFY span of {s.n} rows without its drafts")


class Stage:
    def __init__(self, ctx: PlanContext, model: Transformer, send: Send, pacer: Pacer | None = None):
        mine = ctx.mine
        if mine is None:
            raise ValueError(f"{ctx.me} holds no stage in plan v{ctx.version}")
        self.ctx, self.model, self._send, self.pacer = ctx, model, send, pacer
        self.replica, self.index = mine
        self.first, self.last = self.index == 0, self.index == len(self.replica.stages) - 1
        self.cache = model.new_cache()
        self._tombstones = Tombstones()  # released sequences: late KV (and requests) for them are dropped
        self._kv_have: dict[int, set[int]] = {}  # seq -> layers imported so far (decode replicas)
        self.kv_bytes_sent = self.kv_bytes_received = 0
        self.tokens_computed = {k: 0 for k in SpanKind}  # rows run, by span kind
        self.strays: set[int] = set()  # spans of the last micro-batch that did not fit (_check_spans)

    @property
    def layers(self) -> tuple[int, int]:
        return self.model.start, self.model.end

    # -- compute ------------------------------------------------------------------------------
    def compute(self, x: torch.Tensor, spans: Sequence[WireSpan]) -> torch.Tensor:
        """Run this stage over a micro-batch: hidden states out, or (last stage) the logits of
        `logit_rows(spans)`. `x` is token ids on stage 0, hidden states after it."""
        zombies, self.strays = self._check_spans(spans, x)
        model_spans = []
        for i, s in enumerate(spans):
            sid = s.seq if i not in self.strays else -1 - i  # a scratch slot (wire ids are >= 0)
            if i in self.strays:
                zombies.add(sid)
                self.cache.allocate(sid, s.start + s.n, length=s.start)
            elif s.seq not in self.cache:
                self.cache.allocate(s.seq, s.start + s.n, length=s.start if s.seq in zombies else 0)
            model_spans.append(SeqSpan(sid, s.start, s.n))
            self.tokens_computed[s.kind] += s.n
        rows = torch.tensor(logit_rows(spans), dtype=torch.long) if self.last else None
        try:
            if self.pacer is not None and self.pacer.predict is not None:
                with self.pacer.step(spans, 0 if rows is None else len(rows)):
                    return self.model(x, model_spans, self.cache, logits_rows=rows)
            return self.model(x, model_spans, self.cache, logits_rows=rows)
        finally:
            for seq in zombies:
                self.cache.free(seq)

    def _check_spans(self, spans: Sequence[WireSpan], x: torch.Tensor) -> tuple[set[int], set[int]]:
        """Validate a micro-batch against this stage's cache, then roll back rejected drafts. Returns
        the released sequences it still carries and, after stage 0, the indices of spans that do not
        fit this stage's KV (a sequence this stage lost, or a forged span): both run on scratch slots
        and are discarded, so the other sequences' rows stay exactly as they would be without them;
        a stray span gets no result, so only its own sequence fails, never its whole micro-batch."""
        rows = sum(s.n for s in spans)
        if not spans or x.shape[0] != rows:
            raise ProtocolError(f"micro-batch of {x.shape[0]} rows for spans covering {rows}")
        if not self.first and (x.dim() != 2 or x.shape[1] != self.model.args.dim):
            raise ProtocolError(f"hidden states of shape {tuple(x.shape)}, expected ({rows}, {self.model.args.dim})")
        seen: set[int] = set()
        zombies: set[int] = set()
        strays: set[int] = set()
        rollback: dict[int, int] = {}
        for i, s in enumerate(spans):
            if s.start + s.n > self.model.args.max_seq_len:
                raise ProtocolError(f"seq {s.seq}: position {s.start + s.n} beyond the context")
            have = self.cache.length(s.seq) if s.seq in self.cache else 0
            if s.seq in seen or not (s.start == have or (s.seq in self._tombstones and s.seq not in self.cache)
                                     or (s.kind in (SpanKind.DECODE, SpanKind.VERIFY) and 0 < s.start < have)):
                if self.first:
                    raise ProtocolError(f"seq {s.seq}: span at {s.start} but this stage holds {have} positions")
                strays.add(i)
            elif s.seq not in self.cache and s.start > 0:
                zombies.add(s.seq)
            elif s.start < have:
                rollback[s.seq] = s.start  # drafts the last verification rejected
            seen.add(s.seq)
        for seq, n in rollback.items():
            self.cache.truncate(seq, n)
        return zombies, strays

    def after_batch(self, spans: Sequence[WireSpan], ship: dict[int, int]) -> None:
        """Ship the KV of sequences whose prompt just ended here to their decode replica."""
        for s in spans:
            if s.kind is SpanKind.PREFILL_LAST and s.seq in ship and s.seq in self.cache:
                self.ship_kv(s.seq, ship[s.seq])  # (not in the cache: released mid-prefill)

    # -- messages -------------------------------------------------------------------------------
    def on_activations(self, msg: Message) -> None:
        """A micro-batch from the previous stage (never called on stage 0). Everything is checked
        before the forward writes any KV."""
        if self.first:
            raise ProtocolError("ACTIVATIONS for a replica's first stage (its leader runs that stage)")
        spans = [WireSpan.from_wire(x) for x in msg["spans"]]
        ship = parse_ship(msg["ship"])
        if any(not (self.ctx.has_replica(r) and self.ctx.replica(r).role in DECODE_TARGETS) for r in ship.values()):
            raise ProtocolError(f"ship {sorted(set(ship.values()))}: not decode or mixed replicas of plan "
                                f"v{self.ctx.version}")
        verify = parse_verify(msg["verify"], self.model.args.vocab_size)
        check_verify(spans, verify)
        hidden = msg.tensors["hidden"]
        if hidden.dtype not in ("float32", "bfloat16"):
            raise ProtocolError(f"hidden states of dtype {hidden.dtype}")
        x = hidden.torch().to(self.model.act_dtype)
        if not bool(torch.isfinite(x).all()):
            raise ProtocolError("hidden states hold NaN or infinity")
        out = self.compute(x, spans)
        rid, batch, v = self.replica.id, msg["batch"], self.ctx.version
        if self.last:
            self._send(self.ctx.leader(rid), make(MsgType.RESULTS, replica=rid, batch=batch, plan_version=v,
                                                  out=results_of(out, spans, verify, self.strays)))
        else:
            self._send(self.ctx.next_stage(rid, self.index),
                       make(MsgType.ACTIVATIONS, tensors={"hidden": out}, replica=rid, batch=batch, plan_version=v,
                            spans=msg["spans"], ship=msg["ship"], verify=msg["verify"]))
        self.after_batch(spans, ship)  # after the micro-batch goes on: the KV is not on its critical path

    def ship_kv(self, seq: int, rid: int) -> None:
        k, v = self.cache.export(seq)  # (n_layers, nkv, length, hd) each
        length = k.shape[2]
        for node, (a, b) in self.ctx.holders(rid, self.layers):
            lo, hi = a - self.layers[0], b - self.layers[0]
            m = make(MsgType.KV_TRANSFER, tensors={"k": k[lo:hi], "v": v[lo:hi]}, seq=seq, layers=[a, b],
                     length=length, replica=rid, plan_version=self.ctx.version)
            self.kv_bytes_sent += m.nbytes
            self._send(self.ctx.address(node), m)
        self.cache.free(seq)

    def migrate_out(self, seq: int, rid: int, length: int) -> None:
        """Ship the first `length` positions of a sequence's KV to replica `rid`, then free it (a
        session moving to another decode replica; positions beyond are rejected drafts)."""
        if seq in self.cache:
            self.cache.truncate(seq, min(length, self.cache.length(seq)))
            self.ship_kv(seq, rid)

    def on_kv_transfer(self, msg: Message) -> bool:
        """Import one layer range of a sequence's KV; True once this stage holds all its layers
        (the caller acknowledges to the leader)."""
        seq = check_seq(msg["seq"])
        if seq in self._tombstones:
            return False
        a, b = parse_layers(msg["layers"], self.layers)
        k, v = msg.tensors["k"], msg.tensors["v"]
        shape = (b - a, self.model.args.n_kv_heads, msg["length"], self.model.args.head_dim)
        if k.shape != shape or v.shape != shape or k.dtype != v.dtype or msg["length"] < 1:
            raise ProtocolError(f"seq {seq}: KV of shape {k.shape}/{v.shape}, expected {shape}")
        if k.dtype not in ("float32", "bfloat16", "float16") or msg["length"] > self.model.args.max_seq_len:
            raise ProtocolError(f"seq {seq}: KV of {msg['length']} positions of {k.dtype}")
        if seq in self.cache and (seq not in self._kv_have or not self._kv_have[seq].isdisjoint(range(a, b))
                                  or self.cache.length(seq) != msg["length"]):  # a duplicate, or another sequence's
            raise ProtocolError(f"seq {seq}: KV for layers [{a}, {b}) that this stage holds already")
        dtype = self.cache.dtype
        self.cache.import_seq(seq, k.torch().to(dtype), v.torch().to(dtype), a)
        self.kv_bytes_received += k.nbytes + v.nbytes
        have = self._kv_have.setdefault(seq, set())
        have.update(range(a, b))
        if len(have) == self.layers[1] - self.layers[0]:
            del self._kv_have[seq]
            return True
        return False

    def release(self, seq: int) -> None:
        self.cache.free(seq)
        self._kv_have.pop(seq, None)
        self._tombstones.add(seq)

    def released(self, seq: int) -> bool:
        return seq in self._tombstones


def parse_ship(x: object) -> dict[int, int]:
    if not isinstance(x, (list, tuple)):
        raise ProtocolError("ship must be a list of [seq, replica]")
    out = {}
    for e in x:
        if not isinstance(e, (list, tuple)) or len(e) != 2 or not isinstance(e[1], int):
            raise ProtocolError(f"bad ship entry {e!r:.60}")
        out[check_seq(e[0])] = e[1]
    return out


def parse_layers(x: object, mine: tuple[int, int]) -> tuple[int, int]:
    if (not isinstance(x, (list, tuple)) or len(x) != 2 or not all(isinstance(i, int) for i in x)
            or not mine[0] <= x[0] < x[1] <= mine[1]):
        raise ProtocolError(f"layers {x!r:.40} are not inside this stage's {list(mine)}")
    return x[0], x[1]
