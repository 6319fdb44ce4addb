"""What several test files share (a helper module, not a test file; pytest puts tests/ on
the import path, see pyproject.toml).

- Tiny random-weight models: `make_tiny_model_dir` writes a Hugging Face style directory
  that the engine can load like a real checkpoint (a 2-layer model with random weights plus
  the real SmolLM2 tokenizer and chat template, copied from the converted default model);
  `make_hf_model` loads one with transformers, the oracle, and `hf_greedy` decodes with it.
- Attention: `run_step` runs one paged step of a backend against `dense_attention`.
- Sampling: `sampling_metadata` builds a sampler batch from plain lists.
- Quantized checkpoints: `compress` writes a float checkpoint's linear weights as
  compressed-tensors int8 (`scheme`), `hf_dequantized` loads one in transformers, in floats.
- Servers: `free_port`, `REPO`, `TINY_FLAGS`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagoda.attention_backends import AttentionMetadata, get_attention_backend
from pagoda.attention_backends.base import to_cache_dtype
from pagoda.engine.model_loader import resolve_model
from pagoda.engine.sampling_params import SamplingParams

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
    "qwen3": ("Qwen3Config", {"tie_word_embeddings": False, "head_dim": 16}),
    # NOTE: 4 experts, 2 a token, on both layers (decoder_sparse_step 1), renormalized as the
    # Qwen3-MoE checkpoints people serve are.
    "qwen3_moe": ("Qwen3MoeConfig", {"tie_word_embeddings": False, "head_dim": 16, "num_experts": 4,
                                     "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                                     "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}),
    "mixtral": ("MixtralConfig", {"tie_word_embeddings": False, "num_local_experts": 4, "num_experts_per_tok": 2,
                                  "sliding_window": None}),
    "phi3": ("Phi3Config", {"tie_word_embeddings": False, "sliding_window": None,
                            "original_max_position_embeddings": 1024}),
    # NOTE: a window of 8 tokens on the first layer, global attention on the second: the parity
    # tests' prompts are longer than the window.
    "gemma2": ("Gemma2Config", {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 8,
                                "layer_types": ["sliding_attention", "full_attention"]}),
    "gemma3_text": ("Gemma3TextConfig", {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 8,
                                         "layer_types": ["sliding_attention", "full_attention"]}),
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
        arch: A key of ``_ARCHS``: ``"llama"``, ``"mistral"``, ``"qwen2"``, ``"qwen3"``,
            ``"qwen3_moe"``, ``"mixtral"``, ``"phi3"``, ``"gemma2"`` or ``"gemma3_text"``.
        seed: Seed for the random weights; equal seeds give equal weights.
            Norm weights are ``1 + 0.1 * randn`` and biases ``0.02 * randn``
            (not transformers' 1 and 0) so that parity tests see them.
        max_shard_size: Passed to ``save_pretrained`` (e.g. ``"5MB"``) to write
            a sharded checkpoint with ``model.safetensors.index.json``.
        tokenizer_dir: Where to copy tokenizer files from; defaults to
            ``$PAGODA_TEST_TOKENIZER_DIR``, else the converted default model,
            ``resolve_model(None)``.
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

    # NOTE: PAGODA_TEST_TOKENIZER_DIR stands in for the default model where it cannot be
    # installed (tests/run_gpu_checks.sh on a machine without network).
    if tokenizer_dir is None and os.environ.get("PAGODA_TEST_TOKENIZER_DIR"):
        tokenizer_dir = os.environ["PAGODA_TEST_TOKENIZER_DIR"]
    source = Path(tokenizer_dir) if tokenizer_dir is not None else resolve_model(None)
    for file in source.iterdir():
        if file.is_file() and file.name not in _NOT_TOKENIZER and ".safetensors" not in file.name:
            shutil.copy2(file, path / file.name)
    return path


def make_hf_model(path: Path) -> torch.nn.Module:
    """Loads a model directory with transformers in float32, in eval mode.

    Args:
        path: A directory written by `make_tiny_model_dir` (or any supported
            Hugging Face checkpoint, or a converted GGUF file: its float folder is read).

    Returns:
        The ``AutoModelForCausalLM`` instance, the oracle for parity tests.
    """
    from transformers import AutoModelForCausalLM

    from pagoda.engine.model_loader import float_checkpoint

    model = AutoModelForCausalLM.from_pretrained(str(float_checkpoint(path)), dtype=torch.float32)
    return model.eval()


#: Tokens the parity tests generate, greedily, in the engine and with the oracle.
NUM_NEW = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)


def hf_greedy(model, prompt_ids, num_new):
    """Greedy decoding by full recomputation: the simplest possible oracle."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        for _ in range(num_new):
            next_id = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return ids[0, len(prompt_ids):].tolist()


