"""A decode worker renews the prefill leases its requests hold while they wait for the pull:
here the decode worker's engine core is stopped (SIGSTOP) with a request claimed, for longer
than the prefill worker's lease lives (--lease-ttl 9); the worker process renews the lease
meanwhile (and counts it: tandem:kv_lease_renewals; the prefill worker counts the blocks its claimer
pins: tandem:kv_leased_blocks), and once the core runs again the request
pulls its KV and decodes the tokens it decodes unhindered. Prefill and decode as processes on
127.0.0.1 (shm transport), called directly (no router)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest
from test_kv_capability import VICTIM, decode_request, ended, prefill, stream
from test_metrics import Scrape

from cluster import Cluster, serve
from tandem.v1 import worker_pb2, worker_pb2_grpc

TTL_S = 9.0  # renewed every 3 s; time enough for a renewal late by seconds under load


@pytest.fixture(scope="module")
def cluster(tiny_models, tmp_path_factory):
    yield from serve(Cluster(tmp_path_factory.mktemp("renew"), str(tiny_models["llama"]),
                             worker_args=["--num-blocks", "64"],
                             prefill_args=["--lease-ttl", str(TTL_S)],
                             router_args=["--http-port", "-1"], metrics=True))


def test_a_request_waiting_longer_than_the_lease_keeps_its_kv(cluster):
    p, d = cluster.workers("prefill")[0], cluster.workers("decode")[0]
    prompt = VICTIM[:30]

    async def main():
        async with grpc.aio.insecure_channel(p.address) as pch, \
                grpc.aio.insecure_channel(d.address) as dch:
            resp = await prefill(pch, "unhindered", prompt)
            tokens, ends = await stream(dch, decode_request(
                "unhindered", prompt, resp.kv, list(resp.first_token_ids)))
            assert ended(ends, "unhindered")[0] == grpc.StatusCode.OK
            expected = tokens["unhindered"]

            core = cluster.engine_core(d.name)
            resp = await prefill(pch, "waits", prompt)
            granted = time.monotonic()
            os.kill(core, signal.SIGSTOP)
            try:
                waiting = asyncio.ensure_future(stream(dch, decode_request(
                    "waits", prompt, resp.kv, list(resp.first_token_ids))))
                # Past the lease's time to live, counted from its grant, by a margin.
                await asyncio.sleep(TTL_S + 3.0 - (time.monotonic() - granted))
                load = await worker_pb2_grpc.WorkerStub(pch).GetLoad(worker_pb2.GetLoadRequest())
                assert load.num_leases == 1  # renewed: still pinned there
                assert not waiting.done()
                scrape = Scrape(d)
                assert scrape("tandem:kv_lease_renewals_total") >= 1
                assert scrape("tandem:kv_leases_lost_total") == 0
                # The prefill worker counts what the lease's holder pins: the prompt's 2 blocks,
                # for the one claimer of this plaintext stack (no identity: "").
                assert Scrape(p)("tandem:kv_leased_blocks", holder="") == 2
            finally:
                os.kill(core, signal.SIGCONT)
            tokens, ends = await waiting
            assert ended(ends, "waits")[0] == grpc.StatusCode.OK
            assert tokens["waits"] == expected
        await cluster.wait_idle(timeout=30)

    asyncio.run(main())
