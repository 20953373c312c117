"""The OpenAI surface's checks and answers, in process (the HTTP app over a Frontend whose
workers are scripted): no field ignored at any level, max_tokens past the context refused,
the developer role, tools on a template that cannot show them, reasoning opened by the
template, tool calls to functions not offered, logprobs' bytes, and completions logprobs
without the tokens a stop string removed."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from surface_model import build_surface_model, tag_ids
from tandem.engine.demo import build_demo_checkpoint
from tandem.engine.sampling_params import Logprob, SamplingParams, TokenLogprobs
from tandem.engine.tokenizer import Tokenizer
from tandem.router_svc.chat_output import ChatChoice, ChatOutputSpec
from tandem.router_svc.frontend import Frontend, ModelInfo
from tandem.router_svc.http_api import build_app
from tandem.router_svc.worker_stream import SampleUpdate, Update
from tandem.router_svc.workers import WorkerSet

MAX_MODEL_LEN = 1024


class Scripted:
    """An orchestrator whose workers answer each request with the same steps."""

    def __init__(self) -> None:
        self.steps: list[list[tuple[list[int], str | None]]] = []  # per step: per sample
        self.with_logprobs = False
        self.seen: list[SamplingParams] = []
        self.prompts: list[list[int]] = []

    async def run(self, request_id, prompt, params, timeout, context):
        self.seen.append(params)
        self.prompts.append(prompt)
        for step in self.steps:
            samples = [SampleUpdate(i, ids, [_lp(t) if self.with_logprobs else None
                                             for t in ids], finish)
                       for i, (ids, finish) in enumerate(step)]
            yield Update(samples, len(prompt), 0)


def _lp(token: int) -> TokenLogprobs:
    return TokenLogprobs(Logprob(token, -0.5), ())


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fields")
    (root / "demo").mkdir()
    build_demo_checkpoint(root / "demo")
    return {"demo": root / "demo",
            "surface": build_surface_model(root / "demo", root / "surface")}


@pytest.fixture(scope="module")
def tokenizers(model_dirs):
    return {name: Tokenizer(d) for name, d in model_dirs.items()}


def call(tok: Tokenizer, path: str, body: dict, script: Scripted | None = None) -> httpx.Response:
    fe = Frontend(tok, orchestrator=script or Scripted(),
                  model=ModelInfo("m", "llama", MAX_MODEL_LEN, 512, "float32", 16))

    async def main():
        transport = httpx.ASGITransport(app=build_app(fe, WorkerSet([], [], [])))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post(path, json=body)

    return asyncio.run(main())


def refused(r: httpx.Response, param: str) -> str:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    return error["message"]


USER = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


# -- 11: no field silently ignored, at any level -------------------------------------------------
@pytest.mark.parametrize(("body", "param"), [
    ({"stream": True, "stream_options": {"include_usage": True, "bogus": 1}}, "stream_options"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": SCHEMA, "strictly": True}}}, "response_format.json_schema.strictly"),
    ({"response_format": {"type": "json_object", "schema": SCHEMA}}, "response_format.schema"),
    ({"messages": [{"role": "user", "content": "hi", "mood": "happy"}]}, "messages[0].mood"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "x": 1}]}]},
     "messages[0].content[0].x"),
    ({"tools": [{"type": "function", "function": {"name": "f"}, "extra": 1}]}, "tools[0].extra"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True,
                                                  "parameters": {"type": "object"},
                                                  "examples": []}}]},
     "tools[0].function.examples"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "f", "why": 1}}},
     "tool_choice.function.why"),
])
def test_a_field_this_server_would_ignore_is_refused_by_its_path(tokenizers, body, param):
    r = call(tokenizers["surface"], "/v1/chat/completions", {"messages": USER, **body})
    refused(r, param)


@pytest.mark.parametrize(("schema", "keyword"), [
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "string", "format": "date"}, "format"),
])
def test_a_strict_schema_is_enforced_or_refused_naming_the_keyword(tokenizers, schema, keyword):
    def body(strict):
        return {"messages": USER, "max_tokens": 8, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                   "strict": strict}}}

    assert keyword in refused(call(tokenizers["surface"], "/v1/chat/completions", body(True)),
                              "response_format")
    # strict false: the grammar enforces what it can (here, the type), as documented.
    assert call(tokenizers["surface"], "/v1/chat/completions", body(False)).status_code == 200


# -- 7: max_tokens past the context ----------------------------------------------------------
def test_max_tokens_past_the_context_is_refused_naming_the_field_and_limit(tokenizers):
    prompt = [5] * 1000  # 1000 tokens of 1024
    msg = refused(call(tokenizers["demo"], "/v1/completions",
                       {"prompt": prompt, "max_tokens": 25}), "max_tokens")
    assert "at most 24" in msg
    assert call(tokenizers["demo"], "/v1/completions",
                {"prompt": prompt, "max_tokens": 24}).status_code == 200
    refused(call(tokenizers["demo"], "/v1/chat/completions",
                 {"messages": USER, "max_completion_tokens": 10**6}), "max_completion_tokens")


# -- 8: the developer role -------------------------------------------------------------------
def test_the_developer_role_is_the_system_role(tokenizers):
    def ids(role):
        r = call(tokenizers["demo"], "/tokenize",
                 {"messages": [{"role": role, "content": "Be terse."}, *USER]})
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    assert ids("developer") == ids("system")
    r = call(tokenizers["demo"], "/v1/chat/completions",
             {"messages": [{"role": "developer", "content": "Be terse."}, *USER]})
    assert r.status_code == 200, r.text


# -- 10: tools on a template that cannot show them ---------------------------------------------
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def test_tools_a_template_cannot_show_are_shown_by_the_default_prompt(tokenizers):
    demo = tokenizers["demo"]
    r = call(demo, "/tokenize", {"messages": USER, "tools": [WEATHER]})
    text = demo.decode(r.json()["tokens"], skip_special_tokens=False)
    assert "get_weather" in text and "<tool_call>" in text
    # The surface model's own template shows them: no default prompt there.
    surface = tokenizers["surface"]
    r = call(surface, "/tokenize", {"messages": USER, "tools": [WEATHER]})
    text = surface.decode(r.json()["tokens"], skip_special_tokens=False)
    assert "get_weather" in text and "You may call functions" not in text
    # The answer is read in the syntax the default prompt asked for.
    script = Scripted()
    call_text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    script.steps = [[(list(call_text.encode()), "stop")]]
    r = call(demo, "/v1/chat/completions", {"messages": USER, "tools": [WEATHER]}, script)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


# -- 1: reasoning opened by the template, then the grammar --------------------------------------
def test_a_template_that_opens_reasoning_starts_the_grammar_after_it(tokenizers, model_dirs):
    surface = tokenizers["surface"]
    script = Scripted()
    end = tag_ids(model_dirs["surface"])["</think>"]
    script.steps = [[([*b"plan", end, *b'{"ok": true}'], "stop")]]
    body = {"messages": USER, "chat_template_kwargs": {"thinking": True},
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": SCHEMA}}}
    r = call(surface, "/v1/chat/completions", body, script)
    msg = r.json()["choices"][0]["message"]
    assert msg["reasoning_content"] == "plan" and json.loads(msg["content"]) == {"ok": True}
    assert script.seen[0].response_format.after == "</think>"
    # Not opened by the prompt: the grammar from the first token.
    call(surface, "/v1/chat/completions", {**body, "chat_template_kwargs": {}}, script)
    assert script.seen[1].response_format.after == ""
    # tool_choice required: the call after the reasoning, in tool_calls.
    script.steps = [[([*b"plan", end,
                       *b'[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'], "stop")]]
    r = call(surface, "/v1/chat/completions", {**body, "response_format": None,
                                                "tools": [WEATHER], "tool_choice": "required"},
             script)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning_content"]
    assert script.seen[2].response_format.after == "</think>"


# -- 4: tool_choice auto never calls a function not offered -------------------------------------
def test_auto_reads_a_call_to_a_function_not_offered_as_text():
    spec = ChatOutputSpec(tool_mode="auto", tool_family="llama3_json",
                          tool_names=frozenset({"get_weather"}))
    text = '{"name": "Alice", "parameters": {"age": 30}}'
    choice = ChatChoice(spec)
    streamed = choice.feed(text, []).content
    end = choice.finish()
    assert end.tool_calls == [] and streamed + end.content == text
    offered = ChatChoice(spec)
    offered.feed('{"name": "get_weather", "parameters": {"city": "Oslo"}}', [])
    assert [c.name for c in offered.finish().tool_calls] == ["get_weather"]


# -- 5: logprobs' bytes of byte tokens -----------------------------------------------------------
def test_chat_logprobs_bytes_rebuild_the_text_of_byte_tokens(tokenizers):
    script = Scripted()
    script.with_logprobs = True
    emoji = list("😀!".encode())  # the demo's ids are bytes: four tokens for one character
    script.steps = [[(emoji, "stop")]]
    r = call(tokenizers["demo"], "/v1/chat/completions",
             {"messages": USER, "logprobs": True}, script)
    choice = r.json()["choices"][0]
    entries = choice["logprobs"]["content"]
    assert [e["bytes"] for e in entries] == [[b] for b in emoji]
    assert bytes(b for e in entries for b in e["bytes"]).decode() == choice["message"]["content"]


# -- 6: completions logprobs of tokens a stop string removed -------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_completions_logprobs_leave_out_the_tokens_a_stop_string_removed(tokenizers, stream):
    script = Scripted()
    script.with_logprobs = True
    script.steps = [[(list(b"ab"), None)], [(list(b"c STOP de"), None)]]
    r = call(tokenizers["demo"], "/v1/completions",
             {"prompt": [5, 6], "max_tokens": 20, "logprobs": 0, "stop": ["STOP"],
              "stream": stream}, script)
    if stream:
        chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: {")]
        tokens = [t for c in chunks for t in (c["choices"][0]["logprobs"] or {}).get("tokens", [])]
        text = "".join(c["choices"][0]["text"] for c in chunks)
    else:
        choice = r.json()["choices"][0]
        tokens, text = choice["logprobs"]["tokens"], choice["text"]
    assert text == "abc " and tokens == ["a", "b", "c", " "]
    # With the stop string kept in the text, its tokens are kept too.
    r = call(tokenizers["demo"], "/v1/completions",
             {"prompt": [5, 6], "max_tokens": 20, "logprobs": 0, "stop": ["STOP"],
              "include_stop_str_in_output": True}, script)
    choice = r.json()["choices"][0]
    assert choice["text"] == "abc STOP" and "".join(choice["logprobs"]["tokens"]) == "abc STOP"


# -- 11 (continued): stream options and the service tier -----------------------------------------
def test_stream_options_and_service_tier_are_acted_on(tokenizers):
    script = Scripted()
    script.steps = [[(list(b"ab"), None)], [(list(b"c"), "length")]]
    r = call(tokenizers["demo"], "/v1/completions",
             {"prompt": [5, 6], "max_tokens": 3, "stream": True, "service_tier": "auto",
              "stream_options": {"continuous_usage_stats": True, "include_obfuscation": True}},
             script)
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert [c["usage"]["completion_tokens"] for c in chunks] == [2, 3]
    assert all(c["service_tier"] == "default" and c["obfuscation"] for c in chunks)
    r = call(tokenizers["demo"], "/v1/completions",
             {"prompt": [5, 6], "max_tokens": 3, "service_tier": "auto"}, script)
    assert r.json()["service_tier"] == "default"
    assert "service_tier" not in call(tokenizers["demo"], "/v1/completions",
                                      {"prompt": [5, 6], "max_tokens": 3}, script).json()


# -- prompt logprobs on a colocated worker's stream; structured outputs' spellings --------------
def test_prompt_logprobs_travel_with_a_colocated_workers_first_tokens():
    from tandem.decode_svc.outbox import Outbox
    from tandem.engine.sequence import SeqOutput
    from tandem.router_svc.worker_stream import _by_request

    lps = [TokenLogprobs(Logprob(2, -1.5), (Logprob(7, -0.5),)), _lp(3)]
    outbox = Outbox()
    outbox.tokens([SeqOutput("r", 0, [5], [None], None, 3, 0, 1, prompt_logprobs=lps),
                   SeqOutput("s", 0, [6], [None], None, 3, 0, 1)])
    msg = asyncio.run(outbox.take())
    got = dict(_by_request(msg))
    assert got["r"].prompt_logprobs == lps and got["s"].prompt_logprobs is None


@pytest.mark.parametrize(("body", "kind", "spec"), [
    ({"structured_outputs": {"regex": "a+"}}, "regex", "a+"),
    ({"guided_regex": "a+"}, "regex", "a+"),
    ({"structured_outputs": {"choice": ["x", "y"]}}, "choice", '["x", "y"]'),
    ({"guided_choice": ["x"]}, "choice", '["x"]'),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, "grammar", 'root ::= "a"'),
    ({"structured_outputs": {"json": {"type": "integer"}}}, "json_schema", '{"type": "integer"}'),
    ({"structured_outputs": {"json_object": True}}, "json_object", None),
])
def test_structured_output_spellings(tokenizers, body, kind, spec):
    script = Scripted()
    script.steps = [[(list(b"a"), "stop")]]
    r = call(tokenizers["demo"], "/v1/completions", {"prompt": [5], "max_tokens": 4, **body},
             script)
    assert r.status_code == 200, r.text
    fmt = script.seen[0].response_format
    assert (fmt.type, fmt.schema) == (kind, spec)


@pytest.mark.parametrize(("body", "param"), [
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs"),
])
def test_structured_output_refusals_name_the_field(tokenizers, body, param):
    refused(call(tokenizers["demo"], "/v1/completions",
                 {"prompt": [5], "max_tokens": 4, **body}), param)


# -- the Responses API ----------------------------------------------------------------------
def _events(text: str) -> list[dict]:
    out = []
    for block in text.strip().split("\n\n"):
        kind, data = block.split("\n", 1)
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        out.append(event)
    return out


def test_responses_text_turn_streamed_in_its_events(tokenizers):
    script = Scripted()
    script.steps = [[(list(b"Hel"), None)], [(list(b"lo"), "stop")]]
    r = call(tokenizers["demo"], "/v1/responses",
             {"input": "hi", "instructions": "Be brief.", "stream": True}, script)
    events = _events(r.text)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    done = events[-1]["response"]
    assert done["status"] == "completed" and done["instructions"] == "Be brief."
    assert done["output"][0]["content"][0]["text"] == "Hello"
    assert "".join(e.get("delta", "") for e in events) == "Hello"


def test_responses_function_calls_and_a_conversation_over_previous_response_id(tokenizers):
    surface = tokenizers["surface"]
    script = Scripted()
    script.steps = [[(list(b'[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'),
                      "stop")]]
    tool = {"type": "function", "name": "get_weather",
            "parameters": WEATHER["function"]["parameters"]}
    fe = Frontend(surface, orchestrator=script,
                  model=ModelInfo("m", "llama", MAX_MODEL_LEN, 512, "float32", 16))

    async def main():
        transport = httpx.ASGITransport(app=build_app(fe, WorkerSet([], [], [])))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            first = (await client.post("/v1/responses", json={
                "input": "weather?", "tools": [tool], "tool_choice": "required"})).json()
            call_item = first["output"][0]
            script.steps = [[(list(b"It is mild."), "stop")]]
            second = (await client.post("/v1/responses", json={
                "previous_response_id": first["id"], "tools": [tool],
                "input": [{"type": "function_call_output", "call_id": call_item["call_id"],
                           "output": "12 C"}]})).json()
            got = (await client.get(f"/v1/responses/{second['id']}")).json()
            missing = await client.post("/v1/responses", json={
                "input": "x", "previous_response_id": "resp_nope"})
            return first, second, got, missing

    first, second, got, missing = asyncio.run(main())
    assert first["output"][0]["type"] == "function_call"
    assert first["output"][0]["name"] == "get_weather"
    assert json.loads(first["output"][0]["arguments"]) == {"city": "Oslo"}
    assert second["output"][0]["content"][0]["text"] == "It is mild." and got == second
    # The second turn's prompt held the first turn, its call and the tool's answer.
    prompt = surface.decode(script.prompts[1], skip_special_tokens=False)
    assert "weather?" in prompt and "get_weather" in prompt and "12 C" in prompt
    assert missing.status_code == 400 and \
        missing.json()["error"]["param"] == "previous_response_id"


@pytest.mark.parametrize(("body", "param"), [
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0].type"),
    ({"max_output_tokens": 10**6}, "max_output_tokens"),
    ({"prompt_logprobs": 1}, "prompt_logprobs"),  # a response has no place for them
    ({"n": 2}, "n"),
])
def test_responses_refuse_what_they_do_not_serve_by_name(tokenizers, body, param):
    refused(call(tokenizers["demo"], "/v1/responses", {"input": "hi", **body}), param)
