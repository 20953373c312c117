"""What a caller of a worker can and cannot do: a prefill lease is a capability (its token,
claimed once from the prefill worker, is the only way to its blocks); a bad request fails alone;
whatever a refused request took is released at once; Abort ends a stream. Router, prefill and
decode as processes on 127.0.0.1 with the shm transport. Leases live 120 s here, so a pool that
is idle soon after a test was freed by a release, never by an expiry."""

from __future__ import annotations

import asyncio
import secrets

import grpc
import pytest

from cluster import HOLD_TOKENS, HOLD_WORKER_ARGS, Cluster
from tandem.engine.sampling_params import SamplingParams
from tandem.kvtransfer.lease import prompt_digest
from tandem.runtime.convert import params_to_proto
from tandem.v1 import api_pb2, worker_pb2, worker_pb2_grpc

VICTIM = [(17 * j) % 250 + 3 for j in range(40)]  # 3 blocks of 16
IDLE_S = 10.0  # well inside the lease's 120 s
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(tiny_llama_long, tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("kvcap"), str(tiny_llama_long),
                worker_args=HOLD_WORKER_ARGS, prefill_args=["--lease-ttl", "120"],
                router_args=["--http-port", "-1"]).start()
    yield c
    codes = c.stop()
    assert all(code == 0 for code in codes.values()), codes


@pytest.fixture(autouse=True)
def idle_after(cluster):
    yield
    asyncio.run(cluster.wait_idle(timeout=IDLE_S))


async def generate(stub, prompt, params: SamplingParams, request_id: str = ""):
    """Token ids per sample and the finish reasons, from the router's public API."""
    req = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompt), request_id=request_id,
                                  params=params_to_proto(params))
    tokens: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    async for chunk in stub.Generate(req):
        tokens.setdefault(chunk.index, []).extend(chunk.token_ids)
        if chunk.finish_reason:
            reasons[chunk.index] = chunk.finish_reason
    return [tokens[i] for i in sorted(tokens)], reasons


async def prefill(ch, rid: str, prompt: list[int], params=GREEDY) -> worker_pb2.PrefillResponse:
    return await worker_pb2_grpc.WorkerStub(ch).Prefill(worker_pb2.PrefillRequest(
        request_id=rid, prompt_token_ids=prompt, params=params_to_proto(params)))


def decode_request(rid: str, prompt: list[int], kv: worker_pb2.KVLocation, first: list[int],
                   params=GREEDY) -> worker_pb2.StreamRequest:
    return worker_pb2.StreamRequest(decode=worker_pb2.DecodeRequest(
        request_id=rid, prompt_token_ids=prompt, params=params_to_proto(params), kv=kv,
        first_token_ids=first))


async def stream(ch, *requests: worker_pb2.StreamRequest):
    """Send these on one Stream call to a decode worker; once the call has ended, the tokens
    of each request id and how it ended (the status of each request with that id)."""
    call = worker_pb2_grpc.WorkerStub(ch).Stream(iter(requests))
    tokens: dict[str, list[int]] = {}
    ends: dict[str, list[worker_pb2.RequestUpdate]] = {}
    async for msg in call:
        pos = 0
        for rid, n in zip(msg.tokens.request_id, msg.tokens.num_tokens):
            tokens.setdefault(rid, []).extend(msg.tokens.token_ids[pos:pos + n])
            pos += n
        for u in msg.updates:
            if u.done:
                ends.setdefault(u.request_id, []).append(u)
    assert await call.code() == grpc.StatusCode.OK
    return tokens, ends


def status(update: worker_pb2.RequestUpdate) -> grpc.StatusCode:
    return next(c for c in grpc.StatusCode if c.value[0] == update.error_code)


def ended(ends, rid: str) -> tuple[grpc.StatusCode, str]:
    """How the one request with id `rid` ended: its status and message."""
    (u,) = ends[rid]
    return status(u), u.error_message


def with_old_block_ids(kv: worker_pb2.KVLocation, block_ids: list[int]) -> worker_pb2.KVLocation:
    """`kv` carrying block ids in field 3, where KVLocation had them before it reserved it: the
    bytes an older or hostile sender would put there (the worker must ignore them)."""
    extra = bytes([3 << 3 | 2, len(block_ids), *block_ids])  # packed uint32, each < 128
    return worker_pb2.KVLocation.FromString(kv.SerializeToString() + extra)


