"""The fake prefill worker: a process that answers Register with a real prefill worker's pool
descriptor (fetched from that worker) and ClaimLease with block ids of its choosing, then sends
a decode worker that has not mapped that pool yet a decode request naming its own address. The
decode worker mapped the pool for it: the attacker read other requests' KV through the decode
worker's output, planted KV in its prefix cache, and the real prefill worker was refused from
then on.

Each stack (router, prefill and decode on 127.0.0.1, shm transport) is started once with mutual
TLS and a certificate per role, and once in plaintext:
- with TLS, a decode request comes only from a router (the decode worker's certificate may not
  call Stream), and a pool is mapped only from a peer whose certificate is a prefill worker's;
- in plaintext, the decode worker maps a pool only when the process that owns it listens at
  the address it dialed.
Either way nothing of the victim's comes back, and the real prefill worker is served after."""

from __future__ import annotations

import asyncio
import secrets

import grpc
import pytest

from cluster import Cluster
from tandem.engine.sampling_params import SamplingParams
from tandem.kvtransfer.lease import prompt_digest
from tandem.runtime.convert import params_to_proto
from tandem.runtime.security import ClusterTls
from tandem.v1 import api_pb2, worker_pb2, worker_pb2_grpc

WORKER_ARGS = ["--num-blocks", "256", "--max-num-batched-tokens", "64"]
VICTIM = [(17 * j) % 250 + 3 for j in range(40)]  # 3 blocks of 16
FORGED = [t % 200 + 1 for t in VICTIM[::-1]]  # the attacker's prompt, as long as the victim's
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LAYOUT = worker_pb2.PoolDescriptor(dtype="float32", block_size=16, num_layers=2,
                                   num_kv_heads=2, head_dim=64)  # the tiny llama's pool


@pytest.fixture(scope="module", params=["mtls", "plaintext"])
def cluster(request, tiny_models, tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp(f"fake-prefill-{request.param}"),
                str(tiny_models["llama"]), worker_args=WORKER_ARGS,
                prefill_args=["--lease-ttl", "120"], router_args=["--http-port", "-1"],
                cluster_ca=request.param == "mtls").start()
    yield c
    codes = c.stop()
    assert all(code == 0 for code in codes.values()), codes


@pytest.fixture(autouse=True)
def idle_after(cluster):
    yield
    asyncio.run(cluster.wait_idle(timeout=20))


def creds(cluster: Cluster, name: str) -> ClusterTls | None:
    """Member `name`'s certificate in a TLS stack (what an attacker who took that member's key
    holds); None in plaintext."""
    return cluster.cluster_certs.tls(name) if cluster.cluster_certs else None


def channel(address: str, tls: ClusterTls | None, expect_role: str) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(address)
    return grpc.aio.secure_channel(address, tls.channel_credentials(),
                                   options=tls.channel_options(expect_role))


class FakePrefill(worker_pb2_grpc.WorkerServicer):
    """The impostor: the real worker's pool as its own, and every claim answered with the first
    blocks of that pool, for the attacker's prompt."""

    def __init__(self, real: worker_pb2.RegisterResponse) -> None:
        self.real = real
        self.calls: list[str] = []

    async def Register(self, request, context):  # noqa: N802
        self.calls.append("Register")
        return self.real

    async def ClaimLease(self, request, context):  # noqa: N802
        self.calls.append("ClaimLease")
        return worker_pb2.ClaimLeaseResponse(block_ids=[0, 1, 2], num_tokens=len(FORGED),
                                             prompt_digest=prompt_digest(FORGED), ttl_ms=60000)

    async def Release(self, request, context):  # noqa: N802
        self.calls.append("Release")
        return worker_pb2.ReleaseResponse(released=True)


async def serve_fake(fake: FakePrefill, tls: ClusterTls | None) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(fake, server)
    port = (server.add_secure_port("127.0.0.1:0", tls.server_credentials()) if tls
            else server.add_insecure_port("127.0.0.1:0"))
    await server.start()
    return server, f"127.0.0.1:{port}"


