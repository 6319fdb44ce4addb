"""The attention interface: paged KV write plus attention over block tables.

Backends import nothing from the rest of Pagoda: they see tensors and this metadata.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

# The KV cache's element types besides the model's own dtype (the engine's kv_cache_dtype):
# fp8 halves the cache's bytes, so the same memory holds twice the tokens and a decode reads
# half as many bytes. Scales are 1 (no calibration): values saturate at the format's largest
# finite value (448 for e4m3, 57344 for e5m2).
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in the cache's dtype; into fp8 with saturation (torch's conversion overflows to
    inf or NaN past the largest finite value)."""
    if dtype in FP8_DTYPES:
        limit = torch.finfo(dtype).max
        return x.clamp(-limit, limit).to(dtype)
    return x.to(dtype)


def cache_storage(cache: torch.Tensor) -> torch.Tensor:
    """The cache's bytes as uint8 where it is fp8 (torch lacks some ops, index_copy_ among
    them, for fp8 tensors on the CPU), else the cache itself."""
    return cache.view(torch.uint8) if cache.dtype in FP8_DTYPES else cache


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """``cache[block_ids]`` (int64 ids), in the cache's dtype."""
    return cache_storage(cache).index_select(0, block_ids).view(cache.dtype)


@dataclass(slots=True)
class AttentionMetadata:
    """Describes one step's flattened batch; built once per step, shared by all layers.

    Request ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i + 1]``; its
    queries are the last ``query_lens[i]`` of its ``seq_lens[i]`` tokens, whose K/V live
    in the blocks ``block_tables[i]`` (padded with zeros past its last block).

    Attributes:
        num_tokens: Rows in the flattened batch.
        query_lens: New tokens per request (Python list, for host-side loops).
        seq_lens: Context length per request after this step (Python list).
        query_start_loc: int32 [num_reqs + 1] cumulative query_lens.
        seq_lens_tensor: int32 [num_reqs].
        block_tables: int32 [num_reqs, max_blocks_per_req].
        slot_mapping: int64 [num_tokens]: cache slot (block_id * block_size + offset)
            where each new token's K/V is written.
        block_size: Tokens per block.
        max_query_len: Longest query.
        max_seq_len: Longest context.
        block_tables_host: The block tables on the host (numpy), where the caller has
            them: a backend that plans on the CPU reads them instead of copying
            ``block_tables`` back from a GPU (a sync).
        backend_data: Whatever the backend's prepare() derived from the above.
        sliding: The same step over the sliding layers' own block tables and slots, where
            only some layers slide and theirs have a pool of their own (None otherwise).
    """

    num_tokens: int
    query_lens: list[int]
    seq_lens: list[int]
    query_start_loc: torch.Tensor
    seq_lens_tensor: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    block_size: int
    max_query_len: int
    max_seq_len: int
    block_tables_host: np.ndarray | None = None
    backend_data: Any = None
    sliding: AttentionMetadata | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)


