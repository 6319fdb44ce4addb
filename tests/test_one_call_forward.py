"""Decode steps in one call (engine/models/one_call_forward.py): each step's hidden states and
KV writes those of the layer-by-layer path bit for bit, tokens within rounding of
transformers, and the path not taken where it does not apply."""

from __future__ import annotations

import math
import re

import numpy as np

import pytest
import torch
import torch.nn.functional as F

from pagoda import LLM, SamplingParams
from pagoda.attention_backends import AttentionMetadata, cpu_kernels
from pagoda.native import library as kernel_library
from pagoda.native import linear as linear_kernels
from pagoda.attention_backends.cpu_paged import CpuPagedAttentionBackend
from pagoda.engine.lora import LoRAAdapter, projection_shapes
from pagoda.engine.model_config import ModelConfig
from pagoda.engine.model_loader import load_weights
from pagoda.engine.models import decoder
from pagoda.engine.models.linear import BLOCKED_LAYOUT, GateUpLinear, Linear, choose_packing, packing_available
from pagoda.engine.models.decoder import DecoderForCausalLM, RotaryEmbedding
from pagoda.engine.models import lora as worker_lora
from pagoda.engine.models.lora import LoRAManager
from pagoda.engine.models.moe import SparseMoE
from pagoda.engine.models.one_call_forward import ENV
from pagoda.engine.models.quantized import quantize_int8
from conftest import TINY_INIT
from helpers import compress, hf_dequantized, make_tiny_model_dir

needs_vector = pytest.mark.skipif(not linear_kernels.quant_linear_vector(),
                                  reason="int8 needs the quantized kernel's vector path (AVX512-VNNI or AVX2)")
BLOCK_SIZE = 16


def tiny_model(model_dir, weights: str, max_positions: int = 128, lora_slots: int = 0) -> DecoderForCausalLM:
    """The tiny model in bfloat16 with every linear layer in int8 (``weights`` "int8") or
    bfloat16 packed for this CPU ("bf16"), built as the worker builds it; with ``lora_slots``,
    that many LoRA slots of rank 8 (``model.lora_manager``)."""
    config = ModelConfig.from_dir(model_dir)
    backend = CpuPagedAttentionBackend(config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                                       config.head_dim**-0.5)
    with torch.device("meta"):
        model = DecoderForCausalLM(config, backend, max_positions)
    model = model._apply(lambda t: torch.empty(t.shape, dtype=torch.bfloat16 if t.is_floating_point() else t.dtype))
    model.rotary = RotaryEmbedding(config, max_positions)
    model.load_weights(load_weights(model_dir))
    if lora_slots:
        model.lora_manager = LoRAManager(model, lora_slots, 8, None)
        model.lora_context = model.lora_manager.context
    packing = choose_packing(torch.device("cpu"), torch.bfloat16)
    if weights == "int8":
        if not linear_kernels.quant_linear_vector():
            pytest.skip("the quantized kernel has no vector path here (neither AVX512-VNNI nor AVX2)")
        model.quantize_weights(lambda names, weight: quantize_int8(weight))
        if config.is_moe and packing in BLOCKED_LAYOUT:  # the routers (never quantized), as the worker packs them
            model.pack_weights(packing)
    else:
        if packing not in BLOCKED_LAYOUT:
            pytest.skip(f"Pagoda's bfloat16 kernel does not run here ({packing})")
        model.pack_weights(packing)
    return model.eval()


def step(requests: list[tuple[list[int], list[int]]]) -> AttentionMetadata:
    """A step of the requests (their tokens' positions, their cache blocks)."""
    query_lens = [len(positions) for positions, _ in requests]
    seq_lens = [positions[-1] + 1 for positions, _ in requests]
    width = max(len(blocks) for _, blocks in requests)
    return AttentionMetadata(
        num_tokens=sum(query_lens), query_lens=query_lens, seq_lens=seq_lens,
        query_start_loc=torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32),
        seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([blocks + [0] * (width - len(blocks)) for _, blocks in requests], dtype=torch.int32),
        slot_mapping=torch.tensor([blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                                   for positions, blocks in requests for p in positions]),
        block_size=BLOCK_SIZE, max_query_len=max(query_lens), max_seq_len=max(seq_lens))


def prepared_caches(model, num_blocks: int, record) -> tuple[list, list]:
    """bfloat16 KV caches of ``num_blocks`` blocks with the one call prepared over them, and the
    list of ``record(args)`` of each call it makes."""
    key_shape, value_shape = model.layers[0].self_attn.backend.kv_cache_shapes(num_blocks, BLOCK_SIZE)
    caches = [(torch.zeros(key_shape, dtype=torch.bfloat16), torch.zeros(value_shape, dtype=torch.bfloat16))
              for _ in model.layers]
    assert model.prepare_one_call_forward(caches)
    calls = []
    one_call_fn = model._one_call.fn
    model._one_call.fn = lambda *args: calls.append(record(args)) or one_call_fn(*args)
    return caches, calls


