"""Per-sequence block bookkeeping on top of the BlockPool: prefix hits, slot allocation,
copy-on-write of a shared partial block, forks, and publishing full blocks to the cache. With a
host tier (engine/host_kv_tier.py), prefix hits continue into it."""

from __future__ import annotations

from typing import Protocol

from tandem.engine.block_pool import BlockPool
from tandem.engine.config import cdiv
from tandem.engine.sequence import Sequence
from tandem.kvtransfer.runs import order_like


class Ticket(Protocol):
    """Deferred restores' copies (engine/host_kv_tier.py RestoreTicket)."""

    def done(self) -> bool: ...


class HostTier(Protocol):
    """What the prefix match needs of a host tier (engine/host_kv_tier.py HostKVTier)."""

    async_restores: bool  # restores may run beside the steps (their requests wait instead)

    def lookup(self, block_hash: int) -> int | None: ...  # the slot, pinned until unpin
    def unpin(self, slots: list[int]) -> None: ...
    def restore(self, slot: int, block: int, deferred: bool = False) -> Ticket | None: ...
    def count_misses(self, n: int) -> None: ...
    def offload(self, block: int, block_hash: int, parent: int | None, depth: int) -> None: ...


class KVCacheManager:
    def __init__(self, pool: BlockPool, host: HostTier | None = None) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        # The host tier keeps what the pool evicts; prefix hits continue into it.
        self.host = host if pool.enable_prefix_caching else None
        if self.host is not None:
            pool.on_evict = self.host.offload
        # Deferred restores (a tier with async_restores): pool blocks whose copy may still be
        # in flight, and blocks of sequences freed before theirs was done (freed once it is).
        self.inflight: dict[int, Ticket] = {}
        self.held: list[tuple[Ticket, list[int]]] = []

    def prefix_hits(self, seq: Sequence) -> list[int]:
        """Cached blocks holding a prefix of seq. At least one token is always left to compute
        (its logits give the next token), so hits stop at (num_tokens - 1) // block_size."""
        if not self.pool.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []  # prompt logprobs: every position's logits are computed
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hashes = seq.full_block_hashes(self.block_size, max_blocks * self.block_size)
        deferred = self.host is not None and self.host.async_restores
        hits = self._from_host(hashes, self.pool.lookup(hashes),
                               cdiv(seq.num_tokens, self.block_size), deferred)
        if deferred:  # the step need not wait for the copies: seq waits (restored) instead
            seq.restoring = self._last_pending(hits)
        return hits

    def _last_pending(self, blocks: list[int]) -> Ticket | None:
        """The latest ticket not yet done among these blocks' restores, or None."""
        inflight = self.inflight
        last = None
        for b in blocks:
            t = inflight.get(b)
            if t is not None and not t.done():
                last = t
        return last

    def restored(self, seq: Sequence) -> bool:
        """Whether seq's prefix is in its blocks (no deferred restore of it in flight)."""
        if seq.restoring is not None and not seq.restoring.done():
            return False
        seq.restoring = None
        return True

    def settle(self) -> None:
        """Once a step: forget restores done, free the blocks held for them."""
        if self.inflight:
            self.inflight = {b: t for b, t in self.inflight.items() if not t.done()}
        if self.held:
            done = [blocks for t, blocks in self.held if t.done()]
            self.held = [(t, blocks) for t, blocks in self.held if not t.done()]
            for blocks in done:
                self.pool.free(blocks)

    def _from_host(self, hashes: list[int], hits: list[int], total_blocks: int,
                   deferred: bool = False) -> list[int]:
        """`hits` continued past the pool's cached blocks: a block the pool still caches (past
        a gap) is taken as it is; one the host tier holds is copied into a fresh block, which
        is published in the prefix cache under its hash and left free and cached, for
        allocate_slots (or allocate_for_pull) to revive like any hit. Nothing is restored
        unless the pool has room for every block of the prompt's `total_blocks` still to
        place: a request that cannot be admitted now copies nothing. `deferred`: the copies
        run beside the steps, each fresh block listed in `inflight` until they are done.

            hashes:  [ h0 | h1 | h2 | h3 | h4 | h5 ]
            pool:    [ b7 | b2 | -- | b9 | -- | -- ]     hits [b7, b2]
            host:    [    |    | s4 |    | s1 | -- ]
            result:  [ b7 | b2 | new <- s4 | b9 | new <- s1 ]     (h5: computed)
        """
        host = self.host
        if host is None or len(hits) == len(hashes):
            return hits
        pool = self.pool
        chain: list[int | None] = []  # past the hits: a pool block, or None (from a slot)
        slots: list[int] = []
        for h in hashes[len(hits):]:
            b = pool.cached.get(h)
            if b is None:
                slot = host.lookup(h)
                if slot is None:
                    break
                slots.append(slot)
            chain.append(b)
        host.count_misses(len(hashes) - len(hits) - len(chain))
        kept = hits + [b for b in chain if b is not None]
        revived = sum(1 for b in kept if pool.ref_counts[b] == 0)
        if not slots or pool.num_free - revived < total_blocks - len(kept):
            host.unpin(slots)
            return hits
        # The slots are pinned since lookup: the evictions below do not reuse one still to be
        # read (nor, in a shared tier, does another worker).
        pool.incref(kept)  # ... nor take a block of this prefix
        fresh = iter(zip(slots, pool.allocate(len(slots))))
        out = list(hits)
        for i, b in enumerate(chain, len(hits)):
            if b is None:
                slot, b = next(fresh)
                ticket = host.restore(slot, b, deferred)
                if ticket is not None:
                    self.inflight[b] = ticket
                pool.cache_block(b, hashes[i], hashes[i - 1] if i else None, i)
            out.append(b)
        host.unpin(slots)
        pool.free(out)
        return out

    def take_prefix(self, hashes: list[int], reserve: int = 0) -> list[int]:
        """The blocks holding the longest run of these chained hashes that this pool caches or
        its host tier holds (copied back into fresh pool blocks, published in the prefix cache
        as any restore), a reference taken on each for the caller: a lease lending them to
        another worker (LLMEngine.lend_prefix). Nothing is restored unless the pool has room
        for it and `reserve` blocks more (the running sequences' watermark)."""
        if not self.pool.enable_prefix_caching or not hashes:
            return []
        blocks = self._from_host(hashes, self.pool.lookup(hashes), len(hashes) + reserve)
        self.pool.incref(blocks)
        return blocks

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
            self.pool.cache_block(seq.block_ids[i], hashes[i], hashes[i - 1] if i else None, i)
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
        return self._from_host(hashes, self.pool.lookup(hashes),
                               cdiv(seq.num_prompt_tokens, self.block_size))

    def allocate_for_pull(self, seq: Sequence, hits: list[int], reserve: int = 0) -> bool:
        """Decode role: the prompt's blocks, the first len(hits) of them shared from this
        pool's prefix cache (a reference taken on each), the rest fresh for the pull to fill:

            prompt blocks:  [ hit | hit | hit | new | new ]   (last one partial or full)
                              └ kept here ──────┘└ pulled ──┘

        The new blocks are ordered like the source blocks they receive (kvtransfer.runs.
        order_like), so that blocks adjacent there land in blocks adjacent here: one copy per
        run instead of one per block.

        Returns False, changing nothing, when the pool is short."""
        # A running sequence moving here (live migration) brings its outputs' KV too.
        covered = seq.remote.num_tokens if seq.remote is not None else 0
        need = cdiv(covered or seq.num_prompt_tokens, self.block_size) - len(hits)
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
        if not self.restored(seq):  # a copy still writes its blocks: freed once it is done
            self.pool.incref(seq.block_ids)
            self.held.append((seq.restoring, list(seq.block_ids)))
            seq.restoring = None
        self.pool.free(seq.block_ids)
        seq.block_ids = []
        seq.num_cached_blocks = 0
