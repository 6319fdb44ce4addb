"""Tests for engine.models.rope against transformers' RoPE initialization."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from pagoda.engine.model_config import ModelConfig
from pagoda.engine.models.rope import compute_inv_freq

CASES: dict[str, dict[str, Any]] = {
    "default-small": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    "default-large": {
        "head_dim": 128,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
    },
    "linear": {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}},
    "dynamic": {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}},
    "llama3-31": {
        "head_dim": 128,
        "max_position_embeddings": 131072,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
    "llama3-tiny": {
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "yarn": {
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 256,
        },
    },
    "yarn-qwen": {
        "head_dim": 128,
        "max_position_embeddings": 131072,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 1e6,
            "factor": 4.0,
            "original_max_position_embeddings": 32768,
        },
    },
    "yarn-betas-attention-factor": {
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "original_max_position_embeddings": 128,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "attention_factor": 0.8,
        },
    },
    "yarn-mscale-untruncated": {
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "original_max_position_embeddings": 64,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
            "truncate": False,
        },
    },
}


def _configs(case: dict[str, Any]) -> tuple[LlamaConfig, ModelConfig]:
    """The transformers config and ours, parsed from its config.json dict."""
    kwargs = {
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 1024,
        **case,
    }
    hf_config = LlamaConfig(**kwargs)
    return hf_config, ModelConfig.from_dict(hf_config.to_dict())


def _reference(hf_config: LlamaConfig) -> tuple[torch.Tensor, float]:
    rope_type = hf_config.rope_parameters["rope_type"]
    if rope_type == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(hf_config)
    return ROPE_INIT_FUNCTIONS[rope_type](hf_config, None)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_transformers(name: str) -> None:
    hf_config, config = _configs(CASES[name])
    expected, expected_scaling = _reference(hf_config)
    inv_freq, scaling = compute_inv_freq(config)
    assert inv_freq.dtype == torch.float32
    assert inv_freq.shape == (config.head_dim // 2,)
    torch.testing.assert_close(inv_freq, expected.float(), rtol=0, atol=1e-6)
    assert scaling == pytest.approx(expected_scaling, abs=1e-6)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_llama_rotary_embedding_module(name: str) -> None:
    hf_config, config = _configs(CASES[name])
    module = LlamaRotaryEmbedding(hf_config)
    inv_freq, scaling = compute_inv_freq(config)
    torch.testing.assert_close(inv_freq, module.inv_freq, rtol=0, atol=1e-6)
    assert scaling == pytest.approx(module.attention_scaling, abs=1e-6)


def test_scaling_is_one_except_yarn() -> None:
    for name, case in CASES.items():
        _, scaling = compute_inv_freq(_configs(case)[1])
        if not name.startswith("yarn"):
            assert scaling == 1.0, name
    _, yarn_scaling = compute_inv_freq(_configs(CASES["yarn"])[1])
    assert yarn_scaling == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1.0)


def test_dynamic_equals_default_within_context() -> None:
    dynamic, _ = compute_inv_freq(_configs(CASES["dynamic"])[1])
    default, _ = compute_inv_freq(_configs(CASES["default-small"])[1])
    assert torch.equal(dynamic, default)


def test_transformers4_style_rope_scaling() -> None:
    """Legacy ``rope_theta`` + ``rope_scaling`` with ``type`` gives the same result."""
    hf_config, _ = _configs(CASES["linear"])
    raw = {k: v for k, v in hf_config.to_dict().items() if k != "rope_parameters"}
    raw.update(rope_theta=10000.0, rope_scaling={"type": "linear", "factor": 4.0})
    inv_freq, _ = compute_inv_freq(ModelConfig.from_dict(raw))
    torch.testing.assert_close(inv_freq, _reference(hf_config)[0], rtol=0, atol=1e-6)


def test_missing_parameter_raises() -> None:
    _, config = _configs(CASES["default-small"])
    config.rope_scaling = {"rope_type": "linear"}
    with pytest.raises(ValueError, match="factor"):
        compute_inv_freq(config)


def test_unsupported_type_raises() -> None:
    _, config = _configs(CASES["default-small"])
    config.rope_scaling = {"rope_type": "longrope"}
    with pytest.raises(ValueError, match="longrope"):
        compute_inv_freq(config)


@pytest.mark.parametrize("partial", [1.0, 0.5])
@pytest.mark.parametrize("stated_factor", [None, 8.0])
def test_longrope_short_and_long_factors_match_transformers(partial: float, stated_factor: float | None) -> None:
    """Phi-3's 128k RoPE (and Phi-4-mini's, over half of each head): the short factors within the
    pretraining context, the long ones past it, chosen by the engine's longest sequence."""
    from transformers import Phi3Config

    rotated = int(16 * partial)
    scaling = {"type": "longrope", "short_factor": [1.0 + 0.3 * i for i in range(rotated // 2)],
               "long_factor": [1.5 + 1.1 * i for i in range(rotated // 2)]}
    if stated_factor is not None:
        scaling["factor"] = stated_factor
    hf_config = Phi3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                           max_position_embeddings=4096, original_max_position_embeddings=256,
                           partial_rotary_factor=partial, rope_scaling=scaling)
    config = ModelConfig.from_dict(hf_config.to_dict())
    assert config.rotary_dim == rotated and config.rope_type == "longrope"
    for engine_max, seq_len in ((256, None), (4096, 257)):
        expected, expected_scaling = ROPE_INIT_FUNCTIONS["longrope"](hf_config, None, seq_len=seq_len)
        inv_freq, scaling_factor = compute_inv_freq(config, engine_max)
        assert inv_freq.shape == (rotated // 2,)
        torch.testing.assert_close(inv_freq, expected.float(), rtol=0, atol=1e-6)
        assert scaling_factor == pytest.approx(expected_scaling, abs=1e-6) and scaling_factor > 1
    assert not torch.equal(compute_inv_freq(config, 256)[0], compute_inv_freq(config, 257)[0])


def test_longrope_factors_of_the_wrong_length_are_refused() -> None:
    raw = {"architectures": ["Phi3ForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 4096,
           "original_max_position_embeddings": 256,
           "rope_scaling": {"type": "su", "short_factor": [1.0] * 3, "long_factor": [2.0] * 3}}
    config = ModelConfig.from_dict(raw)  # "su": the first 128k checkpoints' name of longrope
    assert config.rope_type == "longrope"
    with pytest.raises(ValueError, match="short_factor has 3 entries; the head rotates 16 dimensions, which needs 8"):
        compute_inv_freq(config, 256)
