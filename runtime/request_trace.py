"""How one request's spans end, whatever its end, and where its time went.

    outcome(exc)          finished / cancelled / refused / failed, with the error.type both APIs
                          and every service record (a gRPC status name, or the exception's class)
    end_span(span, o)     the span's status, error.type and an event naming the end
    client_call(...)      a CLIENT span for one call to another Tandem service; its context is
                          what the call carries, so the callee's SERVER span hangs under it and
                          the time between hops is attributed to the caller's side
    Progress              a worker's view of one request so far (tokens per sample, finish
                          reasons, timing), kept by its sink, so a request that is cancelled
                          mid-way still reports what it had done
    phase_spans(...)      the engine's timing as child spans: queue / prefill / kv_wait / decode

Span status follows the OpenTelemetry conventions (error.type is set exactly when the operation
did not complete; status ERROR with a description saying why). A caller leaving is an end like
any other: `error.type` "CANCELLED" (the gRPC status name, as on the HTTP API), never an OK span.

Times: the engine stamps time.monotonic() seconds (one clock for every process of a host);
spans take wall-clock nanoseconds, converted here at the moment of recording.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from opentelemetry import propagate, trace
from opentelemetry.semconv._incubating.attributes.rpc_attributes import (
    RPC_GRPC_STATUS_CODE,
    RPC_METHOD,
    RPC_SERVICE,
    RPC_SYSTEM,
)
from opentelemetry.semconv.attributes.error_attributes import ERROR_TYPE
from opentelemetry.semconv.attributes.server_attributes import SERVER_ADDRESS, SERVER_PORT
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from tandem.engine.serving.async_engine import EngineDead, RequestAborted
from tandem.errors import InvalidArgument, LayoutMismatch, ModelLoadError, Overloaded

if TYPE_CHECKING:
    from tandem.engine.sequence import RequestTiming, SeqOutput

FINISHED, CANCELLED, REFUSED, FAILED = "finished", "cancelled", "refused", "failed"
# Status names that mean the caller's request was refused, not that serving it failed.
_REFUSALS = frozenset(("INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED",
                       "FAILED_PRECONDITION", "UNAUTHENTICATED", "PERMISSION_DENIED",
                       "ALREADY_EXISTS", "OUT_OF_RANGE"))
_GRPC_CODES = {"OK": 0, "CANCELLED": 1, "UNKNOWN": 2, "INVALID_ARGUMENT": 3,
               "DEADLINE_EXCEEDED": 4, "NOT_FOUND": 5, "ALREADY_EXISTS": 6,
               "PERMISSION_DENIED": 7, "RESOURCE_EXHAUSTED": 8, "FAILED_PRECONDITION": 9,
               "ABORTED": 10, "OUT_OF_RANGE": 11, "UNIMPLEMENTED": 12, "INTERNAL": 13,
               "UNAVAILABLE": 14, "DATA_LOSS": 15, "UNAUTHENTICATED": 16}


@dataclass(frozen=True)
class Outcome:
    """How a request (or one call of it) ended."""

    kind: str  # finished | cancelled | refused | failed
    error_type: str | None = None  # None exactly when finished
    message: str = ""

    @property
    def grpc_code(self) -> int:
        return _GRPC_CODES.get(self.error_type or "OK", _GRPC_CODES["UNKNOWN"])


# An HTTP API error's status as the gRPC status both APIs report it with (one error.type).
_HTTP_TO_GRPC = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED",
                 404: "NOT_FOUND", 429: "RESOURCE_EXHAUSTED", 499: "CANCELLED",
                 500: "INTERNAL", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}


def status_name(exc: BaseException) -> str | None:
    """The gRPC status name an error carries: WorkerError / RouterError (`.code`, an enum),
    grpc.aio.AioRpcError (`.code()`), the HTTP API's errors (`.status`, an HTTP status);
    None for anything else."""
    http = getattr(exc, "status", None)
    if isinstance(http, int) and not isinstance(http, bool):
        return _HTTP_TO_GRPC.get(http, "UNKNOWN")
    code = getattr(exc, "code", None)
    if callable(code):
        with contextlib.suppress(Exception):
            code = code()
    name = getattr(code, "name", None)
    return name if isinstance(name, str) else None


def outcome(exc: BaseException | None) -> Outcome:
    if exc is None:
        return Outcome(FINISHED)
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        return Outcome(CANCELLED, "CANCELLED", "the caller cancelled the request")
    if isinstance(exc, TimeoutError):
        return Outcome(FAILED, "DEADLINE_EXCEEDED", "deadline exceeded")
    name = status_name(exc) or _engine_status(exc)
    details = getattr(exc, "details", None)  # grpc.aio.AioRpcError: its str is a page long
    message = (details() if callable(details) else None) or str(exc) or type(exc).__name__
    if name is None:
        return Outcome(FAILED, f"{type(exc).__module__}.{type(exc).__qualname__}", message)
    if name == "CANCELLED":
        return Outcome(CANCELLED, name, message)
    return Outcome(REFUSED if name in _REFUSALS else FAILED, name, message)


def _engine_status(exc: BaseException) -> str | None:
    """The engine's errors, named by the gRPC status a worker answers them with
    (as runtime.worker.status_of answers callers)."""
    for kind, name in ((EngineDead, "UNAVAILABLE"), (RequestAborted, "ABORTED"),
                       (InvalidArgument, "INVALID_ARGUMENT"),
                       (LayoutMismatch, "FAILED_PRECONDITION"),
                       (Overloaded, "RESOURCE_EXHAUSTED"), (ModelLoadError, "NOT_FOUND")):
        if isinstance(exc, kind):
            return name
    return None


def end_span(span: Span, o: Outcome, **event_attrs: Any) -> None:
    """Status, error.type and one event that names the end (with `event_attrs`: finish reasons,
    tokens so far). Never an exception event for an end that is not a bug: the message is the
    status description and the event's, not a stack trace."""
    attrs = {k: v for k, v in event_attrs.items() if v is not None}
    if o.error_type is None:
        span.add_event("finished", attrs)
        return
    span.set_attribute(ERROR_TYPE, o.error_type)
    span.add_event(o.kind, {**attrs, ERROR_TYPE: o.error_type, "message": o.message})
    span.set_status(Status(StatusCode.ERROR, f"{o.error_type}: {o.message}"))


