"""The OpenAI-compatible server on a tiny model, driven by the official openai client.

One real server (in a thread, on 127.0.0.1) serves the whole module; its tracer provider
keeps spans in memory so a test can read them.
"""

from __future__ import annotations

import asyncio
import time

import openai
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from prometheus_client.parser import text_string_to_metric_families

from pagoda.engine.config import EngineConfig
from pagoda.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagoda.server.config import ServerConfig
from pagoda.server.tracing import RequestSpan, build_tracer_provider
from pagoda.server.testing import HTTPResult, ServerThread, http_request

API_KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me about paging."}]
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def exporter():
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def server(tiny_llama_dir, exporter):
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    engine_config = EngineConfig(model=str(tiny_llama_dir), enforce_eager=True, dtype="float32", max_model_len=256, block_size=8,
                                 num_kv_blocks=256)
    with ServerThread(engine_config, ServerConfig(api_key=API_KEY), tracer_provider=provider) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def http(server, method: str, path: str, **kwargs) -> HTTPResult:
    headers = {**AUTH, **kwargs.pop("headers", {})}
    return http_request(server.url + path, method, headers=headers, **kwargs)


def scrape(server) -> dict[tuple[str, tuple], float]:
    """/metrics as {(sample name, sorted labels): value}, parsed by prometheus-client's parser."""
    text = http(server, "GET", "/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def metric(samples, name: str, **labels) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


def wait_idle(server, timeout: float = 20.0) -> None:
    deadline = time.time() + timeout
    while server.call(lambda: server.engine.scheduler.has_unfinished_requests()):
        assert time.time() < deadline, "the engine still has requests"
        time.sleep(0.05)


# -- small endpoints ------------------------------------------------------------------------


def test_models_health_version_tokenize(server, client, model, tiny_llama_dir):
    models = client.models.list().data
    assert [m.id for m in models] == [str(tiny_llama_dir)] and models[0].object == "model"
    assert client.models.retrieve(model).id == model
    assert http_request(server.url + "/health").json() == {"status": "ok"}  # no key needed
    assert http(server, "GET", "/version").json()["version"]
    tokens = http(server, "POST", "/tokenize", json={"prompt": "Hello there"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == 256
    assert http(server, "POST", "/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "Hello there"}
    chat = http(server, "POST", "/tokenize", json={"messages": MESSAGES}).json()
    assert chat["count"] > tokens["count"]


# -- completions and chat -------------------------------------------------------------------


def test_completion_stream_equals_non_stream_and_usage(server, client, model):
    prompt = "The history of paged memory"
    num_prompt = http(server, "POST", "/tokenize", json={"prompt": prompt}).json()["count"]
    whole = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, extra_body=IGNORE_EOS)
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    assert whole.choices[0].finish_reason == "length" and whole.choices[0].text
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == (
        num_prompt, 12, num_prompt + 12)
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body=IGNORE_EOS))
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 12
    assert usage_chunk.usage.prompt_tokens == num_prompt
    assert all(c.usage is None for c in text_chunks)


def test_chat_stream_equals_non_stream_and_usage(server, client, model):
    num_prompt = http(server, "POST", "/tokenize", json={"messages": MESSAGES}).json()["count"]
    whole = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=10, temperature=0,
                                           extra_body=IGNORE_EOS)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (num_prompt, 10)
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=10,
                                                 temperature=0, stream=True, extra_body=IGNORE_EOS))
    assert chunks[0].choices[0].delta.role == "assistant" and not chunks[0].choices[0].delta.content
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_prompt_forms_and_choice_order(server, client, model):
    ids = http(server, "POST", "/tokenize", json={"prompt": "Once upon a time"}).json()["tokens"]
    kwargs = dict(model=model, max_tokens=6, temperature=0, extra_body=IGNORE_EOS)
    by_text = client.completions.create(prompt="Once upon a time", **kwargs).choices[0].text
    assert client.completions.create(prompt=ids, **kwargs).choices[0].text == by_text
    many = client.completions.create(prompt=[ids, ids[:2]], **kwargs)
    assert [c.index for c in many.choices] == [0, 1] and many.choices[0].text == by_text
    texts = client.completions.create(prompt=["Once upon a time", "A"], n=2, **kwargs)
    assert [c.index for c in texts.choices] == [0, 1, 2, 3]
    assert texts.choices[0].text == texts.choices[1].text == by_text  # greedy: both samples agree
    assert texts.usage.completion_tokens == 24
    echoed = client.completions.create(prompt="Once upon a time", echo=True, **kwargs).choices[0].text
    assert echoed == "Once upon a time" + by_text


