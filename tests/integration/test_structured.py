"""Structured outputs and tool calls through the disaggregated stack (router, prefill and
decode workers as real processes on 127.0.0.1), driven by the `openai` client and the gRPC API.

The model is a tiny random Llama: its text is noise, so nothing but the grammar can make an
output parse and validate. Strings and arrays in the schemas are bounded so that noise ends.
"""

from __future__ import annotations

import asyncio
import json

import grpc
import jsonschema
import openai
import pytest

from cluster import Cluster
from tandem.v1 import api_pb2, common_pb2

API_KEY = "k"
WORKER_ARGS = ["--num-blocks", "256", "--max-num-batched-tokens", "64"]
QUOTE = 34  # the byte-level tokenizer's ids of '"' and ']'
CLOSE_BRACKET = 93

NAME = {"type": "string", "maxLength": 6}
SCHEMAS = [
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0,
                                                             "maximum": 150}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
     "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "ok": {"type": "boolean"}},
     "required": ["color", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1,
                                                         "maximum": 999},
                                                  "tags": {"type": "array", "items": NAME,
                                                           "maxItems": 2}},
                 "required": ["id", "tags"], "additionalProperties": False},
        "level": {"enum": [1, 2, 3]}},
     "required": ["user", "level"], "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {"k": {"enum": ["a", "b"]},
                                                                 "v": {"type": "null"}},
                                "required": ["k", "v"], "additionalProperties": False},
     "maxItems": 3},
]
WEATHER = {"type": "object", "properties": {"city": NAME, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
TOOL_SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


@pytest.fixture(scope="module")
def cluster(tiny_models, tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("structured"), str(tiny_models["llama"]),
                worker_args=WORKER_ARGS, env={"TANDEM_API_KEY": API_KEY}).start()
    yield c
    codes = c.stop()
    assert all(code == 0 for code in codes.values()), codes


@pytest.fixture(scope="module")
def model(cluster) -> str:
    return cluster.model


@pytest.fixture(scope="module")
def base_url(cluster) -> str:
    return f"http://127.0.0.1:{cluster.router.http_port}/v1"


@pytest.fixture(scope="module")
def client(base_url):
    with openai.OpenAI(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(autouse=True)
def idle_after(cluster):
    yield
    asyncio.run(cluster.wait_idle())


def _fmt(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema,
                                                   "strict": True}}


async def _one(client: openai.AsyncOpenAI, model: str, i: int) -> list[tuple[dict, str, str]]:
    """Request i of 20: its schema, kind (chat / completion, streamed or not, n) varied."""
    schema = SCHEMAS[i % len(SCHEMAS)]
    n = 3 if i % 4 == 1 else 1
    stream = i % 3 == 2
    kw = dict(model=model, max_tokens=300, temperature=1.0, seed=i, n=n,
              response_format=_fmt(schema))
    if i % 2:
        kw["messages"] = [{"role": "user", "content": f"request {i}"}]
        create = client.chat.completions.create
    else:
        kw["prompt"] = f"request {i}:"
        kw["extra_body"] = {"response_format": kw.pop("response_format")}
        create = client.completions.create
    texts = [""] * n
    finish = [""] * n
    if stream:
        async for chunk in await create(**kw, stream=True):
            for c in chunk.choices:
                texts[c.index] += (c.delta.content or "") if i % 2 else c.text
                finish[c.index] = c.finish_reason or finish[c.index]
    else:
        r = await create(**kw)
        for c in r.choices:
            texts[c.index] = c.message.content if i % 2 else c.text
            finish[c.index] = c.finish_reason
    return [(schema, t, f) for t, f in zip(texts, finish, strict=True)]


def test_twenty_json_schema_requests_validate(base_url, model):
    async def main():
        async with openai.AsyncOpenAI(base_url=base_url, api_key=API_KEY, max_retries=0,
                                      timeout=300) as client:
            return await asyncio.gather(*(_one(client, model, i) for i in range(20)))

    results = [r for rs in asyncio.run(main()) for r in rs]
    assert len(results) == 20 + 2 * 5  # five of the twenty ask for n = 3
    for schema, text, finish in results:
        assert finish == "stop", (text, finish)
        jsonschema.validate(json.loads(text), schema)
    # Noise under a grammar still varies: not every answer is the same.
    assert len({t for _, t, _ in results}) > 10


def test_json_object(client, model):
    # A bias towards '"' keeps the noise's strings, and so the object, short.
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "json please"}], max_tokens=400,
        response_format={"type": "json_object"}, logit_bias={str(QUOTE): 6}, n=2, seed=3)
    for c in r.choices:
        assert c.finish_reason == "stop"
        assert isinstance(json.loads(c.message.content), dict)