def test_a_forged_decode_request_reads_no_other_requests_kv(cluster):
    """The finding: a decode request naming the victim's prompt length, the prefill worker's
    address, block ids [0, 1, 2], a lease token the prefill worker never issued and the
    victim's first token. Refused FAILED_PRECONDITION; none of the victim's tokens comes back."""
    p, d = cluster.workers("prefill")[0], cluster.workers("decode")[0]

    async def main():
        async with grpc.aio.insecure_channel(cluster.router.address) as rch, \
                grpc.aio.insecure_channel(d.address) as dch:
            (victim,), _ = await generate(cluster.api(rch), VICTIM, GREEDY, "victim")
            assert len(victim) == GREEDY.max_tokens
            kv = with_old_block_ids(worker_pb2.KVLocation(
                address=p.address, lease_id=secrets.token_hex(16), num_tokens=len(VICTIM),
                lease_ttl_ms=30000), [0, 1, 2])
            forged = [t % 200 + 1 for t in VICTIM[::-1]]  # same length, not the victim's
            tokens, ends = await stream(dch, decode_request("forged", forged, kv, victim[:1]))
            code, message = ended(ends, "forged")
            assert code == grpc.StatusCode.FAILED_PRECONDITION and "refused the lease" in message
            assert not tokens.get("forged")

    asyncio.run(main())


def test_a_lease_token_opens_its_blocks_once(cluster):
    """A lease's token is claimed once: the decode request that carries it decodes; the same
    token again (while that request holds it, and after it released it) is refused
    FAILED_PRECONDITION with no token sent, and so is a direct second claim."""
    p, d = cluster.workers("prefill")[0], cluster.workers("decode")[0]
    prompt = VICTIM[:23]
    slow = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    async def main():
        async with grpc.aio.insecure_channel(p.address) as pch, \
                grpc.aio.insecure_channel(d.address) as dch:
            resp = await prefill(pch, "once", prompt, slow)
            first = list(resp.first_token_ids)
            tokens, ends = await stream(
                dch, decode_request("once", prompt, resp.kv, first, slow),
                decode_request("replay-now", prompt, resp.kv, first, slow))
            assert ended(ends, "once")[0] == grpc.StatusCode.OK
            assert len(tokens["once"]) == slow.max_tokens - 1
            assert ended(ends, "replay-now")[0] == grpc.StatusCode.FAILED_PRECONDITION
            assert not tokens.get("replay-now")
            tokens, ends = await stream(dch, decode_request("replay-later", prompt, resp.kv,
                                                            first, slow))
            code, message = ended(ends, "replay-later")
            assert code == grpc.StatusCode.FAILED_PRECONDITION and "refused the lease" in message
            assert not tokens.get("replay-later")
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await worker_pb2_grpc.WorkerStub(pch).ClaimLease(
                    worker_pb2.ClaimLeaseRequest(lease_id=resp.kv.lease_id))
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION

    asyncio.run(main())


def test_only_a_claimed_lease_is_renewed(cluster):
    """RenewLeases gives each live, claimed lease a full time to live again; an unclaimed,
    unknown or released one is not renewed (0 left), and an unclaimed one stays claimable. Too
    many tokens in one call are refused naming the field."""
    p = cluster.workers("prefill")[0]

    async def main():
        async with grpc.aio.insecure_channel(p.address) as pch:
            stub = worker_pb2_grpc.WorkerStub(pch)
            claimed = (await prefill(pch, "renew-a", VICTIM[:20])).kv.lease_id
            offered = (await prefill(pch, "renew-b", VICTIM[:21])).kv.lease_id
            before = (await stub.ClaimLease(worker_pb2.ClaimLeaseRequest(lease_id=claimed))).ttl_ms

            async def renew(*ids):
                return list((await stub.RenewLeases(
                    worker_pb2.RenewLeasesRequest(lease_ids=ids))).ttl_ms)

            left = await renew(claimed, offered, secrets.token_hex(16), claimed)
            assert left[0] >= before and 110_000 < left[0] <= 120_000 and left[3] >= left[0] - 50
            assert left[1:3] == [0, 0]
            assert (await stub.ClaimLease(worker_pb2.ClaimLeaseRequest(lease_id=offered))).block_ids
            for lease in (claimed, offered):
                assert (await stub.Release(worker_pb2.ReleaseRequest(lease_id=lease))).released
            assert await renew(claimed, offered) == [0, 0]
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await renew(*[claimed] * 4097)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "lease_ids" in e.value.details()

    asyncio.run(main())


