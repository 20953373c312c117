"""Bounded property-based fuzzing of both public APIs against a live stack (router + prefill +
decode on 127.0.0.1): whatever a caller sends, the answer is a success or an error of the
caller's (HTTP 4xx in OpenAI's shape, a gRPC status other than INTERNAL/UNKNOWN), never a
server error; afterwards the router is healthy and both pools are idle.

Generated lengths stay small: valid requests generate at most 4 tokens per sample, so a few
hundred examples take seconds of a tiny model's time. derandomize=True: the same examples on
every run."""

from __future__ import annotations

import asyncio
import json
import math
from collections import Counter

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster import Cluster
from tandem.v1 import api_pb2, api_pb2_grpc, common_pb2

KEY = "fuzz-key"
WORKER_ARGS = ["--num-blocks", "256", "--max-num-batched-tokens", "64"]
FUZZ = settings(max_examples=120, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def cluster(tiny_models, tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("fuzz"), str(tiny_models["llama"]),
                worker_args=WORKER_ARGS, env={"TANDEM_API_KEY": KEY}).start()
    yield c
    codes = c.stop()
    assert all(code == 0 for code in codes.values()), codes


@pytest.fixture(scope="module")
def http(cluster):
    with httpx.Client(base_url=f"http://127.0.0.1:{cluster.router.http_port}", timeout=60,
                      headers={"authorization": f"Bearer {KEY}",
                               "content-type": "application/json"}) as client:
        yield client


def healthy_and_idle(cluster: Cluster, http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    asyncio.run(cluster.wait_idle(timeout=20))


# -- values: the valid and the hostile, mixed -----------------------------------------------------
anything = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
    st.lists(st.integers(min_value=-3, max_value=2**33), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
# A max_tokens that must be refused (never a valid large one: the tiny model would generate up
# to its length).
bad_max_tokens = st.one_of(st.integers(max_value=0), st.integers(min_value=2**32, max_value=2**70),
                           st.floats(allow_nan=True), st.booleans(), st.text(max_size=4))
token_ids = st.lists(st.integers(min_value=0, max_value=250), min_size=1, max_size=12)
short_text = st.text(min_size=1, max_size=3)
VALID = {
    "n": st.integers(1, 2), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50), "min_p": st.floats(0, 1),
    "repetition_penalty": st.floats(0.5, 2), "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2), "seed": st.integers(0, 2**63 - 1),
    "stop": st.one_of(short_text, st.lists(short_text, max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, 250), max_size=3), "stream": st.booleans(),
    "logit_bias": st.dictionaries(st.integers(0, 250).map(str), st.floats(-100, 100),
                                  max_size=2),
    "ignore_eos": st.booleans(), "min_tokens": st.integers(0, 1), "cache_salt": st.text(max_size=8),
    "user": st.text(max_size=8), "skip_special_tokens": st.booleans(),
}
HOSTILE = {**{name: anything for name in VALID}, "max_tokens": bad_max_tokens,
           "model": anything, "bogus_field": anything, "stream_options": anything,
           "response_format": anything}


def with_hostile(valid: st.SearchStrategy[dict], fields: dict) -> st.SearchStrategy[dict]:
    """A valid body, or one with one field (possibly a new one) set to a hostile value."""
    names = sorted(fields)
    mutated = st.tuples(valid, st.sampled_from(names), st.data()).map(
        lambda t: {**t[0], t[1]: t[2].draw(fields[t[1]])})
    return st.one_of(valid, mutated, mutated)


completion = with_hostile(
    st.fixed_dictionaries({"prompt": st.one_of(st.text(min_size=1, max_size=40), token_ids),
                           "max_tokens": st.integers(1, 4)},
                          optional={**VALID, "logprobs": st.integers(0, 3),
                                    "echo": st.booleans()}),
    {**HOSTILE, "prompt": st.one_of(st.lists(token_ids, max_size=2), st.lists(
        st.integers(-2, 2**33), max_size=4), anything), "logprobs": anything, "echo": anything})
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]),
                                 "content": st.text(min_size=1, max_size=30)})
