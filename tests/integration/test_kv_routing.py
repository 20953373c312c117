"""Multi-turn conversations over real workers on 127.0.0.1 (shm): a second turn pulls only its
new blocks (counted by the decode workers), an eviction on one prefill worker reaches the
router's map through that worker's KV events and the next turn goes where the prefix still is,
and a decode worker restarted with an empty cache serves the next turn by pulling everything;
a router started with another routing policy (least-loaded) ignores the caches.

The router here is a WorkerSet and an Orchestrator in this process (the ones `tandem router`
runs), so that a test can wait on the router's own map (KVIndex.wait_for) rather than a clock.
Pools are idle after each test."""

from __future__ import annotations

import asyncio
import signal

import grpc
import pytest

from cluster import Cluster
from tandem.engine.config import cdiv
from tandem.engine.sampling_params import SamplingParams
from tandem.router_svc.orchestrator import Orchestrator
from tandem.router_svc.workers import WorkerSet
from tandem.runtime.convert import params_to_proto
from tandem.v1 import api_pb2, worker_pb2, worker_pb2_grpc

BS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
FIRST = [(7 * i + 3) % 250 + 1 for i in range(40)]  # 2 full blocks + 8
NEW = [(11 * i + 5) % 250 + 1 for i in range(30)]


@pytest.fixture(scope="module")
def cluster(tiny_models, tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("kvroute"), str(tiny_models["llama"]), prefill=2,
                decode=2, worker_args=["--max-num-batched-tokens", "256"],
                prefill_args=["--num-blocks", "40"], decode_args=["--num-blocks", "128"],
                router_args=["--http-port", "-1"]).start()
    yield c
    codes = c.stop()
    assert all(code == 0 for code in codes.values()), codes


async def router(cluster: Cluster) -> tuple[WorkerSet, Orchestrator]:
    """A router's WorkerSet and Orchestrator over the cluster's workers, polled by hand."""
    ws = WorkerSet([p.address for p in cluster.workers("prefill")],
                   [d.address for d in cluster.workers("decode")], [])
    await ws.poll_once()  # every worker answers; their KV events start
    return ws, Orchestrator(ws, max_migrations=3)


async def turn(orch: Orchestrator, rid: str, prompt: list[int]) -> tuple[list[int], int]:
    """The output tokens, and the prompt tokens the prefill worker had cached."""
    tokens, cached = [], None
    async for u in orch.run(rid, prompt, GREEDY, timeout=120):
        cached = u.num_cached_tokens if cached is None else cached
        for s in u.samples:
            tokens += s.token_ids
    return tokens, cached


async def pulled(cluster: Cluster) -> int:
    return sum([(await cluster.load(d)).kv_blocks_pulled for d in cluster.workers("decode")])


async def until(ws: WorkerSet, predicate) -> None:
    """Wait for the router's map to satisfy `predicate` (re-checked at each change); the bound
    only turns a hang into a failure."""
    async with asyncio.timeout(120):
        await ws.kv_index.wait_for(predicate)


async def holds(ws: WorkerSet, role: str, prompt: list[int], blocks: int) -> None:
    """Wait until the router's map shows a `role` worker holding the prompt's first blocks."""
    hashes = ws.prefix_hashes(prompt)[:blocks]
    ws_role = ws.by_role(role)
    await until(ws, lambda: max(ws.cached_blocks(ws_role, hashes).values()) >= blocks)


async def direct_prefill(address: str, rid: str, prompt: list[int]) -> None:
    """A prefill run straight on one worker, its lease released: the prompt's full blocks stay
    in that worker's prefix cache."""
    async with grpc.aio.insecure_channel(address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        resp = await stub.Prefill(worker_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=prompt, params=params_to_proto(GREEDY)), timeout=60)
        await stub.Release(worker_pb2.ReleaseRequest(lease_id=resp.kv.lease_id), timeout=10)


