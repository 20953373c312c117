"""The host tier's memory under a long run (CPU, exact accounting): 50 waves of multi-turn
conversations through a pool far smaller than they are, for a private tier and a shared one.
After every wave the tier holds at most its size in blocks and bytes, the host memory it has
taken (the private tier's chunks; the shared segment's pages in /dev/shm) never exceeds its
size, every block a prompt got back holds its own prefix's KV, and the pool is idle."""

from __future__ import annotations

import os
import random
import uuid

import pytest
import torch

from tandem.engine.block_pool import BlockPool
from tandem.engine.host_kv_tier import HostKVTier
from tandem.engine.kv_manager import KVCacheManager
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sequence import Sequence
from tandem.engine.shared_host_tier import SharedHostKVTier, fingerprint, segment_path

BS = 4
SHAPE = (1, 2, BS, 1, 2)
WAVES = 50
CONVERSATIONS = 6
CAPACITY = 24  # tier blocks; the conversations hold about 3x that at their longest


def kv_of(h: int) -> float:
    return float(h % 65521)


def make_tier(kind: str, data: torch.Tensor) -> HostKVTier:
    if kind == "private":
        tier = HostKVTier(data, CAPACITY)
        tier.memory.done.wait()  # its memory thread is done (the step never waits for it)
        return tier
    return SharedHostKVTier(data, CAPACITY, f"test-{uuid.uuid4().hex[:12]}",
                            fingerprint("soak", SHAPE, "float32"))


def taken_bytes(tier: HostKVTier) -> int:
    """Host memory the tier has really taken: its chunks, or the segment's pages."""
    if isinstance(tier, SharedHostKVTier):
        return os.stat(tier.index.path).st_blocks * 512
    return sum(c.untyped_storage().nbytes() for c in tier.memory.chunks)


@pytest.mark.parametrize("kind", ["private", "shared"])
def test_the_tier_stays_within_its_size_over_50_waves(kind):
    rng = random.Random(0)
    pool = BlockPool(16, BS)
    data = torch.zeros(16, *SHAPE)
    tier = make_tier(kind, data)
    kv = KVCacheManager(pool, tier)
    # The shared segment: its header and table beside the slots' bytes, in whole pages.
    size = os.stat(tier.index.path).st_size if kind == "shared" else tier.capacity_bytes
    overhead = -(-size // 4096) * 4096 - tier.capacity_bytes if kind == "shared" else 0
    history = [[] for _ in range(CONVERSATIONS)]
    restored = 0
    try:
        for wave in range(WAVES):
            for c in rng.sample(range(CONVERSATIONS), CONVERSATIONS):
                if len(history[c]) > 10 * BS:  # the conversation ends; a new one starts
                    history[c] = []
                prompt = history[c] + [rng.randrange(1, 200) for _ in range(BS + 1)]
                seq = Sequence(f"w{wave}c{c}", prompt, SamplingParams(max_tokens=1))
                hits = kv.prefix_hits(seq)
                assert kv.allocate_slots(seq, len(prompt) - len(hits) * BS, hits)
                tier.flush()
                hashes = seq.full_block_hashes(BS, len(prompt))
                for i in range(len(hits)):  # what came back is this prefix's KV
                    assert data[seq.block_ids[i]].flatten()[0] == kv_of(hashes[i])
                for i in range(len(hits), len(seq.block_ids)):
                    data[seq.block_ids[i]] = kv_of(hashes[i]) if i < len(hashes) else -1.0
                seq.num_computed_tokens = len(prompt)
                kv.cache_full_blocks(seq)
                kv.free(seq)
                history[c] = prompt + [rng.randrange(1, 200) for _ in range(2)]
            tier.flush()
            s = tier.stats()
            assert len(tier.index) <= CAPACITY
            assert s.bytes_used <= s.capacity_bytes == CAPACITY * tier.block_bytes
            assert s.allocated_bytes <= s.capacity_bytes
            assert taken_bytes(tier) <= s.capacity_bytes + overhead, wave
            if kind == "shared":
                assert os.stat(tier.index.path).st_size == size  # the segment never grows
            assert pool.is_idle()
            restored = s.hits
        s = tier.stats()
        assert s.evictions > 0 and restored > 0  # the bound was pressed, and the tier served
        assert s.stored > 3 * CAPACITY
    finally:
        tier.close()
    if kind == "shared":
        assert not os.path.exists(segment_path(tier.index.path.rsplit("tier-", 1)[1]))
