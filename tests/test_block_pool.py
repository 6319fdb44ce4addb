"""Block pool and KV cache manager: unit tests and a Hypothesis state machine."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.block_pool import BlockPool, FreeBlockQueue, KVBlock
from engine.kv_cache_manager import KVCacheManager


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


def test_allocation_is_on_demand_and_freed_tail_first():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    assert manager.allocate_slots("a", 5) == [0, 1]
    assert manager.allocate_slots("a", 8) == []  # still fits in two blocks
    assert manager.allocate_slots("a", 9) == [2]
    usage = manager.usage()
    assert (usage.num_used_blocks, usage.num_tokens, usage.num_unused_slots) == (3, 9, 3)
    manager.free("a")
    # Freed tail-first: the deepest block is first in line for reuse.
    assert [b.block_id for b in manager.block_pool.free_block_queue][-3:] == [2, 1, 0]
    manager.check_invariants()


def test_allocation_that_does_not_fit_changes_nothing():
    manager = KVCacheManager(num_blocks=2, block_size=4)
    assert manager.allocate_slots("a", 4) == [0]
    assert manager.allocate_slots("b", 9) is None
    assert manager.get_num_free_blocks() == 1
    assert "b" not in manager.req_to_blocks
    manager.check_invariants()


class KVCacheMachine(RuleBasedStateMachine):
    """Random add / grow / finish / abort; DESIGN.md's invariants after every step."""

    def __init__(self):
        super().__init__()
        self.manager = KVCacheManager(num_blocks=16, block_size=4)
        self.lengths: dict[str, int] = {}
        self.next_id = 0

    @rule(num_tokens=st.integers(1, 40))
    def add(self, num_tokens):
        request_id = f"r{self.next_id}"
        self.next_id += 1
        free_before = self.manager.get_num_free_blocks()
        result = self.manager.allocate_slots(request_id, num_tokens)
        needed = -(-num_tokens // 4)
        assert (result is None) == (needed > free_before)
        if result is not None:
            assert len(result) == needed
            self.lengths[request_id] = num_tokens

    @precondition(lambda self: self.lengths)
    @rule(data=st.data(), grow=st.integers(1, 20))
    def grow(self, data, grow):
        request_id = data.draw(st.sampled_from(sorted(self.lengths)))
        before = len(self.manager.get_block_ids(request_id))
        result = self.manager.allocate_slots(request_id, self.lengths[request_id] + grow)
        if result is None:
            assert len(self.manager.get_block_ids(request_id)) == before
        else:
            self.lengths[request_id] += grow
            assert self.manager.get_block_ids(request_id)[before:] == result

    @precondition(lambda self: self.lengths)
    @rule(data=st.data())
    def finish_or_abort(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.lengths)))
        self.manager.free(request_id)
        del self.lengths[request_id]

    @invariant()
    def invariants_hold(self):
        self.manager.check_invariants()
        used = sum(-(-n // 4) for n in self.lengths.values())
        assert self.manager.get_num_free_blocks() == 16 - used

    def teardown(self):
        for request_id in list(self.lengths):
            self.manager.free(request_id)
        assert self.manager.get_num_free_blocks() == 16
        self.manager.check_invariants()


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
