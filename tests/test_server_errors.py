"""Every error the server sends: its status, OpenAI's error shape, and the server still serving.

The server here runs one request at a time (max_num_seqs 1) with a waiting queue of one,
so the overload case is deterministic. The test that kills the worker runs last.
"""

from __future__ import annotations

import http.client
import os
import signal
import threading
import time

import openai
import pytest

from pagoda.engine.config import EngineConfig
from pagoda.server.config import ServerConfig
from pagoda.server.testing import ServerThread, http_request

API_KEY = "sk-errors"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_BODY = 64 * 1024
USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    engine_config = EngineConfig(model=str(tiny_llama_dir), enforce_eager=True, dtype="float32", max_model_len=256,
                                 block_size=8, num_kv_blocks=256, max_num_seqs=1, max_worker_restarts=0)
    config = ServerConfig(api_key=API_KEY, max_body_bytes=MAX_BODY, max_waiting_requests=1, max_tokens_limit=250)
    with ServerThread(engine_config, config) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def completion(**fields):
    return {"prompt": "Hello", "max_tokens": 2, **fields}


def chat(**fields):
    return {"messages": USER, "max_tokens": 2, **fields}


C, CHAT = "/v1/completions", "/v1/chat/completions"
LONG = " hello" * 300  # well over max_model_len (256) tokens

