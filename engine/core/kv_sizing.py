"""How many KV blocks the cache gets and how long a request may be: a pure function of the
configuration and the model's shape (no torch, no I/O; unit-tested on its own)."""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.engine.config import DEFAULT_KV_CACHE_BYTES, EngineConfig
from pagoda.engine.messages import DeviceMemory
from pagoda.engine.model_config import ModelConfig
from pagoda.engine.tensor_parallel import head_share


@dataclass(frozen=True, slots=True)
class KVCacheSize:
    """The KV cache the engine allocates.

    Attributes:
        num_blocks: Blocks of the cache on the model's device.
        num_cpu_blocks: Blocks of the CPU swap space.
        block_size: Tokens per block.
        bytes_per_block: Bytes of one block on the rank that holds the most KV heads.
        max_model_len: Longest prompt plus output one request may have.
        limited_by_window: max_model_len was cut to the model's sliding window (the attention
            backend runs no windows; within the window attention is exact).
        sliding_window: Every layer attends within this many positions, or with
            num_sliding_blocks the sliding layers do; the blocks before the window go back to
            the pool (None: a request keeps all of its blocks).
        lookback: Positions a request may go back by (rejected draft tokens), whose blocks
            are kept beside the window's.
        num_sliding_blocks: Where only some layers slide (Gemma): blocks of the sliding
            layers' own pool (engine/core/hybrid_kv_cache_manager.py); num_blocks and
            bytes_per_block are then the global layers'. 0: one pool for every layer.
        sliding_bytes_per_block: Bytes of one block of the sliding layers' pool.
    """

    num_blocks: int
    num_cpu_blocks: int
    block_size: int
    bytes_per_block: int
    max_model_len: int
    limited_by_window: bool = False
    sliding_window: int | None = None
    lookback: int = 0
    num_sliding_blocks: int = 0
    sliding_bytes_per_block: int = 0

    @property
    def num_tokens(self) -> int:
        """Tokens the cache holds (in the global layers, where only some slide)."""
        return self.num_blocks * self.block_size

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block + self.num_sliding_blocks * self.sliding_bytes_per_block


def bytes_per_block(model: ModelConfig, block_size: int, dtype_size: int, tensor_parallel_size: int = 1,
                    num_layers: int | None = None) -> int:
    """Bytes of one block (K and V of every layer, or of ``num_layers``) on the rank that holds
    the most KV heads (all of them without tensor parallelism): kv_cache_bytes is what each rank
    may use."""
    kv_heads = max(head_share(model.num_attention_heads, model.num_key_value_heads, rank,
                              tensor_parallel_size).num_kv_heads for rank in range(tensor_parallel_size))
    layers = model.num_hidden_layers if num_layers is None else num_layers
    return 2 * layers * block_size * kv_heads * model.head_dim * dtype_size


def splits_sliding_layers(config: EngineConfig, model: ModelConfig, windows_run: bool, has_draft: bool) -> bool:
    """Whether the sliding layers of a model whose layers only partly slide get a pool of their
    own: where the backend runs windows, with no draft model (whose layers read the global
    table) and no disk tier (which stores one pool's blocks)."""
    return (model.sliding_window is not None and model.sliding_layers is not None and windows_run
            and not has_draft and not config.offloads_kv)