def split_address(address: str) -> tuple[str, int | None]:
    """host:port (host may be [v6]) -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return address, None
    return host.strip("[]"), int(port)


class ClientCall:
    """A traced call in flight: `metadata` carries its span's context (None with tracing off);
    set `complete` once the call has ended well, so that a caller that then stops reading (an
    async generator closed at its last yield) does not count as a cancel."""

    def __init__(self, span: Span, metadata: tuple[tuple[str, str], ...] | None) -> None:
        self.span, self.metadata = span, metadata
        self.complete = False


@contextlib.contextmanager
def client_call(method: str, address: str, parent: Any = None,
                tracer: trace.Tracer | None = None, name: str | None = None,
                **attributes: Any) -> Iterator[ClientCall]:
    """A CLIENT span for one gRPC call (`method`: "/tandem.v1.Worker/Prefill") to `address`,
    a child of `parent` (an OpenTelemetry context; default: the current one); the call sends
    `.metadata`, so the callee's SERVER span hangs under this one and the time between hops is
    the caller's to explain. Ends with the call's status: rpc.grpc.status_code and, unless OK,
    error.type and status ERROR (to a client every non-OK code is an error, per the RPC
    conventions). `tracer`: default, the process's ("tandem")."""
    service, _, rpc = method.lstrip("/").partition("/")
    host, port = split_address(address)
    attrs: dict[str, Any] = {RPC_SYSTEM: "grpc", RPC_SERVICE: service, RPC_METHOD: rpc,
                             SERVER_ADDRESS: host, **attributes}
    if port is not None:
        attrs[SERVER_PORT] = port
    span = (tracer or trace.get_tracer("tandem")).start_span(
        name or method.lstrip("/"), context=parent, kind=SpanKind.CLIENT, attributes=attrs)
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span, parent))
    call = ClientCall(span, tuple(carrier.items()) or None)
    try:
        yield call
    except BaseException as e:
        if isinstance(e, GeneratorExit) and call.complete:
            span.set_attribute(RPC_GRPC_STATUS_CODE, 0)
        else:
            o = outcome(e)
            span.set_attribute(RPC_GRPC_STATUS_CODE, o.grpc_code)
            end_span(span, o)
        raise
    else:
        span.set_attribute(RPC_GRPC_STATUS_CODE, 0)
    finally:
        span.end()


def mono_to_ns(t: float, offset_ns: int | None = None) -> int:
    """A time.monotonic() stamp as the wall-clock nanoseconds spans take. Stamps that are
    compared (one phase's end, the next one's start) share one `offset_ns` (clock_offset_ns()),
    else each conversion reads the two clocks anew and they may cross by a few microseconds."""
    if offset_ns is None:
        offset_ns = clock_offset_ns()
    return int(t * 1e9) + offset_ns


