"""Read-only views that hooks receive instead of the engine's objects.

A plugin depends on these alone; the engine can change its internals freely.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class _RequestLike(Protocol):
    request_id: str
    priority: int
    kv_retention: int
    num_computed_tokens: int
    max_tokens: int


class RequestView:
    """What a policy may know about a request. All attributes are read-only."""

    __slots__ = ("_request",)

    def __init__(self, request: _RequestLike) -> None:
        self._request = request

    @property
    def request_id(self) -> str:
        return self._request.request_id

    @property
    def priority(self) -> int:
        """Lower runs first (under the priority policy)."""
        return self._request.priority

    @property
    def kv_retention(self) -> int:
        """Higher keeps the request's cached blocks longer (under retention eviction)."""
        return self._request.kv_retention

    @property
    def arrival_time(self) -> float:
        return self._request.metrics.arrival_time

    @property
    def num_prompt_tokens(self) -> int:
        return len(self._request.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._request.output_token_ids)

    @property
    def num_computed_tokens(self) -> int:
        return self._request.num_computed_tokens

    @property
    def max_tokens(self) -> int:
        return self._request.max_tokens

    @property
    def num_preemptions(self) -> int:
        return self._request.metrics.num_preemptions

    @property
    def status(self) -> str:
        return self._request.status.name

    def __repr__(self) -> str:
        return f"RequestView({self.request_id!r}, priority={self.priority})"


@dataclass(frozen=True, slots=True)
class KVCacheView:
    """The KV cache as a preemption-mode chooser sees it."""

    block_size: int
    num_free_blocks: int
    num_free_cpu_blocks: int
    victim_num_blocks: int


@dataclass(frozen=True, slots=True)
class StepView:
    """A finished step, for observers."""

    step_id: int
    num_scheduled_tokens: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    kv_cache_usage: float
