"""Typed, validated configuration: cluster files and node files (BRIEF schema).

YAML is read and checked once, here; everything downstream trusts these frozen
dataclasses. Every error is a ConfigError naming the file, the field and the
problem (the CLI turns it into one line and exit code 2).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshllm.defaults import (
    DEFAULT_DRAFT_QUANT,
    DEFAULT_GAMMA,
    DEFAULT_GROUP_SIZE,
    DEFAULT_MAX_TOKENS,
    DEFAULT_MODEL,
    DEFAULT_SPEC_MODE,
    DEFAULT_WEIGHT_DTYPE,
    FAILURE_TIMEOUT_S,
    HEARTBEAT_INTERVAL_S,
    MAX_BUSY_POLL_MS,
    NODE_ROLES,
    QUANTS,
    SPEC_MODES,
    WEIGHT_DTYPES,
    Role,
)
from meshllm.device import DeviceProfile, load_device
from meshllm.errors import ConfigError, InputError
from meshllm.mesh.ingress import RateLimit
from meshllm.mesh.keys import NodeKeys, read_authorized_keys
from meshllm.partition.inputs import LengthDist, PlanInputs, PlanLink, PlanNode

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


@dataclass(frozen=True)
class NodeConfig:
    source: str
    id: str
    device: DeviceProfile
    zone: str = "default"
    listen: str = "127.0.0.1:7700"
    advertise: str | None = None
    seeds: tuple[str, ...] = ()  # HOST:PORT of each seed
    seed_ids: tuple[tuple[str, str], ...] = ()  # (HOST:PORT, node id) of seeds given as ID@HOST:PORT
    mdns: bool = True
    model: str = DEFAULT_MODEL
    roles: tuple[Role, ...] | None = None
    node_key: str | None = None  # this node's CURVE secret key file (with authorized_keys: CURVE on)
    authorized_keys: str | None = None  # the mesh's `NODE_ID Z85_PUBLIC_KEY` lines
    rate_limit: RateLimit = RateLimit()  # per-peer message rate limit of the transport
    links: tuple[LinkSpec, ...] = ()  # zone links: the planner's input; the emulator also shapes them
    heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S  # liveness: see mesh/membership.py
    failure_timeout_s: float = FAILURE_TIMEOUT_S  # a peer silent this long is dead
    gateway: str | None = None  # HOST:PORT of this node's OpenAI-compatible HTTP API, if it runs one
    api_token: str | None = field(default=None, repr=False)  # bearer token that API requires, if any
    fetch_weights: bool = True  # without the model file: fetch this node's layer range from a peer that has it
    weights_cache: str | None = None  # where fetched tensors are kept (default $MESHLLM_WEIGHTS_CACHE or ~/.cache)
    # what the coordinator plans for (the cluster file's settings; see the README's node file schema)
    draft: DraftSpec = DraftSpec()
    speculation: SpeculationSpec = SpeculationSpec()
    weights_dtype: str = DEFAULT_WEIGHT_DTYPE
    workload: Workload = Workload()
    expect_nodes: tuple[str, ...] = ()  # plan only once all of these are alive (emulation)
    plan_settle_s: float = PLAN_SETTLE_S  # otherwise plan after membership is quiet this long
    pace: bool = False  # emulation: stretch compute to the device profile's speed
    fault_injection: bool = False  # emulation: obey FAULT messages (partitions) from the emulator
    time_scale: float = 1.0  # emulation: devices and links this many times slower
    busy_poll_ms: float = 0.0  # the compute thread polls this long for the next message before sleeping

    @property
    def advertise_address(self) -> str:
        if self.advertise:
            return self.advertise
        host, port = split_hostport(self.listen, self.source, "listen")
        if host in ("0.0.0.0", "*", "::"):
            raise ConfigError(self.source, "advertise", "required when listen binds all interfaces")
        return f"{host}:{port}"


# -- helpers ------------------------------------------------------------------------------
def read_yaml(path: str | Path) -> dict:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError(str(path), "(file)", "no such file")
    try:
        with open(p) as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else "(file)"
        raise ConfigError(str(path), where, f"invalid YAML: {getattr(e, 'problem', e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(str(path), "(top level)", "expected a mapping")
    return data


def split_hostport(s: Any, src: str, fld: str) -> tuple[str, int]:
    if not isinstance(s, str) or ":" not in s:
        raise ConfigError(src, fld, f"expected HOST:PORT, got {s!r}")
    host, _, port = s.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(src, fld, f"expected HOST:PORT with a port in 1..65535, got {s!r}")
    return host, int(port)


def _check_keys(d: Any, allowed: set[str], required: set[str], src: str, prefix: str) -> dict:
    if not isinstance(d, dict):
        raise ConfigError(src, prefix or "(top level)", f"expected a mapping, got {type(d).__name__}")
    for k in d:
        if k not in allowed:
            raise ConfigError(src, f"{prefix}{k}", f"unknown key (allowed: {', '.join(sorted(allowed))})")
    for k in sorted(required):
        if k not in d:
            raise ConfigError(src, f"{prefix}{k}", "missing required field")
    return d


def _num(v: Any, src: str, fld: str, *, lo: float = 0.0, integer: bool = False, strict: bool = False) -> float:
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok or v < lo or (strict and v == lo):
        kind = "an integer" if integer else "a number"
        raise ConfigError(src, fld, f"must be {kind} {'>' if strict else '>='} {lo:g}, got {v!r}")
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


def _model(v: Any, src: str) -> str:
    if not isinstance(v, str) or not v:
        raise ConfigError(src, "model", "must be a registry name or a path")
    return v


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
        nid = n["id"]
        if not isinstance(nid, str) or not nid:
            raise ConfigError(src, p + "id", "must be a non-empty string")
        if nid in seen:
            raise ConfigError(src, p + "id", f"duplicate node id {nid!r}")
        seen.add(nid)
        dev = load_device(n["device"], f"{src}: {p}device")
        nodes.append(NodeSpec(nid, dev, str(n["zone"]), _roles(n.get("roles"), src, p + "roles")))
    zones = {n.zone for n in nodes}
    links = tuple(_link(ln, i, src, zones) for i, ln in enumerate(data.get("links") or []))
    return ClusterConfig(
        source=src, model=_model(data["model"], src), nodes=tuple(nodes), links=links,
        draft=_draft(data.get("draft") or {}, src), speculation=_spec(data.get("speculation") or {}, src),
        workload=_workload(data.get("workload") or {}, src),
        weights_dtype=_choice(data.get("weights_dtype", DEFAULT_WEIGHT_DTYPE), WEIGHT_DTYPES, src, "weights_dtype"),
        time_scale=_time_scale(data.get("time_scale", 1.0), src),
        security=_security(data.get("security") or {}, src),
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
        if zones is not None and zz not in zones:
            raise ConfigError(src, p + "zones", f"zone {zz!r} has no nodes (zones: {', '.join(sorted(zones))})")
    return LinkSpec((str(z[0]), str(z[1])), float(_num(ln["rtt_ms"], src, p + "rtt_ms")),
                    float(_num(ln["bandwidth_mbps"], src, p + "bandwidth_mbps", strict=True)))


def _draft(d: Any, src: str) -> DraftSpec:
    _check_keys(d, {"quant", "group_size"}, set(), src, "draft.")
    gs = int(_num(d.get("group_size", DEFAULT_GROUP_SIZE), src, "draft.group_size", lo=1, integer=True))
    if gs % 32:
        raise ConfigError(src, "draft.group_size", f"must be a multiple of 32, got {gs}")
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
    prompts = d.get("prompts") or []
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise ConfigError(src, "workload.prompts", "must be a list of strings")
    return Workload(
        prompts=tuple(prompts),
        max_tokens=int(_num(d.get("max_tokens", DEFAULT_MAX_TOKENS), src, "workload.max_tokens", lo=1,
                            integer=True)),
        temperature=float(_num(d.get("temperature", 0.0), src, "workload.temperature")),
        arrival_rate_per_s=float(_num(d.get("arrival_rate_per_s", 0.0), src, "workload.arrival_rate_per_s")),
        requests=int(_num(d.get("requests", 0), src, "workload.requests", integer=True)),
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


def plan_inputs(cfg: ClusterConfig) -> PlanInputs:
    """The planner's and simulator's plain inputs for a cluster file."""
    nodes = tuple(cfg.nodes)
    return _plan_inputs(cfg, nodes, cfg.source)


def plan_inputs_for_nodes(cfg: NodeConfig, nodes: tuple[PlanNode, ...], source: str) -> PlanInputs:
    """What a live coordinator plans for: the nodes of its peer table, with its own node file's
    model, links and serving settings."""
    return _plan_inputs(cfg, nodes, source)


def _plan_inputs(cfg: ClusterConfig | NodeConfig, nodes: tuple[PlanNode, ...], source: str) -> PlanInputs:
    wl = cfg.workload
    spec_on = cfg.speculation.mode != "off" and cfg.draft.quant != "none"
    return PlanInputs(
        source=source, args=resolve_args(cfg.model), dtype=cfg.weights_dtype, nodes=nodes,
        links=tuple(cfg.links),
        input_tokens=wl.input_tokens, output_tokens=wl.output_tokens, rate_per_s=wl.arrival_rate_per_s,
        requests=wl.requests, n_prompts=len(wl.prompts), draft_quant=cfg.draft.quant if spec_on else None,
    )


# -- node file ------------------------------------------------------------------------------
NODE_KEYS = {"id", "device", "zone", "listen", "advertise", "seeds", "mdns", "model", "roles", "node_key",
             "authorized_keys", "rate_limit", "links", "heartbeat_interval_s", "failure_timeout_s", "gateway", "draft", "speculation",
             "weights_dtype", "workload", "expect_nodes", "plan_settle_s", "pace", "time_scale", "fault_injection",
             "fetch_weights", "weights_cache", "busy_poll_ms"}


def parse_node(data: dict, src: str) -> NodeConfig:
    _check_keys(data, NODE_KEYS, {"id", "device", "listen"}, src, "")
    if not isinstance(data["id"], str) or not data["id"]:
        raise ConfigError(src, "id", "must be a non-empty string")
    split_hostport(data["listen"], src, "listen")
    if data.get("advertise") is not None:
        split_hostport(data["advertise"], src, "advertise")
    security = _node_security(data, src)
    seeds, seed_ids = _seeds(data.get("seeds") or [], src, security.get("authorized"))
    mdns = data.get("mdns", True)
    if not isinstance(mdns, bool):
        raise ConfigError(src, "mdns", f"must be true or false, got {mdns!r}")
    # Links in a node file (written by the emulator) name zones of other nodes: no zone check here.
    links = tuple(_link(ln, i, src, None) for i, ln in enumerate(data.get("links") or []))
    hb = float(_num(data.get("heartbeat_interval_s", HEARTBEAT_INTERVAL_S), src, "heartbeat_interval_s",
                    strict=True))
    fail = float(_num(data.get("failure_timeout_s", FAILURE_TIMEOUT_S), src, "failure_timeout_s", strict=True))
    if fail <= hb:
        raise ConfigError(src, "failure_timeout_s", f"must be larger than heartbeat_interval_s ({hb:g}), got {fail:g}")
    return NodeConfig(
        source=src, id=data["id"], device=load_device(data["device"], f"{src}: device"),
        zone=str(data.get("zone", "default")), listen=data["listen"], advertise=data.get("advertise"),
        seeds=seeds, seed_ids=seed_ids, mdns=mdns, model=_model(data.get("model", DEFAULT_MODEL), src),
        roles=_roles(data.get("roles"), src, "roles"), node_key=security.get("node_key"),
        authorized_keys=security.get("authorized_keys"), rate_limit=_rate_limit(data.get("rate_limit"), src),
        links=links, heartbeat_interval_s=hb, failure_timeout_s=fail, **_gateway(data.get("gateway"), src),
        **_weights_keys(data, src),
        **_serving(data, src),
    )


def _weights_keys(d: dict, src: str) -> dict[str, Any]:
    """fetch_weights / weights_cache: weights over the mesh (roles/weights_fetch.py)."""
    fetch, cache = d.get("fetch_weights", True), d.get("weights_cache")
    if not isinstance(fetch, bool):
        raise ConfigError(src, "fetch_weights", f"must be true or false, got {fetch!r}")
    if cache is not None and (not isinstance(cache, str) or not cache):
        raise ConfigError(src, "weights_cache", f"must be a directory path, got {cache!r}")
    return {"fetch_weights": fetch, "weights_cache": cache}


def _gateway(v: Any, src: str) -> dict[str, Any]:
    """gateway: {listen: HOST:PORT, api_token: FILE} -> the gateway and api_token fields."""
    if v is None:
        return {"gateway": None, "api_token": None}
    _check_keys(v, {"listen", "api_token"}, {"listen"}, src, "gateway.")
    split_hostport(v["listen"], src, "gateway.listen")
    path, token = v.get("api_token"), None
    if path is not None:
        try:
            token = Path(str(path)).read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(src, "gateway.api_token", f"cannot read {path!r}: {e}") from None
        if len(token) < 16 or any(c.isspace() for c in token):
            raise ConfigError(src, "gateway.api_token", f"{path}: the token must be one word of at least 16 "
                                                        "characters")
    return {"gateway": v["listen"], "api_token": token}


def _node_security(d: dict, src: str) -> dict[str, Any]:
    """node_key + authorized_keys (both or neither): CURVE with this node's own key pair."""
    key, auth = d.get("node_key"), d.get("authorized_keys")
    if key is None and auth is None:
        return {}
    if key is None or auth is None:
        missing = "node_key" if key is None else "authorized_keys"
        raise ConfigError(src, missing, "node_key and authorized_keys go together (CURVE needs both)")
    for fld, v in (("node_key", key), ("authorized_keys", auth)):
        if not isinstance(v, str) or not v:
            raise ConfigError(src, fld, f"must be a file path, got {v!r}")
    NodeKeys.load(str(d["id"]), key, auth, src)  # a bad key file or an id without its key: ConfigError
    return {"node_key": key, "authorized_keys": auth, "authorized": read_authorized_keys(auth, src, "authorized_keys")}


