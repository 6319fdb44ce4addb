"""`pagoda bench lora`: what serving LoRA adapters costs, against the base model alone.

The same number of requests (64 by default, random prompts, greedy, a fixed output length) run
on the base model alone, then spread round-robin over 1, 4 and 16 adapters (``--adapters``),
in one engine and one sitting; the table gives output tokens per second and each run's ratio
to the base model's. The adapters are written by the benchmark: random A and B of ``--rank``
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
import tempfile
import time
from pathlib import Path

from pagoda.benchmarks.progress import emit, note, table
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


async def _run(args: argparse.Namespace) -> list[dict]:
    from pagoda.engine.frontend.async_engine import AsyncEngine
    from pagoda.engine.frontend.output_processor import OutputKind
    from pagoda.engine.sampling_params import SamplingParams

    args.enable_lora = True
    args.max_loras = args.max_loras or max(args.adapters)
    args.max_lora_rank = max(args.max_lora_rank, args.rank)
    config = engine_config_from_args(args)
    rng = random.Random(args.bench_seed)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    results = []

    async def run(engine, names: list[str | None]) -> tuple[float, int]:
        vocab = engine.model_config.vocab_size
        prompts = [[rng.randrange(1000, vocab) for _ in range(args.input_len)] for _ in names]
        start = time.perf_counter()

        async def one(prompt, name):
            final = None
            stream = engine.add_request(prompt, params, output_kind=OutputKind.FINAL, lora_name=name)
            async for final in engine.stream_outputs(stream):
                pass
            return len(final.outputs[0].token_ids)

        tokens = sum(await asyncio.gather(*(one(p, n) for p, n in zip(prompts, names))))
        return time.perf_counter() - start, tokens

    note(args, f"starting the engine on {config.model or 'the default model'} ({config.max_loras} LoRA slots) ...")
    async with AsyncEngine(config) as engine:
        directory = Path(args.adapter_dir or tempfile.mkdtemp(prefix="pagoda-bench-lora-"))
        shape = engine.model_config
        names = []
        for i in range(max(args.adapters)):
            path = directory / f"{shape.architecture}-{shape.hidden_size}x{shape.num_hidden_layers}-r{args.rank}-{i}"
            if not (path / "adapter_model.safetensors").is_file():
                write_random_adapter(shape, path, args.rank, tuple(args.targets), seed=i)
            await engine.load_lora_adapter(f"bench-{i}", str(path))
            names.append(f"bench-{i}")
        note(args, f"{len(names)} adapters of rank {args.rank} on {', '.join(args.targets)} in {directory}; warming up")
        await run(engine, [None, *names[:3]] * 2)
        base_rate = None
        for count in [0, *args.adapters]:
            spread = [None] * args.num_requests if count == 0 else [names[i % count] for i in range(args.num_requests)]
            seconds, tokens = await run(engine, spread)
            rate = tokens / seconds
            base_rate = base_rate or rate
            record = {"adapters": count, "label": "base model" if count == 0 else f"{count} adapter{'s' * (count > 1)}",
                      "requests": args.num_requests, "seconds": seconds, "output_tokens": tokens,
                      "tokens_per_s": rate, "ratio": rate / base_rate}
            results.append(record)
            emit(args, record, f"{record['label']}: {args.num_requests} requests in {seconds:.2f} s, "
                               f"{rate:.1f} output tokens/s ({rate / base_rate:.2f}x the base model's)")
    return results


def run_lora(args: argparse.Namespace) -> int:
    from pagoda.engine.frontend.llm import new_event_loop

    loop = new_event_loop()
    try:
        results = loop.run_until_complete(_run(args))
    finally:
        loop.close()
    print(f"\n{args.num_requests} requests x ({args.input_len} prompt + {args.output_len} output), adapters of rank "
          f"{args.rank} on {len(args.targets)} projections; ratio: tokens/s over the base model's")
    print(table(results, [("run", "label", ""), ("seconds", "seconds", ".2f"), ("tokens/s", "tokens_per_s", ".1f"),
                          ("ratio", "ratio", ".2f")]))
    return 0


def add_lora_bench_parser(bench_sub) -> None:
    p = bench_sub.add_parser("lora", help="requests spread over 1, 4 and 16 LoRA adapters against the base model "
                                          "alone (tokens/s ratios)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--adapters", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16],
                   help="adapter counts to spread the requests over (default 1,4,16)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--targets", nargs="+", default=list(ALL_TARGETS), choices=ALL_TARGETS)
    p.add_argument("--adapter-dir", default=None, help="where the random adapters are written (default: a new "
                                                       "temporary directory)")
    p.add_argument("--bench-seed", type=int, default=0)
    add_engine_args(p)
    p.set_defaults(func=run_lora, max_loras=None)  # NOTE: None: the largest of --adapters
