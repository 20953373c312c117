"""A cancelled server stream's status: two gRPC aio server interceptors, which
runtime/telemetry.py puts around opentelemetry-instrumentation-grpc's, so that a
server-streaming call its caller cancels ends with rpc.grpc.status_code CANCELLED on its
server span, not the OK the instrumentation records.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from typing import Any

from opentelemetry import trace
from opentelemetry.semconv._incubating.attributes.rpc_attributes import RPC_GRPC_STATUS_CODE
from opentelemetry.trace import Span

# The spans of this call, handed from the inner interceptor to the outer one.
_CALL_SPANS: contextvars.ContextVar[list[Span] | None] = contextvars.ContextVar(
    "tandem_call_spans", default=None)


def cancel_status_interceptors(filter_: Any = None) -> tuple[Any, Any]:
    """Two gRPC aio server interceptors to put around opentelemetry-instrumentation-grpc's
    (outer first, then the instrumentation's, then inner): a server-streaming call that its
    caller cancels ends with rpc.grpc.status_code CANCELLED (1) on its server span, not the OK
    the instrumentation records for a handler that never returned a status. gRPC ends such a
    call either by cancelling the handler mid-await (the inner one sees it, inside the span) or
    by closing the response generator at a yield (the outer one sees it, and closes the rest
    now rather than at garbage collection). The inner one hands the span to the outer one
    through a context variable."""
    import grpc  # noqa: PLC0415 - only services that trace need it

    def traced(handler: Any, details: Any) -> bool:
        """A server-streaming call the filter (if any) lets through."""
        return handler is not None and handler.response_streaming and (
            filter_ is None or filter_(details))

    def cancelled(spans: list[Span]) -> None:
        for span in spans:
            span.set_attribute(RPC_GRPC_STATUS_CODE, grpc.StatusCode.CANCELLED.value[0])

    class StreamWrapper(grpc.aio.ServerInterceptor):
        """Hands a traced call's handler on with its response stream wrapped: stream(behavior)
        returns the async generator function that runs the handler's behavior."""

        stream: Callable[[Any], Any]

        async def intercept_service(self, continuation, details):
            handler = await continuation(details)
            if not traced(handler, details):
                return handler
            make = (grpc.stream_stream_rpc_method_handler if handler.request_streaming
                    else grpc.unary_stream_rpc_method_handler)
            behavior = (handler.stream_stream if handler.request_streaming
                        else handler.unary_stream)
            return make(self.stream(behavior), request_deserializer=handler.request_deserializer,
                        response_serializer=handler.response_serializer)

    class Outer(StreamWrapper):
        @staticmethod
        def stream(behavior):
            async def run(request, context):
                spans: list[Span] = []
                _CALL_SPANS.set(spans)
                responses = behavior(request, context)
                try:
                    async for response in responses:
                        yield response
                except GeneratorExit:  # closed at a yield: the caller is gone
                    cancelled(spans)
                    raise
                finally:
                    await responses.aclose()
            return run

    class Inner(StreamWrapper):
        @staticmethod
        def stream(behavior):
            async def run(request, context):
                span = trace.get_current_span()  # the instrumentation's, for this call
                spans = _CALL_SPANS.get()
                if spans is not None:
                    spans.append(span)
                try:
                    async for response in behavior(request, context):
                        yield response
                except asyncio.CancelledError:  # cancelled mid-await
                    cancelled([span])
                    raise
            return run

    return Outer(), Inner()
