"""A workload client for a gateway's OpenAI API: what `--cluster` and the benchmarks send.

Each request streams (SSE) and every token's arrival time is recorded, so TTFT and ITL are
what a client sees. Arrivals are all at once (rate 0) or Poisson (seeded). Concurrency is
bounded by the number of requests; every request has a timeout. The metrics follow `vllm
bench serve`: TTFT from send to the first token; ITL the gaps between successive tokens
(tokens that arrive together have a gap of 0; a failover's pause is one, as a resume's in the
mesh is); output tokens/s over the whole run.

Given several gateways, a request whose gateway goes away (a reset, a stream cut before its
end, or ended by a stopping gateway's "shutting_down" error) is sent again to the next one
with the output it has so far (`meshllm.resume_token_ids`): that gateway
goes on after those tokens (greedy and seeded sampling give the same tokens as one attempt
would), and the pause, from the last token before until the next new token, counts as a
recovery gap. (It used to be sent whole, and the next gateway generated every token the client
already had before a new one: on clusters/failure.yaml the first gateway's death paused its
requests up to 5.1 s.) With one gateway it goes to the same one again (a cut stream is never
taken for a whole one). A refused connection is no failover: when every gateway refuses (the
only one restarting, or every one down at once) the request waits, 0.25 s doubling to 2 s (x
the cluster's time_scale), at most 120 s in a row, and tries again, so that a restarted gateway
takes it (it used to spend its failovers on refusals within a millisecond and fail). A 429 (the
gateway at its `max_concurrent`) is no failure: the request waits as its Retry-After says and
goes again, within its timeout.

The report of a run is here too: each node's figures (memory, layers, KV traffic), the KV
shipped per prefilled token, and the readable text `--cluster` prints without `--json`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("meshllm.workload")
REQUEST_TIMEOUT_S = 600.0
FAILOVER_ROUNDS = 2  # a request's stream may be lost this many times per gateway
BACKOFF_S = (0.25, 2.0)  # x time_scale: the first wait when no gateway answers, doubled up to the second
UNREACHABLE_S = 120.0  # x time_scale: the longest a request waits in a row for any gateway to answer


@dataclass(frozen=True)
class Job:
    prompt: str | list[int]  # text, or token ids (synthetic prompts: cluster_run.synthetic_prompts)
    max_tokens: int
    temperature: float = 0.0
    seed: int = 0
    chat: bool = False
    top_p: float = 1.0
    top_k: int = 0
    ext: dict | None = None  # sent as the request body's `meshllm` object (speculation, gamma, ...)


@dataclass
class Outcome:
    prompt: str | list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    ttft_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    queue_ms: float = 0.0
    spec: dict | None = None  # acceptance figures of the session (speculative decoding)
    attempts: int = 1  # > 1: the request was resumed after a failure in the mesh
    recovery_gaps_ms: list[float] = field(default_factory=list)  # the pauses the client saw
    error: str | None = None
    sent: float = 0.0
    done: float = 0.0
    last_at: float | None = None  # when its last token came
    failed_at: float | None = None  # its gateway went away: the last token before that (or then)
    resumed_after: list[int] = field(default_factory=list)  # at each failover, the tokens it had (and went on after)

    def restart(self) -> None:
        """Its gateway went away: the next gateway goes on from the tokens it has (all of them
        sent as `meshllm.resume_token_ids`). Only that is a resume, with a recovery gap from its
        last token: one cut before its first token is sent again whole, its pause in its TTFT
        (it was counted resumed, with a "gap" equal to its TTFT)."""
        self.finish_reason = None
        if not self.token_ids:
            return
        self.failed_at = self.last_at
        self.resumed_after.append(len(self.token_ids))
        self.attempts += 1

    def to_json(self) -> dict[str, Any]:
        out = {"prompt": self.prompt, "token_ids": self.token_ids, "text": self.text,
               "finish_reason": self.finish_reason, "ttft_ms": self.ttft_ms, "itl_ms": self.itl_ms}
        if self.spec:
            out["speculation"] = self.spec
        if self.attempts > 1:
            out["attempts"], out["recovery_gaps_ms"] = self.attempts, self.recovery_gaps_ms
        if self.resumed_after:
            out["resumed_after_tokens"] = self.resumed_after
        if self.error:
            out["error"] = self.error
        return out


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Send offsets in seconds: all 0 for rate 0, else a seeded Poisson process."""
    if rate <= 0:
        return [0.0] * n
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def _one(session, url: str, model: str, job: Job, out: Outcome) -> None:
    body: dict[str, Any] = {"model": model, "max_tokens": job.max_tokens, "temperature": job.temperature,
                            "seed": job.seed, "top_p": job.top_p, "top_k": job.top_k, "stream": True}
    ext = dict(job.ext or {})
    if out.token_ids:  # an earlier attempt's output (its gateway went away): go on after it
        ext["resume_token_ids"] = list(out.token_ids)
    if ext:
        body["meshllm"] = ext
    if job.chat:
        body["messages"] = [{"role": "user", "content": job.prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = job.prompt
        path = "/v1/completions"
    out.sent = out.sent or time.monotonic()
    async with session.post(url + path, json=body) as resp:
        if resp.status == 429:  # the gateway is at its max_concurrent: wait as it says, then again
            raise Overloaded(float(resp.headers.get("Retry-After", "1") or 1))
        if resp.status != 200:
            out.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
            return
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                if ev["error"].get("code") == "shutting_down":  # its drain is over: another gateway can
                    raise GatewayGone(ev["error"].get("message", "the gateway is shutting down"))
                out.error = ev["error"].get("message", "error")
                return
            now = time.monotonic()
            ch = ev["choices"][0]
            ids = ch.get("token_ids") or []
            for i, _ in enumerate(ids):  # the gap from the request's last token, an earlier attempt's too:
                if out.last_at is None:  # a failover's pause is in ITL, as a resume in the mesh is
                    out.ttft_ms = round(1000 * (now - out.sent), 3)
                else:
                    out.itl_ms.append(round(1000 * (now - out.last_at), 3) if i == 0 else 0.0)
                out.last_at = now
            out.token_ids.extend(ids)
            if out.failed_at is not None and (len(out.token_ids) > out.resumed_after[-1] or ch.get("finish_reason")):
                out.recovery_gaps_ms.append(round(1000 * (now - out.failed_at), 3))  # past where it had got
                out.failed_at = None
            out.text += ch.get("text") if "text" in ch else (ch.get("delta") or {}).get("content") or ""
            if ch.get("finish_reason"):
                out.finish_reason = ch["finish_reason"]
                ext = ev.get("meshllm") or {}
                out.queue_ms = float(ext.get("queue_ms", 0.0))
                out.spec = ext.get("spec")
                out.attempts += int(ext.get("attempts", 1)) - 1  # resumed inside the mesh too
                out.recovery_gaps_ms += list(ext.get("recovery_gaps_ms", []))
    if out.finish_reason is None and out.error is None:
        raise GatewayGone("the stream ended before its last token")
    out.done = time.monotonic()


class GatewayGone(Exception):
    """The gateway stopped answering mid-request: the request goes to another gateway."""


class Overloaded(Exception):
    """A 429: the gateway takes no more requests at once for now (`retry_after` seconds)."""

    def __init__(self, retry_after: float):
        super().__init__(f"overloaded; retry after {retry_after:g} s")
        self.retry_after = retry_after


async def _run(urls: list[str], model: str, jobs: list[Job], rate: float, seed: int, progress: bool,
               on_start=None, headers: dict[str, str] | None = None, time_scale: float = 1.0) -> list[Outcome]:
    import aiohttp

    outs = [Outcome(j.prompt) for j in jobs]
    at = arrival_times(len(jobs), rate, seed)
    bar = _bar(len(jobs)) if progress else None
    t0 = time.monotonic()
    if on_start is not None:
        on_start()  # e.g. the fault injector's clock starts with the first request
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)

    async def go(i: int, session) -> None:
        await asyncio.sleep(max(0.0, t0 + at[i] - time.monotonic()))
        await _send(i, session, urls, model, jobs[i], outs[i], time_scale)
        if bar is not None:
            bar.update(1)

    from tqdm.contrib.logging import logging_redirect_tqdm

    # log lines (a gateway gone, a fault) print above the bar, not glued to its end; the bar goes
    # however the run ends (an interrupt left it, and the lines after it, on one line)
    with logging_redirect_tqdm() if bar is not None else contextlib.nullcontext():
        try:
            async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0),
                                             headers=headers) as session:
                await asyncio.gather(*(go(i, session) for i in range(len(jobs))))
        finally:
            if bar is not None:
                bar.close()
    return outs