def test_n_samples_streamed_and_not(client, model):
    params = dict(model=model, max_tokens=8, temperature=1.0, seed=11, n=3, extra_body=IGNORE_EOS)
    whole = client.chat.completions.create(messages=MESSAGES, **params)
    assert [c.index for c in whole.choices] == [0, 1, 2] and whole.usage.completion_tokens == 24
    assert len({c.message.content for c in whole.choices}) > 1
    chunks = list(client.chat.completions.create(messages=MESSAGES, stream=True, **params))
    texts, finished = {0: "", 1: "", 2: ""}, {}
    for chunk in chunks:
        choice = chunk.choices[0]
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            assert choice.index not in finished
            finished[choice.index] = choice.finish_reason
    assert finished == {0: "length", 1: "length", 2: "length"}
    assert texts == {c.index: c.message.content for c in whole.choices}  # seeded: same samples


def test_logprobs(client, model):
    out = client.completions.create(model=model, prompt="Hello", max_tokens=5, temperature=0, logprobs=3,
                                    extra_body=IGNORE_EOS).choices[0]
    lp = out.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == out.text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 4 and top[token] == pytest.approx(logprob)  # distinct ids may share a string
        assert logprob == pytest.approx(max(top.values()), abs=1e-5)  # greedy picks the top token
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=2, extra_body=IGNORE_EOS).choices[0]
    content = chat.logprobs.content
    assert len(content) == 4 and "".join(c.token for c in content) == chat.message.content
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-5)
               for c in content)
    streamed = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, temperature=0,
                                                   logprobs=True, top_logprobs=2, stream=True,
                                                   extra_body={**IGNORE_EOS, "stream_options": {
                                                       "include_usage": True, "continuous_usage_stats": True}}))
    usages = [chunk.usage.completion_tokens for chunk in streamed]
    assert usages == sorted(usages) and usages[-1] == 4  # vLLM's continuous usage: in every chunk
    tokens = [c.token for chunk in streamed if chunk.choices and chunk.choices[0].logprobs
              for c in chunk.choices[0].logprobs.content]
    assert tokens == [c.token for c in content]


def test_stop_strings(client, model):
    kwargs = dict(model=model, prompt="The weather today", max_tokens=20, temperature=0, extra_body=IGNORE_EOS)
    full = client.completions.create(**kwargs).choices[0].text
    stop = full[6:9]
    assert stop.strip(), "pick a stop string that is not blank"
    cut = client.completions.create(stop=[stop, "never-there"], **kwargs).choices[0]
    assert cut.text == full[: full.index(stop)] and cut.finish_reason == "stop"
    assert cut.model_extra["stop_reason"] == stop
    streamed = list(client.completions.create(stop=stop, stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in streamed) == cut.text
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_prefix_cache_hits_are_reported_and_cache_salt_isolates(server, client, model):
    prompt = "A shared system prompt that is long enough to fill several KV blocks of eight tokens each. " * 2
    kwargs = dict(model=model, prompt=prompt, max_tokens=2, temperature=0)
    client.completions.create(**kwargs, extra_body={"priority": 1})
    hits_before = metric(scrape(server), "pagoda:prefix_cache_hits_total")
    again = client.completions.create(**kwargs)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 8 <= cached < again.usage.prompt_tokens
    assert metric(scrape(server), "pagoda:prefix_cache_hits_total") - hits_before == cached
    salted = client.completions.create(**kwargs, extra_body={"cache_salt": "tenant-a"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0


# -- load and disconnects ---------------------------------------------------------------------


def test_32_concurrent_streams_complete_and_are_batched(server, model):
    num_clients, num_tokens = 32, 16
    steps_before = server.call(lambda: server.engine.scheduler.stats.num_steps)

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
        stream = await client.completions.create(
            model=model, prompt=f"Request number {i} says", max_tokens=num_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body=IGNORE_EOS)
        text, usage, finish = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
        assert finish == "length"
        return text, usage.completion_tokens

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(num_clients)))

    results = asyncio.run(main())
    assert [n for _, n in results] == [num_tokens] * num_clients and all(text for text, _ in results)
    num_steps = server.call(lambda: server.engine.scheduler.stats.num_steps) - steps_before
    # Unbatched, the streams would need 32 * 16 = 512 steps.
    assert num_steps <= num_clients * num_tokens // 4, num_steps


def test_client_disconnect_aborts_request_and_frees_blocks(server, client, model, caplog):
    wait_idle(server)
    aborts_before = metric(scrape(server), "pagoda:request_success_total", finished_reason="abort")
    stream = client.completions.create(model=model, prompt="Count forever:", max_tokens=200, temperature=0,
                                       stream=True, extra_body=IGNORE_EOS)
    received = 0
    for chunk in stream:
        received += 1
        if received == 3:
            break
    assert server.call(lambda: server.engine.scheduler.num_running) == 1
    stream.close()  # drops the connection mid-stream
    wait_idle(server)
    kv = server.engine.scheduler.kv_cache_manager
    server.call(kv.check_invariants)
    assert server.call(kv.get_num_free_blocks) == kv.num_blocks
    generated = server.call(lambda: server.engine.scheduler.stats.num_generation_tokens)
    time.sleep(0.3)
    assert server.call(lambda: server.engine.scheduler.stats.num_generation_tokens) == generated  # nothing runs
    assert metric(scrape(server), "pagoda:request_success_total", finished_reason="abort") == aborts_before + 1
    left = [r.getMessage() for r in caplog.records if "ended by its client" in r.getMessage()]
    assert len(left) == 1 and "KV blocks freed" in left[0], left  # one line says who left, when


# -- metrics and tracing --------------------------------------------------------------------


def test_prompt_tokens_count_every_prompt_token_and_split_cached_from_computed(server, client, model):
    # NOTE: vLLM's meaning: prompt_tokens counts the whole prompt, prefix-cache hits too;
    # prompt_tokens_by_source splits it (a dashboard built for vLLM reads both right).
    prompt = "A prompt long enough to fill a few blocks of the prefix cache, " * 3
    first = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    before = scrape(server)
    again = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    after = scrape(server)

    def delta(name, **labels):
        return metric(after, "pagoda:" + name, **labels) - metric(before, "pagoda:" + name, **labels)

    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and again.usage.prompt_tokens == first.usage.prompt_tokens
    assert delta("prompt_tokens_total") == again.usage.prompt_tokens
    assert delta("prompt_tokens_cached_total") == cached
    assert delta("prompt_tokens_by_source_total", source="local_cache_hit") == cached
    assert delta("prompt_tokens_by_source_total", source="local_compute") == again.usage.prompt_tokens - cached
    assert delta("prefill_tokens_computed_total") == again.usage.prompt_tokens - cached


def test_metrics_parse_and_move_with_traffic(server, client, model):
    before = scrape(server)
    names = {name for name, _ in before}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "prompt_tokens_total", "generation_tokens_total",
                 "num_preemptions_total", "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count", "request_queue_time_seconds_count",
                 "request_prefill_time_seconds_count", "request_decode_time_seconds_count"):
        assert "pagoda:" + name in names, name
    out = client.completions.create(model=model, prompt="Metrics move", max_tokens=7, temperature=0,
                                    extra_body=IGNORE_EOS)
    after = scrape(server)

    def delta(name, **labels):
        return metric(after, "pagoda:" + name, **labels) - metric(before, "pagoda:" + name, **labels)

    assert delta("prompt_tokens_total") == out.usage.prompt_tokens
    assert delta("generation_tokens_total") == 7
    assert delta("request_success_total", finished_reason="length") == 1
    assert delta("inter_token_latency_seconds_count") == 6
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds"):
        assert delta(name + "_count") == 1, name
        assert delta(name + "_sum") >= 0, name
    assert metric(after, "pagoda:num_requests_running") == 0 and metric(after, "pagoda:kv_cache_usage_perc") == 0
    ready = server.engine.worker.ready
    assert metric(after, "pagoda:engine_info", attention_backend=ready.attention_backend, device="cpu",
                  dtype="float32", compiled="false") == 1
    assert metric(after, "pagoda:worker_restarts_total") == 0


