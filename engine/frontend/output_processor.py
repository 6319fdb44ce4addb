"""Output processing: turns the scheduler's per-step updates into what callers read.

Each request added to the engine gets a :class:`RequestStream`; the output processor
feeds its samples' new tokens to their detokenizers, finds stop strings, and wakes the
stream's consumer. It runs in the engine process, between steps, off the worker's
critical path (the worker is already computing the next step by then).

A consumer chooses what it reads (:class:`OutputKind`):
    * ``DELTA``: each output holds only what is new since the previous one (tokens,
      text, logprobs), so a long stream costs O(length), not O(length²);
    * ``FINAL``: one output when every sample has finished, woken once;
    * ``CUMULATIVE``: each output holds everything so far (copied; for small scripts).

Detokenizing stays off the step's critical path where it can: requests without stop
strings are detokenized when their consumer reads (after the next step went out, while
the worker computes it), requests read FINAL and without stop strings are decoded once
when they finish, and only requests with stop strings are detokenized between steps
(a match must finish them before the next step is scheduled).
"""

from __future__ import annotations

import asyncio
import enum
import logging
from dataclasses import replace

from pagoda.engine.frontend.detokenizer import IncrementalDetokenizer
from pagoda.engine.outputs import CompletionOutput, RequestOutput
from pagoda.engine.core.request import Request, RequestStatus
from pagoda.engine.core.scheduler import RequestUpdate

logger = logging.getLogger(__name__)


class OutputKind(enum.Enum):
    """What each RequestOutput of a stream holds (see the module docstring)."""

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL = "final"


class Sample:
    """Engine-side state of one of a request's n samples.

    Attributes:
        request: The scheduler's request.
        detokenizer: Incremental detokenizer, None when the text is decoded at the end.
        output: Everything produced so far.
        num_tokens_sent: Tokens (and logprobs) already handed out as deltas.
        finish_sent: The delta carrying the finish reason was handed out.
    """

    __slots__ = ("request", "detokenizer", "output", "num_tokens_sent", "finish_sent", "_text_delta",
                 "detokenize_on_read", "_num_detokenized")

    def __init__(self, request: Request, detokenizer: IncrementalDetokenizer | None, index: int) -> None:
        self.request = request
        self.detokenizer = detokenizer
        # Without stop strings nothing between steps depends on the text: it is made when
        # read (catch_up), off the step's critical path.
        self.detokenize_on_read = detokenizer is not None and not request.sampling_params.stop
        self._num_detokenized = 0
        logprobs = [] if request.sampling_params.logprobs is not None else None
        self.output = CompletionOutput(index=index, logprobs=logprobs)
        self.num_tokens_sent = 0
        self.finish_sent = False
        self._text_delta: list[str] = []

    def add_text(self, text: str) -> None:
        if text:
            self.output.text += text
            self._text_delta.append(text)

    def catch_up(self, stop_terminated: bool = False) -> None:
        """Detokenizes the tokens not detokenized yet (samples detokenized on read).

        Args:
            stop_terminated: The last token is EOS or a stop token id that ended the
                request (left out of the text).
        """
        ids = self.output.token_ids
        if not self.detokenize_on_read or self._num_detokenized == len(ids):
            return
        self.detokenizer.update(ids[self._num_detokenized:], stop_terminated)
        self._num_detokenized = len(ids)
        self.add_text(self.detokenizer.get_delta())

    def take_delta(self) -> CompletionOutput:
        """What is new since the previous call."""
        self.catch_up()
        out = self.output
        start = self.num_tokens_sent
        self.num_tokens_sent = len(out.token_ids)
        text = "".join(self._text_delta)
        self._text_delta.clear()
        finish = out.finish_reason if not self.finish_sent else None
        self.finish_sent = self.finish_sent or out.finished
        return CompletionOutput(
            index=out.index, text=text, token_ids=out.token_ids[start:], finish_reason=finish,
            stop_reason=out.stop_reason if finish is not None else None,
            logprobs=None if out.logprobs is None else out.logprobs[start:],
        )


class RequestStream:
    """A request's progress, read by one consumer (``AsyncEngine.stream_outputs``).

    The consumer waits on ``event``; the output processor sets it when there is
    something to read (for FINAL streams: only when every sample has finished).
    """

    __slots__ = ("request_id", "prompt", "prompt_token_ids", "samples", "event", "error", "num_finished", "kind",
                 "prompt_logprobs_sent")

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 kind: OutputKind = OutputKind.CUMULATIVE) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.samples: list[Sample] = []
        self.event = asyncio.Event()
        self.error: BaseException | None = None
        self.num_finished = 0
        self.kind = kind
        self.prompt_logprobs_sent = False

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.samples)

    def notify(self) -> None:
        if self.kind is not OutputKind.FINAL or self.finished or self.error is not None:
            self.event.set()

    def take(self) -> RequestOutput:
        """The output to hand to the consumer now, in the stream's kind."""
        first = self.samples[0].request
        metrics = first.metrics
        # NOTE: the first sample runs the prompt (n > 1 samples fork from it after).
        prompt_logprobs = first.prompt_logprobs
        if prompt_logprobs is not None and len(prompt_logprobs) < len(self.prompt_token_ids):
            prompt_logprobs = None  # still being computed
        if self.kind is OutputKind.DELTA:
            if self.prompt_logprobs_sent:
                prompt_logprobs = None
            self.prompt_logprobs_sent = self.prompt_logprobs_sent or prompt_logprobs is not None
            outputs = [sample.take_delta() for sample in self.samples]
        elif self.kind is OutputKind.FINAL:
            outputs = [sample.output for sample in self.samples]
        else:
            for sample in self.samples:
                sample.catch_up()
            outputs = [replace(s.output, token_ids=list(s.output.token_ids),
                               logprobs=None if s.output.logprobs is None else list(s.output.logprobs))
                       for s in self.samples]
            metrics = replace(metrics, events=list(metrics.events))
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs, self.finished, metrics,
                             prompt_logprobs, first.embedding)


