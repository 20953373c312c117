"""One start-up and shut-down order for every service:

    config → engine → servicer → health (+ reflection behind a flag) → start
    → wait for SIGTERM/SIGINT → health NOT_SERVING → server.stop(grace) → engine shutdown

During the grace period gRPC refuses new calls (UNAVAILABLE: the listening socket is closed and
open connections take no new streams) and lets in-flight streams finish; whatever is still open
when the grace period ends is cancelled. Other listeners of the service (the router's HTTP API)
drain alongside, within the same grace period. The process then exits 0.

A health Watch stream counts as in flight like any other: a client that watches keeps the drain
waiting until the grace period ends (Check, which probes use, does not).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Sequence

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem.errors import InvalidArgument

log = structlog.get_logger(__name__)

# Channel and server options used by every service. Each non-default value says why.
GRPC_OPTIONS = [
    # Prompts of 100k+ tokens and n > 1 responses exceed the 4 MiB default.
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    # Workers and the router talk over long-lived channels: notice a dead peer in seconds.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    # gRPC core waits for any ping's ack up to this long (60 s by default, which outranks the
    # keepalive timeout above: a SIGSTOPped worker held its streams for 60 s).
    ("grpc.http2.ping_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # Let peers ping as often as the keepalive above.
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    # A peer that was down (starting, restarting) is tried again within a second, not after
    # gRPC's default backoff of up to 120 s: no channel a request needs waits on a peer
    # that is up. min_reconnect_backoff is the connect attempt's timeout (20 s by default).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
    ("grpc.min_reconnect_backoff_ms", 5_000),
]


# On a call a worker refuses because it drains (UNAVAILABLE): its caller hears at once that the
# worker drains, not that it failed, before the worker's next poll says so (Load.draining).
DRAINING_METADATA = ("tandem-draining", "1")


def refused_draining(e: grpc.aio.AioRpcError) -> bool:
    """Whether a call was refused by a worker that drains (DRAINING_METADATA)."""
    return DRAINING_METADATA in tuple(e.trailing_metadata() or ())


# gRPC core listens with SO_REUSEPORT by default: a second server on a port already in use
# then shares it (a second `tandem up` answered on 50051 beside the first, health alternating
# between them) instead of failing to bind.
SERVER_OPTIONS = [*GRPC_OPTIONS, ("grpc.so_reuseport", 0)]


def make_server(interceptors: Sequence[grpc.aio.ServerInterceptor] = (), *,
                reuse_port: bool = False) -> grpc.aio.Server:
    """reuse_port: the port is shared with other processes of one service (SO_REUSEPORT:
    `tandem router --api-processes`); otherwise binding a port another server holds fails."""
    options = [*GRPC_OPTIONS, ("grpc.so_reuseport", 1)] if reuse_port else SERVER_OPTIONS
    return grpc.aio.server(interceptors=list(interceptors), options=options)


def check_port_free(host: str, port: int, flag: str) -> None:
    """Raise InvalidArgument(flag) if host:port cannot be listened on now (another server holds
    it), as a server would listen: SO_REUSEADDR (a port whose last connections linger in
    TIME_WAIT is free), no SO_REUSEPORT. Port 0 (any free port) and negative ports (off) pass.
    A check, not a reservation: the port is free again when this returns."""
    if port <= 0:
        return
    try:
        addresses = {info[4][:2]: info[0] for info in socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)}
    except socket.gaierror as e:
        raise InvalidArgument("--host", f"cannot resolve {host!r}: {e.strerror}") from None
    for address, family in addresses.items():
        try:
            socket.create_server(address, family=family).close()
        except OSError as e:
            why = ("in use (another `tandem up` or server holds it)"
                   if e.errno == errno.EADDRINUSE else os.strerror(e.errno or 0))
            raise InvalidArgument(flag, f"cannot listen on {host}:{port}: {why}; choose "
                                        "another port, or 0 for a free one") from None


class Health:
    """grpc.health.v1 for a server, by service name:

        liveness                the process serves: SERVING from start-up until shut-down
                                begins (SIGTERM), whatever it depends on
        readiness, "" and       it can take a request: live, and what it depends on is usable
        each service name       (`depend`: the router's workers, as its HTTP /health/ready
                                sees them; a worker has nothing to wait for once it serves)

    Kubernetes and docker-compose probe liveness with `liveness` and readiness with `readiness`
    (or "", the whole server, which answers the same)."""

    LIVENESS = "liveness"
    READINESS = "readiness"

    def __init__(self, server: grpc.aio.Server, service_names: Sequence[str]) -> None:
        self.servicer = health.aio.HealthServicer()
        self.names = ["", self.READINESS, *service_names]
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)
        self._up = False
        self._usable = True

    async def set(self, serving: bool) -> None:
        self._up = serving
        await self._publish()

    async def depend(self, usable: bool) -> None:
        self._usable = usable
        await self._publish()

    async def _publish(self) -> None:
        await self.servicer.set(self.LIVENESS, _status(self._up))
        for name in self.names:
            await self.servicer.set(name, _status(self._up and self._usable))


def _status(serving: bool) -> health_pb2.HealthCheckResponse.ServingStatus:
    return (health_pb2.HealthCheckResponse.SERVING if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING)


def enable_reflection(server: grpc.aio.Server, service_names: Sequence[str]) -> None:
    reflection.enable_server_reflection(
        [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME], server)


async def serve_until_signal(server: grpc.aio.Server, health_: Health, *, grace_s: float,
                             on_stop: Callable[[], Awaitable[None]] | None = None,
                             ready: Callable[[], None] | None = None,
                             stop_event: asyncio.Event | None = None,
                             drain_also: Sequence[Callable[[], Awaitable[None]]] = (),
                             evacuate: Callable[[float], Awaitable[None]] | None = None
                             ) -> None:
    """Start, report SERVING, wait for SIGTERM/SIGINT (or stop_event), then drain and stop.
    `drain_also`: other listeners' graceful stops, run alongside the gRPC server's.
    `evacuate(grace_s)`: a worker's drain while the server still takes calls (a decode worker's
    requests moved away, a prefill worker's leases claimed), within the grace period; the
    server's graceful stop gets what is left of it."""
    stop = stop_event or asyncio.Event()
    stop_on_signals(stop.set)
    await server.start()
    await health_.set(True)
    if ready is not None:
        ready()
    await stop.wait()
    ignore_further_sigterm()
    await shut_down(server, health_, grace_s=grace_s, on_stop=on_stop, drain_also=drain_also,
                    evacuate=evacuate)


