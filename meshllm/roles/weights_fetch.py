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
  with a window of requests in flight (`FlowControl`: chunks of ~40 ms of link time, 64 KiB-4 MiB,
  and enough bytes in flight to cover the round trip plus QUEUE_S, so a 100 Mbit/s link stays full
  while the fetch adds at most ~QUEUE_S of delay to heartbeats and activations sharing the link).
- **Verified and resumable**: chunks are appended in order to `<tensor>.part` in the cache
  (engine/tensor_cache.py); a complete tensor becomes `<tensor>.bin` only when its sha256 matches
  the one the server sent, else it is fetched again (MAX_TENSOR_RETRIES). A fetch killed midway
  resumes at each `.part`'s size on the next start (one chunk is always re-asked, to learn the
  tensor's hash). A complete, re-verified cache loads with no network at all.
- **Failures**: every wait is bounded: the index request (INDEX_TIMEOUT_S), a peer that delivers
  nothing for STALL_S or dies (membership) or answers an error is left for the next peer;
  MAX_ROUNDS passes over the peers, then a ModelFileError that names what each peer said.

A coordinator without the file plans from the shape in a peer's index (`MeshWeights.args`).
Out of scope: HF safetensors directories (only GGUF files are served), and serving from a cache.
"""

from __future__ import annotations

import logging
import os
import queue
import random
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from meshllm.defaults import served_name
from meshllm.engine.sources import ModelSource, gguf_shard_names, resolve_model
from meshllm.engine.tensor_cache import HEADER, TensorCache, is_sha256, parse_index, safe_dir_name
from meshllm.errors import ModelFileError
from meshllm.mesh.loop import Worker
from meshllm.mesh.membership import Membership, Peer, PeerState
from meshllm.mesh.protocol import Message, MsgType, ProtocolError, TensorBuf, make
from meshllm.mesh.sockets import RemoteError
from meshllm.mesh.transport import Transport
from meshllm.node_config import NodeConfig
from meshllm.roles.weights_serve import WeightsServer, has_model
from meshllm.shapes import ModelArgs

log = logging.getLogger("meshllm.weights")

CACHE_ENV = "MESHLLM_WEIGHTS_CACHE"  # the cache root when the node file has no `weights_cache`
DEFAULT_CACHE = "~/.cache/meshllm/weights"
INDEX_TIMEOUT_S = 15.0  # a WEIGHTS_INDEX_REQ unanswered this long: the next peer
STALL_S = 15.0  # no chunk delivered for this long: the source peer is given up
ANNOUNCE_WAIT_S = 10.0  # wait this long for a peer announcing the model before asking every live peer
RETRY_PAUSE_S = 1.0  # between passes over the peers
MAX_ROUNDS = 3  # passes over the candidate peers before the fetch fails
MAX_TENSOR_RETRIES = 2  # sha256 mismatches of one tensor before its source peer is given up
MAX_INFLIGHT = 32  # a fetcher's outstanding chunk requests (below weights_serve.MAX_PENDING_PER_PEER)


class PeerFailed(Exception):
    """The source peer cannot (or no longer) serve this fetch: the next one is tried."""


class FlowControl:
    """How much a fetch asks for at once, from what it measures (pure: the time is passed in).

    A chunk lasts about CHUNK_S on the link (MIN_CHUNK..MAX_CHUNK, a power of two) and the bytes in
    flight cover the shortest round trip seen plus QUEUE_S at the delivery rate: the link stays full
    (more in flight would only queue), and the fetch adds at most about QUEUE_S of delay to anything
    else crossing the same link, at 1 Mbit/s as at 1 Gbit/s. Before the first deliveries it asks for
    FIRST_CHUNK x 4."""

    CHUNK_S, QUEUE_S, RATE_WINDOW_S = 0.04, 0.25, 1.0
    MIN_CHUNK, MAX_CHUNK, FIRST_CHUNK = 64 << 10, 4 << 20, 256 << 10
    MAX_WINDOW = 32 << 20

    def __init__(self) -> None:
        self.rate: float | None = None  # bytes/s delivered over the last RATE_WINDOW_S
        self.min_latency_s: float | None = None  # shortest request -> delivery time seen
        self._samples: deque[tuple[float, int]] = deque()  # (delivered at, bytes)

    def delivered(self, nbytes: int, sent_at: float, now: float) -> None:
        latency = now - sent_at
        self.min_latency_s = latency if self.min_latency_s is None else min(self.min_latency_s, latency)
        self._samples.append((now, nbytes))
        while now - self._samples[0][0] > self.RATE_WINDOW_S:
            self._samples.popleft()
        span = now - self._samples[0][0]
        if len(self._samples) >= 2 and span > 0:
            self.rate = sum(n for _, n in list(self._samples)[1:]) / span

    @property
    def chunk_bytes(self) -> int:
        if self.rate is None:
            return self.FIRST_CHUNK
        want = max(self.MIN_CHUNK, min(self.MAX_CHUNK, int(self.rate * self.CHUNK_S)))
        return 1 << (want.bit_length() - 1)

    @property
    def window_bytes(self) -> int:
        if self.rate is None:
            return 4 * self.FIRST_CHUNK
        want = self.rate * (self.QUEUE_S + (self.min_latency_s or 0.0))
        return int(max(2 * self.chunk_bytes, min(self.MAX_WINDOW, want)))


# -- fetching -----------------------------------------------------------------------------------
class WeightsFetcher:
    """The fetching side's network half: the index request and the windowed pull from one peer."""

    def __init__(self, t: Transport, members: Membership | None, my_address: str, worker: Worker):
        self.t, self.members, self.my_address = t, members, my_address
        self._inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._fid = 0  # id of the running pull (0: none)
        self.stale = 0  # chunks of no running pull (late ones of an abandoned peer)
        self.bytes = 0  # chunk bytes accepted by every pull so far
        t.on(MsgType.WEIGHTS_CHUNK, self._on_chunk, worker)

    def _on_chunk(self, msg: Message, reply) -> None:
        """Weights worker: hand a chunk of the running pull to its loop; drop any other."""
        if self._fid and msg["fetch"] == self._fid:
            self._inbox.put(msg)
        else:
            self.stale += 1

    def index(self, peer: Peer, model: str) -> dict[str, Any]:
        """The model's directory from `peer` (validated). Raises TimeoutError, RemoteError, ProtocolError."""
        r = self.t.request(peer.info.address, make(MsgType.WEIGHTS_INDEX_REQ, model=model), INDEX_TIMEOUT_S)
        if r.type is not MsgType.WEIGHTS_INDEX or r["model"] != model:
            raise ProtocolError(f"{peer.info.id} answered WEIGHTS_INDEX_REQ with {r.type.name}")
        try:
            return parse_index(model, r["fingerprint"], r["args"], r["directory"])
        except ValueError as e:
            raise ProtocolError(f"WEIGHTS_INDEX from {peer.info.id}: {e}") from None

    def pull(self, peer: Peer, model: str, cache: TensorCache, names: list[str]) -> dict[str, Any]:
        """Fetch the tensors `names` (not complete in `cache`) from `peer`; PeerFailed if it cannot."""
        while True:  # chunks of an earlier pull still queued are not this one's
            try:
                self._inbox.get_nowait()
            except queue.Empty:
                break
        pull = _Pull(self, peer, model, cache, names, random.getrandbits(62) | 1)
        self._fid = pull.fid
        try:
            pull.run()
        finally:
            self._fid = 0
            self.bytes += pull.bytes
            pull.close()
        return pull.stats()

    def alive(self, peer: Peer) -> bool:
        p = self.members.get(peer.info.id) if self.members is not None else None
        return p is not None and p.info.incarnation == peer.info.incarnation and \
            p.state in (PeerState.ALIVE, PeerState.SUSPECT)


