"""Links between zones, shared by every replica (the planner's side of sim/ports.py).

A link between two different zones is one server per direction; whatever crosses it, for any
replica, adds up. Per request, a grouping sends across each directed zone pair:
- the activations between consecutive stages of a replica that sit in different zones: the
  prompt's on prefill replicas, the output tokens' on decode replicas, both on mixed ones;
- the KV of every layer whose prefill device and decode device are in different zones. The
  router spreads requests over replicas by their capacity, so the zone a layer's KV leaves
  from (and arrives in) is a distribution over the pool; the two are taken as independent.
The link-bound rate is min over directed links of bandwidth / bytes per request; the grouping's
capacity is the lower of that and its roles' capacity (grouping.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from meshllm.partition.cost import BITS_PER_BYTE, ModelCosts
from meshllm.partition.dp import Member, Net
from meshllm.partition.replica import Mix, ReplicaEval, RoleFit, ordered


class LinkLoad:
    """Bytes per request on each shared (inter-zone) link, for groupings of `members`."""

    def __init__(self, mc: ModelCosts, members: Sequence[Member], net: Net, mix: Mix):
        self.mc, self.mix = mc, mix
        self.zones = sorted({m.zone for m in members})
        self.index = {z: i for i, z in enumerate(self.zones)}
        self.bytes_per_s = {}  # (zone index a, zone index b) -> link bytes/s, for shared links only
        for pair, (_, mbps) in net.links.items():
            if len(pair) == 2 and pair <= set(self.zones):
                a, b = sorted(pair)
                self.bytes_per_s[(self.index[a], self.index[b])] = mbps * 1e6 / BITS_PER_BYTE
                self.bytes_per_s[(self.index[b], self.index[a])] = mbps * 1e6 / BITS_PER_BYTE
        self._fits: dict[int, tuple] = {}

    @property
    def active(self) -> bool:
        return bool(self.bytes_per_s)

    def shape(self, members: Sequence[Member], fit: RoleFit) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """(zone index of each layer, directed zone pairs of consecutive stages that differ)."""
        got = self._fits.get(id(fit))
        if got is None:
            seq = ordered(members, fit.split)
            zones = np.repeat([self.index[m.zone] for m in seq], fit.split.counts)
            hops = [(self.index[a.zone], self.index[b.zone]) for a, b in zip(seq, seq[1:]) if a.zone != b.zone]
            got = self._fits[id(fit)] = (zones, hops, fit)  # the fit is kept so its id is not reused
        return got[0], got[1]

    def add_hops(self, load: np.ndarray, ev: ReplicaEval, fit: RoleFit, weight: float, tokens: float) -> None:
        for a, b in self.shape(ev.members, fit)[1]:
            load[a, b] += weight * tokens * self.mc.act_bytes_per_token

    def pool_zones(self, pool: Sequence[tuple[ReplicaEval, RoleFit, float]]) -> np.ndarray:
        """(zones, layers): the share of each layer's traffic in each zone over a pool."""
        out = np.zeros((len(self.zones), self.mc.n_layers))
        for ev, fit, w in pool:
            zones, _ = self.shape(ev.members, fit)
            out[zones, np.arange(self.mc.n_layers)] += w
        return out

    def per_request(self, evals: Sequence[ReplicaEval], roles: Sequence[str], cap_pd: float,
                    cap: float, ship: Mapping[int, float] | None = None) -> np.ndarray:
        """(zones, zones) bytes per request over the grouping, at its capacity split; `ship`: the
        requests/s that mixed replicas decode for the prefill pool (grouping.capacity)."""
        z = len(self.zones)
        load = np.zeros((z, z))
        pre = [(e, e.prefill, e.prefill_req_s) for e, r in zip(evals, roles) if r == "prefill"]
        dec = [(e, e.decode, e.decode_req_s) for e, r in zip(evals, roles) if r == "decode"]
        dec += [(evals[i], evals[i].decode, s) for i, s in (ship or {}).items() if s > 0 and evals[i].decode]
        for e, r in zip(evals, roles):
            if r == "mixed" and e.mixed is not None:
                self.add_hops(load, e, e.mixed, e.mixed_req_s / cap, self.mix.mean_in + self.mix.mean_out)
        if cap_pd > 0:
            share = cap_pd / cap
            p_tot, d_tot = sum(w for *_, w in pre), sum(w for *_, w in dec)
            pre = [(e, f, share * w / p_tot) for e, f, w in pre]
            dec = [(e, f, share * w / d_tot) for e, f, w in dec]
            for e, f, w in pre:
                self.add_hops(load, e, f, w, self.mix.mean_in)
            for e, f, w in dec:
                self.add_hops(load, e, f, w, self.mix.mean_out)
            src, dst = self.pool_zones(pre) / share, self.pool_zones(dec) / share
            kv = self.mc.kv_bytes_per_token * self.mix.mean_in * share
            load += kv * src @ dst.T
        np.fill_diagonal(load, 0.0)
        return load

    def bound(self, evals: Sequence[ReplicaEval], roles: Sequence[str], cap_pd: float, cap: float,
              ship: Mapping[int, float] | None = None) -> float:
        """Requests/s the shared links let through (inf if no traffic crosses one)."""
        if cap <= 0:
            return 0.0
        load = self.per_request(evals, roles, cap_pd, cap, ship)
        rates = [bw / load[ab] for ab, bw in self.bytes_per_s.items() if load[ab] > 0]
        return min(rates, default=float("inf"))
