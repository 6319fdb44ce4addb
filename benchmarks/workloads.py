"""Benchmark workloads: prompts as token ids plus output lengths, drawn fresh per run.

Every run of a workload draws its own prompts (from a seed that changes per run), so no
run reuses the previous run's prefix cache; within a run, sharing is part of the
workload (shared-prefix).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

# NOTE: token ids away from the low ids where tokenizers keep special tokens.
_LOWEST_ID = 1000


@dataclass(frozen=True, slots=True)
class Workload:
    """A named way of drawing a batch of requests.

    Attributes:
        name: Short name used on the command line.
        description: One line for reports.
        kind: "random", "shared-prefix" or "chat".
        count: Number of requests.
        input_len: Prompt length (random), or shared prefix length (shared-prefix), or
            the median prompt length (chat).
        output_len: Tokens generated per request (median for chat).
        suffix_len: Unique tokens after the shared prefix (shared-prefix only).
    """

    name: str
    description: str
    kind: str
    count: int
    input_len: int
    output_len: int
    suffix_len: int = 0

    def draw(self, seed: int, vocab_size: int) -> tuple[list[list[int]], list[int]]:
        """One run's prompts and output lengths."""
        rng = random.Random(seed)

        def tokens(n: int) -> list[int]:
            return [rng.randrange(_LOWEST_ID, vocab_size) for _ in range(n)]

        if self.kind == "random":
            return [tokens(self.input_len) for _ in range(self.count)], [self.output_len] * self.count
        if self.kind == "shared-prefix":
            prefix = tokens(self.input_len)
            return [prefix + tokens(self.suffix_len) for _ in range(self.count)], [self.output_len] * self.count
        if self.kind == "chat":
            # Long-tailed lengths, like chat traffic: log-normal around the medians, clipped.
            inputs = [_lognormal(rng, self.input_len, 0.9, 16, 6 * self.input_len) for _ in range(self.count)]
            outputs = [_lognormal(rng, self.output_len, 0.8, 8, 4 * self.output_len) for _ in range(self.count)]
            return [tokens(n) for n in inputs], outputs
        raise ValueError(f"unknown workload kind {self.kind!r}")

    @property
    def max_len(self) -> int:
        """The longest prompt plus output the workload can draw."""
        if self.kind == "chat":
            return 6 * self.input_len + 4 * self.output_len
        return self.input_len + self.suffix_len + self.output_len


def _lognormal(rng: random.Random, median: int, sigma: float, low: int, high: int) -> int:
    return max(low, min(high, round(median * math.exp(rng.gauss(0.0, sigma)))))


WORKLOADS = {
    w.name: w
    for w in (
        Workload("random", "64 x 256 random prompt -> 128 out", "random", 64, 256, 128),
        Workload("shared-prefix", "64 x (512 shared prefix + 64 unique) -> 64 out", "shared-prefix", 64, 512, 64,
                 suffix_len=64),
        Workload("single", "1 x 128 -> 128 out (single stream)", "random", 1, 128, 128),
        Workload("batch8", "8 x 128 random prompt -> 128 out (small batch)", "random", 8, 128, 128),
        Workload("chat", "64 chat-like: prompts ~200 (long tail to 1200), outputs ~100 (to 400)", "chat", 64, 200,
                 100),
        Workload("prefill", "64 x 256 random prompt -> 1 out (prefill only)", "random", 64, 256, 1),
    )
}
