"""Device-speed emulation: a compute step lasts as long as the device profile predicts.

Used by every stage (roles/stage.py) with `partition/cost.py`'s `stage_batch_s` as the
prediction, times the cluster file's `time_scale`; off on real devices (`enabled=False`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any


class Pacer:
    """Device-speed emulation: make a compute step last as long as the device profile predicts.

    The host CPU is (usually) faster than the emulated device. After a step that
    started at `started_at` (a `clock()` reading), `pace(predicted_s, started_at)`
    sleeps `predicted_s - measured` when that is positive; a step already slower
    than predicted is not stretched (it is counted in `overrun_s`). `predict` is
    injected (e.g. partition/cost.py's roofline time for a stage on a device).
    """

    def __init__(self, predict: Callable[..., float] | None = None, *, enabled: bool = True,
                 clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep):
        self.predict, self.enabled, self.clock, self._sleep = predict, enabled, clock, sleep
        self.steps = 0
        self.measured_s = self.slept_s = self.overrun_s = 0.0

    def pace(self, predicted_s: float, started_at: float) -> float:
        """Sleep the rest of `predicted_s`; returns the seconds slept."""
        measured = self.clock() - started_at
        self.steps += 1
        self.measured_s += measured
        lag = predicted_s - measured
        if lag <= 0 or not self.enabled:
            self.overrun_s += max(0.0, -lag)
            return 0.0
        self._sleep(lag)
        self.slept_s += lag
        return lag

    def summary(self) -> dict[str, float]:
        """Steps, host compute, sleep and overrun (host time the emulation could not hide)."""
        return {"steps": self.steps, "measured_s": round(self.measured_s, 3), "slept_s": round(self.slept_s, 3),
                "overrun_s": round(self.overrun_s, 3)}

    @contextlib.contextmanager
    def step(self, *args: Any, **kwargs: Any) -> Iterator[None]:
        """`with pacer.step(stage, n_tokens): forward(...)`: paced to `predict(*args, **kwargs)`."""
        assert self.predict is not None, "Pacer.step needs a predict callable"
        started = self.clock()
        yield
        self.pace(self.predict(*args, **kwargs), started)


def pacer_factory(cfg, model_args: Callable[[], Any] | None = None) -> Callable:
    """(layers [a, b), served dtype) -> a Pacer that stretches the compute of those layers to what
    `cfg.device` would take (partition/cost.py's stage_batch_s) times `cfg.time_scale`. Emulation
    only (`pace: true` in the node file). Stages pace at the plan's weights dtype, drafters at
    the draft's (int4 / int8). The model's shape is asked for when the first Pacer is made
    (`model_args`, e.g. from the index of a peer's file on a node without one)."""
    from meshllm.config import resolve_args
    from meshllm.partition.cost import model_costs, stage_batch_s

    shape = model_args or (lambda: resolve_args(cfg.model))

    def make(layers: tuple[int, int], dtype: str) -> Pacer:
        mc = model_costs(shape(), dtype)
        n, first, last = layers[1] - layers[0], layers[0] == 0, layers[1] == mc.n_layers

        def predict(spans, logit_rows: int) -> float:
            work = [(s.n_tokens, s.start_pos + s.n_tokens) if hasattr(s, "n_tokens") else (s.n, s.start + s.n)
                    for s in spans]
            return cfg.time_scale * stage_batch_s(mc, cfg.device, n, work, first, last, logit_rows)

        return Pacer(predict)

    return make