@pytest.fixture
def rounded_once(monkeypatch):
    """The eager model's RoPE and (quantized) SiLU-mul rounded to bfloat16 once, from float32
    sums, as the compiled regions' code and the one call round them (eager bfloat16 rounds
    after every op)."""
    rope, gate_up = decoder.apply_rope, GateUpLinear.forward

    def rope_once(x, cos, sin):
        return rope(x.float(), cos.float(), sin.float()).to(x.dtype)

    def gate_up_once(self, x):
        if self.packing in BLOCKED_LAYOUT:  # the kernel's epilogue, the same either way
            return gate_up(self, x)
        gate, up = Linear.forward(self, x).float().split(self.out_features // 2, dim=-1)
        return (F.silu(gate) * up).to(x.dtype)

    monkeypatch.setattr(decoder, "apply_rope", rope_once)
    monkeypatch.setattr(GateUpLinear, "forward", gate_up_once)


@pytest.fixture
def silu_exp(request):
    """The exp of the one call's SiLU (after a quantized gate/up product; a bfloat16 one has
    SiLU in its epilogue, None here): torch's own vector exp, handed over where torch's kernels
    are AVX-512 ones, or the C library's expf (the path elsewhere)."""
    if not kernel_library.available():
        pytest.skip("no C compiler for the CPU kernels")
    lib = kernel_library.load()
    if request.param == "expf":
        lib.one_call_forward_set_exp16(None)
    elif request.param == "torch's" and not (kernel_library._torch_exp16() and lib.one_call_forward_set_exp16(
            kernel_library._torch_exp16())):
        pytest.skip("torch's kernels or this build of the library are not AVX-512 ones")
    yield request.param
    lib.one_call_forward_set_exp16(kernel_library._torch_exp16())


@pytest.mark.parametrize("silu_exp", ["torch's", "expf"], indirect=True)
def test_silu_mul_gives_torchs_result(silu_exp):
    """The one call's SiLU-mul over a million values of magnitudes from 0.001 to 400 and the
    edges (zeros, infinities, NaN, where exp underflows and overflows, subnormal products: the
    AVX512-BF16 conversion takes those for zeros), rows of a length that
    is not a multiple of 16: with torch's exp, what torch's vectorized SiLU gives (F.silu in
    float32 over whole rows, times up, rounded to bfloat16 once) bit for bit; with expf, within
    one bfloat16 rounding of it."""
    generator = torch.Generator().manual_seed(0)
    gate = torch.randn(512, 2050, generator=generator) * torch.logspace(-3, 2, 2050)
    gate[0, :8] = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, -88.0, 88.0, -104.0])
    gate[1] = torch.rand(2050, generator=generator) * 4e-38  # products below float32's smallest normal
    gate, up = gate.bfloat16(), torch.randn(512, 2050, generator=generator).bfloat16()
    act = linear_kernels.silu_mul(torch.cat([gate, up], dim=1))
    # NOTE: row by row, 2048 elements of each through torch's vector loop (its tail elements take
    # std::exp); the last two of a row are compared one bfloat16 rounding apart below.
    expected = torch.stack([(F.silu(g.float()) * u.float()).bfloat16() for g, u in zip(gate, up)])
    if silu_exp == "torch's":
        torch.testing.assert_close(act[:, :2048], expected[:, :2048], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(act.float(), expected.float(), rtol=2**-7, atol=1e-38, equal_nan=True)


@pytest.fixture(scope="module")
def tiny_qwen3_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3", seed=2, **TINY_INIT)


@pytest.fixture(scope="module")
def tiny_qwen3_moe_dir(tmp_path_factory):
    """Qwen3-MoE's layers: the first a mixture of 4 experts (2 a token), the second a dense MLP."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-qwen3-moe"), "qwen3_moe", seed=3, mlp_only_layers=[1],
                               moe_intermediate_size=64,
                               **TINY_INIT)


@pytest.mark.parametrize("weights, silu_exp", [("int8", "torch's"), ("int8", "expf"), ("bf16", None)],
                         indirect=["silu_exp"])
# qwen2: q/k/v with a bias; qwen3: an RMS norm per query and key head; qwen3_moe: and experts
@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3", "qwen3_moe"])
@torch.inference_mode()
def test_each_step_equals_the_layer_by_layer_path(request, monkeypatch, architecture, weights, rounded_once,
                                                  silu_exp):
    """Ten sequences (prompts of 1 to 20 tokens, blocks scattered over the cache) prefilled,
    then 24 decode steps across block boundaries, every sequence in the even ones, the first
    alone in the odd ones, and one step that also prefills an eleventh sequence's 30 tokens;
    each step computed both ways from the same cache (prefill chunks of 8 tokens or more on the
    attention tiles where this CPU has them, shorter ones by the paged kernel): the final
    hidden states and the keys and values written equal bit for bit (SiLU's exp either way)."""
    from pagoda.attention_backends import cpu_paged

    monkeypatch.setattr(cpu_paged, "PREFILL_ON_TILES_MIN_TOKENS", 8)
    model = tiny_model(request.getfixturevalue(f"tiny_{architecture}_dir"), weights)
    assert (model.layers[0].self_attn.qkv_proj.bias is not None) == (architecture == "qwen2")
    assert (model.layers[0].self_attn.q_norm is not None) == architecture.startswith("qwen3")
    assert isinstance(model.layers[0].mlp, SparseMoE) == (architecture == "qwen3_moe")
    backend = model.layers[0].self_attn.backend
    caches, calls = prepared_caches(model, 40, lambda args: args[2])  # rows
    generator = torch.Generator().manual_seed(0)
    order = torch.randperm(40, generator=generator).tolist()
    prompts = [torch.randint(3, 4000, (n,), generator=generator).tolist() for n in (13, 1, 5, 20, 2, 9, 16, 17, 3, 8)]
    blocks = [order[3 * i:3 * i + 3] for i in range(len(prompts))]
    late_prompt, late_blocks = torch.randint(3, 4000, (30,), generator=generator).tolist(), order[30:32]

    def both_ways(requests, ids, positions):
        """The step's final hidden states by the one call, after checking them and the cache
        it wrote against the layer-by-layer path's."""
        metadata = step(requests)
        backend.prepare(metadata)
        ids, positions = torch.tensor(ids), torch.tensor(positions)
        before = [(k.clone(), v.clone()) for k, v in caches]
        layered = model.forward(ids, positions, before, metadata)  # other caches: the layer-by-layer path
        one_call = model(ids, positions, caches, metadata)
        assert one_call.shape == layered.shape == (len(ids), model.config.hidden_size)
        assert torch.equal(one_call, layered), requests
        for (k, v), (k_ref, v_ref) in zip(caches, before):
            assert torch.equal(k, k_ref) and torch.equal(v, v_ref), requests
        return one_call, metadata

    hidden, metadata = both_ways([(list(range(len(p))), b) for p, b in zip(prompts, blocks)],
                                 [t for p in prompts for t in p], [i for p in prompts for i in range(len(p))])
    if backend.tiles is not None:
        assert metadata.backend_data.tile_requests.tolist() == [0, 3, 5, 6, 7, 9]
    tokens = model.compute_logits(hidden[metadata.query_start_loc[1:].long() - 1]).argmax(-1).tolist()
    lengths = [len(p) for p in prompts]
    for i in range(24):
        which = range(len(prompts)) if i % 2 == 0 else [0]
        requests = [([lengths[r]], blocks[r]) for r in which]
        ids, positions = [tokens[r] for r in which], [lengths[r] for r in which]
        if i == 6:  # a mixed step: the decodes and a prompt's first chunk
            requests.append((list(range(30)), late_blocks))
            ids, positions = ids + late_prompt, positions + list(range(30))
        one_call, _ = both_ways(requests, ids, positions)
        for r, token in zip(which, model.compute_logits(one_call[:len(which)]).argmax(-1).tolist()):
            tokens[r] = token
            lengths[r] += 1
    assert calls == [94, *[10, 1] * 3, 40, 1, *[10, 1] * 8]  # every step in one call


@torch.inference_mode()
def test_steps_past_a_sliding_window_equal_the_layer_by_layer_path(tmp_path, rounded_once):
    """A model whose every layer attends within 24 positions (Mistral's windows): prompts of 40
    and 70 tokens prefilled in chunks beside decodes, then decodes, past the window; the blocks
    wholly before every row's window hold NaN (given back to the pool, rewritten by anyone):
    the one call's hidden states and KV writes those of the layer-by-layer path bit for bit,
    the window passed to it only in steps where a row is past the window."""
    model = tiny_model(make_tiny_model_dir(tmp_path, "mistral", sliding_window=24, **TINY_INIT), "bf16")
    assert model.config.windowed_everywhere and model.layers[0].self_attn.window == 24
    caches, windows = prepared_caches(model, 20, lambda args: args[24])
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 4000, (n,), generator=generator).tolist() for n in (40, 70, 9)]
    blocks = [[3, 7, 1, 12, 5, 18], [0, 9, 14, 2, 16, 6, 11], [4, 19]]
    done, tokens = [0, 0, 0], [None, None, None]

    def run(chunks):
        requests, ids, positions = [], [], []
        for r, n in chunks:
            requests.append((list(range(done[r], done[r] + n)), blocks[r]))
            ids += prompts[r][done[r]:done[r] + n] if done[r] < len(prompts[r]) else [tokens[r]]
            positions += list(range(done[r], done[r] + n))
        metadata = step(requests)
        model.layers[0].self_attn.backend.prepare(metadata)
        for (k, v), (r, n) in ((kv, chunk) for kv in caches for chunk in chunks):
            gone = [blocks[r][b] for b in range(max(0, done[r] - 24 + 1) // BLOCK_SIZE)]
            k[gone], v[gone] = float("nan"), float("nan")
        ids, positions = torch.tensor(ids), torch.tensor(positions)
        before = [(k.clone(), v.clone()) for k, v in caches]
        layered = model.forward(ids, positions, before, metadata)
        one_call = model(ids, positions, caches, metadata)
        assert not one_call.isnan().any()
        assert torch.equal(one_call, layered), chunks
        for (k, v), (k_ref, v_ref) in zip(caches, before):
            assert torch.equal(k.nan_to_num(), k_ref.nan_to_num()) and torch.equal(v.nan_to_num(), v_ref.nan_to_num())
        last = metadata.query_start_loc[1:].long() - 1
        for (r, n), token in zip(chunks, model.compute_logits(one_call[last]).argmax(-1).tolist()):
            done[r] += n
            tokens[r] = token

    run([(0, 16), (2, 9)])  # within the window: no window passed
    run([(0, 24), (1, 30), (2, 1)])
    run([(1, 40), (0, 1), (2, 1)])
    for _ in range(20):
        run([(0, 1), (1, 1), (2, 1)])
    assert windows == [0, *[24] * 22]


def head64_model(tmp_path, monkeypatch, tiles: str):
    """A tiny bfloat16 model with head_dim 64 (the attention tiles' size) attending on ``tiles``,
    its KV caches of 40 blocks, the one call prepared over them; its products in bfloat16 where
    Pagoda's kernel takes them, else in int8."""
    monkeypatch.setattr(cpu_kernels, "attention_tiles", lambda: tiles)
    model_dir = make_tiny_model_dir(tmp_path, "llama", hidden_size=128, num_attention_heads=2,
                                    num_key_value_heads=1, **TINY_INIT)
    model = tiny_model(model_dir, "bf16" if choose_packing(torch.device("cpu"), torch.bfloat16) in BLOCKED_LAYOUT
                       else "int8")
    backend = model.layers[0].self_attn.backend
    assert backend.tiles == tiles and backend.head_dim == 64
    key_shape, value_shape = backend.kv_cache_shapes(40, BLOCK_SIZE)
    caches = [(torch.zeros(key_shape, dtype=torch.bfloat16), torch.zeros(value_shape, dtype=torch.bfloat16))
              for _ in model.layers]
    assert model.prepare_one_call_forward(caches)
    return model, backend, caches


def cascade_model(tmp_path, monkeypatch, tiles: str, min_requests: int):
    """head64_model with the cascade taken from ``min_requests`` requests over any shared block,
    and the list the one call's cascade groups are counted into, a count a call."""
    from pagoda.attention_backends import cpu_paged

    monkeypatch.setattr(cpu_paged, "CASCADE_MIN_REQUESTS", min_requests)
    monkeypatch.setattr(cpu_paged, "CASCADE_MIN_TOKENS", 1)
    model, backend, caches = head64_model(tmp_path, monkeypatch, tiles)
    calls = []
    one_call_fn = model._one_call.fn
    model._one_call.fn = lambda *args: calls.append(args[26]) or one_call_fn(*args)  # how many groups share
    return model, backend, caches, calls


TILE_KINDS_HERE = list(cpu_kernels.attention_tile_kinds() if kernel_library.available() else ()) or [
    pytest.param(None, marks=pytest.mark.skip(reason="no attention tiles here"))]


@pytest.mark.parametrize("tiles", TILE_KINDS_HERE)
@torch.inference_mode()
def test_prefill_chunks_on_the_tiles_equal_the_layer_by_layer_path(tmp_path, monkeypatch, rounded_once, tiles):
    """Prompts of 3 to 45 tokens (across block boundaries) prefilled in one step, those of 8
    tokens or more on the attention tiles, the rest by the paged kernel; then a step of
    second chunks (some on the tiles, over contexts already cached) beside one-token decodes:
    in the one call as layer by layer, equal bit for bit, the cache's keys and values too."""
    from pagoda.attention_backends import cpu_paged

    monkeypatch.setattr(cpu_paged, "PREFILL_ON_TILES_MIN_TOKENS", 8)
    model, backend, caches = head64_model(tmp_path, monkeypatch, tiles)
    generator = torch.Generator().manual_seed(5)
    lengths = [45, 3, 17, 8, 7, 26]
    blocks = [[5 * i + j for j in range(5)] for i in range(len(lengths))]
    for chunks in ((45, 3, 17, 8, 7, 26), (1, 20, 1, 9, 2, 1)):
        starts = [0] * len(lengths) if chunks[0] == 45 else lengths
        requests = [(list(range(start, start + n)), b) for start, n, b in zip(starts, chunks, blocks)]
        metadata = step(requests)
        backend.prepare(metadata)
        assert metadata.backend_data.tile_requests.tolist() == [i for i, n in enumerate(chunks) if n >= 8]
        ids = torch.randint(3, 4000, (sum(chunks),), generator=generator)
        positions = torch.tensor([p for positions, _ in requests for p in positions])
        before = [(k.clone(), v.clone()) for k, v in caches]
        layered = model.forward(ids, positions, before, metadata)
        one_call = model(ids, positions, caches, metadata)
        assert torch.equal(one_call, layered), chunks
        for (k, v), (k_ref, v_ref) in zip(caches, before):
            assert torch.equal(k, k_ref) and torch.equal(v, v_ref), chunks
        lengths = [start + n for start, n in zip(starts, chunks)]


@pytest.mark.parametrize("tiles", TILE_KINDS_HERE)
@torch.inference_mode()
def test_a_cascade_step_equals_the_layer_by_layer_path(tmp_path, monkeypatch, rounded_once, tiles):
    """A tiny model with head_dim 64 (the tiles' size), six sequences whose tables start with
    the same two blocks (one 37-token prefix, its cache written once), decoding together and
    one alone past thresholds of 1: each step takes the cascade, in the one call as layer by
    layer, with its shared part on the tiles; equal bit for bit, and within bfloat16 rounding
    of the same step without the cascade."""
    from pagoda.attention_backends import cpu_paged

    model, backend, caches, calls = cascade_model(tmp_path, monkeypatch, tiles, 1)
    generator = torch.Generator().manual_seed(3)
    prefix = torch.randint(3, 4000, (37,), generator=generator).tolist()
    tails = [torch.randint(3, 4000, (n,), generator=generator).tolist() for n in (1, 4, 2, 9, 3, 6)]
    blocks = [[0, 1, 2 + 3 * i, 3 + 3 * i, 4 + 3 * i] for i in range(len(tails))]
    # The prefix with the first tail, then each other tail over the two shared blocks (the
    # first 32 tokens); the 5 prefix tokens of the third block each sequence holds itself.
    lengths = []
    for i, tail in enumerate(tails):
        start = 0 if i == 0 else 32
        tokens = (prefix + tail)[start:]
        metadata = step([(list(range(start, 37 + len(tail))), blocks[i])])
        backend.prepare(metadata)
        ids, positions = torch.tensor(tokens), torch.arange(start, 37 + len(tail))
        before = [(k.clone(), v.clone()) for k, v in caches]
        assert torch.equal(model(ids, positions, caches, metadata), model.forward(ids, positions, before, metadata))
        lengths.append(37 + len(tail))
    calls.clear()
    tokens = [7] * len(tails)
    for i in range(8):
        which = range(len(tails)) if i % 2 == 0 else [0]
        # in step 4 two tokens a sequence (as a speculative step's): the cascade's rows not one a sequence
        width = 2 if i == 4 else 1
        requests = [(list(range(lengths[r], lengths[r] + width)), blocks[r]) for r in which]
        metadata = step(requests)
        backend.prepare(metadata)
        assert metadata.backend_data.shared is not None and metadata.backend_data.shared.tokens == 32
        ids = torch.tensor([tokens[r] if j == 0 else 11 for r in which for j in range(width)])
        positions = torch.tensor([p for positions, _ in requests for p in positions])
        before = [(k.clone(), v.clone()) for k, v in caches]
        layered = model.forward(ids, positions, before, metadata)
        one_call = model(ids, positions, caches, metadata)
        assert torch.equal(one_call, layered), i
        plain = step(requests)
        monkeypatch.setattr(cpu_paged, "CASCADE_MIN_REQUESTS", 0)  # never
        backend.prepare(plain)
        monkeypatch.setattr(cpu_paged, "CASCADE_MIN_REQUESTS", 1)
        assert plain.backend_data.shared is None
        without = model.forward(ids, positions, [(k.clone(), v.clone()) for k, v in before], plain)
        # NOTE: the two orders round differently (the cascade's parts in bfloat16 before the merge)
        # and a random two-layer model amplifies it: up to 0.125 apart on values up to 3.4 seen.
        torch.testing.assert_close(one_call.float(), without.float(), rtol=0.05, atol=0.15,
                                   msg=lambda m: f"step {i}: {m}")
        for r, token in zip(which, model.compute_logits(one_call[width - 1::width]).argmax(-1).tolist()):
            tokens[r] = token
            lengths[r] += width
    assert calls == [1] * 8  # every step in one call, each a cascade of one group (its two blocks: above)


@pytest.mark.parametrize("tiles", TILE_KINDS_HERE)
@torch.inference_mode()
def test_a_cascade_of_some_requests_equals_the_layer_by_layer_path(tmp_path, monkeypatch, rounded_once, tiles):
    """A step as a burst under one system prompt starts: one request computes the 37-token
    prompt whose two whole blocks three others found in the prefix cache (their tails in the
    same step, over keys that step writes), beside a decode of an unrelated sequence. The three
    are the cascade's members; the first request's rows go to the prefill tiles, the decode to
    the paged kernel. In the one call as layer by layer, bit for bit; within bfloat16 rounding
    of the same step without the cascade."""
    from pagoda.attention_backends import cpu_paged

    monkeypatch.setattr(cpu_paged, "PREFILL_ON_TILES_MIN_TOKENS", 8)
    model, backend, caches, calls = cascade_model(tmp_path, monkeypatch, tiles, 2)
    generator = torch.Generator().manual_seed(4)
    alone = torch.randint(3, 4000, (20,), generator=generator).tolist()
    alone_blocks = [30, 31]
    metadata = step([(list(range(20)), alone_blocks)])
    backend.prepare(metadata)
    model(torch.tensor(alone), torch.arange(20), caches, metadata)
    prefix = torch.randint(3, 4000, (37,), generator=generator).tolist()
    tails = [torch.randint(3, 4000, (n,), generator=generator).tolist() for n in (3, 1, 5, 2)]
    blocks = [[0, 1, 2 + 3 * i, 3 + 3 * i] for i in range(len(tails))]
    requests = [(list(range(37 + len(tails[0]))), blocks[0])]
    requests += [(list(range(32, 37 + len(tail))), b) for tail, b in zip(tails[1:], blocks[1:])]
    requests.append(([20], alone_blocks))
    ids = torch.tensor((prefix + tails[0]) + [t for tail in tails[1:] for t in (prefix + tail)[32:]] + [9])
    positions = torch.tensor([p for positions, _ in requests for p in positions])
    metadata = step(requests)
    backend.prepare(metadata)
    plan = metadata.backend_data
    assert plan.shared.tokens == 32 and plan.shared.members.tolist() == [1, 2, 3]
    assert plan.tile_requests.tolist() == [0] and plan.skip.tolist() == [True, True, True, True, False]
    before = [(k.clone(), v.clone()) for k, v in caches]
    layered = model.forward(ids, positions, [(k.clone(), v.clone()) for k, v in before], metadata)
    calls.clear()
    one_call = model(ids, positions, caches, metadata)
    assert calls == [1]  # one group, in the one call
    assert torch.equal(one_call, layered)
    monkeypatch.setattr(cpu_paged, "CASCADE_MIN_REQUESTS", 0)  # never
    plain = step(requests)
    backend.prepare(plain)
    assert plain.backend_data.shared is None
    without = model.forward(ids, positions, [(k.clone(), v.clone()) for k, v in before], plain)
    torch.testing.assert_close(one_call.float(), without.float(), rtol=0.05, atol=0.15)


@pytest.mark.parametrize("tiles", TILE_KINDS_HERE)
@torch.inference_mode()
def test_a_cascade_of_two_groups_equals_the_layer_by_layer_path(tmp_path, monkeypatch, rounded_once, tiles):
    """Traffic under two system prompts (37 and 40 tokens, two whole blocks each): each prompt's
    first request decoding beside two new requests that found it cached (their tails in
    chunks), and a decode of neither. Two groups, each a cascade over its own blocks, in one
    call; bit for bit the layer-by-layer path, within bfloat16 rounding of no cascade."""
    from pagoda.attention_backends import cpu_paged

    model, backend, caches, calls = cascade_model(tmp_path, monkeypatch, tiles, 2)
    generator = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 4000, (n,), generator=generator).tolist() for n in (37, 40, 20)]
    firsts = [[0, 1, 2], [10, 11, 12], [30, 31]]
    metadata = step([(list(range(len(p))), b) for p, b in zip(prompts, firsts)])
    backend.prepare(metadata)
    model(torch.tensor([t for p in prompts for t in p]), metadata_positions(metadata), caches, metadata)
    tails = [torch.randint(3, 4000, (n,), generator=generator).tolist() for n in (4, 9, 2, 6)]
    shares = [0, 0, 1, 1]  # which prompt each tail follows
    blocks = [firsts[g][:2] + [20 + 2 * i, 21 + 2 * i] for i, g in enumerate(shares)]  # (of 40)
    requests = [([len(p)], b) for p, b in zip(prompts, firsts)]
    requests += [(list(range(32, len(prompts[g]) + len(t))), b) for g, t, b in zip(shares, tails, blocks)]
    ids = [5, 6, 7] + [x for g, t in zip(shares, tails) for x in (prompts[g] + t)[32:]]
    ids, positions = torch.tensor(ids), torch.tensor([p for positions, _ in requests for p in positions])
    metadata = step(requests)
    backend.prepare(metadata)
    plan = metadata.backend_data
    assert [(g.tokens, g.members.tolist()) for g in plan.groups] == [(32, [0, 3, 4]), (32, [1, 5, 6])]
    assert plan.tile_requests is None and plan.skip.tolist() == [True, True, False, True, True, True, True]
    before = [(k.clone(), v.clone()) for k, v in caches]
    layered = model.forward(ids, positions, [(k.clone(), v.clone()) for k, v in before], metadata)
    calls.clear()
    one_call = model(ids, positions, caches, metadata)
    assert calls == [2]
    assert torch.equal(one_call, layered)
    monkeypatch.setattr(cpu_paged, "CASCADE_MIN_REQUESTS", 0)  # never
    plain = step(requests)
    backend.prepare(plain)
    without = model.forward(ids, positions, [(k.clone(), v.clone()) for k, v in before], plain)
    torch.testing.assert_close(one_call.float(), without.float(), rtol=0.05, atol=0.15)


