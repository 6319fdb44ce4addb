"""Tool calling in OpenAI's shape: the request's ``tools`` and ``tool_choice``, the grammar
that enforces a required or named call, and the parsers that find the calls in a model's
own text (``tool_choice: "auto"``).

- ``required``: the output is a JSON array of ``{"name", "arguments"}`` objects, each valid
  for one declared function (one item unless ``parallel_tool_calls``): the grammar engine
  enforces it, whatever the model.
- a named function: the output is that function's arguments, valid for its schema.
- ``auto``: the model writes calls in its own syntax, found by the parser the server was
  started with (``--enable-auto-tool-choice --tool-call-parser hermes``; the parsers are in
  server/tool_parsers.py).
- ``none``: no call; the tools still reach the chat template.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from pagoda.engine.sampling_params import StructuredOutputsParams
from pagoda.server.errors import bad_request
from pagoda.server.tool_parsers import TOOL_CALL_PARSERS, Parsed, parse_arguments, parse_json_array


@dataclass(slots=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True)
class ToolRequest:
    """A chat request's tools, validated.

    Attributes:
        tools: The tools as the client sent them (OpenAI's shape), for the chat template.
        choice: "none", "auto", "required" or "named".
        function: The named function (choice "named").
        parallel: parallel_tool_calls: several calls allowed in one answer.
        parser: The --tool-call-parser for "auto" (None otherwise).
    """

    tools: list[dict[str, Any]]
    choice: str
    function: str | None = None
    parallel: bool = True
    parser: str | None = None

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def parameters(self, name: str) -> dict[str, Any]:
        function = self.tools[self.names.index(name)]["function"]
        return function.get("parameters") or {"type": "object", "properties": {}}

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar a required or named choice puts on the output (None otherwise)."""
        if self.choice == "named":
            return StructuredOutputsParams(json=self.parameters(self.function))
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": self.parameters(name)},
                  "required": ["name", "arguments"], "additionalProperties": False} for name in self.names]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)

    def parse(self, text: str, final: bool) -> Parsed:
        """The content and calls in an answer so far (``final``: the whole answer).

        Called on a growing text, the content and each call's arguments only grow, so a
        stream sends the differences (see server/tool_parsers.py).
        """
        if self.choice == "named":
            parsed = parse_arguments(self.function)(text, final)
        elif self.choice == "required":
            parsed = parse_json_array(text, final)
        elif self.choice == "auto" and self.parser is not None:
            parsed = TOOL_CALL_PARSERS[self.parser](text, final)
        else:
            return Parsed(text)
        if not self.parallel:
            del parsed.calls[1:]
        return parsed

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished answer: the calls it makes and the text around them."""
        parsed = self.parse(text, final=True)
        if not parsed.calls:
            return parsed.content, []
        return parsed.content or None, [ToolCall(call.name, call.arguments) for call in parsed.calls]


def parse_tools(body: dict[str, Any], enable_auto: bool, parser: str | None) -> ToolRequest | None:
    """The request's tools and tool_choice, or None when it has no tools.

    Raises:
        APIError: 400 naming the field: malformed tools, a tool_choice naming a function
            that is not among them, ``auto`` on a server started without a parser.
    """
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none", "auto"):
            raise bad_request("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list) or not tools:
        raise bad_request("'tools' must be a non-empty list", "tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise bad_request(f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                              f"tools[{i}]")
        if not isinstance(function.get("name"), str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", function["name"]):
            raise bad_request(f"'tools[{i}].function.name' must be 1-64 letters, digits, '_', '.' or '-'",
                              f"tools[{i}].function.name")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise bad_request(f"'tools[{i}].function.parameters' must be a JSON schema object",
                              f"tools[{i}].function.parameters")
    parallel = body.get("parallel_tool_calls")
    request = ToolRequest(tools=tools, choice="auto", parallel=True if parallel is None else bool(parallel))
    if choice is None or choice == "auto":
        if not enable_auto or parser is None:
            raise bad_request('"auto" tool choice needs the server started with --enable-auto-tool-choice and '
                              "--tool-call-parser; or ask for 'required' or a named function", "tool_choice")
        request.parser = parser
    elif choice in ("none", "required"):
        request.choice = choice
    elif (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
          and isinstance(choice["function"].get("name"), str)):
        name = choice["function"]["name"]
        if name not in request.names:
            raise bad_request(f"'tool_choice' names the function {name!r}, which is not in 'tools' "
                              f"({', '.join(request.names)})", "tool_choice")
        request.choice, request.function = "named", name
    else:
        raise bad_request("'tool_choice' must be \"none\", \"auto\", \"required\" or "
                          "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    return request


def check_template_renders_tools(with_tools: str, without_tools: str) -> None:
    """400 when the chat template renders the same prompt with and without the tools: one that
    ignores them would let the model answer without knowing them."""
    if with_tools == without_tools:
        raise bad_request("This model's chat template does not render tools; start the server with a "
                          "--chat-template that does (Pagoda ships one: --chat-template chatml_tools)", "tools",
                          code="tools_not_supported")
