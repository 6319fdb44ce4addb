"""`pagoda bench fairness`: the service each of two clients gets when one sends ten times
the other's load, under each scheduling policy asked for (fcfs and fair by default).

Both clients send requests of the same shape; the heavy one sends ``--ratio`` requests for
each of the light one's, interleaved in arrival order, all at the start, so both are
backlogged. Per client it reports output tokens per second while both were backlogged
(until the first of them ran out of requests) and when its last request finished.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import replace

from pagoda.benchmarks.progress import emit, note
from pagoda.engine.args import add_engine_args, engine_config_from_args


async def _run(config, args: argparse.Namespace) -> dict:
    from pagoda.engine.frontend.async_engine import AsyncEngine
    from pagoda.engine.frontend.output_processor import OutputKind
    from pagoda.engine.sampling_params import SamplingParams

    rng = random.Random(args.bench_seed)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    async with AsyncEngine(config) as engine:
        vocab = engine.model_config.vocab_size
        clients = []
        for _ in range(args.num_light):
            clients += ["heavy"] * args.ratio + ["light"]
        prompts = [[rng.randrange(1000, vocab) for _ in range(args.input_len)] for _ in clients]
        done: dict[str, list[float]] = {"heavy": [], "light": []}
        start = time.perf_counter()

        async def one(prompt: list[int], client: str) -> None:
            stream = engine.add_request(prompt, params, client=client, output_kind=OutputKind.FINAL)
            async for _ in engine.stream_outputs(stream):
                pass
            done[client].append(time.perf_counter() - start)

        await asyncio.gather(*(one(p, c) for p, c in zip(prompts, clients)))
    both_until = min(max(done["heavy"]), max(done["light"]))
    result = {"policy": config.scheduling_policy, "both_backlogged_s": both_until}
    every = sorted(done["heavy"] + done["light"])
    for client, times in done.items():
        served_early = sum(1 for t in times if t <= both_until)
        # NOTE: how many requests (both clients') had finished when this client's last did:
        # the order the policy served them in, free of the machine's speed.
        result[client] = {"requests": len(times), "last_finished_s": max(times),
                          "last_finished_after": every.index(max(times)),
                          "tokens_per_s_while_both_backlogged": served_early * args.output_len / both_until}
    return result


def run_fairness(args: argparse.Namespace) -> int:
    from pagoda.engine.frontend.llm import new_event_loop

    base = engine_config_from_args(args)
    results = []
    for policy in args.policies.split(","):
        note(args, f"{policy}: two clients, {args.ratio * args.num_light + args.num_light} requests ...")
        loop = new_event_loop()
        try:
            results.append(loop.run_until_complete(_run(replace(base, scheduling_policy=policy), args)))
        finally:
            loop.close()
        r = results[-1]
        emit(args, r, f"{policy}: both backlogged for {r['both_backlogged_s']:.1f} s; light client done after "
                      f"{r['light']['last_finished_s']:.1f} s, heavy after {r['heavy']['last_finished_s']:.1f} s")
    print(f"\nheavy client: {args.ratio * args.num_light} requests, light client: {args.num_light}, each "
          f"{args.input_len} prompt + {args.output_len} output tokens, max_num_seqs {base.max_num_seqs}")
    print(f"{'policy':<10}{'both backlogged s':>19}{'heavy tok/s':>13}{'light tok/s':>13}"
          f"{'heavy done s':>14}{'light done s':>14}")
    for r in results:
        h, li = r["heavy"], r["light"]
        print(f"{r['policy']:<10}{r['both_backlogged_s']:>19.1f}{h['tokens_per_s_while_both_backlogged']:>13.0f}"
              f"{li['tokens_per_s_while_both_backlogged']:>13.0f}{h['last_finished_s']:>14.1f}"
              f"{li['last_finished_s']:>14.1f}")
    return 0


def add_fairness_parser(bench_sub) -> None:
    p = bench_sub.add_parser("fairness", help="service per client when one client sends 10x the other's load, "
                                              "per scheduling policy")
    p.add_argument("--policies", default="fcfs,fair", help="comma-separated scheduling policies to compare")
    p.add_argument("--ratio", type=int, default=10, help="heavy client's requests per light client's request")
    p.add_argument("--num-light", type=int, default=8, help="the light client's requests")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--bench-seed", type=int, default=0)
    add_engine_args(p)
    p.set_defaults(func=run_fairness)
