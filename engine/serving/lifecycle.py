"""One start-up and shut-down order for every service:

    config → engine → servicer → health (+ reflection behind a flag) → start
    → wait for SIGTERM/SIGINT → health NOT_SERVING → server.stop(grace) → engine shutdown

During the grace period gRPC refuses new calls (UNAVAILABLE) and lets in-flight streams finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

# Channel and server options used by every service. Each non-default value says why.
GRPC_OPTIONS = [
    # Prompts of 100k+ tokens and n > 1 responses exceed the 4 MiB default.
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    # Workers and the router talk over long-lived channels: notice a dead peer in seconds.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # Let peers ping as often as the keepalive above.
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
]


def make_server(interceptors: Sequence[grpc.aio.ServerInterceptor] = ()) -> grpc.aio.Server:
    return grpc.aio.server(interceptors=list(interceptors), options=GRPC_OPTIONS)


class Health:
    """grpc.health.v1 for a server's services; "" is the whole server."""

    def __init__(self, server: grpc.aio.Server, service_names: Sequence[str]) -> None:
        self.servicer = health.aio.HealthServicer()
        self.names = ["", *service_names]
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    async def set(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in self.names:
            await self.servicer.set(name, status)


def enable_reflection(server: grpc.aio.Server, service_names: Sequence[str]) -> None:
    reflection.enable_server_reflection(
        [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME], server)


async def serve_until_signal(server: grpc.aio.Server, health_: Health, *, grace_s: float,
                             on_stop: Callable[[], Awaitable[None]] | None = None,
                             ready: Callable[[], None] | None = None,
                             stop_event: asyncio.Event | None = None) -> None:
    """Start, report SERVING, wait for SIGTERM/SIGINT (or stop_event), then drain and stop."""
    loop = asyncio.get_running_loop()
    stop = stop_event or asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    await server.start()
    await health_.set(True)
    if ready is not None:
        ready()
    await stop.wait()
    await health_.set(False)
    await server.stop(grace_s)
    if on_stop is not None:
        await on_stop()