# -- attention backends ----------------------------------------------------------------------

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 16


def dense_attention(q, k, v):
    """Causal attention over one contiguous sequence; q is the last rows of k's positions."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("lhd,shd->hls", q, k) * q.shape[-1] ** -0.5
    seq_len, query_len = k.shape[0], q.shape[0]
    mask = torch.arange(seq_len)[None, :] > torch.arange(seq_len - query_len, seq_len)[:, None]
    return torch.einsum("hls,shd->lhd", scores.masked_fill(mask, float("-inf")).softmax(-1), v)


def run_step(backend_name, block_size, seq_lens, query_lens, seed=0, dtype=torch.float32, device="cpu",
             num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, shared_blocks=0, cache_dtype=None,
             apart=(), window=None, softcap=None, nan_before_window=False):
    """Fills caches for the context, runs one mixed step, returns (output, reference) on the CPU.

    With ``shared_blocks``, every request but those listed in ``apart`` starts with the same
    blocks, holding the same keys and values (a prefix the prefix cache shares). ``cache_dtype`` (an fp8 dtype) stores the
    cache in it, and the reference attends over the keys and values rounded to it. With
    ``window`` or ``softcap`` the backend attends so (the reference does not: compare with
    naive's); with ``nan_before_window`` too, the blocks wholly before each request's first
    query's window hold NaN (as blocks given back to the pool and written by others).
    """
    gen = torch.Generator().manual_seed(seed)
    backend = get_attention_backend(backend_name, torch.device(device), cache_dtype)(num_heads, num_kv_heads,
                                                                                     head_dim, head_dim**-0.5)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    key_shape, value_shape = backend.kv_cache_shapes(num_blocks, block_size)
    kv_cache = (torch.zeros(key_shape, dtype=cache_dtype or dtype, device=device),
                torch.zeros(value_shape, dtype=cache_dtype or dtype, device=device))
    # Scatter each request's blocks over the pool in a shuffled order.
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    shared, perm = perm[:shared_blocks], perm[shared_blocks:]
    shared_tokens = shared_blocks * block_size
    shared_k = torch.randn(shared_tokens, num_kv_heads, head_dim, generator=gen, dtype=dtype)
    shared_v = torch.randn(shared_tokens, num_kv_heads, head_dim, generator=gen, dtype=dtype)
    tables, full_k, full_v = [], [], []
    for i, s in enumerate(seq_lens):
        assert s > shared_tokens or i in apart
        n = -(-s // block_size) - (0 if i in apart else shared_blocks)
        tables.append(([] if i in apart else shared) + perm[:n])
        perm = perm[n:]
        k = torch.randn(s, num_kv_heads, head_dim, generator=gen, dtype=dtype)
        v = torch.randn(s, num_kv_heads, head_dim, generator=gen, dtype=dtype)
        if i not in apart:
            k[:shared_tokens], v[:shared_tokens] = shared_k, shared_v
        full_k.append(k)
        full_v.append(v)
    # Context tokens (all but the step's queries) are already in the cache.
    for table, k, v, s, q in zip(tables, full_k, full_v, seq_lens, query_lens):
        if s > q:
            slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(s - q)],
                                 dtype=torch.int64, device=device)
            backend.write_kv(k[: s - q].to(device), v[: s - q].to(device), kv_cache, slots)
    if nan_before_window:
        for table, s, q in zip(tables, seq_lens, query_lens):
            for block in table[:max(0, s - q - window + 1) // block_size]:
                kv_cache[0][block] = float("nan")
                kv_cache[1][block] = float("nan")
    queries = [torch.randn(q, num_heads, head_dim, generator=gen, dtype=dtype) for q in query_lens]
    max_blocks = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32)
    slots = [table[p // block_size] * block_size + p % block_size
             for table, s, q in zip(tables, seq_lens, query_lens) for p in range(s - q, s)]
    query_start = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32)
    metadata = AttentionMetadata(
        num_tokens=sum(query_lens), query_lens=list(query_lens), seq_lens=list(seq_lens),
        query_start_loc=query_start.to(device),
        seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device), slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_size=block_size, max_query_len=max(query_lens), max_seq_len=max(seq_lens))
    backend.prepare(metadata)
    new_k = torch.cat([k[s - q:] for k, s, q in zip(full_k, seq_lens, query_lens)])
    new_v = torch.cat([v[s - q:] for v, s, q in zip(full_v, seq_lens, query_lens)])
    limits = {name: value for name, value in (("window", window), ("softcap", softcap)) if value is not None}
    out = backend.forward(torch.cat(queries).to(device), new_k.to(device), new_v.to(device), kv_cache,
                          metadata, **limits).cpu()
    def stored(x):
        return (x if cache_dtype is None else to_cache_dtype(x, cache_dtype)).float()

    reference = torch.cat([dense_attention(q.float(), stored(k), stored(v))
                           for q, k, v in zip(queries, full_k, full_v)])
    return out, reference


MIXED = [
    ([5], [5]),  # one prefill from scratch
    ([9, 17, 3], [1, 1, 1]),  # decodes
    ([12, 30, 7, 40], [12, 1, 3, 1]),  # prefill, decode, chunk over context, decode
]

WIDE = ([37, 20, 33, 5, 50], [37, 1, 9, 5, 1])


# -- the sampler ------------------------------------------------------------------------


def sampling_metadata(params, prompt_token_ids, output_token_ids, eos_token_ids, vocab_size, device="cpu"):
    """The sampler's metadata for rows given as lists (row ``i`` is request ``i``), gathered
    through a fresh InputBatch as the worker gathers it from its persistent one."""
    import numpy as np

    from pagoda.engine.messages import NewRequestData
    from pagoda.engine.worker.input_batch import InputBatch

    assert len(prompt_token_ids) == len(params) and len(output_token_ids) == len(params)
    max_len = max((len(p) + len(o) for p, o in zip(prompt_token_ids, output_token_ids)), default=1)
    batch = InputBatch(max(len(params), 1), max_len, 16, vocab_size, list(eos_token_ids), torch.device(device))
    rows = [batch.add(NewRequestData(str(i), list(prompt), list(output), p, [], 0))
            for i, (p, prompt, output) in enumerate(zip(params, prompt_token_ids, output_token_ids))]
    return batch.sampling_metadata(np.array(rows, dtype=np.int64))


# -- servers ----------------------------------------------------------------------------

REPO = Path(__file__).resolve().parent.parent
TINY_FLAGS = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "256",
              "--block-size", "8"]


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def scheme(strategy: str = "channel", activations: bool = True, **weights) -> dict:
    """A quantization_config as llm-compressor writes one for W8A8 (or W8A16) int8."""
    group = {"targets": ["Linear"], "format": "int-quantized",
             "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": strategy, "dynamic": False,
                         "group_size": 32 if strategy == "group" else None, **weights},
             "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                   "dynamic": True} if activations else None}
    return {"quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": group}, "ignore": ["lm_head"]}


def compress(source: Path, target: Path, strategy: str = "channel") -> Path:
    """The float checkpoint ``source`` with its decoder's linear weights in int8 (symmetric,
    scale = largest magnitude / 127 per output channel, tensor or group of 32), as
    compressed-tensors stores them: ``weight`` int8, ``weight_scale`` float."""
    target.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.suffix != ".safetensors" and path.name != "config.json":
            shutil.copy(path, target / path.name)
    tensors = load_file(source / "model.safetensors")
    out = {}
    for name, tensor in tensors.items():
        if name.rsplit(".", 2)[-2] not in LINEARS:
            out[name] = tensor
            continue
        w = tensor.float()
        if strategy == "channel":
            scale = w.abs().amax(dim=1, keepdim=True) / 127
        elif strategy == "tensor":
            scale = w.abs().amax().reshape(1) / 127
        else:
            scale = w.reshape(w.shape[0], -1, 32).abs().amax(dim=2) / 127
        expanded = scale if strategy != "group" else scale.repeat_interleave(32, dim=1)
        out[name] = torch.round(w / expanded).clamp(-128, 127).to(torch.int8)
        out[name + "_scale"] = scale.to(tensor.dtype)
    save_file(out, target / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = scheme(strategy)
    (target / "config.json").write_text(json.dumps(config))
    return target


def hf_dequantized(directory: Path) -> torch.nn.Module:
    """transformers with compressed-tensors reading the checkpoint, weights decompressed to
    float32 (the oracle; its default runs the int8 weights with activations fake-quantized)."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    return AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32,
                                                quantization_config=CompressedTensorsConfig(dequantize=True)).eval()


