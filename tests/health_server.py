"""A grpc.aio server on 127.0.0.1 with grpc's health servicer, for the tests of `tandem health`
and of the cluster's TLS: plaintext, or with a cluster CA's certificates, which asks each caller
for a certificate the CA signed, as a worker does."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tandem.runtime.security import ClusterTls


@contextlib.asynccontextmanager
async def health_server(
        tls: ClusterTls | None = None) -> AsyncIterator[tuple[str, health.aio.HealthServicer]]:
    """The server's address and its health servicer (the whole server "", liveness and
    readiness SERVING until told otherwise); stopped on exit."""
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    if tls is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", tls.server_credentials())
    await server.start()
    for name in ("liveness", "readiness"):  # as every Tandem server names them
        await servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        await server.stop(None)
