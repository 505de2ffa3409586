"""The Plan: replicas (stages + roles), drafters, unused nodes; JSON (README schema), validation.

`plan_cluster(inp)` is the planner: GA grouping (genetic.py) over the nodes allowed to hold a
stage, DP split per replica (dp.py), prefill / decode / mixed roles (grouping.py), latency at
the workload's rate (latency.py), drafters among the rest, and why each node outside a
replica is there (unused.py). Its
input is a plain `PlanInputs` (inputs.py), built from a cluster file by config.py or from the
peer table by a live coordinator. `Plan.to_json` / `Plan.from_json` are the README's `--plan`
object and the PLAN message's payload.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from meshllm.defaults import REPLICA_ROLES, WEIGHT_DTYPES, Role
from meshllm.errors import InputError
from meshllm.partition.dp import Split, memory_shortfall
from meshllm.partition.genetic import evolve_plan
from meshllm.partition.grouping import Evaluator, Grouping
from meshllm.partition.inputs import PlanInputs
from meshllm.partition.replica import decode_fit, evaluate_replica, prefill_fit
from meshllm.partition.unused import draft_build_bytes, outside_reasons

GB = 1e9


def rounded(x: float, places: int) -> float:
    """`x` to `places` decimals, or to 4 significant digits below 0.001 (6 decimals printed a plan
    for 1e-9 req/s as `rate_per_s: 0.0`)."""
    return round(x, places) if x == 0 or not math.isfinite(x) or abs(x) >= 1e-3 else float(f"{x:.4g}")


class PlanInfeasible(InputError):
    """The cluster cannot serve the model at all; the message names the shortfall."""


class PlanError(ValueError):
    """A plan violates an invariant (layers not covered, memory exceeded, unknown node)."""


@dataclass(frozen=True)
class Stage:
    node: str
    layers: tuple[int, int]  # half-open


@dataclass(frozen=True)
class Replica:
    id: int
    role: Role  # prefill | decode | mixed
    stages: tuple[Stage, ...]
    prefill_tok_s: float
    decode_tok_s: float
    bottleneck_ms: float


@dataclass(frozen=True)
class Plan:
    model: str
    n_layers: int
    dtype: str
    replicas: tuple[Replica, ...]
    drafters: tuple[str, ...]
    unused: tuple[str, ...]
    planner_s: float
    capacity_req_s: float  # the GA fitness: sustainable requests/s for the workload mix
    reasons: dict[str, str] = field(default_factory=dict)  # node outside every replica -> why
    prediction: dict[str, float] = field(default_factory=dict)  # latency.py at the planned rate (ms, req/s)
    simulated: dict[str, float] = field(default_factory=dict)  # the simulator at that rate (`--plan --judge`)

    def to_json(self) -> dict:
        return {
            "replicas": [{"id": r.id, "role": r.role,
                          "stages": [{"node": s.node, "layers": list(s.layers)} for s in r.stages],
                          "predicted": {"prefill_tok_s": round(r.prefill_tok_s, 3),
                                        "decode_tok_s": round(r.decode_tok_s, 3),
                                        "bottleneck_ms": round(r.bottleneck_ms, 3)}} for r in self.replicas],
            "drafters": list(self.drafters),
            "unused": list(self.unused),
            "planner_s": round(self.planner_s, 4),
            "model": self.model, "n_layers": self.n_layers, "dtype": self.dtype,
            "capacity_req_s": rounded(self.capacity_req_s, 6),
            "unused_reasons": {n: self.reasons[n] for n in self.unused if n in self.reasons},
            "drafter_reasons": {n: self.reasons[n] for n in self.drafters if n in self.reasons},
            # a rate above the plan's capacity waits without bound: null (JSON has no Infinity)
            "prediction": {k: v if math.isfinite(v) else None for k, v in self.prediction.items()},
            "simulated": {k: v if math.isfinite(v) else None for k, v in self.simulated.items()},
        }

    @classmethod
    def from_json(cls, obj: Any) -> Plan:
        """The inverse of `to_json`, for plans that arrive over the network: anything malformed is a
        PlanError naming what is wrong (never a KeyError deep inside a role)."""
        try:
            reps = []
            for r in obj["replicas"]:
                stages = tuple(Stage(str(s["node"]), (int(s["layers"][0]), int(s["layers"][1])))
                               for s in r["stages"])
                p = r["predicted"]
                reps.append(Replica(int(r["id"]), Role(r["role"]), stages, float(p["prefill_tok_s"]),
                                    float(p["decode_tok_s"]), float(p["bottleneck_ms"])))
            reasons = {str(k): str(v) for key in ("unused_reasons", "drafter_reasons")
                       for k, v in dict(obj.get(key, {})).items()}
            plan = cls(str(obj["model"]), int(obj["n_layers"]), str(obj["dtype"]), tuple(reps),
                       tuple(str(x) for x in obj["drafters"]), tuple(str(x) for x in obj["unused"]),
                       float(obj["planner_s"]), float(obj["capacity_req_s"]), reasons,
                       {str(k): _figure(v) for k, v in dict(obj.get("prediction", {})).items()},
                       {str(k): _figure(v) for k, v in dict(obj.get("simulated", {})).items()})
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            raise PlanError(f"malformed plan: {type(e).__name__}: {e}") from None
        if plan.dtype not in WEIGHT_DTYPES:  # the stages size their KV room by it (roles/host.py)
            raise PlanError(f"dtype {plan.dtype!r} is not one of {list(WEIGHT_DTYPES)}")
        for r in plan.replicas:
            if r.role not in REPLICA_ROLES:
                raise PlanError(f"replica {r.id}: role {r.role!r} is not one of {[str(x) for x in REPLICA_ROLES]}")
            check_cover(r.id, [s.layers for s in r.stages], plan.n_layers)
        return plan

    def nodes_in_use(self) -> set[str]:
        """Every node with a stage or a drafter's job in this plan."""
        return {s.node for r in self.replicas for s in r.stages} | set(self.drafters)

    def replica_of(self, node: str) -> tuple[Replica, int] | None:
        """(replica, stage index) holding `node`, if any."""
        for r in self.replicas:
            for i, s in enumerate(r.stages):
                if s.node == node:
                    return r, i
        return None

    def describe(self) -> str:
        lines = [f"plan for {self.model} ({self.n_layers} layers, {self.dtype}): {len(self.replicas)} replica{'s' * (len(self.replicas) != 1)}, "
                 f"capacity {self.capacity_req_s:.3f} req/s, planned in {self.planner_s:.2f} s"]
        for r in self.replicas:
            stages = "  ".join(f"{s.node}[{s.layers[0]},{s.layers[1]})" for s in r.stages)
            lines.append(f"  replica {r.id} {r.role:7s} prefill {r.prefill_tok_s:9.1f} tok/s  decode "
                         f"{r.decode_tok_s:8.1f} tok/s  bottleneck {r.bottleneck_ms:8.2f} ms  {stages}")
        if self.prediction:
            p = self.prediction
            if math.isfinite(p["mean_wait_ms"]):
                lines.append(f"  predicted at {p['rate_per_s']:.3f} req/s: mean wait {p['mean_wait_ms']:.1f} ms, "
                             f"TTFT {p['mean_ttft_ms']:.1f} ms, end-to-end {p['mean_e2e_ms']:.1f} ms")
            else:
                lines.append(f"  predicted at {p['rate_per_s']:.3f} req/s: above the plan's capacity, waits grow "
                             "without bound")
        if self.simulated:
            s = self.simulated
            lines.append(f"  simulated at {s['rate_per_s']:.3f} req/s ({s['requests']:.0f} requests): mean wait "
                         f"{s['mean_wait_ms']:.1f} ms (p99 {s['p99_wait_ms']:.1f}), TTFT p50 {s['ttft_p50_ms']:.1f} ms "
                         f"(p99 {s['ttft_p99_ms']:.1f}), end-to-end {s['mean_e2e_ms']:.1f} ms; sustains "
                         f"{s['saturation_req_s']:.3f} req/s in the judge's sweep")
        lines.append(f"  drafters: {', '.join(self.drafters) or '-'}")
        lines.append(f"  unused:   {', '.join(self.unused) or '-'}")
        lines += [f"    {n}: {why}" for n, why in self.reasons.items()]
        return "\n".join(lines)


