"""The simulation: the engine's own scheduler, KV cache manager and plugins, in virtual time.

Each replica is what one engine runs: a real :class:`~pagoda.engine.core.scheduler.Scheduler`
built by ``Scheduler.from_config`` (block pool, prefix cache, copy-on-write, swap and
recompute, the policy and eviction plugins), and in the worker's place a
:class:`SimulatedWorker` that takes each ``SchedulerOutput`` as the worker process does and
answers it with a ``RunnerOutput``: one token for every request that samples, after the
step time the step-time model gives. The loop around them does what ``EngineCore``'s step
loop does (schedule, send, take the answer, update; with async scheduling the next step is
scheduled while one runs), with a clock that jumps from event to event instead of waiting.
Requests arrive at the trace's times; with several replicas the engine's data-parallel
``Router`` places each one.
"""

from __future__ import annotations

import math
import time
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from pagoda.engine.config import EngineConfig
from pagoda.engine.core.kv_offload_index import KVTierIndex
from pagoda.engine.core.kv_sizing import KVCacheSize
from pagoda.engine.core.policy import Policy
from pagoda.engine.core.request import Request
from pagoda.engine.core.router import Router
from pagoda.engine.core.scheduler import Scheduler
from pagoda.engine.kv_offload import DEFAULT_OFFLOAD_BYTES, HEADER
from pagoda.engine.messages import RunnerOutput, SchedulerOutput
from pagoda.engine.sampling_params import SamplingParams
from pagoda.simulator.step_time import StepShape, StepTimeModel, step_shape
from pagoda.simulator.trace import TraceRequest, prompt_token_ids

#: The token every simulated sample is (requests ignore EOS and stop at their length).
SAMPLED_TOKEN = 5


def tier_bytes(config: EngineConfig) -> int:
    """The offload tier's size in a simulation: the host memory's, else the disk's."""
    return config.kv_offload_host_bytes or config.kv_offload_bytes or DEFAULT_OFFLOAD_BYTES


class SimulationError(RuntimeError):
    """The simulated engine cannot go on (requests that can never be scheduled)."""


@dataclass(slots=True)
class StepRecord:
    """One simulated step, for fidelity checks (``record_steps=True``)."""

    replica: int
    start: float
    seconds: float
    scheduled: dict[str, int]
    shape: StepShape


class SimulatedWorker:
    """Takes steps as a worker does and answers them after the step-time model's time.

    ``send`` takes the shape of the step at once (the requests' state changes as later
    steps are scheduled), as the real worker would start on it.
    """

    def __init__(self, step_time: StepTimeModel, requests: dict[str, Request], file_bytes: int = 0,
                 read_bytes_per_s: float = 0.0) -> None:
        self.step_time = step_time
        self.requests = requests
        self.file_bytes = file_bytes
        self.read_bytes_per_s = read_bytes_per_s

    def send(self, scheduler_output: SchedulerOutput) -> tuple[RunnerOutput, StepShape]:
        """The step's answer and its shape (the answer's compute_seconds is its time)."""
        shape, sampled = step_shape(scheduler_output, self.requests)
        seconds = self.step_time.step_seconds(shape) if scheduler_output.num_scheduled_tokens else 0.0
        answer = RunnerOutput(scheduler_output.step_id, dict.fromkeys(sampled, SAMPLED_TOKEN),
                              compute_seconds=seconds)
        if scheduler_output.kv_load:
            # NOTE: every block read whole, at the tier's read rate, before the step's forward; the
            # writes are left out (the worker makes them between steps, beside the engine's work).
            answer.kv_loaded = {request_id: len(pairs) for request_id, pairs in scheduler_output.kv_load.items()}
            answer.kv_read_bytes = sum(answer.kv_loaded.values()) * self.file_bytes
            answer.kv_read_seconds = answer.kv_read_bytes / self.read_bytes_per_s
            answer.compute_seconds += answer.kv_read_seconds
        return answer, shape


