"""The built-in preemption-mode chooser: swap a victim out, or drop it and recompute."""

from __future__ import annotations

# NOTE: measured with `pagoda bench preemption` (docs/kv-cache.md): on the CPU, copying a
# token's K/V out and back costs about 1/100 of prefilling it again, so swapping wins for
# every victim that holds at least one full block; below that, the copy round trip's
# fixed cost is not worth it.
MIN_SWAP_TOKENS = 16


def choose_preemption_mode(*, num_computed_tokens: int, num_blocks: int, num_free_cpu_blocks: int,
                           min_swap_tokens: int = MIN_SWAP_TOKENS) -> str:
    """Decides how to preempt one victim.

    Args:
        num_computed_tokens: Tokens whose K/V the victim holds (what recompute redoes).
        num_blocks: Blocks the victim holds (what swapping copies, twice).
        num_free_cpu_blocks: Free blocks in the CPU swap space.
        min_swap_tokens: Below this many computed tokens, recompute.

    Returns:
        "swap" or "recompute".
    """
    if num_blocks <= num_free_cpu_blocks and num_computed_tokens >= min_swap_tokens:
        return "swap"
    return "recompute"
