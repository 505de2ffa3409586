"""Per-sequence KV slots for one shard (layers [start, end)).

Each sequence id owns one slot: K and V buffers of shape
(n_local_layers, n_kv_heads, capacity, head_dim) whose capacity is `slot_capacity` of the
positions they must hold: doubling up to LADDER_DOUBLE_UNTIL positions, then in steps of
LADDER_STEP, so a slot never holds much more than its sequence needs (the leader's KV
admission, roles/batcher.py, charges each sequence that capacity). A slot
records how many positions are *committed*; a forward pass writes positions
[start_pos, start_pos + n) and commits them at the end of the pass.

- `truncate(seq, n)` rolls a slot back to n positions (rejected draft tokens).
- `export(seq, layers)` / `import_seq(...)` move one sequence's KV for a layer
  range between caches (prefill replica -> decode replica). Exported tensors are
  plain contiguous tensors; protocol.py encodes them for the wire.

Pure torch; no sockets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MIN_CAPACITY = 64
LADDER_DOUBLE_UNTIL = 1024  # positions: slots double up to here,
LADDER_STEP = 512  # then grow by this many positions at a time


def slot_capacity(positions: int) -> int:
    """The capacity of a slot that must hold `positions` positions (a pure function of it, so a
    sequence's largest slot is known from its longest context before it runs)."""
    n = max(positions, 1)
    if n <= LADDER_DOUBLE_UNTIL:
        return max(_MIN_CAPACITY, 1 << (n - 1).bit_length())
    return -(-n // LADDER_STEP) * LADDER_STEP


@dataclass
class _Slot:
    k: torch.Tensor  # (n_local, nkv, cap, hd)
    v: torch.Tensor
    length: int = 0  # committed positions


class KVCache:
    def __init__(self, start: int, end: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32):
        self.start, self.end = start, end
        self.n_kv_heads, self.head_dim, self.dtype = n_kv_heads, head_dim, dtype
        self._slots: dict[int, _Slot] = {}

    # -- slot lifecycle ----------------------------------------------------------------
    def allocate(self, seq_id: int, capacity: int = _MIN_CAPACITY, length: int = 0) -> None:
        """A new slot; `length` > 0 pretends that many (zero) positions are already held, a scratch
        slot for a sequence released while its micro-batch was in flight (its output is discarded)."""
        if seq_id in self._slots:
            raise KeyError(f"sequence {seq_id} already has a KV slot")
        shape = (self.end - self.start, self.n_kv_heads, slot_capacity(max(capacity, length)), self.head_dim)
        self._slots[seq_id] = _Slot(torch.zeros(shape, dtype=self.dtype), torch.zeros(shape, dtype=self.dtype),
                                    length)

    def free(self, seq_id: int) -> None:
        self._slots.pop(seq_id, None)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def seq_ids(self) -> list[int]:
        return list(self._slots)

    def length(self, seq_id: int) -> int:
        return self._slot(seq_id).length

    def truncate(self, seq_id: int, length: int) -> None:
        slot = self._slot(seq_id)
        if not 0 <= length <= slot.length:
            raise ValueError(f"sequence {seq_id}: cannot truncate {slot.length} positions to {length}")
        slot.length = length

    def fork(self, src: int, dst: int, length: int, capacity: int = _MIN_CAPACITY) -> None:
        """A new slot `dst` holding a copy of the first `length` positions of `src` (a branch)."""
        slot = self._slot(src)
        if not 0 <= length <= slot.length:
            raise ValueError(f"sequence {src}: cannot fork {length} of its {slot.length} positions")
        self.allocate(dst, max(capacity, length))
        new = self._slots[dst]
        new.k[:, :, :length] = slot.k[:, :, :length]
        new.v[:, :, :length] = slot.v[:, :, :length]
        new.length = length

    def nbytes(self) -> int:
        return sum(s.k.nbytes + s.v.nbytes for s in self._slots.values())

    def slot_bytes(self, capacity: int) -> int:
        """Bytes of K and V of a slot that must hold `capacity` positions (as allocated: `slot_capacity`)."""
        return slot_capacity(capacity) * self.token_bytes()

    def token_bytes(self) -> int:
        """Bytes of K and V per position of a slot (all of this shard's layers)."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * (self.end - self.start) * self.n_kv_heads * self.head_dim * element

    # -- used by the forward pass -----------------------------------------------------
    def write(self, layer: int, seq_id: int, start_pos: int, k: torch.Tensor,
              v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (t, nkv, hd) at [start_pos, start_pos+t) of `layer`.

        Returns views (nkv, start_pos + t, hd) of that layer's K and V.
        """
        slot = self._slot_at(seq_id, start_pos)
        end = start_pos + k.shape[0]
        if end > slot.k.shape[2]:
            self._grow(slot, end)
        li = layer - self.start
        slot.k[li, :, start_pos:end] = k.transpose(0, 1)
        slot.v[li, :, start_pos:end] = v.transpose(0, 1)
        return slot.k[li, :, :end], slot.v[li, :, :end]

    def decode_slab(self, seq_id: int, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For a one-token step at `pos`: views (n_local, nkv, pos + 1, hd) of the slot's K and V
        over all its layers, room for position `pos` made; the forward writes that position of
        each layer itself (model.Attention's one-token rows)."""
        slot = self._slot_at(seq_id, pos)
        if pos + 1 > slot.k.shape[2]:
            self._grow(slot, pos + 1)
        return slot.k[:, :, :pos + 1], slot.v[:, :, :pos + 1]

    def commit(self, spans) -> None:
        for s in spans:
            self._slot(s.seq_id).length = s.start_pos + s.n_tokens

    # -- transfer -----------------------------------------------------------------------
    def export(self, seq_id: int, layers: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of one sequence for global layers [a, b): each (b-a, nkv, length, hd), contiguous."""
        a, b = layers or (self.start, self.end)
        if not self.start <= a < b <= self.end:
            raise ValueError(f"layers [{a}, {b}) are not inside this cache's [{self.start}, {self.end})")
        slot = self._slot(seq_id)
        sl = slice(a - self.start, b - self.start)
        return (slot.k[sl, :, :slot.length].contiguous(), slot.v[sl, :, :slot.length].contiguous())

    def import_seq(self, seq_id: int, k: torch.Tensor, v: torch.Tensor, layer_start: int | None = None) -> None:
        """Install exported K/V for layers [layer_start, layer_start + k.shape[0]).

        The first import of a sequence allocates its slot; further imports (other
        layer ranges, e.g. from several prefill stages) must carry the same length.
        """
        a = self.start if layer_start is None else layer_start
        b = a + k.shape[0]
        n_pos = k.shape[2]
        if not self.start <= a < b <= self.end:
            raise ValueError(f"imported layers [{a}, {b}) are not inside [{self.start}, {self.end})")
        if k.shape != v.shape or k.shape[1:] != (b - a, self.n_kv_heads, n_pos, self.head_dim)[1:]:
            raise ValueError(f"imported KV has shape {tuple(k.shape)}, expected "
                             f"({b - a}, {self.n_kv_heads}, n, {self.head_dim})")
        if seq_id not in self._slots:
            self.allocate(seq_id, n_pos)
        slot = self._slots[seq_id]
        if slot.length not in (0, n_pos):
            raise ValueError(f"sequence {seq_id}: importing {n_pos} positions into a slot holding {slot.length}")
        if n_pos > slot.k.shape[2]:
            self._grow(slot, n_pos)
        slot.k[a - self.start:b - self.start, :, :n_pos] = k
        slot.v[a - self.start:b - self.start, :, :n_pos] = v
        slot.length = n_pos

    # -- internals ------------------------------------------------------------------------
    def _slot(self, seq_id: int) -> _Slot:
        try:
            return self._slots[seq_id]
        except KeyError:
            raise KeyError(f"sequence {seq_id} has no KV slot") from None

    def _slot_at(self, seq_id: int, start_pos: int) -> _Slot:
        """The slot a span starting at `start_pos` extends: it must hold exactly that many positions."""
        slot = self._slot(seq_id)
        if start_pos != slot.length:
            raise ValueError(f"sequence {seq_id}: span starts at {start_pos} but the cache holds "
                             f"{slot.length} positions")
        return slot

    @staticmethod
    def _grow(slot: _Slot, needed: int) -> None:
        cap = slot_capacity(needed)
        shape = (*slot.k.shape[:2], cap, slot.k.shape[3])
        for name in ("k", "v"):
            old = getattr(slot, name)
            new = torch.zeros(shape, dtype=old.dtype)
            new[:, :, :old.shape[2]] = old
            setattr(slot, name, new)
