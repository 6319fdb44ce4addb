"""Every model family against transformers on a small random-weight model of its architecture
(built offline by transformers' own config and model classes): greedy output token for token in
float32 under chunked prefill, prefix-cache hits, preemption and tensor parallelism; bfloat16
prompt logprobs within the stated tolerance; the mixture-of-experts op against a token-by-token
reference, with an expert that gets no token.

Llama and Qwen2 have their own, older tests (test_llm_parity.py, test_distributed.py); a new
family adds its name to FAMILIES here (docs/model-families.md).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda import LLM, SamplingParams
from pagoda.engine.model_config import ModelConfig
from helpers import GREEDY, NUM_NEW, hf_greedy, make_hf_model, make_tiny_model_dir

FAMILIES = ["qwen3", "qwen3_moe", "mixtral", "phi3", "gemma2", "gemma3_text"]
#: The families whose GGUF files Pagoda reads.
GGUF_FAMILIES = ["qwen3", "qwen3_moe", "mixtral", "phi3", "gemma2", "gemma3_text"]

# Two prompts share a 20-token prefix (five blocks of 4): the second finds it in the cache.
PREFIX = [3000 + 11 * i for i in range(20)]
PROMPTS = [PREFIX + [5, 6], PREFIX + [7], [9, 1200, 41, 7, 7, 300, 12, 5000, 77, 2], list(range(400, 430))]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(name, model directory, transformers model, the oracle's greedy tokens per prompt)."""
    model_dir = make_tiny_model_dir(tmp_path_factory.mktemp(request.param), request.param, seed=3)
    hf = make_hf_model(model_dir)
    return request.param, model_dir, hf, [hf_greedy(hf, p, NUM_NEW) for p in PROMPTS]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_config_names_the_family(family):
    name, model_dir, hf, _ = family
    config = ModelConfig.from_dir(model_dir)
    assert config.architecture == name
    assert config.qk_norm == (name in ("qwen3", "qwen3_moe", "gemma3_text"))
    experts = getattr(hf.config, "num_experts", None) or getattr(hf.config, "num_local_experts", None) or 0
    assert config.num_experts == experts and config.is_moe == (name in ("qwen3_moe", "mixtral"))


def test_greedy_matches_transformers_chunked_with_prefix_hits_and_preemption(family):
    name, model_dir, _, expected = family
    # Chunks of 8 tokens in blocks of 4, and a pool that holds every prompt at admission but
    # not the growth that follows: recompute preemption is forced.
    num_blocks = sum(-(-len(p) // 4) for p in PROMPTS) - 2
    with LLM(str(model_dir), dtype="float32", enforce_eager=True, block_size=4, max_num_batched_tokens=8,
             num_kv_blocks=num_blocks, max_model_len=48, swap_space_bytes=0) as llm:
        first = llm.generate(PROMPTS[:1], GREEDY)
        outputs = llm.generate(PROMPTS[1:], GREEDY)
        stats = llm.engine.scheduler.stats
        assert stats.prefix_cache_hits >= len(PREFIX)
        assert stats.num_preemptions > 0
        kv = llm.engine.scheduler.kv_cache_manager
        assert kv.get_num_free_blocks() == kv.num_blocks
    assert token_ids(first + outputs) == expected


# NOTE: two of the families: Mixtral's and Phi-3's layers compile to the same code as Qwen3-MoE's
# and Llama's.
@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"], indirect=True)
def test_greedy_matches_transformers_compiled(family):
    # The default path: the model's regions compiled (q/k norms inside them, the MoE op opaque
    # to the compiler).
    name, model_dir, _, expected = family
    with LLM(str(model_dir), dtype="float32", max_model_len=64) as llm:
        assert token_ids(llm.generate(PROMPTS, GREEDY)) == expected


@pytest.mark.slow
def test_tp2_matches_transformers(family):
    name, model_dir, _, expected = family
    with LLM(str(model_dir), dtype="float32", enforce_eager=True, tensor_parallel_size=2, max_model_len=64) as llm:
        assert token_ids(llm.generate(PROMPTS, GREEDY)) == expected


def test_bfloat16_prompt_logprobs_within_tolerance(family):
    # As for Llama (test_prompt_scoring.py): against float32 transformers, within 1.5x the error
    # of transformers' own bfloat16, never half a nat; the packed CPU kernels run where they can.
    name, model_dir, hf, _ = family
    prompt = PROMPTS[3]
    with LLM(str(model_dir), dtype="bfloat16", enforce_eager=True, block_size=4, max_num_batched_tokens=8) as llm:
        out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    positions, targets = torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])

    def reference(model):
        with torch.no_grad():
            return model(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)[positions, targets]

    want = reference(hf)
    theirs = reference(make_hf_model(model_dir).to(torch.bfloat16))
    error = (torch.tensor([e.logprob for e in out.prompt_logprobs[1:]]) - want).abs()
    assert error.max().item() < 0.5
    assert error.mean().item() <= 1.5 * (theirs - want).abs().mean().item()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gemma2"], indirect=True)
