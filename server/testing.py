"""ServerThread: the real server on 127.0.0.1 in a background thread, for tests and notebooks.

It runs the same app as ``pagoda serve`` (same middlewares, same engine lifecycle,
``handler_cancellation=True``) on its own uvloop event loop, so a test can drive it with
any HTTP client and still look at the engine (``server.call(fn)`` runs ``fn`` on the
server's loop, where reading engine state is race-free).
"""

from __future__ import annotations

import asyncio
import json as jsonlib
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from aiohttp import web

from pagoda.server.app import create_app
from pagoda.server.config import ServerConfig
from pagoda.server.state import STATE_KEY, ServerState

if TYPE_CHECKING:
    from pagoda.engine.frontend.async_engine import AsyncEngine
    from pagoda.engine.config import EngineConfig

T = TypeVar("T")


class ServerThread:
    """Serves an app on a free port of 127.0.0.1 from a daemon thread.

    Example:
        >>> with ServerThread(EngineConfig(model=path, dtype="float32")) as server:
        ...     openai.OpenAI(base_url=server.url + "/v1", api_key="x")

    Args:
        engine_config: The engine to run.
        config: Server options; host and port are ignored.
        tracer_provider: Passed to create_app (e.g. one with an in-memory exporter).
        shutdown_timeout: Seconds in-flight requests get when the server stops.
    """

    def __init__(self, engine_config: EngineConfig, config: ServerConfig | None = None, tracer_provider=None,
                 shutdown_timeout: float = 5.0) -> None:
        self._app = create_app(engine_config, config, tracer_provider)
        self._shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="pagoda-test-server", daemon=True)
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def state(self) -> ServerState:
        return self._app[STATE_KEY]

    @property
    def engine(self) -> AsyncEngine:
        return self.state.engine

    def start(self, timeout: float = 120.0) -> ServerThread:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("the server did not start in time")
        if self._error is not None:
            raise RuntimeError("the server failed to start") from self._error
        return self

    def call(self, fn: Callable[[], T], timeout: float = 30.0) -> T:
        """Runs ``fn()`` on the server's event loop and returns its result."""
        async def run() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout)

    def stop(self, timeout: float = 60.0) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()

    def _run(self) -> None:
        try:
            import uvloop

            loop = uvloop.new_event_loop()
        except ImportError:  # pragma: no cover
            loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._serve())
        except BaseException as exc:  # noqa: BLE001 - reported to start()
            self._error = exc
        finally:
            self._ready.set()
            loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        runner = web.AppRunner(self._app, handler_cancellation=True, shutdown_timeout=self._shutdown_timeout,
                               access_log=None)
        await runner.setup()
        try:
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.port = runner.addresses[0][1]
            self._ready.set()
            await self._stop.wait()
        finally:
            await runner.cleanup()


@dataclass(slots=True)
class HTTPResult:
    """A finished HTTP exchange (see :func:`http_request`)."""

    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode()

    def json(self) -> Any:
        return jsonlib.loads(self.body)


def http_request(url: str, method: str = "GET", *, json: Any = None, data: bytes | None = None,
                 headers: dict[str, str] | None = None, timeout: float = 60.0) -> HTTPResult:
    """One plain HTTP request with the standard library; error statuses are returned, not raised."""
    headers = dict(headers or {})
    if json is not None:
        data = jsonlib.dumps(json).encode()
        headers.setdefault("Content-Type", "application/json")
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return HTTPResult(response.status, dict(response.headers), response.read())
    except urllib.error.HTTPError as exc:
        return HTTPResult(exc.code, dict(exc.headers), exc.read())
