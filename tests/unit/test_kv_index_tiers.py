"""The host tier in the router's map and in the routing score: which worker holds which prefix
block on GPU and which in a host tier (its own, or one shared by the workers of its host), the
worker's event hub carrying both sets, and prefix affinity preferring a GPU hit to a host hit
to none."""

from __future__ import annotations

import asyncio

from tandem.engine.host_kv_tier import HostBlockIndex
from tandem.engine.serving.core_messages import KVEvents
from tandem.router_svc.kv_index import KVIndex, TierMatch
from tandem.router_svc.routing import RouteRequest, WorkerLoad
from tandem.router_svc.routing.prefix_affinity import HOST_HIT_WEIGHT, PrefixAffinity
from tandem.runtime.kv_events import KVEventHub

REQUEST = RouteRequest(list(range(1, 161)))


def test_gpu_then_host_blocks_per_worker():
    idx = KVIndex()
    idx.apply(0, [1, 2], [], host_stored=[3, 4])  # 1-2 on GPU, 3-4 moved to its tier
    idx.apply(1, [1], [], host_stored=[2, 3])
    idx.apply(2, [], [], host_stored=[2, 3])  # no first block anywhere: nothing
    assert idx.match_tiers([1, 2, 3, 4, 5], [0, 1, 2]) == {
        0: TierMatch(2, 2), 1: TierMatch(1, 2), 2: TierMatch(0, 0)}
    assert idx.match([1, 2, 3, 4], [0, 1]) == {0: 2, 1: 1}  # GPU only, as before tiers
    # Restored to the GPU (stored), kept in the tier; then the tier drops 4.
    idx.apply(0, [3], [], host_removed=[4])
    assert idx.match_tiers([1, 2, 3, 4], [0]) == {0: TierMatch(3, 0)}
    assert idx.holds_on_host(0, 3) and not idx.holds_on_host(0, 4)
    idx.clear(0)
    assert idx.match_tiers([1, 2, 3], [0]) == {0: TierMatch(0, 0)}
    assert 0 not in idx.host_counts and not idx.holds_on_host(0, 3)


def test_a_shared_tier_is_read_by_every_worker_of_its_group_and_a_drop_is_for_all():
    idx = KVIndex()
    for slot in (0, 1):
        idx.set_tier(slot, "host-a")
    idx.set_tier(2, "host-b")  # another host's tier: not readable by 0 and 1
    idx.apply(0, [], [], host_stored=[1, 2, 3])
    idx.apply(2, [], [], host_stored=[1, 2, 3])
    assert idx.match_tiers([1, 2, 3], [0, 1, 2, 3]) == {
        0: TierMatch(0, 3), 1: TierMatch(0, 3), 2: TierMatch(0, 3), 3: TierMatch(0, 0)}
    # Worker 1's eviction dropped block 2, which worker 0 stored: gone for both, not host-b's.
    idx.apply(1, [], [], host_removed=[2])
    assert idx.match_tiers([1, 2, 3], [0, 1, 2]) == {
        0: TierMatch(0, 1), 1: TierMatch(0, 1), 2: TierMatch(0, 3)}
    assert sum(idx.host_counts.values()) == sum(bin(m).count("1") for m in idx.host.values())
    idx.set_tier(1, "")  # its tier is its own again: it reads nothing of host-a
    assert idx.match_tiers([1], [1]) == {1: TierMatch(0, 0)}


