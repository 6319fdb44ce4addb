"""AsyncEngine: the asyncio client of the engine, which the offline LLM class and the server
share.

It starts the engine (resolves the model, loads the tokenizer, sizes the KV cache, builds the
scheduler and the :class:`~pagoda.engine.core.engine_core.EngineCore` that runs the step
loop and supervises the worker), validates requests, fans ``n`` out into samples, and hands
out a stream per request. While the worker computes, the event loop is free to serve HTTP,
tokenize and stream.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pluggy
import torch

from pagoda.attention_backends import get_attention_backend
from pagoda.engine.config import EngineConfig, sizes_kv_from_memory
from pagoda.engine.core.engine_core import EngineCore, StepStats
from pagoda.engine.core.grammar import BitmaskFiller, GrammarCompiler
from pagoda.engine.core.kv_offload_index import KVTierIndex
from pagoda.engine.core.kv_sizing import KVCacheSize, kv_cache_budget, size_kv_cache
from pagoda.engine.core.plugin_manager import create_plugin_manager, plugin_names
from pagoda.engine.core.policy import Policy
from pagoda.engine.core.request import Request
from pagoda.engine.core.scheduler import Scheduler
from pagoda.engine.exceptions import EngineDeadError, EngineSleepingError
from pagoda.engine.executor.base import Executor, create_executor
from pagoda.engine.frontend.output_processor import OutputKind, OutputProcessor, RequestStream
from pagoda.engine.frontend.start_plan import plan_start, runs_windows
from pagoda.engine.kv_events import KVEventLog, make_publisher
from pagoda.engine.kv_offload import KVOffloadTarget, default_offload_bytes
from pagoda.engine.lora import LoRAAdapter, LoRAError, LoRARegistry, parse_lora_modules, prefix_salt
from pagoda.engine.messages import DeviceMemory, KVCacheAllocation, WorkerInit, WorkerReady
from pagoda.engine.model_config import ModelConfig
from pagoda.engine.model_loader import load_tokenizer, resolve_model
from pagoda.engine.outputs import RequestOutput
from pagoda.engine.platform import attention_shape, resolve_device, resolve_kv_cache_dtype
from pagoda.engine.reasoning import REASONING_PARSERS, ReasoningParser
from pagoda.engine.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)

__all__ = ["AsyncEngine"]


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
        self.kv_cache_size: KVCacheSize | None = None
        # What each rank measured of its device's memory, where the KV cache was sized from it.
        self.device_memory: list[DeviceMemory] | None = None
        self._worker_init: WorkerInit | None = None
        self.core: EngineCore | None = None
        self.output_processor: OutputProcessor | None = None
        self.grammar_compiler: GrammarCompiler | None = None
        # (parser, its opening tag's ids, its closing tag's ids) with --reasoning-parser.
        self._reasoning: tuple[ReasoningParser, list[int], tuple[int, ...]] | None = None
        self._ids = itertools.count()
        # The LoRA adapters requests may name, with --enable-lora.
        self.loras: LoRARegistry | None = None

    # -- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        """Resolves the model, sizes the KV cache, spawns the worker and starts the loop."""
        config = self.config
        if self.plugin_manager is None:
            self.plugin_manager = create_plugin_manager(config.plugins)
        self.policy = Policy(self.plugin_manager, config.scheduling_policy, config.eviction_policy)
        device = resolve_device(config.device)
        # NOTE: fails early on a bad name, or a backend that cannot store the cache's dtype
        # (before the model is found), or cannot attend with the model's heads (after).
        kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype)
        get_attention_backend(config.attention_backend, device, kv_dtype)
        model_dir = await asyncio.to_thread(resolve_model, config.model)
        logger.info("model: %s", model_dir)
        self.model_config = model_config = ModelConfig.from_dir(model_dir)
        self.tokenizer = await asyncio.to_thread(load_tokenizer, model_dir)
        if config.enable_lora:
            self.loras = LoRARegistry(model_config, config.max_lora_rank)
            for name, path in parse_lora_modules(config.lora_modules):
                adapter = await asyncio.to_thread(self.loras.load, name, path)
                logger.info("LoRA adapter %s: %s (rank %d, %d layers)", name, path, adapter.rank,
                            len(adapter.weights))
        self.output_processor = OutputProcessor(self.tokenizer)
        if config.reasoning_parser is not None:
            parser = REASONING_PARSERS[config.reasoning_parser]
            self._reasoning = (parser, self.tokenizer.encode(parser.start, add_special_tokens=False),
                               tuple(self.tokenizer.encode(parser.end, add_special_tokens=False)))
        draft_dir, draft_config = await asyncio.to_thread(self._draft_model, model_config)
        # NOTE: a clear error before the worker starts where the dtype, quantization or backend cannot run
        plan = await asyncio.to_thread(plan_start, config, model_dir, model_config, device, draft_dir)
        windows_run = runs_windows(plan, model_config)
        kv_dtype = kv_dtype or getattr(torch, plan.dtype)
        # NOTE: sized here, or (from the device's memory) once the worker has loaded the model
        # and measured; either way the sizing's own errors come before the model loads, from
        # the largest cache the configuration could use.
        from_memory = sizes_kv_from_memory(config, device.type)
        kv = size_kv_cache(config, model_config, kv_dtype.itemsize, draft_config,
                           budget=sys.maxsize if from_memory else None, windows_run=windows_run)
        # NOTE: num_blocks None: the worker measures first (then _use_kv_cache fills it in).
        self._worker_init = WorkerInit(config, model_dir, model_config, plan, None if from_memory else kv.num_blocks,
                                       kv.max_model_len, kv.num_cpu_blocks, draft_model_dir=draft_dir,
                                       draft_model_config=draft_config)

        def size_kv(memory: list[DeviceMemory]) -> KVCacheAllocation:
            budget = min(kv_cache_budget(m, config.gpu_memory_utilization) for m in memory)
            logger.info("device memory: %.2f GiB; weights %.2f GiB, activations' peak %.2f GiB, reserved %.2f GiB, "
                        "outside torch %.2f GiB: %.2f GiB for the KV cache (gpu_memory_utilization %s)",
                        *(x / 1024**3 for x in (memory[0].total, memory[0].weights, memory[0].peak_activations,
                                                memory[0].reserved, memory[0].non_torch, budget)),
                        config.gpu_memory_utilization)
            self.device_memory = memory
            return self._use_kv_cache(size_kv_cache(config, model_config, kv_dtype.itemsize, draft_config, budget,
                                                    windows_run), kv_dtype)

        if not from_memory:
            self._use_kv_cache(kv, kv_dtype)
        logger.info("starting the worker process")
        self.core, ready = await EngineCore.launch(config, self._make_executor, self._make_scheduler,
                                                   self.output_processor, self.uses_async_scheduling(),
                                                   size_kv if from_memory else None)
        if config.offloads_kv:
            await self._open_offload(ready)
        threads = f" ({ready.threads})" if ready.threads and ready.device == "cpu" else ""
        logger.info("worker ready: %s%s, %s, %s, attention backend %s, %.2f GiB of KV cache%s%s; async scheduling %s",
                    ready.device, threads, ready.dtype, ready.weights, ready.attention_backend,
                    ready.kv_cache_bytes / 1024**3,
                    f", model compiled in {ready.compile_seconds:.1f} s ({ready.compiled})" if ready.compile_seconds
                    else f", {ready.compiled}" if ready.compiled else "",
                    f", {ready.cuda_graphs}" if ready.cuda_graphs else "", "on" if self.core.async_scheduling else "off")

    async def _open_offload(self, ready: WorkerReady) -> None:
        """The offload tier's index: over the worker's namespace on disk, with the blocks a
        previous run (or another replica) left there; or over the worker's host memory."""
        config = self.config
        target = budget = None
        if config.kv_offload_dir is not None:
            target = KVOffloadTarget(Path(config.kv_offload_dir), bytes.fromhex(ready.kv_offload_namespace))
            budget = config.kv_offload_bytes or default_offload_bytes(target.directory)
        index = KVTierIndex(target, ready.kv_offload_file_bytes, budget or config.kv_offload_host_bytes,
                            config.block_size, evictor=self.policy.make_evictor())
        start = time.perf_counter()
        found = await asyncio.to_thread(index.scan)
        index.events = self.core.kv_events[0] if self.core.kv_events is not None else None
        self.core.scheduler.kv_cache_manager.offload = index
        host = config.kv_offload_host_bytes
        where = (f"{target.root}, {budget / 1024**3:.1f} GiB at most" if target is not None
                 else f"host memory, {host / 1024**3:.1f} GiB")
        logger.info("KV offload tier: %s (%d blocks of %.0f KiB)%s; %d blocks found in %.2f s", where, index.max_files,
                    index.file_bytes / 1024, f", {host / 1024**3:.1f} GiB of host memory in front"
                    if host and target is not None else "", found, time.perf_counter() - start)

    def _make_executor(self, on_death):
        """The worker(s), from the current WorkerInit (a restart allocates what the first start
        decided)."""
        return create_executor(self._worker_init, self.config, on_death)

    def _use_kv_cache(self, kv: KVCacheSize, kv_dtype) -> KVCacheAllocation:
        """Takes the KV cache's size (for the scheduler and the workers' init)."""
        self.kv_cache_size = kv
        if kv.limited_by_window:
            logger.warning("limiting max_model_len to the sliding window (%d tokens): the attention backend runs "
                           "no windows", kv.max_model_len)
        if kv.num_sliding_blocks:
            logger.info("sliding window of %d tokens in %d of %d layers: their KV has a pool of its own, %d blocks "
                        "(%d bytes a token); a request holds the window's blocks there, those before it go back "
                        "to the pool (preemption recomputes: no swap space)", kv.sliding_window,
                        len(self.model_config.sliding_layers), self.model_config.num_hidden_layers,
                        kv.num_sliding_blocks, kv.sliding_bytes_per_block // kv.block_size)
        elif kv.sliding_window is not None:
            logger.info("sliding window of %d tokens in every layer: a request holds the window's blocks, those "
                        "before it go back to the pool", kv.sliding_window)
        logger.info("KV cache: %d blocks of %d tokens = %d tokens (%.2f GiB, %s, %d bytes a token), "
                    "max_model_len %d; swap space %d blocks", kv.num_blocks, kv.block_size, kv.num_tokens,
                    kv.num_bytes / 1024**3, str(kv_dtype).removeprefix("torch."), kv.bytes_per_block // kv.block_size,
                    kv.max_model_len, kv.num_cpu_blocks)
        self._worker_init = replace(self._worker_init, num_blocks=kv.num_blocks, num_cpu_blocks=kv.num_cpu_blocks,
                                    max_model_len=kv.max_model_len, num_sliding_blocks=kv.num_sliding_blocks)
        return KVCacheAllocation(kv.num_blocks, kv.num_cpu_blocks, kv.max_model_len, kv.num_sliding_blocks)

    def _make_scheduler(self) -> tuple[Scheduler, tuple[KVEventLog, object] | None]:
        """The scheduler over the sized KV cache's blocks, with the KV events' log and
        publisher where the config asks for them."""
        scheduler = Scheduler.from_config(self.config, self.kv_cache_size, self.policy,
                                          BitmaskFiller(self.model_config.vocab_size))
        events = self.config.kv_events_config
        if events is None or not events.enable_kv_cache_events:
            return scheduler, None
        log = KVEventLog(self.config.block_size)
        scheduler.kv_cache_manager.block_pool.events = log
        logger.info("KV events: %s on %s%s", events.publisher, events.endpoint,
                    f", replay on {events.replay_endpoint}" if events.replay_endpoint else "")
        return scheduler, (log, make_publisher(events))

    def _draft_model(self, model_config: ModelConfig) -> tuple[Path | None, ModelConfig | None]:
        """Speculative decoding's draft model (method draft_model): its directory and
        config, checked against the model it drafts for."""
        spec = self.config.speculative_config
        if spec is None or spec.method != "draft_model":
            return None, None
        draft_dir = resolve_model(spec.model)
        draft_config = ModelConfig.from_dir(draft_dir)
        if draft_config.vocab_size != model_config.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({draft_config.vocab_size} tokens, {draft_dir}) differs "
                             f"from the model's ({model_config.vocab_size}): a draft model must share the tokenizer")
        logger.info("draft model: %s", draft_dir)
        return draft_dir, draft_config

    async def shutdown(self) -> None:
        """Stops the loop, fails whatever is still running, and stops the worker."""
        if self.core is not None:
            await self.core.shutdown()

    async def __aenter__(self) -> AsyncEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.shutdown()

    @property
    def num_kv_tokens(self) -> int:
        """Tokens the KV cache holds (once started)."""
        return self.kv_cache_size.num_tokens

    def describe(self) -> str:
        """One line on what runs, once started: the model's architecture, device, dtype and
        attention backend, KV capacity, policies and plugins (for the start-up log)."""
        ready, model = self.worker.ready, self.model_config
        plugins = plugin_names(self.plugin_manager)
        return (f"{model.architecture} ({model.num_hidden_layers} layers) on {ready.device} in {ready.dtype} "
                f"({ready.weights}), "
                f"attention backend {ready.attention_backend}"
                f"{', steps in one call' if ready.one_call_forward else ''}"
                f"{', batch-invariant' if ready.batch_invariant else ''}, "
                f"KV cache {self.kv_cache_size.num_tokens} tokens"
                f"{'' if self.config.kv_cache_dtype == 'auto' else ' in ' + self.config.kv_cache_dtype}, "
                f"max_model_len {self.max_model_len}, scheduling policy {self.config.scheduling_policy}, "
                f"eviction policy {self.config.eviction_policy}, plugins: {', '.join(plugins) or 'none'}")

    def uses_async_scheduling(self) -> bool:
        """The config's choice, or auto (see EngineConfig.async_scheduling)."""
        config = self.config
        if config.async_scheduling is not None:
            return config.async_scheduling
        if resolve_device(config.device).type == "cuda":
            return True
        # NOTE: torch uses every core by default; only explicitly fewer leaves one spare.
        threads = config.num_threads or torch.get_num_threads()
        return (os.cpu_count() or 1) > threads * config.tensor_parallel_size

    # -- what callers read of the engine ------------------------------------------------

    @property
    def scheduler(self) -> Scheduler | None:
        return self.core.scheduler if self.core is not None else None

    @property
    def worker(self) -> Executor | None:
        return self.core.worker if self.core is not None else None

    @property
    def standby(self) -> Executor | None:
        """The next worker's process, started ahead (EngineConfig.standby_worker)."""
        return self.core.standby if self.core is not None else None

    @property
    def step_stats(self) -> StepStats:
        return self.core.step_stats

    @property
    def num_worker_restarts(self) -> int:
        return self.core.num_worker_restarts if self.core is not None else 0

    @property
    def worker_restart_seconds(self) -> float:
        """Seconds from each worker death noticed to its replacement ready, summed."""
        return self.core.worker_restart_seconds if self.core is not None else 0.0

    @property
    def last_restart(self) -> tuple[float, float] | None:
        """(when the last worker death was noticed, when its replacement was ready)."""
        return self.core.last_restart if self.core is not None else None

    @property
    def max_model_len(self) -> int:
        return self.kv_cache_size.max_model_len if self.kv_cache_size is not None else 0

    @property
    def is_running(self) -> bool:
        return self.core is not None and self.core.is_running

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
        return self.core.dead_reason if self.core is not None else "it has not been started"

    def compile_grammar(self, params: StructuredOutputsParams) -> None:
        """Compiles a constraint into the cache (thread-safe: callers on the event loop run it
        in a thread first, so that add_request finds it compiled).

        Raises:
            ValueError: The constraint is invalid (the message starts with ``structured_outputs``).
        """
        self._grammars().compile(params)

    def _grammars(self) -> GrammarCompiler:
        if self.grammar_compiler is None:
            self.grammar_compiler = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                                    list(self.model_config.eos_token_ids))
        return self.grammar_compiler

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
                    priority: int = 0, kv_retention: int = 0, client: str | None = None,
                    output_kind: OutputKind = OutputKind.CUMULATIVE, lora_name: str | None = None) -> RequestStream:
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
            client: Who sent it, for per-client policies (the fair policy).
            output_kind: What each output read from the stream holds: everything so
                far, only what is new, or only the final result.
            lora_name: The LoRA adapter to run with (loaded with --lora-modules or
                load_lora_adapter); None: the base model.

        Raises:
            ValueError: Bad prompt or parameters (the message names the field).
            RequestRejected: An admission plugin turned the request away.
            EngineDeadError: The worker has died.
        """
        if self.core is None:
            raise EngineDeadError("the engine has not been started")
        self.core.check_running()
        if self.core.sleeping:
            raise EngineSleepingError("the engine is asleep; wake it up first (wake_up(), POST /wake_up)")
        lora = self.lora_adapter(lora_name)
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
        if params.pooling is not None and params.n != 1:
            raise ValueError("an embedding request has one sample (n must be 1)")
        vocab_size = self.model_config.vocab_size
        if any(t >= vocab_size for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids of this model, in [0, {vocab_size})")
        for name in ("logit_bias", "allowed_token_ids"):
            if any(t >= vocab_size for t in getattr(params, name) or ()):
                raise ValueError(f"{name} must name token ids of this model, in [0, {vocab_size})")
        if params.bad_words and not params.bad_words_token_ids:
            params.bad_words_token_ids = self._bad_words_token_ids(params.bad_words)
        matchers, reasoning_end = [None] * params.n, None
        if params.structured_outputs is not None:
            matchers = self._grammars().matchers(params.structured_outputs, params.n)
            if self._reasoning is not None:
                parser, start_ids, end_ids = self._reasoning
                if parser.is_thinking(prompt_token_ids, start_ids, end_ids):
                    reasoning_end = end_ids  # the grammar waits for the thinking to end
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
            request = Request(child_id, prompt_token_ids, child_params, max_tokens, eos,
                              cache_salt=prefix_salt(cache_salt, lora), priority=priority,
                              kv_retention=kv_retention, client=client, lora=lora)
            request.matcher = matchers[index]
            request.reasoning_end = reasoning_end
            outputs.new_sample(stream, request, index)
            requests.append(request)
        self.policy.admit(requests[0].view, self.scheduler.num_waiting, self.scheduler.num_running)
        self.core.add_request(requests[0], forks=requests[1:])
        outputs.add(stream)
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
        if params.structured_outputs is not None:
            await asyncio.to_thread(self.compile_grammar, params.structured_outputs)  # off the loop; cached
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

    def lora_adapter(self, name: str | None) -> LoRAAdapter | None:
        """The loaded adapter of that name (None for None).

        Raises:
            LoRAError: LoRA is off, or no adapter has that name.
        """
        if name is None:
            return None
        if self.loras is None:
            raise LoRAError(f"LoRA adapter {name!r} requested, but LoRA is off (start with --enable-lora)")
        adapter = self.loras.get(name)
        if adapter is None:
            raise LoRAError(f"no LoRA adapter named {name!r} is loaded")
        return adapter

    async def load_lora_adapter(self, name: str, path: str) -> LoRAAdapter:
        """Reads, checks and registers an adapter while serving (off the event loop).

        Raises:
            LoRAError: LoRA is off, the name is taken, or the adapter cannot be served.
        """
        if self.loras is None:
            raise LoRAError("LoRA is off (start with --enable-lora)")
        adapter = await asyncio.to_thread(self.loras.load, name, path)
        logger.info("LoRA adapter %s loaded: %s (rank %d)", name, path, adapter.rank)
        return adapter

    def unload_lora_adapter(self, name: str) -> None:
        """Unregisters an adapter: new requests can no longer name it; those running with it
        finish with it, and the worker drops it afterwards.

        Raises:
            LoRAError: LoRA is off, or no adapter has that name.
        """
        if self.loras is None:
            raise LoRAError("LoRA is off (start with --enable-lora)")
        adapter = self.loras.unload(name)
        if self.scheduler is not None:
            self.scheduler.unload_lora(adapter)
        logger.info("LoRA adapter %s unloaded", name)

    @property
    def is_sleeping(self) -> bool:
        return self.core is not None and bool(self.core.sleeping)

    async def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode: frees the worker's memory until wake_up() (see EngineCore.sleep);
        requests meanwhile are refused (EngineSleepingError).

        Raises:
            ValueError: A level other than 1 or 2.
            EngineBusyError: Requests are in the engine.
        """
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2; got {level!r}")
        if self.core is None:
            raise EngineDeadError("the engine has not been started")
        await self.core.sleep(level)

    async def wake_up(self) -> None:
        """Starts the worker again after sleep() (a no-op when awake)."""
        if self.core is not None:
            await self.core.wake_up()

    def reset_prefix_cache(self) -> bool:
        """Evicts every cached block no request holds; True when nothing was left cached."""
        kv = self.scheduler.kv_cache_manager
        kv.reset_prefix_cache()
        return kv.usage().num_cached_free_blocks == 0 and not self.scheduler.requests

    def interrupt_all(self, error: BaseException) -> int:
        """Ends every open request stream with ``error`` (raised by stream_outputs, which then
        aborts the request); returns how many it ended."""
        streams = [s for s in self.output_processor.streams.values() if not s.finished]
        for stream in streams:
            stream.error = error
            stream.event.set()
        return len(streams)

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word's tokens, alone and after a space (the two ways it starts in a text)."""
        sequences: list[list[int]] = []
        for word in words:
            for text in (word.strip(), " " + word.strip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in sequences:
                    sequences.append(ids)
        return sequences

    def abort(self, request_id: str) -> None:
        """Aborts a request (all its samples); it frees its blocks before the next step."""
        stream = self.output_processor.streams.get(request_id)
        if stream is None:
            return
        self.core.abort(sample.request.request_id for sample in stream.samples if not sample.output.finished)
