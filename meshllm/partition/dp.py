"""Layer split inside one replica: contiguous non-empty stages minimising the bottleneck.

For a fixed device order, stage i holding n layers costs `table[i, n-1]` seconds (compute
roofline from cost.py; +inf when its weights + KV budget do not fit the device), and the
link from stage i to i+1 costs `links[i]` (rtt/2 + activation bytes / bandwidth). The
bottleneck of a split is the max over all of them. Dynamic programming over (stage, layers
covered) finds the exact optimum in O(k * L^2), vectorised with numpy:

    f[i][j] = min over n in 1..j-1 of max(f[i-1][j-n], table[i, n-1])

Rows are non-decreasing in n, so the optimum itself has a closed form in O(k * L)
(`min_bottleneck`), and for replicas of more than DP_MAX_STAGES stages `threshold_split`
builds a split at it faster than the DP (the property test checks both against brute force).

Device order. The first stage also holds the embedding, the last the LM head, and the links
depend on neighbours, so order matters. Replicas of <= EXACT_ORDER_MAX devices try every
distinct order (members with the same device profile and zone are interchangeable): 4 in the
planner, where thousands of replica shapes are split, and `exact_max=6` is exact too (the
property test). Larger replicas use a heuristic: group members by zone (zones with more
compute first, which keeps the slow inter-zone links to a minimum), and within a zone try
compute-descending, compute-ascending and memory-descending orders; the best one is kept.
Orders are ranked by `min_bottleneck` (with their links), and only the first of the least
is split layer by layer.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from meshllm.device import DeviceProfile
from meshllm.partition.cost import ModelCosts, link_time_s, path_mbps, stage_decode_s, stage_prefill_s

EXACT_ORDER_MAX = 4  # devices the planner orders exhaustively; split_replica(exact_max=6) is exact further
DP_MAX_STAGES = 8  # above this, threshold_split finds the same optimum faster
SAME_ZONE_RTT_MS = 1.0  # assumed when the cluster file gives no link for a zone pair
GB = 1e9
_KINDS: dict[tuple, int] = {}  # Member.key -> Member.kind


@dataclass(frozen=True)
class Member:
    """A device that may hold a stage."""

    id: str
    device: DeviceProfile
    zone: str

    @functools.cached_property
    def key(self) -> tuple:
        """Members with equal keys are interchangeable for planning."""
        d = self.device
        return (d.name, self.zone, d.memory_gb, d.compute_tflops, d.memory_bandwidth_gbps, d.network_mbps)

    @functools.cached_property
    def kind(self) -> int:
        """A small int naming `key` (process-wide): cheap to hash in the split caches."""
        return _KINDS.setdefault(self.key, len(_KINDS))

    def __getstate__(self) -> dict:
        """Pickled without `kind`: its number is this process's, and another process's members
        of another key may hold it (their split caches would mix the two)."""
        state = dict(self.__dict__)
        state.pop("kind", None)
        return state


@dataclass(frozen=True)
class Net:
    """Zone-to-zone links: frozenset({zone_a, zone_b}) -> (rtt_ms, bandwidth_mbps)."""

    links: dict[frozenset, tuple[float, float]]

    def rtt_mbps(self, za: str, zb: str) -> tuple[float, float | None]:
        got = self.links.get(frozenset((za, zb)))
        return (SAME_ZONE_RTT_MS, None) if got is None else got

    def hop_s(self, a: Member, b: Member, nbytes: float) -> float:
        rtt, mbps = self.rtt_mbps(a.zone, b.zone)
        return link_time_s(nbytes, rtt, path_mbps(a.device, b.device, mbps))


@dataclass(frozen=True)
class Workpoint:
    """What a split is optimised for: a prefill of `tokens` prompt tokens, or a decode step of
    a batch of `tokens` sequences at `context` positions. Every stage keeps `kv_tokens` of KV."""

    phase: str  # "prefill" | "decode"
    tokens: float
    context: float
    kv_tokens: float


@dataclass(frozen=True)
class Split:
    order: tuple[int, ...]  # indices into the members passed to split_replica
    counts: tuple[int, ...]  # layers per stage, in order
    bottleneck_s: float

    @property
    def ranges(self) -> list[tuple[int, int]]:
        ends = list(itertools.accumulate(self.counts))
        return [(e - c, e) for c, e in zip(self.counts, ends, strict=True)]


@dataclass(frozen=True)
class Infeasible:
    reason: str


def memory_cap_layers(mc: ModelCosts, dev: DeviceProfile, first: bool, last: bool, kv_tokens: float) -> int:
    """Most layers `dev` can hold at this position with a KV budget of `kv_tokens` tokens."""
    free = dev.memory_bytes - mc.stage_weight_bytes(0, first, last)
    per_layer = mc.layer_bytes + kv_tokens * mc.kv_bytes_per_token
    return max(0, math.floor(free / per_layer))


def kv_room_tokens(mc: ModelCosts, dev: DeviceProfile, layers: tuple[int, int], token_bytes: float) -> int:
    """Positions of KV a stage holding layers [a, b) on `dev` keeps beside its weights, by the memory
    model the plan was made with; `token_bytes`: the KV of one position over those layers as the
    stage's cache holds it (the live leader's KV admission, roles/batcher.py)."""
    a, b = layers
    free = dev.memory_bytes - mc.stage_weight_bytes(b - a, a == 0, b == mc.n_layers)
    return max(0, int(free // token_bytes))


def stage_time_s(mc: ModelCosts, dev: DeviceProfile, n: int, last: bool, wp: Workpoint) -> float:
    if wp.phase == "prefill":
        return stage_prefill_s(mc, dev, n, wp.tokens, last)
    return stage_decode_s(mc, dev, n, wp.tokens, wp.context, last)


def cost_row(mc: ModelCosts, dev: DeviceProfile, first: bool, last: bool, wp: Workpoint) -> np.ndarray:
    """Seconds for `dev` at this position to run n = 1..L layers; +inf where memory does not fit.
    Non-decreasing in n (both roofline terms grow with n)."""
    n_layers = mc.n_layers
    row = np.full(n_layers, np.inf)
    cap = min(n_layers, memory_cap_layers(mc, dev, first, last, wp.kv_tokens))
    row[:cap] = stage_time_s(mc, dev, np.arange(1, cap + 1), last, wp)
    return row


def min_bottleneck_split(table: np.ndarray, links: Sequence[float]) -> tuple[float, tuple[int, ...]] | None:
    """The DP. Returns (bottleneck seconds, layers per stage) or None if no split fits."""
    k, n_layers = table.shape
    if k > n_layers:
        return None
    prev_idx = _prev_index(n_layers)
    f = np.append(table[0], np.inf)
    back = []
    for i in range(1, k):
        cand = np.maximum(f[prev_idx], table[i][None, :])
        arg = cand.argmin(axis=1)
        f = np.append(cand.min(axis=1), np.inf)
        back.append(arg)
    f = f[:-1]
    if not np.isfinite(f[-1]):
        return None
    counts, left = [], n_layers
    for arg in reversed(back):
        c = int(arg[left - 1]) + 1
        counts.append(c)
        left -= c
    counts.append(left)
    return max(float(f[-1]), max(links, default=0.0)), tuple(reversed(counts))


@functools.lru_cache(maxsize=16)
def _prev_index(n_layers: int) -> np.ndarray:
    """[j - 1, n - 1] -> the index into f (padded with +inf at n_layers) of the j - n layers
    covered before a newest stage of n layers; n_layers (the +inf) where j - n < 1."""
    j = np.arange(1, n_layers + 1)[:, None]  # layers covered so far
    prev = j - j.T
    return np.where(prev >= 1, prev - 1, n_layers)


def min_bottleneck(table: np.ndarray) -> float | None:
    """The least bottleneck over the stages (links aside), in O(k L): rows are non-decreasing in n,
    so a bottleneck T is reachable iff every position can take >= 1 layer within T (T >= the
    largest first column entry) and their capacities sum to >= L (T >= the L-th smallest entry of
    the table). The least such T is the larger of the two: a table value, the very one the DP
    finds. None if no split fits."""
    k, n_layers = table.shape
    if k > n_layers:
        return None
    t = max(float(table[:, 0].max()), float(np.partition(table, n_layers - 1, axis=None)[n_layers - 1]))
    return t if math.isfinite(t) else None


def threshold_split(table: np.ndarray, links: Sequence[float],
                    t: float | None = None) -> tuple[float, tuple[int, ...]] | None:
    """Same optimum as the DP at `min_bottleneck`'s T (`t`, if already found): each stage takes
    what fits within T, and the excess is given back from the end; used for long replicas
    (> DP_MAX_STAGES)."""
    t = min_bottleneck(table) if t is None else t
    if t is None:
        return None
    counts = (table <= t).sum(axis=1)
    excess = int(counts.sum()) - table.shape[1]
    spare = (counts - 1)[::-1]  # give back layers from the end, keeping >= 1 each
    counts -= np.clip(excess - (np.cumsum(spare) - spare), 0, spare)[::-1]
    return max(t, max(links, default=0.0)), tuple(counts.tolist())


def best_split(table: np.ndarray, links: Sequence[float],
               t: float | None = None) -> tuple[float, tuple[int, ...]] | None:
    """(bottleneck, layers per stage) of the best split of `table` (`t`: its `min_bottleneck`, if found)."""
    if table.shape[0] <= DP_MAX_STAGES:
        return min_bottleneck_split(table, links)
    return threshold_split(table, links, t)


def candidate_orders(members: Sequence[Member], exact_max: int = EXACT_ORDER_MAX) -> list[tuple[int, ...]]:
    """All distinct orders for small replicas; the zone-grouped heuristic orders otherwise."""
    k = len(members)
    if k <= exact_max:
        seen: dict[tuple, tuple[int, ...]] = {}
        for perm in itertools.permutations(range(k)):
            seen.setdefault(tuple(members[i].kind for i in perm), perm)
        return list(seen.values())
    zone_compute: dict[str, float] = {}
    for m in members:
        zone_compute[m.zone] = zone_compute.get(m.zone, 0.0) + m.device.compute_tflops
    zone_rank = {z: r for r, z in enumerate(sorted(zone_compute, key=lambda z: (-zone_compute[z], z)))}
    zr = [zone_rank[m.zone] for m in members]
    tflops = [m.device.compute_tflops for m in members]
    memory = [m.device.memory_gb for m in members]
    # zones by rank, then within a zone: compute descending, compute ascending, memory descending
    orders = [tuple(sorted(range(k), key=lambda i, col=col, sign=sign: (zr[i], sign * col[i], i)))
              for col, sign in ((tflops, -1.0), (tflops, 1.0), (memory, -1.0))]
    return list(dict.fromkeys(orders))


class Splitter:
    """Order + split search for one model, network and workpoint, caching cost rows per
    (device key, position) and link costs per device-key pair across replicas."""

    def __init__(self, mc: ModelCosts, net: Net, wp: Workpoint):
        self.mc, self.net, self.wp = mc, net, wp
        self._rows: dict[tuple, np.ndarray] = {}
        self._hops: dict[tuple, float] = {}

    def row(self, m: Member, first: bool, last: bool) -> np.ndarray:
        key = (m.kind, first, last)
        got = self._rows.get(key)
        if got is None:
            got = self._rows[key] = cost_row(self.mc, m.device, first, last, self.wp)
        return got

    def hop(self, a: Member, b: Member) -> float:
        key = (a.kind, b.kind)
        got = self._hops.get(key)
        if got is None:
            got = self._hops[key] = self.net.hop_s(a, b, self.wp.tokens * self.mc.act_bytes_per_token)
        return got

    def split(self, members: Sequence[Member], exact_max: int = EXACT_ORDER_MAX,
              orders: Sequence[tuple[int, ...]] | None = None) -> Split | Infeasible:
        """Best order and split of `members`, or the reason none fits (`orders`: the candidate
        orders, if already listed)."""
        best = None  # (bottleneck, order, table, links, stages' bottleneck): the first order of the least
        k = len(members)
        middle = np.stack([self.row(m, False, False) for m in members]) if k > 2 else None
        for order in candidate_orders(members, exact_max) if orders is None else orders:
            if middle is None:
                table = np.stack([self.row(members[i], p == 0, p == k - 1) for p, i in enumerate(order)])
            else:  # every stage but the first and the last costs its middle row
                table = middle[list(order)]
                table[0] = self.row(members[order[0]], True, False)
                table[-1] = self.row(members[order[-1]], False, True)
            stages = min_bottleneck(table)  # the optimum of `best_split`, without its layer counts
            if stages is None or (best is not None and stages >= best[0]):
                continue  # the links can only raise it: this order cannot be the first of the least
            links = [self.hop(members[a], members[b]) for a, b in itertools.pairwise(order)]
            t = max(stages, max(links, default=0.0))
            if best is None or t < best[0]:
                best = (t, order, table, links, stages)
        if best is None:
            return Infeasible(shortfall_reason(self.mc, members, self.wp))
        got = best_split(best[2], best[3], best[4])  # the layer counts, for the chosen order only
        return Split(best[1], got[1], got[0])


def split_replica(mc: ModelCosts, members: Sequence[Member], net: Net, wp: Workpoint,
                  exact_max: int = EXACT_ORDER_MAX) -> Split | Infeasible:
    """Best order and split of `members` for the workpoint, or the reason none fits."""
    return Splitter(mc, net, wp).split(members, exact_max)


SHOWN_IDS = 6  # a reason names this many devices, then counts the rest (a 46-device pack made a line of ids)


def named(members: Sequence[Member]) -> str:
    """The members' ids for a reason: the first SHOWN_IDS, then how many more."""
    ids = ", ".join(m.id for m in members[:SHOWN_IDS])
    return ids + (f" and {len(members) - SHOWN_IDS} more" if len(members) > SHOWN_IDS else "")


