"""Structured outputs through the real openai client against a live server: JSON schemas,
parse() with a Pydantic model, regex, choice, grammars; bad constraints get a 400 and lose
nothing. The default model (SmolLM2-135M-Instruct) writes the answers; the grammar decides
what it may write.
"""

from __future__ import annotations

import json
import re
import urllib.request

import jsonschema
import openai
import pydantic
import pytest

from pagoda.engine.config import EngineConfig
from pagoda.engine.sampling_params import SamplingParams, StructuredOutputsParams
from pagoda.server.testing import ServerThread

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PERSON = [{"role": "user", "content": "Describe a person as JSON."}]

SCHEMAS = {
    "nested object": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 24},
                       "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                                   "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False,
    },
    "enum and integer range": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]},
                       "age": {"type": "integer", "minimum": 18, "maximum": 99}},
        "required": ["color", "age"], "additionalProperties": False,
    },
    "array with bounds": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                "minItems": 2, "maxItems": 3}},
        "required": ["tags"], "additionalProperties": False,
    },
}


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async-scheduling"])
def server(request):
    config = EngineConfig(max_model_len=1024, async_scheduling=request.param)
    with ServerThread(config) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def assert_no_leaks(server):
    kv = server.call(lambda: server.engine.scheduler.kv_cache_manager)
    assert server.call(lambda: kv.get_num_free_blocks()) == kv.num_blocks


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_responses_validate(client, name):
    schema = SCHEMAS[name]
    out = client.chat.completions.create(
        model=MODEL, messages=PERSON, max_tokens=120, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}})
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), schema)


def test_parse_with_a_pydantic_model_and_sampling(client):
    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=30)
        country: str = pydantic.Field(max_length=30)
        # NOTE: bounded, as the grammar then bounds its digits: an unbounded integer lets a
        # sampled stream write digits until max_tokens (seed 3 did, once logits were float32).
        population: int = pydantic.Field(ge=0, le=100_000_000)

    out = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Tell me about Paris as JSON."}], max_tokens=120,
        temperature=0.8, seed=3, n=2, response_format=City)
    assert len(out.choices) == 2
    for choice in out.choices:
        assert isinstance(choice.message.parsed, City), choice.message.content


def test_regex_choice_grammar_and_json_object(client, server):
    phone = client.completions.create(model=MODEL, prompt="Call me at", max_tokens=20, temperature=0,
                                      extra_body={"structured_outputs": {"regex": r" [0-9]{3}-[0-9]{4}"}})
    assert re.fullmatch(r" [0-9]{3}-[0-9]{4}", phone.choices[0].text), phone.choices[0].text
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=10, temperature=0,
        extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert answer.choices[0].message.content in ("yes", "no", "maybe")
    counted = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to three."}], max_tokens=20, temperature=0,
        extra_body={"structured_outputs": {"grammar": 'start: NUM ", " NUM ", " NUM\nNUM: /[1-9]/'}})
    assert re.fullmatch(r"[1-9], [1-9], [1-9]", counted.choices[0].message.content), counted.choices[0].message.content
    assert counted.choices[0].finish_reason == "stop"
    anything = client.chat.completions.create(model=MODEL, messages=PERSON, max_tokens=100, temperature=0,
                                              response_format={"type": "json_object"})
    # NOTE: an open-ended object: the 135M model may still be writing it (or looping in it)
    # at max_tokens, depending on its greedy path, which bfloat16 rounding moves; a whole
    # one must parse. (The schema tests above bound their objects and always finish.)
    content, finish = anything.choices[0].message.content, anything.choices[0].finish_reason
    assert content.startswith("{") and finish in ("stop", "length")
    if finish == "stop":
        assert isinstance(json.loads(content), dict)
    assert_no_leaks(server)


