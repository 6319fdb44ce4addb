"""Quantized weights: GGUF blocks read exactly (engine/models/quantized.py), the quantized
kernel (native/csrc/quant_linear.c) against dequantize-then-multiply, the
engine's --quantization, and what the formats cost in perplexity on the default model."""

import json
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.native import library as kernel_library
from pagoda.native import linear as linear_kernels
from pagoda.engine.config import EngineConfig
from pagoda.engine.model_loader import FLOATS_DIR, QUANTIZED_FILE, default_gguf_path, plan_quantization, resolve_model
from pagoda.engine.models import linear
from pagoda.engine.models import quantized as Q

needs_kernels = pytest.mark.skipif(not kernel_library.available(), reason="needs the CPU kernels (a C compiler)")
needs_vector = pytest.mark.skipif(not linear_kernels.quant_linear_vector(),
                                  reason="the engine quantizes only where the kernel has a vector path "
                                  "(AVX512-VNNI or AVX2; every CPU of this project has both)")


def random_blocks(type_name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random GGUF blocks of ``type_name`` for a [rows, cols] tensor, with finite float16
    scales (random bytes elsewhere: every quant value and bit pattern occurs)."""
    qtype = gguf.GGMLQuantizationType[type_name]
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // block_elems, block_bytes), dtype=np.uint8)
    halves = 2 if type_name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K", "Q8_1") else 1
    scales = (rng.uniform(0.001, 0.05, size=(blocks.shape[0], halves)) * rng.choice([-1, 1], (blocks.shape[0], 1)))
    start = block_bytes - 2 if type_name in ("Q6_K", "Q3_K") else 0  # their float16 d ends the block
    blocks[:, start:start + 2 * halves] = scales.astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


# The 6-bit packing (Q6_K's) runs on the kernel's AVX512-VNNI build only.
needs_q6 = pytest.mark.skipif(not linear_kernels.quant_linear_q6(), reason="6-bit weights run on AVX512-VNNI only")
PACKINGS = [pytest.param(p, marks=needs_q6) if p == "q6" else p for p in Q.QUANT_PACKINGS]


@pytest.mark.parametrize("type_name", Q.EXACT_GGUF_TYPES)
def test_gguf_blocks_are_read_as_gguf_dequantizes_them(type_name):
    rows, cols = 24, 512
    blocks = random_blocks(type_name, rows, cols, seed=len(type_name))
    expected = torch.from_numpy(np.asarray(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[type_name]),
                                           dtype=np.float32).reshape(rows, cols))
    weight = Q.from_gguf(blocks, type_name, (rows, cols))
    assert weight.values.shape == (rows, cols) and weight.scales.shape == (rows, cols // 32)
    got = weight.dequantize()
    if type_name.endswith("_K"):
        # a sub-block's scale and minimum (float16 x 6-bit integer) are rounded to float16 here
        expand = lambda t: t.repeat_interleave(32, 1)  # noqa: E731
        bound = 2**-11 * (weight.values.float().abs() * expand(weight.scales).abs() + expand(weight.mins).abs())
        assert ((got - expected).abs() <= bound * 1.01 + 1e-7).all()
        assert not torch.equal(weight.values[:, :32], weight.values[:, 32:64])  # sub-blocks not mixed up
    else:
        assert torch.equal(got, expected)
    assert weight.bits == (4 if type_name.startswith("Q4") else 8)
    assert int(weight.values.min()) >= (-128 if weight.bits == 8 else 0) and int(weight.values.max()) <= 127


@pytest.mark.parametrize("type_name,six_bit", [("Q3_K", True), ("Q6_K", False)])
def test_other_gguf_types_are_quantized_again_to_8_bits(monkeypatch, type_name, six_bit):
    # Q6_K too where the kernel does not run 6-bit weights (an AVX2 CPU, or one whose AMX tiles run).
    monkeypatch.setattr(Q, "six_bit_kernel", lambda: six_bit)
    blocks = random_blocks(type_name, 8, 256, seed=6)
    expected = torch.from_numpy(np.asarray(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[type_name]),
                                           dtype=np.float32).reshape(8, 256))
    weight = Q.from_gguf(blocks, type_name, (8, 256))
    assert weight.bits == 8 and weight.mins is None
    step = expected.abs().reshape(8, 8, 32).amax(2).repeat_interleave(32, 1) / 127
    assert ((weight.dequantize() - expected).abs() <= step * 0.5 + 1e-3 * step).all()


def test_q6_k_is_read_as_6_bit_values_with_a_scale_per_16(monkeypatch):
    monkeypatch.setattr(Q, "six_bit_kernel", lambda: True)
    rows, cols = 24, 512
    blocks = random_blocks("Q6_K", rows, cols, seed=7)
    expected = torch.from_numpy(np.asarray(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q6_K),
                                           dtype=np.float32).reshape(rows, cols))
    weight = Q.from_gguf(blocks, "Q6_K", (rows, cols))
    assert weight.packing == "q6" and weight.scales.shape == (rows, cols // 16) and weight.mins is None
    assert int(weight.values.min()) == -32 and int(weight.values.max()) == 31
    # a sub-block's scale (float16 d x an int8) is rounded to float16 here
    bound = 2**-11 * weight.values.float().abs() * weight.scales.repeat_interleave(16, 1).abs()
    assert ((weight.dequantize() - expected).abs() <= bound * 1.01 + 1e-7).all()
    assert not torch.equal(weight.scales[:, 0], weight.scales[:, 1])  # a scale per 16, not per 32


def test_int8_quantization_is_symmetric_per_group_of_32():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 96, generator=gen)
    q = Q.quantize_int8(weight)
    assert q.values.dtype == torch.int8 and q.mins is None and q.packing == "q8"
    assert (q.values.reshape(40, 3, 32).abs().amax(2) == 127).all()
    step = q.scales.repeat_interleave(32, 1)
    assert ((q.dequantize() - weight).abs() <= step * 0.51).all()
    with pytest.raises(ValueError, match="multiple of 32"):
        Q.quantize_int8(torch.randn(4, 33))


def test_mixed_types_concatenate_as_8_bit_with_minimums(monkeypatch):
    four = Q.from_gguf(random_blocks("Q4_1", 8, 64, 1), "Q4_1", (8, 64))
    eight = Q.from_gguf(random_blocks("Q8_0", 4, 64, 2), "Q8_0", (4, 64))
    both = Q.GroupQuantized.cat([four, eight])
    assert both.packing == "q8m" and both.shape == (12, 64)
    assert torch.equal(both.dequantize(), torch.cat([four.dequantize(), eight.dequantize()]))
    # A 6-bit part (Q4_K_M's v beside Q4_K's q and k) is quantized again to 8 bits per 32.
    monkeypatch.setattr(Q, "six_bit_kernel", lambda: True)
    six = Q.from_gguf(random_blocks("Q6_K", 4, 256, 3), "Q6_K", (4, 256))
    four_k = Q.from_gguf(random_blocks("Q4_K", 8, 256, 4), "Q4_K", (8, 256))
    mixed = Q.GroupQuantized.cat([four_k, six])
    assert mixed.packing == "q8m" and mixed.scales.shape == (12, 8)
    assert torch.equal(mixed.dequantize()[:8], four_k.dequantize())
    assert torch.equal(mixed.dequantize()[8:], Q.quantize_int8(six.dequantize()).dequantize())
    assert Q.GroupQuantized.cat([six, six]).packing == "q6"


@pytest.mark.parametrize("packing", [p for p in Q.QUANT_PACKINGS])
def test_packing_and_reading_by_rows_change_nothing(monkeypatch, packing):
    # Large weights are decoded and packed ROWS_AT_ONCE rows at a time (their temporaries
    # bounded): the same bytes as all at once, a partial last block included.
    weight = example_weights(97, 256, seed=2)[packing]
    whole = Q.pack(weight)
    monkeypatch.setattr(Q, "ROWS_AT_ONCE", 32)
    assert torch.equal(Q.pack(weight), whole)
    model_dir = resolve_model(None)  # the default model's blocks: 576 rows and more, read 32 at a time
    name = "layers.0.mlp.down_proj.weight"
    by_rows = Q.quantized_weights(model_dir).get(name)
    monkeypatch.setattr(Q, "ROWS_AT_ONCE", 1 << 20)
    assert torch.equal(by_rows.dequantize(), Q.quantized_weights(model_dir).get(name).dequantize())


# -- the kernel ------------------------------------------------------------------------------

def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it: int8 per group of 32 with scale max|x| / 127, dequantized."""
    m, k = x.shape
    groups = x.float().reshape(m, k // 32, 32)
    amax = groups.abs().amax(2, keepdim=True)
    q = torch.round(groups * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax)))
    return (q * amax / 127).reshape(m, k)


