"""Pagoda's hook specifications: the public plugin API.

A plugin is a module or object with functions marked ``@hookimpl`` whose names match the
specs below. Hooks are called with keyword arguments only, run synchronously inside the
engine's step loop, and must be cheap: a policy hook runs once per waiting request, or
once per preemption, never per token. They receive read-only views
(``plugins.views``), never the engine's own objects.

Scheduling hooks take the active policy's name (``--scheduling-policy``) and return None
when the name is not theirs, so several policies can be installed at once and the user
picks one. Decision hooks stop at the first non-None result.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from plugins.admission import RetryLater
    from plugins.eviction import Evictor
    from plugins.views import KVCacheView, RequestView, StepView

PROJECT_NAME = "pagoda"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)


@hookspec
def pagoda_scheduling_policies() -> list[str]:
    """Names of the scheduling policies this plugin implements (for --scheduling-policy)."""


@hookspec
def pagoda_eviction_policies() -> list[str]:
    """Names of the eviction policies this plugin implements (for --eviction-policy)."""


@hookspec(firstresult=True)
def pagoda_request_sort_key(policy: str, request: RequestView) -> tuple | None:
    """Orders the waiting queue: requests with smaller keys are admitted first.

    Called once each time a request enters the waiting queue (on arrival, and again
    when it is preempted), not on every step. A preempted request keeps its place ahead
    of later arrivals as long as its key does not change (fcfs keys by arrival time).

    Args:
        policy: The active scheduling policy's name.
        request: The request.

    Returns:
        A sortable tuple, or None if ``policy`` is not this plugin's.
        Stops at first non-None result.
    """


@hookspec(firstresult=True)
def pagoda_select_victim(policy: str, running: Sequence[RequestView], needing: RequestView) -> RequestView | None:
    """Picks the running request to preempt so that ``needing`` can proceed.

    Called when a running request cannot get a KV block (``needing`` is then running,
    and may be its own victim), and when the first waiting request cannot be admitted
    (``needing`` is then waiting: returning None means it waits).

    Args:
        policy: The active scheduling policy's name.
        running: Running requests in admission order.
        needing: The request that needs memory or a running slot.

    Returns:
        One of ``running`` or, for a waiting ``needing``, None to preempt nothing.
        Stops at first non-None result.
    """


@hookspec(firstresult=True)
def pagoda_preemption_mode(victim: RequestView, kv_cache: KVCacheView) -> str | None:
    """Chooses how a victim is preempted: "swap" (to the CPU swap space) or "recompute".

    Only asked when the engine runs with ``--preemption-mode auto``.
    Stops at first non-None result.
    """


@hookspec(firstresult=True)
def pagoda_make_evictor(policy: str) -> Evictor | None:
    """Builds the object that orders cached free blocks for eviction.

    Called once when the KV cache is built, with the ``--eviction-policy`` name. The
    evictor is then told about every cached block that becomes free and asked which to
    evict (see ``plugins.eviction.Evictor``).
    Stops at first non-None result.
    """


@hookspec(firstresult=True)
def pagoda_admit_request(request: RequestView, num_waiting: int, num_running: int) -> str | RetryLater | None:
    """Accepts or rejects a new request before it is queued (quotas, rate limits).

    Args:
        request: The new request (each of its ``n`` samples is admitted with it).
        num_waiting: Requests waiting in the engine now.
        num_running: Requests running in the engine now.

    Returns:
        None to accept; a reason string to refuse for good (the caller sees it; HTTP
        403, code ``request_rejected``, which clients do not retry); or
        ``plugins.RetryLater(reason, retry_after)`` for a temporary refusal such as a
        rate limit (HTTP 429 with ``Retry-After``, code ``rate_limited``).
        Stops at first non-None result. If a plugin raises, the request is refused with
        HTTP 500 (code ``admission_plugin_failed``): letting it through could break a quota.
    """


@hookspec
def pagoda_request_finished(request: RequestView, finish_reason: str) -> None:
    """Observes a request that finished ("stop", "length", "abort" or "error")."""


@hookspec
def pagoda_step_finished(step: StepView) -> None:
    """Observes a finished engine step."""
