"""Router, prefill and decode as separate processes on 127.0.0.1 with the shm transport:
outputs equal the offline engine's, and every pool ends idle whatever happens to a request."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest

from cluster import (
    HOLD_BLOCKS,
    HOLD_TOKENS,
    HOLD_WORKER_ARGS,
    WORKER_ARGS,
    Cluster,
    Handed,
    stop_cleanly,
)
from tandem.engine.sampling_params import SamplingParams
from tandem.runtime.convert import params_to_proto
from tandem.v1 import api_pb2, worker_pb2, worker_pb2_grpc

PROMPTS = [[(13 * i + 7 * j) % 250 + 1 for j in range(4 + 9 * i)] for i in range(16)]
# Long enough that a decode worker on a loaded machine claims its lease in time, short enough
# that a test waits for one to expire.
LEASE_TTL = "8"


@pytest.fixture(scope="module")
def cluster(tiny_llama_long, tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("disagg"), str(tiny_llama_long),
                worker_args=HOLD_WORKER_ARGS, prefill_args=["--lease-ttl", LEASE_TTL],
                router_args=["--http-port", "-1"]).start()
    yield c
    codes = c.stop()
    assert all(code == 0 for code in codes.values()), codes


@pytest.fixture(autouse=True)
def idle_after(cluster):
    yield
    asyncio.run(cluster.wait_idle())


@pytest.fixture(scope="module")
def short_leases(tiny_llama_long, tmp_path_factory):
    """Stacks whose prefill leases live 3 s: the lease-expiry test reads one first (it waits
    out a lease), then the first kill test takes it, as its last user."""
    def start() -> Cluster:
        return Cluster(tmp_path_factory.mktemp("short-lease"), str(tiny_llama_long),
                       worker_args=HOLD_WORKER_ARGS, prefill_args=["--lease-ttl", "3"],
                       router_args=["--http-port", "-1"]).start()

    stacks = Handed(start, stop_cleanly)
    yield stacks
    stacks.close()


@pytest.fixture
def expiring(short_leases):
    """The stack the lease-expiry test waits on, idle after it."""
    c = short_leases.get()
    yield c
    asyncio.run(c.wait_idle())


async def generate(stub, prompt, params: SamplingParams, timeout=None):
    """Token ids per sample and the finish reasons, from the public API."""
    req = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompt),
                                  params=params_to_proto(params))
    tokens: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    async for chunk in stub.Generate(req, timeout=timeout):
        tokens.setdefault(chunk.index, []).extend(chunk.token_ids)
        if chunk.finish_reason:
            reasons[chunk.index] = chunk.finish_reason
    return [tokens[i] for i in sorted(tokens)], reasons


def test_greedy_16_concurrent_match_offline(cluster, offline):
    params = SamplingParams(temperature=0, max_tokens=24)
    expected = [o.outputs[0].token_ids for o in offline.generate(PROMPTS, params)]

    async def main():
        async with grpc.aio.insecure_channel(cluster.router.address) as ch:
            stub = cluster.api(ch)
            return await asyncio.gather(*(generate(stub, p, params) for p in PROMPTS))

    results = asyncio.run(main())
    assert [r[0][0] for r in results] == expected


def test_seeded_sampling_and_n3_match_colocated(cluster, offline):
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=77, max_tokens=16)
    n3 = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    exp_seeded = [o.token_ids for o in offline.generate([PROMPTS[3]], seeded)[0].outputs]
    exp_n3 = [o.token_ids for o in offline.generate([PROMPTS[5]], n3)[0].outputs]

    async def main():
        async with grpc.aio.insecure_channel(cluster.router.address) as ch:
            stub = cluster.api(ch)
            return await asyncio.gather(generate(stub, PROMPTS[3], seeded),
                                        generate(stub, PROMPTS[5], n3))

    (got_seeded, _), (got_n3, reasons) = asyncio.run(main())
    assert got_seeded == exp_seeded
    assert got_n3 == exp_n3 and len(got_n3) == 3 and reasons == {0: "length", 1: "length",
                                                                  2: "length"}


def test_client_cancel_mid_stream_frees_everything(cluster):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        async with grpc.aio.insecure_channel(cluster.router.address) as ch:
            stub = cluster.api(ch)
            calls = []
            for p in PROMPTS[:6]:
                call = stub.Generate(api_pb2.GenerateRequest(
                    token_ids=api_pb2.TokenIds(ids=p), params=params_to_proto(params)))
                calls.append(call)
            for i, call in enumerate(calls):
                # Half are cancelled right after the first token (the KV is being handed to
                # the decode worker), half after several decode steps.
                for _ in range(1 if i % 2 else 6):
                    await call.read()
                call.cancel()
            await asyncio.sleep(0.2)

    asyncio.run(main())


def test_deadline_mid_stream(cluster):
    """The decode worker's engine core held still (SIGSTOP) from the start: the prompt is
    prefilled, its decode cannot end before the deadline however fast the machine, the call
    ends DEADLINE_EXCEEDED, and once continued the core frees it (the fixture checks idle)."""
    params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    core = cluster.engine_core("decode0")

    async def main():
        async with grpc.aio.insecure_channel(cluster.router.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await generate(cluster.api(ch), PROMPTS[8], params, timeout=2.0)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    os.kill(core, signal.SIGSTOP)
    try:
        asyncio.run(main())
    finally:
        os.kill(core, signal.SIGCONT)


def test_decode_side_never_pulls_lease_expires(expiring):
    """A prefill whose KV nobody pulls: the lease (3 s here) expires and the blocks return.
    A release that comes after that is ignored, not an error."""
    cluster = expiring
    p = cluster.workers("prefill")[0]

    async def main():
        async with grpc.aio.insecure_channel(p.address) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            resp = await stub.Prefill(worker_pb2.PrefillRequest(
                request_id="orphan", prompt_token_ids=PROMPTS[10],
                params=params_to_proto(SamplingParams(temperature=0, max_tokens=8))))
            load = await stub.GetLoad(worker_pb2.GetLoadRequest())
            assert load.num_leases == 1 and resp.kv.num_tokens == len(PROMPTS[10])
            assert load.num_blocks - load.num_free_blocks == -(len(PROMPTS[10]) // -16)
            t0 = time.monotonic()
            await cluster.wait_idle(timeout=24, procs=[p])  # a bound, eight lifetimes
            assert time.monotonic() - t0 > 1.0  # it was the lease that ended it
            assert "expired unreleased" in p.log_text()
            late = await stub.Release(worker_pb2.ReleaseRequest(lease_id=resp.kv.lease_id))
            assert late.released is False
            unknown = await stub.Release(worker_pb2.ReleaseRequest(lease_id="no-such-lease"))
            assert unknown.released is False

    asyncio.run(main())


def test_decode_request_cancelled_before_it_ran_releases_the_lease_at_once(cluster):
    """On a decode worker's Stream call a cancel follows its request in order, so the worker
    always sees the request it cancels: a request cancelled right after it was sent (before its
    task ran, or while it claims, waits or decodes: the cancel may be read late on a busy
    machine, so the request asks for HOLD_TOKENS and cannot be done by then)
    sends no update and releases the prefill side's lease now, not at the lease's expiry
    (LEASE_TTL here). Requests of the wrong kind or a reused id are refused by status; closing
    the call's sending side ends the call once its requests are done."""
    p, d = cluster.workers("prefill")[0], cluster.workers("decode")[0]
    params = params_to_proto(SamplingParams(temperature=0, max_tokens=8))
    endless = params_to_proto(SamplingParams(temperature=0, ignore_eos=True,
                                             max_tokens=HOLD_TOKENS))
    expired_before = p.log_text().count("expired unreleased")

    async def main():
        async with grpc.aio.insecure_channel(p.address) as pch, \
                grpc.aio.insecure_channel(d.address) as dch:
            resp = await worker_pb2_grpc.WorkerStub(pch).Prefill(worker_pb2.PrefillRequest(
                request_id="cancelled-early", prompt_token_ids=PROMPTS[11], params=endless))
            decode = worker_pb2.DecodeRequest(
                request_id="cancelled-early", prompt_token_ids=PROMPTS[11], params=endless,
                kv=resp.kv, first_token_ids=resp.first_token_ids)
            call = worker_pb2_grpc.WorkerStub(dch).Stream(iter([
                worker_pb2.StreamRequest(decode=decode),
                worker_pb2.StreamRequest(cancel="cancelled-early"),
                worker_pb2.StreamRequest(generate=worker_pb2.GenerateOnWorkerRequest(
                    request_id="wrong-kind", prompt_token_ids=[1, 2], params=params))]))
            updates = [u async for m in call for u in m.updates]
            assert await call.code() == grpc.StatusCode.OK
            assert [(u.request_id, grpc.StatusCode.FAILED_PRECONDITION.value[0])
                    for u in updates] == [("wrong-kind", u.error_code) for u in updates], \
                [(u.request_id, u.error_message) for u in updates]
            assert "has role decode" in updates[0].error_message and updates[0].done
            await cluster.wait_idle(timeout=10)
            # Released by the decode worker: the prefill worker saw no lease expire meanwhile.
            assert p.log_text().count("expired unreleased") == expired_before

    asyncio.run(main())


