"""The iteration-level scheduler: one schedule() and one update() per step."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.kv_cache_manager import KVCacheManager
from engine.messages import NewRequestData, RunnerOutput, SchedulerOutput, TokenLogprobs
from engine.request import Request, RequestStatus


@dataclass(slots=True)
class RequestUpdate:
    """What one step did to one request, for the output processor."""

    request: Request
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    finished: bool = False


@dataclass(slots=True)
class SchedulerStats:
    num_steps: int = 0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0


class Scheduler:
    """Decides, every step, which requests run and how many tokens each.

    There is no prefill or decode phase: a request runs ``num_tokens -
    num_computed_tokens`` new tokens, capped by the step's token budget. Running
    requests go first (a decode, or the next chunk of a chunked prefill), then waiting
    ones in arrival order while their blocks can be allocated. When a running request
    cannot get a block, the most recently admitted running request is preempted by
    recompute: its blocks are freed and it is prefilled again when it resumes, ahead of
    requests that arrived after it.

    Args:
        kv_cache_manager: Owner of the block tables.
        max_num_seqs: Cap on running requests.
        max_num_batched_tokens: Token budget of one step.
        max_model_len: No request holds more tokens than this.
        enable_chunked_prefill: Whether a prompt may be split over steps.
    """

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Worker state to drop in the next step: finished, aborted or preempted requests.
        self._finished_ids: list[str] = []
        # Requests whose worker state exists (sent as new once, deltas afterwards).
        self._in_worker: set[str] = set()
        self._step_id = 0
        self._preempted_this_step = False
        self.stats = SchedulerStats()

    # -- requests in and out ---------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Ends a request (abort, stop string, error) and frees its blocks."""
        assert status.is_finished
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        request.status = status
        self._release(request)
        return request

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # -- the step ---------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Builds the next step. Returns an output with nothing scheduled when idle."""
        self._step_id += 1
        out = SchedulerOutput(step_id=self._step_id)
        budget = self.max_num_batched_tokens
        self._preempted_this_step = False

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(self._num_tokens_to_run(request), budget)
            if num_new <= 0:
                index += 1
                continue
            new_block_ids = self._allocate_or_preempt(request, num_new)
            if new_block_ids is None:
                break  # the request preempted itself: it was the last one running
            if new_block_ids:
                out.new_block_ids[request.request_id] = new_block_ids
            out.num_scheduled_tokens[request.request_id] = num_new
            budget -= num_new
            index += 1

        # NOTE: no admission in a step that preempted: the freed blocks would go straight
        # to a newer request and the victim would starve.
        while self.waiting and budget > 0 and not self._preempted_this_step and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            num_new = self._num_tokens_to_run(request)
            if num_new > budget:
                if not self.enable_chunked_prefill:
                    break
                num_new = budget
            new_block_ids = self.kv_cache_manager.allocate_slots(
                request.request_id, request.num_computed_tokens + num_new
            )
            if new_block_ids is None:
                break
            self.waiting.popleft()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            self._in_worker.add(request.request_id)
            out.new_requests.append(
                NewRequestData(
                    request_id=request.request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=list(request.output_token_ids),
                    sampling_params=request.sampling_params,
                    block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
                    num_computed_tokens=request.num_computed_tokens,
                )
            )
            out.num_scheduled_tokens[request.request_id] = num_new
            budget -= num_new
        # NOTE: taken last so that this step's preemptions reach the worker now.
        out.finished_request_ids = self._finished_ids
        self._finished_ids = []
        return out

    def update(self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput) -> list[RequestUpdate]:
        """Applies a step's results: advances computed tokens, appends samples, finishes."""
        updates: list[RequestUpdate] = []
        if scheduler_output.is_empty:
            return updates
        self.stats.num_steps += 1
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            if request.num_computed_tokens < request.num_prompt_tokens:
                self.stats.num_prompt_tokens += min(num_tokens, request.num_prompt_tokens - request.num_computed_tokens)
            request.num_computed_tokens += num_tokens
            token_id = runner_output.sampled.get(request_id)
            if token_id is None:
                continue
            request.append_output_token(token_id)
            self.stats.num_generation_tokens += 1
            update = RequestUpdate(request, [token_id])
            logprobs = runner_output.logprobs.get(request_id)
            if logprobs is not None:
                update.new_logprobs.append(logprobs)
            status = request.check_stop()
            if status is None and request.num_tokens >= self.max_model_len:
                status = RequestStatus.FINISHED_LENGTH_CAPPED
            if status is not None:
                self.finish_request(request_id, status)
                update.finished = True
            updates.append(update)
        return updates

    # -- internals --------------------------------------------------------------------

    def _num_tokens_to_run(self, request: Request) -> int:
        return request.num_tokens - request.num_computed_tokens

    def _allocate_or_preempt(self, request: Request, num_new: int) -> list[int] | None:
        """Allocates the step's slots, preempting newer requests until they fit.

        Returns the new block ids, or None when ``request`` itself was preempted.
        """
        while True:
            new_block_ids = self.kv_cache_manager.allocate_slots(
                request.request_id, request.num_computed_tokens + num_new
            )
            if new_block_ids is not None:
                return new_block_ids
            victim = self.running[-1]
            self._preempt(victim)
            if victim is request:
                return None

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self._preempted_this_step = True
        # NOTE: a preempted request keeps its place ahead of later arrivals.
        self.waiting.appendleft(request)

    def _release(self, request: Request) -> None:
        self.kv_cache_manager.free(request.request_id)
        if request.request_id in self._in_worker:
            self._in_worker.discard(request.request_id)
            self._finished_ids.append(request.request_id)