def test_a_release_if_unclaimed_leaves_a_claimed_lease_to_its_claimer(cluster):
    """Release with if_unclaimed (every release of a router's, which never claims: say of a lease
    it sent to a decode worker it then lost) releases an unclaimed lease, which no claim then
    opens, and changes nothing once a claimer holds the blocks: they stay pinned (it may be
    copying them) until the claimer's release."""
    p = cluster.workers("prefill")[0]

    async def main():
        async with grpc.aio.insecure_channel(p.address) as pch:
            stub = worker_pb2_grpc.WorkerStub(pch)
            unclaimed = (await prefill(pch, "unclaimed-a", VICTIM[:20])).kv.lease_id
            claimed = (await prefill(pch, "unclaimed-b", VICTIM[:21])).kv.lease_id
            await stub.ClaimLease(worker_pb2.ClaimLeaseRequest(lease_id=claimed))

            async def release(lease, **kw):
                return (await stub.Release(worker_pb2.ReleaseRequest(lease_id=lease,
                                                                     **kw))).released

            assert await release(unclaimed, if_unclaimed=True)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.ClaimLease(worker_pb2.ClaimLeaseRequest(lease_id=unclaimed))
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert not await release(claimed, if_unclaimed=True)
            assert await release(claimed)  # its claimer's: the lease was still live

    asyncio.run(main())


class FakePrefill(worker_pb2_grpc.WorkerServicer):
    """A prefill worker's impostor: it presents the real pool (from the real worker's Register)
    and answers every claim with the blocks it likes."""

    def __init__(self, pool: worker_pb2.PoolDescriptor) -> None:
        self.pool = pool

    async def Register(self, request, context):  # noqa: N802
        return worker_pb2.RegisterResponse(prefill_worker_id="impostor", pool=self.pool)

    async def ClaimLease(self, request, context):  # noqa: N802
        return worker_pb2.ClaimLeaseResponse(block_ids=[0, 1, 2], num_tokens=len(VICTIM),
                                             prompt_digest=prompt_digest(VICTIM), ttl_ms=60000)


