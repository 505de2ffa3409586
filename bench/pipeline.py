"""Serving benchmark: pipeline overhead, batching gain and KV handoff, measured side by side.

Run:  python bench/pipeline.py [--tokens 96] [--repeats 3] [--png bench/results/pipeline.png]
      [--pinning leader|round-robin]

Every mesh here is emulated on this machine (`meshllm.emulate.EmulatedCluster`: one OS process
per node, one thread each, ZeroMQ over loopback), with device profiles far faster than this host
so the Pacer never sleeps, and no zone links (no shaping). Requests go through the gateway's
OpenAI API; times are what the client sees. Printed, in one run:
(a) one request's decode tokens/s through an N-stage pipeline (N = 2, 3) vs the single-process
    reference on one thread (same prompt, same tokens) -- goal >= 0.9x; node processes are pinned
    to this host's CPUs (`pinning`), and a node with a CPU of its own busy-polls (mesh/loop.py);
(b) aggregate output tokens/s of 8 and 32 concurrent requests on one decode replica vs 1 request
    -- goals >= 4x at 8, >= 6x at 32; beside it the host's ceiling (`Reference.batch_ceiling`);
(c) the prefill -> decode KV handoff of a 512-token prompt (from the prefill replica having the
    first token to the decode replica holding all the KV) as a fraction of that prompt's prefill
    time -- goal <= 10%.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mesh_client import node_loads, run_ok  # noqa: E402

from meshllm.config import parse_cluster  # noqa: E402
from meshllm.emulate import EmulatedCluster, http_json  # noqa: E402
from meshllm.workload import Job  # noqa: E402

COUNT_PROMPT = "Count from one to a thousand: 1, 2, 3, 4, 5,"  # keeps going: no early end of sequence
FAST = 1000.0  # TFLOPS / GB/s of the bench profiles: far above this host, so pacing never sleeps


def device(memory_gb: float) -> dict:
    return {"name": f"fast-{memory_gb:g}gb", "memory_gb": memory_gb, "compute_tflops": FAST,
            "memory_bandwidth_gbps": FAST, "network_mbps": 100000, "source": "benchmark profile"}


def cluster(nodes: list[dict]) -> dict:
    return {"model": "smollm2-135m", "weights_dtype": "fp32", "speculation": {"mode": "off"}, "nodes": nodes,
            "workload": {"prompts": [COUNT_PROMPT], "max_tokens": 16,
                         "input_tokens": {"mean": 512, "dist": "fixed"}, "output_tokens": {"mean": 64, "dist": "fixed"}}}


def pipeline_cluster(n: int) -> dict:
    """N small devices that only together hold the model: one N-stage replica."""
    mem = {2: 0.40, 3: 0.26}[n]
    return cluster([{"id": f"s{i}", "device": device(mem), "zone": "lab"} for i in range(n)])


def disagg_cluster() -> dict:
    return cluster([{"id": "pre", "device": device(8), "zone": "lab", "roles": ["prefill", "gateway"]},
                    {"id": "dec", "device": device(8), "zone": "lab", "roles": ["decode"]}])


CPUS = sorted(os.sched_getaffinity(0))  # (a) pins each node process to one of these (pinning)


def pinning(n: int, how: str = "leader") -> list[int]:
    """CPU of each of the N stages' processes: a CPU each while there are enough; with more stages
    than CPUs, "leader": stage 0 (the leader, which also runs the gateway) keeps a CPU of its own
    and the others share the rest, round robin (3 stages on 2 CPUs: measured 0.85x against
    0.78-0.83x with the first and last stage sharing one); "round-robin": stage i on CPU i mod k."""
    if how == "round-robin" or n <= len(CPUS) or len(CPUS) < 2:
        return [CPUS[i % len(CPUS)] for i in range(n)]
    return [CPUS[0]] + [CPUS[1 + i % (len(CPUS) - 1)] for i in range(n - 1)]


class Mesh:
    def __init__(self, doc: dict, cpus: list[int] | None = None):
        self.tmp = tempfile.TemporaryDirectory(prefix="meshllm-bench-")
        self.cfg = parse_cluster(doc, "bench")
        self.em = EmulatedCluster(self.cfg, cpus=cpus)

    def __enter__(self) -> Mesh:
        self.em.__enter__()
        self.em.wait_formed()
        self.em.wait_serving()
        self.url = f"http://{self.em.gateway}"
        return self

    def __exit__(self, *exc) -> None:
        self.em.__exit__(*exc)
        self.tmp.cleanup()

    def plan(self) -> dict:
        return http_json(self.url + "/v1/plan")[1]["plan"]

    def run(self, jobs: list[Job]) -> list:
        return run_ok(self.url, "smollm2-135m", jobs)

    def loads(self) -> dict:
        return node_loads(self.url)


def decode_tok_s(outcome) -> float:
    return 1000.0 / statistics.fmean(outcome.itl_ms)


class Reference:
    """The single-process reference on one thread, in this process: prefill the prompt, then time
    greedy decode steps. Measured alternately with each pipeline run (side by side, so the
    ratio holds on a busy machine)."""

    def __init__(self) -> None:
        import torch

        from meshllm.engine.tokenizer import load_tokenizer
        from meshllm.engine.weights import load_transformer, resolve_model

        torch.set_num_threads(1)
        self.model = load_transformer("smollm2-135m")
        self.ids = load_tokenizer(resolve_model("smollm2-135m")).encode(COUNT_PROMPT)

    def tok_s(self, n_tokens: int) -> float:
        from meshllm.engine.generate import decode_one_token, prefill

        with on_one_core():  # as each pipeline stage is
            cache = self.model.new_cache()
            cache.allocate(0, len(self.ids) + n_tokens + 1)
            t0 = time.perf_counter()
            t = int(prefill(self.model, cache, 0, self.ids).argmax(-1)[0])
            self.prefill_ms = 1000 * (time.perf_counter() - t0)  # the prompt's first token, in-process
            t0 = time.perf_counter()
            for _ in range(n_tokens - 1):
                t = int(decode_one_token(self.model, cache, 0, t).argmax(-1)[0])
            return (n_tokens - 1) / (time.perf_counter() - t0)

    def batch_ceiling(self, ns: tuple[int, ...], n_tokens: int) -> dict[int, float]:
        """The most batching can give on this host: in this process, on one core, `n_tokens` greedy
        decode steps of n sequences in one forward each vs of 1 sequence; returns n x t(1) / t(n)
        per n. The mesh's (b) ratio carries its own overheads on top, so it stays below this."""
        import torch

        from meshllm.engine.generate import prefill
        from meshllm.engine.model import SeqSpan

        def steps_s(n: int) -> float:
            cache = self.model.new_cache()
            toks = []
            for s in range(n):
                cache.allocate(s, len(self.ids) + n_tokens + 1)
                toks.append(int(prefill(self.model, cache, s, self.ids).argmax(-1)[0]))
            t0 = time.perf_counter()
            for _ in range(n_tokens):
                x = self.model(torch.tensor(toks), [SeqSpan(s, cache.length(s), 1) for s in range(n)], cache)
                toks = x.argmax(-1).tolist()
            return time.perf_counter() - t0

        with on_one_core():
            one = statistics.median(steps_s(1) for _ in range(3))
            return {n: n * one / steps_s(n) for n in ns}

    def idle_slowdown(self, bounds: list[tuple[int, int]], wait_s: float, n_tokens: int) -> float:
        """The host's share of the pipeline's loss: the same stage split run in this process, each
        stage's forward right after the previous one vs after an idle wait of `wait_s` (what a
        stage waits for its turn in an N-stage pipeline, (N-1)/N of a token). Returns the ratio of
        the forward time summed over stages, waited / back to back (no messages either way)."""
        import torch

        from meshllm.engine.model import SeqSpan
        from meshllm.engine.weights import load_transformer

        stages = [load_transformer("smollm2-135m", a, b) for a, b in bounds]
        busy = []
        with on_one_core():
            for wait in (0.0, wait_s, 0.0, wait_s):
                caches = [m.new_cache() for m in stages]
                x = torch.tensor(self.ids)
                for m, c in zip(stages, caches):
                    c.allocate(0, len(self.ids) + n_tokens + 1)
                    x = m(x, [SeqSpan(0, 0, len(self.ids))], c)
                t, spent = int(x[-1].argmax()), 0.0
                for _ in range(n_tokens - 1):
                    x = torch.tensor([t])
                    for m, c in zip(stages, caches):
                        if wait:
                            time.sleep(wait)
                        t0 = time.perf_counter()
                        x = m(x, [SeqSpan(0, c.length(0), 1)], c)
                        spent += time.perf_counter() - t0
                    t = int(x.argmax(-1)[0])
                busy.append(spent)
        return (busy[1] + busy[3]) / (busy[0] + busy[2])