# -- GGUF files of the tiny models -----------------------------------------------------------

def _gguf_test_tokens() -> list[str]:
    from tokenizers.pre_tokenizers import ByteLevel

    return ["<unk>", "<s>", "</s>", *sorted(ByteLevel.alphabet()), "Ġt", "he"]


#: The vocabulary of write_gguf's tokenizer: a byte-level BPE with every byte and two merges. (The
#: SmolLM2 tokenizer's 49,152 tokens took the GGUF reader and transformers 20 s a file to parse.)
GGUF_TEST_VOCAB_SIZE = 261


def write_gguf(model_dir: Path, path: Path, tensor_type: str = "f32") -> Path:
    """Writes a tiny model directory (make_tiny_model_dir with ``vocab_size=GGUF_TEST_VOCAB_SIZE``)
    as a GGUF file of ``tensor_type`` (float32, or a type the ``gguf`` package quantizes to),
    named and laid out as llama.cpp's converter does for its family (benchmarks/gguf_writer.py),
    with a small byte-level tokenizer.

    Returns:
        ``path``.
    """
    from pagoda.benchmarks.gguf_writer import write_gguf as write

    return write(model_dir, path, _add_test_tokenizer, tensor_type)


def gguf_runs_agree(path: Path, dtype: str) -> tuple[str, str]:
    """Runs a quantized GGUF file as it is and dequantized to floats (``--quantization none``) on
    one 24-token prompt: the first greedy token equal and every prompt token's logprob within 0.05.
    The quantized run (where it quantizes) wrote no float folder (model_loader.float_checkpoint):
    it read no floats of its quantized tensors.

    Returns:
        Each run's start-up description (``engine.describe()``): quantized, floats.
    """
    from pagoda import LLM
    from pagoda.engine.model_loader import FLOATS_DIR, resolve_model

    prompt = [3 + (7 * j) % 250 for j in range(24)]
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=0, ignore_eos=True)
    runs = {}
    for quantization in ("auto", "none"):
        with LLM(str(path), dtype=dtype, enforce_eager=True, max_model_len=64, quantization=quantization) as llm:
            runs[quantization] = (llm.engine.describe(), llm.generate([prompt], params)[0])
        floats_written = (resolve_model(str(path)) / FLOATS_DIR).is_dir()
        assert floats_written == (quantization == "none" or "GGUF types" not in runs[quantization][0])
    (described, quantized), (float_described, floats) = runs["auto"], runs["none"]
    assert quantized.outputs[0].token_ids[0] == floats.outputs[0].token_ids[0]
    for got, want, token in zip(quantized.prompt_logprobs[1:], floats.prompt_logprobs[1:], prompt[1:]):
        assert abs(got[token].logprob - want[token].logprob) < 0.05
    return described, float_described


