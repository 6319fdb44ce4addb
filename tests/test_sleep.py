"""vLLM's sleep mode: ``POST /sleep`` stops the worker (its memory freed), requests meanwhile get
``503 engine_sleeping`` while /health stays up, ``POST /wake_up`` starts a new worker that answers
as the old one did; sleeping with requests in the engine is refused; offline ``LLM.sleep()``."""

from __future__ import annotations

import threading

import pytest

from pagoda import LLM, SamplingParams
from pagoda.engine.exceptions import EngineSleepingError
from pagoda.server.testing import http_request
from helpers import tiny_server

BODY = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with tiny_server(tiny_llama_dir) as server:
        yield server


def post(server, path, body=None):
    return http_request(server.url + path, "POST", json=body if body is not None else {})


def test_sleep_stops_the_worker_and_wake_up_answers_as_before(server):
    before = post(server, "/v1/completions", BODY).json()["choices"][0]["text"]
    old_pid = server.engine.core.worker.pid
    assert http_request(server.url + "/is_sleeping").json() == {"is_sleeping": False}
    assert post(server, "/sleep?level=2").status == 200
    assert http_request(server.url + "/is_sleeping").json() == {"is_sleeping": True}
    assert not server.engine.core.worker.is_alive()
    refused = post(server, "/v1/completions", BODY)
    assert refused.status == 503 and refused.json()["error"]["code"] == "engine_sleeping"
    assert http_request(server.url + "/health").status == 200
    assert post(server, "/sleep?level=1").status == 200  # asleep already: nothing to do
    assert post(server, "/wake_up").status == 200
    assert server.engine.core.worker.pid != old_pid and server.engine.core.worker.is_alive()
    assert http_request(server.url + "/is_sleeping").json() == {"is_sleeping": False}
    assert post(server, "/v1/completions", BODY).json()["choices"][0]["text"] == before
    assert post(server, "/wake_up").status == 200  # awake already


def test_sleep_with_requests_in_the_engine_is_refused_and_bad_levels_too(server):
    assert post(server, "/sleep?level=3").status == 400
    long = {**BODY, "max_tokens": 100, "ignore_eos": True}
    answers = []
    thread = threading.Thread(target=lambda: answers.append(post(server, "/v1/completions", long)))
    thread.start()
    import time

    deadline = time.time() + 10
    while server.engine.scheduler.num_running == 0 and time.time() < deadline:
        time.sleep(0.01)
    busy = post(server, "/sleep")
    thread.join(60)
    assert busy.status == 409 and busy.json()["error"]["code"] == "engine_busy"
    assert answers[0].status == 200 and not server.engine.is_sleeping


def test_offline_sleep_and_wake_up(tiny_llama_dir):
    params = SamplingParams(temperature=0, max_tokens=6)
    with LLM(str(tiny_llama_dir), dtype="float32", enforce_eager=True, max_model_len=64) as llm:
        before = llm.generate(["Hello"], params)[0].outputs[0].token_ids
        llm.sleep(1)
        with pytest.raises(EngineSleepingError):
            llm.generate(["Hello"], params)
        llm.wake_up()
        assert llm.generate(["Hello"], params)[0].outputs[0].token_ids == before
