"""`pagoda bench cascade`: decode attention over a prefix every request shares, with and
without cascade attention (attention_backends/cpu_paged.py), in-process.

For each (requests, shared tokens) pair, a step of one decode row per request over the
shared blocks plus ``--own`` tokens of its own (``--apart`` of the requests over blocks of their
own instead, beside whom the cascade takes the others), through the cpu_paged backend as the model
calls it (write of the new keys, attention), over ``--layers`` layers' calls; the kernel
alone against the cascade (its shared part on the attention tiles where they run, AMX's,
AVX512-BF16's or AVX2's float32 ones, else by torch's flash attention). Shapes default to
SmolLM2-135M's (9 query heads, 3 KV heads, head_dim 64).
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

from pagoda.benchmarks.progress import emit, table

if TYPE_CHECKING:  # NOTE: torch loads when a bench runs, not when `pagoda --help` builds the parsers
    import torch


def _step(requests: int, shared: int, own: int, args: argparse.Namespace, gen: torch.Generator):
    """The backend, a filled cache, one decode step's metadata and inputs."""
    import torch

    from pagoda.attention_backends import cpu_paged
    from pagoda.attention_backends.base import AttentionMetadata

    bs, kv_heads, head_dim = args.block_size, args.num_kv_heads, args.head_dim
    context = shared + own
    per_request, shared_blocks = -(-context // bs), shared // bs
    apart = min(getattr(args, "apart", 0), requests)  # (the kv-cache-dtype bench has no --apart)
    num_blocks = shared_blocks + requests * (per_request - shared_blocks) + apart * shared_blocks + 1
    backend = cpu_paged.CpuPagedAttentionBackend(args.num_heads, kv_heads, head_dim, head_dim**-0.5)
    dtype = getattr(torch, args.dtype)
    key_cache = torch.randn(num_blocks, kv_heads, head_dim, bs, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, kv_heads, bs, head_dim, generator=gen).to(dtype)
    tables = torch.zeros(requests, per_request, dtype=torch.int32)
    tables[:, :shared_blocks] = torch.arange(shared_blocks, dtype=torch.int32)
    own_end = num_blocks - 1 - apart * shared_blocks
    tables[:, shared_blocks:] = torch.arange(shared_blocks, own_end, dtype=torch.int32).view(requests, -1)
    if apart and shared_blocks:
        tables[:apart, :shared_blocks] = torch.arange(own_end, num_blocks - 1, dtype=torch.int32).view(apart, -1)
    last = context - 1
    metadata = AttentionMetadata(
        num_tokens=requests, query_lens=[1] * requests, seq_lens=[context] * requests,
        query_start_loc=torch.arange(requests + 1, dtype=torch.int32),
        seq_lens_tensor=torch.full((requests,), context, dtype=torch.int32), block_tables=tables,
        slot_mapping=(tables[:, last // bs].long() * bs + last % bs), block_size=bs, max_query_len=1,
        max_seq_len=context)
    inputs = (torch.randn(requests, args.num_heads, head_dim, generator=gen).to(dtype),
              torch.randn(requests, kv_heads, head_dim, generator=gen).to(dtype),
              torch.randn(requests, kv_heads, head_dim, generator=gen).to(dtype))
    return backend, (key_cache, value_cache), metadata, inputs


def _time(backend, kv_cache, metadata, inputs, layers: int, repeats: int) -> float:
    backend.prepare(metadata)
    backend.forward(*inputs, kv_cache, metadata)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(layers):
            backend.forward(*inputs, kv_cache, metadata)
        best = min(best, time.perf_counter() - start)
    return best


def run_cascade_bench(args: argparse.Namespace) -> int:
    import torch

    from pagoda.attention_backends import cpu_paged

    gen = torch.Generator().manual_seed(0)
    saved = cpu_paged.CASCADE_MIN_REQUESTS, cpu_paged.CASCADE_MIN_TOKENS
    print(f"decode attention, {args.layers} layers, {args.dtype}, {args.num_heads} heads / {args.num_kv_heads} KV "
          f"heads x {args.head_dim}, {args.own} tokens of each request's own, {args.apart} apart; "
          f"ms (best of {args.repeats})")
    records = []
    try:
        for requests, shared in args.cases:
            backend, kv_cache, metadata, inputs = _step(requests, shared, args.own, args, gen)
            path = backend.tiles_for(getattr(torch, args.dtype)) or "torch"
            cpu_paged.CASCADE_MIN_REQUESTS = 0  # never
            kernel = _time(backend, kv_cache, metadata, inputs, args.layers, args.repeats)
            cpu_paged.CASCADE_MIN_REQUESTS, cpu_paged.CASCADE_MIN_TOKENS = 1, 1  # always
            cascade = _time(backend, kv_cache, metadata, inputs, args.layers, args.repeats)
            cpu_paged.CASCADE_MIN_REQUESTS, cpu_paged.CASCADE_MIN_TOKENS = saved
            taken = cpu_paged.find_shared_prefix(metadata, *cpu_paged.cascade_thresholds(
                None if path == "torch" else path, backend.torch_cascade_pays), subsets=path != "torch")
            record = {"requests": requests, "shared_tokens": shared, "apart": min(args.apart, requests),
                      "shared_part": path,
                      "kernel_ms": round(kernel * 1e3, 2), "cascade_ms": round(cascade * 1e3, 2),
                      "speedup": round(kernel / cascade, 2), "taken_by_default": taken is not None}
            records.append(record)
            emit(args, record, f"{requests} requests, {shared} shared tokens: kernel {record['kernel_ms']} ms, "
                               f"cascade {record['cascade_ms']} ms ({record['speedup']}x)")
    finally:
        cpu_paged.CASCADE_MIN_REQUESTS, cpu_paged.CASCADE_MIN_TOKENS = saved
    print()
    print(table(records, [("requests", "requests", "d"), ("shared", "shared_tokens", "d"), ("apart", "apart", "d"),
                          ("shared part", "shared_part", "s"), ("kernel ms", "kernel_ms", ".2f"),
                          ("cascade ms", "cascade_ms", ".2f"), ("speed-up", "speedup", ".2f"),
                          ("taken by default", "taken_by_default", "")]))
    return 0


def _cases(text: str) -> list[tuple[int, int]]:
    """"64x512,8x256" -> [(64, 512), (8, 256)]."""
    return [tuple(int(n) for n in case.split("x")) for case in text.split(",")]


def add_decode_step_args(p, repeats: int) -> None:
    """The flags of an in-process decode step's shape (SmolLM2-135M's by default)."""
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeats", type=int, default=repeats)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-heads", type=int, default=9)
    p.add_argument("--num-kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)


def add_cascade_bench_parser(bench_sub) -> None:
    p = bench_sub.add_parser("cascade", help="decode attention over a shared prefix, with and without cascade "
                                             "attention (CPU)")
    p.add_argument("--cases", type=_cases, default=_cases("64x512,64x256,64x128,32x512,16x512,8x512,8x256,2x1024"),
                   help="requests x shared tokens, comma-separated (shared tokens: a multiple of --block-size)")
    p.add_argument("--own", type=int, default=88, help="tokens of each request's own after the prefix")
    p.add_argument("--apart", type=int, default=0,
                   help="requests over blocks of their own in place of the prefix (the cascade takes the others)")
    add_decode_step_args(p, repeats=3)
    p.set_defaults(func=run_cascade_bench)
