"""The machine's memory read rate, for the bandwidth floor of decoding.

A decoded token reads every weight of the model once (of a mixture of experts, its token's
experts): at batch 1 the step cannot be faster than those bytes over the rate at which the
cores read memory. `pagoda bench compare` measures the rate before each engine runs and after
both (on these shared machines it moves by tens of percent within minutes) and prints the floor
at the highest, beside the single stream's time per token.
"""

from __future__ import annotations

import time

#: Far above any L3 cache of these machines (32 MiB on AMD Zen, 300-480 MB on the Intel Xeons),
#: so that the sum reads DRAM.
BUFFER_BYTES = 2 << 30


def measure_read_rate(passes: int = 5, buffer_bytes: int = BUFFER_BYTES) -> float:
    """Bytes per second that this process's torch threads read from memory: the best of
    ``passes`` sums over a float32 buffer of ``buffer_bytes`` (a sum does little arithmetic
    per byte, so the read rate bounds it)."""
    import torch

    buffer = torch.ones(buffer_bytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        total = buffer.sum()
        best = min(best, time.perf_counter() - start)
    if total.item() != buffer.numel():  # the sum was computed, not elided
        raise RuntimeError("the read-rate sum came out wrong")
    del buffer
    return buffer_bytes / best


def floor_line(weight_bytes: int, read_rates: list[float], per_step: dict[str, float], workload: str) -> str:
    """``bandwidth floor: ... ms/step; <workload>: pagoda ... ms/step (1.20x the floor), ...``: the
    floor at the highest of the sitting's ``read_rates`` (the rate the machine showed it can read at);
    ``per_step`` is each engine's time over its decode steps (one a token of every row)."""
    rate = max(read_rates)
    floor = weight_bytes / rate
    parts = [f"{engine} {seconds * 1e3:.1f} ms/step ({seconds / floor:.2f}x the floor)"
             for engine, seconds in per_step.items()]
    spread = f"{min(read_rates) / 1e9:.1f}-{rate / 1e9:.1f} GB/s" if len(read_rates) > 1 else "once"
    return (f"bandwidth floor: {weight_bytes / 1e9:.2f} GB of weights read per step (Pagoda's) at {rate / 1e9:.1f} "
            f"GB/s, the highest read rate of the sitting (measured {spread}), = {floor * 1e3:.1f} ms/step; "
            f"{workload} (its prefill included): {', '.join(parts)}")
