"""Anthropic's Messages API: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

A Messages request is read into a chat request (``system`` into a system message, text,
``tool_use`` and ``tool_result`` blocks into chat messages, tools and ``tool_choice`` into
chat's) and runs the chat path; the answer is written back as content blocks (text,
``tool_use`` with its input as an object, ``thinking`` from the reasoning parser) with
Anthropic's stop reasons, and, streamed, as its events (``message_start`` ...
``message_stop``). Errors on these routes come in Anthropic's shape
(``{"type": "error", "error": {"type": ..., "message": ...}}``), and the API key may come as
``x-api-key`` (server/app.py).
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson
from aiohttp import web

from pagoda.server.errors import APIError, bad_request
from pagoda.server.serving import ChatShape, count_prompt_tokens, generate_in_shape, read_json, serve_tracked
from pagoda.server.state import STATE_KEY
from pagoda.server.streaming import open_sse, send_named_event

#: Every field of Anthropic's request (the sampling ones of its earlier versions too, which
#: clients such as LangChain's still send); those Pagoda does not act on are accepted.
KNOWN = frozenset({"model", "messages", "max_tokens", "system", "stop_sequences", "stream", "temperature", "top_p",
                   "top_k", "tools", "tool_choice", "metadata", "thinking", "service_tier", "container",
                   "mcp_servers", "context_management", "output_config", "cache_control", "diagnostics",
                   "inference_geo", "speed", "user_profile_id", "workspace_id"})
#: Chat's names of the fields, in the API's terms for error messages.
PARAMS = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences", "response_format": "output_config.format"}
PREFIX = "/v1/messages"

#: Anthropic's error type for each status.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
                413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_body(error: APIError) -> dict[str, Any]:
    """An error in Anthropic's shape."""
    kind = _ERROR_TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"'{where}' must be a string or a list of text blocks", where)
    texts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise bad_request(f"'{where}[{j}]' must be a text block: this server reads text only", f"{where}[{j}]")
        texts.append(block["text"])
    return "".join(texts)


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """Messages' turns as chat messages: an assistant's tool_use blocks as its tool_calls, a
    user's tool_result blocks as tool messages (before the rest of its text)."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    chat: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise bad_request(f"'{where}.role' must be user or assistant", f"{where}.role")
        role, content = message["role"], message.get("content")
        if isinstance(content, str):
            chat.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise bad_request(f"'{where}.content' must be a string or a list of content blocks", f"{where}.content")
        texts, calls = [], []
        for j, block in enumerate(content):
            at = f"{where}.content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                    raise bad_request(f"'{at}' needs an id and a name", at)
                calls.append({"id": block["id"], "type": "function",
                              "function": {"name": block["name"],
                                           "arguments": orjson.dumps(block.get("input") or {}).decode()}})
            elif kind == "tool_result" and role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise bad_request(f"'{at}.tool_use_id' must be a string", f"{at}.tool_use_id")
                result = _text(block.get("content") or "", f"{at}.content")
                chat.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                             "content": f"Error: {result}" if block.get("is_error") else result})
            elif kind in ("thinking", "redacted_thinking"):
                continue
            else:
                raise bad_request(f"'{at}.type' {kind!r} is not supported here: this server reads text, tool_use "
                                  f"(assistant) and tool_result (user) blocks", f"{at}.type")
        if texts or calls or role == "assistant":
            turn: dict[str, Any] = {"role": role, "content": "".join(texts)}
            if calls:
                turn["tool_calls"] = calls
            chat.append(turn)
    return chat


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list", "tools")
    chat = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") not in (None, "custom") or "name" not in tool:
            raise bad_request(f"'tools[{i}]' is not supported: this server runs client tools ({{\"name\", "
                              f"\"input_schema\"}}), not Anthropic's server tools", f"tools[{i}]")
        function = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
        if tool.get("description"):
            function["description"] = tool["description"]
        chat.append({"type": "function", "function": function})
    return chat


def _tool_choice(choice: Any) -> tuple[Any, bool]:
    """(chat's tool_choice, parallel calls allowed)."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if kind == "tool":
        mapped = {"type": "function", "function": {"name": choice.get("name")}}
    if mapped is None:
        raise bad_request("'tool_choice' must be {\"type\": \"auto\"}, {\"type\": \"any\"}, {\"type\": \"none\"} or "
                          "{\"type\": \"tool\", \"name\": ...}", "tool_choice")
    return mapped, not choice.get("disable_parallel_tool_use", False)


def to_chat(body: Any, count_only: bool = False) -> dict[str, Any]:
    """A Messages request (or a count_tokens one) as a chat request."""
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    for name in body:
        if name not in KNOWN:
            raise bad_request(f"{name}: Extra inputs are not permitted", name)
    for name in ("container", "mcp_servers"):
        if body.get(name):
            raise bad_request(f"'{name}' is not supported by this server", name)
    if not count_only and body.get("max_tokens") is None:
        raise bad_request("max_tokens: Field required", "max_tokens")
    messages = chat_messages(body.get("messages"))
    if body.get("system"):
        messages.insert(0, {"role": "system", "content": _text(body["system"], "system")})
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    last = messages[-1]
    if last["role"] == "assistant" and not last.get("tool_calls") and last["content"]:
        # NOTE: a prefilled answer: the model continues it (the reply holds what follows).
        chat["add_generation_prompt"], chat["continue_final_message"] = False, True
    stops = body.get("stop_sequences")
    if stops is not None and (not isinstance(stops, list) or not all(isinstance(x, str) and x for x in stops)):
        raise bad_request("stop_sequences: must be a list of non-empty strings", "stop_sequences")
    if not count_only:
        chat["max_tokens"] = body["max_tokens"]
        for name in ("temperature", "top_p", "top_k"):
            if body.get(name) is not None:
                chat[name] = body[name]
        if body.get("stop_sequences"):
            chat["stop"] = body["stop_sequences"]
        if body.get("stream"):
            chat["stream"], chat["stream_options"] = True, {"include_usage": True}
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
        if body.get("tool_choice") is not None:
            chat["tool_choice"], chat["parallel_tool_calls"] = _tool_choice(body["tool_choice"])
    fmt = (body.get("output_config") or {}).get("format") if isinstance(body.get("output_config"), dict) else None
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise bad_request("'output_config.format' must be {\"type\": \"json_schema\", \"schema\": {...}}",
                              "output_config.format")
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    return chat


def _input(arguments: str) -> dict[str, Any]:
    """A call's arguments as tool_use's input (an object; a call cut short gives what parses)."""
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


class MessagesShape(ChatShape):
    """One Messages request: read into chat, its answer written back."""

    params = PARAMS

    def __init__(self) -> None:
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.stop_sequences: list[str] = []
        self.blocks: list[dict[str, Any]] = []
        self.open_kind: str | None = None
        self.calls: dict[int, int] = {}
        self.finish_reason: str | None = None
        self.stop_reason: Any = None
        self.usage: dict[str, Any] | None = None

    def to_chat(self, body: Any) -> dict[str, Any]:
        chat = to_chat(body)
        self.stop_sequences = list(body.get("stop_sequences") or [])
        return chat

    def _stop(self) -> tuple[str, str | None]:
        """(Anthropic's stop_reason, stop_sequence) of the chat's finish."""
        if self.finish_reason == "length":
            return "max_tokens", None
        if self.finish_reason == "tool_calls" or any(block["type"] == "tool_use" for block in self.blocks):
            return "tool_use", None
        if isinstance(self.stop_reason, str) and self.stop_reason in self.stop_sequences:
            return "stop_sequence", self.stop_reason
        return "end_turn", None

    def _usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}

    def respond(self, payload: dict[str, Any]) -> web.StreamResponse:
        choice = payload["choices"][0]
        message = choice["message"]
        self.finish_reason, self.stop_reason = choice["finish_reason"], choice.get("stop_reason")
        if self.finish_reason == "error":
            raise APIError(500, f"Generation failed: {self.stop_reason}", code="generation_failed")
        if message.get("reasoning_content"):
            self.blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
        if message.get("content"):
            self.blocks.append({"type": "text", "text": message["content"]})
        for call in message.get("tool_calls") or []:
            self.blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                                "input": _input(call["function"]["arguments"])})
        stop_reason, stop_sequence = self._stop()
        body = {"id": self.id, "type": "message", "role": "assistant", "model": payload["model"],
                "content": self.blocks, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": self._usage(payload["usage"])}
        return web.Response(body=orjson.dumps(body), content_type="application/json", headers={"request-id": self.id})

    # -- the stream ---------------------------------------------------------------------

    async def open(self, request: web.Request, head: dict[str, Any], usage: dict[str, Any]) -> web.StreamResponse:
        response = await open_sse(request, {"request-id": self.id})
        start = {"id": self.id, "type": "message", "role": "assistant", "model": head["model"], "content": [],
                 "stop_reason": None, "stop_sequence": None, "usage": self._usage(usage)}
        await send_named_event(response, "message_start", {"type": "message_start", "message": start})
        await send_named_event(response, "ping", {"type": "ping"})
        return response

    async def _start(self, response: web.StreamResponse, kind: str, block: dict[str, Any]) -> int:
        await self._stop_block(response)
        self.blocks.append(block)
        self.open_kind = kind
        index = len(self.blocks) - 1
        await send_named_event(response, "content_block_start",
                               {"type": "content_block_start", "index": index, "content_block": block})
        return index

    async def _delta(self, response: web.StreamResponse, index: int, delta: dict[str, Any]) -> None:
        await send_named_event(response, "content_block_delta",
                               {"type": "content_block_delta", "index": index, "delta": delta})

    async def _stop_block(self, response: web.StreamResponse) -> None:
        if self.open_kind is not None:
            await send_named_event(response, "content_block_stop",
                                   {"type": "content_block_stop", "index": len(self.blocks) - 1})
            self.open_kind = None

    async def chunk(self, response: web.StreamResponse, chunk: dict[str, Any]) -> None:
        if not chunk["choices"]:
            self.usage = chunk.get("usage")
            return
        choice = chunk["choices"][0]
        delta = choice.get("delta") or {}
        if delta.get("reasoning_content"):
            if self.open_kind != "thinking":
                await self._start(response, "thinking", {"type": "thinking", "thinking": "", "signature": ""})
            await self._delta(response, len(self.blocks) - 1,
                              {"type": "thinking_delta", "thinking": delta["reasoning_content"]})
        if delta.get("content"):
            if self.open_kind != "text":
                await self._start(response, "text", {"type": "text", "text": ""})
            await self._delta(response, len(self.blocks) - 1, {"type": "text_delta", "text": delta["content"]})
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            if call["index"] not in self.calls:
                self.calls[call["index"]] = await self._start(
                    response, "tool_use", {"type": "tool_use", "id": call.get("id"), "name": function.get("name"),
                                           "input": {}})
            if function.get("arguments"):
                await self._delta(response, self.calls[call["index"]],
                                  {"type": "input_json_delta", "partial_json": function["arguments"]})
        if choice.get("finish_reason"):
            self.finish_reason, self.stop_reason = choice["finish_reason"], choice.get("stop_reason")

    async def end(self, response: web.StreamResponse) -> None:
        await self._stop_block(response)
        if self.finish_reason == "error":
            await self.fail(response, APIError(500, f"Generation failed: {self.stop_reason}",
                                               code="generation_failed"))
            return
        stop_reason, stop_sequence = self._stop()
        usage = self._usage(self.usage) if self.usage is not None else {}
        await send_named_event(response, "message_delta", {
            "type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": usage})
        await send_named_event(response, "message_stop", {"type": "message_stop"})
        await response.write_eof()

    async def fail(self, response: web.StreamResponse, error: APIError) -> None:
        await send_named_event(response, "error", error_body(error))
        await response.write_eof()


# -- routes -------------------------------------------------------------------------------


async def create_message(request: web.Request) -> web.StreamResponse:
    """POST /v1/messages."""
    return await serve_tracked(request, "messages", lambda r, state, span, client: generate_in_shape(
        r, state, span, client, MessagesShape()))


async def count_tokens(request: web.Request) -> web.Response:
    """POST /v1/messages/count_tokens: the prompt's tokens as the model would see it."""
    state = request.app[STATE_KEY]
    chat = to_chat(await read_json(request), count_only=True)
    try:
        num_tokens = await count_prompt_tokens(request, state, chat)
    except APIError as exc:
        exc.param = MessagesShape().param(exc.param)
        raise
    return web.Response(body=orjson.dumps({"input_tokens": num_tokens}), content_type="application/json")


def add_routes(app: web.Application) -> None:
    app.router.add_post(PREFIX, create_message)
    app.router.add_post(PREFIX + "/count_tokens", count_tokens)
