"""Weights over the mesh, the serving side: every node whose `model:` is a GGUF file on its disk
serves that file's tensors to peers that lack it (the wire protocol and the fetching side:
roles/weights_fetch.py).

It announces the names it serves in its heartbeat load (`has_model`) and answers on its own
`weights` Worker (never the I/O thread), reading byte ranges from the memory-mapped file; it hashes
each tensor once, when first asked for it (hashing a 40 GB file up front would take minutes).
Chunks go to the requester's ROUTER, sent from that Worker (a data-plane send: it blocks on a full
queue, it is never dropped), and only to the address membership knows for the requesting node id.
At most MAX_PENDING_PER_PEER requests per requester (MAX_PENDING_TOTAL in all) wait in its queue;
more are refused. No request may ask for more than MAX_CHUNK_BYTES.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from dataclasses import replace
from typing import Any

import numpy as np

from meshllm.defaults import served_name
from meshllm.engine.sources import gguf_reader, local_gguf_path, resolve_model
from meshllm.engine.tensor_cache import HEADER, HEADER_TYPE, args_to_wire, is_tensor_name
from meshllm.errors import ModelFileError
from meshllm.mesh.loop import Worker
from meshllm.mesh.membership import Membership, PeerState
from meshllm.mesh.protocol import Message, MsgType, ProtocolError, make
from meshllm.mesh.transport import Transport

log = logging.getLogger("meshllm.weights")

MAX_CHUNK_BYTES = 4 << 20  # the largest WEIGHTS_REQ a server answers
MAX_PENDING_PER_PEER = 64  # chunk requests one requester may have waiting in a server's queue
MAX_PENDING_TOTAL = 256  # ... and all requesters together


def has_model(load: Any) -> list[str]:
    """The model names a peer's heartbeat load says it serves (network data: anything else is [])."""
    names = load.get("has_model") if isinstance(load, dict) else None
    return [n for n in names if isinstance(n, str)] if isinstance(names, list) else []