def test_weight_bytes_per_token_count_a_tokens_experts_and_the_head(family):
    # The bandwidth floor's numerator (pagoda bench compare): every float32 weight but the
    # embedding table where the head is its own, and of the experts top_k of num_experts.
    name, model_dir, hf, _ = family
    config = hf.config
    expected = sum(p.numel() * 4 for p in hf.parameters())  # a tied table counted once: the head reads it
    if not config.tie_word_embeddings:
        expected -= hf.get_input_embeddings().weight.numel() * 4
    experts = sum(p.numel() * 4 for n, p in hf.named_parameters() if ".experts." in n)
    if experts:
        num_experts = getattr(config, "num_experts", None) or config.num_local_experts
        expected -= experts - experts * config.num_experts_per_tok // num_experts
    assert bool(experts) == (name != "gemma2")
    with LLM(str(model_dir), dtype="float32", enforce_eager=True, max_model_len=64) as llm:
        assert llm.engine.worker.ready.weight_bytes_per_token == expected


def test_moe_experts_op_matches_a_token_by_token_reference():
    from pagoda.engine.models.moe import moe_experts

    torch.manual_seed(0)
    tokens, hidden, intermediate, num_experts = 7, 32, 24, 5
    x = torch.randn(tokens, hidden)
    gate_up = torch.randn(num_experts, 2 * intermediate, hidden) / hidden**0.5
    down = torch.randn(num_experts, hidden, intermediate) / intermediate**0.5
    # Two experts a token; expert 3 gets none, expert 0 gets most.
    experts = torch.tensor([[0, 1], [2, 0], [0, 4], [1, 2], [4, 0], [0, 2], [1, 4]])
    weights = torch.rand(tokens, 2)
    got = moe_experts(x, experts, weights, gate_up, down)
    want = torch.zeros_like(x)
    for t in range(tokens):
        for j in range(2):
            e = int(experts[t, j])
            gate, up = (gate_up[e] @ x[t]).split(intermediate)
            want[t] += weights[t, j] * (down[e] @ (F.silu(gate) * up))
    assert 3 not in experts
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", GGUF_FAMILIES)
def test_gguf_file_of_the_family_loads_and_matches(name, tmp_path):
    # The file as llama.cpp's converter lays it out for the family, in float32: converted to a
    # directory of the family's own checkpoint names (engine/model_loader.py), then loaded.
    from helpers import GGUF_TEST_VOCAB_SIZE, write_gguf

    # NOTE: Gemma's attention scale as llama.cpp knows it for a model of this size: head_dim.
    overrides = {"query_pre_attn_scalar": 16} if name.startswith("gemma") else {}
    model_dir = make_tiny_model_dir(tmp_path / "hf", name, seed=4, vocab_size=GGUF_TEST_VOCAB_SIZE, **overrides)
    prompts = [[3 + (5 * i + 7 * j) % 250 for j in range(6 + 11 * i)] for i in range(3)]
    hf = make_hf_model(model_dir)
    expected = [hf_greedy(hf, p, NUM_NEW) for p in prompts]
    path = write_gguf(model_dir, tmp_path / f"{name}.gguf")
    with LLM(str(path), dtype="float32", enforce_eager=True, max_model_len=64) as llm:
        assert llm.engine.model_config.architecture == name
        assert token_ids(llm.generate(prompts, GREEDY)) == expected