class Replica:
    """One engine: its scheduler, its simulated worker and the steps in flight."""

    def __init__(self, index: int, scheduler: Scheduler, step_time: StepTimeModel, depth: int,
                 worker: SimulatedWorker | None = None) -> None:
        self.index = index
        self.scheduler = scheduler
        self.worker = worker or SimulatedWorker(step_time, scheduler.requests)
        self.depth = depth
        self.overhead = step_time.engine_overhead_s
        # (step, answer, when the worker finishes it)
        self.in_flight: deque[tuple[SchedulerOutput, RunnerOutput, float]] = deque()
        self.busy_until = 0.0
        self.busy_seconds = 0.0

    @property
    def next_finish(self) -> float:
        return self.in_flight[0][2] if self.in_flight else math.inf

    def fill(self, now: float, on_step: Callable[[StepRecord], None] | None) -> None:
        """Schedules and sends steps until ``depth`` are in flight or nothing is runnable."""
        while len(self.in_flight) < self.depth:
            if not self.in_flight and not self.scheduler.has_unfinished_requests() and not self.scheduler.has_kv_work():
                return  # NOTE: as EngineCore's loop: an idle engine sends nothing
            step = self.scheduler.schedule()
            if not step.has_work:
                return
            answer, shape = self.worker.send(step)
            start = max(now + self.overhead, self.busy_until)
            self.busy_until = start + answer.compute_seconds
            self.busy_seconds += answer.compute_seconds
            self.in_flight.append((step, answer, self.busy_until))
            if on_step is not None:
                on_step(StepRecord(self.index, start, answer.compute_seconds, dict(step.num_scheduled_tokens), shape))

    def kv_usage(self) -> float:
        manager = self.scheduler.kv_cache_manager
        return 1 - manager.get_num_free_blocks() / manager.num_blocks

    def finish_step(self):
        """Applies the oldest step's answer; returns the scheduler's updates."""
        step, answer, _ = self.in_flight.popleft()
        return self.scheduler.update(step, answer)


@dataclass(slots=True)
class SimulationResult:
    """What happened to every request and to the engine over time.

    Per request (arrays indexed like the trace; NaN where it never happened): arrival,
    priority, first token and finish times in simulated seconds, output tokens. ``rejected`` marks
    requests longer than max_model_len (a server answers them 400). ``itl``: every gap
    between two tokens of one request. The time series, one point per step result:
    time, running and waiting requests (all replicas), KV usage (0..1, their mean).
    ``busy_seconds``: device time per replica.
    """

    policy: str
    eviction: str
    arrival: np.ndarray
    priority: np.ndarray
    first_token: np.ndarray
    finish: np.ndarray
    num_output: np.ndarray
    rejected: np.ndarray
    itl: np.ndarray
    series_time: np.ndarray
    series_running: np.ndarray
    series_waiting: np.ndarray
    series_kv_usage: np.ndarray
    num_steps: int
    num_preemptions: int
    num_swapped_out: int
    num_recomputed: int
    prompt_tokens: int
    prompt_tokens_cached: int
    prompt_tokens_loaded: int
    busy_seconds: float
    wall_seconds: float
    max_running: int
    num_blocks: int
    disk_tier_gib: float = 0.0  # the disk tier's budget (0: off)
    steps: list[StepRecord] = field(default_factory=list)