def metadata_positions(metadata: AttentionMetadata) -> torch.Tensor:
    """Each query row's position (its request's last query_len positions)."""
    return torch.cat([torch.arange(s - q, s) for s, q in zip(metadata.seq_lens, metadata.query_lens)])


@torch.inference_mode()
def test_a_token_or_position_out_of_range_is_an_index_error_and_writes_nothing(tiny_llama_dir):
    """A prompt chunk with a token past the vocabulary, or a position past RoPE's table: an
    IndexError naming the offending value, raised before the call writes the KV cache."""
    weights = "bf16" if choose_packing(torch.device("cpu"), torch.bfloat16) in BLOCKED_LAYOUT else "int8"
    model = tiny_model(tiny_llama_dir, weights, max_positions=128)
    backend = model.layers[0].self_attn.backend
    key_shape, value_shape = backend.kv_cache_shapes(4, BLOCK_SIZE)
    caches = [(torch.zeros(key_shape, dtype=torch.bfloat16), torch.zeros(value_shape, dtype=torch.bfloat16))
              for _ in model.layers]
    assert model.prepare_one_call_forward(caches)
    vocab = model.embed_tokens.num_embeddings
    metadata = step([([0, 1, 2], [1])])
    backend.prepare(metadata)
    for ids, positions, named in (([5, vocab, 7], [0, 1, 2], f"tokens [{vocab}]"),
                                  ([5, 6, -1], [0, 1, 2], "tokens [-1]"),
                                  ([5, 6, 7], [0, 128, 2], "positions [128]")):
        with pytest.raises(IndexError, match=rf"{re.escape(named)} or|or {re.escape(named)} out of range"):
            model(torch.tensor(ids), torch.tensor(positions), caches, metadata)
    assert all(not k.any() and not v.any() for k, v in caches)
    out = model(torch.tensor([5, 6, 7]), torch.tensor([0, 1, 2]), caches, metadata)
    assert out.shape == (3, model.config.hidden_size) and caches[0][0][1].any()


