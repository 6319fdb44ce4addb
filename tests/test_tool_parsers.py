"""Tool-call parsers and reasoning parsers: on texts in each format, whole and streamed (every
prefix of the text, as a stream sees it), and against a live server on a tiny random model
whose output a regex forces into each format, with the real openai client."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from pagoda.engine.config import EngineConfig
from pagoda.engine.outputs import CompletionOutput
from pagoda.engine.reasoning import REASONING_PARSERS
from pagoda.server.config import ServerConfig
from pagoda.server.responses import ChoiceBuilder, ChoiceState
from pagoda.server.testing import ServerThread
from pagoda.server.tool_parsers import TOOL_CALL_PARSERS
from pagoda.server.tools import ToolRequest, ToolSyntax

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
TOOLS = [WEATHER, TIME]
PARIS = {"city": "Paris", "unit": "celsius"}

# (parser, text, content, calls as (name, arguments object))
TEXTS = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
               '\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"city": "Pa\\"ris}"}}</tool_call>',
     "Let me check.", [("get_weather", PARIS), ("get_time", {"city": 'Pa"ris}'})]),
    ("hermes", "It is sunny; no <tool_ needed.", "It is sunny; no <tool_ needed.", []),
    ("hermes", "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ("hermes", '<tool_call>{"name": "g", "arguments": null}</tool_call>',
     '<tool_call>{"name": "g", "arguments": null}</tool_call>', []),  # not streamed as a call either
    ("hermes", '<tool_call>{"name": "g", "parameters": {"a": 1}, "arguments": {"b": 2}}</tool_call>',
     "", [("g", {"a": 1})]),  # the first arguments key wins, streamed or not
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {"city": "Paris"', None, None),  # cut off
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
                    '{"name": "get_time", "parameters": {"city": "Paris"}}',
     "", [("get_weather", PARIS), ("get_time", {"city": "Paris"})]),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {}}', "", [("get_time", {})]),
    ("llama3_json", "The weather is fine {really}.", "The weather is fine {really}.", []),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                '{"name": "get_time", "arguments": {"city": "Paris"}}]',
     "Sure.", [("get_weather", PARIS), ("get_time", {"city": "Paris"})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]get_time[ARGS]{}',
     "", [("get_weather", PARIS), ("get_time", {})]),
    ("pythonic", "[get_weather(city='Paris', unit=\"celsius\"), get_time(city=\"Pa)ris\")]",
     "", [("get_weather", PARIS), ("get_time", {"city": "Pa)ris"})]),
    ("pythonic", "[get_weather(city=", None, None),
    ("pythonic", "Paris is sunny.", "Paris is sunny.", []),
]


def stream_choice(builder: ChoiceBuilder, text: str, piece: int = 3):
    """Feeds ``text`` to a streamed choice a few characters at a time; what the chunks add up to."""
    state, content, reasoning, calls, finish = ChoiceState(), "", "", {}, None
    for start in range(0, len(text), piece):
        last = start + piece >= len(text)
        output = CompletionOutput(0, text[start:start + piece], finish_reason="stop" if last else None)
        for chunk in builder.deltas(0, output, state):
            delta = chunk["delta"]
            content += delta.get("content", "")
            reasoning += delta.get("reasoning_content", "")
            for call in delta.get("tool_calls", []):
                entry = calls.setdefault(call["index"], {"id": None, "name": None, "arguments": ""})
                if "id" in call:
                    assert entry["id"] is None and call["function"]["arguments"] == ""  # id and name first
                    entry["id"], entry["name"] = call["id"], call["function"]["name"]
                entry["arguments"] += call["function"].get("arguments", "")
            finish = chunk["finish_reason"] or finish
    return content, reasoning, [(c["name"], c["arguments"]) for c in calls.values()], finish


@pytest.mark.parametrize("parser, text, content, calls", TEXTS)
def test_parsers_find_calls_and_a_stream_adds_up_to_the_whole(parser, text, content, calls):
    tools = ToolRequest(tools=TOOLS, choice="auto", syntax=ToolSyntax(parser))
    whole_content, whole_calls = tools.extract(text)
    if content is None:
        # Cut off (by max_tokens): the whole answer is content, as the model wrote it; a
        # stream has sent what it had of the call, as OpenAI's do.
        assert (whole_content, whole_calls) == (text, [])
        return
    assert (whole_content or "") == content
    assert [(c.name, json.loads(c.arguments)) for c in whole_calls] == calls
    for piece in (1, 4):
        builder = ChoiceBuilder(True, None, None, tools)
        streamed_content, _, streamed_calls, finish = stream_choice(builder, text, piece)
        assert streamed_calls == [(c.name, c.arguments) for c in whole_calls]
        assert streamed_content == (content if not whole_calls else whole_content or "")
        assert finish == ("tool_calls" if calls else "stop")


def test_parallel_tool_calls_false_keeps_the_first_call():
    tools = ToolRequest(tools=TOOLS, choice="auto", syntax=ToolSyntax("llama3_json"), parallel=False)
    _, calls = tools.extract('{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {}}')
    assert [c.name for c in calls] == ["get_time"]


def test_forced_choices_stream_their_arguments_piece_by_piece():
    required = ToolRequest(tools=TOOLS, choice="required")
    text = '[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]'
    builder = ChoiceBuilder(True, None, None, required)
    state, chunks = ChoiceState(), []
    for i in range(0, len(text), 5):
        chunks += builder.deltas(0, CompletionOutput(0, text[i:i + 5], finish_reason=None), state)
    pieces = [c["delta"]["tool_calls"][0]["function"].get("arguments") for c in chunks]
    assert chunks[0]["delta"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert len(pieces) > 3 and json.loads("".join(pieces[1:])) == PARIS  # sent as it is written
    named = ToolRequest(tools=TOOLS, choice="named", function="get_time")
    assert stream_choice(ChoiceBuilder(True, None, None, named), '{"city": "Oslo"}', 2)[2] == [
        ("get_time", '{"city": "Oslo"}')]


@pytest.mark.parametrize("name, text, reasoning, content", [
    ("deepseek_r1", "The user wants a city.</think>\n\nParis.", "The user wants a city.", "Paris."),
    ("deepseek_r1", "<think>Hmm.</think>Paris.", "Hmm.", "Paris."),
    ("deepseek_r1", "Still thinking when cut", "Still thinking when cut", ""),
    ("qwen3", "<think>\nShort.\n</think>\n\nParis.", "\nShort.\n", "Paris."),
    ("qwen3", "Paris, no thinking. </think>", None, "Paris, no thinking. </think>"),
])
def test_reasoning_parsers_split_thinking_from_the_answer(name, text, reasoning, content):
    parser = REASONING_PARSERS[name]
    assert parser.split(text, final=True) == (reasoning, content)
    builder = ChoiceBuilder(True, None, None, None, parser)
    whole = builder.whole(0, CompletionOutput(0, text, finish_reason="stop"))["message"]
    assert whole.get("reasoning_content") == reasoning and (whole["content"] or "") == content
    for piece in (1, 3):
        streamed_content, streamed_reasoning, _, _ = stream_choice(builder, text, piece)
        assert (streamed_reasoning, streamed_content) == (reasoning or "", content)


def test_reasoning_then_a_tool_call():
    tools = ToolRequest(tools=TOOLS, choice="auto", syntax=ToolSyntax("hermes"))
    builder = ChoiceBuilder(True, None, None, tools, REASONING_PARSERS["qwen3"])
    text = '<think>Weather needs a call.</think>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    message = builder.whole(0, CompletionOutput(0, text, finish_reason="stop"))["message"]
    assert message["reasoning_content"] == "Weather needs a call." and message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}
    assert stream_choice(builder, text, 2)[1:3] == ("Weather needs a call.", [("get_time", "{}")])


# -- a live server: a tiny random model whose output a regex forces into each format ----

CITY = "[A-Za-z]{1,8}"
FORMATS = {
    "hermes": (r'Sure\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "CITY", "unit": "celsius"\}\}'
               r"\n</tool_call>", "Sure."),
    "llama3_json": (r'\{"name": "get_weather", "parameters": \{"city": "CITY", "unit": "celsius"\}\}; '
                    r'\{"name": "get_time", "parameters": \{"city": "CITY"\}\}', None),
    "mistral": (r'\[TOOL_CALLS\]\[\{"name": "get_weather", "arguments": \{"city": "CITY", "unit": "celsius"\}\}\]',
                None),
    "pythonic": (r'\[get_weather\(city="CITY", unit="celsius"\), get_time\(city="CITY"\)\]', None),
}


@pytest.fixture(scope="module", params=[(parser, async_scheduling) for parser in FORMATS
                                        for async_scheduling in (False, True)],
                ids=lambda p: f"{p[0]}-{'async' if p[1] else 'sync'}")
def parser_server(request, tiny_llama_dir):
    parser, async_scheduling = request.param
    engine = EngineConfig(model=str(tiny_llama_dir), dtype="float32", enforce_eager=True, max_model_len=512,
                          num_kv_blocks=128, async_scheduling=async_scheduling)
    config = ServerConfig(chat_template="chatml_tools", tool_call_parser=parser)
    with ServerThread(engine, config) as server:
        yield parser, server


def test_auto_finds_the_calls_of_each_format_in_a_live_answer(parser_server):
    parser, server = parser_server
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    regex, content = FORMATS[parser]
    kwargs = dict(model=client.models.list().data[0].id, messages=[{"role": "user", "content": "Weather in Paris?"}],
                  tools=TOOLS, max_tokens=300, temperature=0,
                  extra_body={"structured_outputs": {"regex": regex.replace("CITY", CITY)}})
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == content
    assert whole.message.tool_calls[0].function.name == "get_weather"
    for call in whole.message.tool_calls:
        assert re.fullmatch(CITY, json.loads(call.function.arguments)["city"])
    calls, text = {}, ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        text += delta.content or ""
        for piece in delta.tool_calls or []:
            entry = calls.setdefault(piece.index, ["", ""])
            entry[0] += piece.function.name or ""
            entry[1] += piece.function.arguments or ""
    assert (text or None) == content
    assert [tuple(c) for c in calls.values()] == [(c.function.name, c.function.arguments)
                                                  for c in whole.message.tool_calls]


@pytest.fixture(scope="module")
def reasoning_server(tiny_llama_dir):
    engine = EngineConfig(model=str(tiny_llama_dir), dtype="float32", enforce_eager=True, max_model_len=512,
                          num_kv_blocks=64, reasoning_parser="qwen3")
    with ServerThread(engine, ServerConfig(chat_template="chatml_tools")) as server:
        yield server


def test_a_grammar_applies_once_the_prompt_closed_the_thinking_live(reasoning_server):
    """--reasoning-parser qwen3: the assistant's thinking, closed in the prompt (continued),
    lets the constraint apply from the first output token; the answer is content."""
    server = reasoning_server
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Yes or no?"}, {"role": "assistant", "content": "<think>Easy.</think>"}]
    kwargs = dict(model=client.models.list().data[0].id, messages=messages, max_tokens=50, temperature=0,
                  extra_body={"structured_outputs": {"regex": "(yes|no)"}, "continue_final_message": True,
                              "add_generation_prompt": False})
    message = client.chat.completions.create(**kwargs).choices[0].message
    assert message.content in ("yes", "no") and message.model_extra.get("reasoning_content") is None
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        stream=True, **kwargs))
    assert streamed == message.content


def test_auto_tools_with_a_response_format_apply_after_the_thinking_live(reasoning_server):
    """--reasoning-parser qwen3, tool_choice auto and a response_format: the thinking closed,
    the answer is a valid call or content valid for the schema, never neither."""
    server = reasoning_server
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
    messages = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": "<think>Hm.</think>"}]
    for seed in range(4):
        choice = client.chat.completions.create(
            model=client.models.list().data[0].id, messages=messages, tools=TOOLS, max_tokens=120, temperature=1,
            seed=seed, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
            extra_body={"continue_final_message": True, "add_generation_prompt": False}).choices[0]
        assert choice.message.model_extra.get("reasoning_content") is None
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            for call in choice.message.tool_calls:
                parameters = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
                arguments = json.loads(call.function.arguments)
                jsonschema.validate(arguments, parameters)
                assert set(arguments) <= set(parameters["properties"])  # closed: no invented keys
        else:
            assert choice.finish_reason == "stop", choice
            assert set(json.loads(choice.message.content)) == {"city"}
