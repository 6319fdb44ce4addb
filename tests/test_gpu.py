"""CUDA checks, run with `pytest -m gpu` on a machine with a GPU (deselected by default).

They cover what the CPU suite cannot: the engine's tensors, the sampler and the attention
backends on a CUDA device (FlashInfer, and the triton kernels compiled rather than
interpreted), against the same oracles. `tests/run_gpu_checks.sh` runs them all.
"""

import os

import pytest
import torch

from pagoda import LLM, SamplingParams
from conftest import TINY_INIT
from helpers import MIXED, WIDE, hf_greedy, make_hf_model, make_tiny_model_dir, run_step

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

def needs(backend: str) -> None:
    if backend == "triton":
        pytest.importorskip("triton")
        assert os.environ.get("TRITON_INTERPRET") != "1", "the GPU checks must compile the triton kernels"
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")


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


@pytest.fixture(scope="module")
def head64_llama_dir(tmp_path_factory):
    """A tiny model with 64-wide heads, a size FlashInfer's kernels take."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("head64"), "llama", hidden_size=128, num_attention_heads=2,
                               num_key_value_heads=1, **TINY_INIT)


def test_greedy_parity_on_cuda_with_the_triton_kernels(tiny_llama_dir):
    needs("triton")
    hf = make_hf_model(tiny_llama_dir)
    prompts = [[1000 + 3 * i + j for j in range(10 + 7 * i)] for i in range(4)]
    expected = [hf_greedy(hf, p, 12) for p in prompts]
    settings = dict(device="cuda", dtype="float32", block_size=16, max_model_len=64, num_kv_blocks=32)
    for eager in (False, True):  # decode steps replaying CUDA graphs, then without
        with LLM(str(tiny_llama_dir), attention_backend="triton", enforce_eager=eager, **settings) as llm:
            ready = llm.engine.worker.ready
            assert ready.attention_backend == "triton"
            assert ready.cuda_graphs.startswith("no CUDA graphs" if eager else "CUDA graphs of decode batches")
            assert eager or "compiled regions loaded" in ready.compiled  # not a compile that fell back
            outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in outputs] == expected


def test_greedy_parity_on_cuda_with_flashinfer(head64_llama_dir):
    # NOTE: FlashInfer computes in half precision only, so its oracle is the naive backend in
    # bfloat16 on the same engine (fp32 transformers and bf16 may part ways on near ties).
    needs("flashinfer")
    prompts = [[1000 + 3 * i + j for j in range(10 + 7 * i)] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    settings = dict(device="cuda", dtype="bfloat16", block_size=16, max_model_len=64, num_kv_blocks=32)
    for eager in (False, True):  # compiled, decode steps replaying CUDA graphs; then neither
        # NOTE: the oracle compiled or not alike: bfloat16 rounds fused and unfused code apart.
        with LLM(str(head64_llama_dir), attention_backend="naive", enforce_eager=eager, **settings) as llm:
            expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        with LLM(str(head64_llama_dir), attention_backend="flashinfer", enforce_eager=eager, **settings) as llm:
            ready = llm.engine.worker.ready
            assert ready.attention_backend == "flashinfer"
            assert ready.cuda_graphs.startswith("no CUDA graphs" if eager else "CUDA graphs of decode batches")
            assert eager or "compiled regions loaded" in ready.compiled  # not a compile that fell back
            outputs = llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outputs] == expected


def test_sampling_features_run_on_cuda(tiny_llama_dir):
    params = SamplingParams(n=2, temperature=0.8, top_k=20, top_p=0.9, min_p=0.01, seed=3, presence_penalty=0.5,
                            repetition_penalty=1.1, min_tokens=4, max_tokens=8, logprobs=2)
    with LLM(str(tiny_llama_dir), device="cuda", dtype="bfloat16", max_model_len=64, num_kv_blocks=32) as llm:
        first = llm.generate("hello there", params)[0]
        again = llm.generate("hello there", params)[0]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in again.outputs]
    assert all(len(o.logprobs) == len(o.token_ids) >= 4 for o in first.outputs)


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_blocks_past_two_to_the_31_elements(backend):
    """A layer's cache of more than 2^31 elements (4 GiB per tensor in bfloat16): requests whose
    blocks sit at its end are read at the right place (the offsets are 64-bit)."""
    needs(backend)
    from pagoda.attention_backends import AttentionMetadata, get_attention_backend

    block_size, kv_heads, head_dim, heads = 16, 2, 64, 4
    num_blocks = 2**31 // (block_size * kv_heads * head_dim) + 64
    device = torch.device("cuda")
    naive = get_attention_backend("naive", device)(heads, kv_heads, head_dim, head_dim**-0.5)
    kernel = get_attention_backend(backend, device)(heads, kv_heads, head_dim, head_dim**-0.5)
    cache = [torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=torch.bfloat16, device=device)
             for _ in range(2)]
    seq_lens, query_lens = [40, 70], [1, 6]
    tables = torch.tensor([[num_blocks - 10 + j for j in range(5)], [num_blocks - 5 + j for j in range(5)]],
                          dtype=torch.int32, device=device)
    gen = torch.Generator(device="cuda").manual_seed(3)
    total = sum(seq_lens)
    slots = torch.cat([tables[i, :].long().repeat_interleave(block_size)[:s] * block_size
                       + torch.arange(s, device=device) % block_size for i, s in enumerate(seq_lens)])
    context = [slots[: seq_lens[0] - 1], slots[seq_lens[0]: total - 6]]
    keys = torch.randn(total, kv_heads, head_dim, generator=gen, device=device, dtype=torch.bfloat16)
    values = torch.randn(total, kv_heads, head_dim, generator=gen, device=device, dtype=torch.bfloat16)
    earlier = torch.cat(context)
    naive.write_kv(keys[: len(earlier)], values[: len(earlier)], cache, earlier)
    new_slots = torch.cat([slots[seq_lens[0] - 1: seq_lens[0]], slots[total - 6:]])
    metadata = AttentionMetadata(
        num_tokens=7, query_lens=query_lens, seq_lens=seq_lens,
        query_start_loc=torch.tensor([0, 1, 7], dtype=torch.int32, device=device),
        seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32, device=device), block_tables=tables,
        slot_mapping=new_slots, block_size=block_size, max_query_len=6, max_seq_len=70)
    query = torch.randn(7, heads, head_dim, generator=gen, device=device, dtype=torch.bfloat16)
    new_k, new_v = keys[len(earlier):], values[len(earlier):]
    naive.prepare(metadata)
    expected = naive.forward(query, new_k, new_v, cache, metadata)
    kernel.prepare(metadata)
    got = kernel.forward(query, new_k, new_v, cache, metadata)
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)


# NOTE: FlashInfer does not take MIXED's 16-wide heads; it is checked on 64/128-wide ones below.
@pytest.mark.parametrize("backend", ["naive", "torch_sdpa", "triton"])
@pytest.mark.parametrize("seq_lens,query_lens", MIXED)
def test_backends_on_cuda_match_dense_attention(backend, seq_lens, query_lens):
    needs(backend)
    out, reference = run_step(backend, 16, seq_lens, query_lens, device="cuda")
    torch.testing.assert_close(out, reference, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("backend", ["torch_sdpa", "triton", "flashinfer"])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_kernel_backends_on_cuda_match_naive(backend, block_size, group, head_dim):
    needs(backend)
    seq_lens, query_lens = WIDE
    shape = dict(num_heads=2 * group, num_kv_heads=2, head_dim=head_dim)
    dtype = torch.bfloat16 if backend == "flashinfer" else torch.float32
    naive, _ = run_step("naive", block_size, seq_lens, query_lens, seed=7, dtype=dtype, device="cuda", **shape)
    out, _ = run_step(backend, block_size, seq_lens, query_lens, seed=7, dtype=dtype, device="cuda", **shape)
    tolerance = dict(rtol=1e-3, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.float(), naive.float(), **tolerance)


@pytest.mark.parametrize("group", [1, 4, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_split_kv_on_cuda_matches_naive(group, dtype):
    """Decodes over long contexts at a small batch: the default plan splits them (8 programs
    a step, far fewer than the GPU's SMs), and the merged parts match the naive backend."""
    needs("triton")
    from pagoda.attention_backends.triton_attention import plan_tiles

    seq_lens, query_lens = [3000, 1100, 17, 600], [1, 1, 1, 1]
    assert plan_tiles(query_lens, seq_lens, group, 2).num_splits > 1
    shape = dict(num_heads=2 * group, num_kv_heads=2, head_dim=128)
    naive, _ = run_step("naive", 16, seq_lens, query_lens, seed=5, dtype=dtype, device="cuda", **shape)
    out, _ = run_step("triton", 16, seq_lens, query_lens, seed=5, dtype=dtype, device="cuda", **shape)
    tolerance = dict(rtol=1e-3, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.float(), naive.float(), **tolerance)


def test_the_kv_cache_is_sized_from_the_gpus_memory(tiny_llama_dir):
    """No kv_cache_bytes: the worker measures the GPU (weights, a forward's peak, the rest) and
    the cache takes what gpu_memory_utilization leaves."""
    with LLM(str(tiny_llama_dir), device="cuda", dtype="float32", max_model_len=256, max_num_seqs=8,
             gpu_memory_utilization=0.3) as llm:
        [memory] = llm.engine.device_memory
        assert memory.total == torch.cuda.mem_get_info()[1]
        assert memory.weights > 0 and memory.peak_activations > 0
        kv = llm.engine.kv_cache_size
        assert memory.reserved > 0  # the penalties' buffers, and the CUDA graphs' pool
        budget = (int(memory.total * 0.3) - memory.weights - memory.peak_activations - memory.reserved
                  - memory.non_torch)
        assert kv.num_blocks == min(budget // kv.bytes_per_block, 8 * 256 // 16)
        out = llm.generate("hello", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4


def test_a_steps_inputs_and_attention_plans_reach_the_gpu_without_a_host_sync():
    """The runner's uploads (pinned, non_blocking) and the triton and flashinfer plans (from
    host arrays) run under torch's sync debug mode set to raise on any synchronizing call."""
    import numpy as np

    from pagoda.attention_backends import AttentionMetadata, get_attention_backend
    from pagoda.engine.worker.host_copy import to_device

    device = torch.device("cuda")
    query_lens, seq_lens = np.array([1, 1, 40], dtype=np.int32), np.array([300, 17, 60], dtype=np.int32)
    tables = np.arange(3 * 19, dtype=np.int32).reshape(3, 19)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ids = to_device(np.arange(42, dtype=np.int32), device, torch.long)
        metadata = AttentionMetadata(
            num_tokens=42, query_lens=query_lens.tolist(), seq_lens=seq_lens.tolist(),
            query_start_loc=to_device(np.array([0, 1, 2, 42], dtype=np.int32), device),
            seq_lens_tensor=to_device(seq_lens, device), block_tables=to_device(tables, device),
            slot_mapping=to_device(np.arange(42, dtype=np.int64), device), block_size=16, max_query_len=40,
            max_seq_len=300, block_tables_host=tables)
        for name in ("triton", "flashinfer"):
            try:
                backend = get_attention_backend(name, device)(8, 2, 128, 128**-0.5)
            except ValueError:
                continue  # not installed here
            backend.prepare(metadata)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert ids.dtype == torch.long and ids.cpu().tolist() == list(range(42))
