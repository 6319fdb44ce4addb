"""Attention backends behind one interface, chosen by name.

The registry maps names to factories that import lazily, so that a backend whose
dependencies are missing (triton, flashinfer) costs nothing until it is asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagoda.attention_backends.base import AttentionBackend, AttentionMetadata


def _naive() -> type[AttentionBackend]:
    from pagoda.attention_backends.naive import NaiveAttentionBackend

    return NaiveAttentionBackend


def _torch_sdpa() -> type[AttentionBackend]:
    from pagoda.attention_backends.torch_sdpa import TorchSdpaAttentionBackend

    return TorchSdpaAttentionBackend


def _cpu_paged() -> type[AttentionBackend]:
    from pagoda.attention_backends.cpu_paged import CpuPagedAttentionBackend

    return CpuPagedAttentionBackend


def _triton() -> type[AttentionBackend]:
    from pagoda.attention_backends.triton_attention import TritonAttentionBackend

    return TritonAttentionBackend


def _flashinfer() -> type[AttentionBackend]:
    from pagoda.attention_backends.flashinfer_attention import FlashInferAttentionBackend

    return FlashInferAttentionBackend


SUPPORTED_ATTENTION_BACKENDS: dict[str, Callable[[], type[AttentionBackend]]] = {
    "naive": _naive,
    "torch_sdpa": _torch_sdpa,
    "cpu_paged": _cpu_paged,
    "triton": _triton,
    "flashinfer": _flashinfer,
}

# Fastest first, per device type: "auto" takes the first that is available.
AUTO_ORDER = {
    "cuda": ("flashinfer", "triton", "torch_sdpa", "naive"),
    "cpu": ("cpu_paged", "torch_sdpa", "naive"),
}


@dataclass(frozen=True, slots=True)
class AttentionShape:
    """What a backend must attend: the model's dtype and heads (one rank's, under tensor
    parallelism: the group of query heads per KV head is the same)."""

    dtype: torch.dtype
    head_dim: int
    num_heads: int
    num_kv_heads: int
    # Layers with a sliding window, or soft-capped scores (Gemma, and Mistral or Phi-3 served
    # past their window): only backends that support_window_and_softcap run them.
    window_or_softcap: bool = False


def get_attention_backend(name: str, device: torch.device, kv_cache_dtype: torch.dtype | None = None,
                          shape: AttentionShape | None = None) -> type[AttentionBackend]:
    """Returns the backend class called ``name`` ("auto": the fastest available that stores
    the cache in ``kv_cache_dtype``, an fp8 dtype (None: the model's own), and attends in
    ``shape``'s dtype and heads (None: not checked)).

    Raises:
        ValueError: The name is unknown or the backend cannot run on ``device``, with that
            cache dtype or that shape (the message says why).
    """
    def stores(backend: type[AttentionBackend]) -> bool:
        return kv_cache_dtype is None or kv_cache_dtype in backend.fp8_kv_cache

    def shape_problem(backend: type[AttentionBackend]) -> str | None:
        if shape is None:
            return None
        if shape.window_or_softcap and not backend.supports_window_and_softcap:
            return ("its layers have sliding windows, or soft-capped scores, which this backend does not run "
                    "(cpu_paged, naive and triton do)")
        if shape.window_or_softcap:
            return backend.shape_problem(shape.dtype, shape.head_dim, shape.num_heads, shape.num_kv_heads,
                                         window_or_softcap=True)
        return backend.shape_problem(shape.dtype, shape.head_dim, shape.num_heads, shape.num_kv_heads)

    if name == "auto":
        for candidate in AUTO_ORDER.get(device.type, ("torch_sdpa", "naive")):
            backend = SUPPORTED_ATTENTION_BACKENDS[candidate]()
            if backend.is_available(device) and stores(backend) and shape_problem(backend) is None:
                return backend
        wanted = "" if kv_cache_dtype is None else f" with a {str(kv_cache_dtype).removeprefix('torch.')} KV cache"
        raise ValueError(f"no attention backend is available on {device}{wanted}")
    if name not in SUPPORTED_ATTENTION_BACKENDS:
        known = ", ".join(sorted(SUPPORTED_ATTENTION_BACKENDS))
        raise ValueError(f"unknown attention backend {name!r}; known: auto, {known}")
    backend = SUPPORTED_ATTENTION_BACKENDS[name]()
    if not backend.is_available(device):
        raise ValueError(f"attention backend {name!r} cannot run on {device}: {backend.unavailable_reason(device)}")
    problem = shape_problem(backend)
    if problem is not None:
        raise ValueError(f"attention backend {name!r} cannot run this model: {problem}")
    if not stores(backend):
        able = [n for n, factory in SUPPORTED_ATTENTION_BACKENDS.items() if kv_cache_dtype in factory().fp8_kv_cache]
        raise ValueError(f"attention backend {name!r} does not support a {str(kv_cache_dtype).removeprefix('torch.')} "
                         f"KV cache (kv_cache_dtype); backends that do: {', '.join(able)}")
    return backend


__all__ = ["AttentionBackend", "AttentionMetadata", "AttentionShape", "SUPPORTED_ATTENTION_BACKENDS",
           "get_attention_backend"]
