"""The router's record of one request: its span (the trace's root unless the client sent a
traceparent), its metrics and its log line, made before the request is validated so that a
refused request is traced and logged too. The services' shared telemetry (tracer, metrics,
logging) is runtime/telemetry.py."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog
from opentelemetry import trace
from opentelemetry.semconv._incubating.attributes.gen_ai_attributes import (
    GEN_AI_INPUT_MESSAGES,
    GEN_AI_OPERATION_NAME,
    GEN_AI_OUTPUT_MESSAGES,
    GEN_AI_OUTPUT_TYPE,
    GEN_AI_PROVIDER_NAME,
    GEN_AI_REQUEST_CHOICE_COUNT,
    GEN_AI_REQUEST_FREQUENCY_PENALTY,
    GEN_AI_REQUEST_MAX_TOKENS,
    GEN_AI_REQUEST_MODEL,
    GEN_AI_REQUEST_PRESENCE_PENALTY,
    GEN_AI_REQUEST_SEED,
    GEN_AI_REQUEST_STOP_SEQUENCES,
    GEN_AI_REQUEST_STREAM,
    GEN_AI_REQUEST_TEMPERATURE,
    GEN_AI_REQUEST_TOP_K,
    GEN_AI_REQUEST_TOP_P,
    GEN_AI_RESPONSE_FINISH_REASONS,
    GEN_AI_RESPONSE_ID,
    GEN_AI_RESPONSE_MODEL,
    GEN_AI_USAGE_INPUT_TOKENS,
    GEN_AI_USAGE_OUTPUT_TOKENS,
)
from opentelemetry.semconv.attributes.server_attributes import SERVER_ADDRESS, SERVER_PORT
from opentelemetry.trace import SpanKind

from tandem.runtime.request_trace import (
    CANCELLED,
    FAILED,
    FINISHED,
    ApiCall,
    end_span,
    input_messages,
    outcome,
)
from tandem.runtime.telemetry import Telemetry, log_fields, use_context

if TYPE_CHECKING:
    from tandem.engine.sampling_params import SamplingParams

log = structlog.get_logger(__name__)


def router_request(tel: Telemetry, request_id: str, prompt: list[int] | None,
                   params: SamplingParams | None, model: str, operation: str,
                   decode: Callable[[list[int]], str] | None = None,
                   api: ApiCall | None = None) -> RouterRequest:
    """The record of one request. `prompt` / `params` None: refused before they were read;
    `decode` (token ids to text) only where --trace-content asks for message contents."""
    return RouterRequest(tel, request_id, prompt, params, model, operation,
                         decode if tel.capture_content else None, api or ApiCall())


class RouterRequest:
    """One request at the router: its span (the trace's root unless the client sent a
    traceparent), its metrics, and its log line.

    Its span is never made current across an await: the Frontend's generator may be resumed by
    another task (the HTTP API runs its first step in one task and streams from another). The
    orchestrator passes `context` explicitly, in the metadata of each call to a worker
    (trace_metadata).

    Attributes: the GenAI conventions' "Inference" span as they stand now (Development status,
    github.com/open-telemetry/semantic-conventions-genai, docs/gen-ai/gen-ai-spans.md; the names
    as opentelemetry-semantic-conventions 0.66b2 spells them): required
    gen_ai.operation.name and gen_ai.provider.name; conditionally required gen_ai.request.model,
    error.type, gen_ai.request.choice.count (n != 1), gen_ai.request.seed, gen_ai.output.type,
    gen_ai.request.stream, gen_ai.request.top_k, server.port (with server.address); recommended
    gen_ai.request.max_tokens / temperature / top_p / stop_sequences / frequency_penalty /
    presence_penalty, gen_ai.response.time_to_first_chunk,
    gen_ai.response.id / model / finish_reasons, gen_ai.usage.*, server.address; opt-in
    gen_ai.input.messages / gen_ai.output.messages (--trace-content only), one entry per message
    with its role. Metrics count admitted requests only, as before refusals were traced.
    """

    def __init__(self, tel: Telemetry, request_id: str, prompt: list[int] | None,
                 params: SamplingParams | None, model: str, operation: str,
                 decode: Callable[[list[int]], str] | None, api: ApiCall) -> None:
        self.tel, self.metrics = tel, tel.metrics
        self.request_id = request_id
        self.num_prompt_tokens = len(prompt or ())
        self.num_samples = params.n if params is not None else 1
        self.start = time.monotonic()
        self.first_token: float | None = None
        self.last_token = 0.0  # time.monotonic() of the last update with tokens
        self.admitted = False
        self.ended = False
        self.reasons: dict[int, str] = {}
        self.sample_tokens: dict[int, int] = {}
        capture = tel.capture_content
        self.texts: dict[int, list[str]] | None = {} if capture else None
        attrs: dict[str, Any] = {
            GEN_AI_OPERATION_NAME: operation, GEN_AI_PROVIDER_NAME: PROVIDER,
            GEN_AI_REQUEST_MODEL: model, GEN_AI_RESPONSE_MODEL: model,
            GEN_AI_RESPONSE_ID: request_id, GEN_AI_REQUEST_STREAM: api.stream,
            "tandem.request_id": request_id}
        if api.server_address:
            attrs[SERVER_ADDRESS] = api.server_address
            if api.server_port is not None:
                attrs[SERVER_PORT] = api.server_port
        if params is not None:
            attrs.update(_request_attrs(params))
        if capture and api.messages is not None:  # chat: one entry per message, its role
            attrs[GEN_AI_INPUT_MESSAGES] = json.dumps(input_messages(api.messages))
        elif capture and decode is not None and prompt is not None:  # a text prompt
            attrs[GEN_AI_INPUT_MESSAGES] = json.dumps(
                [{"role": "user", "parts": [{"type": "text", "content": decode(prompt)}]}])
        parent_ctx = api.parent
        parent = trace.get_current_span(parent_ctx).get_span_context()
        self.span = tel.tracer.start_span(
            f"{operation} {model}", context=parent_ctx,
            kind=SpanKind.INTERNAL if parent.is_valid else SpanKind.SERVER, attributes=attrs)
        self.context = trace.set_span_in_context(self.span, parent_ctx)

    def admit(self) -> None:
        """Validated and admitted: counted in the metrics from here."""
        self.admitted = True
        self.metrics.waiting.inc()
        self.span.add_event("admitted")

    def activate(self) -> contextlib.AbstractContextManager[None]:
        """This request's span and request_id current, for a synchronous block."""
        stack = contextlib.ExitStack()
        stack.enter_context(use_context(self.context))
        stack.enter_context(structlog.contextvars.bound_contextvars(request_id=self.request_id))
        return stack

    def tokens(self, n: int) -> None:
        """Called per update from the workers with the number of new tokens. After the first,
        the time since the last update is one inter-token latency (the planner reads them)."""
        if self.first_token is not None and n and self.admitted:
            now = time.monotonic()
            self.metrics.itl.observe(now - self.last_token)
            self.last_token = now
        if self.first_token is None and n:
            self.first_token = self.last_token = time.monotonic()
            self.span.add_event("first_token")
            if self.admitted:
                self.metrics.ttft.observe(self.first_token - self.start)
                self.metrics.waiting.dec()
                self.metrics.running.inc()

    def sample_tokens_add(self, index: int, n: int) -> None:
        self.sample_tokens[index] = self.sample_tokens.get(index, 0) + n

    def text(self, index: int, text: str) -> None:
        if self.texts is not None and text:
            self.texts.setdefault(index, []).append(text)

    def sample_finished(self, index: int, reason: str) -> None:
        self.reasons[index] = reason
        if self.num_samples > 1:
            self.span.add_event("sample_finished", {
                "tandem.sample.index": index, "tandem.sample.finish_reason": reason,
                "tandem.sample.output_tokens": self.sample_tokens.get(index, 0)})

    def end(self, num_samples: int, completion_tokens: int, cached_tokens: int,
            error: BaseException | None = None) -> None:
        """Once, when the request's stream ends for whatever reason (a refusal included)."""
        if self.ended:
            return
        self.ended = True
        now = time.monotonic()
        o = outcome(error)
        unfinished = "abort" if o.kind in (FINISHED, CANCELLED) else "error"
        for i in range(num_samples):
            self.reasons.setdefault(i, unfinished)
        reasons = [self.reasons[i] for i in sorted(self.reasons)]
        if self.admitted:
            m = self.metrics
            (m.running if self.first_token is not None else m.waiting).dec()
            m.prompt_tokens.inc(self.num_prompt_tokens)
            m.generation_tokens.inc(completion_tokens)
            m.e2e.observe(now - self.start)
            for reason in self.reasons.values():
                m.success(reason)
        attrs: dict[str, Any] = {
            GEN_AI_USAGE_INPUT_TOKENS: self.num_prompt_tokens,
            GEN_AI_USAGE_OUTPUT_TOKENS: completion_tokens,
            "gen_ai.usage.cache_read.input_tokens": cached_tokens,
            GEN_AI_RESPONSE_FINISH_REASONS: reasons}
        if self.first_token is not None:
            attrs["gen_ai.response.time_to_first_chunk"] = self.first_token - self.start
        if self.texts is not None:
            attrs[GEN_AI_OUTPUT_MESSAGES] = json.dumps(
                [{"role": "assistant", "parts": [{"type": "text", "content": "".join(t)}],
                  "finish_reason": self.reasons[i]} for i, t in sorted(self.texts.items())])
        self.span.set_attributes(attrs)
        if o.kind == FAILED and error is not None and "." in (o.error_type or ""):
            self.span.record_exception(error)  # a bug (named by its class): its stack helps
        end_span(self.span, o)
        fields = log_fields({k: v for k, v in attrs.items() if "messages" not in k})
        if o.error_type is not None:
            fields.update(error_type=o.error_type, error=o.message)
        with self.activate():
            (log.info if o.kind in (FINISHED, CANCELLED) else log.warning)(
                "request done", outcome=o.kind, e2e_seconds=round(now - self.start, 6),
                **fields)
        self.span.end()


