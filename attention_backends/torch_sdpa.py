"""The torch SDPA backend: batched decode plus per-request prefill, on any device.

Decode rows (one query each) of the whole step are batched into two matmuls over
key-padded contexts; prefill chunks, of which a step holds few, run one
scaled_dot_product_attention call each. No Python loop over requests in the decode path.

The cache is block-major with heads before offsets, ``[num_blocks, num_kv_heads,
block_size, head_dim]`` per layer (FlashInfer's HND layout): gathering a batch's blocks is
one index_select over whole blocks, and decode attention works block by block on the
gathered tensor without transposing it. A subclass may store keys transposed within each
block (``[num_blocks, num_kv_heads, head_dim, block_size]``, ``keys_transposed``), which
is what the CPU kernel of the cpu_paged backend reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagoda.attention_backends.base import (FP8_DTYPES, AttentionBackend, AttentionMetadata, context_slots, gather_blocks,
                                            to_cache_dtype)


@dataclass(slots=True)
class _Prefill:
    start: int
    query_len: int
    context_slots: torch.Tensor | None  # None when the chunk is the whole context
    mask: torch.Tensor | None  # [query_len, seq_len] True = attend


@dataclass(slots=True)
class SdpaStepData:
    decode_rows: torch.Tensor | slice | None  # query rows of the decode requests
    decode_block_tables: torch.Tensor | None  # int32 [num_decodes, max blocks] of the decode requests
    decode_seq_lens: torch.Tensor | None  # int32 [num_decodes]
    prefills: list[_Prefill]
    # The torch decode path's padded view (built only when it runs).
    decode_blocks: torch.Tensor | None = None  # [num_decodes, max_num_blocks] block ids
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_num_blocks * block_size] True = masked


class TorchSdpaAttentionBackend(AttentionBackend):
    """Attention with batched matmuls (decode) and scaled_dot_product_attention (prefill)."""

    name = "torch_sdpa"
    fp8_kv_cache = FP8_DTYPES
    keys_transposed = False

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, self.num_kv_heads, block_size, self.head_dim)

    def kv_cache_shapes(self, num_blocks: int, block_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        value_shape = self.kv_cache_shape(num_blocks, block_size)
        if not self.keys_transposed:
            return value_shape, value_shape
        return (num_blocks, self.num_kv_heads, self.head_dim, block_size), value_shape

    def write_kv(self, key, value, kv_cache, slot_mapping) -> None:
        key_cache, value_cache = kv_cache
        block_size = value_cache.shape[2]
        blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
        if self.keys_transposed:
            key_cache[blocks, :, :, offsets] = to_cache_dtype(key, key_cache.dtype)
        else:
            key_cache[blocks, :, offsets] = to_cache_dtype(key, key_cache.dtype)
        value_cache[blocks, :, offsets] = to_cache_dtype(value, value_cache.dtype)

    def prepare(self, metadata: AttentionMetadata) -> None:
        device = metadata.block_tables.device
        block_size = metadata.block_size
        starts = metadata.query_start_loc.tolist()
        decode_idx = [i for i, n in enumerate(metadata.query_lens) if n == 1]
        prefills = []
        for i, (query_len, seq_len) in enumerate(zip(metadata.query_lens, metadata.seq_lens)):
            if query_len == 1:
                continue
            if query_len == seq_len:
                prefills.append(_Prefill(starts[i], query_len, None, None))
                continue
            slots = context_slots(metadata.block_tables[i], seq_len, block_size)
            query_pos = torch.arange(seq_len - query_len, seq_len, device=device).unsqueeze(1)
            mask = torch.arange(seq_len, device=device).unsqueeze(0) <= query_pos
            prefills.append(_Prefill(starts[i], query_len, slots, mask))
        data = SdpaStepData(None, None, None, prefills)
        if decode_idx:
            num_decodes = len(decode_idx)
            if decode_idx[-1] == num_decodes - 1:
                # NOTE: the model runner puts decodes first: their rows are a slice, no gather.
                data.decode_rows = slice(0, num_decodes)
                data.decode_block_tables = metadata.block_tables[:num_decodes]
                data.decode_seq_lens = metadata.seq_lens_tensor[:num_decodes]
            else:
                idx = torch.tensor(decode_idx, device=device)
                data.decode_rows = metadata.query_start_loc[idx].long()
                data.decode_block_tables = metadata.block_tables[idx]
                data.decode_seq_lens = metadata.seq_lens_tensor[idx]
        metadata.backend_data = data

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata) -> torch.Tensor:
        self.write_kv(key, value, kv_cache, metadata.slot_mapping)
        data: SdpaStepData = metadata.backend_data
        key_cache, value_cache = kv_cache
        if data.decode_rows is not None and not data.prefills and isinstance(data.decode_rows, slice):
            return self._decode(query, key_cache, value_cache, data)  # a decode-only step
        output = torch.empty_like(query)
        if data.decode_rows is not None:
            output[data.decode_rows] = self._decode(query[data.decode_rows], key_cache, value_cache, data)
        for p in data.prefills:
            rows = slice(p.start, p.start + p.query_len)
            q = query[rows].transpose(0, 1).unsqueeze(0)  # [1, H, L, D]
            if p.context_slots is None:
                # NOTE: as stored (an fp8 cache rounds them), so that a prompt attends alike
                # whether it runs whole or in chunks that read earlier ones from the cache.
                k = to_cache_dtype(key[rows], key_cache.dtype).transpose(0, 1)
                v = to_cache_dtype(value[rows], value_cache.dtype).transpose(0, 1)
            else:
                k = self._context(key_cache, p.context_slots, self.keys_transposed)  # [Hkv, S, D]
                v = self._context(value_cache, p.context_slots, False)
            out = F.scaled_dot_product_attention(
                q,
                k.unsqueeze(0).to(q.dtype),
                v.unsqueeze(0).to(q.dtype),
                attn_mask=p.mask,
                is_causal=p.mask is None,
                scale=self.scale,
                enable_gqa=True,
            )
            output[rows] = out[0].transpose(0, 1)
        return output

    @staticmethod
    def _context(cache: torch.Tensor, slots: torch.Tensor, transposed: bool) -> torch.Tensor:
        """[Hkv, len(slots), D]: one request's context, in order."""
        block_size = cache.shape[-1] if transposed else cache.shape[2]
        blocks, offsets = slots // block_size, slots % block_size
        if transposed:
            return cache[blocks, :, :, offsets].transpose(0, 1)
        return cache[blocks, :, offsets].transpose(0, 1)

    def _decode(self, query, key_cache, value_cache, data: SdpaStepData) -> torch.Tensor:
        """One query per request against its context, block by block, batched.

        Whole blocks are gathered (one index_select); scores are computed per block
        ([B, N, Hkv, G, block]) and joined only for the softmax, a small tensor, so the
        big gathered K/V is never transposed; the tail past each context is masked.

        NOTE: for single-token queries, torch's CPU SDPA kernel with a mask was 10x
        slower than matmuls in bfloat16 (measured: 13.5 ms vs 1.3 ms, 64 requests x 300
        keys); query heads are grouped per KV head so K/V are never repeated.
        """
        num_reqs = query.shape[0]
        num_kv_heads, head_dim = self.num_kv_heads, self.head_dim
        block_size = value_cache.shape[2]
        group = self.num_heads // num_kv_heads
        if data.decode_blocks is None:
            seq_lens = data.decode_seq_lens.long()
            num_blocks = -(-int(seq_lens.max()) // block_size)
            positions = torch.arange(num_blocks * block_size, device=seq_lens.device)
            data.decode_blocks = data.decode_block_tables[:, :num_blocks].long()
            data.decode_mask = (positions.unsqueeze(0) >= seq_lens.unsqueeze(1))[:, None, None, :]
        blocks = data.decode_blocks
        num_blocks = blocks.shape[1]
        flat = blocks.flatten()
        # NOTE: an fp8 cache's blocks are read in the query's dtype.
        k = gather_blocks(key_cache, flat).view(num_reqs, num_blocks, *key_cache.shape[1:]).to(query.dtype)
        v = gather_blocks(value_cache, flat).view(num_reqs, num_blocks, num_kv_heads, block_size,
                                                  head_dim).to(query.dtype)
        q = query.reshape(num_reqs, 1, num_kv_heads, group, head_dim).to(k.dtype)
        scores = torch.matmul(q, k if self.keys_transposed else k.transpose(-1, -2))  # [B, N, Hkv, G, bs]
        scores = scores.permute(0, 2, 3, 1, 4).reshape(num_reqs, num_kv_heads, group, -1).float() * self.scale
        scores.masked_fill_(data.decode_mask, float("-inf"))  # [B, 1, 1, N * bs]
        probs = torch.softmax(scores, dim=-1).to(k.dtype)
        probs = probs.view(num_reqs, num_kv_heads, group, num_blocks, block_size).permute(0, 3, 1, 2, 4)
        out = torch.matmul(probs, v).sum(dim=1, dtype=torch.float32)  # [B, Hkv, G, D]
        return out.view(num_reqs, self.num_heads, head_dim).to(query.dtype)
