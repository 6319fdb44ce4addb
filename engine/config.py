"""EngineConfig: every knob of the engine, validated in one place."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

from pagoda.environment import read_int
from pagoda.engine import compatibility
from pagoda.engine.kv_events import KVEventsConfig
from pagoda.engine.speculative import SpeculativeConfig
from pagoda.engine.reasoning import REASONING_PARSERS
from pagoda.engine.sampling_params import POOLING_METHODS

DTYPES = ("auto", "float32", "bfloat16", "float16")
# The KV cache's element type: "auto" is the model's dtype; fp8 is e4m3 (vLLM's meaning).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
QUANTIZATIONS = ("auto", "none", "int8")
DEFAULT_KV_CACHE_BYTES = 2 * 1024**3
DEFAULT_SWAP_SPACE_BYTES = 4 * 1024**3
PREEMPTION_MODES = ("auto", "swap", "recompute")


@dataclass(slots=True)
class EngineConfig:
    """Configuration of one engine (scheduler, KV cache and worker).

    Attributes:
        model: Model directory, GGUF file, or None for the default model.
        dtype: Weight and activation dtype; "auto" picks bfloat16 on CPUs that run it
            fast and on CUDA, float32 elsewhere.
        kv_cache_dtype: The KV cache's element type: "auto" (the model's dtype), or
            "fp8_e4m3" ("fp8") or "fp8_e5m2": one byte an element, twice the tokens in the
            same memory and half the bytes read per decoded token, at fp8's precision
            (scale 1: values saturate at 448 or 57344; docs/kv-cache.md).
        quantization: How linear weights are stored and multiplied (CPU): "auto" (a GGUF
            file's own quantized types, through Pagoda's quantized kernel; float
            checkpoints in ``dtype``), "none" (everything dequantized to ``dtype``), or
            "int8" (every linear weight quantized to 8 bits per group of 32 at load;
            docs/quantization.md).
        block_size: Tokens per KV cache block.
        kv_cache_bytes: Memory given to the KV cache; used when num_kv_blocks is None.
            None: 2 GiB on the CPU; on a GPU, what gpu_memory_utilization leaves.
        num_kv_blocks: Exact number of KV blocks (overrides kv_cache_bytes).
        gpu_memory_utilization: On a GPU, the share of its memory the worker may use in
            all (vLLM's flag): the KV cache gets what is left of it after the weights, the
            activations' peak (measured by a forward of max_num_batched_tokens at start-up)
            and the memory outside torch. Used when neither kv_cache_bytes nor
            num_kv_blocks is given.
        max_model_len: Longest prompt + output, in tokens; None means the model's own.
        max_num_seqs: Most requests running in one step.
        max_num_batched_tokens: Token budget of one step.
        enable_chunked_prefill: Split long prompts over several steps.
        seed: Seed of the worker's default random generator.
        attention_backend: Name of the attention backend, or "auto".
        device: "cpu", "cuda", "cuda:N" or "auto". On CUDA, tensor-parallel rank r runs on
            the GPU r past the one named, and data-parallel replica i starts
            tensor_parallel_size x i GPUs further on.
        num_threads: Torch threads in the worker; None keeps torch's default.
        tensor_parallel_size: Worker processes (ranks) that split the model between them.
        distributed_executor_backend: How the ranks are started: "mp" (local processes)
            or "ray" (Ray actors, on a Ray cluster or a local one).
        data_parallel_size: Engine replicas behind one server or LLM, each with its own
            workers and KV cache; requests are routed by load and prefix-cache affinity.
        async_scheduling: Schedule and send step N+1 while the worker runs step N. None
            (auto): on when the engine has compute of its own to overlap with (the model
            on a GPU, or spare CPU cores beside the worker's threads), off otherwise: on
            a CPU whose cores the worker uses, the engine's work would slow it down.
        max_worker_restarts: Worker restarts allowed within worker_restart_window
            seconds; past that the engine stops serving.
        worker_restart_window: The window of max_worker_restarts, in seconds.
        standby_worker: Keep a second worker process started and waiting, with torch and the
            compiled model's code imported (at idle priority), so that a restart after a
            crash skips those seconds (about 420 MB of memory, per data-parallel replica; a
            single worker process only, not tensor-parallel ranks or Ray). None (auto): on
            under ``pagoda serve``, off elsewhere.
        enforce_eager: Run the model eagerly instead of compiling it with torch.compile
            at start-up (compiling takes seconds to a minute; steps then run faster).
        enable_prefix_caching: Reuse the KV of shared prompt prefixes.
        swap_space_bytes: CPU memory for swapped-out requests (0: recompute only).
        preemption_mode: "auto" (a chooser decides per victim), "swap" or "recompute".
        scheduling_policy: A registered scheduling policy (fcfs, priority,
            shortest-prompt-first, or a plugin's).
        eviction_policy: A registered eviction policy (lru, retention-priority, ...).
        plugins: ``module:object`` plugins to load after the installed ones.
        batch_invariant: Make every output independent of what it is batched with (and of
            chunked prefill, preemption and worker restarts): every kernel reduces in an
            order that does not depend on the batch. On the CPU in bfloat16 with Pagoda's
            own matrix kernel (AMX tiles for every row where they run, else AVX512-BF16),
            eager, cpu_paged attention. None (the default): on where it costs little
            (AVX512-BF16 without AMX tiles, a model whose steps run in one C call; measured
            at most 6% there), else off; on AMX tiles it costs up to 2.7x (docs/engine.md).
        pooling: How an embedding (``LLM.embed``, ``/v1/embeddings``) pools the prompt's
            final hidden states: "last" token (decoder embedding models), "mean" or
            "cls" (the first token).
        normalize_embeddings: Scale each embedding to unit length (L2).
        speculative_config: Speculative decoding (vLLM's ``--speculative-config``): a
            SpeculativeConfig, a dict of its fields or their JSON text, e.g.
            ``{"method": "ngram", "num_speculative_tokens": 4}``; None: off.
        reasoning_parser: The reasoning family of the model's output (``deepseek_r1``,
            ``qwen3``): a structured-output grammar then applies only after the thinking
            ends, and the server returns the thinking as ``reasoning_content``.
        enable_lora: Serve LoRA adapters (docs/lora.md): each adapted layer gets
            ``max_loras`` slots, and requests name an adapter as their model.
        lora_modules: Adapters loaded at start, as ``name=path`` (or vLLM's JSON form).
        max_loras: Adapters one step may run (the slots); requests of more wait.
        max_lora_rank: The highest rank an adapter may have (the slots' width).
        max_cpu_loras: Adapters the worker keeps beside the slots (least recently used
            dropped first); None: max_loras.
        kv_events_config: KV cache events for routers, vLLM's ``--kv-events-config``
            (engine/kv_events.py; docs/kv-cache.md): a dict, its JSON, or None (off).
        kv_offload_dir: The prefix cache's disk tier (engine/kv_offload.py; docs/kv-cache.md):
            every cached block is also written under this directory, and a prefix found
            there (after an eviction, a restart, or written by another replica of the same
            model) is read back instead of computed. None: off.
        kv_offload_bytes: The most the disk tier's files take; None: 8 GiB or half the
            disk's free space, whichever is less.
        kv_offload_host_bytes: Host memory for the prefix cache's evicted blocks: in front of
            the disk tier, the blocks used last; without kv_offload_dir, a tier of its own
            (the one a KV pool on a GPU wants; on a CPU server the pool is host memory
            already). None: none.
    """

    model: str | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    quantization: str = "auto"
    block_size: int = 16
    kv_cache_bytes: int | None = None
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    seed: int = 0
    attention_backend: str = "auto"
    device: str = "auto"
    num_threads: int | None = None
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "mp"
    data_parallel_size: int = 1
    async_scheduling: bool | None = None
    max_worker_restarts: int = 3
    worker_restart_window: int = 60
    standby_worker: bool | None = None
    enable_prefix_caching: bool = True
    swap_space_bytes: int = DEFAULT_SWAP_SPACE_BYTES
    preemption_mode: str = "auto"
    scheduling_policy: str = "fcfs"
    eviction_policy: str = "lru"
    plugins: tuple[str, ...] = ()
    reasoning_parser: str | None = None
    batch_invariant: bool | None = None
    pooling: str = "last"
    normalize_embeddings: bool = True
    speculative_config: SpeculativeConfig | dict | str | None = None
    enable_lora: bool = False
    lora_modules: tuple[str, ...] = ()
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    kv_events_config: KVEventsConfig | dict | str | None = None
    kv_offload_dir: str | None = None
    kv_offload_bytes: int | None = None
    kv_offload_host_bytes: int | None = None

    def __post_init__(self) -> None:
        _positive_int(self, "block_size")
        if self.kv_cache_bytes is not None:
            _positive_int(self, "kv_cache_bytes")
        if (not isinstance(self.gpu_memory_utilization, (int, float)) or isinstance(self.gpu_memory_utilization, bool)
                or not 0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1]; got {self.gpu_memory_utilization!r}")
        _positive_int(self, "max_num_seqs")
        _positive_int(self, "max_num_batched_tokens")
        if self.num_kv_blocks is not None:
            _positive_int(self, "num_kv_blocks")
        if self.max_model_len is not None:
            _positive_int(self, "max_model_len")
        if self.num_threads is not None:
            _positive_int(self, "num_threads")
        _positive_int(self, "worker_restart_window")
        _positive_int(self, "tensor_parallel_size")
        _positive_int(self, "data_parallel_size")
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError(f"distributed_executor_backend must be mp or ray; got "
                             f"{self.distributed_executor_backend!r}")
        if not isinstance(self.max_worker_restarts, int) or self.max_worker_restarts < 0:
            raise ValueError(f"max_worker_restarts must be a non-negative integer; got {self.max_worker_restarts!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {self.quantization!r}")
        # NOTE: the attention backend's name is checked against the backend registry when
        # the engine starts, so the list of names lives in one place.
        if self.device not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:\d+", str(self.device)):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N; got {self.device!r}")
        if not isinstance(self.swap_space_bytes, int) or self.swap_space_bytes < 0:
            raise ValueError(f"swap_space_bytes must be a non-negative integer; got {self.swap_space_bytes!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}; "
                             f"got {self.preemption_mode!r}")
        self.plugins = tuple(self.plugins)
        if not all(isinstance(p, str) and p for p in self.plugins):
            raise ValueError(f"plugins must be 'module:object' strings; got {self.plugins!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}; "
                             f"got {self.reasoning_parser!r}")
        if self.pooling not in POOLING_METHODS:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_METHODS)}; got {self.pooling!r}")
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer; got {self.seed!r}")
        self.kv_events_config = KVEventsConfig.parse(self.kv_events_config)
        _positive_int(self, "max_loras")
        _positive_int(self, "max_lora_rank")
        if self.max_cpu_loras is not None:
            _positive_int(self, "max_cpu_loras")
        if self.kv_offload_bytes is not None:
            _positive_int(self, "kv_offload_bytes")
            if self.kv_offload_dir is None:
                raise ValueError("kv_offload_bytes needs kv_offload_dir (--kv-offload-dir)")
        if self.kv_offload_host_bytes is not None:
            _positive_int(self, "kv_offload_host_bytes")
        if self.kv_offload_dir is not None:
            self.kv_offload_dir = str(self.kv_offload_dir)
        if self.offloads_kv and not self.enable_prefix_caching:
            raise ValueError("kv_offload_dir and kv_offload_host_bytes need prefix caching: the tier keeps the "
                             "prefix cache's blocks")
        self.lora_modules = tuple(self.lora_modules or ())
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora (--enable-lora)")
        compatibility.check(self)  # NOTE: last: it reads the fields checked above

    @property
    def offloads_kv(self) -> bool:
        """Whether the prefix cache has an offload tier (on disk, in host memory or both)."""
        return self.kv_offload_dir is not None or bool(self.kv_offload_host_bytes)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def _positive_int(config: EngineConfig, name: str) -> None:
    value = getattr(config, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer; got {value!r}")


def compiles_model(config: EngineConfig, device_type: str, world_size: int, batch_invariant: bool) -> bool:
    """Whether the worker compiles the model (torch.compile of its regions): on the CPU or a
    GPU, one rank, unless enforce_eager or batch invariance (``batch_invariant`` as the start
    plan resolved it)."""
    return device_type in ("cpu", "cuda") and world_size == 1 and not (config.enforce_eager or batch_invariant)


# NOTE: for tests: a device of this many bytes simulated on the CPU, so that the start that sizes
# the KV cache from a GPU's memory runs where no GPU is (the weights are measured, the rest 0).
SIMULATED_DEVICE_MEMORY_ENV = "PAGODA_SIMULATED_DEVICE_MEMORY"


def sizes_kv_from_memory(config: EngineConfig, device_type: str) -> bool:
    """Whether the worker sizes the KV cache from the device's free memory (on a GPU, unless
    kv_cache_bytes or num_kv_blocks is given)."""
    if config.kv_cache_bytes is not None or config.num_kv_blocks is not None:
        return False
    return device_type == "cuda" or read_int(SIMULATED_DEVICE_MEMORY_ENV) is not None
