"""Attention backends behind one interface, chosen by name.

The registry maps names to factories that import lazily, so that a backend whose
dependencies are missing (triton, flashinfer) costs nothing until it is asked for.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from attention_backends.base import AttentionBackend, AttentionMetadata


def _naive() -> type[AttentionBackend]:
    from attention_backends.naive import NaiveAttentionBackend

    return NaiveAttentionBackend


def _torch_sdpa() -> type[AttentionBackend]:
    from attention_backends.torch_sdpa import TorchSdpaAttentionBackend

    return TorchSdpaAttentionBackend


def _cpu_paged() -> type[AttentionBackend]:
    from attention_backends.cpu_paged import CpuPagedAttentionBackend

    return CpuPagedAttentionBackend


SUPPORTED_ATTENTION_BACKENDS: dict[str, Callable[[], type[AttentionBackend]]] = {
    "naive": _naive,
    "torch_sdpa": _torch_sdpa,
    "cpu_paged": _cpu_paged,
}

# Fastest first: "auto" takes the first that is available on the device.
_AUTO_ORDER = ("flashinfer", "triton", "cpu_paged", "torch_sdpa", "naive")


def get_attention_backend(name: str, device: torch.device) -> type[AttentionBackend]:
    """Returns the backend class called ``name`` ("auto": the fastest available).

    Raises:
        ValueError: The name is unknown or the backend cannot run on ``device``.
    """
    if name == "auto":
        for candidate in _AUTO_ORDER:
            factory = SUPPORTED_ATTENTION_BACKENDS.get(candidate)
            if factory is None:
                continue
            try:
                backend = factory()
            except ImportError:
                continue
            if backend.is_available(device):
                return backend
        raise ValueError(f"no attention backend is available on {device}")
    if name not in SUPPORTED_ATTENTION_BACKENDS:
        known = ", ".join(sorted(SUPPORTED_ATTENTION_BACKENDS))
        raise ValueError(f"unknown attention backend {name!r}; known: auto, {known}")
    backend = SUPPORTED_ATTENTION_BACKENDS[name]()
    if not backend.is_available(device):
        raise ValueError(f"attention backend {name!r} cannot run on {device}")
    return backend


__all__ = ["AttentionBackend", "AttentionMetadata", "SUPPORTED_ATTENTION_BACKENDS", "get_attention_backend"]
