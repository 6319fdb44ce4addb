"""Tokenizing no client can monopolize: long prompts from one client beside a small request
from another, in the pool itself and through a live server."""

from __future__ import annotations

import asyncio
import random
import statistics
import threading
import time

import pytest

from pagoda.engine.config import EngineConfig
from pagoda.server.config import ServerConfig
from pagoda.server.testing import ServerThread, http_request
from pagoda.server.tokenizer_pool import SMALL_CHARS, TokenizerPool
from conftest import TINY_INIT
from helpers import make_tiny_model_dir


def run(coro):
    return asyncio.run(coro)


def test_long_jobs_are_taken_in_turn_by_client_and_small_ones_never_wait_behind_them():
    async def scenario():
        pool, finished = TokenizerPool(), []

        def job(name, seconds):
            time.sleep(seconds)  # NOTE: releases the GIL, as the fast tokenizer's encode does
            finished.append(name)
            return name

        big = SMALL_CHARS + 1
        hog = [asyncio.create_task(pool.run(job, f"a{i}", 0.1, client="a", cost=big)) for i in range(6)]
        await asyncio.sleep(0.01)
        other = asyncio.create_task(pool.run(job, "b0", 0.1, client="b", cost=big))
        assert await pool.run(job, "small", 0.001, client="c", cost=10) == "small"
        await asyncio.gather(*hog, other)
        pool.shutdown()
        return finished

    finished = run(scenario())
    assert finished[0] == "small", finished  # not behind the long job running, let alone six
    large = [name for name in finished if name != "small"]
    assert large.index("b0") == 1, finished  # b waits for one job of a's, not six
    assert sorted(n for n in finished if n.startswith("a")) == [f"a{i}" for i in range(6)]


def test_a_waiter_that_leaves_does_not_stall_the_lane():
    async def scenario():
        pool = TokenizerPool()
        big = SMALL_CHARS + 1
        first = asyncio.create_task(pool.run(time.sleep, 0.1, client="a", cost=big))
        await asyncio.sleep(0.01)
        leaving = asyncio.create_task(pool.run(time.sleep, 0.1, client="b", cost=big))
        await asyncio.sleep(0.01)
        leaving.cancel()
        await first
        # NOTE: a stalled lane would never answer: the timeout is the failure, not a speed bound.
        answer = await asyncio.wait_for(pool.run(str.upper, "ok", client="c", cost=big), 10)
        pool.shutdown()
        return answer, leaving.cancelled()

    assert run(scenario()) == ("OK", True)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # NOTE: a context of 8192 tokens, as the default model's: a 660k-character prompt is under
    # the character limit (8192 x the longest token, 81 characters), so the tokenizer runs.
    model = make_tiny_model_dir(tmp_path_factory.mktemp("tiny-8k"), "llama", max_position_embeddings=8192,
                                **TINY_INIT)
    config = EngineConfig(model=str(model), enforce_eager=True, dtype="float32", max_model_len=8192,
                          block_size=16, num_kv_blocks=1024)
    with ServerThread(config, ServerConfig()) as server:
        yield server


def small_request_seconds(server) -> float:
    started = time.perf_counter()
    result = http_request(server.url + "/v1/completions", "POST", headers={"Authorization": "Bearer small"},
                          json={"prompt": "Hello", "max_tokens": 2})
    assert result.status == 200, result.text
    return time.perf_counter() - started


def test_six_long_prompts_from_one_client_leave_a_small_request_near_its_alone_latency(server):
    words = "the quick brown fox jumps over a lazy dog while some more words follow here".split()
    rng = random.Random(0)
    huge = " ".join(rng.choice(words) for _ in range(140_000))[:660_000]
    alone = statistics.median(small_request_seconds(server) for _ in range(3))
    statuses = []

    def send_huge():
        result = http_request(server.url + "/v1/completions", "POST", headers={"Authorization": "Bearer hog"},
                              json={"prompt": huge, "max_tokens": 1}, timeout=120)
        statuses.append((result.status, result.json()["error"]["code"]))

    started = time.perf_counter()
    hogs = [threading.Thread(target=send_huge) for _ in range(6)]
    for hog in hogs:
        hog.start()
    time.sleep(0.3)  # the six are queued and one is being tokenized
    beside = small_request_seconds(server)
    for hog in hogs:
        hog.join(120)
    hog_seconds = time.perf_counter() - started
    print(f"small request alone {alone * 1000:.0f} ms, beside six 660k-character prompts {beside * 1000:.0f} ms "
          f"(the six took {hog_seconds:.1f} s)")
    # Tokenized (about 140k tokens each), then refused as longer than the context.
    assert statuses == [(400, "context_length_exceeded")] * 6
    # NOTE: in the same sitting, against the six's own time: behind them it would wait for most
    # of it (a single thread in arrival order: 2.4 s of 2.7 s here); beside them it waits for none.
    assert beside < hog_seconds / 4, (alone, beside, hog_seconds)
