"""What the tracing tests share: an OTLP/gRPC trace receiver on 127.0.0.1 that the services
export to, one trace's spans with their ancestry, waiting for a request's trace or its log lines
(the exporters batch: wait, never sleep), and a request its caller cancels mid-stream."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1 import trace_pb2

from cluster import HOLD_TOKENS, WORKER_ARGS, Cluster
from tandem.engine.sampling_params import SamplingParams
from tandem.runtime.convert import params_to_proto
from tandem.v1 import api_pb2

ERROR = trace_pb2.Status.STATUS_CODE_ERROR
CLIENT, SERVER = trace_pb2.Span.SPAN_KIND_CLIENT, trace_pb2.Span.SPAN_KIND_SERVER
# Ends only when cancelled or aborted: on a stack of the long-context llama (HOLD_WORKER_ARGS).
LONG = SamplingParams(temperature=0, max_tokens=HOLD_TOKENS, ignore_eos=True)


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver: keeps every span with its service.name."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, object]] = []
        self.raw: list[bytes] = []
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def Export(self, request, context):  # noqa: N802 - gRPC method name
        with self.lock:
            self.raw.append(request.SerializeToString())
            for rs in request.resource_spans:
                service = attrs(rs.resource)["service.name"]
                for ss in rs.scope_spans:
                    self.spans.extend((service, s) for s in ss.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def env(self, schedule_delay_ms: int) -> dict[str, str]:
        return {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{self.port}",
                "OTEL_BSP_SCHEDULE_DELAY": str(schedule_delay_ms)}

    def snapshot(self) -> list[tuple[str, object]]:
        with self.lock:
            return list(self.spans)


def traced_cluster(tmp: Path, model: str, receiver: Receiver, **kw) -> Cluster:
    """A stack on the tiny model's worker flags (prefill + decode + router unless `kw` says
    otherwise) whose processes export their spans to `receiver` every 50 ms."""
    kw.setdefault("worker_args", WORKER_ARGS)
    return Cluster(tmp, model, env=receiver.env(schedule_delay_ms=50), **kw)


def _value(v: AnyValue):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind)


def attrs(obj) -> dict:
    return {a.key: _value(a.value) for a in obj.attributes}


def has_error(span, error_type: str) -> bool:
    return span.status.code == ERROR and attrs(span).get("error.type") == error_type


class Spans:
    """The exported spans of one trace: by service and name, with their ancestry. `root` is the
    request's own span (the router's GenAI span), when the trace was found by request id."""

    def __init__(self, spans: list[tuple[str, object]], trace_id: bytes, root=None) -> None:
        self.root = root
        self.all = [(svc, s) for svc, s in spans if s.trace_id == trace_id]
        self.by_id = {s.span_id: s for _, s in self.all}
        self.services = {svc for svc, _ in self.all}

    def named(self, name: str, service: str | None = None) -> list:
        return [s for svc, s in self.all if s.name == name and service in (None, svc)]

    def one(self, name: str, service: str | None = None):
        found = self.named(name, service)
        assert len(found) == 1, (name, service, [(svc, s.name) for svc, s in self.all])
        return found[0]

    def parent(self, span):
        return self.by_id[span.parent_span_id]

    def ancestors(self, span) -> list:
        out = []
        while span.parent_span_id:
            span = self.parent(span)
            out.append(span)
        return out

    def orphans(self) -> list:
        """The names of the spans whose parent is not in the trace."""
        return [s.name for _, s in self.all if s.parent_span_id
                and s.parent_span_id not in self.by_id]


def wait_traces(receiver: Receiver, request_ids: list[str], done: Callable[[Spans], bool],
                timeout: float = 20) -> dict[str, Spans]:
    """Each request's trace once `done(trace)` holds for all of them."""
    deadline = time.monotonic() + timeout
    while True:
        spans = receiver.snapshot()
        traces = {}
        for rid in request_ids:
            roots = [s for _, s in spans if attrs(s).get("gen_ai.response.id") == rid]
            if roots:
                traces[rid] = Spans(spans, roots[0].trace_id, roots[0])
        if len(traces) == len(request_ids) and all(done(t) for t in traces.values()):
            return traces
        if time.monotonic() > deadline:
            missing = [rid for rid in request_ids if rid not in traces or not done(traces[rid])]
            raise AssertionError(f"incomplete traces for {missing}: "
                                 f"{[(svc, s.name) for svc, s in spans]}")
        time.sleep(0.05)


def wait_trace(receiver: Receiver, request_id: str, done: Callable[[Spans], bool],
               timeout: float = 20) -> Spans:
    """The request's trace once `done(trace)` holds."""
    return wait_traces(receiver, [request_id], done, timeout)[request_id]


def wait_logs(cluster: Cluster, request_id: str, events: dict[str, str],
              timeout: float = 20) -> dict[str, dict]:
    """Each process's one line for the request: events[process] is "<span> <outcome>", the line
    {"event": "<span> done", "outcome": "<outcome>"}."""
    deadline = time.monotonic() + timeout
    while True:
        found = {}
        for name, proc in cluster.procs.items():
            if name not in events:
                continue
            span, outcome = events[name].rsplit(" ", 1)
            lines = [line for line in proc.json_logs() if line.get("request_id") == request_id
                     and line.get("event") == f"{span} done"
                     and line.get("outcome") == outcome]
            if len(lines) == 1:
                found[name] = lines[0]
        if found.keys() == events.keys():
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"log lines for {request_id}: found {sorted(found)}, want "
                                 f"{events}")
        time.sleep(0.05)


def cancel_after_tokens(cluster: Cluster, tokens: int = 3) -> str:
    """A long gRPC request, cancelled by its caller once `tokens` tokens arrived; its id."""
    async def main():
        async with grpc.aio.insecure_channel(cluster.router.address) as ch:
            call = cluster.api(ch).Generate(api_pb2.GenerateRequest(
                text="cancel me", params=params_to_proto(LONG)))
            seen = 0
            async for r in call:
                seen += len(r.token_ids)
                if seen >= tokens:
                    call.cancel()
                    return r.request_id
        raise AssertionError("the request ended before it was cancelled")

    return asyncio.run(main())
