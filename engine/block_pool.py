"""The block pool: fixed KV blocks, reference counts and an O(1) free queue.

Mechanism only: the pool never decides which request gets memory; it hands out blocks
and takes them back.
"""

from __future__ import annotations

from collections.abc import Iterable


BlockKey = tuple  # (parent block hash, token ids, extra keys): what a block hash covers


class KVBlock:
    """One physical KV block. ``prev_free``/``next_free`` link it into the free queue.

    A full block whose contents are known carries ``block_hash`` and ``block_key``, the
    exact (parent hash, token ids, extra keys) it was hashed from, so a hash collision
    is caught by comparing keys.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "block_key", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.block_key: BlockKey | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref_cnt={self.ref_cnt})"


class FreeBlockQueue:
    """Doubly linked list of free blocks, least recently freed first.

    Unlike a deque, removing a block from the middle (a prefix-cache hit on a freed
    block) is O(1).
    """

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        # NOTE: sentinel head and tail keep every operation free of None checks.
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None, "block is not free"
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVBlock) -> None:
        self._insert_after(self._tail.prev_free, block)

    def appendleft(self, block: KVBlock) -> None:
        self._insert_after(self._head, block)

    def _insert_after(self, anchor: KVBlock, block: KVBlock) -> None:
        assert block.prev_free is None and block.next_free is None, "block is already free"
        block.prev_free = anchor
        block.next_free = anchor.next_free
        anchor.next_free.prev_free = block
        anchor.next_free = block
        self.num_free_blocks += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free

    def __len__(self) -> int:
        return self.num_free_blocks


class BlockPool:
    """A fixed set of KV blocks with reference counts and a prefix cache.

    Freed blocks that hold a hashed full block stay in the hash map while they wait on
    the free queue: a later request with the same prefix takes them back (``touch``)
    until a new allocation evicts them, least recently freed first.

    Args:
        num_blocks: Number of physical blocks.
        enable_caching: Keep and look up hashed blocks.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block; got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[int, KVBlock] = {}
        self.num_evictions = 0

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

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
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def cache_block(self, block: KVBlock, block_hash: int, block_key: BlockKey) -> None:
        """Registers a block that is (or is being) filled with the tokens of ``block_key``.

        If another block already holds that content it stays the cached one.
        """
        if not self.enable_caching or block.block_hash is not None or block_hash in self.cached_blocks:
            return
        block.block_hash = block_hash
        block.block_key = block_key
        self.cached_blocks[block_hash] = block

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
                self.num_evictions += 1
            block.block_hash = None
            block.block_key = None

    def evict_cached_free_blocks(self) -> int:
        """Drops every cached block that no request holds; returns how many."""
        count = 0
        for block in list(self.free_block_queue):
            if block.block_hash is not None:
                self._evict(block)
                count += 1
        return count

    def num_shared_blocks(self) -> int:
        return sum(1 for block in self.blocks if block.ref_cnt > 1)

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock] | None:
        """Takes ``num_blocks`` blocks off the free queue, or returns None if too few."""
        if num_blocks > self.free_block_queue.num_free_blocks:
            return None
        new_blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            assert block.ref_cnt == 0
            self._evict(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drops one reference from each block; blocks that reach zero become free.

        Callers pass a request's blocks tail-first, so the deepest block of a cached
        chain is evicted before its parents; blocks holding no cached content go to the
        front of the queue, to be reused before any cached block.
        """
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_block_queue.appendleft(block)
                else:
                    self.free_block_queue.append(block)
