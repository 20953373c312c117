"""The host tier shared by the workers of a host (engine/shared_host_tier.py) on the CPU, two
workers' pools in one process: a block one evicts comes back into the other's pool with its
bytes, a salted prefix never crosses salts, a slot being read is never reused, a worker of
another checkpoint or size is refused naming the field, and the last worker out removes the
segment."""

from __future__ import annotations

import os
import uuid

import pytest
import torch

from tandem.engine.block_pool import BlockPool
from tandem.engine.kv_manager import KVCacheManager
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sequence import Sequence
from tandem.engine.shared_host_tier import READY, SharedHostKVTier, fingerprint, segment_path
from tandem.errors import InvalidArgument

BS = 4
FP = fingerprint("tiny", (1, 2, BS, 1, 2), "float32")


class Worker:
    """One worker's pool, its data and its view of the shared tier."""

    def __init__(self, name: str, capacity: int = 16, fp: bytes = FP, num_blocks: int = 4):
        self.pool = BlockPool(num_blocks, BS)
        self.data = torch.zeros(num_blocks, 1, 2, BS, 1, 2)
        self.tier = SharedHostKVTier(self.data, capacity, name, fp)
        self.tier.index.events = {}
        self.kv = KVCacheManager(self.pool, self.tier)

    def run(self, tokens: list[int], salt: str = "") -> tuple[Sequence, int]:
        """Admit, 'compute' what missed (each block's KV: a value of its tokens and salt),
        publish, finish; (the sequence, blocks it found cached)."""
        seq = Sequence("r", tokens, SamplingParams(max_tokens=1, cache_salt=salt))
        hits = self.kv.prefix_hits(seq)
        assert self.kv.allocate_slots(seq, len(tokens) - len(hits) * BS, hits)
        self.tier.flush()
        for i in range(len(hits), len(seq.block_ids)):
            self.data[seq.block_ids[i]] = float(sum(tokens[i * BS:(i + 1) * BS])
                                                + 1000 * len(salt))
        seq.num_computed_tokens = len(tokens)
        self.kv.cache_full_blocks(seq)
        self.kv.free(seq)
        return seq, len(hits)

    def churn(self) -> None:
        """A prompt that takes every block of the pool: what it cached goes to the tier."""
        self.run(list(range(900, 900 + BS * self.pool.num_blocks)))
        self.tier.flush()


@pytest.fixture
def name():
    n = f"test-{uuid.uuid4().hex[:12]}"
    yield n
    assert not os.path.exists(segment_path(n)), "the segment outlived its workers"


def test_a_block_one_worker_evicts_is_served_to_another_with_its_bytes(name):
    a, b = Worker(name), Worker(name)
    assert a.tier.tier_id == b.tier.tier_id != ""
    prompt = list(range(1, 14))  # 3 full blocks + 1 token
    seq, hits_a = a.run(prompt)
    assert hits_a == 0
    want = [a.data[blk].clone() for blk in seq.block_ids[:3]]
    a.churn()  # a's pool evicts the prompt's blocks into the shared tier
    stored, removed = a.tier.index.take_events()
    assert set(seq.block_hashes[:3]) <= set(stored) and not removed
    again = Sequence("r2", prompt, SamplingParams(max_tokens=1))
    hits = b.kv.prefix_hits(again)  # b never saw the prompt
    assert len(hits) == 3 and b.tier.stats().hits == 3
    assert b.kv.allocate_slots(again, 1, hits)
    b.tier.flush()
    for blk, w in zip(again.block_ids[:3], want):
        assert torch.equal(b.data[blk], w)
    b.kv.free(again)
    assert all(pins == 0 and state == READY for _, state, pins in a.tier.index.slots_in_use())
    assert a.pool.is_idle() and b.pool.is_idle()
    a.tier.close()
    assert os.path.exists(segment_path(name))  # b still holds it
    b.tier.close()


def test_salted_prefixes_cross_workers_only_under_their_salt(name):
    a, b = Worker(name), Worker(name)
    prompt = list(range(1, 14))
    a.run(prompt, salt="tenant-a")
    a.churn()
    for salt in ("", "tenant-b"):
        assert b.run(prompt, salt=salt)[1] == 0
    b.churn()
    assert b.run(prompt, salt="tenant-a")[1] == 3
    a.tier.close(), b.tier.close()