def clock_offset_ns() -> int:
    """Wall clock minus monotonic clock, in nanoseconds, now."""
    return time.time_ns() - time.monotonic_ns()


@dataclass
class Progress:
    """One request on a worker so far, as its sink saw the engine's outputs."""

    tokens: dict[int, int] = field(default_factory=dict)  # sample -> output tokens so far
    reasons: dict[int, str] = field(default_factory=dict)  # sample -> finish reason
    finished: list[SeqOutput] = field(default_factory=list)
    first_output: float | None = None  # monotonic: the first output reached the sink
    num_prompt_tokens: int | None = None
    num_cached_tokens: int | None = None

    def seen(self, o: SeqOutput) -> None:
        if self.first_output is None:
            self.first_output = time.monotonic()
        self.num_prompt_tokens, self.num_cached_tokens = o.num_prompt_tokens, o.num_cached_tokens
        self.tokens[o.sample_index] = o.num_output_tokens
        if o.finish_reason is not None:
            self.reasons[o.sample_index] = o.finish_reason.value
            self.finished.append(o)

    def finish_reasons(self, num_samples: int, unfinished: str) -> list[str]:
        return [self.reasons.get(i, unfinished) for i in range(num_samples)]


def phase_spans(tracer: trace.Tracer, parent: Span, timing: RequestTiming | None,
                role: str, **attrs: Any) -> None:
    """Where a finished request's time went on this worker, as child spans of `parent`:

        prefill role:  queue [arrival, scheduled]  prefill_compute [scheduled, first token],
                       in it one prefill_chunk per forward pass that computed prompt tokens
        decode role:   kv_wait [arrival, scheduled] (waiting for free blocks; the KV pull
                       has its own span, kv_transfer)  decode_steps [scheduled, finished]
        both:          queue  prefill_compute [scheduled, first token]
                       decode_steps [first token, finished]
    """
    if timing is None or not parent.is_recording():
        return
    ctx = trace.set_span_in_context(parent)
    t = timing
    phases: list[tuple[str, float, float | None, dict[str, Any]]] = []
    wait = "kv_wait" if role == "decode" else "queue"
    phases.append((wait, t.arrival, t.scheduled if t.scheduled is not None else t.finished, {}))
    if t.scheduled is not None:
        if role == "decode":
            phases.append(("decode_steps", t.scheduled, t.finished, attrs))
        else:
            chunks = {"tandem.prefill.chunks": t.num_prefill_chunks}
            phases.append(("prefill_compute", t.scheduled, t.first_token, chunks))
            if role == "both" and t.first_token is not None:
                phases.append(("decode_steps", t.first_token, t.finished, attrs))
    offset = clock_offset_ns()
    for name, start, end, extra in phases:
        if end is None or end < start:
            continue
        s = tracer.start_span(name, context=ctx,
                              start_time=mono_to_ns(start, offset), attributes=extra)
        if name == "prefill_compute":
            inner = trace.set_span_in_context(s)
            for i, (c_start, c_end, tokens) in enumerate(t.prefill_chunks):
                c = tracer.start_span("prefill_chunk", context=inner,
                                      start_time=mono_to_ns(c_start, offset),
                                      attributes={"tandem.prefill.chunk": i,
                                                  "tandem.prefill.chunk_tokens": tokens})
                c.end(end_time=mono_to_ns(c_end, offset))
        s.end(end_time=mono_to_ns(end, offset))


