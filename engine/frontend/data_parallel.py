"""Data parallelism: several engine replicas behind one API, with a prefix-aware router.

``--data-parallel-size N`` runs N full engines (each with its own scheduler, KV cache and
workers, tensor-parallel or not) in one process; the server and the offline LLM class talk
to a :class:`DataParallelEngine` exactly as to one engine. Each new request goes to a
replica chosen by :class:`~pagoda.engine.core.router.Router`: the replica whose prefix cache holds the longest prefix
of the request's prompt, as long as its load (running plus waiting requests) is within a
small slack of the least loaded replica's; otherwise the least loaded one.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator
from dataclasses import replace

import pluggy
import torch

from pagoda.engine.core.engine_core import StepStats
from pagoda.engine.core.router import Router
from pagoda.engine.lora import prefix_salt
from pagoda.engine.frontend.async_engine import AsyncEngine
from pagoda.engine.config import EngineConfig
from pagoda.engine.cpu_affinity import threads_per_sharer
from pagoda.engine.exceptions import EngineDeadError
from pagoda.engine.frontend.output_processor import RequestStream
from pagoda.engine.outputs import RequestOutput
from pagoda.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

def replica_device(config: EngineConfig, replica: int) -> str:
    """Replica ``replica``'s device: on CUDA, its own GPUs, tensor_parallel_size of them from
    ``cuda:{first + tensor_parallel_size * replica}``; on the CPU the same for all."""
    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if not device.startswith("cuda"):
        return device
    first = torch.device(device).index or 0
    return f"cuda:{first + config.tensor_parallel_size * replica}"


def replica_config(config: EngineConfig, replica: int) -> EngineConfig:
    """Replica ``replica``'s configuration: one replica, its own device; on the CPU, where no
    thread count is given, its share of the CPUs (the replicas share them, and each worker's
    default of one thread per CPU had N replicas' spinning threads on the same cores: two
    replicas on 2 cores took 41-61 s for the `random` workload against 8.0-8.4 s with one
    thread each, Intel Xeon with AMX, 2026-12-05)."""
    device = replica_device(config, replica)
    threads = config.num_threads
    if threads is None and not device.startswith("cuda"):
        threads = threads_per_sharer(config.data_parallel_size * config.tensor_parallel_size)
    events = config.kv_events_config
    if events is not None and replica:  # NOTE: each replica's sockets on ports of its own, as vLLM's ranks'
        events = replace(events, endpoint=_port_plus(events.endpoint, replica),
                         replay_endpoint=events.replay_endpoint and _port_plus(events.replay_endpoint, replica))
    return replace(config, data_parallel_size=1, device=device, num_threads=threads, kv_events_config=events)


def _port_plus(endpoint: str, offset: int) -> str:
    """A ZMQ endpoint ("tcp://host:port") with its port moved up by ``offset``."""
    head, sep, port = endpoint.rpartition(":")
    return f"{head}{sep}{int(port) + offset}" if sep and port.isdigit() else endpoint


class DataParallelEngine:
    """N AsyncEngine replicas behind the AsyncEngine API.

    Args:
        config: The engine configuration; each replica gets it with data_parallel_size 1.
        plugin_manager: Not supported with several replicas (each builds its own from
            the config, so that stateful policies stay per replica).
    """

    def __init__(self, config: EngineConfig, plugin_manager: pluggy.PluginManager | None = None) -> None:
        if plugin_manager is not None:
            raise ValueError("a plugin_manager cannot be shared by data-parallel replicas; name plugins in the "
                             "config instead")
        self.config = config
        self.replicas = [AsyncEngine(replica_config(config, i)) for i in range(config.data_parallel_size)]
        self.router = Router(self.replicas)
        self._owner: dict[str, AsyncEngine] = {}
        # What add_request was given, per request, to send it again elsewhere if its replica dies.
        self._requests: dict[str, tuple] = {}
        #: Requests sent again to another replica after theirs died before answering.
        self.num_rerouted = 0
        self._ids = itertools.count()

    # -- what callers read of an engine -------------------------------------------------

    @property
    def engines(self) -> list[AsyncEngine]:
        return self.replicas

    @property
    def tokenizer(self):
        return self.replicas[0].tokenizer

    @property
    def model_config(self):
        return self.replicas[0].model_config

    @property
    def max_model_len(self) -> int:
        return self.replicas[0].max_model_len

    @property
    def is_running(self) -> bool:
        """Whether a replica serves (a dead one is out of routing; the others go on)."""
        return any(r.is_running for r in self.replicas)

    @property
    def dead_reason(self) -> str:
        return "; ".join(f"replica {i}: {r.dead_reason}" for i, r in enumerate(self.replicas) if r.dead_reason)

    @property
    def num_worker_restarts(self) -> int:
        return sum(r.num_worker_restarts for r in self.replicas)

    @property
    def worker_restart_seconds(self) -> float:
        return sum(r.worker_restart_seconds for r in self.replicas)

    @property
    def num_kv_tokens(self) -> int:
        return sum(engine.num_kv_tokens for engine in self.engines)

    @property
    def num_waiting(self) -> int:
        return sum(r.num_waiting for r in self.replicas)

    @property
    def step_stats(self) -> StepStats:
        total = StepStats()
        for r in self.replicas:
            for name in StepStats.__slots__:
                combine = max if name == "max_in_flight" else (lambda a, b: a + b)
                setattr(total, name, combine(getattr(total, name), getattr(r.step_stats, name)))
        return total

    def compile_grammar(self, params) -> None:
        """Compiles a constraint on every replica (each keeps its own cache)."""
        for replica in self.replicas:
            replica.compile_grammar(params)

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        return self.replicas[0].encode_prompt(prompt)

    # -- lifecycle ----------------------------------------------------------------------

    def describe(self) -> str:
        """The first replica's description, and how many there are."""
        return f"{self.engines[0].describe()}; {len(self.engines)} data-parallel replicas"

    async def start(self) -> None:
        try:
            await asyncio.gather(*(r.start() for r in self.replicas))
        except BaseException:
            await self.shutdown()
            raise
        self.router.policy = self.replicas[0].policy  # NOTE: a routing plugin's hook, if one is installed

    async def shutdown(self) -> None:
        await asyncio.gather(*(r.shutdown() for r in self.replicas))

    async def __aenter__(self) -> DataParallelEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.shutdown()

    # -- requests -----------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    prompt_token_ids: list[int] | None = None, **kwargs) -> RequestStream:
        """Routes the request to a replica and queues it there (see AsyncEngine.add_request)."""
        if prompt_token_ids is None:
            prompt_token_ids = self.encode_prompt(prompt)
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        if request_id in self._owner:
            raise ValueError(f"request id {request_id!r} is already in use")
        # NOTE: each replica has its own copy of an adapter (the same name and path: the same key).
        lora = self.replicas[0].lora_adapter(kwargs.get("lora_name"))
        salt = prefix_salt(kwargs.get("cache_salt"), lora)
        replica = self.replicas[self.router.route(prompt_token_ids, salt)]
        stream = replica.add_request(prompt, params, request_id, prompt_token_ids, **kwargs)
        self._owner[request_id] = replica
        self._requests[request_id] = (prompt, params, prompt_token_ids, salt, kwargs)
        return stream

    async def stream_outputs(self, stream: RequestStream) -> AsyncIterator[RequestOutput]:
        """The request's outputs from its replica. If that replica dies before the request has
        answered anything, the request is sent again to a replica that serves."""
        request_id = stream.request_id
        try:
            while True:
                replica = self._owner[request_id]
                answered = False
                try:
                    async for output in replica.stream_outputs(stream):
                        answered = True
                        yield output
                    return
                except EngineDeadError:
                    if answered or replica.is_running or not self.is_running:
                        raise
                prompt, params, prompt_token_ids, salt, kwargs = self._requests[request_id]
                other = self.replicas[self.router.route(prompt_token_ids, salt)]
                logger.warning("request %s: replica %d died before it answered; sent to replica %d", request_id,
                               self.replicas.index(replica), self.replicas.index(other))
                stream = other.add_request(prompt, params, request_id, prompt_token_ids, **kwargs)
                self._owner[request_id] = other
                self.num_rerouted += 1
        finally:
            self._owner.pop(request_id, None)
            self._requests.pop(request_id, None)

    # The same as one engine's: tokenize, add_request (routed), stream_outputs.
    generate = AsyncEngine.generate

    def interrupt_all(self, error: BaseException) -> int:
        return sum(replica.interrupt_all(error) for replica in self.replicas)

    def abort(self, request_id: str) -> None:
        replica = self._owner.get(request_id)
        if replica is not None:
            replica.abort(request_id)

    def reset_prefix_cache(self) -> bool:
        return all([r.reset_prefix_cache() for r in self.replicas])

    @property
    def loras(self):
        return self.replicas[0].loras

    def lora_adapter(self, name: str | None):
        return self.replicas[0].lora_adapter(name)

    async def load_lora_adapter(self, name: str, path: str):
        """Loads the adapter into every replica (one replica's error: none keeps it)."""
        loaded = []
        try:
            for replica in self.replicas:
                loaded.append(await replica.load_lora_adapter(name, path))
        except Exception:
            for replica in self.replicas[:len(loaded)]:
                replica.unload_lora_adapter(name)
            raise
        return loaded[0]

    @property
    def is_sleeping(self) -> bool:
        return any(replica.is_sleeping for replica in self.replicas)

    async def sleep(self, level: int = 1) -> None:
        for replica in self.replicas:
            await replica.sleep(level)

    async def wake_up(self) -> None:
        await asyncio.gather(*(replica.wake_up() for replica in self.replicas))

    def unload_lora_adapter(self, name: str) -> None:
        for replica in self.replicas:
            replica.unload_lora_adapter(name)


def create_engine(config: EngineConfig,
                  plugin_manager: pluggy.PluginManager | None = None) -> AsyncEngine | DataParallelEngine:
    """One engine, or data_parallel_size replicas behind one."""
    if config.data_parallel_size > 1:
        return DataParallelEngine(config, plugin_manager)
    return AsyncEngine(config, plugin_manager)
