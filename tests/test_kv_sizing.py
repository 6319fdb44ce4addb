"""size_kv_cache: how many blocks the cache gets and how long a request may be (no model)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pagoda.engine.config import EngineConfig
from pagoda.engine.core.kv_sizing import bytes_per_block, kv_cache_budget, size_kv_cache
from pagoda.engine.messages import DeviceMemory
from pagoda.engine.model_config import ModelConfig
from pagoda.engine.speculative import SpeculativeConfig

# SmolLM2-135M's shape: 30 layers, 9 query heads over 3 KV heads of 64.
MODEL = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                    rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=8192,
                    tie_word_embeddings=True, attention_bias=False, bos_token_id=1, eos_token_ids=[2])
BF16 = 2
BLOCK_BYTES = 2 * 30 * 16 * 3 * 64 * BF16  # K and V, every layer, 16 tokens, 3 KV heads of 64


def test_a_block_holds_k_and_v_of_every_layer():
    assert bytes_per_block(MODEL, 16, BF16) == BLOCK_BYTES
    # Tensor parallelism: each rank holds its share of the KV heads (3 over 3 ranks: one each).
    assert bytes_per_block(MODEL, 16, BF16, tensor_parallel_size=3) == BLOCK_BYTES // 3


def test_the_bytes_decide_the_blocks_and_the_model_decides_the_length():
    size = size_kv_cache(EngineConfig(kv_cache_bytes=2 * 1024**3, swap_space_bytes=1024**3), MODEL, BF16)
    assert size.num_blocks == 2 * 1024**3 // BLOCK_BYTES
    assert size.num_cpu_blocks == 1024**3 // BLOCK_BYTES
    assert size.num_tokens == size.num_blocks * 16 and size.num_bytes == size.num_blocks * BLOCK_BYTES
    assert size.max_model_len == 8192 and not size.limited_by_window


def test_never_more_blocks_than_max_num_seqs_full_requests_use():
    size = size_kv_cache(EngineConfig(kv_cache_bytes=64 * 1024**3, max_num_seqs=2, max_model_len=100), MODEL, BF16)
    assert size.num_blocks == 2 * 7  # ceil(100 / 16) blocks each


def test_a_small_cache_caps_the_length_and_an_explicit_one_that_does_not_fit_is_refused():
    assert size_kv_cache(EngineConfig(num_kv_blocks=10), MODEL, BF16).max_model_len == 160
    with pytest.raises(ValueError, match="does not fit in the KV cache"):
        size_kv_cache(EngineConfig(num_kv_blocks=10, max_model_len=200), MODEL, BF16)
    with pytest.raises(ValueError, match="too small to serve any request"):
        size_kv_cache(EngineConfig(num_kv_blocks=1, block_size=1), MODEL, BF16)


def test_lengths_beyond_the_model_or_its_window_are_refused_or_capped():
    with pytest.raises(ValueError, match="larger than the model's context length"):
        size_kv_cache(EngineConfig(max_model_len=10000), MODEL, BF16)
    windowed = replace(MODEL, sliding_window=4096)
    size = size_kv_cache(EngineConfig(), windowed, BF16)
    assert size.max_model_len == 4096 and size.limited_by_window
    with pytest.raises(ValueError, match="sliding window"):
        size_kv_cache(EngineConfig(max_model_len=5000), windowed, BF16)


def test_where_the_backend_runs_windows_the_whole_context_is_served_and_a_request_holds_the_window():
    windowed = replace(MODEL, sliding_window=4096)
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=512, kv_cache_bytes=64 * 1024**3)
    size = size_kv_cache(config, windowed, BF16, windows_run=True)
    assert (size.max_model_len, size.sliding_window, size.limited_by_window) == (MODEL.max_position_embeddings,
                                                                                 4096, False)
    # No more blocks than 4 requests of the window, a step and a block each can hold.
    assert size.num_blocks == 4 * (4096 + 512 + 16) // 16
    # A pool of 300 blocks (4800 tokens) serves the whole context: one request holds 4624 at most.
    size = size_kv_cache(replace(config, num_kv_blocks=300, max_model_len=8192), windowed, BF16, windows_run=True)
    assert size.max_model_len == 8192
    with pytest.raises(ValueError, match="does not fit"):
        size_kv_cache(replace(config, num_kv_blocks=200, max_model_len=8192), windowed, BF16, windows_run=True)
    # Speculation's rejected tokens keep their blocks; a draft model reads every block.
    spec = replace(config, speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    assert size_kv_cache(spec, windowed, BF16, windows_run=True).lookback == 4
    assert size_kv_cache(config, windowed, BF16, draft=MODEL, windows_run=True).sliding_window is None


def test_where_only_some_layers_slide_they_get_a_pool_of_the_windows():
    # Gemma 3's pattern on the 30 layers: every 6th global (5 global, 25 sliding), a 1024 window.
    gemma = replace(MODEL, sliding_window=1024, sliding_layers=tuple(i for i in range(30) if (i + 1) % 6))
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=512, kv_cache_bytes=2 * 1024**3,
                          swap_space_bytes=1024**3)
    size = size_kv_cache(config, gemma, BF16, windows_run=True)
    full_bytes, sliding_bytes = BLOCK_BYTES // 6, BLOCK_BYTES * 5 // 6
    assert (size.bytes_per_block, size.sliding_bytes_per_block) == (full_bytes, sliding_bytes)
    # Four requests' windows (a block partly before it, one being filled) and a step's tokens...
    assert size.num_sliding_blocks == 4 * (1024 // 16 + 2) + 512 // 16
    # ...and the rest of the bytes for the global layers, capped at four whole contexts.
    assert size.num_blocks == min((2 * 1024**3 - size.num_sliding_blocks * sliding_bytes) // full_bytes, 4 * 512)
    assert size.num_bytes <= 2 * 1024**3 and size.sliding_window == 1024 and size.max_model_len == 8192
    assert size.num_cpu_blocks == 0  # preemption recomputes
    # A budget too small for every window: the bytes are split as one pool's would be, and kept.
    for budget in (20_000_000, 50_000_000):
        small = size_kv_cache(replace(config, kv_cache_bytes=budget, max_num_seqs=64), gemma, BF16, windows_run=True)
        assert small.num_bytes <= budget and small.num_sliding_blocks == budget // BLOCK_BYTES
        assert small.num_blocks >= budget // BLOCK_BYTES
    # num_kv_blocks sets the global pool; the sliding one never has more.
    size = size_kv_cache(replace(config, num_kv_blocks=100), gemma, BF16, windows_run=True)
    assert (size.num_blocks, size.num_sliding_blocks) == (100, 100)
    # One pool for every layer where the backend runs no windows or a draft model reads the blocks.
    for size in (size_kv_cache(config, gemma, BF16), size_kv_cache(config, gemma, BF16, draft=MODEL, windows_run=True)):
        assert size.num_sliding_blocks == 0 and size.sliding_window is None


def test_without_chunked_prefill_the_budget_must_hold_a_whole_prompt():
    config = EngineConfig(enable_chunked_prefill=False, max_num_batched_tokens=1024, max_model_len=2048)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        size_kv_cache(config, MODEL, BF16)
    assert size_kv_cache(replace(config, max_num_batched_tokens=2048), MODEL, BF16).max_model_len == 2048


GIB = 1024**3
H200 = DeviceMemory(total=140 * GIB, free_at_start=139 * GIB, weights=16 * GIB, peak_activations=3 * GIB,
                    non_torch=GIB)


def test_on_a_gpu_the_cache_gets_the_utilization_less_weights_activations_and_the_rest():
    budget = kv_cache_budget(H200, 0.9)
    assert budget == int(140 * GIB * 0.9) - 20 * GIB
    assert kv_cache_budget(H200, 0.5) == 50 * GIB
    assert kv_cache_budget(replace(H200, reserved=2 * GIB), 0.5) == 48 * GIB  # penalties' buffers, graphs
    size = size_kv_cache(EngineConfig(max_num_seqs=4096), MODEL, BF16, budget=budget)
    assert size.num_blocks == budget // BLOCK_BYTES  # ~590k blocks, under 4096 x 512
    # The cap of max_num_seqs full-length requests still holds.
    assert size_kv_cache(EngineConfig(), MODEL, BF16, budget=budget).num_blocks == 256 * 8192 // 16


def test_a_device_that_other_processes_fill_or_a_model_that_fills_it_is_refused():
    busy = replace(H200, free_at_start=100 * GIB)
    with pytest.raises(ValueError, match=r"100.00 GiB free of 140.00 GiB at start-up.*lower gpu_memory_utilization"):
        kv_cache_budget(busy, 0.9)
    assert kv_cache_budget(busy, 0.7) == 98 * GIB - 20 * GIB
    with pytest.raises(ValueError, match=r"leaves nothing for the KV cache: weights 16.00 GiB, activations 3.00 GiB"):
        kv_cache_budget(H200, 0.1)
