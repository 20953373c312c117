"""Block pool, KV manager and scheduler on exact block ids. Plain Python: no model, no torch."""

from __future__ import annotations

import pytest

from engine.block_pool import BlockPool, hash_block
from engine.config import SchedulerConfig
from engine.kv_manager import KVCacheManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, Status

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


def test_allocate_fails_cleanly_when_short(pool):
    kv = KVCacheManager(pool)
    a = seq(range(30))
    assert not kv.allocate_slots(a, 33)  # 9 blocks > 8
    assert a.block_ids == [] and pool.num_free == 8
    assert kv.allocate_slots(a, 32)
    kv.free(a)


def make_scheduler(pool, budget=64, max_seqs=8, max_len=64):
    return Scheduler(SchedulerConfig(budget, max_seqs, max_len), KVCacheManager(pool))


def run_step(sched, batch, sample_token=7):
    """What the engine does after a forward pass, minus the model."""
    for s, n in zip(batch.seqs, batch.num_new_tokens):
        s.num_computed_tokens += n
        sched.kv.cache_full_blocks(s)
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(sample_token)


def finish_all(sched):
    for s in list(sched.running) + list(sched.waiting):
        sched.kv.free(s)
        s.status = Status.FINISHED
    sched.remove_finished()


def test_chunked_prefill_mixes_with_decodes(pool):
    sched = make_scheduler(pool, budget=6)
    a, b = seq(range(5), "a"), seq(range(10, 20), "b")
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()  # a whole (5), b gets the 1 token left
    assert [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)] == [
        ("b", 1), ("a", 5)]
    run_step(sched, batch)
    batch = sched.schedule()  # a decodes (1), b continues its chunk (5)
    assert [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)] == [
        ("a", 1), ("b", 5)]
    assert a.block_ids == [0, 1] and b.block_ids == [2, 3]
    run_step(sched, batch)
    finish_all(sched)


def test_max_num_seqs_caps_admission(pool):
    sched = make_scheduler(pool, max_seqs=2)
    for i in range(3):
        sched.add(seq([i] * 3, f"r{i}"))
    batch = sched.schedule()
    assert [s.request_id for s in batch.seqs] == ["r0", "r1"]
    assert [s.request_id for s in sched.waiting] == ["r2"]
    finish_all(sched)


def test_n_counts_all_samples_against_max_num_seqs(pool):
    sched = make_scheduler(pool, max_seqs=4)
    sched.add(seq([1] * 3, "a", n=3))
    sched.add(seq([2] * 3, "b", n=2))
    batch = sched.schedule()
    assert [s.request_id for s in batch.seqs] == ["a"]
    finish_all(sched)


def test_preempts_newest_when_blocks_run_out(pool):
    sched = make_scheduler(pool)
    old, new = seq(range(16), "old"), seq(range(100, 116), "new")
    sched.add(old)
    sched.add(new)
    run_step(sched, sched.schedule())  # 4 blocks each: pool full
    assert pool.num_free == 0
    old_blocks = list(old.block_ids)
    batch = sched.schedule()  # old needs a 5th block for token 17: new is preempted
    assert [s.request_id for s in batch.preempted] == ["new"]
    assert [s.request_id for s in batch.seqs] == ["old"]
    assert new.status is Status.WAITING and new.block_ids == [] and new.num_computed_tokens == 0
    assert list(sched.waiting) == [new] and sched.num_preemptions == 1
    assert old.block_ids[:4] == old_blocks and len(old.block_ids) == 5
    run_step(sched, batch)
    finish_all(sched)


def test_preempted_sequence_resumes_from_prefix_cache(pool):
    sched = make_scheduler(pool)
    old, new = seq(range(16), "old"), seq(range(100, 116), "new")
    sched.add(old)
    sched.add(new)
    run_step(sched, sched.schedule())
    new_full_blocks = new.block_ids[:3]
    batch = sched.schedule()
    run_step(sched, batch)
    # old finishes; new comes back and finds its 3 full blocks still cached.
    sched.kv.free(old)
    old.status = Status.FINISHED
    sched.remove_finished()
    batch = sched.schedule()
    assert batch.seqs == [new]
    # Its 4th block was reused for old's growth (evicted); the first 3 are hits.
    assert new.block_ids[:3] == new_full_blocks and new.num_cached_tokens == 12
    assert batch.num_new_tokens == [17 - 12]  # 16 prompt + 1 output, 12 from cache
    finish_all(sched)


def test_preempting_itself_when_alone_and_stuck():
    pool = BlockPool(2, BS)
    sched = make_scheduler(pool)
    a = seq(range(8), "a")
    sched.add(a)
    run_step(sched, sched.schedule())
    batch = sched.schedule()  # needs a third block that does not exist
    assert batch.preempted == [a] and batch.seqs == []
    finish_all(sched)
    assert pool.is_idle()


def test_watermark_never_blocks_a_request_alone():
    pool = BlockPool(100, BS)
    sched = make_scheduler(pool, budget=512, max_len=512)
    big = seq(range(399), "big")  # 100 blocks: the whole pool, nothing left for a watermark
    sched.add(big)
    batch = sched.schedule()
    assert batch.seqs == [big] and len(big.block_ids) == 100
    finish_all(sched)


def test_block_hashes_agree_across_processes():
    import subprocess
    import sys

    code = ("from engine.block_pool import hash_block; h = hash_block(None, [1, 2, 3, 4]); "
            "print(h, hash_block(h, [5, 6, 7, 8]))")
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True).stdout for _ in range(2)}
    h = hash_block(None, [1, 2, 3, 4])
    assert runs == {f"{h} {hash_block(h, [5, 6, 7, 8])}\n"}
