"""Prefix caching, n > 1 forks and swap/recompute preemption through the whole engine."""

import pytest

from pagoda import LLM, SamplingParams
from helpers import hf_greedy, make_hf_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def free_everything(llm):
    kv = llm.engine.scheduler.kv_cache_manager
    kv.check_invariants()
    return kv.get_num_free_blocks() == kv.num_blocks and not kv.req_to_cpu_blocks


def test_shared_512_token_prefix_is_prefilled_once(tiny_llama_dir):
    prefix = [1000 + (i * 37) % 20000 for i in range(512)]
    first, second = prefix + [5, 6, 7], prefix + [8, 9]
    with LLM(str(tiny_llama_dir), enforce_eager=True, dtype="float32", max_model_len=600, block_size=16) as llm:
        stats = llm.engine.scheduler.stats
        llm.generate([first], GREEDY)
        before = stats.num_prefill_tokens_computed
        cached = llm.generate([second], GREEDY)[0]
        assert stats.num_prefill_tokens_computed - before == 2  # only its own tokens
        assert cached.metrics.num_cached_tokens == 512
        assert stats.prefix_cache_hits >= 512
        assert free_everything(llm)
    with LLM(str(tiny_llama_dir), enforce_eager=True, dtype="float32", max_model_len=600, block_size=16,
             enable_prefix_caching=False) as llm:
        uncached = llm.generate([second], GREEDY)[0]
        assert llm.engine.scheduler.stats.prefix_cache_hits == 0
    assert cached.outputs[0].token_ids == uncached.outputs[0].token_ids


def peak_used_blocks(llm, prompts, params):
    """Runs the prompts and returns the most blocks in use after any step."""
    engine = llm.engine
    kv = engine.scheduler.kv_cache_manager
    peak = 0
    original = engine.scheduler.update

    def tracking_update(*args):
        nonlocal peak
        peak = max(peak, kv.num_blocks - kv.get_num_free_blocks())
        return original(*args)

    engine.scheduler.update = tracking_update
    try:
        outputs = llm.generate(prompts, params)
    finally:
        engine.scheduler.update = original
    return outputs, peak


def test_n_seeded_samples_equal_separate_requests_and_use_fewer_blocks(tiny_llama_dir):
    prompt = [1000 + i for i in range(90)]
    settings = dict(enforce_eager=True, dtype="float32", max_model_len=256, block_size=16, enable_prefix_caching=False)
    with LLM(str(tiny_llama_dir), **settings) as llm:
        group, group_peak = peak_used_blocks(
            llm, [prompt], SamplingParams(n=4, temperature=1.0, seed=100, max_tokens=20, ignore_eos=True))
        prompt_tokens = llm.engine.scheduler.stats.num_prefill_tokens_computed
        assert llm.engine.scheduler.stats.num_forks == 3
        assert free_everything(llm)
    with LLM(str(tiny_llama_dir), **settings) as llm:
        separate, separate_peak = peak_used_blocks(
            llm, [prompt] * 4,
            [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=20, ignore_eos=True) for i in range(4)])
        separate_prompt_tokens = llm.engine.scheduler.stats.num_prefill_tokens_computed
    assert [o.token_ids for o in group[0].outputs] == [s.outputs[0].token_ids for s in separate]
    assert group_peak < separate_peak
    # The prompt ran once, plus its last token once per sample.
    assert prompt_tokens == 89 + 4 and separate_prompt_tokens == 4 * 90


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_by_swap_and_by_recompute_keeps_greedy_output(tiny_llama_dir, mode):
    prompts = [[1000 + 7 * i + j for j in range(20 + 5 * i)] for i in range(4)]
    hf = make_hf_model(tiny_llama_dir)
    expected = [hf_greedy(hf, p, 24) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    # Prompts fit at admission (4 + 5 + 5 + 6 blocks of 4) but their growth does not.
    with LLM(str(tiny_llama_dir), enforce_eager=True, dtype="float32", block_size=4, num_kv_blocks=24, max_model_len=72,
             preemption_mode=mode, swap_space_bytes=1 << 20) as llm:
        outputs = llm.generate(prompts, params)
        stats = llm.engine.scheduler.stats
        assert stats.num_preemptions > 0
        if mode == "swap":
            assert stats.num_swapped_out == stats.num_preemptions
        else:
            assert stats.num_recomputed == stats.num_preemptions
        assert free_everything(llm)
    assert [o.outputs[0].token_ids for o in outputs] == expected