def test_streamed_json_adds_up_to_the_whole(client):
    schema = SCHEMAS["enum and integer range"]
    kwargs = dict(model=MODEL, messages=PERSON, max_tokens=60, temperature=0,
                  response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
              if c.choices]
    assert "".join(pieces) == whole
    jsonschema.validate(json.loads(whole), schema)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "start: @@@"}}, "structured_outputs"),
    ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "[^\\s\\S]"}}, "structured_outputs"),  # allows no output at all
    # A broken tool schema is refused whatever the tool_choice, not only where the grammar forces the call.
    *[({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
        "tool_choice": choice}, "tools[0].function.parameters")
      for choice in ("auto", "required", "none", {"type": "function", "function": {"name": "f"}})],
])
def test_bad_constraints_get_a_400_naming_the_field_and_lose_nothing(client, server, body, param):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=PERSON, max_tokens=5, extra_body=body)
    assert error.value.status_code == 400
    assert error.value.body["param"] in (param, "guided_regex", "response_format"), error.value.body
    assert error.value.body["code"] == "invalid_structured_outputs"
    ok = client.chat.completions.create(model=MODEL, messages=PERSON, max_tokens=3)
    assert ok.choices[0].finish_reason in ("stop", "length")
    assert_no_leaks(server)


def test_a_grammar_that_fails_while_generating_ends_with_an_error_and_loses_nothing(client, server):
    # NOTE: llguidance compiles "a{1000000}" but gives up once it must build the lexer's states.
    for stream in (False, True):
        # NOTE: special tokens kept in the text: the token the grammar rejected must not show.
        response = client.chat.completions.create(model=MODEL, messages=PERSON, max_tokens=20, stream=stream,
                                                  extra_body={"structured_outputs": {"regex": "a{1000000}"},
                                                              "skip_special_tokens": False})
        chunks = list(response) if stream else None
        choice = chunks[-1].choices[0] if stream else response.choices[0]
        assert choice.finish_reason == "error"
        assert choice.model_extra["stop_reason"].startswith("the grammar failed: "), choice
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) if stream \
            else choice.message.content or ""
        assert "<|" not in text, text
    ok = client.chat.completions.create(model=MODEL, messages=PERSON, max_tokens=3)
    assert ok.choices[0].finish_reason in ("stop", "length")
    assert_no_leaks(server)


def test_structured_requests_and_compile_time_are_counted(client, server):
    client.chat.completions.create(model=MODEL, messages=PERSON, max_tokens=30, temperature=0,
                                   extra_body={"guided_regex": "[a-z]{3,8}"})
    with urllib.request.urlopen(server.url + "/metrics") as response:
        metrics = response.read().decode()
    requests = float(re.search(r'^pagoda:structured_output_requests_total\{[^}]*\} (\S+)', metrics, re.M).group(1))
    compiles = float(re.search(r'^pagoda:grammar_compiles_total\{[^}]*\} (\S+)', metrics, re.M).group(1))
    seconds = float(re.search(r'^pagoda:grammar_compile_seconds_total\{[^}]*\} (\S+)', metrics, re.M).group(1))
    assert requests >= 1 and compiles >= 1 and seconds > 0


def test_offline_llm_takes_structured_outputs_with_preemption(tmp_path):
    from pagoda import LLM

    schema = SCHEMAS["nested object"]
    params = SamplingParams(temperature=0.7, seed=5, max_tokens=100,
                            structured_outputs=StructuredOutputsParams(json=schema))
    conversations = [[{"role": "user", "content": f"Describe person number {i} and where they live as JSON."}]
                     for i in range(8)]
    # NOTE: a cache this small preempts (recompute); the matchers keep what was accepted.
    with LLM(max_model_len=256, num_kv_blocks=24, max_num_seqs=8, preemption_mode="recompute") as llm:
        outputs = llm.chat(conversations, params)
        assert llm.engine.scheduler.stats.num_preemptions > 0
    for out in outputs:
        jsonschema.validate(json.loads(out.outputs[0].text), schema)


def test_a_constrained_chat_without_max_tokens_gets_a_bounded_default():
    from pagoda.server.config import ServerConfig
    from pagoda.server.protocol import STRUCTURED_MAX_TOKENS, parse_chat

    def max_tokens(config=ServerConfig(), **body):
        return parse_chat({"messages": PERSON, **body}, config).params.max_tokens

    assert max_tokens() is None  # plain chat: the rest of the context
    assert max_tokens(response_format={"type": "json_object"}) == STRUCTURED_MAX_TOKENS
    assert max_tokens(response_format={"type": "json_object"}, max_tokens=9000) == 9000  # asked for: kept
    assert max_tokens(ServerConfig(max_tokens_limit=100), response_format={"type": "json_object"}) == 100
