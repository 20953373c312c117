"""The block pool: fixed-size KV blocks with reference counts and a prefix cache.

Plain Python, no torch. Every operation is O(1) per block.

    free queue (LRU order, evict from the left)           prefix cache
    ┌────┬────┬────┬────┬────┐                           hash -> block id
    │ 7  │ 2  │ 9  │ 4  │ 5  │ <- freed blocks join       (a block stays cached while
    └────┴────┴────┴────┴────┘    on the right             free, until it is reused)

A block is in the free queue exactly when its reference count is 0. A free block may still hold
a cached prefix (it has a hash); allocating it evicts that entry. A prefix hit on a free cached
block takes it out of the free queue again ("touch").

KV events (a serving worker's, for the router): with `kv_events` set to a dict, every hash
published to the cache and every hash evicted from it is recorded there (hash -> True stored,
False evicted; only the last change of a hash counts) until `take_events` collects them.

Host tier (engine/host_kv_tier.py): with `on_evict` set, a cached block being reallocated is
reported as (block, hash, parent hash, depth) before its entry goes, while its KV is still in
the pool (the parent: the hash of the block before it in its prompt, None for a first block;
the depth: the block's index in its prompt).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence


def hash_block(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Hash of a full block, chained over every token before it: equal hashes mean equal
    prefixes (up to 64-bit collisions). Deterministic across processes: ints and tuples of ints
    hash the same everywhere, and the first block's missing parent is the constant -1 (which
    hash() never returns) rather than None (whose hash is its address before Python 3.12)."""
    return hash((-1 if parent_hash is None else parent_hash, *token_ids))


def salt_root(salt: str) -> int | None:
    """The parent hash of a salted prompt's first block (None: unsalted). Prompts with
    different salts share no cached block: every hash in the chain depends on the root."""
    if not salt:
        return None
    return int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8).digest()) >> 1



def split_changes(changes: dict[int, bool] | None) -> tuple[list[int], list[int]]:
    """A record of changes (hash -> True now held, False dropped) as (held, dropped) lists; the
    prefix cache's and the host tiers' KV events."""
    if not changes:
        return [], []
    return ([h for h, held in changes.items() if held],
            [h for h, held in changes.items() if not held])

class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_parent: list[int | None] = [None] * num_blocks  # the previous block's hash
        self.block_depth = [0] * num_blocks  # the block's index in its prompt
        self.cached: dict[int, int] = {}  # hash -> block id
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # Counters for metrics: lookups and hits in blocks.
        self.prefix_queries = 0
        self.prefix_hits = 0
        # Changes of the cached set since take_events (None: not recorded).
        self.kv_events: dict[int, bool] | None = None
        # Called with (block, hash, parent hash, depth) when allocate evicts a cached block
        # (None: nobody keeps it).
        self.on_evict: Callable[[int, int, int | None, int], None] | None = None

    # -- queries -----------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (free, cached or not)."""
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def is_idle(self) -> bool:
        """No block is referenced: the state every test ends in."""
        return len(self.free_queue) == self.num_blocks and not any(self.ref_counts)

    # -- allocation --------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """n blocks with reference count 1, least recently freed first."""
        if n > len(self.free_queue):
            raise MemoryError(f"asked for {n} blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            block, _ = self.free_queue.popitem(last=False)
            h = self.block_hash[block]
            if h is not None and self.on_evict is not None:
                self.on_evict(block, h, self.block_parent[block], self.block_depth[block])
            self._evict(block)
            self.ref_counts[block] = 1
            out.append(block)
        return out

    def incref(self, blocks: Iterable[int]) -> None:
        """Take another reference (a prefix hit, a fork, a lease); revives free cached blocks."""
        for b in blocks:
            if self.ref_counts[b] == 0:
                del self.free_queue[b]
            self.ref_counts[b] += 1

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference from each block. Pass a sequence's blocks in order: they are
        queued tail first, so that a sequence's later blocks (useful to fewer prefixes) are
        evicted before its earlier ones."""
        for b in reversed(blocks):
            rc = self.ref_counts[b] - 1
            if rc < 0:
                raise RuntimeError(f"block {b} freed more often than referenced")
            self.ref_counts[b] = rc
            if rc == 0:
                self.free_queue[b] = None

    # -- prefix cache ------------------------------------------------------------------------
    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """Longest run of cached blocks matching hashes[0], hashes[1], ... (no reference taken)."""
        hits: list[int] = []
        if not self.enable_prefix_caching:
            return hits
        for h in hashes:
            b = self.cached.get(h)
            if b is None:
                break
            hits.append(b)
        self.prefix_queries += len(hashes)
        self.prefix_hits += len(hits)
        return hits

    def cache_block(self, block: int, block_hash: int, parent: int | None = None,
                    depth: int = 0) -> None:
        """Publish a full, computed block under its chained hash (`parent`: the hash of the
        block before it, None for a first block; `depth`: its index in the prompt). If another
        block already holds this prefix, the existing entry wins and this block stays
        private."""
        if not self.enable_prefix_caching or self.block_hash[block] is not None:
            return
        if block_hash in self.cached:
            return
        self.cached[block_hash] = block
        self.block_hash[block] = block_hash
        self.block_parent[block] = parent
        self.block_depth[block] = depth
        if self.kv_events is not None:
            self.kv_events[block_hash] = True

    def _evict(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            self.block_hash[block] = None
            self.block_parent[block] = None
            if self.cached.get(h) == block:
                del self.cached[h]
                if self.kv_events is not None:
                    self.kv_events[h] = False

    def take_events(self) -> tuple[list[int], list[int]]:
        """The hashes stored and the hashes evicted since the last call, each hash in one of
        the two lists at most (its last change); the record starts empty again."""
        events = self.kv_events
        if events:
            self.kv_events = {}
        return split_changes(events)

    def reset_prefix_cache(self) -> None:
        for b in range(self.num_blocks):
            if self.ref_counts[b] == 0:
                self._evict(b)
