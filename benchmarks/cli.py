"""`pagoda bench`: the benchmark subcommands."""

from __future__ import annotations


def add_bench_parser(sub) -> None:
    from pagoda.benchmarks.cascade import add_cascade_bench_parser
    from pagoda.benchmarks.compare import add_compare_parser
    from pagoda.benchmarks.fairness import add_fairness_parser
    from pagoda.benchmarks.kv import add_kv_bench_parsers
    from pagoda.benchmarks.kv_dtype import add_kv_dtype_bench_parser
    from pagoda.benchmarks.kv_offload import add_kv_offload_bench_parser
    from pagoda.benchmarks.linear import add_linear_bench_parser
    from pagoda.benchmarks.lora import add_lora_bench_parser
    from pagoda.benchmarks.overhead import add_overhead_parser
    from pagoda.benchmarks.plugins import add_plugins_bench_parser
    from pagoda.benchmarks.progress import add_json_flag
    from pagoda.benchmarks.random_model import add_random_model_parser
    from pagoda.benchmarks.scoring import add_scoring_bench_parser
    from pagoda.benchmarks.serve import add_serve_bench_parser
    from pagoda.benchmarks.speculative import add_speculative_bench_parser
    from pagoda.benchmarks.step_time import add_step_time_bench_parser
    from pagoda.benchmarks.throughput import add_throughput_parser

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    add_compare_parser(bench_sub)
    add_throughput_parser(bench_sub)
    add_kv_bench_parsers(bench_sub)
    add_plugins_bench_parser(bench_sub)
    add_overhead_parser(bench_sub)
    add_fairness_parser(bench_sub)
    add_linear_bench_parser(bench_sub)
    add_cascade_bench_parser(bench_sub)
    add_kv_dtype_bench_parser(bench_sub)
    add_scoring_bench_parser(bench_sub)
    add_serve_bench_parser(bench_sub)
    add_speculative_bench_parser(bench_sub)
    add_step_time_bench_parser(bench_sub)
    add_random_model_parser(bench_sub)
    add_lora_bench_parser(bench_sub)
    add_kv_offload_bench_parser(bench_sub)
    for name in ("compare", "throughput", "kv-utilization", "preemption", "overhead", "fairness", "linear", "cascade",
                 "kv-cache-dtype", "lora", "kv-offload"):
        add_json_flag(bench_sub.choices[name])
