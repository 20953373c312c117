"""The HTTP API's errors in OpenAI's shape, {"error": {"message", "type", "param", "code"}}:
the router's and the Frontend's errors mapped as the gRPC API maps them (api_errors.py), the
framework's own (unknown route, a body that does not validate), and fields refused by name."""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.router_svc import openai_requests as req
from tandem.router_svc.api_errors import failure_of

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An answer in OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.code, self.headers = code, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def api_error(e: Exception, names: dict[str, str] | None = None) -> ApiError:
    """The HTTP answer to an error the Frontend or the router raised, mapped as the gRPC API
    maps it (api_errors.failure_of). `names` maps engine field names to the OpenAI parameter
    names this endpoint uses (e.g. chat: logprobs->top_logprobs)."""
    if isinstance(e, ApiError):
        return e
    f = failure_of(e)
    if f is None:
        log.exception("unexpected error in the HTTP API", exc_info=e)
        return ApiError(500, f"internal error: {type(e).__name__}", "server_error")
    status, type_ = f.http_status
    param = (names or {}).get(f.field, f.field) if f.field else None
    message = f"{param}: {f.message}" if param and status == 400 else f.message
    headers = {"Retry-After": str(f.retry_after_s)} if f.retry_after_s is not None else None
    return ApiError(status, message, type_, param=param, code=f.reason.lower(), headers=headers)


def body_error(exc: Exception) -> ApiError:
    """A request-body error in OpenAI's shape, the first error's field as param."""
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = loc[0] if loc and not loc[0].isdigit() else None
    where = ".".join(loc)
    msg = first.get("msg", "invalid request body")
    return ApiError(400, f"{where}: {msg}" if where else msg, param=param,
                    code="invalid_value")


def error_response(status: int, message: str, param: str | None = None,
                    code: str | None = None) -> JSONResponse:
    return ApiError(status, message, param=param, code=code).response()


async def http_error(request: Request, exc: Exception) -> JSONResponse:
    """The framework's own errors (unknown route, wrong method, a body it cannot parse) in
    OpenAI's shape instead of {"detail": ...}."""
    assert isinstance(exc, StarletteHTTPException)
    type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return ApiError(exc.status_code, str(exc.detail), type_,
                    code=HTTPStatus(exc.status_code).phrase.lower().replace(" ", "_"),
                    headers=getattr(exc, "headers", None)).response()


async def internal_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error in the HTTP API", exc_info=exc)
    return ApiError(500, f"internal error: {type(exc).__name__}", "server_error").response()


def refuse(cond: object, param: str, message: str) -> None:
    if cond:
        raise ApiError(400, f"{param}: {message}", param=param, code="unsupported_value")


def refuse_unknown(body: req.CompletionRequest | req.ChatCompletionRequest) -> None:
    name = req.unknown_field(body)
    refuse(name is not None, name or "", "is not supported by this server")
