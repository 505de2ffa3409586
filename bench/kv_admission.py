"""KV admission: how much KV a small device holds under a burst of long requests, against the
memory its profile leaves beside its weights.

Run:  python bench/kv_admission.py [--requests 8] [--max-tokens 160] [--prefill-gb 0.40] [--decode-gb 0.34]
                                  [--gateways 1] [--gap 0] [--compare OTHER_CHECKOUT] [--out FILE]

The mesh of the serving tests' `pipes` fixture (`--cluster ... --serve`), with a little more memory
and planned for the burst's lengths (its workload: the prompts' length in, max_tokens out): a
2-stage prefill replica of 0.40 GB nodes and a 3-stage decode replica of 0.34 GB nodes
(SmolLM2-135M, fp32), whose stages keep room for the KV of about three of the burst's requests. A burst of
`--requests` concurrent completions, each a 392-token prompt with up to `--max-tokens` greedy
tokens. Every 0.1 s the script reads `/v1/mesh` (each node's
`kv_cache_bytes`, from its heartbeat) and keeps each node's peak. Printed per node: its device's
memory less the weights it loaded (what its profile leaves for KV), the peak KV it held, and
their ratio (above 1: the device, were it real, would have run out of memory); then the burst's
wall time and whether every output equals the single-process reference. `--compare` runs the
same burst on another checkout (e.g. a worktree of the commit before KV admission) in the same
sitting. The heartbeats are ~0.5 s apart, so a peak between two of them can be missed: the ratios
are lower bounds. `--gateways 2` serves the API on two nodes (a1's and b1's) and sends the
requests to them in turn, `--gap S` S seconds apart (0: all at once): two gateways that each count
only their own requests let more KV onto the decode stages than one.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from meshllm.engine.generate import GenerationOptions, generate  # noqa: E402
from meshllm.engine.tokenizer import load_tokenizer  # noqa: E402
from meshllm.engine.weights import load_transformer, resolve_model  # noqa: E402

STORY = ("The history of the city begins with a small fishing village on the northern bank of the river. "
         "Over the centuries merchants, monks and soldiers came and went, each leaving roads, walls and "
         "stories behind. ") * 9


def device(name: str, gb: float) -> dict:
    return {"name": name, "memory_gb": gb, "compute_tflops": 1.0, "memory_bandwidth_gbps": 60.0,
            "network_mbps": 1000, "source": "bench profile: the serving tests' pipes fixture"}


def cluster(path: Path, gb: dict[str, float], n_in: int, n_out: int, gateways: int = 1) -> Path:
    """The mesh, planned for this burst's lengths (the planner keeps KV room for a few such requests);
    with 2 gateways, on a1 and b1 (with 1, the emulator's default: a1)."""
    gw = {"a1", "b1"} if gateways == 2 else set()
    nodes = [{"id": f"a{i}", "device": device("half", gb["a"]), "zone": "fog",
              "roles": ["prefill"] + ["gateway"] * (f"a{i}" in gw)} for i in (1, 2)]
    nodes += [{"id": f"b{i}", "device": device("third", gb["b"]), "zone": "fog",
               "roles": ["decode"] + ["gateway"] * (f"b{i}" in gw)} for i in (1, 2, 3)]
    doc = {"model": "smollm2-135m", "weights_dtype": "fp32", "speculation": {"mode": "off"}, "nodes": nodes,
           "links": [{"zones": ["fog", "fog"], "rtt_ms": 1, "bandwidth_mbps": 1000}],
           "workload": {"prompts": ["x"], "max_tokens": 16, "temperature": 0,
                        "input_tokens": {"mean": n_in, "dist": "fixed"},
                        "output_tokens": {"mean": n_out, "dist": "fixed"}}}
    path.write_text(yaml.safe_dump(doc))
    return path


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def mesh(url: str) -> dict:
    with urllib.request.urlopen(url + "/v1/mesh", timeout=10) as r:
        return {k: v["load"] for k, v in json.loads(r.read())["nodes"].items()}


def burst(repo: Path, prompts: list[str], n_in: int, max_tokens: int, work: Path, gb: dict[str, float],
          gateways: int = 1, gap_s: float = 0.0) -> dict:
    """Serve the mesh from `repo`, send the burst, and return the peaks and outputs."""
    log = work / f"serve-{repo.name}.log"
    path = cluster(work / "pipes.yaml", gb, n_in, max_tokens, gateways)
    proc = subprocess.Popen([sys.executable, str(repo / "launch.py"), "--cluster", str(path), "--serve"], cwd=repo,
                            stdout=subprocess.DEVNULL, stderr=open(log, "wb"), start_new_session=True)
    try:
        deadline, url = time.monotonic() + 300, None
        while url is None and time.monotonic() < deadline:
            m = re.search(r"meshllm: serving on (http://\S+)", log.read_text(errors="replace"))
            url = m.group(1) if m else None
            if proc.poll() is not None:
                raise RuntimeError(f"--serve exited {proc.returncode}:\n{log.read_text()[-2000:]}")
            time.sleep(0.3)
        if url is None:
            raise RuntimeError("no serving line in 300 s")
        urls = [url] + re.findall(r"meshllm: another gateway on (http://\S+)", log.read_text(errors="replace"))
        if len(urls) != gateways:
            raise RuntimeError(f"{len(urls)} gateways, not {gateways}: {urls}")
        loads = mesh(url)
        weights = {n: ld["stage"]["weights_mb"] * 1e6 for n, ld in loads.items() if "stage" in ld}
        peak = dict.fromkeys(weights, 0)
        t0 = time.monotonic()
        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            futs = []
            for i, p in enumerate(prompts):
                futs.append(pool.submit(post, urls[i % len(urls)], {"model": "smollm2-135m", "prompt": p,
                                                                    "max_tokens": max_tokens, "temperature": 0}))
                if gap_s and i + 1 < len(prompts):
                    time.sleep(gap_s)
                    for n, ld in mesh(url).items():
                        if n in peak:
                            peak[n] = max(peak[n], ld["stage"]["kv_cache_bytes"])
            while not all(f.done() for f in futs) and time.monotonic() - t0 < 900:
                for n, ld in mesh(url).items():
                    if n in peak:
                        peak[n] = max(peak[n], ld["stage"]["kv_cache_bytes"])
                time.sleep(0.1)
            outs = [f.result(timeout=60)["choices"][0]["token_ids"] for f in futs]
        wall = time.monotonic() - t0
        leaders = {n: ld["leader"] for n, ld in mesh(url).items() if "leader" in ld}
        return {"weights": weights, "peak": peak, "wall_s": wall, "outs": outs, "leaders": leaders}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def report(name: str, r: dict, refs: list[list[int]], gb: dict[str, float]) -> list[str]:
    lines = [f"## {name}: {len(refs)} requests, {sum(map(len, r['outs']))} tokens in {r['wall_s']:.1f} s; "
             f"outputs equal the reference: "
             f"{all(o == ref for o, ref in zip(r['outs'], refs))}",
             f"{'node':<6}{'memory MB':>10}{'weights MB':>11}{'left MB':>9}{'KV peak MB':>11}{'peak/left':>10}"]
    for n in sorted(r["peak"]):
        mem = gb[n[0]] * 1e9
        left = mem - r["weights"][n]
        lines.append(f"{n:<6}{mem / 1e6:>10.0f}{r['weights'][n] / 1e6:>11.1f}{left / 1e6:>9.1f}"
                     f"{r['peak'][n] / 1e6:>11.1f}{r['peak'][n] / left:>10.2f}")
    for n, lead in sorted(r["leaders"].items()):
        if "kv_room" in lead:
            lines.append(f"leader {n}: KV room {lead['kv_room']} positions, peak reserved {lead['kv_peak']}, "
                         f"{lead['kv_waits']} sequences waited for room"
                         + (f", {lead['kv_denied']} reservations refused" if "kv_denied" in lead else ""))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--prefill-gb", type=float, default=0.40, help="memory of the two prefill nodes")
    ap.add_argument("--decode-gb", type=float, default=0.34, help="memory of the three decode nodes")
    ap.add_argument("--gateways", type=int, default=1, choices=(1, 2), help="gateways the requests go to in turn")
    ap.add_argument("--gap", type=float, default=0.0, help="seconds between two requests (0: all at once)")
    ap.add_argument("--compare", type=Path, help="another checkout to run the same burst on")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if not 1 <= a.requests <= 32 or not 1 <= a.max_tokens <= 1000 or not 0 < a.prefill_gb <= 64 \
            or not 0 < a.decode_gb <= 64 or not 0 <= a.gap <= 60:
        ap.error("--requests must be in [1, 32], --max-tokens in [1, 1000], the memories in (0, 64] GB, "
                 "--gap in [0, 60] s")
    gb = {"a": a.prefill_gb, "b": a.decode_gb}
    prompts = [STORY.replace("river", f"river number {i}") + "Summarize this history:" for i in range(a.requests)]
    model, tok = load_transformer(resolve_model("smollm2-135m")), load_tokenizer(resolve_model("smollm2-135m"))
    refs = [generate(model, tok.encode(p), GenerationOptions(a.max_tokens, 0.0), tok.eos_ids).token_ids
            for p in prompts]
    lines = [f"# python bench/kv_admission.py --requests {a.requests} --max-tokens {a.max_tokens} "
             f"--prefill-gb {a.prefill_gb} --decode-gb {a.decode_gb} --gateways {a.gateways} --gap {a.gap:g}"
             + (f" --compare {a.compare}" if a.compare else ""),
             f"prompts of {min(len(tok.encode(p)) for p in prompts)}-{max(len(tok.encode(p)) for p in prompts)} tokens"]
    with tempfile.TemporaryDirectory() as tmp:
        for repo in [ROOT] + ([a.compare.resolve()] if a.compare else []):
            n_in = len(tok.encode(prompts[0]))
            lines += report(str(repo), burst(repo, prompts, n_in, a.max_tokens, Path(tmp), gb, a.gateways, a.gap),
                            refs, gb)
            print("\n".join(lines[-12:]), flush=True)
    if a.out:
        a.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