chat = with_hostile(
    st.fixed_dictionaries({"messages": st.lists(message, min_size=1, max_size=2).map(
                               lambda ms: [*ms[:-1], {**ms[-1], "role": "user"}]),
                           "max_tokens": st.integers(1, 4)},
                          optional={**VALID, "logprobs": st.booleans()}),
    {**HOSTILE, "messages": st.one_of(st.lists(st.one_of(
        st.dictionaries(st.sampled_from(["role", "content", "name"]), anything, max_size=3),
        anything), max_size=3), anything), "logprobs": anything, "top_logprobs": anything,
     "tools": anything, "tool_choice": anything, "max_completion_tokens": bad_max_tokens})


def check_http(r: httpx.Response, seen: Counter) -> None:
    seen[r.status_code] += 1
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert isinstance(err["message"], str)


def test_fuzz_http_completions(cluster, http):
    seen: Counter = Counter()

    @FUZZ
    @given(body=completion)
    def run(body):
        # json.dumps writes NaN/Infinity as Python does: the server must refuse them too.
        check_http(http.post("/v1/completions", content=json.dumps(body).encode()), seen)

    run()
    print("HTTP completions:", dict(seen))
    assert seen[200] >= 10 and seen[400] >= 10, seen  # both paths were exercised
    healthy_and_idle(cluster, http)


def test_fuzz_http_chat(cluster, http):
    seen: Counter = Counter()

    @FUZZ
    @given(body=chat)
    def run(body):
        check_http(http.post("/v1/chat/completions", content=json.dumps(body).encode()), seen)

    run()
    print("HTTP chat:", dict(seen))
    assert seen[200] >= 10 and seen[400] >= 10, seen
    healthy_and_idle(cluster, http)


# -- gRPC ---------------------------------------------------------------------------------------
uint32 = st.integers(min_value=0, max_value=2**32 - 1)
double = st.floats(allow_nan=True, allow_infinity=True)
wire_text = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=40)
GRPC_VALID = {
    "n": st.integers(0, 2), "max_tokens": st.integers(1, 4), "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1), "top_k": st.integers(0, 50), "min_p": st.floats(0, 1),
    "repetition_penalty": st.floats(0.5, 2), "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2), "seed": st.integers(0, 2**63 - 1),
    "stop": st.lists(short_text, max_size=2), "stop_token_ids": st.lists(st.integers(0, 250),
                                                                         max_size=3),
    "ignore_eos": st.booleans(), "logprobs": st.integers(0, 3), "min_tokens": st.integers(0, 1),
    "logit_bias": st.dictionaries(st.integers(0, 250), st.floats(-100, 100), max_size=2),
    "cache_salt": st.text(max_size=8), "skip_special_tokens": st.booleans(),
    "model": st.just(""), "request_id": st.just(""),
    "prompt": st.one_of(st.text(min_size=1, max_size=40), token_ids),
}
GRPC_HOSTILE = {  # anything the wire can carry (max_tokens: never a valid large value)
    "n": uint32, "max_tokens": st.just(0), "temperature": double, "top_p": double,
    "top_k": uint32, "min_p": double, "repetition_penalty": double, "presence_penalty": double,
    "frequency_penalty": double, "seed": st.integers(0, 2**64 - 1),
    "stop": st.lists(wire_text, max_size=2), "stop_token_ids": st.lists(uint32, max_size=3),
    "logprobs": uint32, "min_tokens": uint32, "logit_bias": st.dictionaries(uint32, double,
                                                                            max_size=2),
    "cache_salt": st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=400),
    "model": wire_text, "request_id": st.text(alphabet=st.characters(
        exclude_categories=("Cs",)), max_size=300),
    "prompt": st.one_of(wire_text, st.lists(uint32, max_size=12)),
}


