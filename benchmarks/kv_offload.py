"""`pagoda bench kv-offload`: the prefix cache's disk tier on a working set larger than the pool.

``--num-prefixes`` system prompts of ``--prefix-len`` random tokens, each request one of them
(drawn with Zipf popularity, exponent ``--zipf``) followed by ``--suffix-len`` tokens of its own,
``--concurrency`` requests in flight at a time. The KV pool is sized to a quarter of the
prefixes' blocks (``--pool-fraction``), so most prefixes cannot stay in it. The same requests
run with the disk tier off, then on (a fresh directory), in one sitting; the table gives the
prompt tokens computed, read back, found in the pool, and the throughput. Then a new engine
starts on the tier's directory (as after a restart) and times one request's first token three
ways: its prefix read from disk, from the pool, and an unseen prefix computed. The tier's
measured read rate and the engine's prefill rate say what a block costs either way.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path

from pagoda.benchmarks.progress import emit, note, table
from pagoda.engine.args import add_engine_args, engine_config_from_args


def make_workload(args: argparse.Namespace, vocab_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """The prefixes, and each request's prompt (a prefix by Zipf popularity, then its own suffix)."""
    rng = random.Random(args.bench_seed)
    prefixes = [[rng.randrange(1000, vocab_size) for _ in range(args.prefix_len)] for _ in range(args.num_prefixes)]
    weights = [1 / (rank + 1) ** args.zipf for rank in range(args.num_prefixes)]
    prompts = []
    for choice in rng.choices(range(args.num_prefixes), weights, k=args.num_requests):
        prompts.append(prefixes[choice] + [rng.randrange(1000, vocab_size) for _ in range(args.suffix_len)])
    return prefixes, prompts


async def _first_token_seconds(engine, prompt: list[int]) -> float:
    from pagoda.engine.frontend.output_processor import OutputKind
    from pagoda.engine.sampling_params import SamplingParams

    start = time.perf_counter()
    async for _ in engine.stream_outputs(engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1),
                                                            output_kind=OutputKind.FINAL)):
        pass
    return time.perf_counter() - start


async def _run(args: argparse.Namespace, config, prompts: list[list[int]], label: str) -> dict:
    from pagoda.engine.frontend.async_engine import AsyncEngine
    from pagoda.engine.frontend.output_processor import OutputKind
    from pagoda.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    gate = asyncio.Semaphore(args.concurrency)
    ttfts: list[float] = []

    async def one(engine, prompt) -> None:
        async with gate:
            start = time.perf_counter()
            first = None
            async for _ in engine.stream_outputs(engine.add_request(prompt, params, output_kind=OutputKind.DELTA)):
                first = first or time.perf_counter()
            ttfts.append(first - start)

    note(args, f"{label}: starting the engine ...")
    async with AsyncEngine(config) as engine:
        offload = engine.scheduler.kv_cache_manager.offload
        if offload is not None and args.measure_rates:
            offload.worth_loading = lambda: True  # NOTE: the rates are reported, not acted on
        for prompt in prompts[:args.warmup]:  # NOTE: the worker's first steps, not the workload's
            await _first_token_seconds(engine, [t + 1 for t in prompt[:64]])
        stats, steps = engine.scheduler.stats, engine.core.step_stats
        before = (stats.num_prefill_tokens_computed, stats.num_prompt_tokens_cached, stats.num_prompt_tokens_loaded)
        steps_before = (steps.num_steps, steps.worker_compute_seconds)
        start = time.perf_counter()
        await asyncio.gather(*(one(engine, prompt) for prompt in prompts))
        seconds = time.perf_counter() - start
        computed, cached, loaded = (now - then for now, then in zip(
            (stats.num_prefill_tokens_computed, stats.num_prompt_tokens_cached, stats.num_prompt_tokens_loaded),
            before))
        record = {"event": "run", "run": label, "seconds": seconds, "requests_per_s": len(prompts) / seconds,
                  "prompt_tokens": sum(map(len, prompts)), "computed": computed, "loaded": loaded,
                  "from_pool": cached - loaded, "median_ttft": statistics.median(ttfts),
                  "steps": steps.num_steps - steps_before[0], "worker_s": steps.worker_compute_seconds - steps_before[1]}
        if offload is not None:
            record.update(read_mb_per_s=(offload.read_rate or 0) / 1e6, prefill_tok_per_s=offload.prefill_rate,
                          file_kib=offload.file_bytes / 1024, files=offload.num_files,
                          load_failures=offload.stats.num_load_failures)
    emit(args, record, f"{label}: {seconds:.1f} s, {record['requests_per_s']:.2f} requests/s, {computed} prompt "
                       f"tokens computed, {loaded} read from disk, {cached - loaded} from the pool, median TTFT "
                       f"{record['median_ttft'] * 1000:.0f} ms; {record['steps']} steps, the worker busy "
                       f"{record['worker_s']:.1f} s")
    return record