async def attack(cluster: Cluster, holder: str | None, streamer: str | None,
                 refused_at_door: bool = False):
    """The attack on a decode worker that has not mapped the prefill worker's pool: the victim's
    prompt is prefilled (its KV sits in the prefill pool under a live lease), the attacker gets
    the pool's descriptor with the key of member `holder`, serves it from its own address with
    that key, and sends the decode worker a request naming that address with the key of member
    `streamer` (`refused_at_door`: a key that may not call Stream at all). Returns what came
    back for the forged request: (tokens, status, message), and the calls the fake received."""
    p, d = cluster.workers("prefill")[0], cluster.workers("decode")[0]
    router, holder_tls = creds(cluster, "router"), creds(cluster, holder) if holder else None
    async with channel(p.address, router, "prefill") as pch:
        victim = await worker_pb2_grpc.WorkerStub(pch).Prefill(worker_pb2.PrefillRequest(
            request_id="victim", prompt_token_ids=VICTIM, params=params_to_proto(GREEDY)))
    try:
        async with channel(p.address, holder_tls, "prefill") as pch:
            real = await worker_pb2_grpc.WorkerStub(pch).Register(worker_pb2.RegisterRequest(
                decode_worker_id="attacker", layout=LAYOUT))
        fake = FakePrefill(real)
        server, address = await serve_fake(fake, holder_tls)
        try:
            forged = worker_pb2.StreamRequest(decode=worker_pb2.DecodeRequest(
                request_id="forged", prompt_token_ids=FORGED, params=params_to_proto(GREEDY),
                kv=worker_pb2.KVLocation(address=address, lease_id=secrets.token_hex(16),
                                         instance_id=real.instance_id),
                first_token_ids=[victim.first_token_ids[0]]))
            async with channel(d.address, creds(cluster, streamer) if streamer else None,
                               "decode") as dch:
                tokens, ends = [], []
                call = worker_pb2_grpc.WorkerStub(dch).Stream()
                if refused_at_door:
                    # Refused at the door, on the call's headers: its status is read without
                    # writing (a grpc.aio client whose write races the server's early status
                    # reports INTERNAL "Internal error from Core" instead: grpc/grpc#36066).
                    outcome = [(await call.code(), await call.details())]
                else:
                    await call.write(forged)
                    await call.done_writing()
                    async for msg in call:
                        tokens += list(msg.tokens.token_ids)
                        ends += [u for u in msg.updates if u.done]
                    outcome = [(grpc.StatusCode(_code(u.error_code)), u.error_message)
                               for u in ends]
        finally:
            await server.stop(None)
    finally:
        async with channel(p.address, router, "prefill") as pch:
            await worker_pb2_grpc.WorkerStub(pch).Release(
                worker_pb2.ReleaseRequest(lease_id=victim.kv.lease_id))
    (status, message), = outcome
    return tokens, status, message, fake.calls


def _code(value: int) -> tuple[int, str]:
    return next(c.value for c in grpc.StatusCode if c.value[0] == value)


async def served_through_router(cluster: Cluster) -> list[int]:
    """A request through the router (prefill, then decode pulling from the real prefill
    worker): its tokens."""
    async with grpc.aio.insecure_channel(cluster.router.address) as ch:
        tokens = []
        async for chunk in cluster.api(ch).Generate(api_pb2.GenerateRequest(
                token_ids=api_pb2.TokenIds(ids=VICTIM[:30]), params=params_to_proto(GREEDY))):
            tokens += chunk.token_ids
    return tokens


def test_a_fake_prefill_worker_reads_no_kv_and_the_real_one_is_served_after(cluster):
    """With TLS the attacker holds the decode worker's own key (a decode pod taken over: its
    certificate is one the cluster CA signed), and with it may register with the prefill worker
    and serve the fake; in plaintext it needs nothing. With TLS the forged request is refused
    at the door (only a router may call Stream); in plaintext the decode worker refuses the pool
    (its owner does not listen where the fake does) and claims nothing. No token comes back,
    and a request through the router is served from the real prefill worker afterwards."""
    tls = cluster.cluster_certs is not None
    tokens, status, message, calls = asyncio.run(
        attack(cluster, "decode0" if tls else None, "decode0" if tls else None,
               refused_at_door=tls))
    assert not tokens, tokens
    if tls:
        assert status == grpc.StatusCode.PERMISSION_DENIED and "Stream" in message, message
        assert calls == []
    else:
        assert status == grpc.StatusCode.FAILED_PRECONDITION and "KV pool" in message, message
        assert "Register" in calls and "ClaimLease" not in calls  # dialed, refused, not claimed
    assert len(asyncio.run(served_through_router(cluster))) == GREEDY.max_tokens


def test_a_decode_worker_maps_pools_only_from_prefill_certificates(cluster):
    """TLS: the attacker holds the router's key too (a decode request is then accepted), but
    its fake answers with a key that is not a prefill worker's: the decode worker's channel
    refuses the peer in the handshake, the fake receives no call at all, nothing is mapped,
    and the real prefill worker is served after."""
    if cluster.cluster_certs is None:
        pytest.skip("plaintext: no certificates (the test above covers it)")
    tokens, status, message, calls = asyncio.run(attack(cluster, "decode0", "router"))
    assert not tokens, tokens
    assert status == grpc.StatusCode.UNAVAILABLE, (status, message)
    assert calls == []
    assert len(asyncio.run(served_through_router(cluster))) == GREEDY.max_tokens
