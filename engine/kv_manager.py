"""Per-sequence block bookkeeping on top of the BlockPool: prefix hits, slot allocation,
copy-on-write of a shared partial block, forks, and publishing full blocks to the cache."""

from __future__ import annotations

from engine.block_pool import BlockPool
from engine.config import cdiv
from engine.sequence import Sequence
from kvtransfer.runs import order_like


class KVCacheManager:
    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.block_size = pool.block_size

    def prefix_hits(self, seq: Sequence) -> list[int]:
        """Cached blocks holding a prefix of seq. At least one token is always left to compute
        (its logits give the next token), so hits stop at (num_tokens - 1) // block_size."""
        if not self.pool.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []  # prompt logprobs: every position's logits are computed
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hashes = seq.full_block_hashes(self.block_size, max_blocks * self.block_size)
        return self.pool.lookup(hashes)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, hits: list[int] = (),
                       copies: list[tuple[int, int]] | None = None, reserve: int = 0) -> bool:
        """Make room for num_new_tokens more tokens of seq (after adopting prefix hits),
        leaving at least `reserve` blocks free. Returns False, changing nothing, when the pool
        is short. A copy-on-write of the last block is appended to `copies` as (src, dst).

        Called for every running sequence every step: the common decode case (room left in a
        private last block) returns after a few integer operations."""
        bs = self.block_size
        blocks = seq.block_ids
        computed = len(hits) * bs if hits else seq.num_computed_tokens
        have = len(hits) if hits else len(blocks)
        need = (computed + num_new_tokens + bs - 1) // bs - have
        cow = (not hits and computed % bs != 0 and have * bs > computed
               and self.pool.ref_counts[blocks[-1]] > 1)
        if need <= 0 and not cow:
            return True
        # Reviving free cached hits takes them out of the free queue too.
        revived = sum(1 for b in hits if self.pool.ref_counts[b] == 0) if hits else 0
        if max(need, 0) + cow + revived + reserve > self.pool.num_free:
            return False
        if hits:
            assert not blocks and seq.num_computed_tokens == 0
            self.pool.incref(hits)
            seq.block_ids = blocks = list(hits)
            seq.num_computed_tokens = seq.num_cached_tokens = computed
            seq.num_cached_blocks = len(hits)
        if cow:
            src = blocks[-1]
            (dst,) = self.pool.allocate(1)
            self.pool.free([src])
            blocks[-1] = dst
            if copies is not None:
                copies.append((src, dst))
        if need > 0:
            blocks.extend(self.pool.allocate(need))
        return True

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

    def pulled_prefix_hits(self, seq: Sequence) -> list[int]:
        """Decode role: cached blocks holding a prefix of a prompt whose KV arrives from a
        prefill worker. Every full prompt block may hit (the first token came with the
        handoff: nothing here needs the prompt's last logits); the partial last block never
        does."""
        if not self.pool.enable_prefix_caching:
            return []
        hashes = seq.full_block_hashes(self.block_size, seq.num_prompt_tokens)
        return self.pool.lookup(hashes)

    def allocate_for_pull(self, seq: Sequence, hits: list[int], reserve: int = 0) -> bool:
        """Decode role: the prompt's blocks, the first len(hits) of them shared from this
        pool's prefix cache (a reference taken on each), the rest fresh for the pull to fill:

            prompt blocks:  [ hit | hit | hit | new | new ]   (last one partial or full)
                              └ kept here ──────┘└ pulled ──┘

        The new blocks are ordered like the source blocks they receive (kvtransfer.runs.
        order_like), so that blocks adjacent there land in blocks adjacent here: one copy per
        run instead of one per block.

        Returns False, changing nothing, when the pool is short."""
        need = cdiv(seq.num_prompt_tokens, self.block_size) - len(hits)
        revived = sum(1 for b in hits if self.pool.ref_counts[b] == 0)
        if need + revived + reserve > self.pool.num_free:
            return False
        src = seq.remote.block_ids[len(hits):] if seq.remote is not None else ()
        self.pool.incref(hits)
        fresh = self.pool.allocate(need)
        if len(src) == need:  # paired like the source's blocks: the pull moves runs
            fresh = order_like(src, fresh)
        seq.block_ids = [*hits, *fresh]
        seq.num_cached_blocks = len(hits)
        seq.num_cached_tokens = len(hits) * self.block_size
        return True

    def rewind(self, seq: Sequence, num_computed: int) -> None:
        """Speculative decoding: a verify step wrote KV past what was accepted; the sequence's
        computed length moves back to `num_computed` and the blocks past it are freed (the
        stale KV left in its last block is overwritten by the next steps, never read: attention
        stops at the context length). Nothing is copied.

            before:  [ b0 | b1 ...xx | b2 xxx ]     x: KV of rejected drafts
            after:   [ b0 | b1 ...   ]           b2 back to the pool

        Only blocks this step allocated are freed: they hold no accepted token, so none is
        shared or in the prefix cache."""
        keep = cdiv(num_computed, self.block_size)
        assert keep <= len(seq.block_ids), "rewound past the blocks the sequence holds"
        if keep < len(seq.block_ids):
            self.pool.free(seq.block_ids[keep:])
            del seq.block_ids[keep:]
        seq.num_computed_tokens = num_computed

    def free(self, seq: Sequence) -> None:
        self.pool.free(seq.block_ids)
        seq.block_ids = []
        seq.num_cached_blocks = 0
