"""HybridKVCacheManager: a model whose layers only partly slide (Gemma) keeps its sliding layers'
blocks in a pool of their own, where a request holds the window's blocks however long it gets;
prefix hits need the global blocks of the whole prefix and the sliding blocks of its window.

The Hypothesis state machine simulates both pools' contents block by block: every request's
global table holds all of its tokens, its sliding table those of the next token's window.
"""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from pagoda.engine.core.hybrid_kv_cache_manager import HybridKVCacheManager
from pagoda.engine.core.snapshot import USED, kv_blocks
from test_kv_cache_manager import BLOCK, KVCacheMachine, make_request

WINDOW = 6


def step(manager, request, num_new, computed=None, num_hit=0):
    """Allocates like the scheduler does and marks the tokens computed."""
    alloc = manager.allocate_slots(request, num_new, computed)
    assert alloc is not None
    request.num_computed_tokens += num_hit + num_new
    manager.check_invariants()
    return alloc


def test_a_long_request_holds_the_windows_blocks_in_the_sliding_pool():
    manager = HybridKVCacheManager(num_blocks=40, num_sliding_blocks=6, block_size=4, sliding_window=WINDOW)
    request = make_request("a", range(9))
    alloc = step(manager, request, 9)
    assert alloc.new_block_ids == [0, 1, 2] and len(alloc.new_sliding_block_ids) == 3
    for token in range(100):
        request.all_token_ids.append(token)
        step(manager, request, 1)
        # The next token's window (6 positions) spans two blocks, three at a block's edge.
        assert manager.sliding.num_blocks_held("a") <= 3
    assert manager.full.num_blocks_held("a") == -(-request.num_computed_tokens // 4) == 28
    usage = manager.usage()
    assert (usage.num_sliding_blocks, usage.num_used_sliding_blocks) == (6, manager.sliding.num_blocks_held("a"))
    # The load figures are the fuller pool's: 28 of 40 global blocks, against 3 of 6 sliding.
    held = manager.sliding.num_blocks_held("a")
    assert manager.used_fraction() == usage.usage == max(28 / 40, held / 6) == 0.7
    step(manager, make_request("b", range(8)), 8)
    assert manager.used_fraction() == max(30 / 40, (held + 2) / 6)
    # The console's block map: both pools, the sliding pool's blocks numbered after the global ones.
    states, _ = kv_blocks(manager)
    assert len(states) == manager.num_blocks and states.count(USED) == 28 + held + 2 + 2
    assert all(block_id >= 40 for block_id in manager.get_block_ids("a", held=True)[28:])
    # The sliding table keeps its length (block 0 at the places the window passed).
    assert len(manager.get_sliding_block_ids("a")) == 28
    manager.free("a")
    manager.free("b")
    assert manager.get_num_free_blocks() == manager.num_blocks == 46
    manager.check_invariants()


def test_a_prefix_hit_needs_only_the_windows_blocks_in_the_sliding_pool():
    manager = HybridKVCacheManager(num_blocks=40, num_sliding_blocks=10, block_size=4, sliding_window=WINDOW)
    prompt = list(range(100, 133))  # eight full blocks and a token
    first = make_request("a", prompt)
    step(manager, first, 24)
    step(manager, first, 5)
    # The sliding blocks the window has passed (0-3: the next step's queries start at 24) went
    # back to the pool cached; evicted here.
    assert manager.sliding.block_pool.evict_cached_free_blocks() == 4
    step(manager, first, 4)
    manager.free("a")
    second = make_request("c", prompt + [7])
    computed, num_hit = manager.get_computed_blocks(second)
    # All eight blocks: the window of the token after them reads blocks 6 and 7 only.
    assert num_hit == 32
    full_hits, sliding_hits = computed
    assert len(full_hits) == len(sliding_hits) == 8
    assert manager.num_cached_prefix_tokens(prompt + [7]) == 32  # the same, for routing
    step(manager, second, 2, computed, num_hit)
    assert manager.sliding.num_blocks_held("c") <= 3 and manager.full.num_blocks_held("c") == 9
    # Without block 7 in the sliding pool, the longest hit whose window is there is shorter.
    manager.free("c")
    manager.sliding.block_pool.evict_cached_free_blocks()
    assert manager.get_computed_blocks(make_request("d", prompt + [7])) == ([], 0)
    assert manager.num_cached_prefix_tokens(prompt + [7]) == 0
    manager.check_invariants()


def test_when_either_pool_is_short_nothing_is_allocated():
    manager = HybridKVCacheManager(num_blocks=3, num_sliding_blocks=8, block_size=4, sliding_window=WINDOW)
    assert manager.allocate_slots(make_request("a", range(13)), 13) is None  # four global blocks
    manager = HybridKVCacheManager(num_blocks=8, num_sliding_blocks=2, block_size=4, sliding_window=WINDOW)
    request = make_request("b", range(9))
    assert manager.allocate_slots(request, 9) is None  # three sliding blocks before the window passes any
    assert manager.get_num_free_blocks() == 10
    manager.check_invariants()
    step(manager, make_request("c", range(8)), 8)
    assert manager.full.num_blocks_held("c") == manager.sliding.num_blocks_held("c") == 2


class HybridKVCacheMachine(KVCacheMachine):
    """The state machine of KVCacheManager's tests over both pools (12 global blocks, 7
    sliding); nothing is swapped."""

    NUM_SLIDING = 7

    def __init__(self):
        super().__init__()
        self.manager = HybridKVCacheManager(num_blocks=12, num_sliding_blocks=self.NUM_SLIDING, block_size=BLOCK,
                                            sliding_window=WINDOW)
        self.sliding_content: dict[int, list] = {i: [None] * BLOCK for i in range(self.NUM_SLIDING)}

    def _write(self, request, alloc, start, end):
        for src, dst in alloc.copies:
            if src < 12:
                self.content[dst] = list(self.content[src])
            else:
                self.sliding_content[dst - 12] = list(self.sliding_content[src - 12])
        full = self.manager.get_block_ids(request.request_id)
        sliding = self.manager.get_sliding_block_ids(request.request_id)
        first_held = self.manager.sliding.req_to_dropped.get(request.request_id, 0) * BLOCK
        for pos in range(start, end):
            self.content[full[pos // BLOCK]][pos % BLOCK] = request.all_token_ids[pos]
            if pos >= first_held:
                self.sliding_content[sliding[pos // BLOCK]][pos % BLOCK] = request.all_token_ids[pos]

    @rule(data=st.data())
    def evict(self, data):
        pool = data.draw(st.sampled_from([self.manager.full, self.manager.sliding])).block_pool
        pool.evict_cached_free_blocks()

    @precondition(lambda self: False)
    @rule()
    def swap_out(self):
        pass

    @precondition(lambda self: False)
    @rule()
    def swap_in(self):
        pass

    @invariant()
    def the_sliding_table_holds_the_windows_tokens(self):
        for request in self.requests.values():
            table = self.manager.get_sliding_block_ids(request.request_id)
            computed = request.num_computed_tokens
            first = max(0, computed - WINDOW + 1) // BLOCK * BLOCK  # the next token's window, whole blocks
            held = [self.sliding_content[table[p // BLOCK]][p % BLOCK] for p in range(first, computed)]
            assert held == request.all_token_ids[first:computed]
            assert self.manager.sliding.num_blocks_held(request.request_id) <= -(-WINDOW // BLOCK) + 1 + \
                -(-6 // BLOCK)  # the window's, a partial one and a grow's new tokens (at most 6)

    def teardown(self):
        for request_id in list(self.requests):
            self.manager.free(request_id)
        assert self.manager.get_num_free_blocks() == 12 + self.NUM_SLIDING
        self.manager.check_invariants()


TestHybridKVCacheMachine = HybridKVCacheMachine.TestCase
TestHybridKVCacheMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
