"""tandem.client driving a real stack (router, prefill and decode workers on 127.0.0.1): text
and token-id prompts, streaming, n > 1, cancel on close, deadlines, typed errors that agree
with the HTTP API's, reflection on by default, and retries only where no token was sent."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cluster import Cluster
from tandem import client as tc
from tandem.engine.llm import LLM
from tandem.engine.sampling_params import SamplingParams as EngineParams

ROOT = Path(__file__).resolve().parents[2]
WORKER_ARGS = ["--num-blocks", "256", "--max-num-batched-tokens", "64"]
LONG = 900  # tokens: far longer than any test waits for (and within the context)


@pytest.fixture(scope="module")
def cluster(tiny_models, tmp_path_factory):
    # No --reflection flag: it is on by default.
    c = Cluster(tmp_path_factory.mktemp("client"), str(tiny_models["llama"]),
                worker_args=WORKER_ARGS).start()
    yield c
    assert all(code == 0 for code in c.stop().values())


@pytest.fixture(scope="module")
def client(cluster):
    with tc.Client(cluster.router.address, timeout=60) as c:
        yield c


@pytest.fixture(autouse=True)
def idle_after(request):
    yield
    if "cluster" in request.fixturenames:
        asyncio.run(request.getfixturevalue("cluster").wait_idle())


def test_text_prompt_matches_the_offline_engine(client, tiny_models):
    offline = LLM(str(tiny_models["llama"]), progress=False, num_blocks=256)
    expected = offline.generate(["Tandem says"], EngineParams(temperature=0, max_tokens=12,
                                                              ignore_eos=True))[0]
    out = client.generate("Tandem says", tc.SamplingParams(temperature=0, max_tokens=12,
                                                           ignore_eos=True))
    assert isinstance(out, tc.Completion) and out.request_id
    assert out.samples[0].token_ids == expected.outputs[0].token_ids
    assert out.text == expected.outputs[0].text
    assert out.samples[0].finish_reason == "length"
    assert out.usage == tc.Usage(len(expected.prompt_token_ids), 12, out.usage.cached_prompt_tokens)


def test_token_ids_stream_as_typed_chunks(client):
    chunks = list(client.stream([5, 6, 7, 8, 9], max_tokens=8, temperature=0, ignore_eos=True,
                                logprobs=2))
    assert len(chunks) > 1 and all(isinstance(c, tc.Chunk) for c in chunks)
    assert sum(len(c.token_ids) for c in chunks) == 8
    assert [c.finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    lp = [x for c in chunks for x in c.logprobs]
    assert len(lp) == 8 and all(len(x.top) == 2 for x in lp)
    assert chunks[-1].usage.prompt_tokens == 5 and chunks[-1].usage.completion_tokens == 8


def test_async_n_samples(cluster):
    async def main():
        async with tc.AsyncClient(cluster.router.address, timeout=60) as client:
            return await client.generate([5, 6, 7], n=3, temperature=1.0, seed=11,
                                         max_tokens=6, ignore_eos=True)

    out = asyncio.run(main())
    assert [s.index for s in out.samples] == [0, 1, 2]
    assert all(len(s.token_ids) == 6 and s.finish_reason == "length" for s in out.samples)
    assert len({tuple(s.token_ids) for s in out.samples}) > 1
    assert out.usage.completion_tokens == 18


def test_closing_a_stream_frees_the_workers(cluster, client):
    stream = client.stream([4] * 30, max_tokens=LONG, ignore_eos=True)
    for _ in range(3):
        next(stream)
    stream.close()
    asyncio.run(cluster.wait_idle())

    async def main():
        async with tc.AsyncClient(cluster.router.address) as aclient:
            async with aclient.stream([3] * 30, max_tokens=LONG, ignore_eos=True) as chunks:
                async for _ in chunks:
                    break
            await cluster.wait_idle()

    asyncio.run(main())


def test_deadline_mid_stream(cluster, client):
    """After the first chunk the decode worker's engine core is held still (SIGSTOP), so the
    deadline passes mid-stream however fast or slow the machine; the client raises
    DeadlineExceededError, and the core, continued, frees the request (idle_after checks)."""
    core = cluster.engine_core("decode0")
    got = []
    try:
        with pytest.raises(tc.DeadlineExceededError):
            for c in client.stream([3] * 40, max_tokens=LONG, ignore_eos=True, timeout=5.0):
                if not got:
                    os.kill(core, signal.SIGSTOP)
                got.append(c)
    finally:
        os.kill(core, signal.SIGCONT)
    assert got, "the deadline should expire mid-stream, after some tokens"


def test_errors_name_the_field_as_the_http_api_does(cluster, client):
    """The same refusal through gRPC and HTTP: one reason, the field under each API's name."""
    http = f"http://127.0.0.1:{cluster.router.http_port}/v1/completions"
    # Every parameter is params.<name> over gRPC (the client takes each of them).
    cases = [({"temperature": -1.0}, "params.temperature", "temperature"),
             ({"n": 99}, "params.n", "n"),
             ({"max_tokens": 4, "min_tokens": 9}, "params.min_tokens", "min_tokens"),
             ({"logit_bias": {99999: 1.0}}, "params.logit_bias", "logit_bias"),
             ({"cache_salt": "s" * 300}, "params.cache_salt", "cache_salt")]
    for kw, grpc_field, http_param in cases:
        with pytest.raises(tc.InvalidArgumentError) as e:
            client.generate([1, 2, 3], **kw)
        assert (e.value.field, e.value.reason) == (grpc_field, "INVALID_VALUE")
        body = httpx.post(http, json={"prompt": [1, 2, 3], **kw}).json()["error"]
        assert (body["param"], body["code"]) == (http_param, e.value.reason.lower())
    with pytest.raises(tc.InvalidArgumentError) as e:
        client.generate([1, 2, 3], json_schema={"type": "bogus"})
    assert e.value.field == "params.json_schema"
    with pytest.raises(tc.InvalidArgumentError) as e:
        client.generate([1] * 5000)
    assert e.value.field == "token_ids"
    with pytest.raises(tc.NotFoundError) as e:
        client.generate("hi", model="no-such-model")
    assert e.value.reason == "MODEL_NOT_FOUND" and e.value.metadata == {"field": "model"}


