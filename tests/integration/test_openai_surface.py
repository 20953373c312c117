"""The OpenAI surface end to end, through the `openai` client and tandem.client, over the
disaggregated stack (router, prefill and decode workers as processes on 127.0.0.1, shm): a
reasoning section the template opens before a grammar, max_tokens past the context, the
developer role, prompt logprobs and echo with logprobs, several prompts in one request,
structured outputs beyond JSON, tool-call arguments streamed as deltas, usage in every chunk,
/version. The model is tiny and random (tests/surface_model.py: a chat template that opens
<think> on request and shows tools): only a grammar or logit_bias makes its text mean anything.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from cluster import WORKER_ARGS, Cluster, serve
from surface_model import build_surface_model, tag_ids
from tandem import client as tc
from tandem.engine.llm import LLM
from tandem.engine.sampling_params import SamplingParams

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
USER = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def model_dir(tiny_models, tmp_path_factory) -> Path:
    return build_surface_model(tiny_models["llama"], tmp_path_factory.mktemp("surface") / "m")


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    yield from serve(Cluster(tmp_path_factory.mktemp("surface-stack"), str(model_dir),
                             worker_args=WORKER_ARGS))


@pytest.fixture(scope="module")
def model(cluster) -> str:
    return Path(cluster.model).name


@pytest.fixture(scope="module")
def base_url(cluster) -> str:
    return f"http://127.0.0.1:{cluster.router.http_port}"


@pytest.fixture(scope="module")
def client(base_url):
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0,
                       timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def grpc_client(cluster):
    with tc.Client(cluster.router.address, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def offline(model_dir):
    llm = LLM(str(model_dir), progress=False, num_blocks=256)
    yield llm
    llm.shutdown()


@pytest.fixture(autouse=True)
def idle_after(cluster):
    yield
    asyncio.run(cluster.wait_idle())


# -- the bugs, end to end ------------------------------------------------------------------------
def test_a_reasoning_section_the_template_opens_comes_before_the_grammar(client, model,
                                                                         model_dir):
    """The grammar applies after </think> (biased to come first): the JSON is the content and
    the tool call a tool call, not reasoning_content."""
    end = str(tag_ids(model_dir)["</think>"])
    thinking = {"chat_template_kwargs": {"thinking": True}}
    for stream in (False, True):
        kw = dict(model=model, messages=USER, max_tokens=60, temperature=0,
                  logit_bias={end: 100}, extra_body=thinking)
        if stream:
            chunks = list(client.chat.completions.create(
                **kw, stream=True, response_format={
                    "type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}))
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            r = client.chat.completions.create(**kw, response_format={
                "type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}})
            content = r.choices[0].message.content
        jsonschema.validate(json.loads(content), SCHEMA)
    r = client.chat.completions.create(model=model, messages=USER, max_tokens=200,
                                       temperature=0, logit_bias={end: 100}, tools=TOOLS,
                                       tool_choice="required", parallel_tool_calls=False,
                                       extra_body=thinking)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), WEATHER)


def test_max_tokens_past_the_context_is_refused_on_both_apis(client, model, grpc_client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=[5] * 1000, max_tokens=100)
    assert e.value.body["param"] == "max_tokens" and "at most 24" in e.value.body["message"]
    with pytest.raises(tc.InvalidArgumentError) as g:
        grpc_client.generate([5] * 1000, max_tokens=100_000)
    assert g.value.field == "params.max_tokens"


def test_the_developer_role(client, model):
    r = client.chat.completions.create(model=model, max_tokens=3, messages=[
        {"role": "developer", "content": "Be terse."}, *USER])
    assert r.choices[0].finish_reason in ("stop", "length")


# -- prompt logprobs, echo with logprobs ---------------------------------------------------------
PROMPT = [(11 * i) % 250 + 3 for i in range(40)]


def test_prompt_logprobs_match_the_engine_over_both_apis(client, model, grpc_client, offline):
    expected = offline.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0,
                                                         prompt_logprobs=2))[0].prompt_logprobs
    assert len(expected) == len(PROMPT) - 1
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    got = r.choices[0].model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == len(PROMPT)
    for tok, entry, exp in zip(PROMPT[1:], got[1:], expected, strict=True):
        assert entry[str(tok)]["logprob"] == pytest.approx(exp.sampled.logprob, abs=1e-4)
        assert {int(k) for k in entry} == {tok, *(t.token_id for t in exp.top)}
    # A second time the prompt is cached: still every position's logits.
    again = grpc_client.generate(PROMPT, max_tokens=2, temperature=0, prompt_logprobs=0)
    assert [lp.sampled.logprob for lp in again.prompt_logprobs] == pytest.approx(
        [lp.sampled.logprob for lp in expected], abs=1e-4)
    chat = client.chat.completions.create(model=model, messages=USER, max_tokens=2,
                                          extra_body={"prompt_logprobs": 0})
    assert chat.model_extra["prompt_logprobs"][0] is None


def test_echo_with_logprobs_lists_the_prompt_tokens_first(client, model):
    plain = client.completions.create(model=model, prompt="Echo me", max_tokens=4,
                                      temperature=0, logprobs=1,
                                      extra_body={"ignore_eos": True})
    r = client.completions.create(model=model, prompt="Echo me", max_tokens=4, temperature=0,
                                  logprobs=1, echo=True, extra_body={"ignore_eos": True})
    lp, base = r.choices[0].logprobs, plain.choices[0].logprobs
    n = len(lp.tokens) - len(base.tokens)
    assert r.choices[0].text == "Echo me" + plain.choices[0].text
    assert "".join(lp.tokens[:n]).endswith("Echo me") and lp.token_logprobs[0] is None
    assert all(isinstance(x, float) for x in lp.token_logprobs[1:])
    # (the prompt is computed whole with prompt logprobs: the same numbers, to rounding)
    assert lp.tokens[n:] == base.tokens
    assert lp.token_logprobs[n:] == pytest.approx(base.token_logprobs, abs=1e-4)
    assert lp.text_offset[n] == len("Echo me")
    chunks = list(client.completions.create(model=model, prompt="Echo me", max_tokens=4,
                                            temperature=0, logprobs=1, echo=True, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    assert [t for c in chunks for t in (c.choices[0].logprobs.tokens if c.choices[0].logprobs
                                        else [])] == lp.tokens


# -- several prompts in one request --------------------------------------------------------------
def test_a_list_of_prompts_is_one_request_over_both_apis(client, model, grpc_client):
    prompts = ["one", "two two", "three three three"]
    singles = [client.completions.create(model=model, prompt=p, max_tokens=5, temperature=0,
                                         extra_body={"ignore_eos": True}) for p in prompts]
    r = client.completions.create(model=model, prompt=prompts, max_tokens=5, temperature=0,
                                  n=2, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == list(range(6))
    for i, single in enumerate(singles):
        assert [r.choices[2 * i + j].text for j in (0, 1)] == [single.choices[0].text] * 2
    assert r.usage.completion_tokens == 30
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    chunks = list(client.completions.create(model=model, prompt=prompts, max_tokens=5,
                                            temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))
    for i, single in enumerate(singles):
        assert "".join(c.choices[0].text for c in chunks if c.choices[0].index == i) == \
            single.choices[0].text
    out = grpc_client.generate(prompts, max_tokens=5, temperature=0, ignore_eos=True,
                               prompt_logprobs=0)
    assert [s.text for s in out.samples] == [s.choices[0].text for s in singles]
    # Each prompt's logprobs, on its first sample.
    assert [len(s.prompt_logprobs) for s in out.samples] == \
        [s.usage.prompt_tokens - 1 for s in singles]
    with pytest.raises(openai.BadRequestError) as e:  # one bad prompt refuses them all
        client.completions.create(model=model, prompt=[[1, 2], [99999]], max_tokens=2)
    assert e.value.body["param"] == "prompt"


# -- structured outputs beyond JSON --------------------------------------------------------------
def test_regex_choice_grammar_and_structural_tag_over_both_apis(client, model, grpc_client):
    def text(**extra):
        r = client.completions.create(model=model, prompt="x", max_tokens=40, seed=1,
                                      extra_body=extra)
        assert r.choices[0].finish_reason == "stop", r
        return r.choices[0].text

    assert re.fullmatch(r"[a-c]{2,4}-\d\d", text(structured_outputs={"regex": r"[a-c]{2,4}-\d\d"}))
    assert re.fullmatch(r"[a-c]{2,4}-\d\d", text(guided_regex=r"[a-c]{2,4}-\d\d"))
    assert text(structured_outputs={"choice": ["red", "green", "blue"]}) in \
        ("red", "green", "blue")
    assert text(guided_choice=["yes", "no"]) in ("yes", "no")
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9]'
    assert re.fullmatch(r"\([1-9](\+[1-9])*\)", text(structured_outputs={"grammar": grammar}))
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<answer>",
                                                "content": {"type": "json_schema",
                                                            "json_schema": SCHEMA},
                                                "end": "</answer>"}}
    r = client.chat.completions.create(model=model, messages=USER, max_tokens=60,
                                       response_format=tag)
    body = r.choices[0].message.content
    assert body.startswith("<answer>") and body.endswith("</answer>")
    jsonschema.validate(json.loads(body[len("<answer>"):-len("</answer>")]), SCHEMA)
    # gRPC: the same kinds, as params fields.
    out = grpc_client.generate("x", max_tokens=40, seed=2, regex=r"[a-c]{2,4}-\d\d")
    assert re.fullmatch(r"[a-c]{2,4}-\d\d", out.text)
    assert grpc_client.generate("x", max_tokens=20, choice=["up", "down"]).text in ("up", "down")
    assert re.fullmatch(r"\([1-9](\+[1-9])*\)",
                        grpc_client.generate("x", max_tokens=40, seed=3, grammar=grammar).text)
    body = grpc_client.generate("x", max_tokens=60, seed=4, structural_tag=tag).text
    assert body.startswith("<answer>") and body.endswith("</answer>")
    jsonschema.validate(json.loads(body[len("<answer>"):-len("</answer>")]), SCHEMA)
    with pytest.raises(tc.InvalidArgumentError) as e:
        grpc_client.generate("x", max_tokens=4, regex="(unclosed")
    assert e.value.field == "params.regex"


# -- tool calls streamed, usage in every chunk, /version ----------------------------------------
def test_tool_call_arguments_stream_as_deltas(client, model):
    chunks = list(client.chat.completions.create(
        model=model, messages=USER, tools=TOOLS, tool_choice="required", max_tokens=200,
        parallel_tool_calls=False, stream=True, seed=3))
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].id and calls[0].function.name == "get_weather"
    assert calls[0].function.arguments == "" and len(calls) > 3
    args = "".join(c.function.arguments or "" for c in calls)
    jsonschema.validate(json.loads(args), WEATHER)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_continuous_usage_stats_service_tier_and_version(client, model, base_url,
                                                          grpc_client):
    chunks = list(client.completions.create(
        model=model, prompt="hi", max_tokens=5, stream=True,
        extra_body={"ignore_eos": True, "service_tier": "auto"},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 5 and len(counts) > 1
    assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].choices == []
    assert all(c.service_tier == "default" for c in chunks)
    version = httpx.get(f"{base_url}/version").json()["version"]
    assert version and grpc_client.version() == version


# -- the Responses API ----------------------------------------------------------------------
def test_responses_text_turns_stream_and_continue(client, model):
    r = client.responses.create(model=model, input="hello", instructions="Be brief.",
                                max_output_tokens=8, temperature=0,
                                extra_body={"ignore_eos": True})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text and r.usage.output_tokens == 8 and r.instructions == "Be brief."
    events = list(client.responses.create(model=model, input="hello", max_output_tokens=8,
                                          temperature=0, stream=True,
                                          extra_body={"ignore_eos": True}))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete" and "response.output_text.delta" in kinds
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text
    # The next turn continues the stored conversation: its prompt holds the first.
    again = client.responses.create(model=model, input="and then?", max_output_tokens=4,
                                    previous_response_id=r.id)
    assert again.previous_response_id == r.id
    assert again.usage.input_tokens > r.usage.input_tokens + r.usage.output_tokens
    assert client.responses.retrieve(again.id).id == again.id
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, input="x", previous_response_id="resp_none")
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, input="x", reasoning={"effort": "high"})
    assert e.value.body["param"] == "reasoning"


def test_responses_function_tool_turn(client, model):
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER}
    r = client.responses.create(model=model, input="weather in Oslo?", tools=[tool],
                                tool_choice="required", parallel_tool_calls=False,
                                max_output_tokens=200, temperature=0)
    (call,) = [o for o in r.output if o.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    events = list(client.responses.create(model=model, input="weather in Oslo?", tools=[tool],
                                          tool_choice="required", parallel_tool_calls=False,
                                          max_output_tokens=200, temperature=0, stream=True))
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert len(deltas) > 1 and "".join(deltas) == done.arguments == call.arguments
    # The tool's answer, in the next turn.
    follow = client.responses.create(
        model=model, previous_response_id=r.id, max_output_tokens=4, tools=[tool],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "12 C"}])
    assert follow.status in ("completed", "incomplete")
