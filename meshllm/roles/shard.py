"""The weights this node holds for its part in the plan: a layer range of the target, the whole
target as a warm spare, or the quantized draft. Runs on the node's compute thread.

A new layer range is carved out of the shard held when it lies inside it (a warm spare, or a
stage whose range shrank: no file read); when it overlaps it, the overlap is kept and only the
layers around it are loaded (a re-plan that moves a stage boundary by a few layers reads those
few); otherwise the old shard is freed first and the range is loaded. Layers are loaded from
the model file, or fetched from a peer that has them (roles/weights_fetch.py).

A load asks its `stop` before each tensor it reads (the host's: has a newer plan given this node
another part?): a node that a plan gives a part and the next plan another, while it still reads
the first (minutes for a large shard on a slow disk), stops at once (LoadCancelled) and holds
nothing, instead of reading the rest of a part that is no longer its. A fetch from a peer is not
stopped.
"""

from __future__ import annotations

import logging
import os
import time

from meshllm.defaults import DRAFT_QUANTS, STAGE_ROLES
from meshllm.node_config import NodeConfig
from meshllm.roles.weights_fetch import MeshWeights

log = logging.getLogger("meshllm.shard")


class ShardHolder:
    def __init__(self, me: str, cfg: NodeConfig, weights: MeshWeights):
        self.me, self.cfg, self.weights, self.model_spec = me, cfg, weights, cfg.model
        self.key: tuple | None = None  # (model, (first layer, end)) or ("draft", spec) of `model`
        self.model = None  # the Transformer shard held
        self.weights_mb = 0.0

    def load(self, layers: tuple[int, int | None], stop=None):
        """The target's layers [a, b): the shard held already, carved out of a larger shard held,
        the layers held that it keeps with the rest loaded around them, or loaded from the model.
        `stop()` true before a tensor is read: LoadCancelled, and nothing is held."""
        key = (self.model_spec, tuple(layers))
        if key == self.key:
            return self.model
        from meshllm.engine.model import Transformer
        from meshllm.engine.weights import load_transformer, release_freed_memory, weight_bytes

        t0 = time.perf_counter()
        held = self.model if self.key and self.key[0] == self.model_spec else None
        a, b = layers[0], layers[1] if layers[1] is not None else (held.args.n_layers if held else None)
        if held is not None and b is not None and held.start <= a < b <= held.end \
                and (a > 0 or held.has_embed) and (b < held.args.n_layers or held.has_head):
            self.model = held.sub_shard(a, b)  # the rest of `held` is freed with it
            how = "carved from the layers held"
        elif held is not None and b is not None and (kept := self._overlap(held, a, b)) is not None:
            self.model = held = self.key = None  # what is not kept is freed before the rest is loaded
            release_freed_memory()
            parts = [load_transformer(self.weights.source(a, kept.start), a, kept.start, stop=stop)] \
                if a < kept.start else []
            parts.append(kept)
            if kept.end < b:
                parts.append(load_transformer(self.weights.source(kept.end, b), kept.end, b, stop=stop))
            self.model = Transformer.joined(parts)
            how = f"loaded around layers [{kept.start}, {kept.end}) kept"
            del parts, kept
        else:
            self.model = self.key = None  # free the old shard before loading the new one
            self.model = load_transformer(self.weights.source(a, b), a, b, stop=stop)  # fetched from a peer if not here
            how = "loaded"
        del held
        release_freed_memory()
        self.key = (self.model_spec, (a, self.model.end))
        self.weights_mb = weight_bytes(self.model) / 1e6
        log.info("%s: layers [%d, %d) of %s %s in %.1f s (resident %.0f MB)", self.me, a, self.model.end,
                 self.model_spec, how, time.perf_counter() - t0, rss_mb())
        return self.model

    @staticmethod
    def _overlap(held, a: int, b: int):
        """The layers of `held` that the range [a, b) keeps, as a shard of their own (with the
        embedding or head if [a, b) begins or ends with them), or None when none are kept: no
        overlap, an embedding or head that `held` lacks, or both ends to load (a tied head would be
        read a second time, apart from its embedding)."""
        lo, hi, n = max(a, held.start), min(b, held.end), held.args.n_layers
        if lo >= hi or (lo == 0 and not held.has_embed) or (hi == n and not held.has_head):
            return None
        if a < lo and hi < b and a == 0 and b == n:
            return None
        return held.sub_shard(lo, hi)

    def draft(self, stop=None):
        """The W4A16 (or W8A16) draft of the whole target at the cluster's group size: quantized as
        it loads, a layer at a time (weights.load_quantized: the node never holds the fp32 target),
        or from the whole target when this node holds it already (a warm spare). `stop`: as load's."""
        spec = self.cfg.draft
        if self.key == ("draft", spec):
            return self.model
        from meshllm.engine.quant import quantize_model
        from meshllm.engine.weights import load_quantized, release_freed_memory

        t0 = time.perf_counter()
        held = self.model is not None and self.key == (self.model_spec, (0, self.model.args.n_layers))
        full, self.model, self.key = (self.model if held else None), None, None
        if spec.quant in DRAFT_QUANTS:
            self.model = quantize_model(full, spec.quant, spec.group_size) if full is not None else \
                load_quantized(self.weights.source(0, None), spec.quant, spec.group_size, stop=stop)
        else:  # fp32, or "random": same shape, weights of no use (the verifier rejects ~everything)
            self.model = full if full is not None else self.load((0, None), stop)
            if spec.quant == "random":
                from meshllm.engine.weights import randomize_weights

                randomize_weights(self.model, seed=1234)
        del full
        self.key = ("draft", spec)
        release_freed_memory()
        log.info("%s: %s g%d draft ready in %.1f s (resident %.0f MB)", self.me, spec.quant, spec.group_size,
                 time.perf_counter() - t0, rss_mb())
        return self.model

    def warm_spare(self, version: int, stop=None) -> None:
        """A node the plan leaves without a role loads the whole target when its memory allows,
        so that a re-plan that gives it a stage after a failure does not wait for the model file
        (the shard is carved out of it: see `load`)."""
        if self.cfg.roles is not None and not set(STAGE_ROLES) & set(self.cfg.roles):
            return
        if self.weights.missing() is not None:
            return  # no model file here: only the layers a plan gives this node are fetched
        from meshllm.config import resolve_args
        from meshllm.partition.cost import model_costs

        need = model_costs(resolve_args(self.model_spec), "fp32").weight_bytes
        if self.cfg.device.memory_bytes >= need * 1.2 and self.key is None:
            self.load((0, None), stop)
            log.info("%s: holding the whole model as a warm spare for plan v%d", self.me, version)


