"""Every shipped device profile loads and cites its source; bad profiles name the field."""

from __future__ import annotations

import pytest
import yaml

from meshllm.device import DEVICES_DIR, known_devices, load_device
from meshllm.errors import ConfigError

REQUIRED = ["raspberry-pi-4-4gb", "raspberry-pi-5-8gb", "jetson-orin-nano-8gb", "jetson-agx-orin-64gb",
            "intel-nuc-13-i7", "mac-mini-m2", "desktop-rtx-4090", "cloud-a100-80gb"]


def test_required_profiles_exist():
    assert set(REQUIRED) <= set(known_devices())


@pytest.mark.parametrize("name", known_devices())
def test_profile_loads_with_source(name):
    dev = load_device(name)
    assert dev.memory_gb > 0 and dev.compute_tflops > 0 and dev.memory_bandwidth_gbps > 0 and dev.network_mbps > 0
    assert len(dev.source) > 40, "source must say where the figures come from"
    assert any(p in dev.source.lower() for p in ("fp16", "fp32")), "source must name the TFLOPS precision"
    assert "memory_gb" in dev.source or "reserve" in dev.source.lower() or "minus" in dev.source


def test_profiles_are_ordered_sensibly():
    pi4, a100 = load_device("raspberry-pi-4-4gb"), load_device("cloud-a100-80gb")
    assert pi4.compute_tflops < a100.compute_tflops and pi4.memory_gb < a100.memory_gb
    assert (DEVICES_DIR / "desktop-rtx-4090.yaml").is_file()


def test_a_built_wheel_carries_every_profile(tmp_path):
    """`pip install .` (not -e) gave a meshllm that knew no device: the profiles live in the
    repository's devices/, which the wheel left out ("unknown device 'raspberry-pi-5-8gb'; known: ,
    auto")."""
    import shutil
    import subprocess
    import sys
    import zipfile

    from tests.conftest import REPO

    src = tmp_path / "src"  # a copy: the build writes build/ and *.egg-info beside its sources
    shutil.copytree(REPO, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", "tests", "bench", "__pycache__", "*.egg-info", "build", "dist", ".*cache"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                        "-q", "-w", str(tmp_path / "w")], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = (tmp_path / "w").glob("meshllm-*.whl")
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    shipped = {p.name for p in (tmp_path / "site" / "meshllm" / "devices").glob("*.yaml")}
    assert shipped == {f"{n}.yaml" for n in known_devices()}
    r = subprocess.run([sys.executable, "-c", "from meshllm.device import load_device, DEVICES_DIR;"
                        "print(DEVICES_DIR, load_device('raspberry-pi-5-8gb').memory_gb)"],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path / "site")})
    assert r.returncode == 0 and str(tmp_path / "site") in r.stdout, r.stderr[-2000:]


@pytest.mark.parametrize("body,field", [
    ("memory_gb: 4\ncompute_tflops: 1\nmemory_bandwidth_gbps: 10\n", "network_mbps"),
    ("memory_gb: -4\ncompute_tflops: 1\nmemory_bandwidth_gbps: 10\nnetwork_mbps: 1000\n", "memory_gb"),
    ("memory_gb: 4\ncompute_tflops: fast\nmemory_bandwidth_gbps: 10\nnetwork_mbps: 1000\n", "compute_tflops"),
    ("memory_gb: 4\ncompute_tflops: 1\nmemory_bandwidth_gbps: 10\nnetwork_mbps: 1000\nflux: 3\n", "flux"),
])
def test_bad_profile_names_the_field(tmp_path, body, field):
    (tmp_path / "bad.yaml").write_text(body)
    with pytest.raises(ConfigError) as e:
        load_device("bad", devices_dir=tmp_path)
    assert field in str(e.value) and "bad.yaml" in str(e.value)


def test_profile_bounds_names_and_probe(tmp_path, monkeypatch):
    """The RANGES bounds themselves are taken (and just past them refused), zero and a bool are
    not positive numbers, a profile is named by its `name:`, a profile name is a plain file name,
    memory_bytes is decimal GB, and the probe's compute is 16 FLOP/cycle/core at the max clock."""
    import os
    from types import SimpleNamespace

    import psutil

    from meshllm.device import DeviceProfile, device_from_mapping, probe_this_machine
    from meshllm.errors import ConfigError

    good = {"memory_gb": 1e-3, "compute_tflops": 1, "memory_bandwidth_gbps": 10, "network_mbps": 1e7}
    d = device_from_mapping("x", good, "t")
    assert (d.memory_gb, d.network_mbps, d.name) == (1e-3, 1e7, "x")
    for k, v, why in [("network_mbps", 1.5e7, r"in \[0.001, 1e\+07\]"), ("memory_gb", 0, "positive finite number"),
                      ("compute_tflops", True, "positive finite number")]:
        with pytest.raises(ConfigError, match=f"device.{k}: must be .*{why}"):
            device_from_mapping("x", {**good, k: v}, "t")
    assert load_device({**good, "name": "box"}).name == "box"
    (tmp_path / "p.yaml").write_text(yaml.safe_dump({**good, "name": "Pretty Box"}))
    assert load_device("p", devices_dir=tmp_path).name == "Pretty Box"
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "q.yaml").write_text(yaml.safe_dump(good))
    (tmp_path / ".hidden.yaml").write_text(yaml.safe_dump(good))
    for name in ("sub/q", ".hidden"):
        with pytest.raises(ConfigError, match="unknown device"):
            load_device(name, devices_dir=tmp_path)
    assert DeviceProfile("m", 8, 1, 1, 1).memory_bytes == 8e9
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(psutil, "cpu_freq", lambda: SimpleNamespace(max=3000.0, current=1000.0))
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=4.0e9))
    auto = probe_this_machine()
    assert (auto.compute_tflops, auto.memory_gb) == (2 * 3.0 * 16 / 1000, 4.0)
