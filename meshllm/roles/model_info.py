"""What a gateway knows of the model it serves: the tokenizer (with the chat template and the end
tokens), the context size, the vocabulary and the model's shape. The gateway holds no weights.

From the model file when it is on this node. A node without it takes them from the file's header
and the index a peer that has the file sends (roles/weights_fetch.py, `MeshWeights.header`:
verified against the index's fingerprint, cached), on a thread of its own once the node has
joined (`start`); until then `tokenizer` is None and `error` says why (the API answers 503).
"""

from __future__ import annotations

import logging
import threading

from meshllm.errors import ModelFileError

log = logging.getLogger("meshllm.gateway")

RETRY_S = 10.0  # a header that could not be fetched is tried again after this


class ModelInfo:
    def __init__(self, me: str, name: str):
        self.me, self.name = me, name
        self.tokenizer = None
        self.max_context = 0
        self.vocab = 0
        self.args = None  # ModelArgs, once known
        self.error = ""  # why there is no tokenizer yet
        self._weights = None  # MeshWeights to fetch the header from, when the file is not here
        self._closed = threading.Event()

    def load(self, spec: str, weights) -> None:
        """From the file if it is here (a bad model path fails here); else note that the header
        must be fetched (ModelFileError if the node file forbids fetching)."""
        from meshllm.engine.tokenizer import load_tokenizer
        from meshllm.engine.weights import resolve_model

        if weights.missing() is not None:
            weights.check_fetch_allowed()
            self._weights, self.error = weights, f"fetching {self.name}'s tokenizer from a peer"
            return
        src = resolve_model(spec)
        self._set(load_tokenizer(src), src.args)

    def shape(self):
        """The model's shape: known, or from a peer's index (MeshWeights.args; blocking)."""
        return self.args if self.args is not None else self._weights.args()

    def start(self) -> None:
        """After the node has joined: fetch the header on a thread of its own if the file is not here."""
        if self._weights is not None:
            threading.Thread(target=self._fetch, daemon=True, name=f"gw-info-{self.me}").start()

    def close(self) -> None:
        self._closed.set()

    def _set(self, tokenizer, args) -> None:
        self.args, self.max_context, self.vocab = args, args.max_seq_len, args.vocab_size
        self.tokenizer, self.error = tokenizer, ""

    def _fetch(self) -> None:
        from meshllm.engine.gguf_file import GGUFFile
        from meshllm.engine.tokenizer import tokenizer_from_gguf

        while not self._closed.is_set():
            try:
                path, args = self._weights.header()
                break
            except ModelFileError as e:
                self.error = str(e)
                log.warning("%s: no tokenizer yet: %s; trying again in %.0f s", self.me, e, RETRY_S)
                self._closed.wait(RETRY_S)
        else:
            return
        try:
            self._set(tokenizer_from_gguf(GGUFFile(path, header_only=True)), args)
        except ModelFileError as e:
            self.error = f"the model's tokenizer cannot be used: {e}"
            log.error("%s: %s", self.me, self.error)
            return
        log.info("%s: tokenizer of %s from the file's header (%s)", self.me, self.name, path)
