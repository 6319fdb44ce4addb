"""Tiny random-weight models for tests (a helper module, not a test file).

`make_tiny_model_dir` writes a Hugging Face style directory that the engine can
load like a real checkpoint: a 2-layer model with random weights plus the real
SmolLM2 tokenizer and chat template, copied from the converted default model.
`make_hf_model` loads such a directory with transformers as the oracle.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from engine.model_loader import resolve_model

#: The SmolLM2 tokenizer's vocabulary size and special ids.
TINY_VOCAB_SIZE = 49152
TINY_BOS_TOKEN_ID = 1
TINY_EOS_TOKEN_ID = 2

_TINY_DEFAULTS: dict[str, Any] = {
    "vocab_size": TINY_VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "bos_token_id": TINY_BOS_TOKEN_ID,
    "eos_token_id": TINY_EOS_TOKEN_ID,
    "pad_token_id": TINY_EOS_TOKEN_ID,
}

# Per architecture: transformers config class name and extra defaults.
_ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {"tie_word_embeddings": True}),
    "mistral": ("MistralConfig", {"tie_word_embeddings": False, "sliding_window": None}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": False}),
}

# Files of a model directory that are not tokenizer files (besides weights).
_NOT_TOKENIZER = ("config.json", "generation_config.json")


def make_tiny_model_dir(
    path: Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    max_shard_size: str | int | None = None,
    tokenizer_dir: Path | None = None,
    **config_overrides: Any,
) -> Path:
    """Saves a tiny random-weight model with the SmolLM2 tokenizer.

    Args:
        path: Output directory (created if needed).
        arch: ``"llama"``, ``"mistral"`` or ``"qwen2"``.
        seed: Seed for the random weights; equal seeds give equal weights.
            Norm weights are ``1 + 0.1 * randn`` and biases ``0.02 * randn``
            (not transformers' 1 and 0) so that parity tests see them.
        max_shard_size: Passed to ``save_pretrained`` (e.g. ``"5MB"``) to write
            a sharded checkpoint with ``model.safetensors.index.json``.
        tokenizer_dir: Where to copy tokenizer files from; defaults to the
            converted default model, ``resolve_model(None)``.
        **config_overrides: Fields of the transformers config to override,
            e.g. ``num_hidden_layers=3`` or ``rope_scaling={...}``.

    Returns:
        ``path``.

    Raises:
        ValueError: If ``arch`` is unknown.
    """
    import transformers

    if arch not in _ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(_ARCHS)}")
    config_class_name, arch_defaults = _ARCHS[arch]
    config_class = getattr(transformers, config_class_name)
    config = config_class(**{**_TINY_DEFAULTS, **arch_defaults, **config_overrides})

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            # NOTE: transformers initializes norms to 1 and biases to 0, which
            # would hide a missing norm weight or bias in parity tests.
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.02 * torch.randn_like(param))
    model.generation_config.bos_token_id = config.bos_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(str(path), **save_kwargs)

    source = Path(tokenizer_dir) if tokenizer_dir is not None else resolve_model(None)
    for file in source.iterdir():
        if file.is_file() and file.name not in _NOT_TOKENIZER and ".safetensors" not in file.name:
            shutil.copy2(file, path / file.name)
    return path


def make_hf_model(path: Path) -> torch.nn.Module:
    """Loads a model directory with transformers in float32, in eval mode.

    Args:
        path: A directory written by `make_tiny_model_dir` (or any supported
            Hugging Face checkpoint).

    Returns:
        The ``AutoModelForCausalLM`` instance, the oracle for parity tests.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model.eval()
