"""The blocking client.

    from tandem.client import Client, SamplingParams

    with Client("127.0.0.1:50051") as client:
        print(client.generate("Hello", SamplingParams(max_tokens=32), timeout=30).text)
        with client.stream("Hello", SamplingParams(max_tokens=32)) as chunks:
            for chunk in chunks:
                print(chunk.text, end="")
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
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


class Stream(Iterator[Chunk]):
    """The chunks of one Generate call, as they arrive. close() (or leaving its `with`, or
    dropping it) cancels the call: the server stops generating and frees what it held."""

    def __init__(self, call: Any) -> None:
        self._call = call

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Chunk:
        try:
            return chunk_from_proto(next(self._call))
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None

    def close(self) -> None:
        self._call.cancel()  # a no-op once the call has ended

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


class Client:
    """A channel to the router's public gRPC port. `timeout` is the default deadline of each
    call in seconds (None: none); a call's own `timeout` overrides it. See ChannelConfig for
    api_key, TLS and retry."""

    def __init__(self, target: str = "127.0.0.1:50051", *, timeout: float | None = None,
                 **config: Any) -> None:
        self.config = ChannelConfig(target=target, **config)
        self.timeout = timeout
        opts = self.config.channel_options()
        self._channel = (grpc.secure_channel(target, self.config.credentials(), opts)
                         if self.config.secure else grpc.insecure_channel(target, opts))
        self._stub = api_pb2_grpc.TandemStub(self._channel)
        self._md = self.config.metadata()

    # -- generation ----------------------------------------------------------------------------
    def stream(self, prompt: Prompt, params: SamplingParams | None = None, *, model: str = "",
               request_id: str = "", timeout: float | None = None, **kw: Any) -> Stream:
        """Chunks as they are generated; with n > 1 the samples' chunks interleave (see
        Chunk.index). Keyword arguments beyond these set SamplingParams fields."""
        req = generate_request(prompt, params_with(params, kw), model, request_id)
        return Stream(self._stub.Generate(req, timeout=self._timeout(timeout),
                                          metadata=self._md))

    def generate(self, prompt: Prompt, params: SamplingParams | None = None, *,
                 model: str = "", request_id: str = "", timeout: float | None = None,
                 **kw: Any) -> Completion:
        """The whole answer, every sample."""
        out = Collector()
        with self.stream(prompt, params, model=model, request_id=request_id, timeout=timeout,
                         **kw) as chunks:
            for c in chunks:
                out.add(c)
        return out.result()

    # -- the rest of the API -------------------------------------------------------------------
    def list_models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        resp = self._unary(self._stub.ListModels, api_pb2.ListModelsRequest(), timeout)
        return [model_from_proto(m) for m in resp.models]

    def version(self, *, timeout: float | None = None) -> str:
        """The server's version."""
        return self._unary(self._stub.GetVersion, api_pb2.GetVersionRequest(), timeout).version

    def model_info(self, model: str = "", *, timeout: float | None = None) -> ModelInfo:
        return model_from_proto(self._unary(
            self._stub.GetModelInfo, api_pb2.GetModelInfoRequest(model=model), timeout))

    def tokenize(self, text: str | None = None, *,
                 messages: Sequence[Mapping[str, str]] | None = None,
                 add_special_tokens: bool = False, timeout: float | None = None) -> list[int]:
        """Token ids of `text`, or of chat `messages` ([{"role", "content"}]) with the model's
        chat template."""
        req = tokenize_request(text, messages, add_special_tokens)
        return list(self._unary(self._stub.Tokenize, req, timeout).token_ids)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _timeout(self, timeout: float | None) -> float | None:
        return timeout if timeout is not None else self.timeout

    def _unary(self, method: Any, req: Any, timeout: float | None) -> Any:
        try:
            return method(req, timeout=self._timeout(timeout), metadata=self._md)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None