def _split_pools(config: EngineConfig, model: ModelConfig, dtype_size: int, num_blocks: int | None,
                 cache_bytes: int, wanted_len: int, lookback: int) -> tuple[int, int, int, int]:
    """(global blocks, sliding blocks, their bytes each) of a model whose sliding layers have
    a pool of their own: the sliding pool holds the window of every request that may run
    (and a step's new tokens), never more blocks than the global pool; the rest is global."""
    size = config.block_size
    num_sliding_layers = len(model.sliding_layers)
    full_bytes = bytes_per_block(model, size, dtype_size, config.tensor_parallel_size,
                                 model.num_hidden_layers - num_sliding_layers)
    sliding_bytes = bytes_per_block(model, size, dtype_size, config.tensor_parallel_size, num_sliding_layers)
    windows = config.max_num_seqs * (-(-(model.sliding_window + lookback) // size) + 2) + \
        -(-config.max_num_batched_tokens // size)
    num_sliding = windows
    if num_blocks is None:
        # NOTE: never fewer global blocks than one pool for every layer would have had.
        num_sliding = min(windows, cache_bytes // (full_bytes + sliding_bytes))
        num_blocks = min((cache_bytes - num_sliding * sliding_bytes) // full_bytes,
                         config.max_num_seqs * -(-wanted_len // size))
    return num_blocks, min(num_sliding, num_blocks), full_bytes, sliding_bytes


def size_kv_cache(config: EngineConfig, model: ModelConfig, dtype_size: int,
                  draft: ModelConfig | None = None, budget: int | None = None,
                  windows_run: bool = False) -> KVCacheSize:
    """Sizes the cache from ``config.kv_cache_bytes`` (or ``num_kv_blocks``, or a budget
    measured on the device) and the model.

    Never more blocks than ``max_num_seqs`` full-length requests can use.

    Args:
        config: The engine configuration.
        model: The model's shape.
        dtype_size: Bytes of one element of the KV cache's dtype.
        draft: Speculative decoding's draft model, whose cache has the same blocks: a
            block's bytes are both models'.
        budget: Bytes for the cache measured on the device (:func:`kv_cache_budget`), in
            place of ``config.kv_cache_bytes``.
        windows_run: The attention backend runs sliding windows: a model whose every layer
            has one serves its whole context, and its requests give back the blocks before
            the window (without a draft model, whose layers read the same blocks); else
            max_model_len is capped at the window.

    Raises:
        ValueError: max_model_len is longer than the model's context or window, or does
            not fit in the cache; the cache holds no request at all; or chunked prefill is
            off and max_num_batched_tokens is shorter than max_model_len.
    """
    block_bytes = bytes_per_block(model, config.block_size, dtype_size, config.tensor_parallel_size)
    if draft is not None:
        block_bytes += bytes_per_block(draft, config.block_size, dtype_size, config.tensor_parallel_size)
    model_len = model.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > model_len:
        raise ValueError(f"max_model_len ({config.max_model_len}) is larger than the model's context "
                         f"length ({model_len})")
    wanted_len = config.max_model_len or model_len
    # NOTE: where only some layers have a window (Gemma), the others need every key.
    window = model.sliding_window if model.windowed_everywhere else None
    limited_by_window = False
    spec = config.speculative_config
    lookback = spec.num_speculative_tokens if spec is not None else 0
    bounded = window is not None and windows_run and draft is None
    # Tokens one request holds at most: with the window bounding it, the window's, the lookback's
    # and a step's (in blocks, with one partly before the window).
    held = min(wanted_len, window + lookback + config.max_num_batched_tokens + config.block_size) if bounded \
        else wanted_len
    if window is not None and wanted_len > window and not windows_run:
        if config.max_model_len is not None:
            raise ValueError(f"max_model_len ({config.max_model_len}) exceeds the model's sliding window "
                             f"({window}), and the attention backend runs no windows (cpu_paged, naive and triton do)")
        wanted_len, limited_by_window = window, True
    cache_bytes = budget if budget is not None else config.kv_cache_bytes or DEFAULT_KV_CACHE_BYTES
    num_sliding = sliding_bytes = 0
    if splits_sliding_layers(config, model, windows_run, draft is not None):
        num_blocks, num_sliding, block_bytes, sliding_bytes = _split_pools(
            config, model, dtype_size, config.num_kv_blocks, cache_bytes, wanted_len, lookback)
        window = model.sliding_window
    elif config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    else:
        num_blocks = min(cache_bytes // block_bytes,
                         config.max_num_seqs * -(-held // config.block_size))
    capacity = num_blocks * config.block_size
    if config.max_model_len is not None and min(config.max_model_len, held) > capacity:
        raise ValueError(f"max_model_len ({config.max_model_len}) does not fit in the KV cache "
                         f"({num_blocks} blocks of {config.block_size} tokens = {capacity} tokens); "
                         "give the cache more memory or lower max_model_len")
    max_model_len = wanted_len if held < wanted_len and held <= capacity else min(wanted_len, capacity)
    if max_model_len < 2:
        raise ValueError(f"the KV cache ({num_blocks} blocks) is too small to serve any request")
    if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
        raise ValueError(f"max_num_batched_tokens ({config.max_num_batched_tokens}) must be >= max_model_len "
                         f"({max_model_len}) when chunked prefill is disabled")
    # NOTE: requests of two pools are not swapped (preemption recomputes them).
    return KVCacheSize(num_blocks=num_blocks, num_cpu_blocks=0 if num_sliding else config.swap_space_bytes // block_bytes,
                       block_size=config.block_size, bytes_per_block=block_bytes, max_model_len=max_model_len,
                       limited_by_window=limited_by_window,
                       sliding_window=window if bounded or num_sliding else None, lookback=lookback,
                       num_sliding_blocks=num_sliding, sliding_bytes_per_block=sliding_bytes)


def kv_cache_budget(memory: DeviceMemory, utilization: float) -> int:
    """Bytes the KV cache may take: ``utilization`` of the device's memory, less the weights,
    the activations' peak, what stays reserved beside the cache and the memory outside torch
    (vLLM's rule).

    Raises:
        ValueError: Other processes (and the worker's own CUDA context) already hold more
            than ``1 - utilization`` of the device, or nothing is left for the cache.
    """
    gib = 1024**3
    wanted = int(memory.total * utilization)
    if memory.free_at_start < wanted:
        raise ValueError(f"the device has {memory.free_at_start / gib:.2f} GiB free of {memory.total / gib:.2f} GiB "
                         f"at start-up (other processes and the worker's own CUDA context hold the rest), less than "
                         f"gpu_memory_utilization {utilization} asks for ({wanted / gib:.2f} GiB): lower "
                         "gpu_memory_utilization or free the device")
    budget = wanted - memory.weights - memory.peak_activations - memory.reserved - memory.non_torch
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization {utilization} ({wanted / gib:.2f} GiB of {memory.total / gib:.2f} "
                         f"GiB) leaves nothing for the KV cache: weights {memory.weights / gib:.2f} GiB, activations "
                         f"{memory.peak_activations / gib:.2f} GiB, reserved {memory.reserved / gib:.2f} GiB, "
                         f"outside torch {memory.non_torch / gib:.2f} GiB; raise gpu_memory_utilization, lower "
                         "max_num_batched_tokens or max_num_seqs, or use a smaller model")
    return budget
