"""Block pool and KV manager on exact block ids. Plain Python: no model, no torch.
The scheduler's tests are in test_scheduler.py."""

from __future__ import annotations

import pytest

from tandem.engine.block_pool import BlockPool, hash_block
from tandem.engine.kv_manager import KVCacheManager
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sequence import Sequence

BS = 4


@pytest.fixture
def pool():
    p = BlockPool(num_blocks=8, block_size=BS)
    yield p
    assert p.is_idle(), f"pool not idle after test: refs {p.ref_counts}"


def seq(tokens, rid="r", n=1, max_tokens=16):
    return Sequence(rid, list(tokens), SamplingParams(n=n, max_tokens=max_tokens, temperature=0))


def test_allocate_and_free_exact_ids(pool):
    a = pool.allocate(3)
    b = pool.allocate(2)
    assert a == [0, 1, 2] and b == [3, 4]
    assert pool.num_free == 3 and pool.ref_counts[:5] == [1] * 5
    pool.free(a)
    # Freed tail first: the sequence's last block is the first to be reused.
    assert list(pool.free_queue) == [5, 6, 7, 2, 1, 0]
    assert pool.allocate(4) == [5, 6, 7, 2]
    pool.free([5, 6, 7, 2])
    pool.free(b)
    pool.free([1, 0][:0])  # nothing
    pool.free([])
    assert pool.num_free == 8


def test_double_free_is_caught(pool):
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([b])


def test_over_allocation_raises_without_side_effects(pool):
    with pytest.raises(MemoryError):
        pool.allocate(9)
    assert pool.num_free == 8


def test_prefix_hit_and_lru_eviction_order(pool):
    h0 = hash_block(None, [1, 2, 3, 4])
    h1 = hash_block(h0, [5, 6, 7, 8])
    blocks = pool.allocate(2)  # [0, 1]
    pool.cache_block(blocks[0], h0)
    pool.cache_block(blocks[1], h1)
    pool.free(blocks)
    # Both stay cached while free; lookups follow the chain.
    assert pool.lookup([h0, h1]) == [0, 1]
    assert pool.lookup([h1]) == [1]
    assert pool.lookup([hash_block(None, [9, 9, 9, 9]), h1]) == []
    # Free queue: never-used 2..7 first, then 1 (tail of the freed sequence), then 0.
    assert pool.allocate(6) == [2, 3, 4, 5, 6, 7]
    # The next allocation evicts block 1 (least recently freed of the cached ones).
    assert pool.allocate(1) == [1]
    assert pool.lookup([h0, h1]) == [0]
    pool.free(list(range(1, 8)))


def test_touch_revives_cached_block(pool):
    h = hash_block(None, [1, 2, 3, 4])
    (b,) = pool.allocate(1)
    pool.cache_block(b, h)
    pool.free([b])
    assert pool.num_free == 8
    hits = pool.lookup([h])
    pool.incref(hits)
    assert pool.num_free == 7 and pool.ref_counts[b] == 1
    pool.free(hits)


def test_duplicate_hash_keeps_first_block(pool):
    h = hash_block(None, [1, 2, 3, 4])
    a, b = pool.allocate(2)
    pool.cache_block(a, h)
    pool.cache_block(b, h)
    assert pool.cached[h] == a and pool.block_hash[b] is None
    pool.free([a, b])


def test_prefix_caching_disabled():
    p = BlockPool(4, BS, enable_prefix_caching=False)
    (b,) = p.allocate(1)
    p.cache_block(b, 123)
    assert p.lookup([123]) == []
    p.free([b])
    assert p.is_idle()


def test_kv_manager_prefix_hits_leave_one_token(pool):
    kv = KVCacheManager(pool)
    a = seq(range(12))  # 3 full blocks
    assert kv.allocate_slots(a, 12)
    a.num_computed_tokens = 12
    kv.cache_full_blocks(a)
    assert a.block_ids == [0, 1, 2] and a.num_cached_blocks == 3
    # Same 12 tokens again: only 2 blocks may hit, the last token must be computed.
    b = seq(range(12), rid="b")
    hits = kv.prefix_hits(b)
    assert hits == [0, 1]
    assert kv.allocate_slots(b, 12 - 8, hits)
    assert b.block_ids == [0, 1, 3] and b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert pool.ref_counts[:4] == [2, 2, 1, 1]
    kv.free(a)
    kv.free(b)


def test_copy_on_write_of_shared_partial_block(pool):
    kv = KVCacheManager(pool)
    parent = seq(range(6), n=3)  # blocks: [full][2 of 4]
    assert kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    parent.token_ids.append(100)
    c1 = kv.fork(parent, 1)
    c2 = kv.fork(parent, 2)
    c1.token_ids[-1], c2.token_ids[-1] = 101, 102
    assert pool.ref_counts[:2] == [3, 3]
    copies: list[tuple[int, int]] = []
    # Each writer of the shared partial block copies it, except the last holder.
    assert kv.allocate_slots(c1, 1, copies=copies)
    assert kv.allocate_slots(c2, 1, copies=copies)
    assert kv.allocate_slots(parent, 1, copies=copies)
    assert copies == [(1, 2), (1, 3)]
    assert c1.block_ids == [0, 2] and c2.block_ids == [0, 3] and parent.block_ids == [0, 1]
    assert pool.ref_counts[:4] == [3, 1, 1, 1]
    for s in (parent, c1, c2):
        kv.free(s)


def test_blocks_allocated_for_a_pull_are_ordered_like_the_sources(pool):
    """A decode worker's fresh blocks for a pulled prompt are paired with the prefill
    worker's so that a run there (here descending, as a reused pool hands them out) lands in
    a run here: one copy instead of one per block. Hits keep their place at the front."""
    import time

    from tandem.engine.sequence import RemoteKV
    from tandem.kvtransfer.runs import block_runs

    kv = KVCacheManager(pool)
    held = pool.allocate(2)
    pool.free([held[0]])  # free: [2..7] in order, then 0 (1 stays taken)
    s = seq(range(5 * BS), rid="pulled")
    s.remote = RemoteKV("p:1", "L1", time.monotonic() + 60, (42, 41, 40, 39, 38), (7,), (None,))
    assert kv.allocate_for_pull(s, hits=[])
    assert s.block_ids == [6, 5, 4, 3, 2]  # the 5 allocated (2..6), in the source's order
    assert block_runs(s.remote.block_ids, s.block_ids) == [(38, 2, 5)]
    kv.free(s)
    pool.free([held[1]])


def test_order_like_pairs_each_source_stretch_with_a_range_of_blocks():
    from tandem.kvtransfer.runs import block_runs, order_like

    src = [10, 9, 8, 7, 30, 31, 32, 5]
    blocks = [203, 100, 50, 101, 102, 200, 201, 202]
    out = order_like(src, blocks)
    assert sorted(out) == sorted(blocks)
    assert out == [50, 102, 101, 100, 200, 201, 202, 203]  # 50 alone: no 51 after it
    assert block_runs(src, out) == [(10, 50, 1), (7, 100, 3), (30, 200, 3), (5, 203, 1)]
    assert order_like([], []) == []
    assert block_runs(range(50, 10, -1), order_like(range(50, 10, -1), range(500, 540))) == [
        (11, 500, 40)]
    with pytest.raises(ValueError, match="2 blocks for 3 source ids"):
        order_like([1, 2, 3], [4, 5])


def test_allocate_fails_cleanly_when_short(pool):
    kv = KVCacheManager(pool)
    a = seq(range(30))
    assert not kv.allocate_slots(a, 33)  # 9 blocks > 8
    assert a.block_ids == [] and pool.num_free == 8
    assert kv.allocate_slots(a, 32)
    kv.free(a)


def test_block_hashes_agree_across_processes():
    import subprocess
    import sys

    code = ("from tandem.engine.block_pool import hash_block; h = hash_block(None, [1, 2, 3, 4]); "
            "print(h, hash_block(h, [5, 6, 7, 8]))")
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True).stdout for _ in range(2)}
    h = hash_block(None, [1, 2, 3, 4])
    assert runs == {f"{h} {hash_block(h, [5, 6, 7, 8])}\n"}


def test_kv_events_record_stores_and_evictions():
    pool = BlockPool(num_blocks=3, block_size=BS)
    assert pool.take_events() == ([], [])  # not recording
    pool.kv_events = {}
    a = pool.allocate(2)
    pool.cache_block(a[0], 100)
    pool.cache_block(a[1], 101)
    pool.cache_block(a[1], 101)  # already cached: no second event
    assert pool.take_events() == ([100, 101], [])
    pool.free(a)  # freed blocks stay cached: nothing changes
    assert pool.take_events() == ([], [])
    b = pool.allocate(3)  # the free uncached block first, then the two cached (tail first)
    assert pool.take_events() == ([], [101, 100])
    pool.cache_block(b[0], 100)  # the same prefix computed again
    assert pool.take_events() == ([100], [])
    pool.free(b)
    c = pool.allocate(3)
    pool.cache_block(c[2], 100)  # evicted, then stored again in one record: stored
    stored, removed = pool.take_events()
    assert stored == [100] and removed == []
    pool.free(c)
    pool.reset_prefix_cache()
    assert pool.take_events() == ([], [100])
    assert pool.is_idle()
