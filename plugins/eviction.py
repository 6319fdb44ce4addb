"""Evictors: which cached free block is reused first when the pool needs a block.

The pool keeps blocks that hold no cached prefix apart and hands those out first; only
when none is left does it ask the evictor for a cached one.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol


class Evictor(Protocol):
    """The interface an eviction policy implements (all operations should be O(1)-ish)."""

    def add(self, block_id: int, retention: int) -> None:
        """A cached block became free; ``retention`` is the highest kv_retention of the
        requests that held it."""

    def remove(self, block_id: int) -> None:
        """A free cached block was taken back by a prefix-cache hit."""

    def pop(self) -> int:
        """Returns the block to evict now and forgets it."""

    def __len__(self) -> int: ...


class LRUEvictor:
    """Least recently freed first."""

    def __init__(self) -> None:
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def add(self, block_id: int, retention: int) -> None:
        self._blocks[block_id] = None

    def remove(self, block_id: int) -> None:
        del self._blocks[block_id]

    def pop(self) -> int:
        return self._blocks.popitem(last=False)[0]

    def __len__(self) -> int:
        return len(self._blocks)


class RetentionPriorityEvictor:
    """Lowest kv_retention first, least recently freed first within a level.

    A system prompt sent with a high ``kv_retention`` outlives one-off text in the cache.
    """

    def __init__(self) -> None:
        self._levels: dict[int, OrderedDict[int, None]] = {}
        self._level_of: dict[int, int] = {}

    def add(self, block_id: int, retention: int) -> None:
        self._levels.setdefault(retention, OrderedDict())[block_id] = None
        self._level_of[block_id] = retention

    def remove(self, block_id: int) -> None:
        level = self._level_of.pop(block_id)
        blocks = self._levels[level]
        del blocks[block_id]
        if not blocks:
            del self._levels[level]

    def pop(self) -> int:
        level = min(self._levels)  # NOTE: few distinct levels in practice
        blocks = self._levels[level]
        block_id = blocks.popitem(last=False)[0]
        del self._level_of[block_id]
        if not blocks:
            del self._levels[level]
        return block_id

    def __len__(self) -> int:
        return len(self._level_of)
