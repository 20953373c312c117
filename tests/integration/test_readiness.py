"""The router's liveness and readiness, over gRPC health and HTTP, with a prefill and two decode
workers: one decode worker out leaves the router ready (the other serves); both out, it is live
but not ready (a request gets 503, and /workers says why); one restarted, it is ready again."""

from __future__ import annotations

import asyncio

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster import Cluster
from tandem.runtime.lifecycle import Health

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
BODY = {"prompt": [5, 6, 7], "max_tokens": 4}


async def status(health: health_pb2_grpc.HealthStub, service: str) -> int:
    return (await health.Check(health_pb2.HealthCheckRequest(service=service))).status


async def until_status(health: health_pb2_grpc.HealthStub, service: str, want: int) -> None:
    watch = health.Watch(health_pb2.HealthCheckRequest(service=service))
    try:
        while (await watch.read()).status != want:
            pass
    finally:
        watch.cancel()


async def until_state(h: httpx.AsyncClient, address: str, state: str) -> None:
    """Until the router's /workers says worker `address` is in `state` (up, down, lost)."""
    while True:
        workers = (await h.get("/workers")).json()["workers"]
        if next(w["state"] for w in workers if w["address"] == address) == state:
            return
        await asyncio.sleep(0.05)


def test_ready_while_a_path_is_left_live_while_the_process_serves(tiny_models, tmp_path):
    c = Cluster(tmp_path, str(tiny_models["llama"]), decode=2,
                worker_args=["--num-blocks", "64"]).start()
    d0 = c.procs["decode0"]
    try:
        async def main() -> None:
            async with grpc.aio.insecure_channel(c.router.address) as ch, \
                    httpx.AsyncClient(base_url=f"http://127.0.0.1:{c.router.http_port}",
                                      timeout=60) as h:
                health = health_pb2_grpc.HealthStub(ch)
                await until_status(health, Health.READINESS, SERVING)
                assert (await h.get("/health/ready")).status_code == 200

                c.kill("decode0")  # one of two decode workers out: still ready
                await until_state(h, d0.address, "down")
                for service in (Health.READINESS, "", Health.LIVENESS, "tandem.v1.Tandem"):
                    assert await status(health, service) == SERVING, service
                assert [(await h.get(p)).status_code for p in
                        ("/health/ready", "/health", "/health/live")] == [200, 200, 200]
                states = (await h.get("/workers")).json()
                assert states["ready"] and not states["all_up"]
                assert (await h.post("/v1/completions", json=BODY)).status_code == 200

                # The completion's lease released before its decode worker dies (a lease a
                # killed worker never released stays until it expires).
                await c.wait_idle(procs=c.workers("prefill"))
                c.kill("decode1")  # every decode worker out: live, not ready
                await until_status(health, Health.READINESS, NOT_SERVING)
                assert await status(health, "") == NOT_SERVING
                assert await status(health, Health.LIVENESS) == SERVING
                assert [(await h.get(p)).status_code for p in
                        ("/health/ready", "/health", "/health/live")] == [503, 503, 200]
                r = await h.post("/v1/completions", json=BODY)
                assert r.status_code == 503 and "no healthy decode worker" in r.text

                c.wait_ready([c.restart("decode1")])  # a worker restart: ready again
                await until_status(health, Health.READINESS, SERVING)
                assert (await h.get("/health/ready")).status_code == 200
                assert (await h.post("/v1/completions", json=BODY)).status_code == 200
                await c.wait_idle(timeout=30)

        asyncio.run(main())
    finally:
        codes = c.stop()
    assert codes["router"] == 0 and codes["prefill0"] == 0 and codes["decode1"] == 0, codes
