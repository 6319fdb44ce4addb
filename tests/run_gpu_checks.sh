#!/usr/bin/env bash
# Every GPU check in one go, on a machine with a CUDA GPU (docs/attention-backends.md, "What has
# run where"): the GPU tests (`pytest -m gpu`: CUDA parity with transformers, the compiled
# triton kernels and FlashInfer against the naive backend, 64-bit block offsets), with the
# torch, triton and transformers already installed there; then a timing of decode attention
# per backend (tests/gpu_attention_timing.py).
#
# Offline (the GPU machines lent to this project have no network): run
# tests/prepare_gpu_carry.sh here first and carry .gpu-carry; its wheels are installed without
# an index and its tokenizer serves the tiny test models. With network and no .gpu-carry:
# `pip install -e ".[gpu,test]"` into the environment that has CUDA's torch instead.
# Writes gpu-junit.xml and gpu-summary.txt into $OUT (or the current directory).
# Usage: tests/run_gpu_checks.sh [extra pytest args]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.}"
python="${PYTHON:-python3}"
if [ -d .gpu-carry/wheels ]; then
    # NOTE: only the packages that do not import; --no-deps: the image's own stay as they are.
    missing=$("$python" - <<'PY'
import importlib.util
names = {"gguf": "gguf", "orjson": "orjson", "opentelemetry.sdk": "opentelemetry_sdk",
         "opentelemetry.semconv": "opentelemetry_semantic_conventions", "opentelemetry": "opentelemetry_api",
         "llguidance": "llguidance", "importlib_metadata": "importlib_metadata"}
def found(module):
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False
print(" ".join(sorted({wheel for module, wheel in names.items() if not found(module)})))
PY
)
    for wheel in $missing; do
        "$python" -m pip install --quiet --no-index --no-deps .gpu-carry/wheels/"${wheel}"-*.whl
    done
    export PAGODA_TEST_TOKENIZER_DIR="$PWD/.gpu-carry/tokenizer"
fi
# The repository is the package `pagoda`: importable through a link, without installing it.
link_dir=$(mktemp -d)
ln -s "$PWD" "$link_dir/pagoda"
export PYTHONPATH="$link_dir${PYTHONPATH:+:$PYTHONPATH}"
# NOTE: the kernels must be compiled here, not interpreted.
unset TRITON_INTERPRET
"$python" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), \
torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" | tee "$out/gpu-summary.txt"
"$python" -m pytest -m gpu tests/test_gpu.py -v -p no:cacheprovider --junitxml "$out/gpu-junit.xml" "$@" \
    2>&1 | tee -a "$out/gpu-summary.txt"
status=${PIPESTATUS[0]}
# Decode attention per backend at batch 1 and 64 (a table of milliseconds), checks or not.
"$python" tests/gpu_attention_timing.py 2>&1 | tee -a "$out/gpu-summary.txt"
rm -rf "$link_dir"
exit "$status"
