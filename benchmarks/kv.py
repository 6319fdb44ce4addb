"""KV-cache benchmarks: `pagoda bench kv-utilization` and `pagoda bench preemption`."""

from __future__ import annotations

import argparse
import random
import time

from pagoda.benchmarks.progress import emit, note
from pagoda.engine.args import add_engine_args, engine_config_from_args


def _mixed_workload(num_requests: int, max_len: int, seed: int) -> list[tuple[int, int]]:
    """(prompt length, output length) pairs, each uniform in [16, max_len / 2)."""
    rng = random.Random(seed)
    return [(rng.randrange(16, max_len // 2), rng.randrange(16, max_len // 2)) for _ in range(num_requests)]


def simulate_step(scheduler) -> object:
    """One schedule/update round with a simulated worker that always samples token 7.

    Returns:
        The step's SchedulerOutput.
    """
    from pagoda.engine.messages import RunnerOutput

    out = scheduler.schedule()
    requests = scheduler.requests
    # NOTE: schedule() counts the step's tokens as computed; a request the step samples
    # for has a pending token.
    sampled = {request_id: 7 for request_id in out.num_scheduled_tokens if requests[request_id].num_pending_tokens}
    scheduler.update(out, RunnerOutput(out.step_id, sampled))
    return out


def simulate_paged(workload, num_slots: int, block_size: int, max_model_len: int) -> dict:
    """Runs the real scheduler and KV cache manager with a simulated worker."""
    from pagoda.engine.core.kv_cache_manager import KVCacheManager
    from pagoda.engine.core.request import Request
    from pagoda.engine.sampling_params import SamplingParams
    from pagoda.engine.core.scheduler import Scheduler

    kv = KVCacheManager(num_slots // block_size, block_size, enable_prefix_caching=False)
    scheduler = Scheduler(kv, max_num_seqs=1024, max_num_batched_tokens=4096, max_model_len=max_model_len)
    for i, (prompt_len, output_len) in enumerate(workload):
        params = SamplingParams(max_tokens=output_len, ignore_eos=True)
        scheduler.add_request(Request(f"r{i}", [1 + (i + j) % 1000 for j in range(prompt_len)], params, output_len))
    steps = used_slots = held_tokens = running = 0
    while scheduler.has_unfinished_requests():
        out = simulate_step(scheduler)
        usage = kv.usage()
        steps += 1
        used_slots += usage.num_used_blocks * block_size
        held_tokens += usage.num_tokens
        running += len(out.num_scheduled_tokens)
    return {"scheme": "paged", "steps": steps, "utilization": held_tokens / used_slots,
            "mean_running": running / steps, "preemptions": scheduler.stats.num_preemptions}


def simulate_contiguous(workload, num_slots: int, reserve) -> dict:
    """FCFS with one contiguous reservation per request, released when it finishes."""
    waiting = list(workload)
    running: list[list[int]] = []  # [tokens held, reserved, tokens to go]
    reserved = steps = held = used = num_running = 0
    while waiting or running:
        while waiting and reserved + reserve(*waiting[0]) <= num_slots:
            prompt_len, output_len = waiting.pop(0)
            size = reserve(prompt_len, output_len)
            running.append([prompt_len, size, output_len])
            reserved += size
        steps += 1
        used += reserved
        held += sum(r[0] for r in running)
        num_running += len(running)
        for r in running:
            r[0] += 1
            r[2] -= 1
        for r in [r for r in running if r[2] == 0]:
            running.remove(r)
            reserved -= r[1]
    return {"steps": steps, "utilization": held / used, "mean_running": num_running / steps}


def run_kv_utilization(args: argparse.Namespace) -> int:
    workload = _mixed_workload(args.num_requests, args.max_model_len, args.bench_seed)
    num_slots = args.num_slots
    results = [
        simulate_paged(workload, num_slots, args.block_size, args.max_model_len),
        {"scheme": "contiguous, max_model_len each",
         **simulate_contiguous(workload, num_slots, lambda p, o: args.max_model_len)},
        {"scheme": "contiguous, prompt + max_tokens each",
         **simulate_contiguous(workload, num_slots, lambda p, o: p + o)},
    ]
    print(f"{len(workload)} requests, prompt and output lengths uniform in [16, {args.max_model_len // 2}), "
          f"{num_slots} KV slots, block size {args.block_size}")
    print(f"{'scheme':<38}{'KV utilization':>15}{'mean running':>14}{'steps':>8}")
    for r in results:
        print(f"{r['scheme']:<38}{r['utilization']:>14.1%}{r['mean_running']:>14.1f}{r['steps']:>8}")
    return 0


def run_preemption(args: argparse.Namespace) -> int:
    """Long decodes under memory pressure, once per preemption mode, same prompts."""
    from dataclasses import asdict

    from pagoda.benchmarks.throughput import random_prompts
    from pagoda.engine.frontend.llm import LLM
    from pagoda.engine.sampling_params import SamplingParams

    results = []
    for mode in args.modes.split(","):
        note(args, f"{mode}: {args.num_requests} requests ...")
        config = engine_config_from_args(args)
        config.preemption_mode = mode
        with LLM(**asdict(config)) as llm:
            vocab = llm.engine.model_config.vocab_size
            prompts = random_prompts(args.num_requests, args.input_len, vocab, args.bench_seed)
            params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
            llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2))  # warm-up
            stats = llm.engine.scheduler.stats
            start = time.perf_counter()
            llm.generate(prompts, params)
            elapsed = time.perf_counter() - start
            results.append({"mode": mode, "seconds": elapsed, "preemptions": stats.num_preemptions,
                            "swapped": stats.num_swapped_out, "recomputed": stats.num_recomputed,
                            "prompt_tokens_computed": stats.num_prefill_tokens_computed})
        r = results[-1]
        emit(args, r, f"{mode}: {r['seconds']:.2f} s, {r['preemptions']} preemptions")
    base = results[0]["seconds"]
    print(f"\n{args.num_requests} requests x ({args.input_len} prompt + {args.output_len} output), "
          f"{args.num_kv_blocks} KV blocks of {args.block_size}")
    print(f"{'mode':<11}{'seconds':>9}{'preemptions':>13}{'swapped':>9}{'recomputed':>12}{'prompt tok run':>16}"
          f"{'vs ' + results[0]['mode']:>14}")
    for r in results:
        print(f"{r['mode']:<11}{r['seconds']:>9.2f}{r['preemptions']:>13}{r['swapped']:>9}{r['recomputed']:>12}"
              f"{r['prompt_tokens_computed']:>16}{base / r['seconds']:>13.2f}x")
    return 0


def add_kv_bench_parsers(bench_sub) -> None:
    kvu = bench_sub.add_parser("kv-utilization", help="paged vs contiguous KV memory use (simulated steps)")
    kvu.add_argument("--num-requests", type=int, default=200)
    kvu.add_argument("--num-slots", type=int, default=16384, help="KV capacity in tokens")
    kvu.add_argument("--max-model-len", type=int, default=2048)
    kvu.add_argument("--block-size", type=int, default=16)
    kvu.add_argument("--bench-seed", type=int, default=0)
    kvu.set_defaults(func=run_kv_utilization)

    pre = bench_sub.add_parser("preemption", help="swap vs recompute on long decodes under memory pressure")
    pre.add_argument("--modes", default="recompute,swap,auto")
    pre.add_argument("--num-requests", type=int, default=16)
    pre.add_argument("--input-len", type=int, default=256)
    pre.add_argument("--output-len", type=int, default=256)
    pre.add_argument("--bench-seed", type=int, default=0)
    add_engine_args(pre)
    pre.set_defaults(func=run_preemption, num_kv_blocks=160, max_model_len=1024)
