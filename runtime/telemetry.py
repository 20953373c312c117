"""Logs, traces and metrics for every service, set up in one place.

    TelemetrySettings.from_env()   every environment variable read here, typed
    configure_logging(service)     structlog JSON lines on stdout; inside a request each line
                                   carries request_id, trace_id and span_id
    configure_tracing(service)     OpenTelemetry exporting OTLP when OTEL_* asks for it (an
                                   endpoint, or OTEL_TRACES_EXPORTER), else a no-op tracer
    Metrics(role, model_name)      Prometheus collectors named like vLLM's, prefix `tandem:`
                                   (runtime/metrics.py)
    Telemetry                      what servicers call: request spans, their attributes, the
                                   KV-transfer span (the router's record of a request is
                                   router_svc/request_record.py)

One request's trace across three processes (README "Observing it" shows a real one):

    router   "chat <model>"                 GenAI attributes, usage, finish reasons, TTFT;
      │                                     events: admitted, first_token, sample_finished,
      │                                     migrated, and how it ended
      ├ tandem.v1.Worker/Prefill (CLIENT)   the router's call
      │   └ /tandem.v1.Worker/Prefill       the prefill worker's gRPC server span
      │       └ prefill                     queue time, chunks, cached tokens
      │           ├ queue                   waiting for an engine step
      │           └ prefill_compute         the prompt's chunks, to the first token
      └ decode_leg (CLIENT)                 one per decode worker the request went to
          └ decode                          the decode worker's span (kind SERVER): queue time,
              │                             time to first token, per output token
              ├ kv_pool_registration        the first request of a (decode, prefill) pair only
              ├ tandem.v1.Worker/ClaimLease (CLIENT) → its server span on the prefill worker
              ├ kv_wait                     waiting for free blocks
              ├ kv_transfer                 blocks, bytes, GB/s (measured on the engine core)
              ├ decode_steps                generation
              └ tandem.v1.Worker/Release (CLIENT)    → its server span on the prefill worker

Every span ends saying how the request ended (runtime/request_trace.py): status ERROR and
error.type for a cancel, a refusal or a failure, with the finish reasons and tokens so far.

The context travels as W3C traceparent: in each unary call's gRPC metadata, where
opentelemetry-instrumentation-grpc's aio server interceptor extracts it and makes the server
span, and in each request message on a worker's Stream call (one call carries many requests),
where the decode servicer extracts it for that request's span. Callers make a CLIENT span per
call and send its context (request_trace.client_call). Not the instrumentation's client
interceptors: they end a server stream's span only when their wrapper generator runs out, which
a consumer that stops early leaves to garbage collection.

Never recorded, in spans or logs: token ids, lease tokens and IPC handles (a shm segment's
name, CUDA handle bytes: capabilities all), and prompt or output text unless content capture is asked for
(--trace-content or OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true, router only).

Cost: no span, log line or histogram per token. A worker calls Metrics.on_step once per engine
step, when the step's message arrives from its engine core (two counter increments, one histogram sample for a decode step, and the per-request
histograms of sequences that finished); gauges and the engine's own counters are read when
Prometheus scrapes.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from tandem.runtime.cancel_interceptors import cancel_status_interceptors
from tandem.runtime.metrics import Metrics
from tandem.runtime.request_trace import (
    CANCELLED,
    FINISHED,
    WorkerSpan,
    phase_spans,
    timing_attrs,
)

if TYPE_CHECKING:
    from tandem.engine.sequence import SeqOutput
    from tandem.engine.serving.core_messages import LeaseDone

log = structlog.get_logger(__name__)

EXPORTERS = ("otlp", "console")


# -- settings ----------------------------------------------------------------------------------
def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class TelemetrySettings:
    """The environment, read once. The OpenTelemetry SDK reads the rest of OTEL_* itself
    (OTEL_BSP_SCHEDULE_DELAY, OTEL_EXPORTER_OTLP_HEADERS, ..._TIMEOUT, ..._INSECURE, ...)."""

    service_name: str | None = None  # OTEL_SERVICE_NAME; default tandem-<role>
    traces_exporter: tuple[str, ...] | None = None  # OTEL_TRACES_EXPORTER: otlp, console, none
    otlp_endpoint: str | None = None  # OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or _OTLP_ENDPOINT
    sdk_disabled: bool = False  # OTEL_SDK_DISABLED
    capture_content: bool = False  # OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT
    log_format: str = "json"  # TANDEM_LOG_FORMAT: json | console
    log_level: str = "INFO"  # TANDEM_LOG_LEVEL

    def __post_init__(self) -> None:
        if self.log_format not in ("json", "console"):
            raise ValueError(f"TANDEM_LOG_FORMAT must be json or console, not "
                             f"{self.log_format!r}")
        unknown = set(self.traces_exporter or ()) - {*EXPORTERS, "none"}
        if unknown:
            raise ValueError(f"OTEL_TRACES_EXPORTER: {', '.join(sorted(unknown))} not supported "
                             f"(supported: {', '.join(EXPORTERS)}, none)")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TelemetrySettings:
        env = os.environ if env is None else env
        exporters = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
        return cls(
            service_name=env.get("OTEL_SERVICE_NAME") or None,
            traces_exporter=tuple(e.strip() for e in exporters.split(",") if e.strip())
            if exporters else None,
            otlp_endpoint=env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            or env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None,
            sdk_disabled=_truthy(env.get("OTEL_SDK_DISABLED")),
            capture_content=_truthy(env.get("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT")),
            log_format=env.get("TANDEM_LOG_FORMAT", "json").strip().lower() or "json",
            log_level=env.get("TANDEM_LOG_LEVEL", "INFO").strip().upper() or "INFO")

    @property
    def exporters(self) -> tuple[str, ...]:
        """The span exporters to run; none (tracing off) unless an endpoint or
        OTEL_TRACES_EXPORTER asks for one."""
        if self.sdk_disabled:
            return ()
        if self.traces_exporter is not None:
            return tuple(e for e in self.traces_exporter if e != "none")
        return ("otlp",) if self.otlp_endpoint else ()

    def service(self, role: str) -> str:
        return self.service_name or f"tandem-{role}"


# -- logs --------------------------------------------------------------------------------------
def add_trace_ids(_logger: Any, _method: str, event: dict[str, Any]) -> dict[str, Any]:
    """structlog processor: the current span's trace and span ids, when there is one."""
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        event["trace_id"] = format(ctx.trace_id, "032x")
        event["span_id"] = format(ctx.span_id, "016x")
    return event


