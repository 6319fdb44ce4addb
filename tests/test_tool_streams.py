"""Streamed = not streamed, for every tool-call parser: a differential harness.

Each answer below is fed to a streamed choice in every chunking a server meets (one
character at a time, one token of the default model's tokenizer at a time, random cuts),
ending normally or cut by ``max_tokens`` at many points, and the deltas are added up: they
must equal the non-streamed answer built from the same text (content, calls with their
names and arguments, finish reason). While it streams, a call's arguments may lag the text
by at most a couple of characters (a bounded hold-back), except pythonic calls, which are
sent whole.
"""

from __future__ import annotations

import json
import random

import pytest

from pagoda.engine.outputs import CompletionOutput
from pagoda.server.responses import ChoiceBuilder, ChoiceState
from pagoda.server.tools import ToolRequest, ToolSyntax

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
TOOLS = [WEATHER, TIME]

W = '{"city": "Paris", "unit": "celsius"}'
T = '{"city": "S\\u00e3o \\"Paulo\\" {x}"}'
ANSWERS = {
    "hermes": [f'Let me check both.\n<tool_call>{{"name": "get_weather", "arguments": {W}}}</tool_call>\n'
               f'<tool_call>{{"name": "get_time", "arguments": {T}}}</tool_call>',
               f'<tool_call>\n{{"name": "get_time", "arguments": {T}}}\n</tool_call>',
               "It is sunny in Paris; no call < needed.",
               # the same call twice: the answer ends at the repeat
               f'<tool_call>{{"name": "get_time", "arguments": {T}}}</tool_call>\n'
               f'<tool_call>{{"name": "get_time", "arguments": {T}}}</tool_call>\n<tool_call>{{"name": "get_weather"'],
    "llama3_json": [f'{{"name": "get_weather", "parameters": {W}}}; {{"name": "get_time", "parameters": {T}}}',
                    f'<|python_tag|>{{"name": "get_time", "parameters": {T}}}'],
    "mistral": [f'Sure. [TOOL_CALLS][{{"name": "get_weather", "arguments": {W}}}, '
                f'{{"name": "get_time", "arguments": {T}}}]',
                f"[TOOL_CALLS]get_weather[ARGS]{W}[TOOL_CALLS]get_time[ARGS]{T}"],
    "pythonic": ["[get_weather(city='Paris', unit=\"celsius\"), get_time(city=\"Pa)ris\")]"],
    "required": [f'[{{"name": "get_weather", "arguments": {W}}}, {{"name": "get_time", "arguments": {T}}}]',
                 f'[{{"name": "get_time", "arguments": {T}}}, {{"name": "get_time", "arguments": {T}}}'],
    "named": [T],
}
CASES = [(kind, text) for kind, texts in ANSWERS.items() for text in texts]


def request(kind: str) -> ToolRequest:
    if kind == "required":
        return ToolRequest(TOOLS, "required")
    if kind == "named":
        return ToolRequest(TOOLS, "named", function="get_time")
    return ToolRequest(TOOLS, "auto", syntax=ToolSyntax(kind))


def whole(tools: ToolRequest, text: str, finish: str):
    choice = ChoiceBuilder(True, None, None, tools).whole(0, CompletionOutput(0, text, finish_reason=finish))
    message = choice["message"]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
    return message["content"] or "", calls, choice["finish_reason"]


def streamed(tools: ToolRequest, pieces: list[str], finish: str, lag: list[int] | None = None):
    """What the chunks of a stream fed ``pieces`` add up to; ``lag`` gets, after each piece,
    how far the last call's arguments sent trail the text (see arguments_lag)."""
    builder, state = ChoiceBuilder(True, None, None, tools), ChoiceState()
    content, calls, end, text = "", {}, None, ""
    for i, piece in enumerate(pieces):
        text += piece
        last = i == len(pieces) - 1
        for chunk in builder.deltas(0, CompletionOutput(0, piece, finish_reason=finish if last else None), state):
            delta = chunk["delta"]
            content += delta.get("content", "")
            for call in delta.get("tool_calls", []):
                entry = calls.setdefault(call["index"], ["", ""])
                if "id" in call:
                    assert entry == ["", ""] and call["function"]["arguments"] == ""  # id and name come first
                    entry[0] = call["function"]["name"]
                entry[1] += call["function"].get("arguments", "")
            end = chunk["finish_reason"] or end
        if lag is not None and not last:
            lag.append(arguments_lag(tools, text, [c[1] for c in calls.values()]))
    return content, [tuple(c) for c in calls.values()], end


def arguments_lag(tools: ToolRequest, text: str, sent: list[str]) -> int:
    """Characters of the calls' arguments in ``text`` (counted to its very end: a trailing
    blank counts as written) not yet sent."""
    parsed = tools.parse(text, final=False)
    written = sum(len(call.arguments) for call in parsed.calls if call.name is not None)
    tail = len(text) - len(text.rstrip())
    return max(0, written + (tail if parsed.calls and not parsed.calls[-1].complete else 0) - sum(map(len, sent)))


def token_pieces(tokenizer, text: str) -> list[str]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces, done = [], ""
    for i in range(len(ids)):
        now = tokenizer.decode(ids[:i + 1])
        pieces.append(now[len(done):])
        done = now
    assert done == text
    return pieces


def random_pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.fixture(scope="module")
def tokenizer():
    from pagoda.engine.model_loader import convert_gguf, default_gguf_path, load_tokenizer

    return load_tokenizer(convert_gguf(default_gguf_path()))


@pytest.mark.parametrize("kind, text", CASES, ids=[f"{k}-{i}" for k, texts in ANSWERS.items()
                                                   for i in range(len(texts))])
def test_every_chunking_adds_up_to_the_whole_answer(kind, text, tokenizer):
    tools, rng = request(kind), random.Random(text)
    expected = whole(tools, text, "stop")
    assert expected[1] or kind == "hermes"  # every answer but the plain one holds calls
    chunkings = {"chars": list(text), "tokens": token_pieces(tokenizer, text)}
    chunkings.update({f"random-{i}": random_pieces(text, rng) for i in range(20)})
    for name, pieces in chunkings.items():
        lag: list[int] = []
        assert streamed(tools, pieces, "stop", lag) == expected, name
        if kind != "pythonic" and name == "chars":
            assert max(lag, default=0) <= 2, lag  # arguments go out as they are written


@pytest.mark.parametrize("kind, text", CASES, ids=[f"{k}-{i}" for k, texts in ANSWERS.items()
                                                   for i in range(len(texts))])
def test_an_answer_cut_by_max_tokens_is_the_same_streamed_or_not(kind, text):
    """Cut at every third character: the same calls both ways (a call whose name is written
    is a call, its arguments as far as they got), finish_reason "length"."""
    tools, rng = request(kind), random.Random(len(text))
    for cut in range(1, len(text), 3):
        prefix = text[:cut]
        expected = whole(tools, prefix, "length")
        assert expected[2] == "length"
        assert streamed(tools, list(prefix), "length") == expected, prefix
        assert streamed(tools, random_pieces(prefix, rng) if cut > 1 else [prefix], "length") == expected, prefix


def test_a_repeated_call_ends_the_calls_streamed_and_not():
    tools = request("required")
    text = ANSWERS["required"][1]
    assert tools.repeats(text) and not tools.repeats(text[:-1])
    content, calls, finish = whole(tools, text, "stop")
    assert (content, finish) == ("", "tool_calls") and [c[0] for c in calls] == ["get_time"]
    assert json.loads(calls[0][1]) == json.loads(T)
    assert not ToolRequest(TOOLS, "required", parallel=False).repeats(text)  # one call anyway
