"""A grouping's capacity from its replicas' per-role rates (pure arithmetic on req/s).

`role_rates` gives each replica's (prefill, decode, mixed) requests/s from its evaluation
(replica.py); `capacity` sums what a set of roles sustains: the mixed replicas' own requests,
min(prefill pool, decode pool), and what mixed replicas gain by decoding the prefill pool's
excess (`absorbed`, the best trades first: `trade_order`). grouping.py chooses roles with it,
latency.py and the judge re-rate a grouping whose roles changed.
"""

from __future__ import annotations

from collections.abc import Sequence

from meshllm.partition.replica import ReplicaEval


def role_rates(evals: Sequence[ReplicaEval]) -> list[tuple[float, float, float]]:
    """(prefill, decode, mixed req/s) per replica: what `capacity` and `assign_roles` take."""
    return [(e.prefill_req_s, e.decode_req_s, e.mixed_req_s) for e in evals]


def absorbed(rates: Sequence[tuple[float, float, float]], mixed: Sequence[int], excess: float,
             ranked: Sequence[int] | None = None) -> dict[int, float]:
    """Requests/s of prefilled prompts that each mixed replica decodes of `excess`: one costs it
    1/decode of its time, in which it would serve mixed/decode of its own prompts, so the best
    trades (lowest mixed/decode) go first, each up to its decode rate; none that gains nothing.
    `ranked`: every replica in that order (`trade_order`), if already sorted."""
    out: dict[int, float] = {}
    if excess <= 0:
        return out
    ranked = trade_order(rates) if ranked is None else ranked
    among = set(mixed)
    order = [i for i in ranked if i in among] if len(among) < len(ranked) else ranked
    for i in order:
        d, h = rates[i][1], rates[i][2]
        if excess <= 0 or d <= h:
            break
        out[i] = min(excess, d)
        excess -= out[i]
    return out


def trade_order(rates: Sequence[tuple[float, float, float]]) -> list[int]:
    """Replicas by mixed/decode rate, lowest first: the order in which `absorbed` trades."""
    return sorted(range(len(rates)), key=lambda i: (rates[i][2] / max(rates[i][1], 1e-12), i))


def capacity(rates: Sequence[tuple[float, float, float]], roles: Sequence[str],
             ranked: Sequence[int] | None = None) -> tuple[float, float, dict[int, float]]:
    """(requests/s, of which prefilled on one replica and decoded on another, what each mixed
    replica decodes of them) for (prefill, decode, mixed req/s) per replica with these roles
    (`ranked`: `trade_order(rates)`, if already sorted)."""
    p = d = 0
    mixed = []
    for i, role in enumerate(roles):
        if role == "prefill":
            p += rates[i][0]
        elif role == "decode":
            d += rates[i][1]
        elif role == "mixed":
            mixed.append(i)
    pd = min(p, d)
    ship = absorbed(rates, mixed, p - pd, ranked)
    gain = sum([s * (1.0 - rates[i][2] / rates[i][1]) for i, s in ship.items()])
    return sum([rates[i][2] for i in mixed]) + pd + gain, pd + sum(ship.values()), ship
