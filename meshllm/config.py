"""Typed, validated configuration: cluster files (BRIEF schema), and the field checks that
node files (node_config.py) share with them.

YAML is read and checked once, here; everything downstream trusts these frozen
dataclasses. Every error is a ConfigError naming the file, the field and the
problem (the CLI turns it into one line and exit code 2).
"""

from __future__ import annotations

import functools
import math
import re
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
    NODE_ROLES,
    QUANTS,
    SPEC_MODES,
    WEIGHT_DTYPES,
    Role,
)
from meshllm.device import load_device
from meshllm.errors import ConfigError, InputError, number_hint
from meshllm.mesh.fields import MAX_TEMPERATURE, NODE_PORT_MAX
from meshllm.partition.inputs import LengthDist, PlanInputs, PlanLink, PlanNode

if TYPE_CHECKING:
    from meshllm.node_config import NodeConfig

DISTS = ("fixed", "uniform", "lognormal")
MAX_GAMMA = 16
PLAN_SETTLE_S = 3.0  # a coordinator plans after membership has been quiet this long


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
    time_scale: float = 1.0  # every emulated device and link this many times slower (BRIEF)
    security: SecuritySpec = SecuritySpec()

    def link(self, zone_a: str, zone_b: str) -> LinkSpec | None:
        for ln in self.links:
            if set(ln.zones) == {zone_a, zone_b}:
                return ln
        return None


# -- helpers ------------------------------------------------------------------------------
MAX_WORKLOAD_REQUESTS = 100_000  # a run or a --simulate trace larger than this would run for hours
MAX_YAML_BYTES = 16 << 20  # any configuration or key file: a cluster of thousands of nodes is well under 1 MiB


def read_text_file(path: str | Path, src: str, fld: str, what: str = "a YAML file") -> str:
    """An operator's small text file (a cluster or node file, a key file); ConfigError(src, fld, ...) for a
    missing path, a folder, a device or pipe (/dev/zero would be read for ever), one too large, not UTF-8."""
    p = Path(path)
    name = "" if src == str(path) else f"{str(path)!r}: "
    if not p.exists():
        raise ConfigError(src, fld, f"{name}no such file")
    if not p.is_file():
        raise ConfigError(src, fld, f"{name}is a directory, not {what}" if p.is_dir() else f"{name}not a regular file")
    try:
        if (size := p.stat().st_size) > MAX_YAML_BYTES:
            raise ConfigError(src, fld, f"{name}{size} bytes: too large for {what} (at most {MAX_YAML_BYTES >> 20} MiB)")
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(src, fld, f"{name}not a text file (UTF-8): is it the right path?") from None
    except OSError as e:
        raise ConfigError(src, fld, f"{name}cannot be read: {e.strerror or e}") from None


@functools.cache
def _strict_loader():
    """yaml's SafeLoader, but a key given twice in one mapping is an error: YAML takes the last
    silently (a second `nodes:` list would drop the first list's nodes from the plan)."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            if isinstance(node, yaml.MappingNode):
                seen: dict = {}
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: its keys may be overridden
                        continue
                    key = self.construct_object(key_node, deep=True)
                    try:
                        first = seen.get(key)
                    except TypeError:  # an unhashable key: construct_mapping says so itself
                        continue
                    seen.setdefault(key, key_node.start_mark.line + 1)
                    if first is not None:
                        raise yaml.constructor.ConstructorError(
                            None, None, f"duplicate key {key!r} (first on line {first}): YAML would keep only "
                            "the last", key_node.start_mark)
            return super().construct_mapping(node, deep)

    return StrictLoader


def read_yaml(path: str | Path) -> dict:
    import yaml

    text = read_text_file(path, str(path), "(file)")
    try:
        data = yaml.load(text, Loader=_strict_loader())  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else "(file)"
        raise ConfigError(str(path), where, f"invalid YAML: {getattr(e, 'problem', e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(str(path), "(top level)", "expected a mapping")
    return data


def split_hostport(s: Any, src: str, fld: str, max_port: int = NODE_PORT_MAX) -> tuple[str, int]:
    """HOST:PORT -> (host, port), else ConfigError. A node's address by default (its PUB socket
    takes PORT + 1, so 65535 is no node's port); an HTTP listener passes max_port=65535."""
    if not isinstance(s, str) or ":" not in s:
        raise ConfigError(src, fld, f"expected HOST:PORT, got {s!r}")
    host, _, port = s.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) <= max_port:
        why = "" if max_port == 65535 else " (a node's PUB socket takes PORT + 1)"
        raise ConfigError(src, fld, f"expected HOST:PORT with a port in 1..{max_port}{why}, got {s!r}")
    if ":" in host and max_port != 65535:  # the HTTP API may listen on IPv6; the mesh's sockets do not
        raise ConfigError(src, fld, f"a node's address is an IPv4 address or a host name (the mesh's "
                                    f"ZeroMQ sockets are IPv4 only), got {s!r}")
    if ":" not in host and host != "*" and not _HOST_NAME.fullmatch(host):  # failed only at bind: exit 1
        raise ConfigError(src, fld, f"{host!r:.60} is not an IPv4 address or a host name")
    return host, int(port)


