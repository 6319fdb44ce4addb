"""KVCacheManager: on-demand growth, prefix caching, copy-on-write, swapping.

The Hypothesis state machine simulates the KV contents block by block, so besides the
bookkeeping invariants it checks that every request's blocks hold exactly its tokens.
"""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagoda.engine.core.kv_cache_manager import KVCacheManager
from pagoda.engine.core.request import Request
from pagoda.engine.sampling_params import SamplingParams


def make_request(request_id, tokens, cache_salt=None):
    return Request(request_id, list(tokens), SamplingParams(), max_tokens=1000, cache_salt=cache_salt)


def run(manager, request, num_new, computed=None):
    """Allocates like the scheduler does and marks the tokens computed."""
    alloc = manager.allocate_slots(request, num_new, computed)
    assert alloc is not None
    request.num_computed_tokens += len(computed or []) * manager.block_size + num_new
    return alloc


def test_allocation_is_on_demand_and_freed_tail_first():
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    request = make_request("a", range(5))
    assert run(manager, request, 5).new_block_ids == [0, 1]
    request.all_token_ids += [7, 7, 7]
    assert run(manager, request, 3).new_block_ids == []  # still fits in two blocks
    request.all_token_ids += [7]
    assert run(manager, request, 1).new_block_ids == [2]
    usage = manager.usage()
    assert (usage.num_used_blocks, usage.num_tokens, usage.num_unused_slots) == (3, 9, 3)
    manager.free("a")
    assert manager.get_num_free_blocks() == 8
    manager.check_invariants()


def test_blocks_before_a_sliding_window_go_back_to_the_pool():
    # A window of 6 in blocks of 4: block i goes back once the next token's window starts past it
    # (position 4 * (i + 1) + 5), with a lookback of 1 (a rejected draft token) one token later.
    manager = KVCacheManager(num_blocks=8, block_size=4, sliding_window=6, lookback=1)
    request = make_request("a", range(10))
    run(manager, request, 10)  # 10 computed: the next window starts at 5 (4 with the lookback)
    assert manager.get_block_ids("a") == [0, 1, 2] and manager.num_blocks_held("a") == 3
    request.all_token_ids += [7]
    run(manager, request, 1)  # the next window starts at 6, 5 with the lookback: block 0 passed
    assert manager.get_block_ids("a") == [0, 1, 2] and manager.get_block_ids("a", held=True) == [1, 2]
    assert manager.get_num_free_blocks() == 6
    usage = manager.usage()
    assert (usage.num_used_blocks, usage.num_tokens, usage.num_unused_slots) == (2, 7, 1)
    manager.check_invariants()
    # A fork shares the held blocks; the places out of the window stay so in both.
    child = make_request("b", request.all_token_ids)
    child.num_computed_tokens = request.num_computed_tokens
    manager.fork(request, child)
    assert manager.block_pool.num_shared_blocks() == 2
    manager.check_invariants()
    manager.free("b")
    # A prefix hit past the window takes from the pool only the hits the next token's window sees.
    request.all_token_ids += [8, 9]
    run(manager, request, 2)  # 13 tokens: blocks 0-2 full and cached
    manager.free("a")
    late = make_request("d", request.all_token_ids[:12] + [5, 5])
    hits, num_tokens = manager.get_computed_blocks(late)
    assert [block.block_id for block in hits] == [0, 1, 2] and num_tokens == 12
    run(manager, late, 2, hits)  # 12 cached: the window starts at 7 (6 with the lookback)
    assert manager.get_block_ids("d")[:3] == [0, 1, 2] and manager.get_block_ids("d", held=True)[:2] == [1, 2]
    assert manager.block_pool.blocks[0].ref_cnt == 0  # still free (and cached)
    manager.check_invariants()
    # Swapped out and back: the held blocks only, the places out of the window kept.
    manager = KVCacheManager(num_blocks=8, block_size=4, num_cpu_blocks=4, sliding_window=6)
    request = make_request("c", range(15))
    run(manager, request, 14)
    run(manager, request, 1)  # 14 computed: the window from 9, blocks 0 and 1 passed
    assert manager.get_block_ids("c", held=True) == [2, 3]
    assert len(manager.swap_out("c")) == 2 and len(manager.get_cpu_block_ids("c")) == 2
    manager.check_invariants()
    assert manager.num_blocks_to_swap_in(request, 2) == 3  # and a block for tokens 15-16
    assert len(manager.swap_in(request)) == 2
    assert manager.get_block_ids("c")[:2] == [0, 0] and manager.num_blocks_held("c") == 2
    manager.check_invariants()


