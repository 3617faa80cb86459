"""A preallocated key/value cache with slots: one slot per sequence, written in place by position."""
from __future__ import annotations

import heapq

import torch

from model.config import GPTConfig


class CacheFullError(RuntimeError):
    """Every slot is taken."""


class KVCache:
    """Keys and values for `num_slots` sequences of up to `max_len` tokens, allocated once.

    Layout per layer: (num_slots, 2, n_head, max_len + 1, head_dim), keys then values. The extra
    column at index `max_len` is scratch: padding tokens of a ragged batch write there, and attention
    never reads it, so padding can never clobber a real position.
    """

    def __init__(
        self,
        config: GPTConfig,
        num_slots: int,
        *,
        max_len: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,  # None: torch's default device
    ) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.max_len = max_len or config.n_positions
        if self.max_len > config.n_positions:
            raise ValueError(f"max_len {self.max_len} exceeds the model context {config.n_positions}")
        self.num_slots = num_slots
        shape = (num_slots, 2, config.n_head, self.max_len + 1, config.head_dim)
        # One tensor per layer, keys and values side by side: a layer writes both with one in-place
        # index_put, and on a tensor of its own (not a view of a bigger one) so that a compiled step
        # writes in place too, where a write through a view would copy the whole cache.
        self.layers = [torch.zeros(shape, dtype=dtype, device=device)  # each (S, 2, nh, max_len + 1, hs)
                       for _ in range(config.n_layer)]
        self.columns = torch.arange(self.max_len + 1, device=device)  # column indices, for masks
        # A heap: the lowest free slot goes first, which keeps running slots packed at the front, so a
        # batch's slots are often one contiguous range and attention reads them without a gather.
        self._free: list[int] = list(range(num_slots))

    @property
    def scratch_column(self) -> int:
        return self.max_len

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise CacheFullError(f"all {self.num_slots} KV-cache slots are in use")
        return heapq.heappop(self._free)

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} out of range [0, {self.num_slots})")
        if slot in self._free:
            raise ValueError(f"slot {slot} is already free")
        # Zeroed on the way out: a masked column still multiplies its value by a zero weight, so a NaN
        # left by a failed request would poison the slot's next holder (one memset per request).
        for layer in self.layers:
            layer[slot].zero_()
        heapq.heappush(self._free, slot)

    def bytes_per_token(self) -> int:
        """Cache bytes one token of one sequence occupies (keys and values, all layers)."""
        _, _, n_head, _, head_dim = self.layers[0].shape
        return len(self.layers) * 2 * n_head * head_dim * self.layers[0].element_size()

    def bytes_per_slot(self) -> int:
        return self.bytes_per_token() * (self.max_len + 1)

    def total_bytes(self) -> int:
        return sum(layer.numel() * layer.element_size() for layer in self.layers)


def check_slot_range(slots: slice, rows: int) -> None:
    """A range of slots must hold exactly one slot per row of the batch."""
    if slots.stop - slots.start != rows:
        raise ValueError(f"slots {slots} hold {slots.stop - slots.start} rows, the batch has {rows}")


def slot_index(slots: list[int]) -> slice | None:
    """The slots as a slice when they are one ascending contiguous range (read as a view), else None."""
    if slots and slots == list(range(slots[0], slots[0] + len(slots))):
        return slice(slots[0], slots[0] + len(slots))
    return None
