"""A long prompt and a short one on the demo mesh: is the long one served, does the short one wait?

Run:  python bench/long_prompt.py [--tokens 4000 8186] [--after 3] [--out bench/results]

For each prompt length N: start `launch.py --cluster clusters/demo.yaml --serve`, send a prompt of
N tokens ("hello " x (N - 1) + BOS; max_tokens 1, speculation off), and AFTER seconds later a
1-token prompt ("Hi", max_tokens 4); print each request's HTTP status and seconds. Two things it
shows: a prompt that prefills for longer than the gateway's 60 s no-token timeout is served (the
leader's keepalives, roles/leader.py), and a short prompt is not queued behind the long one's
whole prefill (the replica's prompt aging, sim/router.prompt_aging). Appends to
OUT/long_prompt.txt. About 2 min for 4000 tokens and 3 min for 8186 on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m"


def post(url: str, body: dict, out: dict, name: str) -> None:
    t0 = time.monotonic()
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=900) as r:
            usage = json.loads(r.read())["usage"]
            out[name] = (r.status, time.monotonic() - t0, usage["prompt_tokens"])
    except urllib.error.HTTPError as e:
        out[name] = (e.code, time.monotonic() - t0, json.loads(e.read() or b"{}").get("error", {}).get("message"))


def run(n_tokens: int, after_s: float, log_path: Path) -> dict:
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "launch.py", "--cluster", "clusters/demo.yaml", "--serve"], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    try:
        deadline, url = time.monotonic() + 600, None
        while url is None:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"the demo did not serve:\n{log_path.read_text(errors='replace')[-2000:]}")
            m = re.search(r"serving on (http://\S+)", log_path.read_text(errors="replace"))
            url = m.group(1) if m else None
            time.sleep(0.5)
        out: dict = {}
        long = threading.Thread(target=post, args=(url, {"model": MODEL, "prompt": "hello " * (n_tokens - 1),
                                                         "max_tokens": 1, "temperature": 0,
                                                         "meshllm": {"speculation": "off"}}, out, "long"))
        long.start()
        time.sleep(after_s)
        post(url, {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "temperature": 0}, out, "short")
        long.join()
        return out
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4000, 8186])
    ap.add_argument("--after", type=float, default=3.0, help="seconds between the long and the short request")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    lines = [f"# python bench/long_prompt.py --tokens {' '.join(map(str, a.tokens))} --after {a.after:g}   "
             f"(at {commit}; demo mesh, 2-core host)"]
    with tempfile.TemporaryDirectory() as tmp:
        for n in a.tokens:
            got = run(n, a.after, Path(tmp) / f"serve-{n}.log")
            for name in ("long", "short"):
                status, took, what = got[name]
                lines.append(f"prompt of {n} tokens: {name:5s} request  HTTP {status}  {took:6.1f} s  "
                             f"{'prompt tokens ' + str(what) if status == 200 else what}")
                print(lines[-1], flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "long_prompt.txt", "a") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