def _add_test_tokenizer(writer, config: dict) -> None:
    """write_gguf's small byte-level tokenizer (GGUF_TEST_VOCAB_SIZE tokens)."""
    import gguf

    tokens = _gguf_test_tokens()
    if config["vocab_size"] != len(tokens):
        raise ValueError(f"write_gguf writes a tokenizer of {len(tokens)} tokens: make the model with "
                         f"vocab_size={len(tokens)}")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(tokens) - 3))
    writer.add_token_merges(["Ġ t", "h e"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)


# -- LoRA adapters ---------------------------------------------------------------------------


def make_lora_dir(model_dir: Path, path: Path, *, seed: int = 0, r: int = 8, alpha: float = 16,
                  targets: tuple[str, ...] = ("q_proj", "v_proj"), rslora: bool = False,
                  layers: list[int] | None = None) -> Path:
    """Saves a PEFT LoRA adapter with random A and B (both nonzero, so that it changes the
    model's output) for the model in ``model_dir``, with ``peft`` itself.

    Args:
        model_dir: The base model (make_tiny_model_dir's).
        path: Output directory.
        seed: Seed of the adapter's weights.
        r, alpha, targets, rslora: LoraConfig's ``r``, ``lora_alpha``, ``target_modules`` and
            ``use_rslora``.
        layers: LoraConfig's ``layers_to_transform`` (None: every layer).
    """
    from peft import LoraConfig, get_peft_model

    base = make_hf_model(model_dir)
    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora,
                        init_lora_weights=False, layers_to_transform=layers, lora_dropout=0.0)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:  # NOTE: deltas the size of the base's, not larger
                param.mul_(0.5)
    model.save_pretrained(str(path))
    return Path(path)


