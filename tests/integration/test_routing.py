"""Routing over 2 prefill and 2 decode workers: prefix affinity, load spreading, a killed worker
taken out while new requests succeed, and a full router answering RESOURCE_EXHAUSTED fast."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable

import grpc
import httpx
import pytest

from cluster import HOLD_TOKENS, HOLD_WORKER_ARGS, Cluster, Handed, stop_cleanly
from tandem.engine.sampling_params import SamplingParams
from tandem.runtime.convert import params_to_proto
from tandem.v1 import api_pb2

WORKER_ARGS = ["--num-blocks", "512", "--max-num-batched-tokens", "256"]
PREFIX = [(17 * j) % 250 + 1 for j in range(64)]  # 4 full blocks


def request(prompt, params):
    return api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompt),
                                   params=params_to_proto(params))


async def generate(stub, prompt, params, timeout=30):
    chunks = [c async for c in stub.Generate(request(prompt, params), timeout=timeout)]
    return chunks


async def router_view(cluster: Cluster, addresses: set[str]) -> list[dict]:
    """Those workers as the router sees them (its /workers)."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{cluster.router.http_port}") as h:
        return [w for w in (await h.get("/workers")).json()["workers"]
                if w["address"] in addresses]


async def until_router_sees(cluster: Cluster, addresses: set[str],
                            seen: Callable[[list[dict]], bool]) -> None:
    """Until `seen` holds of those workers as the router sees them (a bound of 60 s, for a
    failure to read: the router polls its workers every 0.5 s)."""
    deadline = time.monotonic() + 60
    while not seen(workers := await router_view(cluster, addresses)):
        assert time.monotonic() < deadline, workers
        await asyncio.sleep(0.05)


async def in_flight_on(cluster: Cluster, addresses: set[str], count: int) -> None:
    """Until the router counts `count` requests in flight on those workers (nothing else
    holds them)."""
    await until_router_sees(cluster, addresses,
                            lambda ws: sum(w["in_flight"] for w in ws) >= count)


@pytest.fixture(scope="module")
def stacks(tiny_models, tmp_path_factory):
    """2P+2D stacks: the affinity test uses one and leaves it idle; the test that kills workers
    takes it after (or a fresh one, run alone). --max-migrations 0: a stream whose decode worker
    dies fails (test_faults.py has them move), and says why. --lease-ttl 3: a decode worker
    killed after its pull and before its Release reached the prefill worker leaves that lease
    claimed, freed when it expires (as in test_faults.py), well within wait_idle's bound."""
    def start() -> Cluster:
        return Cluster(tmp_path_factory.mktemp("routing"), str(tiny_models["llama"]),
                       prefill=2, decode=2, worker_args=WORKER_ARGS,
                       prefill_args=["--lease-ttl", "3"],
                       router_args=["--max-migrations", "0"]).start()

    stacks = Handed(start, stop_cleanly)
    yield stacks
    stacks.close()


def test_prefix_affinity_and_spread(stacks):
    cluster = stacks.get()
    params = SamplingParams(temperature=0, max_tokens=4)

    async def main():
        async with grpc.aio.insecure_channel(cluster.router.address) as ch:
            stub = cluster.api(ch)
            before = [await cluster.load(p) for p in cluster.workers("prefill")]
            # Requests sharing a 64-token prefix: after the first, all hit its cached blocks,
            # which only one of the two prefill workers holds.
            shared = [await generate(stub, [*PREFIX, 200 + i, 7], params) for i in range(8)]
            # Distinct prompts sent together spread over both prefill workers. "Together" is
            # made sure of: both prefill workers' engine cores are held still (SIGSTOP) until
            # the router has all 16 in flight (its /workers), so each pick sees the ones before
            # it however slow this machine is (a prefill done before the next request reached
            # the router would leave both workers equally idle again: ties go to the first).
            distinct = [[(31 * i + 7 * j) % 250 + 1 for j in range(40)] for i in range(16)]
            prefill = cluster.workers("prefill")
            cores = [cluster.engine_core(p.name) for p in prefill]
            for core in cores:
                os.kill(core, signal.SIGSTOP)
            try:
                sent = [asyncio.create_task(generate(
                    stub, p, SamplingParams(temperature=0, max_tokens=24))) for p in distinct]
                await in_flight_on(cluster, {p.address for p in prefill}, len(distinct))
            finally:
                for core in cores:
                    os.kill(core, signal.SIGCONT)
            await asyncio.gather(*sent)
            loads = [await cluster.load(p) for p in prefill]
            return shared, before, loads

    shared, before, loads = asyncio.run(main())
    cached = [chunks[-1].usage.cached_prompt_tokens for chunks in shared]
    assert cached[0] == 0 and all(c == 64 for c in cached[1:]), cached
    # What this test sent, whatever the workers served before it.
    hits = [ld.prefix_cache_hits - b.prefix_cache_hits for ld, b in zip(loads, before)]
    assert sorted(h >= 7 * 4 for h in hits) == [False, True], hits  # one worker got them all
    served = [ld.num_requests - b.num_requests for ld, b in zip(loads, before)]
    assert sum(served) == 24 and min(served) >= 4, served  # the distinct ones spread
    asyncio.run(cluster.wait_idle())


