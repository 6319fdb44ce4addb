"""`pagoda bench scoring`: what scoring a prompt costs next to running it.

One engine, one sitting, the same random prompts (``--num-requests`` x ``--input-len``)
run three ways in turn, ``--runs`` times each (the median is reported):

* ``prefill``: a plain generation of one token (what every request pays for its prompt);
* ``embed``: ``LLM.embed`` (the prompt pooled into one vector);
* ``prompt_logprobs``: one token with ``prompt_logprobs=--num-top`` (the LM head over
  every prompt position, log-softmax, ranks and the top tokens).

Prompt tokens per second of each, and each one's ratio to ``prefill``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict

from pagoda.benchmarks.compare import cpu_line, describe_cpu
from pagoda.benchmarks.throughput import random_prompts
from pagoda.engine.args import add_engine_args, engine_config_from_args

MODES = ("prefill", "embed", "prompt_logprobs")


def run_scoring(args: argparse.Namespace) -> int:
    from pagoda.engine.frontend.llm import LLM
    from pagoda.engine.sampling_params import SamplingParams

    config = engine_config_from_args(args)
    cpu = describe_cpu()
    print(cpu_line(cpu))
    with LLM(**asdict(config)) as llm:
        vocab = llm.engine.model_config.vocab_size
        prompts = random_prompts(args.num_requests, args.input_len, vocab, args.bench_seed)
        one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        scored = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, prompt_logprobs=args.num_top)
        # NOTE: distinct prompts each run, so no run is served from the prefix cache.
        runs = {
            "prefill": lambda batch: llm.generate(batch, one),
            "embed": lambda batch: llm.embed(batch),
            "prompt_logprobs": lambda batch: llm.generate(batch, scored),
        }
        for mode in MODES:  # warm-up
            runs[mode](random_prompts(2, args.input_len, vocab, args.bench_seed + 999))
        seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
        for run in range(args.runs):
            for i, mode in enumerate(MODES):
                batch = random_prompts(args.num_requests, args.input_len, vocab, args.bench_seed + 10 * run + i + 1)
                start = time.perf_counter()
                runs[mode](batch)
                seconds[mode].append(time.perf_counter() - start)
    num_tokens = args.num_requests * args.input_len
    rows = {mode: {"seconds": statistics.median(s), "prompt_tokens_per_s": num_tokens / statistics.median(s),
                   "runs": s} for mode, s in seconds.items()}
    base = rows["prefill"]["prompt_tokens_per_s"]
    print(f"{args.num_requests} x {args.input_len} prompt tokens, {config.dtype}, median of {args.runs}")
    print(f"{'mode':<16} {'seconds':>8} {'prompt tok/s':>13} {'vs prefill':>11}")
    for mode, row in rows.items():
        row["ratio_to_prefill"] = row["prompt_tokens_per_s"] / base
        print(f"{mode:<16} {row['seconds']:>8.2f} {row['prompt_tokens_per_s']:>13.0f} {row['ratio_to_prefill']:>10.2f}x")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"cpu": cpu, "num_requests": args.num_requests, "input_len": args.input_len,
                       "num_top": args.num_top, "dtype": config.dtype, "pooling": config.pooling, "modes": rows},
                      f, indent=2)
    return 0


def add_scoring_bench_parser(bench_sub) -> None:
    p = bench_sub.add_parser("scoring", help="embeddings and prompt logprobs against a plain prefill")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--num-top", type=int, default=1, help="top logprobs per prompt token")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--bench-seed", type=int, default=0)
    p.add_argument("--output", default=None, help="write the figures as JSON here")
    add_engine_args(p)
    p.set_defaults(func=run_scoring)
