"""The front door with the real server on a tiny model: prompts too long for the context
refused before tokenizing, limits on sequences and tokens per request and per client, CORS,
stream_options OpenAI may add, chat-template errors that echo no internals, and an empty API
key refused at start. Each refusal is followed by a request that succeeds."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import openai
import orjson
import pytest

from pagoda.cli.main import main
from pagoda.engine.config import EngineConfig
from pagoda.server.config import ServerConfig
from pagoda.server.testing import ServerThread, http_request

HUGE = "lorem ipsum " * 650_000  # 7.8 MB


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    engine = EngineConfig(model=str(tiny_llama_dir), dtype="float32", enforce_eager=True, max_model_len=256,
                          num_kv_blocks=256)
    config = ServerConfig(served_model_names=["tiny"], max_n=16, max_sequences_per_request=8, max_tokens_per_request=1500,
                          max_sequences_per_client=10, allowed_origins=["https://app.example"],
                          client_header="X-Client", max_body_bytes=16 << 20)
    with ServerThread(engine, config) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def still_serves(server, client) -> None:
    ok = client.completions.create(model="tiny", prompt="Hello", max_tokens=3)
    assert ok.choices[0].finish_reason in ("stop", "length")
    kv = server.call(lambda: server.engine.scheduler.kv_cache_manager)
    assert server.call(lambda: kv.get_num_free_blocks()) == kv.num_blocks


def test_a_prompt_too_long_for_any_tokenization_is_refused_before_the_tokenizer(server, client):
    limits = server.state.limits
    assert limits.max_prompt_chars < len(HUGE)
    results = {}

    def small() -> None:  # a concurrent request is not held up behind the huge one's tokenizing
        start = time.perf_counter()
        client.completions.create(model="tiny", prompt="Hi", max_tokens=2)
        results["small"] = time.perf_counter() - start

    thread = threading.Thread(target=small)
    thread.start()
    for call in (lambda: client.completions.create(model="tiny", prompt=HUGE, max_tokens=2),
                 lambda: client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": HUGE}])):
        with pytest.raises(openai.BadRequestError) as error:
            call()
        assert error.value.body["code"] == "context_length_exceeded" and "characters" in error.value.body["message"]
    thread.join()
    assert "small" in results
    response = http_request(server.url + "/tokenize", "POST", json={"prompt": HUGE})
    assert response.status == 400 and response.json()["error"]["param"] == "prompt"
    response = http_request(server.url + "/detokenize", "POST", json={"tokens": [5] * 300})
    assert response.status == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    still_serves(server, client)


@pytest.mark.parametrize("kwargs, code, param", [
    (dict(prompt=["a", "b"], n=5), "too_many_sequences", "n"),  # 10 sequences > 8
    (dict(prompt="Hello", n=8, max_tokens=200), "too_many_tokens", "max_tokens"),  # 8 x (2 + 200) > 1500
])
def test_requests_over_the_per_request_limits_get_a_400(server, client, kwargs, code, param):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="tiny", **kwargs)
    assert (error.value.body["code"], error.value.body["param"]) == (code, param)
    still_serves(server, client)


def test_a_client_past_its_sequences_in_flight_gets_429_and_others_do_not(server, client):
    hog = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                        default_headers={"X-Client": "hog"})
    stream = hog.completions.create(model="tiny", prompt="Once", n=8, max_tokens=150, stream=True,
                                    extra_body={"ignore_eos": True})
    next(iter(stream))  # its 8 sequences are in flight
    with pytest.raises(openai.RateLimitError) as error:
        hog.completions.create(model="tiny", prompt="Again", n=4, max_tokens=4)  # 8 + 4 > 10
    assert error.value.response.headers["Retry-After"] == "1"
    assert "--max-sequences-per-client" in error.value.body["message"]  # the flag that lifts it
    ok = client.completions.create(model="tiny", prompt="Hello", max_tokens=3)  # another client is not affected
    assert ok.choices[0].finish_reason in ("stop", "length")
    stream.close()  # the hog leaves: its sequences are aborted and their blocks freed
    kv = server.call(lambda: server.engine.scheduler.kv_cache_manager)
    for _ in range(100):
        if server.call(lambda: kv.get_num_free_blocks()) == kv.num_blocks:
            break
        time.sleep(0.1)
    still_serves(server, client)


def test_cors_preflight_needs_no_key_and_answers_carry_the_headers(server):
    origin = {"Origin": "https://app.example"}
    preflight = http_request(server.url + "/v1/chat/completions", "OPTIONS", headers={
        **origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"})
    assert preflight.status == 204
    assert preflight.headers["Access-Control-Allow-Origin"] == "https://app.example"
    assert "POST" in preflight.headers["Access-Control-Allow-Methods"]
    assert preflight.headers["Access-Control-Allow-Headers"] == "authorization"
    models = http_request(server.url + "/v1/models", headers=origin)
    assert models.status == 200 and models.headers["Access-Control-Allow-Origin"] == "https://app.example"
    error = http_request(server.url + "/v1/models/missing", headers=origin)
    assert error.status == 404 and error.headers["Access-Control-Allow-Origin"] == "https://app.example"
    other = http_request(server.url + "/v1/models", "OPTIONS", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "GET"})
    assert other.status == 403 and "Access-Control-Allow-Origin" not in other.headers


def test_stream_options_openai_may_add_are_ignored(server, client):
    chunks = list(client.completions.create(model="tiny", prompt="Hi", max_tokens=2, stream=True,
                                            stream_options={"include_usage": True, "include_obfuscation": False}))
    assert chunks[-1].usage.completion_tokens == 2


def test_a_chat_template_failure_echoes_no_python_internals(server, client):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                       extra_body={"chat_template_kwargs": {"tokenize": True}})
    message = error.value.body["message"]
    assert error.value.body["param"] == "messages" and "got multiple values" not in message
    still_serves(server, client)


def test_version_answers_at_once(capsys):
    from importlib import metadata

    for argv in (["--version"], ["--version", "serve"]):
        with pytest.raises(SystemExit) if argv != ["--version"] else contextlib.nullcontext():
            assert main(argv) == 0
        assert capsys.readouterr().out.strip() == f"pagoda {metadata.version('pagoda')}"


def test_help_builds_no_parser_that_loads_torch():
    # NOTE: torch takes seconds to import; `pagoda --help` and `pagoda serve --help` need none of it.
    import subprocess
    import sys

    code = ("import sys\nfrom pagoda.cli.main import build_parser\n"
            "for command in (None, 'serve', 'generate', 'simulate'):\n"
            "    build_parser(command).format_help()\nprint('torch' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "False", result.stdout + result.stderr


def test_an_empty_api_key_is_refused_at_start(capsys, monkeypatch):
    assert main(["serve", "--api-key", ""]) == 2
    assert "--api-key is empty" in capsys.readouterr().err
    monkeypatch.setenv("PAGODA_API_KEY", "  ")
    assert main(["serve"]) == 2
    assert "PAGODA_API_KEY is empty" in capsys.readouterr().err


@pytest.fixture(scope="module")
def strict_server(tiny_llama_dir):
    engine = EngineConfig(model=str(tiny_llama_dir), dtype="float32", enforce_eager=True, max_model_len=256,
                          num_kv_blocks=64)
    config = ServerConfig(header_timeout=1.0, body_timeout=1.0, max_connections=4)
    with ServerThread(engine, config) as server:
        yield server


def raw_connection(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def read_all(sock: socket.socket) -> bytes:
    """One answer: until the connection closes, or the body its Content-Length announces is in."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
        head, sep, body = data.partition(b"\r\n\r\n")
        length = [line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")]
        if sep and length and len(body) >= int(length[0].split(b":")[1]):
            break
    return data


def test_aiohttps_own_errors_come_as_json_that_echoes_nothing(strict_server):
    with raw_connection(strict_server) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Secret: " + b"s3cr3t" * 2000 + b"\r\n\r\n")
        answer = read_all(sock)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0].endswith(b" 400 Bad Request") and b"application/json" in head
    assert orjson.loads(body)["error"]["code"] == "invalid_http_request" and b"s3cr3t" not in answer


def test_slow_headers_and_slow_bodies_are_cut_off(strict_server):
    with raw_connection(strict_server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        start = time.monotonic()
        with pytest.raises((BrokenPipeError, ConnectionResetError)):
            for _ in range(40):  # a header line every 0.25 s, never the end of the headers
                time.sleep(0.25)
                sock.sendall(b"X-Slow: 1\r\n")
        assert time.monotonic() - start < 5  # closed after the 1 s header timeout, not after 10 s of trickle
    with raw_connection(strict_server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\"")
        answer = read_all(sock)
    assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer


def test_connections_past_the_cap_get_a_503_and_are_closed(strict_server):
    held = [raw_connection(strict_server) for _ in range(4)]
    try:
        time.sleep(0.2)
        with raw_connection(strict_server) as extra:
            answer = read_all(extra)
        assert answer.startswith(b"HTTP/1.1 503") and b"too_many_connections" in answer
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.2)
    assert http_request(strict_server.url + "/health").status == 200
