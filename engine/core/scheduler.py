"""The iteration-level scheduler: one schedule() and one update() per step."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagoda.engine.core.hybrid_kv_cache_manager import HybridKVCacheManager
from pagoda.engine.core.kv_cache_manager import UNCHANGED, KVCacheManager, SlotAllocation
from pagoda.engine.core.policy import Policy
from pagoda.engine.core.request_queue import WaitingQueue
from pagoda.engine.core.drafting import DraftTracker, propose_ngram
from pagoda.engine.speculative import SpeculativeConfig
from pagoda.engine.messages import NewRequestData, RunnerOutput, SchedulerOutput, TokenLogprobs
from pagoda.engine.core.request import Request, RequestStatus
from pagoda.engine.reasoning import ends_with
from pagoda.plugins.views import KVCacheView, StepView

if TYPE_CHECKING:
    from pagoda.engine.config import EngineConfig
    from pagoda.engine.core.grammar import BitmaskFiller
    from pagoda.engine.core.kv_sizing import KVCacheSize

logger = logging.getLogger(__name__)


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
    #: Every prompt token of every admitted request, counted once at its first admission
    #: (vLLM's ``prompt_tokens``), whether computed or served from the prefix cache.
    num_prompt_tokens: int = 0
    #: Of those, the tokens served from the prefix cache at first admission.
    num_prompt_tokens_cached: int = 0
    #: Prompt tokens the model ran, recomputation after preemption included.
    num_prefill_tokens_computed: int = 0
    num_generation_tokens: int = 0
    num_swapped_out: int = 0
    num_recomputed: int = 0
    num_forks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    #: Speculative decoding (vLLM's spec_decode counters): steps in which a request ran
    #: drafts, the drafts, those accepted, and accepted ones by position in the draft.
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    #: LoRA adapters sent to the worker (a first use, or again after it was dropped).
    num_lora_sends: int = 0
    #: Of the prompt tokens cached, those read back from the disk tier (at first admission).
    num_prompt_tokens_loaded: int = 0


class Scheduler:
    """Decides, every step, which requests run and how many tokens each.

    There is no prefill or decode phase: a request runs ``num_tokens -
    num_computed_tokens`` new tokens, capped by the step's token budget. Running
    requests go first (a decode, or the next chunk of a chunked prefill), then waiting
    ones in the policy's order while their blocks can be allocated, after their
    prefix-cache hit is counted. When a running request cannot get a block, the policy
    picks a victim (fcfs: the most recently admitted), which is swapped out or dropped
    for recompute, as the preemption-mode chooser says, and goes back to the waiting
    queue under its sort key (fcfs: ahead of requests that arrived after it). A policy
    may also let the first waiting request preempt a running one (priority).

    Args:
        kv_cache_manager: Owner of the block tables.
        max_num_seqs: Cap on running requests.
        max_num_batched_tokens: Token budget of one step.
        max_model_len: No request holds more tokens than this.
        enable_chunked_prefill: Whether a prompt may be split over steps.
        preemption_mode: "auto" (ask the chooser), "swap" or "recompute".
        policy: The plugin hooks (built-in fcfs and lru when None).
        bitmasks: Fills the token bitmasks of structured requests (needed only when a
            request has a grammar matcher).
    """

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        preemption_mode: str = "auto",
        policy: Policy | None = None,
        bitmasks: BitmaskFiller | None = None,
        speculative: SpeculativeConfig | None = None,
        max_loras: int | None = None,
        max_cpu_loras: int | None = None,
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        # LoRA (None: off): the most adapters the running requests may use together (the
        # worker's slots), and the most the worker keeps; what it has been sent, oldest use
        # first; adapters unloaded from the engine, to drop once no request uses them.
        self.max_loras = max_loras
        self.max_cpu_loras = max(max_cpu_loras or 0, max_loras or 0)
        self._worker_loras: OrderedDict[int, object] = OrderedDict()
        self._unloaded_loras: set[int] = set()
        # Requests whose prefix the worker is reading from the disk tier: id -> (the request,
        # its pool hits in blocks, the step that reads, whether it is its first admission).
        self.loading: dict[str, tuple[Request, int, int, bool]] = {}
        self.speculative = speculative
        self.bitmasks = bitmasks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.preemption_mode = preemption_mode
        self.policy = policy if policy is not None else Policy()
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        # Worker state to drop in the next step: finished, aborted or preempted requests.
        self._finished_ids: list[str] = []
        # Requests whose worker state exists (sent as new once, deltas afterwards).
        self._in_worker: set[str] = set()
        self._step_id = 0
        # Per step in flight: the requests it scheduled, by id (see _commit).
        self._scheduled: dict[int, dict[str, Request]] = {}
        self._preempted_this_step = False
        self._out: SchedulerOutput | None = None
        # Within schedule(): the step's budget left and the running-walk position.
        self._budget = 0
        self._cursor = 0
        self.stats = SchedulerStats(
            accepted_per_position=[0] * (speculative.num_speculative_tokens if speculative else 0))

    @classmethod
    def from_config(cls, config: EngineConfig, kv: KVCacheSize, policy: Policy,
                    bitmasks: BitmaskFiller | None = None) -> Scheduler:
        """The scheduler an engine of this configuration runs, over a cache of ``kv``'s
        size (the engine's and the simulator's are built here alike)."""
        if kv.num_sliding_blocks:
            kv_cache_manager = HybridKVCacheManager(
                kv.num_blocks, kv.num_sliding_blocks, config.block_size, kv.sliding_window,
                enable_prefix_caching=config.enable_prefix_caching,
                evictors=(policy.make_evictor(), policy.make_evictor()), lookback=kv.lookback)
        else:
            kv_cache_manager = KVCacheManager(
                kv.num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching,
                num_cpu_blocks=kv.num_cpu_blocks, evictor=policy.make_evictor(), sliding_window=kv.sliding_window,
                lookback=kv.lookback)
        return cls(
            kv_cache_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=kv.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            preemption_mode=config.preemption_mode,
            policy=policy,
            bitmasks=bitmasks,
            speculative=config.speculative_config,
            max_loras=config.max_loras if config.enable_lora else None,
            max_cpu_loras=config.max_cpu_loras,
        )

    # -- requests in and out ---------------------------------------------------------

    def add_request(self, request: Request, forks: list[Request] | None = None) -> None:
        """Queues a request.

        Args:
            request: The request (for n > 1, its first sample).
            forks: The other samples of an n > 1 request. They share the first
                sample's blocks: its prompt is prefilled once, they fork from it when
                all but the last prompt token are cached.
        """
        for r in [request, *(forks or [])]:
            if r.request_id in self.requests:
                raise ValueError(f"request id {r.request_id!r} is already in use")
        self.requests[request.request_id] = request
        for fork in forks or []:
            self.requests[fork.request_id] = fork
        if forks and request.num_prompt_tokens >= 2:
            request.pending_forks = list(forks)
            forks = []
        for r in [request, *(forks or [])]:
            self._enqueue(r)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Ends a request (abort, stop string, error) and frees its blocks."""
        assert status.is_finished
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif self.loading.pop(request_id, None) is not None:
            pass  # NOTE: its blocks are freed below; the read into them ends within its step
        elif not self.waiting.remove(request):  # a sample still waiting to fork
            for parent in [*self.waiting, *self.running]:
                if request in parent.pending_forks:
                    parent.pending_forks.remove(request)
        for fork in request.pending_forks:
            self._enqueue(fork)  # NOTE: samples that have not forked yet go on their own
        request.pending_forks = []
        request.status = status
        request.metrics.finished_time = request.record("finished")
        self._release(request)
        self.policy.request_finished(request.view, status.finish_reason)
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
        out = self._out = SchedulerOutput(step_id=self._step_id)
        self._budget = self.max_num_batched_tokens
        self._preempted_this_step = False
        if self._unloaded_loras:
            self._drop_unloaded_loras()
        offload = self.kv_cache_manager.offload
        if offload is not None and offload.has_work:
            # NOTE: blocks cached while earlier steps were scheduled: those steps have filled
            # them by the time the worker runs this one (blocks cached below go with the next).
            out.kv_store, out.kv_delete = offload.take()

        # NOTE: an index walk, not a for loop: forks append to running during the walk,
        # and a preemption may remove a request before the cursor (_preempt moves it).
        self._cursor = 0
        while self._cursor < len(self.running) and self._budget > 0:
            request = self.running[self._cursor]
            if request.pending_forks and request.num_computed_tokens == request.num_prompt_tokens - 1:
                self._fork(request)
            num_new = min(self._num_tokens_to_run(request), self._budget)
            if num_new <= 0:
                self._cursor += 1
                continue
            drafts = lookahead = None
            if self.speculative is not None and num_new == 1:
                drafts = self._propose(request)
                lookahead = self._draft_lookahead(request)
            if drafts:
                num_new += len(drafts)
            if lookahead:
                # NOTE: never a slot past max_model_len (the block tables' width).
                lookahead = min(lookahead, self.max_model_len - request.num_computed_tokens - num_new)
            allocation = None
            if drafts or lookahead:
                allocation = self.kv_cache_manager.allocate_slots(request, num_new + max(lookahead or 0, 0))
                if allocation is None:  # NOTE: nobody is preempted for drafts: the plain decode goes on
                    drafts = lookahead = None
                    num_new = 1
            if allocation is None:
                allocation = self._allocate_or_preempt(request, num_new)
            if allocation is None:
                continue  # the request preempted itself; the cursor already moved past it
            if drafts:
                out.spec_token_ids[request.request_id] = drafts
            if lookahead and lookahead > 0:
                out.draft_requests[request.request_id] = lookahead
            if allocation is UNCHANGED and request.request_id in self._in_worker:
                out.num_scheduled_tokens[request.request_id] = num_new  # the common decode
            else:
                self._schedule_running(request, num_new, allocation)
            self._budget -= num_new
            self._cursor += 1

        if self.policy.sort_keys_change and self.waiting:
            self.waiting.rekey(lambda request: self.policy.sort_key(request.view))
        # NOTE: no admission in a step that preempted: the freed blocks would go straight
        # to a newer request and the victim would starve.
        deferred: list[Request] = []  # LoRA requests of an adapter beyond the slots, passed over
        running_loras = self._running_loras() if self.max_loras is not None and self.waiting else None
        while self.waiting and self._budget > 0 and not self._preempted_this_step:
            request = self.waiting.peek()
            lora = request.lora
            if lora is not None and lora.id not in running_loras and len(running_loras) >= self.max_loras:
                deferred.append(self.waiting.pop())
                continue
            # NOTE: samples yet to fork from running parents hold their places too, and so do
            # requests whose prefix is being read from the offload tier.
            num_reserved = len(self.running) + len(self.loading) + sum(len(r.pending_forks) for r in self.running)
            fits_seqs = num_reserved + 1 + len(request.pending_forks) <= self.max_num_seqs
            refusal = self._admit(request, self._budget) if fits_seqs else "seqs"
            if refusal is not None:
                if refusal in ("memory", "seqs"):
                    self._preempt_for_waiting(request)
                break
            self._budget -= out.num_scheduled_tokens.get(request.request_id, 0)
            if lora is not None:
                running_loras.add(lora.id)
        for request in deferred:
            self._enqueue(request)
        # NOTE: taken last so that this step's preemptions reach the worker now.
        out.finished_request_ids = self._finished_ids
        self._finished_ids = []
        self._out = None
        self._commit(out)
        return out

    def _commit(self, out: SchedulerOutput) -> None:
        """Counts the step's tokens as computed now, before it runs.

        The next step can then be scheduled while this one runs: a request whose step
        computes its last known token gets a pending token (the one the step samples),
        which the next step computes (the worker already has it) and update() turns into
        a known token when the result arrives.
        """
        stats = self.stats
        requests = self.requests
        # NOTE: the step's result is matched to these objects, not to ids: an id may be
        # reused by a new request while a step holding the old one is still running.
        self._scheduled[out.step_id] = scheduled = {}
        structured: list[Request] = []
        spec = out.spec_token_ids
        for request_id, num_tokens in out.num_scheduled_tokens.items():
            request = scheduled[request_id] = requests[request_id]
            num_computed = request.num_computed_tokens
            num_prompt = len(request.prompt_token_ids)
            if num_computed < num_prompt:
                stats.num_prefill_tokens_computed += min(num_tokens, num_prompt - num_computed)
            num_computed = request.num_computed_tokens = num_computed + num_tokens
            if spec and request_id in spec:
                # Its drafts count as computed until the result says how many were wrong.
                request.num_drafts_in_flight = len(spec[request_id])
                request.num_pending_tokens += 1
            elif num_computed == len(request.all_token_ids) + request.num_pending_tokens:
                request.num_pending_tokens += 1
                if request.matcher is not None and request.reasoning_end is None:
                    structured.append(request)
        if structured:
            # NOTE: a structured request samples only with all its tokens known (see
            # _num_tokens_to_run), so its matcher is where the sampled token will go on.
            out.grammar_request_ids = [r.request_id for r in structured]
            out.grammar_bitmask = self.bitmasks.fill([r.matcher for r in structured])

    def _admit(self, request: Request, budget: int) -> str | None:
        """Admits the first waiting request if its blocks can be had.

        Returns:
            None when admitted, else why not: "budget", "memory", or "pending" (a
            preempted request whose last sampled token is still in flight: the worker
            dropped it, so it comes back once the token is known).
        """
        if request.num_pending_tokens:
            return "pending"
        kv = self.kv_cache_manager
        request_id = request.request_id
        out = self._out
        computed_blocks: list = []
        num_hit = 0
        swapped = kv.is_swapped(request_id)
        # NOTE: a request that scores its prompt or pools every position of it needs each
        # position's hidden state, which the cache does not keep: it recomputes them.
        queries_cache = (not swapped and request.num_computed_tokens == 0
                         and not request.sampling_params.computes_whole_prompt)
        if queries_cache:
            computed_blocks, num_hit = kv.get_computed_blocks(request)
            if kv.offload is not None and self._start_load(request, computed_blocks, num_hit):
                return None
        num_new = request.num_tokens - request.num_computed_tokens - num_hit
        if request.pending_forks:
            num_new -= 1  # the last prompt token runs once per sample, after the fork
        if num_new > budget:
            if not self.enable_chunked_prefill:
                return "budget"
            num_new = budget
        if swapped:
            if not kv.can_swap_in(request, num_new):
                return "memory"
            out.swap_in.extend(kv.swap_in(request))
        allocation = kv.allocate_slots(request, num_new, computed_blocks)
        if allocation is None:
            return "memory"
        self._count_admission(request, num_hit, queries_cache)
        request.num_computed_tokens += num_hit
        self.waiting.pop()
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        now = request.record("scheduled")
        if request.metrics.first_scheduled_time is None:
            request.metrics.first_scheduled_time = now
        out.copy_blocks.extend(allocation.copies)
        if num_new > 0:  # zero only for a cached prompt that forks first, next step
            self._send_new(request)
            out.num_scheduled_tokens[request_id] = num_new
        return None

    def _count_admission(self, request: Request, num_hit: int, queried_cache: bool) -> None:
        if queried_cache:
            self.stats.prefix_cache_queries += request.num_tokens
            self.stats.prefix_cache_hits += num_hit
        if request.metrics.first_scheduled_time is None:
            request.metrics.num_cached_tokens = num_hit
            self.stats.num_prompt_tokens += len(request.prompt_token_ids)
            self.stats.num_prompt_tokens_cached += num_hit

    # -- the disk tier ---------------------------------------------------------------

    def _start_load(self, request: Request, computed_blocks: list, num_hit: int) -> bool:
        """Has the worker read the blocks of the request's prefix that are on disk after the
        pool's hits, in this step, when reading beats computing them. The request runs no
        tokens in this step: it waits for the read's result (update()), then is admitted
        again with those tokens computed.

        Returns:
            Whether a read was started (the request then leaves the waiting queue).
        """
        kv = self.kv_cache_manager
        offload = kv.offload
        digests = kv.offloaded_blocks(request, len(computed_blocks))
        if not digests:
            return False
        if not offload.worth_loading():
            offload.stats.num_skipped_loads += 1
            return False
        blocks = kv.allocate_for_load(request, computed_blocks, len(digests))
        if blocks is None:
            return False
        first = request.metrics.first_scheduled_time is None
        self._count_admission(request, num_hit, True)
        self.waiting.pop()
        now = request.record("kv_load")
        if first:
            request.metrics.first_scheduled_time = now
        self.loading[request.request_id] = (request, len(computed_blocks), self._out.step_id, first)
        self._out.kv_load[request.request_id] = [(block.block_id, digest) for block, digest in zip(blocks, digests)]
        return True

    def _take_loads(self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput) -> None:
        """Applies a step's reads from disk: the blocks read join the prefix cache and count
        as computed, the request goes back to the queue (in its place) to compute the rest."""
        kv = self.kv_cache_manager
        offload = kv.offload
        offload.forget(runner_output.kv_failed)
        offload.stats.num_load_failures += sum(
            1 for request_id in scheduler_output.kv_load if request_id in runner_output.kv_loaded
            and runner_output.kv_loaded[request_id] < len(scheduler_output.kv_load[request_id]))
        offload.record_read(runner_output.kv_read_bytes, runner_output.kv_read_seconds)
        for request_id, pairs in scheduler_output.kv_load.items():
            entry = self.loading.get(request_id)
            if entry is None or entry[2] != scheduler_output.step_id:
                continue  # finished while its blocks were read (they were freed then)
            del self.loading[request_id]
            request, num_hit_blocks, _, first = entry
            num_loaded = runner_output.kv_loaded.get(request_id, 0)
            for _, digest in pairs[:num_loaded]:
                offload.used(digest)
            kv.finish_load(request, num_hit_blocks + num_loaded)
            request.num_computed_tokens = (num_hit_blocks + num_loaded) * kv.block_size
            num_tokens = num_loaded * kv.block_size
            offload.stats.num_loaded += num_loaded
            self.stats.prefix_cache_hits += num_tokens
            if first:  # NOTE: like the pool's hits, counted for the request's first admission only
                self.stats.num_prompt_tokens_loaded += num_tokens
                self.stats.num_prompt_tokens_cached += num_tokens
                request.metrics.num_cached_tokens += num_tokens
            self._enqueue(request)

    def has_kv_work(self) -> bool:
        """Whether a step is due with no request to run: blocks to store or files to delete."""
        offload = self.kv_cache_manager.offload
        return offload is not None and offload.has_work

    def _schedule_running(self, request: Request, num_new: int, allocation: SlotAllocation) -> None:
        out = self._out
        out.copy_blocks.extend(allocation.copies)
        if request.request_id not in self._in_worker:
            self._send_new(request)  # a sample that just forked
        elif allocation.table_changed:
            out.block_tables[request.request_id] = self.kv_cache_manager.get_block_ids(request.request_id)
            sliding = self.kv_cache_manager.get_sliding_block_ids(request.request_id)
            if sliding is not None:
                out.sliding_block_tables[request.request_id] = sliding
        else:
            if allocation.new_block_ids:
                out.new_block_ids[request.request_id] = allocation.new_block_ids
            if allocation.new_sliding_block_ids:
                out.new_sliding_block_ids[request.request_id] = allocation.new_sliding_block_ids
        out.num_scheduled_tokens[request.request_id] = num_new

    def _send_new(self, request: Request) -> None:
        self._in_worker.add(request.request_id)
        lora = request.lora
        if lora is not None:
            self._send_lora(lora)
        self._out.new_requests.append(
            NewRequestData(
                request_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=list(request.output_token_ids),
                sampling_params=request.sampling_params,
                block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
                sliding_block_ids=self.kv_cache_manager.get_sliding_block_ids(request.request_id),
                num_computed_tokens=request.num_computed_tokens,
                lora_id=0 if lora is None else lora.id,
            )
        )

    # -- LoRA adapters ---------------------------------------------------------------

    def _running_loras(self) -> set[int]:
        """The adapters of the running requests: at most max_loras (a waiting request of another
        adapter is admitted only while a slot is left)."""
        return {r.lora.id for r in self.running if r.lora is not None}

    def _send_lora(self, lora) -> None:
        """Has the worker get ``lora`` with this step, if it lacks it; beyond max_cpu_loras,
        has it drop the adapters used longest ago that no running request needs."""
        held = self._worker_loras
        if lora.id in held:
            held.move_to_end(lora.id)
            return
        self._out.new_loras[lora.id] = lora
        self.stats.num_lora_sends += 1
        held[lora.id] = lora
        if len(held) > self.max_cpu_loras:
            needed = self._running_loras() | {lora.id}
            for adapter_id in [i for i in held if i not in needed][:len(held) - self.max_cpu_loras]:
                del held[adapter_id]
                self._out.drop_loras.append(adapter_id)

    def unload_lora(self, lora) -> None:
        """Forgets an adapter the engine unloaded: the worker drops it once no request uses it."""
        if lora.id in self._worker_loras:
            self._unloaded_loras.add(lora.id)

    def _drop_unloaded_loras(self) -> None:
        in_use = {r.lora.id for r in (*self.running, *self.waiting) if r.lora is not None}
        for adapter_id in list(self._unloaded_loras - in_use):
            self._unloaded_loras.discard(adapter_id)
            if self._worker_loras.pop(adapter_id, None) is not None:
                self._out.drop_loras.append(adapter_id)

    def lora_counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """Running and waiting requests per adapter name (vLLM's lora_requests_info)."""
        counts: tuple[dict[str, int], dict[str, int]] = ({}, {})
        for table, requests in zip(counts, (self.running, self.waiting)):
            for request in requests:
                if request.lora is not None:
                    table[request.lora.name] = table.get(request.lora.name, 0) + 1
        return counts

    def _fork(self, parent: Request) -> None:
        """Starts the pending samples of ``parent``, sharing all its blocks."""
        now = time.time()
        for child in parent.pending_forks:
            self.kv_cache_manager.fork(parent, child)
            child.num_computed_tokens = parent.num_computed_tokens
            child.status = RequestStatus.RUNNING
            child.metrics.first_scheduled_time = child.record("scheduled", now)
            self.running.append(child)
            self.stats.num_forks += 1
        parent.pending_forks = []

    def reset_after_worker_loss(self) -> None:
        """Sends every request back to waiting, to be recomputed by a new worker.

        The KV cache (with the prefix cache and the swap space) was lost with the worker,
        and so were the tokens of steps in flight: each request restarts from the tokens
        it has (its prompt and the output already produced), in its queue order, running
        requests first.
        """
        self.kv_cache_manager.reset()
        if self.kv_cache_manager.offload is not None:
            self.kv_cache_manager.offload.drop_pending_stores()  # NOTE: their blocks died with the worker
        self._scheduled.clear()
        requests = [*self.running, *self.waiting, *(entry[0] for entry in self.loading.values())]
        self.loading.clear()
        self.running.clear()
        self.waiting = WaitingQueue()
        self._in_worker.clear()
        self._finished_ids.clear()
        self._worker_loras.clear()
        self._unloaded_loras.clear()
        for request in requests:
            request.num_computed_tokens = 0
            request.num_pending_tokens = 0
            request.num_drafts_in_flight = 0
            if request.status == RequestStatus.RUNNING:
                request.status = RequestStatus.PREEMPTED
                request.record("preempted")
            self._enqueue(request)

    def discard_step(self, scheduler_output: SchedulerOutput) -> None:
        """Undoes what a step that failed in the worker may have left half done.

        Blocks the step was to fill are taken out of the prefix cache (their K/V was
        never written), and requests it swapped out fall back to recompute (their
        copies may be incomplete). The caller then fails the step's requests.
        """
        kv = self.kv_cache_manager
        self._scheduled.pop(scheduler_output.step_id, None)
        for adapter_id in scheduler_output.new_loras:  # NOTE: sent again when needed (the worker takes it twice)
            self._worker_loras.pop(adapter_id, None)
        for request_id in scheduler_output.num_scheduled_tokens:
            kv.uncache(request_id)
        if kv.offload is not None:
            kv.offload.drop_pending_stores()  # NOTE: blocks the failed step was to fill among them
            for request_id in scheduler_output.kv_load:
                entry = self.loading.get(request_id)
                if entry is not None and entry[2] == scheduler_output.step_id:
                    del self.loading[request_id]
                    kv.free(request_id)
                    entry[0].num_computed_tokens = 0
                    self._enqueue(entry[0])
        # NOTE: blocks the step was to fill may have been freed since it was sent (a
        # preemption while it ran) and still be cached: nothing unreferenced stays cached.
        kv.reset_prefix_cache()
        swapped_cpu_blocks = {cpu for _, cpu in scheduler_output.swap_out}
        for request in list(self.waiting):
            if swapped_cpu_blocks.intersection(kv.get_cpu_block_ids(request.request_id)):
                kv.free(request.request_id)
                request.num_computed_tokens = 0

    def update(self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput) -> list[RequestUpdate]:
        """Applies a step's results: turns pending tokens into known ones, finishes requests.

        The step's tokens were counted as computed when it was scheduled. A request may
        have been preempted since (its sampled token still counts) or have finished
        (its token is dropped).
        """
        updates: list[RequestUpdate] = []
        scheduled = self._scheduled.pop(scheduler_output.step_id, {})
        offload = self.kv_cache_manager.offload
        if offload is not None:
            if scheduler_output.kv_load or runner_output.kv_failed:
                self._take_loads(scheduler_output, runner_output)
            if scheduler_output.total_num_scheduled_tokens >= 64 and runner_output.compute_seconds > 0:
                offload.record_prefill(scheduler_output.total_num_scheduled_tokens,
                                       runner_output.compute_seconds - runner_output.kv_read_seconds)
        if scheduler_output.is_empty:
            return updates
        self.stats.num_steps += 1
        now = time.time()
        sampled = runner_output.sampled
        all_logprobs = runner_output.logprobs
        requests = self.requests
        if runner_output.prompt_logprobs or runner_output.embeddings:
            self._take_prompt_results(runner_output, scheduled)
        for request_id, drafts in runner_output.draft_token_ids.items():
            request = scheduled.get(request_id)
            if request is not None and request.drafts is not None:
                request.drafts.next = drafts
        max_model_len = self.max_model_len
        spec_sampled = runner_output.spec_sampled
        for request_id, request in scheduled.items():
            token_id = sampled.get(request_id)
            if token_id is None:
                if spec_sampled and request_id in spec_sampled:
                    update = self._take_verified(request, spec_sampled[request_id],
                                                 runner_output.spec_logprobs.get(request_id), now)
                    if update is not None:
                        updates.append(update)
                continue
            if requests.get(request_id) is not request:
                continue  # finished (aborted, a stop string) while the step ran
            request.num_pending_tokens -= 1
            request.output_token_ids.append(token_id)
            request.all_token_ids.append(token_id)
            metrics = request.metrics
            metrics.last_token_time = now
            if metrics.first_token_time is None:
                metrics.first_token_time = request.record("first_token", now)
            update = RequestUpdate(request, [token_id])
            if all_logprobs:
                logprobs = all_logprobs.get(request_id)
                if logprobs is not None:
                    update.new_logprobs.append(logprobs)
            status = None
            if request.matcher is not None:
                # NOTE: before check_stop: a failed grammar's mask allows only EOS, which
                # must end the request as an error, not as a stop.
                if request.reasoning_end is None:
                    status = _advance_matcher(request, token_id)
                elif ends_with(request.output_token_ids, request.reasoning_end):
                    request.reasoning_end = None  # the thinking is over: the grammar applies from here
            if status != RequestStatus.FINISHED_ERROR:
                status = request.check_stop() or status
            if status is None and len(request.all_token_ids) >= max_model_len:
                status = RequestStatus.FINISHED_LENGTH_CAPPED
            if status is not None:
                self.finish_request(request_id, status)
                update.finished = True
            updates.append(update)
        self.stats.num_generation_tokens += sum(len(update.new_token_ids) for update in updates)
        kv = self.kv_cache_manager
        self.policy.step_finished(StepView(
            step_id=scheduler_output.step_id,
            num_scheduled_tokens=scheduler_output.total_num_scheduled_tokens,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_preemptions=self.stats.num_preemptions,
            kv_cache_usage=kv.used_fraction(),
            scheduled=scheduler_output.num_scheduled_tokens,
            client_of=lambda request_id: scheduled[request_id].client,
        ))
        return updates

    # -- speculative decoding ----------------------------------------------------------

    def _may_speculate(self, request: Request) -> bool:
        """Whether drafts could run for a request: no grammar (its mask at each draft
        position would need the drafts before it consumed), not an embedding, not about to
        fork. (Penalties and min_tokens count the drafts before each position: see
        InputBatch.sampling_metadata.)"""
        return request.matcher is None and not request.pending_forks and request.sampling_params.pooling is None

    def _waits_for_drafts(self, request: Request) -> bool:
        """Under async scheduling: a request that would propose waits for its token in
        flight instead of running it ahead without drafts (unless its acceptance has paused
        its proposals)."""
        return (self.speculative is not None and (request.drafts is None or not request.drafts.pause)
                and self._may_speculate(request))

    def _propose(self, request: Request) -> list[int] | None:
        """Drafts for a request about to run its last known token, or None.

        Only decodes propose (see _may_speculate), with no token in flight, and with
        room for every draft and the token after them (max_tokens, the context, the step's
        budget).
        """
        config = self.speculative
        if not self._may_speculate(request):
            return None
        if request.drafts is None:
            request.drafts = DraftTracker()
        # A draft model's drafts were made for this very step: a step that does not take
        # them leaves them stale.
        proposed, request.drafts.next = request.drafts.next, None
        if not request.drafts.should_propose():
            return None
        if request.num_pending_tokens or request.num_computed_tokens != len(request.all_token_ids) - 1:
            return None
        # NOTE: the budget keeps a token for each running request after this one in the walk.
        room = min(config.num_speculative_tokens, request.max_tokens - len(request.output_token_ids) - 1,
                   self.max_model_len - len(request.all_token_ids) - 1,
                   self._budget - (len(self.running) - self._cursor))
        if room <= 0:
            return None
        if config.method == "draft_model":
            return proposed[:room] if proposed else None
        drafts = propose_ngram(request.all_token_ids, room, config.prompt_lookup_min, config.prompt_lookup_max)
        if not drafts:
            request.drafts.record(config.num_speculative_tokens, 0, config)  # a miss: back off as from a reject
        return drafts or None

    def _draft_lookahead(self, request: Request) -> int | None:
        """With a draft model: how many drafts it proposes for the request's next step (as
        many as that step can take), which is also the slots past this step it writes (its
        K/V of the token the step samples and of all but the last draft); None when it does
        not propose for it."""
        config = self.speculative
        if (config.method != "draft_model" or request.drafts is None or request.drafts.pause
                or request.num_pending_tokens or request.num_computed_tokens != len(request.all_token_ids) - 1):
            return None
        count = min(config.num_speculative_tokens, request.max_tokens - len(request.output_token_ids) - 2,
                    self.max_model_len - len(request.all_token_ids) - 2)
        return count if count > 0 else None

    def _take_verified(self, request: Request, token_ids: list[int], logprobs: list[TokenLogprobs] | None,
                       now: float) -> RequestUpdate | None:
        """A speculating request's result: its accepted drafts and the token after them.

        The drafts the worker rejected were counted as computed: the count goes back by
        them (their K/V is overwritten by the tokens that take their places).
        """
        num_drafts = request.num_drafts_in_flight
        num_accepted = len(token_ids) - 1
        request.num_drafts_in_flight = 0
        if request.num_computed_tokens > 0:  # zero: preempted by recompute since
            request.num_computed_tokens -= num_drafts - num_accepted
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            stats.accepted_per_position[position] += 1
        request.drafts.record(num_drafts, num_accepted, self.speculative)
        request.num_pending_tokens -= 1
        if self.requests.get(request.request_id) is not request:
            return None  # finished (aborted, a stop string) while the step ran
        metrics = request.metrics
        metrics.last_token_time = now
        if metrics.first_token_time is None:
            metrics.first_token_time = request.record("first_token", now)
        update = RequestUpdate(request)
        for i, token_id in enumerate(token_ids):
            request.output_token_ids.append(token_id)
            request.all_token_ids.append(token_id)
            update.new_token_ids.append(token_id)
            if logprobs is not None:
                update.new_logprobs.append(logprobs[i])
            status = request.check_stop()
            if status is None and len(request.all_token_ids) >= self.max_model_len:
                status = RequestStatus.FINISHED_LENGTH_CAPPED
            if status is not None:
                self.finish_request(request.request_id, status)
                update.finished = True
                break
        return update

    # -- internals --------------------------------------------------------------------

    def _take_prompt_results(self, runner_output: RunnerOutput, scheduled: dict[str, Request]) -> None:
        """Appends a step's prompt logprobs to the requests that asked, and keeps embeddings.

        A prompt computed again (after a preemption by recompute) is scored again: what
        the request has already is not appended twice.
        """
        requests = self.requests
        for request_id, chunk in runner_output.prompt_logprobs.items():
            request = scheduled.get(request_id)
            if request is None or requests.get(request_id) is not request:
                continue
            have = request.prompt_logprobs
            skip = len(have) - chunk.start
            if 0 <= skip < len(chunk.token_ids):
                have.extend(chunk.entries(skip))
        for request_id, embedding in runner_output.embeddings.items():
            request = scheduled.get(request_id)
            if request is not None and requests.get(request_id) is request:
                request.embedding = embedding

    def _num_tokens_to_run(self, request: Request) -> int:
        if request.pending_forks:
            return request.num_prompt_tokens - 1 - request.num_computed_tokens
        num_pending = request.num_pending_tokens
        if num_pending and (request.matcher is not None or request.num_drafts_in_flight
                            or self._waits_for_drafts(request)):
            # Its next mask (or whether its thinking has ended and a mask applies), or how
            # many of its drafts hold, depends on the step in flight: it waits for it.
            return 0
        # NOTE: pending tokens count against the limits.
        num_with_pending = len(request.all_token_ids) + num_pending
        if (len(request.output_token_ids) + num_pending >= request.max_tokens
                or num_with_pending >= self.max_model_len):
            return 0  # its pending token finishes it
        return num_with_pending - request.num_computed_tokens

    def _allocate_or_preempt(self, request: Request, num_new: int) -> SlotAllocation | None:
        """Allocates the step's slots, preempting newer requests until they fit.

        Returns what changed, or None when ``request`` itself was preempted.
        """
        while True:
            allocation = self.kv_cache_manager.allocate_slots(request, num_new)
            if allocation is not None:
                return allocation
            victim = self._select_victim(request, needing_is_running=True)
            self._preempt(victim)
            if victim is request:
                return None

    def _select_victim(self, needing: Request, needing_is_running: bool) -> Request | None:
        view = self.policy.select_victim([r.view for r in self.running], needing.view, needing_is_running)
        return None if view is None else self.requests[view.request_id]

    def _preempt_for_waiting(self, request: Request) -> None:
        """Lets a policy preempt a running request for the first waiting one.

        It is admitted in a later step, once the victim's blocks are out (a step that
        preempts admits nothing).
        """
        if self.running:
            victim = self._select_victim(request, needing_is_running=False)
            if victim is not None:
                self._preempt(victim)

    def _preempt(self, request: Request) -> None:
        kv = self.kv_cache_manager
        request_id = request.request_id
        if self.running.index(request) < self._cursor:
            self._cursor -= 1
        self.running.remove(request)
        mode = self.preemption_mode
        if self._unschedule(request):
            mode = "recompute"  # its copy-on-write copy never ran: there is nothing whole to swap
        elif request.sampling_params.pooling is not None and not request.output_token_ids:
            mode = "recompute"  # the worker's running sum (or first position) of its pooling goes with its row
        elif mode == "auto":
            view = KVCacheView(block_size=kv.block_size, num_free_blocks=kv.get_num_free_blocks(),
                               num_free_cpu_blocks=kv.num_free_cpu_blocks,
                               victim_num_blocks=kv.num_blocks_held(request_id))
            mode = self.policy.preemption_mode(request.view, view)
        if mode == "swap" and kv.can_swap_out(request_id):
            self._out.swap_out.extend(kv.swap_out(request_id))
            self._drop_worker_state(request_id)
            self.stats.num_swapped_out += 1
        else:
            self._release(request)
            request.num_computed_tokens = 0
            self.stats.num_recomputed += 1
        request.status = RequestStatus.PREEMPTED
        request.metrics.num_preemptions += 1
        request.record("preempted")
        self.stats.num_preemptions += 1
        self._preempted_this_step = True
        self._enqueue(request)

    def _unschedule(self, request: Request) -> bool:
        """Takes a victim that was already scheduled in this step back out of it.

        Returns:
            Whether a copy-on-write copy into its blocks was dropped with it.
        """
        out = self._out
        request_id = request.request_id
        if out is None or request_id not in out.num_scheduled_tokens:
            return False
        self._budget += out.num_scheduled_tokens.pop(request_id)
        out.spec_token_ids.pop(request_id, None)
        out.draft_requests.pop(request_id, None)
        blocks = set(self.kv_cache_manager.get_block_ids(request_id, held=True))
        copies = [copy for copy in out.copy_blocks if copy[1] in blocks]
        for copy in copies:
            out.copy_blocks.remove(copy)
        out.new_block_ids.pop(request_id, None)
        out.block_tables.pop(request_id, None)
        out.new_sliding_block_ids.pop(request_id, None)
        out.sliding_block_tables.pop(request_id, None)
        sent_now = [data for data in out.new_requests if data.request_id == request_id]
        if sent_now:
            # The worker has never seen it: forget it here instead of dropping it there.
            out.new_requests.remove(sent_now[0])
            self._in_worker.discard(request_id)
        return bool(copies)

    def _enqueue(self, request: Request) -> None:
        self.waiting.push(request, self.policy.sort_key(request.view))

    def _release(self, request: Request) -> None:
        self.kv_cache_manager.free(request.request_id)
        self._drop_worker_state(request.request_id)

    def _drop_worker_state(self, request_id: str) -> None:
        if request_id in self._in_worker:
            self._in_worker.discard(request_id)
            self._finished_ids.append(request_id)


def _advance_matcher(request: Request, token_id: int) -> RequestStatus | None:
    """Feeds a structured request's matcher its new token; the status it implies, if any.

    A complete grammar allows only an end-of-sequence token next, which ends the request
    as EOS does (even with ignore_eos, and left out of the text). A grammar that fails (it
    allowed no token, or its engine gave up on it) ends the request with finish reason
    "error" and the grammar's message as its stop_reason: never a silent "stop", never a hang.
    """
    matcher = request.matcher
    was_complete = matcher.is_stopped()
    if matcher.consume_token(token_id) and not matcher.is_error() and not was_complete:
        return None
    if matcher.is_error():
        error = matcher.get_error().splitlines()[0] if matcher.get_error() else "no token allowed"
        logger.warning("request %s: its grammar failed (%s); stopping it", request.request_id, error)
        request.stop_reason = f"the grammar failed: {error}"
        return RequestStatus.FINISHED_ERROR
    request.stop_reason = None
    return RequestStatus.FINISHED_STOPPED
