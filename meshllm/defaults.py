"""Names and defaults shared by every floor: roles, quantizations, speculation modes, the default
model, liveness intervals. One constant each, imported everywhere. Pure."""

from __future__ import annotations

from enum import Enum


class Role(str, Enum):
    """What a node or a replica does. A replica is prefill, decode or mixed (both phases, no KV
    shipping); a node's `roles:` limit names drafter, prefill, decode and gateway."""

    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"
    DRAFTER = "drafter"
    GATEWAY = "gateway"

    def __str__(self) -> str:  # f-strings and logs show the value, as JSON does
        return self.value


NODE_ROLES = (Role.DRAFTER, Role.PREFILL, Role.DECODE, Role.GATEWAY)  # what `roles:` may list
STAGE_ROLES = (Role.PREFILL, Role.DECODE)  # a node allowed either may hold a stage
DECODE_TARGETS = (Role.DECODE, Role.MIXED)  # replicas a prefill replica may ship a prompt's KV to
REPLICA_ROLES = (Role.PREFILL, Role.DECODE, Role.MIXED)

TOKEN_BUDGET = 256  # rows per micro-batch, decodes first, then prompt chunks (chunked prefill; several prompts)

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_MAX_TOKENS = 48
MIN_RATE, MAX_RATE = 1e-9, 1e6  # requests/s a plan or simulation is for (1e-300 lost the trace's times
# to float absorption: waits and TTFT of 0; 1e308 printed 300 digits)
MAX_REQUEST_TOKENS = 1 << 31  # a request's max_tokens at most (the API's bound, and a workload's)

# draft models: W4A16 / W8A16 quantizations of the target; "none": no draft. Two references for
# tests and benchmarks: "fp32", the target itself (acceptance 1), and "random", random weights of
# the target's shape (acceptance ~0: an adversarial drafter the verifier must survive)
QUANTS = ("w4a16", "w8a16", "fp32", "random", "none")
DRAFT_QUANTS = ("w4a16", "w8a16")
DEFAULT_DRAFT_QUANT = "w4a16"
DEFAULT_GROUP_SIZE = 64  # group 32 would reproduce the Q4_1 target exactly and prove nothing
GROUP_SIZES = (32, 64, 128, 256)  # a W4A16 draft's groups: the sizes torch's int4 matmul (CPU) takes

SPEC_MODES = ("async", "sync", "off")
DEFAULT_SPEC_MODE = "async"
DEFAULT_GAMMA = 4

WEIGHT_DTYPES = ("fp32", "fp16", "bf16", "int8", "int4")  # served target weights (planner input)
DEFAULT_WEIGHT_DTYPE = "fp16"

HEARTBEAT_INTERVAL_S = 0.5
# a plan's reason for a node it leaves out because that node could not take its part of an earlier
# plan (roles/coordinator.py); the emulator stops on it (emulate.py)
PLAN_ERROR_REASON = "could not take its part of plan"
FAILURE_TIMEOUT_S = 2.5  # a peer silent this long is dead (<= 3 s by default)
# A gateway node told to stop (SIGINT / SIGTERM) takes no new request and lets those in flight
# finish for up to this long (node file `gateway: {drain_s: S}`), its node still in the mesh
# meanwhile; then it ends those left (an error event: code "shutting_down") and leaves.
GATEWAY_DRAIN_S = 30.0
# an API connection that has not sent a whole request's headers this long after it opened (or
# after its last response: keep-alive) is closed: idle and trickling (slowloris) clients do not
# hold the gateway's connections and file descriptors
HTTP_IDLE_S = 15.0
MAX_DRAIN_S = 3600.0
# Requests a gateway takes at once (node file `gateway: {max_concurrent: N}`); beyond, a 429 with
# Retry-After (as TGI's --max-concurrent-requests): an overload is refused, not queued without end.
GATEWAY_MAX_CONCURRENT = 1024

# A node's compute thread may poll its queue this long after each piece of work before it sleeps
# (node file `busy_poll_ms`; 0 = never): a pipeline stage between two micro-batches then picks the
# next one up without a thread wake-up from idle. It costs a busy core while serving, so it is off
# by default; the emulator turns it on for a node that has a CPU of its own (mesh/loop.py).
EMULATED_BUSY_POLL_MS = 50.0
MAX_BUSY_POLL_MS = 1000.0


def served_name(model_spec: str) -> str:
    """The model name the OpenAI API serves a model under: a registry name, or a path's last part."""
    return model_spec.rstrip("/").rsplit("/", 1)[-1]