async def _send(i: int, session, urls: list[str], model: str, job: Job, out: Outcome, time_scale: float) -> None:
    """Request `i` to its end or its error, over the gateways in turn. A stream its gateway lost
    (cut, reset, `shutting_down`) goes on at the next gateway and uses up one of the request's
    FAILOVER_ROUNDS x len(urls) failovers. A refused connection never reached a gateway: it uses
    none. When every gateway refuses (the only one, or all, restarting) the request waits
    (`Unreachable`) and tries again, so that a restarted gateway takes it: it used to spend all
    its failovers back to back within a millisecond and fail."""
    import aiohttp

    gone = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, GatewayGone)  # try the next gateway
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    failovers, k = FAILOVER_ROUNDS * len(urls), 0
    wait = Unreachable(len(urls), time_scale, deadline)
    while True:
        url = urls[k % len(urls)]
        try:
            await asyncio.wait_for(_one(session, url, model, job, out), max(0.0, deadline - time.monotonic()))
            return
        except Overloaded as e:  # not a failure: the same gateway, once it has room (the deadline bounds it)
            wait.answered()
            pause = max(e.retry_after, BACKOFF_S[0] * time_scale)  # a Retry-After of 0 is no busy loop
            if time.monotonic() + pause >= deadline:
                out.error = f"Overloaded: {e}"
                return
            await asyncio.sleep(pause)
        except aiohttp.ClientConnectorError as e:  # refused: down, or restarting
            k += 1
            if not await wait.refused(i, url):
                out.error = f"{type(e).__name__}: {e} (no gateway answered for {wait.waited:.1f} s)"
                return
        except gone as e:
            wait.answered()
            failovers -= 1
            if failovers == 0:
                out.error = f"{type(e).__name__}: {e}"
                return
            log.warning("request %d: gateway %s went away (%s); sending it to %s", i, url, type(e).__name__,
                        urls[(k + 1) % len(urls)])
            out.restart()
            k += 1
        except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
            out.error = f"{type(e).__name__}: {e}"
            return


