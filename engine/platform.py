"""Device and dtype resolution shared by the engine and the worker."""

from __future__ import annotations

import functools

import torch

from pagoda.attention_backends import AttentionShape

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str, offset: int = 0) -> torch.device:
    """"auto" is CUDA when available, else the CPU. On CUDA, ``offset`` GPUs past the one
    named ("cuda" is "cuda:0"): a tensor-parallel rank's own GPU, ``cuda:{first + rank}``.

    Raises:
        ValueError: CUDA was asked for and torch sees none, or fewer GPUs than that one.
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if not device.startswith("cuda"):
        return torch.device(device)
    if not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for but torch sees no CUDA device")
    index = (torch.device(device).index or 0) + offset
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"device {device!r} with offset {offset} needs cuda:{index}, but torch sees {count} "
                         f"GPU{'s' if count != 1 else ''} (tensor_parallel_size x data_parallel_size GPUs are used)")
    return torch.device("cuda", index)


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """Whether this CPU has native bfloat16 matrix instructions (AVX-512 BF16 or AMX)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


_KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def resolve_kv_cache_dtype(kv_cache_dtype: str) -> torch.dtype | None:
    """The KV cache's fp8 dtype, or None for "auto" (the model's dtype)."""
    return _KV_CACHE_DTYPES.get(kv_cache_dtype)


def attention_shape(model_config, dtype: torch.dtype) -> AttentionShape:
    """What the attention backend must handle for this model (a ModelConfig) in ``dtype``."""
    return AttentionShape(dtype, model_config.head_dim, model_config.num_attention_heads,
                          model_config.num_key_value_heads,
                          window_or_softcap=model_config.sliding_layers is not None
                          or model_config.attn_logit_softcapping is not None)


def resolve_dtype(dtype: str, device: torch.device, quantized_weights: bool = False) -> torch.dtype:
    """"auto" is bfloat16 on CUDA, on CPUs with native bf16, and where the linear weights run
    through Pagoda's quantized kernel (``quantized_weights``: it takes bf16 activations on any
    x86 CPU, and the one-call forward step runs in bf16 only); float32 elsewhere, where dense
    bf16 products would take torch's slow fallback."""
    if dtype == "auto":
        if device.type == "cuda" or cpu_has_fast_bf16() or (device.type == "cpu" and quantized_weights):
            return torch.bfloat16
        return torch.float32
    return _DTYPES[dtype]
