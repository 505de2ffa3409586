"""Typed, validated configuration: cluster files (README schema), and the cluster-file sections
that node files (node_config.py) share with them (draft, speculation, workload, links).

YAML is read (yaml_fields.py) and checked once, here; everything downstream trusts these frozen
dataclasses. Every error is a ConfigError naming the file, the field and the
problem (the CLI turns it into one line and exit code 2).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshllm.defaults import (
    DEFAULT_DRAFT_QUANT,
    DEFAULT_GAMMA,
    DEFAULT_GROUP_SIZE,
    DEFAULT_MAX_TOKENS,
    DEFAULT_SPEC_MODE,
    DEFAULT_WEIGHT_DTYPE,
    GROUP_SIZES,
    MAX_RATE,
    MAX_REQUEST_TOKENS,
    MIN_RATE,
    NODE_ROLES,
    QUANTS,
    SPEC_MODES,
    WEIGHT_DTYPES,
    Role,
)
from meshllm.device import load_device
from meshllm.errors import ConfigError, InputError
from meshllm.mesh.fields import MAX_TEMPERATURE
from meshllm.partition.inputs import LengthDist, PlanInputs, PlanLink, PlanNode
from meshllm.yaml_fields import check_keys, choice, given, node_id, number, read_yaml, zone_name

if TYPE_CHECKING:
    from meshllm.node_config import NodeConfig

DISTS = ("fixed", "uniform", "lognormal")
MAX_GAMMA = 16
PLAN_SETTLE_S = 3.0  # a coordinator plans after membership has been quiet this long
MAX_WORKLOAD_REQUESTS = 100_000  # a run or a --simulate trace larger than this would run for hours


@dataclass(frozen=True)
class DraftSpec:
    quant: str = DEFAULT_DRAFT_QUANT
    group_size: int = DEFAULT_GROUP_SIZE


@dataclass(frozen=True)
class SpeculationSpec:
    mode: str = DEFAULT_SPEC_MODE
    gamma: int = DEFAULT_GAMMA  # draft length (the first one, when adaptive)
    adaptive: bool = False  # each session's gamma follows its acceptance and round trip
    max_verify_batch: int = 0  # blocks a decode replica verifies in one forward (0: all it has)


# a cluster file's node and link are exactly what the planner takes (one definition, in the pure floor)
NodeSpec = PlanNode
LinkSpec = PlanLink


@dataclass(frozen=True)
class Workload:
    prompts: tuple[str, ...] = ()
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    arrival_rate_per_s: float = 0.0
    requests: int = 0
    input_tokens: LengthDist = LengthDist(512)
    output_tokens: LengthDist = LengthDist(128)


@dataclass(frozen=True)
class SecuritySpec:
    curve: bool = False  # emulation: per-node CURVE keys and an authorized-keys file in the run directory
    api_token: bool = False  # emulation: the gateway's HTTP API requires a bearer token


@dataclass(frozen=True)
class ClusterConfig:
    source: str
    model: str
    nodes: tuple[NodeSpec, ...]
    links: tuple[LinkSpec, ...] = ()
    draft: DraftSpec = DraftSpec()
    speculation: SpeculationSpec = SpeculationSpec()
    workload: Workload = Workload()
    weights_dtype: str = DEFAULT_WEIGHT_DTYPE
    time_scale: float = 1.0  # every emulated device and link this many times slower (README)
    security: SecuritySpec = SecuritySpec()

    def link(self, zone_a: str, zone_b: str) -> LinkSpec | None:
        for ln in self.links:
            if set(ln.zones) == {zone_a, zone_b}:
                return ln
        return None


# -- cluster-file field checks ----------------------------------------------------------
def _links(d: dict, src: str, zones: set[str] | None) -> tuple[LinkSpec, ...]:
    links = given(d, "links", [])
    if not isinstance(links, list):
        raise ConfigError(src, "links", f"must be a list of {{zones, rtt_ms, bandwidth_mbps}}, got {links!r:.60}")
    out = tuple(_link(ln, i, src, zones) for i, ln in enumerate(links))
    first: dict[frozenset, int] = {}
    for i, ln in enumerate(out):
        j = first.setdefault(frozenset(ln.zones), i)
        if j != i:  # the planner would take one of them, silently
            raise ConfigError(src, f"links[{i}].zones", f"{list(ln.zones)}: links[{j}] already describes that "
                              "pair of zones (one link per pair)")
    return out


def _roles(v: Any, src: str, fld: str) -> tuple[Role, ...] | None:
    if v is None:
        return None
    if not isinstance(v, list) or not v:
        raise ConfigError(src, fld, "must be a non-empty list")
    names = tuple(str(r) for r in NODE_ROLES)
    roles = tuple(Role(choice(r, names, src, f"{fld}[{i}]")) for i, r in enumerate(v))
    if len(set(roles)) < len(roles):  # (it was taken, and echoed as "(drafter, drafter)")
        twice = next(r for i, r in enumerate(roles) if r in roles[:i])
        raise ConfigError(src, fld, f"names {str(twice)!r} twice")
    return roles


def _rate(v: Any, src: str) -> float:
    """A workload's arrival rate: 0 (none given), or one in [MIN_RATE, MAX_RATE] requests/s."""
    rate = float(number(v, src, "workload.arrival_rate_per_s", hi=MAX_RATE))
    if 0 < rate < MIN_RATE:
        raise ConfigError(src, "workload.arrival_rate_per_s", f"must be 0 (none) or at least {MIN_RATE:g}, got {v!r}")
    return rate


