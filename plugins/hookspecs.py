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
    from pagoda.plugins.admission import RetryLater
    from pagoda.plugins.eviction import Evictor
    from pagoda.plugins.views import KVCacheView, RequestView, StepView

PROJECT_NAME = "pagoda"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)


@hookspec
def pagoda_scheduling_policies() -> list[str]:
    """Names of the scheduling policies this plugin implements.

    Called once at start-up; ``--scheduling-policy`` must name one that some plugin (or the
    built-ins: fcfs, priority, shortest-prompt-first) lists, or the engine refuses to start.

    Returns:
        The names (the lists of every plugin are merged).
    """


@hookspec
def pagoda_eviction_policies() -> list[str]:
    """Names of the eviction policies this plugin implements.

    Called once at start-up; ``--eviction-policy`` must name one that some plugin (or the
    built-ins: lru, retention-priority) lists.

    Returns:
        The names (the lists of every plugin are merged).
    """


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
        Stops at first non-None result. When no plugin answers, the request gets fcfs's
        key (its arrival time); when one raises, the error is logged once and counted, and
        the same fallback applies.
    """


@hookspec(firstresult=True)
def pagoda_sort_keys_change(policy: str) -> bool | None:
    """Says whether a scheduling policy's sort keys change while requests wait.

    A policy whose order depends on what has been served since a request was queued (fair
    share) answers True; the engine then asks pagoda_request_sort_key again for every
    waiting request before each step admits any. Asked once, at start-up.

    Args:
        policy: The scheduling policy's name.

    Returns:
        True to have keys asked again every step; None (the fallback: False) otherwise.
        Stops at the first non-None result.
    """


@hookspec(firstresult=True)
def pagoda_select_victim(policy: str, running: Sequence[RequestView], needing: RequestView,
                         needing_is_running: bool) -> RequestView | None:
    """Picks the running request to preempt so that ``needing`` can proceed.

    Called when a running request cannot get a KV block (``needing_is_running`` is True,
    and ``needing`` may be its own victim), and when the first waiting request cannot be
    admitted for lack of memory or of a running slot (``needing_is_running`` is False:
    returning None means it waits).

    Args:
        policy: The active scheduling policy's name.
        running: Running requests in admission order (the last admitted last).
        needing: The request that needs memory or a running slot.
        needing_is_running: Whether ``needing`` is one of ``running``.

    Returns:
        One of ``running``; or None: "not my policy", or, for a waiting ``needing``, "preempt
        nothing". Stops at first non-None result. When no plugin answers for a running
        ``needing``, the built-in choice applies (fcfs: the most recently admitted), silently:
        a policy may implement only a sort key. A plugin that raises or returns a request
        that is not running gets the same fallback, logged once and counted.
    """


@hookspec(firstresult=True)
def pagoda_preemption_mode(victim: RequestView, kv_cache: KVCacheView) -> str | None:
    """Chooses how a victim is preempted: "swap" (to the CPU swap space) or "recompute".

    Only asked when the engine runs with ``--preemption-mode auto``.

    Args:
        victim: The request being preempted.
        kv_cache: The cache's free blocks and the victim's share of it.

    Returns:
        "swap", "recompute", or None to leave it to others. Stops at first non-None result.
        The built-in chooser answers last (swap when the swap space has room and the victim
        has computed enough tokens that recomputing costs more than copying); anything else
        than the two names falls back to it, logged once and counted.
    """


@hookspec(firstresult=True)
def pagoda_make_evictor(policy: str) -> Evictor | None:
    """Builds the object that orders cached free blocks for eviction.

    Called once when the KV cache is built, with the ``--eviction-policy`` name. The
    evictor is then told about every cached block that becomes free and asked which to
    evict (see ``plugins.eviction.Evictor``).

    Args:
        policy: The active eviction policy's name.

    Returns:
        An Evictor, or None if ``policy`` is not this plugin's. Stops at first non-None
        result. When none answers, or one raises, the engine uses lru (logged once).
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
    """Observes a request (one sample of it when ``n`` > 1) that finished.

    Args:
        request: The request, as it finished.
        finish_reason: "stop", "length", "abort" (the client left or cancelled) or "error".

    Every plugin that implements it is called; one that raises is logged once, counted and
    skipped.
    """


@hookspec
def pagoda_step_finished(step: StepView) -> None:
    """Observes a finished engine step (once its results are applied).

    Args:
        step: What the step did and the engine's state after it.

    Every plugin that implements it is called, once per step: keep it cheap. One that raises
    is logged once, counted and skipped.
    """
