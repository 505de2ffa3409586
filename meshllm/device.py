"""Device profiles: the hardware figures the planner, emulator and simulator use.

A profile comes from `devices/NAME.yaml`, from an inline mapping in a config
file, or from `auto` (a psutil probe of this machine). Every shipped profile
cites its `source:`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from pathlib import Path

# the repository's devices/, through the package's link to it, so that a wheel carries the profiles
DEVICES_DIR = Path(__file__).parent / "devices"
# a product's short name -> the profile of its commonest model (`raspberry-pi-5`, as people say it)
ALIASES = {"raspberry-pi-5": "raspberry-pi-5-8gb"}


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    memory_gb: float  # memory usable for weights + KV
    compute_tflops: float  # dense fp16/bf16 (or fp32 on CPUs) peak the runtime can use
    memory_bandwidth_gbps: float  # GB/s
    network_mbps: float  # the device's network port, shared by all its transfers
    source: str = ""

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9


_REQUIRED = ("memory_gb", "compute_tflops", "memory_bandwidth_gbps", "network_mbps")
# what a device of one node may plausibly have, a thousand-fold around today's (memory_gb 1e300
# overflowed the planner's layer count: exit 1; compute_tflops 1e300 divided by zero)
RANGES = {"memory_gb": (1e-3, 1e5), "compute_tflops": (1e-6, 1e6), "memory_bandwidth_gbps": (1e-3, 1e6),
          "network_mbps": (1e-3, 1e7)}


def device_from_mapping(name: str, data: dict, where: str) -> DeviceProfile:
    """Validate a profile mapping; `where` names the file/field for errors."""
    from meshllm.errors import ConfigError, number_hint

    if not isinstance(data, dict):
        raise ConfigError(where, "device", f"expected a mapping, got {type(data).__name__}")
    allowed = {f.name for f in fields(DeviceProfile)}
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ConfigError(where, f"device.{unknown[0]}", f"unknown key (allowed: {', '.join(sorted(allowed))})")
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise ConfigError(where, f"device.{missing[0]}", "missing required field")
    values = {}
    for k in _REQUIRED:
        v = data[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:  # not .nan / .inf
            raise ConfigError(where, f"device.{k}", f"must be a positive finite number, got {v!r}{number_hint(v)}")
        lo, hi = RANGES[k]
        if not lo <= v <= hi:
            raise ConfigError(where, f"device.{k}", f"must be in [{lo:g}, {hi:g}] for one device, got {v:g}")
        values[k] = float(v)
    return DeviceProfile(name=str(data.get("name", name)), source=str(data.get("source", "")), **values)


def known_devices(devices_dir: Path = DEVICES_DIR) -> list[str]:
    return sorted(p.stem for p in devices_dir.glob("*.yaml"))


def load_device(spec: str | dict, where: str = "<config>", devices_dir: Path = DEVICES_DIR) -> DeviceProfile:
    """`spec` is a profile name in devices/ (or an alias of one: ALIASES), an inline mapping, or 'auto'."""

    from meshllm.errors import ConfigError

    if isinstance(spec, dict):
        return device_from_mapping(str(spec.get("name", "inline")), spec, where)
    if spec == "auto":
        return probe_this_machine()
    if isinstance(spec, str) and not (devices_dir / f"{spec}.yaml").is_file():
        spec = ALIASES.get(spec, spec)
    path = devices_dir / f"{spec}.yaml"
    # a name, not a path: devices/../clusters/demo.yaml is no profile (its keys were reported as one's)
    if not isinstance(spec, str) or "/" in spec or "\\" in spec or spec.startswith(".") or not path.is_file():
        raise ConfigError(where, "device", f"unknown device {spec!r}; known: {', '.join(known_devices(devices_dir))}, "
                                           "auto, or an inline mapping")
    from meshllm.yaml_fields import read_yaml

    return device_from_mapping(spec, read_yaml(path), str(path))


def probe_this_machine() -> DeviceProfile:
    """Rough profile of this machine from psutil. Compute and bandwidth are estimates:
    ~16 fp32 FLOP/cycle/core (AVX2 FMA) at the max clock, and ~10 GB/s per memory channel
    guess of 2 channels. Nothing refines them at run time: `python bench/calibrate.py` measures
    this machine, and a node file may give its own figures instead (an inline device mapping)."""
    import psutil

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (psutil.cpu_count() or 1)
    freq = psutil.cpu_freq()
    ghz = (freq.max or freq.current) / 1000 if freq and (freq.max or freq.current) else 2.5
    return DeviceProfile(
        name="auto",
        memory_gb=round(psutil.virtual_memory().available / 1e9, 2),
        compute_tflops=round(cores * ghz * 16 / 1000, 4),
        memory_bandwidth_gbps=20.0,
        network_mbps=1000.0,
        source=f"psutil probe of this machine ({cores} cores at ~{ghz:.1f} GHz); bandwidth and network assumed",
    )