def example_weights(n: int, k: int, seed: int) -> dict[str, Q.GroupQuantized]:
    gen = torch.Generator().manual_seed(seed)
    scales = (torch.rand(n, k // 32, generator=gen) * 0.1).half().float()
    mins = (torch.randn(n, k // 32, generator=gen) * 0.1).half().float()
    nibbles = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int8)
    halves = (torch.randn(n, k // 16, generator=gen) * 0.05).half().float()  # signed, as Q6_K's int8 scales
    return {"q8": Q.quantize_int8(torch.randn(n, k, generator=gen)),
            "q8m": Q.GroupQuantized(torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8), scales,
                                    mins, 8),
            "q6": Q.GroupQuantized(torch.randint(-32, 32, (n, k), generator=gen, dtype=torch.int8), halves, None, 6),
            "q4": Q.GroupQuantized(nibbles, scales, None, 4),
            "q4m": Q.GroupQuantized(nibbles, scales, mins, 4)}


@needs_kernels
@pytest.mark.parametrize("packing", PACKINGS)
@pytest.mark.parametrize("out_features,in_features", [(40, 64), (16, 32), (97, 160), (576, 576)])
@pytest.mark.parametrize("rows", [0, 1, 3, 4, 6, 13])
def test_kernel_matches_dequantize_then_multiply(packing, out_features, in_features, rows):
    weight = example_weights(out_features, in_features, seed=rows + out_features)[packing]
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
    bits, has_min = Q.QUANT_PACKINGS[packing]
    out = linear_kernels.quant_linear(x, Q.pack(weight), None, out_features, bits, has_min, out_f32=True)
    assert out.shape == (rows, out_features) and out.dtype == torch.float32
    if not rows:
        return
    expected = quantize_activations(x).double() @ weight.dequantize().double().T
    scale = expected.abs().max()
    # float32 sums, and now and then one activation rounded the other way at a tie
    assert ((out.double() - expected).abs() <= 4e-3 * scale).all()
    # and the activations' quantization costs little against the exact product
    exact = x.double() @ weight.dequantize().double().T
    assert ((out.double() - exact).abs() <= 0.03 * scale).all()


@needs_kernels
def test_kernel_bias_bfloat16_output_and_float32_input():
    weight = example_weights(50, 96, seed=3)["q4m"]
    packed = Q.pack(weight)
    x = torch.randn(5, 96)
    bias = torch.randn(50)
    plain = linear_kernels.quant_linear(x.bfloat16(), packed, None, 50, 4, True, out_f32=True)
    with_bias = linear_kernels.quant_linear(x.bfloat16(), packed, bias, 50, 4, True)
    assert with_bias.dtype == torch.bfloat16
    assert torch.equal(with_bias, (plain + bias).bfloat16())
    from_f32 = linear_kernels.quant_linear(x, packed, bias, 50, 4, True)
    assert from_f32.dtype == torch.float32
    expected = quantize_activations(x).double() @ weight.dequantize().double().T + bias.double()
    assert ((from_f32.double() - expected).abs() <= 4e-3 * expected.abs().max()).all()


@needs_kernels
@needs_q6
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_6bit_sums_at_their_largest_are_exact(sign):
    # Every activation quantizes to +-127 and every weight is -32 or 31: the sums of each half
    # group start from -32 x the activations' half sums (the values are stored + 32).
    n, k = 48, 576
    values = torch.full((n, k), 31, dtype=torch.int8)
    values[::2] = -32
    weight = Q.GroupQuantized(values, torch.full((n, k // 16), 0.5).index_fill_(1, torch.arange(1, k // 16, 2),
                                                                                 -0.25), None, 6)
    x = torch.full((6, k), sign).to(torch.bfloat16)
    x[1] *= 3.0
    x[2, :16] = -x[2, :16]  # halves of a group with sums of opposite signs
    out = linear_kernels.quant_linear(x, Q.pack(weight), None, n, 6, False, out_f32=True)
    expected = quantize_activations(x).double() @ weight.dequantize().double().T
    assert torch.allclose(out.double(), expected, rtol=1e-6, atol=0)


@needs_kernels
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_4bit_sums_at_their_largest_are_exact(sign):
    # Every activation quantizes to +-127 and every weight is 15: each 16-bit lane of the AVX2
    # tile, which holds 16 of a group's products until its one widening per group, reaches
    # 16 x 15 x 127 = 30480 (of 32767).
    n, k = 48, 576
    weight = Q.GroupQuantized(torch.full((n, k), 15, dtype=torch.int8), torch.full((n, k // 32), 0.5),
                              torch.full((n, k // 32), -0.25), 4)
    x = torch.full((6, k), sign).to(torch.bfloat16)
    x[1] *= 3.0  # a different scale per row, still +-127 after quantization
    out = linear_kernels.quant_linear(x, Q.pack(weight), None, n, 4, True, out_f32=True)
    expected = quantize_activations(x).double() @ weight.dequantize().double().T
    assert torch.allclose(out.double(), expected, rtol=1e-6, atol=0)


@needs_kernels
def test_a_rows_result_does_not_depend_on_its_batch():
    weight = example_weights(3072, 576, seed=9)["q4m"]
    packed = Q.pack(weight)
    x = torch.randn(29, 576).to(torch.bfloat16)
    batched = linear_kernels.quant_linear(x, packed, None, 3072, 4, True)
    for i in (0, 5, 28):
        assert torch.equal(linear_kernels.quant_linear(x[i : i + 1], packed, None, 3072, 4, True), batched[i : i + 1])


@needs_kernels
@pytest.mark.parametrize("packing", PACKINGS)
@pytest.mark.parametrize("tokens", [1, 9])
def test_quantized_experts_at_once_equal_each_product_on_its_own(packing, tokens):
    """A mixture of experts' quantized products run together (csrc's quant_linear_many: one
    parallel region for every expert's gate/up, one for every down): each token's output is,
    bit for bit, its experts' own quant_linear products (gate/up, SiLU-mul, down in float32)
    summed in float32 in the order of its experts and rounded once."""
    hidden, intermediate, num_experts, k = 96, 64, 5, 2
    gate_up = [example_weights(2 * intermediate, hidden, seed=e)[packing] for e in range(num_experts)]
    down = [example_weights(hidden, intermediate, seed=10 + e)[packing] for e in range(num_experts)]
    bits, has_min = Q.QUANT_PACKINGS[packing]
    product = (linear_kernels.QUANTIZED_PRODUCT, bits, int(has_min))
    stacked_gate_up, stacked_down = torch.stack([Q.pack(w) for w in gate_up]), torch.stack([Q.pack(w) for w in down])
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    experts = torch.stack([torch.randperm(num_experts, generator=gen)[:k] for _ in range(tokens)])
    # NOTE: powers of two, whose products are exact (the kernel's multiply-add may be fused)
    weights = 2.0 ** -torch.randint(0, 4, (tokens, k), generator=gen).float()
    got = linear_kernels.moe_experts(x, experts, weights, stacked_gate_up, product, stacked_down, product,
                                     intermediate)
    for t in range(tokens):
        total = torch.zeros(hidden)
        for j in range(k):
            e = int(experts[t, j])
            act = linear_kernels.silu_mul(linear_kernels.quant_linear(x[t:t + 1], stacked_gate_up[e], None,
                                                                      2 * intermediate, bits, has_min))
            total += weights[t, j] * linear_kernels.quant_linear(act, stacked_down[e], None, hidden, bits, has_min,
                                                                 out_f32=True)[0]
        assert torch.equal(got[t], total.to(torch.bfloat16)), t


# -- the tile path (quant_linear.c's quant_linear_tiles: the weight dequantized to bfloat16) ---

needs_amx = pytest.mark.skipif(not linear_kernels.packed_linear_amx_available(),
                               reason="needs AMX tiles that run (Intel Xeon Sapphire Rapids or later)")


def bf16_weight(weight: Q.GroupQuantized) -> torch.Tensor:
    """The weight as the tiles see it: dequantized, rounded to bfloat16."""
    return weight.dequantize().bfloat16().double()


@needs_amx
@pytest.mark.parametrize("packing", [p for p in Q.QUANT_PACKINGS if p != "q6"])  # 6-bit: never on the tiles
@pytest.mark.parametrize("out_features,in_features", [(40, 64), (97, 160), (3072, 576), (576, 1536), (97, 800)])
@pytest.mark.parametrize("rows", [1, 16, 37, 70, 300, 1001])
def test_tiles_match_the_bfloat16_weight_times_x(packing, out_features, in_features, rows):
    # (3072, 576): several chunks a thread; 40 and 97: a last block of 16 and a last half-group
    # that are partly past the weight's end; (576, 1536): the down product's shape, 32 rows of x
    # past L1, fewer units a chunk; 800 inputs: not a multiple of 64; 37, 70, 300 and 1001 rows:
    # a last block of rows padded (70: between 48 and 128 rows, where the bfloat16 weights take
    # 16-row tiles; 1001 x 576: x past ROWS_SPLIT_X_BYTES, the threads split the rows, the last
    # one's with the padded tail)
    weight = example_weights(out_features, in_features, seed=rows + out_features)[packing]
    packed = Q.pack(weight)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    bits, has_min = Q.QUANT_PACKINGS[packing]
    sums = linear_kernels.quant_linear(x, packed, None, out_features, bits, has_min, out_f32=True, amx_min_rows=1)
    rounded = linear_kernels.quant_linear(x, packed, None, out_features, bits, has_min, amx_min_rows=1)
    expected = x.double() @ bf16_weight(weight).T
    scale = expected.abs().max()
    assert ((sums.double() - expected).abs() <= 1e-5 * scale).all()  # float32 sums of exact products
    assert torch.equal(rounded, sums.bfloat16())  # the bfloat16 output: those sums, rounded once
    vectors = linear_kernels.quant_linear(x, packed, None, out_features, bits, has_min, amx_min_rows=rows + 1)
    assert ((vectors.double() - expected).abs() <= 0.03 * scale).all()  # below the rows: the int8 vectors
    assert not torch.equal(vectors, rounded)


@needs_amx
def test_tiles_leave_float32_x_and_a_bias_to_the_vectors():
    weight = example_weights(64, 96, seed=4)["q4m"]
    packed = Q.pack(weight)
    x, bias = torch.randn(40, 96), torch.randn(64)
    for args in ((x, packed, None), (x.bfloat16(), packed, bias)):
        assert torch.equal(linear_kernels.quant_linear(*args, 64, 4, True, amx_min_rows=1),
                           linear_kernels.quant_linear(*args, 64, 4, True))


def reference_silu_mul(x: torch.Tensor, weight: torch.Tensor, intermediate: int) -> torch.Tensor:
    """SiLU(gate) * up as eager torch rounds it in bfloat16 (gate and up, SiLU, the product)."""
    gate_up = (x.double() @ weight.T).float().bfloat16()
    gate, up = gate_up[:, :intermediate], gate_up[:, intermediate:]
    return (torch.nn.functional.silu(gate.float()).bfloat16().float() * up.float()).bfloat16()


@needs_amx
@pytest.mark.parametrize("packing", ["q8", "q4m"])
@pytest.mark.parametrize("intermediate,in_features,rows",
                         [(i, 128, rows) for i in (96, 1536, 80) for rows in (13, 64, 4105)]
                         + [(1536, 576, 37), (1536, 576, 64), (1536, 576, 96)])
def test_gate_up_on_the_tiles_applies_silu_mul_in_the_epilogue(packing, intermediate, in_features, rows):
    # 80: not whole groups of 32, the plain tiles then; 4105 x 128: the threads split the rows;
    # 1536 x 576: several chunks a thread, each dequantized while the tiles' 32-row blocks pass
    # over the one before (one, two or three passes)
    weight = example_weights(2 * intermediate, in_features, seed=intermediate)[packing]
    packed = Q.pack(weight)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16) * 0.5
    bits, has_min = Q.QUANT_PACKINGS[packing]
    out = linear_kernels.quant_silu_mul_linear(x, packed, intermediate, bits, has_min, amx_min_rows=1)
    expected = reference_silu_mul(x, bf16_weight(weight), intermediate).float()
    # the same roundings; a sum on the other side of a bfloat16 tie moves an output by an ulp or two
    assert ((out.float() - expected).abs() <= 2 ** -6 * expected.abs() + 1e-3 * expected.abs().max()).all()
    # below the rows: quant_linear and silu_mul, as without the tiles
    gate_up = linear_kernels.quant_linear(x, packed, None, 2 * intermediate, bits, has_min)
    assert torch.equal(linear_kernels.quant_silu_mul_linear(x, packed, intermediate, bits, has_min,
                                                         amx_min_rows=rows + 1), linear_kernels.silu_mul(gate_up))


@needs_amx
def test_quantized_layers_take_the_tiles_from_a_measured_row_count(monkeypatch, tmp_path):
    monkeypatch.setattr(linear, "_amx_rows", {})
    monkeypatch.setattr(linear, "_calibration_file", lambda: str(tmp_path / "rows.json"))
    plain, gate_up, biased = (linear.Linear(128, 192, bias=False), linear.GateUpLinear(128, 192, bias=False),
                              linear.Linear(128, 192, bias=True))
    for layer in (plain, gate_up, biased):
        layer.quantize(example_weights(192, 128, seed=1)["q4m"])
        layer.tile_quantized()
    assert plain.amx_min_rows in linear.QUANT_CALIBRATION_ROWS
    assert gate_up.amx_min_rows in linear.QUANT_CALIBRATION_ROWS
    assert biased.amx_min_rows == 0  # the tiles have no bias: always the vectors
    assert json.loads((tmp_path / "rows.json").read_text()).keys() == {"192x128+q4m", "192x128+q4m+silu_mul"}
    x = torch.randn(200, 128).to(torch.bfloat16)
    expected = reference_silu_mul(x, bf16_weight(example_weights(192, 128, seed=1)["q4m"]), 96).float()
    assert ((gate_up(x).float() - expected).abs() <= 2 ** -6 * expected.abs() + 1e-3 * expected.abs().max()).all()
    monkeypatch.setenv(linear.QUANT_TILES_ENV, "0")  # the override: never (or from the rows it gives)
    gate_up.tile_quantized()
    assert gate_up.amx_min_rows == 0
    gate, up = linear_kernels.quant_linear(x, gate_up.weight, None, 192, 4, True).split(96, dim=-1)
    assert torch.equal(gate_up(x), torch.nn.functional.silu(gate) * up)  # as on CPUs without the tiles


def first_largest(out: torch.Tensor) -> torch.Tensor:
    """Each row's first index of its largest value."""
    return (out == out.max(dim=1, keepdim=True).values).to(torch.uint8).argmax(dim=1)


@needs_kernels
@pytest.mark.parametrize("packing", PACKINGS)
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_greedy_argmax_is_the_first_largest_of_the_kernels_float32_sums(packing, rows):
    """quant_linear_argmax (greedy sampling's LM head, no logits written): the index of each
    row's largest float32 sum that quant_linear gives, the first where several are equal: here
    three equal largest outputs, in both threads' ranges of features, for every row; widths
    that are not whole chunks of 64 features or even of 16; bfloat16 and float32 inputs, a bias;
    NaN outputs picked first, as torch's max picks them."""
    n, k = 1000, 64
    weight = example_weights(n, k, seed=rows)[packing]
    bits, has_min = Q.QUANT_PACKINGS[packing]
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(1, k, generator=gen).expand(rows, k)  # every row the same input: the same ties
    top = int(linear_kernels.quant_linear(x.bfloat16(), Q.pack(weight), None, n, bits, has_min, out_f32=True)[0].argmax())
    for col in (811, 301, 900):  # the largest output's feature again, 4 times larger (exactly: a power of 2)
        weight.values[col], weight.scales[col] = weight.values[top], weight.scales[top] * 4
        if weight.mins is not None:
            weight.mins[col] = weight.mins[top] * 4
    packed = Q.pack(weight)
    out = linear_kernels.quant_linear(x.bfloat16(), packed, None, n, bits, has_min, out_f32=True)
    assert (out[:, 301] == out[:, 811]).all() and (out[:, 301] == out[:, 900]).all()
    assert (out[:, 301] == out.max(dim=1).values).all()
    threads = torch.get_num_threads()
    try:
        for count in {1, threads}:  # one range, and the threads' ranges merged (301 in the first)
            torch.set_num_threads(count)
            got = linear_kernels.quant_linear_argmax(x.bfloat16(), packed, None, n, bits, has_min)
            assert got.tolist() == [301] * rows, count
    finally:
        torch.set_num_threads(threads)
    for nans in ((900,), (700, 900, 20)):  # a NaN output beats every number, the first NaN all others
        broken = Q.GroupQuantized(weight.values, weight.scales.clone(), weight.mins, weight.bits)
        broken.scales[list(nans)] = float("nan")
        out = linear_kernels.quant_linear(x.bfloat16(), Q.pack(broken), None, n, bits, has_min, out_f32=True)
        got = linear_kernels.quant_linear_argmax(x.bfloat16(), Q.pack(broken), None, n, bits, has_min)
        assert got.tolist() == [min(nans)] * rows == out.max(dim=1).indices.tolist()
    x = torch.randn(rows, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    for inputs in (x, x.bfloat16()):
        for width in (n, 17, 40):
            sub = Q.pack(Q.GroupQuantized(weight.values[:width], weight.scales[:width],
                                          None if weight.mins is None else weight.mins[:width], weight.bits))
            out = linear_kernels.quant_linear(inputs, sub, bias[:width], width, bits, has_min, out_f32=True)
            got = linear_kernels.quant_linear_argmax(inputs, sub, bias[:width], width, bits, has_min)
            assert torch.equal(got, first_largest(out)), (width, inputs.dtype)


@needs_amx
@pytest.mark.parametrize("packing", ["q8", "q4m"])
@pytest.mark.parametrize("out_features,in_features", [(1000, 64), (3000, 576)])
@pytest.mark.parametrize("rows", [16, 37])
def test_greedy_argmax_on_the_tiles_picks_from_the_tiles_sums(packing, out_features, in_features, rows):
    """From amx_min_rows rows, where quant_linear's sums come from the tiles, quant_linear_argmax
    picks from those sums (the first of equal largest ones, the first NaN), one range of
    features or the threads' merged, in one chunk a thread (1000 x 64) or several (3000 x 576,
    3000 not whole chunks); below the row count, from the vectors' sums as before."""
    n, k = out_features, in_features
    weight = example_weights(n, k, seed=rows + n)[packing]
    bits, has_min = Q.QUANT_PACKINGS[packing]
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(1, k, generator=gen).expand(rows, k).bfloat16()
    top = int(linear_kernels.quant_linear(x, Q.pack(weight), None, n, bits, has_min, out_f32=True,
                                       amx_min_rows=1)[0].argmax())
    for col in (n - 1, n // 3, n // 2):  # the largest output's feature again, 4 times larger
        weight.values[col], weight.scales[col] = weight.values[top], weight.scales[top] * 4
        if weight.mins is not None:
            weight.mins[col] = weight.mins[top] * 4
    packed = Q.pack(weight)
    out = linear_kernels.quant_linear(x, packed, None, n, bits, has_min, out_f32=True, amx_min_rows=1)
    assert (out[:, n // 3] == out[:, n - 1]).all() and (out[:, n // 3] == out.max(dim=1).values).all()
    threads = torch.get_num_threads()
    try:
        for count in {1, threads}:
            torch.set_num_threads(count)
            got = linear_kernels.quant_linear_argmax(x, packed, None, n, bits, has_min, amx_min_rows=1)
            assert got.tolist() == [n // 3] * rows, count
    finally:
        torch.set_num_threads(threads)
    broken = Q.GroupQuantized(weight.values, weight.scales.clone(), weight.mins, weight.bits)
    broken.scales[[n - 2, 5]] = float("nan")
    got = linear_kernels.quant_linear_argmax(x, Q.pack(broken), None, n, bits, has_min, amx_min_rows=1)
    assert got.tolist() == [5] * rows
    x = torch.randn(rows, k, generator=gen).bfloat16()
    tiles = linear_kernels.quant_linear(x, packed, None, n, bits, has_min, out_f32=True, amx_min_rows=rows)
    vectors = linear_kernels.quant_linear(x, packed, None, n, bits, has_min, out_f32=True)
    assert not torch.equal(tiles, vectors)
    assert torch.equal(linear_kernels.quant_linear_argmax(x, packed, None, n, bits, has_min, amx_min_rows=rows),
                       first_largest(tiles))
    assert torch.equal(linear_kernels.quant_linear_argmax(x, packed, None, n, bits, has_min, amx_min_rows=rows + 1),
                       first_largest(vectors))


@needs_kernels
def quant_kernel_for(march: str, directory: Path):
    """csrc/quant_linear.c alone, built for ``march`` (a few seconds, where the whole library
    takes a minute), with the flags the library is built with."""
    import ctypes

    target = directory / f"quant_linear-{march}.so"
    flags = [flag for flag in kernel_library._flags() if not flag.startswith("-march=")]
    subprocess.run([kernel_library._compiler(), f"-march={march}", *flags, "-o", str(target),
                    str(kernel_library._CSRC / "quant_linear.c"), "-lm"], check=True, capture_output=True, timeout=120)
    lib = ctypes.CDLL(str(target))
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.quant_linear.argtypes = [p, i64, i64, i32, i64, p, i32, i32, i64, p, p, i64, i32, i64]
    lib.quant_linear_argmax.argtypes = [p, i64, i64, i32, i64, p, i32, i32, i64, p, p, i64]
    for name in ("quant_linear_vnni", "quant_linear_vector", "quant_linear_q6"):
        getattr(lib, name).restype = i32
    return lib


@needs_kernels
@pytest.mark.parametrize("march, vector", [("x86-64-v3", True), ("x86-64-v2", False)])
def test_avx2_and_portable_paths_give_the_vnni_paths_results(tmp_path, march, vector):
    """The kernel built for an AVX2 CPU (x86-64-v3: no AVX512-VNNI) runs its AVX2 path, and for
    an older one (x86-64-v2) the plain C loop: the same integer sums, so the same results up to
    float32 rounding, for every packing, with a bias, one row and several (tiles of 4 and a tail);
    and the greedy argmax there picks from those sums."""
    weights = example_weights(37, 128, seed=5)
    lib = quant_kernel_for(march, tmp_path)
    assert lib.quant_linear_vnni() == 0 and lib.quant_linear_vector() == int(vector)
    # 6-bit weights run on AVX512-VNNI only: refused here (the engine then reads Q6_K as 8-bit)
    assert lib.quant_linear_q6() == 0
    x, out = torch.randn(1, 128).to(torch.bfloat16), torch.empty(1, 37)
    assert lib.quant_linear(x.data_ptr(), 1, 128, 0, 128, Q.pack(weights.pop("q6")).data_ptr(), 6, 0, 37, None,
                            out.data_ptr(), 37, 1, 0) == -2
    bias = torch.randn(37)
    for rows in (1, 7):
        x = torch.randn(rows, 128).to(torch.bfloat16)
        for name, weight in weights.items():
            packed = Q.pack(weight)
            bits, has_min = Q.QUANT_PACKINGS[name]
            for out_f32 in (True, False):
                out = torch.empty(rows, 37, dtype=torch.float32 if out_f32 else torch.bfloat16)
                assert lib.quant_linear(x.data_ptr(), rows, 128, 0, 128, packed.data_ptr(), bits, int(has_min), 37,
                                        bias.data_ptr(), out.data_ptr(), 37, int(out_f32), 0) == 0
                native = linear_kernels.quant_linear(x, packed, bias, 37, bits, has_min, out_f32=out_f32)
                scale = native.float().abs().max().item()
                tolerance = 1e-4 * scale if out_f32 else 1e-2 * scale  # bfloat16 outputs: a rounding apart at most
                assert torch.allclose(out.float(), native.float(), rtol=1e-5, atol=tolerance), (name, rows, out_f32)
                if out_f32:  # greedy's LM head on that path: the first largest of its own sums
                    ids = torch.empty(rows, dtype=torch.int64)
                    assert lib.quant_linear_argmax(x.data_ptr(), rows, 128, 0, 128, packed.data_ptr(), bits,
                                                   int(has_min), 37, bias.data_ptr(), ids.data_ptr(), 0) == 0
                    assert torch.equal(ids, first_largest(out)), (name, rows)


def test_without_a_vector_quantized_kernel_gguf_is_dequantized_and_int8_refused(monkeypatch):
    """Where only the plain C loop runs (neither AVX512-VNNI nor AVX2), the engine does not
    choose it: a GGUF file is dequantized, int8 an error that says why."""
    monkeypatch.setattr(linear_kernels, "quant_linear_vector", lambda: False)
    monkeypatch.setattr(linear_kernels, "packed_linear_amx_available", lambda: False)
    assert plan_quantization("auto", resolve_model(None), torch.device("cpu")) is None
    with pytest.raises(ValueError, match="neither AVX512-VNNI nor AVX2"):
        plan_quantization("int8", resolve_model(None), torch.device("cpu"))


# -- the engine ------------------------------------------------------------------------------

def test_converted_gguf_keeps_the_blocks_of_its_quantized_tensors():
    """The default model's file: Q4_1 layers and a Q8_0 embedding, read from
    gguf/blocks.safetensors, equal the float weights gguf dequantizes them to (load_weights);
    the converter wrote no floats of them."""
    from safetensors import safe_open

    from pagoda.engine.model_loader import load_weights

    model_dir = resolve_model(None)
    checkpoint = Q.quantized_weights(model_dir)
    assert checkpoint is not None and checkpoint.type_counts() == {"Q4_1": 210, "Q8_0": 1}
    names = ("layers.0.self_attn.q_proj.weight", "layers.3.self_attn.k_proj.weight",
             "layers.7.mlp.down_proj.weight", "embed_tokens.weight")
    floats = dict(load_weights(model_dir, skip=lambda name: name.removeprefix("model.") not in names))
    assert len(floats) == len(names)
    for name in names:
        assert torch.equal(checkpoint.get(name).dequantize(), floats["model." + name]), name
    assert checkpoint.get("norm.weight") is None  # kept in floats
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as stored:
        assert all(name.endswith("norm.weight") for name in stored.keys())
    assert (model_dir / QUANTIZED_FILE).is_file() and default_gguf_path().is_file()


def test_auto_dtype_is_bfloat16_where_the_quantized_kernel_runs_the_weights(tiny_llama_dir):
    from pagoda.engine.model_loader import resolve_model_dtype
    from pagoda.engine.platform import cpu_has_fast_bf16

    cpu = torch.device("cpu")
    dense = torch.bfloat16 if cpu_has_fast_bf16() else torch.float32  # float32 on AVX2-only CPUs
    assert resolve_model_dtype("auto", "auto", tiny_llama_dir, cpu) == dense
    assert resolve_model_dtype("auto", "none", resolve_model(None), cpu) == dense
    # NOTE: on AVX2-only CPUs too: the kernel takes bf16 activations, the one-call forward step is bf16 only
    quantized = plan_quantization("auto", resolve_model(None), cpu) is not None
    assert resolve_model_dtype("auto", "auto", resolve_model(None), cpu) == (torch.bfloat16 if quantized else dense)
    if linear_kernels.quant_linear_vector():
        assert resolve_model_dtype("auto", "int8", tiny_llama_dir, cpu) == torch.bfloat16
    assert resolve_model_dtype("float32", "auto", resolve_model(None), cpu) == torch.float32  # asked for, kept


def test_quantization_choice_and_its_errors(tiny_llama_dir, tmp_path):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert plan_quantization("auto", tiny_llama_dir, cpu) is None  # a float checkpoint stays in floats
    assert plan_quantization("none", resolve_model(None), cpu) is None
    if linear_kernels.quant_linear_vector():
        assert plan_quantization("int8", tiny_llama_dir, cpu) == "int8"
    # the portable loop is there for correctness, not chosen for speed; AMX machines quantize
    # too (their products of many rows run on the tiles)
    auto_quantizes = linear_kernels.quant_linear_vector()
    assert plan_quantization("auto", resolve_model(None), cpu) == ("gguf" if auto_quantizes else None)
    assert plan_quantization("auto", resolve_model(None), cuda) is None  # dequantized on CUDA
    with pytest.raises(ValueError, match="int8 cannot run here: the quantized kernel runs on the CPU, this is cuda"):
        plan_quantization("int8", tiny_llama_dir, cuda)
    assert plan_quantization("auto", resolve_model(None), cpu, tensor_parallel_size=2) is None
    with pytest.raises(ValueError, match="int8 cannot run here: it does not run under tensor parallelism"):
        plan_quantization("int8", tiny_llama_dir, cpu, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="quantization must be one of auto, none, int8"):
        EngineConfig(quantization="fp4")
    gptq = tmp_path / "gptq"
    gptq.mkdir()
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (gptq / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantized with 'gptq', which Pagoda does not read"):
        plan_quantization("auto", gptq, cpu)


@pytest.mark.slow
@needs_vector
def test_int8_engine_runs_a_float_checkpoint(tiny_llama_dir):
    """--quantization int8 on a tiny model: every linear layer and the tied LM head in 8
    bits, and its greedy tokens track the float model's logits (the first token equal)."""
    prompts = [[1, 5, 9, 2, 7], [3, 3, 8]]
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=1)
    with LLM(str(tiny_llama_dir), dtype="float32", enforce_eager=True, quantization="int8") as llm:
        assert "int8" in llm.engine.describe() and "q8" in llm.engine.describe()
        quantized = llm.generate(prompts, params)
    with LLM(str(tiny_llama_dir), dtype="float32", enforce_eager=True, quantization="none") as llm:
        assert "q8" not in llm.engine.describe()
        floats = llm.generate(prompts, params)
    for q, f in zip(quantized, floats):
        assert q.outputs[0].token_ids[0] == f.outputs[0].token_ids[0]


@needs_vector
def test_greedy_tokens_without_logits_are_the_samplers(tiny_llama_dir, monkeypatch):
    """The worker lets the int8 LM head pick plain greedy tokens without writing logits
    (quant_linear_argmax); asking for logprobs takes the logits and the sampler instead: the
    same tokens both ways, a batch of prompts and one alone."""
    # NOTE: on AMX, products of many rows run on the tiles, whose sums round otherwise than the
    # vectors': the second run's prompts, mostly from the prefix cache, and the one alone would
    # take the vectors, and this random model's near-ties flip. The vectors for every row here.
    monkeypatch.setenv(linear.QUANT_TILES_ENV, "0")
    prompts = [[1, 5, 9, 2, 7], [3, 3, 8], [4] * 30, [9, 1]]
    with LLM(str(tiny_llama_dir), dtype="bfloat16", enforce_eager=True, quantization="int8") as llm:
        fused = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        sampled = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1))
        alone = llm.generate(prompts[:1], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert [f.outputs[0].token_ids for f in fused] == [s.outputs[0].token_ids for s in sampled]
    assert alone[0].outputs[0].token_ids == fused[0].outputs[0].token_ids


def requantized_default_model(type_name: str, directory: Path) -> Path:
    """The default model with its quantized tensors quantized again to ``type_name`` by gguf
    (from the file's Q4_1 values, dequantized), as Pagoda would convert that type's GGUF file:
    the blocks, and the float tensors beside them."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from pagoda.engine.model_loader import load_weights

    source = resolve_model(None)
    directory.mkdir()
    for file in source.iterdir():
        if file.name not in (Path(QUANTIZED_FILE).parts[0], "model.safetensors", FLOATS_DIR):
            (directory / file.name).symlink_to(file)
    qtype = gguf.GGMLQuantizationType[type_name]
    types, blocks = {}, {}
    weights = dict(load_weights(source))
    with safe_open(str(source / QUANTIZED_FILE), framework="pt") as stored:
        for name, (_, rows, cols) in json.loads(stored.metadata()["gguf_types"]).items():
            quantized = gguf.quants.quantize(weights.pop(name).float().numpy(), qtype)
            blocks[name] = torch.from_numpy(quantized.reshape(rows, -1))
            types[name] = [type_name, rows, cols]
    (directory / QUANTIZED_FILE).parent.mkdir()
    save_file(blocks, str(directory / QUANTIZED_FILE), metadata={"gguf_types": json.dumps(types)})
    save_file(weights, str(directory / "model.safetensors"))
    return directory


PROMPT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.mark.slow
@needs_vector
def test_quantized_formats_cost_the_default_model_little_perplexity(tmp_path):
    """SmolLM2-135M: its Q4_1 file through the quantized kernel, the same weights as a Q8_0
    file, and int8 from the floats, within 2% of the dequantized bfloat16 model's perplexity; a Q5_0 file through the kernel within 1% of its own dequantized
    floats; each answers the README's question as bfloat16 does (docs/quantization.md gives
    the figures)."""
    from test_kv_cache_dtype import TEXT, perplexity

    q8_0, q5_0 = (requantized_default_model(name, tmp_path / name) for name in ("Q8_0", "Q5_0"))
    runs = {"bf16": (None, "none"), "Q4_1": (None, "auto"), "int8": (None, "int8"), "Q8_0": (q8_0, "auto"),
            "Q5_0": (q5_0, "auto"), "Q5_0 dequantized": (q5_0, "none")}
    results, answers = {}, {}
    for name, (model, quantization) in runs.items():
        with LLM(model=model, dtype="bfloat16", enforce_eager=True, max_model_len=512,
                 quantization=quantization) as llm:
            results[name] = perplexity(llm)
            prompt = llm.tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
            answers[name] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10))[0].outputs[0].text
            assert ("GGUF types" in llm.engine.describe()) == (quantization == "auto"), llm.engine.describe()
    print(results, answers)  # pytest -s shows the figures
    assert results["bf16"] < 60, results
    # NOTE: 2%: on this short text rounding alone moves a format's perplexity by up to 1.4%
    # between CPUs (docs/quantization.md: Q8_0 -0.68% on AVX512-VNNI, +0.66% on AVX2); a
    # broken format is off by far more
    for name, bound in {"Q8_0": 1.02, "int8": 1.02, "Q4_1": 1.02}.items():
        assert results[name] < results["bf16"] * bound, (name, results)
    assert results["Q5_0"] < results["Q5_0 dequantized"] * 1.01, results
    assert all(answer == answers["bf16"] for answer in answers.values()), answers


@needs_vector
def test_a_q4_k_file_runs_its_4_bit_weights(tmp_path):
    # A Q4_K file (benchmarks/gguf_writer.py's quantizer, its blocks checked against gguf's
    # dequantizer) of a Llama with rows of 256: its matrices, the tied head among them, run as
    # 4-bit with minimums, within the activations' rounding of the same file dequantized to floats.
    from pagoda.benchmarks.gguf_writer import quantize_q4_k
    from helpers import GGUF_TEST_VOCAB_SIZE, gguf_runs_agree, make_tiny_model_dir, write_gguf

    weight = np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32)
    decoded = gguf.quants.dequantize(quantize_q4_k(weight), gguf.GGMLQuantizationType.Q4_K).reshape(8, 512)
    step = (weight.reshape(8, 16, 32).max(2) - np.minimum(weight.reshape(8, 16, 32).min(2), 0)) / 15
    assert (np.abs(decoded - weight) <= 0.75 * np.repeat(step, 32, axis=1) + 1e-6).all()
    model_dir = make_tiny_model_dir(tmp_path / "hf", "llama", seed=4, vocab_size=GGUF_TEST_VOCAB_SIZE,
                                    hidden_size=256, intermediate_size=512)
    path = write_gguf(model_dir, tmp_path / "llama.Q4_K.gguf", "q4_k")
    described, _ = gguf_runs_agree(path, "bfloat16")
    # 2 x (qkv, o, gate/up, down) and the tied head, every step in one C call
    assert "GGUF types: 9 layers q4m;" in described and "steps in one call" in described, described


@needs_vector
def test_a_q6_k_file_runs_its_6_bit_weights(tmp_path):
    # A Q6_K file (benchmarks/gguf_writer.py's quantizer) of a Llama with rows of 256: its matrices,
    # the tied head among them, run as 6-bit where the kernel runs them (as 8-bit elsewhere); the
    # prompt's logprobs stay within the activations' rounding of the same file dequantized to floats.
    from helpers import GGUF_TEST_VOCAB_SIZE, gguf_runs_agree, make_tiny_model_dir, write_gguf

    model_dir = make_tiny_model_dir(tmp_path / "hf", "llama", seed=4, vocab_size=GGUF_TEST_VOCAB_SIZE,
                                    hidden_size=256, intermediate_size=512)
    path = write_gguf(model_dir, tmp_path / "llama.Q6_K.gguf", "q6_k")
    described, _ = gguf_runs_agree(path, "bfloat16")
    packing = "q6" if Q.six_bit_kernel() else "q8"
    # 2 x (qkv, o, gate/up, down) and the tied head, every step in one C call
    assert f"GGUF types: 9 layers {packing};" in described and "steps in one call" in described, described
