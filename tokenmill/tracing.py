"""OpenTelemetry request tracing (``--otlp-traces-endpoint``, ``--collect-detailed-traces``; docs/tracing.md).

``tokenmill serve`` makes one span ``llm_request`` per engine request (``RequestTracer``), built on the engine
thread when the request finishes or is aborted, with vLLM's GenAI attribute names; ``tokenmill router`` makes one
span ``router_request`` per generation request. Each is a child of the W3C ``traceparent`` / ``tracestate`` its
request came with, and the router sends its own span's to the workers (the prefill worker too, under PD).

Ending a span only appends it to a ``BatchSpanProcessor``'s queue; that processor's own thread exports batches over
OTLP/HTTP (protobuf), so neither the engine thread nor the event loop ever waits on the collector. The SDK is
imported only when a ``Tracing`` is built (no flag: nothing imported), and the global tracer provider is never set:
FastAPI would then trace every route of the server on its own.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping
from urllib.parse import urlsplit

TRACE_HEADERS = ("traceparent", "tracestate")  # W3C Trace Context
MAX_TRACEPARENT_CHARS = 256  # version 00 is 55 characters; longer values are dropped, not forwarded
MAX_TRACESTATE_CHARS = 512  # what W3C asks every vendor to propagate; longer values are dropped
DETAILED_TRACE_MODULES = ("model", "worker", "all")  # --collect-detailed-traces values (vLLM's)
LLM_REQUEST_SPAN = "llm_request"  # vLLM's span name
ROUTER_REQUEST_SPAN = "router_request"
TRACE_SCOPE_KEY = "tokenmill.trace_headers"  # router: the ASGI scope entry holding the headers sent to workers
SHUTDOWN_TIMEOUT_S = 5.0  # how long an exit waits for the last spans to be exported


class SpanAttributes:
    """Attribute names, spelled as vLLM's ``vllm/tracing.py`` spells them (OpenTelemetry GenAI semantic conventions
    plus vLLM's additions); ``GEN_AI_REQUEST_LORA_NAME`` and the ``tokenmill.*`` ones are tokenmill's."""

    GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_LORA_NAME = "gen_ai.request.lora_name"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_USAGE_CACHED_TOKENS = "gen_ai.usage.cached_tokens"
    GEN_AI_USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    # --collect-detailed-traces model
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"
    # --collect-detailed-traces worker
    GEN_AI_LATENCY_TIME_IN_MODEL_EXECUTE = "gen_ai.latency.time_in_model_execute"
    ENGINE_NUM_STEPS = "tokenmill.engine.num_steps"
    # router_request
    ROUTER_WORKER_ID = "tokenmill.router.worker_id"
    HTTP_METHOD = "http.request.method"
    HTTP_STATUS_CODE = "http.response.status_code"
    URL_PATH = "url.path"


def trace_headers(headers: Mapping[str, str]) -> dict[str, str] | None:
    """The W3C trace-context headers among ``headers`` (``traceparent``, and ``tracestate`` with it), or None
    without a ``traceparent``. Over-long values are dropped (a ``traceparent`` over 256 characters drops both),
    so a client cannot make the router forward or the server keep more than that."""
    traceparent = headers.get("traceparent")
    if not traceparent or len(traceparent) > MAX_TRACEPARENT_CHARS:
        return None
    found = {"traceparent": traceparent}
    tracestate = headers.get("tracestate")
    if tracestate and len(tracestate) <= MAX_TRACESTATE_CHARS:
        found["tracestate"] = tracestate
    return found


def otlp_traces_endpoint(url: str) -> str:
    """``--otlp-traces-endpoint`` checked: an ``http://`` or ``https://`` URL of an OTLP/HTTP receiver; one without
    a path gets OTLP's ``/v1/traces``.

    Raises:
        ValueError: not such a URL (a gRPC endpoint such as ``grpc://host:4317`` or ``host:4317`` included: tokenmill
            exports over OTLP/HTTP only, port 4318 by convention), naming the flag.
    """
    parsed = urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"--otlp-traces-endpoint must be the http:// or https:// URL of an OTLP/HTTP receiver, e.g. "
                         f"http://127.0.0.1:4318/v1/traces (tokenmill exports OTLP over HTTP/protobuf, not gRPC), "
                         f"got {url!r}")
    if parsed.path in ("", "/"):
        return url.rstrip("/") + "/v1/traces"
    return url


def detailed_trace_modules(values: Iterable[str]) -> tuple[str, ...]:
    """``--collect-detailed-traces`` values (``model``, ``worker``, ``all``) as the sorted modules they turn on.

    Raises:
        ValueError: an unknown value, naming the flag.
    """
    modules: set[str] = set()
    for value in values:
        if value not in DETAILED_TRACE_MODULES:
            raise ValueError(f"--collect-detailed-traces: unknown value {value!r}; choose from "
                             f"{', '.join(DETAILED_TRACE_MODULES)}")
        modules.update(("model", "worker") if value == "all" else (value,))
    return tuple(sorted(modules))


def _epoch_ns(monotonic_s: float, now_monotonic: float, now_epoch_ns: int) -> int:
    """A ``time.monotonic()`` reading as nanoseconds since the epoch (spans carry wall-clock times)."""
    return now_epoch_ns - int((now_monotonic - monotonic_s) * 1e9)


class Tracing:
    """A private OpenTelemetry ``TracerProvider`` exporting to one OTLP/HTTP endpoint through a
    ``BatchSpanProcessor`` (its schedule and queue follow the SDK's ``OTEL_BSP_*`` variables, the exporter's
    headers, timeout and TLS the ``OTEL_EXPORTER_OTLP_TRACES_*`` ones, sampling ``OTEL_TRACES_SAMPLER``; the
    default keeps a parent's sampled flag and samples every root).

    Args:
        endpoint: the receiver's URL (``otlp_traces_endpoint`` checked).
        service_name: the ``service.name`` resource attribute unless ``OTEL_SERVICE_NAME`` or
            ``OTEL_RESOURCE_ATTRIBUTES`` name one.
    """

    def __init__(self, endpoint: str, service_name: str) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        resource = Resource.create()
        if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
            resource = resource.merge(Resource({SERVICE_NAME: service_name}))
        self.endpoint = endpoint
        self._provider = TracerProvider(resource=resource)  # never made the global provider (see the module doc)
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self._tracer = self._provider.get_tracer("tokenmill")
        self._propagator = TraceContextTextMapPropagator()
        self._server_kind, self._error = SpanKind.SERVER, (Status, StatusCode.ERROR)
        self._set_span_in_context = set_span_in_context

    def start_span(self, name: str, headers: Mapping[str, str] | None, start_time_ns: int | None = None,
                   attributes: Mapping[str, Any] | None = None):
        """Start a server span, child of the context ``headers`` carry (a root span without one)."""
        context = self._propagator.extract(headers or {})
        return self._tracer.start_span(name, context=context, kind=self._server_kind, attributes=attributes,
                                       start_time=start_time_ns)

    def headers_of(self, span) -> dict[str, str]:
        """The ``traceparent`` (and ``tracestate``) that make a receiver's spans children of ``span``."""
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=self._set_span_in_context(span))
        return carrier

    def end_span(self, span, error: str | None = None, end_time_ns: int | None = None) -> None:
        """End ``span`` (status error with ``error`` as its description when given). Only queues it for export."""
        if error is not None:
            status, code = self._error
            span.set_status(status(code, error))
        span.end(end_time=end_time_ns)

    def shutdown(self, timeout: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Export the spans still queued and stop, waiting at most ``timeout`` seconds (an unreachable collector
        must not hold up an exit; what is left then is dropped). Blocking: call it off the event loop."""
        stopper = threading.Thread(target=self._provider.shutdown, name="tokenmill-tracing-shutdown", daemon=True)
        stopper.start()
        stopper.join(timeout)


@dataclass
class RequestTrace:
    """One engine request's trace, kept on the engine thread from its arrival (``RequestTracer.begin``) to its end.
    ``execute_time`` and ``num_steps`` grow only under ``--collect-detailed-traces worker``."""

    request_id: str
    headers: dict[str, str] | None
    model: str
    lora_name: str | None
    attributes: dict[str, Any]
    execute_time: float = 0.0  # seconds of the engine steps that produced an output of this request
    num_steps: int = 0


class RequestTracer:
    """The server's ``llm_request`` spans: ``begin`` when the engine accepts a request, ``step`` for each engine
    step with news of it, ``end`` when it finishes or is aborted. Engine thread only.

    The span starts at the request's arrival (``AsyncEngine.add``) and ends at its end on the engine thread. By
    default it carries the request's model, sampling parameters (max_tokens, temperature, top_p, n), id, token
    usage (prompt, completion, cached), finish reasons, and the queue time, TTFT and end-to-end latency in seconds.
    ``detailed`` (``--collect-detailed-traces``) adds, for ``model``, the model-phase latencies (first scheduling to
    first token, first to last token, first scheduling to last token), and for ``worker`` the summed wall time of
    the engine steps that produced the request's outputs with their count, and span events ``scheduled`` and
    ``first_token``. An aborted request (its client left, the server ended it) ends with status error.
    """

    def __init__(self, tracing: Tracing, detailed: Iterable[str] = ()) -> None:
        self.tracing = tracing
        modules = set(detailed)
        self.detail_model = "model" in modules
        self.detail_worker = "worker" in modules

    def begin(self, request_id: str, headers: dict[str, str] | None, model: str, lora_name: str | None,
              params) -> RequestTrace:
        """The trace of a request the engine just accepted (``params``: its ``SamplingParams``)."""
        A = SpanAttributes
        attributes = {A.GEN_AI_REQUEST_ID: request_id, A.GEN_AI_REQUEST_MODEL: model, A.GEN_AI_RESPONSE_MODEL: model,
                      A.GEN_AI_REQUEST_N: params.n}
        for name, value in ((A.GEN_AI_REQUEST_MAX_TOKENS, params.max_tokens),
                            (A.GEN_AI_REQUEST_TEMPERATURE, params.temperature), (A.GEN_AI_REQUEST_TOP_P, params.top_p),
                            (A.GEN_AI_REQUEST_LORA_NAME, lora_name)):
            if value is not None:
                attributes[name] = value
        return RequestTrace(request_id, headers, model, lora_name, attributes)

    def step(self, trace: RequestTrace, step_time: float) -> None:
        """An engine step of ``step_time`` seconds produced an output of the request (counted with ``worker``)."""
        if self.detail_worker:
            trace.execute_time += step_time
            trace.num_steps += 1

    def end(self, trace: RequestTrace, *, arrival_time: float, first_scheduled_time: float | None,
            first_token_time: float | None, last_token_time: float | None, end_time: float, num_prompt_tokens: int,
            num_output_tokens: int, num_cached_tokens: int, finish_reasons: list[str],
            error: str | None = None) -> None:
        """Build and end the request's span. Times are ``time.monotonic()`` seconds (None: not reached); an
        ``error`` (an abort) ends it with status error."""
        A = SpanAttributes
        attributes = dict(trace.attributes)
        attributes.update({A.GEN_AI_USAGE_PROMPT_TOKENS: num_prompt_tokens,
                           A.GEN_AI_USAGE_COMPLETION_TOKENS: num_output_tokens,
                           A.GEN_AI_USAGE_CACHED_TOKENS: num_cached_tokens,
                           A.GEN_AI_USAGE_NUM_SEQUENCES: len(finish_reasons),
                           A.GEN_AI_RESPONSE_FINISH_REASONS: tuple(finish_reasons),  # a tuple checks faster
                           A.GEN_AI_LATENCY_E2E: end_time - arrival_time})
        if first_scheduled_time is not None:
            attributes[A.GEN_AI_LATENCY_TIME_IN_QUEUE] = max(0.0, first_scheduled_time - arrival_time)
        if first_token_time is not None:
            attributes[A.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] = first_token_time - arrival_time
        if self.detail_model and first_scheduled_time is not None and first_token_time is not None:
            last = last_token_time if last_token_time is not None else first_token_time
            attributes[A.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL] = max(0.0, first_token_time - first_scheduled_time)
            attributes[A.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE] = max(0.0, last - first_token_time)
            attributes[A.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE] = max(0.0, last - first_scheduled_time)
        if self.detail_worker:
            attributes[A.GEN_AI_LATENCY_TIME_IN_MODEL_EXECUTE] = trace.execute_time
            attributes[A.ENGINE_NUM_STEPS] = trace.num_steps
        now, now_ns = time.monotonic(), time.time_ns()
        span = self.tracing.start_span(LLM_REQUEST_SPAN, trace.headers, _epoch_ns(arrival_time, now, now_ns),
                                       attributes)
        if self.detail_worker:
            for name, at in (("scheduled", first_scheduled_time), ("first_token", first_token_time)):
                if at is not None:
                    span.add_event(name, timestamp=_epoch_ns(at, now, now_ns))
        self.tracing.end_span(span, error, _epoch_ns(end_time, now, now_ns))
