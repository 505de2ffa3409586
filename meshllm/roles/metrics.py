"""The gateway's Prometheus metrics (`GET /metrics`), in a registry of its own."""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from meshllm.engine.speculative import AcceptanceStats

log = logging.getLogger("meshllm.metrics")

# seconds; wide enough for emulated Raspberry Pis at time_scale 10
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def summed(before: dict | None, now: dict) -> dict:
    """A request's drafting figures: its ended attempts' (`before`) and the current one's (`now`,
    as its leader sends them). Figures a leader sent malformed are the current attempt's alone (the
    count at the finish then leaves them out, with its warning)."""
    if not before:
        return now
    try:
        both = AcceptanceStats()
        both.merge(before)
        both.merge(now)
    except (TypeError, ValueError, AttributeError):
        return now
    return both.to_json()


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("meshllm_time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.itl = Histogram("meshllm_inter_token_latency_seconds", "Gap between two tokens reaching the client",
                             registry=r, buckets=LATENCY_BUCKETS)
        self.e2e = Histogram("meshllm_e2e_request_latency_seconds", "End-to-end request latency", registry=r,
                             buckets=LATENCY_BUCKETS)
        self.queue_wait = Histogram("meshllm_queue_wait_seconds", "Time a request waited to be scheduled",
                                    registry=r, buckets=LATENCY_BUCKETS)
        self.requests = Counter("meshllm_requests", "Finished requests by status", ["status"], registry=r)
        self.prompt_tokens = Counter("meshllm_prompt_tokens", "Prompt tokens received", registry=r)
        self.generation_tokens = Counter("meshllm_generation_tokens", "Tokens generated", registry=r)
        self.running = Gauge("meshllm_requests_running", "Requests in the mesh", registry=r)
        self.waiting = Gauge("meshllm_requests_waiting_first_token", "Requests before their first token",
                             registry=r)
        self.replicas_ready = Gauge("meshllm_replicas_ready", "Replicas of the current plan ready", registry=r)
        self.resumes = Counter("meshllm_request_resumes", "Attempts resumed after a failure", registry=r)
        self.drafted = Counter("meshllm_spec_draft_tokens", "Draft tokens verified", registry=r)
        self.accepted = Counter("meshllm_spec_accepted_tokens", "Draft tokens accepted", registry=r)
        self.blocks = Counter("meshllm_spec_blocks", "Draft blocks verified", registry=r)
        self.position = Counter("meshllm_spec_accepted_at_position", "Blocks accepting their i-th draft",
                                ["position"], registry=r)
        self.gamma = Counter("meshllm_spec_gamma", "Draft blocks by draft length", ["gamma"], registry=r)
        self.spec = AcceptanceStats()  # the same figures for `--cluster --json`

    def started(self, n_prompt: int) -> None:
        self.prompt_tokens.inc(n_prompt)
        self.running.inc()
        self.waiting.inc()

    def not_sent(self, status: str) -> None:
        """A request that ended before it entered the mesh (no replica ready, the gateway stopping,
        the client gone while it waited for KV room)."""
        self.waiting.dec()
        self.finished(status)

    def first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)
        self.waiting.dec()

    def finished(self, status: str, spec: dict | None = None) -> None:
        self.requests.labels(status=status).inc()
        self.running.dec()
        if spec:
            try:
                one = AcceptanceStats()
                one.merge(spec)
            except (TypeError, ValueError, AttributeError) as e:
                # a malformed figure from a leader: the request is done, its figures not counted
                log.warning("a request's speculation figures are malformed (%s: %.80s); not counted",
                            type(e).__name__, e)
                return
            self.spec.merge(spec)
            self.drafted.inc(one.drafted)
            self.accepted.inc(one.accepted)
            self.blocks.inc(one.blocks)
            for k, v in one.per_position.items():
                self.position.labels(position=str(k)).inc(v)
            for k, v in one.gammas.items():
                self.gamma.labels(gamma=str(k)).inc(v)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def now() -> float:
    return time.monotonic()
