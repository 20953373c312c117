"""The host KV tier across a stack on 127.0.0.1 (CPU, the tiny llama): two prefill workers of
one host share a tier (--host-kv-share) under 24-block pools, a third has none. A prefix pushed
out of one worker's pool is reported moved to the tier (WatchKV), the router prefers a worker
that can read it there to the cold one, a conversation's next turn on the other worker of the
host is served from the shared tier (fewer prompt tokens computed, output equal to the offline
engine's), a salted prefix is served to its own salt only, and every pool ends idle.

Across hosts: the cold worker (and the decode worker) stand for workers of another host, whose
tier id differs. With --remote-prefix-blocks the router has the tier's worker lend the prefix
(LendPrefix) and the worker computing the prompt pulls it over the lender's transport: NIXL,
UCX held to TCP on the loopback device as between two hosts (shm where nixl is not installed),
computing only the rest; a lease that cannot be used (released, or its lender unreachable)
has it compute the prefix instead."""

from __future__ import annotations

import asyncio
import uuid

import grpc
import pytest
from nixl_pools import NO_NIXL

from cluster import Cluster, free_port
from tandem.engine.sampling_params import SamplingParams
from tandem.router_svc.kv_index import TierMatch
from tandem.router_svc.orchestrator import Orchestrator
from tandem.router_svc.routing import RouteRequest
from tandem.router_svc.workers import WorkerSet
from tandem.runtime.convert import params_to_proto
from tandem.v1 import worker_pb2, worker_pb2_grpc

BS = 16
BLOCK_BYTES = 2 * 2 * BS * 2 * 64 * 4  # tiny llama: layers x (K, V) x block x kv heads x dim
TIER_GB = f"{200 * BLOCK_BYTES / (1 << 30):.6f}"  # about 200 blocks
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# The tier's workers serve their pools over NIXL where it is installed (what a worker of
# another host reads them by), UCX held to TCP on the loopback device as between two hosts.
TRANSPORT = "nixl" if NO_NIXL is None else "shm"
UCX_LOOPBACK_TCP = {"UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp"}


@pytest.fixture(scope="module")
def cluster(tiny_models, tmp_path_factory):
    share = f"test-{uuid.uuid4().hex[:12]}"
    c = Cluster(tmp_path_factory.mktemp("hosttier"), str(tiny_models["llama"]), prefill=2,
                decode=1, prefill_args=["--num-blocks", "24", "--host-kv-cache-gb", TIER_GB,
                                        "--host-kv-share", share, "--transport", TRANSPORT],
                decode_args=["--num-blocks", "128"], router_args=["--http-port", "-1"],
                env=UCX_LOOPBACK_TCP)
    # A cold prefill worker beside them: no tier.
    cold = c.spawn("prefill-cold", ["worker", "--role", "prefill", "--device", "cpu", "--model",
                                    c.model, "--port", "0", "--num-blocks", "24"])
    c.start()
    c.wait_ready([cold])
    yield c
    codes = c.stop()
    assert all(code == 0 for code in codes.values()), codes


async def direct_prefill(address: str, rid: str, prompt: list[int], salt: str = "") -> None:
    """A prefill run straight on one worker, its lease released: the prompt's full blocks stay
    in that worker's prefix cache."""
    params = SamplingParams(temperature=0, max_tokens=1, cache_salt=salt)
    async with grpc.aio.insecure_channel(address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        resp = await stub.Prefill(worker_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=prompt, params=params_to_proto(params)), timeout=60)
        await stub.Release(worker_pb2.ReleaseRequest(lease_id=resp.kv.lease_id), timeout=10)


async def load(address: str) -> worker_pb2.Load:
    async with grpc.aio.insecure_channel(address) as ch:
        return await worker_pb2_grpc.WorkerStub(ch).GetLoad(worker_pb2.GetLoadRequest(),
                                                            timeout=10)


