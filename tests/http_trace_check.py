"""The router's HTTP API in this process, traced as `tandem router` traces it (a global tracer
provider, spans kept in memory), with a stand-in for the workers: sends a few requests over
127.0.0.1 and prints, per request, what its spans say as one JSON object. Run as a script by
tests/unit/test_http_trace.py, once with the fastapi and starlette installed and once with the
oldest the project's ranges admit first on PYTHONPATH (a global tracer provider is once per
process, and FastAPI reads it: a process of its own each time).

    python tests/http_trace_check.py      # {"fastapi": ..., "cases": {name: {...}}}
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fastapi
import httpx
import starlette
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)

from tandem.router_svc.frontend import Frontend, ModelInfo
from tandem.router_svc.http_api import HttpServer
from tandem.router_svc.worker_stream import SampleUpdate, Update
from tandem.router_svc.workers import WorkerSet
from tandem.runtime.metrics import Metrics
from tandem.runtime.security import ApiKeys
from tandem.runtime.telemetry import Telemetry, Tracing, configure_logging

KEY = "check-key"
TRACEPARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


class Workers:
    """Stands in for the orchestrator: every request gets three tokens, then ends."""

    def __init__(self) -> None:
        self.workers = WorkerSet([], [], [])
        self.tracer = trace.get_tracer("tandem")

    async def run(self, request_id, prompt, params, timeout=None, trace_ctx=None):
        for i in range(3):
            yield Update([SampleUpdate(0, [10 + i], [None], "length" if i == 2 else None)],
                         len(prompt), 0)
            await asyncio.sleep(0)


async def send(exporter: InMemorySpanExporter, client: httpx.AsyncClient, method: str,
               path: str, **kw) -> dict:
    """One request; what the spans it left say: how many traces, the roots (spans whose parent
    is not among them), and the trace id."""
    exporter.clear()
    if "stream" in kw.get("json", {}):
        async with client.stream(method, path, **kw) as r:
            status = r.status_code
            body = [line async for line in r.aiter_lines()]
    else:
        r = await client.request(method, path, **kw)
        status, body = r.status_code, [r.text]
    # The request's span ends when the server has let go of the request, which may be just
    # after the client has its answer: wait for it (bounded), never for a fixed time.
    deadline = time.monotonic() + 20
    while not _request_span(exporter) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    for _ in range(10):  # anything the same request ends after it
        await asyncio.sleep(0)
    spans = exporter.get_finished_spans()
    ids = {s.context.span_id for s in spans}
    roots = [s for s in spans if s.parent is None or s.parent.span_id not in ids]
    return {"status": status, "done": any("[DONE]" in line for line in body),
            "traces": len({s.context.trace_id for s in spans}),
            "roots": sorted(s.name for s in roots),
            "root_kinds": sorted(s.kind.name for s in roots),
            "trace_id": format(spans[0].context.trace_id, "032x") if spans else None,
            "error_types": sorted({str(s.attributes.get("error.type")) for s in spans
                                   if s.attributes.get("error.type")})}


def _request_span(exporter: InMemorySpanExporter) -> bool:
    return any(s.attributes.get("gen_ai.operation.name") or s.name.startswith("GET ")
               for s in exporter.get_finished_spans())


async def main() -> dict:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)  # as `tandem router` does with tracing on
    logs = io.StringIO()
    configure_logging("tandem-router")
    logging.getLogger().handlers[0].setStream(logs)
    tel = Telemetry("router", Tracing(provider.get_tracer("tandem"), provider),
                    Metrics("router", "m"))
    workers = Workers()
    frontend = Frontend(None, workers, ModelInfo("m", "llama", 64, 100, "float32", 16),
                        telemetry=tel)
    server = HttpServer(frontend, workers.workers, "127.0.0.1", 0, ApiKeys([KEY]))
    port = await server.start()
    auth = {"authorization": f"Bearer {KEY}"}
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 3}
    cases = {}
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
            cases["completion"] = await send(exporter, c, "POST", "/v1/completions",
                                             json=body, headers=auth)
            cases["streamed"] = await send(exporter, c, "POST", "/v1/completions",
                                           json={**body, "stream": True}, headers=auth)
            cases["traceparent"] = await send(
                exporter, c, "POST", "/v1/completions", json=body,
                headers={**auth, "traceparent": f"00-{TRACEPARENT_ID}-00f067aa0ba902b7-01"})
            cases["refused_400"] = await send(exporter, c, "POST", "/v1/completions",
                                              json={**body, "suffix": "x"}, headers=auth)
            cases["refused_401"] = await send(exporter, c, "POST", "/v1/completions", json=body)
            cases["refused_401_models"] = await send(exporter, c, "GET", "/v1/models")
    finally:
        await server.stop()
    lines = [json.loads(line) for line in logs.getvalue().splitlines() if line.startswith("{")]
    refusals = [line for line in lines if line.get("outcome") == "refused"
                and line.get("error_type") == "UNAUTHENTICATED"]
    return {"fastapi": fastapi.__version__, "starlette": starlette.__version__,
            "cases": cases, "unauthenticated_log_lines": len(refusals),
            "log_lines_with_trace_id": sum(bool(line.get("trace_id")) for line in refusals)}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main())))
