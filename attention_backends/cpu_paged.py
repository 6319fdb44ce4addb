"""The cpu_paged backend: decode attention by a CPU kernel that reads the blocks in place.

Prefill chunks run through torch's scaled_dot_product_attention, as in torch_sdpa. Decode
rows go to the C kernel in csrc/paged_attention.c (built on first use for this CPU, see
cpu_kernels.py): each request reads only its own blocks, once, with no gather into a
padded copy, so one long request among short ones costs only its own length. Keys are
stored transposed within each block so the kernel computes a block's scores with vector
lanes over the block's tokens.

Dtypes: bfloat16 and float32 use the kernel; other dtypes (float16) fall back to the
torch decode path of torch_sdpa on the same layout.
"""

from __future__ import annotations

import torch

from attention_backends import cpu_kernels
from attention_backends.torch_sdpa import TorchSdpaAttentionBackend, _SdpaData


class CpuPagedAttentionBackend(TorchSdpaAttentionBackend):
    """torch_sdpa's prefill, plus the paged CPU decode kernel."""

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

    def _decode(self, query, key_cache, value_cache, data: _SdpaData) -> torch.Tensor:
        if not cpu_kernels.supports(query.dtype):
            return super()._decode(query, key_cache, value_cache, data)
        block_tables = data.decode_block_tables
        if block_tables.stride(1) != 1:
            block_tables = block_tables.contiguous()
        return cpu_kernels.paged_decode(query.contiguous(), key_cache, value_cache, block_tables,
                                        data.decode_seq_lens.contiguous(), self.scale)