async def turn(orch: Orchestrator, rid: str, prompt: list[int],
               salt: str = "") -> tuple[list[int], int]:
    """The output tokens, and the prompt tokens the prefill worker had cached."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, cache_salt=salt)
    tokens, cached = [], None
    async for u in orch.run(rid, prompt, params, timeout=120):
        cached = u.num_cached_tokens if cached is None else cached
        for s in u.samples:
            tokens += s.token_ids
    return tokens, cached


async def evict_into_tier(ws: WorkerSet, w, prompt: list[int], salt: str, tag: str) -> list[int]:
    """Seed `prompt` on worker w, then fill w's pool with other prompts until the router's map
    shows the prompt's blocks gone from w's pool and held in its host tier; the hashes."""
    hashes = ws.prefix_hashes(prompt, salt)
    idx = ws.kv_index
    await direct_prefill(w.address, f"seed-{tag}", prompt, salt)
    async with asyncio.timeout(120):  # turns a hang into a failure
        await idx.wait_for(lambda: all(idx.holds(w.slot, h) for h in hashes))
        for k in range(3):  # 3 x 10 blocks through a 24-block pool
            await direct_prefill(w.address, f"fill-{tag}-{k}",
                                 [(13 * i + k) % 250 + 1 for i in range(160)])
        await idx.wait_for(lambda: not any(idx.holds(w.slot, h) for h in hashes)
                           and all(idx.holds_on_host(w.slot, h) for h in hashes))
    return hashes


def test_moves_reported_routed_on_and_the_next_turn_served_from_the_shared_tier(cluster,
                                                                                offline):
    prompt = [(29 * i + 1) % 250 + 1 for i in range(48)]  # 3 full blocks
    nxt = [*prompt, 5, 6, 7, 8]
    want = offline.generate([nxt], GREEDY)[0].outputs[0].token_ids

    async def main():
        pa_addr, pb_addr = (p.address for p in cluster.workers("prefill"))
        cold_addr = cluster.procs["prefill-cold"].address
        # The cold worker before pb: on equal scores the first would win.
        ws = WorkerSet([pa_addr, cold_addr, pb_addr],
                       [d.address for d in cluster.workers("decode")], [])
        await ws.poll_once()
        try:
            pa, cold, pb = ws.by_role("prefill")
            hashes = await evict_into_tier(ws, pa, prompt, "", "plain")
            idx = ws.kv_index
            # pb reads the tier pa wrote (one tier id: the router knows it once pb's KV events
            # have begun, which can trail pa's); the cold worker reads none.
            async with asyncio.timeout(60):
                await idx.wait_for(lambda: all(idx.holds_on_host(pb.slot, h) for h in hashes))
            assert not any(idx.holds_on_host(cold.slot, h) for h in hashes)
            assert ws.tier_hits([pa, cold, pb], ws.prefix_hashes(nxt)) == {
                pa.address: TierMatch(0, 3), cold.address: TierMatch(0, 0),
                pb.address: TierMatch(0, 3)}
            request = RouteRequest(nxt, ws.prefix_hashes(nxt))
            assert ws.pick_prefill(request, exclude={pa.address}) is pb
            # The conversation moves off pa: its next turn goes to pb, from the shared tier.
            pa.draining = True
            before = await load(pb.address)
            out, cached = await turn(Orchestrator(ws, max_migrations=3), "moved", nxt)
            after = await load(pb.address)
            pa.draining = False
            return out, cached, after.prompt_tokens_computed - before.prompt_tokens_computed
        finally:
            await ws.close()

    out, cached, computed = asyncio.run(main())
    assert cached == 3 * BS
    assert computed == len(nxt) - 3 * BS  # only the 4 new tokens were computed
    assert out == want
    asyncio.run(cluster.wait_idle(procs=[*cluster.workers(), cluster.procs["prefill-cold"]]))


def test_a_salted_prefix_in_the_shared_tier_is_served_to_its_salt_only(cluster):
    prompt = [(31 * i + 7) % 250 + 1 for i in range(48)]
    nxt = [*prompt, 9, 10]

    async def main():
        pa_addr, pb_addr = (p.address for p in cluster.workers("prefill"))
        ws = WorkerSet([pa_addr, pb_addr], [d.address for d in cluster.workers("decode")], [])
        await ws.poll_once()
        try:
            pa, pb = ws.by_role("prefill")
            await evict_into_tier(ws, pa, prompt, "tenant-a", "salted")
            pa.draining = True  # every turn on pb, which never saw the prompt
            orch = Orchestrator(ws, max_migrations=3)
            cached = {}
            before = (await load(pb.address)).num_requests
            for salt in ("", "tenant-b", "tenant-a"):
                cached[salt] = (await turn(orch, f"salt-{salt}", nxt, salt))[1]
            pa.draining = False
            assert (await load(pb.address)).num_requests == before + 3
            return cached
        finally:
            await ws.close()

    cached = asyncio.run(main())
    assert cached == {"": 0, "tenant-b": 0, "tenant-a": 3 * BS}
    asyncio.run(cluster.wait_idle(procs=[*cluster.workers(), cluster.procs["prefill-cold"]]))


def test_conversations_past_the_pool_compute_less_with_the_tier(cluster):
    """Multi-turn conversations holding 4x a prefill worker's pool (8 x 12 blocks against 24),
    on a worker with the tier and on the cold one without: the pools evict every conversation
    before its next turn, so without the tier turn 2 computes its whole prompt again, and with
    it what the tier does not hold (the shared tier is set-associative: a full set drops a few
    blocks, the last of their chains). Outputs agree, the tier's bytes stay within its flag throughout, and every pool
    ends idle."""
    first = 12 * BS
    convs = [[(7 * i + 13 * c) % 250 + 1 for i in range(first)] for c in range(8)]
    news = [[(5 * i + 3 * c) % 250 + 1 for i in range(8)] for c in range(8)]
    bound = int(float(TIER_GB) * (1 << 30))

    async def run_on(ws: WorkerSet, w, tag: str) -> tuple[list, list, list]:
        """Both turns of every conversation, each prefill on w: the outputs, per turn the
        prompt tokens w computed and the blocks it restored from its tier, and w's Load after
        each request."""
        orch = Orchestrator(ws, max_migrations=3)
        history, outputs, work, loads = [list(p) for p in convs], [], [], []
        for t in range(2):
            before = await load(w.address)
            outs = []
            for c in range(len(convs)):
                prompt = history[c] if t == 0 else history[c] + news[c]
                out, _ = await turn(orch, f"conv-{tag}-{c}-{t}", prompt)
                history[c] = prompt + out
                outs.append(out)
                loads.append(await load(w.address))
            work.append((loads[-1].prompt_tokens_computed - before.prompt_tokens_computed,
                         loads[-1].host_kv_blocks_restored - before.host_kv_blocks_restored))
            outputs.append(outs)
        return outputs, work, loads

    async def main():
        pa_addr, pb_addr = (p.address for p in cluster.workers("prefill"))
        cold_addr = cluster.procs["prefill-cold"].address
        ws = WorkerSet([pa_addr, cold_addr, pb_addr],
                       [d.address for d in cluster.workers("decode")], [])
        await ws.poll_once()
        try:
            pa, cold, pb = ws.by_role("prefill")
            results = {}
            for w, others, tag in ((pa, (cold, pb), "tier"), (cold, (pa, pb), "cold")):
                for o in others:
                    o.draining = True  # every prefill on w
                try:
                    results[tag] = await run_on(ws, w, tag)
                finally:
                    for o in others:
                        o.draining = False
            return results
        finally:
            await ws.close()

    results = asyncio.run(main())
    (out_tier, work_tier, loads), (out_cold, work_cold, cold_loads) = (results["tier"],
                                                                       results["cold"])
    assert out_tier == out_cold
    turn2 = sum(len(c) + 8 + len(n) for c, n in zip(convs, news))  # prompt + answer + new
    assert work_cold == [(8 * first, 0), (turn2, 0)]  # evicted: turn 2 computed from scratch
    (computed1, restored1), (computed2, restored2) = work_tier
    assert (computed1, restored1) == (8 * first, 0)
    # Turn 2: what the tier gave back was not computed, and it gave back nearly all of turn 1:
    # a restore stops at a conversation's first block the tier dropped, and a full set drops
    # the blocks whose loss costs least, a chain's last ones (here 92 of 96 blocks; 71 when a
    # full set dropped its least recently used block, wherever it sat in its chain).
    assert computed2 == turn2 - restored2 * BS
    assert restored2 >= 88
    assert computed2 < work_cold[1][0]
    for ld in loads:
        assert 0 < ld.host_kv_capacity_bytes <= bound
        assert ld.host_kv_bytes_used <= ld.host_kv_capacity_bytes
        assert ld.host_kv_bytes_allocated <= ld.host_kv_capacity_bytes
    assert all(ld.host_kv_capacity_bytes == 0 for ld in cold_loads)
    asyncio.run(cluster.wait_idle(procs=[*cluster.workers(), cluster.procs["prefill-cold"]]))


# -- across hosts: a prefix lent from the tier and pulled (router_svc/remote_prefix.py) ---------

async def turn_on(orch: Orchestrator, rid: str, prompt: list[int]) -> tuple[list[int], int]:
    """A turn's output tokens and the prompt tokens cached where it was computed."""
    tokens, cached = [], None
    async for u in orch.run(rid, prompt, GREEDY, timeout=120):
        cached = u.num_cached_tokens if cached is None else cached
        tokens += [t for s in u.samples for t in s.token_ids]
    return tokens, cached


