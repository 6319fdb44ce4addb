"""Cancelling a running request by the id its client saw: the request ends with finish_reason
"abort" (its stream gets the chunk and its end), its KV blocks are freed, and the requests beside
it run on."""

from __future__ import annotations

import threading

import openai
import pytest

from pagoda.server.testing import http_request
from helpers import tiny_server

LONG = dict(max_tokens=400, extra_body={"ignore_eos": True}, temperature=0)


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with tiny_server(tiny_llama_dir, max_model_len=512, num_kv_blocks=128) as server:
        yield server


def test_a_cancelled_stream_ends_with_abort_its_kv_freed_while_another_runs_on(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    other: dict = {}

    def run_other():
        out = client.completions.create(model=model, prompt="another request", **LONG)
        other["finish"], other["tokens"] = out.choices[0].finish_reason, out.usage.completion_tokens

    thread = threading.Thread(target=run_other)
    thread.start()
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "go on"}],
                                            stream=True, **LONG)
    chunks = iter(stream)
    first = next(chunks)
    answer = http_request(server.url + f"/v1/requests/{first.id}/cancel", "POST")
    assert answer.status == 200 and answer.json()["status"] == "cancelled"
    rest = list(chunks)
    finishes = [c.choices[0].finish_reason for c in rest if c.choices and c.choices[0].finish_reason]
    assert finishes == ["abort"]
    assert sum(1 for c in rest if c.choices and c.choices[0].delta.content) < 390  # cut short
    thread.join(timeout=120)
    assert other == {"finish": "length", "tokens": 400}
    kv = server.call(lambda: server.engine.scheduler.kv_cache_manager)
    assert server.call(kv.get_num_free_blocks) == kv.num_blocks
    metrics = http_request(server.url + "/metrics").text
    for name in ("pagoda:num_requests_running", "pagoda:kv_cache_usage_perc"):
        values = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(name + "{")]
        assert values == [0.0], (name, values)  # the metrics are back to zero
    # Ended requests are no longer known; neither is a made-up id.
    for request_id in (first.id, "chatcmpl-nowhere"):
        gone = http_request(server.url + f"/v1/requests/{request_id}/cancel", "POST")
        assert gone.status == 404 and gone.json()["error"]["code"] == "request_not_found"


def test_a_background_response_is_fetched_by_its_id_and_cancelled_by_it(server):
    import time

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id

    def wait(response_id, statuses):
        for _ in range(600):
            response = client.responses.retrieve(response_id)
            if response.status in statuses:
                return response
            time.sleep(0.05)
        raise AssertionError(f"{response_id} stayed {response.status}")

    short = client.responses.create(model=model, input="hello", max_output_tokens=5, background=True)
    assert short.background and short.status == "in_progress" and not short.output
    done = wait(short.id, ("completed", "incomplete"))
    assert done.usage.output_tokens == 5 and done.output[0].type == "message"
    long = client.responses.create(model=model, input="go on", max_output_tokens=400, temperature=0,
                                   background=True)
    assert client.responses.cancel(long.id).status == "cancelled"
    ended = wait(long.id, ("cancelled",))
    assert ended.usage.output_tokens < 400
    kv = server.call(lambda: server.engine.scheduler.kv_cache_manager)
    assert server.call(kv.get_num_free_blocks) == kv.num_blocks
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=model, input="x", background=True, store=False)
