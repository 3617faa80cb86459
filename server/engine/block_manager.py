"""KV-cache blocks: who holds which, and the prefix cache. Knows nothing of tensors.

- Every block has a reference count: the requests whose block tables list it.
- Blocks no request holds wait in `FreeBlocks` (free_blocks.py): empty ones are taken first, then cached
  ones that never served a hit, then those that did, each least recently released first. A block
  that still caches a prefix is evicted only when no empty block is left.
- A full block of a request that uses the cache is keyed by a hash chain, BLAKE2b(parent's key, its
  token ids), the first block's parent being the request's cache salt. A new request looks its
  blocks up in order and reuses the longest run of hits, verified token by token.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from server.engine.free_blocks import PROTECTED_SHARE, FreeBlocks
from server.engine.request import Request


def chain_root(cache_salt: str | None) -> int:
    """The parent key of a chain's first block. Stable across processes (a str's hash() is not, under
    PYTHONHASHSEED), so that a router in another process computes the keys a replica holds."""
    digest = hashlib.blake2b(("kvserve\0" + (cache_salt or "")).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True) if cache_salt else NO_SALT


NO_SALT = int.from_bytes(hashlib.blake2b(b"kvserve", digest_size=8).digest(), "little", signed=True)


def extend_block_keys(
    keys: list[int], token_ids: Sequence[int], block_size: int, cache_salt: str | None, count: int
) -> list[int]:
    """Extends `keys`, the prefix-cache keys of the first full blocks of `token_ids`, in place to `count`
    keys: hash(parent's key, the block's token ids). Returns the first `count`. The one hash chain of the
    project: the block manager and the cluster's router both call it."""
    while len(keys) < count:
        i = len(keys)
        parent = keys[-1] if i else chain_root(cache_salt)
        keys.append(block_key(parent, token_ids[i * block_size : (i + 1) * block_size]))
    return keys[:count]


def block_key(parent: int, tokens: Sequence[int]) -> int:
    """One link of the chain: a 64-bit BLAKE2b of the parent's key and the block's token ids. Python's own
    tuple hash is not a safe key here: its collisions can be built (one parent key and another 2^61 - 1
    apart collide), and a hit is verified against the block's own tokens, not its parents', so a crafted
    prompt could be served another context's KV entries."""
    data = parent.to_bytes(8, "little", signed=True) + array("q", tokens).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        protected_share: float = PROTECTED_SHARE,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need blocks and a block size, got {num_blocks} x {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.free = FreeBlocks(num_blocks, protected_share)  # in the order they are taken
        self.block_hash: list[int | None] = [None] * num_blocks  # key of a cached full block, else None
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks  # its tokens, to verify hits
        self.cached: dict[int, int] = {}  # key -> block
        self.reused = [False] * num_blocks  # per block: its cached tokens have served a hit (protects it)
        self.hit_counts = [0] * num_blocks  # per block: prefix-cache hits it served (for the KV view)
        self.evictions = 0  # cached blocks reused for other tokens (for the KV view)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (some of them still caching a prefix until they are reused)."""
        return len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (0..1)."""
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache -----------------------------------------------------------------------------

    def block_hashes(self, req: Request, count: int) -> list[int]:
        """The keys of the request's first `count` full blocks, extending its hash chain as needed."""
        return extend_block_keys(req.block_hashes, req.token_ids, self.block_size, req.cache_salt, count)

    def cached_prefix(self, req: Request) -> list[int]:
        """Blocks holding the longest cached prefix of the request's tokens. They never cover its last
        token, which is always computed (its logits are the next token's)."""
        if not self.enable_prefix_caching or not req.use_cache or req.params.prompt_logprobs is not None:
            return []  # (a request that scores its prompt computes every position)
        bs, hits = self.block_size, []
        for i, key in enumerate(self.block_hashes(req, (req.num_tokens - 1) // bs)):
            block = self.cached.get(key)
            if block is None or self.block_tokens[block] != tuple(req.token_ids[i * bs : (i + 1) * bs]):
                break
            hits.append(block)
        return hits

    def register_full_blocks(self, req: Request) -> None:
        """Enters the request's newly computed full blocks into the prefix cache."""
        if not self.enable_prefix_caching or not req.use_cache:
            return
        full = min(req.num_computed // self.block_size, len(req.block_ids))
        if req.registered_blocks >= full:
            return
        bs = self.block_size
        for i, key in enumerate(self.block_hashes(req, full)[req.registered_blocks :], start=req.registered_blocks):
            block = req.block_ids[i]
            if key not in self.cached and self.block_hash[block] is None:  # else the same tokens are cached already
                self.cached[key] = block
                self.block_hash[block] = key
                self.block_tokens[block] = tuple(req.token_ids[i * bs : (i + 1) * bs])
        req.registered_blocks = full

    # ---- allocation -------------------------------------------------------------------------------

    def can_admit(self, req: Request, hits: list[int]) -> bool:
        """Whether blocks for all of the request's tokens fit, after its prefix hits."""
        reusable_free = sum(1 for b in hits if self.ref_counts[b] == 0)  # taking them removes them from the queue
        return len(self.free) - reusable_free >= self.blocks_for(req.num_tokens) - len(hits)

    def admit(self, req: Request, hits: list[int]) -> None:
        """Gives the request its prefix hits and fresh blocks for the rest of its tokens (can_admit first).
        Its hits protect their blocks from eviction (free_blocks.py), unless they are its own: a preempted
        request coming back, or a copy (n > 1) reading the prompt its first copy computed."""
        assert not req.block_ids, f"{req} already holds blocks"
        shared = req.stats.preemptions == 0 and req.wait_for is None
        for block in hits:
            if self.ref_counts[block] == 0:
                self.free.remove(block)
            self.ref_counts[block] += 1
            self.hit_counts[block] += 1
            self.reused[block] = self.reused[block] or shared
        req.block_ids = list(hits) + self._allocate(self.blocks_for(req.num_tokens) - len(hits))
        req.num_computed = len(hits) * self.block_size
        req.registered_blocks = len(hits)

    def grow(self, req: Request, num_tokens: int) -> bool:
        """Makes the request hold blocks for its first `num_tokens` tokens; False if too few are free."""
        needed = self.blocks_for(num_tokens) - len(req.block_ids)
        if needed <= 0:
            return True
        if needed > len(self.free):
            return False
        req.block_ids += self._allocate(needed)
        return True

    def release(self, req: Request) -> list[int]:
        """Gives back the request's blocks, last block first, so that a sequence's tail is evicted before
        its head. Returns the blocks no one holds any more."""
        freed = []
        for block in reversed(req.block_ids):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} released more often than held"
            if self.ref_counts[block] == 0:
                self.free.add(block, cached=self.block_hash[block] is not None, reused=self.reused[block])
                freed.append(block)
        req.block_ids, req.num_computed, req.registered_blocks = [], 0, 0
        return freed

    def forget(self, blocks: list[int]) -> None:
        """Removes blocks from the prefix cache (a failed request's: their values may be NaN)."""
        for block in blocks:
            key = self.block_hash[block]
            if key is not None and self.cached.get(key) == block:
                del self.cached[key]
            self.block_hash[block] = self.block_tokens[block] = None
            self.reused[block] = False
            self.free.emptied(block)

    def _allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"{n} blocks asked, {len(self.free)} free")
        blocks = []
        for _ in range(n):
            block = self.free.pop()
            self.evictions += self.block_hash[block] is not None
            self.forget([block])
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks
