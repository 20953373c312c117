"""What the HTTP API does with a request body before any framework code sees it, so hostile
input is cheap to refuse and every refusal is in OpenAI's error shape:

    Content-Length or bytes read > limit  → 413 (the rest is never read)
    not UTF-8                             → 400
    not JSON, or nested deeper than 64    → 400
    NaN / Infinity / a number that        → 400 naming the field (JSON has no such numbers;
      overflows a double                        Python's parser would accept them)
    a string with a lone surrogate        → 400 naming the field (it cannot be encoded)

A body that passes is handed on unchanged. Paths: every POST.

Before that, with API keys set, ApiKeyAuth answers 401 to a /v1 (or tokenize) request without
a valid `Authorization: Bearer <key>`, before a byte of the body is read.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

from router_svc.http_errors import ApiError
from runtime.security import ApiKeys

DEFAULT_MAX_BODY_BYTES = 8 << 20
MAX_JSON_DEPTH = 64


class BodyError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str = "invalid_value") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


class _NonFinite:
    def __init__(self, text: str) -> None:
        self.text = text


def _parse_float(text: str) -> float | _NonFinite:
    v = float(text)
    return v if math.isfinite(v) else _NonFinite(text)


def _path(parts: list[str | int]) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out


def _check_str(s: str, parts: list[str | int]) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise BodyError(400, f"{_path(parts) or 'body'}: contains a lone surrogate "
                        "(not valid Unicode)", _top(parts)) from None


def _top(parts: list[str | int]) -> str | None:
    return parts[0] if parts and isinstance(parts[0], str) else None


def check_json(body: bytes) -> Any:
    """The parsed body, or BodyError naming what is wrong (and where)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(400, f"the request body is not valid UTF-8 (byte {e.start})") from None
    try:
        doc = json.loads(text, parse_float=_parse_float, parse_constant=_NonFinite)
    except RecursionError:
        raise BodyError(400, f"the request body is nested too deeply (limit "
                        f"{MAX_JSON_DEPTH})") from None
    except ValueError as e:
        raise BodyError(400, f"the request body is not valid JSON: {e}") from None
    # Iterative walk: depth, non-finite numbers, unencodable strings (keys too).
    stack: list[tuple[Any, list[str | int]]] = [(doc, [])]
    while stack:
        node, parts = stack.pop()
        if len(parts) > MAX_JSON_DEPTH:
            raise BodyError(400, f"the request body is nested too deeply (limit "
                            f"{MAX_JSON_DEPTH})", _top(parts))
        if isinstance(node, _NonFinite):
            raise BodyError(400, f"{_path(parts) or 'body'}: must be a finite number, got "
                            f"{node.text}", _top(parts))
        if isinstance(node, str):
            _check_str(node, parts)
        elif isinstance(node, dict):
            for k, v in node.items():
                _check_str(k, parts)
                stack.append((v, [*parts, k]))
        elif isinstance(node, list):
            stack.extend((v, [*parts, i]) for i, v in enumerate(node))
    return doc


class BodyGuard:
    """ASGI middleware applying the checks above to every POST body, reading at most
    max_bytes. `respond(status, message, param, code)` builds the error response."""

    def __init__(self, app: Callable, max_bytes: int, respond: Callable[..., Any]) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.respond = respond

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        try:
            body = await self._read(scope, receive)
            if body is None:
                return  # the client left
            if body:
                check_json(body)
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
    """ASGI middleware: every /v1 path needs `Authorization: Bearer <key>` (security.ApiKeys:
    constant-time compare). Runs before the body is read, so an unauthenticated caller learns
    nothing about validation. The caller's tenant goes to the request's state."""

    def __init__(self, app: Callable, keys: ApiKeys,
                 on_refused: Callable[[dict], None] | None = None) -> None:
        self.app = app
        self.keys = keys
        self.on_refused = on_refused  # traces and logs a refusal (the HTTP API's)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        path = scope["path"] if scope["type"] == "http" else ""
        if path.startswith("/v1") or path in ("/tokenize", "/detokenize"):
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
