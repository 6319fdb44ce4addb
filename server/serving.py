"""POST /v1/completions and /v1/chat/completions: validate, submit, stream or collect.

One HTTP request becomes one engine request per prompt (a completions request may hold
many); each engine request carries the ``n`` samples. Choice ``i`` of prompt ``p`` is
choice ``p * n + i`` of the response, as in OpenAI's and vLLM's APIs.

A client that goes away cancels the handler (``handler_cancellation=True``): the engine
streams are closed, which aborts their requests and frees their KV blocks before the
next step.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import orjson
from aiohttp import web

from pagoda.engine.frontend.output_processor import OutputKind
from pagoda.engine.outputs import RequestOutput
from pagoda.engine.reasoning import REASONING_PARSERS
from pagoda.engine.sampling_params import StructuredOutputsParams
from pagoda.engine.exceptions import (AdmissionPluginFailed, EngineDeadError, RequestInterrupted, RequestRejected,
                                      StepError)
from pagoda.server.errors import APIError, bad_request, from_value_error
from pagoda.server.metrics import RequestTracker
from pagoda.server.protocol import GenerateRequest, parse_chat, parse_completion
from pagoda.server.responses import (ChoiceBuilder, ChoiceState, echoed_prompt_logprobs, usage,
                                     vllm_prompt_logprobs)
from pagoda.server.state import STATE_KEY, ServerState, cut_off, shutting_down
from pagoda.server.streaming import merge, open_sse, send_done, send_event
from pagoda.server.tools import ToolRequest, tools_in_system, uses_tools
from pagoda.server.tracing import RequestSpan


logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Job:
    """One prompt's engine request."""

    request_id: str
    prompt: str | list[int]
    prompt_token_ids: list[int]
    echo: str
    tracker: RequestTracker
    stream: Any = None
    final: RequestOutput | None = None
    latest: RequestOutput | None = None
    # Per sample: tokens generated so far and the finish reason (streams read deltas).
    num_tokens: list[int] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)


class ChatShape:
    """How an engine endpoint's request reads and its answer is sent: OpenAI's chat and
    completions APIs as they are. The Responses and Anthropic Messages APIs
    (server/responses_api.py, server/messages_api.py) subclass it: each turns its request into a
    chat request, and the chat answer (a ``chat.completion`` payload, or the stream of its
    chunks, which then always end with the usage) into its own."""

    #: The API's name for a chat request's field, in error messages (``max_tokens`` ->
    #: ``max_output_tokens``).
    params: dict[str, str] = {}
    #: The request runs on after its handler answers (``accepted()``), its result kept by the
    #: shape (the Responses API's ``background``).
    background = False

    def accepted(self) -> web.StreamResponse:
        """The answer to a background request, sent at once."""
        raise NotImplementedError

    def failed(self, error: APIError) -> None:
        """A background request failed with ``error``."""

    def to_chat(self, body: Any) -> Any:
        return body

    def param(self, name: str | None) -> str | None:
        """``name`` in the API's terms (the first part of a path: ``messages[2].content`` ->
        ``input``)."""
        if name is None:
            return None
        head = name.split("[", 1)[0].split(".", 1)[0]
        return self.params[head] if head in self.params else name

    def respond(self, payload: dict[str, Any]) -> web.StreamResponse:
        return web.Response(body=orjson.dumps(payload), content_type="application/json",
                            headers={"X-Request-Id": payload["id"]})

    async def open(self, request: web.Request, head: dict[str, Any], usage: dict[str, Any]) -> web.StreamResponse:
        """Starts the stream (``usage``: the prompt's, nothing generated yet)."""
        return await open_sse(request, {"X-Request-Id": head["id"]})

    async def chunk(self, response: web.StreamResponse, chunk: dict[str, Any]) -> None:
        await send_event(response, chunk)

    async def fail(self, response: web.StreamResponse, error: APIError) -> None:
        await send_event(response, error.to_dict())
        await send_done(response)

    async def end(self, response: web.StreamResponse) -> None:
        await send_done(response)


CHAT = ChatShape()