def random_moe(seed: int):
    """A float32 mixture-of-experts layer of 6 experts (2 a token), hidden 64, intermediate 96."""
    from pagoda.engine.models.moe import SparseMoE

    torch.manual_seed(seed)
    moe = SparseMoE(hidden_size=64, num_experts=6, top_k=2, intermediate_size=96, norm_topk_prob=True)
    with torch.no_grad():
        moe.gate.weight.normal_(0, 0.3)
        moe.gate_up.normal_(0, 64**-0.5)
        moe.down.normal_(0, 96**-0.5)
    return moe


@pytest.mark.parametrize("packing", ["amx", "blocked"])
def test_packed_experts_match_the_experts_as_loaded(packing):
    # bfloat16 experts on Pagoda's packed kernel (as a CPU with AVX512-BF16 runs them) against
    # torch's products on the same weights, with 1 row (decode) and 40 rows (the tiles' range).
    from pagoda.engine.models.linear import packing_available
    from pagoda.engine.models.moe import SparseMoE

    if not packing_available(packing):
        pytest.skip(f"this CPU has no {packing} kernel")
    moe = random_moe(seed=1).to(torch.bfloat16)
    for rows in (1, 40):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        experts, weights = moe.route(x)
        want = torch.ops.pagoda.moe_experts(x, experts, weights, moe.gate_up, moe.down)
        packed = SparseMoE(64, 6, 2, 96, True).to(torch.bfloat16)
        packed.load_state_dict(moe.state_dict())
        packed.pack(packing)
        assert packed.packing == packing and packed.gate_up.shape != moe.gate_up.shape
        got = packed(x)
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_packed_experts_at_once_equal_each_product_on_its_own():
    """bfloat16 experts on Pagoda's packed kernel, every expert's products in one parallel region
    (csrc's blocked_experts): each token's output is, bit for bit, its experts' own packed
    products (gate/up with SiLU-mul, then down in float32) summed in float32 in the order of its
    experts and rounded once; 1 token (decode), 9 and 40."""
    from pagoda.engine.models.linear import packing_available
    from pagoda.native import linear as linear_kernels

    if not packing_available("blocked"):
        pytest.skip("this CPU has no blocked bfloat16 kernel")
    moe = random_moe(seed=3).to(torch.bfloat16)
    moe.pack("blocked")
    generator = torch.Generator().manual_seed(3)
    for tokens in (1, 9, 40):
        x = torch.randn(tokens, 64, generator=generator).to(torch.bfloat16)
        experts = torch.stack([torch.randperm(6, generator=generator)[:2] for _ in range(tokens)])
        # NOTE: powers of two, whose products are exact (the kernel's multiply-add may be fused)
        weights = 2.0 ** -torch.randint(0, 4, (tokens, 2), generator=generator).float()
        got = linear_kernels.moe_experts(x, experts, weights, moe.gate_up, moe.products[:3], moe.down,
                                         moe.products[3:], 96)
        for t in range(tokens):
            total = torch.zeros(64)
            for j in range(2):
                e = int(experts[t, j])
                act = linear_kernels.packed_silu_mul_linear(x[t:t + 1], moe.gate_up[e], 96)
                total += weights[t, j] * linear_kernels.packed_linear(act, moe.down[e], None, 64,
                                                                      out_dtype=torch.float32)[0]
            assert torch.equal(got[t], total.to(torch.bfloat16)), (tokens, t)


