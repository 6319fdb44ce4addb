"""EngineCore: the inner loop of the engine: schedule, execute, update, and the worker's
supervision.

It owns the scheduler and the executor (the worker process, or the group of ranks) and
nothing of the caller's: no tokenizer, no streams. What a step produces goes to an
:class:`OutputSink` (the frontend's output processor), which also says which requests
a stop string finished. The asyncio client around it (``frontend/async_engine.py``)
validates requests, fans out ``n`` and hands out streams.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from contextlib import suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pagoda.engine.config import EngineConfig
from pagoda.engine.core.request import Request, RequestStatus
from pagoda.engine.core.scheduler import RequestUpdate, Scheduler
from pagoda.engine.kv_events import KVEventBatch, KVEventLog
from pagoda.engine.exceptions import EngineBusyError, EngineDeadError, StepError, WorkerDiedError
from pagoda.engine.messages import RunnerOutput, SchedulerOutput, WorkerReady

if TYPE_CHECKING:
    from pagoda.engine.executor.base import Executor, SizeKVCache

logger = logging.getLogger(__name__)


class StepObserver(Protocol):
    """Watches the step loop from outside (benchmarks: ``pagoda bench step-time``)."""

    def sent(self, scheduler_output: SchedulerOutput) -> None:
        """A step went to the worker (called before the next schedule())."""

    def answered(self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput) -> None:
        """The worker answered a step (called before its results are applied)."""


class OutputSink(Protocol):
    """Where the core sends what happens to requests (the frontend's OutputProcessor)."""

    def process(self, updates: list[RequestUpdate]) -> Iterable[Request]:
        """Takes a step's new tokens; returns the requests a stop string finished."""

    def finish_sample(self, request: Request) -> None:
        """A request finished (its status says how)."""

    def fail(self, request: Request, error: BaseException) -> None:
        """A request failed with ``error``."""

    def fail_all(self, error: BaseException) -> list[str]:
        """Every request failed with ``error``; returns their ids."""


@dataclass(slots=True)
class StepStats:
    """Where the time of the engine's steps went, summed over steps (for benchmarks).

    Attributes:
        num_steps: Steps whose results came back.
        schedule_seconds: Engine time building steps (schedule()).
        update_seconds: Engine time applying results (update, detokenizing, streams).
        worker_compute_seconds: Worker time running steps.
        worker_idle_seconds: Worker time waiting for its next step: the engine
            overhead that is on the critical path.
        max_in_flight: Most steps sent and not yet answered at once.
    """

    num_steps: int = 0
    schedule_seconds: float = 0.0
    update_seconds: float = 0.0
    worker_compute_seconds: float = 0.0
    worker_idle_seconds: float = 0.0
    max_in_flight: int = 0

    def record(self, runner_output: RunnerOutput, update_seconds: float) -> None:
        self.num_steps += 1
        self.update_seconds += update_seconds
        self.worker_compute_seconds += runner_output.compute_seconds
        self.worker_idle_seconds += runner_output.idle_seconds


class EngineCore:
    """The scheduler and the executor, and the loop that runs steps between them.

    Built by :meth:`launch`, once the first worker is ready and the KV cache is sized.

    Args:
        config: The engine configuration (restart budget).
        scheduler: The scheduler (with its KV cache manager and policy).
        worker: The started executor.
        wakeup: The event the loop waits on, which ``worker`` sets when it dies.
        make_executor: Builds a fresh executor (also after a worker death); it is given
            the callback to run when the worker is found dead.
        sink: Receives the requests' tokens, finishes and failures.
        async_scheduling: Schedule step N+1 while the worker runs step N.
        kv_events: The block pool's event log and its publisher, or None.
    """

    def __init__(self, config: EngineConfig, scheduler: Scheduler, worker: Executor, wakeup: asyncio.Event,
                 make_executor: Callable[[Callable[[], None]], Executor], sink: OutputSink,
                 async_scheduling: bool, kv_events: tuple[KVEventLog, object] | None = None) -> None:
        self.config = config
        self.scheduler = scheduler
        self.sink = sink
        self.async_scheduling = async_scheduling
        self._make_executor = make_executor
        self.worker = worker
        self._pending_aborts: set[str] = set()
        self._wakeup = wakeup
        self._loop_task: asyncio.Task | None = None
        self.dead: BaseException | None = None
        self._restart_times: list[float] = []
        self.standby: Executor | None = None  # the next worker's process, started ahead
        self.num_worker_restarts = 0
        self.worker_restart_seconds = 0.0  # from each death noticed to its replacement ready, summed
        # (when the last worker death was noticed, when its replacement was ready), time.time()
        self.last_restart: tuple[float, float] | None = None
        self.step_stats = StepStats()
        #: Told of every step sent and answered, when set.
        self.step_observer: StepObserver | None = None
        # KV events (engine/kv_events.py): the block pool's log and the publisher, or None.
        self.kv_events = kv_events
        # The sleep level (1 or 2) while asleep (sleep()), else 0.
        self.sleeping = 0

    # -- lifecycle --------------------------------------------------------------------

    @classmethod
    async def launch(cls, config: EngineConfig, make_executor: Callable[[Callable[[], None]], Executor],
                     make_scheduler: Callable[[], tuple[Scheduler, tuple[KVEventLog, object] | None]],
                     sink: OutputSink, async_scheduling: bool,
                     size_kv: SizeKVCache | None = None) -> tuple[EngineCore, WorkerReady]:
        """Starts the first worker, then builds the core and starts its loop; returns the
        core and what the worker reported.

        Args:
            make_scheduler: The scheduler over the sized KV cache, with the KV events' log
                and publisher (or None); called once the worker is ready, when the cache
                is sized.
            size_kv: Where the worker sizes the KV cache from its device's memory: decides
                it from what the worker measured.
            Others: as the constructor's.

        Raises:
            WorkerDiedError: The worker failed to start (it is stopped).
        """
        wakeup = asyncio.Event()
        worker = make_executor(wakeup.set)
        try:
            ready = await worker.start(size_kv)
            scheduler, kv_events = make_scheduler()
        except BaseException:  # NOTE: also cancelled: no worker outlives a start that failed
            await worker.shutdown()
            raise
        core = cls(config, scheduler, worker, wakeup, make_executor, sink, async_scheduling, kv_events)
        core._spawn_standby()
        core._loop_task = asyncio.get_running_loop().create_task(core._run_loop(), name="pagoda-engine-loop")
        return core, ready

    async def shutdown(self) -> None:
        """Stops the loop, fails whatever is still running, and stops the worker."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            with suppress(asyncio.CancelledError):
                await self._loop_task
            self._loop_task = None
        self._fail_all(EngineDeadError("the engine was shut down"))
        await self._stop_standby()
        await self.worker.shutdown()
        if self.kv_events is not None:
            self.kv_events[1].shutdown()
            self.kv_events = None

    async def sleep(self, level: int) -> None:
        """Frees the worker's memory until wake_up(): its process (the KV cache, the prefix
        cache and, whatever the level, the weights: on the CPU there is no other memory to keep
        them in) and a standby's; the loop waits. Does nothing when asleep already.

        Raises:
            EngineBusyError: Requests are running or waiting.
        """
        if self.sleeping:
            return
        if self.scheduler.has_unfinished_requests():
            raise EngineBusyError(f"{self.scheduler.num_running + self.scheduler.num_waiting} requests are in the "
                                  "engine; sleep once they have finished")
        self.sleeping = level
        await self.worker.shutdown()
        await self._stop_standby()
        self.scheduler.reset_after_worker_loss()  # NOTE: the (empty) cache's blocks, and the prefix cache, are gone
        if self.kv_events is not None:
            self._publish_kv_events()
        logger.info("asleep (level %d): the worker stopped", level)

    async def wake_up(self) -> WorkerReady | None:
        """Starts a new worker after sleep(); returns what it reported (None when awake already).

        Raises:
            WorkerDiedError: The worker failed to start (the engine stays asleep).
        """
        if not self.sleeping:
            return None
        start = time.perf_counter()
        worker = self._make_executor(self._wakeup.set)
        ready = await worker.start()
        self.worker = worker
        self.sleeping = 0
        self._spawn_standby()
        self._wakeup.set()
        logger.info("awake: a new worker (pid %s) in %.1f s", worker.pid, time.perf_counter() - start)
        return ready

    def _spawn_standby(self) -> None:
        """Starts the next worker's process ahead when config.standby_worker says so (see
        EngineConfig), for the executors that can (processes, not Ray actors)."""
        if self.config.standby_worker and self.standby is None:
            standby = self._make_executor(self._wakeup.set)
            if not hasattr(standby, "spawn"):
                return
            try:
                standby.spawn()
            except OSError as exc:  # e.g. out of processes or memory: serving goes on without one
                logger.warning("could not start a standby worker: %s", exc)
                return
            self.standby = standby
            logger.info("standby worker started (pid %s) for the next restart", standby.pid)

    async def _stop_standby(self) -> None:
        standby, self.standby = self.standby, None
        if standby is not None:
            await standby.shutdown(timeout=1.0)

    @property
    def is_running(self) -> bool:
        return self._loop_task is not None and self.dead is None

    @property
    def dead_reason(self) -> str:
        """Why the engine stopped serving ("" while it runs)."""
        if self.dead is None:
            return "" if self._loop_task is not None else "it has not been started"
        return str(self.dead)

    def check_running(self) -> None:
        """Raises EngineDeadError unless the loop runs."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine is not running: {self.dead}")
        if self._loop_task is None:
            raise EngineDeadError("the engine has not been started")

    # -- requests ---------------------------------------------------------------------

    def add_request(self, request: Request, forks: list[Request]) -> None:
        """Queues an admitted request (and the samples that fork from it)."""
        self.scheduler.add_request(request, forks=forks)
        self._wakeup.set()

    def abort(self, request_ids: Iterable[str]) -> None:
        """Aborts requests by id; they free their blocks before the next step."""
        self._pending_aborts.update(request_ids)
        self._wakeup.set()

    # -- the loop ---------------------------------------------------------------------

    async def _run_loop(self) -> None:
        """Runs steps; when the worker dies, restarts it (within the budget) and goes on."""
        while True:
            try:
                try:
                    await self._run_steps()
                except WorkerDiedError as exc:
                    if not await self._restart_worker(exc):
                        return
            except Exception as exc:  # a bug in the loop (or the restart) must not leave requests hanging
                logger.exception("engine loop crashed")
                self.dead = exc
                self._fail_all(EngineDeadError(f"the engine loop crashed: {exc!r}"))
                return

    async def _run_steps(self) -> None:
        """The step loop. With async scheduling, step N+1 is scheduled and sent while the
        worker runs step N, so the worker never waits for the engine's bookkeeping."""
        scheduler, worker, stats = self.scheduler, self.worker, self.step_stats
        # Steps sent and not answered yet, each with whether the engine had been idle
        # (no work at all) before it: the worker's wait for such a step is not overhead.
        in_flight: deque[tuple[SchedulerOutput, bool]] = deque()
        depth = 2 if self.async_scheduling else 1
        was_idle = True
        while True:
            if (self.sleeping or self.worker is not worker) and not in_flight:
                # NOTE: asleep, no worker: nothing runs until wake_up(); then _run_loop runs the
                # steps again, on the new worker.
                while self.sleeping:
                    self._wakeup.clear()
                    await self._wakeup.wait()
                return
            if (not in_flight and not scheduler.has_unfinished_requests() and not self._pending_aborts
                    and not scheduler.has_kv_work()):
                self._wakeup.clear()
                await self._wakeup.wait()
                was_idle = True
                if self.sleeping or self.worker is not worker:
                    continue  # NOTE: put to sleep (or woken) meanwhile: the worker changed
            worker.check()
            self._apply_aborts()
            if len(in_flight) < depth:
                start = time.perf_counter()
                scheduler_output = scheduler.schedule()
                sent = scheduler_output.has_work
                if sent:
                    worker.send(scheduler_output)
                    in_flight.append((scheduler_output, was_idle))
                    stats.max_in_flight = max(stats.max_in_flight, len(in_flight))
                    was_idle = False
                stats.schedule_seconds += time.perf_counter() - start
                if sent and self.step_observer is not None:
                    self.step_observer.sent(scheduler_output)
                if not in_flight:
                    await asyncio.sleep(0.001)  # nothing runnable yet; do not spin
                    was_idle = True
                    continue
                if sent and len(in_flight) < depth:
                    continue  # keep the worker's queue full before waiting for a result
            runner_output = await worker.recv()
            step, after_idle = in_flight.popleft()
            if self.step_observer is not None:
                self.step_observer.answered(step, runner_output)
            start = time.perf_counter()
            if runner_output.error is not None:
                self._fail_step(step, runner_output.error, [s for s, _ in in_flight])
            else:
                self._process_updates(scheduler.update(step, runner_output))
            if after_idle:
                runner_output.idle_seconds = 0.0
            if self.kv_events is not None:
                self._publish_kv_events()
            stats.record(runner_output, time.perf_counter() - start)

    def _publish_kv_events(self) -> None:
        """The events of the steps scheduled and updated since the last call, as one batch."""
        log, publisher = self.kv_events
        events = log.take()
        if events:
            publisher.publish(KVEventBatch(time.time(), events))

    async def _restart_worker(self, exc: WorkerDiedError) -> bool:
        """Starts a new worker after ``exc`` and re-queues every request for recompute.

        Returns:
            False when the restart budget is spent (the engine is then dead).
        """
        detected = time.time()
        while True:
            if not self._take_restart(exc):
                await self.worker.shutdown(timeout=1.0)
                await self._stop_standby()
                return False
            await self.worker.shutdown(timeout=1.0)
            # NOTE: the KV cache and the swap space died with the worker: every request
            # starts over from its tokens so far (the prompt and the output already streamed).
            self.scheduler.reset_after_worker_loss()
            standby, self.standby = self.standby, None
            if standby is not None and not standby.is_alive():  # killed meanwhile: not worth a restart
                await standby.shutdown(timeout=1.0)
                standby = None
            self.worker = standby or self._make_executor(self._wakeup.set)
            try:
                ready = await self.worker.start()
            except WorkerDiedError as start_exc:
                exc = start_exc
                continue
            self.last_restart = (detected, time.time())
            self.worker_restart_seconds += self.last_restart[1] - detected
            logger.info("worker restarted (pid %s%s) in %.1f s%s", self.worker.pid, ", the standby" if standby else "",
                        self.last_restart[1] - detected,
                        f" (model compiled in {ready.compile_seconds:.1f} s: {ready.compiled})"
                        if ready.compile_seconds else "")
            self._spawn_standby()
            self._wakeup.set()
            return True

    def _take_restart(self, exc: WorkerDiedError) -> bool:
        """Counts one restart against the budget (max_worker_restarts per window)."""
        config = self.config
        now = time.monotonic()
        self._restart_times = [t for t in self._restart_times if now - t < config.worker_restart_window]
        if len(self._restart_times) >= config.max_worker_restarts:
            logger.error("worker died: %s; it was restarted %d times in the last %d s, giving up", exc,
                         len(self._restart_times), config.worker_restart_window)
            self.dead = EngineDeadError(
                f"{exc}; it was restarted {len(self._restart_times)} times in {config.worker_restart_window} s "
                "(--max-worker-restarts), so the engine gave up")
            self._fail_all(self.dead)
            return False
        self._restart_times.append(now)
        self.num_worker_restarts += 1
        logger.error("worker died: %s; restarting it (restart %d), %d requests will be recomputed", exc,
                     self.num_worker_restarts, len(self.scheduler.requests))
        return True

    def _apply_aborts(self) -> None:
        for request_id in self._pending_aborts:
            request = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
            if request is not None:
                self.sink.finish_sample(request)
        self._pending_aborts.clear()

    def _process_updates(self, updates: list[RequestUpdate]) -> None:
        for request in self.sink.process(updates):
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
            self.sink.finish_sample(request)

    def _fail_step(self, step: SchedulerOutput, error: str, later_steps: list[SchedulerOutput]) -> None:
        """Fails the requests of a step that failed in the worker.

        The steps sent after it may have read K/V the failed step never wrote (a prefix-cache
        hit on its blocks), so their requests are failed too; failures are rare and this
        keeps every output trustworthy.
        """
        logger.error("step failed in the worker:\n%s", error)
        step_error = StepError(f"the model step failed: {error.strip().splitlines()[-1]}")
        self.scheduler.discard_step(step)
        request_ids = [*step.num_scheduled_tokens, *(r for s in later_steps for r in s.num_scheduled_tokens)]
        for request_id in request_ids:
            request = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ERROR)
            if request is not None:
                self.sink.fail(request, step_error)

    def _fail_all(self, error: BaseException) -> None:
        # NOTE: every stream learns of the error first, so none hangs if cleaning up
        # the scheduler below fails too.
        for request_id in self.sink.fail_all(error):
            try:
                self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ERROR)
            except Exception:
                logger.exception("could not clean up request %s", request_id)
