"""An example Pagoda plugin, installed as a package with an entry point.

It adds a scheduling policy, ``longest-prompt-first``, and an admission quota that turns
away prompts longer than ``PAGODA_EXAMPLE_MAX_PROMPT_TOKENS`` tokens (default 4000). Enable the policy with
``--scheduling-policy longest-prompt-first``; the quota applies whenever the plugin is
installed.
"""

from __future__ import annotations

import os

from pagoda.plugins import hookimpl
from pagoda.plugins.scheduling import SchedulingPolicy


class LongestPromptFirst(SchedulingPolicy):
    def sort_key(self, request):
        return (-request.num_prompt_tokens, request.arrival_time)

    def select_victim(self, running, needing, needing_is_running):
        if not needing_is_running:
            return None  # waiting requests never preempt
        # Preempt the request with the shortest prompt: it is the cheapest to redo.
        return min(running, key=lambda r: (r.num_prompt_tokens, -r.arrival_time))


@hookimpl
def pagoda_scheduling_policies():
    return {"longest-prompt-first": LongestPromptFirst}


@hookimpl
def pagoda_admit_request(request, num_waiting, num_running):
    limit = int(os.environ.get("PAGODA_EXAMPLE_MAX_PROMPT_TOKENS", "4000"))
    if request.num_prompt_tokens > limit:
        return f"prompts are limited to {limit} tokens by the example quota"
    return None