class Unreachable:
    """A request's waits while no gateway answers: after each round of refused connections (every
    gateway tried once) it sleeps BACKOFF_S[0] x time_scale, doubling up to BACKOFF_S[1] x
    time_scale, and gives up once it has waited UNREACHABLE_S x time_scale in a row or would pass
    the request's deadline: bounded in time and so in tries. A gateway that answers starts it over."""

    def __init__(self, n_urls: int, time_scale: float, deadline: float):
        self.n, self.scale, self.deadline = n_urls, time_scale, deadline
        self.answered()

    def answered(self) -> None:
        self.tries, self.waited = 0, 0.0

    async def refused(self, i: int, url: str) -> bool:
        """One more refused connection: False when the request should give up, else True once it
        may try the next gateway (at once while this round has gateways left)."""
        self.tries += 1
        if self.tries % self.n:
            return True
        pause = min(BACKOFF_S[1], BACKOFF_S[0] * 2 ** (self.tries // self.n - 1)) * self.scale
        if self.waited + pause > UNREACHABLE_S * self.scale or time.monotonic() + pause >= self.deadline:
            return False
        log.warning("request %d: no gateway answers (the last: %s); trying again in %.2f s", i, url, pause)
        await asyncio.sleep(pause)
        self.waited += pause
        return True


def _bar(n: int):
    from tqdm import tqdm

    return tqdm(total=n, desc="requests", unit="req", file=sys.stderr, leave=False, dynamic_ncols=True)


def run_jobs(url: str | list[str], model: str, jobs: list[Job], rate: float = 0.0, seed: int = 0,
             progress: bool = True, on_start=None, headers: dict[str, str] | None = None,
             time_scale: float = 1.0) -> list[Outcome]:
    """Send `jobs` to the gateway at `url` (http://HOST:PORT; a list: the first, and the others in
    turn when one goes away) and wait for every one (`headers`: e.g. the API's bearer token;
    `time_scale`: the emulated cluster's, which stretches the waits for a gateway to answer)."""
    urls = [url] if isinstance(url, str) else list(url)
    return asyncio.run(_run(urls, model, jobs, rate, seed, progress, on_start, headers, time_scale))


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))], 3)