def refused_call(tel: Telemetry, name: str, error: BaseException, api: ApiCall) -> None:
    """A call refused before any GenAI operation began (a /v1/models or /tokenize request
    without a valid API key): its span, ended with the refusal's error.type, and its log
    line."""
    parent = trace.get_current_span(api.parent).get_span_context()
    attrs: dict[str, Any] = {}
    if api.server_address:
        attrs[SERVER_ADDRESS] = api.server_address
        if api.server_port is not None:
            attrs[SERVER_PORT] = api.server_port
    span = tel.tracer.start_span(name, context=api.parent, attributes=attrs,
                                 kind=SpanKind.INTERNAL if parent.is_valid else SpanKind.SERVER)
    o = outcome(error)
    end_span(span, o)
    with use_context(trace.set_span_in_context(span, api.parent)):
        log.warning("call done", call=name, outcome=o.kind, error_type=o.error_type,
                    error=o.message)
    span.end()


PROVIDER = "tandem"  # gen_ai.provider.name: no well-known value names a self-hosted server


def _request_attrs(params: SamplingParams) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        GEN_AI_REQUEST_MAX_TOKENS: params.max_tokens,
        GEN_AI_REQUEST_TEMPERATURE: params.temperature, GEN_AI_REQUEST_TOP_P: params.top_p,
        GEN_AI_OUTPUT_TYPE: "json" if params.response_format is not None else "text"}
    if params.top_k:
        attrs[GEN_AI_REQUEST_TOP_K] = params.top_k
    if params.n != 1:
        attrs[GEN_AI_REQUEST_CHOICE_COUNT] = params.n
    if params.seed is not None:
        attrs[GEN_AI_REQUEST_SEED] = params.seed
    if params.stop:
        attrs[GEN_AI_REQUEST_STOP_SEQUENCES] = list(params.stop)
    if params.frequency_penalty:
        attrs[GEN_AI_REQUEST_FREQUENCY_PENALTY] = params.frequency_penalty
    if params.presence_penalty:
        attrs[GEN_AI_REQUEST_PRESENCE_PENALTY] = params.presence_penalty
    return attrs
