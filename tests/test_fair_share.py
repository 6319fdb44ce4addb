"""The ``fair`` scheduling policy: a client that fills every slot does not starve another.

In the scheduler without a model (the worker's answer simulated) against fcfs, and with the
real server: a request whose 64 sequences fill every slot, from one client, and a 4-token
request from another."""

from __future__ import annotations

import threading
import time

import openai
import pytest

from pagoda.engine.config import EngineConfig
from pagoda.engine.core.kv_cache_manager import KVCacheManager
from pagoda.engine.core.plugin_manager import create_plugin_manager
from pagoda.engine.core.policy import Policy
from pagoda.engine.core.request import Request, RequestStatus
from pagoda.engine.core.scheduler import Scheduler
from pagoda.engine.messages import RunnerOutput
from pagoda.engine.sampling_params import SamplingParams
from pagoda.server.config import ServerConfig
from pagoda.server.testing import ServerThread


def make_scheduler(policy: str) -> Scheduler:
    return Scheduler(KVCacheManager(256, 4, num_cpu_blocks=256), max_num_seqs=8, max_num_batched_tokens=64,
                     max_model_len=512, preemption_mode="swap",
                     policy=Policy(create_plugin_manager(load_entry_points=False), policy))


def add(scheduler: Scheduler, request_id: str, client: str, max_tokens: int) -> Request:
    request = Request(request_id, list(range(1, 9)), SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens,
                      client=client)
    scheduler.add_request(request)
    return request


def step(scheduler: Scheduler) -> None:
    out = scheduler.schedule()
    sampled = {request_id: 7 for request_id in out.num_scheduled_tokens
               if scheduler.requests[request_id].num_pending_tokens}
    scheduler.update(out, RunnerOutput(step_id=out.step_id, sampled=sampled))
    scheduler.kv_cache_manager.check_invariants()


@pytest.mark.parametrize("policy", ["fcfs", "fair"])
def test_a_second_client_is_served_while_the_first_fills_every_slot(policy):
    scheduler = make_scheduler(policy)
    hog = [add(scheduler, f"a{i}", "a", max_tokens=200) for i in range(12)]
    for _ in range(5):
        step(scheduler)
    assert sum(r.status == RequestStatus.RUNNING for r in hog) == 8  # every slot
    small = add(scheduler, "b0", "b", max_tokens=4)
    for _ in range(8):
        step(scheduler)
    if policy == "fair":  # preempts one of the hog's sequences, runs, finishes
        assert small.status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert scheduler.stats.num_preemptions >= 1
    else:  # waits behind every one of the hog's requests
        assert small.status == RequestStatus.WAITING
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert all(r.num_output_tokens == 200 for r in hog)  # nothing lost to the preemption
    assert scheduler.kv_cache_manager.get_num_free_blocks() == 256


def test_fair_admits_the_least_served_client_first():
    scheduler = make_scheduler("fair")
    for i in range(8):
        add(scheduler, f"a{i}", "a", max_tokens=50)
    for _ in range(3):
        step(scheduler)
    fair = scheduler.policy.scheduling
    served_a = fair.served["a"]
    late_a = add(scheduler, "a-late", "a", max_tokens=5)
    b = add(scheduler, "b0", "b", max_tokens=5)
    # b was idle: it starts level with the least-served backlogged client, with no credit
    # saved up for the time it sent nothing ...
    assert fair.served["b"] == served_a > 0
    for _ in range(3):  # a tie, then a served more: one of a's preempted, then b admitted
        step(scheduler)
    # ... and once a has been served more, b runs (a preempted for it) and a-late waits.
    assert b.status == RequestStatus.RUNNING and late_a.status == RequestStatus.WAITING
    assert b.view.client == "b" and late_a.view.client == "a"

@pytest.mark.slow
def test_fair_on_a_live_server_answers_a_small_request_beside_a_hog_that_fills_every_slot(tiny_llama_dir):
    engine = EngineConfig(model=str(tiny_llama_dir), dtype="float32", enforce_eager=True, max_model_len=256,
                          num_kv_blocks=1024, max_num_seqs=64, scheduling_policy="fair")
    with ServerThread(engine, ServerConfig(client_header="X-Client", max_n=128, max_sequences_per_request=64)) as server:
        hog_client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                   default_headers={"X-Client": "hog"})
        small_client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                     default_headers={"X-Client": "small"})
        model = small_client.models.list().data[0].id
        hog_started, hog_done = threading.Event(), threading.Event()

        def hog() -> None:
            stream = hog_client.completions.create(model=model, prompt=["Once upon a time", "In a galaxy"], n=32,
                                                   max_tokens=100, stream=True, extra_body={"ignore_eos": True})
            for _ in stream:
                hog_started.set()
            hog_done.set()

        thread = threading.Thread(target=hog)
        thread.start()
        assert hog_started.wait(60)
        for _ in range(100):  # its samples fork from their prompts' first steps
            if server.call(lambda: server.engine.scheduler.num_running) == 64:
                break
            time.sleep(0.05)
        assert server.call(lambda: server.engine.scheduler.num_running) == 64  # the hog holds every slot
        small = small_client.completions.create(model=model, prompt="Hi", max_tokens=4,
                                                extra_body={"ignore_eos": True})
        assert len(small.choices[0].text) > 0 and small.usage.completion_tokens == 4
        assert not hog_done.is_set()  # served beside the hog, not after it
        thread.join(120)
        assert hog_done.is_set()
        kv = server.call(lambda: server.engine.scheduler.kv_cache_manager)
        assert server.call(lambda: kv.get_num_free_blocks()) == kv.num_blocks


def test_fair_counts_every_sample_of_an_n_request():
    scheduler = make_scheduler("fair")
    samples = [Request(f"a-{i}", list(range(1, 9)), SamplingParams(max_tokens=20), max_tokens=20, client="a")
               for i in range(4)]
    scheduler.add_request(samples[0], forks=samples[1:])
    add(scheduler, "b0", "b", max_tokens=20)  # keeps the fair plugin counting
    for _ in range(10):
        step(scheduler)
    fair = scheduler.policy.scheduling
    computed = sum(r.num_computed_tokens for r in samples)
    assert computed > 8 + 3 * 5  # the forks decoded too
    assert fair.served["a"] == computed - 3 * 7  # NOTE: the forks share the first sample's 7 prompt tokens
