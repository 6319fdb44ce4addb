"""Policy: the scheduler's one door to its scheduling policy and the plugin hooks, with a safety net.

The scheduling policy is one object, built once from the factory registered under
``--scheduling-policy`` (plugins/scheduling.py). A plugin that raises must not bring the
engine loop down: each decision falls back to the built-in one of the same kind (fcfs for
scheduling, lru for eviction) when the policy or a hook raises or answers something
unusable; the error is logged (once per method or hook) and counted in
``num_plugin_errors``. Observers that raise are logged and skipped. The admission hook is
the exception: if it raises, the request is rejected with the plugin's error, since letting
it through could break a quota.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pluggy

from pagoda.engine.core.plugin_manager import check_policy_names, create_plugin_manager, \
    scheduling_policy_factories
from pagoda.engine.exceptions import AdmissionPluginFailed, RequestRejected
from pagoda.plugins.admission import RetryLater
from pagoda.plugins.builtin import FCFS, LRU, BuiltinPolicies
from pagoda.plugins.eviction import Evictor
from pagoda.plugins.scheduling import SchedulingPolicy
from pagoda.plugins.views import KVCacheView, RequestView, StepView

logger = logging.getLogger(__name__)


class Policy:
    """Holds the chosen scheduling policy and calls the plugin hooks.

    Args:
        pm: The engine's plugin manager (None: built-ins only).
        scheduling_policy: The registered name of the scheduling policy.
        eviction_policy: Name passed to pagoda_make_evictor.

    Raises:
        ValueError: An unknown policy name (the message lists the known ones), or a factory
            that fails or does not build a SchedulingPolicy.
    """

    def __init__(self, pm: pluggy.PluginManager | None = None, scheduling_policy: str = FCFS,
                 eviction_policy: str = LRU) -> None:
        if pm is None:
            pm = create_plugin_manager(load_entry_points=False)
        check_policy_names(pm, scheduling_policy, eviction_policy)
        self.pm = pm
        self.hook = pm.hook
        self.scheduling_policy = scheduling_policy
        self.eviction_policy = eviction_policy
        self._builtin = BuiltinPolicies()
        self._fcfs = SchedulingPolicy()
        try:
            self.scheduling = scheduling_policy_factories(pm)[scheduling_policy]()
        except Exception as exc:
            raise ValueError(f"scheduling policy {scheduling_policy!r} could not be built: {exc!r}") from exc
        if not isinstance(self.scheduling, SchedulingPolicy):
            raise ValueError(f"scheduling policy {scheduling_policy!r}: its factory built {self.scheduling!r}, "
                             f"not a pagoda.plugins.scheduling.SchedulingPolicy")
        self.num_plugin_errors = 0
        self._logged: set[str] = set()
        #: The waiting queue's keys are asked for again before each step's admission.
        self.sort_keys_change = bool(self.scheduling.keys_change)
        #: A plugin routes requests between data-parallel replicas (pagoda_route_request).
        self.routes = bool(pm.hook.pagoda_route_request.get_hookimpls())

    def _failed(self, where: str, exc: BaseException | None, detail: str = "") -> None:
        self.num_plugin_errors += 1
        if where not in self._logged:
            self._logged.add(where)
            logger.error("%s failed%s; using the built-in choice (logged once)", where,
                         f" ({detail})" if detail else "", exc_info=exc)

    def route_request(self, prompt_token_ids: list[int], replicas: list) -> int | None:
        """A routing plugin's choice among ``replicas`` (ReplicaViews), or None for the built-in one."""
        try:
            choice = self.hook.pagoda_route_request(prompt_token_ids=prompt_token_ids, replicas=replicas)
        except Exception as exc:
            self._failed("plugin hook pagoda_route_request", exc)
            return None
        if choice is None:
            return None
        if not any(view.index == choice for view in replicas):
            self._failed("plugin hook pagoda_route_request", None, f"it chose {choice!r}, not a serving replica")
            return None
        return choice

    def sort_key(self, request: RequestView) -> tuple:
        """The waiting queue's key for ``request``; fcfs's when the policy fails."""
        try:
            return tuple(self.scheduling.sort_key(request))
        except Exception as exc:
            self._failed(f"scheduling policy {self.scheduling_policy!r}: sort_key", exc)
        return self._fcfs.sort_key(request)

    def select_victim(self, running: Sequence[RequestView], needing: RequestView,
                      needing_is_running: bool) -> RequestView | None:
        """A running request to preempt for ``needing``; never None when ``needing`` runs."""
        where = f"scheduling policy {self.scheduling_policy!r}: select_victim"
        try:
            victim = self.scheduling.select_victim(running, needing, needing_is_running)
            if victim is None and not needing_is_running:
                return None
            if victim is not None and any(r is victim for r in running):
                return victim
            self._failed(where, None, f"returned {victim!r}, not a running request")
        except Exception as exc:
            self._failed(where, exc)
        return self._fcfs.select_victim(running, needing, needing_is_running)

    def preemption_mode(self, victim: RequestView, kv_cache: KVCacheView) -> str:
        try:
            mode = self.hook.pagoda_preemption_mode(victim=victim, kv_cache=kv_cache)
            if mode in ("swap", "recompute"):
                return mode
            self._failed("plugin hook pagoda_preemption_mode", None, f"returned {mode!r}")
        except Exception as exc:
            self._failed("plugin hook pagoda_preemption_mode", exc)
        return self._builtin.pagoda_preemption_mode(victim, kv_cache)

    def make_evictor(self) -> Evictor:
        try:
            evictor = self.hook.pagoda_make_evictor(policy=self.eviction_policy)
            if evictor is not None:
                return evictor
            self._failed("plugin hook pagoda_make_evictor", None, "no plugin answered")
        except Exception as exc:
            self._failed("plugin hook pagoda_make_evictor", exc)
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
            self.scheduling.request_finished(request, finish_reason)
        except Exception as exc:
            self._failed(f"scheduling policy {self.scheduling_policy!r}: request_finished", exc)
        try:
            self.hook.pagoda_request_finished(request=request, finish_reason=finish_reason)
        except Exception as exc:
            self._failed("plugin hook pagoda_request_finished", exc)

    def step_finished(self, step: StepView) -> None:
        try:
            self.scheduling.step_finished(step)
        except Exception as exc:
            self._failed(f"scheduling policy {self.scheduling_policy!r}: step_finished", exc)
        try:
            self.hook.pagoda_step_finished(step=step)
        except Exception as exc:
            self._failed("plugin hook pagoda_step_finished", exc)