def build_replicas(inp: PlanInputs, grouping: Grouping) -> tuple[Replica, ...]:
    out = []
    for rid, (canon, role, ev) in enumerate(zip(grouping.groups, grouping.roles, grouping.evals, strict=True)):
        fit = {"prefill": ev.prefill, "decode": ev.decode, "mixed": ev.mixed}[role]
        assert fit is not None
        split: Split = fit.split
        members = ev.members
        stages = tuple(Stage(inp.members[canon[i]].id, rng) for i, rng in zip(split.order, split.ranges))
        pf = prefill_fit(inp.mc, members, split, inp.net, inp.mix)
        df = decode_fit(inp.mc, members, split, inp.net, inp.mix)
        out.append(Replica(rid, Role(role), stages, pf.tok_s, df.tok_s, split.bottleneck_s * 1000))
    return tuple(out)


def choose_drafters(inp: PlanInputs, in_replicas: set[str]) -> tuple[list[str], list[str]]:
    """Nodes outside replicas become drafters if allowed and they can hold the draft model while
    they build it: the draft and one layer of the target in fp32 (weights.load_quantized)."""
    draft_bytes = draft_build_bytes(inp)
    drafters, unused = [], []
    for n in inp.nodes:
        if n.id in in_replicas:
            continue
        ok = (n.roles is None or Role.DRAFTER in n.roles) and n.device.memory_bytes >= draft_bytes
        (drafters if ok else unused).append(n.id)
    return drafters, unused


def plan_from_grouping(inp: PlanInputs, grouping: Grouping, t0: float, ev: Evaluator | None = None) -> Plan:
    replicas = build_replicas(inp, grouping)
    drafters, unused = choose_drafters(inp, {s.node for r in replicas for s in r.stages})
    reasons = outside_reasons(inp, ev, grouping, set(drafters)) if ev is not None else {}
    pred = grouping.prediction
    prediction = {} if pred is None else {
        "rate_per_s": rounded(float(pred.rate_per_s), 6), "mean_wait_ms": round(float(1000 * pred.wait_s), 3),
        "mean_ttft_ms": round(float(1000 * pred.ttft_s), 3), "mean_e2e_ms": round(float(1000 * pred.e2e_s), 3)}
    plan = Plan(inp.args.name, inp.args.n_layers, inp.dtype, replicas, tuple(drafters), tuple(unused),
                time.perf_counter() - t0, grouping.fitness, reasons, prediction)
    validate_plan(plan, inp)
    return plan


def planner_evaluator(inp: PlanInputs) -> Evaluator:
    return Evaluator(inp.mc, inp.members, inp.net, inp.mix, inp.forced, (inp.input_tokens.cs2, inp.output_tokens.cs2))


Judge = Callable[[PlanInputs, Sequence[Grouping], float, Sequence[int]], Grouping]


def plan_cluster(inp: PlanInputs, seed: int = 0, log: bool = True, judge: Judge | None = None) -> Plan:
    """The planner (GA + DP + roles), for the workload's rate (`inp.rate_per_s`; 0: none given).
    `judge(inp, candidates, rate, standard) -> grouping` picks among the search's candidates and
    any it adds (the simulator's `sim.judge.simulated_judge` runs each through the simulator and
    adds the baselines' own groupings; `standard`: the candidates an operator would run, whose
    saturation the pick must match); without one, the
    latency phase's pick stands. Raises PlanInfeasible when no replica can be formed."""
    t0 = time.perf_counter()
    ev = planner_evaluator(inp)
    found = evolve_plan(ev, inp.rate_per_s, seed=seed, log=log)
    grouping = found.best
    if not grouping.groups or grouping.fitness <= 0:
        raise PlanInfeasible(f"{inp.source}: cannot serve {inp.args.name}: {infeasible_reason(inp)}")
    if judge is not None:
        grouping = judge(inp, found.candidates, found.rate, found.standard)
    return plan_from_grouping(inp, grouping, t0, ev)


