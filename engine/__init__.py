"""Pagoda's engine: paged KV cache, scheduler, worker and the offline LLM API."""

from engine.config import EngineConfig
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams


def __getattr__(name: str):
    # NOTE: lazy, so that importing engine.config in the worker does not pull in
    # the whole engine.
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "AsyncEngine":
        from engine.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(name)


__all__ = ["LLM", "AsyncEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput"]