class Simulation:
    """Runs a trace through simulated replicas of one engine configuration.

    Args:
        config: The engine configuration (scheduling and eviction policy, plugins, budget,
            block size, prefix caching, preemption, async scheduling, data parallelism).
        kv: The KV cache of each replica (sized for the device by the caller).
        step_time: The step-time model.
        make_policy: Builds a fresh policy (plugins included) for a replica.
        vocab_size: The model's vocabulary (prompt ids stay below it).
        record_steps: Keep every step's schedule (fidelity checks; costs memory).
        kv_offload_read_bytes_per_s: With an offload tier (``config.kv_offload_host_bytes`` or
            ``kv_offload_dir``): how fast it reads back (its index runs as the engine's; no
            block is written or read).
    """

    def __init__(self, config: EngineConfig, kv: KVCacheSize, step_time: StepTimeModel,
                 make_policy: Callable[[], Policy], vocab_size: int, record_steps: bool = False,
                 kv_offload_read_bytes_per_s: float = 0.5e9) -> None:
        if config.speculative_config is not None:
            raise ValueError("the simulator does not model speculative decoding")
        self.config = config
        self.kv = kv
        self.step_time = step_time
        self.vocab_size = vocab_size
        depth = 2 if config.async_scheduling else 1
        self.replicas = []
        for i in range(config.data_parallel_size):
            scheduler = Scheduler.from_config(replace(config, data_parallel_size=1), kv, make_policy())
            worker = None
            if config.offloads_kv:
                file_bytes = HEADER.size + kv.bytes_per_block
                scheduler.kv_cache_manager.offload = KVTierIndex(
                    None, file_bytes, tier_bytes(config), config.block_size, evictor=scheduler.policy.make_evictor())
                worker = SimulatedWorker(step_time, scheduler.requests, file_bytes, kv_offload_read_bytes_per_s)
            self.replicas.append(Replica(i, scheduler, step_time, depth, worker))
        self.router = Router(self.replicas, policy=self.replicas[0].scheduler.policy) if len(self.replicas) > 1 else None
        self.record_steps = record_steps

    def run(self, trace: list[TraceRequest], progress: bool | None = None) -> SimulationResult:
        """Simulates the trace to its end (every request finished or rejected)."""
        from tqdm import tqdm

        n = len(trace)
        arrival = np.array([r.arrival for r in trace], dtype=np.float64)
        first = np.full(n, np.nan)
        finish = np.full(n, np.nan)
        last = np.zeros(n)
        num_output = np.zeros(n, dtype=np.int64)
        rejected = np.zeros(n, dtype=bool)
        itl = array("d")
        series = [array("d") for _ in range(4)]
        steps: list[StepRecord] = []
        on_step = steps.append if self.record_steps else None
        max_model_len = self.kv.max_model_len
        replicas = self.replicas
        max_running = 0
        wall = time.perf_counter()
        bar = tqdm(total=n, desc="simulating", unit="req", disable=None if progress is None else not progress,
                   smoothing=0.05, mininterval=0.5)
        i = 0
        while True:
            t_arrival = arrival[i] if i < n else math.inf
            busy = min(replicas, key=lambda r: r.next_finish)
            t_finish = busy.next_finish
            if t_arrival == math.inf and t_finish == math.inf:
                stuck = [r for r in replicas if r.scheduler.has_unfinished_requests()]
                if stuck:
                    raise SimulationError(f"{sum(len(r.scheduler.requests) for r in stuck)} requests can never be "
                                          "scheduled (a KV cache too small for them?)")
                break
            if t_arrival <= t_finish:
                now = t_arrival
                touched = set()
                # NOTE: every request arriving at this instant is queued before a step is
                # scheduled, as when a client submits a batch at once.
                while i < n and arrival[i] == now:
                    request = trace[i]
                    if request.prompt_len >= max_model_len:
                        rejected[i] = True
                        bar.update(1)
                    else:
                        touched.add(self._add(i, request, now))
                    i += 1
                for replica in touched:
                    # NOTE: as EngineCore's loop: with a step in flight it waits for the answer
                    # before it looks at new requests.
                    if not replica.in_flight:
                        replica.fill(now, on_step)
                continue
            now = t_finish
            updates = busy.finish_step()
            finished = 0
            for update in updates:
                index = int(update.request.request_id)
                if math.isnan(first[index]):
                    first[index] = now
                else:
                    itl.append(now - last[index])
                last[index] = now
                num_output[index] += len(update.new_token_ids)
                if update.finished:
                    finish[index] = now
                    finished += 1
            if finished:
                bar.update(finished)
            busy.fill(now, on_step)
            running = sum(r.scheduler.num_running for r in replicas)
            max_running = max(max_running, running)
            series[0].append(now)
            series[1].append(running)
            series[2].append(sum(r.scheduler.num_waiting for r in replicas))
            series[3].append(sum(r.kv_usage() for r in replicas) / len(replicas))
        bar.close()
        stats = [r.scheduler.stats for r in replicas]
        return SimulationResult(
            policy=self.config.scheduling_policy, eviction=self.config.eviction_policy, arrival=arrival,
            priority=np.array([r.priority for r in trace], dtype=np.int64),
            first_token=first, finish=finish, num_output=num_output, rejected=rejected,
            itl=np.frombuffer(itl, dtype=np.float64) if itl else np.zeros(0),
            series_time=np.frombuffer(series[0]) if series[0] else np.zeros(0),
            series_running=np.frombuffer(series[1]) if series[1] else np.zeros(0),
            series_waiting=np.frombuffer(series[2]) if series[2] else np.zeros(0),
            series_kv_usage=np.frombuffer(series[3]) if series[3] else np.zeros(0),
            num_steps=sum(s.num_steps for s in stats),
            num_preemptions=sum(s.num_preemptions for s in stats),
            num_swapped_out=sum(s.num_swapped_out for s in stats),
            num_recomputed=sum(s.num_recomputed for s in stats),
            prompt_tokens=sum(s.num_prompt_tokens for s in stats),
            prompt_tokens_cached=sum(s.num_prompt_tokens_cached for s in stats),
            prompt_tokens_loaded=sum(s.num_prompt_tokens_loaded for s in stats),
            busy_seconds=sum(r.busy_seconds for r in replicas) / len(replicas),
            wall_seconds=time.perf_counter() - wall, max_running=max_running,
            num_blocks=self.kv.num_blocks, steps=steps,
            disk_tier_gib=tier_bytes(self.config) / 1024**3 if self.config.offloads_kv else 0.0)

    def _add(self, index: int, trace_request: TraceRequest, now: float) -> Replica:
        """Queues a trace request at its arrival; returns the replica it went to."""
        prompt = prompt_token_ids(trace_request, index, self.vocab_size)
        max_tokens = min(trace_request.output_len, self.kv.max_model_len - trace_request.prompt_len)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        replica = self.replicas[self.router.route(prompt) if self.router is not None else 0]
        # NOTE: arrival stamps strictly increase with the trace's order, as a server's clock
        # stamps requests that come together: policies order by them (a preempted request
        # goes back ahead of those that arrived after it).
        stamp = now + index * 1e-9
        replica.scheduler.add_request(Request(str(index), prompt, params, max_tokens, arrival_time=stamp,
                                              priority=trace_request.priority, client=trace_request.client,
                                              kv_retention=trace_request.kv_retention))
        return replica
