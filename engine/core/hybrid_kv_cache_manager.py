"""Block tables for a model whose layers only partly slide (Gemma 2 and 3).

The global layers need every key of a request; the sliding layers only the last window's. So
the two kinds of layer keep their K/V in pools of their own (the worker gives the sliding layers
cache tensors of ``num_sliding_blocks`` blocks), and each request has a table in each: the
global one grows with the request, the sliding one gives its blocks back as the window passes
them (KVCacheManager's sliding window, as for a model whose every layer slides). A long request
then holds the window's blocks in the sliding layers however long it gets: the KV bytes of
``n_global * length + n_sliding * window`` tokens instead of ``(n_global + n_sliding) * length``.
This is vLLM's hybrid KV cache manager in Pagoda's terms (a pool per kind of layer where vLLM
shares one pool between groups of equal size).

A prefix hit needs the global layers' blocks of the whole prefix and the sliding layers' blocks
of its last window only: the sliding pool, small, evicts the blocks before the window first.

Block ids: a table holds each pool's own ids; where the scheduler names blocks of both pools in
one list (copy-on-write copies, the blocks a request holds), a sliding block is ``num_blocks``
(the global pool's size) plus its id. Requests are not swapped (preemption recomputes) and the
disk tier is not served: both would move the blocks of two pools.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from pagoda.engine.core.kv_cache_manager import (OUT_OF_WINDOW, UNCHANGED, KVCacheManager, KVCacheUsage,
                                                 SlotAllocation)
from pagoda.plugins.eviction import Evictor

if TYPE_CHECKING:
    from pagoda.engine.core.block_pool import KVBlock
    from pagoda.engine.core.request import Request


class HybridKVCacheManager:
    """A request's blocks in the global layers' pool and in the sliding layers' own pool.

    Args:
        num_blocks: Blocks of the global layers' pool.
        num_sliding_blocks: Blocks of the sliding layers' pool.
        block_size: Tokens per block (both pools).
        sliding_window: The sliding layers' window.
        enable_prefix_caching: Reuse cached full blocks across requests.
        evictors: Eviction order of each pool's cached free blocks.
        lookback: Positions a request's computed tokens may go back by (rejected drafts).
    """

    # Neither swapping nor the disk tier (see the module's docstring).
    offload = None
    num_cpu_blocks = 0
    num_free_cpu_blocks = 0

    def __init__(self, num_blocks: int, num_sliding_blocks: int, block_size: int, sliding_window: int,
                 enable_prefix_caching: bool = True, evictors: tuple[Evictor | None, Evictor | None] = (None, None),
                 lookback: int = 0) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.enable_prefix_caching = enable_prefix_caching
        self.full = KVCacheManager(num_blocks, block_size, enable_prefix_caching, evictor=evictors[0])
        self.sliding = KVCacheManager(num_sliding_blocks, block_size, enable_prefix_caching, evictor=evictors[1],
                                      sliding_window=sliding_window, lookback=lookback)
        # NOTE: the same tokens, the same hash chain: computed once for both pools.
        self.sliding.req_to_hashes = self.full.req_to_hashes

    @property
    def num_blocks(self) -> int:
        """Blocks of both pools."""
        return self.full.num_blocks + self.sliding.num_blocks

    @property
    def block_pool(self):
        """The global layers' pool (the one whose blocks KV events report)."""
        return self.full.block_pool

    def get_num_free_blocks(self) -> int:
        return self.full.get_num_free_blocks() + self.sliding.get_num_free_blocks()

    def used_fraction(self) -> float:
        """Of the fuller pool (either one running out stops the requests)."""
        return max(self.full.used_fraction(), self.sliding.used_fraction())

    def all_blocks(self) -> list[KVBlock]:
        """The global pool's blocks, then the sliding pool's (numbered after them)."""
        return self.full.all_blocks() + self.sliding.all_blocks()

    def num_blocks_needed(self, num_tokens: int) -> int:
        return self.full.num_blocks_needed(num_tokens)

    # -- prefix caching ---------------------------------------------------------------

    def num_cached_prefix_tokens(self, token_ids: list[int], cache_salt: str | None = None) -> int:
        """How many leading tokens of a prompt both pools hold now, as get_computed_blocks would
        find them (no side effects; for routing between replicas)."""
        num_full = self.full.num_cached_prefix_tokens(token_ids, cache_salt) // self.block_size
        hashes, parent = [], None
        for i in range(num_full):
            key = self.full._block_key(parent, token_ids, i, cache_salt)
            parent = hash(key)
            hashes.append((parent, key))
        return self._longest_hit(hashes)[0] * self.block_size

    def get_computed_blocks(self, request: Request) -> tuple[tuple[list[KVBlock], list[KVBlock]] | list, int]:
        """The longest cached prefix (leaving the last token to compute) whose global blocks
        are all cached and whose sliding blocks are cached from its window on.

        Returns:
            (the global hits, the sliding hits with OUT_OF_WINDOW before the window), or an
            empty list; and the number of tokens they hold.
        """
        full_hits, _ = self.full.get_computed_blocks(request)
        if not full_hits:
            return [], 0
        count, cached = self._longest_hit(self.full.req_to_hashes[request.request_id][:len(full_hits)])
        if not count:
            return [], 0
        passed = self.sliding._num_passed(count * self.block_size)
        return (full_hits[:count], [OUT_OF_WINDOW] * passed + cached[passed:count]), count * self.block_size

    def _longest_hit(self, hashes: list) -> tuple[int, list[KVBlock | None]]:
        """Of a run of blocks cached in the global pool (their hashes), the most leading ones
        whose window's blocks (those the token after them reads) are all in the sliding pool;
        and the sliding pool's cached blocks of the run (None where it has none)."""
        pool = self.sliding.block_pool
        cached = [pool.get_cached_block(block_hash, key) for block_hash, key in hashes]
        # The last block missing before each end: a hit of ``count`` blocks needs none in its window.
        last_missing, lasts = -1, []
        for i, block in enumerate(cached):
            last_missing = i if block is None else last_missing
            lasts.append(last_missing)
        for count in range(len(cached), 0, -1):
            if lasts[count - 1] < self.sliding._num_passed(count * self.block_size):
                return count, cached
        return 0, cached

    # -- allocation -------------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: tuple[list[KVBlock], list[KVBlock]] | None = None) -> SlotAllocation | None:
        """Grows both of the request's tables (neither when either pool is short)."""
        full_hits, sliding_hits = computed_blocks or (None, None)
        if not (self.full.can_allocate(request, num_new_tokens, full_hits)
                and self.sliding.can_allocate(request, num_new_tokens, sliding_hits)):
            return None
        full = self.full.allocate_slots(request, num_new_tokens, full_hits)
        sliding = self.sliding.allocate_slots(request, num_new_tokens, sliding_hits)
        assert full is not None and sliding is not None, "can_allocate and allocate_slots disagree"
        if full is UNCHANGED and sliding is UNCHANGED:
            return UNCHANGED
        offset = self.full.num_blocks
        return SlotAllocation(new_block_ids=full.new_block_ids,
                              copies=full.copies + [(src + offset, dst + offset) for src, dst in sliding.copies],
                              table_changed=full.table_changed or sliding.table_changed,
                              new_sliding_block_ids=sliding.new_block_ids)

    def fork(self, parent: Request, child: Request) -> list[int]:
        self.sliding.fork(parent, child)
        return self.full.fork(parent, child)

    def free(self, request_id: str) -> None:
        self.full.free(request_id)
        self.sliding.free(request_id)

    def reset(self) -> None:
        self.full.reset()
        self.sliding.reset()

    def reset_prefix_cache(self) -> int:
        return self.full.reset_prefix_cache() + self.sliding.reset_prefix_cache()

    def uncache(self, request_id: str) -> None:
        self.full.uncache(request_id)
        self.sliding.uncache(request_id)

    def get_block_ids(self, request_id: str, held: bool = False) -> list[int]:
        """The global layers' table; with ``held`` the blocks the request holds in both pools
        (a sliding block as num_blocks plus its id)."""
        if not held:
            return self.full.get_block_ids(request_id)
        offset = self.full.num_blocks
        return self.full.get_block_ids(request_id, held=True) + [
            block_id + offset for block_id in self.sliding.get_block_ids(request_id, held=True)]

    def get_sliding_block_ids(self, request_id: str) -> list[int]:
        """The sliding layers' table (block 0 at the places the window has passed)."""
        return self.sliding.get_block_ids(request_id)

    def num_blocks_held(self, request_id: str) -> int:
        return self.full.num_blocks_held(request_id) + self.sliding.num_blocks_held(request_id)

    # -- no swapping ------------------------------------------------------------------

    def is_swapped(self, request_id: str) -> bool:
        return False

    def can_swap_out(self, request_id: str) -> bool:
        return False

    def get_cpu_block_ids(self, request_id: str) -> list[int]:
        return []

    # -- introspection ----------------------------------------------------------------

    def usage(self) -> KVCacheUsage:
        """Both pools' blocks (a sliding block holds fewer layers' bytes than a global one);
        the tokens and slots of the global layers' tables."""
        full, sliding = self.full.usage(), self.sliding.usage()
        return replace(full, num_blocks=full.num_blocks + sliding.num_blocks,
                       num_used_blocks=full.num_used_blocks + sliding.num_used_blocks,
                       num_free_blocks=full.num_free_blocks + sliding.num_free_blocks,
                       num_cached_free_blocks=full.num_cached_free_blocks + sliding.num_cached_free_blocks,
                       num_shared_blocks=full.num_shared_blocks + sliding.num_shared_blocks,
                       num_sliding_blocks=sliding.num_blocks, num_used_sliding_blocks=sliding.num_used_blocks)

    def check_invariants(self) -> None:
        self.full.check_invariants()
        self.sliding.check_invariants()
        assert set(self.full.req_to_blocks) == set(self.sliding.req_to_blocks), "a request in one pool only"
