"""What a run reports (the README's metric definitions), and the cluster's physical bound.

Per run: mean / p99 waiting time, mean prefill wait, TTFT mean / p50 / p99, ITL p50 / p99 (over
every gap between two tokens of every request, as `vllm bench serve` reports it), end-to-end
latency mean / p50 / p99, output tokens/s. Percentiles are nearest-rank.

`bound_rate_per_s`: the arrival rate at which every stage-capable device would be 100% busy on
useful FLOPs (cost.request_flops, averaged over the trace), at the achieved compute of
cost.py. A device that cannot hold the whole model must pass activations to a neighbour for
every token it works on, so its port at line rate caps it too: at most port bytes/s /
activation bytes token-passes per second, each through at most as many layers as it holds.
Memory bandwidth caps it too, in the roofline of cost.py: a decode step streams the weights
of its layers and the KV of its batch, so a device does decode FLOPs at most at its best
step's rate (`decode_flops_cap`: over the layer counts n it can hold, the largest batch whose
KV fits beside n layers, at most the planner's MAX_DECODE_BATCH). A step that is memory-bound
leaves compute idle, which chunked prefill fills, so the two phases overlap on a device: the
rate is bounded by all the FLOPs at the devices' compute, and separately by the decode FLOPs
at those decode caps (`decode_memory_rate_per_s`), not by a time-share of the two (one that
split each device's time between the phases came out at 636 req/s on mesh-six, where
meshllm's simulated saturation is 871-889 req/s). A step may hold the LM head (its weights
read, its FLOPs done for each sequence), and a request's decode FLOPs count the head's of each
decode token: counted per request against steps that left the head out, they put the bound
7 % below the decode step the simulator costs on a llama-3-8b device where decode memory
binds; both left out, the bound put SmolLM2's NUC 26 % above its full step (the head is a fifth
of a SmolLM2 token's FLOPs). A node's `roles:` are the cluster's too, and no
policy may break them (`device_caps`): a device kept to decode counts at most at its best decode
step, and its layers' FLOPs at most as fast as its port brings in their KV; one kept to prefill
decodes nothing, and its layers' FLOPs go at most as fast as its port ships their KV out (a
layer's FLOPs and KV go together on any share of the layers; the LM head's ship no KV: a cap of
the whole request's FLOPs per byte put the bound 14 % below a pipeline whose last stage, on a
slow port, held few layers and the head); and the devices that may prefill bound the rate by
the prompts' FLOPs (`prefill_rate_per_s`, which
binds only where roles keep most compute from prompts). On every cluster in clusters/ without
such roles the decode-memory rate is 1.4-4.9x the FLOPs one, so the FLOPs bound binds; on
demo.yaml, whose stage nodes are kept to one phase each, the decode-only devices' steps bind
(42 req/s, against 451 for all FLOPs), on failure.yaml the prompts' FLOPs and the
prefill-only Jetson's port (583 req/s, against 1393). Every relaxation is on the bound's side
(the KV of a sequence at its mean decode context, no embedding weights, the LM head in a step
of any layer count, no pipeline bubbles, links, or KV shipping but where roles force it, each
port's two directions at line rate for it alone). No plan can beat it; each policy's
saturation is reported as a fraction of it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from meshllm.partition.cost import flops_per_s, prefill_work, request_flops, roofline
from meshllm.partition.dp import memory_cap_layers
from meshllm.partition.inputs import PlanInputs
from meshllm.partition.replica import MAX_DECODE_BATCH
from meshllm.sim.simulator import Request


def nearest_rank(xs: Sequence[float], q: float) -> float:
    """q-quantile of sorted `xs`, nearest rank."""
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def weighted_quantiles(pairs: list[tuple[float, int]], qs: Sequence[float]) -> list[float]:
    """Quantiles of values given as (value, count) pairs."""
    if not pairs:
        return [math.nan for _ in qs]
    pairs.sort()
    total = sum(c for _, c in pairs)
    out, acc, j = [], 0, 0
    for q in qs:
        rank = max(1, math.ceil(q * total))
        while acc + pairs[j][1] < rank:
            acc += pairs[j][1]
            j += 1
        out.append(pairs[j][0])
    return out


def ms(x: float) -> float:
    return round(1000 * x, 3)


def metrics(reqs: Sequence[Request]) -> dict:
    waits = sorted(r.wait_s for r in reqs)
    ttft = sorted(r.first_token - r.arrival for r in reqs)
    e2e = sorted(r.done - r.arrival for r in reqs)
    itl50, itl99 = weighted_quantiles([g for r in reqs for g in r.gaps], (0.5, 0.99))
    span = max(r.done for r in reqs) - min(r.arrival for r in reqs)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {
        "mean_wait_ms": ms(mean(waits)), "p99_wait_ms": ms(nearest_rank(waits, 0.99)),
        "mean_prefill_wait_ms": ms(mean([r.prefill_start - r.arrival for r in reqs])),
        "mean_ttft_ms": ms(mean(ttft)), "ttft_p50_ms": ms(nearest_rank(ttft, 0.5)),
        "ttft_p99_ms": ms(nearest_rank(ttft, 0.99)),
        "itl_p50_ms": None if math.isnan(itl50) else ms(itl50), "itl_p99_ms": None if math.isnan(itl99) else ms(itl99),
        "mean_e2e_ms": ms(mean(e2e)), "e2e_p50_ms": ms(nearest_rank(e2e, 0.5)), "e2e_p99_ms": ms(nearest_rank(e2e, 0.99)),
        "throughput_tok_s": round(sum(r.n_out for r in reqs) / span, 3) if span > 0 else None,
    }


def device_flops_cap(inp: PlanInputs, i: int, ctx: float) -> float:
    """Useful FLOP/s device i can do at most: its compute, or what its port lets through."""
    m = inp.members[i]
    cap = flops_per_s(m.device)
    mc = inp.mc
    held = memory_cap_layers(mc, m.device, False, False, 0.0)
    if held >= mc.n_layers:
        return cap
    passes = m.device.network_mbps * 1e6 / 8 / mc.act_bytes_per_token  # token-passes/s per direction
    return min(cap, passes * held * (mc.layer_flops_per_token + mc.attn_flops_per_token_ctx * ctx))


def decode_flops_cap(inp: PlanInputs, i: int, ctx: float) -> float:
    """Decode FLOP/s device i can do at most: its best decode step (module docstring), every
    sequence at `ctx` tokens of context; a step may hold the LM head too (the last stage's),
    whose weights it reads and whose FLOPs it does once per sequence."""
    mc, dev = inp.mc, inp.members[i].device
    per_token = mc.layer_flops_per_token + mc.attn_flops_per_token_ctx * ctx
    best = 0.0
    for n in range(1, min(mc.n_layers, memory_cap_layers(mc, dev, False, False, 0.0)) + 1):
        for head in (0, 1):
            batch = min(MAX_DECODE_BATCH, math.floor((dev.memory_bytes - n * mc.layer_bytes - head * mc.head_bytes)
                                                     / (n * ctx * mc.kv_bytes_per_token)))
            if batch < 1:
                continue
            flops = batch * (n * per_token + head * mc.head_flops_per_token)
            nbytes = n * (mc.layer_bytes + batch * ctx * mc.kv_bytes_per_token) + head * mc.head_bytes
            best = max(best, flops / float(roofline(flops, nbytes, dev)))
    return best


def phases(inp: PlanInputs) -> list[tuple[bool, bool]]:
    """Per member: whether its `roles:` let it prefill, and decode (a mixed replica does both)."""
    return [(f != "decode", f != "prefill") for f in inp.forced]


def per_request(inp: PlanInputs, lengths: Sequence[tuple[int, int]]) -> dict[str, float]:
    """Mean FLOPs of a request of `lengths`: all of them (`total`), its prefill's (`pre`: the
    prompt and the first token's LM head; `pre_layers` without the head), its decode steps'
    (`dec`: the layers' and the LM head's of each decode token, as decode_flops_cap's steps may
    hold the head -- counted with steps that left the head's weights out, they put the bound
    below a step the roofline costs, 7 % on llama-3-8b, tests/test_sim.py; `dec_layers` without
    the head); and the bytes of KV of all its layers that a prefill replica ships to a decode one
    (`kv`; none when the first token ends it)."""
    mc, n = inp.mc, len(lengths)
    total = sum(request_flops(mc, n_in, n_out) for n_in, n_out in lengths) / n
    pre = sum(prefill_work(mc, mc.n_layers, n_in, True)[0] for n_in, _ in lengths) / n
    heads = sum(max(0, n_out - 1) for _, n_out in lengths) / n * mc.head_flops_per_token
    kv = sum(n_in * mc.n_layers * mc.kv_bytes_per_token for n_in, n_out in lengths if n_out > 1) / n
    return {"total": total, "pre": pre, "pre_layers": pre - mc.head_flops_per_token, "dec": total - pre,
            "dec_layers": total - pre - heads, "kv": kv}


def device_caps(inp: PlanInputs, lengths: Sequence[tuple[int, int]]) -> list[dict[str, float]]:
    """Per member, the FLOP/s it can do at most: `all` (useful FLOPs), `pre` (prefill FLOPs) and
    `pre_layers` (the prompts' layers', LM head left out), `dec` (decode FLOPs) and `dec_layers`.
    A device free to run both phases: its compute (or port) for all and for prompts, its best
    decode step for decode. One that its `roles:` keep to prefill decodes nothing, and the KV of
    the layers it prefills leaves through its port (no decode replica holds them); one kept to
    decode prefills nothing, decodes at most at its best step, and the KV of the layers it
    decodes came in through its port (full duplex: each direction at line rate). A layer's
    FLOPs and its KV go together, whatever share of the layers a device holds; the LM head's
    FLOPs ship no KV, so the port caps the layers' FLOPs only."""
    ctx = inp.mix.decode_ctx
    per = per_request(inp, lengths)
    out = []
    for i, (may_pre, may_dec) in enumerate(phases(inp)):
        cap = device_flops_cap(inp, i, ctx)
        port = inp.members[i].device.network_mbps * 1e6 / 8  # bytes/s each way
        kv_s = port / per["kv"] if per["kv"] > 0 else math.inf  # requests' KV per second through it
        if not may_dec:
            out.append({"all": cap, "pre": cap, "pre_layers": min(cap, kv_s * per["pre_layers"]),
                        "dec": 0.0, "dec_layers": 0.0})
        elif not may_pre:
            d = min(cap, decode_flops_cap(inp, i, ctx))
            out.append({"all": d, "pre": 0.0, "pre_layers": 0.0, "dec": d,
                        "dec_layers": min(d, kv_s * per["dec_layers"])})
        else:
            d = decode_flops_cap(inp, i, ctx)
            out.append({"all": cap, "pre": cap, "pre_layers": cap, "dec": d, "dec_layers": d})
    return out


def rate_of(caps: list[dict[str, float]], per: dict[str, float], *kinds: str) -> float:
    """Requests/s the devices' `kinds` of FLOP/s allow, the lowest over `kinds`."""
    return min(sum(c[k] for c in caps) / per[k] if per[k] > 0 else math.inf for k in kinds)


def flops_rate_per_s(inp: PlanInputs, lengths: Sequence[tuple[int, int]]) -> float:
    """Requests/s at which every stage-capable device is busy at its compute (or port), each in
    the phases its `roles:` allow (device_caps)."""
    caps, per = device_caps(inp, lengths), per_request(inp, lengths)
    return sum(c["all"] for c in caps) / per["total"]


def prefill_rate_per_s(inp: PlanInputs, lengths: Sequence[tuple[int, int]]) -> float:
    """Requests/s at which every device that its `roles:` let prefill is busy prefilling at its
    compute (or, for its layers' FLOPs, its port): binds only where roles keep most devices
    from prompts."""
    return rate_of(device_caps(inp, lengths), per_request(inp, lengths), "pre", "pre_layers")


def decode_memory_rate_per_s(inp: PlanInputs, lengths: Sequence[tuple[int, int]]) -> float:
    """Requests/s at which every device that its `roles:` let decode decodes at its best step
    (or, for its layers' FLOPs, at its port's rate)."""
    return rate_of(device_caps(inp, lengths), per_request(inp, lengths), "dec", "dec_layers")


def bound_rate_per_s(inp: PlanInputs, lengths: Sequence[tuple[int, int]]) -> float:
    """Requests/s at which every stage-capable device is busy on useful FLOPs at its roofline
    (module docstring)."""
    if not inp.members or not lengths:
        return 0.0
    return min(flops_rate_per_s(inp, lengths), decode_memory_rate_per_s(inp, lengths), prefill_rate_per_s(inp, lengths))
