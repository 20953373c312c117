"""Per-sequence block bookkeeping on top of the BlockPool: prefix hits, slot allocation,
copy-on-write of a shared partial block, forks, and publishing full blocks to the cache."""

from __future__ import annotations

from engine.block_pool import BlockPool
from engine.config import cdiv
from engine.sequence import Sequence


class KVCacheManager:
    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.block_size = pool.block_size

    def prefix_hits(self, seq: Sequence) -> list[int]:
        """Cached blocks holding a prefix of seq. At least one token is always left to compute
        (its logits give the next token), so hits stop at (num_tokens - 1) // block_size."""
        if not self.pool.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hashes = seq.full_block_hashes(self.block_size, max_blocks * self.block_size)
        return self.pool.lookup(hashes)

    def can_allocate(self, seq: Sequence, num_new_tokens: int, hits: list[int] = ()) -> bool:
        return self._blocks_needed(seq, num_new_tokens, hits) <= self.pool.num_free

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, hits: list[int] = (),
                       copies: list[tuple[int, int]] | None = None) -> bool:
        """Make room for num_new_tokens more tokens of seq (after adopting prefix hits).
        Returns False, changing nothing, when the pool is short. A copy-on-write of the last
        block is appended to `copies` as (src, dst)."""
        if self._blocks_needed(seq, num_new_tokens, hits) > self.pool.num_free:
            return False
        if hits:
            assert not seq.block_ids and seq.num_computed_tokens == 0
            self.pool.incref(hits)
            seq.block_ids = list(hits)
            seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
            seq.num_cached_blocks = len(hits)
        if self._writes_shared_block(seq):
            src = seq.block_ids[-1]
            (dst,) = self.pool.allocate(1)
            self.pool.free([src])
            seq.block_ids[-1] = dst
            if copies is not None:
                copies.append((src, dst))
        need = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) - len(seq.block_ids)
        if need > 0:
            seq.block_ids.extend(self.pool.allocate(need))
        return True

    def _blocks_needed(self, seq: Sequence, num_new_tokens: int, hits: list[int]) -> int:
        computed = len(hits) * self.block_size if hits else seq.num_computed_tokens
        have = len(hits) if hits else len(seq.block_ids)
        need = max(0, cdiv(computed + num_new_tokens, self.block_size) - have)
        # Reviving free cached hits takes them out of the free queue too.
        need += sum(1 for b in hits if self.pool.ref_counts[b] == 0)
        if not hits and self._writes_shared_block(seq):
            need += 1
        return need

    def _writes_shared_block(self, seq: Sequence) -> bool:
        """The next token lands in a partially filled last block that another sequence shares."""
        return (seq.num_computed_tokens % self.block_size != 0
                and len(seq.block_ids) * self.block_size > seq.num_computed_tokens
                and self.pool.ref_counts[seq.block_ids[-1]] > 1)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Publish blocks that the last step filled (computed) to the prefix cache."""
        full = seq.num_computed_tokens // self.block_size
        if full <= seq.num_cached_blocks or not self.pool.enable_prefix_caching:
            return
        hashes = seq.full_block_hashes(self.block_size, full * self.block_size)
        for i in range(seq.num_cached_blocks, full):
            self.pool.cache_block(seq.block_ids[i], hashes[i])
        seq.num_cached_blocks = full

    def fork(self, parent: Sequence, sample_index: int) -> Sequence:
        child = parent.fork(sample_index)
        self.pool.incref(child.block_ids)
        return child

    def allocate_blocks(self, seq: Sequence, num_tokens: int) -> bool:
        """Decode role: fresh blocks for a prompt whose KV arrives from elsewhere."""
        need = cdiv(num_tokens, self.block_size)
        if need > self.pool.num_free:
            return False
        seq.block_ids = self.pool.allocate(need)
        return True

    def free(self, seq: Sequence) -> None:
        self.pool.free(seq.block_ids)
        seq.block_ids = []
        seq.num_cached_blocks = 0