def test_registration_with_a_different_layout_is_refused(cluster):
    p = cluster.workers("prefill")[0]

    async def main():
        async with grpc.aio.insecure_channel(p.address) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            ok = await stub.Register(worker_pb2.RegisterRequest(
                decode_worker_id="probe", layout=worker_pb2.PoolDescriptor(
                    dtype="float32", block_size=16, num_layers=2, num_kv_heads=2, head_dim=64)))
            assert ok.pool.transport == "shm" and ok.pool.num_blocks == HOLD_BLOCKS
            for field, bad in [("block_size", 32), ("head_dim", 128), ("dtype", "bfloat16"),
                               ("num_layers", 4), ("num_kv_heads", 8)]:
                layout = dict(dtype="float32", block_size=16, num_layers=2, num_kv_heads=2,
                              head_dim=64)
                layout[field] = bad
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Register(worker_pb2.RegisterRequest(
                        decode_worker_id="probe", layout=worker_pb2.PoolDescriptor(**layout)))
                assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert field in e.value.details()

    asyncio.run(main())


def test_bad_input_is_refused_before_any_block(cluster):
    async def main():
        async with grpc.aio.insecure_channel(cluster.router.address) as ch:
            stub = cluster.api(ch)
            cases = [
                (api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=[])), "prompt"),
                (api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=[1, 99999])), "prompt"),
                (api_pb2.GenerateRequest(text="hi", params=params_to_proto(
                    SamplingParams(max_tokens=4)).__class__(max_tokens=4, top_p=1.5)), "top_p"),
                (api_pb2.GenerateRequest(text="hi", params=params_to_proto(
                    SamplingParams()).__class__(temperature=-1)), "temperature"),
            ]
            for req, field in cases:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await generate_raw(stub, req)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
                assert field in e.value.details()

    asyncio.run(main())