def _generate_request(fields: dict) -> api_pb2.GenerateRequest:
    fields = dict(fields)
    prompt, model, rid = fields.pop("prompt"), fields.pop("model"), fields.pop("request_id")
    req = api_pb2.GenerateRequest(params=common_pb2.SamplingParams(**fields), model=model,
                                  request_id=rid)
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    return req


# Values the server must refuse with INVALID_ARGUMENT, whatever else the request holds. Drawn in
# their own share of the examples (and asserted one by one), so the refusal path is reached by
# construction: how often a hostile draw happens to be invalid depends on Hypothesis' pool of
# constants, which changes with the modules a run has imported.
not_finite = st.sampled_from([math.nan, math.inf, -math.inf])
GRPC_REFUSED = {
    "n": st.integers(17, 2**32 - 1),  # past the stack's limit of samples (16)
    "temperature": st.one_of(st.floats(max_value=-1e-3), not_finite),
    "top_p": st.one_of(st.floats(min_value=1.001), not_finite),
    "min_p": st.one_of(st.floats(min_value=1.001), st.floats(max_value=-1e-3), not_finite),
    "repetition_penalty": st.one_of(st.floats(max_value=0), not_finite),
    "presence_penalty": st.one_of(st.floats(min_value=2.001), st.floats(max_value=-2.001)),
    "frequency_penalty": st.one_of(st.floats(min_value=2.001), st.floats(max_value=-2.001)),
    "seed": st.integers(2**63, 2**64 - 1),
    "logprobs": st.integers(21, 2**32 - 1),
    "min_tokens": st.integers(5, 2**32 - 1),  # past max_tokens (at most 4)
    "logit_bias": st.dictionaries(st.integers(0, 250), st.one_of(
        st.floats(min_value=100.001), st.floats(max_value=-100.001), not_finite),
        min_size=1, max_size=2),
    "cache_salt": st.text(min_size=257, max_size=300),
    "stop": st.lists(st.just("a"), min_size=257, max_size=260),
    "prompt": st.lists(st.integers(2**20, 2**32 - 1), min_size=1, max_size=4),  # past the vocab
}


def _refused(t: tuple) -> tuple[str, dict]:
    valid, name, data = t
    return name, {**valid, name: data.draw(GRPC_REFUSED[name])}


refused_request = st.tuples(st.fixed_dictionaries(GRPC_VALID), st.sampled_from(
    sorted(GRPC_REFUSED)), st.data()).map(_refused)
generate_request = st.one_of(
    with_hostile(st.fixed_dictionaries(GRPC_VALID), GRPC_HOSTILE).map(lambda f: (None, f)),
    refused_request).map(lambda t: (t[0], _generate_request(t[1])))
FINE = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.RESOURCE_EXHAUSTED}


def test_fuzz_grpc_generate(cluster, http):
    loop = asyncio.new_event_loop()
    channel = loop.run_until_complete(_channel(cluster))
    stub = api_pb2_grpc.TandemStub(channel)

    async def call(req) -> tuple[grpc.StatusCode, str]:
        try:
            async for _ in stub.Generate(req, metadata=(("authorization", f"Bearer {KEY}"),),
                                         timeout=60):
                pass
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details() or ""
        return grpc.StatusCode.OK, ""

    seen: Counter = Counter()

    @settings(FUZZ, max_examples=250)
    @given(case=generate_request)
    def run(case):
        refused_field, req = case
        code, details = loop.run_until_complete(call(req))
        seen[code.name] += 1
        assert code in FINE, (code, req)
        if refused_field is not None:  # refused, naming the field
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (refused_field, code, req)
            assert refused_field in details, (refused_field, details)

    try:
        run()
    finally:
        loop.run_until_complete(channel.close())
        loop.close()
    print("gRPC Generate:", dict(seen))
    assert seen["OK"] >= 10 and seen["INVALID_ARGUMENT"] >= 10, seen
    healthy_and_idle(cluster, http)


async def _channel(cluster: Cluster) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(cluster.router.address)