def test_models_tokenize_and_reflection_by_default(cluster, client):
    (model,) = client.list_models()
    assert model == client.model_info() and model.architecture == "LlamaForCausalLM"
    assert client.tokenize("hello") and all(isinstance(t, int) for t in client.tokenize("hi"))
    assert client.tokenize(messages=[{"role": "user", "content": "hi"}])

    async def services():
        async with grpc.aio.insecure_channel(cluster.router.address) as ch:
            async def ask():
                yield reflection_pb2.ServerReflectionRequest(list_services="")
                yield reflection_pb2.ServerReflectionRequest(
                    file_containing_symbol="tandem.v1.Tandem")

            return [r async for r in reflection_pb2_grpc.ServerReflectionStub(ch)
                    .ServerReflectionInfo(ask())]

    listed, files = asyncio.run(services())
    assert "tandem.v1.Tandem" in {s.name for s in listed.list_services_response.service}
    assert files.file_descriptor_response.file_descriptor_proto  # what grpcurl describes


# -- the gRPC guide's examples, as written (docs/grpc.md) -----------------------------------------
def readme_block(lang: str, index: int = 0) -> str:
    guide = (ROOT / "docs" / "grpc.md").read_text()
    return re.findall(rf"```{lang}\n(.*?)```", guide, re.S)[index]


def test_readme_python_example(cluster):
    code = readme_block("python").replace("127.0.0.1:50051", cluster.router.address)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "Usage(prompt_tokens=" in lines[0]
    assert {line.split()[0] for line in lines[1:]} == {"0", "1"}  # n=2 samples streamed