def stop_on_signals(stop: Callable[[], None]) -> None:
    """SIGTERM and SIGINT call `stop` (on the running loop)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop)


def ignore_further_sigterm() -> None:
    """Told once: a later SIGTERM changes nothing, also once the loop is gone and the process
    tears down (a supervisor's can come after the one a launcher thread's exit sends:
    PR_SET_PDEATHSIG follows the thread that started the process, runtime/lifeline.py)."""
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
        asyncio.get_running_loop().remove_signal_handler(signal.SIGTERM)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


async def shut_down(server: grpc.aio.Server, health_: Health, *, grace_s: float,
                    on_stop: Callable[[], Awaitable[None]] | None = None,
                    drain_also: Sequence[Callable[[], Awaitable[None]]] = (),
                    evacuate: Callable[[float], Awaitable[None]] | None = None) -> None:
    """NOT_SERVING, `evacuate` within the grace period, then the server's graceful stop (and
    `drain_also`) with what is left of it, then `on_stop`."""
    t0 = time.monotonic()
    log.info("shutting down: NOT_SERVING, draining in-flight requests", grace_s=grace_s)
    await health_.set(False)
    if evacuate is not None:
        await evacuate(grace_s)
    # At least a second for the calls that saw the evacuation through (Drain's answer).
    left = max(grace_s - (time.monotonic() - t0), 1.0)
    await close_server(server, left, drain_also)
    log.info("drained", seconds=round(time.monotonic() - t0, 3))
    if on_stop is not None:
        await on_stop()


async def close_server(server: grpc.aio.Server, grace_s: float,
                       drain_also: Sequence[Callable[[], Awaitable[None]]] = ()) -> None:
    """The server's graceful stop: no new call, the ones in flight get `grace_s` seconds to
    finish (then they are cancelled); other listeners' stops (`drain_also`) alongside."""
    await asyncio.gather(server.stop(grace_s), *(drain() for drain in drain_also))
