"""Typed exceptions for the statuses the Tandem API answers with.

The server puts a google.rpc.Status in each error's trailers (`grpc-status-details-bin`) with:
  - ErrorInfo: a stable `reason` (INVALID_VALUE, MODEL_NOT_FOUND, RATE_LIMIT_EXCEEDED,
    UNAVAILABLE, DEADLINE_EXCEEDED, ...), domain "tandem";
  - BadRequest: the field violations of an INVALID_ARGUMENT (`field` as a path in the request:
    params.temperature, text, token_ids, model);
  - RetryInfo: when to try again (RESOURCE_EXHAUSTED, UNAVAILABLE).
Branch on the exception class and these attributes, never on the message text.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

DOMAIN = "tandem"


@dataclass(frozen=True)
class FieldViolation:
    field: str  # a path in the request message, e.g. "params.max_tokens"
    description: str


class TandemError(Exception):
    """A call failed. `code`: the gRPC status; `reason`: ErrorInfo's reason when the server
    sent one; `retry_after`: seconds to wait before retrying, when the server said so."""

    def __init__(self, code: grpc.StatusCode, message: str, *, reason: str | None = None,
                 metadata: dict[str, str] | None = None, retry_after: float | None = None,
                 violations: tuple[FieldViolation, ...] = ()) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.reason = reason
        self.metadata = metadata or {}
        self.retry_after = retry_after
        self.violations = violations


class InvalidArgumentError(TandemError):
    """The request was refused before any work; `field` names the first bad field."""

    @property
    def field(self) -> str | None:
        return self.violations[0].field if self.violations else None


class NotFoundError(TandemError):
    """E.g. a model that is not served (reason MODEL_NOT_FOUND)."""


class OverloadedError(TandemError):
    """RESOURCE_EXHAUSTED: the server is at capacity; retry after `retry_after` seconds."""


class UnavailableError(TandemError):
    """No worker could serve it, or a worker failed mid-stream. The client already retried
    what was safe (UNAVAILABLE before any chunk); after chunks arrived it never retries."""


class DeadlineExceededError(TandemError):
    """The call's deadline passed (chunks already yielded stay valid)."""


class UnauthenticatedError(TandemError):
    """Missing or wrong API key."""


class PermissionDeniedError(TandemError):
    pass


_BY_CODE: dict[grpc.StatusCode, type[TandemError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: OverloadedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
}


def _rich_status(e: grpc.RpcError) -> status_pb2.Status | None:
    try:
        return rpc_status.from_call(e)  # type: ignore[arg-type]
    except (ValueError, AttributeError):  # inconsistent or missing: the plain status stands
        return None


def error_from_rpc(e: grpc.RpcError) -> TandemError:
    """The typed exception for a failed call (sync grpc.RpcError or grpc.aio.AioRpcError)."""
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN  # type: ignore[attr-defined]
    message = (e.details() if hasattr(e, "details") else None) or str(e)  # type: ignore[attr-defined]
    reason, metadata, retry_after = None, {}, None
    violations: list[FieldViolation] = []
    status = _rich_status(e)
    for any_ in status.details if status is not None else ():
        if any_.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            any_.Unpack(info)
            reason, metadata = info.reason, dict(info.metadata)
        elif any_.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            any_.Unpack(bad)
            violations += [FieldViolation(v.field, v.description) for v in bad.field_violations]
        elif any_.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            any_.Unpack(info)
            retry_after = info.retry_delay.ToTimedelta().total_seconds()
    if retry_after is None:  # servers without RetryInfo may still say so in plain metadata
        md = dict(e.trailing_metadata() or ()) if hasattr(e, "trailing_metadata") else {}
        value = md.get("retry-after")
        if value is not None:
            with contextlib.suppress(ValueError):
                retry_after = float(value)
    cls = _BY_CODE.get(code, TandemError)
    return cls(code, message, reason=reason, metadata=metadata, retry_after=retry_after,
               violations=tuple(violations))
