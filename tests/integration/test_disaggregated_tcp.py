"""The disaggregated stack with the tcp transport: router, prefill and decode as separate
processes on 127.0.0.1, the prefill worker started with `--transport tcp`, its pool read by the
decode worker over a TCP stream (what two hosts without the nixl extra do), with the cluster's
mutual TLS as a multi-host deployment has it (a decode worker with cluster TLS opens only a tcp
pool served over TLS: kvtransfer/tcp.py TcpTransport.open). Outputs equal the offline engine's,
and every pool ends idle."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from test_disaggregated import PROMPTS, WORKER_ARGS, generate

from cluster import Cluster, serve
from tandem.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def cluster(tiny_models, tmp_path_factory):
    yield from serve(Cluster(tmp_path_factory.mktemp("disagg-tcp"), str(tiny_models["llama"]),
                             worker_args=WORKER_ARGS, prefill_args=["--transport", "tcp"],
                             router_args=["--http-port", "-1"], cluster_ca=True))


def test_greedy_over_tcp_matches_offline_and_pools_end_idle(cluster, offline):
    params = SamplingParams(temperature=0, max_tokens=16)
    prompts = PROMPTS[:8]
    expected = [o.outputs[0].token_ids for o in offline.generate(prompts, params)]

    async def main():
        async with grpc.aio.insecure_channel(cluster.router.address) as ch:
            stub = cluster.api(ch)
            results = await asyncio.gather(*(generate(stub, p, params) for p in prompts))
        await cluster.wait_idle()
        return results

    results = asyncio.run(main())
    assert [r[0][0] for r in results] == expected
    d = cluster.workers("decode")[0]
    mapped = [line["event"] for line in d.json_logs()
              if line["event"].startswith("mapped the KV pool")]
    assert mapped and all("'transport': 'tcp'" in m for m in mapped)
