"""Node files (`--node-config`, README schema): one node's identity, address, peers, security,
and the settings it serves and plans with.

Checked once, here, with the cluster file's field checks (config.py); every error is a
ConfigError naming the file, the field and the problem (the CLI turns it into one line and
exit code 2).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshllm.config import (
    PLAN_SETTLE_S,
    DraftSpec,
    LinkSpec,
    SpeculationSpec,
    Workload,
    _draft,
    _links,
    _model,
    _plan_inputs,
    _roles,
    _spec,
    _time_scale,
    _workload,
    check_draft_groups,
    check_lengths,
    file_model_args,
)
from meshllm.defaults import (
    DEFAULT_MODEL,
    DEFAULT_WEIGHT_DTYPE,
    FAILURE_TIMEOUT_S,
    GATEWAY_DRAIN_S,
    GATEWAY_MAX_CONCURRENT,
    HEARTBEAT_INTERVAL_S,
    MAX_BUSY_POLL_MS,
    MAX_DRAIN_S,
    WEIGHT_DTYPES,
    Role,
)
from meshllm.device import DeviceProfile, load_device
from meshllm.engine.sources import not_here
from meshllm.errors import ConfigError
from meshllm.mesh.ingress import RateLimit
from meshllm.mesh.keys import NodeKeys, read_authorized_keys
from meshllm.partition.inputs import PlanInputs, PlanNode
from meshllm.shapes import transformer_configs
from meshllm.yaml_fields import (
    check_keys,
    choice,
    given,
    node_id,
    number,
    read_text_file,
    read_yaml,
    split_hostport,
    zone_name,
)


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
    cluster_key: str | None = None  # one CURVE secret key file that every node holds (instead of the two above)
    rate_limit: RateLimit = RateLimit()  # per-peer message rate limit of the transport
    links: tuple[LinkSpec, ...] = ()  # zone links: the planner's input; the emulator also shapes them
    heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S  # liveness: see mesh/membership.py
    failure_timeout_s: float = FAILURE_TIMEOUT_S  # a peer silent this long is dead
    gateway: str | None = None  # HOST:PORT of this node's OpenAI-compatible HTTP API, if it runs one
    api_token: str | None = field(default=None, repr=False)  # bearer token that API requires, if any
    max_concurrent: int = GATEWAY_MAX_CONCURRENT  # requests that API takes at once (then 429)
    drain_s: float = GATEWAY_DRAIN_S  # stopped, the API lets its requests finish this long, then ends them
    fetch_weights: bool = True  # without the model file: fetch this node's layer range from a peer that has it
    weights_cache: str | None = None  # where fetched tensors are kept (default $MESHLLM_WEIGHTS_CACHE or ~/.cache)
    # what the coordinator plans for (the cluster file's settings; see the README's node file schema)
    draft: DraftSpec = DraftSpec()
    speculation: SpeculationSpec = SpeculationSpec()
    weights_dtype: str = DEFAULT_WEIGHT_DTYPE
    workload: Workload = Workload()
    expect_nodes: tuple[str, ...] = ()  # plan only once all of these are alive (emulation)
    plan_settle_s: float = PLAN_SETTLE_S  # otherwise plan after membership is quiet this long
    plan_judge: bool = False  # the coordinator's plan is the simulator's pick among the search's (sim/judge.py)
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


def plan_inputs_for_nodes(cfg: NodeConfig, nodes: tuple[PlanNode, ...], source: str, args=None) -> PlanInputs:
    """What a live coordinator plans for: the nodes of its peer table, with its own node file's
    model, links and serving settings (`args`: the model's shape, if not from the file)."""
    return _plan_inputs(cfg, nodes, source, args)


# -- node file ------------------------------------------------------------------------------
NODE_KEYS = {"id", "device", "zone", "listen", "advertise", "seeds", "mdns", "model", "roles", "node_key",
             "authorized_keys", "cluster_key", "rate_limit", "links", "heartbeat_interval_s", "failure_timeout_s", "gateway", "draft", "speculation",
             "weights_dtype", "workload", "expect_nodes", "plan_settle_s", "pace", "time_scale", "fault_injection",
             "fetch_weights", "weights_cache", "busy_poll_ms", "plan_judge"}


def parse_node(data: dict, src: str) -> NodeConfig:
    check_keys(data, NODE_KEYS, {"id", "device", "listen"}, src, "")
    node_id(data["id"], src, "id")
    split_hostport(data["listen"], src, "listen")
    if data.get("advertise") is not None:
        split_hostport(data["advertise"], src, "advertise")
    security = _node_security(data, src)
    seeds, seed_ids = _seeds(given(data, "seeds", []), src, security.get("authorized"))
    mdns = data.get("mdns", True)
    if not isinstance(mdns, bool):
        raise ConfigError(src, "mdns", f"must be true or false, got {mdns!r}")
    # Links in a node file (written by the emulator) name zones of other nodes: no zone check here.
    links = _links(data, src, None)
    hb = float(number(data.get("heartbeat_interval_s", HEARTBEAT_INTERVAL_S), src, "heartbeat_interval_s",
                    strict=True))
    fail = float(number(data.get("failure_timeout_s", FAILURE_TIMEOUT_S), src, "failure_timeout_s", strict=True))
    if fail <= hb:
        raise ConfigError(src, "failure_timeout_s", f"must be larger than heartbeat_interval_s ({hb:g}), got {fail:g}")
    model, weights = _model(data.get("model", DEFAULT_MODEL), src), _weights_keys(data, src)
    if not weights["fetch_weights"] and (why := not_here(model)):
        raise ConfigError(src, "model", f"{model!r}: {why}, and fetch_weights is false (no peer may send it)")
    cfg = NodeConfig(
        source=src, id=data["id"], device=load_device(data["device"], src),
        zone=zone_name(data.get("zone", "default"), src, "zone"), listen=data["listen"], advertise=data.get("advertise"),
        seeds=seeds, seed_ids=seed_ids, mdns=mdns, model=model,
        roles=_roles(data.get("roles"), src, "roles"), node_key=security.get("node_key"),
        authorized_keys=security.get("authorized_keys"), cluster_key=security.get("cluster_key"), rate_limit=_rate_limit(data.get("rate_limit"), src),
        links=links, heartbeat_interval_s=hb, failure_timeout_s=fail, **_gateway(data, src),
        **weights,
        **_serving(data, src),
    )
    _check_ports(cfg)
    if model in transformer_configs:  # a model file's shape is read only when the node runs (or fetched)
        check_draft_groups(cfg, transformer_configs[model])
        check_lengths(cfg, transformer_configs[model])
    elif Path(model).exists():  # here, yet no model (/etc/passwd, a truncated file): exit 2, not a node that never plans
        file_model_args(model, src)  # (its draft groups are the plan's to check: a node that cannot build the
        # draft is planned around, roles/host.py plan_error)
    return cfg


def _weights_keys(d: dict, src: str) -> dict[str, Any]:
    """fetch_weights / weights_cache: weights over the mesh (roles/weights_fetch.py)."""
    fetch, cache = d.get("fetch_weights", True), d.get("weights_cache")
    if not isinstance(fetch, bool):
        raise ConfigError(src, "fetch_weights", f"must be true or false, got {fetch!r}")
    if cache is not None and (not isinstance(cache, str) or not cache):
        raise ConfigError(src, "weights_cache", f"must be a directory path, got {cache!r}")
    return {"fetch_weights": fetch, "weights_cache": cache}


ANY_HOST = {"0.0.0.0", "::", "*", ""}


def _check_ports(cfg: NodeConfig) -> None:
    """The API's port is not the node's ROUTER port nor its PUB port (that + 1) on an address they
    share: the node failed at start with "the gateway cannot listen" (exit 1)."""
    if cfg.gateway is None:
        return
    host, port = split_hostport(cfg.listen, cfg.source, "listen")
    ghost, gport = split_hostport(cfg.gateway, cfg.source, "gateway.listen", 65535)
    if gport in (port, port + 1) and (host == ghost or host in ANY_HOST or ghost in ANY_HOST):
        raise ConfigError(cfg.source, "gateway.listen", f"{cfg.gateway} takes port {gport}, which the node's own "
                          f"sockets use (listen {cfg.listen}: ROUTER on {port}, PUB on {port + 1})")


def _gateway(data: dict, src: str) -> dict[str, Any]:
    """gateway: {listen: HOST:PORT, api_token: FILE, max_concurrent: N, drain_s: S} -> the gateway,
    api_token, max_concurrent and drain_s fields."""
    if "gateway" not in data:
        return {"gateway": None, "api_token": None}
    v = data["gateway"]
    if v is None:  # a bare `gateway:` ran no API, and said nothing
        raise ConfigError(src, "gateway", "is empty: give {listen: HOST:PORT}, or leave the key out")
    check_keys(v, {"listen", "api_token", "max_concurrent", "drain_s"}, {"listen"}, src, "gateway.")
    limit = int(number(v.get("max_concurrent", GATEWAY_MAX_CONCURRENT), src, "gateway.max_concurrent", lo=1,
                     integer=True))
    drain = float(number(v.get("drain_s", GATEWAY_DRAIN_S), src, "gateway.drain_s"))
    if drain > MAX_DRAIN_S:  # also .inf: a stop must end
        raise ConfigError(src, "gateway.drain_s", f"must be at most {MAX_DRAIN_S:g} s, got {drain:g}")
    split_hostport(v["listen"], src, "gateway.listen", 65535)
    path, token = v.get("api_token"), None
    if path is not None:
        if not isinstance(path, str):
            raise ConfigError(src, "gateway.api_token", f"must be the path of a token file, got {path!r:.80}")
        token = read_text_file(path, src, "gateway.api_token", "a token file", secret=True).strip()
        if len(token) < 16 or any(c.isspace() for c in token):
            raise ConfigError(src, "gateway.api_token", f"{path}: the token must be one word of at least 16 "
                                                        "characters")
    return {"gateway": v["listen"], "api_token": token, "max_concurrent": limit, "drain_s": drain}


def _node_security(d: dict, src: str) -> dict[str, Any]:
    """node_key + authorized_keys (both or neither): CURVE with this node's own key pair; or
    cluster_key: CURVE with the key pair every node holds."""
    key, auth, shared = d.get("node_key"), d.get("authorized_keys"), d.get("cluster_key")
    if shared is not None:
        if key is not None or auth is not None:
            raise ConfigError(src, "cluster_key", "give cluster_key, or node_key with authorized_keys; not both")
        if not isinstance(shared, str) or not shared:
            raise ConfigError(src, "cluster_key", f"must be a file path, got {shared!r}")
        NodeKeys.cluster(str(d["id"]), shared, src)  # a bad key file: ConfigError
        return {"cluster_key": shared}
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
        nid, at, address = str(s).rpartition("@") if isinstance(s, str) else ("", "", s)
        split_hostport(address, src, f"seeds[{i}]")
        if at and not nid:
            raise ConfigError(src, f"seeds[{i}]", f"expected ID@HOST:PORT, got {s!r}")
        if authorized is not None and nid not in authorized:
            raise ConfigError(src, f"seeds[{i}]", f"with CURVE a seed is ID@HOST:PORT with ID in authorized_keys, "
                                                  f"got {s!r}")
        addresses.append(address)
        if nid:
            ids.append((address, nid))
    return tuple(addresses), tuple(ids)


def _rate_limit(v: Any, src: str) -> RateLimit:
    if v is None:
        return RateLimit()
    check_keys(v, {"messages_per_s", "burst"}, set(), src, "rate_limit.")
    default = RateLimit()
    rate = float(number(v.get("messages_per_s", default.messages_per_s), src, "rate_limit.messages_per_s", strict=True))
    burst = float(number(v.get("burst", default.burst), src, "rate_limit.burst", lo=1.0))
    return RateLimit(rate, burst)


def _serving(d: dict, src: str) -> dict[str, Any]:
    """The node-file keys shared with cluster files (what the coordinator plans for) and emulation."""
    expect = given(d, "expect_nodes", [])
    if not isinstance(expect, list) or not all(isinstance(x, str) and x for x in expect):
        raise ConfigError(src, "expect_nodes", "must be a list of node ids")
    pace, faults, judge = d.get("pace", False), d.get("fault_injection", False), d.get("plan_judge", False)
    for key, v in (("pace", pace), ("fault_injection", faults), ("plan_judge", judge)):
        if not isinstance(v, bool):
            raise ConfigError(src, key, f"must be true or false, got {v!r}")
    return dict(
        draft=_draft(given(d, "draft", {}), src), speculation=_spec(given(d, "speculation", {}), src),
        weights_dtype=choice(d.get("weights_dtype", DEFAULT_WEIGHT_DTYPE), WEIGHT_DTYPES, src, "weights_dtype"),
        workload=_workload(given(d, "workload", {}), src, node=True), expect_nodes=tuple(expect),
        plan_settle_s=float(number(d.get("plan_settle_s", PLAN_SETTLE_S), src, "plan_settle_s")), plan_judge=judge,
        pace=pace, time_scale=_time_scale(d.get("time_scale", 1.0), src), fault_injection=faults,
        busy_poll_ms=_busy_poll_ms(d.get("busy_poll_ms", 0.0), src),
    )


def _busy_poll_ms(v: Any, src: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= MAX_BUSY_POLL_MS:
        raise ConfigError(src, "busy_poll_ms", f"must be a number from 0 to {MAX_BUSY_POLL_MS:g}, got {v!r}")
    return float(v)


def load_node(path: str | Path) -> NodeConfig:
    return parse_node(read_yaml(path), str(path))
