"""Tensor parallelism on torch.distributed: the process group, and how a model is split.

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

import torch


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


class TensorParallelGroup:
    """This rank's view of the tensor-parallel group (a no-op when world_size is 1).

    Args:
        rank: This rank.
        world_size: Number of ranks.
    """

    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        self.rank = rank
        self.world_size = world_size

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums ``x`` over ranks, in place."""
        if self.world_size > 1:
            torch.distributed.all_reduce(x)
        return x

    def all_gather_last_dim(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Concatenates every rank's ``x`` (``sizes[r]`` wide on rank r) along the last dim."""
        if self.world_size == 1:
            return x
        width = max(sizes)
        padded = torch.nn.functional.pad(x, (0, width - x.shape[-1])).contiguous()
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, padded)
        return torch.cat([part[..., :size] for part, size in zip(parts, sizes)], dim=-1)

    def broadcast_object(self, obj=None):
        """Rank 0's ``obj`` on every rank."""
        if self.world_size == 1:
            return obj
        holder = [obj]
        torch.distributed.broadcast_object_list(holder, src=0)
        return holder[0]

    def synchronize(self) -> None:
        """Waits until this rank's collectives are done (NCCL only queues them on the GPU)."""
        if self.world_size > 1 and torch.distributed.get_backend() == "nccl":
            torch.cuda.synchronize()

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's tensor into ``x`` on every rank."""
        if self.world_size > 1:
            torch.distributed.broadcast(x, src=0)
        return x


def init_tensor_parallel(rank: int, world_size: int, init_method: str | None,
                         device: torch.device) -> TensorParallelGroup:
    """Joins the process group (gloo on the CPU, NCCL on CUDA) when there is more than one rank."""
    if world_size > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        torch.distributed.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    return TensorParallelGroup(rank, world_size)
