"""The aiohttp application: routes, middlewares, and the engine's lifecycle.

``create_app`` builds the app; the engine (its loop task and its worker process) is
started by a cleanup context when the app starts and stopped when it stops, after the
in-flight requests have drained. ``run_server`` runs the app on uvloop with the signal
handling ``pagoda serve`` needs: SIGTERM or SIGINT stops listening, lets in-flight
requests finish for up to ``shutdown_timeout`` seconds, then cancels the rest (which
aborts them in the engine) and stops the worker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import hashlib
import hmac
import logging
import os
import signal
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import suppress
from importlib import metadata
from typing import TYPE_CHECKING

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from pagoda.engine.core.snapshot import STEP_LOG_SPEC
from pagoda.engine.frontend.data_parallel import create_engine
from pagoda.engine.config import EngineConfig
from pagoda.server.config import ServerConfig
from pagoda.server.connections import harden
from pagoda.server.errors import APIError, bad_request, error_middleware
from pagoda.server.metrics import ServerMetrics
from pagoda.server.protocol import Body, parse_messages
from pagoda.server.responses import TokenStrings
from pagoda.server import console, lora_api, messages_api, responses_api, scoring_api, sleep_api
from pagoda.server.embeddings import embeddings
from pagoda.server.serving import cancel_request, chat_completions, client_key, completions, read_json
from pagoda.server.state import STATE_KEY, ServerState, load_chat_template, served_model_names, shutting_down
from pagoda.server.tracing import Tracing, build_tracer_provider

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

logger = logging.getLogger(__name__)

#: Reachable without the API key (load balancers and orchestrators probe it).
PUBLIC_PATHS = frozenset({"/health"})
#: Seconds between the engine's death and the server's exit (requests get 503 meanwhile).
ENGINE_DEATH_GRACE = 5.0


def _json(payload: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(payload), content_type="application/json")


def _version() -> str:
    try:
        return metadata.version("pagoda")
    except metadata.PackageNotFoundError:
        return "unknown"


# -- middlewares --------------------------------------------------------------------------


def auth_middleware(api_key: str, public_prefix: str | None = None):
    """Requires ``Authorization: Bearer <api_key>`` (or ``x-api-key: <api_key>``, as Anthropic's
    clients send it) on every path but /health and, with the console on, its page (/console and
    its files: they hold no data; the page asks for the key to read the engine's state).

    The keys are compared as SHA-256 digests with ``hmac.compare_digest``, so the time
    taken depends on neither the key's content nor its length.
    """
    expected = hashlib.sha256(api_key.encode()).digest()
    challenge = {"WWW-Authenticate": "Bearer"}

    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        public = request.path in PUBLIC_PATHS or (public_prefix is not None and (
            request.path == public_prefix or request.path.startswith(public_prefix + "/")))
        if not public:
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            if "x-api-key" in request.headers and not token.strip():
                scheme, token = "bearer", request.headers["x-api-key"]
            if scheme.lower() != "bearer" or not token.strip():
                raise APIError(401, "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.",
                               code="invalid_api_key", headers=challenge)
            if not hmac.compare_digest(hashlib.sha256(token.strip().encode()).digest(), expected):
                raise APIError(401, "Incorrect API key provided.", code="invalid_api_key", headers=challenge)
        return await handler(request)

    return middleware


def cors(origins: list[str], methods: list[str], headers: list[str], credentials: bool):
    """CORS as browsers ask for it (--allowed-origins, --allowed-methods, --allowed-headers,
    --allow-credentials): preflight ``OPTIONS`` answered here, before the API key is asked
    for (browsers never send it on a preflight), and the ``Access-Control-Allow-*`` headers on
    every answer to an allowed origin, errors and streams included.

    Returns:
        (the preflight middleware, the on_response_prepare callback).
    """
    any_origin, any_header = "*" in origins, "*" in headers

    def allow_origin(request: web.Request) -> str | None:
        origin = request.headers.get("Origin")
        if origin is None or not (any_origin or origin in origins):
            return None
        # NOTE: with credentials the literal "*" is not allowed: the origin is echoed back.
        return "*" if any_origin and not credentials else origin

    @web.middleware
    async def preflight(request: web.Request, handler) -> web.StreamResponse:
        if request.method != "OPTIONS" or "Access-Control-Request-Method" not in request.headers:
            return await handler(request)
        origin = allow_origin(request)
        if origin is None:
            raise APIError(403, "This origin is not allowed (--allowed-origins).", code="cors_origin_not_allowed")
        asked = request.headers.get("Access-Control-Request-Headers", "")
        return web.Response(status=204, headers={
            "Access-Control-Allow-Methods": ", ".join(methods),
            "Access-Control-Allow-Headers": asked if any_header else ", ".join(headers),
            "Access-Control-Max-Age": "600",
        })

    async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
        origin = allow_origin(request)
        if origin is None:
            return
        response.headers["Access-Control-Allow-Origin"] = origin
        if origin != "*":
            response.headers.add("Vary", "Origin")
        if credentials:
            response.headers["Access-Control-Allow-Credentials"] = "true"

    return preflight, on_prepare


def body_size_middleware(max_bytes: int):
    """413 for a declared Content-Length over the limit, before reading the body.

    Bodies without a Content-Length (chunked) hit aiohttp's ``client_max_size`` (the same
    limit) while being read; the error middleware reshapes that 413 too.
    """

    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        length = request.content_length
        if length is not None and length > max_bytes:
            raise APIError(413, f"Request body too large: {length} bytes; the limit is {max_bytes} bytes.",
                           code="request_too_large")
        return await handler(request)

    return middleware


# -- small endpoints ----------------------------------------------------------------------


async def health(request: web.Request) -> web.Response:
    """GET /health: 200 while the engine can serve (also while it restarts a dead worker), 503 once it
    has given up on its worker or while it is stopping."""
    state = request.app[STATE_KEY]
    if state.draining:
        return shutting_down().to_response()
    if not state.is_healthy():
        return APIError(503, f"The engine is not serving: {state.engine.dead_reason}.",
                        code="engine_dead").to_response()
    return _json({"status": "ok"})


async def version(request: web.Request) -> web.Response:
    """GET /version."""
    return _json({"version": _version()})


def _model_card(state: ServerState, name: str) -> dict:
    return {"id": name, "object": "model", "created": state.created, "owned_by": "pagoda",
            "root": state.engine.config.model or state.model_names[0], "parent": None,
            "max_model_len": state.engine.max_model_len}


def _adapter_card(state: ServerState, name: str) -> dict:
    """A LoRA adapter as a model (vLLM's card: the base model as its parent, its directory as root)."""
    adapter = state.engine.loras.get(name)
    return {"id": name, "object": "model", "created": state.created, "owned_by": "pagoda", "root": adapter.path,
            "parent": state.model_names[0], "max_model_len": state.engine.max_model_len}


async def list_models(request: web.Request) -> web.Response:
    """GET /v1/models: the model's names, then the LoRA adapters loaded."""
    state = request.app[STATE_KEY]
    cards = [_model_card(state, name) for name in state.model_names]
    if state.engine.loras is not None:
        cards += [_adapter_card(state, adapter.name) for adapter in state.engine.loras]
    return _json({"object": "list", "data": cards})


async def get_model(request: web.Request) -> web.Response:
    """GET /v1/models/{model}."""
    state = request.app[STATE_KEY]
    name = state.resolve_model(request.match_info["model"])
    return _json(_adapter_card(state, name) if state.lora_of(name) else _model_card(state, name))


async def metrics(request: web.Request) -> web.Response:
    """GET /metrics: Prometheus text format."""
    body = request.app[STATE_KEY].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def tokenize(request: web.Request) -> web.Response:
    """POST /tokenize: ``{"prompt": str}`` or ``{"messages": [...]}`` to token ids (vLLM's API)."""
    state = request.app[STATE_KEY]
    client = client_key(request, state.config.client_header)
    body = await read_json(request)
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    known = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "continue_final_message",
             "chat_template_kwargs", "return_token_strs"}
    for name in body:
        if name not in known:
            raise bad_request(f"Unrecognized request argument supplied: {name}", name, code="unrecognized_argument")
    b = Body(body)
    state.resolve_model(b.str_("model"))
    if ("prompt" in body) == ("messages" in body):
        raise bad_request("give exactly one of 'prompt' and 'messages'", "prompt")
    if "prompt" in body:
        prompt = b.str_("prompt")
        if prompt is None:
            raise bad_request("'prompt' must be a string", "prompt")
        state.limits.check_chars(len(prompt), "prompt")
        ids = await state.run_tokenizer(state.encode, prompt, b.bool_("add_special_tokens", True), client=client,
                                        cost=len(prompt))
    else:
        messages = parse_messages(body.get("messages"))
        num_chars = sum(len(m.get("content") or "") for m in messages)
        state.limits.check_chars(num_chars, "messages")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs")
        text = await state.run_tokenizer(state.render_chat, messages, b.bool_("add_generation_prompt", True),
                                         b.bool_("continue_final_message", False), kwargs, client=client,
                                         cost=num_chars)
        ids = await state.run_tokenizer(state.encode, text, b.bool_("add_special_tokens", False), client=client,
                                        cost=len(text))
    result = {"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids, "token_strs": None}
    if b.bool_("return_token_strs", False):
        result["token_strs"] = state.engine.tokenizer.convert_ids_to_tokens(ids)
    return _json(result)


async def detokenize(request: web.Request) -> web.Response:
    """POST /detokenize: ``{"tokens": [ids]}`` to ``{"prompt": text}`` (vLLM's API)."""
    state = request.app[STATE_KEY]
    body = await read_json(request)
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    for name in body:
        if name not in ("model", "tokens"):
            raise bad_request(f"Unrecognized request argument supplied: {name}", name, code="unrecognized_argument")
    state.resolve_model(Body(body).str_("model"))
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise bad_request("'tokens' must be a list of token ids", "tokens")
    if len(tokens) > state.engine.max_model_len:
        raise bad_request(f"'tokens' has {len(tokens)} ids; at most this model's maximum context length "
                          f"({state.engine.max_model_len}) are allowed", "tokens", code="context_length_exceeded")
    try:
        ids = state.engine.encode_prompt(tokens) if tokens else []
    except ValueError as exc:
        raise bad_request(str(exc).replace("prompt token ids", "'tokens'"), "tokens") from None
    text = await state.run_tokenizer(state.engine.tokenizer.decode, ids)
    return _json({"prompt": text})


# -- the app ------------------------------------------------------------------------------


def create_app(engine_config: EngineConfig, config: ServerConfig | None = None,
               tracer_provider: TracerProvider | None = None,
               on_engine_death: Callable[[], None] | None = None) -> web.Application:
    """Builds the server app; the engine starts when the app starts.

    Args:
        engine_config: The engine to run.
        config: Server options (defaults when None).
        tracer_provider: A tracer provider to use instead of the one the OTEL_*
            variables and ``config.otlp_traces_endpoint`` describe; the caller owns it.
        on_engine_death: Called ENGINE_DEATH_GRACE seconds after the engine stops for
            good (its worker restart budget spent), unless
            ``config.keep_alive_on_engine_death``; ``pagoda serve`` exits with status 1.

    Raises:
        ValueError: A tracing option asks for an exporter that is not installed.
    """
    config = config or ServerConfig()
    owned_provider = None
    if tracer_provider is None:
        tracer_provider = owned_provider = build_tracer_provider(config.otlp_traces_endpoint)
    chat_template = load_chat_template(config.chat_template)
    model_names, accepted_names = served_model_names(engine_config.model, config.served_model_names)
    if config.console and STEP_LOG_SPEC not in engine_config.plugins:
        # NOTE: each replica's recent steps, for the console's time line (no log without one).
        engine_config = dataclasses.replace(engine_config, plugins=(*engine_config.plugins, STEP_LOG_SPEC))

    middlewares = [error_middleware({messages_api.PREFIX: messages_api.error_body})]
    on_prepare = None
    if config.allowed_origins:
        preflight, on_prepare = cors(config.allowed_origins, config.allowed_methods, config.allowed_headers,
                                     config.allow_credentials)
        middlewares.append(preflight)
    if config.api_key is not None:
        middlewares.append(auth_middleware(config.api_key, console.PREFIX if config.console else None))
    middlewares.append(body_size_middleware(config.max_body_bytes))
    app = web.Application(middlewares=middlewares, client_max_size=config.max_body_bytes,
                          handler_args={"keepalive_timeout": config.header_timeout})
    harden(app, config.max_connections)
    if on_prepare is not None:
        app.on_response_prepare.append(on_prepare)

    async def engine_context(app: web.Application) -> AsyncIterator[None]:
        engine = create_engine(engine_config)
        try:
            await engine.start()
        except BaseException:
            await engine.shutdown()
            raise
        state = ServerState(
            engine=engine, config=config, metrics=ServerMetrics(engine, model_names[0]),
            tracing=Tracing(tracer_provider) if tracer_provider is not None else None,
            token_str=TokenStrings(engine.tokenizer), model_names=model_names, accepted_names=accepted_names,
            chat_template=chat_template,
        )
        app[STATE_KEY] = state
        watcher = None
        if on_engine_death is not None and not config.keep_alive_on_engine_death:
            watcher = asyncio.create_task(_exit_on_engine_death(engine, on_engine_death), name="pagoda-death-watch")
        try:
            yield
        finally:
            if watcher is not None:
                watcher.cancel()
                with suppress(asyncio.CancelledError):
                    await watcher
            state.draining = True
            await engine.shutdown()
            logger.info("engine stopped")
            state.tokenizer_pool.shutdown()

    async def tracing_context(app: web.Application) -> AsyncIterator[None]:
        yield
        if owned_provider is not None:
            owned_provider.shutdown()  # flushes the spans still queued

    async def drain(app: web.Application) -> None:
        # NOTE: on_shutdown runs once the listening sockets are closed and before aiohttp
        # waits for its handlers (up to twice its own timeout); draining here makes
        # shutdown_timeout the bound. New requests on kept-alive connections get 503.
        state = app.get(STATE_KEY)
        if state is not None:
            await state.drain(config.shutdown_timeout)

    # NOTE: cleanup runs in reverse order: the engine stops before the last spans flush.
    app.cleanup_ctx.append(tracing_context)
    app.cleanup_ctx.append(engine_context)
    app.on_shutdown.append(drain)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", get_model)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/requests/{request_id}/cancel", cancel_request)
    responses_api.add_routes(app, config.responses_store_size)
    messages_api.add_routes(app)
    scoring_api.add_routes(app)
    lora_api.add_routes(app)
    sleep_api.add_routes(app)
    if config.console:
        console.add_routes(app)
    return app


