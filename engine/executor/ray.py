"""The Ray executor: the same ranks as Ray actors, placed by a placement group.

``--distributed-executor-backend ray`` runs each tensor-parallel rank (one, without
tensor parallelism) as a Ray actor that builds the same ModelRunner as a worker process.
The actors are placed with a placement group (one bundle per rank: a CPU, or a GPU on
CUDA, packed onto as few nodes as possible) on the Ray cluster that ``ray.init()`` finds:
the one at ``RAY_ADDRESS`` when it is set, else a local one started here. Rank 0 takes
each step as an actor call, hands it to the other ranks over torch.distributed (they sit
in a long-running ``follow`` call) and returns the tokens.

Ray is an optional extra: ``pip install 'pagoda[ray]'``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING

from pagoda.engine.exceptions import WorkerDiedError
from pagoda.engine.messages import (KVCacheAllocation, RunnerOutput, SchedulerOutput, WorkerInit, WorkerMemory,
                                    WorkerReady)
from pagoda.engine.platform import resolve_device

if TYPE_CHECKING:
    from pagoda.engine.executor.base import SizeKVCache

logger = logging.getLogger(__name__)


class RankActor:
    """One rank in a Ray worker process (wrapped with ray.remote when the group starts)."""

    def rendezvous(self) -> str:
        """``tcp://ip:port`` on this actor's node, for torch.distributed (asked of rank 0)."""
        import ray

        from pagoda.engine.executor.multiproc import free_port

        return f"tcp://{ray.util.get_node_ip_address()}:{free_port()}"

    def start(self, init: WorkerInit) -> WorkerReady | WorkerMemory:
        from pagoda.engine.worker.main import build_runner, ready_message

        self.runner = build_runner(init)
        if self.runner.kv_caches is None:  # sized from the device's memory: allocate() follows
            return WorkerMemory(self.runner.measure_memory())
        return ready_message(self.runner)

    def allocate(self, allocation: KVCacheAllocation) -> WorkerReady:
        from pagoda.engine.worker.main import ready_message

        self.runner.allocate(allocation)
        return ready_message(self.runner)

    def execute(self, step: SchedulerOutput) -> RunnerOutput:
        from pagoda.engine.worker.main import run_step

        return run_step(self.runner, step)

    def follow(self) -> None:
        from pagoda.engine.worker.main import follow

        follow(self.runner)

    def stop(self) -> None:
        from pagoda.engine.messages import Shutdown

        self.runner.tp.broadcast_object(Shutdown())


class RayWorkerGroup:
    """The ranks as Ray actors, driven like one worker (see the module docstring).

    Args:
        init: What to load; rank, world size and rendezvous are filled in per rank.
        world_size: Number of ranks.
    """

    def __init__(self, init: WorkerInit, world_size: int) -> None:
        self._init = init
        self._world_size = world_size
        self._actors: list = []
        self._placement_group = None
        self._pending: deque = deque()
        self._follow: list = []
        self._death: WorkerDiedError | None = None
        self.ready: WorkerReady | None = None

    @property
    def pid(self) -> int | None:
        return self.ready.pid if self.ready else None

    @property
    def death(self) -> WorkerDiedError | None:
        return self._death

    def is_alive(self) -> bool:
        return bool(self._actors) and self._death is None

    async def start(self, size_kv: SizeKVCache | None = None) -> WorkerReady:
        try:
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError as exc:
            raise WorkerDiedError("the ray executor needs Ray: pip install 'pagoda[ray]'") from exc
        if not ray.is_initialized():
            ray.init(log_to_driver=False)
        # NOTE: Ray shows each actor its own GPU only (as cuda:0): ranks take no offset there.
        on_gpu = resolve_device(self._init.config.device).type == "cuda"
        bundle = {"GPU": 1, "CPU": 1} if on_gpu else {"CPU": 1}
        self._placement_group = placement_group([bundle] * self._world_size, strategy="PACK")
        await self._placement_group.ready()
        actor_class = ray.remote(RankActor)
        self._actors = [
            actor_class.options(
                num_cpus=1, num_gpus=1 if on_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._placement_group,
                                                                    placement_group_bundle_index=rank),
            ).remote()
            for rank in range(self._world_size)
        ]
        try:
            method = await self._actors[0].rendezvous.remote() if self._world_size > 1 else None
            starts = [actor.start.remote(replace(self._init, rank=rank, world_size=self._world_size,
                                                 dist_init_method=method))
                      for rank, actor in enumerate(self._actors)]
            results = await asyncio.gather(*starts)
        except Exception as exc:  # ray.exceptions.RayTaskError carries the rank's traceback
            await self.shutdown()
            raise WorkerDiedError(f"the worker failed to start:\n{exc}") from exc
        if isinstance(results[0], WorkerMemory):
            try:
                allocation = size_kv([r.memory for r in results])  # a configuration's error as it is
            except BaseException:
                await self.shutdown()
                raise
            try:
                results = await asyncio.gather(*(actor.allocate.remote(allocation) for actor in self._actors))
            except Exception as exc:
                await self.shutdown()
                raise WorkerDiedError(f"the worker failed to start:\n{exc}") from exc
        self._follow = [actor.follow.remote() for actor in self._actors[1:]]
        self.ready = results[0]
        return self.ready

    def check(self) -> None:
        if self._death is None and self._follow:
            import ray

            done, _ = ray.wait(self._follow, timeout=0)
            if done:
                self._death = WorkerDiedError("a tensor-parallel rank (a Ray actor) stopped")
        if self._death is not None:
            raise self._death

    def send(self, scheduler_output: SchedulerOutput) -> None:
        self.check()
        self._pending.append(self._actors[0].execute.remote(scheduler_output))

    async def recv(self) -> RunnerOutput:
        import ray

        try:
            return await self._pending.popleft()
        except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError) as exc:
            self._death = WorkerDiedError(f"the worker (a Ray actor) died: {exc}")
            raise self._death from exc

    async def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        self.send(scheduler_output)
        return await self.recv()

    def kill(self) -> None:
        import ray

        if self._actors:
            ray.kill(self._actors[0])

    async def shutdown(self, timeout: float = 5.0) -> None:
        import ray

        if self._actors and self._death is None and self._world_size > 1 and self.ready is not None:
            try:
                await asyncio.wait_for(self._actors[0].stop.remote(), timeout)
            except Exception:  # noqa: BLE001 - the actors are killed below anyway
                logger.debug("stopping the ranks failed", exc_info=True)
        for actor in self._actors:
            ray.kill(actor)
        self._actors = []
        if self._placement_group is not None:
            ray.util.remove_placement_group(self._placement_group)
            self._placement_group = None
