"""Tensor parallelism in the worker: the torch.distributed group of the ranks.

How a model is split over ranks (heads, MLP, vocabulary) is in ``engine/tensor_parallel.py``,
which the engine process reads too.
"""

from __future__ import annotations

from datetime import timedelta

import torch

# The followers wait in the step broadcast for as long as the server is idle: no timeout that
# an idle night could reach (NCCL's watchdog and gloo's default give up after 10 and 30 minutes).
OBJECT_BROADCAST_TIMEOUT = timedelta(days=365)


class TensorParallelGroup:
    """This rank's view of the tensor-parallel group (a no-op when world_size is 1).

    Args:
        rank: This rank.
        world_size: Number of ranks.
        object_group: The gloo group (CPU) that carries the steps' Python objects.
    """

    def __init__(self, rank: int = 0, world_size: int = 1, object_group=None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.object_group = object_group

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
        torch.distributed.broadcast_object_list(holder, src=0, group=self.object_group)
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
    """Joins the process group (gloo on the CPU, NCCL on this rank's GPU on CUDA) when there is
    more than one rank, plus a gloo group without a timeout for the steps' objects (on CUDA
    they would otherwise go through NCCL, whose watchdog ends an idle server's followers)."""
    if world_size == 1:
        return TensorParallelGroup(rank, world_size)
    if device.type == "cuda":
        torch.distributed.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world_size,
                                             device_id=device)
    else:
        torch.distributed.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    objects = torch.distributed.new_group(backend="gloo", timeout=OBJECT_BROADCAST_TIMEOUT)
    return TensorParallelGroup(rank, world_size, objects)
