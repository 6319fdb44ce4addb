"""Faults with the real server: a killed worker, a crash loop, a disconnect storm, load, client limits."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest

from pagoda.engine.config import EngineConfig
from pagoda.engine.models.linear import packing_available
from pagoda.server.config import ServerConfig
from pagoda.server.testing import ServerThread, http_request
from helpers import REPO, TINY_FLAGS, free_port

pytestmark = pytest.mark.slow  # NOTE: `python -m pytest -m slow` runs it (CI runs both sets)

PROMPTS = [f"Fault test number {i} says" for i in range(16)]


def tiny_engine(tiny_llama_dir, **overrides) -> EngineConfig:
    settings = dict(model=str(tiny_llama_dir), enforce_eager=True, dtype="float32", max_model_len=256, block_size=8,
                    num_kv_blocks=512, max_num_seqs=64)
    return EngineConfig(**{**settings, **overrides})


def engine_is_empty(server: ServerThread) -> bool:
    def check():
        scheduler = server.engine.scheduler
        kv = scheduler.kv_cache_manager
        return scheduler.num_running == 0 and scheduler.num_waiting == 0 and kv.usage().num_used_blocks == 0

    return server.call(check)


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.parametrize("options", [
    pytest.param({"standby_worker": True}, id="float32-standby"),
    pytest.param({"dtype": "bfloat16", "batch_invariant": True}, id="bfloat16-batch-invariant",
                 marks=pytest.mark.skipif(not packing_available("blocked"), reason="needs the blocked kernel")),
])
def test_kill_9_during_16_streams_restarts_the_worker_and_every_stream_finishes_unchanged(tiny_llama_dir, options):
    with ServerThread(tiny_engine(tiny_llama_dir, **options)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        model = client.models.list().data[0].id
        # Half greedy, half seeded sampling: both must continue exactly across the restart.
        args = [dict(model=model, max_tokens=40, temperature=0 if i % 2 else 0.9, seed=i,
                     extra_body={"ignore_eos": True}) for i in range(len(PROMPTS))]
        expected = [client.completions.create(prompt=p, **a).choices[0].text for p, a in zip(PROMPTS, args)]

        texts = [""] * len(PROMPTS)
        finish = [None] * len(PROMPTS)
        started = threading.Barrier(len(PROMPTS) + 1)
        killed_at: list[float] = []

        def stream(i: int) -> None:
            first = True
            for chunk in client.completions.create(prompt=PROMPTS[i], stream=True, **args[i]):
                texts[i] += chunk.choices[0].text
                finish[i] = chunk.choices[0].finish_reason or finish[i]
                if first:
                    first = False
                    started.wait(60)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        started.wait(60)  # every stream has its first tokens
        old_pid = server.engine.worker.pid
        standby_pid = server.engine.standby.pid if options.get("standby_worker") else None
        assert (standby_pid is None) == (server.engine.standby is None)
        killed_at.append(time.time())
        os.kill(old_pid, signal.SIGKILL)
        for t in threads:
            t.join(120)
        assert finish == ["length"] * len(PROMPTS)
        assert texts == expected
        assert server.engine.num_worker_restarts == 1 and server.engine.worker.pid != old_pid
        if standby_pid is not None:  # the standby took over, and a new one waits
            assert server.engine.worker.pid == standby_pid
            assert server.engine.standby.pid not in (None, old_pid, standby_pid)
        metrics = http_request(server.url + "/metrics").text
        assert 'pagoda:worker_restarts_total{engine="0",model_name=' in metrics
        assert [line for line in metrics.splitlines() if line.startswith("pagoda:worker_restarts_total")][0] \
            .endswith(" 1.0")
        restart_seconds = float([line for line in metrics.splitlines()
                                 if line.startswith("pagoda:worker_restart_seconds_total")][0].split()[-1])
        detected, ready = server.engine.last_restart
        assert restart_seconds == pytest.approx(ready - detected)
        assert http_request(server.url + "/health").status == 200
        wait_until(lambda: engine_is_empty(server), 10, "the engine to be empty")
        # NOTE: noticed when the worker's socket closes (0.14 s measured); the bar is a second,
        # with slack for a loaded machine.
        assert detected - killed_at[0] < 2.0
        print(f"\nworker killed: noticed in {detected - killed_at[0]:.3f} s, new worker ready {ready - detected:.2f} s "
              f"later; all 16 streams done {time.time() - killed_at[0]:.2f} s after the kill")


def children(pid: int) -> list[int]:
    pids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        pids += [int(p) for p in (task / "children").read_text().split()]
    return pids


def worker_of(pid: int) -> int | None:
    """The serving worker of a server process: its oldest child (the standby is younger)."""
    started = {}
    for child in children(pid):
        try:
            started[child] = int(Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[19])
        except (FileNotFoundError, ProcessLookupError):
            pass  # reaped meanwhile
    return min(started, key=started.get, default=None)


def serve_tiny(tiny_llama_dir, log, *flags: str) -> tuple[subprocess.Popen, str]:
    """``pagoda serve`` on the tiny model in a process of its own, once /health answers."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pagoda", "serve", "--model", str(tiny_llama_dir), *TINY_FLAGS,
                             *flags, "--port", str(port)], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return http_request(url + "/health", timeout=5).status == 200
        except OSError:
            return False

    try:
        wait_until(up, 120, "the server")
    except BaseException:
        proc.kill()
        raise
    return proc, url


