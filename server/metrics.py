"""Prometheus metrics with vLLM's names and meanings, under the prefix ``pagoda:``.

A dashboard built for vLLM works after renaming ``vllm:`` to ``pagoda:``. Engine-wide
gauges and counters (requests running and waiting, KV cache usage, token and
preemption counts, prefix cache queries and hits) are read from the engine at scrape
time; per-request histograms are observed by the request handlers.

Every metric carries the labels ``model_name`` (the first served model name) and
``engine`` ("0"), as vLLM's do. The registry belongs to the app: no global state.
"""

from __future__ import annotations

from collections import deque

import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

if TYPE_CHECKING:
    from pagoda.engine.frontend.async_engine import AsyncEngine
    from pagoda.engine.outputs import RequestOutput

PREFIX = "pagoda:"
LABELS = ("model_name", "engine")

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class _EngineCollector:
    """Reads the engines' own counters at scrape time, so nothing is counted twice; one
    sample per engine replica (label ``engine``)."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self._engine = engine
        self._model_name = model_name

    def collect(self):
        engines = [e for e in self._engine.engines if e.scheduler is not None]
        if not engines:
            return
        families = {}

        def sample(cls, name: str, doc: str, labels: list[str], value: float, extra_labels: tuple = ()) -> None:
            family = families.get(name)
            if family is None:
                family = families[name] = cls(PREFIX + name, doc, labels=LABELS + extra_labels)
            family.add_metric(labels, value)

        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        for index, engine in enumerate(engines):
            labels = [self._model_name, str(index)]
            scheduler = engine.scheduler
            stats = scheduler.stats
            usage = scheduler.kv_cache_manager.usage()
            sample(gauge, "num_requests_running", "Number of requests in model execution batches.", labels,
                   scheduler.num_running)
            sample(gauge, "num_requests_waiting", "Number of requests waiting to be processed.", labels,
                   scheduler.num_waiting)
            sample(gauge, "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels, usage.usage)
            sample(counter, "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                   labels, stats.prefix_cache_queries)
            sample(counter, "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", labels,
                   stats.prefix_cache_hits)
            sample(counter, "num_preemptions", "Cumulative number of preemptions from the engine.", labels,
                   stats.num_preemptions)
            sample(counter, "prompt_tokens", "Number of prefill tokens processed.", labels, stats.num_prompt_tokens)
            sample(counter, "prompt_tokens_cached", "Number of cached prompt tokens (local prefix cache hits).",
                   labels, stats.num_prompt_tokens_cached)
            computed = stats.num_prompt_tokens - stats.num_prompt_tokens_cached
            loaded = stats.num_prompt_tokens_loaded
            for source, value in (("local_compute", computed), ("local_cache_hit", stats.num_prompt_tokens_cached - loaded),
                                  ("external_kv_transfer", loaded)):
                sample(counter, "prompt_tokens_by_source", "Number of prompt tokens by source.", [*labels, source],
                       value, ("source",))
            sample(counter, "prefill_tokens_computed", "Prompt tokens the model ran, recomputation after "
                   "preemption included (Pagoda's own).", labels, stats.num_prefill_tokens_computed)
            sample(counter, "generation_tokens", "Number of generation tokens processed.", labels,
                   stats.num_generation_tokens)
            if scheduler.speculative is not None:
                sample(counter, "spec_decode_num_drafts", "Number of spec decoding drafts.", labels, stats.num_drafts)
                sample(counter, "spec_decode_num_draft_tokens", "Number of draft tokens.", labels,
                       stats.num_draft_tokens)
                sample(counter, "spec_decode_num_accepted_tokens", "Number of accepted tokens.", labels,
                       stats.num_accepted_tokens)
                for position, accepted in enumerate(stats.accepted_per_position):
                    sample(counter, "spec_decode_num_accepted_tokens_per_pos",
                           "Accepted tokens per draft position.", [*labels, str(position)], accepted, ("position",))
            if scheduler.max_loras is not None:
                # NOTE: vLLM's gauge: the adapters in its labels, the scrape's time as its value.
                running, waiting = scheduler.lora_counts()
                sample(gauge, "lora_requests_info", "Running stats on lora requests.",
                       [*labels, str(scheduler.max_loras), ",".join(sorted(running)), ",".join(sorted(waiting))],
                       time.time(), ("max_lora", "running_lora_adapters", "waiting_lora_adapters"))
                sample(counter, "lora_adapter_sends", "LoRA adapters sent to the worker: a first use, or again "
                       "after it was dropped past --max-cpu-loras (Pagoda's own).", labels, stats.num_lora_sends)
            offload = scheduler.kv_cache_manager.offload
            if offload is not None:
                tier = offload.stats
                sample(gauge, "kv_offload_files", "Blocks of the prefix cache's disk tier on disk (Pagoda's own).",
                       labels, offload.num_files)
                for name, doc, value in (
                        ("kv_offload_blocks_stored", "Cached blocks sent to the disk tier.", tier.num_stored),
                        ("kv_offload_blocks_loaded", "Blocks read back from the disk tier instead of computed.",
                         tier.num_loaded),
                        ("kv_offload_load_failures", "Blocks found missing or damaged on disk, computed instead.",
                         tier.num_load_failures),
                        ("kv_offload_blocks_deleted", "Files deleted to keep the disk tier within its budget.",
                         tier.num_deleted),
                        ("kv_offload_read_bytes", "Bytes read back from the disk tier.", tier.bytes_read)):
                    sample(counter, name, f"{doc} (Pagoda's own)", labels, value)
            grammars = engine.grammar_compiler
            sample(counter, "structured_output_requests", "Requests with a structured-output constraint (Pagoda's own).",
                   labels, grammars.num_requests if grammars else 0)
            sample(counter, "grammar_compiles", "Distinct output constraints compiled (cache misses; Pagoda's own).",
                   labels, grammars.num_compiles if grammars else 0)
            sample(counter, "grammar_compile_seconds", "Seconds spent compiling output constraints (Pagoda's own).",
                   labels, grammars.compile_seconds if grammars else 0.0)
            sample(counter, "worker_restarts", "Times the worker process died and was restarted.", labels,
                   engine.num_worker_restarts)
            sample(counter, "worker_restart_seconds", "Seconds from a worker's death noticed to its replacement "
                   "ready, summed over restarts.", labels, engine.worker_restart_seconds)
            ready = engine.worker.ready if engine.worker is not None else None
            if ready is not None:
                info = families.get("engine")
                if info is None:
                    info = families["engine"] = InfoMetricFamily(PREFIX + "engine", "How the engine runs the model.",
                                                                 labels=LABELS)
                info.add_metric(labels, {"attention_backend": ready.attention_backend, "device": ready.device,
                                         "dtype": ready.dtype, "compiled": str(ready.compile_seconds > 0).lower(),
                                         "tensor_parallel_size": str(engine.config.tensor_parallel_size)})
        yield from families.values()


class ServerMetrics:
    """The app's registry and the per-request metrics.

    Args:
        engine: The engine whose counters are exported.
        model_name: Value of the ``model_name`` label.
    """

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.registry = registry = CollectorRegistry()
        self.labels = [model_name, "0"]
        #: The latest finished requests' (finish time, TTFT, TPOT) seconds, for the console.
        self.recent: deque[tuple[float, float | None, float | None]] = deque(maxlen=512)
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        registry.register(_EngineCollector(engine, model_name))

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, doc, LABELS, buckets=buckets, registry=registry)

        self.request_success = Counter(PREFIX + "request_success", "Count of successfully processed requests.",
                                       LABELS + ("finished_reason",), registry=registry)
        self.ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             _LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", _LATENCY_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", _LATENCY_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", _LATENCY_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.", _LATENCY_BUCKETS)
        self.prompt_tokens = histogram("request_prompt_tokens", "Number of prefill tokens processed.",
                                       _TOKEN_BUCKETS)
        self.generation_tokens = histogram("request_generation_tokens", "Number of generation tokens processed.",
                                           _TOKEN_BUCKETS)
        self.params_n = histogram("request_params_n", "Histogram of the n request parameter.",
                                  (1, 2, 5, 10, 20, 50, 100))
        self.params_max_tokens = histogram("request_params_max_tokens",
                                           "Histogram of the max_tokens request parameter.", _TOKEN_BUCKETS)

    def render(self) -> bytes:
        """The text exposition of every metric."""
        return generate_latest(self.registry)

    def tracker(self) -> RequestTracker:
        """A recorder for one engine request."""
        return RequestTracker(self)


class RequestTracker:
    """Observes one engine request: inter-token latency as it streams, the rest at the end.

    An output can bring several new tokens (a consumer that fell behind); their gap is
    spread evenly over them, so every token still gets one observation.
    """

    __slots__ = ("_metrics", "_num_tokens", "_last_token_time", "_done")

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics
        self._num_tokens = 0
        self._last_token_time: float | None = None
        self._done = False

    def update(self, output: RequestOutput, num_tokens: int) -> None:
        """Records an output; ``num_tokens``: the first sample's tokens so far."""
        timing = output.metrics
        if timing is None or not output.outputs or timing.first_token_time is None:
            return
        previous_time = self._last_token_time or timing.first_token_time
        previous_num = self._num_tokens or 1
        if num_tokens > previous_num and timing.last_token_time is not None:
            gap = (timing.last_token_time - previous_time) / (num_tokens - previous_num)
            child = self._metrics.itl.labels(*self._metrics.labels)
            for _ in range(num_tokens - previous_num):
                child.observe(max(gap, 0.0))
        if num_tokens:
            self._num_tokens = num_tokens
            self._last_token_time = timing.last_token_time

    def finish(self, output: RequestOutput, max_tokens: int | None, num_tokens: list[int],
               finish_reasons: list[str | None]) -> None:
        """Records a finished request (call once, with its last output).

        Args:
            output: The last output.
            max_tokens: The request's max_tokens.
            num_tokens: Tokens generated by each sample.
            finish_reasons: Each sample's finish reason.
        """
        if self._done:
            return
        self._done = True
        self.update(output, num_tokens[0])
        m, labels = self._metrics, self._metrics.labels
        for count, reason in zip(num_tokens, finish_reasons):
            m.request_success.labels(*labels, reason or "abort").inc()
            m.generation_tokens.labels(*labels).observe(count)
        m.prompt_tokens.labels(*labels).observe(len(output.prompt_token_ids))
        m.params_n.labels(*labels).observe(len(output.outputs))
        if max_tokens is not None:
            m.params_max_tokens.labels(*labels).observe(max_tokens)
        timing = output.metrics
        if timing is None:
            return
        end = timing.finished_time or time.time()
        m.e2e.labels(*labels).observe(max(end - timing.arrival_time, 0.0))
        if timing.first_scheduled_time is not None:
            m.queue_time.labels(*labels).observe(max(timing.first_scheduled_time - timing.arrival_time, 0.0))
        if timing.first_token_time is not None:
            m.ttft.labels(*labels).observe(max(timing.first_token_time - timing.arrival_time, 0.0))
            if timing.first_scheduled_time is not None:
                m.prefill_time.labels(*labels).observe(max(timing.first_token_time - timing.first_scheduled_time, 0))
        if timing.last_token_time is not None and timing.first_token_time is not None:
            m.decode_time.labels(*labels).observe(max(timing.last_token_time - timing.first_token_time, 0.0))
        ttft = None if timing.first_token_time is None else max(timing.first_token_time - timing.arrival_time, 0.0)
        tpot = None
        if timing.last_token_time is not None and timing.first_token_time is not None and num_tokens[0] > 1:
            tpot = (timing.last_token_time - timing.first_token_time) / (num_tokens[0] - 1)
        m.recent.append((end, ttft, tpot))
        if timing.last_token_time is not None and timing.first_scheduled_time is not None:
            m.inference_time.labels(*labels).observe(max(timing.last_token_time - timing.first_scheduled_time, 0))

    def abort(self, num_samples: int, reason: str = "abort") -> None:
        """Records a request that ended early: its client left ("abort") or it failed ("error")."""
        if self._done:
            return
        self._done = True
        self._metrics.request_success.labels(*self._metrics.labels, reason).inc(num_samples)
