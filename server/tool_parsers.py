"""Finding tool calls in a model's text, whole or while it is still being written.

Every parser reads the text generated so far and returns what it holds: the content (the
text that is not a call) and the calls, the last of which may be unfinished. Called again
on a longer text, a parser returns a content and arguments that extend the earlier ones, so
a stream sends only the difference (see ``server/responses.py``) and the pieces add up to
the whole answer. Text that may still turn into a call (``"<tool_"`` at the end) is held
back until it is clear.

The formats, as vLLM's ``--tool-call-parser`` names them:

- ``hermes`` (Hermes, Qwen2/2.5, SmolLM3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks after optional content.
- ``llama3_json`` (Llama 3.1-3.3): the answer is one or more ``{"name": ..., "parameters": {...}}``
  objects, separated by ``;``, optionally after ``<|python_tag|>``.
- ``mistral``: ``[TOOL_CALLS]`` and a JSON array of ``{"name", "arguments"}`` objects, or
  (newer tokenizers) ``[TOOL_CALLS]name[ARGS]{...}`` per call.
- ``pythonic`` (Llama 3.2/4, ToolACE): the answer is a Python list of calls,
  ``[get_weather(city="Paris"), get_time(city="Paris")]``; arguments become JSON, and each
  call is sent once it is complete.

The forced choices use the same machinery: ``required`` is a JSON array of
``{"name", "arguments"}`` objects (:func:`parse_json_array`), a named function's answer is
its arguments (:func:`parse_arguments`).
"""

from __future__ import annotations

import ast
import json
from collections.abc import Callable
from dataclasses import dataclass, field

WHITESPACE = " \t\n\r"


@dataclass(slots=True)
class PartialCall:
    """A call as far as it has been written.

    Attributes:
        name: The function's name, None until it is complete.
        arguments: The arguments' JSON text so far (whole once ``complete``).
        complete: The call is finished.
    """

    name: str | None
    arguments: str = ""
    complete: bool = False


@dataclass(slots=True)
class Parsed:
    """What a text holds: content and calls."""

    content: str = ""
    calls: list[PartialCall] = field(default_factory=list)


class Malformed(ValueError):
    """The text claims a call but does not hold one in the parser's format."""


#: A parser: (text so far, the text is final) -> what it holds.
Parser = Callable[[str, bool], Parsed]


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """The end (exclusive) of the JSON string starting at ``text[i]``; None when cut off."""
    j = i + 1
    while j < len(text):
        char = text[j]
        if char == "\\":
            j += 2
        elif char == '"':
            return j + 1
        else:
            j += 1
    return None


_DECODER = json.JSONDecoder()


def _value_end(text: str, i: int) -> int | None:
    """The end (exclusive) of the JSON value starting at ``text[i]``; None when it is cut
    off (or not JSON). NOTE: json's C scanner, not a loop here: a stream re-reads the
    arguments at every delta, and a Python loop made a 28k-character call cost seconds."""
    if i >= len(text):
        return None
    try:
        end = _DECODER.raw_decode(text, i)[1]
    except ValueError:
        return None
    if end == len(text) and text[i] not in '"{[':
        return None  # a number or a literal may go on
    return end


def _call_object(text: str, i: int, argument_keys: tuple[str, ...],
                 forced: bool = False) -> tuple[PartialCall, int | None]:
    """A ``{"name": ..., "arguments": ...}`` object starting at ``text[i]`` (which is "{");
    ``forced``: a grammar makes the arguments an object, so the name counts once written.

    Returns:
        The call so far and the end of the object (None when it is cut off).

    Raises:
        Malformed: It is not such an object.
    """
    call = PartialCall(None)
    seen_arguments = False
    j = _skip_ws(text, i + 1)
    while j < len(text):
        if text[j] == "}":
            if call.name is None:
                raise Malformed("a call without a name")
            call.complete = True
            return call, j + 1
        if text[j] == ",":
            j = _skip_ws(text, j + 1)
            continue
        if text[j] != '"':
            raise Malformed("not a JSON object")
        key_end = _string_end(text, j)
        if key_end is None:
            break
        key = json.loads(text[j:key_end])
        j = _skip_ws(text, key_end)
        if j < len(text) and text[j] != ":":
            raise Malformed("not a JSON object")
        j = _skip_ws(text, j + 1)
        end = _value_end(text, j)
        if key in argument_keys and not seen_arguments:  # NOTE: the first such key wins
            seen_arguments = True
            call.arguments = text[j:end] if end is not None else text[j:].rstrip(WHITESPACE)
        if end is None:
            break
        if key == "name":
            name = json.loads(text[j:end])
            if not isinstance(name, str):
                raise Malformed("a call's name must be a string")
            call.name = name
        j = _skip_ws(text, end)
    if not forced and not call.arguments.startswith("{"):
        call.name = None  # NOTE: not streamed until its arguments turn out to be an object
    return call, None


