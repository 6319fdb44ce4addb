"""The built-in policies, registered as a plugin like any third-party one.

Scheduling: ``fcfs`` (default), ``priority``, ``shortest-prompt-first`` and ``fair``
(plugins/fair.py).
Eviction: ``lru`` (default) and ``retention-priority``.
Preemption mode: the chooser in ``plugins.preemption``.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagoda.plugins import hookimpl
from pagoda.plugins.eviction import Evictor, LRUEvictor, RetentionPriorityEvictor
from pagoda.plugins.fair import FAIR, FairShare
from pagoda.plugins.preemption import choose_preemption_mode
from pagoda.plugins.scheduling import PolicyFactory, SchedulingPolicy
from pagoda.plugins.views import KVCacheView, RequestView

FCFS = "fcfs"
PRIORITY = "priority"
SHORTEST_PROMPT_FIRST = "shortest-prompt-first"
LRU = "lru"
RETENTION_PRIORITY = "retention-priority"


class Priority(SchedulingPolicy):
    """Lower ``priority`` first, ties by arrival. The victim is the lowest priority (the latest
    arrival among equals); a waiting request preempts only a strictly lower priority."""

    def sort_key(self, request: RequestView) -> tuple:
        return (request.priority, request.arrival_time)

    def select_victim(self, running: Sequence[RequestView], needing: RequestView,
                      needing_is_running: bool) -> RequestView | None:
        victim = max(running, key=lambda r: (r.priority, r.arrival_time))
        if needing_is_running or victim.priority > needing.priority:
            return victim
        return None


class ShortestPromptFirst(SchedulingPolicy):
    """Fewest prompt tokens first, ties by arrival; victims as fcfs."""

    def sort_key(self, request: RequestView) -> tuple:
        return (request.num_prompt_tokens, request.arrival_time)


class BuiltinPolicies:
    """The built-in scheduling policies, lru and retention eviction, the preemption-mode chooser."""

    @hookimpl
    def pagoda_scheduling_policies(self) -> dict[str, PolicyFactory]:
        return {FCFS: SchedulingPolicy, PRIORITY: Priority, SHORTEST_PROMPT_FIRST: ShortestPromptFirst,
                FAIR: FairShare}

    @hookimpl
    def pagoda_eviction_policies(self) -> list[str]:
        return [LRU, RETENTION_PRIORITY]

    @hookimpl(trylast=True)
    def pagoda_preemption_mode(self, victim: RequestView, kv_cache: KVCacheView) -> str | None:
        return choose_preemption_mode(num_computed_tokens=victim.num_computed_tokens,
                                      num_blocks=kv_cache.victim_num_blocks,
                                      num_free_cpu_blocks=kv_cache.num_free_cpu_blocks)

    @hookimpl(trylast=True)
    def pagoda_make_evictor(self, policy: str) -> Evictor | None:
        if policy == LRU:
            return LRUEvictor()
        if policy == RETENTION_PRIORITY:
            return RetentionPriorityEvictor()
        return None
