"""`pagoda serve` as a real process: CLI wiring, graceful shutdown, the README's default model."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import torch

from pagoda.engine.config import EngineConfig
from pagoda.engine.model_loader import resolve_model, resolve_model_dtype
from pagoda.server.config import ServerConfig
from pagoda.server.testing import ServerThread, http_request
from helpers import REPO, TINY_FLAGS, ServerProcess

pytestmark = pytest.mark.slow  # NOTE: `python -m pytest -m slow` runs it (CI runs both sets)

API_KEY = "sk-lifecycle"


class StreamReader(threading.Thread):
    """Reads one streaming completion in the background, recording how it ended."""

    def __init__(self, client: openai.OpenAI, model: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.started = threading.Event()
        self.stream = client.completions.create(model=model, prompt="Tell a long story:", max_tokens=max_tokens,
                                                temperature=0, stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True})
        self.finish_reason = self.usage = self.error = None

    def run(self) -> None:
        try:
            for chunk in self.stream:
                self.started.set()
                if chunk.choices and chunk.choices[0].finish_reason:
                    self.finish_reason = chunk.choices[0].finish_reason
                self.usage = chunk.usage or self.usage
        except Exception as exc:  # noqa: BLE001 - a stream cut by the shutdown timeout
            self.error = exc
        finally:
            self.started.set()


@pytest.fixture
def serve(tmp_path):
    servers = []

    def start(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> ServerProcess:
        server = ServerProcess(list(args), tmp_path / f"server{len(servers)}.log", env)
        servers.append(server)
        server.wait_ready(timeout)
        return server

    yield start
    for server in servers:
        server.close()


def test_sigterm_stops_listening_and_drains_in_flight_requests(serve, tiny_llama_dir):
    server = serve(str(tiny_llama_dir), *TINY_FLAGS, env={"PAGODA_API_KEY": API_KEY})
    client = server.client()
    model = client.models.list().data[0].id
    with pytest.raises(openai.AuthenticationError):
        server.client("wrong").models.list()
    answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert answer.choices[0].message.role == "assistant" and answer.usage.completion_tokens >= 1
    # NOTE: long enough that both are still generating when SIGTERM lands: with 8 tokens the
    # first could finish before the second stream's first chunk arrived (seen once in CI), and
    # with 64 once more on two busy cores. The prompt and 240 tokens fit --max-model-len 256.
    lengths = (200, 240)
    readers = [StreamReader(client, model, n) for n in lengths]
    for reader in readers:
        reader.start()
    assert all(reader.started.wait(30) for reader in readers)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    # Still listening while it drains: /health and new requests say it is stopping.
    health = http_request(server.url + "/health", timeout=5)
    assert health.status == 503 and health.json()["error"]["code"] == "shutting_down"
    with pytest.raises(openai.InternalServerError) as refused:
        client.completions.create(model=model, prompt="Hi", max_tokens=2)
    assert refused.value.status_code == 503 and refused.value.body["code"] == "shutting_down"
    for reader, num_tokens in zip(readers, lengths):
        reader.join(60)
        assert reader.error is None and reader.finish_reason == "length"
        assert reader.usage.completion_tokens == num_tokens
    server.assert_stopped_cleanly(timeout=30)
    drained = [line for line in server.log().splitlines() if "draining" in line]
    assert any("draining 2 in-flight requests" in line for line in drained), drained


def test_a_second_signal_ends_the_requests_at_once(serve, tiny_llama_dir):
    server = serve(str(tiny_llama_dir), *TINY_FLAGS, "--max-model-len", "1024", "--shutdown-timeout", "60")
    client = server.client()
    reader = StreamReader(client, client.models.list().data[0].id, 1000)
    reader.start()
    assert reader.started.wait(30)
    server.proc.send_signal(signal.SIGTERM)  # drains: the stream would go on to its 1000 tokens
    time.sleep(0.2)
    started = time.time()
    server.proc.send_signal(signal.SIGTERM)  # now
    reader.join(30)
    assert isinstance(reader.error, openai.APIError) and reader.error.body["code"] == "shutting_down", reader.error
    server.assert_stopped_cleanly(timeout=30)
    assert time.time() - started < 30 and "a second signal" in server.log()


def test_shutdown_timeout_ends_every_request_in_a_way_its_client_understands(tiny_llama_dir):
    engine_config = EngineConfig(model=str(tiny_llama_dir), enforce_eager=True, dtype="float32", max_model_len=1024,
                                 block_size=8, num_kv_blocks=256)
    server = ServerThread(engine_config, ServerConfig(shutdown_timeout=0.5)).start()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    reader = StreamReader(client, model, 1000)
    reader.start()
    # A non-streamed request through a client that retries by default (max_retries 2): it must
    # get the 503 once, not be sent again to a server that is about to stop listening.
    sent = []
    retrying = openai.OpenAI(base_url=server.url + "/v1", api_key="unused",
                             http_client=httpx.Client(event_hooks={"request": [sent.append]}))
    waiting: dict = {}

    def wait_for_answer() -> None:
        try:
            retrying.completions.create(model=model, prompt="Tell a long story:", max_tokens=1000,
                                        extra_body={"ignore_eos": True})
        except Exception as exc:  # noqa: BLE001 - examined below
            waiting["error"] = exc

    waiter = threading.Thread(target=wait_for_answer, daemon=True)
    waiter.start()
    assert reader.started.wait(30)
    deadline = time.time() + 30
    while server.call(lambda: server.engine.scheduler.num_running) < 2:
        assert time.time() < deadline
        time.sleep(0.05)
    worker = server.engine.worker
    started = time.time()
    server.stop()
    assert time.time() - started < 0.5 + 10
    reader.join(30)
    waiter.join(30)
    assert reader.finish_reason is None  # ended, not finished
    assert isinstance(reader.error, openai.APIError) and reader.error.body["code"] == "shutting_down", reader.error
    assert "--shutdown-timeout" in reader.error.message
    error = waiting["error"]
    assert isinstance(error, openai.InternalServerError) and error.status_code == 503, error
    assert error.body["code"] == "shutting_down" and error.response.headers["Retry-After"]
    assert len(sent) == 1  # no silent retry
    assert not worker.is_alive()


def test_ctrl_c_to_the_process_group_drains_and_stops_the_worker(serve, tiny_llama_dir):
    server = serve("--model", str(tiny_llama_dir), *TINY_FLAGS)
    client = server.client()
    reader = StreamReader(client, client.models.list().data[0].id, 40)
    reader.start()
    assert reader.started.wait(30)
    os.killpg(server.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    reader.join(60)
    assert reader.error is None and reader.finish_reason == "length" and reader.usage.completion_tokens == 40
    server.assert_stopped_cleanly(timeout=30)


@pytest.mark.slow
def test_readme_default_model_answers_a_chat(serve):
    server = serve(timeout=600)  # `pagoda serve`: the default model, SmolLM2-135M-Instruct
    client = server.client("no-key-needed")
    assert client.models.list().data[0].id == "SmolLM2-135M-Instruct"
    answer = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
        max_tokens=32, temperature=0)
    assert "Paris" in answer.choices[0].message.content
    assert answer.choices[0].finish_reason in ("stop", "length")
    # Start-up says what it does, stage by stage, and ends with what runs where.
    log = server.log()
    # NOTE: the compiled model is compiled at a first start, loaded from disk at later ones; where
    # every step runs in one C call (the default model wherever Pagoda's kernels run), neither.
    compiled = next((stage for stage in ("worker: every step runs in one C call", "worker: compiling the model",
                                        "worker: loading the compiled model from ") if stage in log),
                    "worker: (a compile stage)")
    stages = ["model: ", "KV cache: ", "starting the worker process", "worker: loading weights", compiled,
              "worker ready: ", "ready on http://127.0.0.1:"]
    positions = [log.find(stage) for stage in stages]
    assert -1 not in positions and positions == sorted(positions), log
    ready_line = log[positions[-1]:].splitlines()[0]
    # NOTE: "auto" is bfloat16 where the CPU has it natively or the weights are quantized (the default
    # model's GGUF file wherever the quantized kernel runs), float32 otherwise
    cpu = torch.device("cpu")
    dtype = str(resolve_model_dtype("auto", "auto", resolve_model(None), cpu)).removeprefix("torch.")
    for fact in ("model SmolLM2-135M-Instruct", f" in {dtype} ", "attention backend ", "KV cache ", " tokens",
                 "scheduling policy fcfs", "eviction policy lru", "plugins: "):
        assert fact in ready_line, ready_line


def test_port_in_use_fails_before_the_model_loads(tiny_llama_dir, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "pagoda", "serve", "--model", str(tiny_llama_dir), *TINY_FLAGS,
                                 "--port", str(port)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert f"error: cannot listen on 127.0.0.1:{port}: the port is already in use" in result.stderr
    assert "--port" in result.stderr
    assert "starting the worker" not in result.stderr and "model: " not in result.stderr  # nothing was loaded