class _Pull:
    """Fetching some tensors from one peer: what is asked, what arrived, what is on disk."""

    def __init__(self, f: WeightsFetcher, peer: Peer, model: str, cache: TensorCache, names: list[str], fid: int):
        self.f, self.peer, self.model, self.cache, self.fid = f, peer, model, cache, fid
        self.flow = FlowControl()
        self.todo: deque[str] = deque()  # tensors with bytes not yet asked for, in order
        self.next_off: dict[str, int] = {}
        self.written: dict[str, int] = {}  # bytes on disk: the `.part` prefix
        self.files: dict[str, Any] = {}
        self.early: dict[str, dict[int, TensorBuf]] = {}  # chunks that arrived ahead of the prefix
        self.shas: dict[str, str] = {}  # what the peer says each tensor hashes to
        self.inflight: dict[tuple[str, int], tuple[int, float]] = {}  # (tensor, offset) -> (length, sent at)
        self.inflight_bytes = self.bytes = self.refetched = self.done = 0
        self.retries: dict[str, int] = {}
        self.left = set(names)
        self.first_sent: float | None = None
        self.last_delivery = time.monotonic()
        for n in names:
            # resume at the `.part`'s size, but ask for at least its last byte: a chunk says its sha256
            self._restart(n, min(cache.part_size(n), cache.nbytes(n) - 1))

    def _restart(self, name: str, offset: int) -> None:
        self.written[name] = self.next_off[name] = offset
        self.early[name] = {}
        if name not in self.todo:
            self.todo.append(name)

    def run(self) -> None:
        last_progress = time.monotonic()
        while self.left:
            self.fill()
            try:
                msg = self.f._inbox.get(timeout=0.25)
            except queue.Empty:
                msg = None
            now = time.monotonic()
            if msg is not None and self.on_chunk(msg, now):
                last_progress = now
            elif now - last_progress > STALL_S:
                raise PeerFailed(f"no chunk from {self.peer.info.id} for {STALL_S:g} s")
            if msg is None and not self.f.alive(self.peer):
                raise PeerFailed(f"{self.peer.info.id} is no longer alive")

    def fill(self) -> None:
        """Ask for more while the window has room."""
        while self.todo and len(self.inflight) < MAX_INFLIGHT and self.inflight_bytes < self.flow.window_bytes:
            name = self.todo[0]
            off, total = self.next_off[name], self.cache.nbytes(name)
            length = min(self.flow.chunk_bytes, total - off)
            self.next_off[name] = off + length
            if off + length >= total:
                self.todo.popleft()
            now = time.monotonic()
            self.first_sent = self.first_sent or now
            self.inflight[(name, off)] = (length, now)
            self.inflight_bytes += length
            req = make(MsgType.WEIGHTS_REQ, model=self.model, fingerprint=self.cache.index["fingerprint"],
                       fetch=self.fid, tensor=name, offset=off, length=length, reply_to=self.f.my_address)
            try:
                self.f.t.send(self.peer.info.address, req)
            except TimeoutError as e:
                raise PeerFailed(f"{self.peer.info.id} takes no requests: {e}") from None

    def on_chunk(self, msg: Message, now: float) -> bool:
        """A chunk of this pull: check it, keep it; True if it was one this pull asked for."""
        error = msg.fields.get("error")
        if error is not None:
            raise PeerFailed(f"{self.peer.info.id}: {str(error)[:200]}")
        key = (msg["tensor"], msg["offset"])
        entry = self.inflight.pop(key, None)
        if entry is None:
            return False  # a duplicate, or nothing this pull asked for
        length, sent_at = entry
        self.inflight_bytes -= length
        name, data, sha = key[0], msg.tensors["data"], msg["sha256"]
        if data.dtype != "uint8" or data.nbytes != length or msg["total"] != self.cache.nbytes(name) \
                or not is_sha256(sha):
            raise PeerFailed(f"{self.peer.info.id} sent a malformed chunk of {name}")
        if self.shas.setdefault(name, sha) != sha:
            raise PeerFailed(f"{self.peer.info.id}'s {name} changed while it was fetched")
        self.flow.delivered(length, sent_at, now)
        self.bytes += length
        self.last_delivery = now
        self.early[name][key[1]] = data
        self._write(name)
        return True

    def _write(self, name: str) -> None:
        """Append the chunks that continue the `.part` prefix; finish the tensor when it is whole."""
        early = self.early[name]
        while (buf := early.pop(self.written[name], None)) is not None:
            f = self.files.get(name)
            if f is None:
                f = self.files[name] = self.cache.open_part(name, self.written[name])
            view = buf.data
            while view.nbytes:
                view = view[f.write(view):]
            self.written[name] += buf.nbytes
        if self.written[name] == self.cache.nbytes(name):
            self.files.pop(name).close()
            self._finish(name)

    def _finish(self, name: str) -> None:
        if self.cache.finish(name, self.shas[name]):
            self.left.discard(name)
            self.done += 1
            return
        self.refetched += 1
        self.retries[name] = self.retries.get(name, 0) + 1
        log.warning("%s: %s from %s does not match its sha256; fetching it again", self.f.t.node_id, name,
                    self.peer.info.id)
        if self.retries[name] > MAX_TENSOR_RETRIES:
            raise PeerFailed(f"{name} from {self.peer.info.id} failed its sha256 check {self.retries[name]} times")
        self._restart(name, 0)

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        self.files.clear()

    def stats(self) -> dict[str, Any]:
        """This pull's figures: its transfer time runs from the first request to the last delivery."""
        seconds = max(1e-9, self.last_delivery - self.first_sent) if self.first_sent else 0.0
        return {"source": self.peer.info.id, "pulled_bytes": self.bytes, "tensors": self.done,
                "refetched": self.refetched, "seconds": round(seconds, 3),
                "mbps": round(self.bytes * 8 / seconds / 1e6, 2) if seconds else 0.0}


# -- the node's side ----------------------------------------------------------------------------
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
        self.worker.start()

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
