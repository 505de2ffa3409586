"""What the benchmarks that drive an emulated mesh through its OpenAI API share: run jobs and
fail loudly if any request failed, and read every node's load from the gateway."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from meshllm.emulate import http_json  # noqa: E402
from meshllm.workload import Job, Outcome, run_jobs  # noqa: E402


def run_ok(url: str, model: str, jobs: list[Job]) -> list[Outcome]:
    """Every job's outcome, in order; a RuntimeError naming the first failure if any failed."""
    outs = run_jobs(url, model, jobs, progress=False)
    bad = [o.error for o in outs if o.error]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(outs)} requests failed: {bad[0]}")
    return outs


def node_loads(url: str) -> dict:
    """Each node's load as the gateway's /v1/mesh reports it (from the nodes' heartbeats)."""
    return {k: v["load"] for k, v in http_json(url + "/v1/mesh")[1]["nodes"].items()}
