"""Scheduler tests without a model: the worker's answer is simulated from the step."""

from pagoda.engine.core.kv_cache_manager import KVCacheManager
from pagoda.engine.messages import RunnerOutput
from pagoda.engine.core.request import Request, RequestStatus
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.core.scheduler import Scheduler

EOS = 0


def make_scheduler(num_blocks=64, block_size=4, budget=32, max_num_seqs=8, max_model_len=256, chunked=True,
                   caching=False, num_cpu_blocks=0, preemption_mode="recompute"):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching, num_cpu_blocks=num_cpu_blocks)
    return Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len,
                     enable_chunked_prefill=chunked, preemption_mode=preemption_mode)


def add(scheduler, request_id, prompt_len, max_tokens=8, prompt=None, priority=0, **params):
    prompt = prompt or list(range(1, prompt_len + 1))
    request = Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, **params),
                      max_tokens=max_tokens, eos_token_ids=frozenset({EOS}), priority=priority)
    scheduler.add_request(request)
    return request


def step(scheduler, next_token=lambda request: 7):
    """One schedule/update round; samples for requests whose tokens are all computed."""
    out = scheduler.schedule()
    assert out.total_num_scheduled_tokens <= scheduler.max_num_batched_tokens
    assert len(scheduler.running) <= scheduler.max_num_seqs
    sampled = {}
    for request_id in out.num_scheduled_tokens:
        # NOTE: schedule() already counted the step's tokens as computed; the step samples
        # for a request when that reaches its last token (the pending one it samples).
        request = scheduler.requests[request_id]
        assert request.num_computed_tokens < request.num_tokens_with_pending or not request.num_pending_tokens
        if request.num_pending_tokens:
            assert request.num_computed_tokens == request.num_tokens_with_pending - 1
            sampled[request_id] = next_token(request)
    updates = scheduler.update(out, RunnerOutput(step_id=out.step_id, sampled=sampled))
    scheduler.kv_cache_manager.check_invariants()
    return out, updates


def test_long_prompt_is_prefilled_in_chunks_then_decodes():
    scheduler = make_scheduler(budget=16)
    request = add(scheduler, "a", prompt_len=40, max_tokens=3)
    chunks = [step(scheduler)[0].num_scheduled_tokens["a"] for _ in range(5)]
    assert chunks == [16, 16, 8, 1, 1]
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert request.output_token_ids == [7, 7, 7]
    assert scheduler.kv_cache_manager.get_num_free_blocks() == 64


def test_without_chunking_a_prompt_waits_for_a_whole_budget():
    scheduler = make_scheduler(budget=16, chunked=False)
    add(scheduler, "a", prompt_len=10)
    add(scheduler, "b", prompt_len=10)
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"a": 10}
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"a": 1, "b": 10}


def test_running_requests_go_first_and_decode_mixes_with_prefill():
    scheduler = make_scheduler(budget=12)
    add(scheduler, "a", prompt_len=4)
    step(scheduler)
    add(scheduler, "b", prompt_len=20)
    out, _ = step(scheduler)
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 11)]


def test_eos_and_stop_token_and_min_tokens():
    scheduler = make_scheduler()
    a = add(scheduler, "a", prompt_len=3, max_tokens=10)
    b = add(scheduler, "b", prompt_len=3, max_tokens=10, stop_token_ids=[5])
    c = add(scheduler, "c", prompt_len=3, max_tokens=10, min_tokens=3)
    tokens = {"a": [4, EOS], "b": [5], "c": [EOS, EOS, EOS]}
    for _ in range(4):
        step(scheduler, lambda r: tokens[r.request_id].pop(0) if tokens[r.request_id] else 9)
    assert a.output_token_ids == [4, EOS] and a.status.finish_reason == "stop"
    assert b.output_token_ids == [5] and b.stop_reason == 5
    assert c.output_token_ids == [EOS, EOS, EOS] and c.status == RequestStatus.FINISHED_STOPPED


def test_ignore_eos_runs_to_max_tokens():
    scheduler = make_scheduler()
    request = add(scheduler, "a", prompt_len=3, max_tokens=4, ignore_eos=True)
    for _ in range(4):
        step(scheduler, lambda r: EOS)
    assert request.output_token_ids == [EOS] * 4
    assert request.status.finish_reason == "length"