# -- serving ------------------------------------------------------------------------------------
class WeightsServer:
    """Serves the tensors of this node's GGUF model file to peers that lack it."""

    def __init__(self, t: Transport, spec: str, members: Membership | None, worker: Worker):
        self.t, self.members, self.worker, self.spec = t, members, worker, spec
        self.name = served_name(spec)
        self.path = local_gguf_path(spec)
        self.aliases = sorted({self.name, self.path.name}) if self.path is not None else []
        self._lock = threading.Lock()
        self._pending: dict[str, int] = {}  # requester id -> requests queued (I/O thread adds, worker removes)
        self._sha: dict[str, str] = {}
        self._directory: dict[str, Any] | None = None
        self.chunks_sent = self.bytes_sent = 0
        t.on(MsgType.WEIGHTS_INDEX_REQ, self._on_index_req, worker)
        t.on(MsgType.WEIGHTS_REQ, self._on_req)  # I/O thread: counts the request, the worker answers it

    def directory(self) -> dict[str, Any]:
        """WEIGHTS_INDEX fields: the header's sha256, the model's shape and every tensor's type, shape
        and size, and the header itself as one more entry of raw bytes (tensor_cache.HEADER)."""
        if self._directory is None:
            f = gguf_reader(self.path)
            args = replace(resolve_model(self.spec).args, name=self.name)
            fingerprint = hashlib.sha256(f.header_bytes()).hexdigest()
            size = len(f.header_bytes())
            self._sha[HEADER] = fingerprint
            self._directory = {
                "fingerprint": fingerprint, "args": args_to_wire(args),
                "directory": {HEADER: [HEADER_TYPE, [size], size]} | {
                    n: [t.ggml_type, list(t.shape), t.nbytes] for n, t in f.tensors.items()}}
        return self._directory

    def _requester(self, node: str) -> str | None:
        """The address membership knows for a live node id (where its chunks may go)."""
        p = self.members.get(node) if self.members is not None and node else None
        return p.info.address if p is not None and p.state in (PeerState.ALIVE, PeerState.SUSPECT) else None

    def _on_index_req(self, msg: Message, reply) -> None:
        name = msg["model"]
        if name not in self.aliases:
            reply(make(MsgType.ERROR, code="not_found", message=f"{self.t.node_id} has no model file for {name!r:.80}"))
        elif self._requester(msg.src) is None:
            reply(make(MsgType.ERROR, code="unknown_peer", message=f"{self.t.node_id} does not know {msg.src!r:.40} "
                                                                     "as a live node yet"))
        else:
            try:
                d = self.directory()
            except ModelFileError as e:
                reply(make(MsgType.ERROR, code="not_found", message=str(e)))
                return
            reply(make(MsgType.WEIGHTS_INDEX, model=name, **d))

    def _on_req(self, msg: Message, reply) -> None:
        """I/O thread: admit the request into the worker's queue unless its sender has too many there."""
        with self._lock:
            n = self._pending.get(msg.src, 0)
            if n >= MAX_PENDING_PER_PEER or sum(self._pending.values()) >= MAX_PENDING_TOTAL:
                raise ProtocolError(f"WEIGHTS_REQ from {msg.src!r:.40}: {n} of its requests already wait "
                                    f"(limit {MAX_PENDING_PER_PEER} per peer, {MAX_PENDING_TOTAL} in all)")
            self._pending[msg.src] = n + 1
        self.worker.submit(lambda: self._serve(msg))

    def _serve(self, msg: Message) -> None:
        try:
            self._answer(msg)
        finally:
            with self._lock:
                n = self._pending.pop(msg.src, 1) - 1
                if n > 0:
                    self._pending[msg.src] = n

    def _answer(self, msg: Message) -> None:
        to = self._requester(msg.src)
        if to is None or msg["reply_to"] != to:
            raise ProtocolError(f"WEIGHTS_REQ from {msg.src!r:.40}: reply_to {msg['reply_to']!r:.60} is not the "
                                "address of that live node")
        name, off, length = msg["tensor"], msg["offset"], msg["length"]
        error = self._check(msg)
        head = dict(model=msg["model"], fetch=msg["fetch"], tensor=name, offset=off)
        if error is not None:
            chunk = make(MsgType.WEIGHTS_CHUNK, tensors={"data": np.zeros(0, np.uint8)}, total=0, sha256="",
                         error=error, **head)
        else:
            data = self._bytes(name)[off:off + length]  # a view of the memory-mapped file
            chunk = make(MsgType.WEIGHTS_CHUNK, tensors={"data": data}, total=self.directory()["directory"][name][2],
                         sha256=self._tensor_sha(name), **head)
        try:
            self.t.send(to, chunk)
        except TimeoutError as e:  # the requester stopped reading: it asks again if it still wants it
            log.warning("%s: weights chunk for %s not sent: %s", self.t.node_id, msg.src, e)
            return
        self.chunks_sent += 1
        self.bytes_sent += chunk.nbytes

    def _check(self, msg: Message) -> str | None:
        """Why a request cannot be served (None: it can)."""
        if msg["model"] not in self.aliases:
            return f"{self.t.node_id} has no model file for {msg['model']!r:.80}"
        try:
            d = self.directory()
        except ModelFileError as e:
            return str(e)
        name, off, length = msg["tensor"], msg["offset"], msg["length"]
        if msg["fingerprint"] != d["fingerprint"]:
            return f"{self.t.node_id}'s file of {msg['model']} is not the one indexed (fingerprint differs)"
        if not is_tensor_name(name) or name not in d["directory"]:
            return f"no tensor {name!r:.80}"
        total = d["directory"][name][2]
        if not (0 <= off < total and 0 < length <= MAX_CHUNK_BYTES and off + length <= total):
            return f"bytes [{off}, {off}+{length}) are not within {name}'s {total} (chunks up to {MAX_CHUNK_BYTES})"
        return None

    def _bytes(self, name: str) -> np.ndarray:
        """A tensor's raw bytes (or the header's), flat, from the memory-mapped file."""
        f = gguf_reader(self.path)
        return np.frombuffer(f.header_bytes(), np.uint8) if name == HEADER else f.raw(name).reshape(-1)

    def _tensor_sha(self, name: str) -> str:
        """sha256 of a tensor's raw bytes, computed the first time it is asked for (the header's is
        the fingerprint)."""
        h = self._sha.get(name)
        if h is None:
            h = self._sha[name] = hashlib.sha256(self._bytes(name)).hexdigest()
        return h