def test_allocation_that_does_not_fit_changes_nothing():
    manager = KVCacheManager(num_blocks=2, block_size=4)
    run(manager, make_request("a", range(4)), 4)
    assert manager.allocate_slots(make_request("b", range(9)), 9) is None
    assert manager.get_num_free_blocks() == 1 and "b" not in manager.req_to_blocks
    manager.check_invariants()


def test_paged_attention_walkthrough_fork_and_copy_on_write():
    words = "The cat sat on the mat and purred softly at dawn . but meowed instead".split()
    ids = {w: i for i, w in enumerate(dict.fromkeys(words))}
    seq_a = [ids[w] for w in "The cat sat on the mat and purred softly at dawn .".split()]
    seq_b = [ids[w] for w in "The cat sat on the mat but meowed instead .".split()]
    manager = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("A", seq_a[:6])
    run(manager, a, 6)  # "The cat sat on | the mat"
    b = make_request("B", seq_b[:6])
    manager.fork(a, b)
    b.num_computed_tokens = 6
    assert manager.get_block_ids("A") == manager.get_block_ids("B") == [0, 1]
    assert [manager.block_pool.blocks[i].ref_cnt for i in (0, 1)] == [2, 2]
    # B writes "but" into the shared partial block: it is copied first.
    b.all_token_ids.append(seq_b[6])
    alloc = run(manager, b, 1)
    assert alloc.copies == [(1, 2)] and alloc.table_changed
    assert manager.block_pool.blocks[0].ref_cnt == 2 and manager.block_pool.blocks[1].ref_cnt == 1
    # A now owns block 1 alone and writes in place, then grows into a new block.
    a.all_token_ids += seq_a[6:]
    assert run(manager, a, 6).copies == []
    b.all_token_ids += seq_b[7:]
    run(manager, b, 3)
    assert manager.get_block_ids("A") == [0, 1, 3]
    assert manager.get_block_ids("B") == [0, 2, 4]
    manager.check_invariants()


def test_prefix_hit_reuses_full_blocks_and_respects_the_salt():
    manager = KVCacheManager(num_blocks=16, block_size=4)
    first = make_request("first", range(10))
    run(manager, first, 10)
    manager.free("first")
    second = make_request("second", list(range(8)) + [50, 51, 52])
    blocks, num_hit = manager.get_computed_blocks(second)
    assert num_hit == 8
    run(manager, second, second.num_tokens - num_hit, blocks)
    assert manager.get_block_ids("second")[:2] == [b.block_id for b in blocks]
    salted = make_request("salted", range(10), cache_salt="tenant-b")
    assert manager.get_computed_blocks(salted) == ([], 0)
    # A fully cached prompt still leaves its last token to compute.
    again = make_request("again", range(8))
    assert manager.get_computed_blocks(again)[1] == 4
    manager.check_invariants()


def test_swap_out_and_back_in():
    manager = KVCacheManager(num_blocks=4, block_size=4, num_cpu_blocks=4)
    request = make_request("a", range(7))
    run(manager, request, 7)
    pairs = manager.swap_out("a")
    assert [gpu for gpu, _ in pairs] == [0, 1] and manager.get_num_free_blocks() == 4
    assert manager.is_swapped("a") and manager.can_swap_in(request, 0)
    back = manager.swap_in(request)
    assert [cpu for cpu, _ in back] == [cpu for _, cpu in pairs]
    assert not manager.is_swapped("a") and len(manager.free_cpu_blocks) == 4
    manager.check_invariants()


BLOCK = 4
TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=14)  # few symbols: many shared prefixes