async def _restart(args: argparse.Namespace, config, prefixes: list[list[int]], vocab_size: int) -> dict:
    """A new engine on the tier's directory: one request's first token with its prefix on disk, in
    the pool, and never seen."""
    from pagoda.engine.frontend.async_engine import AsyncEngine

    rng = random.Random(args.bench_seed + 1)

    def fresh(prefix):
        return prefix + [rng.randrange(1000, vocab_size) for _ in range(args.suffix_len)]

    note(args, "restart: a new engine on the same directory ...")
    async with AsyncEngine(config) as engine:
        await _first_token_seconds(engine, [t + 2 for t in prefixes[1][:64]])  # NOTE: warm-up
        from_disk = await _first_token_seconds(engine, fresh(prefixes[0]))
        from_pool = await _first_token_seconds(engine, fresh(prefixes[0]))
        unseen = [rng.randrange(1000, vocab_size) for _ in range(args.prefix_len)]
        computed = await _first_token_seconds(engine, fresh(unseen))
        loaded = engine.scheduler.stats.num_prompt_tokens_loaded
    record = {"event": "restart", "ttft_disk": from_disk, "ttft_pool": from_pool, "ttft_computed": computed,
              "loaded": loaded}
    emit(args, record, f"after a restart, the first token of a {args.prefix_len + args.suffix_len}-token prompt: "
                       f"{from_disk * 1000:.0f} ms with its prefix on disk ({loaded} tokens read), "
                       f"{from_pool * 1000:.0f} ms from the pool, {computed * 1000:.0f} ms computed")
    return record


