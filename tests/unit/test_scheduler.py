"""The scheduler (token budget, chunked prefill, max_num_seqs, preemption, the watermark) on exact
block ids, with the model replaced by run_step. Plain Python: no model, no torch."""

from __future__ import annotations

import time

import pytest

from tandem.engine.block_pool import BlockPool
from tandem.engine.config import SchedulerConfig
from tandem.engine.kv_manager import KVCacheManager
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import Scheduler
from tandem.engine.sequence import RemoteKV, Sequence, Status

BS = 4


@pytest.fixture
def pool():
    p = BlockPool(num_blocks=8, block_size=BS)
    yield p
    assert p.is_idle(), f"pool not idle after test: refs {p.ref_counts}"


def seq(tokens, rid="r", n=1, max_tokens=16):
    return Sequence(rid, list(tokens), SamplingParams(n=n, max_tokens=max_tokens, temperature=0))


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


def test_a_sequence_whose_kv_is_arriving_is_neither_scheduled_nor_preempted(pool):
    """A decode worker's pull over NIXL writes a sequence's blocks outside the step: until it
    is done (kv_pull cleared) the sequence is skipped, and when blocks run out the newest
    sequence not pulling is preempted instead (here the one asking)."""
    sched = make_scheduler(pool)
    old, pulling = seq(range(16), "old"), seq(range(100, 116), "pulling")
    sched.add(old)
    sched.add(pulling)
    run_step(sched, sched.schedule())  # 4 blocks each: pool full
    pulling.kv_pull = object()  # its KV still arriving
    held = list(pulling.block_ids)
    batch = sched.schedule()  # old needs a 5th block; pulling may not lose its blocks
    assert [s.request_id for s in batch.preempted] == ["old"] and batch.seqs == []
    assert pulling.block_ids == held and pulling.status is Status.RUNNING
    assert list(sched.waiting) == [old] and sched.running == [pulling]
    assert sched.schedule().seqs == []  # still arriving: not scheduled
    pulling.kv_pull = None
    assert [s.request_id for s in sched.schedule().seqs] == ["pulling"]
    finish_all(sched)


def test_admission_waits_while_too_many_sequences_wait_for_their_kv(monkeypatch):
    import tandem.engine.scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "MAX_PULLING", 2)
    pool = BlockPool(num_blocks=32, block_size=BS)
    sched = make_scheduler(pool)
    remote = RemoteKV("p:1", "L", float("inf"), (1,), (7,), (None,))
    seqs = [seq(range(10 * i, 10 * i + 4), f"r{i}") for i in range(4)]
    for s in seqs:
        s.remote = remote
        sched.add(s)
    assert len(sched.schedule().pulls) == 4  # none waiting for its KV yet
    for s in seqs[:2]:
        s.kv_pull = object()  # still arriving
    for s in seqs[2:]:
        s.remote = None
        s.num_computed_tokens = s.num_tokens  # pulled
        s.token_ids.append(7)
    late = seq(range(100, 104), "late")
    late.remote = remote
    sched.add(late)
    batch = sched.schedule()
    assert batch.pulls == [] and list(sched.waiting) == [late]
    assert [s.request_id for s in batch.seqs] == ["r2", "r3"]
    seqs[0].kv_pull = None
    seqs[0].remote = None
    seqs[0].num_computed_tokens = seqs[0].num_tokens
    seqs[0].token_ids.append(7)
    assert sched.schedule().pulls == [late]  # one waits now: room for another
    for s in [*seqs, late]:
        s.kv_pull = None
    finish_all(sched)
    assert pool.is_idle()


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


def remote_seq(tokens, rid):
    """A request whose prompt KV lives on a prefill worker, in blocks 1000, 1001, ... there
    (ascending: the blocks allocated here keep their ascending order)."""
    s = seq(tokens, rid)
    s.remote = RemoteKV("p:1", f"lease-{rid}", time.monotonic() + 60,
                        tuple(range(1000, 1000 + -(-len(s.token_ids) // BS))), (7,), (None,))
    return s


def test_pull_admission_keeps_cached_full_blocks(pool):
    """Decode role: a prompt whose full blocks this pool caches is admitted with those blocks
    (a reference taken each) and fresh ones for the rest; only the rest is pulled. Exact ids."""
    sched = make_scheduler(pool)
    a = remote_seq(range(10), "a")  # blocks [0..3] [4..7] [8 9]
    sched.add(a)
    batch = sched.schedule()
    assert batch.pulls == [a] and a.block_ids == [0, 1, 2] and a.num_cached_blocks == 0
    a.num_computed_tokens = a.num_prompt_tokens  # pulled
    sched.kv.cache_full_blocks(a)
    # The next turn repeats a's prompt and adds 6 tokens: blocks 0 and 1 are kept, the
    # block holding tokens 8..11 is new (a's block 2 is partial, never cached).
    b = remote_seq([*range(10), 50, 51, 52, 53, 54, 55], "b")
    sched.add(b)
    batch = sched.schedule()
    assert batch.pulls == [b]
    assert b.block_ids[:2] == [0, 1] and b.num_cached_blocks == 2
    assert b.num_cached_tokens == 2 * BS and len(b.block_ids) == 4
    assert pool.ref_counts[0] == pool.ref_counts[1] == 2
    finish_all(sched)  # each shared block dropped once per holder: the pool goes idle


def test_pull_admission_revives_free_cached_blocks_and_counts_them():
    """A cached block that is free (its request ended) counts against the free blocks when
    revived: with room for the rest but not for the revival, admission waits."""
    pool = BlockPool(num_blocks=4, block_size=BS)
    sched = make_scheduler(pool)
    a = remote_seq(range(8), "a")
    sched.add(a)
    sched.schedule()
    a.num_computed_tokens = 8
    sched.kv.cache_full_blocks(a)
    finish_all(sched)  # blocks 0, 1 free but cached
    other = seq(range(100, 108), "x")  # takes the 2 uncached free blocks
    sched.add(other)
    sched.schedule()
    b = remote_seq([*range(8), 9, 9, 9, 9, 9, 9, 9, 9], "b")  # needs 0, 1 + 2 new: 4 > 2 free
    sched.add(b)
    assert sched.schedule().pulls == []
    finish_all(sched)
    assert pool.is_idle()