def test_a_crash_loop_past_the_budget_turns_health_503_and_sigterm_still_exits_cleanly(tiny_llama_dir, tmp_path):
    log = open(tmp_path / "server.log", "w")
    proc, url = serve_tiny(tiny_llama_dir, log, "--max-worker-restarts", "2", "--keep-alive-on-engine-death")
    try:
        body = {"prompt": "Hello", "max_tokens": 3}
        for round_ in range(3):
            # NOTE: pagoda serve keeps a standby worker: two children once it has started.
            wait_until(lambda: len(children(proc.pid)) == 2, 60, "the standby worker")
            worker = worker_of(proc.pid)
            os.kill(worker, signal.SIGKILL)
            if round_ < 2:  # restarted: a new worker serves again
                wait_until(lambda: worker_of(proc.pid) not in (None, worker), 60, "a new worker")
                wait_until(lambda: http_request(url + "/v1/completions", "POST", json=body).status == 200, 60,
                           "the restarted worker to serve")
        wait_until(lambda: http_request(url + "/health").status == 503, 30, "/health to give up")
        error = http_request(url + "/health").json()["error"]
        assert error["code"] == "engine_dead" and "--max-worker-restarts" in error["message"]
        result = http_request(url + "/v1/completions", "POST", json=body)
        assert result.status == 503 and result.json()["error"]["code"] == "engine_dead"
        assert "pagoda:worker_restarts_total" in http_request(url + "/metrics").text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert not children(proc.pid) if proc.poll() is None else True
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    text = (tmp_path / "server.log").read_text()
    assert "restarting it (restart 1)" in text and "giving up" in text
    assert "standby worker started" in text and ", the standby) in " in text  # pagoda serve's default


def test_past_the_restart_budget_the_server_exits_with_status_1(tiny_llama_dir, tmp_path):
    """Without --keep-alive-on-engine-death, a dead engine ends the process (after requests
    got their 503s), so that a supervisor that watches the process restarts it."""
    log = open(tmp_path / "server.log", "w")
    proc, url = serve_tiny(tiny_llama_dir, log, "--max-worker-restarts", "0")
    try:
        wait_until(lambda: len(children(proc.pid)) == 2, 60, "the standby worker")
        worker = worker_of(proc.pid)
        (standby,) = set(children(proc.pid)) - {worker}
        os.kill(worker, signal.SIGKILL)
        wait_until(lambda: http_request(url + "/health").status == 503, 30, "/health to give up")
        result = http_request(url + "/v1/completions", "POST", json={"prompt": "Hello", "max_tokens": 3})
        assert result.status == 503 and result.json()["error"]["code"] == "engine_dead"
        wait_until(lambda: not Path(f"/proc/{standby}").exists(), 10, "the standby to go with the engine")
        assert proc.wait(60) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    assert "exits with status 1" in (tmp_path / "server.log").read_text()