@contextlib.contextmanager
def on_one_core() -> Iterator[None]:
    """Run this process on CPUS[0] only, then restore its affinity."""
    mask = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {CPUS[0]})
    try:
        yield
    finally:
        os.sched_setaffinity(0, mask)


def bench_pipeline(n: int, tokens: int, repeats: int, ref: Reference, pin: str = "leader") -> dict:
    with Mesh(pipeline_cluster(n), cpus=pinning(n, pin)) as m:
        replicas = m.plan()["replicas"]
        assert [len(r["stages"]) for r in replicas] == [n], f"expected one {n}-stage replica, got {replicas}"
        polling = sum(m.em.own_cpu(i) for i in range(n))
        m.run([Job(COUNT_PROMPT, 8)])  # warm-up
        pairs, ttft = [], []
        for _ in range(repeats):
            r = ref.tok_s(tokens)
            out = m.run([Job(COUNT_PROMPT, tokens)])[0]
            pairs.append((r, decode_tok_s(out)))
            ttft.append((ref.prefill_ms, out.ttft_ms))
    ref_tok_s = statistics.median(r for r, _ in pairs)
    bounds = [tuple(st["layers"]) for st in replicas[0]["stages"]]
    return {"stages": n, "busy_polling": polling, "reference_tok_s": ref_tok_s,
            "tok_s": statistics.median(p for _, p in pairs),
            "ratio": statistics.median(p / r for r, p in pairs),
            "ttft_ms": statistics.median(t for _, t in ttft), "reference_prefill_ms": statistics.median(r for r, _ in ttft),
            "idle_slowdown": ref.idle_slowdown(bounds, (n - 1) / n / ref_tok_s, tokens)}