async def read_json(request: web.Request) -> Any:
    """The request body as JSON; 400 when it does not parse (413 comes from aiohttp's size limit)."""
    timeout = request.app[STATE_KEY].config.body_timeout
    try:
        raw = await asyncio.wait_for(request.read(), timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"The request body did not arrive within {timeout:g} s (--body-timeout).",
                       code="request_timeout") from None
    if not raw:
        raise bad_request("The request body is empty; send a JSON object.", code="invalid_json")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}", code="invalid_json") from None


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions."""
    return await serve_tracked(request, "text_completion", partial(_generate, chat=False))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    return await serve_tracked(request, "chat", partial(_generate, chat=True))


async def serve_tracked(request: web.Request, operation: str, handler) -> web.StreamResponse:
    """Runs an engine endpoint's ``handler(request, state, span, client)`` under the
    per-client connection count and a trace span named ``operation``."""
    state = request.app[STATE_KEY]
    span = state.tracing.start(request, operation) if state.tracing is not None else RequestSpan()
    status, error = 500, None
    task = asyncio.current_task()
    key = client_key(request, state.config.client_header)
    try:
        state.track(task, key)
    except APIError as exc:
        span.end(exc.status, exc.message)
        raise
    try:
        response = await handler(request, state, span, key)
        status = response.status
        return response
    except APIError as exc:
        status, error = exc.status, exc.message
        raise
    except asyncio.CancelledError:
        status, error = 499, "the client disconnected"
        raise
    finally:
        state.untrack(task, key)
        span.end(status, error)


async def cancel_request(request: web.Request) -> web.Response:
    """POST /v1/requests/{request_id}/cancel: ends a running request by the id its client saw
    (the response's ``id``, or ``X-Request-Id``). Its samples finish with ``finish_reason``
    "abort" (a stream gets that chunk and its end), and its KV blocks are freed before the
    next step."""
    cancel(request.app[STATE_KEY], request.match_info["request_id"])
    return web.Response(body=orjson.dumps({"id": request.match_info["request_id"], "object": "request",
                                           "status": "cancelled"}), content_type="application/json")


def cancel(state: ServerState, request_id: str) -> None:
    """Aborts the running request its client knows as ``request_id``; 404 when none runs."""
    engine_ids = state.running.get(request_id)
    if engine_ids is None:
        raise APIError(404, f"No request with id {request_id!r} is running (it may have finished).",
                       param="request_id", code="request_not_found")
    for engine_id in engine_ids:
        state.engine.abort(engine_id)
    logger.info("request %s cancelled by its id", request_id)


def client_key(request: web.Request, header: str | None = None) -> str:
    """Who a request is from, for the per-client limits and the fair policy: the value of
    ``header`` (--client-header) when set and present, else its API key, else its address."""
    if header is not None:
        value = request.headers.get(header, "").strip()
        if value:
            return "client:" + value[:256]
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        token = request.headers.get("x-api-key", "")  # Anthropic's clients send the key so
    if token.strip():
        return "key:" + hashlib.sha256(token.strip().encode()).hexdigest()[:16]
    return "addr:" + (request.remote or "unknown")


async def _generate(request: web.Request, state: ServerState, span: RequestSpan, client: str, *,
                    chat: bool, shape: ChatShape = CHAT) -> web.StreamResponse:
    try:
        return await _generate_as(request, state, span, client, chat, shape)
    except APIError as exc:
        exc.param = shape.param(exc.param)
        raise


async def generate_in_shape(request: web.Request, state: ServerState, span: RequestSpan, client: str,
                            shape: ChatShape) -> web.StreamResponse:
    """A chat request in another API's shape (``shape`` reads it and writes the answer)."""
    return await _generate(request, state, span, client, chat=True, shape=shape)


async def _generate_as(request: web.Request, state: ServerState, span: RequestSpan, client: str, chat: bool,
                       shape: ChatShape) -> web.StreamResponse:
    config, engine = state.config, state.engine
    body = shape.to_chat(await read_json(request))
    gen = parse_chat(body, config, state.tool_syntax) if chat else parse_completion(body, config)
    model = state.resolve_model(gen.model)
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    span.set_request(gen, request_id, model, state.lora_of(model))
    state.check_can_serve()
    state.budget.check_room(client)
    jobs = await _prepare(state, gen, chat, request_id, client)
    num_sequences, num_tokens = _cost(gen, jobs, engine.max_model_len)
    state.limits.check_tokens(num_tokens, gen.max_tokens_param)
    state.budget.charge(client, num_sequences, num_tokens)

    if not shape.background:
        try:
            return await _run(request, state, gen, chat, span, request_id, jobs, model, client, shape)
        finally:
            state.budget.release(client, num_sequences, num_tokens)

    async def in_background() -> None:
        try:
            # NOTE: a span of its own: the request's ends with its handler.
            await _run(None, state, gen, chat, RequestSpan(), request_id, jobs, model, client, shape)
        except APIError as exc:
            shape.failed(exc)
        except asyncio.CancelledError:
            shape.failed(shutting_down())  # the drain ran out
            raise
        except Exception as exc:  # noqa: BLE001 - it has no handler to answer for it
            logger.exception("background request %s failed", request_id)
            shape.failed(APIError(500, f"Generation failed: {exc!r}", code="generation_failed"))

    def ended(task: asyncio.Task) -> None:
        # NOTE: here, not in the coroutine: a task cancelled before it ran never enters it.
        state.budget.release(client, num_sequences, num_tokens)
        state.untrack(task, client)

    task = asyncio.create_task(in_background(), name=f"pagoda-background-{request_id}")
    state.adopt(task, client)
    task.add_done_callback(ended)
    return shape.accepted()


def _cost(gen: GenerateRequest, jobs: list[_Job], max_model_len: int) -> tuple[int, int]:
    """(sequences, tokens) a request asks for: prompts x n, and each sequence's prompt plus
    the tokens it may generate."""
    n, max_tokens = gen.params.n, gen.params.max_tokens
    num_tokens = 0
    for job in jobs:
        room = max_model_len - len(job.prompt_token_ids)
        num_tokens += (len(job.prompt_token_ids) + (room if max_tokens is None else min(max_tokens, room))) * n
    return len(jobs) * n, num_tokens


async def _run(request: web.Request, state: ServerState, gen: GenerateRequest, chat: bool, span: RequestSpan,
               request_id: str, jobs: list[_Job], model: str, client: str, shape: ChatShape) -> web.StreamResponse:
    """Submits a validated request's prompts and streams or collects the answer."""
    engine = state.engine
    reasoning = engine.config.reasoning_parser
    builder = ChoiceBuilder(chat, gen.logprobs, state.token_str, gen.tools,
                            REASONING_PARSERS[reasoning] if reasoning is not None else None)
    # NOTE: an answer that may repeat a call is read as it grows, so that a repeat ends it.
    watch = builder.watches_repeats and gen.params.n == 1 and len(jobs) == 1
    kind = OutputKind.DELTA if gen.stream else OutputKind.CUMULATIVE if watch else OutputKind.FINAL
    if state.interrupted:
        raise shutting_down()  # NOTE: prepared (tokenized, compiled) while the drain ran out
    try:
        for job in jobs:
            job.stream = engine.add_request(job.prompt, gen.params, request_id=job.request_id,
                                            prompt_token_ids=job.prompt_token_ids, priority=gen.priority,
                                            cache_salt=gen.cache_salt, kv_retention=gen.kv_retention, client=client,
                                            output_kind=kind, lora_name=state.lora_of(model))
    except (ValueError, EngineDeadError, AdmissionPluginFailed) as exc:
        for job in jobs:
            engine.abort(job.request_id)
        if isinstance(exc, EngineDeadError):
            raise APIError(503, f"The engine is not running: {exc}", code="engine_dead") from None
        if isinstance(exc, AdmissionPluginFailed):
            raise APIError(500, str(exc), code="admission_plugin_failed") from None
        if isinstance(exc, RequestRejected):
            raise rejection_error(exc) from None
        raise from_value_error(exc, "messages" if chat else "prompt") from None
    created = int(time.time())
    head = {"id": request_id, "object": _object(chat, gen.stream), "created": created, "model": model}
    names = {request_id, getattr(shape, "id", request_id)}  # NOTE: the ids its client may cancel it by
    for name in names:
        state.running[name] = [job.request_id for job in jobs]
    try:
        if gen.stream:
            return await _stream(request, state, gen, jobs, builder, head, span, watch, shape)
        return shape.respond(await _collect(state, gen, jobs, builder, head, span, watch))
    except BaseException as exc:
        _abandon(state, jobs, gen.params.n, "abort" if isinstance(exc, asyncio.CancelledError) else "error")
        raise
    finally:
        for name in names:
            state.running.pop(name, None)


def rejection_error(exc: RequestRejected) -> APIError:
    """A plugin's refusal: 429 with Retry-After when it is temporary, else 403.

    NOTE: OpenAI clients retry a 429 (and 5xx) by themselves; a permanent refusal must
    not be one, or every rejected request is sent three times.
    """
    if exc.retry_after is None:
        return APIError(403, str(exc), code="request_rejected")
    return APIError(429, str(exc), code="rate_limited", headers={"Retry-After": str(math.ceil(exc.retry_after))})


def _abandon(state: ServerState, jobs: list[_Job], n: int, reason: str) -> None:
    """Aborts the unfinished engine requests (their blocks are freed before the next step),
    with a log line for each: ``reason`` "abort" when the client left, "error" otherwise."""
    for job in jobs:
        if job.final is None:
            state.engine.abort(job.request_id)
            job.tracker.abort(n, reason)
            logger.info("request %s %s after %d generated tokens: aborted, its KV blocks freed", job.request_id,
                        "ended by its client" if reason == "abort" else "failed", sum(job.num_tokens or [0]))


def _object(chat: bool, stream: bool) -> str:
    if chat:
        return "chat.completion.chunk" if stream else "chat.completion"
    return "text_completion"


async def _prepare(state: ServerState, gen: GenerateRequest, chat: bool, request_id: str, client: str) -> list[_Job]:
    """Tokenizes (or renders and tokenizes) the prompts and checks them against the context."""
    engine, limits = state.engine, state.limits
    # NOTE: both bounds come before the tokenizer runs: a huge prompt costs nothing but a 400.
    limits.check_sequences((1 if chat else len(gen.prompts)) * gen.params.n)
    if chat:
        num_chars = (sum(len(m.get("content") or "") for m in gen.messages)
                     + (len(orjson.dumps(gen.tools.tools)) if gen.tools is not None else 0))
        limits.check_chars(num_chars, "messages")
    else:
        for prompt in gen.prompts:
            if isinstance(prompt, str):
                limits.check_chars(len(prompt), "prompt")
    if chat:
        text, ids = await _render_chat(state, gen, client, num_chars)
        last = gen.messages[-1]
        echo = last["content"] if gen.echo and last["role"] == "assistant" else ""
        prompts = [(text, ids, echo)]
    else:
        texts = [p for p in gen.prompts if isinstance(p, str)]
        encoded = iter(await asyncio.gather(*(state.run_tokenizer(state.encode, t, gen.add_special_tokens,
                                                                  client=client, cost=len(t)) for t in texts)))
        prompts = []
        for prompt in gen.prompts:
            if isinstance(prompt, str):
                prompts.append((prompt, next(encoded), prompt if gen.echo else ""))
                continue
            try:
                ids = engine.encode_prompt(prompt)
            except ValueError as exc:
                raise bad_request(str(exc), "prompt") from None
            echo = await state.run_tokenizer(engine.tokenizer.decode, ids, client=client) if gen.echo else ""
            prompts.append((ids, ids, echo))
    if gen.tools is not None:
        # NOTE: every tool's schema is checked whatever the tool_choice (cached once compiled).
        await asyncio.to_thread(_check_tool_schemas, engine, gen.tools)
    structured = gen.params.structured_outputs
    if structured is not None:
        # NOTE: compiled (and validated) off the event loop; add_request finds it cached.
        try:
            await asyncio.to_thread(engine.compile_grammar, structured)
        except ValueError as exc:
            message = str(exc).removeprefix("structured_outputs: ")
            raise bad_request(f"{gen.structured_param}: {message}", gen.structured_param,
                              code="invalid_structured_outputs") from None
    jobs = []
    for index, (prompt, ids, echo) in enumerate(prompts):
        state.check_length(len(ids), gen.max_tokens, "messages" if chat else "prompt", gen.max_tokens_param)
        job_id = request_id if len(prompts) == 1 else f"{request_id}-{index}"
        jobs.append(_Job(job_id, prompt, ids, echo, state.metrics.tracker()))
    return jobs


async def _render_chat(state: ServerState, gen: GenerateRequest, client: str, cost: int) -> tuple[str, list[int]]:
    """A chat request's prompt: its messages (and tools) through the chat template, tokenized."""
    messages, kwargs, template = gen.messages, gen.chat_template_kwargs, None
    syntax = state.tool_syntax
    if syntax is not None and (gen.tools is not None or uses_tools(messages)):
        tools = gen.tools.tools if gen.tools is not None else None
        if syntax.in_system:
            messages = tools_in_system(messages, tools)
        elif tools is not None:
            kwargs = {**kwargs, "tools": tools}
        template = syntax.template
    text = await state.run_tokenizer(state.render_chat, messages, gen.add_generation_prompt,
                                     gen.continue_final_message, kwargs, template, client=client, cost=cost)
    ids = await state.run_tokenizer(state.encode, text, gen.add_special_tokens, client=client, cost=len(text))
    return text, ids


async def count_prompt_tokens(request: web.Request, state: ServerState, body: dict[str, Any]) -> int:
    """The tokens of a chat request's prompt as the model would see it (nothing generated)."""
    gen = parse_chat(body, state.config, state.tool_syntax)
    state.resolve_model(gen.model)
    num_chars = sum(len(m.get("content") or "") for m in gen.messages)
    state.limits.check_chars(num_chars, "messages")
    _, ids = await _render_chat(state, gen, client_key(request, state.config.client_header), num_chars)
    return len(ids)


def _check_tool_schemas(engine, tools: ToolRequest) -> None:
    """400 naming the tool whose parameters schema cannot be compiled."""
    for i, tool in enumerate(tools.tools):
        try:
            engine.compile_grammar(StructuredOutputsParams(json=ToolRequest.parameters_of(tool)))
        except ValueError as exc:
            message = str(exc).removeprefix("structured_outputs: ")
            raise bad_request(f"tools[{i}].function.parameters: {message}", f"tools[{i}].function.parameters",
                              code="invalid_structured_outputs") from None


def _usage(jobs: list[_Job]) -> dict[str, Any]:
    num_prompt = sum(len(job.prompt_token_ids) for job in jobs)
    num_completion = sum(sum(job.num_tokens) for job in jobs)
    num_cached = 0
    for job in jobs:
        out = job.final or job.latest
        if out is not None and out.metrics is not None:
            num_cached += out.metrics.num_cached_tokens
    return usage(num_prompt, num_completion, num_cached)


def _engine_error(exc: Exception) -> APIError:
    if isinstance(exc, RequestInterrupted):
        return cut_off(exc)
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"The engine stopped: {exc}", code="engine_dead")
    return APIError(500, f"Generation failed: {exc}", code="generation_failed")


