"""The live console: ``/console`` (a page shipped with the package, no build step, no CDN) fed
by ``/v1/engine/state/stream``, server-sent events of the engine's state a few times a second;
``/v1/engine/state`` gives one snapshot as JSON for scripts.

The page holds no data: it is served without the API key, and asks for the key once (kept in
the browser's localStorage) to read the state and to send the playground's chats, which need
it as the API does. ``--no-console`` turns all of it off (and the step log with it).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from pagoda.engine.core.plugin_manager import plugin_names
from pagoda.engine.core.snapshot import STEP_LOG_SPEC, StepLog, engine_snapshot
from pagoda.server.errors import bad_request
from pagoda.server.state import STATE_KEY, ServerState
from pagoda.server.streaming import open_sse, send_event

STATIC = Path(__file__).parent / "console"
PREFIX = "/console"
#: Fastest and slowest sampling the stream takes (seconds between snapshots).
INTERVALS = (0.1, 5.0)


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    ordered = sorted(values)
    return {name: ordered[min(len(ordered) - 1, int(q * len(ordered)))]
            for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))}


def snapshot(state: ServerState, replica: int = 0) -> dict[str, Any]:
    """The console's view: one replica's engine state and the server's clients and latencies."""
    engines = state.engine.engines
    if not 0 <= replica < len(engines):
        raise bad_request(f"'replica' must be in [0, {len(engines) - 1}]", "replica")
    engine = engines[replica]
    step_log = engine.plugin_manager.get_plugin(STEP_LOG_SPEC) if engine.plugin_manager is not None else None
    data = engine_snapshot(engine.scheduler, step_log if isinstance(step_log, StepLog) else None)
    policy = engine.policy
    served = getattr(policy.scheduling, "served", None)
    clients = {key: {"in_flight": count} for key, count in state.inflight_per_key.items()}
    for key, tokens in (served or {}).items():
        clients.setdefault(str(key), {"in_flight": 0})["served_tokens"] = tokens
    recent = list(state.metrics.recent)
    data.update({
        "model": state.model_names[0], "replica": replica, "num_replicas": len(engines),
        "policy": {"scheduling": policy.scheduling_policy, "eviction": policy.eviction_policy,
                   "plugins": plugin_names(engine.plugin_manager)},
        "clients": clients,
        "latency": {"ttft": _percentiles([r[1] for r in recent if r[1] is not None]),
                    "tpot": _percentiles([r[2] for r in recent if r[2] is not None]),
                    "recent": [list(r) for r in recent[-120:]]},
    })
    return data


def _replica(request: web.Request) -> int:
    try:
        return int(request.query.get("replica", "0"))
    except ValueError:
        raise bad_request("'replica' must be an integer", "replica") from None


async def engine_state(request: web.Request) -> web.Response:
    """GET /v1/engine/state[?replica=N]."""
    body = orjson.dumps(snapshot(request.app[STATE_KEY], _replica(request)))
    return web.Response(body=body, content_type="application/json")


async def engine_state_stream(request: web.Request) -> web.StreamResponse:
    """GET /v1/engine/state/stream[?interval=0.25&replica=N]: a snapshot every ``interval``
    seconds, as server-sent events, until the client leaves."""
    state = request.app[STATE_KEY]
    try:
        interval = float(request.query.get("interval", "0.25"))
    except ValueError:
        raise bad_request("'interval' must be a number of seconds", "interval") from None
    if not INTERVALS[0] <= interval <= INTERVALS[1]:
        raise bad_request(f"'interval' must be in [{INTERVALS[0]}, {INTERVALS[1]}] seconds", "interval")
    replica = _replica(request)
    snapshot(state, replica)  # NOTE: a bad replica is a 400 before the stream starts
    response = await open_sse(request)
    try:
        while not state.draining:
            await send_event(response, snapshot(state, replica))
            await asyncio.sleep(interval)
    except ConnectionError:
        pass  # the page was closed
    return response


async def page(request: web.Request) -> web.FileResponse:
    """GET /console and its files."""
    name = request.match_info.get("name") or "index.html"
    path = (STATIC / name).resolve()
    if path.parent != STATIC.resolve() or not path.is_file():
        raise web.HTTPNotFound()
    return web.FileResponse(path, headers={"Cache-Control": "no-cache"})


async def settings(request: web.Request) -> web.Response:
    """GET /console/settings: what the page needs before it reads any state (whether to ask
    for the key), so that it never makes a request it knows will be refused."""
    config = request.app[STATE_KEY].config
    return web.Response(body=orjson.dumps({"needs_key": config.api_key is not None}), content_type="application/json")


def add_routes(app: web.Application) -> None:
    app.router.add_get(PREFIX + "/settings", settings)
    app.router.add_get(PREFIX, page)
    app.router.add_get(PREFIX + "/{name}", page)
    app.router.add_get("/v1/engine/state", engine_state)
    app.router.add_get("/v1/engine/state/stream", engine_state_stream)
