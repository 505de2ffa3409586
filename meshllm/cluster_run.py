"""`python launch.py --cluster CLUSTER.yaml`: the emulated cluster (emulate.py) run end to end.

The cluster file's workload (or `--prompt`s) is checked and the cluster planned before any
process starts (bad input exits 2); then the emulator spawns the nodes, waits until the mesh
serves, runs the requests through the gateway's OpenAI API (with `--kill` / `--restart` /
`--pause` / `--partition` faults injected on their schedule, faults.py) and reports the README's `--cluster`
JSON: the results, the metrics (METRIC_KEYS and each node's memory and traffic) and the plan the mesh
served. With `--serve` it keeps serving until Ctrl-C instead. SIGINT and SIGTERM unwind
through the emulator's `with`, which tears every node down.
"""

from __future__ import annotations

import random
import signal
import sys
import time
from typing import Any

from meshllm.config import ClusterConfig
from meshllm.defaults import served_name
from meshllm.emulate import (
    FORMATION_TIMEOUT_S,
    INTERRUPTED,
    READY_TIMEOUT_S,
    EmulatedCluster,
    alive_peers,
    gateway_nodes,
    http_json,
    log,
    raise_if_interrupted,
    raise_interrupt,
)
from meshllm.errors import InputError
from meshllm.faults import HEAL_TIMEOUT_S, FaultInjector, parse_faults
from meshllm.partition.plan import Plan, PlanError
from meshllm.workload import Job, node_figures, recovery_figures, run_jobs, serving_figures, summarize

SYNTHETIC_REQUESTS = 8  # a workload without prompts and without `requests`: this many synthetic ones
SYNTHETIC_LOW_ID = 1000  # synthetic prompts' token ids start here (below: special tokens, bytes)
METRIC_KEYS = ("ttft_ms_mean", "ttft_ms_p99", "itl_ms_mean", "itl_ms_p50", "itl_ms_p99", "output_tokens_per_s",
               "queue_wait_ms_mean", "acceptance_rate", "mean_acceptance_length", "drafted_tokens",
               "accepted_tokens")