@pytest.fixture
def spent(stacks):
    """The module's stack, its last user: this test kills workers; stopped at the end."""
    c = stacks.take()
    yield c
    c.stop()


def test_killed_workers_are_taken_out(spent):
    cluster = spent
    long = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)  # within 1024
    short = SamplingParams(temperature=0, max_tokens=8)

    async def main():
        async with grpc.aio.insecure_channel(cluster.router.address) as ch:
            stub = cluster.api(ch)
            # The router's view of the decode workers idle first: its polls lag the last test's
            # end by up to 0.5 s, and a worker it still saw running that test's requests would
            # lose every pick of the burst below. From an idle view each pick sees the ones
            # before it (in flight), and both workers get some of the six streams.
            decode = {p.address: p.name for p in cluster.workers("decode")}
            await until_router_sees(cluster, set(decode), lambda ws: all(
                w["in_flight"] == w["running"] == w["waiting"] == 0 for w in ws))
            calls = [stub.Generate(request([i + 1] * 20, long)) for i in range(6)]
            for call in calls:  # its first token, then its decode worker's first
                await call.read()
                await call.read()
            loads = {decode[w["address"]]: w["in_flight"]
                     for w in await router_view(cluster, set(decode))}
            assert all(n > 0 for n in loads.values()), f"streams not spread: {loads}"
            victim = max(loads, key=loads.get)
            cluster.kill(victim)

            async def outcome(call):
                """How a stream ends: "done", or the status it failed with."""
                try:
                    while await call.read() is not grpc.aio.EOF:
                        pass
                    return "done"
                except grpc.aio.AioRpcError as e:
                    assert "--max-migrations 0" in e.details(), e.details()
                    return e.code()

            # In-flight requests on the dead worker end UNAVAILABLE, the others run to their
            # end (1,000 tokens each: still running at the kill, which follows the load check).
            outcomes = await asyncio.gather(*(outcome(call) for call in calls))
            assert grpc.StatusCode.UNAVAILABLE in outcomes, (outcomes, loads)
            assert "done" in outcomes, (outcomes, loads)
            # New requests succeed at once: one that goes to the dead worker before the router
            # has seen it gone is retried on the other before its first decode token.
            results = await asyncio.gather(*(generate(stub, [9, i + 1, 3], short)
                                             for i in range(8)))
            assert all(r[-1].finish_reason in ("length", "stop") for r in results)
            # A prefill worker killed too: its requests are retried on the other before any
            # token was sent, so none fails.
            cluster.kill("prefill0")
            results = await asyncio.gather(*(generate(stub, [11, i + 1, 5], short)
                                             for i in range(8)))
            assert all(r[-1].finish_reason in ("length", "stop") for r in results)

    asyncio.run(main())
    asyncio.run(cluster.wait_idle(procs=[p for p in cluster.workers()
                                         if p.popen.poll() is None]))


def test_full_router_answers_resource_exhausted(tiny_llama_long, tmp_path):
    # Streams cancelled right after their first token, while their KV may be in flight: the
    # decode worker releases every lease at once (wait_idle's 20 s is within the default 30 s
    # lease, so expiry cannot be what frees them).
    c = Cluster(tmp_path, str(tiny_llama_long), worker_args=HOLD_WORKER_ARGS,
                router_args=["--http-port", "-1", "--max-requests", "2"]).start()
    try:
        long = SamplingParams(temperature=0, max_tokens=HOLD_TOKENS, ignore_eos=True)

        async def main():
            async with grpc.aio.insecure_channel(c.router.address) as ch:
                stub = c.api(ch)
                calls = [stub.Generate(request([i + 1] * 10, long)) for i in range(2)]
                for call in calls:
                    await call.read()
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await generate(stub, [1, 2, 3], SamplingParams(max_tokens=4))
                assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert dict(e.value.trailing_metadata() or ()).get("retry-after") == "1"
                for call in calls:
                    call.cancel()
                # Room again once the router has seen the cancels: a request goes through
                # (retried after each refusal, as Retry-After asks, not after a fixed wait).
                deadline = time.monotonic() + 30
                while True:
                    try:
                        ok = await generate(stub, [1, 2, 3], SamplingParams(max_tokens=4))
                        break
                    except grpc.aio.AioRpcError as e:
                        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                        assert time.monotonic() < deadline, "the cancelled calls never left"
                        await asyncio.sleep(0.05)
                assert ok[-1].finish_reason

        asyncio.run(main())
        asyncio.run(c.wait_idle())
    finally:
        c.stop()
