"""CUDA checks, run with `pytest -m gpu` on a machine with a GPU (deselected by default).

They cover what the CPU suite cannot: the engine's tensors, the sampler and the attention
backends on a CUDA device, against the same oracles.
"""

import pytest
import torch

from engine import LLM, SamplingParams
from model_factory import make_hf_model
from test_attention_backends import MIXED, run_step
from test_llm_parity import hf_greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_greedy_parity_on_cuda(tiny_llama_dir):
    hf = make_hf_model(tiny_llama_dir)
    prompts = [[1000 + 3 * i + j for j in range(10 + 7 * i)] for i in range(4)]
    expected = [hf_greedy(hf, p, 12) for p in prompts]
    with LLM(str(tiny_llama_dir), device="cuda", dtype="float32", block_size=4, num_kv_blocks=16,
             max_model_len=64, preemption_mode="swap", swap_space_bytes=1 << 20) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        assert llm.engine.worker.ready.device.startswith("cuda")
        assert llm.engine.scheduler.stats.num_swapped_out > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_sampling_features_run_on_cuda(tiny_llama_dir):
    params = SamplingParams(n=2, temperature=0.8, top_k=20, top_p=0.9, min_p=0.01, seed=3, presence_penalty=0.5,
                            repetition_penalty=1.1, min_tokens=4, max_tokens=8, logprobs=2)
    with LLM(str(tiny_llama_dir), device="cuda", dtype="bfloat16", max_model_len=64, num_kv_blocks=32) as llm:
        first = llm.generate("hello there", params)[0]
        again = llm.generate("hello there", params)[0]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in again.outputs]
    assert all(len(o.logprobs) == len(o.token_ids) >= 4 for o in first.outputs)


@pytest.mark.parametrize("backend", ["naive", "torch_sdpa"])
@pytest.mark.parametrize("seq_lens,query_lens", MIXED)
def test_backends_on_cuda_match_dense_attention(backend, seq_lens, query_lens):
    out, reference = run_step(backend, 16, seq_lens, query_lens, device="cuda")
    torch.testing.assert_close(out, reference, rtol=1e-3, atol=1e-4)
