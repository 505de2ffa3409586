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
  drafts on from the corrected token ("no mutual waiting", seeds 000/001). A greedy async session
  also drafts proactively where a block in flight is likely to be rejected (SpecEdge): at the
  positions the draft was least sure of, it takes its runner-up token and drafts a block after it
  in a branch of its own (a forked KV slot), published before the verdict that would need it. The
  verifier takes whichever block was drafted after exactly the committed prefix, so when the
  target's correction is that runner-up, the branch's block is verified at once, no round trip,
  and the drafter adopts the branch as its stream (roles/branches.py). Branch rows ride only in
  the room a draft step has left (the same measured rule as look-ahead rows).
- sync: draft gamma, send, wait for the verdict, repeat (the baseline the seeds argue against).

Every block carries (session, block number, committed length and hash it was drafted after), so
duplicates and stale blocks are harmless. A block without a verdict in `resend_s` is published
again (ZeroMQ's slow joiner and high-water mark can drop PUB messages). With adaptive gamma a
session's draft length follows its measured acceptance and round trip, and an async session
drafts ahead only while the model says the look-ahead pays (engine/speculative.py: a look-ahead
block stands only after a fully accepted block whose bonus was guessed right).
For sampled requests the drafter draws each token from the draft's top-K distribution with the
Gumbel noise the target draws that output index with (engine/sampling.py): where the two
distributions are close it proposes the target's own draw, which the verifier accepts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from meshllm.config import MAX_GAMMA
from meshllm.engine.model import SeqSpan, Transformer
from meshllm.engine.sampling import SamplingParams, gumbel, probs, token_generator
from meshllm.engine.speculative import (
    ASYNC_OUTSTANDING,
    Choices,
    choices,
    choose_drafting,
    ewma,
    extend_hash,
)
from meshllm.mesh.fields import (
    Tombstones,
    check_address,
    check_int_list,
    check_offset,
    check_sampling,
    check_seq,
)
from meshllm.mesh.protocol import Message, MsgType, ProtocolError, make
from meshllm.roles.branches import Branch, Branches
from meshllm.roles.pacer import Pacer

log = logging.getLogger("meshllm.drafter")

Q_TOP_K = 32  # the draft's most likely tokens a sampled draft is drawn among
MAX_OUTSTANDING = {"async": ASYNC_OUTSTANDING, "sync": 1}  # blocks in flight per session
RESEND_MIN_S = 2.0  # x time_scale: a block with no verdict this long is published again
SESSION_IDLE_S = 120.0  # x time_scale: a session with no verdict this long is dropped
PREFILL_CHUNK = 256
LOOKAHEAD_SLACK = 1.1  # look-ahead rows may stretch a draft step by at most this factor


@dataclass
class OutBlock:
    no: int
    start: int
    hash: int
    tokens: list[int]
    sent: float
    branch: bool = False  # drafted in a proactive branch


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
    offset: int = 0  # output tokens before this attempt (a resumed request's): its draws' indices follow them
    committed: list[int] = field(default_factory=list)  # verified output tokens
    hash: int = 0
    started: bool = False  # the first VERDICT came
    stream: list[int] = field(default_factory=list)  # drafted tokens after `committed`
    fed: int = 0  # tokens of prompt + committed + stream in the draft KV
    blocks: list[OutBlock] = field(default_factory=list)  # published, no verdict yet
    next_no: int = 0
    heard: float = field(default_factory=time.monotonic)  # last SESSION / VERDICT for it
    alpha: float | None = None  # per-token acceptance estimate
    rtt_s: float | None = None
    draft_s: float | None = None
    pipeline: bool = True  # async: draft ahead of verdicts (adaptive sessions decide per estimate)
    slot: int = -1  # its draft KV slot (a branch's, once it adopted one)
    runner: list[Choices] = field(default_factory=list)  # per stream token: the draft's choices
    branches: list[Branch] = field(default_factory=list)
    tried: set[tuple[int, int]] = field(default_factory=set)  # (position, token) branched to
    rescue: float | None = None  # share of missed verdicts that a branch turned into a hit

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.committed + self.stream

    def block_start(self) -> int:
        """Stream index where the block being drafted starts (after each earlier block and its
        guessed bonus)."""
        return sum(len(b.tokens) + 1 for b in self.blocks)

    def branching(self) -> bool:
        return self.mode == "async" and self.params.greedy and self.started

    def capacity(self, max_seq_len: int) -> int:
        """Draft KV positions the session may need: prompt, output, and two blocks ahead."""
        return min(len(self.prompt) + self.max_tokens + 2 * self.gamma + 2, max_seq_len)

    def can_draft(self) -> bool:
        limit = MAX_OUTSTANDING[self.mode] if self.pipeline else 1
        if not self.started or len(self.blocks) >= limit:
            return self.fed < len(self.prompt)  # a new session prefills its prompt meanwhile
        return len(self.committed) + len(self.stream) < self.max_tokens + self.gamma


class BlockSender:
    """Numbers a session's draft blocks and publishes each as a DRAFT on its decode replica's
    topic; publishes again a block whose verdict has not come in `resend_s`."""

    def __init__(self, me: str, publish: Callable[[Message, int], None], stats: dict, resend_s: float):
        self.me, self.publish, self.stats, self.resend_s = me, publish, stats, resend_s

    def ready(self, s: Session) -> None:
        """Publish every complete block of the stream: after each earlier block and its guessed
        bonus, gamma drafts (a gamma that shrank, or an adopted branch, can leave several)."""
        while len(s.stream) - s.block_start() >= s.gamma:
            start = s.block_start()
            s.blocks.append(self.send(s, len(s.prompt) + len(s.committed) + start,
                                      extend_hash(s.hash, s.stream[:start]), s.stream[start:start + s.gamma]))

    def send(self, s: Session, start: int, h: int, tokens: list[int],
             branch_tokens: list[int] | None = None) -> OutBlock:
        """Number and publish a block of `s` drafted after its first `start` tokens (hash `h` of
        their output part): of its stream, or of a branch whose whole sequence is `branch_tokens`."""
        b = OutBlock(s.next_no, start, h, tokens, time.monotonic(), branch=branch_tokens is not None)
        s.next_no += 1
        self.stats["blocks"] += 1
        self.publish(self.message(s, b, branch_tokens), s.rid)
        return b

    def message(self, s: Session, b: OutBlock, tokens: list[int] | None = None) -> Message:
        after = (tokens or s.tokens)[b.start - 1]
        return make(MsgType.DRAFT, tenant=self.me, seq=s.seq, block=b.no,
                    start=b.start, after=after, hash=b.hash, tokens=b.tokens, plan_version=0, branch=b.branch)

    def resend(self, sessions: Iterable[Session], now: float) -> None:
        for s in sessions:
            for b in s.blocks:
                if now - b.sent > self.resend_s:
                    b.sent = now
                    self.stats["resent"] += 1
                    self.publish(self.message(s, b), s.rid)

    def next_wake_s(self, sessions: Iterable[Session]) -> float | None:
        sent = [b.sent for s in sessions for b in s.blocks]
        return max(0.0, min(sent) + self.resend_s - time.monotonic()) if sent else None


class Drafter:
    def __init__(self, me: str, model: Transformer, send: Callable[[str, Message], None],
                 publish: Callable[[Message, int], None], pacer: Pacer | None, time_scale: float = 1.0,
                 branch_kv_bytes: float | None = None):
        self.me, self.model, self._send, self.publish, self.pacer = me, model, send, publish, pacer
        self.cache = model.new_cache()
        self.sessions: dict[int, Session] = {}
        self.ended = Tombstones()  # a SESSION its RELEASE overtook starts nothing (it would wait SESSION_IDLE_S)
        self.resend_s = RESEND_MIN_S * time_scale
        self.idle_s = SESSION_IDLE_S * time_scale
        self.busy_s = 0.0
        self.since: float | None = None  # first session's arrival: the busy fraction's window
        self.stats = {"steps": 0, "blocks": 0, "resent": 0, "resyncs": 0, "lookahead_deferred": 0, "verdicts": 0,
                      "pipelined_verdicts": 0}
        self.step_s: dict[int, float] = {}  # rows (one token each) -> measured step seconds
        self.branches = Branches(self.cache, self.stats, lambda s: s.capacity(model.args.max_seq_len),
                                 branch_kv_bytes)  # None: no limit
        self.sender = BlockSender(me, publish, self.stats, self.resend_s)

    # -- messages ---------------------------------------------------------------------------------
    def on_session(self, msg: Message, vocab: int) -> None:
        seq = check_seq(msg["seq"])
        prompt = check_int_list(msg["prompt_token_ids"], "prompt_token_ids", 0, vocab - 1,
                                self.model.args.max_seq_len - 1)
        gamma = msg["gamma"]
        if not prompt or msg["mode"] not in MAX_OUTSTANDING or seq in self.sessions or not 1 <= gamma <= MAX_GAMMA:
            raise ProtocolError(f"seq {seq}: bad SESSION (mode {msg['mode']!r}, {len(prompt)} prompt tokens, "
                                f"gamma {gamma!r:.20})")  # (an out-of-range gamma was taken as the default)
        if seq in self.ended:
            log.info("%s: seq %d was released before its SESSION came; not drafting for it", self.me, seq)
            return
        t, k, p, seed = check_sampling(msg["sampling"])
        check_address(msg["gateway"], "gateway")
        if msg["max_tokens"] < 1:
            raise ProtocolError(f"seq {seq}: max_tokens must be positive")
        offset = check_offset(msg.fields, seq)
        s = Session(seq, prompt, msg["max_tokens"], SamplingParams(t, k, p), seed, msg["decode_replica"], gamma,
                    bool(msg["adaptive"]), msg["mode"], str(msg["gateway"]), slot=seq, offset=offset)
        self.sessions[seq] = s
        self.cache.allocate(seq, s.capacity(self.model.args.max_seq_len))
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
            self.stats["verdicts"] += 1
            self.stats["pipelined_verdicts"] += s.mode == "async" and s.pipeline  # drafting ahead of it
            learn(s, done, msg["accepted"], time.monotonic())
        kept = done is not None and s.stream[:len(tokens)] == tokens  # the bonus guess came true
        s.committed += tokens
        s.hash = extend_hash(s.hash, tokens)
        branch = self.branches.after_verdict(s, kept, done is not None)
        if kept:  # later blocks were drafted after exactly this: they stand
            s.stream, s.runner = s.stream[len(tokens):], s.runner[len(tokens):]
            s.blocks = [b for b in s.blocks if b.no != done.no]
        elif branch is not None:  # a choice it branched to came true: that branch is the stream now
            self.branches.adopt(s, branch)
            self.sender.ready(s)
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
        """Drop the speculative stream, its blocks and branches; the draft KV keeps `keep` positions at most."""
        s.stream, s.runner, s.blocks = [], [], []
        self.branches.drop(s)
        s.fed = min(s.fed, keep)
        self.cache.truncate(s.slot, min(self.cache.length(s.slot), s.fed))

    def _extend_branch(self, s: Session, br: Branch, logits: torch.Tensor) -> None:
        br.tokens.append(int(logits.argmax(-1)[0]))
        br.runner.append(choices(logits, br.tokens[-1]))
        if len(br.tokens) - br.base == br.gamma:
            br.block = self.sender.send(s, br.base, extend_hash(0, br.tokens[len(s.prompt):br.base]),
                                        br.tokens[br.base:], br.tokens)

    def replan(self, unchanged: Callable[[int], bool]) -> None:
        """A new plan: sessions whose decode replica changed are over (their requests failed)."""
        for s in list(self.sessions.values()):
            if not unchanged(s.rid):
                self.end(s.seq)

    def end(self, seq: int) -> None:
        self.ended.add(seq)
        s = self.sessions.pop(seq, None)
        if s is not None:
            self.branches.drop(s)
            self.cache.free(s.slot)

    # -- the loop -----------------------------------------------------------------------------------
    def step(self) -> bool:
        """One batched draft forward over every session that may draft; True if any did."""
        now = time.monotonic()
        self._expire(now)
        self.sender.resend(self.sessions.values(), now)
        for s in self.sessions.values():
            self.branches.grow(s)
        ready = self._rows([s for s in self.sessions.values()
                            if s.can_draft() and len(s.tokens) < self.model.args.max_seq_len],
                           [(s, br) for s in self.sessions.values() for br in s.branches if br.block is None])
        if not ready:
            return False
        spans, ids = [], []
        for s, br in ready:
            if br is None:
                feed = s.tokens[s.fed:s.fed + PREFILL_CHUNK]
                spans.append(SeqSpan(s.slot, s.fed, len(feed)))
            else:
                feed = br.tokens[br.fed:br.fed + 1]
                spans.append(SeqSpan(br.slot, br.fed, 1))
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
        for i, ((s, br), sp) in enumerate(zip(ready, spans)):
            if br is not None:
                br.fed += 1
                self._extend_branch(s, br, logits[i:i + 1])
                continue
            s.fed += sp.n_tokens
            if s.started and s.fed == len(s.tokens):  # caught up: this row's logits draft a token
                s.draft_s = ewma(s.draft_s, took)
                self._extend(s, logits[i:i + 1])
        return True

    def _rows(self, mains: list[Session], branches: list[tuple[Session, Branch]]) -> list[tuple[Session, Branch | None]]:
        """The rows this step drafts: (session, None) for a session's stream, (session, branch) for
        a branch. Speculative rows (a stream drafting past a block that awaits its verdict, then
        branches, most promising first: mostly thrown away) ride along only while they leave the
        step's measured time within LOOKAHEAD_SLACK of the committed-prefix rows' alone: on a
        shared, compute-bound draft server they must not slow the sessions whose drafts will
        stand. With no committed-prefix rows the look-ahead rows are the ones that go, and
        branches ride within the slack of those (of one row when there are none either)."""
        first = [(s, None) for s in mains if not s.blocks]
        ahead = [(s, None) for s in mains if s.blocks]
        must = first or ahead
        optional = (ahead if first else []) + sorted(branches, key=lambda sb: -sb[1].score)
        base = self.step_s.get(max(1, len(must)))
        n = len(must)
        for _ in optional:
            cost = self.step_s.get(n + 1)
            if n and base is not None and cost is not None and cost > LOOKAHEAD_SLACK * base:
                break
            n += 1
        taken = optional[:n - len(must)]
        self.stats["lookahead_deferred"] += sum(1 for _, br in optional[len(taken):] if br is None)
        return must + taken

    def _extend(self, s: Session, logits: torch.Tensor) -> None:
        """Append one drafted token; publish the block when it is complete."""
        index = s.offset + len(s.committed) + len(s.stream)  # the output index the target draws it at
        if s.params.greedy:
            tok = int(logits.argmax(-1)[0])
        else:  # the target's noise at this index: its own draw, wherever the draft is close to it
            p = probs(logits, s.params)[0]
            top = p.topk(min(Q_TOP_K, p.shape[-1]))
            noise = gumbel((1, p.shape[-1]), token_generator(s.seed, index))[0]
            tok = int(top.indices[int((top.values.log() + noise[top.indices]).argmax())])
        s.stream.append(tok)
        s.runner.append(choices(logits, tok) if s.params.greedy else (1.0, ()))
        self.sender.ready(s)

    def _expire(self, now: float) -> None:
        for s in [s for s in self.sessions.values() if now - s.heard > self.idle_s]:
            log.warning("%s: session %d heard nothing for %.0f s; dropped", self.me, s.seq, now - s.heard)
            self.end(s.seq)  # its verifier and its gateway are gone: memory stays bounded

    def next_wake_s(self) -> float | None:
        return self.sender.next_wake_s(self.sessions.values())

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


def learn(s: Session, b: OutBlock, accepted: int, now: float) -> None:
    """Acceptance and round-trip estimates for adaptive gamma."""
    rejected = 1 if accepted < len(b.tokens) else 0
    s.alpha = ewma(s.alpha, accepted / max(1, accepted + rejected))
    if not b.branch:  # a branch's block waited for the verdict before it: no round trip
        s.rtt_s = ewma(s.rtt_s, now - b.sent)
    if s.adaptive and s.draft_s:
        s.gamma, pipe = choose_drafting(min(s.alpha, 0.98), s.draft_s, 0.0, s.rtt_s, s.mode == "async",
                                        rescue=s.rescue or 0.0)
        s.pipeline = s.mode == "async" and pipe
