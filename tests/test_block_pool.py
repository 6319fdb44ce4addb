"""Block pool: the O(1) free queue, reference counts and the prefix-cache map."""

import pytest

from engine.block_pool import BlockPool, FreeBlockQueue, KVBlock


def test_free_queue_removes_from_the_middle_in_order():
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert [b.block_id for b in queue] == [0, 1, 3, 4]
    queue.appendleft(blocks[2])
    assert [b.block_id for b in queue] == [2, 0, 1, 3, 4]
    assert queue.popleft() is blocks[2]
    assert len(queue) == 4


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
    # Freed tail-first: c (never hashed) goes to the front, then b, then a.
    pool.free_blocks([c, b, a])
    assert [blk.block_id for blk in pool.free_block_queue] == [c.block_id, 3, b.block_id, a.block_id]
    # A hit revives b from the middle of the queue.
    assert pool.get_cached_block(22, (11, (2,), ())) is b
    pool.touch([b])
    assert b.ref_cnt == 1 and pool.get_num_free_blocks() == 3
    # New allocations take c and the unused block first, then evict a.
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