# (case, method, path, body: dict | bytes | None, headers, status, param, code, words in the message)
CASES = [
    ("malformed JSON", "POST", C, b'{"prompt": "hi",', AUTH, 400, None, "invalid_json", "not valid JSON"),
    ("empty body", "POST", C, b"", AUTH, 400, None, "invalid_json", "empty"),
    ("body not an object", "POST", C, b"[1, 2]", AUTH, 400, None, None, "JSON object"),
    ("missing prompt", "POST", C, {"max_tokens": 2}, AUTH, 400, "prompt", None, "required"),
    ("prompt of a wrong type", "POST", C, completion(prompt=5), AUTH, 400, "prompt", None, "must be a string"),
    ("empty prompt", "POST", C, completion(prompt=""), AUTH, 400, "prompt", None, "empty"),
    ("token id out of vocab", "POST", C, completion(prompt=[1, 10**9]), AUTH, 400, "prompt", None, "49152"),
    ("negative temperature", "POST", C, completion(temperature=-0.5), AUTH, 400, "temperature", None, "[0, 2]"),
    ("temperature over OpenAI's 2", "POST", C, completion(temperature=3), AUTH, 400, "temperature", None, "[0, 2]"),
    ("temperature of 1e308", "POST", C, completion(temperature=1e308), AUTH, 400, "temperature", None, "[0, 2]"),
    ("stop_token_ids out of vocab", "POST", C, completion(stop_token_ids=[2, 10**6]), AUTH, 400, "stop_token_ids",
     None, "[0, 49152)"),
    ("top_p of 0", "POST", C, completion(top_p=0), AUTH, 400, "top_p", None, "(0, 1]"),
    ("max_tokens a string", "POST", C, completion(max_tokens="ten"), AUTH, 400, "max_tokens", None, "integer"),
    ("max_tokens of 0", "POST", C, completion(max_tokens=0), AUTH, 400, "max_tokens", None, ">= 1"),
    ("n over the limit", "POST", C, completion(n=129), AUTH, 400, "n", None, "[1, 128]"),
    ("logprobs over the limit", "POST", C, completion(logprobs=21), AUTH, 400, "logprobs", None, "[0, 20]"),
    ("too many stop strings", "POST", C, completion(stop=[f"s{i}" for i in range(17)]), AUTH, 400, "stop", None,
     "at most 16"),
    ("unknown field", "POST", C, completion(max_tokenz=3), AUTH, 400, "max_tokenz", "unrecognized_argument",
     "Unrecognized request argument"),
    ("prompt over the context", "POST", C, completion(prompt=LONG), AUTH, 400, "prompt", "context_length_exceeded",
     "maximum context length is 256 tokens"),
    ("max_tokens over the context", "POST", C, completion(prompt=" hello" * 10, max_tokens=250), AUTH, 400,
     "max_tokens", "context_length_exceeded", "maximum context length is 256 tokens"),
    ("max_tokens over the server limit", "POST", C, completion(max_tokens=251), AUTH, 400, "max_tokens",
     "max_tokens_limit_exceeded", "--max-tokens-limit"),
    ("frequency_penalty out of range", "POST", C, completion(frequency_penalty=3), AUTH, 400, "frequency_penalty",
     None, "[-2, 2]"),
    ("presence_penalty a string", "POST", C, completion(presence_penalty="x"), AUTH, 400, "presence_penalty", None,
     "number"),
    ("repetition_penalty of 0", "POST", C, completion(repetition_penalty=0), AUTH, 400, "repetition_penalty", None,
     "> 0"),
    ("min_p over 1", "POST", C, completion(min_p=1.5), AUTH, 400, "min_p", None, "[0, 1]"),
    ("top_k below -1", "POST", C, completion(top_k=-5), AUTH, 400, "top_k", None, "positive integer"),
    ("seed a string", "POST", C, completion(seed="abc"), AUTH, 400, "seed", None, "integer"),
    ("n of 0", "POST", C, completion(n=0), AUTH, 400, "n", None, "[1, 128]"),
    ("min_tokens over max_tokens", "POST", C, completion(min_tokens=5), AUTH, 400, "min_tokens", None,
     "max_tokens"),
    ("stream not a boolean", "POST", C, completion(stream="yes"), AUTH, 400, "stream", None, "boolean"),
    ("stop a number", "POST", C, completion(stop=5), AUTH, 400, "stop", None, "string"),
    ("stop_token_ids of strings", "POST", C, completion(stop_token_ids=["a"]), AUTH, 400, "stop_token_ids", None,
     "list of integers"),
    ("temperature a string", "POST", C, completion(temperature="hot"), AUTH, 400, "temperature", None, "number"),
    ("negative logprobs", "POST", C, completion(logprobs=-1), AUTH, 400, "logprobs", None, "[0, 20]"),
    ("prompt of mixed types", "POST", C, completion(prompt=[1, "a"]), AUTH, 400, "prompt", None, "prompt"),
    ("null body", "POST", C, b"null", AUTH, 400, None, None, "JSON object"),
    ("unknown model", "POST", C, completion(model="gpt-4"), AUTH, 404, "model", "model_not_found", "gpt-4"),
    ("stream_options without stream", "POST", C, completion(stream_options={"include_usage": True}), AUTH, 400,
     "stream_options", None, "stream"),
    ("best_of other than n", "POST", C, completion(best_of=3), AUTH, 400, "best_of", "unsupported_parameter", "n"),
    ("logit_bias out of range", "POST", C, completion(logit_bias={"1": 500}), AUTH, 400, "logit_bias", None,
     "[-100, 100]"),
    ("missing messages", "POST", CHAT, {"max_tokens": 2}, AUTH, 400, "messages", None, "required"),
    ("bad role", "POST", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), AUTH, 400, "messages[0].role",
     None, "must be one of"),
    ("image content", "POST", CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), AUTH, 400,
     "messages[0].content", None, "text only"),
    ("top_logprobs without logprobs", "POST", CHAT, chat(top_logprobs=2), AUTH, 400, "top_logprobs", None, "logprobs"),
    ("auto tools with a choice constraint", "POST", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                                               structured_outputs={"choice": ["a", "b"]}), AUTH, 400,
     "tool_choice", "invalid_structured_outputs", "combines with"),
    ("chat over the context", "POST", CHAT, chat(messages=[{"role": "user", "content": LONG}]), AUTH, 400,
     "messages", "context_length_exceeded", "256"),
    ("max_completion_tokens over the context", "POST", CHAT,
     chat(messages=[{"role": "user", "content": " hello" * 20}], max_completion_tokens=250), AUTH, 400,
     "max_completion_tokens", "context_length_exceeded", "256"),
    ("max_completion_tokens of 0", "POST", CHAT, chat(max_completion_tokens=0), AUTH, 400, "max_completion_tokens",
     None, ">= 1"),
    ("duplicate tool names", "POST", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}] * 2), AUTH,
     400, "tools[1].function.name", None, "repeats the name"),
    ("max_completion_tokens over the server limit", "POST", CHAT, chat(max_completion_tokens=300), AUTH, 400,
     "max_completion_tokens", "max_tokens_limit_exceeded", "at most 250"),
    ("empty messages", "POST", CHAT, chat(messages=[]), AUTH, 400, "messages", None, "messages"),
    ("messages not a list", "POST", CHAT, chat(messages="hi"), AUTH, 400, "messages", None, "list"),
    ("message without content", "POST", CHAT, chat(messages=[{"role": "user"}]), AUTH, 400, "messages[0].content",
     None, "content"),
    ("bad detokenize tokens", "POST", "/detokenize", {"tokens": ["a"]}, AUTH, 400, "tokens", None, "tokens"),
    ("missing API key", "POST", C, completion(), {}, 401, None, "invalid_api_key", "API key"),
    ("wrong API key", "POST", C, completion(), {"Authorization": "Bearer sk-wrong"}, 401, None, "invalid_api_key",
     "Incorrect API key"),
    ("missing API key on /v1/models", "GET", "/v1/models", None, {}, 401, None, "invalid_api_key", "API key"),
    ("missing API key on /metrics", "GET", "/metrics", None, {}, 401, None, "invalid_api_key", "API key"),
    ("wrong API key on /tokenize", "POST", "/tokenize", {"prompt": "x"}, {"Authorization": "Bearer x"}, 401, None,
     "invalid_api_key", "Incorrect"),
    ("body over the limit", "POST", C, completion(prompt="x" * (MAX_BODY + 10)), AUTH, 413, None,
     "request_too_large", str(MAX_BODY)),
    ("unknown route", "GET", "/v1/nothing", None, AUTH, 404, None, "not_found", "/v1/nothing"),
    ("wrong method", "GET", C, None, AUTH, 405, None, "method_not_allowed", "POST"),
]