async def generate_raw(stub, req):
    return [c async for c in stub.Generate(req)]


@pytest.mark.parametrize("victim", ["worker", "engine core"])
def test_decode_worker_or_its_engine_core_killed_mid_stream(short_leases, victim):
    """SIGKILL mid-stream, to the decode worker or to its engine core: its requests fail
    UNAVAILABLE and the prefill pool is idle again (released after the pulls). A killed worker
    takes its core with it (nothing left holding the pool or a GPU); a worker whose core died
    exits 1, for its supervisor to restart it."""
    c = short_leases.take()  # killed here: its last user
    try:
        params = SamplingParams(temperature=0, max_tokens=HOLD_TOKENS, ignore_eos=True)

        async def main():
            async with grpc.aio.insecure_channel(c.router.address) as ch:
                calls = await c.streams_under_way(ch, PROMPTS[:4], params)
                core = c.engine_core("decode0")
                if victim == "worker":
                    c.kill("decode0")
                else:
                    os.kill(core, signal.SIGKILL)
                for call in calls:
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        while (await call.read()) is not grpc.aio.EOF:
                            pass
                    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
                await c.wait_idle(procs=c.workers("prefill"))
                await wait_gone(core)

        asyncio.run(main())
        if victim == "engine core":
            assert c.procs["decode0"].popen.wait(30) == 1
            logs = c.procs["decode0"].json_logs()
            assert any("engine core exited" in line["event"] for line in logs)
    finally:
        c.stop()


async def wait_gone(pid: int, timeout: float = 10.0) -> None:
    """Until process `pid` has exited (gone, or a zombie nobody reaped yet)."""
    deadline = time.monotonic() + timeout
    while _state(pid) != "Z":
        assert time.monotonic() < deadline, f"process {pid} still alive"
        await asyncio.sleep(0.05)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def test_a_decode_leg_that_fails_before_its_first_token_goes_to_another_decode_worker(
        tiny_models, offline, tmp_path):
    """A decode worker gone before the router notices (it polls every 60 s here): the decode
    leg that reaches it fails UNAVAILABLE before any token, and the router prefills again and
    decodes on the other worker, carrying the first tokens the client already has. Every
    request's output is what the offline engine gives, greedy and seeded n=2 alike. The failed
    leg's lease went out with its request to the dead worker, which never releases it: the
    router does, at once, not the lease's 30 s later."""
    c = Cluster(tmp_path, str(tiny_models["llama"]), decode=2, worker_args=WORKER_ARGS,
                router_args=["--http-port", "-1", "--poll-interval", "60"]).start()
    try:
        greedy = SamplingParams(temperature=0, max_tokens=16)
        seeded = SamplingParams(n=2, temperature=0.8, seed=11, max_tokens=12, ignore_eos=True)
        jobs = [(p, greedy) for p in PROMPTS[:5]] + [(PROMPTS[6], seeded)]
        expected = [[o.token_ids for o in offline.generate([p], params)[0].outputs]
                    for p, params in jobs]
        c.kill("decode0")
        c.procs["decode0"].popen.wait(10)

        async def main():
            async with grpc.aio.insecure_channel(c.router.address) as ch:
                stub = c.api(ch)
                results = await asyncio.gather(*(generate(stub, p, params)
                                                 for p, params in jobs))
                # Released by the router (the default lease lives 30 s): none expired.
                await c.wait_idle(timeout=15, procs=c.workers("prefill"))
                assert "expired unreleased" not in c.procs["prefill0"].log_text()
                return results

        results = asyncio.run(main())
        assert [tokens for tokens, _ in results] == expected
        events = [line["event"] for line in c.procs["router"].json_logs()]
        assert any("prefilling again" in e for e in events), events[-20:]
    finally:
        c.stop()
