"""A real deployment on loopback: nodes started one by one with `--node-config` (seeds), one of
them running the gateway (`gateway: {listen: ..., max_concurrent: 2}`: a third request at once is
a 429); the coordinator plans after membership settles. Then a node is killed mid-generation: the mesh re-plans, the requests in flight finish
(resumed where needed) with the reference's tokens, and the next one is served. Last, the gateway
node is stopped mid-stream (`drain_s: 1`): the stream ends with a "shutting_down" error."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from meshllm.mesh.sockets import free_port_pair
from tests.conftest import REPO, spawn, stop_processes
from tests.serving_util import reference, same_up_to_tie

pytestmark = pytest.mark.slow

DEVICE = {"name": "box", "memory_gb": 8, "compute_tflops": 1, "memory_bandwidth_gbps": 60, "network_mbps": 1000}


def start(tmp: Path, nid: str, seeds: list[str], **extra) -> tuple[subprocess.Popen, str]:
    address = f"127.0.0.1:{free_port_pair()}"
    cfg = {"id": nid, "device": DEVICE, "zone": "lan", "listen": address, "seeds": seeds, "mdns": False,
           "model": "smollm2-135m", "speculation": {"mode": "off"}, "plan_settle_s": 1.0, **extra}
    (tmp / f"{nid}.yaml").write_text(yaml.safe_dump(cfg))
    proc = spawn([sys.executable, str(REPO / "launch.py"), "--node-config", str(tmp / f"{nid}.yaml")],
                 cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(tmp / f"{nid}.log", "wb"),
                 env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
                 start_new_session=True)
    return proc, address


def wait_healthy(url: str, timeout_s: float = 240) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                return json.loads(r.read())
        except (OSError, ValueError):
            time.sleep(0.5)
    raise AssertionError(f"{url} never became healthy")


def complete(url: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_separately_started_nodes_serve_and_a_replan_fails_in_flight_requests_clearly(tmp_path, smollm2,
                                                                                     smollm2_tokenizer):
    gw = f"127.0.0.1:{free_port_pair()}"
    procs = {}
    try:
        procs["n1"], seed = start(tmp_path, "n1", [], gateway={"listen": gw, "max_concurrent": 2,
                                                                            "drain_s": 1})
        procs["n2"], _ = start(tmp_path, "n2", [seed])
        procs["n3"], _ = start(tmp_path, "n3", [seed])
        log = tmp_path / "n1.log"
        deadline = time.monotonic() + 60
        while not re.search(r"gateway serving the OpenAI API on http://\S+", log.read_text(errors="replace")):
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        url = f"http://{gw}"
        wait_healthy(url)
        from tests.conftest import run_cli

        r = run_cli("--status", seed, "--json", timeout=60)  # the gateway is one of the node's roles
        st = json.loads(r.stdout)
        assert "gateway" in st["roles"] and st["load"]["gateway"] == {"listen": gw, "in_flight": 0,
                                                                     "max_concurrent": 2, "kv_claims": [],
                                                                     "plan_version": st["plan_version"]}, st
        body = {"model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 10, "temperature": 0}
        code, res = complete(url, body)
        assert code == 200, res
        assert same_up_to_tie(res["choices"][0]["token_ids"],
                              reference(smollm2, smollm2_tokenizer, body["prompt"], 10))[0]
        v1 = wait_healthy(url)["plan_version"]

        # requests in flight, then a node dies: the mesh re-plans and every request completes, each
        # exactly as the reference (those on the dead node's replica resume from their tokens)
        long_prompt, n_long = "Count from one to a thousand: 1, 2, 3,", 120
        long_body = {**body, "prompt": long_prompt, "max_tokens": n_long}
        import concurrent.futures as cf

        with cf.ThreadPoolExecutor(2) as pool:
            futs = [pool.submit(complete, url, long_body, 300) for _ in range(2)]
            time.sleep(2)
            code, res = complete(url, body)  # a third beside them: over the gateway's max_concurrent
            assert code == 429 and res["error"]["code"] == "overloaded", res
            os.killpg(procs["n3"].pid, signal.SIGKILL)
            results = [f.result(timeout=300) for f in futs]
        want = reference(smollm2, smollm2_tokenizer, long_prompt, n_long)
        for code, res in results:
            assert code == 200, res
            assert same_up_to_tie(res["choices"][0]["token_ids"], want)[0]
        deadline = time.monotonic() + 120
        while wait_healthy(url)["plan_version"] == v1 or wait_healthy(url)["status"] != "ok":
            assert time.monotonic() < deadline
            time.sleep(0.5)
        code, res = complete(url, body)
        assert code == 200 and same_up_to_tie(res["choices"][0]["token_ids"],
                                              reference(smollm2, smollm2_tokenizer, body["prompt"], 10))[0]
        # four at once through the workload client (`--cluster`'s): the two over the limit wait as the
        # 429's Retry-After says and go again; none fails
        from meshllm.workload import Job, run_jobs

        outs = run_jobs(url, "smollm2-135m", [Job(body["prompt"], 10)] * 4, progress=False)
        assert [o.error for o in outs] == [None] * 4
        assert all(o.token_ids == res["choices"][0]["token_ids"] for o in outs)
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            rejected = re.search(r'meshllm_requests_total\{status="rejected"\} (\d+)', r.read().decode())
        assert rejected and int(rejected.group(1)) >= 1, "the 429s are counted"

        # stopped mid-stream, the gateway drains for its drain_s (1 s), then ends what is left with a
        # "shutting_down" error event and [DONE] (the client can go to another gateway), no cut stream
        from tests.serving_util import streaming

        with streaming(url, {**body, "prompt": long_prompt, "max_tokens": 2000, "stream": True}) as sock:
            t0 = time.monotonic()
            procs["n1"].send_signal(signal.SIGTERM)
            raw = b""
            while b"data: [DONE]" not in raw and (chunk := sock.recv(65536)):
                raw += chunk
        events = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")]
        assert events and events[-1].get("error", {}).get("code") == "shutting_down", raw[-500:]
        assert b"data: [DONE]" in raw and time.monotonic() - t0 < 20, "ended at the drain's deadline"
        assert procs["n1"].wait(timeout=30) == 0
        assert "still in flight after the 1 s drain; ending them" in log.read_text()
    finally:
        stop_processes(procs.values())
    assert procs["n1"].returncode == 0 and procs["n2"].returncode == 0
