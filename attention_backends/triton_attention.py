"""The triton backend: Triton kernels that write K/V into their slots and attend over block tables.

Three kernels, one layout (the default ``[num_blocks, block_size, num_kv_heads, head_dim]``):

* ``write_kv``: one program per (token, KV head) copies the new key and value into the
  token's slot.
* ``paged_attention``: one program per (tile of a request's queries, KV head): the tile's
  rows are its query tokens times the query heads that read that KV head (grouped-query
  attention packed into the rows, so a group's keys and values are loaded once, not once per
  query head). It walks the request's context ``BLOCK_N`` tokens at a time, looking every
  token's block up in the block table (so any block size works, 1 included, and contexts
  need not fill their last block), masks causally against the query positions (a chunk's
  queries are the last tokens of the context, so prefill over a cached prefix, chunked
  prefill and decode are one case), and keeps an online softmax in float32. A layer with a
  sliding window starts the walk at its tile's first query's window and masks each row's keys
  before its own; one with a soft cap maps each score s to ``cap * tanh(s / cap)`` first.
* Split-KV: when a step has too few programs to keep a GPU busy (a few decodes over long
  contexts), each program takes one part of the context and writes its result with its
  log-sum-exp; ``merge`` combines the parts of each query row and head.

:func:`plan_tiles` decides the tiles and the split from the step's lengths (CPU lists).

On a GPU the kernels are compiled by Triton. On the CPU they run only under Triton's
interpreter (``TRITON_INTERPRET=1``), which is how the test suite checks their logic on
every machine; that is slow and meant for tests, not for serving.

The kernels are defined on first use, not at import: Triton reads TRITON_INTERPRET when
a kernel is defined.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np
import torch

from pagoda.attention_backends.base import AttentionBackend, AttentionMetadata

BLOCK_M = 16  # query tokens per program, at most
BLOCK_N = 32  # context tokens per loop iteration
MAX_ROWS = 64  # query rows (tokens x the query heads of one KV head) per program, at most
MIN_ROWS = 16  # tl.dot's smallest M: fewer real rows are padded to it
# Split-KV: a step with fewer programs than a GPU keeps busy (about two per SM of an H100/H200)
# has its contexts cut into parts of at least SPLIT_MIN_LEN tokens, each part a program.
SPLIT_TARGET_PROGRAMS = 256
SPLIT_MIN_LEN = 256
MAX_SPLITS = 32


@dataclass(frozen=True, slots=True)
class TilePlan:
    """How one step's queries are cut into programs (host side, from CPU lists: no sync).

    Attributes:
        tile_request: int32 per tile: its request.
        tile_start: int32 per tile: its first query, counted within the request.
        tokens: Query tokens per tile (1 when every request decodes).
        group_pad: Rows per token: the query heads of one KV head, padded to a power of 2
            (and so that a tile has at least MIN_ROWS rows).
        num_splits: Parts each tile's context is cut into, each part a program (1: no
            split-KV); the kernel sizes a request's parts from its own length.
    """

    tile_request: np.ndarray
    tile_start: np.ndarray
    tokens: int
    group_pad: int
    num_splits: int


def plan_tiles(query_lens: list[int], seq_lens: list[int], group: int, num_kv_heads: int) -> TilePlan:
    """Tiles of ``tokens`` queries x ``group`` heads, one program per tile and KV head, and
    split-KV when those programs are too few for the GPU and the contexts long enough."""
    group_pow2 = 1 << (group - 1).bit_length()
    tokens = 1 if max(query_lens) == 1 else max(1, min(BLOCK_M, MAX_ROWS // group_pow2))
    group_pad = max(group_pow2, MIN_ROWS // tokens)
    query_lens = np.asarray(query_lens)
    num_tiles = -(-query_lens // tokens)
    tile_request = np.repeat(np.arange(len(query_lens)), num_tiles)
    first_tile = np.cumsum(num_tiles) - num_tiles
    tile_start = (np.arange(len(tile_request)) - first_tile[tile_request]) * tokens
    return TilePlan(tile_request.astype(np.int32), tile_start.astype(np.int32), tokens, group_pad,
                    _num_splits(len(tile_request) * num_kv_heads, max(seq_lens)))


def _num_splits(programs: int, longest: int) -> int:
    """Parts enough to bring the programs to SPLIT_TARGET_PROGRAMS, none shorter than
    SPLIT_MIN_LEN over the longest context, at most MAX_SPLITS."""
    return max(1, min(MAX_SPLITS, -(-SPLIT_TARGET_PROGRAMS // programs), longest // SPLIT_MIN_LEN))


def plan_decode_graph(num_reqs: int, group: int, num_kv_heads: int, max_model_len: int) -> TilePlan:
    """The plan of any step of ``num_reqs`` decodes, whatever their lengths (a CUDA graph's:
    it cannot see them): one tile per request, the split chosen for the longest context a
    request may have."""
    group_pow2 = 1 << (group - 1).bit_length()
    return TilePlan(np.arange(num_reqs, dtype=np.int32), np.zeros(num_reqs, dtype=np.int32), 1,
                    max(group_pow2, MIN_ROWS), _num_splits(num_reqs * num_kv_heads, max_model_len))


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
    def paged_attention_kernel(query_ptr, key_cache_ptr, value_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
                               block_tables_ptr, seq_lens_ptr, query_start_ptr, tile_request_ptr, tile_start_ptr,
                               scale, num_splits, window, softcap,
                               stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
                               stride_kc_block, stride_kc_slot, stride_kc_head,
                               stride_vc_block, stride_vc_slot, stride_vc_head, stride_table,
                               stride_part_split, stride_part_tok, stride_part_head,
                               QUERIES_PER_KV: tl.constexpr, GROUP_PAD: tl.constexpr, TOKENS: tl.constexpr,
                               BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                               TILE_N: tl.constexpr, SPLIT: tl.constexpr, DOT_IN_FP32: tl.constexpr,
                               WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
        tile = tl.program_id(0)
        kv_head = tl.program_id(1)
        request = tl.load(tile_request_ptr + tile)
        query_begin = tl.load(query_start_ptr + request)
        query_len = tl.load(query_start_ptr + request + 1) - query_begin
        seq_len = tl.load(seq_lens_ptr + request)
        first = tl.load(tile_start_ptr + tile)  # the tile's first query, counted within the request

        # The tile's rows: TOKENS queries x the GROUP_PAD query heads that read this KV head
        # (QUERIES_PER_KV of them, the rest padding), so each key and value is loaded once
        # for the whole group.
        rows = tl.arange(0, TOKENS * GROUP_PAD)
        token = first + rows // GROUP_PAD
        head = kv_head * QUERIES_PER_KV + rows % GROUP_PAD
        row_mask = (token < query_len) & (rows % GROUP_PAD < QUERIES_PER_KV)
        dims = tl.arange(0, HEAD_DIM_PAD)
        dim_mask = dims < HEAD_DIM
        q = tl.load(query_ptr + (query_begin + token)[:, None] * stride_q_tok + head[:, None] * stride_q_head
                    + dims[None, :], mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
        # A chunk's queries are the last query_len tokens of the context.
        positions = seq_len - query_len + token

        m_i = tl.full([TOKENS * GROUP_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([TOKENS * GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([TOKENS * GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
        context_end = tl.minimum(seq_len, seq_len - query_len + first + TOKENS)
        # With a window, the keys before the tile's first query's window are never read (their
        # blocks may have gone back to the pool and hold another request's keys, or NaN).
        window_begin = tl.maximum(seq_len - query_len + first - window + 1, 0) if WINDOW else 0
        if SPLIT:
            # Split-KV: this program takes one of num_splits equal parts of the tile's context
            # (whole TILE_N columns; the last parts of a short context are empty).
            split_len = tl.cdiv(tl.cdiv(context_end - window_begin, num_splits), TILE_N) * TILE_N
            context_begin = window_begin + tl.program_id(2) * split_len
            context_end = tl.minimum(context_end, context_begin + split_len)
        else:
            context_begin = window_begin
        for start in range(context_begin, context_end, TILE_N):
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
            if SOFTCAP:
                # cap * tanh(s / cap), tanh(x) = 1 - 2 / (exp(2x) + 1) (exp's overflow gives 1)
                scores = softcap * (1.0 - 2.0 / (tl.exp(scores * (2.0 / softcap)) + 1.0))
            visible = (cols[None, :] <= positions[:, None]) & col_mask[None, :]
            if WINDOW:
                visible = visible & (cols[None, :] > positions[:, None] - window)
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            # NOTE: a row that has seen no key yet (a split before its position) keeps -inf;
            # 0 in its place keeps exp() of -inf - -inf from making NaNs.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(scores - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(value_cache_ptr + blocks[:, None] * stride_vc_block + offsets[:, None] * stride_vc_slot
                        + kv_head * stride_vc_head + dims[None, :], mask=kv_mask, other=0.0)
            p = p.to(v.dtype)  # NOTE: rounded to the cache dtype, as on a GPU's tensor cores
            if DOT_IN_FP32:
                acc = acc * alpha[:, None] + tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            m_i = m_new
        seen = l_i > 0
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
        out_mask = row_mask[:, None] & dim_mask[None, :]
        if SPLIT:
            # The part's result and its log-sum-exp (-inf where it saw no key), for merge_kernel.
            part = tl.program_id(2) * stride_part_split + (query_begin + token) * stride_part_tok + head * stride_part_head
            tl.store(part_out_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :], out, mask=out_mask)
            tl.store(part_lse_ptr + part, tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf")),
                     mask=row_mask)
        else:
            tl.store(out_ptr + (query_begin + token)[:, None] * stride_o_tok + head[:, None] * stride_o_head
                     + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=out_mask)

    @triton.jit
    def merge_kernel(part_out_ptr, part_lse_ptr, out_ptr, num_splits,
                     stride_part_split, stride_part_tok, stride_part_head, stride_o_tok, stride_o_head,
                     SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
        """One program per (query row, query head): the parts of split-KV merged by their
        log-sum-exp."""
        token = tl.program_id(0)
        head = tl.program_id(1)
        splits = tl.arange(0, SPLITS_PAD)
        split_mask = splits < num_splits
        part = splits * stride_part_split + token * stride_part_tok + head * stride_part_head
        lse = tl.load(part_lse_ptr + part, mask=split_mask, other=float("-inf"))
        weights = tl.exp(lse - tl.max(lse, 0))  # every row sees a key in some split: the max is finite
        dims = tl.arange(0, HEAD_DIM_PAD)
        parts = tl.load(part_out_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :],
                        mask=split_mask[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)
        out = tl.sum(parts * weights[:, None], 0) / tl.sum(weights, 0)
        tl.store(out_ptr + token * stride_o_tok + head * stride_o_head + dims, out.to(out_ptr.dtype.element_ty),
                 mask=dims < HEAD_DIM)

    return write_kv_kernel, paged_attention_kernel, merge_kernel


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
        write_kv_kernel = _kernels(interpreting())[0]
        key = key.to(key_cache.dtype)
        value = value.to(value_cache.dtype)
        write_kv_kernel[(key.shape[0], self.num_kv_heads)](
            key, value, key_cache, value_cache, slot_mapping,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
            BLOCK_SIZE=key_cache.shape[1], HEAD_DIM=self.head_dim, HEAD_DIM_PAD=self._head_dim_pad())

    def prepare(self, metadata: AttentionMetadata) -> None:
        """Cuts every request's queries into tiles (one program per tile and KV head) and
        decides the split of the context (see :func:`plan_tiles`)."""
        plan = plan_tiles(metadata.query_lens, metadata.seq_lens, self.num_heads // self.num_kv_heads,
                          self.num_kv_heads)
        device = metadata.block_tables.device

        def upload(array: np.ndarray) -> torch.Tensor:  # NOTE: pinned and non_blocking: no wait on the GPU
            tensor = torch.from_numpy(array)
            return tensor.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else tensor

        metadata.backend_data = (plan, upload(plan.tile_request), upload(plan.tile_start))

    supports_decode_graphs = True

    def prepare_decode_graph(self, metadata: AttentionMetadata, kv_dtype: torch.dtype) -> None:
        plan = plan_decode_graph(metadata.num_reqs, self.num_heads // self.num_kv_heads, self.num_kv_heads,
                                 metadata.max_seq_len)
        device = metadata.block_tables.device
        metadata.backend_data = (plan, torch.from_numpy(plan.tile_request).to(device),
                                 torch.from_numpy(plan.tile_start).to(device))

    supports_window_and_softcap = True

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        self.write_kv(key, value, kv_cache, metadata.slot_mapping)
        key_cache, value_cache = kv_cache
        _, attention_kernel, merge_kernel = _kernels(interpreting())
        plan, tile_request, tile_start = metadata.backend_data
        query = query.to(key_cache.dtype)
        out = torch.empty_like(query)
        head_dim_pad = self._head_dim_pad()
        if plan.num_splits > 1:
            part_lse = torch.empty(plan.num_splits, query.shape[0], self.num_heads, dtype=torch.float32,
                                   device=query.device)
            part_out = torch.empty(*part_lse.shape, head_dim_pad, dtype=torch.float32, device=query.device)
        else:
            part_lse = part_out = out  # unused
        block_tables = metadata.block_tables
        attention_kernel[(len(plan.tile_request), self.num_kv_heads, plan.num_splits)](
            query, key_cache, value_cache, out, part_out, part_lse, block_tables, metadata.seq_lens_tensor,
            metadata.query_start_loc, tile_request, tile_start, self.scale, plan.num_splits, window or 0,
            softcap or 0.0,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_tables.stride(0),
            *(part_lse.stride() if plan.num_splits > 1 else (0, 0, 0)),
            QUERIES_PER_KV=self.num_heads // self.num_kv_heads, GROUP_PAD=plan.group_pad, TOKENS=plan.tokens,
            BLOCK_SIZE=key_cache.shape[1], HEAD_DIM=self.head_dim, HEAD_DIM_PAD=head_dim_pad, TILE_N=BLOCK_N,
            SPLIT=plan.num_splits > 1,
            # NOTE: Triton's interpreter computes tl.dot of half-precision inputs wrongly;
            # there the products are taken in float32 (the same values, bf16 -> fp32 is exact).
            DOT_IN_FP32=interpreting(), WINDOW=window is not None, SOFTCAP=softcap is not None)
        if plan.num_splits > 1:
            merge_kernel[(query.shape[0], self.num_heads)](
                part_out, part_lse, out, plan.num_splits, *part_lse.stride(), out.stride(0), out.stride(1),
                SPLITS_PAD=max(2, 1 << (plan.num_splits - 1).bit_length()), HEAD_DIM=self.head_dim,
                HEAD_DIM_PAD=head_dim_pad)
        return out
