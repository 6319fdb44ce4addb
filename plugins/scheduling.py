"""Scheduling policies: objects registered by name.

A scheduling policy decides in what order waiting requests are admitted and which running
request is preempted when memory or a sequence slot runs out. A plugin registers its policies
with the ``pagoda_scheduling_policies`` hook, which returns ``{name: factory}``; the engine calls
the factory of the policy that ``--scheduling-policy`` names once, and its scheduler holds that
one object for its life: the policy's state (the fair policy's counters) is its own, and no
other policy's code runs.

Subclass :class:`SchedulingPolicy` and override what differs: the base class is first come,
first served.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pagoda.plugins.views import RequestView, StepView


class SchedulingPolicy:
    """First come, first served; the base of every scheduling policy.

    Every method runs synchronously inside the engine's step loop: keep them cheap.

    Attributes:
        keys_change: Whether a waiting request's key moves while it waits (the fair policy's
            does, as clients are served): the engine then asks ``sort_key`` again for every
            waiting request before each step's admission. False: asked once per enqueue.
    """

    keys_change: bool = False

    def sort_key(self, request: RequestView) -> tuple:
        """The waiting queue's key of ``request``: smaller keys are admitted first.

        Asked when a request enters the waiting queue (on arrival, and again when it is
        preempted), and before every step for every waiting request when ``keys_change``.
        """
        return (request.arrival_time,)

    def select_victim(self, running: Sequence[RequestView], needing: RequestView,
                      needing_is_running: bool) -> RequestView | None:
        """The running request to preempt so that ``needing`` can proceed.

        Args:
            running: Running requests in admission order (the last admitted last).
            needing: The request that lacks a KV block (``needing_is_running``: it is one of
                ``running`` and may be its own victim) or, when it is the first waiting
                request, a block or a sequence slot.

        Returns:
            One of ``running``; for a waiting ``needing``, None lets it wait. The base class
            preempts the most recently admitted, and never for a waiting request.
        """
        return running[-1] if needing_is_running else None

    def request_finished(self, request: RequestView, finish_reason: str) -> None:
        """Observes a request (one sample when ``n`` > 1) that ended."""

    def step_finished(self, step: StepView) -> None:
        """Observes a finished step."""


#: What a plugin's ``pagoda_scheduling_policies`` maps each name to.
PolicyFactory = Callable[[], SchedulingPolicy]
