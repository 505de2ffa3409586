"""Pulling a model's tensors from one peer (the fetching half of weights over the mesh, whose wire
and rules roles/weights_fetch.py describes): `WeightsFetcher` asks a peer for the index and pulls
tensors with a window of requests in flight (`FlowControl`), `_Pull` verifies each tensor's sha256
and appends chunks in order to its `.part` in the cache; a peer that stalls, dies, errs or sends
bad bytes raises `PeerFailed`, and MeshWeights (weights_fetch.py) tries the next one."""

from __future__ import annotations

import logging
import queue
import random
import time
from collections import deque
from typing import Any

from meshllm.engine.tensor_cache import TensorCache, is_sha256, parse_index
from meshllm.mesh.loop import Worker
from meshllm.mesh.membership import Membership, Peer, PeerState
from meshllm.mesh.protocol import Message, MsgType, ProtocolError, TensorBuf, make
from meshllm.mesh.transport import Transport

log = logging.getLogger("meshllm.weights")

INDEX_TIMEOUT_S = 15.0  # a WEIGHTS_INDEX_REQ unanswered this long: the next peer
STALL_S = 15.0  # no chunk delivered for this long: the source peer is given up
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