def test_preemption_by_recompute_under_a_small_budget_frees_everything():
    # 8 blocks of 4 tokens = 32 slots for 6 requests that each grow to 14 tokens.
    scheduler = make_scheduler(num_blocks=8, block_size=4, budget=64)
    requests = [add(scheduler, f"r{i}", prompt_len=6, max_tokens=8) for i in range(6)]
    for _ in range(200):
        if not scheduler.has_unfinished_requests():
            break
        step(scheduler, lambda r: 10 + r.num_output_tokens)
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in requests)
    assert all(r.output_token_ids == list(range(10, 18)) for r in requests)
    assert scheduler.stats.num_preemptions > 0
    assert scheduler.kv_cache_manager.get_num_free_blocks() == 8
    assert not scheduler.kv_cache_manager.req_to_blocks


def test_the_most_recently_admitted_request_is_preempted_and_keeps_its_place():
    scheduler = make_scheduler(num_blocks=4, block_size=4, budget=64)
    first = add(scheduler, "first", prompt_len=8, max_tokens=8)
    second = add(scheduler, "second", prompt_len=8, max_tokens=8)
    step(scheduler)  # both admitted: 4 blocks used, both full
    assert [r.request_id for r in scheduler.running] == ["first", "second"]
    late = add(scheduler, "late", prompt_len=2, max_tokens=2)
    out, _ = step(scheduler)  # first needs a block: second is the victim
    assert second.status == RequestStatus.PREEMPTED and second.num_computed_tokens == 0
    assert "second" in out.finished_request_ids
    assert [r.request_id for r in scheduler.waiting] == ["second", "late"]
    assert first.status == RequestStatus.RUNNING


def test_abort_frees_blocks_and_tells_the_worker():
    scheduler = make_scheduler()
    add(scheduler, "a", prompt_len=10)
    step(scheduler)
    assert scheduler.kv_cache_manager.get_num_free_blocks() < 64
    scheduler.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert scheduler.kv_cache_manager.get_num_free_blocks() == 64
    out, _ = step(scheduler)
    assert out.finished_request_ids == ["a"]
    # Aborting a waiting request needs no worker message.
    add(scheduler, "b", prompt_len=3)
    scheduler.finish_request("b", RequestStatus.FINISHED_ABORTED)
    assert step(scheduler)[0].finished_request_ids == []


def test_max_num_seqs_caps_running_requests():
    scheduler = make_scheduler(max_num_seqs=2)
    for i in range(4):
        add(scheduler, f"r{i}", prompt_len=2)
    out, _ = step(scheduler)
    assert sorted(out.num_scheduled_tokens) == ["r0", "r1"]


def test_prefix_hit_prefills_only_the_new_tokens():
    scheduler = make_scheduler(caching=True, budget=64)
    first = add(scheduler, "first", 0, max_tokens=1, prompt=list(range(1, 21)))
    step(scheduler)
    assert first.is_finished
    second = add(scheduler, "second", 0, max_tokens=1, prompt=list(range(1, 17)) + [90, 91])
    out, _ = step(scheduler)
    assert out.new_requests[0].num_computed_tokens == 16
    assert out.num_scheduled_tokens == {"second": 2}
    assert second.metrics.num_cached_tokens == 16
    assert (scheduler.stats.prefix_cache_queries, scheduler.stats.prefix_cache_hits) == (38, 16)


def test_n_samples_prefill_the_prompt_once_and_fork():
    scheduler = make_scheduler(caching=True, budget=64)
    parent = Request("p-0", list(range(1, 11)), SamplingParams(max_tokens=3), max_tokens=3)
    children = [Request(f"p-{i}", list(range(1, 11)), SamplingParams(max_tokens=3), max_tokens=3) for i in (1, 2)]
    scheduler.add_request(parent, forks=children)
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"p-0": 9}  # all but the last prompt token, once
    out, _ = step(scheduler)
    # Each sample runs the last prompt token over the shared blocks; the shared partial
    # block is copied for all but the last writer.
    assert out.num_scheduled_tokens == {"p-0": 1, "p-1": 1, "p-2": 1}
    assert [n.request_id for n in out.new_requests] == ["p-1", "p-2"]
    assert len(out.copy_blocks) == 2
    kv = scheduler.kv_cache_manager
    assert kv.get_block_ids("p-0")[:2] == kv.get_block_ids("p-1")[:2] == kv.get_block_ids("p-2")[:2]
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert all(r.num_output_tokens == 3 for r in [parent, *children])
    assert scheduler.stats.num_prefill_tokens_computed == 9 + 3
    assert kv.get_num_free_blocks() == kv.num_blocks