def configure_logging(service: str, *, json: bool = True, level: str | int = "INFO") -> None:
    """Every log line of the process, stdlib `logging` and structlog alike, as one JSON object
    per line on stdout: timestamp, level, logger, event, service, plus request_id (bound by the
    request's handler), trace_id and span_id inside a request."""
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _add_service(service),
        add_trace_ids,
    ]
    structlog.configure(
        processors=[structlog.stdlib.filter_by_level, *shared,
                    structlog.stdlib.PositionalArgumentsFormatter(),
                    structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True)
    renderer = (structlog.processors.JSONRenderer() if json
                else structlog.dev.ConsoleRenderer(colors=False))
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info, renderer]))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.captureWarnings(True)


def configure_process_logging(role: str) -> None:
    """The logging of a process serving `role` from the environment's settings: what a worker's
    engine core runs first (CoreSpec.process_setup)."""
    settings = TelemetrySettings.from_env()
    configure_logging(settings.service(role), json=settings.log_format == "json",
                      level=settings.log_level)


def _add_service(service: str) -> Callable[[Any, str, dict[str, Any]], dict[str, Any]]:
    def add(_logger: Any, _method: str, event: dict[str, Any]) -> dict[str, Any]:
        event["service"] = service
        return event

    return add


# -- traces ------------------------------------------------------------------------------------
class Tracing:
    """The process's tracer, the gRPC server interceptor that goes with it, and the flush at
    exit. With tracing off: a no-op tracer, no interceptor."""

    def __init__(self, tracer: trace.Tracer | None = None, provider: Any = None,
                 interceptors: Iterable[Any] = ()) -> None:
        self.tracer = tracer or trace.NoOpTracer()
        self.provider = provider
        self._interceptors = list(interceptors)

    @property
    def enabled(self) -> bool:
        return self.provider is not None

    def server_interceptors(self) -> list[Any]:
        return list(self._interceptors)

    def shutdown(self) -> None:
        """Export what is still buffered, then stop the exporters."""
        if self.provider is not None:
            self.provider.shutdown()


