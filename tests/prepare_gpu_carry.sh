#!/usr/bin/env bash
# Fills .gpu-carry/ (git-ignored, a few MB) with what tests/run_gpu_checks.sh needs on a GPU
# machine that has no network: wheels of the dependencies its image lacks, for its Python, and
# the test tokenizer (tiny test models copy it; here it comes from the 94 MB default model).
# Run it here, in the venv of the README, then name .gpu-carry in the device run's `carry`.
# Usage: tests/prepare_gpu_carry.sh [python version of the GPU machine, default 3.12]
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:-3.12}"
rm -rf .gpu-carry && mkdir -p .gpu-carry/wheels .gpu-carry/tokenizer
# NOTE: only what the image lacks (torch, triton, transformers, tokenizers, aiohttp, pluggy,
# numpy, pytest... are there: docs/attention-backends.md, "What has run where"); --no-deps so
# that nothing it has is replaced.
python -m pip download --quiet --no-deps --only-binary=:all: --dest .gpu-carry/wheels \
    --python-version "$version" --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform any \
    gguf orjson opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions llguidance \
    importlib-metadata
python - <<'PY'
import shutil
from pathlib import Path

from pagoda.engine.model_loader import resolve_model

source = resolve_model(None)
for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
             "chat_template.jinja"):
    if (source / name).exists():
        shutil.copy(source / name, Path(".gpu-carry/tokenizer") / name)
PY
du -sh .gpu-carry