def check_error_shape(result, status: int) -> dict:
    assert result.status == status, result.text
    assert result.headers["Content-Type"].startswith("application/json")
    error = result.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    assert isinstance(error["message"], str) and error["message"]
    return error


def check_still_serving(server) -> None:
    assert http_request(server.url + "/health").status == 200
    result = http_request(server.url + C, "POST", json=completion(max_tokens=1), headers=AUTH)
    assert result.status == 200 and result.json()["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize("case,method,path,body,headers,status,param,code,words", CASES, ids=[c[0] for c in CASES])
def test_error(server, case, method, path, body, headers, status, param, code, words):
    kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
    error = check_error_shape(http_request(server.url + path, method, headers=headers, **kwargs), status)
    assert error["param"] == param and error["code"] == code
    assert words in error["message"], error["message"]
    check_still_serving(server)


def test_chunked_body_over_the_limit(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    chunks = (b'{"prompt": "' + b"x" * 8192 for _ in range(MAX_BODY // 8192 + 2))
    conn.request("POST", C, body=chunks, headers={**AUTH, "Content-Type": "application/json"}, encode_chunked=True)
    response = conn.getresponse()
    body = response.read()
    conn.close()
    assert response.status == 413 and b'"code":"request_too_large"' in body
    check_still_serving(server)


def test_openai_client_raises_typed_errors(server, client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=client.models.list().data[0].id, prompt="Hi", temperature=-1)
    assert info.value.status_code == 400 and info.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=USER)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_full_waiting_queue_gets_503_with_retry_after(server, client):
    model = client.models.list().data[0].id
    running = client.completions.create(model=model, prompt="Long", max_tokens=200, stream=True,
                                        extra_body={"ignore_eos": True})
    next(iter(running))
    waiting_result = {}

    def waiting_request():
        waiting_result["out"] = client.completions.create(model=model, prompt="Wait", max_tokens=2)

    thread = threading.Thread(target=waiting_request)
    thread.start()
    deadline = time.time() + 20
    while server.call(lambda: server.engine.scheduler.num_waiting) < 1:
        assert time.time() < deadline
        time.sleep(0.02)
    result = http_request(server.url + C, "POST", json=completion(), headers=AUTH)
    error = check_error_shape(result, 503)
    assert error["code"] == "overloaded" and "--max-waiting-requests 1" in error["message"]
    assert result.headers["Retry-After"] == "1"
    assert http_request(server.url + "/health").status == 200
    running.close()
    thread.join(30)
    assert waiting_result["out"].usage.completion_tokens == 2
    check_still_serving(server)


def test_dead_worker_past_the_restart_budget_gives_503_on_health_and_generation(server):
    # NOTE: runs last in this module: it leaves the server without a worker (no restarts allowed).
    os.kill(server.engine.worker.pid, signal.SIGKILL)
    deadline = time.time() + 20
    while http_request(server.url + "/health").status != 503:
        assert time.time() < deadline, "/health did not notice the dead worker"
        time.sleep(0.05)
    assert check_error_shape(http_request(server.url + "/health"), 503)["code"] == "engine_dead"
    error = check_error_shape(http_request(server.url + C, "POST", json=completion(), headers=AUTH), 503)
    assert error["code"] == "engine_dead"
    assert http_request(server.url + "/v1/models", headers=AUTH).status == 200
