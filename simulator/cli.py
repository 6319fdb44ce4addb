"""`pagoda simulate`: a trace through the engine's own scheduler and plugins on a step-time
model (see docs/simulate.md)."""

from __future__ import annotations

import argparse
import itertools
import json
import resource
import sys
from dataclasses import replace
from pathlib import Path

from pagoda.engine.config import DEFAULT_KV_CACHE_BYTES, KV_CACHE_DTYPES, EngineConfig

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def add_simulate_parser(sub) -> None:
    p = sub.add_parser("simulate", help="simulate serving a trace with the real scheduler on a step-time model",
                       description="Runs a request trace through Pagoda's own scheduler, KV cache manager and "
                                   "plugins, with the worker replaced by a step-time model of a device.")
    p.add_argument("--model", default="llama-3-8b",
                   help="a model directory, a config.json, or a named shape (default llama-3-8b; see docs)")
    p.add_argument("--device", default="h200",
                   help="h100, h200, a100, l4 (rooflines), cpu (a roofline of this CPU, probed) or a profile "
                        "file from `pagoda bench step-time`")
    t = p.add_argument_group("trace (a file, or a synthetic one)")
    t.add_argument("--trace", default=None, help="JSONL (arrival, prompt_len, output_len, ...) or an Azure LLM "
                                                 "inference trace CSV")
    t.add_argument("--limit", type=int, default=None, help="only the first N requests of --trace")
    t.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply every arrival time (0.5: the same trace at twice the rate), e.g. to fit a "
                        "cluster's trace to one replica")
    t.add_argument("--num-requests", type=int, default=1000)
    t.add_argument("--request-rate", type=float, default=10.0, help="requests per second (inf: all at once)")
    t.add_argument("--arrival", choices=["poisson", "gamma"], default="poisson")
    t.add_argument("--burstiness", type=float, default=1.0, help="gamma arrivals' coefficient of variation")
    t.add_argument("--prompt-len", default="lognormal:512:1.0", help="N, A-B or lognormal:MEDIAN:SIGMA")
    t.add_argument("--output-len", default="lognormal:128:1.0", help="N, A-B or lognormal:MEDIAN:SIGMA")
    t.add_argument("--prefix-groups", type=int, default=0, help="groups of requests sharing a prompt prefix")
    t.add_argument("--prefix-len", type=int, default=0, help="tokens a group shares")
    t.add_argument("--prefix-fraction", type=float, default=0.0, help="fraction of requests in a group")
    t.add_argument("--prefix-zipf", type=float, default=0.0,
                   help="popularity of the groups: Zipf with this exponent (0: uniform)")
    t.add_argument("--priorities", type=int, default=1, help="priorities drawn from 0 .. N-1")
    t.add_argument("--clients", type=int, default=0, help="clients drawn uniformly (for the fair policy)")
    t.add_argument("--retain-prefixes", action="store_true",
                   help="grouped requests ask to keep their cached blocks (kv_retention 1)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--save-trace", default=None, metavar="FILE", help="write the trace used as JSONL")
    e = p.add_argument_group("the engine simulated (as `pagoda serve`'s flags)")
    e.add_argument("--scheduling-policy", default="fcfs", help="one or several, comma-separated: fcfs,priority,shortest-prompt-first,fair")
    e.add_argument("--eviction-policy", default="lru", help="one or several, comma-separated: lru,retention-priority")
    e.add_argument("--plugin", dest="plugins", action="append", default=[], metavar="MODULE:OBJECT")
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--max-num-seqs", type=int, default=256)
    e.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="step token budget (default: 8192 on a GPU device, 2048 on cpu, the profile's on a "
                        "measured one)")
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    e.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    e.add_argument("--preemption-mode", default="auto", choices=["auto", "swap", "recompute"])
    e.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule a step while one runs (default: on for GPU devices, off on cpu, as measured "
                        "for a profile)")
    e.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    e.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES))
    e.add_argument("--kv-cache-gib", type=float, default=None,
                   help="KV cache per device (default: from --gpu-memory-utilization on a GPU device)")
    e.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    e.add_argument("--swap-space", type=float, default=4.0, help="GiB of host swap space per replica")
    e.add_argument("--kv-offload-gib", default="0",
                   help="the prefix cache's offload tier (disk or host memory, as its read rate says) per replica, "
                        "in GiB; comma-separated to compare, e.g. 0,64 (0: off)")
    e.add_argument("--kv-offload-read-gbps", type=float, default=0.5,
                   help="how fast the disk tier reads back, GB/s (default 0.5: a CPU server's page cache as "
                        "`pagoda bench kv-offload` measured it)")
    e.add_argument("--tensor-parallel-size", type=int, default=1)
    e.add_argument("--data-parallel-size", type=int, default=1)
    o = p.add_argument_group("output")
    o.add_argument("--slo", default=None, help="goodput targets, e.g. ttft=2,tpot=100ms")
    o.add_argument("--output", default=None, metavar="FILE", help="JSON with every run's summary and time series")
    o.add_argument("--plot", default=None, metavar="DIR", help="write latency CDF and KV usage PNGs here")
    o.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None)
    p.set_defaults(func=run_simulate)


