"""The torch SDPA backend: batched decode plus per-request prefill, on any device.

Decode rows (one query each) of the whole step are batched into a single
scaled_dot_product_attention call over key-padded contexts; prefill chunks, of which a
step holds few, run one call each. No Python loop over requests inside the decode path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attention_backends.base import AttentionBackend, AttentionMetadata, context_slots, write_kv


@dataclass(slots=True)
class _Prefill:
    start: int
    query_len: int
    seq_len: int
    context_slots: torch.Tensor | None  # None when the chunk is the whole context
    mask: torch.Tensor | None


@dataclass(slots=True)
class _SdpaData:
    decode_rows: torch.Tensor | None  # query rows of the decode requests
    decode_slots: torch.Tensor | None  # [num_decodes, max_seq_len] cache slots
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_seq_len] True = attend
    prefills: list[_Prefill]


class TorchSdpaAttentionBackend(AttentionBackend):
    """Attention with torch.nn.functional.scaled_dot_product_attention."""

    name = "torch_sdpa"

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
                prefills.append(_Prefill(starts[i], query_len, seq_len, None, None))
                continue
            slots = context_slots(metadata.block_tables[i], seq_len, block_size)
            query_pos = torch.arange(seq_len - query_len, seq_len, device=device).unsqueeze(1)
            mask = torch.arange(seq_len, device=device).unsqueeze(0) <= query_pos
            prefills.append(_Prefill(starts[i], query_len, seq_len, slots, mask))
        data = _SdpaData(None, None, None, prefills)
        if decode_idx:
            idx = torch.tensor(decode_idx, device=device)
            seq_lens = metadata.seq_lens_tensor[idx].long()
            max_len = int(seq_lens.max())
            positions = torch.arange(max_len, device=device)
            tables = metadata.block_tables[idx].long()
            data.decode_rows = metadata.query_start_loc[idx].long()
            data.decode_slots = tables[:, positions // block_size] * block_size + positions % block_size
            data.decode_mask = (positions.unsqueeze(0) < seq_lens.unsqueeze(1))[:, None, None, :]
        metadata.backend_data = data

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata) -> torch.Tensor:
        write_kv(key, value, kv_cache, metadata.slot_mapping)
        data: _SdpaData = metadata.backend_data
        key_cache, value_cache = kv_cache
        flat_keys = key_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_values = value_cache.view(-1, self.num_kv_heads, self.head_dim)
        output = torch.empty_like(query)
        if data.decode_rows is not None:
            q = query[data.decode_rows].unsqueeze(2)  # [B, H, 1, D]
            k = flat_keys[data.decode_slots].transpose(1, 2)  # [B, Hkv, S, D]
            v = flat_values[data.decode_slots].transpose(1, 2)
            out = F.scaled_dot_product_attention(
                q, k.to(q.dtype), v.to(q.dtype), attn_mask=data.decode_mask, scale=self.scale, enable_gqa=True
            )
            output[data.decode_rows] = out.squeeze(2)
        for p in data.prefills:
            rows = slice(p.start, p.start + p.query_len)
            q = query[rows].transpose(0, 1).unsqueeze(0)  # [1, H, L, D]
            if p.context_slots is None:
                k, v = key[rows], value[rows]
                mask, causal = None, True
            else:
                k, v = flat_keys[p.context_slots], flat_values[p.context_slots]
                mask, causal = p.mask, False
            out = F.scaled_dot_product_attention(
                q,
                k.transpose(0, 1).unsqueeze(0).to(q.dtype),
                v.transpose(0, 1).unsqueeze(0).to(q.dtype),
                attn_mask=mask,
                is_causal=causal,
                scale=self.scale,
                enable_gqa=True,
            )
            output[rows] = out[0].transpose(0, 1)
        return output