@pytest.fixture(scope="module")
def compressed_dir(tiny_llama_dir, tmp_path_factory):
    return compress(tiny_llama_dir, tmp_path_factory.mktemp("w8a8"))


@needs_vector
def test_the_engine_takes_it_alone_and_tracks_transformers(compressed_dir, monkeypatch):
    """Prompts run one at a time (every decode a one-token step; [7] a one-token prefill too):
    each token within rounding of transformers' best on the dequantized weights, and the first
    token (from the prefill, the same either way) equal to the layer-by-layer path's."""
    prompts = [[1, 5, 9, 2, 7, 11, 4], [3, 3, 8], [20, 40, 60, 80, 100, 120], [7]]
    params = SamplingParams(max_tokens=8, temperature=0)
    engine = dict(dtype="bfloat16", enforce_eager=True, max_model_len=64, num_kv_blocks=64, quantization="int8")
    with LLM(str(compressed_dir), **engine) as llm:
        assert llm.engine.worker.ready.one_call_forward
        assert "steps in one call" in llm.engine.describe()
        one_call = [llm.generate([prompt], params)[0].outputs[0].token_ids for prompt in prompts]
    monkeypatch.setenv(ENV, "0")
    with LLM(str(compressed_dir), **engine) as llm:
        assert not llm.engine.worker.ready.one_call_forward
        layered = [llm.generate([prompt], params)[0].outputs[0].token_ids for prompt in prompts[:3]]
    assert [tokens[0] for tokens in one_call[:3]] == [tokens[0] for tokens in layered]
    hf = hf_dequantized(compressed_dir)
    for prompt, tokens in zip(prompts, one_call):
        ids = list(prompt)
        for token in tokens:
            with torch.no_grad():
                logprobs = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
            # NOTE: bfloat16 and int8 activations on a model 64 wide: the layer-by-layer path's
            # own tokens came within 0.3 of the best.
            assert logprobs.max() - logprobs[token] < 0.4, (prompt, ids, token)
            ids.append(token)


