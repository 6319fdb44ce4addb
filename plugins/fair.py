"""The ``fair`` scheduling policy: equal service for every backlogged client.

In the spirit of the Virtual Token Counter (Sheng et al., "Fairness in Serving Large
Language Models", OSDI '24): each client (the server's client key: a hash of its API key,
the value of ``--client-header``, or its address) has a counter of the service it got,
the tokens the engine computed for it (prompt tokens prefilled, output tokens decoded;
tokens served from the prefix cache cost nothing). Then:

- admission: the waiting request of the least-served client goes first (keys are asked
  again every step, since counters move while requests wait);
- preemption for a waiting request: the newest running request of the most-served client
  is preempted if that client has been served more than the waiting one's; a client never
  preempts itself;
- preemption for memory: the newest running request of the most-served client;
- a client that was idle comes back with its counter lifted to the least-served
  backlogged client's, so idle time is not saved up as credit against the others.

One client with a 256-sequence request therefore no longer holds every slot against a
second client's 4-token request: the latter is admitted within a step or two, at the price
of one of the former's sequences being preempted (swapped or recomputed).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from pagoda.plugins.scheduling import SchedulingPolicy
from pagoda.plugins.views import RequestView, StepView

FAIR = "fair"


class FairShare(SchedulingPolicy):
    """The ``fair`` policy and its counters (one instance per engine)."""

    keys_change = True

    def __init__(self) -> None:
        #: Tokens computed per client so far (the virtual token counters).
        self.served: dict[str | None, float] = {}
        self._client_of: dict[str, str | None] = {}
        self._num_active: Counter[str | None] = Counter()

    def sort_key(self, request: RequestView) -> tuple:
        client = request.client
        if request.request_id not in self._client_of:
            if not self._num_active[client]:
                backlogged = [self.served.get(c, 0.0) for c, n in self._num_active.items() if n]
                if backlogged:
                    self.served[client] = max(self.served.get(client, 0.0), min(backlogged))
            self._client_of[request.request_id] = client
            self._num_active[client] += 1
        return (self.served.get(client, 0.0), request.arrival_time)

    def select_victim(self, running: Sequence[RequestView], needing: RequestView,
                      needing_is_running: bool) -> RequestView | None:
        served = self.served
        victim = max(running, key=lambda r: (served.get(r.client, 0.0), r.arrival_time))
        if needing_is_running:
            return victim
        if victim.client == needing.client or served.get(victim.client, 0.0) <= served.get(needing.client, 0.0):
            return None
        return victim

    def step_finished(self, step: StepView) -> None:
        # NOTE: by the step's own client_of, so that the samples of an n > 1 request, which
        # fork from the first without passing through the queue, count too.
        served, client_of = self.served, step.client_of
        for request_id, num_tokens in step.scheduled.items():
            client = client_of(request_id)
            served[client] = served.get(client, 0.0) + num_tokens

    def request_finished(self, request: RequestView, finish_reason: str) -> None:
        if request.request_id not in self._client_of:
            return
        client = self._client_of.pop(request.request_id)
        self._num_active[client] -= 1
        if not self._num_active[client]:
            del self._num_active[client]