def test_request_span_has_gen_ai_attributes_and_events(server, client, model, exporter):
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    out = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=5, temperature=0.5, top_p=0.9, n=2, seed=3,
        extra_body=IGNORE_EOS, extra_headers={"traceparent": f"00-{trace_id}-{parent_id}-01"})
    spans = [s for s in exporter.get_finished_spans() if s.context.trace_id == int(trace_id, 16)]
    assert len(spans) == 1
    span = spans[0]
    assert span.kind == SpanKind.SERVER and span.parent.span_id == int(parent_id, 16)
    attrs = span.attributes
    assert attrs["gen_ai.request.id"] == out.id and attrs["gen_ai.request.model"] == model
    assert (attrs["gen_ai.request.max_tokens"], attrs["gen_ai.request.temperature"], attrs["gen_ai.request.top_p"],
            attrs["gen_ai.request.n"]) == (5, 0.5, 0.9, 2)
    assert attrs["gen_ai.usage.prompt_tokens"] == out.usage.prompt_tokens
    assert attrs["gen_ai.usage.completion_tokens"] == out.usage.completion_tokens == 10
    latency = {k: attrs[f"gen_ai.latency.{k}"] for k in ("time_in_queue", "time_to_first_token", "e2e")}
    assert 0 <= latency["time_in_queue"] <= latency["time_to_first_token"] <= latency["e2e"]
    assert attrs["http.response.status_code"] == 200
    events = [e.name for e in span.events]
    assert events[0] == "queued" and events[-1] == "finished"
    assert {"scheduled", "first_token"} <= set(events)
    assert all(span.start_time <= e.timestamp <= span.end_time for e in span.events)


def test_tracing_is_configured_by_otel_variables_or_the_flag(monkeypatch):
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                 "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    assert build_tracer_provider() is None  # off by default
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    provider = build_tracer_provider()
    assert provider is not None and provider.resource.attributes["service.name"] == "pagoda"
    provider.shutdown()
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert build_tracer_provider() is None
    monkeypatch.delenv("OTEL_SDK_DISABLED")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert build_tracer_provider() is None
    try:
        import opentelemetry.exporter.otlp.proto.grpc.trace_exporter  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="opentelemetry-exporter-otlp"):
            build_tracer_provider("http://127.0.0.1:4317")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
        monkeypatch.delenv("OTEL_TRACES_EXPORTER")
        assert build_tracer_provider() is None  # asked by the environment only: a warning
    else:
        provider = build_tracer_provider("http://127.0.0.1:4317")
        assert provider is not None
        provider.shutdown()


def test_span_records_every_engine_event_including_preemption():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    events = [("queued", 100.0), ("kv_load", 100.2), ("scheduled", 100.5), ("first_token", 101.0),
              ("preempted", 102.0), ("scheduled", 103.0), ("finished", 104.0)]
    timing = RequestMetrics(arrival_time=100.0, first_scheduled_time=100.5, first_token_time=101.0,
                            last_token_time=104.0, finished_time=104.0, num_preemptions=1, events=events,
                            num_cached_tokens=32)
    output = RequestOutput("req-1", "x", [1, 2, 3], [CompletionOutput(0, "abc", [4, 5], "length")], True, timing)
    span = RequestSpan(provider.get_tracer("test").start_span("chat", start_time=99_000_000_000))
    span.add_output(output, 2, ["length"])
    span.end(200)
    (finished,) = exporter.get_finished_spans()
    assert [(e.name, e.timestamp) for e in finished.events] == [(n, int(t * 1e9)) for n, t in events]
    attrs = finished.attributes
    assert (attrs["gen_ai.usage.prompt_tokens"], attrs["gen_ai.usage.completion_tokens"]) == (3, 2)
    assert attrs["pagoda.prefix_cache.cached_tokens"] == 32
    assert (attrs["gen_ai.latency.time_in_queue"], attrs["gen_ai.latency.time_to_first_token"],
            attrs["gen_ai.latency.e2e"]) == (0.5, 1.0, 4.0)
