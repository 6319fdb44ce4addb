"""An fp8 KV cache (kv_cache_dtype): every backend against attention over the rounded keys and
values, the engine's block features over it, and what it costs the real model."""

import math

import pytest
import torch

from helpers import MIXED, WIDE, run_step
from pagoda import LLM, SamplingParams
from pagoda.attention_backends import SUPPORTED_ATTENTION_BACKENDS, cpu_paged, get_attention_backend
from pagoda.native import library as kernel_library
from pagoda.attention_backends.base import to_cache_dtype
from pagoda.engine.config import EngineConfig

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
CPU = torch.device("cpu")


@pytest.mark.parametrize("backend", ["naive", "torch_sdpa", "cpu_paged"])
@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("block_size", [16, 7])  # cpu_paged: the vector path, the generic one
def test_fp8_cache_matches_attention_over_rounded_keys_and_values(backend, cache_dtype, dtype, block_size):
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for seq_lens, query_lens in (*MIXED, WIDE):
        out, reference = run_step(backend, block_size, seq_lens, query_lens, seed=sum(seq_lens), dtype=dtype,
                                  cache_dtype=cache_dtype)
        torch.testing.assert_close(out.float(), reference, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
def test_fp8_cache_with_the_default_models_heads(cache_dtype, dtype):
    """9 query heads over 3 KV heads of 64: the kernels' specialised cases (bfloat16), and
    torch's code under cpu_paged (float16, which has no kernel)."""
    for seq_lens, query_lens in (*MIXED, WIDE):
        out, reference = run_step("cpu_paged", 16, seq_lens, query_lens, dtype=dtype, num_heads=9, num_kv_heads=3,
                                  head_dim=64, cache_dtype=cache_dtype)
        torch.testing.assert_close(out.float(), reference, atol=2e-2, rtol=2e-2)


def test_fp8_cache_of_a_shared_prefix_takes_the_plain_kernel(monkeypatch):
    """With an fp8 cache cpu_paged neither cascades nor uses the tiles (they read the model's
    dtype), even with the cascade forced: 40 requests sharing 512 tokens are still right."""
    monkeypatch.setattr(cpu_paged, "CASCADE_MIN_REQUESTS", 1)
    monkeypatch.setattr(cpu_paged, "CASCADE_MIN_TOKENS", 1)
    seq_lens = [512 + 3 + i for i in range(40)]
    out, reference = run_step("cpu_paged", 16, seq_lens, [1] * 40, dtype=torch.bfloat16, shared_blocks=32,
                              cache_dtype=torch.float8_e4m3fn)
    torch.testing.assert_close(out.float(), reference, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("backend", ["naive", "cpu_paged"])
@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
def test_values_past_the_fp8_range_saturate(backend, cache_dtype):
    """Stored keys keep their sign at the format's largest value, never inf or NaN."""
    cls = get_attention_backend(backend, CPU, cache_dtype)
    layer = cls(2, 1, 16, 0.25)
    key_shape, value_shape = layer.kv_cache_shapes(2, 16)
    cache = (torch.zeros(key_shape, dtype=cache_dtype), torch.zeros(value_shape, dtype=cache_dtype))
    new = torch.tensor([1e6, -1e6, 0.5, -3.0] * 4).view(1, 1, 16)
    layer.write_kv(new, new, cache, torch.tensor([17]))
    limit = torch.finfo(cache_dtype).max
    expected = sorted([limit, -limit, 0.5, -3.0] * 4)
    assert to_cache_dtype(new, cache_dtype).float().flatten().sort().values.tolist() == expected
    for stored in cache:  # the slot's 16 elements, wherever the layout puts them
        stored = stored.float().flatten()
        assert torch.isfinite(stored).all()
        assert sorted(stored[stored != 0].tolist()) == expected


def test_backend_selection_respects_the_cache_dtype(monkeypatch):
    expected = "cpu_paged" if kernel_library.available() else "torch_sdpa"
    assert get_attention_backend("auto", CPU, torch.float8_e5m2).name == expected

    from pagoda.attention_backends.naive import NaiveAttentionBackend

    class NoFp8(NaiveAttentionBackend):
        name = "no_fp8"
        fp8_kv_cache = ()

    monkeypatch.setitem(SUPPORTED_ATTENTION_BACKENDS, "no_fp8", lambda: NoFp8)
    assert get_attention_backend("no_fp8", CPU) is NoFp8
    with pytest.raises(ValueError, match="does not support a float8_e4m3fn KV cache.*cpu_paged"):
        get_attention_backend("no_fp8", CPU, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2"):
        EngineConfig(kv_cache_dtype="int4")


def prompts_sharing_a_prefix():
    prefix = [300 + (i * 13) % 900 for i in range(24)]
    return [prefix + [1000 + 7 * i + j for j in range(6 + 3 * i)] for i in range(4)]


def test_fp8_cache_through_the_engine_prefix_cache_swap_and_forks(tiny_llama_dir):
    """The same memory holds twice the bfloat16 tokens; prefix-cache hits, swapping and
    copy-on-write move fp8 blocks without changing an output."""
    base = dict(enforce_eager=True, dtype="bfloat16", max_model_len=96, block_size=4, kv_cache_dtype="fp8_e4m3")
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    forked = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=16, ignore_eos=True)
    greedy_forks = SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True)
    prompts = prompts_sharing_a_prefix()
    with LLM(str(tiny_llama_dir), kv_cache_bytes=1 << 18, enable_prefix_caching=False, **base) as llm:
        fp8_blocks = llm.engine.kv_cache_size.num_blocks
        expected = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        expected_forks = [o.token_ids for o in llm.generate([prompts[0]], forked)[0].outputs]
    with LLM(str(tiny_llama_dir), kv_cache_bytes=1 << 18, **{**base, "kv_cache_dtype": "auto"}) as llm:
        assert fp8_blocks == 2 * llm.engine.kv_cache_size.num_blocks
    # Few blocks: the four requests cannot all grow, so some are swapped out and back.
    with LLM(str(tiny_llama_dir), num_kv_blocks=24, preemption_mode="swap", swap_space_bytes=1 << 20,
             **base) as llm:
        cache = llm.engine.scheduler.kv_cache_manager
        first = llm.generate(prompts[:1], greedy)[0]
        outputs = llm.generate(prompts, greedy)
        stats = llm.engine.scheduler.stats
        assert stats.num_swapped_out > 0 and stats.prefix_cache_hits > 0
        forks = llm.generate([prompts[0]], forked)[0]
        assert stats.num_forks > 0
        # Copy-on-write of a shared partial block: both greedy samples continue as one request.
        same = llm.generate([prompts[1]], greedy_forks)[0]
        cache.check_invariants()
        assert cache.get_num_free_blocks() == cache.num_blocks
    assert first.outputs[0].token_ids == expected[0]
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert [o.token_ids for o in forks.outputs] == expected_forks
    assert [o.token_ids for o in same.outputs] == [expected[1]] * 2


# Perplexity of the real model over a text the tests ship, by the KV cache's dtype.
TEXT = (
    "The library opened at nine every morning, and by ten the reading room was full. Students came to "
    "prepare for their examinations, retired engineers to read the newspapers, and children to borrow "
    "picture books about ships, trains and animals. The librarian knew most of them by name. She kept "
    "a small notebook in which she wrote down the titles that people asked for but could not find, and "
    "at the end of each month she ordered as many of them as the budget allowed. Over the years the "
    "collection grew to reflect the town itself: a shelf of local history, a corner for gardening, and "
    "an entire wall of detective novels, which were borrowed more than anything else."
)


def perplexity(llm) -> float:
    ids = llm.tokenizer.encode(TEXT)
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    logprobs = [entry.logprob for entry in out.prompt_logprobs[1:]]
    return math.exp(-sum(logprobs) / len(logprobs))


@pytest.mark.slow
def test_fp8_cache_costs_the_default_model_little_perplexity():
    """SmolLM2-135M in bfloat16: e4m3 within 3% of the bfloat16 cache's perplexity, e5m2
    (two mantissa bits) within 10% (docs/kv-cache.md gives the measured figures)."""
    results = {}
    for kv_cache_dtype in ("auto", "fp8_e4m3", "fp8_e5m2"):
        with LLM(dtype="bfloat16", enforce_eager=True, max_model_len=512, kv_cache_dtype=kv_cache_dtype) as llm:
            results[kv_cache_dtype] = perplexity(llm)
    bf16 = results["auto"]
    assert bf16 < 60, results  # ordinary English (38.7 measured)
    assert results["fp8_e4m3"] < bf16 * 1.03, results
    assert results["fp8_e5m2"] < bf16 * 1.10, results