def run_cluster(cfg: ClusterConfig, args: Any = None) -> dict[str, Any] | None:
    """Emulate `cfg`, wait until it serves, run its workload (or `--prompt`s) through the gateway,
    report results, metrics and the live plan; with `serve`, keep serving until Ctrl-C instead."""
    from meshllm.config import plan_inputs
    from meshllm.partition.plan import plan_cluster

    timeout_s = getattr(args, "timeout", None) or FORMATION_TIMEOUT_S
    serve = getattr(args, "serve", False)
    inp = plan_inputs(cfg)
    plan = plan_cluster(inp, seed=0, log=False)  # infeasible -> exit 2 before any spawn
    # bad input -> exit 2 before anything starts (a served mesh takes its requests from the API)
    jobs = [] if serve else workload_jobs(cfg, args, inp.args)
    faults = parse_faults(cfg, getattr(args, "kill", None) or [], getattr(args, "partition", None) or [],
                          gateway_nodes(cfg), getattr(args, "restart", None) or [], getattr(args, "pause", None) or [])
    log.info("plan: %d replica(s), %d drafter(s), planned in %.2f s%s", len(plan.replicas), len(plan.drafters),
             plan.planner_s, "; the coordinator will judge it and other candidates in the simulator"
             if getattr(args, "judge", False) else "")
    # SIGINT explicitly too: a shell script's background job starts with SIGINT ignored, and
    # Python then leaves it ignored, so `kill -INT` (or the test's Ctrl-C) would not stop the mesh
    INTERRUPTED.clear()
    previous = {s: signal.signal(s, raise_interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        t0 = time.monotonic()
        with EmulatedCluster(cfg, judge=getattr(args, "judge", False)) as cluster:
            statuses = cluster.wait_formed(timeout_s)
            formed_s = time.monotonic() - t0
            log.info("mesh of %d nodes formed in %.2f s; loading the plan's layers", len(cfg.nodes), formed_s)
            cluster.wait_serving(max(timeout_s, READY_TIMEOUT_S))
            log.info("serving after %.1f s", time.monotonic() - t0)
            if serve:
                return serve_until_interrupted(cluster)
            injector = FaultInjector(cluster, faults, *healing_watch(cluster, faults, cfg.time_scale))
            try:
                outs = run_jobs(cluster.gateway_urls(), served_name(cfg.model), jobs,
                                cfg.workload.arrival_rate_per_s, getattr(args, "seed", 0) or 0,
                                progress=len(jobs) > 1, on_start=injector.start, headers=cluster.api_headers,
                                time_scale=cfg.time_scale)
            except BaseException:  # Ctrl-C or an error: no fault fires during the teardown
                injector.halt()
                raise
            injector.stop()
            report = cluster_report(cfg, cluster, outs, formed_s, statuses)
            report["faults"] = injector.done
            report["faults_not_run"] = injector.not_run  # the workload ended first (a warning too)
            return report
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def healing_watch(cluster: EmulatedCluster, faults: list, time_scale: float) -> tuple:
    """FaultInjector's (live_plan, in_use, heal_timeout_s, kinds) for a run with a pause or a
    partition: the gateway's plan, the nodes it uses now (before the faults), the bound on healing,
    each node's kind (device, zone, roles: a twin in use in a node's place counts); () without one."""
    if not any(f.kind in ("pause", "partition") for f in faults):
        return ()

    def live_plan() -> Any:  # from a gateway that is alive
        return http_json(f"http://{cluster.gateway}/v1/plan", headers=cluster.api_headers)[1].get("plan")

    try:
        in_use = Plan.from_json(live_plan()).nodes_in_use()
    except PlanError as e:
        log.warning("the gateway gave no plan (%s): the mesh's healing is not watched", e)
        return ()
    kinds = {n.id: (n.device.name, n.zone, n.roles) for n in cluster.cfg.nodes}
    return live_plan, in_use, HEAL_TIMEOUT_S * time_scale, kinds


def workload_jobs(cfg: ClusterConfig, args: Any, model: Any) -> list[Job]:
    """The requests of a run: `--prompt`s, or the cluster file's prompts cycled to `requests`, or
    without either, synthetic ones (`synthetic_prompts`); `model`: the model's ModelArgs."""
    wl = cfg.workload
    prompts = list(getattr(args, "prompt", None) or wl.prompts)
    chat = bool(getattr(args, "chat", False))
    max_tokens = getattr(args, "max_tokens", None) or wl.max_tokens
    temp = getattr(args, "temperature", None)
    temp = wl.temperature if temp is None else temp
    seed, top_p, top_k = getattr(args, "seed", 0) or 0, getattr(args, "top_p", 1.0) or 1.0, getattr(args, "top_k", 0) or 0
    if not prompts:
        if chat:
            raise InputError(f"{cfg.source}: workload.prompts: no prompts, and synthetic ones are token ids, which "
                             "the chat endpoint does not take (give --prompt TEXT, or list workload.prompts)")
        return [Job(ids, n_out, temp, seed, False, top_p, top_k)
                for ids, n_out in synthetic_prompts(cfg, model, max_tokens, seed)]
    if "" in prompts and not chat:  # no tokens to start from (the API would refuse each: 400)
        where = "--prompt" if getattr(args, "prompt", None) else f"{cfg.source}: workload.prompts"
        raise InputError(f"{where}: an empty prompt encodes to zero tokens (give text, or --chat)")
    n = len(prompts) if getattr(args, "prompt", None) else (wl.requests or len(prompts))
    return [Job(prompts[i % len(prompts)], max_tokens, temp, seed, chat, top_p, top_k) for i in range(n)]


def synthetic_prompts(cfg: ClusterConfig, model: Any, max_tokens: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, max_tokens) of a workload without prompts: `requests` of them
    (SYNTHETIC_REQUESTS if 0), lengths drawn from `input_tokens` and `output_tokens` (the
    workload `--simulate` assumes; at most `max_tokens` out, and the two within the context),
    ids drawn uniformly above the low ids where tokenizers keep their special tokens. Seeded."""
    wl, rng = cfg.workload, random.Random(seed)
    low = min(SYNTHETIC_LOW_ID, model.vocab_size // 2)
    out = []
    for _ in range(wl.requests or SYNTHETIC_REQUESTS):
        n_in, n_out = wl.input_tokens.draw(rng), min(max_tokens, wl.output_tokens.draw(rng))
        n_in = max(1, min(n_in, model.max_seq_len - n_out))
        out.append(([rng.randrange(low, model.vocab_size) for _ in range(n_in)], n_out))
    return out


def serve_until_interrupted(cluster: EmulatedCluster) -> None:
    """Serve until Ctrl-C / SIGTERM. A node that dies meanwhile is reported, not fatal: the mesh
    re-plans around it (and the death of the last gateway node ends the run)."""
    first, *others = cluster.gateway_urls()
    print(f"meshllm: serving on {first}", file=sys.stderr, flush=True)
    for url in others:
        print(f"meshllm: another gateway on {url}", file=sys.stderr, flush=True)
    if cluster.api_headers:  # security.api_token: without it every request is a 401
        print(f"meshllm: the API wants `Authorization: Bearer TOKEN`; TOKEN is in {cluster.workdir / 'api_token'} "
              "(deleted when the mesh stops)", file=sys.stderr, flush=True)
    reported: set[str] = set()
    order: list[str] = []  # the nodes that died, in the order they were seen dead
    try:
        while True:
            raise_if_interrupted()
            for nid in sorted(cluster.dead() - reported):
                reported.add(nid)
                order.append(nid)
                log.warning("node %s %s; the mesh goes on without it%s", nid, cluster.how_exited(nid),
                            f" (its API at http://{cluster.gateways[nid]} is gone)" if nid in cluster.gateways else "")
            if set(cluster.gateways) <= reported:
                last = max(cluster.gateways, key=lambda nid: order.index(nid))
                raise RuntimeError(f"the last gateway node, {last}, {cluster.how_exited(last)}; its log ends: "
                                   f"{cluster.log_tail(last)}")
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("meshllm: stopping the emulated mesh", file=sys.stderr, flush=True)
    return None


def cluster_report(cfg: ClusterConfig, cluster: EmulatedCluster, outs: list, formed_s: float,
                   statuses: dict[str, dict]) -> dict[str, Any]:
    """The README's `--cluster` JSON: results, metrics (with each node's memory and traffic) and the
    plan the mesh actually served."""
    _, live = http_json(f"http://{cluster.gateway}/v1/plan", headers=cluster.api_headers)
    nodes, dead = {}, cluster.dead()
    for n in cfg.nodes:
        if n.id in dead:  # killed by a fault (or crashed) and not restarted: asking would only wait out the timeout
            log.warning("node %s has exited (code %s); its figures are left out of the report", n.id,
                        cluster.procs[n.id].returncode)
            continue
        try:
            st = cluster.status(n.id, 5.0)
        except (TimeoutError, RuntimeError) as e:  # dead (a fault), or too busy to answer: the report goes on
            log.warning("node %s: no status for the report (%s); its figures are left out", n.id, e)
            continue
        nodes[n.id] = {"roles": st["roles"], **node_figures(st["load"])}
    metrics = summarize(outs)
    metrics.update(serving_figures(nodes, live.get("plan", {}), outs))
    metrics.update(recovery_figures(outs))  # over the requests that completed
    metrics["nodes"] = nodes
    failed = [o for o in outs if o.error]
    if failed:
        log.error("%d of %d requests failed; first: %s", len(failed), len(outs), failed[0].error)
    mesh = [{"id": n.id, "zone": n.zone, "device": n.device.name, "address": cluster.addresses[n.id],
             "pid": cluster.procs[n.id].pid, "peers": sorted(alive_peers(statuses[n.id]))} for n in cfg.nodes]
    return {"results": [o.to_json() for o in outs], "metrics": metrics, "plan": live.get("plan"),
            "plan_version": live.get("version"),
            "mesh": {"nodes": mesh, "formation_s": round(formed_s, 3), "gateway": cluster.gateway_urls()[0],
                     "gateways": cluster.gateway_urls(),
                     "links": [{"zones": list(ln.zones), "rtt_ms": ln.rtt_ms, "bandwidth_mbps": ln.bandwidth_mbps}
                               for ln in cfg.links]}}
