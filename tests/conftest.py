"""Shared fixtures: tiny random-weight models written once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# NOTE: without a GPU, the triton backend's kernels are tested under Triton's interpreter.
# Triton reads the variable when it is imported, so it is set before anything imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers import make_tiny_model_dir  # noqa: E402

# NOTE: a wider init than transformers' 0.02 gives peaked logits, so greedy parity is
# not decided by float noise between near-tied tokens.
TINY_INIT = {"initializer_range": 0.3}


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"), "llama", **TINY_INIT)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", seed=1, **TINY_INIT)


@pytest.fixture(scope="session")
def hf_default_model():
    """transformers' own loading of the default model's GGUF, in float32: the oracle of the
    default-model tests, loaded once for all of them (it takes about 15 s)."""
    from transformers import AutoModelForCausalLM

    from pagoda.engine.model_loader import default_gguf_path

    gguf = default_gguf_path()
    return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