def _trace(args):
    from pagoda.simulator.trace import load_trace, save_trace, synthetic_trace

    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    if args.trace:
        trace = load_trace(args.trace, args.limit)
    else:
        trace = synthetic_trace(args.num_requests, args.request_rate, args.prompt_len, args.output_len, args.arrival,
                                args.burstiness, args.prefix_groups, args.prefix_len, args.prefix_fraction,
                                args.priorities, args.clients, args.retain_prefixes, seed=args.seed,
                                prefix_zipf=args.prefix_zipf)
    if not args.time_scale > 0:
        raise ValueError(f"--time-scale must be > 0, got {args.time_scale}")
    if args.time_scale != 1.0:
        for request in trace:
            request.arrival *= args.time_scale
    if args.save_trace:
        save_trace(trace, args.save_trace)
    return trace


def build(args) -> tuple[EngineConfig, object, object, object]:
    """The engine configuration, the KV cache size, the step-time model and the model's shape."""
    from pagoda.engine.core.kv_sizing import size_kv_cache
    from pagoda.simulator.model_shapes import load_model_shape
    from pagoda.simulator.step_time import FittedProfile, Roofline, load_step_time

    for name, low in (("tensor_parallel_size", 1), ("data_parallel_size", 1), ("block_size", 1)):
        if getattr(args, name) < low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    if args.kv_cache_gib is not None and not args.kv_cache_gib > 0:
        raise ValueError(f"--kv-cache-gib must be > 0, got {args.kv_cache_gib}")
    model = load_model_shape(args.model)
    dtype_bytes = _DTYPE_BYTES[args.dtype]
    kv_dtype_bytes = dtype_bytes if args.kv_cache_dtype == "auto" else 1  # the fp8 formats
    step_time = load_step_time(args.device, model, args.block_size, dtype_bytes, kv_dtype_bytes,
                               args.tensor_parallel_size)
    measured = isinstance(step_time, FittedProfile)
    on_gpu = isinstance(step_time, Roofline) and step_time.device.memory_bytes > 0
    if measured:
        kv_dtype_bytes = step_time.kv_dtype_bytes
    async_scheduling = args.async_scheduling
    if async_scheduling is None:  # as the engine: on for CUDA; measured profiles say what ran
        async_scheduling = bool(step_time.fit.get("async_scheduling", False)) if measured else on_gpu
    budget = args.max_num_batched_tokens
    if budget is None:
        budget = int(step_time.fit.get("max_num_batched_tokens", 2048)) if measured else 8192 if on_gpu else 2048
    if args.kv_cache_gib is not None:
        kv_bytes = int(args.kv_cache_gib * 1024**3)
    elif on_gpu:
        kv_bytes = step_time.kv_cache_bytes(args.gpu_memory_utilization)
    else:
        kv_bytes = DEFAULT_KV_CACHE_BYTES
    config = EngineConfig(
        block_size=args.block_size, kv_cache_bytes=kv_bytes, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=budget,
        enable_chunked_prefill=args.enable_chunked_prefill, enable_prefix_caching=args.enable_prefix_caching,
        preemption_mode=args.preemption_mode, async_scheduling=async_scheduling,
        tensor_parallel_size=args.tensor_parallel_size, data_parallel_size=args.data_parallel_size,
        swap_space_bytes=int(args.swap_space * 1024**3), plugins=tuple(args.plugins))
    kv = size_kv_cache(config, model, kv_dtype_bytes)
    return config, kv, step_time, model