class WorkerSpan:
    """One request's span on a worker, from its arrival to its end, whatever the end: the
    servicer marks what it learns (`progress` through its sink, `cause` before a gRPC abort
    replaces the real error with AbortError) and `end` records it once: status, error.type,
    finish reasons and tokens so far, per-sample events, the phases as child spans, and one log
    line with the request's trace id."""

    def __init__(self, tracer: trace.Tracer, span: Span, name: str, role: str,
                 num_samples: int = 1) -> None:
        self.tracer, self.span, self.name, self.role = tracer, span, name, role
        self.num_samples = num_samples
        self.progress = Progress()
        self.cause: BaseException | None = None
        self.attributes: dict[str, Any] = {}  # what the servicer recorded (prefill_done)

    def set_attributes(self, attrs: dict[str, Any]) -> None:
        self.attributes.update(attrs)
        self.span.set_attributes(attrs)

    def end(self, error: BaseException | None) -> tuple[Outcome, dict[str, Any]]:
        """The span's end attributes; returns the outcome and the fields for the log line."""
        o = outcome(self.cause or error)
        fields: dict[str, Any] = dict(self.attributes)
        if self.progress.first_output is not None or self.role != "prefill":
            fields.update(self._generation(o))
        self.span.set_attributes({k: v for k, v in fields.items()
                                  if k not in self.attributes})
        end_span(self.span, o, **({"tandem.finish_reasons": fields.get("tandem.finish_reasons"),
                                    "tandem.output_tokens": fields.get("tandem.output_tokens")}
                                   if self.role != "prefill" else {}))
        if o.error_type is not None:
            fields["error_type"] = o.error_type
            fields["error"] = o.message
        return o, fields

    def _generation(self, o: Outcome) -> dict[str, Any]:
        """Decode and colocated workers: token counts, finish reasons (an unfinished sample:
        "abort" when the caller left, "error" otherwise), per-sample events, phases."""
        p = self.progress
        handed_over = 1 if self.role == "decode" else 0  # the first token came from prefill
        unfinished = "abort" if o.kind == CANCELLED else "error"
        attrs: dict[str, Any] = {
            "tandem.output_tokens": sum(max(n - handed_over, 0) for n in p.tokens.values()),
            "tandem.finish_reasons": p.finish_reasons(self.num_samples, unfinished)
            if o.kind != FINISHED else [p.reasons[i] for i in sorted(p.reasons)]}
        if p.num_prompt_tokens is not None:
            attrs["tandem.prompt_tokens"] = p.num_prompt_tokens
        finished = sorted(p.finished, key=lambda out: out.sample_index)
        if self.num_samples > 1:
            for out in finished:
                when = mono_to_ns(out.timing.finished) if out.timing is not None else None
                self.span.add_event("sample_finished", {
                    "tandem.sample.index": out.sample_index,
                    "tandem.sample.finish_reason": out.finish_reason.value
                    if out.finish_reason is not None else "",
                    "tandem.sample.output_tokens": out.num_output_tokens - handed_over},
                    timestamp=when)
        if finished and finished[0].timing is not None:
            first = finished[0]
            t = first.timing
            mine = first.num_output_tokens - handed_over
            tpot = (t.finished - t.first_token) / (mine - 1) \
                if t.first_token is not None and mine > 1 else None
            attrs.update(timing_attrs(t.queue_s, t.first_token_s, tpot))
            attrs["tandem.preemptions"] = t.num_preemptions
            if t.spec_proposed:  # speculative decoding (docs/speculative.md)
                attrs["tandem.spec.draft_tokens"] = t.spec_proposed
                attrs["tandem.spec.accepted_tokens"] = t.spec_accepted
            phase_spans(self.tracer, self.span, t, self.role,
                        **{"tandem.output_tokens": mine})
        elif p.first_output is not None:
            # Ended before any sample finished (no engine timing): when its tokens began.
            self.span.add_event("first_output", timestamp=mono_to_ns(p.first_output))
        return attrs


def timing_attrs(queue_s: float | None, ttft_s: float | None,
                 tpot_s: float | None) -> dict[str, float]:
    out = {"tandem.queue_time_seconds": queue_s, "tandem.time_to_first_token_seconds": ttft_s,
           "tandem.time_per_output_token_seconds": tpot_s}
    return {k: v for k, v in out.items() if v is not None}


# -- the router's side -------------------------------------------------------------------------
@dataclass(frozen=True)
class ApiCall:
    """What the public API knows of a request that the engine does not: for the GenAI span."""

    stream: bool = True  # gen_ai.request.stream
    server_address: str | None = None  # the router as the client addressed it
    server_port: int | None = None
    messages: tuple[dict[str, Any], ...] | None = None  # chat messages (OpenAI shape)
    parent: Any = None  # the caller's trace context (HTTP traceparent); default: the current


def input_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI chat messages in the GenAI conventions' shape (gen_ai.input.messages: one entry
    per message with its role, content as typed parts; tool calls and tool results as their
    own part types)."""
    out = []
    for m in messages:
        role = m.get("role") or "user"
        parts: list[dict[str, Any]] = []
        content = m.get("content")
        if isinstance(content, str) and content:
            parts.append({"type": "text", "content": content})
        elif isinstance(content, list):
            parts += [{"type": "text", "content": p.get("text", "")} for p in content
                      if isinstance(p, dict) and p.get("type") == "text"]
        if role == "tool":
            text = "".join(p["content"] for p in parts)
            parts = [{"type": "tool_call_response", "id": m.get("tool_call_id"),
                      "result": text}]
        for call in m.get("tool_calls") or ():
            if not isinstance(call, dict):
                continue
            fn = call.get("function") or {}
            parts.append({"type": "tool_call", "id": call.get("id"), "name": fn.get("name"),
                          "arguments": fn.get("arguments")})
        out.append({"role": role, "parts": parts})
    return out
