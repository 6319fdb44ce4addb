"""The triton backend: Triton kernels that write K/V into their slots and attend over block tables.

Two kernels, one layout (the default ``[num_blocks, block_size, num_kv_heads, head_dim]``):

* ``write_kv``: one program per (token, KV head) copies the new key and value into the
  token's slot.
* ``paged_attention``: one program per (tile of up to ``BLOCK_M`` query tokens of one
  request, query head). It walks the request's context ``BLOCK_N`` tokens at a time,
  looking every token's block up in the block table (so any block size works, 1
  included, and contexts need not fill their last block), masks causally against the
  query positions (a chunk's queries are the last tokens of the context, so prefill over
  a cached prefix, chunked prefill and decode are one case), and keeps an online softmax
  in float32. Query head ``h`` reads KV head ``h // (num_heads / num_kv_heads)``.

On a GPU the kernels are compiled by Triton. On the CPU they run only under Triton's
interpreter (``TRITON_INTERPRET=1``), which is how the test suite checks their logic on
every machine; that is slow and meant for tests, not for serving.

The kernels are defined on first use, not at import: Triton reads TRITON_INTERPRET when
a kernel is defined.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch

from pagoda.attention_backends.base import AttentionBackend, AttentionMetadata

BLOCK_M = 16  # query tokens per program
BLOCK_N = 32  # context tokens per loop iteration


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _kernels(interpret: bool):
    """Defines the kernels (once per mode: compiled, or interpreted on the CPU)."""
    import triton
    import triton.language as tl

    @triton.jit
    def write_kv_kernel(key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
                        stride_key_tok, stride_key_head, stride_value_tok, stride_value_head,
                        stride_kc_block, stride_kc_slot, stride_kc_head,
                        stride_vc_block, stride_vc_slot, stride_vc_head,
                        BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
        token = tl.program_id(0)
        head = tl.program_id(1)
        slot = tl.load(slot_ptr + token)
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        dims = tl.arange(0, HEAD_DIM_PAD)
        mask = dims < HEAD_DIM
        key = tl.load(key_ptr + token * stride_key_tok + head * stride_key_head + dims, mask=mask)
        value = tl.load(value_ptr + token * stride_value_tok + head * stride_value_head + dims, mask=mask)
        tl.store(key_cache_ptr + block * stride_kc_block + offset * stride_kc_slot + head * stride_kc_head + dims,
                 key, mask=mask)
        tl.store(value_cache_ptr + block * stride_vc_block + offset * stride_vc_slot + head * stride_vc_head + dims,
                 value, mask=mask)

    @triton.jit
    def paged_attention_kernel(query_ptr, key_cache_ptr, value_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr,
                               query_start_ptr, tile_request_ptr, tile_start_ptr, scale,
                               stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
                               stride_kc_block, stride_kc_slot, stride_kc_head,
                               stride_vc_block, stride_vc_slot, stride_vc_head, stride_table,
                               QUERIES_PER_KV: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                               HEAD_DIM_PAD: tl.constexpr, TILE_M: tl.constexpr, TILE_N: tl.constexpr,
                               DOT_IN_FP32: tl.constexpr):
        tile = tl.program_id(0)
        head = tl.program_id(1)
        kv_head = head // QUERIES_PER_KV
        request = tl.load(tile_request_ptr + tile)
        query_begin = tl.load(query_start_ptr + request)
        query_len = tl.load(query_start_ptr + request + 1) - query_begin
        seq_len = tl.load(seq_lens_ptr + request)
        first = tl.load(tile_start_ptr + tile)  # the tile's first query, counted within the request

        rows = first + tl.arange(0, TILE_M)
        row_mask = rows < query_len
        dims = tl.arange(0, HEAD_DIM_PAD)
        dim_mask = dims < HEAD_DIM
        q = tl.load(query_ptr + (query_begin + rows)[:, None] * stride_q_tok + head * stride_q_head + dims[None, :],
                    mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
        # A chunk's queries are the last query_len tokens of the context.
        positions = seq_len - query_len + rows

        m_i = tl.full([TILE_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([TILE_M], dtype=tl.float32)
        acc = tl.zeros([TILE_M, HEAD_DIM_PAD], dtype=tl.float32)
        context_end = tl.minimum(seq_len, seq_len - query_len + first + TILE_M)
        for start in range(0, context_end, TILE_N):
            cols = start + tl.arange(0, TILE_N)
            col_mask = cols < context_end
            # NOTE: in int64: block * stride passes 2^31 once one layer's cache holds that many
            # elements (4 GiB in bfloat16), well within a GPU's memory.
            blocks = tl.load(block_tables_ptr + request * stride_table + cols // BLOCK_SIZE, mask=col_mask,
                             other=0).to(tl.int64)
            offsets = cols % BLOCK_SIZE
            kv_mask = col_mask[:, None] & dim_mask[None, :]
            k = tl.load(key_cache_ptr + blocks[:, None] * stride_kc_block + offsets[:, None] * stride_kc_slot
                        + kv_head * stride_kc_head + dims[None, :], mask=kv_mask, other=0.0)
            if DOT_IN_FP32:
                scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
            else:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            visible = (cols[None, :] <= positions[:, None]) & col_mask[None, :]
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(value_cache_ptr + blocks[:, None] * stride_vc_block + offsets[:, None] * stride_vc_slot
                        + kv_head * stride_vc_head + dims[None, :], mask=kv_mask, other=0.0)
            p = p.to(v.dtype)  # NOTE: rounded to the cache dtype, as on a GPU's tensor cores
            if DOT_IN_FP32:
                acc = acc * alpha[:, None] + tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(out_ptr + (query_begin + rows)[:, None] * stride_o_tok + head * stride_o_head + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])

    return write_kv_kernel, paged_attention_kernel


class TritonAttentionBackend(AttentionBackend):
    """Paged attention with Triton kernels (compiled on CUDA, interpreted on the CPU)."""

    name = "triton"

    @classmethod
    def is_available(cls, device: torch.device) -> bool:
        try:
            import triton  # noqa: F401
        except ImportError:
            return False
        return device.type == "cuda" or (device.type == "cpu" and interpreting())

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str:
        try:
            import triton  # noqa: F401
        except ImportError:
            return "the triton package is not installed (pip install 'pagoda[triton]')"
        return "it needs a CUDA device (on the CPU it runs only under TRITON_INTERPRET=1, for tests)"

    def _head_dim_pad(self) -> int:
        return max(16, 1 << (self.head_dim - 1).bit_length())

    def write_kv(self, key, value, kv_cache, slot_mapping) -> None:
        key_cache, value_cache = kv_cache
        write_kv_kernel, _ = _kernels(interpreting())
        key = key.to(key_cache.dtype)
        value = value.to(value_cache.dtype)
        write_kv_kernel[(key.shape[0], self.num_kv_heads)](
            key, value, key_cache, value_cache, slot_mapping,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
            BLOCK_SIZE=key_cache.shape[1], HEAD_DIM=self.head_dim, HEAD_DIM_PAD=self._head_dim_pad())

    def prepare(self, metadata: AttentionMetadata) -> None:
        """Cuts every request's queries into tiles of BLOCK_M: one program per tile and head."""
        query_lens = np.asarray(metadata.query_lens)
        num_tiles = -(-query_lens // BLOCK_M)
        tile_request = np.repeat(np.arange(len(query_lens)), num_tiles)
        first_tile = np.concatenate([[0], np.cumsum(num_tiles)[:-1]])
        tile_start = (np.arange(len(tile_request)) - first_tile[tile_request]) * BLOCK_M
        device = metadata.block_tables.device
        metadata.backend_data = (torch.from_numpy(tile_request.astype(np.int32)).to(device),
                                 torch.from_numpy(tile_start.astype(np.int32)).to(device))

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata) -> torch.Tensor:
        self.write_kv(key, value, kv_cache, metadata.slot_mapping)
        key_cache, value_cache = kv_cache
        _, attention_kernel = _kernels(interpreting())
        tile_request, tile_start = metadata.backend_data
        query = query.to(key_cache.dtype)
        out = torch.empty_like(query)
        block_tables = metadata.block_tables
        attention_kernel[(tile_request.shape[0], self.num_heads)](
            query, key_cache, value_cache, out, block_tables, metadata.seq_lens_tensor, metadata.query_start_loc,
            tile_request, tile_start, self.scale,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_tables.stride(0),
            QUERIES_PER_KV=self.num_heads // self.num_kv_heads, BLOCK_SIZE=key_cache.shape[1],
            HEAD_DIM=self.head_dim, HEAD_DIM_PAD=self._head_dim_pad(), TILE_M=BLOCK_M, TILE_N=BLOCK_N,
            # NOTE: Triton's interpreter computes tl.dot of half-precision inputs wrongly;
            # there the products are taken in float32 (the same values, bf16 -> fp32 is exact).
            DOT_IN_FP32=interpreting())
        return out
