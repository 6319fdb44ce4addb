"""The waiting queue: a heap ordered by the scheduling policy's sort keys."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator

from pagoda.engine.core.request import Request


class WaitingQueue:
    """Requests waiting for admission, smallest sort key first (ties: insertion order).

    Keys come from the policy once per insertion, so ordering costs O(log n) per request
    rather than a sort per step; removal (abort) is lazy.
    """

    def __init__(self) -> None:
        self._heap: list[list] = []
        self._entries: dict[str, list] = {}
        self._counter = itertools.count()

    def push(self, request: Request, key: tuple) -> None:
        entry = [key, next(self._counter), request]
        self._entries[request.request_id] = entry
        heapq.heappush(self._heap, entry)

    def rekey(self, key: Callable[[Request], tuple]) -> None:
        """Orders the queue by fresh keys (for policies whose keys change while requests wait)."""
        self._heap = [[key(entry[2]), entry[1], entry[2]] for entry in self._entries.values()]
        heapq.heapify(self._heap)
        self._entries = {entry[2].request_id: entry for entry in self._heap}

    def peek(self) -> Request | None:
        self._drop_removed()
        return self._heap[0][2] if self._heap else None

    def pop(self) -> Request:
        self._drop_removed()
        entry = heapq.heappop(self._heap)
        del self._entries[entry[2].request_id]
        return entry[2]

    def remove(self, request: Request) -> bool:
        entry = self._entries.pop(request.request_id, None)
        if entry is None or entry[2] is not request:
            return False
        entry[2] = None  # NOTE: lazy deletion; skipped when it reaches the top
        return True

    def _drop_removed(self) -> None:
        while self._heap and self._heap[0][2] is None:
            heapq.heappop(self._heap)

    def __contains__(self, request: Request) -> bool:
        entry = self._entries.get(request.request_id)
        return entry is not None and entry[2] is request

    def __len__(self) -> int:
        return len(self._entries)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __iter__(self) -> Iterator[Request]:
        """In admission order (a sorted copy; for tests and introspection)."""
        return iter([entry[2] for entry in sorted(self._entries.values(), key=lambda e: (e[0], e[1]))])