def _seeds(v: Any, src: str, authorized: dict | None) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """`[ID@]HOST:PORT` seeds -> (addresses, (address, id) pairs). With CURVE every seed needs its id."""
    if not isinstance(v, list):
        raise ConfigError(src, "seeds", "must be a list of HOST:PORT or ID@HOST:PORT")
    addresses, ids = [], []
    for i, s in enumerate(v):
        node_id, at, address = str(s).rpartition("@") if isinstance(s, str) else ("", "", s)
        split_hostport(address, src, f"seeds[{i}]")
        if at and not node_id:
            raise ConfigError(src, f"seeds[{i}]", f"expected ID@HOST:PORT, got {s!r}")
        if authorized is not None and node_id not in authorized:
            raise ConfigError(src, f"seeds[{i}]", f"with CURVE a seed is ID@HOST:PORT with ID in authorized_keys, "
                                                  f"got {s!r}")
        addresses.append(address)
        if node_id:
            ids.append((address, node_id))
    return tuple(addresses), tuple(ids)


def _rate_limit(v: Any, src: str) -> RateLimit:
    if v is None:
        return RateLimit()
    _check_keys(v, {"messages_per_s", "burst"}, set(), src, "rate_limit.")
    default = RateLimit()
    rate = float(_num(v.get("messages_per_s", default.messages_per_s), src, "rate_limit.messages_per_s", strict=True))
    burst = float(_num(v.get("burst", default.burst), src, "rate_limit.burst", lo=1.0))
    return RateLimit(rate, burst)


