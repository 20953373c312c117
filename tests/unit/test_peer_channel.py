"""A worker's channel to a peer it pulls KV from (runtime/kv_peers.py), after that peer was down
and came back on its port: a call made before gRPC dials it again would fail at once with the
old error (a decode worker failed the requests of a prefill worker that had just restarted,
and the router, prefilling them again there, ran out of tries within 40 ms); `connected` waits
for the channel instead, within a bound."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tandem.runtime.kv_peers import connected
from tandem.runtime.lifecycle import GRPC_OPTIONS, SERVER_OPTIONS


async def serve(port: int = 0) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(options=SERVER_OPTIONS)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port


async def until(ch: grpc.aio.Channel, state: grpc.ChannelConnectivity) -> None:
    """Dial until the channel is in `state` (each change an event, no clock)."""
    now = ch.get_state(try_to_connect=True)
    while now != state:
        await ch.wait_for_state_change(now)
        now = ch.get_state(try_to_connect=True)


def test_a_channel_to_a_peer_back_on_its_port_is_waited_for_not_failed():
    async def main() -> None:
        server, port = await serve()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=30)
            await server.stop(None)
            # The channel saw the peer down: its connection attempts are refused.
            await until(ch, grpc.ChannelConnectivity.TRANSIENT_FAILURE)
            server, _ = await serve(port)  # back, on the same port
            try:
                await connected(ch, within=60)
                assert ch.get_state() == grpc.ChannelConnectivity.READY
                resp = await stub.Check(health_pb2.HealthCheckRequest(), timeout=30)
                assert resp.status == health_pb2.HealthCheckResponse.SERVING
            finally:
                await server.stop(None)

    asyncio.run(main())


def test_a_peer_that_stays_down_is_waited_for_only_within_the_bound():
    async def main() -> None:
        server, port = await serve()
        await server.stop(None)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS) as ch:
            await until(ch, grpc.ChannelConnectivity.TRANSIENT_FAILURE)
            await connected(ch, within=0.05)  # returns: the call that follows fails as before
            assert ch.get_state() != grpc.ChannelConnectivity.READY
            try:
                await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                           timeout=30)
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE
            else:
                raise AssertionError("a call to a peer that is down succeeded")

    asyncio.run(main())


def test_a_caller_cancelled_while_it_waits_is_cancelled():
    """A request cancelled while its claim waits for the channel ends there (its task sees
    CancelledError), however the wait ends."""
    async def main() -> None:
        server, port = await serve()
        await server.stop(None)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS) as ch:
            await until(ch, grpc.ChannelConnectivity.TRANSIENT_FAILURE)
            waiting = asyncio.get_running_loop().create_future()

            async def claim() -> None:
                waiting.set_result(None)
                await connected(ch, within=60)

            task = asyncio.create_task(claim())
            await waiting  # the task is in connected() from here on
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            else:
                raise AssertionError("the wait swallowed its caller's cancel")

    asyncio.run(main())
