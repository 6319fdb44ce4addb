"""`pagoda bench random-model`: a random-weight model of a real shape, for measuring speed where
the default model (135M parameters, inside these machines' L3 cache) says little.

The model is built offline with transformers' own config and model classes, in bfloat16, with
the default model's tokenizer (SmolLM2's vocabulary of 49,152 tokens, so any shape runs with
the same prompts), and saved as a Hugging Face directory that Pagoda and vLLM both load:

    pagoda bench random-model llama-1b --output /tmp/llama-1b
    pagoda bench compare --model /tmp/llama-1b --peer vllm --vllm-python ... --workloads single,random

With ``--gguf`` it also writes the model as GGUF files for llama.cpp (and Pagoda): a float16 file
by the `gguf` package, with the default model's tokenizer copied from its GGUF file (the same
token ids in both engines), and each quantized type by llama.cpp's own quantizer, run with the
llama.cpp environment's python (``--llamacpp-python``; the quantized types are llama.cpp's, so
the files are the ones its users make):

    pagoda bench random-model llama-1b --output /tmp/llama-1b --gguf Q4_K_M,Q8_0,Q4_1 \
        --llamacpp-python /tmp/peers/llamacpp/bin/python
    pagoda bench compare --model /tmp/llama-1b/llama-1b.Q4_K_M.gguf --peer llamacpp ...

Random weights give arbitrary tokens: the figures are for speed, not for output.
"""

from __future__ import annotations

import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from pagoda.environment import read

logger = logging.getLogger(__name__)

_VOCAB = 49152  # SmolLM2's, whose tokenizer the directory gets

#: name -> (transformers config class, its fields, what the shape is).
SHAPES: dict[str, tuple[str, dict[str, Any], str]] = {
    "llama-1b": ("LlamaConfig", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, rope_theta=500000.0, tie_word_embeddings=True,
        max_position_embeddings=8192, rms_norm_eps=1e-5),
        "Llama-3.2-1B's shape (16 layers, 2048 wide, GQA 32/8), 1.07B parameters"),
    "llama-8b": ("LlamaConfig", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, rope_theta=500000.0, tie_word_embeddings=False,
        max_position_embeddings=8192, rms_norm_eps=1e-5),
        "Llama-3.1-8B's shape (32 layers, 4096 wide, GQA 32/8, untied head), 7.5B parameters with this vocabulary: "
        "15 GB in bfloat16 (and as much again while --gguf writes its float16 file), 4.6 GB as Q4_K_M"),
    "qwen3-1.7b": ("Qwen3Config", dict(
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, max_position_embeddings=8192,
        rms_norm_eps=1e-6, rope_theta=1000000.0),
        "Qwen3-1.7B's shape (28 layers, 2048 wide, GQA 16/8, q/k norms), 1.5B parameters"),
    "gemma3-270m": ("Gemma3TextConfig", dict(
        hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
        head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
        rope_theta=1000000.0, rope_local_base_freq=10000.0, max_position_embeddings=32768, rms_norm_eps=1e-6,
        tie_word_embeddings=True),
        "Gemma-3-270M's shape (18 layers, 640 wide, 15 of them within a 512-token window, one KV head of 256), "
        "0.13B parameters with this vocabulary"),
    "qwen3-moe": ("Qwen3MoeConfig", dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=8,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=64, num_experts_per_tok=8,
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, tie_word_embeddings=False,
        max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=1000000.0),
        "Qwen3-30B-A3B's layer (2048 wide, 8 of the experts a token, each 768 wide, GQA 32/4) with 64 "
        "experts and 8 layers instead of 128 and 48, 2.7B parameters (0.5B active a token)"),
}