def _finish(job: _Job, out: RequestOutput, gen: GenerateRequest, span: RequestSpan, cumulative: bool = False) -> None:
    """Takes one output of a job (a delta when streaming, else the final one, or everything
    so far when ``cumulative``)."""
    if gen.score_only:
        _drop_generated(out)
    job.latest = out
    if not job.num_tokens:
        job.num_tokens = [0] * len(out.outputs)
        job.finish_reasons = [None] * len(out.outputs)
    for i, o in enumerate(out.outputs):
        job.num_tokens[i] = len(o.token_ids) + (0 if cumulative else job.num_tokens[i])
        job.finish_reasons[i] = o.finish_reason or job.finish_reasons[i]
    job.tracker.update(out, job.num_tokens[0])
    if out.finished:
        job.final = out
        job.tracker.finish(out, gen.params.max_tokens, job.num_tokens, job.finish_reasons)
        span.add_output(out, sum(job.num_tokens), job.finish_reasons)


def _drop_generated(out: RequestOutput) -> None:
    """Scoring only (max_tokens 0): the one token the engine sampled is left out."""
    for o in out.outputs:
        o.text, o.token_ids = "", []
        if o.logprobs is not None:
            o.logprobs = []
        if o.finish_reason is not None:
            o.finish_reason, o.stop_reason = "length", None


