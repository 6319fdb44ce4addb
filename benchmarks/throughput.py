"""`pagoda bench throughput`: offline generation throughput, with transformers as baseline.

Every figure is measured in the same process and reported with its ratio to the
baseline, so results compare across machines.
"""

from __future__ import annotations

import argparse
import gc
import random
import time

from pagoda.benchmarks.progress import emit, note
from pagoda.engine.args import add_engine_args, engine_config_from_args


def random_prompts(num_requests: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Random token ids, away from the low ids where tokenizers keep special tokens."""
    rng = random.Random(seed)
    return [[rng.randrange(1000, vocab_size) for _ in range(input_len)] for _ in range(num_requests)]


def bench_pagoda(args: argparse.Namespace, dtype: str, prompts: list[list[int]]) -> dict:
    from dataclasses import asdict

    from pagoda.engine.frontend.llm import LLM
    from pagoda.engine.sampling_params import SamplingParams

    config = engine_config_from_args(args)
    config.dtype = dtype
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    with LLM(**asdict(config)) as llm:
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))  # warm-up
        steps_before = llm.engine.scheduler.stats.num_steps
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        num_steps = llm.engine.scheduler.stats.num_steps - steps_before
        preemptions = llm.engine.scheduler.stats.num_preemptions
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"engine": "pagoda", "dtype": dtype, "seconds": elapsed, "output_tokens": num_out,
            "output_tokens_per_s": num_out / elapsed, "steps": num_steps, "preemptions": preemptions}


def bench_transformers(args: argparse.Namespace, dtype: str, prompts: list[list[int]]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from pagoda.engine.model_loader import float_checkpoint, resolve_model

    model_dir = float_checkpoint(resolve_model(args.model))
    torch_dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch_dtype).eval()
    batch = args.hf_batch_size or len(prompts)
    num_out = 0
    with torch.inference_mode():
        model.generate(torch.tensor(prompts[:2]), max_new_tokens=4, do_sample=False)  # warm-up
        start = time.perf_counter()
        for i in range(0, len(prompts), batch):
            ids = torch.tensor(prompts[i : i + batch])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.output_len,
                                 min_new_tokens=args.output_len, do_sample=False, pad_token_id=0)
            num_out += (out.shape[1] - ids.shape[1]) * ids.shape[0]
        elapsed = time.perf_counter() - start
    del model
    gc.collect()
    return {"engine": "transformers", "dtype": dtype, "seconds": elapsed, "output_tokens": num_out,
            "output_tokens_per_s": num_out / elapsed, "batch_size": batch}


def run_throughput(args: argparse.Namespace) -> int:
    from pagoda.engine.model_loader import resolve_model
    from pagoda.engine.model_config import ModelConfig

    vocab_size = ModelConfig.from_dir(resolve_model(args.model)).vocab_size
    prompts = random_prompts(args.num_requests, args.input_len, vocab_size, args.bench_seed)
    results = []
    for dtype in args.dtypes.split(","):
        engines = [("pagoda", bench_pagoda)] + ([("transformers", bench_transformers)] if args.compare_transformers
                                                else [])
        for engine, bench in engines:
            note(args, f"{engine} {dtype}: {args.num_requests} requests ...")
            results.append(bench(args, dtype, prompts))
            r = results[-1]
            emit(args, r, f"{engine} {dtype}: {r['seconds']:.2f} s, {r['output_tokens_per_s']:.1f} output tok/s")
    baseline = next((r for r in results if r["engine"] == "transformers"), results[0])
    print(f"\n{args.num_requests} requests x ({args.input_len} prompt + {args.output_len} output) tokens")
    print(f"{'engine':<14}{'dtype':<10}{'seconds':>9}{'out tok/s':>11}{'vs ' + baseline['engine'] + ' ' + baseline['dtype']:>30}")
    for r in results:
        ratio = r["output_tokens_per_s"] / baseline["output_tokens_per_s"]
        print(f"{r['engine']:<14}{r['dtype']:<10}{r['seconds']:>9.2f}{r['output_tokens_per_s']:>11.1f}{ratio:>29.2f}x")
    return 0


def add_throughput_parser(bench_sub) -> None:
    tp = bench_sub.add_parser("throughput", help="offline throughput on random prompts")
    tp.add_argument("--num-requests", type=int, default=64)
    tp.add_argument("--input-len", type=int, default=256)
    tp.add_argument("--output-len", type=int, default=128)
    tp.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated dtypes to run")
    tp.add_argument("--compare-transformers", action=argparse.BooleanOptionalAction, default=True)
    tp.add_argument("--hf-batch-size", type=int, default=None, help="transformers batch (default: all)")
    tp.add_argument("--bench-seed", type=int, default=0)
    add_engine_args(tp)
    tp.set_defaults(func=run_throughput)
