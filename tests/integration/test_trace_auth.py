"""A request refused for its API key is traced and logged like every refusal, by a real router
process exporting to an OTLP receiver on 127.0.0.1: over gRPC a server span of the call with
status UNAUTHENTICATED, over HTTP the request's GenAI span with error.type UNAUTHENTICATED; each
with one router log line (outcome refused) carrying that span's trace id."""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import pytest
from traces import ERROR, attrs

from cluster import WORKER_ARGS, Cluster, serve
from tandem.v1 import api_pb2

KEY = "trace-auth-key"


@pytest.fixture(scope="module")
def cluster(tiny_models, tmp_path_factory, receiver):
    yield from serve(Cluster(tmp_path_factory.mktemp("auth"), str(tiny_models["llama"]),
                             worker_args=WORKER_ARGS,
                             env={**receiver.env(schedule_delay_ms=50), "TANDEM_API_KEY": KEY}))


def wait_span(receiver, match, timeout: float = 20):
    """The first router span `match` accepts, once exported (bounded wait)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [s for svc, s in receiver.snapshot() if svc == "tandem-router" and match(s)]
        if found:
            return found[0]
        assert time.monotonic() < deadline, [s.name for _, s in receiver.snapshot()]
        time.sleep(0.05)


def wait_refusal_line(cluster, trace_id: str, timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        lines = [line for line in cluster.router.json_logs()
                 if line.get("trace_id") == trace_id and line.get("outcome") == "refused"]
        if lines:
            return lines[0]
        assert time.monotonic() < deadline, cluster.router.log_text()[-3000:]
        time.sleep(0.05)


def test_a_grpc_call_without_its_key_is_traced_and_logged(cluster, receiver):
    async def main():
        async with grpc.aio.insecure_channel(cluster.router.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in cluster.api(ch).Generate(api_pb2.GenerateRequest(text="hi")):
                    pass
            return e.value.code()

    assert asyncio.run(main()) == grpc.StatusCode.UNAUTHENTICATED
    span = wait_span(receiver, lambda s: s.name == "/tandem.v1.Tandem/Generate")
    assert attrs(span)["rpc.grpc.status_code"] == grpc.StatusCode.UNAUTHENTICATED.value[0]
    line = wait_refusal_line(cluster, span.trace_id.hex())
    assert line["error_type"] == "UNAUTHENTICATED" and line["event"] == "call done"
    assert KEY not in cluster.router.log_text()


def test_an_http_request_without_its_key_is_traced_and_logged(cluster, receiver):
    r = httpx.post(f"http://127.0.0.1:{cluster.router.http_port}/v1/completions",
                   json={"prompt": "hi", "max_tokens": 2},
                   headers={"authorization": "Bearer wrong"}, timeout=30)
    assert r.status_code == 401
    span = wait_span(receiver, lambda s: attrs(s).get("error.type") == "UNAUTHENTICATED"
                     and attrs(s).get("gen_ai.operation.name") == "text_completion")
    assert span.status.code == ERROR and not span.parent_span_id
    line = wait_refusal_line(cluster, span.trace_id.hex())
    assert line["error_type"] == "UNAUTHENTICATED" and line["event"] == "request done"
