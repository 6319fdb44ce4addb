"""Compiled regions kept on disk (engine/models/precompiled.py): saved per variant, loaded by a
later start without tracing, equal bit for bit to torch.compile's code, recompiled when stale."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from pagoda import LLM, SamplingParams
from pagoda.engine.models.precompiled import PrecompiledRegion

pytestmark = pytest.mark.slow  # NOTE: `python -m pytest -m slow` runs it (CI runs both sets)


def norm_then_linear(norm: nn.Module, linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(linear(norm(x))) * 2


def with_a_graph_break(norm: nn.Module, linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    y = norm(x)
    torch._dynamo.graph_break()
    return linear(y)


def modules(seed: int) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    return nn.LayerNorm(32).eval(), nn.Linear(32, 48).eval()


@pytest.fixture(autouse=True)
def floats_specialized():
    """As the model compiles them (DecoderForCausalLM.compile_regions): LayerNorm's eps a constant."""
    with torch._dynamo.config.patch(specialize_float=True):
        yield


@pytest.fixture
def jit():
    return torch.compile(norm_then_linear, dynamic=True)


def test_variants_are_saved_then_loaded_without_compiling_and_equal_torch_compile(tmp_path, jit):
    first, second = modules(0), modules(1)
    # NOTE: made outside inference mode, all of them: the guards tell inference tensors apart.
    x7, x1, x33 = torch.randn(7, 32), torch.randn(1, 32), torch.randn(33, 32)
    with torch.inference_mode():
        region = PrecompiledRegion(norm_then_linear, tmp_path, {})
        outputs = [region(*first, x7), region(*first, x1)]
        assert (region.loaded, region.compiled) == (0, 2)  # a one-row batch is compiled apart
        assert len(list(tmp_path.glob("norm_then_linear-*.bin"))) == 2

        later = PrecompiledRegion(norm_then_linear, tmp_path, {})  # as a later start
        again = [later(*first, x7), later(*first, x1)]
        assert (later.loaded, later.compiled) == (2, 0)
        expected = [jit(*first, x7), jit(*first, x1)]
        for got in (outputs, again):
            assert all(torch.equal(a, b) for a, b in zip(got, expected))
        # The same variant serves other modules of the same shapes (every decoder layer) and
        # other row counts.
        assert torch.equal(later(*second, x33), jit(*second, x33))
        assert later.compiled == 0
        assert torch.allclose(later(*second, x33), norm_then_linear(*second, x33), atol=1e-5)


def test_inputs_no_saved_variant_accepts_are_compiled_and_saved_beside(tmp_path):
    norm, linear = modules(0)
    with torch.inference_mode():
        region = PrecompiledRegion(norm_then_linear, tmp_path, {})
        region(norm, linear, torch.randn(5, 32))
        doubles = (norm.double(), linear.double())
        out = region(*doubles, torch.randn(5, 32, dtype=torch.float64))  # the guards refuse the float32 code
        assert out.dtype == torch.float64 and region.compiled == 2
        assert len(list(tmp_path.glob("*.bin"))) == 2


def test_a_broken_file_is_compiled_again_with_a_warning(tmp_path, caplog, jit):
    norm, linear = modules(0)
    (tmp_path / "norm_then_linear-broken.bin").write_bytes(b"not a compiled function")
    x = torch.randn(4, 32)
    with torch.inference_mode(), caplog.at_level(logging.WARNING):
        region = PrecompiledRegion(norm_then_linear, tmp_path, {})
        assert torch.equal(region(norm, linear, x), jit(norm, linear, x))
    assert (region.loaded, region.compiled) == (0, 1)
    assert "could not load the compiled region" in caplog.text and "norm_then_linear-broken.bin" in caplog.text


def test_a_region_with_a_graph_break_falls_back_to_torch_compile(tmp_path, caplog):
    norm, linear = modules(0)
    x = torch.randn(4, 32)
    with torch.inference_mode(), caplog.at_level(logging.INFO):
        region = PrecompiledRegion(with_a_graph_break, tmp_path, {})
        assert torch.allclose(region(norm, linear, x), linear(norm(x)), atol=1e-6)
        region(norm, linear, torch.randn(1, 32))
    assert "compiling with_a_graph_break ahead of time failed" in caplog.text
    assert not list(tmp_path.glob("*.bin"))


def test_a_second_start_loads_every_region_and_generates_the_same_tokens(tiny_llama_dir):
    prompts = ["The compiled model says", "Hi"]
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=1)
    results = []
    for _ in range(2):
        with LLM(str(tiny_llama_dir), dtype="float32", max_model_len=128, num_kv_blocks=64) as llm:
            outputs = llm.generate(prompts, params)
            results.append([(o.outputs[0].token_ids, [p.logprob for p in o.outputs[0].logprobs])
                            for o in outputs])
            compiled = llm.engine.worker.ready.compiled
    # NOTE: the first start may have loaded them too (an earlier run, same code and model
    # shape); the second compiles nothing: 3 regions x (one token, more) at least are loaded.
    loaded = int(compiled.split()[0])
    assert compiled == f"{loaded} compiled regions loaded" and loaded >= 6
    assert results[0] == results[1]


def test_the_model_is_compiled_on_one_rank_of_a_cpu_or_a_gpu_unless_told_not_to():
    from pagoda.engine.config import EngineConfig, compiles_model

    assert compiles_model(EngineConfig(), "cpu", 1, False) and compiles_model(EngineConfig(), "cuda", 1, False)
    assert not compiles_model(EngineConfig(), "cuda", 2, False)  # the all-reduces sit inside the regions
    assert not compiles_model(EngineConfig(enforce_eager=True), "cuda", 1, False)
    assert not compiles_model(EngineConfig(), "cpu", 1, True)  # batch invariance, as the start plan resolved it
