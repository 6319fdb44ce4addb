"""What callers of the engine get back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagoda.engine.messages import TokenLogprobs


@dataclass(slots=True)
class RequestMetrics:
    """Timings of one request, in time.time() seconds, for metrics and tracing.

    Attributes:
        arrival_time: When the engine accepted the request.
        first_scheduled_time: When it first ran a step.
        first_token_time: When its first output token came back.
        last_token_time: When its latest output token came back.
        finished_time: When it finished.
        num_preemptions: How often it was preempted.
        num_cached_tokens: Prompt tokens served from the prefix cache.
        events: (name, time) pairs: queued, kv_load (its prefix read back from the disk tier),
            scheduled, first_token, preempted, finished.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    events: list[tuple[str, float]] = field(default_factory=list)


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request, as far as it has got.

    Attributes:
        index: Which of the request's n samples this is.
        text: Detokenized output. While the request runs it stops short of any text
            that could still turn out to be the start of a stop string.
        token_ids: Generated token ids.
        finish_reason: "stop", "length", "abort" or "error" once finished, else None.
        stop_reason: The stop string or stop token id that ended it, if any.
        logprobs: Per generated token, when the request asked for logprobs.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """A snapshot of one request and all its samples.

    Attributes:
        request_id: The request's id.
        prompt: The prompt text, when the prompt was given as text.
        prompt_token_ids: The tokenized prompt.
        outputs: One CompletionOutput per sample.
        finished: Whether every sample has finished.
        metrics: Timings of the request (of its first sample when n > 1).
        prompt_logprobs: Per prompt token, its logprobs (the first token's is None), when
            the request asked for them; a DELTA stream hands them out once, with the
            first output after the whole prompt has run.
        embedding: An embedding request's pooled final hidden states (float32 numpy, not
            normalised), once its prompt has run.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    embedding: Any = None
