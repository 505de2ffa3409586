"""The Plan: replicas (stages + roles), drafters, unused nodes; JSON (BRIEF schema), validation.

`plan_cluster(cfg)` is the planner: GA grouping (genetic.py) over the nodes allowed to hold a
stage, DP split per replica (dp.py), roles by the max-min rule, drafters among the rest.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from meshllm.config import ClusterConfig
from meshllm.errors import InputError
from meshllm.model import ModelArgs, model_args
from meshllm.partition.cost import DRAFT_DTYPE, ModelCosts, model_costs
from meshllm.partition.dp import Member, Net, Split
from meshllm.partition.genetic import Evaluator, Grouping, evolve
from meshllm.partition.replica import Mix, decode_fit, evaluate_replica, prefill_fit

STAGE_ROLES = ("prefill", "decode")
GB = 1e9


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
    role: str  # "prefill" | "decode"
    stages: tuple[Stage, ...]
    prefill_tok_s: float
    decode_tok_s: float
    bottleneck_ms: float
    decode_batch: int = 1  # concurrent sequences its memory holds (decode)


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
        }

    def describe(self) -> str:
        lines = [f"plan for {self.model} ({self.n_layers} layers, {self.dtype}): {len(self.replicas)} replicas, "
                 f"capacity {self.capacity_req_s:.3f} req/s, planned in {self.planner_s:.2f} s"]
        for r in self.replicas:
            stages = "  ".join(f"{s.node}[{s.layers[0]},{s.layers[1]})" for s in r.stages)
            lines.append(f"  replica {r.id} {r.role:7s} prefill {r.prefill_tok_s:9.1f} tok/s  decode "
                         f"{r.decode_tok_s:8.1f} tok/s  bottleneck {r.bottleneck_ms:8.2f} ms  {stages}")
        lines.append(f"  drafters: {', '.join(self.drafters) or '-'}")
        lines.append(f"  unused:   {', '.join(self.unused) or '-'}")
        return "\n".join(lines)


@dataclass(frozen=True)
class PlanInputs:
    """Everything the planner and simulator derive from a cluster file."""

    args: ModelArgs
    dtype: str
    mc: ModelCosts
    members: tuple[Member, ...]  # nodes allowed to hold a stage
    forced: tuple[str | None, ...]  # per member: the only stage role its `roles:` allows, if one
    net: Net
    mix: Mix


def resolve_args(model: str) -> ModelArgs:
    """Registry name, or a model file/dir through weights.py when available."""
    try:
        from meshllm.weights import resolve_model_args  # lazy: reads GGUF metadata / config.json
    except ImportError:
        resolve_model_args = None
    try:
        return resolve_model_args(model) if resolve_model_args else model_args(model)
    except ValueError as e:
        if isinstance(e, InputError):
            raise
        raise InputError(f"model: {e}") from None


def plan_inputs(cfg: ClusterConfig) -> PlanInputs:
    args = resolve_args(cfg.model)
    dtype = cfg.weights_dtype
    members, forced = [], []
    for n in cfg.nodes:
        allowed = STAGE_ROLES if n.roles is None else tuple(r for r in STAGE_ROLES if r in n.roles)
        if allowed:
            members.append(Member(n.id, n.device, n.zone))
            forced.append(allowed[0] if len(allowed) == 1 else None)
    net = Net({frozenset(ln.zones): (ln.rtt_ms, ln.bandwidth_mbps) for ln in cfg.links})
    wl = cfg.workload
    return PlanInputs(args, dtype, model_costs(args, dtype), tuple(members), tuple(forced), net,
                      Mix(wl.input_tokens.mean, wl.output_tokens.mean))


def build_replicas(inp: PlanInputs, grouping: Grouping) -> tuple[Replica, ...]:
    out = []
    for rid, (canon, role, ev) in enumerate(zip(grouping.groups, grouping.roles, grouping.evals, strict=True)):
        fit = ev.prefill if role == "prefill" else ev.decode
        assert fit is not None
        split: Split = fit.split
        members = ev.members
        stages = tuple(Stage(inp.members[canon[i]].id, rng) for i, rng in zip(split.order, split.ranges))
        pf = prefill_fit(inp.mc, members, split, inp.net, inp.mix)
        df = decode_fit(inp.mc, members, split, inp.net, inp.mix)
        out.append(Replica(rid, role, stages, pf.tok_s, df.tok_s, split.bottleneck_s * 1000, df.batch))
    return tuple(out)


def choose_drafters(cfg: ClusterConfig, inp: PlanInputs, in_replicas: set[str]) -> tuple[list[str], list[str]]:
    """Nodes outside replicas become drafters if allowed and they can hold the draft model."""
    quant = cfg.draft.quant
    spec_on = cfg.speculation.mode != "off" and quant in DRAFT_DTYPE
    draft_bytes = model_costs(inp.args, DRAFT_DTYPE[quant]).weight_bytes if spec_on else float("inf")
    drafters, unused = [], []
    for n in cfg.nodes:
        if n.id in in_replicas:
            continue
        ok = spec_on and (n.roles is None or "drafter" in n.roles) and n.device.memory_bytes >= draft_bytes
        (drafters if ok else unused).append(n.id)
    return drafters, unused


def plan_from_grouping(cfg: ClusterConfig, inp: PlanInputs, grouping: Grouping, t0: float) -> Plan:
    replicas = build_replicas(inp, grouping)
    drafters, unused = choose_drafters(cfg, inp, {s.node for r in replicas for s in r.stages})
    plan = Plan(inp.args.name, inp.args.n_layers, inp.dtype, replicas, tuple(drafters), tuple(unused),
                time.perf_counter() - t0, grouping.fitness)
    validate_plan(plan, cfg, inp)
    return plan


def plan_cluster(cfg: ClusterConfig, seed: int = 0, log: bool = True) -> Plan:
    """The planner (GA + DP + roles). Raises PlanInfeasible when no replica can be formed."""
    t0 = time.perf_counter()
    inp = plan_inputs(cfg)
    ev = Evaluator(inp.mc, inp.members, inp.net, inp.mix, inp.forced)
    grouping = evolve(ev, seed=seed, log=log)
    if not grouping.groups or grouping.fitness <= 0:
        raise PlanInfeasible(f"{cfg.source}: cannot serve {inp.args.name}: {infeasible_reason(inp)}")
    return plan_from_grouping(cfg, inp, grouping, t0)


def infeasible_reason(inp: PlanInputs) -> str:
    if not inp.members:
        return "no node may hold a stage (every node's roles exclude prefill and decode)"
    ev = evaluate_replica(inp.mc, inp.members, inp.net, inp.mix)
    if ev.reason:
        return f"all stage-capable nodes together: {ev.reason}"
    if len(inp.members) > 1 and any(f is not None for f in inp.forced):
        return "the nodes' roles leave no valid prefill/decode assignment"
    return "no replica reaches a positive request rate"


def validate_plan(plan: Plan, cfg: ClusterConfig, inp: PlanInputs) -> None:
    """Layers cover [0, L) in every replica, nodes exist and appear once, stage memory fits."""
    nodes = {n.id: n for n in cfg.nodes}
    seen: set[str] = set()
    for r in plan.replicas:
        if r.role not in STAGE_ROLES:
            raise PlanError(f"replica {r.id}: role {r.role!r}")
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


def render_png(plan: Plan, cfg: ClusterConfig, path: str) -> None:
    """Devices grouped into replicas (columns), stages top to bottom with layer ranges and roles."""
    from meshllm.partition.draw import draw_plan  # lazy: matplotlib + networkx

    draw_plan(plan, cfg, path)
