"""The drafter: an edge device running the W4A16 draft, drafting for many sessions at once.

A SESSION from the gateway names the sequence, its prompt, its sampling settings and the decode
replica whose topic (`draft/<replica>`) verifies it. The drafter prefills the prompt into its
own KV right away; the decode replica's first VERDICT gives it the committed output, and from
then on it drafts blocks of gamma tokens and publishes each as a DRAFT.

One loop serves every session (StarSD's one-for-many draft server): each step is one ragged
forward of the draft model with a row (or a catch-up chunk) for every session that may draft,
so the draft server is never idle while any session has work, and each session's state (KV
slot, tokens, blocks) is its own.

Modes:
- async: a session drafts block k+1 while block k is in flight, after its own guess of block
  k's bonus token; block k's verdict keeps block k+1 only if block k was fully accepted and the
  bonus matches the guess, else the drafter rolls its KV back to the committed length and
  drafts on from the corrected token ("no mutual waiting", seeds 000/001).
- sync: draft gamma, send, wait for the verdict, repeat (the baseline the seeds argue against).

Every block carries (session, block number, committed length and hash it was drafted after), so
duplicates and stale blocks are harmless. A block without a verdict in `resend_s` is published
again (ZeroMQ's slow joiner and high-water mark can drop PUB messages). With adaptive gamma a
session's draft length follows its measured acceptance and round trip, and an async session
drafts ahead only while the model says the look-ahead pays (engine/speculative.py: a look-ahead
block stands only after a fully accepted block whose bonus was guessed right).
For sampled requests the drafter samples from the draft's top-K distribution and sends exactly
that distribution, so the verifier's rejection rule stays lossless.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from meshllm.engine.model import SeqSpan, Transformer
from meshllm.engine.sampling import SamplingParams, probs, token_generator
from meshllm.engine.speculative import ASYNC_OUTSTANDING, choose_drafting, ewma, extend_hash
from meshllm.mesh.protocol import (
    Message,
    MsgType,
    ProtocolError,
    check_address,
    check_int_list,
    check_sampling,
    check_seq,
    make,
)
from meshllm.roles.pacer import Pacer

log = logging.getLogger("meshllm.drafter")

Q_TOP_K = 32  # draft distribution support sent with sampled blocks
MAX_OUTSTANDING = {"async": ASYNC_OUTSTANDING, "sync": 1}  # blocks in flight per session
RESEND_MIN_S = 2.0  # x time_scale: a block with no verdict this long is published again
DRAFT_SALT = 0xD7AF7  # the drafter's sampling generators differ from the target's
SESSION_IDLE_S = 120.0  # x time_scale: a session with no verdict this long is dropped
PREFILL_CHUNK = 256
LOOKAHEAD_SLACK = 1.1  # look-ahead rows may stretch a draft step by at most this factor


@dataclass
class OutBlock:
    no: int
    start: int
    hash: int
    tokens: list[int]
    qs: list[tuple[list[int], list[float]]]
    sent: float


@dataclass
class Session:
    seq: int
    prompt: list[int]
    max_tokens: int
    params: SamplingParams
    seed: int
    rid: int  # the decode replica verifying it
    gamma: int
    adaptive: bool
    mode: str
    gateway: str
    committed: list[int] = field(default_factory=list)  # verified output tokens
    hash: int = 0
    started: bool = False  # the first VERDICT came
    stream: list[int] = field(default_factory=list)  # drafted tokens after `committed`
    qs: list[tuple[list[int], list[float]]] = field(default_factory=list)  # their draft distributions
    fed: int = 0  # tokens of prompt + committed + stream in the draft KV
    blocks: list[OutBlock] = field(default_factory=list)  # published, no verdict yet
    next_no: int = 0
    block_end: int = 0  # stream index where the block being drafted ends
    heard: float = field(default_factory=time.monotonic)  # last SESSION / VERDICT for it
    alpha: float | None = None  # per-token acceptance estimate
    rtt_s: float | None = None
    draft_s: float | None = None
    pipeline: bool = True  # async: draft ahead of verdicts (adaptive sessions decide per estimate)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.committed + self.stream

    def block_start(self) -> int:
        """Stream index where the block being drafted starts (after each earlier block and its
        guessed bonus)."""
        return sum(len(b.tokens) + 1 for b in self.blocks)

    def can_draft(self) -> bool:
        limit = MAX_OUTSTANDING[self.mode] if self.pipeline else 1
        if not self.started or len(self.blocks) >= limit:
            return self.fed < len(self.prompt)  # a new session prefills its prompt meanwhile
        return len(self.committed) + len(self.stream) < self.max_tokens + self.gamma


class Drafter:
    def __init__(self, me: str, model: Transformer, send: Callable[[str, Message], None],
                 publish: Callable[[Message, int], None], pacer: Pacer | None, time_scale: float = 1.0):
        self.me, self.model, self._send, self.publish, self.pacer = me, model, send, publish, pacer
        self.cache = model.new_cache()
        self.sessions: dict[int, Session] = {}
        self.resend_s = RESEND_MIN_S * time_scale
        self.idle_s = SESSION_IDLE_S * time_scale
        self.busy_s = 0.0
        self.since: float | None = None  # first session's arrival: the busy fraction's window
        self.stats = {"steps": 0, "blocks": 0, "resent": 0, "resyncs": 0, "lookahead_deferred": 0}
        self.step_s: dict[int, float] = {}  # rows (one token each) -> measured step seconds

    # -- messages ---------------------------------------------------------------------------------
    def on_session(self, msg: Message, vocab: int, default_gamma: int) -> None:
        seq = check_seq(msg["seq"])
        prompt = check_int_list(msg["prompt_token_ids"], "prompt_token_ids", 0, vocab - 1,
                                self.model.args.max_seq_len - 1)
        gamma = msg["gamma"] if 1 <= msg["gamma"] <= 16 else default_gamma
        if not prompt or msg["mode"] not in MAX_OUTSTANDING or seq in self.sessions:
            raise ProtocolError(f"seq {seq}: bad SESSION (mode {msg['mode']!r}, {len(prompt)} prompt tokens)")
        t, k, p, seed = check_sampling(msg["sampling"])
        check_address(msg["gateway"], "gateway")
        if msg["max_tokens"] < 1:
            raise ProtocolError(f"seq {seq}: max_tokens must be positive")
        self.sessions[seq] = Session(seq, prompt, msg["max_tokens"], SamplingParams(t, k, p), seed,
                                     msg["decode_replica"], gamma, bool(msg["adaptive"]), msg["mode"],
                                     str(msg["gateway"]))
        self.cache.allocate(seq, min(len(prompt) + msg["max_tokens"] + 2 * gamma + 2, self.model.args.max_seq_len))
        self.since = self.since or time.monotonic()

    def on_verdict(self, msg: Message) -> None:
        s = self.sessions.get(check_seq(msg["seq"]))
        if s is None or msg["tenant"] != self.me:
            return
        if msg["finished"]:
            self.end(s.seq)
            return
        room = self.model.args.max_seq_len - len(s.prompt) - (len(s.committed) if msg["block"] >= 0 else 0)
        tokens = check_int_list(msg["tokens"], "tokens", 0, self.model.args.vocab_size - 1, room)
        s.heard = time.monotonic()
        s.rid = msg["replica"]  # the session may have moved to another decode replica
        if msg["block"] < 0:
            self._resync(s, tokens)  # the whole output: first token, a step taken without us, migration
        else:
            self._commit(s, tokens, msg)
        if msg["hash"] != s.hash or msg["context"] != len(s.prompt) + len(s.committed):
            log.warning("%s: seq %d out of step with its verifier; waiting for a full verdict", self.me, s.seq)
            s.started = False

    def _commit(self, s: Session, tokens: list[int], msg: Message) -> None:
        """Block `msg["block"]` committed `tokens` (accepted drafts + the target's token)."""
        done = next((b for b in s.blocks if b.no == msg["block"]), None)
        if done is not None:
            self._learn(s, done, msg["accepted"], time.monotonic())
        kept = done is not None and s.stream[:len(tokens)] == tokens  # the bonus guess came true
        s.committed += tokens
        s.hash = extend_hash(s.hash, tokens)
        if kept:  # later blocks were drafted after exactly this: they stand
            s.stream, s.qs = s.stream[len(tokens):], s.qs[len(tokens):]
            s.blocks = [b for b in s.blocks if b.no != done.no]
        else:
            self._rollback(s, len(s.prompt) + len(s.committed) - 1)

    def _resync(self, s: Session, out: list[int]) -> None:
        """Adopt the verifier's whole output; keep the KV of the longest common prefix."""
        old, new = s.tokens, s.prompt + out
        common = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
        self.stats["resyncs"] += s.started
        s.committed, s.hash, s.started = list(out), extend_hash(0, out), True
        self._rollback(s, min(common, len(new) - 1))

    def _rollback(self, s: Session, keep: int) -> None:
        """Drop the speculative stream and its blocks; the draft KV keeps `keep` positions at most."""
        s.stream, s.qs, s.blocks = [], [], []
        s.fed = min(s.fed, keep)
        self.cache.truncate(s.seq, min(self.cache.length(s.seq), s.fed))

    def _learn(self, s: Session, b: OutBlock, accepted: int, now: float) -> None:
        """Acceptance and round-trip estimates for adaptive gamma."""
        rejected = 1 if accepted < len(b.tokens) else 0
        s.alpha = ewma(s.alpha, accepted / max(1, accepted + rejected))
        s.rtt_s = ewma(s.rtt_s, now - b.sent)
        if s.adaptive and s.draft_s:
            s.gamma, pipe = choose_drafting(min(s.alpha, 0.98), s.draft_s, 0.0, s.rtt_s, s.mode == "async")
            s.pipeline = s.mode == "async" and pipe

    def replan(self, unchanged: Callable[[int], bool]) -> None:
        """A new plan: sessions whose decode replica changed are over (their requests failed)."""
        for s in list(self.sessions.values()):
            if not unchanged(s.rid):
                self.end(s.seq)

    def end(self, seq: int) -> None:
        if self.sessions.pop(seq, None) is not None:
            self.cache.free(seq)

    # -- the loop -----------------------------------------------------------------------------------
    def step(self) -> bool:
        """One batched draft forward over every session that may draft; True if any did."""
        now = time.monotonic()
        self._resend(now)
        ready = self._rows([s for s in self.sessions.values()
                            if s.can_draft() and len(s.tokens) < self.model.args.max_seq_len])
        if not ready:
            return False
        spans, ids = [], []
        for s in ready:
            feed = s.tokens[s.fed:s.fed + PREFILL_CHUNK]
            spans.append(SeqSpan(s.seq, s.fed, len(feed)))
            ids.extend(feed)
        t0 = time.perf_counter()
        rows = torch.tensor([sum(sp.n_tokens for sp in spans[:i + 1]) - 1 for i in range(len(spans))])
        if self.pacer is not None and self.pacer.predict is not None:
            with self.pacer.step(spans, len(spans)):
                logits = self.model(torch.tensor(ids), spans, self.cache, logits_rows=rows)
        else:
            logits = self.model(torch.tensor(ids), spans, self.cache, logits_rows=rows)
        took = time.perf_counter() - t0
        self.busy_s += took
        self.stats["steps"] += 1
        if len(ids) == len(spans):
            self.step_s[len(spans)] = ewma(self.step_s.get(len(spans)), took)
        for i, (s, sp) in enumerate(zip(ready, spans)):
            s.fed += sp.n_tokens
            if s.started and s.fed == len(s.tokens):  # caught up: this row's logits draft a token
                s.draft_s = ewma(s.draft_s, took)
                self._extend(s, logits[i:i + 1])
        return True

    def _rows(self, ready: list[Session]) -> list[Session]:
        """The sessions this step drafts for. Look-ahead rows (a session drafting past a block that
        awaits its verdict, mostly thrown away) ride along only while they leave the step's
        measured time within LOOKAHEAD_SLACK of the committed-prefix rows' alone: on a shared,
        compute-bound draft server they must not slow the sessions whose drafts will stand."""
        first = [s for s in ready if not s.blocks]
        ahead = [s for s in ready if s.blocks]
        if not first or not ahead:
            return ready
        base = self.step_s.get(len(first))
        n = len(first)
        while n < len(ready):
            cost = self.step_s.get(n + 1)
            if base is not None and cost is not None and cost > LOOKAHEAD_SLACK * base:
                break
            n += 1
        self.stats["lookahead_deferred"] += len(ready) - n
        return first + ahead[:n - len(first)]

    def _extend(self, s: Session, logits: torch.Tensor) -> None:
        """Append one drafted token; publish the block when it is complete."""
        index = len(s.committed) + len(s.stream)
        if s.params.greedy:
            tok, q = int(logits.argmax(-1)[0]), ([], [])
        else:
            p = probs(logits, s.params)[0]
            top = p.topk(min(Q_TOP_K, p.shape[-1]))
            qp = top.values / top.values.sum()
            pick = int(torch.multinomial(qp, 1, generator=token_generator(s.seed ^ DRAFT_SALT, index))[0])
            tok, q = int(top.indices[pick]), (top.indices.tolist(), qp.tolist())
        s.stream.append(tok)
        s.qs.append(q)
        start = s.block_start()
        if len(s.stream) - start == s.gamma:
            self._publish(s, start)

    def _publish(self, s: Session, start: int) -> None:
        tokens, qs = s.stream[start:start + s.gamma], s.qs[start:start + s.gamma]
        b = OutBlock(s.next_no, len(s.prompt) + len(s.committed) + start,
                     extend_hash(s.hash, s.stream[:start]), tokens, qs, time.monotonic())
        s.next_no += 1
        s.blocks.append(b)
        self.stats["blocks"] += 1
        self.publish(self._message(s, b), s.rid)

    def _message(self, s: Session, b: OutBlock) -> Message:
        greedy = s.params.greedy
        q_ids = torch.zeros((0, 0), dtype=torch.int32) if greedy else torch.tensor([q[0] for q in b.qs], dtype=torch.int32)
        q_p = torch.zeros((0, 0), dtype=torch.float16) if greedy else torch.tensor([q[1] for q in b.qs]).half()
        after = (s.prompt + s.committed + s.stream)[b.start - 1]
        return make(MsgType.DRAFT, tensors={"q_ids": q_ids, "q_p": q_p}, tenant=self.me, seq=s.seq, block=b.no,
                    start=b.start, after=after, hash=b.hash, tokens=b.tokens, plan_version=0)

    def _resend(self, now: float) -> None:
        for s in [s for s in self.sessions.values() if now - s.heard > self.idle_s]:
            log.warning("%s: session %d heard nothing for %.0f s; dropped", self.me, s.seq, now - s.heard)
            self.end(s.seq)  # its verifier and its gateway are gone: memory stays bounded
        for s in self.sessions.values():
            for b in s.blocks:
                if now - b.sent > self.resend_s:
                    b.sent = now
                    self.stats["resent"] += 1
                    self.publish(self._message(s, b), s.rid)

    def next_wake_s(self) -> float | None:
        sent = [b.sent for s in self.sessions.values() for b in s.blocks]
        return max(0.0, min(sent) + self.resend_s - time.monotonic()) if sent else None

    def load(self) -> dict:
        """Sessions, draft steps, busy time (cumulative: callers difference two readings for a
        window) and, when emulating, the pacer's figures."""
        window = time.monotonic() - self.since if self.since else 0.0
        out = {"sessions": len(self.sessions), "busy_s": round(self.busy_s, 3),
               "busy_fraction": round(self.busy_s / window, 4) if window else None,
               "pipelined_sessions": sum(1 for s in self.sessions.values() if s.mode == "async" and s.pipeline),
               **self.stats}
        if self.pacer is not None:
            out["pacer"] = self.pacer.summary()
        return out