@needs_vector
def test_nothing_is_compiled_where_every_step_takes_the_call(tmp_path):
    """head_dim 64 with attention tiles here: no step is left to the compiled regions, so the
    worker compiles nothing (without enforce_eager) and still answers."""
    if cpu_kernels.attention_tiles() is None:
        pytest.skip("the backend takes no attention tiles here")
    model_dir = make_tiny_model_dir(tmp_path, "llama", hidden_size=128, num_attention_heads=2,
                                    num_key_value_heads=1, **TINY_INIT)
    params = SamplingParams(max_tokens=4, temperature=0)
    with LLM(str(model_dir), dtype="bfloat16", quantization="int8", max_model_len=64, num_kv_blocks=64) as llm:
        ready = llm.engine.worker.ready
        assert ready.one_call_forward and ready.compile_seconds == 0, ready
        assert len(llm.generate([[3, 3, 8]], params)[0].outputs[0].token_ids) == 4


@needs_vector
def test_not_taken_in_float32_or_with_onednn_products_but_with_batch_invariance(tiny_llama_dir, compressed_dir,
                                                                                 monkeypatch):
    small = dict(enforce_eager=True, max_model_len=64, num_kv_blocks=64)
    # NOTE: batch invariance plans every attention row for the paged kernel, which the call runs
    # as the backend would; its products take the tiles (or vectors) for every row.
    for model, options, packing, taken in ((compressed_dir, dict(dtype="float32", quantization="int8"), None, False),
                                           (tiny_llama_dir, dict(dtype="bfloat16"), "onednn", False),
                                           (compressed_dir, dict(dtype="bfloat16", quantization="int8",
                                                                 batch_invariant=True), None, True)):
        if options.get("batch_invariant") and not linear_kernels.packed_linear_available():
            continue  # batch invariance needs the blocked kernel (AVX512-BF16); elsewhere a clear error
        if packing is not None:
            if not packing_available(packing):
                continue
            monkeypatch.setenv("PAGODA_CPU_LINEAR", packing)
        with LLM(str(model), **small, **options) as llm:
            assert llm.engine.worker.ready.one_call_forward == taken, options
            assert ("steps in one call" in llm.engine.describe()) == taken
            output = llm.generate([[3, 3, 8]], SamplingParams(max_tokens=3, temperature=0))[0].outputs[0]
            assert len(output.token_ids) == 3


