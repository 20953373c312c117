"""One mapping from what went wrong to what both public APIs answer, so a program can act on
an error without parsing its message.

    raised by the Frontend/router   gRPC status          HTTP  reason (ErrorInfo; HTTP code)
    InvalidArgument(field)          INVALID_ARGUMENT     400   INVALID_VALUE + the field
    ModelNotFound                   NOT_FOUND            404   MODEL_NOT_FOUND + "model"
    Overloaded                      RESOURCE_EXHAUSTED   429   RATE_LIMIT_EXCEEDED + retry delay
    RouterError(UNAVAILABLE)        UNAVAILABLE          503   UNAVAILABLE + retry delay
    RouterError(other code)         that code            ...   the code's name

gRPC sends it as a google.rpc.Status in the trailers (grpc-status-details-bin): ErrorInfo
(reason, domain "tandem"), BadRequest (field violations, the field as a path in the request
message: params.temperature, text, token_ids), RetryInfo. HTTP sends the OpenAI error body:
`code` is the reason in lower case, `param` the field under the endpoint's own name, and a
Retry-After header.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from tandem.errors import InvalidArgument, Overloaded
from tandem.router_svc.frontend import ModelNotFound
from tandem.router_svc.orchestrator import RouterError
from tandem.runtime.convert import FORMAT_ONEOF
from tandem.v1 import common_pb2

DOMAIN = "tandem"
RETRY_AFTER_S = 1

# gRPC status -> (HTTP status, OpenAI error type)
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}


@dataclass(frozen=True)
class Failure:
    """An error as both APIs report it. `field`: the engine's name of the bad field."""

    code: grpc.StatusCode
    reason: str
    message: str
    field: str | None = None
    retry_after_s: int | None = None

    @property
    def http_status(self) -> tuple[int, str]:
        return HTTP_STATUS.get(self.code, (500, "server_error"))


def failure_of(e: BaseException) -> Failure | None:
    """The Failure for an error the Frontend or the router raises on purpose; None for any
    other (a bug: the caller answers 500 / INTERNAL without details)."""
    if isinstance(e, InvalidArgument):
        return Failure(grpc.StatusCode.INVALID_ARGUMENT, "INVALID_VALUE", e.message, e.field)
    if isinstance(e, ModelNotFound):
        return Failure(grpc.StatusCode.NOT_FOUND, "MODEL_NOT_FOUND", str(e), "model")
    if isinstance(e, Overloaded):
        return Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, "RATE_LIMIT_EXCEEDED",
                       f"the server is at capacity, retry later ({e})",
                       retry_after_s=RETRY_AFTER_S)
    if isinstance(e, RouterError):
        retry = RETRY_AFTER_S if e.code in (grpc.StatusCode.UNAVAILABLE,
                                            grpc.StatusCode.RESOURCE_EXHAUSTED) else None
        return Failure(e.code, e.code.name, e.message, retry_after_s=retry)
    return None


# Engine field names -> paths in tandem.v1.GenerateRequest: every request parameter is
# params.<its proto field> (response_format: the member of that oneof the request set); the
# prompt is whichever of text / token_ids the request set.
_SAMPLING_FIELDS = frozenset(common_pb2.SamplingParams.DESCRIPTOR.fields_by_name)


def grpc_field(field: str, prompt_field: str = "prompt",
               format_field: str | None = None) -> str:
    if field == FORMAT_ONEOF:
        return f"params.{format_field or 'json_schema'}"
    if field in _SAMPLING_FIELDS:
        return f"params.{field}"
    return prompt_field if field == "prompt" else field


def grpc_status(f: Failure, field_path: str | None = None) -> grpc.Status:
    """A grpc.Status whose trailers carry the google.rpc.Status of `f`, the field under
    `field_path` (its path in the request). The message stays what the API has always sent
    ("prompt: must not be empty"): callers may show or match it."""
    field = field_path or f.field
    invalid = f.code == grpc.StatusCode.INVALID_ARGUMENT
    message = f"{f.field}: {f.message}" if f.field and invalid else f.message
    status = status_pb2.Status(code=f.code.value[0], message=message)
    info = error_details_pb2.ErrorInfo(reason=f.reason, domain=DOMAIN)
    if field:
        info.metadata["field"] = field
    status.details.add().Pack(info)
    if field and invalid:
        status.details.add().Pack(error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=field, description=f.message)]))
    if f.retry_after_s is not None:
        status.details.add().Pack(error_details_pb2.RetryInfo(
            retry_delay=duration_pb2.Duration(seconds=f.retry_after_s)))
    return rpc_status.to_status(status)


def end_call(context: grpc.aio.ServicerContext, f: Failure,
             field_path: str | None = None) -> None:
    """Set `f`'s status and details for the handler to return with: what abort sends, without
    the AbortError that tracing would record as an exception (twice, with the message only in
    its stack trace)."""
    status = grpc_status(f, field_path)
    md = tuple(status.trailing_metadata)
    if f.retry_after_s is not None:  # for callers that read plain metadata
        md += (("retry-after", str(f.retry_after_s)),)
    context.set_trailing_metadata(md)
    context.set_code(status.code)
    context.set_details(status.details)


async def abort(context: grpc.aio.ServicerContext, f: Failure,
                field_path: str | None = None) -> None:
    """End the call with `f`'s status and details (raises, as context.abort does)."""
    status = grpc_status(f, field_path)
    md = tuple(status.trailing_metadata)
    if f.retry_after_s is not None:  # for callers that read plain metadata
        md += (("retry-after", str(f.retry_after_s)),)
    await context.abort(status.code, status.details, md)