@pytest.mark.parametrize("where", ["prefill", "decode"])
def test_a_prefix_in_another_hosts_tier_is_pulled_not_computed(cluster, offline, where):
    """Turn 2 of a conversation whose turn 1 sits in pa's tier (pa's pool evicted it) goes to
    a worker that cannot read that tier: the cold prefill worker, or the decode worker
    prefilling it itself (no prefill worker up). pa lends the prefix (restored from its tier
    into its pool) and that worker pulls those 3 blocks over pa's transport, computing only
    the 4 new tokens; output equal to the offline engine's; every pool ends idle."""
    seed = 11 if where == "prefill" else 13  # a prompt no worker has seen (the other case's
    prompt = [(37 * i + seed) % 250 + 1 for i in range(48)]  # ends in the decode pool)
    nxt = [*prompt, 1, 2, 3, 4]
    want = offline.generate([nxt], GREEDY)[0].outputs[0].token_ids

    async def main():
        pa_addr, pb_addr = (p.address for p in cluster.workers("prefill"))
        cold_addr = cluster.procs["prefill-cold"].address
        (d_addr,) = (d.address for d in cluster.workers("decode"))
        ws = WorkerSet([pa_addr, pb_addr, cold_addr], [d_addr], [])
        await ws.poll_once()
        try:
            pa, pb, cold = ws.by_role("prefill")
            (d,) = ws.by_role("decode")
            await evict_into_tier(ws, pa, prompt, "", f"far-{where}")
            dest = cold if where == "prefill" else d
            lending = Orchestrator(ws, remote_prefix_blocks=1).lending
            (lender, blocks) = lending.lender(RouteRequest(nxt, ws.prefix_hashes(nxt)), dest)
            assert lender in (pa, pb) and blocks == 3  # a worker reading the tier pa wrote
            for w in (pa, pb) if where == "prefill" else (pa, pb, cold):
                w.draining = True  # dest computes the prompt (a decode worker: fallback)
            watched = [dest, lender]
            before = [await load(w.address) for w in watched]
            out, cached = await turn_on(Orchestrator(ws, remote_prefix_blocks=1), where, nxt)
            after = [await load(w.address) for w in watched]
            for w in (pa, pb, cold):
                w.draining = False
            return out, cached, before, after, lender.address
        finally:
            await ws.close()

    out, cached, before, after, lender = asyncio.run(main())
    (dest0, lender0), (dest1, lender1) = before, after
    assert out == want
    assert cached == 3 * BS
    assert dest1.prompt_tokens_computed - dest0.prompt_tokens_computed == len(nxt) - 3 * BS
    assert dest1.kv_blocks_pulled - dest0.kv_blocks_pulled == 3  # the lent prefix, pulled
    assert lender1.host_kv_blocks_restored - lender0.host_kv_blocks_restored == 3
    # Over the lender's transport: the worker computing the prompt mapped its pool so.
    dest = cluster.procs["prefill-cold"] if where == "prefill" else cluster.workers("decode")[0]
    mapped = [line["event"] for line in dest.json_logs()
              if line["event"].startswith(f"mapped the KV pool of prefill@{lender}")]
    assert mapped and all(f"'transport': '{TRANSPORT}'" in m for m in mapped)
    asyncio.run(cluster.wait_idle(procs=[*cluster.workers(), cluster.procs["prefill-cold"]]))


