"""The cpu_paged backend: attention by a CPU kernel that reads the KV blocks in place.

Every query row of a step, prefill chunks and decodes alike, goes to the C kernel in
csrc/paged_attention.c (built on first use for this CPU, see cpu_kernels.py): each
request reads only its own blocks, with no gather into a padded copy, so one long request
among short ones costs only its own length; a prefill chunk is cut into tiles of a few
query tokens, and each tile reads its context once. The step's new keys and values are
written into their slots by the same library. Keys are stored transposed within each
block so the kernel computes a block's scores with vector lanes over the block's tokens.

Dtypes: bfloat16 and float32 use the kernels; other dtypes (float16) fall back to
torch_sdpa's torch code on the same layout.
"""

from __future__ import annotations

import torch

from pagoda.attention_backends import cpu_kernels
from pagoda.attention_backends.base import AttentionMetadata
from pagoda.attention_backends.torch_sdpa import TorchSdpaAttentionBackend


class CpuPagedAttentionBackend(TorchSdpaAttentionBackend):
    """The paged CPU kernels, with torch_sdpa's code for the dtypes they lack."""

    name = "cpu_paged"
    keys_transposed = True

    @classmethod
    def is_available(cls, device: torch.device) -> bool:
        return device.type == "cpu" and cpu_kernels.available()

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str:
        if device.type != "cpu":
            return "it is a CPU backend"
        return "its CPU kernels could not be built (a C compiler is needed; see the log)"

    def prepare(self, metadata: AttentionMetadata) -> None:
        # NOTE: the kernels need nothing beyond the metadata; torch_sdpa's view of the step
        # is built only if a dtype without kernels asks for it (see forward).
        metadata.backend_data = None

    def write_kv(self, key, value, kv_cache, slot_mapping) -> None:
        key_cache, value_cache = kv_cache
        if not cpu_kernels.supports(key_cache.dtype):
            return super().write_kv(key, value, kv_cache, slot_mapping)
        cpu_kernels.write_kv(key.to(key_cache.dtype).contiguous(), value.to(value_cache.dtype).contiguous(),
                             slot_mapping, key_cache, value_cache)

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata) -> torch.Tensor:
        key_cache, value_cache = kv_cache
        if not cpu_kernels.supports(query.dtype) or key_cache.dtype != query.dtype:
            if metadata.backend_data is None:
                super().prepare(metadata)
            return super().forward(query, key, value, kv_cache, metadata)
        self.write_kv(key, value, kv_cache, metadata.slot_mapping)
        return cpu_kernels.paged_attention(query.contiguous(), key_cache, value_cache, metadata.block_tables,
                                           metadata.seq_lens_tensor, metadata.query_start_loc, self.scale)
