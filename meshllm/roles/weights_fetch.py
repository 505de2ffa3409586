"""Weights over the mesh: a node without the model file fetches only its own layer range's tensors
from a peer that has the file; every node with the file serves them.

Wire (types in mesh/protocol.py):

    fetcher --WEIGHTS_INDEX_REQ {model}-------------------------------> server   request/reply
    server  --WEIGHTS_INDEX {model, fingerprint, args, tensors}-------> fetcher
    fetcher --WEIGHTS_REQ {tensor, offset, length, fetch, reply_to}---> server   a window of them
    server  --WEIGHTS_CHUNK {tensor, offset, total, sha256} + bytes---> fetcher's ROUTER

- **What moves**: the raw GGUF tensor bytes (Q4_1 is ~7x smaller than fp32) of the shard's tensors
  only, `engine/sources.py`'s `gguf_shard_names` (the rule the loader uses): `blk.{i}.*` for i in
  [a, b), `token_embd.weight` when a == 0, `output_norm.weight` and the head (`output.weight`, or
  `token_embd.weight` when tied) when b == n_layers (the index carries the shape the shard needs:
  ModelArgs and each tensor's type, shape and size), never another range. A gateway without the
  file fetches the file's header instead (`MeshWeights.header`: the index lists it as one more
  entry, tensor_cache.HEADER, whose sha256 is the fingerprint), for the tokenizer.
- **Serving** (`WeightsServer`, roles/weights_serve.py): a node whose `model:` is a GGUF file on its
  disk announces the names it serves in its heartbeat load (`has_model`) and answers on its own
  `weights` Worker (never the I/O thread) from the memory-mapped file, sending each chunk only to
  the address membership knows for the requesting node id; see that module for the details.
- **Fetching** (`MeshWeights.source`, called by ShardHolder.load (roles/shard.py) on the compute thread): ask a
  peer announcing the model for the index (else every live peer), then pull the missing tensors
  with a window of requests in flight (roles/weights_pull.py; `FlowControl`: chunks of ~40 ms of link time, 64 KiB-4 MiB,
  and enough bytes in flight to cover the round trip plus QUEUE_S, so a 100 Mbit/s link stays full
  while the fetch adds at most ~QUEUE_S of delay to heartbeats and activations sharing the link).
- **Verified and resumable**: chunks are appended in order to `<tensor>.part` in the cache
  (engine/tensor_cache.py); a complete tensor becomes `<tensor>.bin` only when its sha256 matches
  the one the server sent, else it is fetched again (weights_pull.MAX_TENSOR_RETRIES). A fetch killed midway
  resumes at each `.part`'s size on the next start (one chunk is always re-asked, to learn the
  tensor's hash). A complete, re-verified cache loads with no network at all.
- **Failures**: every wait is bounded: the index request (weights_pull.INDEX_TIMEOUT_S), a peer that delivers
  nothing for weights_pull.STALL_S or dies (membership) or answers an error is left for the next peer;
  MAX_ROUNDS passes over the peers, then a ModelFileError that names what each peer said.

A coordinator without the file plans from the shape in a peer's index (`MeshWeights.args`).
Out of scope: HF safetensors directories (only GGUF files are served), and serving from a cache.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from meshllm.defaults import served_name
from meshllm.engine.sources import ModelSource, gguf_shard_names, resolve_model
from meshllm.engine.tensor_cache import HEADER, TensorCache, safe_dir_name
from meshllm.errors import ModelFileError
from meshllm.mesh.inbox import RemoteError
from meshllm.mesh.loop import Worker
from meshllm.mesh.membership import Membership, Peer
from meshllm.mesh.protocol import ProtocolError
from meshllm.mesh.transport import Transport
from meshllm.node_config import NodeConfig
from meshllm.roles.weights_pull import PeerFailed, WeightsFetcher
from meshllm.roles.weights_serve import WeightsServer, has_model
from meshllm.shapes import ModelArgs

log = logging.getLogger("meshllm.weights")

CACHE_ENV = "MESHLLM_WEIGHTS_CACHE"  # the cache root when the node file has no `weights_cache`
DEFAULT_CACHE = "~/.cache/meshllm/weights"
ANNOUNCE_WAIT_S = 10.0  # wait this long for a peer announcing the model before asking every live peer
RETRY_PAUSE_S = 1.0  # between passes over the peers
MAX_ROUNDS = 3  # passes over the candidate peers before the fetch fails


class MeshWeights:
    """This node's part in weights over the mesh: it serves its model file's tensors to peers and,
    when it has no file, gives ShardHolder.load a cache holding its layer range, fetched first."""

    def __init__(self, t: Transport, cfg: NodeConfig, members: Membership | None):
        self.t, self.cfg, self.members = t, cfg, members
        self.spec, self.name = cfg.model, served_name(cfg.model)
        self.worker = Worker(f"weights-{cfg.id}")
        self.server = WeightsServer(t, cfg.model, members, self.worker)
        self.fetcher = WeightsFetcher(t, members, cfg.advertise_address, self.worker)
        root = cfg.weights_cache or os.environ.get(CACHE_ENV) or DEFAULT_CACHE
        self.cache_dir = Path(root).expanduser() / safe_dir_name(self.name)
        self.stats: dict[str, Any] | None = None  # the last shard's: fetched bytes, source, rate

    def start(self) -> None:
        try:
            err = self.missing() if self.cfg.fetch_weights else None
        except ModelFileError:
            err = None  # a broken file here: ShardHolder.load says so when it needs it
        if err is not None:  # a typo'd path looks the same as a deliberate fetch: say it once, up front
            log.warning("%s: %s: its layers and tokenizer will be fetched from a peer that has it "
                        "(fetch_weights: true)", self.cfg.id, err)
            self.check_cache_dir()  # before joining: found only once a plan came, it cost a re-plan
        self.worker.start()

    def check_cache_dir(self) -> None:
        """ModelFileError if the weights cache cannot be made or written here."""
        try:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            if not os.access(self.cache_dir, os.W_OK | os.X_OK):
                raise PermissionError(13, "not writable by this user")
        except OSError as e:
            raise ModelFileError(f"{self.name} is not on this node and its weights cache {self.cache_dir} cannot "
                                 f"be used: {e.strerror or e} (weights_cache in {self.cfg.source}, or "
                                 f"${CACHE_ENV})") from None

    def close(self) -> None:
        self.worker.close()

    def announce(self) -> dict[str, Any]:
        """What the heartbeat load says: the model names this node serves weights for."""
        return {"has_model": self.server.aliases} if self.server.aliases else {}

    def missing(self) -> ModelFileError | None:
        """Why this node must fetch its model's weights (None: they are here). A model file that is
        here but broken raises: that is for its owner to fix, not for the mesh to hide."""
        try:
            resolve_model(self.spec)
        except ModelFileError as e:
            if Path(self.spec).exists():
                raise
            return e
        return None

    def args(self) -> ModelArgs:
        """The model's shape: from the file, else from the index a peer sent (fetched if not cached)."""
        if self.missing() is None:
            from meshllm.config import resolve_args

            return resolve_args(self.spec)
        cache = TensorCache(self.cache_dir)
        if cache.index is None:
            self._with_a_peer(lambda peer: cache.set_index(self.fetcher.index(peer, self.name)), "its shape")
        return cache.args

    def header(self) -> tuple[Path, ModelArgs]:
        """The model file's header (its metadata: the tokenizer, the chat template) and the model's
        shape, for a gateway without the file: from the cache, else fetched from a peer first."""
        self.check_fetch_allowed()
        cache = TensorCache(self.cache_dir)
        path = cache.header_path()
        if path is None:
            def fetch(peer: Peer) -> None:
                cache.set_index(self.fetcher.index(peer, self.name))
                if HEADER not in cache.index["tensors"]:
                    raise PeerFailed("its index lists no file header (an older meshllm)")
                log.info("%s: fetching the header of %s (%.1f MB: the tokenizer) from %s", self.t.node_id,
                         self.name, cache.nbytes(HEADER) / 1e6, peer.info.id)
                self.fetcher.pull(peer, self.name, cache, [HEADER])
                if cache.header_path() is None:
                    raise PeerFailed("the header failed its sha256 check after the fetch")

            self._with_a_peer(fetch, "the file's header (the tokenizer)")
            path = cache.header_path()
        return path, cache.args

    def check_fetch_allowed(self) -> None:
        """ModelFileError if the file is not here and the node file forbids fetching it."""
        err = self.missing()
        if err is not None and not self.cfg.fetch_weights:
            raise ModelFileError(f"{err}; fetch_weights is false in {self.cfg.source}, so it is not fetched "
                                 "from a peer")

    def source(self, start: int, end: int | None) -> str | ModelSource:
        """What load_transformer builds the shard [start, end) from: the model spec when the file is
        here; else the tensor cache, once it holds every tensor of the range, verified."""
        if self.missing() is None:
            return self.spec
        self.check_fetch_allowed()
        cache = TensorCache(self.cache_dir)
        if cache.index is not None:
            names = self._names(cache.args, start, end)
            if all([cache.verify(n) for n in names]):  # every one hashed: a corrupt file is deleted
                self._report(cache, names, start, end, {"source": "cache", "bytes": 0, "resumed_bytes": 0})
                return cache.source()
        t0, bytes0, resumed = time.monotonic(), self.fetcher.bytes, []

        def fetch(peer: Peer) -> None:
            cache.set_index(self.fetcher.index(peer, self.name))
            names = self._names(cache.args, start, end)
            todo = [n for n in names if not cache.complete(n)]
            if not resumed:  # what an earlier, interrupted start left on disk
                resumed.append(sum(min(cache.part_size(n), cache.nbytes(n) - 1) for n in todo))
            log.info("%s: fetching %d tensors of %s layers [%d, %s) (%.1f MB) from %s", self.t.node_id, len(todo),
                     self.name, start, end, sum(cache.nbytes(n) for n in todo) / 1e6, peer.info.id)
            pulled = self.fetcher.pull(peer, self.name, cache, todo)
            if not all([cache.verify(n) for n in names]):
                raise PeerFailed("tensors failed their sha256 check after the fetch")
            self._report(cache, names, start, end, {**pulled, "bytes": self.fetcher.bytes - bytes0,
                                                    "resumed_bytes": resumed[0], "wall_s": round(time.monotonic() - t0, 3)})

        self._with_a_peer(fetch, f"layers [{start}, {end})")
        return cache.source()

    def _names(self, args: ModelArgs, start: int, end: int | None) -> list[str]:
        if not 0 <= start < (end if end is not None else args.n_layers) <= args.n_layers:
            raise ModelFileError(f"{self.name}: layers [{start}, {end}) are not within its {args.n_layers} layers")
        return list(dict.fromkeys(gguf_shard_names(args, start, end).values()))  # tied: the embedding once

    def _with_a_peer(self, fn, what: str) -> None:
        """Run fn(peer) with the candidate peers in turn until one succeeds; ModelFileError if none does."""
        errors: list[str] = []
        for peer in self._candidates():
            try:
                fn(peer)
                return
            except (TimeoutError, RemoteError, ProtocolError, PeerFailed) as e:
                errors.append(f"{peer.info.id}: {e}")
                log.warning("%s: weights of %s from %s: %s; trying another peer", self.t.node_id, self.name,
                            peer.info.id, e)
            except OSError as e:  # this node's disk (full, read-only), not the peer's fault: no other peer helps
                raise ModelFileError(f"{self.name}: {what} from {peer.info.id} cannot be written to the weights "
                                     f"cache {self.cache_dir}: {e.strerror or e} (free some space, or set "
                                     f"weights_cache in {self.cfg.source})") from None
        raise ModelFileError(f"{self.name} is not on this node and no peer could send {what}: "
                             f"{'; '.join(errors[-4:]) or 'no live peer'}")

    def _candidates(self) -> Iterator[Peer]:
        """Peers announcing the model (same zone first), else every live peer; MAX_ROUNDS passes."""
        deadline = time.monotonic() + ANNOUNCE_WAIT_S
        for rnd in range(MAX_ROUNDS):
            peers = self._announcing()
            while not peers and time.monotonic() < deadline:
                time.sleep(0.25)
                peers = self._announcing()
            yield from peers or (self.members.live() if self.members is not None else [])
            if rnd + 1 < MAX_ROUNDS:
                time.sleep(RETRY_PAUSE_S)

    def _announcing(self) -> list[Peer]:
        if self.members is None:
            return []
        peers = [p for p in self.members.live() if self.name in has_model(p.load)]
        return sorted(peers, key=lambda p: (p.info.zone != self.cfg.zone, p.info.id))

    def _report(self, cache: TensorCache, names: list[str], start: int, end: int | None,
                figures: dict[str, Any]) -> None:
        """Keep and log the shard's figures. bytes: chunk bytes fetched in this start (every peer tried);
        resumed_bytes: what an interrupted start had left in `.part` files; seconds / mbps: the last
        pull's transfer (first request to last delivery); total_bytes: the range's raw tensor bytes."""
        total = sum(cache.nbytes(n) for n in names)
        self.stats = {"model": self.name, "layers": [start, end if end is not None else cache.args.n_layers],
                      "total_bytes": total, **figures}
        if figures["source"] == "cache":
            log.info("%s: layers [%d, %s) of %s from the weights cache (%.1f MB, verified; no network)",
                     self.t.node_id, start, end, self.name, total / 1e6)
        else:
            log.info("%s: fetched %d bytes of %s layers [%d, %s) (%d tensors, %d bytes resumed) from %s: %.2f s "
                     "at %.1f Mbit/s", self.t.node_id, figures["bytes"], self.name, start, end, figures["tensors"],
                     figures["resumed_bytes"], figures["source"], figures["seconds"], figures["mbps"])