def test_swap_preemption_keeps_computed_tokens_and_swaps_back_in():
    scheduler = make_scheduler(num_blocks=4, block_size=4, budget=64, num_cpu_blocks=8, preemption_mode="swap")
    first = add(scheduler, "first", prompt_len=8, max_tokens=8)
    second = add(scheduler, "second", prompt_len=8, max_tokens=8)
    step(scheduler, lambda r: 10 + r.num_output_tokens)
    out, _ = step(scheduler, lambda r: 10 + r.num_output_tokens)  # first needs a block: second swaps out
    assert second.status == RequestStatus.PREEMPTED and second.num_computed_tokens == 8
    assert [gpu for gpu, _ in out.swap_out] == [2, 3] and scheduler.stats.num_swapped_out == 1
    while first.status == RequestStatus.RUNNING:
        out, _ = step(scheduler, lambda r: 10 + r.num_output_tokens)
    out, _ = step(scheduler, lambda r: 10 + r.num_output_tokens)
    assert len(out.swap_in) == 2 and out.new_requests[0].num_computed_tokens == 8
    assert out.num_scheduled_tokens == {"second": 1}
    while scheduler.has_unfinished_requests():
        step(scheduler, lambda r: 10 + r.num_output_tokens)
    assert second.output_token_ids == list(range(10, 18))
    assert scheduler.kv_cache_manager.usage().num_free_cpu_blocks == 8


def make_priority_scheduler(**kwargs):
    from pagoda.engine.core.policy import Policy

    scheduler = make_scheduler(**kwargs)
    scheduler.policy = Policy(scheduling_policy="priority")
    return scheduler


def test_priority_victim_already_scheduled_in_the_step_is_taken_back_out():
    scheduler = make_priority_scheduler(num_blocks=4, block_size=4, budget=64)
    low = add(scheduler, "low", prompt_len=8, max_tokens=8, priority=9)
    step(scheduler)  # low: 9 tokens
    high = add(scheduler, "high", prompt_len=4, max_tokens=8, priority=0)
    step(scheduler)  # low takes a third block, high the fourth
    assert [r.request_id for r in scheduler.running] == ["low", "high"]
    # low fits in its blocks and is scheduled first; high then needs a block and the
    # policy's victim is low, which must leave the step it was already in.
    out, _ = step(scheduler)
    assert low.status == RequestStatus.PREEMPTED
    assert "low" not in out.num_scheduled_tokens and "low" in out.finished_request_ids
    assert out.num_scheduled_tokens == {"high": 1}
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert low.num_output_tokens == 8 and high.num_output_tokens == 8


def test_aborting_an_n_request_before_it_forks():
    scheduler = make_scheduler(caching=True, budget=4)
    parent = Request("p-0", list(range(1, 11)), SamplingParams(max_tokens=3), max_tokens=3)
    children = [Request(f"p-{i}", list(range(1, 11)), SamplingParams(max_tokens=3), max_tokens=3) for i in (1, 2)]
    scheduler.add_request(parent, forks=children)
    step(scheduler)  # a first chunk of the prompt
    for request_id in ("p-2", "p-0", "p-1"):
        scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
    assert not scheduler.has_unfinished_requests() and not scheduler.waiting
    step(scheduler)
    kv = scheduler.kv_cache_manager
    assert kv.get_num_free_blocks() == kv.num_blocks


def test_a_step_that_only_swaps_in_still_goes_to_the_worker():
    from pagoda.engine.messages import SchedulerOutput

    assert SchedulerOutput(step_id=1, swap_in=[(0, 1)]).has_work
    assert SchedulerOutput(step_id=1, copy_blocks=[(0, 1)]).has_work
    assert not SchedulerOutput(step_id=1).has_work


def _with_tier(num_blocks=16):
    """A scheduler over a small pool with a host-memory offload tier's index (the worker's part
    is the test's: it answers each step's reads)."""
    from pagoda.engine.core.kv_offload_index import KVTierIndex

    scheduler = make_scheduler(num_blocks=num_blocks, block_size=4, caching=True, budget=64)
    scheduler.kv_cache_manager.offload = KVTierIndex(None, file_bytes=100, max_bytes=100 * 1000, block_size=4)
    return scheduler


