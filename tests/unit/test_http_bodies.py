"""Hostile HTTP requests cost the router little and hold up nobody: a body is read only from an
authenticated caller and only for a route that takes one; it is refused at the first item past
its field's limit, before it is parsed; a large body is checked off the event loop; a client
that never finishes sending its request is cut off. The HTTP app in process (and, for the
deadline, served by uvicorn on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading

import httpx
import pytest

import tandem.router_svc.http_guard as http_guard
from tandem.router_svc.frontend import Frontend, ModelInfo
from tandem.router_svc.http_api import HttpServer, build_app
from tandem.router_svc.json_body import MAX_ITEMS, BodyError, BodyLimits, check_json
from tandem.router_svc.openai_requests import MAX_TOOLS
from tandem.router_svc.workers import WorkerSet
from tandem.runtime.security import ApiKeys

MAX_MODEL_LEN = 64
KEY = "key-of-a-tenant"


def frontend() -> Frontend:
    return Frontend(None, orchestrator=None,
                    model=ModelInfo("m", "llama", MAX_MODEL_LEN, 512, "float32", 16))


def app(keys: ApiKeys | None = None):
    return build_app(frontend(), WorkerSet([], [], []), keys)


def asgi_call(app, method: str, path: str, body: bytes, headers=()) -> tuple[int, int]:
    """(status, how many times the app asked for the request's body)."""
    reads = 0
    sent: list[dict] = []

    async def receive():
        nonlocal reads
        reads += 1
        if reads == 1:
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client stays: nothing more comes

    async def send(msg):
        sent.append(msg)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "server": ("127.0.0.1", 8000),
             "client": ("127.0.0.1", 5000),
             "headers": [(b"content-length", str(len(body)).encode()), *headers]}
    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], reads


HOSTILE = b"[" + b",".join([b"0"] * 100_000) + b"]"


def test_an_unknown_path_is_answered_404_with_its_body_unread():
    for method, path in (("POST", "/nope"), ("PUT", "/v1/completions"),
                         ("POST", "/v1/nowhere")):
        status, reads = asgi_call(app(), method, path, HOSTILE)
        assert status in (404, 405) and reads == 0, (method, path, status)
    status, reads = asgi_call(app(), "POST", "/v1/completions", b'{"prompt": [1]}')
    assert reads == 1  # a route that takes a body does read it


def test_with_keys_a_body_is_read_only_from_an_authenticated_caller():
    keyed = app(ApiKeys([KEY]))
    auth = [(b"authorization", f"Bearer {KEY}".encode())]
    for path in ("/nope", "/v1/completions", "/tokenize", "/health"):
        assert asgi_call(keyed, "POST", path, HOSTILE) == (401, 0), path
    assert asgi_call(keyed, "POST", "/nope", HOSTILE, auth) == (404, 0)
    assert asgi_call(keyed, "GET", "/health", b"")[0] in (200, 503)  # probes carry no key
    assert asgi_call(keyed, "GET", "/nope", b"")[0] == 404
    assert asgi_call(keyed, "GET", "/v1/models", b"")[0] == 401


# -- limits, checked while the body is scanned ---------------------------------------------------
def test_a_body_is_refused_at_the_first_item_past_its_limit():
    """The items past the limit are not even JSON: a refusal that names the limit, not the
    syntax error further on, shows the scan stopped at the first item too many instead of
    reading (or parsing) the rest."""
    limits = BodyLimits({"logit_bias": 1024, "prompt": 64})
    bias = ", ".join(f'"{i}": 1' for i in range(1025))
    for body, param in ((f'{{"logit_bias": {{{bias}, garbage'.encode(), "logit_bias"),
                        (b'{"prompt": [' + b"1, " * 64 + b"not json", "prompt"),
                        (b'{"x": [' + b"0," * MAX_ITEMS + b"!", "x"),
                        (b"[" + b"0," * 300 + b"!", None)):
        with pytest.raises(BodyError) as e:
            check_json(body, limits)
        assert e.value.status == 400 and e.value.param == param, body[:40]
        assert "more than" in e.value.message
    with pytest.raises(BodyError) as e:  # the total, over fields each within their limits
        check_json(json.dumps({f"f{i}": list(range(100)) for i in range(20)}).encode(),
                   BodyLimits(total=1000))
    assert "in all" in e.value.message and e.value.param == "f9"  # 10 x 100 items
    # Within the limits, strings and all: parsed as JSON reads it.
    doc = {"prompt": list(range(64)), "s": 'a, [b] {c}: "d" \\', "n": [[], {}, [1, [2]]]}
    assert check_json(json.dumps(doc).encode(), limits) == doc


