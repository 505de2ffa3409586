"""A small fixed cluster for the planner's and simulator's tests (independent of clusters/*.yaml,
which change with the demos): SmolLM2-135M (fp32) on two Jetson Orin Nanos, a NUC and a Mac mini,
with a Raspberry Pi drafter at the edge."""

from __future__ import annotations

from meshllm.config import parse_cluster, plan_inputs
from meshllm.partition.inputs import PlanInputs

CLUSTER = {
    "model": "smollm2-135m",
    "weights_dtype": "fp32",
    "nodes": [
        {"id": "edge-1", "device": "raspberry-pi-5-8gb", "zone": "edge", "roles": ["drafter"]},
        {"id": "fog-1", "device": "jetson-orin-nano-8gb", "zone": "fog"},
        {"id": "fog-2", "device": "jetson-orin-nano-8gb", "zone": "fog"},
        {"id": "fog-3", "device": "intel-nuc-13-i7", "zone": "fog"},
        {"id": "fog-4", "device": "mac-mini-m2", "zone": "fog"},
    ],
    "links": [{"zones": ["edge", "fog"], "rtt_ms": 80, "bandwidth_mbps": 50},
              {"zones": ["fog", "fog"], "rtt_ms": 1, "bandwidth_mbps": 1000}],
    "workload": {"prompts": ["a", "b", "c", "d"], "max_tokens": 32, "arrival_rate_per_s": 0,
                 "input_tokens": {"mean": 16, "dist": "fixed"}, "output_tokens": {"mean": 32, "dist": "fixed"}},
}


def small_inputs() -> PlanInputs:
    return plan_inputs(parse_cluster(CLUSTER, "planner_fixtures.py"))
