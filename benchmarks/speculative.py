"""`pagoda bench speculative`: the same workloads with and without speculative decoding.

One sitting, one engine after the other (without, then with ``--speculative-config``),
fresh prompts for every run, median of ``--runs``:

* ``copy``: single stream, chat prompts that ask for a paragraph to be repeated, copied or
  its spelling fixed, answered until EOS (the answers copy from the prompt: where prompt
  lookup pays);
* ``random-greedy``: single stream, random token prompts, greedy (a small model often
  falls into loops here, which lookup also predicts);
* ``random-sampled``: single stream, random prompts, temperature 1 (text lookup cannot
  predict: what speculation costs when it does not pay);
* ``batch``: 64 random prompts of 256 tokens, 128 tokens each, greedy.

Reported: output tokens per second, the ratio with speculation to without, and the drafts
accepted.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import asdict

from pagoda.benchmarks.compare import cpu_line, describe_cpu
from pagoda.engine.args import add_engine_args, engine_config_from_args

TEXTS = [
    "Paged attention stores the keys and values of every sequence in fixed-size blocks that are allocated on "
    "demand, so no memory is reserved for tokens that are never generated.",
    "A block table maps the logical blocks of each sequence to physical ones, and sequences that start with the "
    "same prompt share the blocks of that prompt through copy-on-write.",
    "The scheduler decides at every step which requests run and how many tokens each one computes, within a "
    "budget of tokens per step and a budget of memory for the cache.",
    "When memory runs out, a running request is preempted: its blocks are either copied to the CPU and brought "
    "back later, or freed and computed again when it resumes.",
]
ASKS = ["Repeat the following text exactly, word for word:\n\n{}",
        "Fix the spelling mistakes in this text and write it out in full:\n\n{}",
        "Copy this paragraph:\n\n{}"]
WORKLOADS = ("copy", "random-greedy", "random-sampled", "batch")


def _prompts(llm, workload: str, run: int, seed: int) -> tuple[list, object]:
    from pagoda.engine.sampling_params import SamplingParams

    rng = random.Random(seed * 1000 + run)
    vocab = llm.engine.model_config.vocab_size
    if workload == "copy":
        # A paragraph of about 140 tokens (its sentences rotated run by run, so that no run
        # meets the last one's prompt in the cache), answered until EOS.
        shift = run % len(TEXTS)
        text = " ".join(TEXTS[shift:] + TEXTS[:shift])
        ask = ASKS[run % len(ASKS)]
        if "spelling" in ask:
            text = text.replace("allocated", "alocated").replace("scheduler", "schedular")
        ids = llm.apply_chat_template([{"role": "user", "content": ask.format(text)}])
        return [ids], SamplingParams(max_tokens=256, temperature=0)
    if workload == "batch":
        prompts = [[rng.randrange(1000, vocab) for _ in range(256)] for _ in range(64)]
        return prompts, SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    prompt = [[rng.randrange(1000, vocab) for _ in range(128)]]
    if workload == "random-greedy":
        return prompt, SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    return prompt, SamplingParams(max_tokens=128, temperature=1.0, seed=run, ignore_eos=True)


def _run_engine(args: argparse.Namespace, speculative: str | None, workloads: list[str]) -> dict:
    from pagoda.engine.frontend.llm import LLM
    from pagoda.engine.sampling_params import SamplingParams

    config = engine_config_from_args(args)
    config.speculative_config = speculative
    results = {}
    with LLM(**asdict(config)) as llm:
        llm.generate([[1000 + i for i in range(32)]], SamplingParams(max_tokens=8, temperature=0))  # warm-up
        for workload in workloads:
            stats = llm.engine.scheduler.stats
            drafts_before, accepted_before = stats.num_draft_tokens, stats.num_accepted_tokens
            rates = []
            for run in range(args.runs):
                prompts, params = _prompts(llm, workload, run, args.bench_seed)
                llm.reset_prefix_cache()
                start = time.perf_counter()
                outputs = llm.generate(prompts, params)
                seconds = time.perf_counter() - start
                rates.append(sum(len(o.outputs[0].token_ids) for o in outputs) / seconds)
            results[workload] = {"output_tokens_per_s": statistics.median(rates), "runs": rates,
                                 "draft_tokens": stats.num_draft_tokens - drafts_before,
                                 "accepted_tokens": stats.num_accepted_tokens - accepted_before}
    return results


def run_speculative(args: argparse.Namespace) -> int:
    workloads = args.workloads.split(",")
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        raise ValueError(f"unknown workload(s) {', '.join(unknown)}; known: {', '.join(WORKLOADS)}")
    cpu = describe_cpu()
    print(cpu_line(cpu), flush=True)
    without = _run_engine(args, None, workloads)
    with_spec = _run_engine(args, args.speculative, workloads)
    print(f"\nspeculative config {args.speculative}; median of {args.runs} runs, fresh prompts each")
    print(f"{'workload':<16}{'without tok/s':>14}{'with tok/s':>12}{'speed-up':>10}{'accepted':>16}")
    for workload in workloads:
        a, b = without[workload], with_spec[workload]
        ratio = b["output_tokens_per_s"] / a["output_tokens_per_s"]
        accepted = f"{b['accepted_tokens']}/{b['draft_tokens']}"
        print(f"{workload:<16}{a['output_tokens_per_s']:>14.1f}{b['output_tokens_per_s']:>12.1f}{ratio:>9.2f}x"
              f"{accepted:>16}")
        b["speedup"] = ratio
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"cpu": cpu, "speculative_config": args.speculative, "without": without,
                       "with": with_spec}, f, indent=2)
    return 0


def add_speculative_bench_parser(bench_sub) -> None:
    p = bench_sub.add_parser("speculative", help="the same workloads with and without speculative decoding")
    p.add_argument("--speculative", default='{"method": "ngram", "num_speculative_tokens": 4}',
                   help="the speculative config to measure (JSON)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {', '.join(WORKLOADS)}")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--bench-seed", type=int, default=0)
    p.add_argument("--output", default=None, help="write the figures as JSON here")
    add_engine_args(p)
    p.set_defaults(func=run_speculative)
