"""How spans end, in process with an in-memory exporter: the outcome of each kind of end, CLIENT
spans, the router's GenAI span for refused and cancelled requests, messages one per entry under
--trace-content, and a worker span cancelled mid-request."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sequence import FinishReason, RequestTiming, SeqOutput
from tandem.engine.serving.async_engine import RequestAborted
from tandem.errors import InvalidArgument
from tandem.router_svc.decode_legs import RouterError
from tandem.router_svc.frontend import Frontend, ModelInfo
from tandem.router_svc.orchestrator import SampleUpdate, Update
from tandem.router_svc.routing import RouteRequest
from tandem.runtime.metrics import Metrics
from tandem.runtime.request_trace import ApiCall, client_call, input_messages, outcome
from tandem.runtime.telemetry import Telemetry, Tracing


@pytest.fixture
def traced():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter, provider


def telemetry(provider, role="router", capture=False) -> Telemetry:
    return Telemetry(role, Tracing(provider.get_tracer("test"), provider), Metrics(role, "m"),
                     capture_content=capture)


@pytest.mark.parametrize(("error", "kind", "error_type"), [
    (None, "finished", None),
    (asyncio.CancelledError(), "cancelled", "CANCELLED"),
    (GeneratorExit(), "cancelled", "CANCELLED"),
    (InvalidArgument("prompt", "must not be empty"), "refused", "INVALID_ARGUMENT"),
    (RouterError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded"), "failed",
     "DEADLINE_EXCEEDED"),
    (RouterError(grpc.StatusCode.UNAVAILABLE, "no healthy decode worker"), "failed",
     "UNAVAILABLE"),
    (RequestAborted("request 'r' was aborted"), "failed", "ABORTED"),
    (KeyError("bug"), "failed", "builtins.KeyError"),
])
def test_outcome_of_each_end(error, kind, error_type):
    o = outcome(error)
    assert (o.kind, o.error_type) == (kind, error_type)


class _Rpc(Exception):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "connection refused"


def test_client_call_span_ends_with_the_calls_status(traced):
    exporter, provider = traced
    tracer = provider.get_tracer("test")
    with client_call("/tandem.v1.Worker/Prefill", "127.0.0.1:5001", tracer=tracer) as call:
        assert call.metadata and call.metadata[0][0] == "traceparent"
        assert format(call.span.get_span_context().span_id, "016x") in call.metadata[0][1]
    with pytest.raises(_Rpc), client_call("/tandem.v1.Worker/Release", "[::1]:5002",
                                          tracer=tracer):
        raise _Rpc()

    async def leg(complete: bool):
        with client_call("/tandem.v1.Worker/Stream", "127.0.0.1:5003", tracer=tracer,
                         name=f"leg-{complete}") as call:
            call.complete = complete
            yield 1

    async def close_after_first(complete: bool):
        gen = leg(complete)
        await anext(gen)
        await gen.aclose()  # the consumer stops at the last update, or mid-stream

    asyncio.run(close_after_first(True))
    asyncio.run(close_after_first(False))
    ok, failed, done, cancelled = exporter.get_finished_spans()
    assert ok.kind == SpanKind.CLIENT and ok.name == "tandem.v1.Worker/Prefill"
    assert dict(ok.attributes).items() >= {
        "rpc.system": "grpc", "rpc.service": "tandem.v1.Worker", "rpc.method": "Prefill",
        "server.address": "127.0.0.1", "server.port": 5001, "rpc.grpc.status_code": 0}.items()
    assert ok.status.status_code == StatusCode.UNSET
    assert failed.attributes["server.address"] == "::1"
    assert failed.attributes["rpc.grpc.status_code"] == 14
    assert failed.attributes["error.type"] == "UNAVAILABLE"
    assert failed.status.status_code == StatusCode.ERROR
    assert "connection refused" in failed.status.description
    assert done.status.status_code == StatusCode.UNSET and "error.type" not in done.attributes
    assert cancelled.attributes["error.type"] == "CANCELLED"
    assert cancelled.attributes["rpc.grpc.status_code"] == 1


class _Orchestrator:
    """Stands in for the workers: two tokens per sample per update, `steps` updates."""

    def __init__(self, steps: int = 2) -> None:
        self.steps = steps

    async def run(self, request_id, prompt, params, timeout=None, trace_ctx=None):
        for step in range(self.steps):
            last = step == self.steps - 1
            yield Update([SampleUpdate(i, [65, 66], [None, None], "length" if last else None)
                          for i in range(params.n)], len(prompt), 0)


def _frontend(tel: Telemetry, steps: int = 2) -> Frontend:
    return Frontend(None, _Orchestrator(steps), ModelInfo("m", "llama", 1024, 512, "float32", 16),
                    telemetry=tel)


def test_refused_request_has_a_span_and_is_not_counted(traced):
    exporter, provider = traced
    tel = telemetry(provider)
    fe = _frontend(tel)

    async def main():
        with pytest.raises(InvalidArgument):
            async for _ in fe.stream("r-bad", [], SamplingParams(max_tokens=3),
                                     api=ApiCall(stream=False, server_address="127.0.0.1",
                                                 server_port=8000)):
                pass

    asyncio.run(main())
    (span,) = exporter.get_finished_spans()
    assert span.name == "text_completion m" and span.kind == SpanKind.SERVER
    assert span.attributes["error.type"] == "INVALID_ARGUMENT"
    assert span.status.status_code == StatusCode.ERROR
    assert span.status.description == "INVALID_ARGUMENT: prompt: must not be empty"
    assert span.attributes["gen_ai.provider.name"] == "tandem"
    assert span.attributes["gen_ai.request.stream"] is False
    assert span.attributes["server.port"] == 8000
    assert [e.name for e in span.events] == ["refused"]
    # Metrics count admitted requests only (as they did before refusals were traced).
    assert [s.value for s in tel.metrics.e2e.collect()[0].samples
            if s.name.endswith("_count")] == [0]
    assert fe.active == 0


def test_cancelled_request_reports_tokens_so_far(traced):
    exporter, provider = traced
    fe = _frontend(telemetry(provider), steps=50)

    async def main():
        gen = fe.stream("r-gone", [1, 2, 3], SamplingParams(max_tokens=100, n=2))
        await anext(gen)
        await anext(gen)
        await gen.aclose()  # the client left

    asyncio.run(main())
    (span,) = exporter.get_finished_spans()
    a = span.attributes
    assert a["error.type"] == "CANCELLED" and span.status.status_code == StatusCode.ERROR
    assert list(a["gen_ai.response.finish_reasons"]) == ["abort", "abort"]
    assert a["gen_ai.usage.output_tokens"] == 8
    assert a["gen_ai.request.choice.count"] == 2


def test_samples_finishing_are_events_and_messages_are_one_per_entry(traced):
    exporter, provider = traced
    fe = _frontend(telemetry(provider, capture=True))
    messages = ({"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "rainy"})

    async def main():
        async for _ in fe.stream("chatcmpl-1", [1, 2, 3], SamplingParams(max_tokens=4, n=2),
                                 api=ApiCall(messages=messages)):
            pass

    asyncio.run(main())
    (span,) = exporter.get_finished_spans()
    assert span.name == "chat m"
    assert json.loads(span.attributes["gen_ai.input.messages"]) == [
        {"role": "system", "parts": [{"type": "text", "content": "be brief"}]},
        {"role": "user", "parts": [{"type": "text", "content": "weather?"}]},
        {"role": "assistant", "parts": [{"type": "tool_call", "id": "c1",
                                         "name": "get_weather", "arguments": "{}"}]},
        {"role": "tool", "parts": [{"type": "tool_call_response", "id": "c1",
                                    "result": "rainy"}]}]
    samples = [dict(e.attributes) for e in span.events if e.name == "sample_finished"]
    assert samples == [{"tandem.sample.index": i, "tandem.sample.finish_reason": "length",
                        "tandem.sample.output_tokens": 4} for i in (0, 1)]
    assert "error.type" not in span.attributes
    assert input_messages([{"role": "user", "content": "hi"}]) == [
        {"role": "user", "parts": [{"type": "text", "content": "hi"}]}]


def _out(index: int, tokens: int, reason: FinishReason | None,
         timing: RequestTiming | None = None) -> SeqOutput:
    return SeqOutput("r", index, [7], [None], reason, 5, 0, tokens, timing=timing)


def test_worker_span_cancelled_mid_request(traced):
    exporter, provider = traced
    tel = telemetry(provider, role="decode")

    async def handler(record):
        record.progress.seen(_out(0, 4, None))
        record.progress.seen(_out(1, 6, None))
        await asyncio.sleep(3600)  # cancelled here

    async def main():
        async def run():
            with tel.request_span("decode", "r", SpanKind.SERVER, 2) as record:
                await handler(record)

        task = asyncio.ensure_future(run())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    (span,) = exporter.get_finished_spans()
    a = span.attributes
    assert a["error.type"] == "CANCELLED" and span.status.status_code == StatusCode.ERROR
    assert list(a["tandem.finish_reasons"]) == ["abort", "abort"]
    assert a["tandem.output_tokens"] == 3 + 5  # the first token of each came from prefill
    assert [e.name for e in span.events] == ["first_output", "cancelled"]


def test_worker_span_finished_has_phases(traced):
    exporter, provider = traced
    tel = telemetry(provider, role="both")
    timing = RequestTiming(arrival=10.0, scheduled=10.5, first_token=11.0, finished=12.0,
                           num_prefill_chunks=2, num_preemptions=0,
                           prefill_chunks=((10.5, 10.7, 64), (10.7, 11.0, 30)))
    with tel.request_span("generate", "r", SpanKind.SERVER) as record:
        record.progress.seen(_out(0, 3, FinishReason.LENGTH, timing))
    chunks = [s for s in exporter.get_finished_spans() if s.name == "prefill_chunk"]
    spans = {s.name: s for s in exporter.get_finished_spans() if s.name != "prefill_chunk"}
    assert set(spans) == {"generate", "queue", "prefill_compute", "decode_steps"}
    assert [c.attributes["tandem.prefill.chunk_tokens"] for c in chunks] == [64, 30]
    assert {c.parent.span_id for c in chunks} == {spans["prefill_compute"].context.span_id}
    assert chunks[1].end_time - chunks[1].start_time == pytest.approx(0.3e9, abs=1e6)
    parent, queue, compute, steps = (spans[n] for n in ("generate", "queue", "prefill_compute",
                                                        "decode_steps"))
    assert {s.parent.span_id for s in (queue, compute, steps)} == {parent.context.span_id}
    assert queue.end_time - queue.start_time == pytest.approx(0.5e9, abs=1e6)
    assert compute.attributes["tandem.prefill.chunks"] == 2
    assert steps.end_time - steps.start_time == pytest.approx(1e9, abs=1e6)
    assert parent.attributes["tandem.time_to_first_token_seconds"] == pytest.approx(1.0)
    assert "error.type" not in parent.attributes


def test_a_cancel_after_the_deadline_is_a_deadline(traced):
    exporter, provider = traced
    started = asyncio.Event()

    class Stuck:
        async def run(self, request_id, prompt, params, timeout=None, trace_ctx=None):
            started.set()
            await asyncio.Event().wait()  # never answers
            yield

    fe = Frontend(None, Stuck(), ModelInfo("m", "llama", 1024, 512, "float32", 16),
                  telemetry=telemetry(provider))

    async def main():
        async def consume():
            async for _ in fe.stream("r-late", [1, 2], SamplingParams(max_tokens=2),
                                     timeout=1e-9):
                pass

        task = asyncio.ensure_future(consume())
        await started.wait()
        task.cancel()  # as gRPC cancels a call whose deadline passed
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    (span,) = exporter.get_finished_spans()
    assert span.attributes["error.type"] == "DEADLINE_EXCEEDED"
    assert [e.name for e in span.events] == ["admitted", "failed"]


def test_moved_decode_legs_are_client_spans_and_events(traced):
    from test_router_faults import FakeOrchestrator, FakeStream, _run

    from tandem.router_svc.decode_legs import DecodeLegs
    from tandem.runtime.convert import params_to_proto

    exporter, provider = traced
    tracer = provider.get_tracer("test")
    streams = [FakeStream(3, fail=True), FakeStream(2, fail=True), FakeStream(4, fail=False)]
    orch = FakeOrchestrator(streams, max_migrations=2)
    orch.tracer = tracer
    params = SamplingParams(max_tokens=100)

    async def main():
        root = tracer.start_span("chat m")
        from opentelemetry import trace

        legs = DecodeLegs(orch, "r", RouteRequest([1, 2, 3]), params,
                          params_to_proto(params), None, trace.set_span_in_context(root))
        async for _ in legs.run():
            pass
        root.end()

    asyncio.run(main())
    assert _run  # the fake stack is test_router_faults'
    spans = exporter.get_finished_spans()
    legs = [s for s in spans if s.name == "decode_leg"]
    root = next(s for s in spans if s.name == "chat m")
    assert [s.attributes.get("error.type") for s in legs] == ["UNAVAILABLE", "UNAVAILABLE",
                                                               None]
    assert [s.attributes["tandem.request_id"] for s in legs] == ["r", "r.1", "r.2"]
    assert all(s.parent.span_id == root.context.span_id for s in legs)
    moves = [e for e in root.events if e.name == "migrated"]
    assert [e.attributes["tandem.moves"] for e in moves] == [1, 2]
    assert [e.attributes["tandem.tokens_so_far"] for e in moves] == [4, 6]
