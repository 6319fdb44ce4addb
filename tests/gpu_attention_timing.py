"""Times one decode step of attention per backend: batch 1 and 64, short and long contexts.

Part of tests/run_gpu_checks.sh (its table goes into gpu-summary.txt); on the CPU it runs
too (``--device cpu --backends naive,cpu_paged``), which is how the suite keeps it working.
Shape: a 7B-class layer (32 query heads, 8 KV heads, head size 128), bf16, blocks of 16,
the blocks of every request scattered over the cache.

Usage: python tests/gpu_attention_timing.py [--device cuda] [--backends a,b] [--iters N]
"""

from __future__ import annotations

import argparse
import time

import torch

from pagoda.attention_backends import AttentionMetadata, get_attention_backend

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


def decode_metadata(batch: int, context: int, device: torch.device, gen: torch.Generator) -> AttentionMetadata:
    blocks_per_req = -(-context // BLOCK_SIZE)
    tables = torch.randperm(batch * blocks_per_req, generator=gen).view(batch, blocks_per_req).to(torch.int32)
    slots = tables[:, (context - 1) // BLOCK_SIZE].long() * BLOCK_SIZE + (context - 1) % BLOCK_SIZE
    return AttentionMetadata(
        num_tokens=batch, query_lens=[1] * batch, seq_lens=[context] * batch,
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens_tensor=torch.full((batch,), context, dtype=torch.int32, device=device),
        block_tables=tables.to(device), slot_mapping=slots.to(device), block_size=BLOCK_SIZE, max_query_len=1,
        max_seq_len=context)


def time_decode(backend_name: str, batch: int, context: int, device: torch.device, iters: int) -> float:
    """Milliseconds of one layer's decode step (prepare once, forward ``iters`` times)."""
    gen = torch.Generator().manual_seed(0)
    backend = get_attention_backend(backend_name, device)(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
    metadata = decode_metadata(batch, context, device, gen)
    num_blocks = batch * -(-context // BLOCK_SIZE)
    cache = tuple(torch.randn(shape, generator=gen).to(device, torch.bfloat16)
                  for shape in backend.kv_cache_shapes(num_blocks, BLOCK_SIZE))
    query = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(device, torch.bfloat16)
    key, value = (torch.randn(batch, KV_HEADS, HEAD_DIM, generator=gen).to(device, torch.bfloat16) for _ in "kv")
    backend.prepare(metadata)
    backend.forward(query, key, value, cache, metadata)  # compiles, plans
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        backend.forward(query, key, value, cache, metadata)
    synchronize()
    return (time.perf_counter() - start) / iters * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--backends", default="naive,torch_sdpa,triton,flashinfer")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--contexts", default="512,4096")
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("decode attention timing: no CUDA device here, skipped")
        return
    print(f"decode attention, one layer ({HEADS} heads, {KV_HEADS} KV heads, head size {HEAD_DIM}, bf16, "
          f"blocks of {BLOCK_SIZE}) on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
          f"ms a step (mean of {args.iters})")
    cases = [(int(b), int(c)) for b in args.batches.split(",") for c in args.contexts.split(",")]
    print(f"{'backend':<12}" + "".join(f"{f'{b} x {c}':>14}" for b, c in cases))
    for name in args.backends.split(","):
        try:
            get_attention_backend(name, device)
        except (ValueError, ImportError) as exc:
            print(f"{name:<12}  not available: {exc}")
            continue
        print(f"{name:<12}" + "".join(f"{time_decode(name, b, c, device, args.iters):>14.3f}" for b, c in cases),
              flush=True)


if __name__ == "__main__":
    main()