def _mean(xs: list[float]) -> float | None:
    return round(statistics.fmean(xs), 3) if xs else None


def summarize(outs: list[Outcome]) -> dict[str, Any]:
    """The README's `metrics` object (speculation fields are filled in by the caller)."""
    ok = [o for o in outs if o.error is None]
    ttft = [o.ttft_ms for o in ok if o.ttft_ms is not None]
    itl = [x for o in ok for x in o.itl_ms]
    span = (max(o.done for o in ok) - min(o.sent for o in ok)) if ok else 0.0
    n_tok = sum(len(o.token_ids) for o in ok)
    return {
        "requests": len(outs), "failed": len(outs) - len(ok),
        "ttft_ms_mean": _mean(ttft), "ttft_ms_p50": _pct(ttft, 0.5), "ttft_ms_p99": _pct(ttft, 0.99),
        "itl_ms_mean": _mean(itl), "itl_ms_p50": _pct(itl, 0.5), "itl_ms_p99": _pct(itl, 0.99),
        "output_tokens": n_tok, "output_tokens_per_s": round(n_tok / span, 3) if span > 0 else None,
        "queue_wait_ms_mean": _mean([o.queue_ms for o in ok]),
        **speculation([o.spec for o in ok if o.spec]),
    }


def recovery_figures(outs: list[Outcome]) -> dict[str, Any]:
    """`resumed_requests` and `recovery_gap_ms_max` over the requests that completed: a failed
    request's resumes recovered nothing (9 failed of 9 were reported as 9 resumed)."""
    ok = [o for o in outs if o.error is None]
    gaps = [g for o in ok for g in o.recovery_gaps_ms]
    return {"resumed_requests": sum(1 for o in ok if o.attempts > 1), "recovery_gap_ms_max": max(gaps, default=None)}


def speculation(specs: list[dict]) -> dict[str, Any]:
    """Acceptance over every session (vLLM's definitions); null fields without speculation."""
    from meshllm.engine.speculative import AcceptanceStats

    if not specs:
        return {"acceptance_rate": None, "mean_acceptance_length": None, "drafted_tokens": None,
                "accepted_tokens": None, "draft_blocks": None, "acceptance_by_position": None,
                "gamma_histogram": None}
    st = AcceptanceStats()
    for sp in specs:
        st.merge(sp)
    per_pos = {k: round(st.per_position[int(k)] / v, 4) for k, v in st.to_json()["offered"].items() if v}
    return {"acceptance_rate": round(st.rate, 4) if st.rate is not None else None,
            "mean_acceptance_length": round(st.mean_length, 4) if st.mean_length is not None else None,
            "drafted_tokens": st.drafted, "accepted_tokens": st.accepted, "draft_blocks": st.blocks,
            "acceptance_by_position": per_pos, "gamma_histogram": st.to_json()["gamma_histogram"]}


def node_figures(load: dict) -> dict[str, Any]:
    st = load.get("stage") or {}
    return {"rss_mb": load.get("rss_mb"), "weights_mb": st.get("weights_mb"), "layers": st.get("layers"),
            "replica": st.get("replica"),
            "kv_bytes_sent": st.get("kv_bytes_sent", 0), "kv_bytes_received": st.get("kv_bytes_received", 0),
            "tokens": st.get("tokens", {}), "pacer": st.get("pacer")}


