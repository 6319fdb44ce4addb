"""Read-only views that hooks receive instead of the engine's objects.

A plugin depends on these alone; the engine can change its internals freely.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol


class _RequestLike(Protocol):
    request_id: str
    priority: int
    kv_retention: int
    num_computed_tokens: int
    max_tokens: int
    client: str | None
    lora: object | None


class RequestView:
    """What a policy may know about a request. All attributes are read-only."""

    __slots__ = ("_request",)

    def __init__(self, request: _RequestLike) -> None:
        self._request = request

    @property
    def request_id(self) -> str:
        """The engine's id of the request (one sample of it when ``n`` > 1)."""
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
    def client(self) -> str | None:
        """Who sent it, for per-client policies (fair): the server's client key (a hash of
        the API key, the --client-header value, or the address); None offline."""
        return self._request.client

    @property
    def lora_name(self) -> str | None:
        """The LoRA adapter it runs with (its name), None for the base model; a policy may
        group requests by it."""
        lora = self._request.lora
        return None if lora is None else lora.name

    @property
    def arrival_time(self) -> float:
        """When it arrived, in ``time.time()`` seconds (fcfs orders by it)."""
        return self._request.metrics.arrival_time

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens of its prompt."""
        return len(self._request.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens it has generated so far."""
        return len(self._request.output_token_ids)

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose keys and values are in the KV cache (what a recompute would redo)."""
        return self._request.num_computed_tokens

    @property
    def max_tokens(self) -> int:
        """Most tokens it may generate (its max_tokens, clamped to the context left)."""
        return self._request.max_tokens

    @property
    def num_preemptions(self) -> int:
        """Times it was preempted so far."""
        return self._request.metrics.num_preemptions

    @property
    def status(self) -> str:
        """``WAITING``, ``RUNNING``, ``PREEMPTED`` or a ``FINISHED_*`` name."""
        return self._request.status.name

    def __repr__(self) -> str:
        return f"RequestView({self.request_id!r}, priority={self.priority})"


@dataclass(frozen=True, slots=True)
class KVCacheView:
    """The KV cache as a preemption-mode chooser sees it.

    Attributes:
        block_size: Tokens per block.
        num_free_blocks: Free blocks of the (device) cache now.
        num_free_cpu_blocks: Free blocks of the CPU swap space now.
        victim_num_blocks: Blocks the victim holds (what a swap would copy out).
    """

    block_size: int
    num_free_blocks: int
    num_free_cpu_blocks: int
    victim_num_blocks: int


@dataclass(frozen=True, slots=True)
class StepView:
    """A finished step, for observers.

    Attributes:
        step_id: The step's number (increasing).
        num_scheduled_tokens: Tokens the step computed, over every request.
        num_running: Requests running after it.
        num_waiting: Requests waiting after it.
        num_preemptions: Preemptions so far, over the engine's life.
        kv_cache_usage: Fraction of KV blocks in use after it (1 = all).
        scheduled: Tokens the step computed per request id (read-only; the fair policy
            counts each client's service with it).
        client_of: The client of a request id in ``scheduled`` (RequestView.client).
    """

    step_id: int
    num_scheduled_tokens: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    kv_cache_usage: float
    scheduled: Mapping[str, int] = field(default_factory=dict)
    client_of: Callable[[str], str | None] = lambda request_id: None


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """A data-parallel replica as a routing policy sees it, for one request.

    Attributes:
        index: The replica's number (what the routing hook returns).
        num_running: Requests running on it.
        num_waiting: Requests waiting on it.
        kv_cache_usage: Fraction of its KV blocks in use (1 = all).
        cached_prefix_tokens: Leading tokens of the request's prompt its prefix cache holds now.
    """

    index: int
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    cached_prefix_tokens: int