def test_a_slot_being_read_is_not_reused_and_ways_evict_lru(name):
    a = Worker(name, capacity=8)  # one set of 8 ways
    ix = a.tier.index
    assert (ix.capacity, ix.ways, ix.num_sets) == (8, 8, 1)
    for h in range(8):
        assert ix.put(h) == h
    ix.publish(list(range(8)))
    assert ix.get(0) == 0  # pinned by the reader; now the most recently used
    assert ix.put(100) == 1  # the least recently used unpinned: 1
    ix.publish([1])
    for h in range(101, 107):
        ix.put(h)
        ix.publish([ix._find(h)])
    assert ix._find(0) == 0  # still pinned: never the victim
    slot_0_state = ix.slots_in_use()[0]
    assert slot_0_state == (0, READY, 1)
    ix.unpin([0])
    assert ix.put(200) == 0  # unpinned and least recently used now
    assert ix.get(200) is None  # WRITING: not found before its copy is published
    a.tier.close()


def test_a_full_set_drops_the_block_whose_loss_costs_least(name):
    """A restore stops at a chain's first block missing, so a full set drops a chain's last
    block held (a leaf) before one with a child held, and, with no leaf, the deepest. Before,
    it dropped the set's least recently used block: in both cases here a chain's head, which
    took its whole chain from the next restore."""
    a = Worker(name, capacity=24)  # 3 sets of 8 ways: hash h in set h % 3
    ix = a.tier.index
    assert (ix.num_sets, ix.ways) == (3, 8)

    def h(set_: int, k: int) -> int:
        return 3 * k + set_

    def store(block: int, parent: int | None = None, depth: int = 0) -> None:
        ix.publish([ix.put(block, parent, depth)])

    def chain_tail_first(blocks: list[int]) -> None:  # as a pool evicts a prompt's blocks
        for d in reversed(range(len(blocks))):
            store(blocks[d], blocks[d - 1] if d else None, d)

    # Set 0: chains A (2 blocks), B (4), C (2), each stored tail first; then A's second
    # block is read back (a restore), so A's head, with a child held, is the set's LRU slot.
    A, B, C = [h(0, 1), h(0, 2)], [h(0, k) for k in range(3, 7)], [h(0, 7), h(0, 8)]
    for blocks in (A, B, C):
        chain_tail_first(blocks)
    ix.unpin([ix.get(A[1])])
    assert {b: k for b, _, _, k in ix.slots_children()} == {
        A[0]: 1, A[1]: 0, B[0]: 1, B[1]: 1, B[2]: 1, B[3]: 0, C[0]: 1, C[1]: 0}
    store(h(0, 9))  # the oldest leaf goes: B's last block (B keeps 3), not A's head (A: 0)
    assert ix._find(B[3]) is None and ix._find(A[0]) is not None

    # Set 1: 8 blocks, each with a child held in set 2 (no leaf): 4 heads stored first, then
    # 4 blocks at depth 5. The deepest, least recently used goes, not the LRU head.
    for k in range(1, 9):
        store(h(1, k), None, 0 if k <= 4 else 5)
        store(h(2, k), h(1, k), 1 if k <= 4 else 6)
    store(h(1, 9))
    assert ix._find(h(1, 5)) is None and ix._find(h(1, 1)) is not None
    a.tier.close()


def test_refused_for_another_checkpoint_or_size_and_reopened_after_the_last_left(name):
    a = Worker(name)
    with pytest.raises(InvalidArgument, match="host_kv_share"):
        Worker(name, fp=fingerprint("another", (1, 2, BS, 1, 2), "float32"))
    with pytest.raises(InvalidArgument, match="host_kv_cache_gb"):
        Worker(name, capacity=32)
    a.tier.close()
    b = Worker(name, capacity=32)  # the last left: a new tier, of the new size
    assert b.tier.index.capacity == 32
    b.tier.close()
    with pytest.raises(InvalidArgument, match="host_kv_share"):
        segment_path("../etc")