def _model(v: Any, src: str) -> str:
    if not isinstance(v, str) or not v:
        raise ConfigError(src, "model", "must be a registry name or a path")
    return v


MAX_TIME_SCALE = 100.0  # the benchmarks use 12-25; 500000 overflowed a socket timeout (5 s x K), and
# the emulator's fixed waits (the mesh formed within 60 s) do not scale: a run that large fails late


def _time_scale(v: Any, src: str) -> float:
    return float(number(v, src, "time_scale", lo=1.0, hi=MAX_TIME_SCALE))


# -- cluster file ---------------------------------------------------------------------------
def parse_cluster(data: dict, src: str) -> ClusterConfig:
    check_keys(data, {"model", "draft", "speculation", "nodes", "links", "workload", "weights_dtype",
                       "time_scale", "security"}, {"model", "nodes"}, src, "")
    nodes_raw = data["nodes"]
    if not isinstance(nodes_raw, list) or not nodes_raw:
        raise ConfigError(src, "nodes", "must be a non-empty list")
    nodes, seen = [], set()
    for i, n in enumerate(nodes_raw):
        p = f"nodes[{i}]."
        check_keys(n, {"id", "device", "zone", "roles"}, {"id", "device", "zone"}, src, p)
        nid = node_id(n["id"], src, p + "id")
        if nid in seen:
            raise ConfigError(src, p + "id", f"duplicate node id {nid!r}")
        seen.add(nid)
        dev = load_device(n["device"], f"{src}: {p.rstrip('.')}")
        nodes.append(NodeSpec(nid, dev, zone_name(n["zone"], src, p + "zone"), _roles(n.get("roles"), src, p + "roles")))
    zones = {n.zone for n in nodes}
    return ClusterConfig(
        source=src, model=_model(data["model"], src), nodes=tuple(nodes), links=_links(data, src, zones),
        draft=_draft(given(data, "draft", {}), src), speculation=_spec(given(data, "speculation", {}), src),
        workload=_workload(given(data, "workload", {}), src),
        weights_dtype=choice(data.get("weights_dtype", DEFAULT_WEIGHT_DTYPE), WEIGHT_DTYPES, src, "weights_dtype"),
        time_scale=_time_scale(data.get("time_scale", 1.0), src),
        security=_security(given(data, "security", {}), src),
    )


def _security(d: Any, src: str) -> SecuritySpec:
    check_keys(d, {"curve", "api_token"}, set(), src, "security.")
    for k in ("curve", "api_token"):
        if not isinstance(d.get(k, False), bool):
            raise ConfigError(src, f"security.{k}", f"must be true or false, got {d[k]!r}")
    return SecuritySpec(d.get("curve", False), d.get("api_token", False))


