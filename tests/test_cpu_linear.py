"""The bfloat16 linear layer's CPU kernel (native/csrc/packed_linear.c) and the
choice of weight packing (engine/models/linear.py)."""

import pytest
import torch
import torch.nn.functional as F

from pagoda.native import library as kernel_library
from pagoda.native import linear as linear_kernels
from pagoda import LLM, SamplingParams
from pagoda.engine.models import linear
from pagoda.engine.models.linear import PACKING_ENV, GateUpLinear, Linear, choose_packing

needs_kernel = pytest.mark.skipif(not linear_kernels.packed_linear_available(),
                                  reason="needs the CPU kernels and a CPU with AVX512-BF16")
# NOTE: the AMX path runs where a tile product ran (Intel Xeon from Sapphire Rapids); on
# AMD Zen these tests skip and the AVX512 path's tests above cover the kernel.
needs_amx = pytest.mark.skipif(not linear_kernels.packed_linear_amx_available(),
                               reason="needs a CPU whose AMX tiles run")


def reference(x, weight, bias):
    """float32 product of the bfloat16 inputs, and a bound on each output's rounding: half a
    bfloat16 step of the result plus float32 sums over K."""
    out = x.float() @ weight.float().T + (0 if bias is None else bias.float())
    magnitude = x.float().abs() @ weight.float().abs().T
    return out, out.abs() * 2.0**-8 + magnitude * x.shape[1] * 2.0**-23 + 1e-30


@needs_kernel
@pytest.mark.parametrize("out_features,in_features", [(192, 64), (100, 50), (33, 17), (16, 3), (1, 1), (960, 576)])
@pytest.mark.parametrize("rows", [0, 1, 5, 6, 7, 13, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_float32_within_rounding(out_features, in_features, rows, with_bias):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=gen).to(torch.bfloat16) if with_bias else None
    out = linear_kernels.packed_linear(x, linear_kernels.pack_linear_weight(weight), bias, out_features)
    expected, bound = reference(x, weight, bias)
    assert out.shape == (rows, out_features) and out.dtype == torch.bfloat16
    assert ((out.float() - expected).abs() <= bound).all()


@needs_kernel
def test_packed_linear_reads_strided_rows():
    weight = torch.randn(96, 40).to(torch.bfloat16)
    wide = torch.randn(9, 70).to(torch.bfloat16)
    x = wide[:, 10:50]  # rows 70 apart
    packed = linear_kernels.pack_linear_weight(weight)
    assert torch.equal(linear_kernels.packed_linear(x, packed, None, 96),
                       linear_kernels.packed_linear(x.contiguous(), packed, None, 96))


@needs_kernel
def test_a_rows_result_does_not_depend_on_its_batch():
    # Every output is one sequential sum over K, whatever the batch size or thread split.
    weight = torch.randn(3072, 576).to(torch.bfloat16)
    x = torch.randn(29, 576).to(torch.bfloat16)
    packed = linear_kernels.pack_linear_weight(weight)
    batched = linear_kernels.packed_linear(x, packed, None, 3072)
    for i in (0, 5, 6, 28):
        assert torch.equal(linear_kernels.packed_linear(x[i : i + 1], packed, None, 3072), batched[i : i + 1])


@needs_kernel
def test_linear_module_packed_for_the_kernel_matches_the_unpacked_one():
    layer = Linear(200, 136, bias=True).to(torch.bfloat16)
    x = torch.randn(11, 200).to(torch.bfloat16)
    with torch.no_grad():
        expected = layer(x)
        layer.pack("blocked")
        out = layer(x)
    assert layer.weight.shape == (3, 100, 64, 2)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2**-7, atol=1e-2)


def test_packing_choice_and_its_override(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv(PACKING_ENV, raising=False)
    assert choose_packing(cpu, torch.float32) is None
    assert choose_packing(torch.device("cuda"), torch.bfloat16) is None
    automatic = choose_packing(cpu, torch.bfloat16)
    assert automatic in ("amx", "blocked", "onednn", None)
    if linear_kernels.packed_linear_available() and " amx_bf16" not in kernel_library.cpu_flags():
        assert automatic == "blocked"
    monkeypatch.setenv(PACKING_ENV, "none")
    assert choose_packing(cpu, torch.bfloat16) is None
    monkeypatch.setenv(PACKING_ENV, "fastest")
    with pytest.raises(ValueError, match="amx, blocked, onednn or none"):
        choose_packing(cpu, torch.bfloat16)
    monkeypatch.setenv(PACKING_ENV, "amx")
    if linear_kernels.packed_linear_amx_available():
        assert choose_packing(cpu, torch.bfloat16) == "amx"
    else:
        with pytest.raises(ValueError, match="not available"):
            choose_packing(cpu, torch.bfloat16)


def test_the_tiles_are_chosen_where_they_run_and_never_for_batch_invariance(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv(PACKING_ENV, raising=False)
    if linear_kernels.packed_linear_amx_available():
        assert choose_packing(cpu, torch.bfloat16) == "amx"
    if linear_kernels.packed_linear_available():
        invariant = "amx" if linear_kernels.packed_linear_amx_available() else "blocked"
        assert choose_packing(cpu, torch.bfloat16, batch_invariant=True) == invariant
        monkeypatch.setenv(PACKING_ENV, "onednn")  # not invariant: not taken
        assert choose_packing(cpu, torch.bfloat16, batch_invariant=True) == invariant
        monkeypatch.setenv(PACKING_ENV, "blocked")
        assert choose_packing(cpu, torch.bfloat16, batch_invariant=True) == "blocked"


@needs_kernel
def test_bfloat16_generation_with_the_kernel_matches_unpacked_weights(tiny_qwen2_dir, monkeypatch):
    # NOTE: qwen2 has q/k/v biases; the tiny models' logits are peaked (see conftest), so
    # greedy tokens are not decided by rounding differences between the two products. Decode
    # steps layer by layer for every packing: in one call (the kernel's packings) RoPE rounds
    # once, as compiled code does, where eager bfloat16 rounds each op, and on this model that
    # alone moves tokens (tests/test_one_call_forward.py checks the one call bit for bit).
    monkeypatch.setenv("PAGODA_ONE_CALL_FORWARD", "0")
    prompts = [[3, 17, 99, 5, 42, 8], [7, 7, 300, 12]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    results = {}
    packings = ["blocked", "none"] + (["amx"] if linear_kernels.packed_linear_amx_available() else [])
    for packing in packings:
        monkeypatch.setenv(PACKING_ENV, packing)
        with LLM(str(tiny_qwen2_dir), dtype="bfloat16", max_model_len=64, num_kv_blocks=32,
                 enforce_eager=True) as llm:
            results[packing] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert all(results[packing] == results["none"] for packing in packings)


@needs_kernel
@pytest.mark.parametrize("intermediate,in_features", [(1536, 576), (64, 64), (40, 17), (17, 50), (1, 3)])
@pytest.mark.parametrize("rows", [0, 1, 5, 6, 7, 13])
def test_fused_silu_mul_matches_the_product_then_torch_silu_mul(intermediate, in_features, rows):
    gen = torch.Generator().manual_seed(rows * 1000 + intermediate + in_features)
    weight = torch.randn(2 * intermediate, in_features, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
    out = linear_kernels.packed_silu_mul_linear(x, linear_kernels.pack_silu_mul_weight(weight), intermediate)
    # The same products by the plain kernel (the same sums over K, rounded the same), then
    # torch's bfloat16 SiLU and product: only exp's last float32 bit may differ.
    gate, up = linear_kernels.packed_linear(x, linear_kernels.pack_linear_weight(weight), None,
                                         2 * intermediate).split(intermediate, dim=-1)
    expected = (F.silu(gate) * up).float()
    assert out.shape == (rows, intermediate) and out.dtype == torch.bfloat16
    assert ((out.float() - expected).abs() <= expected.abs() * 2.0**-7).all()
    if rows:
        assert (out.float() == expected).float().mean() > 0.99


@needs_kernel
def test_fused_silu_mul_keeps_nan_and_saturates():
    weight = torch.eye(64).repeat(2, 1).to(torch.bfloat16)  # gate = up = x
    x = torch.zeros(2, 64)
    x[0, 0] = float("nan")  # poisons every sum of its row
    x[1, :4] = torch.tensor([200.0, -200.0, 0.0, 1.0])
    out = linear_kernels.packed_silu_mul_linear(x.to(torch.bfloat16), linear_kernels.pack_silu_mul_weight(weight),
                                             64).float()
    assert out[0].isnan().all()
    assert out[1, 0] == torch.tensor(200.0 * 200.0).to(torch.bfloat16).float()  # SiLU(200) = 200
    assert out[1, 1] == 0.0 and out[1, 2] == 0.0  # exp(200) overflows to inf: SiLU(-200) = -0
    assert out[1, 3] == F.silu(torch.tensor(1.0)).to(torch.bfloat16).float()


@needs_kernel
def test_gate_up_module_packed_for_the_kernel_matches_the_unpacked_one():
    layer = GateUpLinear(200, 2 * 72, bias=False).to(torch.bfloat16)
    x = torch.randn(11, 200).to(torch.bfloat16)
    with torch.no_grad():
        expected = layer(x)
        layer.pack("blocked")
        out = layer(x)
    assert out.shape == (11, 72)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2**-6, atol=2e-2)


# -- the AMX path (csrc/packed_linear.c: the tiles from amx_min_rows rows) ------------------


@needs_amx
@pytest.mark.parametrize("out_features,in_features", [(192, 64), (100, 96), (33, 32), (3072, 576), (576, 1536)])
@pytest.mark.parametrize("rows", [1, 15, 16, 17, 31, 32, 33, 64, 100, 150])
@pytest.mark.parametrize("with_bias", [False, True])
def test_amx_path_matches_float32_within_rounding(out_features, in_features, rows, with_bias):
    # Rows across the 16-row tiles and the 32-row blocks (a partial last block from padded
    # rows), features across half-groups and the N tail.
    gen = torch.Generator().manual_seed(rows * 1000 + out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=gen).to(torch.bfloat16) if with_bias else None
    out = linear_kernels.packed_linear(x, linear_kernels.pack_linear_weight(weight), bias, out_features, amx_min_rows=1)
    expected, bound = reference(x, weight, bias)
    assert out.shape == (rows, out_features)
    assert ((out.float() - expected).abs() <= bound).all()


@needs_amx
@pytest.mark.parametrize("in_features", [64, 50])
def test_amx_path_reads_strided_rows_and_leaves_other_k_to_the_vectors(in_features):
    # K = 50 is no multiple of 32: the call runs on the vectors, bit-identical to amx off.
    weight = torch.randn(96, in_features).to(torch.bfloat16)
    wide = torch.randn(40, 130).to(torch.bfloat16)
    x = wide[:, 10 : 10 + in_features]
    packed = linear_kernels.pack_linear_weight(weight)
    tiles = linear_kernels.packed_linear(x, packed, None, 96, amx_min_rows=1)
    assert torch.equal(tiles, linear_kernels.packed_linear(x.contiguous(), packed, None, 96, amx_min_rows=1))
    vectors = linear_kernels.packed_linear(x, packed, None, 96)
    if in_features % 32:
        assert torch.equal(tiles, vectors)
    torch.testing.assert_close(tiles.float(), vectors.float(), rtol=2**-7, atol=1e-2)


@needs_amx
@pytest.mark.parametrize("intermediate,in_features", [(1536, 576), (40, 64), (64, 32)])
@pytest.mark.parametrize("rows", [1, 16, 33, 70, 140])
def test_amx_fused_silu_mul_matches_the_amx_product_then_torch_silu_mul(intermediate, in_features, rows):
    gen = torch.Generator().manual_seed(rows * 1000 + intermediate + in_features)
    weight = torch.randn(2 * intermediate, in_features, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
    out = linear_kernels.packed_silu_mul_linear(x, linear_kernels.pack_silu_mul_weight(weight), intermediate,
                                             amx_min_rows=1)
    gate, up = linear_kernels.packed_linear(x, linear_kernels.pack_linear_weight(weight), None, 2 * intermediate,
                                         amx_min_rows=1).split(intermediate, dim=-1)
    expected = (F.silu(gate) * up).float()
    assert ((out.float() - expected).abs() <= expected.abs() * 2.0**-7).all()
    assert (out.float() == expected).float().mean() > 0.99


@needs_amx
def test_on_the_tiles_a_rows_result_does_not_depend_on_its_batch():
    # With the tiles for every row (batch_invariant), each output is the same chain of tile
    # products over K in 16-row tiles or 32-row blocks, whatever rows share them.
    weight = torch.randn(3072, 576).to(torch.bfloat16)
    x = torch.randn(140, 576).to(torch.bfloat16)  # 32-row blocks (2 x 2 tiles) at this size
    packed = linear_kernels.pack_linear_weight(weight)
    fused = linear_kernels.pack_silu_mul_weight(weight)
    batched = linear_kernels.packed_linear(x, packed, None, 3072, amx_min_rows=1)
    batched_mlp = linear_kernels.packed_silu_mul_linear(x, fused, 1536, amx_min_rows=1)
    # 16-row tiles (1 x 4) from 48 to 127 rows, 32-row blocks below and above, padded tails
    for rows in (slice(0, 1), slice(5, 6), slice(16, 33), slice(40, 110), slice(69, 70), slice(2, 140)):
        assert torch.equal(linear_kernels.packed_linear(x[rows], packed, None, 3072, amx_min_rows=1), batched[rows])
        assert torch.equal(linear_kernels.packed_silu_mul_linear(x[rows], fused, 1536, amx_min_rows=1),
                           batched_mlp[rows])


@needs_amx
def test_amx_threshold_is_measured_once_per_shape_and_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(linear, "_calibration_file", lambda: str(tmp_path / "rows.json"))
    monkeypatch.setattr(linear, "_amx_rows", {})
    packed = linear_kernels.pack_linear_weight(torch.randn(256, 128).to(torch.bfloat16))
    rows = linear.amx_min_rows(packed, 256)
    assert rows in linear.CALIBRATION_ROWS
    assert (tmp_path / "rows.json").exists()
    # A later start (an empty cache in memory) reads the number without timing anything.
    monkeypatch.setattr(linear, "_amx_rows", {})
    monkeypatch.setattr(linear, "_time", lambda fn, repeats=5: pytest.fail("measured again"))
    assert linear.amx_min_rows(packed, 256) == rows


@needs_amx
def test_modules_packed_for_amx_match_the_unpacked_ones():
    layer = Linear(192, 136, bias=True).to(torch.bfloat16)
    mlp = GateUpLinear(192, 2 * 72, bias=False).to(torch.bfloat16)
    x = torch.randn(40, 192).to(torch.bfloat16)
    with torch.no_grad():
        expected = layer(x), mlp(x)
        layer.pack("amx")
        mlp.pack("amx")
        out = layer(x), mlp(x)
    assert layer.amx_min_rows in linear.CALIBRATION_ROWS and mlp.amx_min_rows in linear.CALIBRATION_ROWS
    torch.testing.assert_close(out[0].float(), expected[0].float(), rtol=2**-7, atol=1e-2)
    torch.testing.assert_close(out[1].float(), expected[1].float(), rtol=2**-6, atol=2e-2)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 7, 40, 130])
@pytest.mark.parametrize("tiles", [False, True])
def test_float32_output_is_the_sums_before_rounding(rows, tiles):
    # The LM head's logits (engine/models/linear.py: BlockedMethod.logits): the very sums that the
    # bfloat16 output rounds, so two candidates a bfloat16 step apart no longer tie.
    if tiles and not linear_kernels.packed_linear_amx_available():
        pytest.skip("needs a CPU whose AMX tiles run")
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(1000, 576, generator=gen).to(torch.bfloat16)
    bias = torch.randn(1000, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)
    packed = linear_kernels.pack_linear_weight(weight)
    amx = 1 if tiles else 0
    sums = linear_kernels.packed_linear(x, packed, bias, 1000, amx, out_dtype=torch.float32)
    rounded = linear_kernels.packed_linear(x, packed, bias, 1000, amx)
    assert sums.dtype == torch.float32 and torch.equal(sums.to(torch.bfloat16), rounded)
    expected, _ = reference(x, weight, bias)
    torch.testing.assert_close(sums, expected, rtol=1e-5, atol=1e-4)
    assert (sums != sums.to(torch.bfloat16).float()).any()  # not rounded


def test_a_layer_hands_its_products_to_the_method_its_packing_chose():
    # Linear keeps the weight; the method, chosen once by pack() or quantize(), multiplies it: each
    # packing this CPU has, and int8, against torch's product of the weight as loaded.
    from pagoda.engine.models import quantized as Q

    torch.manual_seed(0)
    source = Linear(64, 40, bias=True).to(torch.bfloat16)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    want, bound = reference(x, source.weight, source.bias)
    assert source.method is linear.AS_LOADED and source.greedy_tokens(x) is None
    kinds = {"amx": linear.BlockedMethod, "blocked": linear.BlockedMethod, "onednn": linear.OneDNNMethod}
    for packing in filter(linear.packing_available, linear.PACKINGS):
        layer = Linear(64, 40, bias=True).to(torch.bfloat16)
        layer.load_state_dict(source.state_dict())
        layer.pack(packing)
        assert type(layer.method) is kinds[packing] and layer.packing == packing
        assert ((layer(x).float() - want).abs() <= 2 * bound + 1e-2).all(), packing
        logits = layer.logits(x)
        assert logits.dtype == (torch.float32 if packing in linear.BLOCKED_LAYOUT else torch.bfloat16)
    if linear_kernels.quant_linear_vector():
        layer = Linear(64, 40, bias=False).to(torch.bfloat16)
        weight = Q.quantize_int8(source.weight.float())
        layer.quantize(weight)
        assert isinstance(layer.method, linear.QuantizedMethod) and layer.packing == "q8"
        exact = x.float() @ weight.dequantize().T
        assert (layer.logits(x) - exact).abs().max() <= 0.03 * exact.abs().max()
        assert torch.equal(layer.greedy_tokens(x), layer.logits(x).argmax(dim=-1))
    with pytest.raises(ValueError, match="unknown packing 'fp4'"):
        linear.method_for("fp4")
