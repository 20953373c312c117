"""Traces and logs across router, prefill and decode as three processes, exporting OTLP to a real
OTLP/gRPC receiver run by the test: each request is one trace whose decode and KV-transfer spans
descend from its router span, with the GenAI and timing attributes set; log lines inside a request
carry its trace id; no span and no log line holds prompt text or the pool's IPC handle; spans
still buffered at SIGTERM are flushed before exit."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import grpc
import httpx
import pytest
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from traces import Receiver, Spans, attrs, traced_cluster, wait_trace, wait_traces

from cluster import WORKER_ARGS, Cluster, serve
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.tokenizer import Tokenizer
from tandem.router_svc.frontend import Frontend, ModelInfo
from tandem.router_svc.orchestrator import SampleUpdate, Update
from tandem.runtime.convert import descriptor_from_proto, params_to_proto
from tandem.runtime.metrics import Metrics
from tandem.runtime.telemetry import Telemetry, Tracing
from tandem.v1 import api_pb2, worker_pb2, worker_pb2_grpc

SECRET = "zebra-quartz-"  # prompt text that must never reach a span or a log line
BLOCK_BYTES = 2 * 2 * 16 * 2 * 64 * 4  # layers x (K, V) x block x kv heads x head dim x fp32


@pytest.fixture(scope="module")
def cluster(tiny_models, tmp_path_factory, receiver):
    yield from serve(traced_cluster(tmp_path_factory.mktemp("tracing"), str(tiny_models["llama"]),
                                    receiver))


def complete(t: Spans) -> bool:
    """The request's decode, KV transfer and prefill spans exported, and every span's parent
    (the request's own span's caller aside)."""
    return (len(t.named("decode", "tandem-decode")) == 1
            and len(t.named("kv_transfer", "tandem-decode")) == 1
            and len(t.named("prefill", "tandem-prefill")) == 1
            and all(s.parent_span_id in t.by_id for _, s in t.all
                    if s.parent_span_id and s is not t.root))


def prompt_text(i: int) -> str:
    return f"{SECRET}{i} " + "lorem ipsum dolor " * (1 + 3 * i)


async def generate(stub, text: str, params: SamplingParams) -> tuple[str, api_pb2.Usage, list]:
    reasons = []
    async for r in stub.Generate(api_pb2.GenerateRequest(text=text,
                                                         params=params_to_proto(params))):
        if r.finish_reason:
            reasons.append(r.finish_reason)
    return r.request_id, r.usage, reasons


def test_each_request_is_one_trace_across_three_processes(cluster, receiver):
    params = SamplingParams(temperature=0.5, seed=1, max_tokens=12, ignore_eos=True)

    async def main():
        async with grpc.aio.insecure_channel(cluster.router.address) as ch:
            stub = cluster.api(ch)
            return await asyncio.gather(*(generate(stub, prompt_text(i), params)
                                          for i in range(6)))

    results = asyncio.run(main())
    # One more over HTTP: its first step and its stream run in different tasks of the router.
    r = httpx.post(f"http://127.0.0.1:{cluster.router.http_port}/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": SECRET + " chat"}],
                         "max_tokens": 7, "temperature": 0, "ignore_eos": True, "stream": True},
                   timeout=30)
    assert r.status_code == 200
    chat_id = json.loads(r.text.split("\n")[0].removeprefix("data: "))["id"]
    traces = wait_traces(receiver, [rid for rid, _, _ in results] + [chat_id], complete)

    assert len({t.root.trace_id for t in traces.values()}) == len(traces)
    for rid, usage, reasons in [*results, (chat_id, None, ["length"])]:
        t = traces[rid]
        assert t.services == {"tandem-router", "tandem-prefill", "tandem-decode"}
        (decode,), (kv,), (prefill,) = (t.named("decode", "tandem-decode"),
                                        t.named("kv_transfer", "tandem-decode"),
                                        t.named("prefill", "tandem-prefill"))
        assert kv.parent_span_id == decode.span_id
        for span in (decode, kv, prefill):
            assert t.root in t.ancestors(span), (rid, span.name)
        # The prefill span sits under its gRPC server span, a child of the router's CLIENT span
        # for the call (the context crossed in the call's metadata); the decode span, a request
        # on the decode worker's Stream call, is the child of the router's CLIENT span for that
        # leg (it crossed in the message) and the long-lived Stream call has no span of its own.
        assert [s.name for s in t.ancestors(decode)][:2] == ["decode_leg", t.root.name]
        assert decode.kind == trace_pb2.Span.SPAN_KIND_SERVER
        assert t.ancestors(decode)[0].kind == trace_pb2.Span.SPAN_KIND_CLIENT
        assert [s.name for s in t.ancestors(prefill)][:3] == [
            "/tandem.v1.Worker/Prefill", "tandem.v1.Worker/Prefill", t.root.name]
        assert t.ancestors(prefill)[1].kind == trace_pb2.Span.SPAN_KIND_CLIENT
        assert not t.named("/tandem.v1.Worker/Stream", "tandem-decode")

        ra = attrs(t.root)
        model = Path(cluster.model).name  # served under its directory's name
        op = "chat" if rid == chat_id else "text_completion"
        assert t.root.name == f"{op} {model}"
        assert ra["gen_ai.operation.name"] == op and ra["gen_ai.request.model"] == model
        assert ra["gen_ai.request.max_tokens"] == (7 if rid == chat_id else 12)
        assert ra["gen_ai.request.temperature"] == (0.0 if rid == chat_id else 0.5)
        assert ra["gen_ai.response.finish_reasons"] == reasons == ["length"]
        if usage is not None:
            assert ra["gen_ai.usage.input_tokens"] == usage.prompt_tokens
            assert ra["gen_ai.usage.output_tokens"] == usage.completion_tokens == 12
        assert 0 < ra["gen_ai.response.time_to_first_chunk"] < (
            t.root.end_time_unix_nano - t.root.start_time_unix_nano) / 1e9

        pa = attrs(prefill)
        prompt_tokens = ra["gen_ai.usage.input_tokens"]
        assert pa["tandem.request_id"] == rid and pa["tandem.prompt_tokens"] == prompt_tokens
        assert pa["tandem.queue_time_seconds"] >= 0 and "tandem.cached_tokens" in pa
        assert pa["tandem.prefill.chunks"] >= -(-prompt_tokens // 64)  # 64-token budget/step
        assert pa["tandem.time_to_first_token_seconds"] > pa["tandem.queue_time_seconds"]

        ka = attrs(kv)
        blocks = -(-prompt_tokens // 16)
        assert ka["tandem.kv.blocks"] == blocks and ka["tandem.kv.bytes"] == blocks * BLOCK_BYTES
        assert ka["tandem.kv.gbps"] > 0 and ka["tandem.kv.transport"] == "shm"
        # fresh pools on both sides: the prompt's blocks are one run there and land in one here
        assert ka["tandem.kv.runs"] == 1
        assert kv.end_time_unix_nano > kv.start_time_unix_nano

        da = attrs(decode)
        assert da["tandem.request_id"] == rid
        assert da["tandem.output_tokens"] == ra["gen_ai.usage.output_tokens"] - 1  # 1st: prefill
        assert da["tandem.queue_time_seconds"] >= 0
        assert da["tandem.time_to_first_token_seconds"] > 0
        assert da["tandem.time_per_output_token_seconds"] > 0
        # The KV pull happens inside the decode span, before its first token.
        assert decode.start_time_unix_nano <= kv.start_time_unix_nano <= kv.end_time_unix_nano \
            <= decode.end_time_unix_nano


def test_log_lines_carry_the_trace_and_nothing_secret(cluster, receiver):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def main():
        async with grpc.aio.insecure_channel(cluster.router.address) as ch:
            stub = cluster.api(ch)
            return await asyncio.gather(*(generate(stub, prompt_text(i), params)
                                          for i in range(3)))

    rids = [rid for rid, _, _ in asyncio.run(main())]
    traces = wait_traces(receiver, rids, complete)

    # The pool's handle, as a decode worker is given it: a shm segment name.
    async def shm_name():
        async with grpc.aio.insecure_channel(cluster.workers("prefill")[0].address) as ch:
            resp = await worker_pb2_grpc.WorkerStub(ch).Register(worker_pb2.RegisterRequest(
                decode_worker_id="probe", layout=worker_pb2.PoolDescriptor(
                    dtype="float32", block_size=16, num_layers=2, num_kv_heads=2, head_dim=64)))
            return descriptor_from_proto(resp.pool).shm_name

    handle = asyncio.run(shm_name())
    assert handle
    for proc in cluster.procs.values():
        lines = proc.json_logs()
        assert lines and all(line.get("service", "").startswith("tandem-") for line in lines)
        service = lines[0]["service"]
        for rid in rids:
            mine = [line for line in lines if line.get("request_id") == rid]
            assert mine, (proc.name, rid)
            trace_id = traces[rid].root.trace_id.hex()
            assert {line.get("trace_id") for line in mine} == {trace_id}, (proc.name, mine)
            spans = {s.span_id.hex() for svc, s in traces[rid].all if svc == service}
            assert all(line["span_id"] in spans for line in mine)
        text = proc.log_text()
        assert SECRET not in text and handle not in text, proc.name
    exported = b"".join(receiver.raw)
    assert SECRET.encode() not in exported and handle.encode() not in exported


def test_spans_buffered_at_sigterm_are_flushed(tiny_models, tmp_path):
    """A schedule delay of a minute: nothing leaves before the processes are told to stop."""
    receiver = Receiver()
    try:
        c = Cluster(tmp_path, str(tiny_models["llama"]), worker_args=WORKER_ARGS,
                    env=receiver.env(schedule_delay_ms=60_000),
                    router_args=["--http-port", "-1"]).start()
        try:
            async def main():
                async with grpc.aio.insecure_channel(c.router.address) as ch:
                    return await generate(c.api(ch), prompt_text(1),
                                          SamplingParams(temperature=0, max_tokens=4))

            rid = asyncio.run(main())[0]
            time.sleep(0.3)
            assert not [s for _, s in receiver.snapshot() if s.name in ("prefill", "decode")]
        finally:
            codes = c.stop()
        assert codes == {"prefill0": 0, "decode0": 0, "router": 0}
        wait_trace(receiver, rid, complete, timeout=1)
    finally:
        receiver.server.stop(0)


# -- prompt and output text: only with --trace-content (in process) ----------------------------
class _Orchestrator:
    """Stands in for the workers: two tokens, then the sample ends."""

    async def run(self, request_id, prompt, params, timeout=None, trace_ctx=None):
        yield Update([SampleUpdate(0, [72, 105], [None, None], None)], len(prompt), 0)
        yield Update([SampleUpdate(0, [33], [None], "length")], len(prompt), 0)


@pytest.mark.parametrize("capture", [False, True])
def test_text_is_recorded_only_with_trace_content(tiny_models, capture):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry = Telemetry("router", Tracing(provider.get_tracer("test"), provider),
                          Metrics("router", "m"), capture_content=capture)
    tok = Tokenizer(tiny_models["llama"])
    fe = Frontend(tok, _Orchestrator(), ModelInfo("m", "llama", 1024, 512, "float32", 16),
                  telemetry=telemetry)

    async def main():
        return [d async for d in fe.stream("r1", tok.encode(SECRET + "prompt"),
                                           SamplingParams(max_tokens=3))]

    deltas = asyncio.run(main())
    output = "".join(d.text for step, _ in deltas for d in step)
    (span,) = exporter.get_finished_spans()
    values = json.dumps(dict(span.attributes))
    assert span.attributes["gen_ai.usage.output_tokens"] == 3
    if capture:
        inputs = json.loads(span.attributes["gen_ai.input.messages"])
        outputs = json.loads(span.attributes["gen_ai.output.messages"])
        assert SECRET + "prompt" in inputs[0]["parts"][0]["content"]
        assert outputs[0]["parts"][0]["content"] == output and outputs[0]["finish_reason"] \
            == "length"
    else:
        assert SECRET not in values and "messages" not in values
