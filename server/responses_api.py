"""OpenAI's Responses API: ``POST /v1/responses``, retrieval, deletion and input items by id.

A Responses request is read into a chat request (input items into messages, ``instructions``
into a system message, function tools and ``text.format`` into chat's ``tools`` and
``response_format``, ``previous_response_id`` into the stored conversation before the new
input) and runs the chat path, the same tools, constraints and limits; the chat answer is
written back as Responses output items (a reasoning item from the reasoning parser, a message,
function calls) and, streamed, as the API's typed events (``response.created`` ...
``response.completed``). Responses are kept for ``previous_response_id`` and ``GET`` in a
bounded store (the newest ``--responses-store-size``, in memory, lost at restart).
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from typing import Any

import orjson
from aiohttp import web

from pagoda.server.errors import APIError, bad_request
from pagoda.server.protocol import check_fields
from pagoda.server.serving import ChatShape, cancel, generate_in_shape, serve_tracked
from pagoda.server.state import STATE_KEY
from pagoda.server.streaming import open_sse, send_named_event

#: Every field of OpenAI's request; those Pagoda does not act on are accepted and echoed.
KNOWN = frozenset({
    "model", "input", "instructions", "tools", "tool_choice", "text", "temperature", "top_p", "max_output_tokens",
    "stream", "stream_options", "store", "previous_response_id", "metadata", "parallel_tool_calls", "reasoning",
    "background", "user", "include", "truncation", "service_tier", "prompt_cache_key", "safety_identifier",
    "top_logprobs", "max_tool_calls", "seed", "conversation", "prompt",
})
#: Chat's names of the fields, in the API's terms for error messages.
PARAMS = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens", "messages": "input",
          "response_format": "text.format", "logprobs": "top_logprobs"}


class ResponseStore:
    """The newest ``capacity`` responses, with the conversation each ended (for
    ``previous_response_id``), least recently used first out."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]] = \
            OrderedDict()

    def put(self, response: dict[str, Any], messages: list[dict[str, Any]], input_items: list[dict[str, Any]]):
        if self.capacity <= 0:
            return
        self._items[response["id"]] = (response, messages, input_items)
        self._items.move_to_end(response["id"])
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
        """(response, conversation, input items); 404 in the API's words when it is not kept."""
        item = self._items.get(response_id)
        if item is None:
            raise APIError(404, f"No response with id {response_id!r} is stored here (responses are kept in memory, "
                                f"the newest {self.capacity}, until the server restarts).",
                           param="previous_response_id", code="response_not_found")
        self._items.move_to_end(response_id)
        return item

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._items[response_id]


