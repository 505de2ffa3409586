"""The planner's judge: the search's candidate groupings, each run through the simulator, the
best one picked (`plan_cluster(inp, judge=simulated_judge)`).

The analytic model (partition/replica.py, latency.py) steers the GA through thousands of
groupings; it errs where the simulator's dynamics matter (deep mixed pipelines, a chunked-prefill
scheduler that cannot keep every stage busy), and the GA exploits such errors. So the last word
goes to the simulator itself, on a handful of candidates, on a trace of its own (JUDGE_SEED, not
the one results are reported on):
1. each candidate's saturation rate, by the stability rule of sweep.py on runs of 2 x 600 to
   2 x 1200 requests with 4 bisections (~2.5% resolution), cached per grouping;
2. the candidates include the baselines' own groupings (`operator_groupings`: mixed-dp's
   replicas all mixed and tuned Splitwise's pools, exactly as sim/baselines.py builds them), so
   the plan can always be what the best of those operators would run;
3. with no workload rate given (`inp.rate_per_s` 0: plan for capacity), eligible: the
   operator's own groupings (the baselines'; without those, the search's one-device-type-per-
   replica candidates), whose best saturation is the floor, and the others that sustain
   JUDGE_MARGIN more than that floor (the estimates are this noisy); all at least HEADROOM x
   the planned rate. With a rate given, capacity is only a constraint, as issue 8 asks:
   eligible are all that sustain HEADROOM x the rate (with the saturation floor at every
   rate, bench-mesh-200 at 4.2 req/s, half its capacity, got mixed-dp's grouping and waited
   0.65x Splitwise's, where plans with prefill replicas that sustain less wait less); the
   baselines' groupings by runs as long as the reported sweep's (N >= 2000, cached per
   grouping: bench-mesh-200's mixed-dp grouping sustains 6.50 req/s on 2 x 600 requests, 9.06
   on 2 x 2000, and the short runs shut it out at 6.86 req/s, where it waits 2.5 s and the
   search's pick 7.4 s; the search's candidates, many more, keep the short runs). Of
   those, with a rate given, the lowest cost at the rate wins (mean e2e + WAIT_WEIGHT x mean
   wait over JUDGE_REQUESTS requests, the planner's cost); for capacity, the highest
   saturation (issue 8: with no rate, maximise the rate at which the latency target holds,
   which the stability rule's wait cap keeps). If none is eligible, the highest saturation
   wins;
4. with a rate given, a winner that is not a baseline's grouping must cost no more than the
   cheapest eligible baseline grouping on the CONFIRM_SEEDS traces (`confirm_cost`, else the
   next is tried, then that baseline grouping wins); with no rate given, it must confirm its
   saturation: on CAPACITY_SEEDS more traces, with runs CONFIRM_SCALE x as long (as long as
   the reported sweep's: N >= 2000), its saturation must lead the best baseline grouping's on
   the same traces (of those within OP_SHORTLIST of the best on the short runs) by more than
   the traces' noise (`wins_on_evidence`: CONFIRM_Z standard errors of the per-trace
   differences); else the next eligible candidate is tried (at most CONFIRM_TOP of them), and then
   the best baseline grouping on those traces wins. A short run on one trace picked a plan 3% below mixed-dp on bench-edge-8b;
   and shorter confirming runs (N 1200) hid a decode backlog: on bench-mesh-200 they put a plan
   with five prefill replicas 11% above mixed-dp's grouping (8.41 against 7.55 req/s), which
   at N = 2000 on the same two traces was 4% below it (7.80 against 8.16). So meshllm's plan
   for capacity is either a baseline's grouping itself or one that out-sustains the best of
   them beyond the noise of the judge's traces;
5. with a rate given, the pick's replicas are turned mixed one at a time, the turn that costs
   least first, while each lowers the cost at the rate on the judge's trace (`refine_roles`, at
   most FLIP_ROUNDS), kept if it still sustains HEADROOM x the rate and costs no more than the
   pick on the CONFIRM_SEEDS traces. The next search grouping in cost order is refined too
   (REFINE_TOP), and the one that then costs less on those traces wins: a grouping's cost before
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
   four it leads by 1.67 req/s a trace (standard error 0.63).
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
from meshllm.partition.latency import WAIT_WEIGHT
from meshllm.partition.plan import Plan, plan_cluster, planner_evaluator
from meshllm.partition.replica import on_prefill_split
from meshllm.sim import baselines, sweep
from meshllm.sim.metrics import metrics, nearest_rank
from meshllm.sim.replica import from_grouping, from_plan

JUDGE_REQUESTS = 1200  # 400 ranked plans by noise: on bench-fog-40-8b it put first one that lost on 4 of 4 longer traces
JUDGE_SWEEP_REQUESTS = 600
JUDGE_BISECT_STEPS = 4
JUDGE_WINDOW, JUDGE_MAX_REQUESTS = 10, 1200  # as the reported sweep, shorter: it only compares candidates
JUDGE_SEED = 7919  # a trace of its own, not the one the results are reported on
HEADROOM = 1.25  # an eligible plan sustains at least this x the planned rate
JUDGE_MARGIN = 0.02  # a plan of its own must out-sustain the operator's groupings by this much (the
# final check on more traces guards the rest: 0.05 shut out bench-fog-40-8b's best plan at 1.045)
CONFIRM_SEEDS = (JUDGE_SEED + 1, JUDGE_SEED + 2)  # more traces of its own, for the final check
# for capacity, four: the sweep on one trace moves by +-5% on bench-fog-40-8b, and mixed-dp's sized
# grouping there by 25.1 to 30.8 req/s over these four (full sweeps on them tie it with the search's
# pick, 113.76 against 113.73 summed; the judge's shorter estimate, 113.26 against 114.34, is
# within one standard error: `wins_on_evidence`)
CAPACITY_SEEDS = tuple(JUDGE_SEED + 1 + k for k in range(4))
CONFIRM_Z = 1.0  # a plan of its own must lead the best baseline grouping by this many standard errors
OP_SHORTLIST = 0.8  # baseline groupings confirmed on long runs: within this of the best on short ones
CONFIRM_SCALE = sweep.SWEEP_REQUESTS / JUDGE_SWEEP_REQUESTS  # the final check's runs are this x longer
CONFIRM_TOP = 3  # eligible candidates checked at most before the best baseline grouping wins
# (2 left bench-edge-8b on mixed-dp's grouping, 17.04 req/s, once a mixed replica drained a backlog in
# 4 steps: its first two by the short runs lost the paired test, the third sustains 17.88)
FLIP_ROUNDS = 3  # step 5: replicas turned mixed at most, one per round of trials
FLIP_GAIN = 0.01  # a turn must lower the cost by this fraction
TTFT_SLACK = 1.5  # a turn to prefill may raise the TTFT p50 on the judge's trace at most this x (issue 8's
# bound against Splitwise's): its prompts' first tokens wait for nothing, the others' for a port's KV
CAPACITY_TURNS = 2  # step 6: kinds of decode replica turned mixed at most, one kind per round of trials
TURN_KINDS = 2  # step 6: kinds tried per round (those with the most compute: four runs each)
TURN_GAIN = 0.01  # step 6: a turn must sustain this much more in all, and lead on the evidence
REFINE_TOP = 2  # step 5: the pick and the next search grouping in cost order are refined; the cheaper wins
SIMULATED = ("mean_wait_ms", "p99_wait_ms", "ttft_p50_ms", "ttft_p99_ms", "mean_e2e_ms")  # judged_plan(report=True)
_SATURATION: dict[tuple, float] = {}  # (inputs, replicas, N, trace) -> saturation, across calls (the bench re-plans)
_CONFIRM: dict[tuple, float] = {}  # (inputs, replicas, rate) -> cost over the CONFIRM_SEEDS traces
CONFIRM_CACHE = 1024  # entries of _CONFIRM kept at most


def operator_groupings(inp: PlanInputs, ev: Evaluator) -> list[Grouping]:
    """mixed-dp's and tuned Splitwise's replicas and roles, exactly as sim/baselines.py builds
    them, as groupings of `inp.members` (each member list in its evaluation's order)."""
    index = {m.id: i for i, m in enumerate(inp.members)}
    out = []
    sub, _ = baselines.unforced(inp)
    evs, _ = baselines.mixed_dp_replicas(sub)
    if evs and all(e.mixed is not None for e in evs):
        out.append((evs, ["mixed"] * len(evs), sum(e.mixed_req_s for e in evs)))
    evs, roles, cap, _ = baselines.splitwise_pools(inp)
    if cap >= 0:
        out.append((evs, roles, cap))
    return [ev.with_links(Grouping(tuple(tuple(index[m.id] for m in e.members) for e in evs), tuple(roles),
                                   tuple(evs), cap)) for evs, roles, cap in out]


def run_cost(reps, trace, rate: float) -> float:
    return run_cost_ttft(reps, trace, rate)[0]


def run_cost_ttft(reps, trace, rate: float) -> tuple[float, float]:
    """The planner's cost at `rate` (mean e2e + WAIT_WEIGHT x mean wait) and the TTFT p50."""
    reqs = sweep.simulate(reps, trace, rate, gaps=False)
    ttft = sorted(r.first_token - r.arrival for r in reqs)
    return sum(r.done - r.arrival + WAIT_WEIGHT * r.wait_s for r in reqs) / len(reqs), nearest_rank(ttft, 0.5)


def inputs_key(inp: PlanInputs) -> tuple:
    return (inp.source, inp.args.name, inp.dtype, tuple(node.id for node in inp.nodes), inp.input_tokens,
            inp.output_tokens)


def confirm_total(inp: PlanInputs, reps, rate: float) -> float:
    """The cost at `rate` summed over the CONFIRM_SEEDS traces, cached (steps 4 and 5 of the module
    docstring ask it of the same plans: the pick, the baseline grouping it is held to, the
    refined pair)."""
    key = (inputs_key(inp), replicas_key(reps), rate)
    got = _CONFIRM.get(key)
    if got is None:
        if len(_CONFIRM) >= CONFIRM_CACHE:
            _CONFIRM.clear()
        got = _CONFIRM[key] = sum(run_cost(reps, sweep.make_trace(inp, JUDGE_REQUESTS, s), rate)
                                  for s in CONFIRM_SEEDS)
    return got


def replicas_key(reps) -> tuple:
    """What the simulator sees of a plan's replicas: their roles, members and layer counts (a
    grouping's groups and roles do not say which split a replica runs: a prefill replica turned
    mixed runs its decode split or its prefill split, `turns_to_mixed`)."""
    return tuple((r.role, tuple(m.id for m in r.members), tuple(r.counts)) for r in reps)


def saturation(inp: PlanInputs, g: Grouping, reps, requests: int = JUDGE_SWEEP_REQUESTS,
               seed: int = JUDGE_SEED) -> float:
    key = (*inputs_key(inp), replicas_key(reps), requests, seed)
    got = _SATURATION.get(key)
    if got is None:
        most = max(requests, JUDGE_MAX_REQUESTS * requests // JUDGE_SWEEP_REQUESTS)
        s = sweep.Sweep(reps, inp, seed, requests, JUDGE_WINDOW, most, confirm=False)
        got = _SATURATION[key] = s.saturation(JUDGE_BISECT_STEPS)
    return got


def eligible_for(sat: Sequence[float], floor_from: Sequence[int], rate: float, given: bool) -> list[int]:
    """The candidates (by index) that may win (step 3 of the module docstring): each sustains
    HEADROOM x `rate`; for capacity (`given` False) also the best saturation of `floor_from`,
    and JUDGE_MARGIN more unless it is one of them."""
    floor = 0.0 if given else max([sat[i] for i in floor_from], default=0.0)
    need = [floor if i in floor_from else floor * (1 + JUDGE_MARGIN) for i in range(len(sat))]
    return [i for i, s in enumerate(sat) if s >= max(need[i], HEADROOM * rate) * (1 - 1e-9)]


def judged_plan(inp: PlanInputs, seed: int = 0, log: bool = False, sweep_requests: int = JUDGE_SWEEP_REQUESTS,
                report: bool = False) -> Plan:
    """The planner with the simulator as its judge, for `inp.rate_per_s` (0: for capacity): the
    plan `--simulate` and bench/planner.py run as meshllm, and `--plan --judge` prints. `log`:
    progress on stderr (each candidate's saturation, minutes on a 200-device cluster).
    `report`: the plan's `simulated` holds the simulator's figures at the planned rate
    (`SIMULATED`, on the judge's trace of JUDGE_REQUESTS requests) and the pick's saturation in
    the judge's sweep, beside the analytic prediction and capacity, which can be far off where
    the simulator's dynamics matter (bench-mesh-200's search pick at 1 req/s: TTFT 1.0 s
    predicted, ~8 s simulated; its judged plan: capacity 2.6 req/s analytic, 8.2 simulated)."""
    picked: list[Grouping] = []

    def judge(*args) -> Grouping:
        picked.append(simulated_judge(*args, sweep_requests=sweep_requests, log=log))
        return picked[-1]

    plan = plan_cluster(inp, seed=seed, log=log, judge=judge)
    rate = plan.prediction.get("rate_per_s", 0.0)
    if not report or rate <= 0:
        return plan
    g = picked[-1]
    m = metrics(sweep.simulate(from_plan(inp, plan), sweep.make_trace(inp, JUDGE_REQUESTS, JUDGE_SEED), rate))
    return replace(plan, simulated={"rate_per_s": rate, "requests": float(JUDGE_REQUESTS),
                                    **{k: float(m[k]) for k in SIMULATED},
                                    "saturation_req_s": saturation(inp, g, from_grouping(inp, g), sweep_requests)})


def simulated_judge(inp: PlanInputs, candidates: Sequence[Grouping], rate: float,
                    floor_from: Sequence[int] = (), sweep_requests: int = JUDGE_SWEEP_REQUESTS,
                    log: bool = False) -> Grouping:
    """The winner among `candidates` and the baselines' groupings; `floor_from`: the candidates
    whose saturation eligible ones must match; `sweep_requests`: N of the saturation runs
    (smaller for quick runs); `log`: a line on stderr per candidate and for the pick."""
    ev = planner_evaluator(inp)
    ops = [Grouping(g.groups, g.roles, g.evals, g.fitness, ev.latency(g, rate) if rate > 0 else None, g.link_req_s)
           for g in operator_groupings(inp, ev)]
    cands = list(candidates) + ops
    op_idx = range(len(candidates), len(cands))
    floor_from = list(op_idx) if ops else list(floor_from)  # the baselines' groupings, when there are any
    reps = [from_grouping(inp, g) for g in cands]
    sat, t0 = [], time.perf_counter()
    for k, (g, r) in enumerate(zip(cands, reps)):
        sat.append(saturation(inp, g, r, sweep_requests))
        if log:
            print(f"judge: candidate {k + 1}/{len(cands)} ({describe(g, k in op_idx)}) sustains {sat[-1]:.3f} req/s "
                  f"in the simulator, {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    at_rate = inp.rate_per_s > 0 and rate > 0  # planning for a workload's rate, not for capacity
    longer = round(sweep_requests * CONFIRM_SCALE)
    if at_rate:  # step 3: a baseline's grouping is eligible by a run as long as its sweep's
        for k in op_idx:
            sat[k] = saturation(inp, cands[k], reps[k], longer)
            if log:
                print(f"judge: candidate {k + 1}/{len(cands)} ({describe(cands[k], True)}) sustains {sat[k]:.3f} req/s "
                      f"on {longer} requests, {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    if log:
        how = "the highest saturation" if inp.rate_per_s <= 0 else f"the lowest cost at {rate:.3f} req/s"
        print(f"judge: choosing {how} (a plan of the search's own is checked on "
              f"{len(CONFIRM_SEEDS if inp.rate_per_s > 0 else CAPACITY_SEEDS)} more traces)",
              file=sys.stderr)
    k, order = pick(inp, cands, reps, sat, op_idx, floor_from, rate, sweep_requests)
    if log:
        print(f"judge: picked candidate {k + 1} ({describe(cands[k], k in op_idx)}), {time.perf_counter() - t0:.1f} s",
              file=sys.stderr)
    if not at_rate:
        return turned_for_capacity(inp, ev, cands[k], rate, sweep_requests, log)
    tries = [k] + [i for i in order[:REFINE_TOP] if i != k and i not in op_idx][:REFINE_TOP - 1]
    # a baseline's grouping was eligible by runs as long as the reported sweep's, so is what it turns into
    refined = [refine_roles(inp, ev, cands[i], rate, longer if i in op_idx else sweep_requests, log) for i in tries]
    if len(refined) == 1:
        return refined[0]
    costs = [confirm_total(inp, from_grouping(inp, g), rate) for g in refined]
    j = min(range(len(refined)), key=lambda j: (costs[j], j))
    if log:
        n = len(CONFIRM_SEEDS)
        print(f"judge: refined, candidate {tries[j] + 1} costs least on {n} more traces "
              f"({', '.join(f'{i + 1}: {c / n:.3f} s' for i, c in zip(tries, costs))})", file=sys.stderr)
    return refined[j]


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
        c, t = run_cost_ttft(from_grouping(inp, cand), trace, rate)
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
            tried.append((run_cost(from_grouping(inp, cand), trace, rate), i, v, cand))
    return tried


def refine_roles(inp: PlanInputs, ev: Evaluator, g: Grouping, rate: float, sweep_requests: int = JUDGE_SWEEP_REQUESTS,
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
    trace = sweep.make_trace(inp, JUDGE_REQUESTS, JUDGE_SEED)
    (cost, ttft), best, t0 = run_cost_ttft(from_grouping(inp, g), trace, rate), g, time.perf_counter()
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
    kept = (saturation(inp, best, reps, sweep_requests) >= HEADROOM * rate * (1 - 1e-9)
            and confirm_total(inp, reps, rate) <= confirm_total(inp, from_grouping(inp, g), rate))
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
                        sweep_requests: int = JUDGE_SWEEP_REQUESTS, log: bool = False) -> Grouping:
    """Step 6 of the module docstring: for capacity, the pick with a kind of its decode replicas
    (`decode_kinds`, the TURN_KINDS with the most compute) turned mixed, each trial run on the
    CAPACITY_SEEDS traces (runs as long as the reported sweep's); the one that sustains most there
    is taken if it out-sustains the plan so far on the evidence (`wins_on_evidence`) by more than
    TURN_GAIN in all; at most CAPACITY_TURNS kinds, one per round."""
    if not decode_kinds(inp, ev, g):
        return g  # nothing to turn: no runs
    longer = round(sweep_requests * CONFIRM_SCALE)

    def runs(x: Grouping) -> list[float]:
        return [saturation(inp, x, from_grouping(inp, x), longer, seed) for seed in CAPACITY_SEEDS]

    best, t0 = g, time.perf_counter()
    now = runs(g)
    for _ in range(CAPACITY_TURNS):
        tried = []
        for idx in decode_kinds(inp, ev, best)[:TURN_KINDS]:
            roles = tuple("mixed" if i in idx else r for i, r in enumerate(best.roles))
            cand = with_roles(ev, best, roles, rate)
            got = runs(cand)
            if wins_on_evidence(got, now) and sum(got) > (1 + TURN_GAIN) * sum(now):
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


def role_counts(g: Grouping) -> str:
    """`2 prefill, 5 decode, 1 mixed`."""
    return ", ".join(f"{g.roles.count(r)} {r}" for r in ("prefill", "decode", "mixed") if r in g.roles)


def describe(g: Grouping, baseline: bool) -> str:
    """`2 prefill, 5 decode, 1 mixed; the search's grouping` (or `...; a baseline's grouping`)."""
    return f"{role_counts(g)}; {'a baseline' if baseline else 'the search'}'s grouping"


def pick(inp: PlanInputs, cands: Sequence[Grouping], reps, sat: Sequence[float], op_idx: range,
         floor_from: Sequence[int], rate: float, sweep_requests: int) -> tuple[int, list[int]]:
    """Steps 3 and 4 of the module docstring, given each candidate's saturation: the winner's index,
    and the eligible candidates in the order they were ranked (by cost at a given rate)."""
    ops = list(op_idx)
    for_capacity = inp.rate_per_s <= 0  # no workload rate: the highest saturation wins
    given = not for_capacity and bool(ops)  # a workload rate: its cost decides, capacity is a constraint
    eligible = eligible_for(sat, floor_from, rate, given)
    if not eligible:
        order = sorted(range(len(sat)), key=lambda i: (-sat[i], i))
    elif for_capacity or len(eligible) == 1:
        order = sorted(eligible, key=lambda i: (-sat[i], i))
    else:
        trace = sweep.make_trace(inp, JUDGE_REQUESTS, JUDGE_SEED)
        order = [i for _, i in sorted((run_cost(reps[i], trace, rate), i) for i in eligible)]
    if not ops:
        return order[0], order
    if given:
        return confirm_cost(inp, reps, order, [i for i in order if i in op_idx], rate), order
    longer = round(sweep_requests * CONFIRM_SCALE)
    theirs: dict[int, list[float]] = {}

    def best_op() -> int:
        """The baseline grouping with the highest saturation summed over CAPACITY_SEEDS (those
        within OP_SHORTLIST of the best on the short runs)."""
        if not theirs:
            top = max(sat[j] for j in op_idx)
            theirs.update({j: [saturation(inp, cands[j], reps[j], longer, s) for s in CAPACITY_SEEDS]
                           for j in op_idx if sat[j] >= OP_SHORTLIST * top})
        return max(theirs, key=lambda j: (sum(theirs[j]), -j))

    for i in order[:CONFIRM_TOP]:
        if i in op_idx:
            return best_op(), order
        mine = [saturation(inp, cands[i], reps[i], longer, s) for s in CAPACITY_SEEDS]
        if wins_on_evidence(mine, theirs[best_op()]):
            return i, order
    return best_op(), order


def wins_on_evidence(mine: Sequence[float], theirs: Sequence[float]) -> bool:
    """Step 4's test for capacity: a plan of the search's own replaces the best baseline grouping
    only if its saturation on the same traces leads by at least CONFIRM_Z standard errors of the
    per-trace differences (a paired test; identical runs pass). On a tie within that noise the
    baseline's grouping is the plan, so a tie no longer leaves meshllm below it on other traces:
    on bench-fog-40-8b the search's pick led mixed-dp's sized grouping by 0.27 req/s a trace on
    average (+2.17, +1.34, -1.23, -1.21: one standard error 0.89) and lost to it by 1.4% on the
    benchmark's three traces; on bench-edge-8b its pick leads by 0.74 (standard error 0.24)."""
    d = [a - b for a, b in zip(mine, theirs, strict=True)]
    mean = sum(d) / len(d)
    var = sum((x - mean) ** 2 for x in d) / (len(d) - 1) if len(d) > 1 else 0.0
    return mean >= CONFIRM_Z * (var / len(d)) ** 0.5 - 1e-9 * max(1.0, *map(abs, theirs))


def confirm_cost(inp: PlanInputs, reps, order: Sequence[int], ops: Sequence[int], rate: float) -> int:
    """At a given rate: the first of `order` that is a baseline's grouping, or that costs no more
    than the cheapest eligible baseline grouping (`ops[0]`) on the CONFIRM_SEEDS traces; with no
    baseline grouping eligible, the first of `order`."""
    if not ops:
        return order[0]
    for i in order[:CONFIRM_TOP]:
        if i in ops:
            return i
        if confirm_total(inp, reps[i], rate) <= confirm_total(inp, reps[ops[0]], rate):
            return i
    return ops[0]
