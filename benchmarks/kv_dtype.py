"""`pagoda bench kv-cache-dtype`: decode attention over a bfloat16 cache against an fp8 one
(the engine's kv_cache_dtype), in-process, through the cpu_paged backend as the model calls it.

For each (requests, context tokens) case: one decode row per request over its own blocks,
``--layers`` layers' calls (write of the new keys, attention), each layer with a cache of its
own as in the model (one cache called 30 times would sit in the CPU's last-level cache); the
best of ``--repeats``. Bytes read are the cache's bytes of every request's context; an fp8
cache holds half of them.
Shapes default to SmolLM2-135M's (9 query heads, 3 KV heads, head_dim 64).
"""

from __future__ import annotations

import argparse
import time

from pagoda.benchmarks.progress import emit, table
from pagoda.benchmarks.cascade import _cases, _step, add_decode_step_args
from pagoda.engine.config import KV_CACHE_DTYPES

DEFAULT_DTYPES = ["auto", "fp8_e4m3", "fp8_e5m2"]


def run_kv_dtype_bench(args: argparse.Namespace) -> int:
    import torch  # NOTE: here, not at import: `pagoda --help` builds this parser without torch

    from pagoda.engine.platform import resolve_kv_cache_dtype

    gen = torch.Generator().manual_seed(0)
    print(f"decode attention, {args.layers} layers, {args.dtype} queries, {args.num_heads} heads / "
          f"{args.num_kv_heads} KV heads x {args.head_dim}; ms (best of {args.repeats}), ratio to the "
          f"{args.kv_cache_dtypes[0]} cache")
    records = []
    for requests, context in args.cases:
        backend, (key_cache, value_cache), metadata, inputs = _step(requests, 0, context, args, gen)
        backend.prepare(metadata)
        baseline = None
        for name in args.kv_cache_dtypes:
            dtype = resolve_kv_cache_dtype(name) or key_cache.dtype
            caches = [(key_cache.to(dtype), value_cache.to(dtype)) for _ in range(args.layers)]
            backend.forward(*inputs, caches[0], metadata)
            seconds = float("inf")
            for _ in range(args.repeats):
                start = time.perf_counter()
                for kv_cache in caches:
                    backend.forward(*inputs, kv_cache, metadata)
                seconds = min(seconds, time.perf_counter() - start)
            del caches
            baseline = baseline or seconds
            read = 2 * requests * context * args.num_kv_heads * args.head_dim * dtype.itemsize
            record = {"requests": requests, "context": context, "kv_cache_dtype": name,
                      "ms": _figure(seconds * 1e3), "speedup": round(baseline / seconds, 2),
                      "cache_gb_per_s": _figure(read * args.layers / seconds / 1e9)}
            records.append(record)
            emit(args, record, f"{requests} requests x {context} tokens, {name} cache: {record['ms']} ms, "
                               f"{record['speedup']}x, {record['cache_gb_per_s']} GB/s")
    print()
    print(table(records, [("requests", "requests", "d"), ("context", "context", "d"), ("KV cache", "kv_cache_dtype", "s"),
                          ("ms", "ms", ""), ("speed-up", "speedup", ".2f"), ("cache GB/s", "cache_gb_per_s", "")]))
    return 0


def _dtypes(text: str) -> list[str]:
    names = text.split(",")
    unknown = [n for n in names if n not in KV_CACHE_DTYPES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown KV cache dtype {unknown[0]!r}; known: {', '.join(KV_CACHE_DTYPES)}")
    return names


def add_kv_dtype_bench_parser(bench_sub) -> None:
    p = bench_sub.add_parser("kv-cache-dtype", help="decode attention over a bfloat16 KV cache against an fp8 one "
                                                    "(CPU)")
    p.add_argument("--cases", type=_cases, default=_cases("64x256,64x512,64x1024,16x2048,1x4096"),
                   help="requests x context tokens, comma-separated")
    p.add_argument("--kv-cache-dtypes", type=_dtypes, default=DEFAULT_DTYPES,
                   help="comma-separated, the first is the baseline (default auto,fp8_e4m3,fp8_e5m2)")
    add_decode_step_args(p, repeats=5)
    p.set_defaults(func=run_kv_dtype_bench)


def _figure(value: float) -> float:
    """Three significant digits (a small case's time or rate never rounds to 0)."""
    return float(f"{value:.3g}")
