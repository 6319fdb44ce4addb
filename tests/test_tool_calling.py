"""Tool calling with the real openai client against a live server on the default model:
required and named calls enforced by the grammar (streamed and not), a two-turn tool loop,
auto with the hermes parser, and bad inputs that get a 400 and lose nothing; all with no
tool flags."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from pagoda.engine.config import EngineConfig
from pagoda.server.config import ServerConfig
from pagoda.server.testing import ServerThread
from pagoda.server.tools import ToolRequest, ToolSyntax, tools_in_system

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async-scheduling"])
def server(request):
    # NOTE: no flags: the default model's template ignores tools, the server picks chatml_tools and hermes.
    with ServerThread(EngineConfig(max_model_len=1024, async_scheduling=request.param), ServerConfig()) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def check_calls(calls, names=None):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_forced_calls_are_valid_and_the_stream_adds_up(client, tool_choice):
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=80, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls"
    check_calls(whole.message.tool_calls, ["get_weather"] if isinstance(tool_choice, dict) else None)
    # The stream: id and name first, then the arguments, adding up to the same calls.
    calls, finish = {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
            if delta.id:
                assert call["id"] is None and not call["arguments"]  # id and name come first
                call["id"], call["name"] = delta.id, delta.function.name
            call["arguments"] += delta.function.arguments or ""
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_a_two_turn_tool_loop_ends_with_an_answer(client):
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})}]
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                           max_tokens=40, temperature=0)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason in ("stop", "length")


def test_auto_lets_the_model_answer_or_call(client):
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80, temperature=0)
    choice = out.choices[0]
    if choice.message.tool_calls:  # the hermes parser found calls in the model's own text
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            assert call.function.name and json.loads(call.function.arguments) is not None
    else:
        assert choice.message.content and choice.finish_reason in ("stop", "length")


def test_the_hermes_parser_on_texts_in_its_format():
    tools = ToolRequest(tools=TOOLS, choice="auto", syntax=ToolSyntax("hermes"))
    content, calls = tools.extract('Let me check.\n<tool_call>{"name": "get_weather", "arguments": '
                                   '{"city": "Paris", "unit": "celsius"}}</tool_call>\n<tool_call>{"name": "get_time", '
                                   '"arguments": {"city": "Paris"}}</tool_call>')
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"city": "Paris"})]
    assert tools.extract("Just text.") == ("Just text.", [])
    assert tools.extract("<tool_call>not json</tool_call>")[1] == []


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}], "tool_choice": "required"},
     "tools[0].function.name"),
    ({"tools": "weather", "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tool_requests_get_a_400_naming_the_field(client, server, body, param):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, extra_body=body)
    assert error.value.body["param"] == param, error.value.body
    ok = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3)
    assert ok.choices[0].finish_reason in ("stop", "length")
    kv = server.call(lambda: server.engine.scheduler.kv_cache_manager)
    assert server.call(lambda: kv.get_num_free_blocks()) == kv.num_blocks


PLAIN_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


def test_a_template_that_is_not_chatml_gets_the_tools_in_its_system_message(tiny_llama_dir, caplog):
    """A template that ignores tools and is not ChatML: Pagoda writes the tools and the call
    format into the system message (one log line says so), the grammar forces the call, and
    the call and its result go back as text the model reads."""
    engine = EngineConfig(model=str(tiny_llama_dir), dtype="float32", enforce_eager=True, max_model_len=1024,
                          num_kv_blocks=128)
    with caplog.at_level("INFO", logger="pagoda"), \
            ServerThread(engine, ServerConfig(chat_template=PLAIN_TEMPLATE)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        first = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                               parallel_tool_calls=False,
                                               max_tokens=120, temperature=0).choices[0]
        assert first.finish_reason == "tool_calls"
        check_calls(first.message.tool_calls)
        call = first.message.tool_calls[0]
        messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": "21 degrees"}]
        second = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="none",
                                                max_tokens=5, temperature=0)
        assert second.choices[0].finish_reason in ("stop", "length")
    rendered = tools_in_system(messages, TOOLS)
    assert rendered[0]["role"] == "system" and '"name": "get_time"' in rendered[0]["content"]
    assert "<tool_call>" in rendered[2]["content"] and "tool_calls" not in rendered[2]
    assert rendered[3] == {"role": "user", "content": "<tool_response>21 degrees</tool_response>"}
    assert any("into the system message" in r.getMessage() for r in caplog.records)