def _link(ln: Any, i: int, src: str, zones: set[str] | None) -> LinkSpec:
    p = f"links[{i}]."
    check_keys(ln, {"zones", "rtt_ms", "bandwidth_mbps"}, {"zones", "rtt_ms", "bandwidth_mbps"}, src, p)
    z = ln["zones"]
    if not isinstance(z, list) or len(z) != 2:
        raise ConfigError(src, p + "zones", "must be a list of two zone names")
    for zz in z:
        if not isinstance(zz, str) or not zz:
            raise ConfigError(src, p + "zones", f"zone names are non-empty strings, got {zz!r:.60}")
        if zones is not None and zz not in zones:
            raise ConfigError(src, p + "zones", f"zone {zz!r} has no nodes (zones: {', '.join(sorted(zones))})")
    return LinkSpec((str(z[0]), str(z[1])), float(number(ln["rtt_ms"], src, p + "rtt_ms", hi=1e6)),
                    float(number(ln["bandwidth_mbps"], src, p + "bandwidth_mbps", lo=1e-3, hi=1e7)))


def _draft(d: Any, src: str) -> DraftSpec:
    check_keys(d, {"quant", "group_size"}, set(), src, "draft.")
    gs = int(number(d.get("group_size", DEFAULT_GROUP_SIZE), src, "draft.group_size", lo=1, integer=True))
    if gs not in GROUP_SIZES:
        raise ConfigError(src, "draft.group_size", f"must be one of {', '.join(map(str, GROUP_SIZES))}, got {gs}")
    return DraftSpec(choice(d.get("quant", DEFAULT_DRAFT_QUANT), QUANTS, src, "draft.quant"), gs)


def _spec(d: Any, src: str) -> SpeculationSpec:
    check_keys(d, {"mode", "gamma", "adaptive", "max_verify_batch"}, set(), src, "speculation.")
    mode = d.get("mode", DEFAULT_SPEC_MODE)
    mode = "off" if mode is False else mode  # YAML 1.1 reads a bare `off` as false
    adaptive = d.get("adaptive", False)
    if not isinstance(adaptive, bool):
        raise ConfigError(src, "speculation.adaptive", f"must be true or false, got {adaptive!r}")
    gamma = int(number(d.get("gamma", DEFAULT_GAMMA), src, "speculation.gamma", lo=1, integer=True))
    if gamma > MAX_GAMMA:
        raise ConfigError(src, "speculation.gamma", f"must be at most {MAX_GAMMA}, got {gamma}")
    mvb = int(number(d.get("max_verify_batch", 0), src, "speculation.max_verify_batch", integer=True))
    return SpeculationSpec(choice(mode, SPEC_MODES, src, "speculation.mode"), gamma, adaptive, mvb)


def _dist(d: Any, src: str, fld: str, default: float) -> LengthDist:
    if d is None:
        return LengthDist(default)
    check_keys(d, {"mean", "dist"}, {"mean"}, src, fld + ".")
    return LengthDist(float(number(d["mean"], src, fld + ".mean", lo=1)),  # (a mean of 0.001 drew 0-token prompts)
                      choice(d.get("dist", "lognormal"), DISTS, src, fld + ".dist"))


PLANNED_WORKLOAD_KEYS = {"arrival_rate_per_s", "requests", "input_tokens", "output_tokens"}  # what a plan is for
CLIENT_WORKLOAD_KEYS = {"prompts", "max_tokens", "temperature"}  # what the cluster run's client sends


def _workload(d: Any, src: str, node: bool = False) -> Workload:
    """A cluster file's workload, or (`node`) a node file's: only what the coordinator plans for,
    since a node sends no requests (prompts, max_tokens, temperature there would silently do nothing)."""
    if node and isinstance(d, dict):
        for k in sorted(CLIENT_WORKLOAD_KEYS & set(d)):
            raise ConfigError(src, f"workload.{k}", "a node file's workload is what the coordinator plans for "
                                                    f"({', '.join(sorted(PLANNED_WORKLOAD_KEYS))}); {k} belongs "
                                                    "to the cluster file or the API request")
    check_keys(d, PLANNED_WORKLOAD_KEYS | CLIENT_WORKLOAD_KEYS, set(), src, "workload.")
    prompts = given(d, "prompts", [])
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise ConfigError(src, "workload.prompts", "must be a list of strings")
    return Workload(
        prompts=tuple(prompts),
        max_tokens=int(number(d.get("max_tokens", DEFAULT_MAX_TOKENS), src, "workload.max_tokens", lo=1,
                              integer=True, hi=MAX_REQUEST_TOKENS)),
        temperature=float(number(d.get("temperature", 0.0), src, "workload.temperature", hi=MAX_TEMPERATURE)),
        arrival_rate_per_s=_rate(d.get("arrival_rate_per_s", 0.0), src),
        requests=int(number(d.get("requests", 0), src, "workload.requests", integer=True, hi=MAX_WORKLOAD_REQUESTS)),
        input_tokens=_dist(d.get("input_tokens"), src, "workload.input_tokens", 512),
        output_tokens=_dist(d.get("output_tokens"), src, "workload.output_tokens", 128),
    )


