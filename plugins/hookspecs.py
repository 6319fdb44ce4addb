"""Pagoda's hook specifications: the public plugin API.

A plugin is a module or object with functions marked ``@hookimpl`` whose names match the
specs below. Hooks are called with keyword arguments only, run synchronously inside the
engine's step loop, and must be cheap: a policy hook runs once per waiting request, or
once per preemption, never per token. They receive read-only views
(``plugins.views``), never the engine's own objects.

Scheduling policies are objects (``plugins.scheduling.SchedulingPolicy``) registered by name:
several can be installed at once, the user picks one (``--scheduling-policy``), and only that
one's code runs. Decision hooks stop at the first non-None result.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from pagoda.plugins.admission import RetryLater
    from pagoda.plugins.eviction import Evictor
    from pagoda.plugins.scheduling import PolicyFactory
    from pagoda.plugins.views import KVCacheView, ReplicaView, RequestView, StepView

PROJECT_NAME = "pagoda"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)


@hookspec
def pagoda_scheduling_policies() -> dict[str, PolicyFactory]:
    """The scheduling policies this plugin implements, by name.

    Called once at start-up. ``--scheduling-policy`` must name one that some plugin (or the
    built-ins: fcfs, priority, shortest-prompt-first, fair) registers, or the engine refuses
    to start; the engine then calls that name's factory once and its scheduler holds the
    object (a ``plugins.scheduling.SchedulingPolicy``) for its life.

    Returns:
        ``{name: factory}``: a factory takes no arguments (a SchedulingPolicy subclass is
        one). Two plugins registering one name is an error at start-up.
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


@hookspec(firstresult=True)
def pagoda_route_request(prompt_token_ids: list[int], replicas: list[ReplicaView]) -> int | None:
    """Chooses the data-parallel replica a new request goes to (``--data-parallel-size`` above 1).

    Args:
        prompt_token_ids: The request's prompt.
        replicas: The replicas that serve (a dead one is left out), with their load and how
            much of this prompt each one's prefix cache holds.

    Returns:
        The ``index`` of one of ``replicas``, or None to leave it to others. Stops at first
        non-None result. The built-in router answers when none does: the replica holding the
        longest cached prefix while its load is within a slack of the least loaded one's, else
        the least loaded (in turns). An index not among ``replicas``, or a plugin that raises,
        falls back to it (logged once, counted).
    """