def test_tool_choice_required_returns_valid_tool_calls(client, model):
    msgs = [{"role": "user", "content": "weather in Paris?"}]
    # The noise favours another call over closing the list: a bias towards ']' ends it.
    r = client.chat.completions.create(model=model, messages=msgs, tools=TOOLS,
                                       tool_choice="required", max_tokens=370, n=3, seed=1,
                                       logit_bias={str(CLOSE_BRACKET): 8})
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None
        assert c.message.tool_calls
        for call in c.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments),
                                TOOL_SCHEMAS[call.function.name])

    # One call at most without parallel tool calls; streamed as tool_calls deltas.
    chunks = list(client.chat.completions.create(
        model=model, messages=msgs, tools=TOOLS, tool_choice="required", max_tokens=300,
        parallel_tool_calls=False, stream=True, seed=2))
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert {d.index for d in deltas} == {0} and deltas[0].id.startswith("call_")
    assert all(d.id is None for d in deltas[1:])  # then its arguments, in pieces
    jsonschema.validate(json.loads("".join(d.function.arguments for d in deltas)),
                        TOOL_SCHEMAS[deltas[0].function.name])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    # A named function: its arguments, and the tool result accepted in the next turn.
    r = client.chat.completions.create(
        model=model, messages=msgs, tools=TOOLS, max_tokens=300,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TIME)
    follow = [*msgs, r.choices[0].message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    r2 = client.chat.completions.create(model=model, messages=follow, tools=TOOLS,
                                        tool_choice="none", max_tokens=4)
    assert r2.choices[0].message.tool_calls is None


@pytest.mark.parametrize(("kw", "param"), [
    ({"extra_body": {"prompt_logprobs": -1}}, "prompt_logprobs"),
    ({"extra_body": {"guided_regex": "(a"}}, "guided_regex"),
    ({"extra_body": {"tool_choice": "required"}}, "tool_choice"),  # completions take no tools
    ({"extra_body": {"response_format": _fmt({"type": "bogus"})}}, "response_format"),
    ({"extra_body": {"response_format": {"type": "yaml"}}}, "response_format"),
    ({"extra_body": {"logit_bias": {"99999": 1}}}, "logit_bias"),
    ({"extra_body": {"min_tokens": 9}}, "min_tokens"),  # above max_tokens
    ({"chat": True, "tool_choice": "required"}, "tool_choice"),  # without tools
    ({"chat": True, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": 5}}}], "tool_choice": "required"}, "tools"),
    ({"chat": True, "extra_body": {"chat_template_kwargs": {"tools": []}}},
     "chat_template_kwargs"),
])
def test_unsupported_or_bad_fields_are_400_by_name(client, model, kw, param):
    kw = dict(kw)
    with pytest.raises(openai.BadRequestError) as e:
        if kw.pop("chat", False):
            client.chat.completions.create(**{"model": model, "max_tokens": 4, "messages": [
                {"role": "user", "content": "hi"}], **kw})
        else:
            client.completions.create(**{"model": model, "prompt": "hi", "max_tokens": 4, **kw})
    assert e.value.status_code == 400
    assert e.value.param == param and param in e.value.message


def test_harmless_fields_are_accepted(client, model):
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2, user="u1",
        metadata={"k": "v"}, store=False, service_tier="auto")
    assert r.choices[0].finish_reason in ("stop", "length")


def test_grpc_json_schema_and_bad_schema(cluster):
    schema = SCHEMAS[3]

    async def main():
        async with grpc.aio.insecure_channel(cluster.router.address) as ch:
            stub = cluster.api(ch)
            params = common_pb2.SamplingParams(n=2, max_tokens=300, seed=5,
                                               json_schema=json.dumps(schema))
            chunks = [c async for c in stub.Generate(
                api_pb2.GenerateRequest(text="grpc", params=params), metadata=_auth())]
            bad = common_pb2.SamplingParams(max_tokens=4, json_schema='{"type": "bogus"}')
            with pytest.raises(grpc.aio.AioRpcError) as e:
                _ = [c async for c in stub.Generate(
                    api_pb2.GenerateRequest(text="grpc", params=bad), metadata=_auth())]
            return chunks, e.value

    chunks, err = asyncio.run(main())
    for i in (0, 1):
        mine = [c for c in chunks if c.index == i]
        assert mine[-1].finish_reason == "stop"
        jsonschema.validate(json.loads("".join(c.text for c in mine)), schema)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "response_format" in err.details() and "bogus" in err.details()


def _auth():
    return (("authorization", f"Bearer {API_KEY}"),)


def test_disaggregated_equals_offline_token_for_token(client, model, tiny_models):
    """Seeded samples do not depend on the worker: the stack's answer (first token sampled
    under the mask on the prefill worker, the matcher rebuilt from it on the decode worker) is
    the offline engine's, for each of n = 3 samples."""
    from tandem.engine.llm import LLM
    from tandem.engine.sampling_params import ResponseFormat, SamplingParams

    schema = SCHEMAS[3]
    offline = LLM(str(tiny_models["llama"]), progress=False, num_blocks=256)
    params = SamplingParams(n=3, max_tokens=300, temperature=1.0, seed=11,
                            response_format=ResponseFormat("json_schema", json.dumps(schema)))
    expected = [o.text for o in offline.generate(["same tokens:"], params)[0].outputs]
    r = client.completions.create(model=model, prompt="same tokens:", n=3, max_tokens=300,
                                  temperature=1.0, seed=11,
                                  extra_body={"response_format": _fmt(schema)})
    assert [c.text for c in r.choices] == expected
    assert len(set(expected)) == 3
