"""A Python client for Tandem's public gRPC API (tandem.v1.Tandem), blocking and asyncio.

    from tandem.client import Client, SamplingParams

    with Client("127.0.0.1:50051", api_key=None, timeout=60) as client:
        answer = client.generate("The capital of France is", max_tokens=16, temperature=0)
        print(answer.text, answer.usage)

Streams are iterators of Chunk; closing one cancels its call. Calls that fail raise
TandemError subclasses with what a program needs to act (InvalidArgumentError.field,
OverloadedError.retry_after, ...). UNAVAILABLE before any chunk is retried by gRPC itself
(RetryPolicy); after a chunk, never. TLS and mTLS: see ChannelConfig.
"""

from tandem.client.aio import AsyncClient, AsyncStream
from tandem.client.channel import ChannelConfig, RetryPolicy
from tandem.client.errors import (
    DeadlineExceededError,
    FieldViolation,
    InvalidArgumentError,
    NotFoundError,
    OverloadedError,
    PermissionDeniedError,
    TandemError,
    UnauthenticatedError,
    UnavailableError,
    error_from_rpc,
)
from tandem.client.sync import Client, Stream
from tandem.client.types import (
    Chunk,
    Completion,
    Logprob,
    ModelInfo,
    Sample,
    SamplingParams,
    TokenLogprobs,
    Usage,
)

__all__ = [
    "AsyncClient", "AsyncStream", "ChannelConfig", "Chunk", "Client", "Completion",
    "DeadlineExceededError", "FieldViolation", "InvalidArgumentError", "Logprob", "ModelInfo",
    "NotFoundError", "OverloadedError", "PermissionDeniedError", "RetryPolicy", "Sample",
    "SamplingParams", "Stream", "TandemError", "TokenLogprobs", "UnauthenticatedError",
    "UnavailableError", "Usage", "error_from_rpc",
]
