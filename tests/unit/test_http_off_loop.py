"""Tokenizing runs off the router's event loop: while one caller's text is being tokenized,
another caller is answered. The HTTP app in process, with a tokenizer that blocks until told."""

from __future__ import annotations

import asyncio
import threading

import httpx

from tandem.router_svc.frontend import Frontend, ModelInfo
from tandem.router_svc.http_api import build_app
from tandem.router_svc.workers import WorkerSet


class _BlockingTokenizer:
    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def max_token_chars(self) -> int:
        return 8

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.entered.set()
        self.release.wait(10)  # bounded: without the fix the test fails instead of hanging
        return [1, 2, 3]


def test_another_caller_is_served_while_a_prompt_is_tokenized():
    tok = _BlockingTokenizer()
    fe = Frontend(tok, orchestrator=None, model=ModelInfo("m", "llama", 64, 512, "float32", 16))
    app = build_app(fe, WorkerSet([], [], []))

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            slow = asyncio.create_task(client.post("/tokenize", json={"prompt": "hello"}))
            assert await asyncio.to_thread(tok.entered.wait, 10)
            models = await client.get("/v1/models")  # answered while the tokenizer is busy
            assert models.status_code == 200
            assert not slow.done()
            tok.release.set()
            assert (await slow).json()["tokens"] == [1, 2, 3]
            # Longer than 64 tokens of at most 8 characters: refused without tokenizing.
            tok.entered.clear()
            r = await client.post("/tokenize", json={"prompt": "x" * (64 * 8 + 1)})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
            assert not tok.entered.is_set()

    asyncio.run(main())


def test_a_long_prompts_hashing_and_checks_run_off_the_loop():
    """Work in proportion to a prompt (its block hashes for routing, the check of every token
    id) runs in a worker thread once the prompt is long (OFF_LOOP_TOKENS), on the loop below."""
    from tandem.engine.sampling_params import SamplingParams
    from tandem.router_svc.workers import OFF_LOOP_TOKENS

    ws = WorkerSet([], [], [])
    fe = Frontend(None, orchestrator=None, model=ModelInfo("m", "llama", 1 << 20, 512,
                                                             "float32", 16))
    threads: list[tuple[str, int, int]] = []
    hashes, validate = ws.prefix_hashes, fe.validate

    def hashing(prompt, salt=""):
        threads.append(("hash", len(prompt), threading.get_ident()))
        return hashes(prompt, salt)

    def checking(prompt, params):
        threads.append(("check", len(prompt), threading.get_ident()))
        return validate(prompt, params)

    ws.prefix_hashes, fe.validate = hashing, checking

    async def main() -> int:
        for n in (OFF_LOOP_TOKENS - 1, OFF_LOOP_TOKENS):
            assert len(await ws.prompt_hashes([1] * n)) == n // 16
            await fe.check([1] * n, SamplingParams(max_tokens=4))
        return threading.get_ident()

    loop_thread = asyncio.run(main())
    short, long = OFF_LOOP_TOKENS - 1, OFF_LOOP_TOKENS
    assert [(what, n, t == loop_thread) for what, n, t in threads] == [
        ("hash", short, True), ("check", short, True),
        ("hash", long, False), ("check", long, False)]
