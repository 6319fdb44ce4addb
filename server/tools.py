"""Tool calling in OpenAI's shape: the request's ``tools`` and ``tool_choice``, how the tools
reach a model whose chat template may not render them, the grammar each choice puts on the
output, and the parsers that find the calls in a model's own text.

- ``required``: the output is a JSON array of ``{"name", "arguments"}`` objects, each valid
  for one declared function (one item unless ``parallel_tool_calls``).
- a named function: the output is that function's arguments, valid for its schema.
- ``auto`` (the default with tools): the model writes content or calls in its own syntax,
  found by the parser :class:`ToolSyntax` chose for the model (``--tool-call-parser``
  overrides it; the parsers are in server/tool_parsers.py). With the ``hermes`` syntax the
  grammar lets the model write any content, and makes each ``<tool_call>`` it opens a valid
  call of a declared function; with ``response_format`` as well, the answer is either calls
  or content valid for the schema.
- ``none``: no call; the tools still reach the chat template.

Every grammar reads the schemas as engine/core/json_schema.py says (closed objects, compact
JSON, bounded numbers), so a small model's call ends. With ``parallel_tool_calls`` a model
that repeats a call it has already made is stopped there: the answer keeps the calls before
the repeat.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagoda.engine.core.json_schema import generation_schema
from pagoda.engine.sampling_params import StructuredOutputsParams
from pagoda.server.errors import bad_request
from pagoda.server.tool_parsers import TOOL_CALL_PARSERS, Parsed, parse_arguments, parse_json_array

#: Pagoda's ChatML template with tools (Hermes-style calls).
CHATML_TOOLS = Path(__file__).parent / "templates" / "chatml_tools.jinja"


@dataclass(slots=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class ToolSyntax:
    """How the served model sees tools and writes calls, decided once at start.

    Attributes:
        parser: The parser of ``tool_choice: "auto"`` (a TOOL_CALL_PARSERS name).
        template: The chat template for requests with tools, when the model's own
            ignores them (None: the model's own, or --chat-template).
        in_system: Pagoda writes the tools and the hermes call format into the system
            message (the template ignores tools and is not ChatML).
        newline: hermes calls are written ``<tool_call>\\n{...}\\n</tool_call>`` (as
            Qwen's templates show them) rather than on one line.
        reason: What was chosen and why, for the start-up log line.
    """

    parser: str
    template: str | None = None
    in_system: bool = False
    newline: bool = False
    reason: str = ""


_PROBE_TOOL = {"type": "function", "function": {"name": "pagoda_probe_function", "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}


def choose_tool_syntax(render: Callable[[list[dict[str, Any]], str | None, list | None], str], template: str,
                       parser: str | None) -> ToolSyntax:
    """Decides how tools reach the model whose chat template is ``template``.

    Args:
        render: (messages, template or None for the served one, tools or None) -> the
            rendered prompt.
        template: The served chat template's text.
        parser: --tool-call-parser, None to choose from the template.
    """
    try:
        renders = "pagoda_probe_function" in render([{"role": "user", "content": "hi"}], None, [_PROBE_TOOL])
    except Exception:  # noqa: BLE001 - a template that fails on tools does not render them
        renders = False
    if renders:
        guessed = ("hermes" if "<tool_call>" in template else "mistral" if "[TOOL_CALLS]" in template
                   else "llama3_json" if "<|python_tag|>" in template or "ipython" in template else None)
        chosen = parser or guessed or "hermes"
        how = ("--tool-call-parser" if parser else "read from the template" if guessed
               else "the template names no format; the common one")
        return ToolSyntax(chosen, newline="<tool_call>\\n" in template or "<tool_call>\n" in template,
                          reason=f"the chat template renders tools; calls parsed as {chosen} ({how})")
    if "<|im_start|>" in template:
        return ToolSyntax(parser or "hermes", template=CHATML_TOOLS.read_text(),
                          reason="the chat template ignores tools; requests with tools are rendered with Pagoda's "
                                 f"chatml_tools template (ChatML with hermes calls), parsed as {parser or 'hermes'}")
    return ToolSyntax(parser or "hermes", in_system=True,
                      reason="the chat template ignores tools and is not ChatML; Pagoda writes them and the hermes "
                             f"call format into the system message, parsed as {parser or 'hermes'}")


def tools_in_system(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The conversation for a template that ignores tools: the tools and how to call them
    in the system message, earlier calls and their results as text the model reads."""
    result = []
    for message in messages:
        if message.get("tool_calls"):
            calls = "\n".join("<tool_call>" + json.dumps({"name": c["function"]["name"],
                                                          "arguments": c["function"]["arguments"]}) + "</tool_call>"
                              for c in message["tool_calls"])
            message = {"role": "assistant", "content": "\n".join(filter(None, (message.get("content"), calls)))}
        elif message["role"] == "tool":
            message = {"role": "user", "content": f"<tool_response>{message['content']}</tool_response>"}
        result.append(message)
    if tools:
        listing = "\n".join(json.dumps(tool) for tool in tools)
        text = ("You can call functions. Their signatures, as JSON schemas:\n<tools>\n" + listing + "\n</tools>\n"
                'To call one, answer with one line per call:\n<tool_call>{"name": <function name>, '
                '"arguments": <arguments object>}</tool_call>')
        if result and result[0]["role"] == "system":
            result[0] = {**result[0], "content": result[0]["content"] + "\n\n" + text}
        else:
            result.insert(0, {"role": "system", "content": text})
    return result


def uses_tools(messages: list[dict[str, Any]]) -> bool:
    """The conversation holds calls or their results."""
    return any(m.get("tool_calls") or m["role"] == "tool" for m in messages)


@dataclass(slots=True)
class ToolRequest:
    """A chat request's tools, validated.

    Attributes:
        tools: The tools as the client sent them (OpenAI's shape), for the chat template.
        choice: "none", "auto", "required" or "named".
        function: The named function (choice "named").
        parallel: parallel_tool_calls: several calls allowed in one answer.
        syntax: How the model writes calls (its parser for "auto").
    """

    tools: list[dict[str, Any]]
    choice: str
    function: str | None = None
    parallel: bool = True
    syntax: ToolSyntax = field(default_factory=lambda: ToolSyntax("hermes"))

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    @property
    def parser(self) -> str | None:
        return self.syntax.parser if self.choice == "auto" else None

    def parameters(self, name: str) -> dict[str, Any]:
        return self.parameters_of(self.tools[self.names.index(name)])

    @staticmethod
    def parameters_of(tool: dict[str, Any]) -> dict[str, Any]:
        """A tool's arguments schema (an empty object's when it gives none)."""
        return tool["function"].get("parameters") or {"type": "object", "properties": {}}

    def _call_schema(self, arguments_key: str = "arguments") -> dict[str, Any]:
        calls = [{"type": "object", "properties": {"name": {"const": name}, arguments_key: self.parameters(name)},
                  "required": ["name", arguments_key], "additionalProperties": False} for name in self.names]
        return calls[0] if len(calls) == 1 else {"anyOf": calls}

    def constraint(self, answer: StructuredOutputsParams | None = None) -> StructuredOutputsParams | None:
        """The grammar the choice puts on the output (None: none), ``answer`` being the
        request's own response_format (auto only; it becomes the alternative to calls)."""
        if self.choice == "named":
            return StructuredOutputsParams(json=self.parameters(self.function))
        if self.choice == "required":
            schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": self._call_schema()}
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutputsParams(json=schema)
        if self.choice != "auto" or self.syntax.parser != "hermes":
            return answer
        return StructuredOutputsParams(grammar=self._hermes_grammar(answer))

    def _hermes_grammar(self, answer: StructuredOutputsParams | None) -> str:
        """Lark (llguidance's): content, or content and then ``<tool_call>`` blocks each
        holding a valid call; with ``answer``, that answer or calls alone."""
        schema = json.dumps(generation_schema(self._call_schema()))
        call = (f'"\\n" %json {schema} "\\n</tool_call>"' if self.syntax.newline
                else f'%json {schema} "</tool_call>"')
        more = f'("\\n<tool_call>" call)*' if self.parallel else ""
        lines = ["%llguidance {}", f"calls: call {more}", f"call: {call}"]
        if answer is None:
            lines[1:1] = ["start: free | pre calls", "free: /(.|\\n)*/", 'pre[suffix="<tool_call>"]: /(.|\\n)*/']
            return "\n".join(lines)
        # NOTE: no text before the calls here: a free text beside the answer's lexemes keeps
        # the lexer from ever closing the answer.
        if answer.json is not None or answer.json_object:
            schema = {"type": "object"} if answer.json_object else answer.json
            schema = json.loads(schema) if isinstance(schema, str) else schema
            lines.insert(1, f"answer: %json {json.dumps(generation_schema(schema))}")
        elif answer.regex is not None:
            lines.insert(1, f"answer: /{answer.regex.replace('/', chr(92) + '/')}/")
        else:
            raise bad_request("'tool_choice' \"auto\" combines with a JSON schema, JSON object or regex answer "
                              "format only", "tool_choice", code="invalid_structured_outputs")
        lines.insert(1, 'start: answer | "<tool_call>" calls')
        return "\n".join(lines)

    def parse(self, text: str, final: bool) -> Parsed:
        """The content and calls in an answer so far (``final``: the whole answer).

        Called on a growing text, the content and each call's arguments only grow, so a
        stream sends the differences (see server/tool_parsers.py). A call that repeats an
        earlier one (same name, same arguments) ends the calls: it and what follows are
        left out.
        """
        if self.choice == "named":
            return parse_arguments(self.function)(text, final)
        if self.choice not in ("required", "auto"):
            return Parsed(text)
        parser = parse_json_array if self.choice == "required" else TOOL_CALL_PARSERS[self.syntax.parser]
        parsed = parser(text, final)
        if not self.parallel:
            del parsed.calls[1:]
            return parsed
        # NOTE: an answer ended at a repeat is whole up to it: read as a growing text.
        growing = parser(text, False) if final else parsed
        repeat = _first_repeat(growing)
        if repeat is not None:
            del growing.calls[repeat:]
            return growing
        return parsed

    def repeats(self, text: str) -> bool:
        """The answer so far has made a call it had made before: it should end here."""
        if not self.parallel or self.choice not in ("required", "auto"):
            return False
        parser = parse_json_array if self.choice == "required" else TOOL_CALL_PARSERS[self.syntax.parser]
        calls = parser(text, False).calls
        repeat = _first_repeat(Parsed("", calls))
        return repeat is not None and calls[repeat].complete

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished answer: the calls it makes and the text around them."""
        parsed = self.parse(text, final=True)
        if not parsed.calls:
            return parsed.content, []
        return parsed.content or None, [ToolCall(call.name, call.arguments) for call in parsed.calls]


def _first_repeat(parsed: Parsed) -> int | None:
    """The index of the first call that repeats an earlier complete one (the same name and
    arguments text), or None. A call still being written that so far matches an earlier one
    counts too: a stream holds it back until it differs, so that a repeat is never sent."""
    seen: dict[str, list[str]] = {}
    for i, call in enumerate(parsed.calls):
        earlier = seen.get(call.name, ())
        if call.complete and call.arguments in earlier:
            return i
        if not call.complete:
            return i if any(a.startswith(call.arguments) for a in earlier) else None
        seen.setdefault(call.name, []).append(call.arguments)
    return None


def parse_tools(body: dict[str, Any], syntax: ToolSyntax | None) -> ToolRequest | None:
    """The request's tools and tool_choice, or None when it has no tools.

    Args:
        body: The request.
        syntax: How the model writes calls (None: the model has no chat template).

    Raises:
        APIError: 400 naming the field: malformed tools, a tool_choice naming a function
            that is not among them.
    """
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none", "auto"):
            raise bad_request("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list) or not tools:
        raise bad_request("'tools' must be a non-empty list", "tools")
    seen: set[str] = set()
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
        if function["name"] in seen:
            raise bad_request(f"'tools[{i}].function.name' repeats the name {function['name']!r}: each tool needs "
                              "its own", f"tools[{i}].function.name")
        seen.add(function["name"])
    parallel = body.get("parallel_tool_calls")
    request = ToolRequest(tools=tools, choice="auto", parallel=True if parallel is None else bool(parallel),
                          syntax=syntax or ToolSyntax("hermes"))
    if choice is None or choice == "auto":
        pass
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