def test_a_peer_presenting_another_workers_pool_is_refused(cluster):
    """A decode request naming an impostor's address: the impostor hands over the real prefill
    worker's pool handle and claims for its blocks. The decode worker maps one address per
    pool, so it refuses (FAILED_PRECONDITION) and copies nothing."""
    p, d = cluster.workers("prefill")[0], cluster.workers("decode")[0]

    async def main():
        async with grpc.aio.insecure_channel(cluster.router.address) as rch, \
                grpc.aio.insecure_channel(p.address) as pch, \
                grpc.aio.insecure_channel(d.address) as dch:
            (victim,), _ = await generate(cluster.api(rch), VICTIM, GREEDY)  # D maps P's pool
            real = await worker_pb2_grpc.WorkerStub(pch).Register(worker_pb2.RegisterRequest(
                decode_worker_id="probe", layout=worker_pb2.PoolDescriptor(
                    dtype="float32", block_size=16, num_layers=2, num_kv_heads=2, head_dim=64)))
            server = grpc.aio.server()
            worker_pb2_grpc.add_WorkerServicer_to_server(FakePrefill(real.pool), server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            try:
                kv = worker_pb2.KVLocation(address=f"127.0.0.1:{port}",
                                           lease_id=secrets.token_hex(16))
                tokens, ends = await stream(dch, decode_request("impostor", VICTIM, kv,
                                                                victim[:1]))
            finally:
                await server.stop(None)
            code, message = ended(ends, "impostor")
            assert code == grpc.StatusCode.FAILED_PRECONDITION and "KV pool of another" in message
            assert not tokens.get("impostor")

    asyncio.run(main())


def test_a_bad_decode_request_fails_alone(cluster):
    """Decode requests with a bad id or length, each carrying a live lease of its own, sent to
    the decode worker while four requests stream there: each is refused INVALID_ARGUMENT naming
    its field; the four finish with every token; every lease is released at once."""
    p, d = cluster.workers("prefill")[0], cluster.workers("decode")[0]
    long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    prompt = VICTIM[:20]
    other = [t % 200 + 1 for t in prompt[::-1]]
    cases = {  # request id: (field named, change to a good request)
        "oov-first": ("first_token_ids", dict(first=[5000])),
        "oov-prompt": ("prompt_token_ids", dict(prompt=[*prompt[:-1], 5000])),
        "two-firsts": ("first_token_ids", dict(first=[7, 7])),
        "not-the-lease-prompt": ("prompt_token_ids", dict(prompt=other)),
        "shorter-prompt": ("prompt_token_ids", dict(prompt=prompt[:-1])),
        "n-too-large": ("n", dict(params=SamplingParams(n=1000, max_tokens=4))),
        "no-lease": ("kv", dict(kv=worker_pb2.KVLocation())),
    }

    async def main():
        async with grpc.aio.insecure_channel(cluster.router.address) as rch, \
                grpc.aio.insecure_channel(p.address) as pch, \
                grpc.aio.insecure_channel(d.address) as dch:
            api = cluster.api(rch)
            calls = [api.Generate(api_pb2.GenerateRequest(
                token_ids=api_pb2.TokenIds(ids=[i + 5] * (8 + i)), params=params_to_proto(long)))
                for i in range(4)]
            for call in calls:
                await call.read()  # streaming on the decode worker
            bad = []
            for rid, (_, change) in cases.items():
                resp = await prefill(pch, rid, prompt)  # a live lease for each
                args = dict(prompt=prompt, kv=resp.kv, first=list(resp.first_token_ids),
                            params=GREEDY) | change
                bad.append(decode_request(rid, **args))
                if "kv" in change:  # not handed to anyone: the test releases it
                    await worker_pb2_grpc.WorkerStub(pch).Release(
                        worker_pb2.ReleaseRequest(lease_id=resp.kv.lease_id))
            tokens, ends = await stream(dch, *bad)
            for rid, (field, _) in cases.items():
                code, message = ended(ends, rid)
                assert code == grpc.StatusCode.INVALID_ARGUMENT and message.startswith(field), \
                    (rid, code, message)
                assert not tokens.get(rid)
            for call in calls:
                n, reason = 1, ""
                while (chunk := await call.read()) is not grpc.aio.EOF:
                    n += len(chunk.token_ids)
                    reason = chunk.finish_reason or reason
                assert (n, reason) == (long.max_tokens, "length")
            await cluster.wait_idle(timeout=IDLE_S)

    asyncio.run(main())


def test_repeated_request_ids_release_what_they_took(cluster):
    """Twenty requests with one request id at once through the router: one runs, the others are
    refused INVALID_ARGUMENT; the id is free again once it ended. On a decode worker's Stream
    call, a second request with the id of one in flight is refused and its lease released.
    Every pool is idle within seconds, though leases live 120 s."""
    p, d = cluster.workers("prefill")[0], cluster.workers("decode")[0]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)

    async def main():
        async with grpc.aio.insecure_channel(cluster.router.address) as rch, \
                grpc.aio.insecure_channel(p.address) as pch, \
                grpc.aio.insecure_channel(d.address) as dch:
            api = cluster.api(rch)
            results = await asyncio.gather(*(generate(api, VICTIM[i:i + 30], params, "dup")
                                             for i in range(20)), return_exceptions=True)
            refused = [r for r in results if isinstance(r, BaseException)]
            done = [r for r in results if not isinstance(r, BaseException)]
            assert refused and done, results
            assert all(isinstance(r, grpc.aio.AioRpcError)
                       and r.code() == grpc.StatusCode.INVALID_ARGUMENT
                       and "request_id" in r.details() for r in refused), refused
            assert all(len(tokens[0]) == params.max_tokens for tokens, _ in done)
            await cluster.wait_idle(timeout=IDLE_S)
            again, _ = await generate(api, VICTIM[:9], params, "dup")
            assert len(again[0]) == params.max_tokens

            a, b = await prefill(pch, "twin", VICTIM[:18]), await prefill(pch, "twin", VICTIM[:9])
            # The second twin goes out once the first is decoding (a token of it came back),
            # and the first, far from its end, is cancelled once the second was refused: the
            # order is the events', not a race between the two messages and 30 decode steps.
            long = SamplingParams(temperature=0, max_tokens=HOLD_TOKENS, ignore_eos=True)
            decoding, refused = asyncio.Event(), asyncio.Event()

            async def twins():
                yield decode_request("twin", VICTIM[:18], a.kv, list(a.first_token_ids), long)
                await decoding.wait()
                yield decode_request("twin", VICTIM[:9], b.kv, list(b.first_token_ids), params)
                await refused.wait()
                yield worker_pb2.StreamRequest(cancel="twin")

            call = worker_pb2_grpc.WorkerStub(dch).Stream(twins())
            got, ends = 0, []
            async for msg in call:
                got += sum(n for rid, n in zip(msg.tokens.request_id, msg.tokens.num_tokens)
                           if rid == "twin")
                if got:
                    decoding.set()
                ends += [u for u in msg.updates if u.done and u.request_id == "twin"]
                if ends:
                    refused.set()
            assert await call.code() == grpc.StatusCode.OK
            # The refusal is the only end: the first was cancelled (by this caller, who knows).
            assert [status(u).name for u in ends] == ["INVALID_ARGUMENT"], ends
            assert "request_id" in ends[0].error_message
            assert 0 < got < long.max_tokens - 1
            await cluster.wait_idle(timeout=IDLE_S)

    asyncio.run(main())