def _echoed_entries(gen: GenerateRequest, job: _Job, out: RequestOutput) -> list | None:
    """An echoed prompt's logprobs entries, when the request asked for logprobs."""
    # NOTE: chat echoes the last message, not the prompt: its logprobs are the output's only.
    if not gen.echo or gen.logprobs is None or not gen.prompts or out.prompt_logprobs is None:
        return None
    return echoed_prompt_logprobs(job.prompt_token_ids, out.prompt_logprobs)


def _end_at_repeat(builder: ChoiceBuilder, out: RequestOutput, text: str) -> bool:
    """Ends an answer that has just repeated a call (one sample, one prompt): True when it did."""
    if out.finished or not builder.repeats(text):
        return False
    out.outputs[0].finish_reason, out.finished = "stop", True  # the engine request is aborted on leaving
    return True


async def _collect(state: ServerState, gen: GenerateRequest, jobs: list[_Job], builder: ChoiceBuilder,
                   head: dict[str, Any], span: RequestSpan, watch: bool) -> dict[str, Any]:
    engine = state.engine
    try:
        async with aclosing(merge([engine.stream_outputs(job.stream) for job in jobs])) as outputs:
            async for index, out in outputs:
                ended = watch and _end_at_repeat(builder, out, out.outputs[0].text)
                _finish(jobs[index], out, gen, span, cumulative=watch)
                if ended:
                    break
    except (EngineDeadError, StepError, RequestInterrupted) as exc:
        raise _engine_error(exc) from None
    n = gen.params.n
    choices = [builder.whole(index * n + o.index, o, job.echo, _echoed_entries(gen, job, job.final))
               for index, job in enumerate(jobs) for o in job.final.outputs]
    payload = {**head, "choices": choices, "usage": _usage(jobs)}
    if gen.prompt_logprobs is not None:
        asked = [vllm_prompt_logprobs(job.final.prompt_logprobs, state.token_str, gen.prompt_logprobs)
                 for job in jobs]
        if builder.chat:
            payload["prompt_logprobs"] = asked[0]
        else:
            for choice in choices:
                choice["prompt_logprobs"] = asked[choice["index"] // n]
    return payload


async def _stream(request: web.Request, state: ServerState, gen: GenerateRequest, jobs: list[_Job],
                  builder: ChoiceBuilder, head: dict[str, Any], span: RequestSpan, watch: bool,
                  shape: ChatShape) -> web.StreamResponse:
    engine, n = state.engine, gen.params.n
    response = await shape.open(request, head, _usage(jobs))
    states = {index * n + i: ChoiceState(prefix=job.echo, text_offset=len(job.echo))
              for index, job in enumerate(jobs) for i in range(n)}

    async def send(choice: dict[str, Any]) -> None:
        chunk = {**head, "choices": [choice]}
        if gen.include_usage:
            chunk["usage"] = _usage(jobs) if gen.continuous_usage else None
        await shape.chunk(response, chunk)

    try:
        if builder.chat:
            for choice_index in states:
                await send(builder.role(choice_index))
        async with aclosing(merge([engine.stream_outputs(job.stream) for job in jobs])) as outputs:
            async for index, out in outputs:
                ended = watch and _end_at_repeat(builder, out, states[0].text + out.outputs[0].text)
                _finish(jobs[index], out, gen, span)
                echoed = _echoed_entries(gen, jobs[index], out)
                for o in out.outputs:
                    choice_index = index * n + o.index
                    if echoed is not None:
                        states[choice_index].prompt_entries = echoed
                    for choice in builder.deltas(choice_index, o, states[choice_index]):
                        await send(choice)
                if ended:
                    break
    except (EngineDeadError, StepError, RequestInterrupted) as exc:
        error = _engine_error(exc)
        span.fail(error.message)
        _abandon(state, jobs, n, "error")
        await shape.fail(response, error)
        return response
    except ConnectionError:
        # NOTE: the client left between two writes, before aiohttp cancelled the handler.
        span.fail("the client disconnected")
        _abandon(state, jobs, n, "abort")
        return response
    if gen.include_usage:
        await shape.chunk(response, {**head, "choices": [], "usage": _usage(jobs)})
    await shape.end(response)
    return response