def memory_shortfall(mc: ModelCosts, members: Sequence[Member], wp: Workpoint) -> str | None:
    """How much memory `members` lack, all together, for the weights and the KV of `wp`; None if
    they have enough."""
    need = mc.weight_bytes + mc.n_layers * wp.kv_tokens * mc.kv_bytes_per_token
    have = sum(m.device.memory_bytes for m in members)
    if have >= need:
        return None
    return (f"devices {named(members)} have {have / GB:.2f} GB, the model needs {need / GB:.2f} GB "
            f"(weights + KV for {wp.kv_tokens:.0f} tokens): {(need - have) / GB:.2f} GB short")


def shortfall_reason(mc: ModelCosts, members: Sequence[Member], wp: Workpoint) -> str:
    """Why no split fits: too many devices for the layers, or memory (with how much is missing)."""
    if len(members) > mc.n_layers:
        return f"{len(members)} devices but only {mc.n_layers} layers"
    short = memory_shortfall(mc, members, wp)
    if short is not None:
        return short
    tight = [m for m in members if memory_cap_layers(mc, m.device, False, False, wp.kv_tokens) < 1]
    if tight:
        m = tight[0]
        short = mc.layer_bytes + wp.kv_tokens * mc.kv_bytes_per_token - m.device.memory_bytes
        return f"device {m.id} ({m.device.name}) cannot hold one layer: {short / 1e6:.0f} MB short"
    return f"devices {named(members)}: no order fits the embedding/head and layers (memory too fragmented)"
