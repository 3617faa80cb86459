"""A read-only picture of the KV-cache block pool, for people to watch (`GET /kv` and the playground's map).

`kv_snapshot` reads the block manager and the scheduler; it must run on the engine thread between two
steps (`Engine.run_between_steps`), where nothing changes under it. Nothing here runs unless someone
asks: the engine's only standing cost is the block manager's two counters (`hit_counts`, `evictions`).
Every block is in exactly one state: held (some running request lists it), cached (no one holds it,
but it still keys a prefix and can be hit until it is evicted) or free (no one holds it, it keys nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

from server.engine.block_manager import BlockManager
from server.engine.scheduler import Scheduler


@dataclass(frozen=True)
class RequestBlocks:
    """One running request's holdings."""

    request_id: str  # the engine's id of the request
    blocks: list[int]  # its block table: position p's keys and values live in blocks[p // block_size]
    num_tokens: int  # prompt + generated tokens so far
    num_computed: int  # leading tokens whose keys and values its blocks hold
    cached_tokens: int  # prompt tokens taken from the prefix cache at its first admission
    use_cache: bool  # False: it recomputes its whole sequence every step


@dataclass(frozen=True)
class KVSnapshot:
    """The pool between two steps. free_blocks + held_blocks + cached_blocks == num_blocks."""

    num_blocks: int  # blocks in the pool
    block_size: int  # tokens per block
    free_blocks: int  # held by no request and keying no prefix
    held_blocks: int  # listed by at least one running request
    cached_blocks: int  # held by none, still keying a prefix: a hit reuses it, an allocation may evict it
    ref_counts: list[int]  # per block: how many running requests list it (more than 1: shared)
    cached_lru: list[int]  # the cached blocks in eviction order (free_blocks.py): the first goes first
    hit_counts: list[int]  # per block: prefix-cache hits it has served since the engine started
    requests: list[RequestBlocks]  # the running requests, in admission order
    num_waiting: int  # requests queued, holding no blocks (new or preempted)
    prefix_cache_queries: int  # prompt tokens of admitted requests that use the cache, since start
    prefix_cache_hits: int  # of those, tokens served from the prefix cache
    evictions: int  # cached blocks taken for other tokens, since start
    preemptions: int  # running requests sent back to the queue for lack of blocks, since start


def kv_snapshot(blocks: BlockManager, scheduler: Scheduler) -> KVSnapshot:
    """The pool as it is now. Call it on the engine thread, between steps."""
    cached_lru = [b for b in blocks.free if blocks.block_hash[b] is not None]  # `free` iterates in eviction order
    requests = [
        RequestBlocks(
            request_id=r.request_id,
            blocks=list(r.block_ids),
            num_tokens=r.num_tokens,
            num_computed=r.num_computed,
            cached_tokens=r.stats.cached_tokens,
            use_cache=r.use_cache,
        )
        for r in scheduler.running
    ]
    stats = scheduler.stats
    return KVSnapshot(
        num_blocks=blocks.num_blocks,
        block_size=blocks.block_size,
        free_blocks=len(blocks.free) - len(cached_lru),
        held_blocks=blocks.num_blocks - len(blocks.free),
        cached_blocks=len(cached_lru),
        ref_counts=list(blocks.ref_counts),
        cached_lru=cached_lru,
        hit_counts=list(blocks.hit_counts),
        requests=requests,
        num_waiting=scheduler.num_waiting,
        prefix_cache_queries=stats.prefix_cache_queries,
        prefix_cache_hits=stats.prefix_cache_hits,
        evictions=blocks.evictions,
        preemptions=stats.preemptions,
    )
