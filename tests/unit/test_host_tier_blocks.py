"""The host tier's bookkeeping and copies on the CPU, with exact block ids and slots: evicted
cached blocks land in host slots keyed by their chained hash, a prefix match continues into
them and gets the same bytes back in fresh pool blocks, pinned slots are never reused, and the
tier never holds more than its capacity."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.block_pool import BlockPool
from tandem.engine.host_kv_tier import HostBlockIndex, HostKVTier, host_tier_bytes, host_tier_for
from tandem.engine.kv_manager import KVCacheManager
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sequence import Sequence

BS = 4


def test_index_lru_order_and_touch():
    ix = HostBlockIndex(2)
    assert ix.put(10) == 0 and ix.put(11) == 1
    assert ix.put(10) is None  # held already: touched, nothing to copy
    assert ix.put(12) == 1  # 11 was the least recently used
    assert ix.get(11) is None and ix.get(10) == 0 and ix.get(12) == 1
    assert ix.evictions == 1 and ix.stored == 3 and len(ix) == 2


def test_index_never_reuses_a_pinned_slot():
    ix = HostBlockIndex(2)
    ix.put(1), ix.put(2)
    ix.pinned.update({0, 1})
    assert ix.put(3) is None  # no room: the block is dropped, no slot overwritten
    ix.pinned.discard(1)
    assert ix.put(3) == 1 and ix.get(1) == 0


def _setup(num_blocks: int, capacity: int):
    pool = BlockPool(num_blocks, BS)
    data = torch.zeros(num_blocks, 1, 2, BS, 1, 2)
    tier = HostKVTier(data, capacity)
    tier.memory.done.wait()  # its host memory is there (taken by the tier's own thread)
    return pool, data, tier, KVCacheManager(pool, tier)


def _run_prompt(kv: KVCacheManager, data: torch.Tensor, tier: HostKVTier, tokens: list[int],
                salt: str = "") -> Sequence:
    """Admit, 'compute' (each block's KV: a value derived from its tokens), publish, finish."""
    seq = Sequence("r", tokens, SamplingParams(max_tokens=1, cache_salt=salt))
    hits = kv.prefix_hits(seq)
    assert kv.allocate_slots(seq, len(tokens) - len(hits) * BS, hits)
    tier.flush()
    for i in range(len(hits), len(seq.block_ids)):
        data[seq.block_ids[i]] = float(sum(tokens[i * BS:(i + 1) * BS]) + 1000 * len(salt))
    seq.num_computed_tokens = len(tokens)
    kv.cache_full_blocks(seq)
    return seq


def test_evicted_blocks_come_back_with_their_bytes():
    pool, data, tier, kv = _setup(num_blocks=4, capacity=8)
    a = list(range(1, 14))  # 3 full blocks + 1 token
    seq = _run_prompt(kv, data, tier, a)
    want = [data[b].clone() for b in seq.block_ids[:3]]
    kv.free(seq)
    other = _run_prompt(kv, data, tier, list(range(100, 116)))  # takes all 4 blocks
    tier.flush()
    assert not any(h in pool.cached for h in seq.block_hashes[:3])
    assert tier.stats().stored == 3 and len(tier.index) == 3
    kv.free(other)

    again = Sequence("r2", a, SamplingParams(max_tokens=1))
    hits = kv.prefix_hits(again)
    assert len(hits) == 3 and tier.stats().hits == 3
    assert kv.allocate_slots(again, 1, hits)
    tier.flush()
    assert again.num_cached_tokens == 12
    for b, w in zip(again.block_ids[:3], want):
        assert torch.equal(data[b], w)
    kv.free(again)
    assert pool.is_idle() and not tier.index.pinned and not tier.ops


def test_no_restore_when_the_prompt_cannot_fit():
    pool, data, tier, kv = _setup(num_blocks=4, capacity=8)
    a = list(range(1, 14))
    kv.free(_run_prompt(kv, data, tier, a))
    kv.free(_run_prompt(kv, data, tier, list(range(100, 116))))
    held = pool.allocate(2)  # 2 free: the prompt's 4 blocks cannot be placed
    tier.flush()
    assert kv.prefix_hits(Sequence("r2", a, SamplingParams(max_tokens=1))) == []
    assert tier.stats().hits == 0 and not tier.ops
    pool.free(held)
    assert pool.is_idle()


def test_a_salted_prefix_never_matches_another_salt_from_the_host():
    pool, data, tier, kv = _setup(num_blocks=4, capacity=8)
    a = list(range(1, 14))
    kv.free(_run_prompt(kv, data, tier, a, salt="tenant-a"))
    kv.free(_run_prompt(kv, data, tier, list(range(100, 116))))
    assert len(tier.index) == 3
    for salt in ("", "tenant-b"):
        seq = Sequence("r", a, SamplingParams(max_tokens=1, cache_salt=salt))
        assert kv.prefix_hits(seq) == []
    assert tier.stats().hits == 0
    seq = Sequence("r", a, SamplingParams(max_tokens=1, cache_salt="tenant-a"))
    assert len(kv.prefix_hits(seq)) == 3
    tier.flush()
    assert pool.is_idle()


def test_tier_size_from_the_flag():
    pool = torch.zeros(8, 2, 2, BS, 1, 4)
    block = pool[0].nbytes
    tier = host_tier_for(pool, 5.5 * block / (1 << 30), enabled=True)
    assert tier.index.capacity == 5 and tier.capacity_bytes == 5 * block
    assert host_tier_for(pool, 0.5 * block / (1 << 30), enabled=True) is None
    assert host_tier_for(pool, 1.0, enabled=False) is None
    assert host_tier_bytes(None, torch.device("cpu")) == 0  # CPU: off unless asked


class Allocator:
    """The tier's chunk allocator, recorded: the thread of each call, each held until the test
    lets it go."""

    def __init__(self) -> None:
        import threading

        self.threads: list[int] = []
        self.go = threading.Semaphore(0)

    def __call__(self, shape, dtype, pin):
        import threading

        self.threads.append(threading.get_ident())
        self.go.acquire()
        return torch.zeros(shape, dtype=dtype)


def test_host_memory_is_taken_off_the_steps_thread_and_evictions_never_wait(monkeypatch):
    """Before this tier's memory thread, the step's thread took a chunk on the first eviction
    that reached it (a 256 MiB pinned chunk held a GPU step for a few hundred ms). Now the
    first chunk is taken when the tier is made (before any eviction) and the others by the
    tier's own thread; an eviction with no ready slot reuses the LRU one rather than wait."""
    import threading

    import tandem.engine.host_kv_tier as hkt

    pool = torch.arange(8 * 16, dtype=torch.float32).reshape(8, 1, 2, BS, 1, 2)
    block = pool[0].nbytes
    monkeypatch.setattr(hkt, "CHUNK_BYTES", 2 * block)
    alloc = Allocator()
    monkeypatch.setattr(hkt, "_chunk", alloc)
    alloc.go.release()  # the first chunk, taken as the tier is made
    tier = HostKVTier(pool, 5)  # chunks of 2, 2, 1 slots
    try:
        assert alloc.threads[0] == threading.get_ident() and tier.memory.ready == 2
        steps_thread_calls = len(alloc.threads)
        for b in range(4):  # 4 evictions, 2 ready slots (the thread's next chunk held back)
            tier.offload(b, 100 + b)
            tier.flush()
        assert dict(tier.index.lru) == {102: 0, 103: 1} and tier.index.evictions == 2
        assert tier.allocated_bytes == 2 * block
        alloc.go.release()
        alloc.go.release()
        tier.memory.done.wait()  # the test waits; the step never does
        for b in range(4, 7):
            tier.offload(b, 100 + b)
            tier.flush()
        assert tier.allocated_bytes == tier.capacity_bytes == 5 * block
        assert sorted(tier.index.lru.values()) == [0, 1, 2, 3, 4]
        assert torch.equal(tier.slot(4), pool[6]) and torch.equal(tier.slot(0), pool[2])
        assert len(alloc.threads) == 3
        # Every chunk after the first on the tier's own thread, never on the step's.
        assert threading.get_ident() not in alloc.threads[steps_thread_calls:]
    finally:
        for _ in range(3):
            alloc.go.release()
        tier.close()


@pytest.mark.parametrize("bad", [-1.0, float("nan")])
def test_bad_flag_names_the_field(bad):
    from tandem.engine.config import EngineConfig
    from tandem.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="host_kv_cache_gb"):
        EngineConfig(model="m", host_kv_cache_gb=bad)
    with pytest.raises(InvalidArgument, match="host_kv_cache_gb"):
        EngineConfig(model="m", host_kv_cache_gb=1.0, enable_prefix_caching=False)
    with pytest.raises(InvalidArgument, match="host_kv_share"):  # ranks keep tiers of their own
        EngineConfig(model="m", host_kv_cache_gb=1.0, host_kv_share="t", tensor_parallel_size=2)


def test_metrics_show_the_tier():
    from tandem.engine.serving.core_messages import EngineSnapshot
    from tandem.engine.serving.engine_core import _host_tier_fields
    from tandem.runtime.metrics import Metrics

    pool, data, tier, kv = _setup(num_blocks=4, capacity=2)
    assert pool.is_idle()
    a = list(range(1, 14))
    kv.free(_run_prompt(kv, data, tier, a))
    kv.free(_run_prompt(kv, data, tier, list(range(100, 116))))  # 3 evicted, 2 slots: 1 dropped
    # 2 blocks back from the host (their slots pinned: the 2 blocks their restore evicts find no
    # room), then the 2 new blocks evict 2 more, which replace a's 2 slots.
    kv.free(_run_prompt(kv, data, tier, a))
    tier.flush()
    stats = tier.stats()
    assert (stats.hits, stats.evictions, stats.bytes_used) == (2, 3, 2 * tier.block_bytes)
    snap = EngineSnapshot(block_size=BS, **_host_tier_fields(tier))
    m = Metrics("decode", "m")
    snaps = [snap]
    m.bind_engine(lambda: snaps[-1])
    labels = {"role": "decode", "model_name": "m"}

    def value(name: str) -> float:
        return m.registry.get_sample_value(f"tandem:{name}", labels)

    assert value("host_kv_cache_hits_total") == 2 * BS
    assert value("host_kv_cache_misses_total") == stats.misses * BS > 0
    assert value("host_kv_cache_evictions_total") == 3
    assert value("host_kv_cache_usage_bytes") == stats.bytes_used
    assert value("host_kv_cache_capacity_bytes") == tier.capacity_bytes
    assert value("host_kv_cache_allocated_bytes") == tier.allocated_bytes > 0
    snaps.append(EngineSnapshot(block_size=BS))  # no tier: no such series
    assert value("host_kv_cache_hits_total") is None
    assert pool.is_idle()


@pytest.mark.parametrize("seed", range(6))
def test_every_hit_holds_its_own_prefix_under_churn(seed):
    """Random prompts sharing prefixes (three salts) through a 6-block pool and a 5-slot tier,
    two sequences alive at a time: after each admission's copies, every block a prompt got
    from either tier holds the KV written for that block's hash, and the accounting is exact."""
    import random

    rng = random.Random(seed)
    pool, data, tier, kv = _setup(num_blocks=6, capacity=5)

    def kv_of(h: int) -> float:
        return float(h % 65521)

    stems = [[rng.randrange(1, 50) for _ in range(12)] for _ in range(3)]
    alive: list[Sequence] = []
    restored = 0
    for step in range(120):
        tokens = rng.choice(stems)[:rng.choice([4, 8, 12])] + [rng.randrange(1, 50)
                                                                 for _ in range(rng.randrange(1, 6))]
        seq = Sequence(f"r{step}", tokens, SamplingParams(max_tokens=1,
                                                          cache_salt=rng.choice(["", "a", "b"])))
        hits = kv.prefix_hits(seq)
        if not kv.allocate_slots(seq, len(tokens) - len(hits) * BS, hits):
            tier.flush()
            if alive:
                kv.free(alive.pop(0))
            continue
        tier.flush()
        hashes = seq.full_block_hashes(BS, len(tokens))
        for i in range(len(hits)):
            assert data[seq.block_ids[i]].flatten()[0] == kv_of(hashes[i]), (seed, step, i)
        for i in range(len(hits), len(seq.block_ids)):  # "compute" the rest
            data[seq.block_ids[i]] = kv_of(hashes[i]) if i < len(hashes) else -1.0
        seq.num_computed_tokens = len(tokens)
        kv.cache_full_blocks(seq)
        alive.append(seq)
        if len(alive) > 2:
            kv.free(alive.pop(0))
        ix = tier.index
        assert len(ix.lru) + len(ix.free_slots) == ix.capacity and not ix.pinned
        restored = tier.stats().hits
    for seq in alive:
        kv.free(seq)
    assert pool.is_idle() and restored > 0


class Gate:
    """A deferred restore's copies, done when the test says (a CUDA event on a GPU)."""

    def __init__(self) -> None:
        self.passed = False

    def query(self) -> bool:
        return self.passed


def test_a_restore_runs_beside_the_steps_and_its_request_waits_for_it():
    """With restores beside the steps (CUDA: a side stream; here a gate the test opens), a
    request whose prefix comes back from the tier is admitted holding its blocks but is not
    scheduled until its copies are done, while another request's prefill goes on every step;
    it is never preempted meanwhile; a request ended before its copies are done has its
    blocks freed only once they are. Before, the restore was copied before the step that ran
    its request, and that step (every request in it) waited for the copy."""
    from tandem.engine.config import SchedulerConfig
    from tandem.engine.scheduler import Scheduler

    pool, data, tier, kv = _setup(num_blocks=12, capacity=8)
    tier.async_restores = True
    gates: list[Gate] = []

    def record() -> Gate:
        gates.append(Gate())
        return gates[-1]

    tier._record = record
    a = list(range(1, 14))  # 3 full blocks + 1 token
    kv.free(_run_prompt(kv, data, tier, a))
    want = [data[b].clone() for b in pool.cached.values()]
    kv.free(_run_prompt(kv, data, tier, list(range(100, 148))))  # 12 blocks: a's 3 evicted
    tier.flush()
    assert len(tier.index) == 3 and not pool.cached.keys() & set(
        Sequence("x", a, SamplingParams()).full_block_hashes(BS, 12))

    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=16), kv)
    other = Sequence("other", list(range(200, 208)), SamplingParams(max_tokens=8))
    again = Sequence("again", a, SamplingParams(max_tokens=1))
    sched.add(other)
    sched.add(again)
    steps = []
    for k in range(3):
        batch = sched.schedule()
        tier.flush()
        steps.append([(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)])
        sched.advance(batch, 0.0, 0.0)
        other.token_ids.append(300 + k)  # its sampled token: it decodes next step
    # Step 1: "other" prefills and "again" is admitted with its 3 blocks from the tier, then
    # waits for their copies while "other" decodes.
    assert steps == [[("other", 8)], [("other", 1)], [("other", 1)]]
    assert again in sched.running and again.restoring is not None and len(gates) == 1
    assert again.num_computed_tokens == 12 and tier.stats().hits == 3
    assert sched._pop_victim() is other and sched.running == [again]  # never the restoring one
    sched.running.insert(0, other)
    gates[0].passed = True  # the copies are done
    batch = sched.schedule()
    assert [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)] == [
        ("other", 1), ("again", 1)]
    for b, w in zip(again.block_ids[:3], want):
        assert torch.equal(data[b], w)
    sched.advance(batch, 0.0, 0.0)

    sched.running.clear()
    kv.free(again)
    kv.free(other)
    assert pool.is_idle()

    # Ended while its copies are in flight: its blocks stay taken until they are done.
    pool, data, tier, kv = _setup(num_blocks=4, capacity=8)
    kv.free(_run_prompt(kv, data, tier, a))
    kv.free(_run_prompt(kv, data, tier, list(range(100, 116))))  # a's 3 blocks to the tier
    tier.flush()
    tier.async_restores, tier._record = True, record
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=16), kv)
    late = Sequence("late", a, SamplingParams(max_tokens=1))
    sched.add(late)
    assert sched.schedule().seqs == []
    tier.flush()
    assert late.restoring is not None and len(gates) == 2
    sched.running.remove(late)  # aborted
    kv.free(late)
    assert not pool.is_idle() and sched.has_work()
    sched.schedule()
    assert not pool.is_idle()
    gates[1].passed = True
    sched.schedule()
    assert pool.is_idle() and not sched.has_work() and not kv.inflight
