"""Textbook queueing formulas (mean waiting time in queue, seconds). Pure.

Used two ways: the planner's latency estimate (latency.py) calls the fast approximations, and
the simulator's tests check the simulator against the exact single-server and M/M/c results.

- M/M/1: Wq = rho / (mu - lambda).  M/D/1: Wq = rho S / (2 (1 - rho)).
- M/G/1 (Pollaczek-Khinchine): Wq = lambda E[S^2] / (2 (1 - rho)) = rho S (1 + cs2) / (2 (1 - rho)).
- M/M/c: Wq = C(c, a) S / (c - a), with a = lambda S and C the Erlang C probability of waiting,
  computed exactly from the Erlang B recursion B(k) = a B(k-1) / (k + a B(k-1)).
- M/G/c, fast: Sakasegawa's P(wait) ~ rho^(sqrt(2 (c + 1)) - 1) with the Allen-Cunneen
  factor (1 + cs2) / 2 for Poisson arrivals.
Every function returns inf at or above saturation.
"""

from __future__ import annotations

import math


def mm1_wait(lam: float, service_s: float) -> float:
    rho = lam * service_s
    return math.inf if rho >= 1 else rho * service_s / (1 - rho)


def mg1_wait(lam: float, service_s: float, cs2: float) -> float:
    """Pollaczek-Khinchine; cs2 = squared coefficient of variation of the service time."""
    rho = lam * service_s
    return math.inf if rho >= 1 else rho * service_s * (1 + cs2) / (2 * (1 - rho))


def md1_wait(lam: float, service_s: float) -> float:
    return mg1_wait(lam, service_s, 0.0)


def erlang_c(c: int, a: float) -> float:
    """Probability that an arrival waits in an M/M/c queue with offered load a = lambda S."""
    if a >= c:
        return 1.0
    b = 1.0
    for k in range(1, c + 1):
        b = a * b / (k + a * b)
    rho = a / c
    return b / (1 - rho + rho * b)


def mmc_wait(lam: float, service_s: float, c: int) -> float:
    a = lam * service_s
    return math.inf if a >= c else erlang_c(c, a) * service_s / (c - a)


def mgc_wait_approx(lam: float, service_s: float, c: float, cs2: float) -> float:
    """M/G/c mean wait, Sakasegawa + Allen-Cunneen (c may be fractional: a pool of unequal
    servers counted in units of its mean server)."""
    if c <= 0:
        return math.inf
    rho = lam * service_s / c
    if rho >= 1:
        return math.inf
    if rho <= 0:
        return 0.0
    p_wait = rho ** (math.sqrt(2 * (c + 1)) - 1)
    return p_wait * service_s / (c * (1 - rho)) * (1 + cs2) / 2
