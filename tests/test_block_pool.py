"""Block pool: reference counts, the prefix-cache map and eviction order."""

import pytest

from pagoda.engine.core.block_pool import BlockPool
from pagoda.plugins.eviction import LRUEvictor, RetentionPriorityEvictor


def test_pool_returns_none_when_full_and_refuses_double_free():
    pool = BlockPool(3)
    got = pool.get_new_blocks(3)
    assert [b.ref_cnt for b in got] == [1, 1, 1]
    assert pool.get_new_blocks(1) is None
    pool.free_blocks(got)
    assert pool.get_num_free_blocks() == 3
    with pytest.raises(AssertionError):
        pool.free_blocks([got[0]])


def test_cached_blocks_wait_in_lru_order_and_are_evicted_on_reuse():
    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_block(a, 11, (None, (1,), ()))
    pool.cache_block(b, 22, (11, (2,), ()))
    # Freed tail-first: c (never hashed) is reused first, then b (deepest), then a.
    pool.free_blocks([c, b, a])
    assert pool.get_num_free_blocks() == 4
    # A hit revives b from the middle of the eviction order in O(1).
    assert pool.get_cached_block(22, (11, (2,), ())) is b
    pool.touch([b])
    assert b.ref_cnt == 1 and pool.get_num_free_blocks() == 3
    # New allocations take c and the never-used block first, then evict a.
    taken = pool.get_new_blocks(3)
    assert [blk.block_id for blk in taken] == [c.block_id, 3, a.block_id]
    assert pool.get_cached_block(11, (None, (1,), ())) is None
    assert pool.num_evictions == 1


def test_a_hash_collision_never_returns_another_prefix():
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, 42, (None, (1, 2), ()))
    assert pool.get_cached_block(42, (None, (9, 9), ())) is None
    assert pool.get_cached_block(42, (None, (1, 2), ())) is block


def test_lru_evictor_order_and_removal_from_the_middle():
    evictor = LRUEvictor()
    for block_id in (5, 6, 7):
        evictor.add(block_id, retention=0)
    evictor.remove(6)
    assert [evictor.pop(), evictor.pop()] == [5, 7] and len(evictor) == 0


def test_retention_evictor_keeps_high_retention_blocks_longest():
    evictor = RetentionPriorityEvictor()
    evictor.add(1, retention=5)  # a system prompt
    evictor.add(2, retention=0)
    evictor.add(3, retention=0)
    evictor.add(4, retention=5)
    evictor.remove(3)
    assert [evictor.pop() for _ in range(3)] == [2, 1, 4]


def test_retention_survives_in_the_pool():
    pool = BlockPool(3, evictor=RetentionPriorityEvictor())
    system, other = pool.get_new_blocks(2)
    pool.cache_block(system, 1, (None, (1,), ()))
    pool.cache_block(other, 2, (None, (2,), ()))
    pool.free_blocks([system], retention=9)
    pool.free_blocks([other], retention=0)
    pool.get_new_blocks(2)  # the unused block, then the low-retention one
    assert pool.get_cached_block(1, (None, (1,), ())) is system
    assert pool.get_cached_block(2, (None, (2,), ())) is None