def configure_tracing(service: str, settings: TelemetrySettings | None = None) -> Tracing:
    """Tracing as the environment asks. When on: a global TracerProvider whose resource names
    the service, batch export (OTEL_BSP_* tune it), and a gRPC server interceptor that continues
    the caller's trace (`server_interceptors()`). Health checks, GetLoad polls and reflection
    are left out of traces."""
    settings = settings or TelemetrySettings.from_env()
    if not settings.exporters:
        return Tracing()
    # The SDK and exporters load only when tracing is on.
    from opentelemetry.instrumentation.grpc import aio_server_interceptor, filters  # noqa: PLC0415
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource  # noqa: PLC0415
    from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415
    from opentelemetry.sdk.trace.export import (  # noqa: PLC0415
        BatchSpanProcessor,
        ConsoleSpanExporter,
    )

    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service,
                                                        "service.namespace": "tandem"}))
    for name in settings.exporters:
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # noqa: PLC0415
                OTLPSpanExporter,
            )

            exporter: Any = OTLPSpanExporter()
        else:
            exporter = ConsoleSpanExporter(out=sys.stderr)  # stdout carries the JSON logs
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    # Not a worker's Stream call either: it lives as long as its router and carries many
    # requests, each of which has its own span in the trace the router sent with it.
    traced = filters.negate(filters.any_of(filters.health_check(), filters.method_name("GetLoad"),
                                           filters.method_name("Stream"),
                                           filters.service_prefix("grpc.reflection")))
    outer, inner = cancel_status_interceptors(traced)
    return Tracing(provider.get_tracer("tandem"), provider,
                   [outer, aio_server_interceptor(tracer_provider=provider, filter_=traced),
                    inner])


