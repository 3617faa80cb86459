"""The KV blocks no request holds, in the order they are taken for new tokens (evicting what they cache).

Three queues, drained in this order:
1. `empty`: blocks that cache nothing (never filled, a request's partial last block, or forgotten).
   Taking one costs nothing, so a cached block is never evicted while an empty one is free.
2. `probation`: cached blocks that have served no prefix-cache hit since they were filled, least
   recently released first: a request's own prompt suffix and output, and a new prefix until it is
   first reused.
3. `protected`: cached blocks that have served a hit, least recently released first: the prefixes that
   requests share (a tenant's system prompt). Bounded by `protected_limit` blocks: past it, its least
   recently released block moves to the back of probation, where it may be reused (and protected again)
   or evicted in turn.

With one plain LRU queue, a stream of requests with shared prefixes and suffixes of their own evicts a
shared prefix that has waited longer than the last few requests' private blocks. Here those private
blocks go first: segmented LRU (SLRU), the scan-resistant variant of LRU, with hits as the promotion.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

PROTECTED_SHARE = 0.75  # at most this share of all blocks sit free in `protected`; the rest is probation's


class FreeBlocks:
    def __init__(self, num_blocks: int, protected_share: float = PROTECTED_SHARE) -> None:
        self.empty: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.probation: OrderedDict[int, None] = OrderedDict()  # least recently released first
        self.protected: OrderedDict[int, None] = OrderedDict()  # least recently released first
        self.protected_limit = int(protected_share * num_blocks)

    def __len__(self) -> int:
        return len(self.empty) + len(self.probation) + len(self.protected)

    def __contains__(self, block: int) -> bool:
        return block in self.empty or block in self.probation or block in self.protected

    def __iter__(self) -> Iterator[int]:
        """Every free block, the next to be taken first."""
        yield from self.empty
        yield from self.probation
        yield from self.protected

    def add(self, block: int, cached: bool, reused: bool) -> None:
        """A block no request holds any more: `cached` if it holds a prefix-cache entry, `reused` if that
        entry has served a hit."""
        if not cached:
            self.empty[block] = None
        elif not reused:
            self.probation[block] = None
        else:
            self.protected[block] = None
            if len(self.protected) > self.protected_limit:
                demoted, _ = self.protected.popitem(last=False)
                self.probation[demoted] = None

    def remove(self, block: int) -> None:
        """A free block taken as a prefix hit."""
        for queue in (self.probation, self.protected, self.empty):
            if block in queue:
                del queue[block]
                return
        raise KeyError(f"block {block} is not free")

    def emptied(self, block: int) -> None:
        """A free block's cache entry was dropped: it is now taken before any cached block."""
        for queue in (self.probation, self.protected):
            if block in queue:
                del queue[block]
                self.empty[block] = None

    def pop(self) -> int:
        """Takes the next block for new tokens: an empty one, else the least recently released of probation,
        else of protected."""
        for queue in (self.empty, self.probation, self.protected):
            if queue:
                return queue.popitem(last=False)[0]
        raise IndexError("no free block")
