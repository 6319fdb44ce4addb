"""The block pool: fixed KV blocks, reference counts and an O(1) free queue.

Mechanism only: the pool never decides which request gets memory; it hands out blocks
and takes them back.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from pagoda.plugins.eviction import Evictor, LRUEvictor


BlockKey = tuple  # (parent block hash, token ids, extra keys): what a block hash covers


class KVBlock:
    """One physical KV block.

    A full block whose contents are known carries ``block_hash`` and ``block_key``, the
    exact (parent hash, token ids, extra keys) it was hashed from, so a hash collision
    is caught by comparing keys; ``retention`` is the highest kv_retention of the
    requests that held it, for retention-aware eviction.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "block_key", "retention")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.block_key: BlockKey | None = None
        self.retention = 0

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref_cnt={self.ref_cnt})"


class BlockPool:
    """A fixed set of KV blocks with reference counts and a prefix cache.

    Free blocks live in two places. Blocks that hold no cached prefix wait in
    ``free_uncached`` and are handed out first. Freed blocks that hold a hashed full
    block stay in the hash map and go to the evictor: a later request with the same
    prefix takes them back (``touch``, O(1) from the middle) until an allocation that
    finds no uncached block evicts one, in the evictor's order (least recently freed
    first by default).

    Args:
        num_blocks: Number of physical blocks.
        enable_caching: Keep and look up hashed blocks.
        evictor: Orders cached free blocks for eviction (an LRUEvictor by default).
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True, evictor: Evictor | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block; got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_uncached: deque[KVBlock] = deque(self.blocks)
        self.evictor: Evictor = evictor if evictor is not None else LRUEvictor()
        self.cached_blocks: dict[int, KVBlock] = {}
        self.num_evictions = 0
        # KV events (engine/kv_events.py's KVEventLog) where the engine publishes them, else None.
        self.events = None

    def get_num_free_blocks(self) -> int:
        return len(self.free_uncached) + len(self.evictor)

    def free_block_ids(self) -> list[int]:
        """Every free block id (uncached ones first); O(num_blocks), for tests."""
        return [b.block_id for b in self.free_uncached] + [
            b.block_id for b in self.blocks if b.ref_cnt == 0 and b.block_hash is not None]

    def get_cached_block(self, block_hash: int, block_key: BlockKey) -> KVBlock | None:
        """The block cached under ``block_hash`` if its key matches exactly, else None."""
        block = self.cached_blocks.get(block_hash)
        if block is None or block.block_key != block_key:
            return None  # NOTE: a collision must never hand out another prefix's KV
        return block

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Takes a reference on cache hits, reviving blocks that were waiting to be evicted."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.evictor.remove(block.block_id)  # only cached blocks are hits
            block.ref_cnt += 1

    def cache_block(self, block: KVBlock, block_hash: int, block_key: BlockKey) -> bool:
        """Registers a block that is (or is being) filled with the tokens of ``block_key``;
        returns whether it was (if another block already holds that content, that one stays
        the cached one)."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self.cached_blocks:
            return False
        block.block_hash = block_hash
        block.block_key = block_key
        self.cached_blocks[block_hash] = block
        if self.events is not None:
            self.events.stored(block_hash, block_key)
        return True

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
                self.num_evictions += 1
                if self.events is not None:
                    self.events.removed(block.block_hash)
            block.block_hash = None
            block.block_key = None
        block.retention = 0

    def uncache_block(self, block: KVBlock) -> None:
        """Forgets a held block's cached content (it stays owned)."""
        assert block.ref_cnt > 0, "only held blocks can be uncached this way"
        self._evict(block)

    def evict_cached_free_blocks(self) -> int:
        """Drops every cached block that no request holds; returns how many."""
        count = 0
        while len(self.evictor):
            block = self.blocks[self.evictor.pop()]
            self._evict(block)
            self.free_uncached.append(block)
            count += 1
        return count

    def reset(self) -> None:
        """Every block free and uncached again, as when the pool was made."""
        while len(self.evictor):
            self.evictor.pop()
        for block in self.blocks:
            block.ref_cnt = 0
            block.block_hash = None
            block.block_key = None
            block.retention = 0
        self.free_uncached = deque(self.blocks)
        self.cached_blocks.clear()
        if self.events is not None:
            self.events.cleared()

    def num_shared_blocks(self) -> int:
        return sum(1 for block in self.blocks if block.ref_cnt > 1)

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock] | None:
        """Takes ``num_blocks`` blocks off the free queue, or returns None if too few."""
        if num_blocks > self.get_num_free_blocks():
            return None
        new_blocks = []
        for _ in range(num_blocks):
            if self.free_uncached:
                block = self.free_uncached.popleft()
            else:
                block = self.blocks[self.evictor.pop()]
            assert block.ref_cnt == 0
            self._evict(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def free_blocks(self, blocks: Iterable[KVBlock], retention: int = 0) -> None:
        """Drops one reference from each block; blocks that reach zero become free.

        Callers pass a request's blocks tail-first, so the deepest block of a cached
        chain is evicted before its parents; blocks holding no cached content are
        reused before any cached block.

        Args:
            blocks: The blocks.
            retention: The releasing request's kv_retention.
        """
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            block.retention = max(block.retention, retention)
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    block.retention = 0
                    self.free_uncached.appendleft(block)
                else:
                    self.evictor.add(block.block_id, block.retention)
