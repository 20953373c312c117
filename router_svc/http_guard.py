"""What the HTTP API does with a request before any framework code sees it, so hostile input
is cheap to refuse and every refusal is in OpenAI's error shape.

ApiKeyAuth, first, with API keys set: 401 without a valid `Authorization: Bearer <key>` on
/v1, /tokenize and /detokenize, and on every request whose method may carry a body (POST, PUT,
...), whatever its path: a body is read only from an authenticated caller.

BodyGuard, then, for a POST to a route that takes a body (any other request goes on unread, so
an unknown path is answered 404 with its body never read):

    Content-Length or bytes read > limit  → 413 (the rest is never read)
    not UTF-8, not JSON                   → 400
    an array or object past its limit,    → 400 naming the field (json_body.py: the limits are
      nesting deeper than 64, NaN,              checked while the body is scanned, before it is
      Infinity, a lone surrogate                parsed)

A body larger than INLINE_BYTES is scanned and parsed on a thread of the guard's own, never on
the event loop that serves every other client. A body that passes is handed on unchanged.
How long a client may take to send its request is bounded by the server (http_api:
RequestDeadline), not here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tandem.router_svc.http_errors import ApiError
from tandem.router_svc.json_body import BodyError, BodyLimits, check_json
from tandem.runtime.security import ApiKeys

DEFAULT_MAX_BODY_BYTES = 8 << 20
DEFAULT_READ_TIMEOUT_S = 30.0  # to send a whole request, from its first byte
# Bodies up to this size are checked on the event loop (well under a millisecond); larger ones
# on the guard's threads.
INLINE_BYTES = 64 << 10
BODY_THREADS = 2
# Methods that carry no body: the only ones an unauthenticated caller may use, off /v1.
_BODILESS = frozenset({"GET", "HEAD", "OPTIONS"})


class BodyGuard:
    """ASGI middleware applying the checks above to the body of a request `takes_body(scope)`
    says a route reads, reading at most max_bytes. `respond(status, message, param, code)`
    builds the error response."""

    def __init__(self, app: Callable, max_bytes: int, respond: Callable[..., Any],
                 takes_body: Callable[[dict], bool], limits: BodyLimits | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.respond = respond
        self.takes_body = takes_body
        self.limits = limits or BodyLimits()
        # Its own threads: bodies being checked never hold up the tokenizer's (the default
        # executor), and at most BODY_THREADS at a time compete with the event loop for the CPU.
        self._threads = ThreadPoolExecutor(BODY_THREADS, thread_name_prefix="http-body")

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or not self.takes_body(scope):
            await self.app(scope, receive, send)
            return
        try:
            body = await self._read(scope, receive)
            if body is None:
                return  # the client left
            if len(body) > INLINE_BYTES:
                await asyncio.get_running_loop().run_in_executor(
                    self._threads, check_json, body, self.limits)
            elif body:
                check_json(body, self.limits)
        except BodyError as e:
            await self.respond(e.status, e.message, e.param, e.code)(scope, receive, send)
            return
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read(self, scope: dict, receive: Callable) -> bytes | None:
        too_big = BodyError(413, f"the request body is larger than {self.max_bytes} bytes "
                            "(the router's --max-body-bytes)", code="request_too_large")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                raise BodyError(400, "Content-Length is not a number") from None
            if declared > self.max_bytes:
                raise too_big
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return None
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise too_big
            chunks.append(chunk)
            if not msg.get("more_body"):
                return b"".join(chunks)


class ApiKeyAuth:
    """ASGI middleware: `Authorization: Bearer <key>` (security.ApiKeys: constant-time compare)
    on every /v1 path, /tokenize and /detokenize, and on every request whose method may carry
    a body, whatever its path. Runs before a byte of the body is read, so an unauthenticated
    caller costs nothing and learns nothing about validation. Bodiless requests elsewhere
    (/health, /metrics, an unknown path's 404) stay open. The caller's tenant goes to the
    request's state."""

    def __init__(self, app: Callable, keys: ApiKeys,
                 on_refused: Callable[[dict], None] | None = None) -> None:
        self.app = app
        self.keys = keys
        self.on_refused = on_refused  # traces and logs a refusal (the HTTP API's)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and _needs_key(scope):
            tenant = self.keys.tenant(dict(scope["headers"]).get(b"authorization", b""))
            if tenant is None:
                if self.on_refused is not None:
                    self.on_refused(scope)
                resp = ApiError(401, "missing or incorrect API key", code="invalid_api_key",
                                headers={"WWW-Authenticate": "Bearer"}).response()
                await resp(scope, receive, send)
                return
            scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)


def _needs_key(scope: dict) -> bool:
    path = scope["path"]
    return (scope["method"] not in _BODILESS or path.startswith("/v1")
            or path in ("/tokenize", "/detokenize"))
