"""The APIs agents speak, with clients nobody here wrote, against a live server on the default
model started with no flags: OpenAI's Responses API (the `openai` package streamed and not, a
function tool and a two-turn loop through previous_response_id, the OpenAI Agents SDK on its
default Responses model) and Anthropic's Messages API (the `anthropic` package, create and
stream, a tool loop, count_tokens; LangChain's ChatAnthropic); bad input on each route in that
API's own error shape, the server serving on."""

from __future__ import annotations

import asyncio
import json

import anthropic
import openai
import pytest

from pagoda.engine.config import EngineConfig
from pagoda.server.config import ServerConfig
from pagoda.server.testing import ServerThread, http_request

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
KEY = "sk-agents"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city now.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
WEATHER_TOOL = {"name": "get_weather", "description": "The weather in a city now.",
                "input_schema": WEATHER["parameters"]}
ASK = "What is the weather in Paris?"
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server():
    with ServerThread(EngineConfig(max_model_len=2048), ServerConfig(api_key=KEY)) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def check_blocks_freed(server):
    kv = server.call(lambda: server.engine.scheduler.kv_cache_manager)
    assert server.call(lambda: kv.get_num_free_blocks()) == kv.num_blocks


# -- the Responses API ----------------------------------------------------------------------


def test_a_response_streamed_and_not_is_the_same(client, server):
    # NOTE: after a first run, so that both runs find the prompt in the prefix cache: a prompt
    # computed whole and one mostly read from the cache may differ at a bfloat16 near-tie
    # (docs/engine.md#batch-invariance, the option that makes them equal).
    client.responses.create(model=MODEL, input="Name three colors.", max_output_tokens=200, **GREEDY)
    whole = client.responses.create(model=MODEL, input="Name three colors.", max_output_tokens=200, **GREEDY)
    assert whole.status == "completed" and whole.output_text
    assert whole.usage.output_tokens > 0 and whole.usage.total_tokens == whole.usage.input_tokens + \
        whole.usage.output_tokens
    with client.responses.stream(model=MODEL, input="Name three colors.", max_output_tokens=200, **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.output_text == whole.output_text
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    cut = client.responses.create(model=MODEL, input="Name three colors.", max_output_tokens=3, **GREEDY)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    check_blocks_freed(server)


def test_a_function_tool_and_a_second_turn_through_previous_response_id(client, server):
    first = client.responses.create(model=MODEL, input=ASK, tools=[WEATHER], tool_choice="required",
                                    max_output_tokens=60, **GREEDY)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and "city" in json.loads(calls[0].arguments)
    # Streamed, the same call comes in events that add up to it.
    stream = client.responses.create(model=MODEL, input=ASK, tools=[WEATHER], tool_choice="required",
                                     max_output_tokens=60, stream=True, **GREEDY)
    events = list(stream)
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(e.name, e.arguments) for e in done] == [(c.name, c.arguments) for c in calls]
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == \
        "".join(c.arguments for c in calls)
    # The second turn sends only the call's output: the rest comes from the stored response.
    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[WEATHER],
                                     input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                             "output": "It is 21 degrees and sunny."}],
                                     max_output_tokens=40, **GREEDY)
    assert second.status in ("completed", "incomplete") and second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens  # the history was rendered in
    assert client.responses.retrieve(first.id).output[0].call_id == calls[0].call_id
    items = client.responses.input_items.list(second.id)
    assert [item.type for item in items.data] == ["function_call_output"]
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    check_blocks_freed(server)


def test_parse_with_a_pydantic_model_streamed_and_not(client):
    import pydantic

    class City(pydantic.BaseModel):
        name: str
        country: str

    whole = client.responses.parse(model=MODEL, input="Describe Paris as JSON.", text_format=City, **GREEDY)
    assert whole.status == "completed" and isinstance(whole.output_parsed, City)
    with client.responses.stream(model=MODEL, input="Describe Paris as JSON.", text_format=City, **GREEDY) as stream:
        for _ in stream:
            pass
        assert isinstance(stream.get_final_response().output_parsed, City)


