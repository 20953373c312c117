"""The public gRPC API as a client in another service uses it: text and token-id prompts,
streaming, n > 1, deadlines, cancellation, health, reflection, model info and tokenize."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cluster import HOLD_TOKENS, HOLD_WORKER_ARGS, Cluster
from tandem.engine.sampling_params import SamplingParams
from tandem.runtime.convert import params_to_proto
from tandem.v1 import api_pb2


@pytest.fixture(scope="module")
def cluster(tiny_llama_long, tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("grpc"), str(tiny_llama_long),
                worker_args=HOLD_WORKER_ARGS, router_args=["--http-port", "-1", "--reflection"]
                ).start()
    yield c
    assert all(code == 0 for code in c.stop().values())


@pytest.fixture(autouse=True)
def idle_after(cluster):
    yield
    asyncio.run(cluster.wait_idle())


def run(coro):
    return asyncio.run(coro)


async def collect(stub, req, timeout=None):
    chunks = [c async for c in stub.Generate(req, timeout=timeout)]
    return chunks


def test_text_prompt_streams_text_and_usage(cluster, offline):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = offline.generate(["Tandem says"], params)[0]

    async def main():
        async with grpc.aio.insecure_channel(cluster.router.address) as ch:
            return await collect(cluster.api(ch), api_pb2.GenerateRequest(
                text="Tandem says", params=params_to_proto(params)))

    chunks = run(main())
    assert len(chunks) > 1  # streamed, not one message
    assert [t for c in chunks for t in c.token_ids] == expected.outputs[0].token_ids
    assert "".join(c.text for c in chunks) == expected.outputs[0].text
    last = chunks[-1]
    assert last.finish_reason == "length" and last.request_id
    assert last.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert last.usage.completion_tokens == 12
    assert all(not c.finish_reason for c in chunks[:-1])


def test_n_samples_interleave_with_their_index(cluster):
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)

    async def main():
        async with grpc.aio.insecure_channel(cluster.router.address) as ch:
            return await collect(cluster.api(ch), api_pb2.GenerateRequest(
                token_ids=api_pb2.TokenIds(ids=[5, 6, 7, 8, 9]), params=params_to_proto(params)))

    chunks = run(main())
    per_sample = {i: [t for c in chunks if c.index == i for t in c.token_ids] for i in range(3)}
    assert all(len(v) == 6 for v in per_sample.values())
    assert len({tuple(v) for v in per_sample.values()}) > 1
    assert sorted(c.index for c in chunks if c.finish_reason) == [0, 1, 2]
    assert chunks[-1].usage.completion_tokens == 18


def test_deadline_mid_stream_ends_deadline_exceeded(cluster):
    """The deadline passes mid-stream: after the first token the decode worker's engine core is
    held still (SIGSTOP), so the call cannot finish before its deadline however fast the machine;
    the client sees DEADLINE_EXCEEDED, and once the core runs again the router's cancel frees
    the request's blocks (the autouse fixture waits for every pool to be idle)."""
    params = SamplingParams(temperature=0, max_tokens=HOLD_TOKENS, ignore_eos=True)
    core = cluster.engine_core("decode0")

    async def main():
        async with grpc.aio.insecure_channel(cluster.router.address) as ch:
            call = cluster.api(ch).Generate(api_pb2.GenerateRequest(
                token_ids=api_pb2.TokenIds(ids=[3] * 40), params=params_to_proto(params)),
                timeout=5.0)
            first = await call.read()
            assert first.token_ids, first
            os.kill(core, signal.SIGSTOP)
            try:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    while (c := await call.read()) is not grpc.aio.EOF:
                        assert not c.finish_reason, "the call ended although its decoder is held"
                assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            finally:
                os.kill(core, signal.SIGCONT)

    run(main())


def test_client_cancel(cluster):
    """Cancelled after three tokens, while the decode worker's engine core is held still
    (SIGSTOP), so the request is still running when the cancel comes however slow this
    machine; once the core runs again the router's cancel frees its blocks (the autouse
    fixture waits for every pool to be idle)."""
    params = SamplingParams(temperature=0, max_tokens=HOLD_TOKENS, ignore_eos=True)
    core = cluster.engine_core("decode0")

    async def main():
        async with grpc.aio.insecure_channel(cluster.router.address) as ch:
            call = cluster.api(ch).Generate(api_pb2.GenerateRequest(
                token_ids=api_pb2.TokenIds(ids=[4] * 30), params=params_to_proto(params)))
            for _ in range(3):
                await call.read()
            os.kill(core, signal.SIGSTOP)
            try:
                assert call.cancel()
                assert await call.code() == grpc.StatusCode.CANCELLED
            finally:
                os.kill(core, signal.SIGCONT)

    run(main())


def test_health_reflection_models_and_tokenize(cluster, offline):
    async def main():
        async with grpc.aio.insecure_channel(cluster.router.address) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            for service in ("", "tandem.v1.Tandem"):
                resp = await health.Check(health_pb2.HealthCheckRequest(service=service))
                assert resp.status == health_pb2.HealthCheckResponse.SERVING
            refl = reflection_pb2_grpc.ServerReflectionStub(ch)

            async def ask():
                yield reflection_pb2.ServerReflectionRequest(list_services="")

            services = set()
            async for r in refl.ServerReflectionInfo(ask()):
                services |= {s.name for s in r.list_services_response.service}
            assert {"tandem.v1.Tandem", "grpc.health.v1.Health"} <= services
            api = cluster.api(ch)
            models = await api.ListModels(api_pb2.ListModelsRequest())
            assert len(models.models) == 1 and models.models[0].architecture == "LlamaForCausalLM"
            # The workers' dtype (float32 on the CPU): the router was not told one.
            info = await api.GetModelInfo(api_pb2.GetModelInfoRequest(model=cluster.model))
            assert (info.id, info.dtype) == (Path(cluster.model).name, "float32")
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await api.GetModelInfo(api_pb2.GetModelInfoRequest(model="no-such-model"))
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            tok = await api.Tokenize(api_pb2.TokenizeRequest(text="hello", add_special_tokens=True))
            assert list(tok.token_ids) == offline.tokenizer.encode("hello")
            chat = await api.Tokenize(api_pb2.TokenizeRequest(chat=api_pb2.ChatMessages(
                messages=[api_pb2.ChatMessage(role="user", content="hi")])))
            assert list(chat.token_ids) == offline.tokenizer.apply_chat_template(
                [{"role": "user", "content": "hi"}])

    run(main())
