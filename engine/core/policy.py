"""Policy: the scheduler's one door to the plugin hooks, with a safety net.

A plugin that raises must not bring the engine loop down. Each decision hook falls back
to the built-in policy of the same kind when a plugin raises or returns something
unusable; the error is logged (once per hook) and counted in ``num_plugin_errors``.
Observer hooks that raise are logged and skipped. The admission hook is the exception:
if it raises, the request is rejected with the plugin's error, since letting it through
could break a quota.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pluggy

from pagoda.engine.exceptions import AdmissionPluginFailed, RequestRejected
from pagoda.plugins.admission import RetryLater
from pagoda.plugins.builtin import FCFS, LRU, BuiltinPolicies
from pagoda.plugins.eviction import Evictor
from pagoda.plugins.views import KVCacheView, RequestView, StepView

logger = logging.getLogger(__name__)


class Policy:
    """Calls the hooks for the chosen scheduling and eviction policies.

    Args:
        pm: The engine's plugin manager (None: built-ins only).
        scheduling_policy: Name passed to the scheduling hooks.
        eviction_policy: Name passed to pagoda_make_evictor.
    """

    def __init__(self, pm: pluggy.PluginManager | None = None, scheduling_policy: str = FCFS,
                 eviction_policy: str = LRU) -> None:
        if pm is None:
            from pagoda.engine.core.plugin_manager import create_plugin_manager

            pm = create_plugin_manager(load_entry_points=False)
        self.pm = pm
        self.hook = pm.hook
        self.scheduling_policy = scheduling_policy
        self.eviction_policy = eviction_policy
        self._builtin = BuiltinPolicies()
        self._fallback_policy = scheduling_policy if scheduling_policy in self._builtin.pagoda_scheduling_policies() else FCFS
        self.num_plugin_errors = 0
        self._logged: set[str] = set()
        #: The waiting queue's keys are asked for again before each step's admission.
        self.sort_keys_change = False
        try:
            self.sort_keys_change = bool(self.hook.pagoda_sort_keys_change(policy=scheduling_policy))
        except Exception as exc:
            self._failed("pagoda_sort_keys_change", exc)

    def _failed(self, hook: str, exc: BaseException | None, detail: str = "") -> None:
        self.num_plugin_errors += 1
        if hook not in self._logged:
            self._logged.add(hook)
            logger.error("plugin hook %s failed%s; using the built-in policy (logged once)", hook,
                         f" ({detail})" if detail else "", exc_info=exc)

    def sort_key(self, request: RequestView) -> tuple:
        """The waiting queue's key for ``request``; fcfs's when no plugin answers."""
        try:
            key = self.hook.pagoda_request_sort_key(policy=self.scheduling_policy, request=request)
            if key is not None:
                return tuple(key)
        except Exception as exc:
            self._failed("pagoda_request_sort_key", exc)
        return self._builtin.pagoda_request_sort_key(self._fallback_policy, request)

    def select_victim(self, running: Sequence[RequestView], needing: RequestView,
                      needing_is_running: bool) -> RequestView | None:
        """A running request to preempt for ``needing``; never None when ``needing`` runs.

        NOTE: no answer is no error: a policy that only orders the queue leaves victims to
        the built-in choice (fcfs: the most recently admitted, and waiting requests wait).
        """
        try:
            victim = self.hook.pagoda_select_victim(policy=self.scheduling_policy, running=running, needing=needing,
                                                    needing_is_running=needing_is_running)
            if victim is None and not needing_is_running:
                return None
            if victim is not None and any(r is victim for r in running):
                return victim
            if victim is not None:
                self._failed("pagoda_select_victim", None, f"returned {victim!r}, not a running request")
        except Exception as exc:
            self._failed("pagoda_select_victim", exc)
        return self._builtin.pagoda_select_victim(self._fallback_policy, running, needing, needing_is_running)

    def preemption_mode(self, victim: RequestView, kv_cache: KVCacheView) -> str:
        try:
            mode = self.hook.pagoda_preemption_mode(victim=victim, kv_cache=kv_cache)
            if mode in ("swap", "recompute"):
                return mode
            self._failed("pagoda_preemption_mode", None, f"returned {mode!r}")
        except Exception as exc:
            self._failed("pagoda_preemption_mode", exc)
        return self._builtin.pagoda_preemption_mode(victim, kv_cache)

    def make_evictor(self) -> Evictor:
        try:
            evictor = self.hook.pagoda_make_evictor(policy=self.eviction_policy)
            if evictor is not None:
                return evictor
            self._failed("pagoda_make_evictor", None, "no plugin answered")
        except Exception as exc:
            self._failed("pagoda_make_evictor", exc)
        return self._builtin.pagoda_make_evictor(LRU)

    def admit(self, request: RequestView, num_waiting: int, num_running: int) -> None:
        """Raises RequestRejected when a plugin turns the request away, AdmissionPluginFailed
        when it raises."""
        try:
            answer = self.hook.pagoda_admit_request(request=request, num_waiting=num_waiting,
                                                    num_running=num_running)
        except Exception as exc:
            logger.exception("admission plugin failed; rejecting the request")
            raise AdmissionPluginFailed(f"request rejected: the admission plugin failed ({exc!r})") from exc
        if answer is None:
            return
        if isinstance(answer, RetryLater):
            raise RequestRejected(f"request rejected: {answer.reason}", retry_after=answer.retry_after)
        raise RequestRejected(f"request rejected: {answer}")

    def request_finished(self, request: RequestView, finish_reason: str) -> None:
        try:
            self.hook.pagoda_request_finished(request=request, finish_reason=finish_reason)
        except Exception as exc:
            self._failed("pagoda_request_finished", exc)

    def step_finished(self, step: StepView) -> None:
        try:
            self.hook.pagoda_step_finished(step=step)
        except Exception as exc:
            self._failed("pagoda_step_finished", exc)