def _figure(v: Any) -> float:
    """A prediction's figure from JSON: null is an unbounded one (to_json writes inf as null)."""
    return math.inf if v is None else float(v)


NO_STAGE = "no node may hold a stage (every node's roles exclude prefill and decode)"


def check_servable(inp: PlanInputs) -> None:
    """PlanInfeasible when no plan can exist, as far as is known without a search (no node may
    hold a stage, or all that may are short of memory together): `--simulate` checks it first."""
    why = NO_STAGE if not inp.members else phase_shortfall(inp)
    if why is None:
        why = memory_shortfall(inp.mc, inp.members, inp.mix.prefill_wp())
        why = why and f"all stage-capable nodes together: {why}"
    if why is not None:
        raise PlanInfeasible(f"{inp.source}: cannot serve {inp.args.name}: {why}")


def phase_shortfall(inp: PlanInputs) -> str | None:
    """Every request is prefilled and decoded by a replica that holds the whole model, so the
    nodes whose `roles:` allow each phase must hold it together (a mixed replica does both: its
    nodes must allow both); else why not."""
    for phase in ("prefill", "decode"):
        able = [m for m, f in zip(inp.members, inp.forced) if f in (None, phase)]
        if not able:
            return f"no node may {phase} (the stage-capable nodes' roles allow only {inp.forced[0]})"
        if len(able) < len(inp.members) and (short := memory_shortfall(inp.mc, able, inp.mix.prefill_wp())):
            return f"the nodes that may {phase} cannot hold the model together: {short}"
    return None


def infeasible_reason(inp: PlanInputs) -> str:
    if not inp.members:
        return NO_STAGE
    if why := phase_shortfall(inp):
        return why
    ev = evaluate_replica(inp.mc, inp.members, inp.net, inp.mix)
    if ev.reason:
        return f"all stage-capable nodes together: {ev.reason}"
    if len(inp.members) > 1 and any(f is not None for f in inp.forced):
        return "the nodes' roles leave no valid prefill/decode assignment"
    return "no replica reaches a positive request rate"


def validate_plan(plan: Plan, inp: PlanInputs) -> None:
    """Layers cover [0, L) in every replica, nodes exist and appear once, stage memory fits, and
    each replica's role is one its nodes' `roles:` allow."""
    nodes = {n.id: n for n in inp.nodes}
    forced = dict(zip((m.id for m in inp.members), inp.forced))
    seen: set[str] = set()
    for r in plan.replicas:
        if r.role not in REPLICA_ROLES:
            raise PlanError(f"replica {r.id}: role {r.role!r}")
        if bad := [s.node for s in r.stages if forced.get(s.node) not in (None, str(r.role))]:
            raise PlanError(f"replica {r.id}: {r.role} on {bad[0]}, whose roles allow {forced[bad[0]]} only")
        check_cover(r.id, [s.layers for s in r.stages], plan.n_layers)
        for i, s in enumerate(r.stages):
            if s.node not in nodes or s.node in seen:
                raise PlanError(f"replica {r.id}: node {s.node!r} unknown or used twice")
            seen.add(s.node)
            need = inp.mc.stage_weight_bytes(s.layers[1] - s.layers[0], i == 0, i == len(r.stages) - 1)
            if need > nodes[s.node].device.memory_bytes:
                raise PlanError(f"replica {r.id}: {s.node} needs {need / GB:.2f} GB, has "
                                f"{nodes[s.node].device.memory_gb} GB")
    rest = set(plan.drafters) | set(plan.unused)
    if rest & seen or rest | seen != set(nodes) or len(plan.drafters) + len(plan.unused) != len(rest):
        raise PlanError("every node must be in exactly one of: a replica, drafters, unused")


def check_cover(rid: int, ranges: Sequence[tuple[int, int]], n_layers: int) -> None:
    pos = 0
    for s, e in ranges:
        if s != pos or e <= s:
            raise PlanError(f"replica {rid}: stage [{s},{e}) does not continue at layer {pos}")
        pos = e
    if pos != n_layers:
        raise PlanError(f"replica {rid}: layers end at {pos}, model has {n_layers}")