def test_quantized_experts_match_the_experts_dequantized():
    # Every expert's gate/up and down in 8 and 4 bits (with minimums), on the quantized kernel
    # (the layer in one C call), against torch's products on the weights they stand for: 1 row
    # (decode, most experts get no token) and 40 rows (every expert several), in bfloat16.
    from pagoda.native import linear as linear_kernels
    from pagoda.engine.models import quantized as Q
    from pagoda.engine.models.moe import SparseMoE

    if not linear_kernels.quant_linear_vector():
        pytest.skip("no vector quantized kernel on this CPU")
    moe = random_moe(seed=2)

    def q4m(weight: torch.Tensor) -> Q.GroupQuantized:  # 4 bits a weight, a scale and minimum per 32
        n, k = weight.shape
        groups = weight.reshape(n, k // 32, 32)
        low, high = groups.amin(dim=2), groups.amax(dim=2)
        scales = ((high - low) / 15).half().float()
        values = torch.round((groups - low.unsqueeze(2)) / scales.unsqueeze(2)).clamp(0, 15).to(torch.int8)
        return Q.GroupQuantized(values.reshape(n, k), scales, low.half().float(), 4)

    gate_up = [q4m(w) for w in moe.gate_up]
    down = [Q.quantize_int8(w) for w in moe.down]
    reference = SparseMoE(64, 6, 2, 96, True)
    reference.load_state_dict(moe.state_dict())
    with torch.no_grad():
        reference.gate_up.copy_(torch.stack([w.dequantize() for w in gate_up]))
        reference.down.copy_(torch.stack([w.dequantize() for w in down]))
    moe, reference = moe.to(torch.bfloat16), reference.to(torch.bfloat16)
    moe.quantize(gate_up, down)
    assert moe.packing == "q4m+q8" and moe.gate_up.dtype == torch.uint8
    moe.pack("blocked")  # NOTE: packing the model's other layers leaves quantized experts alone
    assert moe.packing == "q4m+q8"
    for rows in (1, 40):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        experts, weights = moe.route(x)
        assert torch.equal(experts, reference.route(x)[0])
        want = torch.ops.pagoda.moe_experts(x, experts, weights, reference.gate_up, reference.down)
        # NOTE: the kernel quantizes each row's activations to 8 bits (test_quantized.py)
        got = moe(x)
        error = (got.float() - want.float()).abs().max()
        assert error <= 0.03 * want.float().abs().max(), (rows, error)
        # one C call for the layer, whose tokens do not change each other's sums
        alone = linear_kernels.moe_experts(x[-1:], experts[-1:], weights[-1:], moe.gate_up, moe.products[:3],
                                           moe.down, moe.products[3:], 96)
        assert torch.equal(alone, got[-1:])
    with pytest.raises(ValueError, match=r"expert ids must be in \[0, 6\)"):
        linear_kernels.moe_experts(x[:1], torch.tensor([[0, 6]]), torch.ones(1, 2), moe.gate_up, moe.products[:3],
                                   moe.down, moe.products[3:], 96)
    with pytest.raises(ValueError, match="different packings"):
        SparseMoE(64, 6, 2, 96, True).quantize(gate_up[:5] + [Q.quantize_int8(moe.gate_up.new_ones(192, 64).float())],
                                              down)


def test_the_kernels_routing_is_the_routers():
    """The C kernel's routing (csrc's moe_route: the layer's op and the one-call forward route
    with it) picks the experts SparseMoE.route picks, the lower id first among equal logits,
    with their weights within a bfloat16 step, renormalized or not."""
    from pagoda.native import library as kernel_library
    from pagoda.native import linear as linear_kernels
    from pagoda.engine.models.moe import SparseMoE

    if not kernel_library.available():
        pytest.skip("needs the CPU kernels (a C compiler)")
    torch.manual_seed(5)
    logits = torch.randn(300, 8).mul(3).to(torch.bfloat16)
    logits[0] = 1.0  # every expert tied
    logits[1] = torch.tensor([0.5, 2, 1, 2, 2, -1, 0, 1])  # three tied for two places
    for norm in (True, False):
        router = SparseMoE(hidden_size=8, num_experts=8, top_k=2, intermediate_size=32, norm_topk_prob=norm)
        router = router.to(torch.bfloat16)
        with torch.no_grad():
            router.gate.weight.copy_(torch.eye(8))  # the logits as given
        want_experts, want_weights = router.route(logits)
        experts, weights = linear_kernels.moe_route(logits, 2, norm)
        assert torch.equal(experts, want_experts)
        assert experts[0].tolist() == [0, 1] and experts[1].tolist() == [1, 3]
        torch.testing.assert_close(weights, want_weights.float(), rtol=2**-8, atol=0)
        if norm:
            assert weights.sum(1).sub(1).abs().max() < 0.01


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_a_quantized_gguf_files_experts_run_quantized(name, tmp_path):
    # A Q8_0 file (written by the gguf package's quantizer): the experts are read as their own
    # blocks and multiplied by the quantized kernel, as every other matrix of the file; the
    # prompt's logprobs stay within Q8_0's error of the same file dequantized to floats.
    from pagoda.native import linear as linear_kernels
    from helpers import GGUF_TEST_VOCAB_SIZE, gguf_runs_agree, write_gguf

    if not linear_kernels.quant_linear_vector():
        pytest.skip("no vector quantized kernel on this CPU")
    model_dir = make_tiny_model_dir(tmp_path / "hf", name, seed=4, vocab_size=GGUF_TEST_VOCAB_SIZE,
                                    **({"moe_intermediate_size": 64} if name == "qwen3_moe" else {}))
    path = write_gguf(model_dir, tmp_path / f"{name}.Q8_0.gguf", "q8_0")
    described, float_described = gguf_runs_agree(path, "float32")
    assert "GGUF types" in described and "2 layers q8+q8 experts" in described, described
    assert "experts" not in float_described


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"], indirect=True)
def test_gemma_layers_keep_their_windows_past_the_window(family):
    # The first layer attends within 8 tokens, the second globally: prompts of 22-30 tokens are
    # past the window, the context is not capped at it; the CPU kernel runs windows and
    # soft-capping beside global layers (auto chooses it), and so do naive and triton (its kernels
    # under Triton's interpreter here).
    name, model_dir, _, expected = family
    config = ModelConfig.from_dir(model_dir)
    assert (config.sliding_window, config.sliding_layers) == (8, (0,)) and not config.windowed_everywhere
    assert max(len(p) for p in PROMPTS) > config.sliding_window
    for backend in ("auto", "naive", "triton"):
        with LLM(str(model_dir), dtype="float32", enforce_eager=True, max_model_len=64,
                 attention_backend=backend) as llm:
            assert llm.engine.worker.ready.attention_backend == ("cpu_paged" if backend == "auto" else backend)
            assert llm.engine.max_model_len == 64
            assert token_ids(llm.generate(PROMPTS, GREEDY)) == expected


def test_phi3_longrope_over_part_of_each_head_matches_transformers(tmp_path):
    # Phi-4-mini's RoPE at a tiny size: LongRoPE's factors over the first half of each head, the
    # short factors within the 48-token pretraining context, the long ones past it (transformers
    # switches by the sequence's length; the engine by its max_model_len: the same choice for
    # sequences that stay on one side of the context, as these do).
    model_dir = make_tiny_model_dir(
        tmp_path / "phi4-mini-like", "phi3", seed=3, partial_rotary_factor=0.5, max_position_embeddings=128,
        original_max_position_embeddings=48,
        rope_scaling={"type": "longrope", "short_factor": [1.0, 1.3, 2.0, 3.5], "long_factor": [1.5, 2.5, 4.0, 9.0]})
    config = ModelConfig.from_dir(model_dir)
    assert (config.rope_type, config.rotary_dim, config.head_dim) == ("longrope", 8, 16)
    hf = make_hf_model(model_dir)
    within, past = PROMPTS[:3], [list(range(400, 460)), [7 + 13 * i for i in range(70)]]
    for prompts, max_model_len in ((within, 48), (past, 128)):
        with LLM(str(model_dir), dtype="float32", enforce_eager=True, max_model_len=max_model_len) as llm:
            assert token_ids(llm.generate(prompts, GREEDY)) == [hf_greedy(hf, p, NUM_NEW) for p in prompts]


@pytest.mark.slow
def test_phi3_longrope_gguf_reads_its_factor_tensors_and_partial_rotation(tmp_path):
    from helpers import GGUF_TEST_VOCAB_SIZE, write_gguf

    model_dir = make_tiny_model_dir(
        tmp_path / "hf", "phi3", seed=4, vocab_size=GGUF_TEST_VOCAB_SIZE, partial_rotary_factor=0.5,
        max_position_embeddings=128, original_max_position_embeddings=48,
        rope_scaling={"type": "longrope", "short_factor": [1.0, 1.3, 2.0, 3.5], "long_factor": [1.5, 2.5, 4.0, 9.0]})
    hf = make_hf_model(model_dir)
    prompts = [[3 + (5 * i + 7 * j) % 250 for j in range(50 + 11 * i)] for i in range(2)]  # past the 48
    path = write_gguf(model_dir, tmp_path / "phi4-mini-like.gguf")
    with LLM(str(path), dtype="float32", enforce_eager=True, max_model_len=128) as llm:
        config = llm.engine.model_config
        assert (config.rope_type, config.rotary_dim, config.rope_scaling["long_factor"]) == (
            "longrope", 8, [1.5, 2.5, 4.0, 9.0])
        assert token_ids(llm.generate(prompts, GREEDY)) == [hf_greedy(hf, p, NUM_NEW) for p in prompts]
