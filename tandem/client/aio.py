"""The asyncio client: the same calls as Client, awaited.

    from tandem.client import AsyncClient

    async with AsyncClient("127.0.0.1:50051") as client:
        async with client.stream("Hello", max_tokens=32) as chunks:
            async for chunk in chunks:
                print(chunk.text, end="")
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import grpc

from tandem.client.channel import ChannelConfig
from tandem.client.errors import error_from_rpc
from tandem.client.types import (
    Chunk,
    Collector,
    Completion,
    ModelInfo,
    Prompt,
    SamplingParams,
    chunk_from_proto,
    generate_request,
    model_from_proto,
    params_with,
    tokenize_request,
)
from tandem.v1 import api_pb2, api_pb2_grpc


class AsyncStream(AsyncIterator[Chunk]):
    """The chunks of one Generate call. aclose() (or leaving its `async with`, or cancelling
    the task that reads it) cancels the call."""

    def __init__(self, call: grpc.aio.UnaryStreamCall) -> None:
        self._call = call

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> Chunk:
        try:
            resp = await self._call.read()
        except grpc.aio.AioRpcError as e:
            raise error_from_rpc(e) from None
        except asyncio.CancelledError:
            self._call.cancel()
            raise
        if resp is grpc.aio.EOF:
            raise StopAsyncIteration
        return chunk_from_proto(resp)

    async def aclose(self) -> None:
        self._call.cancel()

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class AsyncClient:
    """See Client: the same arguments. Create it inside the event loop that uses it."""

    def __init__(self, target: str = "127.0.0.1:50051", *, timeout: float | None = None,
                 **config: Any) -> None:
        self.config = ChannelConfig(target=target, **config)
        self.timeout = timeout
        opts = self.config.channel_options()
        self._channel = (grpc.aio.secure_channel(target, self.config.credentials(), opts)
                         if self.config.secure else grpc.aio.insecure_channel(target, opts))
        self._stub = api_pb2_grpc.TandemStub(self._channel)
        self._md = self.config.metadata()

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, *, model: str = "",
               request_id: str = "", timeout: float | None = None, **kw: Any) -> AsyncStream:
        req = generate_request(prompt, params_with(params, kw), model, request_id)
        return AsyncStream(self._stub.Generate(req, timeout=self._timeout(timeout),
                                               metadata=self._md))

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None, *,
                       model: str = "", request_id: str = "", timeout: float | None = None,
                       **kw: Any) -> Completion:
        out = Collector()
        async with self.stream(prompt, params, model=model, request_id=request_id,
                               timeout=timeout, **kw) as chunks:
            async for c in chunks:
                out.add(c)
        return out.result()

    async def list_models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        resp = await self._unary(self._stub.ListModels, api_pb2.ListModelsRequest(), timeout)
        return [model_from_proto(m) for m in resp.models]

    async def version(self, *, timeout: float | None = None) -> str:
        """The server's version."""
        resp = await self._unary(self._stub.GetVersion, api_pb2.GetVersionRequest(), timeout)
        return resp.version

    async def model_info(self, model: str = "", *, timeout: float | None = None) -> ModelInfo:
        return model_from_proto(await self._unary(
            self._stub.GetModelInfo, api_pb2.GetModelInfoRequest(model=model), timeout))

    async def tokenize(self, text: str | None = None, *,
                       messages: Sequence[Mapping[str, str]] | None = None,
                       add_special_tokens: bool = False,
                       timeout: float | None = None) -> list[int]:
        req = tokenize_request(text, messages, add_special_tokens)
        return list((await self._unary(self._stub.Tokenize, req, timeout)).token_ids)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _timeout(self, timeout: float | None) -> float | None:
        return timeout if timeout is not None else self.timeout

    async def _unary(self, method: Any, req: Any, timeout: float | None) -> Any:
        try:
            return await method(req, timeout=self._timeout(timeout), metadata=self._md)
        except grpc.aio.AioRpcError as e:
            raise error_from_rpc(e) from None