class AttentionBackend(ABC):
    """One attention implementation over the paged KV cache.

    The KV cache of a layer is a pair of tensors (keys, values) of the shapes the
    backend asks for in ``kv_cache_shapes`` (by default both ``[num_blocks, block_size,
    num_kv_heads, head_dim]``), allocated once by the worker; only the backend reads or
    writes inside a block, and cache slot ``block_id * block_size + offset`` is how the
    rest of the engine names a token's place. Block ``i`` is ``cache[i]`` in every
    layout, so whole blocks can be copied (swap, copy-on-write) without knowing it.

    Args:
        num_heads: Query heads.
        num_kv_heads: Key/value heads (grouped-query attention when fewer).
        head_dim: Size of one head.
        scale: Softmax scale, usually head_dim ** -0.5.
    """

    name: str = "abstract"
    # The cache dtypes besides the model's own (FP8_DTYPES) that the backend reads and writes.
    fp8_kv_cache: tuple[torch.dtype, ...] = ()

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    @classmethod
    def is_available(cls, device: torch.device) -> bool:
        """Whether the backend can run on ``device`` in this environment."""
        return True

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str:
        """Why is_available is False on ``device`` (for the error message)."""
        return "it does not support this device"

    @classmethod
    def shape_problem(cls, dtype: torch.dtype, head_dim: int, num_heads: int, num_kv_heads: int,
                      window_or_softcap: bool = False) -> str | None:
        """Why the backend cannot attend in ``dtype`` with these heads (and windows or soft caps,
        asked only of backends that support_window_and_softcap), or None if it can."""
        return None

    # Whether forward() takes ``window`` (keys within the last ``window`` positions of each
    # query's) and ``softcap`` (scores s become softcap * tanh(s / softcap)), per layer.
    supports_window_and_softcap: bool = False

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of one layer's key (and value) cache tensor."""
        return (num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def kv_cache_shapes(self, num_blocks: int, block_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of one layer's key cache and value cache (the same unless a backend
        lays keys out differently from values)."""
        shape = self.kv_cache_shape(num_blocks, block_size)
        return shape, shape

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                 slot_mapping: torch.Tensor) -> None:
        """Stores new keys and values ([num_tokens, num_kv_heads, head_dim]) in their slots."""
        for cache, new in zip(kv_cache, (key, value)):
            cache_storage(cache).view(-1, self.num_kv_heads, self.head_dim).index_copy_(
                0, slot_mapping, cache_storage(to_cache_dtype(new, cache.dtype)))

    def copy_blocks(self, src_cache: torch.Tensor, dst_cache: torch.Tensor, src_ids: torch.Tensor,
                    dst_ids: torch.Tensor, block_size: int) -> None:
        """Copies whole blocks ``src_ids`` of one cache tensor into ``dst_ids`` of another
        (or the same: copy-on-write). Used for swapping and copy-on-write."""
        dst, src = cache_storage(dst_cache), cache_storage(src_cache)
        dst[dst_ids.to(dst.device)] = src[src_ids.to(src.device)].to(dst.device)

    def prepare(self, metadata: AttentionMetadata) -> None:
        """Derives per-step data shared by every layer into ``metadata.backend_data``."""

    # Whether prepare_decode_graph can plan decode steps for CUDA graphs.
    supports_decode_graphs: bool = False

    def prepare_decode_graph(self, metadata: AttentionMetadata, kv_dtype: torch.dtype) -> None:
        """Plans, once, every step of ``metadata.num_reqs`` decodes (one query each) whose
        lengths, block tables and slots are later written into metadata's tensors in place:
        a CUDA graph's plan, which may read nothing of a step on the host (its lists hold
        the longest lengths, not a step's). Only where ``supports_decode_graphs``."""
        raise NotImplementedError(f"the {self.name} backend does not plan decode steps for CUDA graphs")

    def update_decode_graph(self, metadata: AttentionMetadata, seq_lens: np.ndarray, block_tables: np.ndarray) -> None:
        """Before a replay: whatever the backend keeps beside metadata's tensors for the step
        (its host lengths and block tables, padding rows included). Nothing by default."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Writes the new K/V into their slots, then attends over each request's context.

        Args:
            query: [num_tokens, num_heads, head_dim].
            key: [num_tokens, num_kv_heads, head_dim], the new tokens' keys.
            value: [num_tokens, num_kv_heads, head_dim].
            kv_cache: This layer's (key_cache, value_cache).
            metadata: The step's batch description.
            window, softcap: Keyword arguments, only to backends that
                ``supports_window_and_softcap``, only for the layers that have them.

        Returns:
            [num_tokens, num_heads, head_dim].
        """


def context_slots(block_table: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """Cache slots of a request's first ``seq_len`` tokens, in order."""
    positions = torch.arange(seq_len, device=block_table.device)
    return block_table[positions // block_size].long() * block_size + positions % block_size