class KVCacheMachine(RuleBasedStateMachine):
    """add / grow / fork / finish / abort / evict / swap-out / swap-in, contents simulated."""

    def __init__(self):
        super().__init__()
        self.manager = KVCacheManager(num_blocks=12, block_size=BLOCK, num_cpu_blocks=6)
        self.requests: dict[str, Request] = {}
        self.swapped: dict[str, Request] = {}
        self.content: dict[int, list] = {i: [None] * BLOCK for i in range(12)}
        self.cpu_content: dict[int, list] = {i: [None] * BLOCK for i in range(6)}
        self.next_id = 0

    def _write(self, request, alloc, start, end):
        for src, dst in alloc.copies:
            self.content[dst] = list(self.content[src])
        table = self.manager.get_block_ids(request.request_id)
        for pos in range(start, end):
            self.content[table[pos // BLOCK]][pos % BLOCK] = request.all_token_ids[pos]

    def _new_id(self):
        self.next_id += 1
        return f"r{self.next_id}"

    @rule(tokens=TOKENS, salt=st.sampled_from([None, None, "s"]))
    def add(self, tokens, salt):
        request = make_request(self._new_id(), tokens, cache_salt=salt)
        computed, num_hit = self.manager.get_computed_blocks(request)
        alloc = self.manager.allocate_slots(request, request.num_tokens - num_hit, computed)
        if alloc is None:
            self.manager.free(request.request_id)
            return
        self._write(request, alloc, num_hit, request.num_tokens)
        request.num_computed_tokens = request.num_tokens
        self.requests[request.request_id] = request

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def grow(self, data, extra):
        request = self.requests[data.draw(st.sampled_from(sorted(self.requests)))]
        start = request.num_computed_tokens
        request.all_token_ids += extra
        alloc = self.manager.allocate_slots(request, len(extra))
        if alloc is None:  # no room: the request is aborted, as a preemption would
            self.manager.free(request.request_id)
            del self.requests[request.request_id]
            return
        self._write(request, alloc, start, request.num_tokens)
        request.num_computed_tokens = request.num_tokens

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def fork(self, data):
        parent = self.requests[data.draw(st.sampled_from(sorted(self.requests)))]
        child = make_request(self._new_id(), parent.all_token_ids, parent.cache_salt)
        self.manager.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        self.requests[child.request_id] = child

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish_or_abort(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.requests)))
        self.manager.free(request_id)
        del self.requests[request_id]

    @rule()
    def evict(self):
        self.manager.block_pool.evict_cached_free_blocks()

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def swap_out(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.requests)))
        if not self.manager.can_swap_out(request_id):
            return
        for gpu, cpu in self.manager.swap_out(request_id):
            self.cpu_content[cpu] = list(self.content[gpu])
        self.swapped[request_id] = self.requests.pop(request_id)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.swapped)))
        if not self.manager.can_swap_in(self.swapped[request_id], 0):
            return
        request = self.swapped.pop(request_id)
        for cpu, gpu in self.manager.swap_in(request):
            self.content[gpu] = list(self.cpu_content[cpu])
        self.requests[request_id] = request

    @invariant()
    def bookkeeping_holds(self):
        self.manager.check_invariants()

    @invariant()
    def every_block_holds_its_requests_tokens(self):
        for request in self.requests.values():
            table = self.manager.get_block_ids(request.request_id)
            held = [self.content[table[p // BLOCK]][p % BLOCK] for p in range(request.num_computed_tokens)]
            assert held == request.all_token_ids[: request.num_computed_tokens]

    def teardown(self):
        for request_id in list(self.requests) + list(self.swapped):
            self.manager.free(request_id)
        assert self.manager.get_num_free_blocks() == 12
        assert len(self.manager.free_cpu_blocks) == 6
        self.manager.check_invariants()


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class WindowedKVCacheMachine(KVCacheMachine):
    """The same under a sliding window of 5 positions: the blocks before a request's next
    token's window go back to the pool as it grows (prefix hits past the window, forks and
    swaps included); the blocks it holds keep its tokens."""

    WINDOW = 5

    def __init__(self):
        super().__init__()
        self.manager = KVCacheManager(num_blocks=12, block_size=BLOCK, num_cpu_blocks=6, sliding_window=self.WINDOW)

    @invariant()
    def every_block_holds_its_requests_tokens(self):
        for request in self.requests.values():
            table = self.manager.get_block_ids(request.request_id)
            computed = request.num_computed_tokens
            first = max(0, computed - self.WINDOW + 1) // BLOCK * BLOCK  # the next token's window, whole blocks
            held = [self.content[table[p // BLOCK]][p % BLOCK] for p in range(first, computed)]
            assert held == request.all_token_ids[first:computed]


TestWindowedKVCacheMachine = WindowedKVCacheMachine.TestCase
TestWindowedKVCacheMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
