"""ServerState: what the handlers share, kept on the app under STATE_KEY (no globals)."""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web
from jinja2 import TemplateError

from pagoda.engine.exceptions import RequestInterrupted
from pagoda.engine.model_loader import DEFAULT_MODEL, DEFAULT_MODEL_ALIASES
from pagoda.server.errors import APIError, bad_request
from pagoda.server.limits import ClientBudget, Limits
from pagoda.server.tokenizer_pool import TokenizerPool
from pagoda.server.tools import ToolSyntax, choose_tool_syntax

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from pagoda.engine.frontend.async_engine import AsyncEngine
    from pagoda.server.config import ServerConfig
    from pagoda.server.metrics import ServerMetrics
    from pagoda.server.responses import TokenStrings
    from pagoda.server.tracing import Tracing


def _tokens(count: int) -> str:
    return f"{count} token" if count == 1 else f"{count} tokens"


def served_model_names(model: str | None, names: list[str]) -> tuple[list[str], frozenset[str]]:
    """The names to list in /v1/models, and every name a request may use.

    Returns:
        ``(listed, accepted)``: ``--served-model-name`` values if given, else the
        ``--model`` value (the default model's name when it is left out); the default
        model also answers to its aliases.
    """
    if names:
        return list(names), frozenset(names)
    if model is None or model in DEFAULT_MODEL_ALIASES:
        return [DEFAULT_MODEL], frozenset((DEFAULT_MODEL, *DEFAULT_MODEL_ALIASES))
    return [model], frozenset((model, Path(model).name))


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a path to a Jinja file, the name of one Pagoda ships
    (``chatml_tools``: server/templates/), or the template itself."""
    if value is None:
        return None
    shipped = Path(__file__).parent / "templates" / f"{value}.jinja"
    if value.isidentifier() and shipped.is_file():
        return shipped.read_text()
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text()
    except OSError:
        pass
    return value


@dataclass(slots=True)
class ServerState:
    """Everything a request handler needs.

    Attributes:
        engine: The running engine.
        config: The server configuration.
        metrics: The Prometheus registry and per-request metrics.
        tracing: Span factory, None when tracing is off.
        token_str: Token id to text, for logprobs.
        model_names: Names listed by /v1/models (the first is the default).
        accepted_names: Every name a request may give as ``model``.
        chat_template: A template overriding the tokenizer's, or None.
        tool_syntax: How tools reach the model and how its calls are found (None: the
            model has no chat template).
        tokenizer_pool: Tokenizing and chat templates off the event loop, fair between clients
            (server/tokenizer_pool.py).
        created: When the server started (Unix seconds).
        draining: Set on shutdown: new generation requests get 503 (and /health says so).
        interrupted: Set when the shutdown timeout ran out: the requests still running were
            ended (a stream with an error event, others with a 503).
        inflight: The tasks running generation requests (for the drain on shutdown).
        idle: Set while no generation request runs.
        inflight_per_key: Generation requests in flight per client key (API key or address).
        running: The engine request ids of each running generation request, by the ids its
            client sees (``chatcmpl-...``, ``resp_...``, ``msg_...``), for cancelling by id.
        limits: Characters, sequences and tokens allowed (server/limits.py).
        budget: Sequences and tokens in flight per client.
    """

    engine: AsyncEngine
    config: ServerConfig
    metrics: ServerMetrics
    tracing: Tracing | None
    token_str: TokenStrings
    model_names: list[str]
    accepted_names: frozenset[str]
    chat_template: str | None = None
    tool_syntax: ToolSyntax | None = None
    tokenizer_pool: TokenizerPool = field(default_factory=TokenizerPool)
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False
    interrupted: bool = False
    inflight: set[asyncio.Task] = field(default_factory=set)
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    inflight_per_key: dict[str, int] = field(default_factory=dict)
    running: dict[str, list[str]] = field(default_factory=dict)
    limits: Limits = field(init=False)
    budget: ClientBudget = field(init=False)

    def __post_init__(self) -> None:
        self.idle.set()
        self.limits = Limits.resolve(self.config, self.engine)
        self.budget = ClientBudget(self.limits)
        template = self.served_template
        if template:
            self.tool_syntax = choose_tool_syntax(
                lambda messages, other, tools: self.render_chat(messages, kwargs={"tools": tools}, template=other),
                template, self.config.tool_call_parser)
            logger.info("tools: %s", self.tool_syntax.reason)

    # -- in-flight requests -----------------------------------------------------------

    def track(self, task: asyncio.Task, client_key: str) -> None:
        """Counts a generation request in; 503 while draining, 429 when a concurrency limit is
        reached."""
        if self.draining:
            raise shutting_down()
        config = self.config
        limit = config.max_concurrent_requests
        if limit is not None and len(self.inflight) >= limit:
            raise APIError(429, f"Too many concurrent requests: {len(self.inflight)} are in flight "
                                f"(--max-concurrent-requests {limit}). Retry later.",
                           code="too_many_requests", headers={"Retry-After": "1"})
        per_key = config.max_concurrent_requests_per_key
        if per_key is not None and self.inflight_per_key.get(client_key, 0) >= per_key:
            raise APIError(429, f"Too many concurrent requests from this client: {per_key} are in flight "
                                f"(--max-concurrent-requests-per-key {per_key}). Retry later.",
                           code="too_many_requests", headers={"Retry-After": "1"})
        self.adopt(task, client_key)

    def adopt(self, task: asyncio.Task, client_key: str) -> None:
        """Counts a generation in flight (the drain waits for it) without the limits' checks:
        a request admitted already that goes on in the background after its handler returns."""
        self.inflight.add(task)
        self.inflight_per_key[client_key] = self.inflight_per_key.get(client_key, 0) + 1
        self.idle.clear()

    def untrack(self, task: asyncio.Task, client_key: str) -> None:
        self.inflight.discard(task)
        count = self.inflight_per_key.get(client_key, 0) - 1
        if count > 0:
            self.inflight_per_key[client_key] = count
        else:
            self.inflight_per_key.pop(client_key, None)
        if not self.inflight:
            self.idle.set()

    async def drain(self, timeout: float) -> None:
        """Stops taking generation requests and waits up to ``timeout`` seconds for those in
        flight; then ends the rest so that each client hears why.

        At the timeout every engine request still running is interrupted: its handler sends a
        stream an error event (``shutting_down``) and ``[DONE]``, a non-streamed request a 503
        with Retry-After. A handler that has not reached the engine yet gets the same 503; one
        that still has not answered a few seconds later is cancelled (its connection cut).
        Once only: a second call (aiohttp's shutdown hook after the signal's drain) returns at once.
        """
        if self.draining:
            return
        self.draining = True
        if not self.inflight:
            logger.info("shutting down: no requests in flight")
            return
        logger.info("shutting down: draining %d in-flight requests (up to %.0f s)", len(self.inflight), timeout)
        with suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.idle.wait(), timeout)
            return
        ended = self.interrupt(f"--shutdown-timeout ({timeout:g} s) ran out")
        logger.warning("ending %d requests still running after %.0f s (--shutdown-timeout): %d in the engine",
                       len(self.inflight), timeout, ended)
        with suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.idle.wait(), 5)
            return
        for task in list(self.inflight):
            task.cancel()
        with suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.idle.wait(), 5)

    def interrupt(self, why: str) -> int:
        """Ends every request still running (``why`` completes "this request was still running
        when ..."): their handlers answer 503 shutting_down or an error event, and requests not
        yet in the engine get the 503; returns how many engine requests it ended."""
        self.interrupted = True
        return self.engine.interrupt_all(RequestInterrupted(why))

    # -- checks -----------------------------------------------------------------------

    def resolve_model(self, name: str | None) -> str:
        """The model name to answer with; 404 for a model this server does not serve."""
        if name is None:
            return self.model_names[0]
        if name not in self.accepted_names and self.lora_of(name) is None:
            raise APIError(404, f"The model `{name}` does not exist. This server serves "
                                f"{', '.join(self.model_names)}.", param="model", code="model_not_found")
        return name

    def lora_of(self, name: str | None) -> str | None:
        """``name`` where it names a loaded LoRA adapter (with --enable-lora), else None."""
        loras = self.engine.loras
        return name if name is not None and loras is not None and name in loras else None

    def is_healthy(self) -> bool:
        """True while the engine serves: also while it restarts a worker that died
        (requests wait for it), False once the restart budget is spent."""
        return self.engine.is_running

    def check_can_serve(self) -> None:
        """503 while draining, when the engine gave up, while it sleeps, or when the waiting queue is full."""
        if self.draining:
            raise shutting_down()
        if not self.is_healthy():
            raise APIError(503, f"The engine is not running: {self.engine.dead_reason}. Restart the server.",
                           code="engine_dead")
        if self.engine.is_sleeping:
            raise APIError(503, "The engine is asleep (POST /sleep); POST /wake_up first.", code="engine_sleeping")
        limit = self.config.max_waiting_requests
        if limit is not None and self.engine.num_waiting >= limit:
            raise APIError(503, f"The server is overloaded: {self.engine.num_waiting} requests are "
                                f"waiting (--max-waiting-requests {limit}). Retry later.",
                           code="overloaded", headers={"Retry-After": "1"})

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None, prompt_param: str,
                     max_tokens_param: str = "max_tokens") -> None:
        """400 when the prompt, or the prompt plus max_tokens, exceeds the context."""
        limit = self.engine.max_model_len
        if num_prompt_tokens >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens, but the prompt is "
                f"{_tokens(num_prompt_tokens)} long (the prompt plus at least one output token must fit). "
                "Shorten the prompt.",
                prompt_param, code="context_length_exceeded")
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise bad_request(
                f"'{max_tokens_param}' is too large: {max_tokens}. This model's maximum context length is {limit} "
                f"tokens and the prompt is {_tokens(num_prompt_tokens)} long "
                f"({num_prompt_tokens} + {max_tokens} > {limit}).", max_tokens_param, code="context_length_exceeded")

    # -- tokenizing -------------------------------------------------------------------

    async def run_tokenizer(self, fn, *args, client: str = "", cost: int = 0) -> Any:
        """``fn(*args)`` on a tokenizer thread: ``client`` asked, ``cost`` characters of work."""
        return await self.tokenizer_pool.run(fn, *args, client=client, cost=cost)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.engine.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    @property
    def served_template(self) -> str | None:
        """The chat template requests are rendered with (--chat-template, else the model's)."""
        return self.chat_template or self.engine.tokenizer.chat_template

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, kwargs: dict[str, Any] | None = None,
                    template: str | None = None) -> str:
        """Applies the chat template (``template``: another one for this request); 400
        naming ``messages`` when it cannot."""
        tokenizer = self.engine.tokenizer
        template = template or self.served_template
        if not template:
            raise bad_request("This model has no chat template; use /v1/completions, or start the server with "
                              "--chat-template.", "messages", code="no_chat_template")
        try:
            return tokenizer.apply_chat_template(
                messages, chat_template=template, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tokenize=False, **(kwargs or {}))
        except APIError:
            raise
        except TemplateError as exc:  # the template's own raise_exception(), or its syntax
            raise bad_request(f"The chat template could not render these messages: {exc}", "messages") from None
        except Exception:  # noqa: BLE001 - a Python error inside transformers: not the client's to read
            logger.warning("the chat template failed", exc_info=True)
            raise bad_request("The chat template could not render these messages (chat_template_kwargs or the "
                              "messages' fields do not fit it); see the server log.", "messages") from None


STATE_KEY = web.AppKey("pagoda_state", ServerState)


def shutting_down(reason: str = "The server is shutting down.") -> APIError:
    """The 503 of a server that is stopping. Retry-After is for load balancers and clients that
    go to another replica; ``x-should-retry: false`` keeps OpenAI's SDKs from silently retrying
    the same address, which is about to stop listening."""
    return APIError(503, reason, code="shutting_down", headers={"Retry-After": "5", "x-should-retry": "false"})


def cut_off(exc: RequestInterrupted) -> APIError:
    """The 503 of a request the shutdown timeout ended (see ServerState.drain)."""
    return shutting_down(f"The server is shutting down: this request was still running when {exc}.")

