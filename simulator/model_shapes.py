"""Models for `pagoda simulate --model`: a directory, a config.json, or a named shape.

The simulator needs a model's shape only (layers, widths, heads, vocabulary: its FLOPs,
weight bytes and K/V bytes per token), never its weights, so the shapes of common models
are named here with their published config.json values.
"""

from __future__ import annotations

import json
from pathlib import Path

from pagoda.engine.model_config import ModelConfig


def _llama(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int, positions: int,
           theta: float, tied: bool = False, architecture: str = "LlamaForCausalLM") -> dict:
    return {"architectures": [architecture], "hidden_size": hidden, "intermediate_size": intermediate,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "vocab_size": vocab, "max_position_embeddings": positions, "rope_theta": theta,
            "tie_word_embeddings": tied, "rms_norm_eps": 1e-5}


#: config.json values of models people serve (as published with their weights).
NAMED_SHAPES: dict[str, dict] = {
    "llama-3-8b": _llama(4096, 14336, 32, 32, 8, 128256, 8192, 500000.0),
    "llama-3.1-8b": _llama(4096, 14336, 32, 32, 8, 128256, 131072, 500000.0),
    "llama-3-70b": _llama(8192, 28672, 80, 64, 8, 128256, 8192, 500000.0),
    "qwen2.5-7b": _llama(3584, 18944, 28, 28, 4, 152064, 32768, 1000000.0, architecture="Qwen2ForCausalLM"),
    "mistral-7b": _llama(4096, 14336, 32, 32, 8, 32768, 32768, 1000000.0, architecture="MistralForCausalLM"),
    "smollm2-135m": _llama(576, 1536, 30, 9, 3, 49152, 8192, 100000.0, tied=True),
}


def load_model_shape(spec: str) -> ModelConfig:
    """A model's shape from a name of NAMED_SHAPES, a model directory or a config.json.

    Raises:
        ValueError: None of these, or a config the engine does not support.
    """
    if spec.lower() in NAMED_SHAPES:
        return ModelConfig.from_dict(NAMED_SHAPES[spec.lower()], source=spec)
    path = Path(spec)
    if path.is_dir():
        return ModelConfig.from_dir(path)
    if path.is_file():
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not JSON ({exc.msg})") from None
        return ModelConfig.from_dict(raw, source=str(path))
    raise ValueError(f"model {spec!r}: not a directory, a config.json or one of the named shapes "
                     f"{sorted(NAMED_SHAPES)}")