def test_an_unterminated_string_or_scalar_run_costs_one_pass():
    """Possessive patterns: an 8 MB string that never ends, or 8 MB of one bare word, is
    refused as malformed (a backtracking scan would take hours on either)."""
    for body in (b'{"prompt": "' + b"a" * (8 << 20), b"a" * (8 << 20)):
        with pytest.raises(BodyError) as e:
            check_json(body)
        assert "not valid JSON" in e.value.message


def test_limits_name_the_field():
    limits = {b: p for b, p in (
        (json.dumps({"prompt": [1] * (MAX_MODEL_LEN + 1)}), "prompt"),
        (json.dumps({"prompt": [[1] * (MAX_MODEL_LEN + 1)]}), "prompt"),
        (json.dumps({"messages": [{"role": "user", "content": "hi"}],
                     "tools": [{"type": "function", "function": {"name": f"f{i}"}}
                               for i in range(MAX_TOOLS + 1)]}), "tools"),
        (json.dumps({"prompt": [1], "logit_bias": {str(i): 1 for i in range(1025)}}),
         "logit_bias"),
        (json.dumps({"prompt": [1], "metadata": {str(i): 1 for i in range(MAX_ITEMS + 1)}}),
         "metadata"),
    )}
    for body, param in limits.items():
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = _post(app(), path, body.encode())
        assert r.status_code == 400, (param, r.text[:200])
        err = r.json()["error"]
        assert err["param"] == param and "more than" in err["message"], err


def _post(application, path: str, body: bytes) -> httpx.Response:
    async def main():
        transport = httpx.ASGITransport(app=application)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
            return await c.post(path, content=body,
                                headers={"content-type": "application/json"})
    return asyncio.run(main())


# -- a large body is checked off the event loop --------------------------------------------------
def test_another_caller_is_answered_while_a_large_body_is_checked(monkeypatch):
    """The check of a large body is held until released: meanwhile /health and /v1/models are
    answered, and the body's own answer (a 400 naming the field) comes after them."""
    entered, release = threading.Event(), threading.Event()
    real = http_guard.check_json

    def held(body, *args):
        entered.set()
        release.wait(10)  # bounded: checked on the loop, the test fails instead of hanging
        return real(body, *args)

    monkeypatch.setattr(http_guard, "check_json", held)
    big = json.dumps({"prompt": [0] * 1_000_000}).encode()
    assert len(big) > http_guard.INLINE_BYTES
    application = app()

    async def main():
        transport = httpx.ASGITransport(app=application)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            hostile = asyncio.create_task(client.post("/v1/completions", content=big))
            assert await asyncio.to_thread(entered.wait, 10)
            assert (await client.get("/health")).status_code in (200, 503)
            assert (await client.get("/v1/models")).status_code == 200
            assert not hostile.done()  # answered before the body's check ended
            release.set()
            r = await hostile
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"

    asyncio.run(main())


# -- a client that never finishes its request ----------------------------------------------------
def test_a_request_not_sent_in_time_is_cut_off():
    """uvicorn with the router's deadline (a short one here): a connection that sends part of
    its headers, or its headers and part of its body, is closed (with a 408 for the latter),
    while a whole request on another connection is answered."""
    async def main():
        server = HttpServer(frontend(), WorkerSet([], [], []), "127.0.0.1", 0,
                            read_timeout_s=0.5)
        port = await server.start()
        try:
            head_only = await _send(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            part_body = await _send(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                    b"Content-Type: application/json\r\n"
                                    b"Content-Length: 1000\r\n\r\n" + b'{"prompt": ')
            whole = await _send(port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n"
                                b"Connection: close\r\n\r\n")
        finally:
            await server.stop()
        return head_only, part_body, whole

    head_only, part_body, whole = asyncio.run(main())
    assert head_only == b""  # closed: nothing to answer without a request line
    assert part_body.startswith(b"HTTP/1.1 408")
    assert whole.startswith(b"HTTP/1.1 200")


async def _send(port: int, data: bytes) -> bytes:
    """Send `data`, then read until the server closes the connection (bounded at 60 s, far
    past the deadline: a server without one fails the test instead of hanging it)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), 60)
    except TimeoutError:
        return b"<still open>"
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()

