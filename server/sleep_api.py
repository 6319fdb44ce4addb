"""vLLM's sleep mode over HTTP: ``POST /sleep?level=1|2``, ``POST /wake_up``, ``GET /is_sleeping``
(behind the API key where the server has one).

Asleep, the worker process is stopped (its KV cache, prefix cache and weights freed: on the CPU
there is no other memory to keep the weights in, so both levels free them); requests get
``503 engine_sleeping`` and ``/health`` stays 200. ``/wake_up`` starts a new worker.
"""

from __future__ import annotations

import orjson
from aiohttp import web

from pagoda.engine.exceptions import EngineBusyError, WorkerDiedError
from pagoda.server.errors import APIError, bad_request
from pagoda.server.state import STATE_KEY


async def sleep(request: web.Request) -> web.Response:
    """POST /sleep?level=1 (or 2): 200 once the worker has stopped; 409 while requests run."""
    state = request.app[STATE_KEY]
    level = request.query.get("level", "1")
    if level not in ("1", "2"):
        raise bad_request(f"'level' must be 1 or 2; got {level!r}", "level")
    if state.draining:
        raise APIError(503, "The server is shutting down.", code="shutting_down")
    try:
        await state.engine.sleep(int(level))
    except EngineBusyError as exc:
        raise APIError(409, f"Cannot sleep: {exc}.", code="engine_busy") from None
    return web.Response(status=200)


async def wake_up(request: web.Request) -> web.Response:
    """POST /wake_up: 200 once a new worker is ready (at once when awake)."""
    state = request.app[STATE_KEY]
    try:
        await state.engine.wake_up()
    except WorkerDiedError as exc:
        raise APIError(500, f"The worker failed to start: {exc}", code="wake_up_failed") from None
    return web.Response(status=200)


async def is_sleeping(request: web.Request) -> web.Response:
    """GET /is_sleeping: ``{"is_sleeping": bool}``."""
    return web.Response(body=orjson.dumps({"is_sleeping": request.app[STATE_KEY].engine.is_sleeping}),
                        content_type="application/json")


def add_routes(app: web.Application) -> None:
    app.router.add_post("/sleep", sleep)
    app.router.add_post("/wake_up", wake_up)
    app.router.add_get("/is_sleeping", is_sleeping)
