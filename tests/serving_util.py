"""Helpers for the serving tests: emulated meshes started with `--cluster ... --serve`, and the
single-process reference they are compared with (the same engine call as `--reference`)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml

from meshllm.engine import sampling
from tests.conftest import REPO, spawn

SERVE_TIMEOUT_S = 300  # node processes import torch and load layers on a 2-core machine


def small_device(name: str, memory_gb: float, tflops: float = 1.0, gbps: float = 60.0) -> dict:
    return {"name": name, "memory_gb": memory_gb, "compute_tflops": tflops, "memory_bandwidth_gbps": gbps,
            "network_mbps": 1000, "source": "test profile: small enough to force a multi-stage split"}


def write_cluster(path: Path, nodes: list[dict], **extra) -> Path:
    doc = {"model": "smollm2-135m", "weights_dtype": "fp32", "speculation": {"mode": "off"}, "nodes": nodes,
           "links": [{"zones": ["fog", "fog"], "rtt_ms": 1, "bandwidth_mbps": 1000}],
           "workload": {"prompts": ["The capital of France is"], "max_tokens": 16, "temperature": 0,
                        "input_tokens": {"mean": 32, "dist": "fixed"}, "output_tokens": {"mean": 32, "dist": "fixed"}}}
    doc.update(extra)
    path.write_text(yaml.safe_dump(doc))
    return path


class Served:
    """`python launch.py --cluster FILE --serve` in the background; stop() checks a clean exit."""

    def __init__(self, cluster: Path, log: Path):
        self.log = log
        self.proc = spawn([sys.executable, str(REPO / "launch.py"), "--cluster", str(cluster), "--serve"],
                          cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(log, "wb"),
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        self.url = self._wait_url()

    def node_logs(self) -> str:
        """What the mesh's nodes have logged so far (the emulator names their folder)."""
        m = re.search(r"logs in (\S+?)\)", self.log.read_text(errors="replace"))
        assert m, self.log.read_text()[-2000:]
        return "".join(p.read_text(errors="replace") for p in sorted(Path(m.group(1)).glob("*.log")))

    def _wait_url(self) -> str:
        deadline = time.monotonic() + SERVE_TIMEOUT_S
        while time.monotonic() < deadline:
            m = re.search(r"meshllm: serving on (http://\S+)", self.log.read_text(errors="replace"))
            if m:
                return m.group(1)
            if self.proc.poll() is not None:
                raise RuntimeError(f"--serve exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"no serving line in {SERVE_TIMEOUT_S} s:\n{self.log.read_text()[-3000:]}")

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=30) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def post(self, path: str, body: bytes | dict, timeout: float = 120) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def post_stream(self, path: str, body: dict, timeout: float = 120) -> list[dict]:
        """A streaming POST read to its end: the SSE events' JSON objects, in order."""
        req = urllib.request.Request(self.url + path, data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            lines = r.read().decode().splitlines()
        return [json.loads(ln[6:]) for ln in lines if ln.startswith("data: ") and ln != "data: [DONE]"]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


@contextlib.contextmanager
def streaming(url: str, body: dict, events: int = 3):
    """A streaming POST /v1/completions on a raw socket, held once `events` SSE events have come;
    leaving the block closes the socket (the client goes away)."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
        got = b""
        while got.count(b"data: ") < events:
            chunk = sock.recv(65536)  # the socket's timeout bounds each wait
            assert chunk, f"the gateway closed the connection after {got.count(b'data: ')} events: {got[-2000:]!r}"
            got += chunk
        yield sock


_REFERENCES: dict[tuple, dict] = {}  # the session's model fixtures are loaded once: their results are too


def reference(model, tokenizer, prompt: str, max_tokens: int, chat: bool = False, temperature: float = 0.0,
              seed: int = 0) -> dict:
    """What `--reference` computes (engine.generate, fp32), in this process (once per arguments:
    the model is deterministic, and many tests ask for the same prompt)."""
    from meshllm.engine.generate import GenerationOptions, generate

    key = (id(model), id(tokenizer), prompt, max_tokens, chat, temperature, seed)
    if key not in _REFERENCES:
        text = tokenizer.render_chat([{"role": "user", "content": prompt}]) if chat else prompt
        r = generate(model, tokenizer.encode(text), GenerationOptions(max_tokens, temperature, seed=seed, chat=chat),
                     tokenizer.eos_ids)
        _REFERENCES[key] = {"token_ids": tuple(r.token_ids), "margins": tuple(r.margins),
                            "finish_reason": r.finish_reason}
    got = _REFERENCES[key]
    return {"token_ids": list(got["token_ids"]), "margins": list(got["margins"]), "finish_reason": got["finish_reason"]}


def same_up_to_tie(got: list[int], ref: dict) -> tuple[bool, str]:
    """The identity rule against a `reference` result (engine/sampling.py same_up_to_tie)."""
    return sampling.same_up_to_tie(got, ref["token_ids"], ref["margins"])