def trace_metadata(ctx: otel_context.Context | None = None) -> tuple[tuple[str, str], ...] | None:
    """gRPC call metadata carrying `ctx` (default: the current context) as W3C traceparent;
    None when there is no trace to continue (tracing off)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    return tuple(carrier.items()) or None


@contextlib.contextmanager
def use_context(ctx: otel_context.Context | None) -> Iterator[None]:
    """Make `ctx` current for a synchronous block. Never hold it across an await: a generator
    resumed in another task could not detach it."""
    if ctx is None:
        yield
        return
    token = otel_context.attach(ctx)
    try:
        yield
    finally:
        otel_context.detach(token)


# -- what services call ------------------------------------------------------------------------
class Telemetry:
    """A service's tracer and metrics, and the request-level records its servicers make."""

    def __init__(self, role: str, tracing: Tracing | None = None, metrics: Metrics | None = None,
                 *, capture_content: bool = False) -> None:
        self.role = role
        self.tracing = tracing or Tracing()
        self.tracer = self.tracing.tracer
        self.metrics = metrics or Metrics(role, "")
        self.capture_content = capture_content

    @classmethod
    def start(cls, role: str, model_name: str, *, capture_content: bool = False,
              settings: TelemetrySettings | None = None) -> Telemetry:
        """Logging, tracing and metrics for a service process, from the environment."""
        settings = settings or TelemetrySettings.from_env()
        service = settings.service(role)
        configure_logging(service, json=settings.log_format == "json", level=settings.log_level)
        tracing = configure_tracing(service, settings)
        if tracing.enabled:
            log.info("tracing on", exporters=list(settings.exporters))
        return cls(role, tracing, Metrics(role, model_name),
                   capture_content=capture_content or settings.capture_content)

    def shutdown(self) -> None:
        self.tracing.shutdown()
        self.metrics.stop()

    # -- workers -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def request_span(self, name: str, request_id: str, kind: SpanKind = SpanKind.INTERNAL,
                     num_samples: int = 1) -> Iterator[WorkerSpan]:
        """A worker's span for one request, current for the handler's task (so the calls it
        makes and the lines it logs carry it), with request_id bound for its log lines. SERVER
        where no gRPC server span stands above it (a request on a Stream call). However the
        request ends (finished, cancelled, refused, failed) the span says so, with what was
        done so far, and one log line reports it (runtime/request_trace.py)."""
        with structlog.contextvars.bound_contextvars(request_id=request_id), \
                self.tracer.start_as_current_span(
                    name, kind=kind, attributes={"tandem.request_id": request_id},
                    record_exception=False, set_status_on_exception=False) as span:
            record = WorkerSpan(self.tracer, span, name, self.role, num_samples)
            error: BaseException | None = None
            try:
                yield record
            except BaseException as e:
                error = e
                raise
            finally:
                o, fields = record.end(error)
                (log.info if o.kind in (FINISHED, CANCELLED) else log.warning)(
                    f"{name} done", outcome=o.kind, **log_fields(fields))

    def refused(self, name: str, request_id: str, error: BaseException,
                parent: otel_context.Context | None = None) -> None:
        """A request this worker refused before it started (draining, a replayed lease, a
        request id in use): a SERVER span in the caller's trace (`parent`) saying why, and one
        log line."""
        with use_context(parent), \
                self.request_span(name, request_id, SpanKind.SERVER) as record:
            record.cause = error

    def prefill_done(self, record: WorkerSpan, out: SeqOutput) -> None:
        t = out.timing
        attrs: dict[str, Any] = {"tandem.prompt_tokens": out.num_prompt_tokens,
                                 "tandem.cached_tokens": out.num_cached_tokens}
        if t is not None:
            attrs.update(timing_attrs(t.queue_s, t.first_token_s, None))
            attrs["tandem.prefill.chunks"] = t.num_prefill_chunks
            attrs["tandem.preemptions"] = t.num_preemptions
            phase_spans(self.tracer, record.span, t, self.role)
        record.set_attributes(attrs)

    def kv_transfer(self, parent: contextvars.Context | None, pull: LeaseDone) -> None:
        """Decode worker: one request's KV pull (done on the engine core), as a child of its
        decode span (`parent` is the handler's context, copied) and in the transfer
        histograms. Never raises: telemetry must not fail a request."""
        try:
            self._kv_transfer(parent, pull)
        except Exception:  # logged; the request goes on
            log.exception("recording a KV transfer failed")

    def _kv_transfer(self, parent: contextvars.Context | None, pull: LeaseDone) -> None:
        if pull.error is None:
            self.metrics.kv_transfer_seconds.observe(pull.seconds)
            self.metrics.kv_transfer_bytes.observe(pull.nbytes)
        if not self.tracing.enabled:
            return
        ctx = parent.run(otel_context.get_current) if parent is not None else None
        span = self.tracer.start_span("kv_transfer", context=ctx, start_time=pull.start_ns,
                                      attributes={
            "tandem.kv.blocks": pull.num_blocks, "tandem.kv.runs": pull.num_runs,
            "tandem.kv.bytes": pull.nbytes,
            "tandem.kv.gbps": pull.nbytes / pull.seconds / 1e9 if pull.seconds > 0 else 0.0,
            "tandem.kv.transport": pull.transport, "tandem.kv.source": pull.address})
        if pull.error is not None:
            span.add_event("exception", {"exception.message": pull.error})
            span.set_status(Status(StatusCode.ERROR, pull.error.split(":", 1)[0]))
        span.end(end_time=pull.end_ns)

def span_name(role: str) -> str:
    """The worker span of a streamed request: decode (disaggregated) or generate (colocated)."""
    return "decode" if role == "decode" else "generate"


def log_fields(attrs: dict[str, Any]) -> dict[str, Any]:
    """Span attributes as log fields: without the namespace, seconds rounded."""
    return {k.removeprefix("tandem.").removeprefix("gen_ai.").replace(".", "_"):
            round(v, 6) if isinstance(v, float) else v for k, v in attrs.items()}