def _serving(d: dict, src: str) -> dict[str, Any]:
    """The node-file keys shared with cluster files (what the coordinator plans for) and emulation."""
    expect = d.get("expect_nodes") or []
    if not isinstance(expect, list) or not all(isinstance(x, str) and x for x in expect):
        raise ConfigError(src, "expect_nodes", "must be a list of node ids")
    pace, faults = d.get("pace", False), d.get("fault_injection", False)
    for key, v in (("pace", pace), ("fault_injection", faults)):
        if not isinstance(v, bool):
            raise ConfigError(src, key, f"must be true or false, got {v!r}")
    return dict(
        draft=_draft(d.get("draft") or {}, src), speculation=_spec(d.get("speculation") or {}, src),
        weights_dtype=_choice(d.get("weights_dtype", DEFAULT_WEIGHT_DTYPE), WEIGHT_DTYPES, src, "weights_dtype"),
        workload=_workload(d.get("workload") or {}, src), expect_nodes=tuple(expect),
        plan_settle_s=float(_num(d.get("plan_settle_s", PLAN_SETTLE_S), src, "plan_settle_s")),
        pace=pace, time_scale=_time_scale(d.get("time_scale", 1.0), src), fault_injection=faults,
        busy_poll_ms=_busy_poll_ms(d.get("busy_poll_ms", 0.0), src),
    )


def _busy_poll_ms(v: Any, src: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= MAX_BUSY_POLL_MS:
        raise ConfigError(src, "busy_poll_ms", f"must be a number from 0 to {MAX_BUSY_POLL_MS:g}, got {v!r}")
    return float(v)


def _time_scale(v: Any, src: str) -> float:
    return float(_num(v, src, "time_scale", lo=1.0))


def load_node(path: str | Path) -> NodeConfig:
    return parse_node(read_yaml(path), str(path))
