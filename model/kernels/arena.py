"""Where the packed weights live: large CPU buffers that Linux may back with 2 MiB pages.

A batch-1 decode step streams every weight once. On 4 KiB pages that is a TLB miss every 64 cache
lines of each stream the kernels read at once (four strips of a group, csrc/linear.cpp); on 2 MiB
pages the walks all but vanish. Transparent huge pages are often set to `madvise` (as here:
/sys/kernel/mm/transparent_hugepage/enabled), so a buffer gets them only when asked: each chunk is
aligned to 2 MiB and advised (madvise MADV_HUGEPAGE) before anything touches it, then the packed
weights are copied in one after another, 64-byte aligned. Where the kernel says no (THP `never`,
not Linux), the chunks are plain memory and nothing else changes: the bytes, and so every result,
are the same wherever they sit.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import sys

import torch

log = logging.getLogger("kvserve.kernels")

HUGE_PAGE = 2 << 20
CHUNK = 64 << 20  # bytes a chunk holds at least; a larger weight gets a chunk of its own size
ALIGN = 64  # a cache line: every weight starts on one
MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux


def _madvise_huge(address: int, length: int) -> bool:
    """Asks Linux to back [address, address + length) with huge pages; False where it cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


class WeightArena:
    """A bump allocator of 2 MiB-aligned, huge-page-advised CPU chunks for the packed weights. On
    another device `place` returns the tensor as it is."""

    def __init__(self) -> None:
        self.chunks: list[torch.Tensor] = []  # (bytes,) uint8, each 2 MiB-aligned inside its allocation
        self.used = 0  # bytes used of the last chunk
        self.advised = 0  # chunks Linux agreed to back with huge pages

    def _new_chunk(self, size: int) -> None:
        size = -(-max(size, CHUNK) // HUGE_PAGE) * HUGE_PAGE
        raw = torch.empty(size + HUGE_PAGE, dtype=torch.uint8)  # untouched until the copies below
        start = -raw.data_ptr() % HUGE_PAGE
        chunk = raw[start : start + size]
        self.advised += _madvise_huge(chunk.data_ptr(), size)
        self.chunks.append(chunk)
        self.used = 0

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of `tensor` (contiguous) in the arena, same dtype and shape."""
        if tensor.device.type != "cpu":
            return tensor
        nbytes = tensor.numel() * tensor.element_size()
        if not self.chunks or self.used + nbytes > self.chunks[-1].numel():
            self._new_chunk(nbytes)
        chunk, offset = self.chunks[-1], self.used
        view = chunk[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor)
        self.used = -(-(offset + nbytes) // ALIGN) * ALIGN
        return view

    def hold(self, packed):
        """A PackedWeight (model/kernels/exact.py) with its weight moved into the arena."""
        return dataclasses.replace(packed, weight=self.place(packed.weight))
