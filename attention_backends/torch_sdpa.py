"""The torch SDPA backend: batched decode plus per-request prefill, on any device.

Decode rows (one query each) of the whole step are batched into two matmuls over
key-padded contexts; prefill chunks, of which a step holds few, run one
scaled_dot_product_attention call each. No Python loop over requests in the decode path.

The cache is head-major, ``[num_kv_heads, num_slots, head_dim]`` per layer: gathering a
batch's context slots then yields ``[num_kv_heads, batch, seq, head_dim]`` directly, the
layout the matmuls want, in a single copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attention_backends.base import AttentionBackend, AttentionMetadata, context_slots


@dataclass(slots=True)
class _Prefill:
    start: int
    query_len: int
    context_slots: torch.Tensor | None  # None when the chunk is the whole context
    mask: torch.Tensor | None  # [query_len, seq_len] True = attend


@dataclass(slots=True)
class _SdpaData:
    decode_rows: torch.Tensor | None  # query rows of the decode requests
    decode_blocks: torch.Tensor | None  # [num_decodes, max_num_blocks] block ids
    decode_mask: torch.Tensor | None  # [1, num_decodes, 1, max_num_blocks * block_size] True = masked out
    prefills: list[_Prefill]
    block_size: int


class TorchSdpaAttentionBackend(AttentionBackend):
    """Attention with batched matmuls (decode) and scaled_dot_product_attention (prefill)."""

    name = "torch_sdpa"

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (self.num_kv_heads, num_blocks * block_size, self.head_dim)

    def write_kv(self, key, value, kv_cache, slot_mapping) -> None:
        key_cache, value_cache = kv_cache
        key_cache.index_copy_(1, slot_mapping, key.transpose(0, 1).to(key_cache.dtype))
        value_cache.index_copy_(1, slot_mapping, value.transpose(0, 1).to(value_cache.dtype))

    def copy_blocks(self, src_cache, dst_cache, src_ids, dst_ids, block_size) -> None:
        src = src_cache.view(self.num_kv_heads, -1, block_size * self.head_dim)
        dst = dst_cache.view(self.num_kv_heads, -1, block_size * self.head_dim)
        dst[:, dst_ids.to(dst.device)] = src[:, src_ids.to(src.device)].to(dst.device)

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
        data = _SdpaData(None, None, None, prefills, block_size)
        if decode_idx:
            idx = torch.tensor(decode_idx, device=device)
            seq_lens = metadata.seq_lens_tensor[idx].long()
            num_blocks = -(-int(seq_lens.max()) // block_size)
            positions = torch.arange(num_blocks * block_size, device=device)
            data.decode_rows = metadata.query_start_loc[idx].long()
            data.decode_blocks = metadata.block_tables[idx, :num_blocks].long()
            data.decode_mask = (positions.unsqueeze(0) >= seq_lens.unsqueeze(1))[None, :, None, :]
        metadata.backend_data = data

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata) -> torch.Tensor:
        self.write_kv(key, value, kv_cache, metadata.slot_mapping)
        data: _SdpaData = metadata.backend_data
        key_cache, value_cache = kv_cache
        output = torch.empty_like(query)
        if data.decode_rows is not None:
            output[data.decode_rows] = self._decode(query[data.decode_rows], key_cache, value_cache, data)
        for p in data.prefills:
            rows = slice(p.start, p.start + p.query_len)
            q = query[rows].transpose(0, 1).unsqueeze(0)  # [1, H, L, D]
            if p.context_slots is None:
                k = key[rows].transpose(0, 1)
                v = value[rows].transpose(0, 1)
            else:
                k = key_cache[:, p.context_slots]  # [Hkv, S, D]
                v = value_cache[:, p.context_slots]
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

    def _decode(self, query, key_cache, value_cache, data: _SdpaData) -> torch.Tensor:
        """One query per request against its padded context, as two batched matmuls.

        Whole blocks are gathered (rows of block_size * head_dim elements, much faster to
        copy than single slots); the tail past each context is masked.

        NOTE: for single-token queries, torch's CPU SDPA kernel with a mask was 10x
        slower than this in bfloat16 (measured: 13.5 ms vs 1.3 ms, 64 requests x 300
        keys); query heads are grouped per KV head so K/V are never repeated.
        """
        num_reqs = query.shape[0]
        group = self.num_heads // self.num_kv_heads
        q = query.view(num_reqs, self.num_kv_heads, group, self.head_dim).transpose(0, 1)  # [Hkv, B, G, D]
        k = self._gather_blocks(key_cache, data.decode_blocks, data.block_size).to(q.dtype)  # [Hkv, B, S, D]
        v = self._gather_blocks(value_cache, data.decode_blocks, data.block_size).to(q.dtype)
        scores = torch.matmul(q, k.transpose(-1, -2)).float() * self.scale  # [Hkv, B, G, S]
        scores.masked_fill_(data.decode_mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        out = torch.matmul(probs, v)  # [Hkv, B, G, D]
        return out.transpose(0, 1).reshape(num_reqs, self.num_heads, self.head_dim)

    @staticmethod
    def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
        """[Hkv, num_slots, D] cache, [B, N] block ids -> [Hkv, B, N * block_size, D]."""
        num_kv_heads, _, head_dim = cache.shape
        num_reqs, num_blocks = blocks.shape
        per_block = cache.view(num_kv_heads, -1, block_size * head_dim)
        gathered = per_block.index_select(1, blocks.flatten())  # faster than per_block[:, blocks]
        return gathered.view(num_kv_heads, num_reqs, num_blocks * block_size, head_dim)