def serving_figures(nodes: dict, plan: dict, outs: list) -> dict[str, Any]:
    """KV shipped per prefilled prompt token, and prompt tokens computed on decode replicas (0)."""
    roles = {s["node"]: r["role"] for r in plan.get("replicas", []) for s in r["stages"]}
    sent = sum(v["kv_bytes_sent"] for k, v in nodes.items() if roles.get(k) == "prefill")
    prefilled = sum(sum(v["tokens"].get(x, 0) for x in ("prefill", "prefill_last")) for k, v in nodes.items()
                    if roles.get(k) == "prefill" and v.get("layers") and v["layers"][0] == 0)
    recomputed = sum(sum(v["tokens"].get(x, 0) for x in ("prefill", "prefill_last")) for k, v in nodes.items()
                     if roles.get(k) == "decode")
    return {"kv_bytes_per_prefilled_token": round(sent / prefilled, 3) if prefilled else None,
            "decode_prompt_tokens_computed": recomputed}


def half_open(layers: Any) -> str:
    """A stage's layer range as the plan means it, `[a, b)`; `-` for a node without layers."""
    return f"[{layers[0]}, {layers[1]})" if isinstance(layers, (list, tuple)) and len(layers) == 2 else "-"


def format_report(r: dict[str, Any]) -> str:
    """Readable `--cluster` output: each prompt's text, then a small metrics table."""
    lines = []
    for i, res in enumerate(r["results"]):
        p = res["prompt"]
        lines.append(f"--- [{i}] {p!r}" if isinstance(p, str) else f"--- [{i}] ({len(p)} synthetic prompt tokens)")
        lines.append(res.get("error") and f"ERROR: {res['error']}" or res["text"].strip())
    m = r["metrics"]
    lines.append("--- metrics")
    rows = [("requests (failed)", f"{m['requests']} ({m['failed']})"),
            ("TTFT mean / p99 (ms)", f"{m['ttft_ms_mean']} / {m['ttft_ms_p99']}"),
            ("ITL mean / p50 / p99 (ms)", f"{m['itl_ms_mean']} / {m['itl_ms_p50']} / {m['itl_ms_p99']}"),
            ("output tokens/s", f"{m['output_tokens_per_s']}"),
            ("queue wait mean (ms)", f"{m['queue_wait_ms_mean']}")]
    if m.get("acceptance_rate") is not None:
        rows.append(("acceptance rate / mean length", f"{m['acceptance_rate']} / {m['mean_acceptance_length']}"))
    rows += [(f"node {k} {','.join(v['roles']) or '-'} layers {half_open(v['layers'])}", f"{v['rss_mb']} MB")
             for k, v in m.get("nodes", {}).items()]
    rows += fault_rows(r.get("faults") or [], m, r.get("faults_not_run") or [])
    width = max(len(a) for a, _ in rows)
    lines += [f"{a:<{width}}  {b}" for a, b in rows]
    return "\n".join(lines)


def fault_rows(faults: list[dict[str, Any]], m: dict[str, Any],
               not_run: list[dict[str, Any]] = ()) -> list[tuple[str, str]]:
    """The report's rows for `--kill` / `--restart` / `--pause` / `--partition` runs: each fault, each
    one the workload ended before (a drill must not look as if it ran), and what the clients saw."""
    rows = []
    for f in faults:
        if f["kind"] in ("kill", "restart"):
            again = " and start again" if f["kind"] == "restart" else ""
            rows.append((f"fault: kill -9 {f['node']}{again}", f"at {f['at_s']} s"))
        else:
            healed = f.get("healed_after_s")
            heal = "" if "healed_after_s" not in f else (
                f", every node in use again {healed} s after" if healed is not None else ", not healed")
            what = f"stop {f['node']}" if f["kind"] == "pause" else f"partition {':'.join(f['zones'])}"
            heal += f", not told {', '.join(sorted(f['not_told']))}" if f.get("not_told") else ""
            rows.append((f"fault: {what}", f"{f['at_s']}-{f['until_s']} s{heal}"))
    for f in not_run:
        rows.append((f"fault not run: {f['kind']} {f.get('node') or ':'.join(f.get('zones', []))}",
                     f"due at {f['at_s']} s; {f['reason']}"))
    if faults:
        rows.append(("resumed requests / recovery gap max (ms)",
                     f"{m.get('resumed_requests', 0)} / {m.get('recovery_gap_ms_max') or '-'}"))
    return rows