async def _exit_on_engine_death(engine, exit_server: Callable[[], None]) -> None:
    """Waits for the engine to stop for good, then (after a grace period in which requests
    get their 503s and /health says why) asks the server to exit, so that a supervisor that
    watches the process (systemd, Kubernetes) starts a new one."""
    while engine.is_running:
        await asyncio.sleep(0.5)
    logger.error("the engine stopped for good (%s); the server exits with status 1 in %.0f s "
                 "(--keep-alive-on-engine-death keeps it up)", engine.dead_reason, ENGINE_DEATH_GRACE)
    await asyncio.sleep(ENGINE_DEATH_GRACE)
    exit_server()


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads, so a port in use fails at once.

    Raises:
        ValueError: The address cannot be had (in use, not this machine's, no permission).
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise ValueError(f"cannot listen on {host!r}: {exc.strerror}") from None
    sock = socket.socket(family, kind, proto)
    try:
        # NOTE: as aiohttp's own sites do: a restart may bind while old connections linger.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ValueError(f"cannot listen on {host}:{port}: the port is already in use (is another server "
                             "running?); stop it or choose another port with --port") from None
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def run_server(engine_config: EngineConfig, config: ServerConfig) -> int:
    """Serves until SIGTERM or SIGINT, on uvloop when it is installed; blocks.

    Returns:
        The exit status: 0, or 1 when the server stopped because the engine died.

    Raises:
        ValueError: The address cannot be listened on (checked before the model loads).
    """
    sock = bind_socket(config.host, config.port)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        import asyncio

        loop = asyncio.new_event_loop()
    else:
        loop = uvloop.new_event_loop()
    engine_died = False

    def exit_on_death() -> None:
        nonlocal engine_died
        engine_died = True
        os.kill(os.getpid(), signal.SIGTERM)  # the same graceful stop as a supervisor's

    app = create_app(engine_config, config, on_engine_death=exit_on_death)
    host = f"[{config.host}]" if ":" in config.host else config.host
    base_url = f"http://{host}:{sock.getsockname()[1]}/v1"

    def ready(_message: str) -> None:
        # NOTE: aiohttp calls this once its sites listen (after the engine has started).
        state = app[STATE_KEY]
        console_line = f"; console at {base_url.removesuffix('/v1')}/console" if config.console else ""
        logger.info("ready on %s: model %s, %s%s. Press CTRL+C to stop.", base_url, ", ".join(state.model_names),
                    state.engine.describe(), console_line)

    signals: list[int] = []
    stopped: list[bool] = []

    def stop() -> None:
        # NOTE: once: a GracefulExit raised while run_app cleans up would escape it (status 1).
        if not stopped:
            stopped.append(True)
            raise web.GracefulExit()  # raised from a loop callback, it ends run_app's loop

    def on_signal() -> None:
        # NOTE: aiohttp's own handler stops listening at once, so /health would refuse
        # connections during the drain: this one drains while still listening (/health and
        # new requests get 503 shutting_down), then stops the app. A second signal ends the
        # requests still running (as the timeout would) and stops now; later ones are ignored.
        signals.append(1)
        state = app.get(STATE_KEY)
        if state is None and len(signals) == 1:
            stop()  # still starting: nothing to drain
        if len(signals) == 1:
            loop.create_task(_drain_then_exit(state, config.shutdown_timeout, lambda: loop.call_soon(stop)))
        elif len(signals) == 2:
            logger.warning("a second signal: ending every request now")
            if state is not None:
                state.interrupt("a second stop signal came")
            stop()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal)
    web.run_app(
        app, sock=sock, loop=loop, handler_cancellation=True, shutdown_timeout=config.shutdown_timeout,
        access_log=logging.getLogger("aiohttp.access") if config.access_log else None, print=ready,
        handle_signals=False,
    )
    return 1 if engine_died else 0


async def _drain_then_exit(state: ServerState, timeout: float, stop: Callable[[], object]) -> None:
    try:
        await state.drain(timeout)
    except Exception:  # noqa: BLE001 - the server stops whatever the drain met
        logger.exception("the drain failed; stopping")
    stop()