class OutputProcessor:
    """Owns the engine's request streams and applies each step's updates to them.

    Args:
        tokenizer: The model's tokenizer.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.streams: dict[str, RequestStream] = {}
        # Each sample's (stream, state), by the scheduler's request id of the sample.
        self.samples: dict[str, tuple[RequestStream, Sample]] = {}

    def new_sample(self, stream: RequestStream, request: Request, index: int) -> Sample:
        params = request.sampling_params
        detokenizer = None
        if stream.kind is not OutputKind.FINAL or params.stop:
            detokenizer = IncrementalDetokenizer(self.tokenizer, stream.prompt_token_ids, params)
        sample = Sample(request, detokenizer, index)
        stream.samples.append(sample)
        return sample

    def add(self, stream: RequestStream) -> None:
        self.streams[stream.request_id] = stream
        for sample in stream.samples:
            self.samples[sample.request.request_id] = (stream, sample)

    def forget(self, stream: RequestStream) -> None:
        self.streams.pop(stream.request_id, None)
        for sample in stream.samples:
            self.samples.pop(sample.request.request_id, None)

    def process(self, updates: list[RequestUpdate]) -> list[Request]:
        """Applies one step's updates.

        Returns:
            Requests that a stop string ended; the caller finishes them in the
            scheduler and then calls :meth:`finish_sample` for each.
        """
        stopped_requests = []
        for update in updates:
            entry = self.samples.get(update.request.request_id)
            if entry is None:
                continue  # finished already (a stop string, an abort)
            stream, sample = entry
            request = update.request
            out = sample.output
            new_ids, new_logprobs = update.new_token_ids, update.new_logprobs
            detokenizer = sample.detokenizer
            matched = False
            if detokenizer is not None and not sample.detokenize_on_read:
                # EOS or a stop token id: the token ends the text and is left out of it.
                stop_terminated = update.finished and _last_token_left_out(request)
                if len(new_ids) == 1:
                    matched = detokenizer.update(new_ids, stop_terminated)
                else:
                    # Several tokens (accepted drafts): a stop string may end at any of them,
                    # and the output ends with that token, as it does token by token.
                    for i in range(len(new_ids)):
                        if detokenizer.update(new_ids[i:i + 1], stop_terminated and i == len(new_ids) - 1):
                            matched = True
                            new_ids, new_logprobs = new_ids[:i + 1], new_logprobs[:i + 1]
                            break
            out.token_ids.extend(new_ids)
            if out.logprobs is not None:
                out.logprobs.extend(new_logprobs)
            if detokenizer is not None and not sample.detokenize_on_read:
                if matched:
                    request.stop_reason = detokenizer.stop_reason
                    if not update.finished:
                        stopped_requests.append(request)
                        continue
                    # NOTE: the text ends at the stop string, so that is the finish reason
                    # even when the same token also reached max_tokens.
                    request.status = RequestStatus.FINISHED_STOPPED
            if request.is_finished:
                self.finish_sample(request)
            else:
                if detokenizer is not None and not sample.detokenize_on_read:
                    sample.add_text(detokenizer.get_delta())
                stream.notify()
        return stopped_requests

    def finish_sample(self, request: Request) -> None:
        """Closes a finished sample's output and wakes its stream."""
        entry = self.samples.pop(request.request_id, None)
        if entry is None:
            return
        stream, sample = entry
        out = sample.output
        if sample.detokenizer is not None:
            # EOS or a stop token id ended it: that token is left out of the text.
            sample.catch_up(stop_terminated=_last_token_left_out(request))
            sample.add_text(sample.detokenizer.finish())
        else:
            ids = out.token_ids
            params = request.sampling_params
            if _last_token_left_out(request) and not params.include_stop_str_in_output:
                ids = ids[:-1]  # without stop strings, only EOS or a stop token id stops: left out of the text
            sample.add_text(self.tokenizer.decode(
                ids, skip_special_tokens=params.skip_special_tokens,
                clean_up_tokenization_spaces=False))
        out.finish_reason = request.status.finish_reason
        out.stop_reason = request.stop_reason
        stream.num_finished += 1
        stream.notify()

    def fail(self, request: Request, error: BaseException) -> None:
        """Ends a sample with an error its consumer will raise."""
        entry = self.samples.get(request.request_id)
        if entry is None:
            return
        entry[0].error = error
        self.finish_sample(request)

    def fail_all(self, error: BaseException) -> list[str]:
        """Hands ``error`` to every unfinished stream; returns the sample ids it ended."""
        entries = list(self.samples.items())
        self.samples.clear()
        for _child_id, (stream, _sample) in entries:
            stream.error = error
            stream.event.set()
        return [child_id for child_id, _ in entries]


def _last_token_left_out(request: Request) -> bool:
    """Whether a finished request's last token is left out of its text: EOS or a stop token id
    ended it, or its grammar rejected that token (finish reason "error": the token the sampler
    had to take when nothing was allowed, often EOS, is no part of the answer)."""
    if request.status == RequestStatus.FINISHED_STOPPED:
        return True
    return (request.status == RequestStatus.FINISHED_ERROR and request.matcher is not None
            and request.matcher.is_error())