# a host name (RFC 1123 labels, and "_", which resolvers take: compose service names) or a dotted
# IPv4 address, which is one too
_HOST_NAME = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9_-]{1,63}(?<!-))*\.?")


def given(d: dict, key: str, empty: Any) -> Any:
    """d[key], or `empty` where it is absent or null (a bare `key:` in YAML). Any other value is
    the caller's to check: `speculation: off` (false in YAML 1.1), 0 or "" are not "absent"."""
    v = d.get(key)
    return empty if v is None else v


def _zone(v: Any, src: str, fld: str) -> str:
    if not isinstance(v, str) or not v:
        raise ConfigError(src, fld, f"must be a non-empty string, got {v!r:.60}")
    return v


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


def _check_keys(d: Any, allowed: set[str], required: set[str], src: str, prefix: str) -> dict:
    if not isinstance(d, dict):
        hint = " (speculation: {mode: off} turns it off)" if prefix == "speculation." and d is False else ""
        raise ConfigError(src, prefix.rstrip(".") or "(top level)", f"expected a mapping, got {type(d).__name__}{hint}")
    for k in d:
        if k not in allowed:
            raise ConfigError(src, f"{prefix}{k}", f"unknown key (allowed: {', '.join(sorted(allowed))})")
    for k in sorted(required):
        if k not in d:
            raise ConfigError(src, f"{prefix}{k}", "missing required field")
    return d


def _num(v: Any, src: str, fld: str, *, lo: float = 0.0, integer: bool = False, strict: bool = False,
         hi: float | None = None) -> float:
    ok = isinstance(v, int) if integer else isinstance(v, (int, float)) and math.isfinite(v)  # not .nan / .inf
    if isinstance(v, bool) or not ok or v < lo or (strict and v == lo) or (hi is not None and v > hi):
        kind = "an integer" if integer else "a finite number"
        if hi is not None:
            raise ConfigError(src, fld, f"must be {kind} in [{lo:g}, {hi:g}], got {v!r}{number_hint(v)}")
        raise ConfigError(src, fld, f"must be {kind} {'>' if strict else '>='} {lo:g}, got {v!r}{number_hint(v)}")
    return v


def _choice(v: Any, choices: tuple[str, ...], src: str, fld: str) -> str:
    if v not in choices:
        raise ConfigError(src, fld, f"must be one of {', '.join(choices)}, got {v!r}")
    return v


def _roles(v: Any, src: str, fld: str) -> tuple[Role, ...] | None:
    if v is None:
        return None
    if not isinstance(v, list) or not v:
        raise ConfigError(src, fld, "must be a non-empty list")
    names = tuple(str(r) for r in NODE_ROLES)
    return tuple(Role(_choice(r, names, src, f"{fld}[{i}]")) for i, r in enumerate(v))


NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")


def node_id(v: Any, src: str, fld: str) -> str:
    """A node id: 1 to 63 letters, digits, '_', '-' or '.', from a letter or digit. It names the
    node's files in an emulated cluster, its mDNS service and a `NODE_ID KEY` line of
    authorized_keys, and `ID@HOST:PORT` names it in seeds and --status."""
    if not isinstance(v, str) or not NODE_ID.fullmatch(v):
        raise ConfigError(src, fld, f"must be 1 to 63 letters, digits, '_', '-' or '.' (from a letter or digit), "
                          f"got {v!r:.80}")
    return v


def _model(v: Any, src: str) -> str:
    if not isinstance(v, str) or not v:
        raise ConfigError(src, "model", "must be a registry name or a path")
    return v


def _time_scale(v: Any, src: str) -> float:
    return float(_num(v, src, "time_scale", lo=1.0))


# -- cluster file ---------------------------------------------------------------------------
def parse_cluster(data: dict, src: str) -> ClusterConfig:
    _check_keys(data, {"model", "draft", "speculation", "nodes", "links", "workload", "weights_dtype",
                       "time_scale", "security"}, {"model", "nodes"}, src, "")
    nodes_raw = data["nodes"]
    if not isinstance(nodes_raw, list) or not nodes_raw:
        raise ConfigError(src, "nodes", "must be a non-empty list")
    nodes, seen = [], set()
    for i, n in enumerate(nodes_raw):
        p = f"nodes[{i}]."
        _check_keys(n, {"id", "device", "zone", "roles"}, {"id", "device", "zone"}, src, p)
        nid = node_id(n["id"], src, p + "id")
        if nid in seen:
            raise ConfigError(src, p + "id", f"duplicate node id {nid!r}")
        seen.add(nid)
        dev = load_device(n["device"], f"{src}: {p.rstrip('.')}")
        nodes.append(NodeSpec(nid, dev, _zone(n["zone"], src, p + "zone"), _roles(n.get("roles"), src, p + "roles")))
    zones = {n.zone for n in nodes}
    return ClusterConfig(
        source=src, model=_model(data["model"], src), nodes=tuple(nodes), links=_links(data, src, zones),
        draft=_draft(given(data, "draft", {}), src), speculation=_spec(given(data, "speculation", {}), src),
        workload=_workload(given(data, "workload", {}), src),
        weights_dtype=_choice(data.get("weights_dtype", DEFAULT_WEIGHT_DTYPE), WEIGHT_DTYPES, src, "weights_dtype"),
        time_scale=_time_scale(data.get("time_scale", 1.0), src),
        security=_security(given(data, "security", {}), src),
    )


def _security(d: Any, src: str) -> SecuritySpec:
    _check_keys(d, {"curve", "api_token"}, set(), src, "security.")
    for k in ("curve", "api_token"):
        if not isinstance(d.get(k, False), bool):
            raise ConfigError(src, f"security.{k}", f"must be true or false, got {d[k]!r}")
    return SecuritySpec(d.get("curve", False), d.get("api_token", False))


def _link(ln: Any, i: int, src: str, zones: set[str] | None) -> LinkSpec:
    p = f"links[{i}]."
    _check_keys(ln, {"zones", "rtt_ms", "bandwidth_mbps"}, {"zones", "rtt_ms", "bandwidth_mbps"}, src, p)
    z = ln["zones"]
    if not isinstance(z, list) or len(z) != 2:
        raise ConfigError(src, p + "zones", "must be a list of two zone names")
    for zz in z:
        if not isinstance(zz, str) or not zz:
            raise ConfigError(src, p + "zones", f"zone names are non-empty strings, got {zz!r:.60}")
        if zones is not None and zz not in zones:
            raise ConfigError(src, p + "zones", f"zone {zz!r} has no nodes (zones: {', '.join(sorted(zones))})")
    return LinkSpec((str(z[0]), str(z[1])), float(_num(ln["rtt_ms"], src, p + "rtt_ms")),
                    float(_num(ln["bandwidth_mbps"], src, p + "bandwidth_mbps", strict=True)))


def _draft(d: Any, src: str) -> DraftSpec:
    _check_keys(d, {"quant", "group_size"}, set(), src, "draft.")
    gs = int(_num(d.get("group_size", DEFAULT_GROUP_SIZE), src, "draft.group_size", lo=1, integer=True))
    if gs not in GROUP_SIZES:
        raise ConfigError(src, "draft.group_size", f"must be one of {', '.join(map(str, GROUP_SIZES))}, got {gs}")
    return DraftSpec(_choice(d.get("quant", DEFAULT_DRAFT_QUANT), QUANTS, src, "draft.quant"), gs)


def _spec(d: Any, src: str) -> SpeculationSpec:
    _check_keys(d, {"mode", "gamma", "adaptive", "max_verify_batch"}, set(), src, "speculation.")
    mode = d.get("mode", DEFAULT_SPEC_MODE)
    mode = "off" if mode is False else mode  # YAML 1.1 reads a bare `off` as false
    adaptive = d.get("adaptive", False)
    if not isinstance(adaptive, bool):
        raise ConfigError(src, "speculation.adaptive", f"must be true or false, got {adaptive!r}")
    gamma = int(_num(d.get("gamma", DEFAULT_GAMMA), src, "speculation.gamma", lo=1, integer=True))
    if gamma > MAX_GAMMA:
        raise ConfigError(src, "speculation.gamma", f"must be at most {MAX_GAMMA}, got {gamma}")
    mvb = int(_num(d.get("max_verify_batch", 0), src, "speculation.max_verify_batch", integer=True))
    return SpeculationSpec(_choice(mode, SPEC_MODES, src, "speculation.mode"), gamma, adaptive, mvb)


def _dist(d: Any, src: str, fld: str, default: float) -> LengthDist:
    if d is None:
        return LengthDist(default)
    _check_keys(d, {"mean", "dist"}, {"mean"}, src, fld + ".")
    return LengthDist(float(_num(d["mean"], src, fld + ".mean", strict=True)),
                      _choice(d.get("dist", "lognormal"), DISTS, src, fld + ".dist"))


def _workload(d: Any, src: str) -> Workload:
    allowed = {"prompts", "max_tokens", "temperature", "arrival_rate_per_s", "requests", "input_tokens",
               "output_tokens"}
    _check_keys(d, allowed, set(), src, "workload.")
    prompts = given(d, "prompts", [])
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise ConfigError(src, "workload.prompts", "must be a list of strings")
    return Workload(
        prompts=tuple(prompts),
        max_tokens=int(_num(d.get("max_tokens", DEFAULT_MAX_TOKENS), src, "workload.max_tokens", lo=1,
                            integer=True)),
        temperature=float(_num(d.get("temperature", 0.0), src, "workload.temperature", hi=MAX_TEMPERATURE)),
        arrival_rate_per_s=float(_num(d.get("arrival_rate_per_s", 0.0), src, "workload.arrival_rate_per_s")),
        requests=int(_num(d.get("requests", 0), src, "workload.requests", integer=True, hi=MAX_WORKLOAD_REQUESTS)),
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
