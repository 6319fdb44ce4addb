"""Tensor parallelism: how a model is split over ranks (pure arithmetic, read by both processes).

Each rank is a worker process with its own share of the model and of every KV block:

* attention heads are split by KV-head groups (a rank holds whole groups, so its query
  heads still map onto its KV heads evenly); with fewer KV heads than ranks, each rank
  takes an equal share of the query heads and a copy of the one KV head they read;
* the MLP's intermediate size and the vocabulary are split as evenly as they go;
* q/k/v and gate/up are column-parallel (each rank computes its slice of the outputs),
  o_proj and down_proj row-parallel (each rank computes a partial sum, all-reduced);
* the embedding is vocab-parallel (each rank looks up its rows, the results are summed)
  and so is the LM head (each rank computes its slice of the logits, gathered on all).

The engine sends each step to rank 0 only, which broadcasts it to the other ranks; the
block tables stay the engine's one truth, and every rank applies the same step to its own
share of the blocks. Rank 0 samples and broadcasts the sampled tokens so that every rank
keeps the same token ids. The backend is gloo on the CPU and NCCL on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass


def even_split(size: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, end) of rank's share of ``size`` items; the first ranks take one more."""
    base, extra = divmod(size, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


@dataclass(frozen=True, slots=True)
class HeadShare:
    """The attention heads of one rank: query heads [q_start, q_end), KV heads [kv_start, kv_end)."""

    q_start: int
    q_end: int
    kv_start: int
    kv_end: int

    @property
    def num_heads(self) -> int:
        return self.q_end - self.q_start

    @property
    def num_kv_heads(self) -> int:
        return self.kv_end - self.kv_start


def head_share(num_heads: int, num_kv_heads: int, rank: int, world_size: int) -> HeadShare:
    """Splits attention heads over ranks (see the module docstring).

    Raises:
        ValueError: The heads cannot be split over ``world_size`` ranks.
    """
    group = num_heads // num_kv_heads
    if num_kv_heads >= world_size:
        kv_start, kv_end = even_split(num_kv_heads, rank, world_size)
        return HeadShare(kv_start * group, kv_end * group, kv_start, kv_end)
    if world_size % num_kv_heads or num_heads % world_size:
        raise ValueError(f"cannot split {num_heads} query heads and {num_kv_heads} KV heads over "
                         f"{world_size} tensor-parallel ranks")
    per_rank = num_heads // world_size
    q_start = rank * per_rank
    kv = q_start // group
    return HeadShare(q_start, q_start + per_rank, kv, kv + 1)
