"""Greedy parity with transformers, token for token, through the whole engine."""

import pytest

from pagoda import LLM
from helpers import GREEDY, NUM_NEW, hf_greedy, make_hf_model

PROMPTS = [
    "The quick brown fox jumps over the lazy dog",
    "Paged attention stores keys and values in fixed-size blocks, allocated on demand as a sequence grows.",
    "Hi",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30",
]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_and_expected(request, tiny_llama_dir, tiny_qwen2_dir):
    model_dir = tiny_llama_dir if request.param == "llama" else tiny_qwen2_dir
    hf = make_hf_model(model_dir)
    from pagoda.engine.model_loader import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    expected = [hf_greedy(hf, ids, NUM_NEW) for ids in prompt_ids]
    return model_dir, prompt_ids, expected



# NOTE: block16 runs the compiled model (the default); the rest run eagerly, so that both
# paths are held to the oracle without compiling in every case.
ENGINE_SETUPS = {
    "block16": dict(block_size=16),
    "block1": dict(block_size=1, enforce_eager=True),
    "block7": dict(block_size=7, enforce_eager=True),  # divides none of the prompt lengths
    "chunked": dict(block_size=4, max_num_batched_tokens=8, enforce_eager=True),
    "naive": dict(block_size=16, attention_backend="naive", enforce_eager=True),
    "torch_sdpa": dict(block_size=16, attention_backend="torch_sdpa", enforce_eager=True),
}


@pytest.mark.parametrize("setup", sorted(ENGINE_SETUPS))
def test_greedy_matches_transformers(model_and_expected, setup):
    model_dir, prompt_ids, expected = model_and_expected
    with LLM(str(model_dir), dtype="float32", **ENGINE_SETUPS[setup]) as llm:
        outputs = llm.generate(prompt_ids, GREEDY)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        if setup == "chunked":
            assert llm.engine.scheduler.stats.num_steps > len(prompt_ids)
        assert llm.engine.scheduler.kv_cache_manager.get_num_free_blocks() == llm.engine.scheduler.kv_cache_manager.num_blocks


def test_greedy_matches_transformers_under_preemption(model_and_expected):
    model_dir, prompt_ids, expected = model_and_expected
    # Every prompt fits at admission, but not the growth that follows: preemption is forced.
    num_blocks = sum(-(-len(ids) // 4) for ids in prompt_ids) + 1
    max_len = max(len(ids) for ids in prompt_ids) + NUM_NEW
    with LLM(str(model_dir), dtype="float32", block_size=4, num_kv_blocks=num_blocks, max_model_len=max_len,
             enforce_eager=True) as llm:
        outputs = llm.generate(prompt_ids, GREEDY)
        assert llm.engine.scheduler.stats.num_preemptions > 0
        assert [o.outputs[0].token_ids for o in outputs] == expected
        kv = llm.engine.scheduler.kv_cache_manager
        assert kv.get_num_free_blocks() == kv.num_blocks


@pytest.mark.slow
def test_greedy_matches_transformers_with_the_triton_kernels(tiny_llama_dir):
    # NOTE: without a GPU the kernels run under Triton's interpreter (conftest.py), which the
    # worker inherits: their logic is checked end to end on every machine (on one model: the
    # interpreter is slow, and the kernels do not care which model calls them).
    pytest.importorskip("triton", reason="the triton package is not installed (pip install 'pagoda[triton]')")
    from pagoda.engine.model_loader import load_tokenizer

    hf = make_hf_model(tiny_llama_dir)
    tokenizer = load_tokenizer(tiny_llama_dir)
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    expected = [hf_greedy(hf, ids, NUM_NEW) for ids in prompt_ids]
    with LLM(str(tiny_llama_dir), dtype="float32", block_size=16, attention_backend="triton",
             enforce_eager=True) as llm:
        assert llm.engine.worker.ready.attention_backend == "triton"
        outputs = llm.generate(prompt_ids, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected
