"""OpenTelemetry tracing: one SERVER span per generation request, vLLM's gen_ai attributes.

Tracing is off unless configured: ``--otlp-traces-endpoint URL``, or the standard
variables (``OTEL_TRACES_EXPORTER=otlp|console``, ``OTEL_EXPORTER_OTLP_ENDPOINT``,
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``; ``OTEL_SDK_DISABLED=true`` turns it off;
``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES`` and ``OTEL_TRACES_SAMPLER`` apply).
The OTLP exporter (``pip install opentelemetry-exporter-otlp``) is imported only then.

The tracer provider belongs to the app (it is never installed globally). A span is
parented from the request's W3C ``traceparent`` header when there is one.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aiohttp import web
    from opentelemetry.sdk.trace import TracerProvider

    from pagoda.engine.outputs import RequestOutput
    from pagoda.server.protocol import GenerateRequest

logger = logging.getLogger(__name__)


def _otlp_exporter(endpoint: str | None):
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()


def build_tracer_provider(otlp_traces_endpoint: str | None = None) -> TracerProvider | None:
    """Builds the tracer provider that the configuration asks for, or None (tracing off).

    Raises:
        ValueError: ``otlp_traces_endpoint`` was given but the OTLP exporter is not installed.
    """
    env = os.environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    names = {n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()}
    if otlp_traces_endpoint:
        names.add("otlp")
    elif not names and (env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
        names.add("otlp")
    names.discard("none")
    if not names:
        return None
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    attributes = {} if env.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: "pagoda"}
    provider = TracerProvider(resource=Resource.create(attributes))
    num_exporters = 0
    for name in sorted(names):
        if name == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
            num_exporters += 1
        elif name == "otlp":
            try:
                exporter = _otlp_exporter(otlp_traces_endpoint)
            except ImportError as exc:
                message = f"OTLP trace export needs `pip install opentelemetry-exporter-otlp` ({exc})"
                if otlp_traces_endpoint:
                    raise ValueError(message) from exc
                logger.warning("%s; traces are not exported", message)
                continue
            provider.add_span_processor(BatchSpanProcessor(exporter))
            num_exporters += 1
        else:
            logger.warning("OTEL_TRACES_EXPORTER=%s is not supported; use otlp or console", name)
    if not num_exporters:
        provider.shutdown()
        return None
    logger.info("tracing on: exporting to %s", ", ".join(sorted(names)))
    return provider


class Tracing:
    """Starts request spans from one tracer provider.

    Args:
        provider: An OpenTelemetry SDK TracerProvider.
    """

    def __init__(self, provider: TracerProvider) -> None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.tracer = provider.get_tracer("pagoda.server")
        self._propagator = TraceContextTextMapPropagator()

    def start(self, request: web.Request, operation: str) -> RequestSpan:
        """Starts the SERVER span of one HTTP request, child of its ``traceparent``."""
        from opentelemetry.trace import SpanKind

        context = self._propagator.extract(carrier=dict(request.headers))
        span = self.tracer.start_span(operation, context=context, kind=SpanKind.SERVER,
                                      attributes={"http.request.method": request.method, "url.path": request.path,
                                                  "gen_ai.operation.name": operation, "gen_ai.system": "pagoda"})
        return RequestSpan(span)


class RequestSpan:
    """One request's span; every method does nothing when tracing is off (``span`` None)."""

    __slots__ = ("_span", "_num_prompt_tokens", "_num_completion_tokens", "_timed", "_finish_reasons", "_error")

    def __init__(self, span: Any | None = None) -> None:
        self._span = span
        self._num_prompt_tokens = 0
        self._num_completion_tokens = 0
        self._timed = False
        self._finish_reasons: list[str] = []
        self._error: str | None = None

    def set_request(self, gen: GenerateRequest, request_id: str, model: str, lora_name: str | None = None) -> None:
        """Records the request's id, model (an adapter's name where it names one, and then
        ``pagoda.lora_adapter``) and sampling parameters."""
        if self._span is None:
            return
        params = gen.params
        attributes = {
            "gen_ai.request.id": request_id, "gen_ai.request.model": model, "gen_ai.response.model": model,
            "gen_ai.request.temperature": params.temperature, "gen_ai.request.top_p": params.top_p,
            "gen_ai.request.n": params.n,
        }
        if gen.max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = gen.max_tokens
        if params.seed is not None:
            attributes["gen_ai.request.seed"] = params.seed
        if lora_name is not None:
            attributes["pagoda.lora_adapter"] = lora_name
        self._span.set_attributes(attributes)

    def add_output(self, output: RequestOutput, num_completion_tokens: int,
                   finish_reasons: list[str | None]) -> None:
        """Adds one engine request's outcome: usage, latencies and its timed events.

        Args:
            output: The request's last output (its metrics are read).
            num_completion_tokens: Tokens its samples generated.
            finish_reasons: Each sample's finish reason.
        """
        if self._span is None:
            return
        self._num_prompt_tokens += len(output.prompt_token_ids)
        self._num_completion_tokens += num_completion_tokens
        self._finish_reasons += [reason or "abort" for reason in finish_reasons]
        self._span.set_attributes({
            "gen_ai.usage.prompt_tokens": self._num_prompt_tokens,
            "gen_ai.usage.completion_tokens": self._num_completion_tokens,
            "gen_ai.response.finish_reasons": self._finish_reasons,
        })
        timing = output.metrics
        if timing is None:
            return
        for name, at in timing.events:
            self._span.add_event(name, {"gen_ai.request.id": output.request_id}, timestamp=int(at * 1e9))
        if self._timed:
            return  # NOTE: latencies are those of the first prompt, as for n > 1.
        self._timed = True
        # NOTE: the prompt tokens the prefix cache served, from the KV pool or read back from the
        # disk tier (whose read is the "kv_load" event).
        latency = {"gen_ai.latency.e2e": (timing.finished_time or time.time()) - timing.arrival_time,
                   "pagoda.prefix_cache.cached_tokens": timing.num_cached_tokens}
        if timing.first_scheduled_time is not None:
            latency["gen_ai.latency.time_in_queue"] = timing.first_scheduled_time - timing.arrival_time
        if timing.first_token_time is not None:
            latency["gen_ai.latency.time_to_first_token"] = timing.first_token_time - timing.arrival_time
            if timing.first_scheduled_time is not None:
                latency["gen_ai.latency.time_in_model_prefill"] = timing.first_token_time - timing.first_scheduled_time
        if timing.last_token_time is not None and timing.first_token_time is not None:
            latency["gen_ai.latency.time_in_model_decode"] = timing.last_token_time - timing.first_token_time
        self._span.set_attributes(latency)

    def fail(self, error: str) -> None:
        """Marks a failure after the response started (a stream that ends in an error event)."""
        self._error = error

    def end(self, status: int, error: str | None = None) -> None:
        """Ends the span with the HTTP status; 5xx (and a failure mid-stream) mark it as an error."""
        if self._span is None:
            return
        error = error or self._error
        from opentelemetry.trace import Status, StatusCode

        self._span.set_attribute("http.response.status_code", status)
        if error is not None:
            self._span.set_attribute("error.type", str(status))
            if status >= 500 or status == 200:
                self._span.set_status(Status(StatusCode.ERROR, error))
        self._span.end()
