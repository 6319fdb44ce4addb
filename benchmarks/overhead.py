"""`pagoda bench overhead`: the engine's own cost per step, outside the model's forward.

Many short requests run at once (256 by default), so the engine has the most
bookkeeping per step: scheduling, the message to the worker and back, applying results,
detokenizing and waking streams. The run is done twice, without and with async
scheduling, and reports per step:

* engine time: schedule() plus applying the results (update, detokenizing, streams);
* worker idle: how long the worker waited for its next step after answering one, which
  is the part of the engine's cost on the critical path (async scheduling hides the
  engine's work behind the worker's);
* worker compute, the wall time, and their difference: all the time per step outside
  the forward (engine time, both ends of the message passing, admitting the requests).

``--output-kind delta`` reads every request as a stream of deltas, as the server's
streaming responses do (text detokenized and each stream woken every step); ``final``
reads one output per request, as ``LLM.generate`` does.

``--structured-output json`` constrains every request with a JSON schema (an object holding
an array of integers), so the cost of structured outputs (the per-step bitmasks, the
matchers, and with async scheduling the wait for each structured request's pending token)
shows against the same run without it.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import asdict

from pagoda.benchmarks.progress import emit, note
from pagoda.engine.args import add_engine_args, engine_config_from_args
from pagoda.engine.core.snapshot import STEP_LOG_SPEC


#: The schema of --structured-output json: open-ended, so requests run to max_tokens mostly.
BENCH_SCHEMA = {"type": "object", "properties": {"values": {"type": "array", "items": {"type": "integer"}}},
                "required": ["values"], "additionalProperties": False}


async def _run(config, args: argparse.Namespace) -> tuple[dict, dict, float, int]:
    """Starts an engine, warms it up, runs the workload; returns the step stats before and
    after it and its wall time."""
    from pagoda.engine.frontend.async_engine import AsyncEngine
    from pagoda.engine.frontend.output_processor import OutputKind
    from pagoda.engine.sampling_params import SamplingParams, StructuredOutputsParams

    async def consume(engine, prompt, params, kind) -> None:
        async for _ in engine.stream_outputs(engine.add_request(prompt, params, output_kind=kind)):
            pass

    rng = random.Random(args.bench_seed)
    async with AsyncEngine(config) as engine:
        vocab = engine.model_config.vocab_size
        prompts = [[rng.randrange(1000, vocab) for _ in range(args.input_len)] for _ in range(args.num_requests)]
        structured = StructuredOutputsParams(json=BENCH_SCHEMA) if args.structured_output == "json" else None
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True,
                                structured_outputs=structured)
        warm_up = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, structured_outputs=structured)
        await asyncio.gather(*(consume(engine, p, warm_up, OutputKind.FINAL) for p in prompts[:4]))
        before = asdict(engine.step_stats)
        tokens_before = engine.scheduler.stats.num_generation_tokens
        start = time.perf_counter()
        kind = OutputKind(args.output_kind)
        watcher = asyncio.create_task(_watch(engine, args.console_interval)) if args.console_interval else None
        await asyncio.gather(*(consume(engine, p, params, kind) for p in prompts))
        wall = time.perf_counter() - start
        if watcher is not None:
            watcher.cancel()
        return before, asdict(engine.step_stats), wall, engine.scheduler.stats.num_generation_tokens - tokens_before


async def _watch(engine, interval: float) -> None:
    """What a console watching the engine costs it: the step log (registered as a plugin) and a
    snapshot of the engine's state, serialized, every ``interval`` seconds."""
    import orjson

    from pagoda.engine.core.snapshot import engine_snapshot

    step_log = engine.plugin_manager.get_plugin(STEP_LOG_SPEC)
    while True:
        orjson.dumps(engine_snapshot(engine.scheduler, step_log))
        await asyncio.sleep(interval)


def measure(args: argparse.Namespace, async_scheduling: bool) -> dict:
    from pagoda.engine.frontend.llm import new_event_loop

    config = engine_config_from_args(args)
    config.async_scheduling = async_scheduling
    if args.console_interval:
        config.plugins = (*config.plugins, STEP_LOG_SPEC)
    loop = new_event_loop()
    try:
        before, after, wall, num_tokens = loop.run_until_complete(_run(config, args))
    finally:
        loop.close()
    steps = after["num_steps"] - before["num_steps"]

    def per_step(key: str) -> float:
        return 1e3 * (after[key] - before[key]) / steps

    return {"async_scheduling": async_scheduling, "requests": args.num_requests, "steps": steps,
            "wall_ms_per_step": 1e3 * wall / steps, "schedule_ms_per_step": per_step("schedule_seconds"),
            "update_ms_per_step": per_step("update_seconds"),
            "engine_ms_per_step": per_step("schedule_seconds") + per_step("update_seconds"),
            "worker_idle_ms_per_step": per_step("worker_idle_seconds"),
            "worker_compute_ms_per_step": per_step("worker_compute_seconds"),
            "outside_forward_ms_per_step": 1e3 * wall / steps - per_step("worker_compute_seconds"),
            "output_kind": args.output_kind, "structured_output": args.structured_output, "seconds": wall,
            "output_tokens": num_tokens, "output_tokens_per_s": num_tokens / wall}


def run_overhead(args: argparse.Namespace) -> int:
    results = []
    for async_scheduling in (False, True):
        note(args, f"async scheduling {'on' if async_scheduling else 'off'}: {args.num_requests} requests ...")
        r = measure(args, async_scheduling)
        results.append(r)
        emit(args, r, f"async scheduling {'on' if async_scheduling else 'off'}: {r['steps']} steps, "
                      f"{r['wall_ms_per_step']:.2f} ms per step, engine {r['engine_ms_per_step']:.2f} ms")
    print(f"\n{args.num_requests} requests x ({args.input_len} prompt + {args.output_len} output), "
          f"{args.output_kind} outputs, structured output: {args.structured_output}; per step (ms):")
    print(f"{'async scheduling':<18}{'engine':>9}{'schedule':>10}{'update':>9}{'worker idle':>13}"
          f"{'worker compute':>16}{'wall':>9}{'outside fwd':>13}{'total s':>9}{'tok/s':>8}")
    for r in results:
        print(f"{'on' if r['async_scheduling'] else 'off':<18}{r['engine_ms_per_step']:>9.2f}"
              f"{r['schedule_ms_per_step']:>10.2f}{r['update_ms_per_step']:>9.2f}{r['worker_idle_ms_per_step']:>13.2f}"
              f"{r['worker_compute_ms_per_step']:>16.2f}{r['wall_ms_per_step']:>9.2f}"
              f"{r['outside_forward_ms_per_step']:>13.2f}{r['seconds']:>9.2f}{r['output_tokens_per_s']:>8.0f}")
    return 0


def add_overhead_parser(bench_sub) -> None:
    p = bench_sub.add_parser("overhead", help="engine time per step outside the forward, with and without "
                                              "async scheduling")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--bench-seed", type=int, default=0)
    p.add_argument("--output-kind", choices=["final", "delta"], default="final",
                   help="final: one output per request (LLM.generate); delta: streamed deltas (the server)")
    p.add_argument("--structured-output", choices=["none", "json"], default="none",
                   help="json: every request constrained by a JSON schema (see the module docstring)")
    p.add_argument("--console-interval", type=float, default=0.0, metavar="SECONDS",
                   help="also take the console's snapshot of the engine's state every SECONDS (0: no console), "
                        "with its step log, to measure what a watching console costs")
    add_engine_args(p)
    p.set_defaults(func=run_overhead)
