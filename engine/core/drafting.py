"""Speculative decoding, engine side: what to propose, and when to stop proposing.

A request that speculates runs its last known token plus ``k`` proposed tokens (drafts) in
one step; the worker samples every one of those ``k + 1`` positions as it would sample a
decode, and keeps the drafts up to the first one that differs from what it sampled there,
plus the sample at that position (engine/worker/model_runner.py). Drafts are a
deterministic function of the tokens so far (a point mass), so keeping a draft exactly when
the target's own sample equals it is the speculative-sampling rule: the outputs follow the
target distribution, and with a seed they are the very tokens decoding one by one gives.

Proposals come from prompt lookup (n-grams, here): the latest earlier occurrence of the
request's last ``n`` tokens (``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``),
and the tokens that followed it there; or from a draft model, greedily, in the worker
(ModelRunner._propose_drafts), handed to the scheduler with the step's result.
"""

from __future__ import annotations

import numpy as np

from pagoda.engine.speculative import SpeculativeConfig


def propose_ngram(token_ids: list[int], num_drafts: int, min_n: int, max_n: int) -> list[int]:
    """The tokens that followed the latest earlier occurrence of the sequence's last n
    tokens (the longest n that occurs), at most ``num_drafts``; [] when none occurs."""
    length = len(token_ids)
    if length <= min_n or num_drafts <= 0:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        tail = tokens[length - n:]
        # Windows that start before the tail itself and match it.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:length - 1], n)
        starts = np.flatnonzero((windows == tail).all(axis=1))
        if len(starts):
            follow = int(starts[-1]) + n
            return token_ids[follow:follow + num_drafts]
    return []


class DraftTracker:
    """One request's acceptance so far: whether it should propose this step.

    After ``window`` proposals with too few drafts accepted, the request stops proposing
    for a pause that doubles each time (up to 64 steps), then tries again.
    """

    __slots__ = ("proposed", "accepted", "pause", "backoff", "next")

    def __init__(self) -> None:
        self.proposed = 0
        self.accepted = 0
        self.pause = 0
        self.backoff = 4
        # With a draft model: the drafts it proposed for the request's next step.
        self.next: list[int] | None = None

    def should_propose(self) -> bool:
        if self.pause > 0:
            self.pause -= 1
            return False
        return True

    def record(self, num_drafts: int, num_accepted: int, config: SpeculativeConfig) -> None:
        self.proposed += num_drafts
        self.accepted += num_accepted
        if self.proposed >= config.window * config.num_speculative_tokens:
            if self.accepted < config.min_acceptance * self.proposed:
                self.pause = self.backoff
                self.backoff = min(self.backoff * 2, 64)
            else:
                self.backoff = 4
            self.proposed = self.accepted = 0
