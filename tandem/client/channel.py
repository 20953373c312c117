"""How the client connects: TLS, the API key, and the retry policy, for both clients.

Retries are gRPC's own (a service config `retryPolicy`), never a loop in this package: gRPC
retries a call only while it is uncommitted, and a call commits when the server's response
headers arrive. Tandem sends its headers together with the first chunk, so

    UNAVAILABLE with no chunk received     -> retried, with exponential backoff and jitter
    UNAVAILABLE after a chunk was received -> never retried: UnavailableError

A retried Generate therefore never repeats or loses tokens the caller has seen. Every attempt
counts against the same deadline.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from tandem.v1 import api_pb2

SERVICE = api_pb2.DESCRIPTOR.services_by_name["Tandem"].full_name
Pem = bytes | str | os.PathLike  # PEM bytes or text, or the path of a PEM file


@dataclass(frozen=True)
class RetryPolicy:
    """gRPC's retry policy for UNAVAILABLE before any response. gRPC caps attempts at 5."""

    max_attempts: int = 4
    initial_backoff_s: float = 0.2
    max_backoff_s: float = 2.0
    backoff_multiplier: float = 2.0

    def service_config(self) -> str:
        return json.dumps({"methodConfig": [{
            "name": [{"service": SERVICE}],
            "retryPolicy": {
                "maxAttempts": self.max_attempts,
                "initialBackoff": f"{self.initial_backoff_s}s",
                "maxBackoff": f"{self.max_backoff_s}s",
                "backoffMultiplier": self.backoff_multiplier,
                "retryableStatusCodes": ["UNAVAILABLE"],
            }}]})


@dataclass(frozen=True)
class ChannelConfig:
    """target: host:port of the router's public gRPC port.
    api_key: sent as `authorization: Bearer <key>` on every call (the router's --api-key).
    tls: use TLS; implied by any of the three PEMs. root_certificates: the CA that signed the
    server's certificate (default: the system's roots). client_certificate and client_key:
    for mutual TLS. server_name: the name to check the server's certificate against, when it
    is not the host in target. retry: None turns retries off."""

    target: str = "127.0.0.1:50051"
    api_key: str | None = None
    tls: bool = False
    root_certificates: Pem | None = None
    client_certificate: Pem | None = None
    client_key: Pem | None = None
    server_name: str | None = None
    retry: RetryPolicy | None = RetryPolicy()
    options: Sequence[tuple[str, object]] = ()

    def __post_init__(self) -> None:
        if (self.client_certificate is None) != (self.client_key is None):
            raise ValueError("client_certificate and client_key go together (mutual TLS)")

    @property
    def secure(self) -> bool:
        return self.tls or any(p is not None for p in (
            self.root_certificates, self.client_certificate, self.client_key))

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.api_key}"),) if self.api_key else ()

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=_pem(self.root_certificates),
                                            private_key=_pem(self.client_key),
                                            certificate_chain=_pem(self.client_certificate))

    def channel_options(self) -> list[tuple[str, object]]:
        opts: list[tuple[str, object]] = [
            # Long prompts as token ids and n > 1 answers exceed the 4 MiB default (the
            # router allows 64 MiB).
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20),
        ]
        if self.retry is None:
            opts.append(("grpc.enable_retries", 0))
        else:
            opts += [
                ("grpc.enable_retries", 1),
                ("grpc.service_config", self.retry.service_config()),
                # gRPC keeps the request to resend it; past this size (256 KiB by default, a
                # prompt of ~60k token ids) it would commit at once and never retry.
                ("grpc.per_rpc_retry_buffer_size", 64 << 20),
            ]
        if self.server_name:
            opts.append(("grpc.ssl_target_name_override", self.server_name))
        return opts + list(self.options)


def _pem(value: Pem | None) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    if isinstance(value, str) and value.lstrip().startswith("-----BEGIN"):
        return value.encode()
    return Path(value).read_bytes()