def _run_to_end(scheduler, loaded=lambda request_id, pairs: len(pairs)):
    """Steps until every request finishes; each step's reads succeed as ``loaded`` says."""
    reads = []
    for _ in range(200):
        if not scheduler.has_unfinished_requests():
            return reads
        out = scheduler.schedule()
        sampled = {r: 7 for r in out.num_scheduled_tokens if scheduler.requests[r].num_pending_tokens}
        answer = RunnerOutput(step_id=out.step_id, sampled=sampled,
                              kv_loaded={r: loaded(r, pairs) for r, pairs in out.kv_load.items()})
        answer.kv_failed = [pairs[answer.kv_loaded[r]][1] for r, pairs in out.kv_load.items()
                            if answer.kv_loaded[r] < len(pairs)]
        reads.append(dict(out.kv_load))
        scheduler.update(out, answer)
        scheduler.kv_cache_manager.check_invariants()
    raise AssertionError("the requests did not finish")


def test_an_evicted_prefix_is_read_back_then_the_rest_computed():
    scheduler = _with_tier()
    prompt = list(range(1, 22))  # 5 full blocks before the last token
    add(scheduler, "a", 21, max_tokens=2, prompt=prompt)
    _run_to_end(scheduler)
    assert scheduler.kv_cache_manager.offload.num_files == 5  # the full blocks of its 23 tokens
    scheduler.kv_cache_manager.reset_prefix_cache()
    request = add(scheduler, "b", 21, max_tokens=2, prompt=prompt)
    reads = _run_to_end(scheduler)
    assert [len(pairs) for read in reads for pairs in read.values()] == [5]
    assert request.metrics.num_cached_tokens == 20 and scheduler.stats.num_prompt_tokens_loaded == 20
    assert "kv_load" in [name for name, _ in request.metrics.events]
    # A read that fails at its third block: two blocks count, the rest is computed.
    scheduler.kv_cache_manager.reset_prefix_cache()
    request = add(scheduler, "c", 21, max_tokens=2, prompt=prompt)
    _run_to_end(scheduler, loaded=lambda request_id, pairs: 2)
    assert request.metrics.num_cached_tokens == 8 and scheduler.kv_cache_manager.offload.stats.num_load_failures == 1
    assert scheduler.kv_cache_manager.get_num_free_blocks() == scheduler.kv_cache_manager.num_blocks


def test_a_request_aborted_or_lost_while_its_prefix_is_read_frees_its_blocks():
    scheduler = _with_tier()
    prompt = list(range(1, 22))
    add(scheduler, "a", 21, max_tokens=1, prompt=prompt)
    _run_to_end(scheduler)
    kv = scheduler.kv_cache_manager
    kv.reset_prefix_cache()
    add(scheduler, "b", 21, max_tokens=1, prompt=prompt)
    out = scheduler.schedule()
    assert list(out.kv_load) == ["b"] and "b" in scheduler.loading
    scheduler.finish_request("b", RequestStatus.FINISHED_ABORTED)  # while the worker reads
    scheduler.update(out, RunnerOutput(step_id=out.step_id, kv_loaded={"b": 5}))
    kv.check_invariants()
    assert not scheduler.loading and kv.get_num_free_blocks() == kv.num_blocks
    # A worker lost while it reads: the request starts over (reads again) on the next worker.
    request = add(scheduler, "c", 21, max_tokens=1, prompt=prompt)
    out = scheduler.schedule()
    assert list(out.kv_load) == ["c"]
    scheduler.reset_after_worker_loss()
    assert not scheduler.loading and request in list(scheduler.waiting)
    reads = _run_to_end(scheduler)
    assert [list(read) for read in reads if read] == [["c"]] and request.is_finished
    # A step that failed in the worker: the read is undone, the request queued again.
    kv.reset_prefix_cache()
    request = add(scheduler, "d", 21, max_tokens=1, prompt=prompt)
    out = scheduler.schedule()
    scheduler.discard_step(out)
    kv.check_invariants()
    assert not scheduler.loading and request.num_computed_tokens == 0 and request in list(scheduler.waiting)
    _run_to_end(scheduler)
    assert kv.get_num_free_blocks() == kv.num_blocks
