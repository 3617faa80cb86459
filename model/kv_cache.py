"""A preallocated key/value cache with slots: one slot per sequence, written in place by position."""
from __future__ import annotations

import heapq

import torch

from model.config import GPTConfig


class CacheFullError(RuntimeError):
    """Every slot is taken."""


class KVCache:
    """Keys and values for `num_slots` sequences of up to `max_len` tokens, allocated once.

    Layout per layer: (num_slots, n_head, max_len + 1, head_dim). The extra column at index
    `max_len` is scratch: padding tokens of a ragged batch write there, and attention never
    reads it, so padding can never clobber a real position.
    """

    def __init__(
        self,
        config: GPTConfig,
        num_slots: int,
        *,
        max_len: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.max_len = max_len or config.n_positions
        if self.max_len > config.n_positions:
            raise ValueError(f"max_len {self.max_len} exceeds the model context {config.n_positions}")
        self.num_slots = num_slots
        shape = (config.n_layer, num_slots, config.n_head, self.max_len + 1, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # (L, S, nh, max_len + 1, hs)
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # (L, S, nh, max_len + 1, hs)
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
        self.k[:, slot].zero_()
        self.v[:, slot].zero_()
        heapq.heappush(self._free, slot)

    def bytes_per_token(self) -> int:
        """Cache bytes one token of one sequence occupies (keys and values, all layers)."""
        n_layer, _, n_head, _, head_dim = self.k.shape
        return 2 * n_layer * n_head * head_dim * self.k.element_size()

    def bytes_per_slot(self) -> int:
        return self.bytes_per_token() * (self.max_len + 1)

    def total_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


def slot_index(slots: list[int]) -> slice | None:
    """The slots as a slice when they are one ascending contiguous range (read as a view), else None."""
    if slots and slots == list(range(slots[0], slots[0] + len(slots))):
        return slice(slots[0], slots[0] + len(slots))
    return None
