"""Pagoda: an LLM inference engine built on PagedAttention.

``from pagoda import LLM, SamplingParams`` for offline generation; ``pagoda serve`` (or
``python -m pagoda serve``) for the OpenAI-compatible server; ``from pagoda.plugins import
hookimpl`` to write a plugin. The package's folders are the repository's top-level ones
(``engine/`` is ``pagoda.engine``, and so on; see docs/architecture.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagoda.engine.cpu_affinity import record_process_cpus

# NOTE: before anything of Pagoda's imports torch, whose OpenMP may bind this thread to one CPU
# (see engine/cpu_affinity.py).
record_process_cpus()

if TYPE_CHECKING:
    from pagoda.engine.config import EngineConfig
    from pagoda.engine.frontend.async_engine import AsyncEngine
    from pagoda.engine.frontend.llm import LLM
    from pagoda.engine.lora import LoRARequest
    from pagoda.engine.outputs import CompletionOutput, RequestOutput
    from pagoda.engine.sampling_params import SamplingParams

# NOTE: lazy, so that `import pagoda.plugins` (a plugin) or the worker's imports do not pull
# in the whole engine, and torch, for names they never use.
_EXPORTS = {
    "LLM": "pagoda.engine.frontend.llm",
    "AsyncEngine": "pagoda.engine.frontend.async_engine",
    "EngineConfig": "pagoda.engine.config",
    "SamplingParams": "pagoda.engine.sampling_params",
    "RequestOutput": "pagoda.engine.outputs",
    "CompletionOutput": "pagoda.engine.outputs",
    "LoRARequest": "pagoda.engine.lora",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pagoda' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = list(_EXPORTS)
