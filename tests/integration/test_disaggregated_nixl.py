"""The disaggregated stack with the nixl transport: router, prefill and decode as separate
processes on 127.0.0.1, the prefill worker started with `--transport nixl`, its pool read by the
decode worker over NIXL with UCX held to TCP on the loopback device (UCX_TLS=tcp,
UCX_NET_DEVICES=lo: the path two hosts would take, with no shared memory between the
processes). The parity, cancel, deadline and lease tests of test_disaggregated.py run here
unchanged against this stack, and every pool ends idle after each test."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from test_disaggregated import (  # the same tests, collected here against the nixl stack
    PROMPTS,
    generate,
    test_client_cancel_mid_stream_frees_everything,
    test_deadline_mid_stream,
    test_decode_request_cancelled_before_it_ran_releases_the_lease_at_once,
    test_decode_side_never_pulls_lease_expires,
    test_greedy_16_concurrent_match_offline,
    test_seeded_sampling_and_n3_match_colocated,
)

from cluster import HOLD_BLOCKS, HOLD_WORKER_ARGS, Cluster
from tandem.engine.sampling_params import SamplingParams
from tandem.v1 import worker_pb2, worker_pb2_grpc

try:
    import nixl._api  # noqa: F401
except ImportError as e:
    pytest.skip(f"the nixl package is not installed (pip install 'tandem[nixl]'): {e}",
                allow_module_level=True)

__all__ = [
    "test_client_cancel_mid_stream_frees_everything",
    "test_deadline_mid_stream",
    "test_decode_request_cancelled_before_it_ran_releases_the_lease_at_once",
    "test_decode_side_never_pulls_lease_expires",
    "test_greedy_16_concurrent_match_offline",
    "test_seeded_sampling_and_n3_match_colocated",
]

UCX_LOOPBACK_TCP = {"UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp"}


@pytest.fixture(scope="module")
def cluster(tiny_llama_long, tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("disagg-nixl"), str(tiny_llama_long),
                worker_args=HOLD_WORKER_ARGS, prefill_args=["--lease-ttl", "3", "--transport", "nixl"],
                router_args=["--http-port", "-1"], env=UCX_LOOPBACK_TCP).start()
    yield c
    codes = c.stop()
    assert all(code == 0 for code in codes.values()), codes


@pytest.fixture(autouse=True)
def idle_after(cluster):
    yield
    asyncio.run(cluster.wait_idle())


@pytest.fixture
def expiring(cluster):
    """The lease-expiry test's stack: this one, whose leases live 3 s too."""
    return cluster


def test_the_prefill_worker_serves_its_pool_over_nixl_and_never_logs_the_handle(cluster):
    p, d = cluster.workers("prefill")[0], cluster.workers("decode")[0]

    async def main():
        async with grpc.aio.insecure_channel(p.address) as ch:
            ok = await worker_pb2_grpc.WorkerStub(ch).Register(worker_pb2.RegisterRequest(
                decode_worker_id="probe", layout=worker_pb2.PoolDescriptor(
                    dtype="float32", block_size=16, num_layers=2, num_kv_heads=2, head_dim=64)))
        async with grpc.aio.insecure_channel(cluster.router.address) as ch:
            tokens, _ = await generate(cluster.api(ch), PROMPTS[2],
                                       SamplingParams(temperature=0, max_tokens=4))
        return ok.pool, tokens

    pool, tokens = asyncio.run(main())
    assert (pool.transport, pool.device_index, pool.num_blocks) == ("nixl", -1, HOLD_BLOCKS)
    assert pool.handle.startswith(b"TNX1") and len(tokens[0]) == 4
    # The handle holds the agent's metadata: a capability, in no log line.
    agent_name = pool.handle[14:14 + int.from_bytes(pool.handle[12:14], "little")].decode()
    assert agent_name.startswith("tandem-")
    mapped = [line["event"] for line in d.json_logs()
              if line["event"].startswith("mapped the KV pool")]
    assert mapped and all("'transport': 'nixl'" in m for m in mapped)
    for proc in (p, d):
        text = proc.log_text()
        assert pool.handle.hex() not in text and pool.handle.hex()[28:] not in text

