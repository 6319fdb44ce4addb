"""Server-sent events for ``stream: true``, and merging the streams of several prompts.

The SSE framing follows OpenAI: each chunk is one ``data: {json}`` event, and the stream
ends with ``data: [DONE]``. The response is prepared only once the request is known to
be valid, so validation errors are still plain JSON errors with a proper status.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import suppress
from typing import Any, TypeVar

import orjson
from aiohttp import web

T = TypeVar("T")

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "Connection": "keep-alive",
    # NOTE: tells nginx-like proxies not to buffer the stream.
    "X-Accel-Buffering": "no",
}
DONE = b"data: [DONE]\n\n"


async def open_sse(request: web.Request, headers: dict[str, str] | None = None) -> web.StreamResponse:
    """Sends the SSE response headers (no Content-Length: aiohttp switches to chunked)."""
    response = web.StreamResponse(status=200, headers={**SSE_HEADERS, **(headers or {})})
    await response.prepare(request)
    return response


async def send_event(response: web.StreamResponse, payload: dict[str, Any]) -> None:
    """Writes one ``data: {json}`` event."""
    await response.write(b"data: " + orjson.dumps(payload) + b"\n\n")


async def send_named_event(response: web.StreamResponse, name: str, payload: dict[str, Any]) -> None:
    """Writes one ``event: <name>`` / ``data: {json}`` event (the Responses and Anthropic
    Messages streams name each event; OpenAI's chat stream does not)."""
    await response.write(b"event: " + name.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n")


async def send_done(response: web.StreamResponse) -> None:
    """Writes ``data: [DONE]`` and ends the response."""
    await response.write(DONE)
    await response.write_eof()


async def merge(iterators: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Yields ``(index, item)`` from several async iterators as items arrive.

    Each pending ``__anext__`` runs as a task owned here: whatever ends the merge
    (exhaustion, an error, the consumer leaving, cancellation), the tasks are cancelled
    and awaited, and every iterator that has an ``aclose`` is closed.
    """
    if len(iterators) == 1:
        # NOTE: the common case needs no tasks at all.
        async for item in iterators[0]:
            yield 0, item
        return
    pending: dict[asyncio.Task, int] = {}
    try:
        for index, iterator in enumerate(iterators):
            pending[asyncio.ensure_future(iterator.__anext__())] = index
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(iterators[index].__anext__())] = index
                yield index, item
    finally:
        for task in pending:
            task.cancel()
        for task in pending:
            with suppress(asyncio.CancelledError, StopAsyncIteration, Exception):
                await task
        for iterator in iterators:
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                with suppress(Exception):
                    await aclose()
