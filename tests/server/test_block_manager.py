"""The block manager on its own: reference counts, the hash chain, LRU eviction, no double free."""
from __future__ import annotations

import pytest

from model.sampling import SamplingParams
from server.engine.block_manager import BlockManager
from server.engine.request import Request


def request(tokens, salt=None, use_cache=True):
    return Request(list(tokens), SamplingParams(temperature=0), seed=0, sink=lambda o: None, use_cache=use_cache,
                   cache_salt=salt)


def admitted(bm, tokens, **kw):
    req = request(tokens, **kw)
    hits = bm.cached_prefix(req)
    assert bm.can_admit(req, hits)
    bm.admit(req, hits)
    return req, hits


def computed(bm, req):
    """As after a step that computed every token the request holds."""
    req.num_computed = req.num_tokens
    bm.register_full_blocks(req)


def test_blocks_are_counted_and_given_back():
    bm = BlockManager(8, 4)
    a, _ = admitted(bm, range(10))  # 3 blocks
    assert len(a.block_ids) == 3 and bm.num_free_blocks == 5
    assert bm.grow(a, 12) and len(a.block_ids) == 3  # still fits
    assert bm.grow(a, 13) and len(a.block_ids) == 4
    assert not bm.grow(a, 4 * 9), "more blocks than exist"
    freed = bm.release(a)
    assert sorted(freed) == sorted(set(freed)) and len(freed) == 4 and bm.num_free_blocks == 8
    bm.check_invariants()


def test_the_hash_chain_keys_a_block_by_its_tokens_and_everything_before_them():
    bm = BlockManager(16, 4)
    a = request([1, 2, 3, 4, 5, 6, 7, 8])
    b = request([9, 9, 9, 9, 5, 6, 7, 8])  # same second block, different first
    c = request([1, 2, 3, 4, 5, 6, 7, 8], salt="tenant-2")
    ha, hb, hc = (bm.block_hashes(r, 2) for r in (a, b, c))
    assert ha[1] != hb[1], "a block's key must depend on its prefix"
    assert ha[0] != hc[0] and ha[1] != hc[1], "the salt must change every key"
    assert bm.block_hashes(request([1, 2, 3, 4, 0, 0, 0, 0]), 1) == ha[:1]


def test_a_prefix_hit_shares_blocks_and_never_covers_the_last_token():
    bm = BlockManager(16, 4)
    a, _ = admitted(bm, range(12))
    computed(bm, a)
    b, hits = admitted(bm, list(range(12)) + [50, 51])
    assert hits == a.block_ids[:3] and b.num_computed == 12
    assert all(bm.ref_counts[x] == 2 for x in hits)
    c, hits = admitted(bm, range(12))  # all 12 tokens cached: the last block is recomputed
    assert hits == a.block_ids[:2] and c.num_computed == 8
    d, hits = admitted(bm, list(range(7)) + [99])
    assert hits == a.block_ids[:1], "a partial block is never a hit"
    e, hits = admitted(bm, list(range(12)), salt="other")
    assert hits == []
    for r in (a, b, c, d, e):
        bm.release(r)
    bm.check_invariants()
    assert bm.num_free_blocks == 16 and all(n == 0 for n in bm.ref_counts)


def test_blocks_no_one_holds_stay_cached_until_evicted_least_recent_first():
    bm = BlockManager(6, 4)
    a, _ = admitted(bm, range(8))  # 2 blocks
    computed(bm, a)
    bm.release(a)
    b, _ = admitted(bm, range(100, 108))
    computed(bm, b)
    bm.release(b)
    assert len(bm.cached) == 4  # both requests' blocks, unreferenced
    # allocation takes never-used blocks first, then the least recently released: a's tail, then a's head
    c, _ = admitted(bm, range(200, 212))  # 3 blocks: 2 never used + 1 evicted
    assert len(bm.cached) == 3
    again, hits = admitted(bm, list(range(8)) + [1])
    assert len(hits) == 1, "a's head is still cached, its tail was evicted first"
    bm.check_invariants()


def test_a_release_never_drops_a_count_below_zero():
    bm = BlockManager(4, 4)
    a, _ = admitted(bm, range(4))
    blocks = list(a.block_ids)
    bm.release(a)
    a.block_ids = blocks  # a bug that releases twice
    with pytest.raises(AssertionError, match="released more often than held"):
        bm.release(a)


def test_requests_without_the_cache_or_with_caching_off_never_hit():
    bm = BlockManager(16, 4)
    a, _ = admitted(bm, range(12))
    computed(bm, a)
    assert bm.cached_prefix(request(range(12), use_cache=False)) == []
    off = BlockManager(16, 4, enable_prefix_caching=False)
    b, _ = admitted(off, range(12))
    computed(off, b)
    assert off.cached == {} and off.cached_prefix(request(range(12))) == []


def test_forgotten_blocks_leave_the_cache():
    bm = BlockManager(8, 4)
    a, _ = admitted(bm, range(8))
    computed(bm, a)
    bm.forget(a.block_ids)
    assert bm.cached == {} and bm.cached_prefix(request(range(9))) == []
    bm.release(a)
    bm.check_invariants()