def test_the_lender_of_a_prefix_is_a_worker_whose_tier_the_computing_one_cannot_read():
    """KVIndex.lender: the worker serving the longest run of the prompt from its pool and a
    host tier the computing worker (dest) does not read, by at least min_gain blocks more than
    dest serves itself; never one whose run is all on GPU (nothing in a tier to lend), nor one
    sharing dest's tier (dest reads it itself)."""
    idx = KVIndex()
    for slot, tier in ((0, "host-a"), (1, "host-a"), (2, "host-b")):
        idx.set_tier(slot, tier)
    hashes = [1, 2, 3, 4, 5]
    idx.apply(0, [], [], host_stored=[1, 2, 3, 4])  # host-a's tier: 4 blocks, slots 0 and 1
    idx.apply(2, [1, 2], [], host_stored=[3])  # host-b: 3 blocks
    idx.apply(3, [1, 2, 3, 4, 5], [])  # all on GPU, no tier: not a lender of a tier's prefix
    idx.apply(4, [1], [])  # dest of another host, one block of its own
    assert idx.lender(hashes, 4, [0, 1, 2, 3]) == (0, 4)
    assert idx.lender(hashes, 4, [2, 3]) == (2, 3)
    assert idx.lender(hashes, 4, [0, 1, 2], min_gain=3) == (0, 4)
    assert idx.lender(hashes, 4, [0, 1, 2], min_gain=4) is None  # 4 - 1 < 4
    assert idx.lender(hashes, 1, [0, 2]) is None  # dest 1 reads host-a itself: 4 > 3
    assert idx.lender(hashes, 2, [0, 1]) == (0, 4)  # host-b's worker, one block short
    assert idx.lender(hashes, 5, [], min_gain=1) is None


def test_bound_counts_both_maps():
    idx = KVIndex(max_blocks=100)
    idx.apply(0, range(50), [], host_stored=range(1000, 1051))
    assert len(idx.blocks) + len(idx.host) <= 100
    assert 1000 not in idx.host and 1050 in idx.host and len(idx.blocks) == 50
    assert idx.host_counts[0] == len(idx.host)


def test_tier_index_reports_what_it_holds_and_drops():
    ix = HostBlockIndex(2)
    ix.events = {}
    ix.put(10)
    ix.put(11)
    ix.put(10)  # held already: still held, now most recent
    ix.put(12)  # full: drops 11, the least recently used
    assert ix.take_events() == ([10, 12], [11])
    assert ix.take_events() == ([], [])
    ix.pinned = {0, 1}  # every slot pinned: 13 is not kept, nothing reported
    ix.put(13)
    assert ix.take_events() == ([], [])


def test_hub_carries_the_host_set_and_its_tier_id():
    async def main():
        hub = KVEventHub(16, "inst", host_tier_id="t1")
        hub.publish(KVEvents([1, 2], [], [5, 6], []))
        hub.publish(KVEvents([], [2], [2], [5]))  # 2 moved to the tier; the tier dropped 5
        watch = hub.watch()
        first = await anext(watch)
        assert first.reset and first.host_tier_id == "t1"
        assert sorted(first.stored) == [1] and sorted(first.host_stored) == [2, 6]
        hub.publish(KVEvents([2], [], [], [6]))
        nxt = await anext(watch)
        assert list(nxt.stored) == [2] and list(nxt.host_removed) == [6]
        await hub.close()
    asyncio.run(main())


def _load(address: str, gpu: int = 0, host: int = 0, queued: int = 0,
          role: str = "prefill") -> WorkerLoad:
    return WorkerLoad(address, role, 0, queued, 0, 64, gpu, host_blocks=host,
                      other_waiting=queued)


def test_score_gpu_hit_over_host_hit_over_none():
    policy = PrefixAffinity()
    assert 0 < HOST_HIT_WEIGHT < 1
    cold, host, gpu = _load("cold"), _load("host", host=6), _load("gpu", gpu=6)
    for pick in (policy.pick_prefill, policy.pick_decode):
        assert pick(REQUEST, [cold, host]) is host
        assert pick(REQUEST, [cold, host, gpu]) is gpu
        # 6 in the tier (worth 3 on GPU) beat 2 on GPU; 2 on GPU plus 6 in the tier beat 4.
        assert pick(REQUEST, [_load("g2", gpu=2), host]) is host
        mixed = _load("mix", gpu=2, host=6)
        assert pick(REQUEST, [_load("g4", gpu=4), mixed]) is mixed
    # Load still comes first: a host hit past the slack loses to a cold, idle worker.
    assert policy.pick_prefill(REQUEST, [cold, _load("busy", host=9, queued=5)]) is cold
