"""The built-in policies, registered as plugins like any third-party one.

Scheduling: ``fcfs`` (default), ``priority`` and ``shortest-prompt-first``.
Eviction: ``lru`` (default) and ``retention-priority``.
Preemption mode: the chooser in ``plugins.preemption``.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagoda.plugins import hookimpl
from pagoda.plugins.eviction import Evictor, LRUEvictor, RetentionPriorityEvictor
from pagoda.plugins.preemption import choose_preemption_mode
from pagoda.plugins.views import KVCacheView, RequestView

FCFS = "fcfs"
PRIORITY = "priority"
SHORTEST_PROMPT_FIRST = "shortest-prompt-first"
LRU = "lru"
RETENTION_PRIORITY = "retention-priority"


class BuiltinPolicies:
    """fcfs, priority and shortest-prompt-first scheduling; lru and retention eviction."""

    @hookimpl
    def pagoda_scheduling_policies(self) -> list[str]:
        return [FCFS, PRIORITY, SHORTEST_PROMPT_FIRST]

    @hookimpl
    def pagoda_eviction_policies(self) -> list[str]:
        return [LRU, RETENTION_PRIORITY]

    @hookimpl(trylast=True)
    def pagoda_request_sort_key(self, policy: str, request: RequestView) -> tuple | None:
        if policy == FCFS:
            return (request.arrival_time,)
        if policy == PRIORITY:
            return (request.priority, request.arrival_time)
        if policy == SHORTEST_PROMPT_FIRST:
            return (request.num_prompt_tokens, request.arrival_time)
        return None

    @hookimpl(trylast=True)
    def pagoda_select_victim(self, policy: str, running: Sequence[RequestView], needing: RequestView,
                             needing_is_running: bool) -> RequestView | None:
        if policy in (FCFS, SHORTEST_PROMPT_FIRST):
            # The most recently admitted; a waiting request never preempts.
            return running[-1] if needing_is_running else None
        if policy == PRIORITY:
            # The lowest priority (largest value), latest arrival among equals ...
            victim = max(running, key=lambda r: (r.priority, r.arrival_time))
            if needing_is_running:
                return victim
            # ... and a waiting request preempts only a strictly lower priority.
            return victim if victim.priority > needing.priority else None
        return None

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
