"""compressed-tensors int8 checkpoints (the W8A8 format vLLM-CPU serves): read as they are,
multiplied by the quantized kernel, checked against transformers loading the same files."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from pagoda import LLM, SamplingParams
from pagoda.native import linear as linear_kernels
from pagoda.engine.model_loader import check_compressed_tensors_scheme as check_scheme
from pagoda.engine.model_loader import plan_quantization
from pagoda.engine.models.compressed_tensors import CompressedTensorsCheckpoint
from helpers import LINEARS, compress, hf_dequantized, hf_greedy, scheme

PROMPTS = [[1, 5, 9, 2, 7, 11, 4], [3, 3, 8], [20, 40, 60, 80, 100, 120]]
needs_vector = pytest.mark.skipif(not linear_kernels.quant_linear_vector(),
                                  reason="needs the quantized kernel's vector path (AVX512-VNNI or AVX2)")


@pytest.fixture(scope="module")
def compressed_dir(tiny_llama_dir, tmp_path_factory):
    return compress(tiny_llama_dir, tmp_path_factory.mktemp("w8a8"))


def test_transformers_reads_the_checkpoint_as_written(compressed_dir):
    """The oracle: compressed-tensors (through transformers) decompresses these files to the
    weights Pagoda's reader gives."""
    hf = hf_dequantized(compressed_dir)
    reader = CompressedTensorsCheckpoint(json.loads((compressed_dir / "config.json").read_text())
                                         ["quantization_config"])
    floats = dict(reader.dequantizing(load_file(compressed_dir / "model.safetensors").items()))
    assert len(reader.quantized) == 2 * len(LINEARS)
    state = hf.state_dict()
    for name, weight in floats.items():
        if name.rsplit(".", 2)[-2] in LINEARS:
            # NOTE: Pagoda rounds a scale to float16 (the kernel's type): 2^-11 relative.
            torch.testing.assert_close(state[name].float(), weight.float(), rtol=2**-10, atol=1e-7)


@pytest.mark.parametrize("strategy", ["channel", "tensor", "group"])
def test_every_weight_strategy_reads_into_the_kernels_groups(tiny_llama_dir, tmp_path, strategy):
    directory = compress(tiny_llama_dir, tmp_path / strategy, strategy)
    reader = CompressedTensorsCheckpoint(scheme(strategy))
    tensors = load_file(directory / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.input_scale"] = torch.ones(1)  # a static scale: not used
    floats = dict(reader.dequantizing(tensors.items()))
    name = "model.layers.0.mlp.down_proj.weight"
    scale = tensors[name + "_scale"].float()
    scale = scale.repeat_interleave(32, dim=1) if strategy == "group" else scale
    expected = tensors[name].float() * scale
    torch.testing.assert_close(floats[name], expected, rtol=2**-10, atol=0)
    quantized = reader.quantized[name.removeprefix("model.")]
    assert quantized.bits == 8 and quantized.mins is None and torch.equal(quantized.values, tensors[name])
    assert "input_scale" not in " ".join(floats)
    # Where the kernel will not run them, nothing is kept and the scales are the checkpoint's own.
    exact = CompressedTensorsCheckpoint(scheme(strategy), keep=False)
    floats = dict(exact.dequantizing(tensors.items()))
    assert not exact.quantized and torch.equal(floats[name], expected)


@needs_vector
def test_w8a8_engine_tracks_transformers_on_the_same_checkpoint(compressed_dir):
    """Greedy tokens of the quantized kernel (int8 weights, activations quantized per row and
    group of 32) against transformers running the dequantized weights in float32: each step's
    chosen token is within the kernel's rounding of transformers' best."""
    hf = hf_dequantized(compressed_dir)
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=1)
    # NOTE: int8 runs the checkpoint's own weights through the kernel wherever it runs (auto
    # keeps floats on CPUs whose AMX tiles run).
    with LLM(str(compressed_dir), dtype="float32", enforce_eager=True, max_model_len=64, num_kv_blocks=64,
             quantization="int8") as llm:
        description = llm.engine.describe()
        assert "compressed-tensors W8A8 int8 weights per channel" in description and ": 8 layers q8;" in description  # fused q/k/v, gate/up
        outputs = llm.generate(PROMPTS, params)
    for prompt, output in zip(PROMPTS, outputs):
        ids = list(prompt)
        for token in output.outputs[0].token_ids:
            with torch.no_grad():
                logprobs = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
            assert logprobs.max() - logprobs[token] < 0.05, (prompt, ids, token)
            ids.append(token)
    with LLM(str(compressed_dir), dtype="float32", enforce_eager=True, max_model_len=64, num_kv_blocks=64,
             quantization="none") as llm:  # dequantized: the float model transformers runs
        assert "compressed-tensors" not in llm.engine.describe()
        floats = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0))
    assert [o.outputs[0].token_ids for o in floats] == [hf_greedy(hf, p, 6) for p in PROMPTS]


def test_schemes_pagoda_does_not_read_fail_with_their_name(compressed_dir, tmp_path):
    check_scheme(scheme(activations=False))  # W8A16 reads
    cases = {
        "'pack-quantized'": {**scheme(), "format": "pack-quantized",
                             "config_groups": {"group_0": {**scheme()["config_groups"]["group_0"], "format": None}}},
        "4-bit int weights": scheme(num_bits=4),
        "8-bit float weights": scheme(type="float"),
        "asymmetric weights": scheme(symmetric=False),
        "weights quantized per block": scheme("block"),
        "a group size of 48": scheme("group", group_size=48),
        "8-bit float activations": {**scheme(), "config_groups": {"group_0": {
            **scheme()["config_groups"]["group_0"], "input_activations": {"num_bits": 8, "type": "float"}}}},
        "a sparsity config": {**scheme(), "sparsity_config": {"format": "sparse-24-bitmask"}},
        "a group size of None": scheme("group", group_size=None),
        "activation-ordered weight columns": scheme("group", actorder="group"),
        "a quantized KV cache scheme": {**scheme(), "kv_cache_scheme": {"num_bits": 8, "type": "float"}},
    }
    for words, config in cases.items():
        with pytest.raises(ValueError, match=words):
            check_scheme(config)
    broken = tmp_path / "fp8"
    shutil.copytree(compressed_dir, broken)
    config = json.loads((broken / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["type"] = "float"
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="8-bit float weights"):
        plan_quantization("auto", broken, torch.device("cpu"))
    with pytest.raises(ValueError, match="8-bit float weights"):
        LLM(str(broken), enforce_eager=True)


def test_where_the_kernel_cannot_run_the_weights_are_dequantized(compressed_dir):
    cpu = torch.device("cpu")
    assert plan_quantization("none", compressed_dir, cpu) is None
    assert plan_quantization("auto", compressed_dir, torch.device("cuda")) is None
    assert plan_quantization("auto", compressed_dir, cpu, tensor_parallel_size=2) is None
    with pytest.raises(ValueError, match="int8 cannot run here: the quantized kernel runs on the CPU"):
        plan_quantization("int8", compressed_dir, torch.device("cuda"))
    if linear_kernels.quant_linear_vector():  # AMX machines too: their products of many rows run on the tiles
        assert plan_quantization("auto", compressed_dir, cpu) == "compressed-tensors"
    if linear_kernels.quant_linear_vector():
        assert plan_quantization("int8", compressed_dir, cpu) == "compressed-tensors"