STORE_KEY = web.AppKey("pagoda_response_store", ResponseStore)


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_of(content: Any, where: str) -> str:
    """A message's content (a string or parts of text) as text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"'{where}.content' must be a string or a list of content parts", f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            raise bad_request(f"'{where}.content[{j}]' of type {kind!r} is not supported: this server reads text only "
                              f"(input_text, output_text)", f"{where}.content[{j}]")
        if not isinstance(part.get("text"), str):
            raise bad_request(f"'{where}.content[{j}].text' must be a string", f"{where}.content[{j}].text")
        texts.append(part["text"])
    return "".join(texts)


def input_messages(items: Any) -> list[dict[str, Any]]:
    """Responses input (a string or a list of items) as chat messages: function calls join the
    assistant message before them, their outputs become tool messages, reasoning items are
    left out (the template renders the answers, as it does a chat history)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_request("'input' must be a string or a non-empty list of items", "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"'{where}' must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"'{where}.role' must be user, assistant, system or developer; got {role!r}",
                                  f"{where}.role")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise bad_request(f"'{where}.{key}' must be a string", f"{where}.{key}")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"'{where}.call_id' must be a string", f"{where}.call_id")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text_of(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            continue
        else:
            raise bad_request(f"'{where}.type' {kind!r} is not supported: this server reads messages, function_call "
                              f"and function_call_output items", f"{where}.type")
    return messages


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list", "tools")
    chat = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad_request(f"'tools[{i}].type' {kind!r} is not supported: this server runs function tools only",
                              f"tools[{i}].type")
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
        chat.append({"type": "function", "function": function})
    return chat


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if choice in ("auto", "none", "required"):
        return choice
    raise bad_request(f"'tool_choice' must be auto, none, required or {{\"type\": \"function\", \"name\": ...}}; "
                      f"got {choice!r}", "tool_choice")


def _response_format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {key: fmt[key] for key in ("name", "schema", "strict",
                                                                                 "description") if key in fmt}}
    raise bad_request("'text.format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                      "{\"type\": \"json_schema\", \"name\": ..., \"schema\": {...}}", "text.format")


class ResponsesShape(ChatShape):
    """One Responses request: read into chat, its answer written back."""

    params = PARAMS

    def __init__(self, store: ResponseStore) -> None:
        self.store = store
        self.id = _id("resp")
        self.created_at = int(time.time())
        self.body: dict[str, Any] = {}
        self.conversation: list[dict[str, Any]] = []
        self.input_items: list[dict[str, Any]] = []
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # the output items, streamed: as they grow
        self.open_kind: str | None = None
        self.calls: dict[int, int] = {}  # a streamed tool call's index -> its output item
        self.finish_reason: str | None = None
        self.stop_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.model = ""

    # -- the request --------------------------------------------------------------------

    def to_chat(self, body: Any) -> dict[str, Any]:
        check_fields(body, KNOWN)
        for name in ("conversation", "prompt"):
            if body.get(name) is not None:
                raise bad_request(f"'{name}' is not supported by this server (use previous_response_id, and send the "
                                  f"prompt's text)", name, code="unsupported_parameter")
        if body.get("background"):
            if body.get("store") is False or self.store.capacity <= 0:
                raise bad_request("'background' needs 'store' (a background response is fetched by its id; the server "
                                  "keeps none with --responses-store-size 0)",
                                  "background")
            if body.get("stream"):
                raise bad_request("'background' with 'stream' is not supported by this server: stream the response, "
                                  "or fetch the background one by its id", "background",
                                  code="unsupported_parameter")
            self.background = True
        if "input" not in body:
            raise bad_request("'input' is required", "input")
        self.body = body
        history: list[dict[str, Any]] = []
        previous = body.get("previous_response_id")
        if previous is not None:
            if not isinstance(previous, str):
                raise bad_request("'previous_response_id' must be a string", "previous_response_id")
            stored, history, _ = self.store.get(previous)
            if stored["status"] in ("in_progress", "failed"):
                raise bad_request(f"'previous_response_id' {previous!r} is {stored['status']}: a turn continues a "
                                  f"response that has ended", "previous_response_id")
        new = input_messages(body["input"])
        items = body["input"] if isinstance(body["input"], list) else [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": body["input"]}]}]
        self.input_items = [{"id": item.get("id") or _id("msg"), **item} if isinstance(item, dict) else item
                            for item in items]
        self.conversation = [*history, *new]
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise bad_request("'instructions' must be a string", "instructions")
        # NOTE: instructions are this request's only, not carried to the next through
        # previous_response_id (as OpenAI's API does).
        messages = ([{"role": "system", "content": instructions}] if instructions else []) + self.conversation
        chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
        for name in ("temperature", "top_p", "seed", "user", "parallel_tool_calls"):
            if body.get(name) is not None:
                chat[name] = body[name]
        if body.get("max_output_tokens") is not None:
            chat["max_tokens"] = body["max_output_tokens"]
        if body.get("tools"):
            chat["tools"] = _tools(body["tools"])
            if body.get("tool_choice") is not None:
                chat["tool_choice"] = _tool_choice(body["tool_choice"])
        elif body.get("tool_choice") not in (None, "auto", "none"):
            raise bad_request("'tool_choice' needs 'tools'", "tool_choice")
        response_format = _response_format(body.get("text"))
        if response_format is not None:
            chat["response_format"] = response_format
        if body.get("top_logprobs"):
            chat["logprobs"], chat["top_logprobs"] = True, body["top_logprobs"]
        if body.get("stream"):
            chat["stream"], chat["stream_options"] = True, {"include_usage": True}
        return chat

    # -- the response object ------------------------------------------------------------

    def _response(self, status: str, error: dict[str, Any] | None = None) -> dict[str, Any]:
        body = self.body
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "background": self.background, "error": error, "incomplete_details": incomplete,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "max_tool_calls": body.get("max_tool_calls"), "model": self.model, "output": self.items,
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"),
            "reasoning": body.get("reasoning") or {"effort": None, "summary": None},
            "service_tier": "default", "store": body.get("store", True),
            "temperature": body.get("temperature", 1.0), "text": body.get("text") or {"format": {"type": "text"}},
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "top_logprobs": body.get("top_logprobs", 0), "top_p": body.get("top_p", 1.0),
            "truncation": body.get("truncation", "disabled"), "usage": self._usage(), "user": body.get("user"),
            "metadata": body.get("metadata") or {},
        }

    def _usage(self) -> dict[str, Any] | None:
        if self.usage is None:
            return None
        cached = (self.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return {"input_tokens": self.usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": self.usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.usage["total_tokens"]}

    def _status(self) -> str:
        return {"length": "incomplete", "abort": "cancelled"}.get(self.finish_reason, "completed")

    def _finish(self) -> dict[str, Any]:
        """The finished response, stored (unless ``store`` is false) with its conversation."""
        response = self._response(self._status())
        if self.body.get("store", True) is False:
            return response
        answer: dict[str, Any] = {"role": "assistant", "content": ""}
        for item in self.items:
            if item["type"] == "message":
                answer["content"] += "".join(part["text"] for part in item["content"])
            elif item["type"] == "function_call":
                answer.setdefault("tool_calls", []).append(
                    {"id": item["call_id"], "type": "function",
                     "function": {"name": item["name"], "arguments": item["arguments"]}})
        self.store.put(response, [*self.conversation, answer], self.input_items)
        return response

    def accepted(self) -> web.StreamResponse:
        """A background response, kept as "in_progress" until it ends (GET it by its id)."""
        self.model = self.body.get("model") or ""
        response = self._response("in_progress")
        self.store.put(response, self.conversation, self.input_items)
        return web.Response(body=orjson.dumps(response), content_type="application/json",
                            headers={"X-Request-Id": self.id})

    def failed(self, error: APIError) -> None:
        self.store.put(self._response("failed", {"code": error.code or "server_error", "message": error.message}),
                       self.conversation, self.input_items)

    def respond(self, payload: dict[str, Any]) -> web.StreamResponse:
        self.model, self.usage = payload["model"], payload.get("usage")
        choice = payload["choices"][0]
        message, self.finish_reason = choice["message"], choice["finish_reason"]
        if message.get("reasoning_content"):
            self.items.append(_reasoning_item(_id("rs"), message["reasoning_content"]))
        if message.get("content"):
            self.items.append(_message_item(_id("msg"), message["content"], "completed"))
        for call in message.get("tool_calls") or []:
            self.items.append(_call_item(_id("fc"), call["id"], call["function"]["name"],
                                         call["function"]["arguments"], "completed"))
        if self.finish_reason == "error":
            raise APIError(500, f"Generation failed: {choice.get('stop_reason')}", code="generation_failed")
        return web.Response(body=orjson.dumps(self._finish()), content_type="application/json",
                            headers={"X-Request-Id": self.id})

    # -- the stream ---------------------------------------------------------------------

    async def _emit(self, stream: web.StreamResponse, kind: str, **fields: Any) -> None:
        await send_named_event(stream, kind, {"type": kind, "sequence_number": self.sequence, **fields})
        self.sequence += 1

    async def open(self, request: web.Request, head: dict[str, Any], usage: dict[str, Any]) -> web.StreamResponse:
        self.model = head["model"]
        response = await open_sse(request, {"X-Request-Id": self.id})
        await self._emit(response, "response.created", response=self._response("in_progress"))
        await self._emit(response, "response.in_progress", response=self._response("in_progress"))
        return response

    async def chunk(self, response: web.StreamResponse, chunk: dict[str, Any]) -> None:
        if not chunk["choices"]:
            self.usage = chunk.get("usage")  # the last chunk
            return
        choice = chunk["choices"][0]
        delta = choice.get("delta") or {}
        if delta.get("reasoning_content"):
            await self._text(response, "reasoning", delta["reasoning_content"])
        if delta.get("content"):
            await self._text(response, "message", delta["content"])
        for call in delta.get("tool_calls") or []:
            await self._call(response, call)
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]
            self.stop_reason = choice.get("stop_reason")

    async def _open_item(self, response: web.StreamResponse, kind: str, item: dict[str, Any]) -> int:
        await self._close_item(response)
        self.items.append(item)
        self.open_kind = kind
        index = len(self.items) - 1
        await self._emit(response, "response.output_item.added", output_index=index, item=item)
        return index

    async def _text(self, response: web.StreamResponse, kind: str, text: str) -> None:
        part_type = "output_text" if kind == "message" else "reasoning_text"
        if self.open_kind != kind:
            item = (_message_item(_id("msg"), "", "in_progress") if kind == "message"
                    else _reasoning_item(_id("rs"), ""))
            item["content"] = []  # NOTE: its part comes with content_part.added, as OpenAI streams it
            index = await self._open_item(response, kind, item)
            item["content"].append(_part(part_type, ""))
            await self._emit(response, "response.content_part.added", item_id=item["id"], output_index=index,
                             content_index=0, part=_part(part_type, ""))
        index = len(self.items) - 1
        item = self.items[index]
        item["content"][0]["text"] += text
        event = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        await self._emit(response, event, item_id=item["id"], output_index=index, content_index=0, delta=text, **extra)

    async def _call(self, response: web.StreamResponse, call: dict[str, Any]) -> None:
        function = call.get("function") or {}
        if call["index"] not in self.calls:
            item = _call_item(_id("fc"), call.get("id") or _id("call"), function.get("name") or "", "", "in_progress")
            self.calls[call["index"]] = await self._open_item(response, "call", item)
        index = self.calls[call["index"]]
        item = self.items[index]
        if function.get("arguments"):
            item["arguments"] += function["arguments"]
            await self._emit(response, "response.function_call_arguments.delta", item_id=item["id"],
                             output_index=index, delta=function["arguments"])

    async def _close_item(self, response: web.StreamResponse) -> None:
        if self.open_kind is None:
            return
        index = len(self.items) - 1
        item = self.items[index]
        if self.open_kind == "call":
            await self._emit(response, "response.function_call_arguments.done", item_id=item["id"],
                             output_index=index, name=item["name"], arguments=item["arguments"])
        else:
            part = item["content"][0]
            done = "response.output_text.done" if self.open_kind == "message" else "response.reasoning_text.done"
            extra = {"logprobs": []} if self.open_kind == "message" else {}
            await self._emit(response, done, item_id=item["id"], output_index=index, content_index=0,
                             text=part["text"], **extra)
            await self._emit(response, "response.content_part.done", item_id=item["id"], output_index=index,
                             content_index=0, part=part)
        item["status"] = "completed"
        await self._emit(response, "response.output_item.done", output_index=index, item=item)
        self.open_kind = None

    async def end(self, response: web.StreamResponse) -> None:
        await self._close_item(response)
        if self.finish_reason == "error":
            await self.fail(response, APIError(500, f"Generation failed: {self.stop_reason}",
                                               code="generation_failed"))
            return
        final = self._finish()
        event = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(final["status"],
                                                                                            "response.failed")
        await self._emit(response, event, response=final)
        await response.write_eof()

    async def fail(self, response: web.StreamResponse, error: APIError) -> None:
        await self._emit(response, "error", code=error.code, message=error.message, param=error.param)
        await self._emit(response, "response.failed",
                         response=self._response("failed", {"code": error.code or "server_error",
                                                            "message": error.message}))
        await response.write_eof()


def _part(kind: str, text: str) -> dict[str, Any]:
    return {"type": kind, "text": text, "annotations": [], "logprobs": []} if kind == "output_text" else \
        {"type": kind, "text": text}


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [_part("output_text", text)]}


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "status": "completed", "summary": [],
            "content": [_part("reasoning_text", text)]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


# -- routes -------------------------------------------------------------------------------


async def create_response(request: web.Request) -> web.StreamResponse:
    """POST /v1/responses."""
    store = request.app[STORE_KEY]
    return await serve_tracked(request, "responses", lambda r, state, span, client: generate_in_shape(
        r, state, span, client, ResponsesShape(store)))


async def get_response(request: web.Request) -> web.Response:
    """GET /v1/responses/{id}."""
    response, _, _ = request.app[STORE_KEY].get(request.match_info["response_id"])
    return web.Response(body=orjson.dumps(response), content_type="application/json")


async def delete_response(request: web.Request) -> web.Response:
    """DELETE /v1/responses/{id}."""
    response_id = request.match_info["response_id"]
    request.app[STORE_KEY].delete(response_id)
    return web.Response(body=orjson.dumps({"id": response_id, "object": "response", "deleted": True}),
                        content_type="application/json")


async def list_input_items(request: web.Request) -> web.Response:
    """GET /v1/responses/{id}/input_items: the request's input, as items."""
    _, _, items = request.app[STORE_KEY].get(request.match_info["response_id"])
    data = list(items)
    return web.Response(body=orjson.dumps({"object": "list", "data": data, "has_more": False,
                                           "first_id": data[0]["id"] if data else None,
                                           "last_id": data[-1]["id"] if data else None}),
                        content_type="application/json")


async def cancel_response(request: web.Request) -> web.Response:
    """POST /v1/responses/{id}/cancel: ends a response still being generated (streamed or not);
    it ends with status "cancelled", its KV blocks freed."""
    response_id = request.match_info["response_id"]
    cancel(request.app[STATE_KEY], response_id)
    try:
        response = {**request.app[STORE_KEY].get(response_id)[0], "status": "cancelled"}
    except APIError:  # NOTE: a response not kept (store false, or streamed and not ended yet)
        response = {"id": response_id, "object": "response", "status": "cancelled"}
    return web.Response(body=orjson.dumps(response), content_type="application/json")


def add_routes(app: web.Application, store_size: int) -> None:
    app[STORE_KEY] = ResponseStore(store_size)
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", get_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)
    app.router.add_get("/v1/responses/{response_id}/input_items", list_input_items)
    app.router.add_post("/v1/responses/{response_id}/cancel", cancel_response)