def rss_mb() -> float:
    """This process's resident memory in MB (psutil, a dependency)."""
    import psutil

    return psutil.Process(os.getpid()).memory_info().rss / 1e6


TRIM_IDLE_S = 1.0  # a node that held sequences and holds none for this long gives freed heap back


class IdleTrim:
    """Hands the heap freed by finished sequences back to the OS once the node holds none. Each
    sequence's KV slots, activations and frames are freed when it ends, but glibc keeps freed
    heap (and, once a large block is freed, raises its mmap threshold, so later blocks of that
    size come from the fragmentable heap too): a decode node of the demo served 480 requests in
    bursts of 40 and grew from 959 to 1389 MB resident with no KV held. `tick` runs on the
    compute thread, at least every SNAPSHOT_S; the trim (malloc_trim, a few ms) runs only when
    no sequence is held, so no token waits for it. `work`, a count that grows with the rows the
    node computes, marks it as having held sequences too: a prefill stage allocates, runs,
    ships and frees a prompt's KV within one compute call, so a tick never sees it held (the
    demo's prefill node, also its gateway, grew 1177 -> 1253 MB over 28 rounds of 40 requests,
    never trimmed)."""

    def __init__(self, trim=None, clock=time.monotonic):
        if trim is None:
            from meshllm.engine.weights import release_freed_memory as trim
        self.trim, self.clock = trim, clock
        self.dirty = False  # sequences were held since the last trim
        self.idle_since = 0.0
        self.trims = 0
        self.work = 0  # `work` at the last tick

    def tick(self, holding: bool, work: int = 0) -> None:
        now = self.clock()
        if holding or work != self.work:
            self.dirty, self.idle_since, self.work = True, now, work
        elif self.dirty and now - self.idle_since >= TRIM_IDLE_S:
            self.dirty = False
            self.trim()
            self.trims += 1