def bench_batching(m: Mesh, tokens: int) -> dict:
    out = {}
    for n in (1, 8, 32):
        prompts = [f"{COUNT_PROMPT} {i}" for i in range(n)]
        outs = m.run([Job(p, tokens) for p in prompts])
        span = max(o.done for o in outs) - min(o.sent for o in outs)
        out[n] = sum(len(o.token_ids) for o in outs) / span
    return out


def bench_handoff(m: Mesh, repeats: int) -> list[tuple[float, float]]:
    long_prompt = " ".join(f"item {i}," for i in range(170))  # ~512 tokens
    seen = len(m.loads()["dec"]["leader"]["handoffs"])
    for _ in range(repeats):
        m.run([Job(long_prompt, 2)])
    time.sleep(1.5)  # heartbeats carry the decode leader's figures
    return m.loads()["dec"]["leader"]["handoffs"][seen:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--png", default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--pinning", choices=("leader", "round-robin"), default="leader",
                    help="(a) with more stages than CPUs: which stages share one (see `pinning`)")
    a = ap.parse_args()
    ref = Reference()
    pipes = [bench_pipeline(n, a.tokens, a.repeats, ref, a.pinning) for n in (2, 3)]
    with Mesh(disagg_cluster()) as m:
        batching = bench_batching(m, 64)
        handoffs = bench_handoff(m, a.repeats)
    res = {"pipelines": pipes, "batching_tok_s": batching, "batch_ceiling": ref.batch_ceiling((8, 32), 64),
           "handoffs_ms": handoffs}
    report(res)
    if a.png:
        plot(res, a.png)
    if a.json:
        print(json.dumps(res))