def test_second_turn_pulls_only_its_new_blocks(cluster):
    async def main():
        ws, orch = await router(cluster)
        try:
            before = await pulled(cluster)
            out1, _ = await turn(orch, "conv-1", FIRST)
            first_pull = await pulled(cluster) - before
            second = FIRST + out1 + NEW
            kept = (len(FIRST) + len(out1) - 1) // BS  # the decode worker computed these
            # Turn 2 routes on what the workers reported of turn 1: wait until the map has it.
            await holds(ws, "decode", second, kept)
            await holds(ws, "prefill", second, len(FIRST) // BS)
            before = await pulled(cluster)
            out2, cached = await turn(orch, "conv-2", second)
            return first_pull, await pulled(cluster) - before, kept, second, out2, cached
        finally:
            await ws.close()

    first_pull, second_pull, kept, second, out2, cached = asyncio.run(main())
    assert first_pull == cdiv(len(FIRST), BS)
    assert second_pull == cdiv(len(second), BS) - kept  # only the new blocks
    assert cached == len(FIRST) // BS * BS  # the prefill side reused turn 1's prompt too
    assert len(out2) == GREEDY.max_tokens
    asyncio.run(cluster.wait_idle())


def test_eviction_is_seen_and_the_next_turn_goes_where_the_prefix_is(cluster):
    prompt = [(29 * i + 1) % 250 + 1 for i in range(48)]  # 3 full blocks
    nxt = [*prompt, 5, 6, 7, 8]

    async def main():
        ws, orch = await router(cluster)
        try:
            pa, pb = ws.by_role("prefill")  # equal hits and load: pa would be picked
            for w in (pa, pb):
                await direct_prefill(w.address, f"seed-{w.address}", prompt)
            hashes = ws.prefix_hashes(prompt)
            idx = ws.kv_index
            await until(ws, lambda: idx.holds(pa.slot, hashes[0]) and
                        idx.holds(pb.slot, hashes[0]))
            # Fill pa's 40 blocks with other prompts: the conversation's blocks, freed
            # first, are evicted first.
            for k in range(4):
                await direct_prefill(pa.address, f"fill-{k}",
                                     [(13 * i + k) % 250 + 1 for i in range(160)])
            await until(ws, lambda: not idx.holds(pa.slot, hashes[0]))
            assert idx.holds(pb.slot, hashes[2])
            served = {w.address: (await cluster_load(w.address)).num_requests for w in (pa, pb)}
            _, cached = await turn(orch, "after-eviction", nxt)
            now = {w.address: (await cluster_load(w.address)).num_requests for w in (pa, pb)}
            return cached, served, now, pa.address, pb.address
        finally:
            await ws.close()

    cached, served, now, pa, pb = asyncio.run(main())
    assert now[pb] == served[pb] + 1 and now[pa] == served[pa]
    assert cached == 3 * BS  # pb still held the whole prefix
    asyncio.run(cluster.wait_idle())


async def cluster_load(address: str) -> worker_pb2.Load:
    async with grpc.aio.insecure_channel(address) as ch:
        return await worker_pb2_grpc.WorkerStub(ch).GetLoad(worker_pb2.GetLoadRequest(),
                                                            timeout=10)


def test_restarted_decode_worker_pulls_everything(cluster):
    async def main():
        ws, orch = await router(cluster)
        try:
            out1, _ = await turn(orch, "restart-1", FIRST)
            second = FIRST + out1 + NEW
            kept = (len(FIRST) + len(out1) - 1) // BS
            await holds(ws, "decode", second, kept)
            hashes = ws.prefix_hashes(second)[:kept]
            (holder,) = [w for w in ws.by_role("decode")
                         if ws.cached_blocks([w], hashes)[w.address] == kept]
            name = next(d.name for d in cluster.workers("decode") if d.address == holder.address)
            # The first turn's lease released first: its Release, sent once the decode worker's
            # core has pulled, can trail the turn's last token, and a lease a killed worker never
            # released stays until it expires (past wait_idle's bound).
            await cluster.wait_idle(procs=cluster.workers("prefill"))
            cluster.kill(name)
            cluster.wait_ready([cluster.restart(name)])
            # The router hears of the restart (a new instance); what the old one cached is
            # forgotten once its events stop.
            old = holder.instance_id
            while not (holder.healthy and holder.instance_id != old):
                await ws.poll_once()
            await until(ws, lambda: ws.kv_index.counts.get(holder.slot, 0) == 0)
            # The restarted worker serves the next turn (the other is left out of routing).
            for w in ws.by_role("decode"):
                w.draining = w is not holder
            before = (await cluster_load(holder.address)).kv_blocks_pulled
            out2, _ = await turn(orch, "restart-2", second)
            return (await cluster_load(holder.address)).kv_blocks_pulled - before, second, out2
        finally:
            await ws.close()

    n, second, out2 = asyncio.run(main())
    assert n == cdiv(len(second), BS)  # nothing cached anywhere on the decode side
    assert len(out2) == GREEDY.max_tokens
    asyncio.run(cluster.wait_idle())


def test_a_router_started_least_loaded_spreads_a_repeated_prompt(cluster):
    """`tandem router --routing-policy least-loaded` over the same workers: one prompt sent
    twice, one request after the other, is prefilled once on each prefill worker (idle workers
    take turns), blind to the blocks the first request left on one of them."""
    argv = ["router", "--model", cluster.model, "--grpc-port", "0", "--http-port", "-1",
            "--routing-policy", "least-loaded"]
    for role in ("prefill", "decode"):
        argv += [a for w in cluster.workers(role) for a in (f"--{role}", w.address)]
    name = "router-least-loaded"
    proc = cluster.spawn(name, argv)
    prompt = [(23 * i + 9) % 250 + 1 for i in range(48)]

    async def main():
        prefill = [w.address for w in cluster.workers("prefill")]
        before = [(await cluster_load(a)).num_requests for a in prefill]
        async with grpc.aio.insecure_channel(proc.address) as ch:
            for _ in range(2):
                async for _ in cluster.api(ch).Generate(api_pb2.GenerateRequest(
                        token_ids=api_pb2.TokenIds(ids=prompt), params=params_to_proto(GREEDY)),
                        timeout=120):
                    pass
        return [(await cluster_load(a)).num_requests - n for a, n in zip(prefill, before)]

    try:
        cluster.wait_ready([proc])
        served = asyncio.run(main())
    finally:
        proc.popen.send_signal(signal.SIGTERM)
        code = proc.popen.wait(60)
        del cluster.procs[name]
    assert served == [1, 1]
    assert code == 0
    asyncio.run(cluster.wait_idle())