def _check_arguments(call: PartialCall) -> None:
    try:
        arguments = json.loads(call.arguments or "{}")
    except ValueError:
        raise Malformed("the arguments are not JSON") from None
    if not isinstance(arguments, dict):
        raise Malformed("the arguments must be an object")
    call.arguments = call.arguments or "{}"


def _json_calls(text: str, i: int, argument_keys: tuple[str, ...], separator: str,
                closing: str | None, forced: bool = False) -> tuple[list[PartialCall], int | None]:
    """Call objects from ``text[i]`` on, separated by ``separator`` and ended by ``closing``
    (or the end of the text when None).

    Returns:
        The calls and the index after the closing character (None while it is missing).
    """
    calls: list[PartialCall] = []
    j = _skip_ws(text, i)
    while j < len(text):
        if closing is not None and text[j] == closing:
            return calls, j + 1
        if calls and text[j] == separator:
            j = _skip_ws(text, j + 1)
            continue
        if text[j] != "{":
            raise Malformed("expected a call object")
        call, end = _call_object(text, j, argument_keys, forced)
        calls.append(call)
        if end is None:
            break
        _check_arguments(call)
        j = _skip_ws(text, end)
    return calls, None


def _held(text: str, markers: tuple[str, ...]) -> int:
    """Where the text's tail that may be the beginning of a marker starts (len(text) if none)."""
    if not markers:
        return len(text)
    for start in range(max(0, len(text) - max(map(len, markers)) + 1), len(text)):
        if any(marker.startswith(text[start:]) for marker in markers):
            return start
    return len(text)


def _content(text: str, final: bool, markers: tuple[str, ...]) -> str:
    """Content with no call in it: all of it when final, else all but a tail that may become
    a marker, and trailing blanks (which belong to the content only if more follows)."""
    return text if final else text[:_held(text, markers)].rstrip(WHITESPACE)


def _finish(parsed: Parsed, text: str, final: bool) -> Parsed:
    """A final answer whose calls are not all whole is content, as the model wrote it."""
    if final and not all(call.complete for call in parsed.calls):
        return Parsed(text)
    return parsed


def parse_hermes(text: str, final: bool) -> Parsed:
    marker = "<tool_call>"
    start = text.find(marker)
    if start < 0:
        return Parsed(_content(text, final, (marker,)))
    parsed = Parsed(text[:start].rstrip(WHITESPACE))
    try:
        while start >= 0:
            calls, end = _hermes_block(text, start + len(marker))
            parsed.calls.extend(calls)
            if end is None:
                break
            start = text.find(marker, end)
    except Malformed:
        if final:
            return Parsed(text)
        parsed.calls = [call for call in parsed.calls if call.complete]
        return parsed
    return _finish(parsed, text, final)


def _hermes_block(text: str, i: int) -> tuple[list[PartialCall], int | None]:
    """One ``{...}</tool_call>`` block from ``text[i]``: its call and the end of the block."""
    j = _skip_ws(text, i)
    if j >= len(text):
        return [], None
    if text[j] != "{":
        raise Malformed("a tool_call block must hold a JSON object")
    call, end = _call_object(text, j, ("arguments", "parameters"))
    if end is None:
        return [call], None
    _check_arguments(call)
    j = _skip_ws(text, end)
    closing = "</tool_call>"
    if text.startswith(closing, j):
        return [call], j + len(closing)
    if closing.startswith(text[j:]):
        return [call], None  # the closing tag is still being written
    raise Malformed("a tool_call block must end with </tool_call>")


def parse_llama3_json(text: str, final: bool) -> Parsed:
    tag = "<|python_tag|>"
    body = text.lstrip(WHITESPACE)
    if body.startswith(tag):
        body = body[len(tag):]
    elif not body.startswith("{"):
        if not final and tag.startswith(body):
            return Parsed()
        return Parsed(_content(text, final, ()))
    try:
        calls, _ = _json_calls(body, 0, ("parameters", "arguments"), ";", None)
    except Malformed:
        return Parsed(text) if final else Parsed()
    return _finish(Parsed("", calls), text, final)