@pytest.mark.parametrize("failure", ["released", "unreachable"])
def test_a_lent_prefix_that_cannot_be_pulled_is_computed(cluster, offline, failure):
    """The cold worker handed a lease it cannot use computes the prompt whole, with the same
    output and nothing left pinned: a lease already released (as one expired: its claim is
    refused), or one whose lender it cannot reach (gone: nothing listens at its address; its
    lease, which no one can then release, is released here as its process's end would)."""
    seed = 3 if failure == "released" else 5  # a prompt the cold worker never computed
    prompt = [(41 * i + seed) % 250 + 1 for i in range(48)]
    nxt = [*prompt, 9, 8, 7]
    want = offline.generate([nxt], SamplingParams(temperature=0, max_tokens=1))[0]
    pa = cluster.workers("prefill")[0]
    cold = cluster.procs["prefill-cold"]

    async def main():
        ws = WorkerSet([p.address for p in cluster.workers("prefill")],
                       [d.address for d in cluster.workers("decode")], [])
        await ws.poll_once()
        try:
            await evict_into_tier(ws, ws.by_role("prefill")[0], prompt, "", failure)
        finally:
            await ws.close()
        async with grpc.aio.insecure_channel(pa.address) as ch:
            lender = worker_pb2_grpc.WorkerStub(ch)
            lent = (await lender.LendPrefix(worker_pb2.LendPrefixRequest(
                prompt_token_ids=nxt[:48]), timeout=30)).kv
            assert lent.num_tokens == 48 and lent.lease_id
            if failure == "released":
                assert (await lender.Release(worker_pb2.ReleaseRequest(
                    lease_id=lent.lease_id), timeout=10)).released
            kv = worker_pb2.KVLocation()
            kv.CopyFrom(lent)
            if failure == "unreachable":
                kv.address = f"127.0.0.1:{free_port()}"
            before = await load(cold.address)
            async with grpc.aio.insecure_channel(cold.address) as cc:
                resp = await worker_pb2_grpc.WorkerStub(cc).Prefill(worker_pb2.PrefillRequest(
                    request_id=f"lent-{failure}", prompt_token_ids=nxt,
                    params=params_to_proto(SamplingParams(temperature=0, max_tokens=1)),
                    prefix_kv=kv), timeout=60)
                await worker_pb2_grpc.WorkerStub(cc).Release(
                    worker_pb2.ReleaseRequest(lease_id=resp.kv.lease_id), timeout=10)
            after = await load(cold.address)
            if failure == "unreachable":  # its lender's lease, ended with it
                assert (await lender.Release(worker_pb2.ReleaseRequest(
                    lease_id=lent.lease_id), timeout=10)).released
            return resp, before, after

    resp, before, after = asyncio.run(main())
    assert list(resp.first_token_ids) == want.outputs[0].token_ids
    assert resp.num_cached_tokens == 0
    assert after.prompt_tokens_computed - before.prompt_tokens_computed == len(nxt)
    assert after.kv_blocks_pulled == before.kv_blocks_pulled
    asyncio.run(cluster.wait_idle(procs=[*cluster.workers(), cluster.procs["prefill-cold"]]))