def peft_model(model_dir: Path, adapter_dir: Path) -> torch.nn.Module:
    """The base model with the adapter applied by ``peft`` (the oracle), float32, eval mode."""
    from peft import PeftModel

    return PeftModel.from_pretrained(make_hf_model(model_dir), str(adapter_dir)).eval()


def tiny_server(model_dir: Path, max_model_len: int = 128, num_kv_blocks: int = 64, **engine):
    """A live server (pagoda.server.testing.ServerThread, not started) on a tiny model in float32,
    eager, with a small KV cache; ``engine`` adds EngineConfig fields."""
    from pagoda.engine.config import EngineConfig
    from pagoda.server.testing import ServerThread

    return ServerThread(EngineConfig(model=str(model_dir), enforce_eager=True, dtype="float32",
                                     max_model_len=max_model_len, num_kv_blocks=num_kv_blocks, **engine))


def live_processes_in_group(pgid: int) -> list[int]:
    """Pids of the group's processes that are not zombies (an exited child awaiting its reaper)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


class ServerProcess:
    """`pagoda serve ...` in its own session (process group), logging to a file."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        pagoda = Path(sys.executable).with_name("pagoda")
        command = [str(pagoda)] if pagoda.exists() else [sys.executable, "-m", "pagoda"]
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen([*command, "serve", *args, "--port", str(self.port)], cwd=REPO,
                                     env={**os.environ, **(env or {})}, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_ready(self, timeout: float) -> None:
        from pagoda.server.testing import http_request

        deadline = time.time() + timeout
        while True:
            assert self.proc.poll() is None, f"the server exited:\n{self.log()}"
            assert time.time() < deadline, f"the server did not start:\n{self.log()}"
            try:
                if http_request(self.url + "/health", timeout=5).status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)

    def client(self, api_key: str = "sk-lifecycle"):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=120)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        self._log.close()

    def assert_stopped_cleanly(self, timeout: float) -> None:
        """The server exits 0 and leaves no process of its group (the worker) behind."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server did not stop in {timeout} s:\n{self.log()}")
        assert code == 0, self.log()
        deadline = time.time() + 10
        while live_processes_in_group(self.proc.pid):
            assert time.time() < deadline, f"left behind: {live_processes_in_group(self.proc.pid)}"
            time.sleep(0.1)
