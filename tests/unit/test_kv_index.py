"""The router's map of worker caches (router_svc/kv_index.py) and a worker's event hub
(runtime/kv_events.py): exact prefixes per worker, evictions, resets, the memory bound, and
subscribers that start from the whole set."""

from __future__ import annotations

import asyncio

import pytest

from tandem.engine.serving.core_messages import KVEvents
from tandem.router_svc.kv_index import KVIndex
from tandem.runtime.kv_events import KVEventHub, SubscriberLagged


def test_match_is_each_workers_longest_prefix():
    idx = KVIndex()
    idx.apply(0, [1, 2, 3], [])
    idx.apply(1, [1, 2], [])
    idx.apply(2, [2, 3], [])  # no first block: no prefix
    assert idx.match([1, 2, 3, 4], [0, 1, 2]) == {0: 3, 1: 2, 2: 0}
    assert idx.match([1, 2], [0, 1]) == {0: 2, 1: 2}
    assert idx.match([], [0]) == {0: 0}
    assert idx.match([1, 2, 3], [1]) == {1: 2}  # only the slots asked about


def test_eviction_shortens_the_prefix_and_clear_forgets_a_worker():
    idx = KVIndex()
    idx.apply(0, [1, 2, 3], [])
    idx.apply(1, [1, 2, 3], [])
    idx.apply(0, [], [2])  # a hole: the prefix stops before it
    assert idx.match([1, 2, 3], [0, 1]) == {0: 1, 1: 3}
    assert idx.counts == {0: 2, 1: 3}
    idx.clear(1)
    assert idx.match([1, 2, 3], [0, 1]) == {0: 1, 1: 0}
    assert sorted(idx.blocks) == [1, 3] and 1 not in idx.counts
    idx.apply(0, [], [1, 3, 99])  # 99 was never there: ignored
    assert len(idx) == 0 and idx.counts == {0: 0}


def test_bounded_drops_the_oldest_entries():
    idx = KVIndex(max_blocks=100)
    idx.apply(0, range(60), [])
    idx.apply(1, range(40, 101), [])  # 101 distinct hashes: the oldest tenth goes
    assert len(idx) <= 100
    assert 0 not in idx.blocks and 100 in idx.blocks
    assert idx.counts[0] + idx.counts[1] == sum(bin(m).count("1") for m in idx.blocks.values())


def test_wait_for_wakes_on_changes():
    async def main():
        idx = KVIndex()
        waiter = asyncio.create_task(idx.wait_for(lambda: idx.holds(3, 7)))
        await asyncio.sleep(0)
        idx.apply(3, [5], [])
        await asyncio.sleep(0)
        assert not waiter.done()
        idx.apply(3, [7], [])
        await asyncio.wait_for(waiter, 10)
    asyncio.run(main())


def test_hub_sends_the_set_then_changes_and_cuts_off_a_laggard():
    async def main():
        hub = KVEventHub(16, "inst", max_pending=2)
        hub.publish(KVEvents([1, 2, 3], []))
        hub.publish(KVEvents([], [2]))
        watch = hub.watch()
        first = await anext(watch)
        assert first.reset and sorted(first.stored) == [1, 3] and first.block_size == 16
        hub.publish(KVEvents([4], [1]))
        nxt = await anext(watch)
        assert not nxt.reset and list(nxt.stored) == [4] and list(nxt.removed) == [1]
        assert hub.cached == {3, 4}
        for h in range(10, 13):  # three changes unread: past max_pending
            hub.publish(KVEvents([h], []))
        assert hub.num_subscribers == 0
        with pytest.raises(SubscriberLagged):
            while True:
                await anext(watch)
        # A new subscriber starts from the whole set, the missed changes included.
        again = hub.watch()
        assert sorted((await anext(again)).stored) == [3, 4, 10, 11, 12]
        await hub.close()
        with pytest.raises(StopAsyncIteration):
            await anext(again)
        assert hub.num_subscribers == 0
    asyncio.run(main())


def _workers(role: str, n: int):
    from tandem.router_svc.routing.prefix_affinity import PrefixAffinity
    from tandem.router_svc.workers import Worker, WorkerSet

    ws = WorkerSet([], [], [], policy=PrefixAffinity(balance_slack=2))
    ws.workers = [Worker(f"{role}{i}", role, None, None, None, healthy=True, slot=i)
                  for i in range(n)]
    return ws, ws.workers


def _route(ws, prompt: list[int], cache_salt: str = ""):
    from tandem.router_svc.routing import RouteRequest

    return RouteRequest(prompt, ws.prefix_hashes(prompt, cache_salt))


def test_picks_the_longest_cached_prefix_among_the_near_least_loaded():
    ws, (w0, w1, w2) = _workers("prefill", 3)
    prompt = list(range(1, 81))  # 5 full blocks of 16
    hashes = ws.prefix_hashes(prompt)
    assert len(hashes) == 5 and ws.prefix_hashes(prompt, "tenant") != hashes
    ws.kv_index.apply(1, hashes[:2], [])
    ws.kv_index.apply(2, hashes, [])  # the whole prompt, beyond any 8-block window too
    assert ws.pick_prefill(_route(ws, prompt)) is w2
    assert ws.pick_prefill(_route(ws, prompt, "tenant")) is w0  # another tenant's: no hit
    w2.in_flight = 3  # busier than the least loaded by more than balance_slack
    assert ws.pick_prefill(_route(ws, prompt)) is w1
    ws.kv_index.apply(1, [], hashes[:1])  # evicted on w1: its prefix is gone
    assert ws.pick_prefill(_route(ws, prompt)) is w0  # least loaded


def test_decode_pick_follows_the_conversation_then_free_blocks():
    ws, (d0, d1) = _workers("decode", 2)
    d0.load.num_free_blocks, d1.load.num_free_blocks = 100, 50
    prompt = list(range(1, 65))
    assert ws.pick_decode(_route(ws, prompt)) is d0  # no hits: the most free blocks
    ws.kv_index.apply(1, ws.prefix_hashes(prompt)[:3], [])
    assert ws.pick_decode(_route(ws, prompt)) is d1
    assert ws.pick_decode(_route(ws, [])) is d0  # no prompt given: free blocks only