def report(r: dict) -> None:
    print("(a) one request, decode tokens/s through an N-stage pipeline vs the single-process reference "
          "on 1 thread (alternating runs; median ratio)")
    for p in r["pipelines"]:
        ratio = p["ratio"]
        print(f"    {p['stages']}-stage pipeline: medians {p['tok_s']:.1f} vs {p['reference_tok_s']:.1f} tok/s; "
              f"median of the runs' pairwise ratios {ratio:.3f}x  "
              f"(goal >= 0.9x: {'met' if ratio >= 0.9 else 'NOT met'}; {p.get('busy_polling', 0)} of its "
              f"{p['stages']} stages busy-poll: those with a CPU of their own of the {len(CPUS)} here)")
        if "ttft_ms" in p:
            print(f"      its TTFT p50 {p['ttft_ms']:.1f} ms through the gateway, against the reference's in-process "
                  f"prefill of the same prompt {p['reference_prefill_ms']:.1f} ms")
    for p in r["pipelines"]:
        if "idle_slowdown" in p:
            k = p["idle_slowdown"]
            print(f"    host: in one process, {p['stages']} stage forwards each after sleeping the idle wait a "
                  f"pipeline stage has ({p['stages'] - 1}/{p['stages']} of a token) take {k:.3f}x as long as back "
                  f"to back: a {p['stages']}-stage pipeline whose stages sleep while they wait cannot beat "
                  f"{1 / k:.3f}x on this host, however cheap its hops")
    b = r["batching_tok_s"]
    print(f"(b) one decode replica, aggregate output tokens/s: 1 req {b[1]:.1f}")
    for n, goal in ((8, 4), (32, 6)):
        ratio = b[n] / b[1]
        print(f"    {n} concurrent: {b[n]:.1f} tok/s = {ratio:.2f}x  (goal >= {goal}x: "
              f"{'met' if ratio >= goal else 'NOT met'})")
    for n, k in r.get("batch_ceiling", {}).items():
        print(f"    host: in one process, one forward of {n} sequences does the work of {k:.2f} forwards of 1 "
              f"(64 decode steps each): batching {n} requests cannot beat {k:.2f}x on this host")
    h = r["handoffs_ms"]
    if h:
        fr = statistics.median(x[1] / x[0] for x in h)
        print(f"(c) 512-token prompt: prefill {statistics.median(x[0] for x in h):.1f} ms, KV handoff "
              f"{statistics.median(x[1] for x in h):.1f} ms = {100 * fr:.1f}% of the prefill  (goal <= 10%: "
              f"{'met' if fr <= 0.10 else 'NOT met'})")


def plot(r: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    b, h = r["batching_tok_s"], r["handoffs_ms"]
    labels = [f"{p['stages']}-stage\nvs 1 process" for p in r["pipelines"]] + ["8 concurrent\nvs 1", "32 concurrent\nvs 1"]
    vals = [p["ratio"] for p in r["pipelines"]] + [b[8] / b[1], b[32] / b[1]]
    goals = [0.9, 0.9, 4, 6]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [3, 1]})
    ax1.bar(labels, vals, color=["#2a9d8f" if v >= g else "#e76f51" for v, g in zip(vals, goals)])
    ax1.scatter(labels, goals, marker="_", s=900, color="black", label="goal", zorder=3)
    ax1.set_ylabel("ratio, measured side by side")
    ax1.set_title("decode throughput")
    ax1.legend()
    if h:
        fr = 100 * statistics.median(x[1] / x[0] for x in h)
        ax2.bar(["KV handoff"], [fr], color="#2a9d8f" if fr <= 10 else "#e76f51")
        ax2.axhline(10, color="black", lw=1, label="goal")
        ax2.set_ylabel("% of the 512-token prefill")
        ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
