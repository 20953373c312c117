"""Every request leaves one trace that says how it ended, whatever the end, exported by three
processes (router, prefill, decode) to a real OTLP/gRPC receiver on 127.0.0.1:

    finished    (gRPC, n=2)  every span OK; CLIENT spans for each call between services, the
                             callee's SERVER span under each; queue / prefill_compute / kv_wait
                             / kv_transfer / decode_steps child spans; per-sample events
    cancelled   gRPC and HTTP: the router's span and the decode worker's span end ERROR with
                             error.type CANCELLED, finish reason abort and the tokens so far
    refused     gRPC and HTTP: a GenAI span with error.type INVALID_ARGUMENT and the message in
                             its status, no exception events, no worker span
    failed      the decode worker aborts the request mid-stream: error.type ABORTED on the router
                             and the decode worker

and one log line per service with the request's trace id; a request a worker refuses is a span in
the caller's trace. Every pool is idle after each. A colocated worker's requests:
test_trace_colocated.py."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import httpx
import pytest
from traces import (
    CLIENT,
    ERROR,
    LONG,
    SERVER,
    Spans,
    attrs,
    cancel_after_tokens,
    has_error,
    traced_cluster,
    wait_logs,
    wait_trace,
)

from cluster import HOLD_TOKENS, HOLD_WORKER_ARGS, serve
from tandem.engine.sampling_params import SamplingParams
from tandem.runtime.convert import params_to_proto
from tandem.v1 import api_pb2, worker_pb2, worker_pb2_grpc


@pytest.fixture(scope="module")
def cluster(tiny_llama_long, tmp_path_factory, receiver):
    yield from serve(traced_cluster(tmp_path_factory.mktemp("outcomes"), str(tiny_llama_long),
                                    receiver, worker_args=HOLD_WORKER_ARGS))


@pytest.fixture(autouse=True)
def idle_after(cluster):
    yield
    asyncio.run(cluster.wait_idle())


def test_finished_request_has_client_spans_phases_and_sample_events(cluster, receiver):
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True, n=2)

    async def main():
        async with grpc.aio.insecure_channel(cluster.router.address) as ch:
            return [r async for r in cluster.api(ch).Generate(api_pb2.GenerateRequest(
                text="tell the whole story", params=params_to_proto(params)))]

    chunks = asyncio.run(main())
    rid = chunks[0].request_id

    def complete(t: Spans) -> bool:
        return (len(t.named("decode_steps", "tandem-decode")) == 1
                and len(t.named("tandem.v1.Worker/Release", "tandem-decode")) == 1
                and len(t.named("/tandem.v1.Worker/Release", "tandem-prefill")) == 1
                and len(t.named("decode_leg")) == 1 and not t.orphans())

    t = wait_trace(receiver, rid, complete)
    root = t.root
    ra = attrs(root)
    assert root.status.code != ERROR and "error.type" not in ra
    assert ra["gen_ai.provider.name"] == "tandem" and ra["gen_ai.request.stream"] is True
    assert ra["server.address"] == "127.0.0.1"
    assert ra["server.port"] == int(cluster.router.address.rsplit(":", 1)[1])
    assert ra["gen_ai.request.choice.count"] == 2 and ra["gen_ai.output.type"] == "text"
    assert ra["gen_ai.response.finish_reasons"] == ["length", "length"]
    events = [e for e in root.events if e.name == "sample_finished"]
    assert sorted(attrs(e)["tandem.sample.index"] for e in events) == [0, 1]
    assert all(attrs(e)["tandem.sample.output_tokens"] == 6 for e in events)
    assert [e.name for e in root.events][:2] == ["admitted", "first_token"]

    # Every hop is a CLIENT span with the callee's SERVER span under it.
    prefill_call = t.one("tandem.v1.Worker/Prefill", "tandem-router")
    assert prefill_call.kind == CLIENT and t.parent(prefill_call) is root
    assert attrs(prefill_call)["rpc.grpc.status_code"] == 0
    assert t.parent(t.one("/tandem.v1.Worker/Prefill", "tandem-prefill")) is prefill_call
    leg = t.one("decode_leg", "tandem-router")
    assert leg.kind == CLIENT and t.parent(leg) is root and leg.status.code != ERROR
    decode = t.one("decode", "tandem-decode")
    assert decode.kind == SERVER and t.parent(decode) is leg
    for method in ("ClaimLease", "Release"):
        call = t.one(f"tandem.v1.Worker/{method}", "tandem-decode")
        assert call.kind == CLIENT and t.parent(call) is decode
        assert attrs(call)["server.port"] == int(
            cluster.workers("prefill")[0].address.rsplit(":", 1)[1])
        assert t.parent(t.one(f"/tandem.v1.Worker/{method}", "tandem-prefill")) is call
    # Time between the prefill's end and the decode's start is the router's, in its spans.
    assert prefill_call.end_time_unix_nano <= leg.start_time_unix_nano \
        <= decode.start_time_unix_nano

    # Where the time went, on each worker.
    prefill = t.one("prefill", "tandem-prefill")
    queue, compute = t.one("queue", "tandem-prefill"), t.one("prefill_compute", "tandem-prefill")
    assert t.parent(queue) is prefill and t.parent(compute) is prefill
    assert queue.end_time_unix_nano <= compute.start_time_unix_nano
    chunks = t.named("prefill_chunk", "tandem-prefill")
    assert len(chunks) == attrs(compute)["tandem.prefill.chunks"] >= 1
    assert all(t.parent(c) is compute for c in chunks)
    assert sum(attrs(c)["tandem.prefill.chunk_tokens"] for c in chunks) == \
        attrs(prefill)["tandem.prompt_tokens"] - attrs(prefill)["tandem.cached_tokens"]
    kv_wait, kv, gen = (t.one(n, "tandem-decode") for n in ("kv_wait", "kv_transfer",
                                                             "decode_steps"))
    assert all(t.parent(s) is decode for s in (kv_wait, kv, gen))
    # kv_transfer is stamped with the engine core's wall clock, kv_wait converted from its
    # monotonic one: the order, within a millisecond.
    assert kv_wait.end_time_unix_nano <= kv.start_time_unix_nano + 1_000_000
    assert attrs(gen)["tandem.output_tokens"] == 5  # the first token came from prefill
    da = attrs(decode)
    assert da["tandem.finish_reasons"] == ["length", "length"]
    assert da["tandem.output_tokens"] == 10 and "error.type" not in da
    assert len([e for e in decode.events if e.name == "sample_finished"]) == 2

    logs = wait_logs(cluster, rid, {"router": "request finished", "prefill0": "prefill finished",
                                    "decode0": "decode finished"})
    assert {line["trace_id"] for line in logs.values()} == {root.trace_id.hex()}

    # The one-time pool registration, in the trace of the request that came first, named so.
    (reg,) = [s for svc, s in receiver.snapshot() if s.name == "kv_pool_registration"]
    first = Spans(receiver.snapshot(), reg.trace_id)
    assert first.parent(reg).name == "decode"
    assert "once" in attrs(reg)["tandem.kv.registration"]
    call = first.one("tandem.v1.Worker/Register", "tandem-decode")
    assert first.parent(call) is reg and call.kind == CLIENT
    assert first.parent(first.one("/tandem.v1.Worker/Register", "tandem-prefill")) is call


def _assert_cancelled_on_decode(t: Spans) -> None:
    decode = t.one("decode", "tandem-decode")
    assert has_error(decode, "CANCELLED")
    da = attrs(decode)
    assert da["tandem.finish_reasons"] == ["abort"] and da["tandem.output_tokens"] >= 1
    (event,) = [e for e in decode.events if e.name == "cancelled"]
    assert attrs(event)["tandem.finish_reasons"] == ["abort"]


def test_grpc_cancel_is_cancelled_on_every_service(cluster, receiver):
    rid = cancel_after_tokens(cluster)
    # Each process exports its spans on its own schedule: a worker's Release span can come
    # before the router's client span it hangs under. Complete: every parent arrived.
    t = wait_trace(receiver, rid, lambda t: bool(t.named("decode", "tandem-decode"))
                   and bool(t.named("/tandem.v1.Tandem/Generate")) and not t.orphans())
    root = t.root
    assert has_error(root, "CANCELLED")
    assert attrs(root)["gen_ai.response.finish_reasons"] == ["abort"]
    assert attrs(root)["gen_ai.usage.output_tokens"] >= 3
    server = t.one("/tandem.v1.Tandem/Generate", "tandem-router")
    assert attrs(server)["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]
    assert has_error(t.one("decode_leg", "tandem-router"), "CANCELLED")
    _assert_cancelled_on_decode(t)
    logs = wait_logs(cluster, rid, {"router": "request cancelled",
                                    "prefill0": "prefill finished",
                                    "decode0": "decode cancelled"})
    assert logs["decode0"]["error_type"] == "CANCELLED"
    assert {line["trace_id"] for line in logs.values()} == {root.trace_id.hex()}


def test_http_client_drop_is_cancelled_like_grpc(cluster, receiver):
    url = f"http://127.0.0.1:{cluster.router.http_port}/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "drop me"}], "max_tokens": HOLD_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as h, h.stream("POST", url, json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        rid = None
        for line in lines:
            if line.startswith("data: "):
                chunk = json.loads(line.removeprefix("data: "))
                rid = chunk["id"]
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    break
    # The connection is closed here, mid-stream.
    t = wait_trace(receiver, rid, lambda t: bool(t.named("decode", "tandem-decode")))
    root = t.root
    assert root.kind == SERVER and has_error(root, "CANCELLED")
    assert attrs(root)["gen_ai.request.stream"] is True
    assert attrs(root)["gen_ai.operation.name"] == "chat"
    _assert_cancelled_on_decode(t)
    wait_logs(cluster, rid, {"router": "request cancelled", "prefill0": "prefill finished",
                             "decode0": "decode cancelled"})


def test_http_traceparent_is_continued(cluster, receiver):
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    r = httpx.post(f"http://127.0.0.1:{cluster.router.http_port}/v1/completions",
                   json={"prompt": "continue my trace", "max_tokens": 2, "temperature": 0},
                   headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}, timeout=30)
    assert r.status_code == 200
    rid = r.json()["id"]
    root = wait_trace(receiver, rid, lambda t: bool(t.named("decode", "tandem-decode"))).root
    assert root.trace_id.hex() == trace_id and root.parent_span_id.hex() == "00f067aa0ba902b7"
    assert attrs(root)["gen_ai.request.stream"] is False


def test_refused_requests_are_traced_and_logged(cluster, receiver):
    wire = params_to_proto(SamplingParams(max_tokens=4))
    wire.temperature = -1.0

    async def main():
        async with grpc.aio.insecure_channel(cluster.router.address) as ch:
            call = cluster.api(ch).Generate(api_pb2.GenerateRequest(
                text="refuse me", request_id="refused-grpc", params=wire))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in call:
                    pass
            return e.value.code()

    assert asyncio.run(main()) == grpc.StatusCode.INVALID_ARGUMENT
    t = wait_trace(receiver, "refused-grpc",
                   lambda t: bool(t.named("/tandem.v1.Tandem/Generate")))
    root = t.root
    assert has_error(root, "INVALID_ARGUMENT") and "temperature" in root.status.message
    server = t.one("/tandem.v1.Tandem/Generate", "tandem-router")
    assert attrs(server)["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert not [e for _, s in t.all for e in s.events if e.name == "exception"]
    assert {svc for svc, _ in t.all} == {"tandem-router"}  # no worker saw it
    line = wait_logs(cluster, "refused-grpc", {"router": "request refused"})["router"]
    assert line["error_type"] == "INVALID_ARGUMENT" and line["trace_id"] == root.trace_id.hex()

    # HTTP: a parameter the API refuses before the Frontend, and a body that does not parse.
    base = f"http://127.0.0.1:{cluster.router.http_port}"
    for body in ({"prompt": "x", "suffix": "y"}, {"prompt": "x", "max_tokens": "many"}):
        before = {s.span_id for _, s in receiver.snapshot()}
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
        assert r.status_code == 400

        def refused(before=before):
            return [s for _, s in receiver.snapshot() if s.span_id not in before
                    and attrs(s).get("gen_ai.operation.name") == "text_completion"]

        deadline = time.monotonic() + 20
        while not refused() and time.monotonic() < deadline:
            time.sleep(0.05)
        (span,) = refused()
        assert has_error(span, "INVALID_ARGUMENT") and span.kind == SERVER
        assert attrs(span)["server.port"] == cluster.router.http_port


def test_failed_request_is_an_error_on_router_and_decode(cluster, receiver):
    async def main():
        async with grpc.aio.insecure_channel(cluster.router.address) as ch, \
                grpc.aio.insecure_channel(cluster.workers("decode")[0].address) as wch:
            call = cluster.api(ch).Generate(api_pb2.GenerateRequest(
                text="fail me", request_id="failed-grpc", params=params_to_proto(LONG)))
            seen, aborted = 0, None
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for r in call:
                    seen += len(r.token_ids)
                    if seen >= 3 and aborted is None:  # decoding: the decode worker drops it
                        aborted = await worker_pb2_grpc.WorkerStub(wch).Abort(
                            worker_pb2.AbortRequest(request_id="failed-grpc"))
                        assert aborted.aborted
            return e.value.code()

    assert asyncio.run(main()) == grpc.StatusCode.ABORTED
    t = wait_trace(receiver, "failed-grpc", lambda t: bool(t.named("decode", "tandem-decode")))
    root = t.root
    assert has_error(root, "ABORTED")
    assert attrs(root)["gen_ai.response.finish_reasons"] == ["error"]
    decode = t.one("decode", "tandem-decode")
    assert has_error(decode, "ABORTED")
    assert attrs(decode)["tandem.finish_reasons"] == ["error"]
    assert attrs(decode)["tandem.output_tokens"] >= 1
    assert has_error(t.one("decode_leg", "tandem-router"), "ABORTED")
    logs = wait_logs(cluster, "failed-grpc", {"router": "request failed",
                                               "prefill0": "prefill finished",
                                               "decode0": "decode failed"})
    assert logs["router"]["error_type"] == "ABORTED"


def test_a_request_a_worker_refuses_is_a_span_in_the_callers_trace(cluster, receiver):
    """A decode request whose lease token is malformed, straight on the decode worker's Stream
    call (one without a lease is not refused: the worker prefills it, prefill fallback)."""
    trace_id, parent = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"

    async def main():
        async def requests():
            yield worker_pb2.StreamRequest(
                decode=worker_pb2.DecodeRequest(request_id="bad-lease", prompt_token_ids=[1, 2],
                                                kv=worker_pb2.KVLocation(lease_id="x" * 65)),
                trace_context={"traceparent": f"00-{trace_id}-{parent}-01"})

        async with grpc.aio.insecure_channel(cluster.workers("decode")[0].address) as ch:
            return [u for m in await _collect(worker_pb2_grpc.WorkerStub(ch).Stream(requests()))
                    for u in m.updates]

    (update,) = asyncio.run(main())
    assert update.error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    deadline = time.monotonic() + 20
    while True:
        found = [s for svc, s in receiver.snapshot() if svc == "tandem-decode"
                 and s.trace_id.hex() == trace_id]
        if found or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    (span,) = found
    assert span.name == "decode" and span.kind == SERVER and span.parent_span_id.hex() == parent
    assert has_error(span, "INVALID_ARGUMENT") and "lease" in span.status.message
    wait_logs(cluster, "bad-lease", {"decode0": "decode refused"})


async def _collect(call) -> list:
    return [m async for m in call]
