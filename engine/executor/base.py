"""The Executor interface: how the engine drives its worker(s), whatever runs them.

One worker process (:class:`~pagoda.engine.executor.multiproc.WorkerProcess`), the
tensor-parallel ranks as processes (:class:`~pagoda.engine.executor.multiproc.WorkerGroup`)
or as Ray actors (:class:`~pagoda.engine.executor.ray.RayWorkerGroup`): the engine's step
loop sees one worker that takes steps in order and answers each.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from pagoda.engine.config import EngineConfig
from pagoda.engine.exceptions import WorkerDiedError
from pagoda.engine.messages import (DeviceMemory, KVCacheAllocation, RunnerOutput, SchedulerOutput, WorkerInit,
                                    WorkerReady)

# Decides the KV cache from what every rank measured of its device's memory (for a worker
# started with num_blocks None): the engine's part of that start.
SizeKVCache = Callable[[list[DeviceMemory]], KVCacheAllocation]


class Executor(Protocol):
    """A worker (or a group of ranks) driven like one.

    Attributes:
        ready: What the worker reported once it had loaded the model (None before).
    """

    ready: WorkerReady | None

    @property
    def pid(self) -> int | None:
        """The (first rank's) process id, where there is one."""

    @property
    def death(self) -> WorkerDiedError | None:
        """Why the worker is known to be dead; None while it is thought alive."""

    def is_alive(self) -> bool:
        """Whether every process of it runs."""

    async def start(self, size_kv: SizeKVCache | None = None) -> WorkerReady:
        """Starts the worker and waits until it has loaded the model and allocated the KV
        cache; where the init's num_blocks is None, ``size_kv`` decides that cache from the
        ranks' measurements in between.

        Raises:
            WorkerDiedError: It failed to start; the message holds its traceback.
        """

    def check(self) -> None:
        """Raises WorkerDiedError if the worker is known to be dead."""

    def send(self, scheduler_output: SchedulerOutput) -> None:
        """Sends one step without waiting for it (results come back in order)."""

    async def recv(self):
        """The next message: the RunnerOutput of the oldest step sent and not answered.

        Raises:
            WorkerDiedError: The worker is gone.
        """

    async def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """Sends one step and waits for its result."""

    def kill(self) -> None:
        """Kills the (first) worker process at once (for tests of worker deaths)."""

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Stops the worker: asks, then terminates, then kills; safe to call twice."""


def create_executor(init: WorkerInit, config: EngineConfig, on_death: Callable[[], None] | None = None) -> Executor:
    """The executor the configuration asks for.

    Args:
        init: What the worker loads.
        config: The engine configuration (``distributed_executor_backend``,
            ``tensor_parallel_size``).
        on_death: Called on the event loop when the worker is found dead, so that an
            idle engine notices at once, not at its next step.
    """
    if config.distributed_executor_backend == "ray":
        from pagoda.engine.executor.ray import RayWorkerGroup

        return RayWorkerGroup(init, config.tensor_parallel_size)
    from pagoda.engine.executor.multiproc import WorkerGroup, WorkerProcess

    if config.tensor_parallel_size > 1:
        return WorkerGroup(init, config.tensor_parallel_size, on_death=on_death)
    return WorkerProcess(init, on_death=on_death)