def run_kv_offload(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from pagoda.benchmarks.compare import cpu_line, describe_cpu
    from pagoda.engine.frontend.llm import new_event_loop
    from pagoda.engine.model_config import ModelConfig
    from pagoda.engine.model_loader import resolve_model

    config = engine_config_from_args(args)
    shape = ModelConfig.from_dir(resolve_model(config.model))
    block = config.block_size
    working_set = args.num_prefixes * -(-args.prefix_len // block)
    per_request = -(-(args.prefix_len + args.suffix_len + args.output_len) // block)
    # NOTE: at least room for the requests in flight and a quarter more, or they would preempt each other.
    num_blocks = config.num_kv_blocks or max(int(working_set * args.pool_fraction),
                                             int(1.25 * args.concurrency * per_request))
    config = replace(config, num_kv_blocks=num_blocks,
                     max_model_len=config.max_model_len or args.prefix_len + args.suffix_len + args.output_len + block)
    prefixes, prompts = make_workload(args, shape.vocab_size)
    directory = Path(args.offload_dir or tempfile.mkdtemp(prefix="pagoda-bench-kv-offload-"))
    note(args, f"{args.num_prefixes} prefixes of {args.prefix_len} tokens ({working_set} blocks) over a pool of "
               f"{num_blocks} blocks ({working_set / num_blocks:.1f}x the pool); tier in {directory}")
    loop = new_event_loop()
    runs: list[dict] = []
    try:
        for i in range(args.runs):  # NOTE: alternated, so that a slow stretch of the machine hits both
            runs.append(loop.run_until_complete(_run(args, config, prompts, "tier off")))
            on = replace(config, kv_offload_dir=str(directory / f"run{i}"))  # NOTE: each run starts empty
            runs.append(loop.run_until_complete(_run(args, on, prompts, "tier on")))
        restart = None if args.no_restart else loop.run_until_complete(
            _restart(args, on, prefixes, shape.vocab_size))
    finally:
        loop.close()
    records = []
    for label in ("tier off", "tier on"):
        mine = [r for r in runs if r["run"] == label]
        middle = sorted(mine, key=lambda r: r["seconds"])[len(mine) // 2]
        records.append({**middle, "all_seconds": ", ".join(f"{r['seconds']:.1f}" for r in mine)})
    off, tier = records
    for record in records:
        record["speedup"] = off["seconds"] / record["seconds"]
    print(f"\n{cpu_line(describe_cpu())}")
    print(f"{args.num_requests} requests, {args.concurrency} at a time: one of {args.num_prefixes} prefixes of "
          f"{args.prefix_len} tokens (Zipf {args.zipf}) + {args.suffix_len} tokens of its own, {args.output_len} "
          f"output tokens; KV pool {num_blocks} blocks of {block} tokens, the prefixes {working_set / num_blocks:.1f}x "
          f"its size; {config.model or 'the default model'}, {config.dtype}")
    print(f"median of {args.runs} run(s) each, alternated; tokens of that run")
    print(table(records, [("run", "run", ""), ("seconds", "seconds", ".1f"), ("runs", "all_seconds", ""), ("requests/s", "requests_per_s", ".2f"),
                          ("computed", "computed", "d"), ("read back", "loaded", "d"), ("from pool", "from_pool", "d"),
                          ("median TTFT s", "median_ttft", ".3f"), ("speed-up", "speedup", ".2f")]))
    if tier.get("prefill_tok_per_s"):
        read_ms = tier["file_kib"] * 1024 / (tier["read_mb_per_s"] * 1e6) * 1000 if tier["read_mb_per_s"] else None
        compute_ms = block / tier["prefill_tok_per_s"] * 1000
        print(f"a block ({tier['file_kib']:.0f} KiB): read back at {tier['read_mb_per_s']:.0f} MB/s in "
              f"{read_ms:.2f} ms, computed at {tier['prefill_tok_per_s']:.0f} prompt tokens/s in {compute_ms:.2f} ms"
              if read_ms else "")
    if restart is not None:
        print(f"after a restart: first token in {restart['ttft_disk'] * 1000:.0f} ms from disk, "
              f"{restart['ttft_pool'] * 1000:.0f} ms from the pool, {restart['ttft_computed'] * 1000:.0f} ms computed")
    return 0


def add_kv_offload_bench_parser(bench_sub) -> None:
    p = bench_sub.add_parser("kv-offload", help="the disk tier on a working set of prefixes larger than the KV pool: "
                                                "tokens computed and throughput with the tier off and on, and the "
                                                "first token after a restart")
    p.add_argument("--num-prefixes", type=int, default=64)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=192)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--zipf", type=float, default=1.0, help="popularity exponent of the prefixes (default 1.0)")
    p.add_argument("--pool-fraction", type=float, default=0.25,
                   help="the KV pool's size as a share of the prefixes' blocks (default 0.25; --num-kv-blocks wins)")
    p.add_argument("--offload-dir", default=None, help="the tier's directory (default: a new temporary one)")
    p.add_argument("--runs", type=int, default=1, help="runs of each, alternated (the table gives the median)")
    p.add_argument("--warmup", type=int, default=4, help="short requests before each timed run")
    p.add_argument("--measure-rates", action="store_true",
                   help="read every prefix found on disk, whatever the rates say (to measure both)")
    p.add_argument("--no-restart", action="store_true", help="skip the restart's first-token timings")
    p.add_argument("--bench-seed", type=int, default=0)
    add_engine_args(p)
    p.set_defaults(func=run_kv_offload)