def make_random_model(shape: str, output: Path, seed: int = 0) -> Path:
    """Builds and saves the random-weight model ``shape`` (a key of SHAPES) in ``output``."""
    import torch
    import transformers

    from pagoda.engine.model_loader import resolve_model

    class_name, fields, _ = SHAPES[shape]
    config = getattr(transformers, class_name)(vocab_size=_VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                                               **fields)
    torch.manual_seed(seed)
    start = time.perf_counter()
    logger.info("building %s with random weights (bfloat16)", shape)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    logger.info("%.2fB parameters in %.0f s; saving to %s", params / 1e9, time.perf_counter() - start, output)
    output.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(output))
    tokenizer = resolve_model(None)
    for file in tokenizer.iterdir():
        if file.is_file() and file.name not in ("config.json", "generation_config.json") and \
                ".safetensors" not in file.name:
            shutil.copy2(file, output / file.name)
    return output


def write_gguf_files(model_dir: Path, name: str, types: list[str], llamacpp_python: str | None) -> list[Path]:
    """The model directory as GGUF files ``<model_dir>/<name>.<type>.gguf``, one per type: "f16"
    (and the source of every other) written here, the others quantized by llama.cpp."""
    import subprocess

    from pagoda.benchmarks.gguf_writer import tokenizer_of, write_gguf
    from pagoda.benchmarks.llamacpp_peer import QUANT_TYPES
    from pagoda.engine.model_loader import DEFAULT_GGUF_FILE, default_gguf_path

    unknown = [kind for kind in types if kind != "f16" and kind not in QUANT_TYPES]
    if unknown:
        raise ValueError(f"unknown GGUF types {unknown}; known: f16, {', '.join(QUANT_TYPES)}")
    quantized = [kind for kind in types if kind != "f16"]
    if quantized and not llamacpp_python:
        raise ValueError("quantized GGUF files are written by llama.cpp's quantizer: give --llamacpp-python, the "
                         "python of a virtual environment with llama-cpp-python (docs/benchmarks.md)")
    source = model_dir / f"{name}.f16.gguf"
    start = time.perf_counter()
    logger.info("writing %s (float16, the tokenizer of %s)", source, DEFAULT_GGUF_FILE)
    write_gguf(model_dir, source, tokenizer_of(default_gguf_path()), "f16")
    logger.info("%.1f GB in %.0f s", source.stat().st_size / 1e9, time.perf_counter() - start)
    written = [source] if "f16" in types else []
    for kind in quantized:
        target = model_dir / f"{name}.{kind}.gguf"
        logger.info("quantizing to %s with llama.cpp", kind)
        subprocess.run([llamacpp_python, str(Path(__file__).with_name("llamacpp_peer.py")), "--gguf", str(source),
                        "--quantize", kind, str(target)], check=True)
        logger.info("%s: %.2f GB", target, target.stat().st_size / 1e9)
        written.append(target)
    if "f16" not in types:
        source.unlink()
    return written


def run_random_model(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    output = Path(args.output)
    types = [kind for kind in (args.gguf or "").split(",") if kind]
    if (output / "config.json").exists() and not args.force:
        if not types:
            print(f"error: {output} already holds a model (--force replaces it)", file=sys.stderr)
            return 2
        logger.info("%s already holds the model: writing its GGUF files", output)
    else:
        make_random_model(args.shape, output, args.seed)
    print(f"{output}: {SHAPES[args.shape][2]}")
    try:
        for path in write_gguf_files(output, args.shape, types, args.llamacpp_python) if types else ():
            print(path)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def add_random_model_parser(bench_sub) -> None:
    p = bench_sub.add_parser("random-model", help="save a random-weight model of a real shape (for speed "
                                                  "measurements)",
                             description="\n".join(f"{name}: {about}" for name, (_, _, about) in SHAPES.items()))
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("--output", required=True, help="the directory to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="replace a model already there")
    p.add_argument("--gguf", default=None, metavar="TYPES",
                   help="also write GGUF files of these comma-separated types (f16, and llama.cpp's Q4_K_M, Q8_0, "
                        "Q4_1, ...: quantized by llama.cpp); a model already in --output is kept")
    p.add_argument("--llamacpp-python", default=read("PAGODA_LLAMACPP_PYTHON"),
                   help="python of the virtual environment holding llama-cpp-python, for the quantized GGUF files "
                        "(default: $PAGODA_LLAMACPP_PYTHON)")
    p.set_defaults(func=run_random_model)
