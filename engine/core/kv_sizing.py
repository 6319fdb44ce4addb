"""How many KV blocks the cache gets and how long a request may be: a pure function of the
configuration and the model's shape (no torch, no I/O; unit-tested on its own)."""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.engine.config import EngineConfig
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
        limited_by_window: max_model_len was cut to the model's sliding window (which
            Pagoda does not implement; within the window attention is exact).
    """

    num_blocks: int
    num_cpu_blocks: int
    block_size: int
    bytes_per_block: int
    max_model_len: int
    limited_by_window: bool = False

    @property
    def num_tokens(self) -> int:
        """Tokens the cache holds."""
        return self.num_blocks * self.block_size

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


def bytes_per_block(model: ModelConfig, block_size: int, dtype_size: int, tensor_parallel_size: int = 1) -> int:
    """Bytes of one block (K and V of every layer) on the rank that holds the most KV heads
    (all of them without tensor parallelism): kv_cache_bytes is what each rank may use."""
    kv_heads = max(head_share(model.num_attention_heads, model.num_key_value_heads, rank,
                              tensor_parallel_size).num_kv_heads for rank in range(tensor_parallel_size))
    return 2 * model.num_hidden_layers * block_size * kv_heads * model.head_dim * dtype_size


def size_kv_cache(config: EngineConfig, model: ModelConfig, dtype_size: int,
                  draft: ModelConfig | None = None) -> KVCacheSize:
    """Sizes the cache from ``config.kv_cache_bytes`` (or ``num_kv_blocks``) and the model.

    Never more blocks than ``max_num_seqs`` full-length requests can use.

    Args:
        config: The engine configuration.
        model: The model's shape.
        dtype_size: Bytes of one element of the KV cache's dtype.
        draft: Speculative decoding's draft model, whose cache has the same blocks: a
            block's bytes are both models'.

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
    window = model.sliding_window
    limited_by_window = False
    if window is not None and wanted_len > window:
        if config.max_model_len is not None:
            raise ValueError(f"max_model_len ({config.max_model_len}) exceeds the model's sliding window "
                             f"({window}), which Pagoda does not implement yet")
        wanted_len, limited_by_window = window, True
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    else:
        num_blocks = min(config.kv_cache_bytes // block_bytes,
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
    return KVCacheSize(num_blocks=num_blocks, num_cpu_blocks=config.swap_space_bytes // block_bytes,
                       block_size=config.block_size, bytes_per_block=block_bytes, max_model_len=max_model_len,
                       limited_by_window=limited_by_window)
