"""One request's trace as a span tree: a 1 prefill + 1 decode stack on this machine exporting OTLP
to a receiver this script runs on 127.0.0.1, one request (chat over HTTP, or --grpc), and its
spans printed as a tree with each span's service, kind, start offset and duration, and the
attributes that tell where the time went. --cancel-after N cancels the request after N tokens.

    python benchmarks/serving/trace_tree.py                      # the demo model, CPU
    python benchmarks/serving/trace_tree.py --model /models/Llama-3.1-8B-Instruct --device cuda
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for _p in (ROOT / "protos", ROOT):
    sys.path.insert(0, str(_p))

import grpc  # noqa: E402
import httpx  # noqa: E402
from opentelemetry.proto.collector.trace.v1 import (  # noqa: E402
    trace_service_pb2,
    trace_service_pb2_grpc,
)
from opentelemetry.proto.trace.v1 import trace_pb2  # noqa: E402

from tandem.cli.launcher import LocalStack  # noqa: E402
from tandem.engine.sampling_params import SamplingParams  # noqa: E402
from tandem.runtime.convert import params_to_proto  # noqa: E402
from tandem.v1 import api_pb2, api_pb2_grpc  # noqa: E402

KINDS = {trace_pb2.Span.SPAN_KIND_SERVER: "SERVER", trace_pb2.Span.SPAN_KIND_CLIENT: "CLIENT",
         trace_pb2.Span.SPAN_KIND_INTERNAL: "INTERNAL"}
SHOWN = ("error.type", "rpc.grpc.status_code", "gen_ai.response.finish_reasons",
         "gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens",
         "gen_ai.response.time_to_first_chunk", "tandem.prefill.chunks", "tandem.cached_tokens",
         "tandem.kv.blocks", "tandem.kv.gbps", "tandem.output_tokens", "tandem.finish_reasons",
         "tandem.kv.registration")


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver on 127.0.0.1 keeping (service, span) pairs."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, trace_pb2.Span]] = []
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def Export(self, request, context):  # noqa: N802 - gRPC method name
        with self.lock:
            for rs in request.resource_spans:
                service = next(a.value.string_value for a in rs.resource.attributes
                               if a.key == "service.name")
                for ss in rs.scope_spans:
                    self.spans.extend((service, s) for s in ss.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


def _value(v):
    kind = v.WhichOneof("value")
    return [_value(x) for x in v.array_value.values] if kind == "array_value" else getattr(v, kind)


def attrs(span) -> dict:
    return {a.key: _value(a.value) for a in span.attributes}


def tree(spans: list[tuple[str, trace_pb2.Span]], root: trace_pb2.Span) -> list[str]:
    mine = [(svc, s) for svc, s in spans if s.trace_id == root.trace_id]
    children: dict[bytes, list] = {}
    for svc, s in mine:
        children.setdefault(s.parent_span_id, []).append((svc, s))
    by_id = {s.span_id: (svc, s) for svc, s in mine}
    top = ("tandem-router", root)
    while top[1].parent_span_id in by_id:  # from the trace's first span (the gRPC call's)
        top = by_id[top[1].parent_span_id]
    t0 = top[1].start_time_unix_nano
    lines: list[str] = []

    def walk(svc: str, s, depth: int) -> None:
        a = attrs(s)
        shown = {k.removeprefix("gen_ai.").removeprefix("tandem."): round(v, 4)
                 if isinstance(v, float) else v for k, v in a.items() if k in SHOWN}
        status = " ERROR" if s.status.code == trace_pb2.Status.STATUS_CODE_ERROR else ""
        lines.append(f"{'  ' * depth}{s.name}  [{svc.removeprefix('tandem-')} "
                     f"{KINDS.get(s.kind, '?')}{status}]  "
                     f"+{(s.start_time_unix_nano - t0) / 1e6:.1f} ms "
                     f"{(s.end_time_unix_nano - s.start_time_unix_nano) / 1e6:.1f} ms"
                     + (f"  {json.dumps(shown)}" if shown else ""))
        for e in s.events:
            lines.append(f"{'  ' * (depth + 1)}· {e.name} +{(e.time_unix_nano - t0) / 1e6:.1f} ms")
        for c in sorted(children.get(s.span_id, []), key=lambda x: x[1].start_time_unix_nano):
            walk(*c, depth + 1)

    walk(*top, 0)
    return lines


async def _grpc_request(address: str, max_tokens: int, cancel_after: int | None) -> str:
    async with grpc.aio.insecure_channel(address) as ch:
        call = api_pb2_grpc.TandemStub(ch).Generate(api_pb2.GenerateRequest(
            text="Tell me about prefill and decode.", params=params_to_proto(SamplingParams(
                temperature=0, max_tokens=max_tokens, ignore_eos=True))))
        seen, rid = 0, ""
        async for r in call:
            rid, seen = r.request_id, seen + len(r.token_ids)
            if cancel_after is not None and seen >= cancel_after:
                call.cancel()
                break
        return rid


def _http_request(port: int, max_tokens: int, cancel_after: int | None) -> str:
    body = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "Tell me about prefill and decode."}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    seen, rid = 0, ""
    with httpx.Client(timeout=120) as h, h.stream(
            "POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            rid = chunk["id"]
            seen += 1 if chunk["choices"] and chunk["choices"][0]["delta"].get("content") else 0
            if cancel_after is not None and seen >= cancel_after:
                break
    return rid


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tandem-demo")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (prefill on cuda:0, decode "
                                                   "on cuda:1)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--grpc", action="store_true", help="the gRPC API (default: HTTP chat)")
    p.add_argument("--cancel-after", type=int, default=None, metavar="N",
                   help="cancel the request after N tokens (gRPC) or N content chunks (HTTP)")
    p.add_argument("--trace-content", action="store_true", help="record messages in the trace")
    args = p.parse_args(argv)

    receiver = Receiver()
    devices = ["cpu", "cpu"] if args.device == "cpu" else ["cuda:0", "cuda:1"]
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
           "OTEL_BSP_SCHEDULE_DELAY": "100", "TANDEM_LOG_FORMAT": "console"}
    stack = LocalStack(args.model, ["prefill", "decode"], devices,
                       router_args=["--grpc-port", "0", "--http-port", "0",
                                    *(["--trace-content"] if args.trace_content else [])],
                       log_dir=tempfile.mkdtemp(prefix="tandem-trace-"), env=env).start()
    try:
        # A first request maps the prefill worker's pool (once per pair): traced on its own.
        for _ in range(2):
            if args.grpc:
                rid = asyncio.run(_grpc_request(stack.router.address, args.max_tokens,
                                                args.cancel_after))
            else:
                rid = _http_request(stack.router.http_port, args.max_tokens, args.cancel_after)
    finally:
        stack.stop()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with receiver.lock:
            spans = list(receiver.spans)
        roots = [s for _, s in spans if attrs(s).get("gen_ai.response.id") == rid]
        if roots:
            break
        time.sleep(0.1)
    else:
        print(f"no trace arrived for {rid}", file=sys.stderr)
        return 1
    print("\n".join(tree(spans, roots[0])))
    receiver.server.stop(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