@torch.inference_mode()
def test_greedy_tokens_are_the_first_largest_logits_of_the_quantized_lm_head(tiny_llama_dir):
    """DecoderForCausalLM.greedy_tokens with the tied LM head in int8: each row's first largest
    of compute_logits, with no logits written; with a bfloat16 head, None (the worker then
    takes the logits and the sampler)."""
    model = tiny_model(tiny_llama_dir, "int8")
    hidden = torch.randn(9, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32
    first = (logits == logits.max(dim=1, keepdim=True).values).to(torch.uint8).argmax(dim=1)
    assert torch.equal(model.greedy_tokens(hidden), first)
    assert tiny_model(tiny_llama_dir, "bf16").greedy_tokens(hidden) is None



def random_adapter(config: ModelConfig, adapter_id: int, rank: int, seed: int) -> LoRAAdapter:
    """An adapter of random weights on every projection of every layer (as engine/lora.py reads one)."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(config.num_hidden_layers):
        for target, (out_features, in_features) in projection_shapes(config).items():
            block = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            weights[f"layers.{layer}.{block}.{target}"] = (
                torch.randn(rank, in_features, generator=generator) / in_features**0.5,
                0.3 * torch.randn(out_features, rank, generator=generator))
    return LoRAAdapter(adapter_id, f"a{adapter_id}", "", rank, weights)


@pytest.mark.parametrize("tiles", [True, False], ids=["amx-where-it-runs", "vectors"])
@pytest.mark.parametrize("weights", ["bf16", "int8"])
@torch.inference_mode()
def test_lora_rows_in_one_call_equal_the_layer_by_layer_path(tiny_llama_dir, weights, tiles, rounded_once,
                                                            monkeypatch):
    """A step of four requests, the base model's and two adapters' (ranks 8 and 4; one adapter's
    two requests one run of rows), prefill then decode: the one call's hidden states (the deltas
    by csrc/one_call_forward.c's lora_add) and the layer-by-layer path's (engine/models/lora.py)
    equal bit for bit; the adapters' rows differ from the base model's, whose rows are unchanged.
    With ``tiles`` off, the deltas' products on the vectors only, as on CPUs without AMX."""
    if not tiles:
        monkeypatch.setattr(worker_lora, "LORA_TILE_ROWS", 0)
    model = tiny_model(tiny_llama_dir, weights, lora_slots=2)
    assert model.layers[0].self_attn.qkv_proj.lora.tile_rows == (
        worker_lora.LORA_TILE_ROWS if linear_kernels.packed_linear_amx_available() else 0)
    manager = model.lora_manager
    manager.add({1: random_adapter(model.config, 1, 8, 0), 2: random_adapter(model.config, 2, 4, 1)})
    backend = model.layers[0].self_attn.backend
    caches, calls = prepared_caches(model, 16, lambda args: args[-2])  # the LoRA runs
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 4000, (n,), generator=generator).tolist() for n in (7, 19, 3, 12)]
    lora_ids = np.array([0, 1, 1, 2])
    for decode in (False, True):
        requests = [([len(p)] if decode else list(range(len(p))), [2 * i, 2 * i + 1]) for i, p in enumerate(prompts)]
        ids = torch.tensor([p[-1] if decode else t for p in prompts for t in ([None] if decode else p)])
        positions = torch.tensor([i for positions, _ in requests for i in positions])
        metadata = step(requests)
        backend.prepare(metadata)
        query_lens = np.array([len(r[0]) for r in requests])
        manager.end_step()
        before = [(k.clone(), v.clone()) for k, v in caches]
        base = model.forward(ids, positions, [(k.clone(), v.clone()) for k, v in before], metadata)
        assert manager.begin_step(lora_ids, query_lens)
        layered = model.forward(ids, positions, before, metadata)
        one_call = model(ids, positions, caches, metadata)
        assert torch.equal(one_call, layered)
        rows = np.repeat(lora_ids, query_lens)
        assert torch.equal(one_call[rows == 0], base[rows == 0])
        assert not torch.equal(one_call[rows == 1], base[rows == 1])
        assert not torch.equal(one_call[rows == 2], base[rows == 2])
    manager.end_step()
    assert calls == [2, 2]  # both steps in one call, each with its two runs of adapter rows
