"""The data-parallel router: which replica a new request goes to.

It reads only each replica's scheduler (its load and its prefix cache), so the engine's
replicas and the simulator's (``pagoda simulate``) route with the same code.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pagoda.engine.core.scheduler import Scheduler


class HasScheduler(Protocol):
    """A replica as the router sees it."""

    @property
    def scheduler(self) -> Scheduler: ...


@dataclass(slots=True)
class RouterStats:
    """How requests were routed.

    Attributes:
        num_routed: Requests routed.
        num_by_prefix: Sent to the replica holding their longest cached prefix.
        per_replica: Requests sent to each replica.
    """

    num_routed: int = 0
    num_by_prefix: int = 0
    per_replica: list[int] | None = None


class Router:
    """Picks a replica for each request (see the module docstring).

    Args:
        replicas: The engines.
        slack: Extra load (requests) a replica may carry over the least loaded one and
            still get a request for its cached prefix; None: a quarter of the least
            load, at least 2.
    """

    def __init__(self, replicas: Sequence[HasScheduler], slack: int | None = None) -> None:
        self.replicas = replicas
        self.slack = slack
        self.stats = RouterStats(per_replica=[0] * len(replicas))
        self._round_robin = itertools.cycle(range(len(replicas)))

    def route(self, prompt_token_ids: list[int], cache_salt: str | None = None) -> int:
        loads = [r.scheduler.num_running + r.scheduler.num_waiting for r in self.replicas]
        cached = [r.scheduler.kv_cache_manager.num_cached_prefix_tokens(prompt_token_ids, cache_salt)
                  for r in self.replicas]
        least = min(loads)
        slack = self.slack if self.slack is not None else max(2, least // 4)
        best = max(range(len(self.replicas)), key=lambda i: (cached[i], -loads[i]))
        if cached[best] > 0 and loads[best] <= least + slack:
            self.stats.num_by_prefix += 1
            choice = best
        else:
            # NOTE: among equally loaded replicas, take turns.
            choice = next(i for i in self._round_robin if loads[i] == least)
        self.stats.num_routed += 1
        self.stats.per_replica[choice] += 1
        return choice