def test_the_agents_sdk_runs_a_function_tool_on_its_default_responses_model(server):
    from agents import (Agent, ModelSettings, Runner, function_tool, set_default_openai_api,
                        set_default_openai_client, set_tracing_disabled)

    set_tracing_disabled(True)  # NOTE: no network here: its traces would go to OpenAI
    set_default_openai_client(openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0),
                              use_for_tracing=False)
    set_default_openai_api("responses")

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city now."""
        return f"It is sunny in {city}."

    agent = Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather], model=MODEL,
                  model_settings=ModelSettings(temperature=0, max_tokens=80, tool_choice="required"),
                  tool_use_behavior="stop_on_first_tool")
    result = Runner.run_sync(agent, ASK, max_turns=3)
    assert result.final_output.startswith("It is sunny in ")

    async def streamed():
        # NOTE: a client of this event loop (run_sync's loop has closed with the first one).
        set_default_openai_client(openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0),
                                  use_for_tracing=False)
        run = Runner.run_streamed(agent, ASK, max_turns=3)
        kinds = [event.type async for event in run.stream_events()]
        return run, kinds

    run, kinds = asyncio.run(streamed())
    assert "raw_response_event" in kinds and run.final_output.startswith("It is sunny in ")


@pytest.mark.parametrize("body, param, status", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]",
     400),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type", 400),
    ({"input": "hi", "previous_response_id": "resp_nowhere"}, "previous_response_id", 404),
    ({"input": "hi", "max_output_tokens": -1}, "max_output_tokens", 400),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format", 400),
    ({"input": "hi", "frobnicate": 1}, "frobnicate", 400),
    ({}, "input", 400),
])
def test_bad_responses_input_is_an_openai_error_naming_the_field(server, client, body, param, status):
    answer = http_request(server.url + "/v1/responses", "POST", json={"model": MODEL, **body},
                          headers={"Authorization": f"Bearer {KEY}"})
    assert answer.status == status, answer.json()
    error = answer.json()["error"]
    assert error["param"] == param and error["message"]
    assert client.responses.create(model=MODEL, input="Hi", max_output_tokens=2).status == "incomplete"
    check_blocks_freed(server)


# -- the Messages API -----------------------------------------------------------------------


def test_a_message_created_and_streamed_is_the_same(claude, server):
    ask = dict(model=MODEL, max_tokens=30, system="Answer briefly.",
               messages=[{"role": "user", "content": "Name three colors."}], extra_body=GREEDY)
    claude.messages.create(**ask)  # NOTE: as above, both runs then find the prompt cached
    whole = claude.messages.create(**ask)
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.content[0].type == "text"
    with claude.messages.stream(**ask) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    counted = claude.messages.count_tokens(model=MODEL, system="Answer briefly.",
                                           messages=[{"role": "user", "content": "Name three colors."}])
    assert counted.input_tokens == whole.usage.input_tokens
    stopped = claude.messages.create(model=MODEL, max_tokens=60, stop_sequences=[whole.content[0].text.split()[1]],
                                     messages=ask["messages"], system="Answer briefly.", extra_body=GREEDY)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == whole.content[0].text.split()[1]
    check_blocks_freed(server)


def test_a_tool_loop_through_the_messages_api(claude, server):
    ask = [{"role": "user", "content": ASK}]
    first = claude.messages.create(model=MODEL, max_tokens=60, tools=[WEATHER_TOOL], tool_choice={"type": "any"},
                                   messages=ask, extra_body=GREEDY)
    uses = [block for block in first.content if block.type == "tool_use"]
    assert first.stop_reason == "tool_use" and uses[0].name == "get_weather" and "city" in uses[0].input
    with claude.messages.stream(model=MODEL, max_tokens=60, tools=[WEATHER_TOOL], tool_choice={"type": "any"},
                                messages=ask, extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [(u.name, u.input) for u in uses]
    second = claude.messages.create(
        model=MODEL, max_tokens=40, tools=[WEATHER_TOOL], extra_body=GREEDY,
        messages=[*ask, {"role": "assistant", "content": first.content},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                "content": "It is 21 degrees and sunny."}]}])
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert second.usage.input_tokens > first.usage.input_tokens
    check_blocks_freed(server)


def test_langchain_chat_anthropic_against_the_server(server):
    from langchain_anthropic import ChatAnthropic

    model = ChatAnthropic(model=MODEL, base_url=server.url, api_key=KEY, max_tokens=30, max_retries=0)
    assert model.invoke("Say hello.").content
    bound = model.bind_tools([WEATHER_TOOL], tool_choice="get_weather")
    calls = bound.invoke(ASK).tool_calls
    assert calls and calls[0]["name"] == "get_weather" and "city" in calls[0]["args"]


@pytest.mark.parametrize("body, says", [
    ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens: Field required"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "'messages[0].content[0].type' 'image' is not supported"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "'messages[0].role' must be user or"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web_search_20250305",
                                                                                   "name": "web_search"}]},
     "'tools[0]' is not supported"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "frobnicate": 1},
     "frobnicate: Extra inputs are not permitted"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "stop_sequences": 5},
     "stop_sequences: must be a list of non-empty strings"),
])
def test_bad_messages_input_is_an_anthropic_error(server, claude, body, says):
    answer = http_request(server.url + "/v1/messages", "POST", json={"model": MODEL, **body},
                          headers={"x-api-key": KEY})
    assert answer.status == 400
    assert answer.json()["type"] == "error" and answer.json()["error"]["type"] == "invalid_request_error"
    assert says in answer.json()["error"]["message"]
    assert claude.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}]).content
    check_blocks_freed(server)


def test_a_wrong_key_is_an_authentication_error_in_each_apis_shape(server):
    with pytest.raises(anthropic.AuthenticationError) as refused:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert refused.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError) as refused:
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).responses.create(
            model=MODEL, input="Hi")
    assert refused.value.code == "invalid_api_key"
    # x-api-key is the key on every route (Anthropic's clients send it so).
    answer = http_request(server.url + "/v1/models", headers={"x-api-key": KEY})
    assert answer.status == 200
