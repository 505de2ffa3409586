"""Soak: the demo mesh under a steady stream of concurrent clients, for minutes.

Run:  python bench/soak.py [--cluster clusters/demo.yaml] [--clients 32] [--minutes 10]
                           [--max-tokens 32] [--out bench/results/soak.txt]
      python bench/soak.py --rounds 12 --clients 40 [--idle-s 3] [--cut-every 5]

`--clients` concurrent clients (each sends a request, waits for its last token, sends the next,
cycling through the cluster's prompts) run against the emulated mesh's gateway for `--minutes`.
Every node's resident memory is sampled every `--sample-s` seconds from `/v1/mesh`. Printed:
requests completed and failed, latency p50/p99, the throughput, and each node's memory at the
start, at the end of minute 2 and at the end, with its growth from minute 2 to the end (goal:
<= 10%: nothing leaks per request). Bounded: the run stops at `--minutes` and every request has
a timeout.

With `--rounds R` the load comes in bursts instead: each round every client sends one request
(every `--cut-every`-th one is streamed and dropped by its client after the first bytes), then
the mesh idles `--idle-s` seconds and every node's memory is sampled; growth is measured from
round 2 to the end, and the sequences the nodes still hold then (KV slots, drafter sessions)
are printed: after a round nothing should be held, and an idle node gives its freed heap back
(roles/shard.py IdleTrim).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from meshllm.config import load_cluster  # noqa: E402
from meshllm.defaults import served_name  # noqa: E402
from meshllm.emulate import EmulatedCluster, http_json  # noqa: E402
from meshllm.workload import Job, Outcome, _one  # noqa: E402

REQUEST_TIMEOUT_S = 300.0


async def client(url: str, model: str, jobs: list[Job], until: float, outs: list, k: int) -> None:
    import aiohttp

    i = k
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while time.monotonic() < until:
            job = jobs[i % len(jobs)]
            o = Outcome(job.prompt)
            try:
                await asyncio.wait_for(_one(session, url, model, job, o), REQUEST_TIMEOUT_S)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                o.error = f"{type(e).__name__}: {e}"
            if o.done == 0.0:
                o.done = time.monotonic()
            outs.append(o)
            i += 1


async def cut_one(session, url: str, model: str, job: Job) -> None:
    """A client that goes away once its response has started (the gateway releases its sequence)."""
    body = {"model": model, "prompt": job.prompt, "max_tokens": job.max_tokens, "stream": True}
    async with session.post(url + "/v1/completions", json=body) as resp:
        await resp.content.readany()


async def run_rounds(url: str, model: str, jobs: list[Job], n: int, rounds: int, idle_s: float, cut_every: int,
                     samples: list) -> list[Outcome]:
    """`rounds` bursts of `n` requests, each followed by `idle_s` of quiet and a memory sample."""
    import aiohttp

    outs: list[Outcome] = []
    samples.append((0, node_figures(url)))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as session:
        async def one(i: int) -> None:
            job = jobs[i % len(jobs)]
            if cut_every and i % cut_every == 0:
                await cut_one(session, url, model, job)
                return
            o = Outcome(job.prompt)
            try:
                await asyncio.wait_for(_one(session, url, model, job, o), REQUEST_TIMEOUT_S)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                o.error = f"{type(e).__name__}: {e}"
            o.done = o.done or time.monotonic()
            outs.append(o)

        for r in range(rounds):
            await asyncio.gather(*(one(r * n + k) for k in range(n)))
            await asyncio.sleep(idle_s)
            samples.append((r + 1, node_figures(url)))
            print(f"round {r + 1}/{rounds}: {len(outs)} requests completed", file=sys.stderr, flush=True)
    return outs


def node_figures(url: str) -> dict:
    """Every node's resident MB, and what it holds: KV slots' bytes, drafter sessions, a gateway's
    requests in flight, a leader's sequences running or queued."""
    _, view = http_json(url + "/v1/mesh", 10)
    out = {}
    for nid, n in view.get("nodes", {}).items():
        load = n.get("load") or {}
        out[nid] = {"rss_mb": load.get("rss_mb"), "kv_bytes": (load.get("stage") or {}).get("kv_cache_bytes", 0),
                    "sessions": (load.get("drafter") or {}).get("sessions", 0),
                    "in_flight": (load.get("gateway") or {}).get("in_flight", 0),
                    "leader": sum((load.get("leader") or {}).get(k, 0) for k in ("active", "queued"))}
    return out


async def run_clients(url: str, model: str, jobs: list[Job], n: int, seconds: float) -> list[Outcome]:
    outs: list[Outcome] = []
    until = time.monotonic() + seconds
    await asyncio.gather(*(client(url, model, jobs, until, outs, k) for k in range(n)))
    return outs