def parse_mistral(text: str, final: bool) -> Parsed:
    marker = "[TOOL_CALLS]"
    start = text.find(marker)
    if start < 0:
        return Parsed(_content(text, final, (marker,)))
    parsed = Parsed(text[:start].rstrip(WHITESPACE))
    try:
        j = _skip_ws(text, start + len(marker))
        if j < len(text) and text[j] == "[":
            parsed.calls, _ = _json_calls(text, j + 1, ("arguments",), ",", "]")
        else:
            parsed.calls = _mistral_named_calls(text, start)
    except Malformed:
        if final:
            return Parsed(text)
        parsed.calls = [call for call in parsed.calls if call.complete]
    return _finish(parsed, text, final)


def _mistral_named_calls(text: str, start: int) -> list[PartialCall]:
    """``[TOOL_CALLS]name[ARGS]{...}`` calls (Mistral's tokenizers from v11 on)."""
    marker, args = "[TOOL_CALLS]", "[ARGS]"
    calls = []
    while start >= 0:
        name_start = start + len(marker)
        args_at = text.find(args, name_start)
        if args_at < 0:
            break  # the name is still being written
        call = PartialCall(text[name_start:args_at].strip())
        calls.append(call)
        j = _skip_ws(text, args_at + len(args))
        end = _value_end(text, j)
        call.arguments = text[j:] if end is None else text[j:end]
        if end is None:
            break
        _check_arguments(call)
        call.complete = True
        start = text.find(marker, end)
    return calls


def parse_pythonic(text: str, final: bool) -> Parsed:
    body = text.lstrip(WHITESPACE)
    if not body.startswith("["):
        return Parsed(_content(text, final, ()) if body or final else "")
    try:
        calls = [_python_call(segment) for segment in _python_call_segments(body)]
    except Malformed:
        return Parsed(text) if final else Parsed()
    if final and not _is_python_list(body):
        return Parsed(text)
    return Parsed("", calls)


def _python_call_segments(body: str) -> list[str]:
    """The complete ``name(...)`` calls of a Python list of calls that starts at body[0]."""
    segments, depth, quote, start, i = [], 0, None, 1, 1
    while i < len(body):
        char = body[i]
        if quote is not None:
            if char == "\\":
                i += 1
            elif char == quote:
                quote = None
        elif char in "\"'":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            if depth == 0:
                break  # the list's own "]"
            depth -= 1
            if depth == 0 and char == ")":
                segments.append(body[start:i + 1].strip(WHITESPACE + ","))
                start = i + 1
        i += 1
    return segments


def _is_python_list(body: str) -> bool:
    try:
        return isinstance(ast.parse(body.strip(WHITESPACE), mode="eval").body, ast.List)
    except SyntaxError:
        return False


def _python_call(segment: str) -> PartialCall:
    try:
        node = ast.parse(segment, mode="eval").body
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            raise Malformed("a call must be name(keyword=value, ...)")
        arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
    except (SyntaxError, ValueError, TypeError) as exc:
        raise Malformed(f"not a Python call: {exc}") from None
    return PartialCall(node.func.id, json.dumps(arguments, ensure_ascii=False), complete=True)


def parse_json_array(text: str, final: bool) -> Parsed:
    """``tool_choice: "required"``: a JSON array of ``{"name", "arguments"}`` objects."""
    j = _skip_ws(text, 0)
    if j >= len(text):
        return Parsed(text) if final else Parsed()
    try:
        if text[j] != "[":
            raise Malformed("expected a JSON array")
        calls, end = _json_calls(text, j + 1, ("arguments",), ",", "]", forced=True)
    except Malformed:
        return Parsed(text) if final else Parsed()
    if final and end is None:
        return Parsed(text)  # cut by max_tokens before the array closed
    return _finish(Parsed("", calls), text, final)


def parse_arguments(name: str) -> Parser:
    """A named function's answer: the whole text is its arguments."""

    def parse(text: str, final: bool) -> Parsed:
        arguments = text.strip(WHITESPACE) if final else text.lstrip(WHITESPACE).rstrip(WHITESPACE)
        return Parsed("", [PartialCall(name, arguments, complete=final)])

    return parse


#: Parsers for ``tool_choice: "auto"`` (--tool-call-parser).
TOOL_CALL_PARSERS: dict[str, Parser] = {
    "hermes": parse_hermes,
    "llama3_json": parse_llama3_json,
    "mistral": parse_mistral,
    "pythonic": parse_pythonic,
}

#: Parsers whose markers are special tokens, which the detokenizer must keep.
KEEPS_SPECIAL_TOKENS = frozenset({"llama3_json", "mistral"})
