"""KVCacheManager: per-request block tables on top of the block pool."""

from __future__ import annotations

from dataclasses import dataclass

from engine.block_pool import BlockPool, KVBlock


@dataclass(slots=True)
class KVCacheUsage:
    """A snapshot of the KV cache for metrics and tests.

    Attributes:
        num_blocks: Blocks in the pool.
        num_used_blocks: Blocks held by at least one request.
        num_free_blocks: Blocks on the free queue.
        num_tokens: Token slots that hold (or are being filled with) a request's K/V.
        num_unused_slots: Slots allocated to requests but not holding a token yet.
    """

    num_blocks: int
    num_used_blocks: int
    num_free_blocks: int
    num_tokens: int
    num_unused_slots: int

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks


class KVCacheManager:
    """Owns every request's block table; allocates blocks on demand as requests grow.

    A request never reserves its maximum length: each step asks for just the slots the
    step's new tokens need.

    Args:
        num_blocks: Number of physical blocks.
        block_size: Tokens per block.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self.req_to_num_tokens: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, request_id: str, num_total_tokens: int) -> list[int] | None:
        """Grows a request's block table to hold ``num_total_tokens`` tokens.

        Args:
            request_id: The request.
            num_total_tokens: Tokens the request will hold once this step has run
                (computed tokens plus the step's new ones).

        Returns:
            The ids of newly allocated blocks (possibly empty), or None when the pool
            has too few free blocks; nothing is allocated then.
        """
        blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new_blocks = self.num_blocks_needed(num_total_tokens) - len(blocks)
        new_blocks: list[KVBlock] = []
        if num_new_blocks > 0:
            got = self.block_pool.get_new_blocks(num_new_blocks)
            if got is None:
                if not blocks:
                    del self.req_to_blocks[request_id]
                return None
            new_blocks = got
            blocks.extend(new_blocks)
        self.req_to_num_tokens[request_id] = max(num_total_tokens, self.req_to_num_tokens.get(request_id, 0))
        return [block.block_id for block in new_blocks]

    def free(self, request_id: str) -> None:
        """Releases every block of a request, tail first. Unknown ids are ignored."""
        blocks = self.req_to_blocks.pop(request_id, None)
        self.req_to_num_tokens.pop(request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def usage(self) -> KVCacheUsage:
        num_free = self.get_num_free_blocks()
        num_used = self.num_blocks - num_free
        num_tokens = sum(self.req_to_num_tokens.values())
        num_slots = sum(len(blocks) for blocks in self.req_to_blocks.values()) * self.block_size
        return KVCacheUsage(
            num_blocks=self.num_blocks,
            num_used_blocks=num_used,
            num_free_blocks=num_free,
            num_tokens=num_tokens,
            num_unused_slots=num_slots - num_tokens,
        )

    def check_invariants(self) -> None:
        """Asserts DESIGN.md's invariants; for tests and debugging, O(num_blocks)."""
        holders: dict[int, int] = {}
        for blocks in self.req_to_blocks.values():
            for block in blocks:
                holders[block.block_id] = holders.get(block.block_id, 0) + 1
        free_ids = {block.block_id for block in self.block_pool.free_block_queue}
        assert len(free_ids) == self.get_num_free_blocks(), "free queue count is off"
        for block in self.block_pool.blocks:
            num_holders = holders.get(block.block_id, 0)
            assert block.ref_cnt == num_holders, f"{block}: held by {num_holders} block tables"
            assert (block.block_id in free_ids) == (block.ref_cnt == 0), f"{block}: free and owned"
        for request_id, blocks in self.req_to_blocks.items():
            assert self.num_blocks_needed(self.req_to_num_tokens.get(request_id, 0)) <= len(blocks)
