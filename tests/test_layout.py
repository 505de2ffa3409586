"""The house plan holds: pure floors import no I/O libraries, and the repository stands alone."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

# module -> what it must not pull in (directly or through anything it imports)
PURE = {
    "meshllm.partition.plan": ("torch", "yaml", "zmq", "meshllm.config", "meshllm.roles"),
    "meshllm.partition.draw": ("torch", "yaml", "zmq", "meshllm.config"),
    "meshllm.partition.steps": ("torch", "yaml", "zmq", "meshllm.config", "meshllm.sim"),
    "meshllm.sim.sweep": ("torch", "yaml", "zmq", "meshllm.config", "meshllm.roles"),
    "meshllm.mesh.protocol": ("torch", "yaml", "zmq"),
    "meshllm.mesh.membership": ("torch", "yaml", "zmq"),
    "meshllm.mesh.ingress": ("torch", "yaml", "zmq"),
    "meshllm.mesh.loop": ("torch", "yaml", "zmq"),
    "meshllm.engine.model": ("zmq", "yaml", "meshllm.mesh", "meshllm.roles"),
    "meshllm.engine.sampling": ("zmq", "yaml", "meshllm.mesh", "meshllm.roles"),
    # not pure, but torch-free on import: the emulator's parent process, `--status` and a bad
    # `--kill` never import torch (a node that may compute imports it in Node.start, before it joins)
    "meshllm.mesh.node": ("torch",),
    "meshllm.emulate": ("torch",),
    "meshllm.cluster_run": ("torch",),
    "meshllm.launch": ("torch",),
}


@pytest.mark.parametrize("module", sorted(PURE))
def test_pure_modules_import_no_io(module):
    banned = PURE[module]
    code = (f"import sys, {module}\n"
            f"bad = [m for m in {banned!r} if any(k == m or k.startswith(m + '.') for k in sys.modules)]\n"
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"{module} imports {out.stdout.strip()}"


# what a file of a repository that stands alone never names: the folder beside a development
# checkout (spelled in pieces, so that this file does not name it either)
OUTSIDE = ("/".join(("..", "shared")), "/".join(("shared", "fixtures")))


def test_repository_stands_alone():
    tracked = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=REPO).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    offenders = []
    for name in tracked:
        path = REPO / name
        if path.suffix not in (".py", ".md", ".toml", ".yaml", ".sh", ".cfg") and not name.startswith(".ci/"):
            continue
        text = path.read_text(errors="replace")
        if any(needle in text for needle in OUTSIDE):
            offenders.append(name)
    assert offenders == []