def _gib_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--kv-offload-gib takes GiB, comma-separated (0: off); got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise ValueError(f"--kv-offload-gib takes GiB >= 0, comma-separated; got {text!r}")
    return values


def run_simulate(args) -> int:
    from pagoda.engine.core.plugin_manager import check_policy_names, create_plugin_manager
    from pagoda.engine.core.policy import Policy
    from pagoda.simulator import report
    from pagoda.simulator.simulator import Simulation, SimulationError

    try:
        slo = report.SLO.parse(args.slo)
        policies = [p.strip() for p in args.scheduling_policy.split(",") if p.strip()]
        evictions = [p.strip() for p in args.eviction_policy.split(",") if p.strip()]
        tiers = _gib_list(args.kv_offload_gib)
        if not args.kv_offload_read_gbps > 0:
            raise ValueError(f"--kv-offload-read-gbps must be > 0, got {args.kv_offload_read_gbps}")
        config, kv, step_time, model = build(args)
        manager = create_plugin_manager(config.plugins)
        for policy, eviction in itertools.product(policies, evictions):
            check_policy_names(manager, policy, eviction)
        trace = _trace(args)
        for path in (args.output, args.save_trace):
            if path and not Path(path).resolve().parent.is_dir():
                raise ValueError(f"cannot write {path}: its folder does not exist")
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"model {args.model}: {model.num_hidden_layers} layers, hidden {model.hidden_size}; {step_time.describe()}")
    print(f"KV cache {kv.num_blocks:,} blocks x {kv.block_size} = {kv.num_tokens:,} tokens per replica, "
          f"max_model_len {kv.max_model_len:,}, budget {config.max_num_batched_tokens} tokens, "
          f"max_num_seqs {config.max_num_seqs}, async scheduling {'on' if config.async_scheduling else 'off'}, "
          f"{config.data_parallel_size} replica(s); trace: {len(trace):,} requests over "
          f"{trace[-1].arrival:,.1f} s")
    results, summaries = [], []
    for policy, eviction, tier_gib in itertools.product(policies, evictions, tiers):
        run_config = replace(config, scheduling_policy=policy, eviction_policy=eviction,
                             kv_offload_host_bytes=int(tier_gib * 1024**3) if tier_gib else None)

        def make_policy(policy=policy, eviction=eviction):
            return Policy(create_plugin_manager(config.plugins), policy, eviction)

        simulation = Simulation(run_config, kv, step_time, make_policy, model.vocab_size,
                                kv_offload_read_bytes_per_s=args.kv_offload_read_gbps * 1e9)
        try:
            result = simulation.run(trace, progress=args.progress)
        except SimulationError as exc:
            print(f"error: {policy}/{eviction}: {exc}", file=sys.stderr)
            return 1
        summary = report.summarize(result, slo)
        result.itl = result.itl[:0]  # NOTE: summarized; every token's gap is the largest array
        results.append(result)
        summaries.append(summary)
        label = f"{policy}/{eviction}" + (f", disk tier {tier_gib:g} GiB" if tier_gib else "")
        print(f"{label}: {summary['finished']:,} requests in {summary['duration_s']:,.1f} simulated s "
              f"({summary['rejected_too_long']:,} rejected: prompt and output over max_model_len), "
              f"{summary['steps']:,} steps, {summary['wall_s']:.1f} s wall "
              f"({summary['simulated_requests_per_wall_s']:,.0f} requests/s)")
    print()
    print(report.table(summaries))
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if args.output:
        data = {"model": args.model, "device": step_time.describe(), "trace": args.trace or "synthetic",
                "num_requests": len(trace), "kv_blocks": kv.num_blocks, "block_size": kv.block_size,
                "max_num_batched_tokens": config.max_num_batched_tokens, "max_num_seqs": config.max_num_seqs,
                "peak_memory_mib": round(peak_mib, 1),
                "runs": [{**s, "time_series": report.time_series(r)} for s, r in zip(summaries, results)]}
        with open(args.output, "w") as f:
            json.dump(data, f, indent=1)
        print(f"\nwrote {args.output}")
    if args.plot:
        try:
            files = report.plot(results, args.plot, f"{args.model} on {args.device}")
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print("plots: " + ", ".join(str(f) for f in files))
    print(f"peak memory {peak_mib:,.0f} MiB")
    return 0
