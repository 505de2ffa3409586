"""What the planner and the simulator plan for: plain, frozen inputs. Pure: no YAML, no torch.

`config.plan_inputs` builds a `PlanInputs` from a cluster file; a live coordinator builds one
from the device profiles in its peer table (roles/coordinator.py). Everything the planner,
the simulator and the baselines need is here, and nothing else: they never read a file.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass

from meshllm.defaults import STAGE_ROLES, Role
from meshllm.device import DeviceProfile
from meshllm.partition.cost import ModelCosts, model_costs
from meshllm.partition.dp import Member, Net
from meshllm.partition.replica import Mix
from meshllm.shapes import ModelArgs

LOGNORMAL_SIGMA = 0.6  # shape of lognormal lengths (the mean is the file's mean)
MAX_LENGTH_FACTOR = 8  # lengths are clipped to [1, factor x mean]


@dataclass(frozen=True)
class LengthDist:
    """Token lengths of a workload: a mean and a distribution (fixed | uniform | lognormal;
    exponential for the simulator's queueing-theory tests)."""

    mean: float
    dist: str = "lognormal"

    @property
    def cs2(self) -> float:
        """Squared coefficient of variation (variance / mean^2), before clipping and rounding."""
        if self.dist == "fixed":
            return 0.0
        if self.dist == "uniform":
            return (2 * self.mean - 2) ** 2 / 12 / self.mean ** 2
        if self.dist == "exponential":
            return 1.0
        return math.exp(LOGNORMAL_SIGMA ** 2) - 1

    def draw(self, rng: random.Random) -> int:
        if self.dist == "fixed":
            x = self.mean
        elif self.dist == "uniform":
            x = rng.uniform(1, 2 * self.mean - 1)
        elif self.dist == "exponential":
            x = rng.expovariate(1 / self.mean)
        else:
            x = rng.lognormvariate(math.log(self.mean) - LOGNORMAL_SIGMA ** 2 / 2, LOGNORMAL_SIGMA)
        return int(min(max(1, round(x)), MAX_LENGTH_FACTOR * self.mean))


@dataclass(frozen=True)
class PlanNode:
    """A device of the mesh as the planner sees it."""

    id: str
    device: DeviceProfile
    zone: str
    roles: tuple[Role, ...] | None = None  # None: the planner decides


@dataclass(frozen=True)
class PlanLink:
    zones: tuple[str, str]
    rtt_ms: float
    bandwidth_mbps: float


@dataclass(frozen=True)
class PlanInputs:
    source: str  # where these came from (a cluster file, "the live mesh"), for messages
    args: ModelArgs
    dtype: str  # served target weights: fp32 | fp16 | bf16 | int8 | int4
    nodes: tuple[PlanNode, ...]
    links: tuple[PlanLink, ...] = ()
    input_tokens: LengthDist = LengthDist(512)
    output_tokens: LengthDist = LengthDist(128)
    rate_per_s: float = 0.0  # the workload's arrival rate (0: all at once / not given)
    requests: int = 0  # the workload's request count (0: one per prompt, or the reporting default)
    n_prompts: int = 0  # prompts the workload lists
    draft_quant: str | None = None  # drafters' quantization; None when speculation is off

    @functools.cached_property
    def mc(self) -> ModelCosts:
        return model_costs(self.args, self.dtype)

    @functools.cached_property
    def stage_nodes(self) -> tuple[PlanNode, ...]:
        """Nodes whose roles allow a stage (prefill, decode or mixed)."""
        return tuple(n for n in self.nodes if n.roles is None or set(n.roles) & set(STAGE_ROLES))

    @functools.cached_property
    def members(self) -> tuple[Member, ...]:
        return tuple(Member(n.id, n.device, n.zone) for n in self.stage_nodes)

    @functools.cached_property
    def forced(self) -> tuple[str | None, ...]:
        """Per member: the only stage role its `roles:` allow, if just one."""
        out = []
        for n in self.stage_nodes:
            allowed = STAGE_ROLES if n.roles is None else tuple(r for r in STAGE_ROLES if r in n.roles)
            out.append(allowed[0].value if len(allowed) == 1 else None)
        return tuple(out)

    @functools.cached_property
    def net(self) -> Net:
        return Net({frozenset(ln.zones): (ln.rtt_ms, ln.bandwidth_mbps) for ln in self.links})

    @functools.cached_property
    def mix(self) -> Mix:
        return Mix(self.input_tokens.mean, self.output_tokens.mean)

    @functools.cached_property
    def step_caches(self) -> dict[tuple, dict]:
        """(member keys in pipeline order, layer counts) -> the step times the simulator has
        computed for a replica of that shape (sim/replica.py): replicas of the same device kinds
        and split, in one policy or in the judge's candidates, share them."""
        return {}