def sampler(url: str, every_s: float, stop: threading.Event, samples: list) -> None:
    t0 = time.monotonic()
    while not stop.is_set():
        _, view = http_json(url + "/v1/mesh", 10)
        samples.append((time.monotonic() - t0, {nid: {"rss_mb": n["load"].get("rss_mb")}
                                                for nid, n in view.get("nodes", {}).items()}))
        stop.wait(every_s)


def at(samples: list, t: float) -> dict:
    """The memory sample closest to `t` seconds."""
    return min(samples, key=lambda s: abs(s[0] - t))[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cluster", default="clusters/demo.yaml")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--sample-s", type=float, default=15.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--rounds", type=int, default=0, help="bursts instead of a steady stream (see above)")
    ap.add_argument("--idle-s", type=float, default=3.0)
    ap.add_argument("--cut-every", type=int, default=5)
    a = ap.parse_args()
    cfg = load_cluster(a.cluster)
    jobs = [Job(p, a.max_tokens) for p in cfg.workload.prompts]
    lines = []
    with EmulatedCluster(cfg) as mesh:
        mesh.wait_formed()
        mesh.wait_serving()
        url = f"http://{mesh.gateway}"
        samples: list = []
        stop = threading.Event()
        t0 = time.monotonic()
        if a.rounds:
            outs = asyncio.run(run_rounds(url, served_name(cfg.model), jobs, a.clients, a.rounds, a.idle_s,
                                          a.cut_every, samples))
        else:
            th = threading.Thread(target=sampler, args=(url, a.sample_s, stop, samples), daemon=True)
            th.start()
            outs = asyncio.run(run_clients(url, served_name(cfg.model), jobs, a.clients, a.minutes * 60))
            stop.set()
            th.join(timeout=30)
        wall = time.monotonic() - t0
    ok = [o for o in outs if o.error is None]
    lat = sorted(o.done - o.sent for o in ok)
    tokens = sum(len(o.token_ids) for o in ok)
    lines.append(f"soak: {a.cluster}, " + (f"{a.rounds} rounds of {a.clients} requests ({a.idle_s:g} s idle after "
                                           f"each, 1 in {a.cut_every} dropped by its client)" if a.rounds
                                           else f"{a.clients} clients for {a.minutes:g} min")
                 + f", {a.max_tokens} tokens per request")
    lines.append(f"requests completed {len(ok)}, failed {len(outs) - len(ok)}"
                 + (f" (first error: {next(o.error for o in outs if o.error)})" if len(ok) < len(outs) else ""))
    if lat:
        p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
        lines.append(f"latency p50 {statistics.median(lat):.2f} s, p99 {p99:.2f} s; "
                     f"{tokens / wall:.1f} output tokens/s over {wall:.0f} s")
    start, minute2, end = samples[0][1], at(samples, 2 if a.rounds else 120.0), samples[-1][1]
    lines.append(f"{'node':<10}{'start MB':>10}{'round 2' if a.rounds else 'minute 2':>10}{'end MB':>10}"
                 f"{'growth 2->end':>15}")
    worst = 0.0
    for nid in sorted(end):
        s, m2, e = (start.get(nid, {}).get("rss_mb"), minute2.get(nid, {}).get("rss_mb"),
                    end.get(nid, {}).get("rss_mb"))
        growth = (e - m2) / m2 if e and m2 else float("nan")
        worst = max(worst, growth) if growth == growth else worst
        lines.append(f"{nid:<10}{s or 0:>10.0f}{m2 or 0:>10.0f}{e or 0:>10.0f}{100 * growth:>14.1f}%")
    lines.append(f"largest growth from {'round' if a.rounds else 'minute'} 2 to the end: {100 * worst:.1f}% (goal <= 10%: "
                 f"{'met' if worst <= 0.10 else 'NOT met'}); failed requests: {len(outs) - len(ok)} (goal 0)")
    if a.rounds:
        held = {nid: f["kv_bytes"] for nid, f in end.items() if f.get("kv_bytes")}
        sessions = {nid: f["sessions"] for nid, f in end.items() if f.get("sessions")}
        flight = {nid: f["in_flight"] for nid, f in end.items() if f.get("in_flight")}
        seqs = {nid: f["leader"] for nid, f in end.items() if f.get("leader")}
        lines.append(f"held after the last round: KV bytes {held or 'none'}, drafter sessions {sessions or 'none'}, "
                     f"gateway requests {flight or 'none'}, leader sequences {seqs or 'none'}")
    text = "\n".join(lines)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n" + json.dumps({"samples": samples}) + "\n")


if __name__ == "__main__":
    main()
