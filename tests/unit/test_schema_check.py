"""Structured-output schemas are checked in a process of their own, within a time budget: a
grammar bomb is refused with a 400 naming the field (response_format, or tools for a required
tool choice), while the router answers everyone else; verdicts are remembered. The HTTP app in
process over the demo model's tokenizer; real checker processes."""

from __future__ import annotations

import asyncio
import json
import sys

import httpx
import pytest

from tandem.engine.config import ModelConfig
from tandem.engine.demo import build_demo_checkpoint
from tandem.engine.sampling_params import ResponseFormat
from tandem.engine.tokenizer import Tokenizer
from tandem.errors import InvalidArgument
from tandem.router_svc import schema_check
from tandem.router_svc.frontend import Frontend, ModelInfo
from tandem.router_svc.http_api import build_app
from tandem.router_svc.schema_check import SchemaChecker
from tandem.router_svc.workers import WorkerSet

pytest.importorskip("xgrammar")

# Minutes to convert into a grammar (1,000 properties, each a pattern of up to 300 letters).
BOMB = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "[a-z]{1,300}"}
                                         for i in range(1000)}}
SMALL = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("demo")
    build_demo_checkpoint(d)
    return d


def checker(model_dir, budget_s: float) -> SchemaChecker:
    cfg = ModelConfig.from_dir(model_dir)
    return SchemaChecker(model_dir, cfg.vocab_size, cfg.eos_token_ids, budget_s=budget_s)


def app_with(model_dir, schemas: SchemaChecker):
    fe = Frontend(Tokenizer(model_dir), orchestrator=None,
                  model=ModelInfo("m", "llama", 1 << 17, 320, "float32", 16), schemas=schemas)
    return build_app(fe, WorkerSet([], [], []))


def fmt(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def test_a_grammar_bomb_is_checked_off_the_loop_while_others_are_answered(model_dir,
                                                                           monkeypatch):
    """Once the bomb is in the checker process (a budget far past the time it takes to answer
    anyone else), /v1/models and /health are answered, and the bomb is still unanswered after
    them. Closing the checker ends the check."""
    schemas = checker(model_dir, budget_s=600)
    sent = asyncio.Event()
    ask = schema_check._Checker.ask

    async def noted(self, schema):
        sent.set()
        return await ask(self, schema)

    monkeypatch.setattr(schema_check._Checker, "ask", noted)

    async def main():
        transport = httpx.ASGITransport(app=app_with(model_dir, schemas))
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            bomb = asyncio.create_task(client.post("/v1/completions", json={
                "prompt": [1, 2, 3], "max_tokens": 4, "response_format": fmt(BOMB)}))
            await asyncio.wait_for(sent.wait(), 180)  # the checker process starts first
            for _ in range(3):
                assert (await client.get("/v1/models")).status_code == 200
                assert (await client.get("/health")).status_code in (200, 503)
            assert not bomb.done()
            bomb.cancel()
            await schemas.close()
        return schemas.num_checked

    assert asyncio.run(main()) == 1


def test_past_its_budget_a_schema_is_refused_naming_the_field_and_remembered(model_dir):
    async def main():
        schemas = checker(model_dir, budget_s=1.0)
        application = app_with(model_dir, schemas)
        transport = httpx.ASGITransport(app=application)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            async def completion(schema: dict) -> httpx.Response:
                return await client.post("/v1/completions", json={
                    "prompt": [1, 2, 3], "max_tokens": 4, "response_format": fmt(schema)})
            # One checker process for these, then killed at the bomb's budget...
            with pytest.raises(InvalidArgument):  # the checker itself: xgrammar's reason
                await schemas.check(ResponseFormat("json_schema", json.dumps({"type": 7})))
            await schemas.check(ResponseFormat("json_schema", json.dumps(SMALL)))
            answers = [await completion({"type": "bogus"}), await completion(BOMB),
                       await completion(BOMB)]
            # ... and a new one for the tools: tool_choice "required" makes their grammar.
            tools = [{"type": "function", "function": {"name": "f", "parameters": BOMB}}]
            answers.append(await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "tools": tools, "tool_choice": "required"}))
            checked = schemas.num_checked
        await schemas.close()
        return answers, checked

    answers, checked = asyncio.run(main())
    params = [(r.status_code, r.json()["error"]["param"]) for r in answers]
    assert params == [(400, "response_format")] * 3 + [(400, "tools")], \
        [r.text[:200] for r in answers]
    bogus, bomb, again, tools = (r.json()["error"]["message"] for r in answers)
    assert "bogus" in bogus
    assert "longer than 1 s" in bomb and again == bomb and "longer than 1 s" in tools
    assert checked == 5  # two schemas, the bogus one, the bomb once (then remembered), the tools


def test_a_checker_that_does_not_start_answers_unavailable_and_nothing_is_remembered(model_dir):
    """The checker process answers something else than ready (a broken install, say): the
    request gets 503 naming the schema checker, not a 500 or a verdict on the schema; the same
    schema is checked again once a checker starts."""
    schemas = checker(model_dir, budget_s=60.0)
    argv, schemas.argv = schemas.argv, [sys.executable, "-c", "print('no')"]

    async def main():
        transport = httpx.ASGITransport(app=app_with(model_dir, schemas))
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            async def completion() -> httpx.Response:
                return await client.post("/v1/completions", json={
                    "prompt": [1, 2, 3], "max_tokens": 4, "response_format": fmt({"type": "bogus"})})
            first = await completion()
            schemas.argv = argv
            second = await completion()
        await schemas.close()
        return first, second

    first, second = asyncio.run(main())
    assert first.status_code == 503, first.text
    assert "the schema checker did not start" in first.json()["error"]["message"]
    assert second.status_code == 400 and "bogus" in second.json()["error"]["message"]
    assert schemas.num_checked == 1