def test_readme_grpcurl_call_through_reflection(cluster):
    """The gRPC guide's grpcurl request, sent by buf curl (installed with buf; grpcurl too where
    it is installed): both learn the schema from the router's reflection alone."""
    cmd = readme_block("bash").replace("\\\n", " ").splitlines()[1]
    args = shlex.split(cmd)
    body, method = args[args.index("-d") + 1], args[-1]
    assert method == "tandem.v1.Tandem/Generate" and args[-2] == "127.0.0.1:50051"
    buf = shutil.which("buf", path=str(ROOT / ".tools" / "node_modules" / ".bin"))
    if buf is None:
        pytest.skip("buf is not installed (make buf)")
    r = subprocess.run([buf, "curl", "--protocol", "grpc", "--http2-prior-knowledge", "-d", body,
                        f"http://{cluster.router.address}/{method}"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    chunks = [json.loads(m) for m in re.findall(r"^\{.*?^\}", r.stdout, re.S | re.M)]
    assert chunks[-1]["finishReason"] == "length"
    assert chunks[-1]["usage"]["completionTokens"] == json.loads(body)["params"]["max_tokens"]
    if shutil.which("grpcurl"):
        args[-2] = cluster.router.address
        r = subprocess.run(args, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and '"finishReason": "length"' in r.stdout, r.stderr


# -- a stack that is made to fail ----------------------------------------------------------------
@pytest.fixture(scope="module")
def fragile(tiny_models, tmp_path_factory):
    """One request at a time; its tests run in order and kill the workers."""
    c = Cluster(tmp_path_factory.mktemp("fragile"), str(tiny_models["llama"]),
                worker_args=WORKER_ARGS, router_args=["--max-requests", "1"]).start()
    yield c
    c.stop()


def attempts(c: Cluster, rid: str, at_least: int = 1) -> int:
    """How many times the router ran request `rid` (its "request done" log lines), once at
    least `at_least` are there (the log is written before the status goes out)."""
    deadline = time.monotonic() + 20
    while True:
        n = sum(1 for line in c.router.json_logs()
                if line.get("request_id") == rid and line.get("event") == "request done")
        if n >= at_least or time.monotonic() > deadline:
            return n
        time.sleep(0.05)


def test_overloaded_is_typed_with_its_retry_delay(fragile):
    with tc.Client(fragile.router.address, timeout=60) as client, \
            client.stream([4] * 10, max_tokens=LONG, ignore_eos=True) as held:
        next(held)
        with pytest.raises(tc.OverloadedError) as e:
            client.generate([1, 2, 3], request_id="full-1")
    assert e.value.retry_after == 1.0 and e.value.reason == "RATE_LIMIT_EXCEEDED"
    asyncio.run(fragile.wait_idle())


def test_no_retry_after_tokens_arrived(fragile):
    """The decode worker dies mid-stream: UNAVAILABLE after tokens, never retried."""
    with tc.Client(fragile.router.address, timeout=60) as client:
        got = []
        with pytest.raises(tc.UnavailableError) as e:
            for c in client.stream([6] * 20, max_tokens=LONG, ignore_eos=True,
                                   request_id="mid-stream"):
                got.append(c)
                if len(got) == 3:
                    fragile.kill("decode0")
    assert len(got) >= 3 and "decode worker" in e.value.message
    # Every attempt logs its line before its status goes out: all are there by now.
    assert attempts(fragile, "mid-stream") == 1


def test_retry_before_any_token(fragile):
    """No prefill worker either: UNAVAILABLE before any token, which the client retries, the
    router seeing every attempt under the same request id."""
    fragile.kill("prefill0")
    fragile.procs["prefill0"].popen.wait(10)
    policy = tc.RetryPolicy(max_attempts=3, initial_backoff_s=0.05, max_backoff_s=0.1)
    with tc.Client(fragile.router.address, retry=policy, timeout=60) as client, \
            pytest.raises(tc.UnavailableError) as e:
        client.generate([1, 2, 3], request_id="before-token")
    assert "prefill" in e.value.message and e.value.retry_after == 1.0
    assert attempts(fragile, "before-token", at_least=3) == 3
