"""Tokenizing and chat templates off the event loop, in a pool no client can monopolize.

A long prompt holds a tokenizer thread for about a second per 600k characters. With one
thread in first-come order, six such prompts from one client kept a two-token request from
another waiting eight seconds. Here the work goes to two lanes, each one thread:

- small jobs (up to ``SMALL_CHARS`` characters: a few milliseconds) have their own lane, so
  they never wait behind a long one;
- long jobs share the other lane, taken in turn by client (round-robin over the clients that
  have one waiting), so one client's queue of long prompts delays another's by one job at most.

Hugging Face's fast tokenizers release the GIL while they encode, so the two lanes run in
parallel. A job's size is checked against the server's character limit before it is queued
(server/limits.py): no job is longer than the context can hold.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

#: Jobs up to this many characters take the small lane (about 40 ms of encoding at most).
SMALL_CHARS = 50_000


class _Lane:
    """One thread, and the jobs waiting for it, queued per client and taken in turn."""

    def __init__(self, name: str) -> None:
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.busy = False
        self.running = ""  # the client whose job has the thread
        # NOTE: insertion order is the turn order; a served client goes to the back.
        self.waiting: dict[str, deque[asyncio.Future]] = {}

    async def run(self, client: str, job: Callable[[], T]) -> T:
        if self.busy:
            turn = asyncio.get_running_loop().create_future()
            self.waiting.setdefault(client, deque()).append(turn)
            try:
                await turn
            except asyncio.CancelledError:
                if turn.done() and not turn.cancelled():
                    self._next()  # the lane was handed over as the waiter left: pass it on
                raise
        else:
            self.busy, self.running = True, client
        # NOTE: handed on when the thread is done, not when the waiter is: a client that leaves
        # mid-job leaves the thread busy until the job ends, and the next job waits for it.
        future = asyncio.get_running_loop().run_in_executor(self.executor, job)
        future.add_done_callback(lambda _: self._next())
        return await asyncio.shield(future)

    def _next(self) -> None:
        """Hands the lane to the next client's oldest job, or frees it."""
        while self.waiting:
            client = next(iter(self.waiting))
            if client == self.running and len(self.waiting) > 1:
                self.waiting[client] = self.waiting.pop(client)  # it just had a turn: another client's now
                client = next(iter(self.waiting))
            queue = self.waiting.pop(client)
            turn = queue.popleft()
            if queue:
                self.waiting[client] = queue
            if not turn.done():  # NOTE: a waiter that left has a cancelled future: skipped
                self.running = client
                turn.set_result(None)
                return
        self.busy = False


class TokenizerPool:
    """Runs tokenizer work (encode, decode, chat templates) for the server's handlers."""

    def __init__(self) -> None:
        self._small = _Lane("pagoda-tokenizer-small")
        self._large = _Lane("pagoda-tokenizer")

    async def run(self, fn: Callable[..., T], *args: Any, client: str = "", cost: int = 0) -> T:
        """``fn(*args)`` on a tokenizer thread.

        Args:
            client: Who asked (the per-client key); long jobs are taken in turn by client.
            cost: The job's size in characters (a prompt's length, a conversation's text).
        """
        lane = self._small if cost <= SMALL_CHARS else self._large
        return await lane.run(client, lambda: fn(*args))

    def shutdown(self) -> None:
        for lane in (self._small, self._large):
            lane.executor.shutdown(wait=False, cancel_futures=True)