def test_disconnect_storm_leaves_no_running_request_and_no_used_block(tiny_llama_dir):
    rng = random.Random(0)
    with ServerThread(tiny_engine(tiny_llama_dir, max_num_seqs=32)) as server:
        def one(i: int, behaviour: str) -> None:
            body = {"prompt": f"storm {i}", "max_tokens": rng.randrange(5, 60), "temperature": 0.5,
                    "stream": behaviour != "impatient"}
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
            try:
                conn.request("POST", "/v1/completions", body=json.dumps(body),
                             headers={"Content-Type": "application/json"})
                if behaviour == "impatient":
                    conn.sock.settimeout(0.05)  # leaves before the whole answer comes
                response = conn.getresponse()
                if behaviour == "leaves":
                    response.read(rng.randrange(1, 400))  # a few events, then hang up mid-stream
                else:
                    response.read()
            except (TimeoutError, OSError):
                pass
            finally:
                conn.close()

        behaviours = [rng.choice(["leaves", "impatient", "stays"]) for _ in range(200)]
        threads = []
        for i, behaviour in enumerate(behaviours):
            threads.append(threading.Thread(target=one, args=(i, behaviour)))
            threads[-1].start()
            if len(threads) >= 40:  # 40 clients at a time
                threads.pop(0).join(60)
        for t in threads:
            t.join(60)
        wait_until(lambda: engine_is_empty(server), 30, "every request to be gone")
        assert http_request(server.url + "/health").status == 200
        server.call(lambda: server.engine.scheduler.kv_cache_manager.check_invariants())


def test_64_concurrent_streams_all_finish_without_errors(tiny_llama_dir):
    with ServerThread(tiny_engine(tiny_llama_dir)) as server:
        async def main() -> list[tuple[str, int]]:
            client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
            model = (await client.models.list()).data[0].id

            async def stream(i: int) -> tuple[str, int]:
                reason, tokens = None, 0
                async for chunk in await client.chat.completions.create(
                        model=model, messages=[{"role": "user", "content": f"Stream {i}"}], max_tokens=24,
                        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
                    if chunk.choices:
                        reason = chunk.choices[0].finish_reason or reason
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
                return reason, tokens

            results = await asyncio.gather(*(stream(i) for i in range(64)), return_exceptions=True)
            await client.close()
            return results

        results = asyncio.run(main())
        errors = [r for r in results if isinstance(r, BaseException)]
        assert not errors, errors[:3]
        assert all(reason == "length" and tokens == 24 for reason, tokens in results)
        wait_until(lambda: engine_is_empty(server), 10, "the engine to be empty")


def test_concurrency_limits_answer_429_per_client_and_overall(tiny_llama_dir):
    config = ServerConfig(max_concurrent_requests=3, max_concurrent_requests_per_key=2)
    with ServerThread(tiny_engine(tiny_llama_dir), config) as server:
        def client(key: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)

        model = client("a").models.list().data[0].id
        long = dict(model=model, prompt="Long", max_tokens=200, stream=True, extra_body={"ignore_eos": True})
        streams = [client("a").completions.create(**long) for _ in range(2)]
        for s in streams:
            next(iter(s))
        with pytest.raises(openai.RateLimitError) as info:
            client("a").completions.create(model=model, prompt="Hi", max_tokens=2)
        assert info.value.body["code"] == "too_many_requests" and "per-key" in info.value.body["message"]
        streams.append(client("b").completions.create(**long))  # another client still gets in
        next(iter(streams[-1]))
        with pytest.raises(openai.RateLimitError) as info:
            client("c").completions.create(model=model, prompt="Hi", max_tokens=2)
        assert "--max-concurrent-requests 3" in info.value.body["message"]
        for s in streams:
            s.close()
        wait_until(lambda: engine_is_empty(server), 10, "the streams to end")
        assert client("a").completions.create(model=model, prompt="Hi", max_tokens=2).usage.completion_tokens == 2
