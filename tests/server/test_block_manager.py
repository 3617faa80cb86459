"""The block manager on its own: reference counts, the hash chain, eviction (empty blocks first, then
segmented LRU), no double free."""

from __future__ import annotations

import pytest

from model.sampling import SamplingParams
from server.engine.block_manager import BlockManager
from server.engine.request import Request
from tests.server.conftest import check_block_invariants


def request(tokens, salt=None, use_cache=True):
    return Request(
        list(tokens), SamplingParams(temperature=0), seed=0, sink=lambda o: None, use_cache=use_cache, cache_salt=salt
    )


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
    check_block_invariants(bm)


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
    check_block_invariants(bm)
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
    check_block_invariants(bm)


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
    check_block_invariants(bm)


def test_a_cached_block_is_evicted_only_when_no_empty_block_is_left():
    bm = BlockManager(4, 4)
    a, _ = admitted(bm, range(8))  # 2 full blocks, cached
    computed(bm, a)
    a_blocks = list(a.block_ids)
    c, _ = admitted(bm, range(50, 52))  # 1 partial block: caches nothing
    computed(bm, c)
    bm.release(a)
    bm.release(c)  # released last: under plain LRU, a's blocks would be taken before it
    admitted(bm, range(100, 105))  # 2 blocks: the never-used one and c's
    assert len(bm.cached) == 2, "a's cached blocks must survive while empty ones are free"
    assert bm.cached_prefix(request(list(range(8)) + [1])) == a_blocks
    check_block_invariants(bm)


def test_a_shared_prefix_outlives_one_off_blocks_released_after_it():
    """Segmented LRU: blocks that served a hit are evicted after those that never did, though released
    earlier. Plain LRU evicts the prefix here."""
    bm = BlockManager(10, 4, protected_share=0.5)
    prefix = list(range(8))  # 2 blocks
    first, _ = admitted(bm, prefix + [500])
    computed(bm, first)
    second, hits = admitted(bm, prefix + [501])
    assert len(hits) == 2
    bm.release(first)
    bm.release(second)  # the prefix's blocks are free now, having served a hit
    for k in range(6):  # one-off prompts of 2 full blocks each, released after the prefix
        one_off, _ = admitted(bm, range(1000 + 100 * k, 1009 + 100 * k))
        computed(bm, one_off)
        bm.release(one_off)
    assert len(bm.cached_prefix(request(prefix + [502]))) == 2
    check_block_invariants(bm)


def test_protected_blocks_are_bounded_and_give_way_to_a_new_shared_working_set():
    bm = BlockManager(8, 4, protected_share=0.25)  # at most 2 free protected blocks

    def shared_twice(prefix):  # two requests on one 2-block prefix: the second hits it
        a, _ = admitted(bm, prefix + [1])
        computed(bm, a)
        b, hits = admitted(bm, prefix + [2])
        assert len(hits) == 2
        bm.release(a)
        bm.release(b)

    old = [list(range(100 * t, 100 * t + 8)) for t in range(2)]
    for prefix in old:
        shared_twice(prefix)
    assert len(bm.free.protected) == 2 and len(bm.free.probation) == 2, "the older tenant's blocks were demoted"
    assert len(bm.cached_prefix(request(old[0] + [3]))) == 2, "demoted, not evicted"
    for t in range(3):  # new tenants: their hits protect them, and the old tenants' blocks go
        shared_twice(list(range(1000 + 100 * t, 1008 + 100 * t)))
    assert all(bm.cached_prefix(request(p + [3])) == [] for p in old)
    assert len(bm.free.protected) == 2
    check_block_invariants(bm)


def test_forgetting_a_free_cached_block_makes_it_the_next_taken():
    bm = BlockManager(4, 4)
    a, _ = admitted(bm, range(8))
    computed(bm, a)
    blocks = list(a.block_ids)
    bm.release(a)
    bm.forget(blocks[:1])
    assert list(bm.free)[:3] == [2, 3, blocks[0]], "empty blocks first, the forgotten one among them"
    check_block_invariants(bm)


def test_a_request_hitting_its_own_blocks_after_preemption_does_not_protect_them():
    bm = BlockManager(8, 4)
    a, _ = admitted(bm, range(9))
    computed(bm, a)
    own = list(a.block_ids[:2])
    bm.release(a)  # preempted: the scheduler counts it, then admits it again on its own cached blocks
    a.stats.preemptions += 1
    hits = bm.cached_prefix(a)
    bm.admit(a, hits)
    assert hits == own
    computed(bm, a)
    bm.release(a)
    assert not set(own) & set(bm.free.protected), "a one-off request's blocks must stay evictable first"
    b, hits = admitted(bm, list(range(8)) + [77])  # another request: a real reuse
    assert hits == own
    bm.release(b)
    assert set(own) <= set(bm.free.protected)
    check_block_invariants(bm)


def test_block_keys_do_not_collide_where_pythons_tuple_hash_does():
    """Parent keys 2^61 - 1 apart hash alike inside a tuple (Python reduces ints modulo 2^61 - 1), and a hit
    is verified against its block's own tokens only: the chain must not inherit that collision."""
    from server.engine.block_manager import NO_SALT, block_key

    tokens = tuple(range(16))
    twin = NO_SALT - (2**61 - 1)
    assert hash((NO_SALT, tokens)) == hash((twin, tokens))  # the collision the chain must not have
    assert block_key(NO_SALT, tokens) != block_key(twin, tokens)
    assert block_key(NO_SALT, tokens) == block_key(NO_SALT, list(tokens))  # a key depends on values alone
