"""Per-request state kept by the scheduler."""

from __future__ import annotations

import enum
import time

from pagoda.engine.messages import TokenLogprobs
from pagoda.engine.outputs import RequestMetrics
from pagoda.engine.sampling_params import SamplingParams
from pagoda.plugins.views import RequestView


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request. Finished states sort after PREEMPTED."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI finish_reason of a finished status, None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One sequence being generated.

    There is no prefill or decode phase: each step runs ``num_tokens - num_computed_tokens``
    tokens (capped by the budget), which covers chunked prefill, decode and recompute.

    Attributes:
        request_id: Unique id.
        prompt_token_ids: The prompt.
        output_token_ids: Tokens generated so far.
        all_token_ids: Prompt followed by output.
        num_computed_tokens: Tokens whose K/V are in the cache, or will be once the
            steps already sent to the worker have run.
        num_pending_tokens: Tokens sampled by steps in flight, not known yet: a step that
            computes a request's last known token samples one more, which the next step
            can already compute (the worker has it) before the engine learns it.
        max_tokens: Output length cap, already clamped to max_model_len.
        stop_reason: The token id or string that stopped the request, if any.
        cache_salt: Extra key of the prefix cache; requests with different salts
            never share cached blocks.
        priority: Scheduling priority (lower runs first) for policies that use it.
        kv_retention: Eviction priority of its cached blocks (higher is kept longer)
            for eviction policies that use it.
        client: Who sent it (the server's client key), for per-client policies.
        lora: The LoRA adapter it runs with (engine/lora.py's LoRAAdapter), None for the base model.
        prompt_logprobs: Per prompt token, its logprobs as computed so far (the first
            token's is None), when the request asked for them.
        embedding: Its prompt's pooled final hidden states (float32 numpy, not
            normalised) once computed, for an embedding request.
        view: The read-only view plugins see.
    """

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "sampling_params",
        "output_token_ids",
        "all_token_ids",
        "num_computed_tokens",
        "num_pending_tokens",
        "status",
        "metrics",
        "max_tokens",
        "eos_token_ids",
        "stop_reason",
        "stop_token_set",
        "cache_salt",
        "priority",
        "kv_retention",
        "pending_forks",
        "view",
        "matcher",
        "reasoning_end",
        "client",
        "prompt_logprobs",
        "embedding",
        "num_drafts_in_flight",
        "drafts",
        "lora",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        max_tokens: int,
        eos_token_ids: frozenset[int] = frozenset(),
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        kv_retention: int = 0,
        client: str | None = None,
        lora=None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_pending_tokens = 0
        self.status = RequestStatus.WAITING
        self.metrics = RequestMetrics(arrival_time=time.time() if arrival_time is None else arrival_time)
        self.metrics.events.append(("queued", self.metrics.arrival_time))
        self.max_tokens = max_tokens
        self.eos_token_ids = frozenset() if sampling_params.ignore_eos else eos_token_ids
        self.stop_token_set = frozenset(sampling_params.stop_token_ids)
        self.stop_reason: int | str | None = None
        self.cache_salt = cache_salt
        self.priority = priority
        self.kv_retention = kv_retention
        self.client = client
        self.lora = lora
        self.view = RequestView(self)
        # Samples of an n > 1 request that fork from this one once its prompt (all
        # but the last token) is in the cache.
        self.pending_forks: list[Request] = []
        # The structured-output matcher (an llguidance LLMatcher), None when unconstrained.
        self.matcher = None
        # The token ids that end the model's thinking while its grammar waits for them
        # (--reasoning-parser); None once the grammar applies.
        self.reasoning_end: tuple[int, ...] | None = None
        # Per prompt token, its logprobs as far as computed (the first token has none).
        self.prompt_logprobs: list[TokenLogprobs | None] | None = (
            None if sampling_params.prompt_logprobs is None else [None])
        # The pooled hidden state of an embedding request, once its prompt has run.
        self.embedding = None
        # Speculative decoding: drafts the step in flight verifies, and the request's
        # acceptance so far (a DraftTracker; None until it first proposes).
        self.num_drafts_in_flight = 0
        self.drafts = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        return len(self.all_token_ids) + self.num_pending_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def arrival_time(self) -> float:
        return self.metrics.arrival_time

    def record(self, event: str, now: float | None = None) -> float:
        """Appends a timed event to the request's metrics; returns the time."""
        now = time.time() if now is None else now
        self.metrics.events.append((event, now))
        return now

    def check_stop(self) -> RequestStatus | None:
        """Returns the finished status the last token implies, or None to go on."""
        num_output = len(self.output_token_ids)
        if num_output == 0:
            return None
        last = self.output_token_ids[-1]
        if num_output >= self.sampling_params.min_tokens:
            if last in self.eos_token_ids:
                self.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if last in self.stop_token_set:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if num_output >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )
