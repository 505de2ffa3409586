"""The judge's last steps (sim/judge.py, steps 1-4, picks a grouping): the pick's roles (and, for
capacity, its pipelines' splits) refined in the simulator (sim/trials.py; trials that do not depend on
each other run at once, sim/pool.py).

5. with a rate given, the pick's replicas are turned mixed one at a time, the turn that costs
least first, while each lowers the cost at the rate on the judge's trace (`refine_roles`, at
most FLIP_ROUNDS), kept if it still sustains HEADROOM x the rate and costs no more than the
pick on the CONFIRM_SEEDS traces. The next search grouping in cost order is refined too
(REFINE_TOP, sim/judge.py), and the one that then costs less on those traces wins: a grouping's cost before
refining does not rank it after (bench-fog-40-8b at 13.9 req/s: the pick, 8 prefill, 8 decode
and 3 mixed replicas, refined to 20.0 s a request; the runner-up, 10 prefill, 10 decode and 1
mixed, to 15.7 s). The analytic model rates a mixed replica beside disaggregated ones low (a
share of its compute bound, a queueing estimate), so the search leaves replicas prefilling
that serve better doing both: on bench-fog-40-8b at 9.9 / 13.9 req/s, the RTX 3060 pair's and
the Orin NX + RTX 3060's prefill replicas turned mixed lowered the mean wait from 104.5 to
88.6 / 206.9 to 140.5 ms (e2e 4.65 -> 4.76 / 6.67 -> 5.95 s; bench/planner.py): their prompts
no longer wait for the RTX 4090's port to take their KV. The other way, a mixed replica is
tried prefill (its prompts' KV shipped to the mixed and decode replicas), in the same rounds,
where some replica would still decode, and only if the TTFT p50 on the judge's trace stays
within TTFT_SLACK of the pick's: on bench-mesh-200 at 70 % of Splitwise's saturation, mixed-dp's
grouping with its RTX 4090 and Mac mini pipelines turned prefill waits 1.25 s a request
against 2.04 (e2e 58 against 34 s, TTFT p50 1.48 against 1.09 s; Splitwise: 2.43, 87, 2.60 s):
the pipelines' decodes were paused by every prompt that rode along (with the router before it
counted KV on zone links; with it the judge picks a search grouping there, 5 prefill and 11 mixed
replicas, and turns three more prefill: 0.38 s). Turning a replica decode-
only is not tried: on bench-edge-8b at 1 req/s it lowered the cost by making the RTX 4090
decode-only, at 5x the TTFT (p50 103 -> 550 ms);
6. with no rate given (for capacity), the pick's decode replicas are turned mixed a kind at a time
(the decode replicas on the same device types), each turn judged on the CAPACITY_SEEDS traces
with runs as long as the reported sweep's, the best one taken if it leads the plan so far on
the evidence (at most CAPACITY_TURNS kinds; `turned_for_capacity`). A decode replica is
memory-bound: its steps stream the weights and the KV and leave most of its compute idle,
which a mixed replica fills with prompt chunks, while the analytic model rates a mixed
replica beside disaggregated ones low. On bench-fog-40-8b the pick's two Jetson AGX Orins
decoded for 10 prefill replicas at 0.58 of their compute at 30.2 req/s (the sweep's traces:
30.00 / 29.51 / 30.10 req/s, 0.910 of the bound); turned mixed, they sustain 31.60 / 31.58 /
32.42 (0.970). One trace does not tell: on the judge's own, with its short runs, the turn
sustained less (21.76 against 22.95 req/s; 29.30 against 29.77 on 2000 requests), on the
four it leads by 1.67 req/s a trace (standard error 0.63);
7. then, for capacity, the plan's mixed and decode pipelines re-split to keep KV room for more
sequences (`with_kv_room`, KV_ROOMS), where that sustains KV_ROOM_GAIN more with the replica
alone (mixed) in the simulator on the judge's trace; those replicas re-split together, or failing that the one
that gained most alone, are taken if the plan then out-sustains the plan so far on the evidence
(as in step 6; `kv_room_for_capacity`). The DP splits a decode pipeline for a step at a
reference batch and keeps room for only KV_RESERVE_SEQS sequences, so on unequal devices the
batch is what the tightest stage's memory leaves: bench-mesh-200's mixed replica of 2 A100 + 3
RTX 4090 holds 127 sequences as the DP splits it and 256 re-split (3.00 -> 3.95 req/s alone,
bench/bound_gap.py --replicas), and the plan sustains 14.14 against 12.99 req/s on the four
traces. The analytic model rates that re-split lower (its mixed fit bound by the compute of the
A100s, which take more layers), so the evidence decides.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import replace

from meshllm.defaults import DECODE_TARGETS
from meshllm.partition.capacity import capacity, role_rates
from meshllm.partition.cost import flops_per_s
from meshllm.partition.grouping import Evaluator, Grouping
from meshllm.partition.inputs import PlanInputs
from meshllm.partition.replica import ReplicaEval, on_prefill_split, with_kv_room
from meshllm.sim import sweep, trials
from meshllm.sim.replica import from_grouping, sim_replica

FLIP_ROUNDS = 3  # step 5: replicas turned mixed at most, one per round of trials
FLIP_GAIN = 0.01  # a turn must lower the cost by this fraction
TTFT_SLACK = 1.5  # a turn to prefill may raise the TTFT p50 on the judge's trace at most this x (issue 8's
# bound against Splitwise's): its prompts' first tokens wait for nothing, the others' for a port's KV
CAPACITY_TURNS = 2  # step 6: kinds of decode replica turned mixed at most, one kind per round of trials
TURN_KINDS = 2  # step 6: kinds tried per round (those with the most compute: four runs each)
TURN_GAIN = 0.01  # step 6: a turn must sustain this much more in all, and lead on the evidence (step 7: too)
KV_ROOMS = (64, 256)  # step 7: sequences of KV room a mixed or decode pipeline is re-split for (the DP keeps 4)
KV_ROOM_GAIN = 0.03  # step 7: a re-split replica must sustain this much more alone


def with_roles(ev: Evaluator, g: Grouping, roles: tuple[str, ...], rate: float = 0.0) -> Grouping:
    """`g`'s replicas with other roles: capacity and link bound anew, and the prediction at
    `rate` (none if 0)."""
    out = ev.with_links(Grouping(g.groups, roles, g.evals, capacity(role_rates(g.evals), roles)[0]))
    return replace(out, prediction=ev.latency(out, rate)) if rate > 0 else out


Turn = tuple[float, int, int, Grouping]  # (cost at the rate, replica, variant, the grouping turned)


def turns_to_prefill(inp: PlanInputs, ev: Evaluator, best: Grouping, to_prefill: Sequence[int],
                     trace: Sequence[tuple[float, int, int]], rate: float, ttft_cap: float) -> list[Turn]:
    """`best` with one of its mixed replicas (of `to_prefill`) turned prefill, each run on `trace`
    at `rate`; only those whose KV has a replica to go to and whose TTFT p50 stays <= ttft_cap
    (variant 2: ranked after the turns to mixed at an equal cost)."""
    tried = []
    for i in to_prefill:
        if best.roles[i] != "mixed":
            continue
        roles = best.roles[:i] + ("prefill",) + best.roles[i + 1:]
        if not any(r in DECODE_TARGETS for r in roles):  # its KV must have somewhere to go
            continue
        cand = with_roles(ev, best, roles)
        c, t = trials.run_cost_ttft(from_grouping(inp, cand), trace, rate)
        if t <= ttft_cap:
            tried.append((c, i, 2, cand))
    return tried


def turns_to_mixed(inp: PlanInputs, ev: Evaluator, best: Grouping, flippable: Sequence[int],
                   trace: Sequence[tuple[float, int, int]], rate: float) -> list[Turn]:
    """`best` with one of its replicas (of `flippable`) turned mixed, each run on `trace` at
    `rate`: a prefill replica on its decode split (variant 0) and on its prefill split (1); the
    turn of the last prefill replica turns the decode replicas mixed too, or is not tried."""
    tried = []
    for i in flippable:
        if best.roles[i] == "mixed":
            continue
        roles = best.roles[:i] + ("mixed",) + best.roles[i + 1:]
        if "prefill" not in roles and "decode" in roles:  # no KV would reach a decode replica
            if any(r == "decode" and j not in flippable for j, r in enumerate(roles)):
                continue
            roles = tuple("mixed" if r == "decode" else r for r in roles)
        alt = on_prefill_split(inp.mc, best.evals[i], inp.net, inp.mix) if best.roles[i] == "prefill" else None
        for v, e in enumerate([best.evals[i]] + ([alt] if alt is not None else [])):
            cand = with_roles(ev, replace(best, evals=best.evals[:i] + (e,) + best.evals[i + 1:]), roles)
            tried.append((trials.run_cost(from_grouping(inp, cand), trace, rate), i, v, cand))
    return tried


def refine_roles(inp: PlanInputs, ev: Evaluator, g: Grouping, rate: float, sweep_requests: int = trials.JUDGE_SWEEP_REQUESTS,
                 log: bool = False) -> Grouping:
    """Step 5 of the module docstring: the pick with replicas turned mixed (or mixed ones turned
    prefill, within TTFT_SLACK of the pick's TTFT p50), one at a time while
    that lowers the cost at `rate` on the judge's trace by FLIP_GAIN (at most FLIP_ROUNDS
    replicas); kept if it still sustains HEADROOM x `rate` (by runs of `sweep_requests`: a
    baseline's grouping gets the reported sweep's length, as in step 3) and costs no more than the pick on the
    CONFIRM_SEEDS traces. Only replicas whose roles: the node files leave free; turned mixed, those that can hold a
    mixed split; a prefill replica is tried mixed on its decode split and on its prefill split
    (`on_prefill_split`: the RTX 3060 pair of bench-fog-40-8b at 9.9 req/s cost 14.84 s a
    request on 17 + 15 layers, 12.98 s on 16 + 16, the pick 13.86 s); the turn of the last
    prefill replica turns the decode replicas mixed too (or is not tried), as no KV would
    reach them. The result carries the analytic prediction at `rate` for its roles."""
    trace = sweep.make_trace(inp, trials.JUDGE_REQUESTS, trials.JUDGE_SEED)
    (cost, ttft), best, t0 = trials.run_cost_ttft(from_grouping(inp, g), trace, rate), g, time.perf_counter()
    free = [i for i, canon in enumerate(g.groups) if not (ev.any_forced and ev.group_role(canon))]
    flippable = [i for i in free if g.roles[i] != "mixed" and g.evals[i].mixed is not None]
    to_prefill = [i for i in free if g.roles[i] == "mixed" and g.evals[i].prefill is not None]
    for _ in range(FLIP_ROUNDS):
        tried = (turns_to_prefill(inp, ev, best, to_prefill, trace, rate, TTFT_SLACK * ttft)
                 + turns_to_mixed(inp, ev, best, flippable, trace, rate))
        if not tried:
            break
        c, i, _, cand = min(tried, key=lambda t: t[:3])
        if c > cost * (1 - FLIP_GAIN):
            break
        cost, best = c, cand
        if log:
            print(f"judge: replica {i} turned {best.roles[i]} costs {cost:.3f} s at {rate:.3f} req/s, "
                  f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    if best is g:
        return g
    best = with_roles(ev, best, best.roles, rate)  # with its prediction
    reps = from_grouping(inp, best)
    kept = (trials.saturation(inp, best, reps, sweep_requests) >= trials.HEADROOM * rate * (1 - 1e-9)
            and trials.confirm_total(inp, reps, rate) <= trials.confirm_total(inp, from_grouping(inp, g), rate))
    if log:
        print(f"judge: the roles turned ({role_counts(best)}) {'kept' if kept else 'not confirmed: the pick stays'} "
              f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    return best if kept else g


def decode_kinds(inp: PlanInputs, ev: Evaluator, g: Grouping) -> list[list[int]]:
    """`g`'s decode replicas that could turn mixed (able to hold a mixed split, roles left free by
    the node files), in kinds: the same device types; the kinds with the most compute first."""
    out: dict[tuple, list[int]] = {}
    for i, (canon, role, e) in enumerate(zip(g.groups, g.roles, g.evals, strict=True)):
        if role == "decode" and e.mixed is not None and not (ev.any_forced and ev.group_role(canon)):
            out.setdefault(tuple(sorted(inp.members[j].device.name for j in canon)), []).append(i)
    compute = {k: sum(flops_per_s(inp.members[j].device) for i in idx for j in g.groups[i]) for k, idx in out.items()}
    return [out[k] for k in sorted(out, key=lambda k: (-compute[k], out[k]))]


def turned_for_capacity(inp: PlanInputs, ev: Evaluator, g: Grouping, rate: float,
                        sweep_requests: int = trials.JUDGE_SWEEP_REQUESTS, log: bool = False) -> Grouping:
    """Step 6 of the module docstring: for capacity, the pick with a kind of its decode replicas
    (`decode_kinds`, the TURN_KINDS with the most compute) turned mixed, each trial run on the
    CAPACITY_SEEDS traces (runs as long as the reported sweep's); the one that sustains most there
    is taken if it out-sustains the plan so far on the evidence (`wins_on_evidence`) by more than
    TURN_GAIN in all; at most CAPACITY_TURNS kinds, one per round."""
    if not decode_kinds(inp, ev, g):
        return g  # nothing to turn: no runs

    best, t0, now = g, time.perf_counter(), None
    for _ in range(CAPACITY_TURNS):
        tried = []
        kinds = decode_kinds(inp, ev, best)[:TURN_KINDS]
        cands = [with_roles(ev, best, tuple("mixed" if i in idx else r for i, r in enumerate(best.roles)), rate)
                 for idx in kinds]
        runs = capacity_runs_of(inp, ([g] if now is None else []) + cands, sweep_requests)  # all at once
        if now is None:
            now, runs = runs[0], runs[1:]
        for idx, cand, got in zip(kinds, cands, runs):
            if trials.wins_on_evidence(got, now) and sum(got) > (1 + TURN_GAIN) * sum(now):
                tried.append((sum(got), -idx[0], got, cand))
            if log:
                print(f"judge: for capacity, replica {idx[0]} and its kind ({len(idx)}) turned mixed sustain "
                      f"{sum(got) / len(got):.3f} against {sum(now) / len(now):.3f} req/s on {len(got)} traces, "
                      f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
        if not tried:
            break
        _, _, now, best = max(tried, key=lambda t: t[:2])
    if log and best is not g:
        print(f"judge: for capacity, the roles turned: {role_counts(best)}", file=sys.stderr)
    return best


def capacity_runs(inp: PlanInputs, g: Grouping, sweep_requests: int) -> list[float]:
    """`g`'s saturation on each of the CAPACITY_SEEDS traces, by runs as long as the reported
    sweep's (steps 6 and 7: the evidence a turn is judged on)."""
    return capacity_runs_of(inp, [g], sweep_requests)[0]


def capacity_runs_of(inp: PlanInputs, gs: Sequence[Grouping], sweep_requests: int) -> list[list[float]]:
    """`capacity_runs` of each of `gs`, all run at once (sim/pool.py)."""
    longer, seeds = round(sweep_requests * trials.CONFIRM_SCALE), trials.CAPACITY_SEEDS
    got = iter(trials.saturations(inp, [(g, from_grouping(inp, g), longer, s) for g in gs for s in seeds]))
    return [[next(got) for _ in seeds] for _ in gs]


def kv_room_gainers(inp: PlanInputs, g: Grouping, sweep_requests: int) -> list[tuple[float, int, ReplicaEval]]:
    """`g`'s mixed and decode pipelines whose re-split for KV room (the best of KV_ROOMS) sustains
    KV_ROOM_GAIN more alone, as mixed, on the judge's trace: (gain, replica, re-split evaluation),
    the largest gain first."""
    pipes = []  # (replica, its evaluation, its re-splits)
    for i, (canon, role, e) in enumerate(zip(g.groups, g.roles, g.evals, strict=True)):
        if role == "prefill" or len(canon) < 2 or e.mixed is None:
            continue
        alts = [a for a in (with_kv_room(inp.mc, e, inp.net, inp.mix, r) for r in KV_ROOMS) if a is not None]
        if alts:
            pipes.append((i, e, alts))
    got = iter(trials.saturations(inp, [(g, [sim_replica(inp, 0, [inp.members[c] for c in g.groups[i]], "mixed", x)], sweep_requests,
                                         trials.JUDGE_SEED) for i, e, alts in pipes for x in [e, *alts]]))
    out = []
    for i, _, alts in pipes:
        alone = [next(got) for _ in range(1 + len(alts))]
        k = max(range(1, len(alone)), key=lambda k: (alone[k], -k))
        if alone[k] > (1 + KV_ROOM_GAIN) * alone[0]:
            out.append((alone[k] / max(alone[0], 1e-9), i, alts[k - 1]))
    return sorted(out, key=lambda t: (-t[0], t[1]))


def kv_room_for_capacity(inp: PlanInputs, ev: Evaluator, g: Grouping, rate: float,
                         sweep_requests: int = trials.JUDGE_SWEEP_REQUESTS, log: bool = False) -> Grouping:
    """Step 7 of the module docstring: for capacity, `g` with the pipelines that gain alone
    (`kv_room_gainers`) re-split for KV room, all of them, or failing that the one that gains
    most; taken if it out-sustains `g` on the CAPACITY_SEEDS traces (`wins_on_evidence`) by more
    than TURN_GAIN in all."""
    t0 = time.perf_counter()
    gainers = kv_room_gainers(inp, g, sweep_requests)
    if not gainers:
        return g
    now = None
    for group in [gainers] + ([gainers[:1]] if len(gainers) > 1 else []):
        evals = list(g.evals)
        for _, i, e in group:
            evals[i] = e
        cand = with_roles(ev, replace(g, evals=tuple(evals)), g.roles, rate)
        if now is None:  # the plan so far and the first candidate, at once
            now, got = capacity_runs_of(inp, [g, cand], sweep_requests)
        else:
            got = capacity_runs(inp, cand, sweep_requests)
        won = trials.wins_on_evidence(got, now) and sum(got) > (1 + TURN_GAIN) * sum(now)
        if log:
            print(f"judge: for capacity, replicas {', '.join(str(i) for _, i, _ in group)} re-split for KV room "
                  f"(gains alone x{', x'.join(f'{a:.2f}' for a, _, _ in group)}) sustain {sum(got) / len(got):.3f} "
                  f"against {sum(now) / len(now):.3f} req/s on {len(got)} traces: {'taken' if won else 'not taken'}, "
                  f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
        if won:
            return cand
    return g


def role_counts(g: Grouping) -> str:
    """`2 prefill, 5 decode, 1 mixed`."""
    return ", ".join(f"{g.roles.count(r)} {r}" for r in ("prefill", "decode", "mixed") if r in g.roles)
