"""AsyncEngine: the asyncio core loop that the offline LLM class and the server share.

The loop pulls new requests, asks the scheduler for a step, awaits the worker, applies
the result and pushes text to each request's stream. While the worker computes, the
event loop is free to serve HTTP, tokenize and stream.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import suppress
from dataclasses import dataclass, replace

import pluggy

from attention_backends import get_attention_backend
from engine.config import EngineConfig
from engine.distributed import head_share
from engine.executor import WorkerDiedError, WorkerGroup, WorkerProcess
from engine.kv_cache_manager import KVCacheManager
from engine.messages import RunnerOutput, SchedulerOutput, WorkerInit
from engine.model_loader import load_tokenizer, resolve_model
from engine.models.config import ModelConfig
from engine.output_processor import OutputKind, OutputProcessor, RequestStream, StepError
from engine.outputs import RequestOutput
from engine.platform import resolve_device, resolve_dtype
from engine.plugin_manager import check_policy_names, create_plugin_manager, plugin_names
from engine.policy import Policy
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The worker died; the engine cannot serve any more requests."""


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


class AsyncEngine:
    """The engine: scheduler and KV cache manager here, the model in a worker process.

    Use ``await engine.start()`` (or ``async with engine``), then ``generate()``.

    Args:
        config: The engine configuration.
        plugin_manager: Plugins to use; by default one is built from the config
            (built-ins, installed entry points, then ``config.plugins``).
    """

    def __init__(self, config: EngineConfig, plugin_manager: pluggy.PluginManager | None = None) -> None:
        self.config = config
        self.plugin_manager = plugin_manager
        self.policy: Policy | None = None
        self.tokenizer = None
        self.model_config: ModelConfig | None = None
        self.scheduler: Scheduler | None = None
        self.worker: WorkerProcess | WorkerGroup | None = None
        self.max_model_len = 0
        self.output_processor: OutputProcessor | None = None
        self._pending_aborts: set[str] = set()
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._dead: BaseException | None = None
        self._ids = itertools.count()
        self._worker_init: WorkerInit | None = None
        self._restart_times: list[float] = []
        self.num_worker_restarts = 0
        # (when the last worker death was noticed, when its replacement was ready), time.time()
        self.last_restart: tuple[float, float] | None = None
        self.step_stats = StepStats()

    # -- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        """Resolves the model, sizes the KV cache, spawns the worker and starts the loop."""
        config = self.config
        if self.plugin_manager is None:
            self.plugin_manager = create_plugin_manager(config.plugins)
        check_policy_names(self.plugin_manager, config.scheduling_policy, config.eviction_policy)
        self.policy = Policy(self.plugin_manager, config.scheduling_policy, config.eviction_policy)
        get_attention_backend(config.attention_backend, resolve_device(config.device))  # fail early on a bad name
        model_dir = await asyncio.to_thread(resolve_model, config.model)
        logger.info("model: %s", model_dir)
        self.model_config = model_config = ModelConfig.from_dir(model_dir)
        self.tokenizer = await asyncio.to_thread(load_tokenizer, model_dir)
        self.output_processor = OutputProcessor(self.tokenizer)
        num_blocks, self.max_model_len = self._size_kv_cache(model_config)
        bytes_per_block = self._bytes_per_block(model_config)
        num_cpu_blocks = config.swap_space_bytes // bytes_per_block
        logger.info("KV cache: %d blocks of %d tokens = %d tokens (%.2f GiB), max_model_len %d; "
                    "swap space %d blocks", num_blocks, config.block_size, num_blocks * config.block_size,
                    num_blocks * bytes_per_block / 1024**3, self.max_model_len, num_cpu_blocks)
        self.scheduler = Scheduler(
            KVCacheManager(num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching,
                           num_cpu_blocks=num_cpu_blocks, evictor=self.policy.make_evictor()),
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            preemption_mode=config.preemption_mode,
            policy=self.policy,
        )
        self._worker_init = WorkerInit(config, model_dir, model_config, num_blocks, self.max_model_len,
                                       num_cpu_blocks)
        self.worker = self._make_worker()
        logger.info("starting the worker process")
        ready = await self.worker.start()
        logger.info("worker ready: %s, %s, attention backend %s, %.2f GiB of KV cache%s; async scheduling %s",
                    ready.device, ready.dtype, ready.attention_backend, ready.kv_cache_bytes / 1024**3,
                    f", model compiled in {ready.compile_seconds:.1f} s" if ready.compile_seconds else "",
                    "on" if self.uses_async_scheduling() else "off")
        self._loop_task = asyncio.get_running_loop().create_task(self._run_loop(), name="pagoda-engine-loop")

    async def shutdown(self) -> None:
        """Stops the loop, fails whatever is still running, and stops the worker."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            with suppress(asyncio.CancelledError):
                await self._loop_task
            self._loop_task = None
        self._fail_all(EngineDeadError("the engine was shut down"))
        if self.worker is not None:
            await self.worker.shutdown()

    async def __aenter__(self) -> AsyncEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.shutdown()

    def describe(self) -> str:
        """One line on what runs, once started: the model's architecture, device, dtype and
        attention backend, KV capacity, policies and plugins (for the start-up log)."""
        ready, model = self.worker.ready, self.model_config
        num_tokens = self.scheduler.kv_cache_manager.num_blocks * self.config.block_size
        plugins = plugin_names(self.plugin_manager)
        return (f"{model.architecture} ({model.num_hidden_layers} layers) on {ready.device} in {ready.dtype}, "
                f"attention backend {ready.attention_backend}, KV cache {num_tokens} tokens, "
                f"max_model_len {self.max_model_len}, scheduling policy {self.config.scheduling_policy}, "
                f"eviction policy {self.config.eviction_policy}, plugins: {', '.join(plugins) or 'none'}")

    def uses_async_scheduling(self) -> bool:
        """The config's choice, or auto (see EngineConfig.async_scheduling)."""
        config = self.config
        if config.async_scheduling is not None:
            return config.async_scheduling
        if resolve_device(config.device).type == "cuda":
            return True
        import torch

        # NOTE: torch uses every core by default; only explicitly fewer leaves one spare.
        threads = config.num_threads or torch.get_num_threads()
        return (os.cpu_count() or 1) > threads * config.tensor_parallel_size

    def _make_worker(self):
        """The worker (or the group of tensor-parallel ranks) that runs the model."""
        config = self.config
        if config.distributed_executor_backend == "ray":
            from engine.ray_executor import RayWorkerGroup

            return RayWorkerGroup(self._worker_init, config.tensor_parallel_size)
        if config.tensor_parallel_size > 1:
            return WorkerGroup(self._worker_init, config.tensor_parallel_size, on_death=self._wakeup.set)
        return WorkerProcess(self._worker_init, on_death=self._wakeup.set)

    def _bytes_per_block(self, model_config: ModelConfig) -> int:
        """Bytes of one block on the rank that holds the most KV heads (all of them without
        tensor parallelism): kv_cache_bytes is what each rank may use."""
        config = self.config
        dtype = resolve_dtype(config.dtype, resolve_device(config.device))
        size = config.tensor_parallel_size
        kv_heads = max(head_share(model_config.num_attention_heads, model_config.num_key_value_heads, rank,
                                  size).num_kv_heads for rank in range(size))
        return 2 * model_config.num_hidden_layers * config.block_size * kv_heads * model_config.head_dim * dtype.itemsize

    def _size_kv_cache(self, model_config: ModelConfig) -> tuple[int, int]:
        config = self.config
        bytes_per_block = self._bytes_per_block(model_config)
        model_len = model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > model_len:
            raise ValueError(f"max_model_len ({config.max_model_len}) is larger than the model's context "
                             f"length ({model_len})")
        wanted_len = config.max_model_len or model_len
        window = model_config.sliding_window
        if window is not None and wanted_len > window:
            # NOTE: no sliding-window attention yet; within the window it is exact.
            if config.max_model_len is not None:
                raise ValueError(f"max_model_len ({config.max_model_len}) exceeds the model's sliding window "
                                 f"({window}), which Pagoda does not implement yet")
            logger.warning("limiting max_model_len to the sliding window (%d tokens)", window)
            wanted_len = window
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        else:
            # NOTE: never more blocks than max_num_seqs full-length requests can use.
            num_blocks = min(config.kv_cache_bytes // bytes_per_block,
                             config.max_num_seqs * -(-wanted_len // config.block_size))
        capacity = num_blocks * config.block_size
        if config.max_model_len is not None and config.max_model_len > capacity:
            raise ValueError(f"max_model_len ({config.max_model_len}) does not fit in the KV cache "
                             f"({num_blocks} blocks of {config.block_size} tokens = {capacity} tokens); "
                             "give the cache more memory or lower max_model_len")
        max_model_len = min(wanted_len, capacity)
        if max_model_len < 2:
            raise ValueError(f"the KV cache ({num_blocks} blocks) is too small to serve any request")
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
            raise ValueError(f"max_num_batched_tokens ({config.max_num_batched_tokens}) must be >= max_model_len "
                             f"({max_model_len}) when chunked prefill is disabled")
        return num_blocks, max_model_len

    # -- requests ---------------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self._loop_task is not None and self._dead is None

    @property
    def engines(self) -> list[AsyncEngine]:
        """The engines behind this API: just this one (see DataParallelEngine)."""
        return [self]

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def dead_reason(self) -> str:
        """Why the engine stopped serving ("" while it runs)."""
        if self._dead is None:
            return "" if self._loop_task is not None else "it has not been started"
        return str(self._dead)

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """Tokenizes a text prompt, or validates a token-id prompt."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return self.tokenizer.encode(prompt)
        token_ids = list(prompt)
        vocab_size = self.model_config.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab_size})")
        return token_ids

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    prompt_token_ids: list[int] | None = None, *, cache_salt: str | None = None,
                    priority: int = 0, kv_retention: int = 0,
                    output_kind: OutputKind = OutputKind.CUMULATIVE) -> RequestStream:
        """Validates and queues a request; returns its stream.

        Args:
            prompt: Text, or token ids.
            params: Sampling parameters; n > 1 samples share the prompt's blocks.
            request_id: Unique id (generated when None).
            prompt_token_ids: The prompt already tokenized, if it is text.
            cache_salt: Keeps this request's prefix-cache entries apart from other salts.
            priority: Scheduling priority, lower first, for policies that use it.
            kv_retention: Eviction priority of the request's cached blocks, higher kept
                longer, for eviction policies that use it.
            output_kind: What each output read from the stream holds: everything so
                far, only what is new, or only the final result.

        Raises:
            ValueError: Bad prompt or parameters (the message names the field).
            RequestRejected: An admission plugin turned the request away.
            EngineDeadError: The worker has died.
        """
        if self._dead is not None:
            raise EngineDeadError(f"the engine is not running: {self._dead}")
        if self._loop_task is None:
            raise EngineDeadError("the engine has not been started")
        if prompt_token_ids is None:
            prompt_token_ids = self.encode_prompt(prompt)
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        num_prompt = len(prompt_token_ids)
        if num_prompt >= self.max_model_len:
            raise ValueError(f"prompt is {num_prompt} tokens long, but max_model_len is {self.max_model_len} "
                             "(prompt plus at least one generated token must fit)")
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        outputs = self.output_processor
        if request_id in outputs.streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n ({params.n}) is larger than max_num_seqs ({self.config.max_num_seqs}): "
                             "the samples of one request must be able to run together")
        room = self.max_model_len - num_prompt
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        stream = RequestStream(request_id, prompt if isinstance(prompt, str) else None, list(prompt_token_ids),
                               output_kind)
        eos = frozenset(self.model_config.eos_token_ids)
        requests = []
        for index in range(params.n):
            child_params = params
            if params.n > 1:
                seed = None if params.seed is None else params.seed + index
                child_params = replace(params, n=1, seed=seed)
            child_id = request_id if params.n == 1 else f"{request_id}-{index}"
            request = Request(child_id, prompt_token_ids, child_params, max_tokens, eos, cache_salt=cache_salt,
                              priority=priority, kv_retention=kv_retention)
            outputs.new_sample(stream, request, index)
            requests.append(request)
        self.policy.admit(requests[0].view, self.scheduler.num_waiting, self.scheduler.num_running)
        self.scheduler.add_request(requests[0], forks=requests[1:])
        outputs.add(stream)
        self._wakeup.set()
        return stream

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None, **kwargs) -> AsyncIterator[RequestOutput]:
        """Runs one request, yielding outputs as tokens arrive; the last one is finished.

        Takes add_request's keyword arguments (``output_kind`` among them). Leaving the
        iteration early (or being cancelled) aborts the request.
        """
        params = params or SamplingParams()
        prompt_token_ids = None
        if isinstance(prompt, str) and prompt:
            prompt_token_ids = await asyncio.to_thread(self.tokenizer.encode, prompt)
        stream = self.add_request(prompt, params, request_id, prompt_token_ids, **kwargs)
        async for output in self.stream_outputs(stream):
            yield output

    async def stream_outputs(self, stream: RequestStream) -> AsyncIterator[RequestOutput]:
        """Yields the outputs of a request added with add_request() until it finishes.

        Leaving the iteration early (or being cancelled) aborts the request.
        """
        try:
            while True:
                await stream.event.wait()
                stream.event.clear()
                if stream.error is not None:
                    raise stream.error
                output = stream.take()
                yield output
                if output.finished:
                    return
        finally:
            if not stream.finished:
                self.abort(stream.request_id)
            self.output_processor.forget(stream)

    def reset_prefix_cache(self) -> bool:
        """Evicts every cached block no request holds; True when nothing was left cached."""
        kv = self.scheduler.kv_cache_manager
        kv.reset_prefix_cache()
        return kv.usage().num_cached_free_blocks == 0 and not self.scheduler.requests

    def abort(self, request_id: str) -> None:
        """Aborts a request (all its samples); it frees its blocks before the next step."""
        stream = self.output_processor.streams.get(request_id)
        if stream is None:
            return
        for sample in stream.samples:
            if not sample.output.finished:
                self._pending_aborts.add(sample.request.request_id)
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
                self._dead = exc
                self._fail_all(EngineDeadError(f"the engine loop crashed: {exc!r}"))
                return

    async def _run_steps(self) -> None:
        """The step loop. With async scheduling, step N+1 is scheduled and sent while the
        worker runs step N, so the worker never waits for the engine's bookkeeping."""
        scheduler, worker, stats = self.scheduler, self.worker, self.step_stats
        # Steps sent and not answered yet, each with whether the engine had been idle
        # (no work at all) before it: the worker's wait for such a step is not overhead.
        in_flight: deque[tuple[SchedulerOutput, bool]] = deque()
        depth = 2 if self.uses_async_scheduling() else 1
        was_idle = True
        while True:
            if not in_flight and not scheduler.has_unfinished_requests() and not self._pending_aborts:
                self._wakeup.clear()
                await self._wakeup.wait()
                was_idle = True
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
                if not in_flight:
                    await asyncio.sleep(0.001)  # nothing runnable yet; do not spin
                    was_idle = True
                    continue
                if sent and len(in_flight) < depth:
                    continue  # keep the worker's queue full before waiting for a result
            runner_output = await worker.recv()
            step, after_idle = in_flight.popleft()
            start = time.perf_counter()
            if runner_output.error is not None:
                self._fail_step(step, runner_output.error, [s for s, _ in in_flight])
            else:
                self._process_updates(scheduler.update(step, runner_output))
            if after_idle:
                runner_output.idle_seconds = 0.0
            stats.record(runner_output, time.perf_counter() - start)

    async def _restart_worker(self, exc: WorkerDiedError) -> bool:
        """Starts a new worker after ``exc`` and re-queues every request for recompute.

        Returns:
            False when the restart budget is spent (the engine is then dead).
        """
        detected = time.time()
        while True:
            if not self._take_restart(exc):
                await self.worker.shutdown(timeout=1.0)
                return False
            await self.worker.shutdown(timeout=1.0)
            # NOTE: the KV cache and the swap space died with the worker: every request
            # starts over from its tokens so far (the prompt and the output already streamed).
            self.scheduler.reset_after_worker_loss()
            self.worker = self._make_worker()
            try:
                await self.worker.start()
            except WorkerDiedError as start_exc:
                exc = start_exc
                continue
            self.last_restart = (detected, time.time())
            logger.info("worker restarted (pid %s) in %.1f s", self.worker.pid, self.last_restart[1] - detected)
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
            self._dead = EngineDeadError(
                f"{exc}; it was restarted {len(self._restart_times)} times in {config.worker_restart_window} s "
                "(--max-worker-restarts), so the engine gave up")
            self._fail_all(self._dead)
            return False
        self._restart_times.append(now)
        self.num_worker_restarts += 1
        logger.error("worker died: %s; restarting it (restart %d), %d requests will be recomputed", exc,
                     self.num_worker_restarts, len(self.scheduler.requests))
        return True

    def _apply_aborts(self) -> None:
        for child_id in self._pending_aborts:
            request = self.scheduler.finish_request(child_id, RequestStatus.FINISHED_ABORTED)
            if request is not None:
                self.output_processor.finish_sample(request)
        self._pending_aborts.clear()

    def _process_updates(self, updates) -> None:
        outputs = self.output_processor
        for request in outputs.process(updates):
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
            outputs.finish_sample(request)

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
        for child_id in request_ids:
            request = self.scheduler.finish_request(child_id, RequestStatus.FINISHED_ERROR)
            if request is not None:
                self.output_processor.fail(request, step_error)

    def _fail_all(self, error: BaseException) -> None:
        if self.output_processor is None:
            return
        # NOTE: every stream learns of the error first, so none hangs if cleaning up
        # the scheduler below fails too.
        for child_id in self.output_processor.fail_all(error):
            try:
                if self.scheduler is not None:
                    self.scheduler.finish_request(child_id, RequestStatus.FINISHED_ERROR)
            except Exception:
                logger.exception("could not clean up request %s", child_id)
