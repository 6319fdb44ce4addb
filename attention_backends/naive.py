"""The naive backend: plain torch, one request at a time. The correctness oracle."""

from __future__ import annotations

import torch

from pagoda.attention_backends.base import FP8_DTYPES, AttentionBackend, AttentionMetadata, context_slots


class NaiveAttentionBackend(AttentionBackend):
    """Gathers each request's context from its block table and does softmax attention
    by hand in float32. Slow and easy to read; other backends must match it."""

    name = "naive"
    fp8_kv_cache = FP8_DTYPES
    supports_window_and_softcap = True

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        self.write_kv(key, value, kv_cache, metadata.slot_mapping)
        key_cache, value_cache = kv_cache
        flat_keys = key_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_values = value_cache.view(-1, self.num_kv_heads, self.head_dim)
        group = self.num_heads // self.num_kv_heads
        output = torch.empty_like(query)
        starts = metadata.query_start_loc.tolist()
        for i, (query_len, seq_len) in enumerate(zip(metadata.query_lens, metadata.seq_lens)):
            slots = context_slots(metadata.block_tables[i], seq_len, metadata.block_size)
            k = flat_keys[slots].float().repeat_interleave(group, dim=1)  # [S, H, D]
            v = flat_values[slots].float().repeat_interleave(group, dim=1)
            q = query[starts[i] : starts[i] + query_len].float()  # [L, H, D]
            scores = torch.einsum("lhd,shd->hls", q, k) * self.scale
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            # Query j sits at position seq_len - query_len + j and sees keys up to it (within the
            # last ``window`` positions, itself included, where the layer has a window).
            query_pos = torch.arange(seq_len - query_len, seq_len, device=query.device).unsqueeze(1)
            key_pos = torch.arange(seq_len, device=query.device).unsqueeze(0)
            hidden = key_pos > query_pos
            if window is not None:
                hidden |= key_pos <= query_pos - window
            scores = scores.masked_fill(hidden, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            output[starts[i] : starts[i] + query_len] = torch.einsum("hls,shd->lhd", probs, v).to(query.dtype)
        return output