def test_a_worker_abort_ends_the_stream(cluster):
    """Abort on the decode worker, mid-stream: the request's stream ends ABORTED (through the
    router to the client), it does not hang; its blocks are freed."""
    d = cluster.workers("decode")[0]
    long = SamplingParams(temperature=0, max_tokens=HOLD_TOKENS, ignore_eos=True)

    async def main():
        async with grpc.aio.insecure_channel(cluster.router.address) as rch, \
                grpc.aio.insecure_channel(d.address) as dch:
            call = cluster.api(rch).Generate(api_pb2.GenerateRequest(
                token_ids=api_pb2.TokenIds(ids=VICTIM[:12]), request_id="to-abort",
                params=params_to_proto(long)))
            for _ in range(3):
                await call.read()
            resp = await worker_pb2_grpc.WorkerStub(dch).Abort(
                worker_pb2.AbortRequest(request_id="to-abort"))
            assert resp.aborted

            async def drain():
                while await call.read() is not grpc.aio.EOF:
                    pass

            with pytest.raises(grpc.aio.AioRpcError) as e:
                await asyncio.wait_for(drain(), 60)  # a guard against a hang, not a window
            assert e.value.code() == grpc.StatusCode.ABORTED, e.value.details()
            assert "aborted" in e.value.details()

    asyncio.run(main())


def test_huge_counts_are_refused_before_any_work(cluster):
    """Values that would each make the worker build something of their size, sent on a decode
    worker's Stream call and to the prefill worker: n = 2**32 - 1 (a list of four billion
    finish reasons for the request's log line; the worker was wedged for minutes at 7 GB),
    request ids and lease tokens of megabytes, a trace context of 10,000 entries. Each is refused
    INVALID_ARGUMENT naming its field, and both workers answer at once afterwards."""
    p, d = cluster.workers("prefill")[0], cluster.workers("decode")[0]
    prompt = VICTIM[:20]
    huge_n = SamplingParams(n=2**32 - 1, max_tokens=4)

    async def main():
        async with grpc.aio.insecure_channel(p.address) as pch, \
                grpc.aio.insecure_channel(d.address) as dch:
            kv = (await prefill(pch, "huge-n", prompt)).kv
            traced = decode_request("huge-trace", prompt, kv, [5])
            traced.trace_context.update({f"k{i}": "v" for i in range(10_000)})
            cases = {  # request id as it comes back: (field named, the message)
                "huge-n": ("n", decode_request("huge-n", prompt, kv, [5], huge_n)),
                "huge-trace": ("trace_context", traced),
                "x" * 160: ("request_id", decode_request("x" * 2_000_000, prompt, kv, [5])),
                "huge-lease": ("kv.lease_id", decode_request("huge-lease", prompt,
                                                             worker_pb2.KVLocation(
                                                                 address=p.address,
                                                                 lease_id="f" * 2_000_000),
                                                             [5])),
            }
            tokens, ends = await stream(dch, *(msg for _, msg in cases.values()))
            for rid, (field, _) in cases.items():
                code, message = ended(ends, rid)
                assert code == grpc.StatusCode.INVALID_ARGUMENT and message.startswith(field), \
                    (rid[:20], code, message[:200])
                assert not tokens.get(rid)
            stub = worker_pb2_grpc.WorkerStub(pch)
            for call, field in ((stub.ClaimLease(worker_pb2.ClaimLeaseRequest(
                                    lease_id="f" * 2_000_000)), "lease_id"),
                                (stub.RenewLeases(worker_pb2.RenewLeasesRequest(
                                    lease_ids=["f" * 1_000_000] * 4)), "lease_ids"),
                                (stub.Prefill(worker_pb2.PrefillRequest(
                                    request_id="r" * 2_000_000, prompt_token_ids=prompt)),
                                 "request_id"),
                                (stub.Prefill(worker_pb2.PrefillRequest(
                                    request_id="long", prompt_token_ids=[5] * 1_000_000)),
                                 "prompt_token_ids")):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
                assert e.value.details().startswith(field), e.value.details()[:200]
            for ch in (pch, dch):  # both still answer, at once
                await worker_pb2_grpc.WorkerStub(ch).GetLoad(worker_pb2.GetLoadRequest(),
                                                             timeout=10)

    asyncio.run(main())
