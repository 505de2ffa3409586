"""Proactive branches of a drafter's sessions (SpecEdge's drafting of the likely corrections).

Where a block in flight may be rejected, an async greedy session takes one of the draft's next
choices at that position (engine/speculative.py `best_branch`), forks its draft KV into a slot of
its own and drafts a block after it, published like any block before the verdict that would
need it. When the verdict's correction is that choice, the verifier already holds a block drafted
after exactly the committed prefix, and the session adopts the branch as its stream.

This module keeps a drafter's branches: forking them (bounded, so a busy draft server copies no
KV for branches it would never draft), finding the one a verdict makes true, adopting it and
freeing the rest. The drafter (roles/drafter.py) gives branch rows their draft steps and
publishes their blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from meshllm.engine.kvcache import KVCache
from meshllm.engine.speculative import Choices, best_branch, ewma

if TYPE_CHECKING:
    from meshllm.roles.drafter import Session

MAX_BRANCHES = 6  # proactive branches per session at once
BRANCHES_DRAFTING = 2  # ... of which still drafting (a fork copies the session's KV: only for rows that come)
BRANCH_KV_SHARE = 0.1  # of the device's memory, what all sessions' branch KV slots may hold together


@dataclass
class Branch:
    """A proactive branch of a session: one of the draft's next choices at one position of its
    stream, then a block drafted after it. `tokens` is the whole sequence (prompt, output, the path
    to that choice, then the drafts); the choice sits at `base - 1` and the block starts at `base`."""
    slot: int  # its own draft KV slot (forked from the session's)
    tokens: list[int]
    base: int
    fed: int
    score: float
    gamma: int
    runner: list[Choices] = field(default_factory=list)  # per drafted token
    block: Any = None  # its published OutBlock (roles/drafter.py)


class Branches:
    def __init__(self, cache: KVCache, stats: dict[str, int], capacity: Callable[[Session], int],
                 budget_bytes: float | None = None):
        """`budget_bytes`: what the branch KV slots of all sessions may hold together (None: no
        limit); a fork that would go over it is not made (`branches_over_budget`)."""
        self.cache, self.stats, self.capacity, self.budget = cache, stats, capacity, budget_bytes
        self.stats.update(branches=0, branch_hits=0, branch_hits_ready=0, branch_misses=0, branches_over_budget=0)
        self._next_slot = -1  # branch slots count down (sequence ids are >= 0)
        self.held: dict[int, int] = {}  # branch slot -> its KV bytes

    def held_bytes(self) -> int:
        return sum(self.held.values())

    def grow(self, s: Session) -> None:
        """Fork the most promising untried branch (engine/speculative.py best_branch: at a stream
        position, a draft in a block in flight or being drafted, or a guessed bonus token, one of
        the draft's next choices) while the session has room for one: at most MAX_BRANCHES, of
        which BRANCHES_DRAFTING still drafting, so that a busy draft server, whose steps leave no
        room for branch rows, does not copy KV for branches that would never be drafted."""
        if (not s.branching() or len(s.branches) >= MAX_BRANCHES
                or sum(1 for br in s.branches if br.block is None) >= BRANCHES_DRAFTING):
            return
        cap, done = self.capacity(s), len(s.prompt) + len(s.committed)
        best = best_branch(s.runner, lambda i, r: (done + i, r) in s.tried, cap - done - 1 - s.gamma)
        if best is None:
            return
        score, i, r = best
        need = self.cache.slot_bytes(max(cap, done + i))
        if self.budget is not None and self.held_bytes() + need > self.budget:
            self.stats["branches_over_budget"] += 1
            return
        s.tried.add((done + i, r))
        slot, self._next_slot = self._next_slot, self._next_slot - 1
        self.cache.fork(s.slot, slot, done + i, cap)
        self.held[slot] = need
        s.branches.append(Branch(slot, s.tokens[:done + i] + [r], done + i + 1, done + i, score, s.gamma))
        self.stats["branches"] += 1

    def after_verdict(self, s: Session, kept: bool, verified: bool) -> Branch | None:
        """A verdict just committed output to `s`: the branch drafted after exactly that output, if
        any; counts it (`verified`: the verdict was for one of the session's blocks) and, when the
        stream stood (`kept`), frees the branches that left the committed path."""
        done = s.prompt + s.committed
        if kept:
            self.drop(s, lambda br: br.base <= len(done))
            s.tried = {t for t in s.tried if t[0] >= len(done)}
            return None
        s.tried = set()  # the stream is replaced (a branch's or none): its positions start over
        branch = next((br for br in s.branches if br.base == len(done) and br.tokens[:br.base] == done), None)
        if verified and s.branching():  # a verdict that broke the stream
            s.rescue = ewma(s.rescue, float(branch is not None and branch.block is not None))  # a hit in full
            self.stats["branch_misses"] += branch is None
        return branch

    def adopt(self, s: Session, br: Branch) -> None:
        """The branch came true: its KV slot, drafts and block are the session's stream now."""
        s.branches.remove(br)
        self.held.pop(br.slot, None)  # the session's own slot now
        self.drop(s)
        self.cache.free(s.slot)
        s.slot, s.fed = br.slot, br.fed
        s.stream, s.runner = br.tokens[br.base:], list(br.runner)
        s.blocks = [br.block] if br.block is not None else []
        self.stats["branch_hits"] += 1
        self.stats["branch_hits_ready"] += br.block is not None  # its block already out: no redrafting at all

    def drop(self, s: Session, which: Callable[[Branch], bool] = lambda br: True) -> None:
        for br in [br for br in s.branches if which(br)]:
            s.branches.remove(br)
            self.cache.free(br.slot)
            self.held.pop(br.slot, None)