def load_cluster(path: str | Path) -> ClusterConfig:
    return parse_cluster(read_yaml(path), str(path))


def resolve_args(model: str):
    """A registry name (shape-only ones included) or a model file/dir -> ModelArgs; InputError if not.
    Registry names need no torch; a file's shape is read by engine/weights.py."""
    from meshllm.shapes import transformer_configs

    if model in transformer_configs:
        return transformer_configs[model]
    from meshllm.engine.weights import resolve_model_args  # lazy: torch, GGUF metadata / config.json

    try:
        return resolve_model_args(model)
    except ValueError as e:
        if isinstance(e, InputError):
            raise
        raise InputError(f"model: {e}") from None


def file_model_args(model: str, src: str):
    """resolve_args for the `model:` of file `src`: a path that is no model is a ConfigError naming
    the file and the field."""
    try:
        return resolve_args(model)
    except ConfigError:
        raise
    except InputError as e:
        problem = str(e).removeprefix("model: ").removeprefix("model ")
        raise ConfigError(src, "model", problem if model in problem else f"{model!r}: {problem}") from None


def plan_inputs(cfg: ClusterConfig) -> PlanInputs:
    """The planner's and simulator's plain inputs for a cluster file; ConfigError for a draft group
    size the model's layers do not split into (its drafters would fail to build the draft, and the
    mesh would never serve)."""
    inp = _plan_inputs(cfg, tuple(cfg.nodes), cfg.source)
    check_draft_groups(cfg, inp.args)
    check_lengths(cfg, inp.args)
    return inp


def check_lengths(cfg: ClusterConfig | NodeConfig, args) -> None:
    """ConfigError for a workload whose mean request does not fit the model's context: the plan and
    its figures would be for requests the mesh refuses (the API's context_length_exceeded)."""
    wl, default = cfg.workload, Workload()
    if (wl.input_tokens, wl.output_tokens) == (default.input_tokens, default.output_tokens):
        return  # not the file's word: the planner's default lengths (a test model's context may be shorter)
    if wl.input_tokens.mean + wl.output_tokens.mean > args.max_seq_len:
        raise ConfigError(cfg.source, "workload.input_tokens", f"mean {wl.input_tokens.mean:g} + output_tokens mean "
                          f"{wl.output_tokens.mean:g} exceed {args.name}'s context of {args.max_seq_len} tokens")


def check_draft_groups(cfg: ClusterConfig | NodeConfig, args) -> None:
    """ConfigError for a W4A16 draft group size the model's layers do not split into (with speculation
    on): every drafter would fail to build the draft."""
    from meshllm.shapes import draft_group_problem

    if cfg.speculation.mode != "off" and cfg.draft.quant == "w4a16" \
            and (problem := draft_group_problem(args, cfg.draft.group_size)):
        raise ConfigError(cfg.source, "draft.group_size", problem)


def _plan_inputs(cfg: ClusterConfig | NodeConfig, nodes: tuple[PlanNode, ...], source: str,
                 args=None) -> PlanInputs:
    """`args`: the model's shape when known otherwise (a node without the file: a peer's index)."""
    wl = cfg.workload
    spec_on = cfg.speculation.mode != "off" and cfg.draft.quant != "none"
    return PlanInputs(
        source=source, args=args if args is not None else file_model_args(cfg.model, cfg.source), dtype=cfg.weights_dtype,
        nodes=nodes,
        links=tuple(cfg.links),
        input_tokens=wl.input_tokens, output_tokens=wl.output_tokens, rate_per_s=wl.arrival_rate_per_s,
        requests=wl.requests, n_prompts=len(wl.prompts), draft_quant=cfg.draft.quant if spec_on else None,
    )
