"""Tools and structured outputs with clients nobody here wrote, against a live server on the
default model started with no flags: the `openai` package (every tool_choice streamed and
not, a call cut by max_tokens, a two-turn loop that sends the streamed call back, parse()
with a Pydantic model under the default token limit, auto with a response_format), the
OpenAI Agents SDK (Runner.run and Runner.run_streamed on the chat model), LangChain's
ChatOpenAI (bind_tools and with_structured_output, every method) and LiteLLM."""

from __future__ import annotations

import asyncio
import json
import os

import jsonschema
import openai
import pydantic
import pytest

from pagoda.engine.config import EngineConfig
from pagoda.server.config import ServerConfig
from pagoda.server.testing import ServerThread

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}  # NOTE: open as LangChain and most users write it
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


class City(pydantic.BaseModel):
    name: str
    country: str
    population: int
    area_km2: float


@pytest.fixture(scope="module")
def server():
    with ServerThread(EngineConfig(max_model_len=2048), ServerConfig()) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def stream_calls(client, **kwargs):
    """(calls as (name, arguments), finish_reason) a stream adds up to."""
    calls, finish = {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or []:
            entry = calls.setdefault(delta.index, ["", ""])
            entry[0] += delta.function.name or ""
            entry[1] += delta.function.arguments or ""
    return [tuple(c) for c in calls.values()], finish


def whole_calls(choice):
    return [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]


def check_blocks_freed(server):
    kv = server.call(lambda: server.engine.scheduler.kv_cache_manager)
    assert server.call(lambda: kv.get_num_free_blocks()) == kv.num_blocks


@pytest.mark.parametrize("tool_choice", ["required", NAMED, "auto"], ids=["required", "named", "auto"])
def test_every_tool_choice_streamed_and_not_gives_the_same_calls(client, server, tool_choice):
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=tool_choice, temperature=0, max_tokens=60)
    choice = client.chat.completions.create(**kwargs).choices[0]
    calls = whole_calls(choice)
    if tool_choice != "auto":
        assert choice.finish_reason == "tool_calls" and len(calls) >= 1
    for name, arguments in calls:
        assert name == "get_weather"
        arguments = json.loads(arguments)
        jsonschema.validate(arguments, WEATHER["function"]["parameters"])
        assert set(arguments) <= {"city", "days"}  # closed: no invented keys
    assert stream_calls(client, **kwargs) == (calls, choice.finish_reason)
    check_blocks_freed(server)


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_a_call_cut_by_max_tokens_comes_back_the_same_and_goes_back_in(client, tool_choice):
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=tool_choice, temperature=0, max_tokens=9)
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.tool_calls and choice.message.tool_calls[0].function.name == "get_weather"
    assert stream_calls(client, **kwargs) == (whole_calls(choice), "length")
    # The server takes its own cut call back in the next turn.
    messages = [*ASK, {"role": "assistant", "content": None,
                       "tool_calls": [c.model_dump() for c in choice.message.tool_calls]},
                {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "sunny"}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=10,
                                            temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_a_two_turn_loop_sends_the_streamed_call_back(client):
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0)
    ids, calls = {}, {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for delta in chunk.choices[0].delta.tool_calls or []:
            ids.setdefault(delta.index, delta.id)
            entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
    assert calls
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": ids[i], "type": "function", "function": call} for i, call in calls.items()]}]
    messages += [{"role": "tool", "tool_call_id": ids[i], "content": json.dumps({"sky": "clear", "celsius": 21})}
                 for i in calls]
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                           max_tokens=40, temperature=0).choices[0]
    assert final.message.content and not final.message.tool_calls


def test_parse_with_a_pydantic_model_finishes_under_the_default_limit(client):
    out = client.chat.completions.parse(model=MODEL, response_format=City, temperature=0,
                                        messages=[{"role": "user", "content": "Tell me about Paris as JSON."}])
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(out.choices[0].message.parsed, City)
    assert out.usage.completion_tokens < 200


@pytest.mark.parametrize("question", ["What is the weather in Paris?", "Describe Paris as JSON."])
def test_auto_with_a_response_format_gives_a_call_or_valid_content(client, question):
    schema = City.model_json_schema()
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": question}], tools=[WEATHER], temperature=0,
                  response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    choice = client.chat.completions.create(**kwargs).choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        json.loads(choice.message.tool_calls[0].function.arguments)
    else:
        assert choice.finish_reason == "stop"
        City.model_validate_json(choice.message.content)


# -- the OpenAI Agents SDK -----------------------------------------------------------------

def agent(server, **settings):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # NOTE: no network here: its traces would go to OpenAI

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city now."""
        return f"It is sunny in {city}."

    model = OpenAIChatCompletionsModel(model=MODEL, openai_client=openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key="unused", max_retries=0))
    return Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather], model=model,
                 model_settings=ModelSettings(temperature=0, max_tokens=80, **settings),
                 tool_use_behavior="stop_on_first_tool")


def test_the_agents_sdk_runs_a_function_tool(server):
    from agents import Runner

    result = Runner.run_sync(agent(server, tool_choice="required"), "What is the weather in Paris?", max_turns=3)
    assert result.final_output.startswith("It is sunny in ")


def test_the_agents_sdk_streams_a_function_tool(server):
    from agents import Runner

    async def run():
        result = Runner.run_streamed(agent(server, tool_choice="required"), "What is the weather in Paris?",
                                     max_turns=3)
        kinds = [event.type async for event in result.stream_events()]
        return result, kinds

    result, kinds = asyncio.run(run())
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
    assert result.final_output.startswith("It is sunny in ")


# -- LangChain --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def chat_model(server):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key="unused", temperature=0, max_tokens=80,
                      max_retries=0)


def get_weather(city: str) -> str:
    """The weather in a city now."""
    return "sunny"


@pytest.mark.parametrize("tool_choice", ["get_weather", "any", "auto"])
def test_langchain_bind_tools(chat_model, tool_choice):
    message = chat_model.bind_tools([get_weather], tool_choice=tool_choice).invoke("What is the weather in Paris?")
    if tool_choice != "auto":
        assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    for call in message.tool_calls:
        assert set(call["args"]) <= {"city"}


@pytest.mark.parametrize("method, strict", [("json_schema", True), ("json_schema", False),
                                            ("function_calling", True), ("function_calling", False),
                                            ("json_mode", None)])
def test_langchain_with_structured_output(chat_model, method, strict):
    if method == "json_mode":
        # NOTE: JSON mode constrains to an object; keys come from the prompt, so the schema
        # is a dict (no Pydantic validation of what the prompt asked for). Its strings are
        # unbounded: asked for a population too, the 135M model's greedy string ran on
        # ("11111...") past 400 tokens, or not, by how its prompt was cached; two keys it closes.
        runnable = chat_model.with_structured_output(City.model_json_schema(), method="json_mode")
        out = runnable.invoke("Describe Paris as a JSON object with the keys name and country.")
        assert isinstance(out, dict) and out.get("name") == "Paris", out
        return
    out = chat_model.with_structured_output(City, method=method, strict=strict).invoke("Tell me about Paris.")
    assert isinstance(out, City)


# -- LiteLLM ----------------------------------------------------------------------------------

def test_litellm_with_tools(server):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # NOTE: no network for its price list
    import litellm

    response = litellm.completion(model=f"openai/{MODEL}", api_base=server.url + "/v1", api_key="unused",
                                  messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=60)
    calls = response.choices[0].message.tool_calls
    assert response.choices[0].finish_reason == "tool_calls"
    assert calls[0].function.name == "get_weather" and json.loads(calls[0].function.arguments)["city"]
