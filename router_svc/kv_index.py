"""The router's map of what its workers' prefix caches hold, fed by their KV events (WatchKV).

    block hash ──▶ bitmask of worker slots holding that block
                   (slot i: bit i; a worker gets a slot while connected)

Hashes are the workers' own chained block hashes (engine/block_pool.py hash_block, rooted at
salt_root(cache_salt)), so the blocks a prompt shares with a worker's cache are the prompt's
leading hashes present under that worker's bit: `match` walks them once for every worker.

Bounded: at most `max_blocks` hashes. Past that the oldest tenth of the entries (by insertion)
goes, as one rebuild: the map is a routing hint, and a hint lost only costs a cache-blind
placement, never a wrong answer (a worker recomputes or pulls what it does not have). Memory,
measured with tracemalloc (benchmarks/serving/multiturn.py --index-memory): about 78 bytes per hash, so
78 MB for 1M cached blocks, whatever the number of workers (up to 60 in one small int each).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterable, Sequence

DEFAULT_MAX_BLOCKS = 1 << 20


class KVIndex:
    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.max_blocks = max_blocks
        self.blocks: dict[int, int] = {}  # hash -> bitmask of slots
        self.counts: dict[int, int] = {}  # slot -> hashes under its bit
        self._changed = asyncio.Event()

    def __len__(self) -> int:
        return len(self.blocks)

    # -- updates -----------------------------------------------------------------------------
    def apply(self, slot: int, stored: Iterable[int], removed: Iterable[int]) -> None:
        """A worker's events: `removed` first, then `stored` (a hash is in one of them at most,
        its last change)."""
        bit = 1 << slot
        blocks = self.blocks
        n = self.counts.get(slot, 0)
        for h in removed:
            m = blocks.get(h, 0)
            if m & bit:
                m &= ~bit
                if m:
                    blocks[h] = m
                else:
                    del blocks[h]
                n -= 1
        for h in stored:
            m = blocks.get(h, 0)
            if not m & bit:
                blocks[h] = m | bit
                n += 1
        self.counts[slot] = n
        if len(blocks) > self.max_blocks:
            self._shrink()
        self._notify()

    def clear(self, slot: int) -> None:
        """Forget everything the worker in `slot` said (its events stopped: it restarted, left,
        or its call broke). O(map size), and free when the slot holds nothing."""
        if not self.counts.pop(slot, 0):
            return
        bit = 1 << slot
        blocks = self.blocks
        for h, m in list(blocks.items()):
            if m & bit:
                if m == bit:
                    del blocks[h]
                else:
                    blocks[h] = m & ~bit
        self._notify()

    def _shrink(self) -> None:
        """Drop the oldest tenth of the entries (insertion order), in one rebuild: popping them
        one by one from the front of a dict is quadratic."""
        drop = max(1, len(self.blocks) // 10)
        gone = itertools.islice(self.blocks.values(), drop)
        for m in gone:
            while m:
                low = m & -m
                slot = low.bit_length() - 1
                self.counts[slot] -= 1
                m ^= low
        self.blocks = dict(itertools.islice(self.blocks.items(), drop, None))

    # -- queries -----------------------------------------------------------------------------
    def match(self, hashes: Sequence[int], slots: Iterable[int]) -> dict[int, int]:
        """slot -> how many of `hashes` (a prompt's chained block hashes, in order) lead that
        worker's cache: its longest cached prefix, in blocks."""
        alive = 0
        for s in slots:
            alive |= 1 << s
        out = {}
        blocks = self.blocks
        for i, h in enumerate(hashes):
            if not alive:
                break
            m = blocks.get(h, 0) & alive
            gone = alive & ~m
            while gone:
                low = gone & -gone
                out[low.bit_length() - 1] = i
                gone ^= low
            alive = m
        while alive:
            low = alive & -alive
            out[low.bit_length() - 1] = len(hashes)
            alive ^= low
        return out

    def holds(self, slot: int, h: int) -> bool:
        return bool(self.blocks.get(h, 0) & (1 << slot))

    # -- waiting (tests, tools) --------------------------------------------------------------
    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        """Return once `predicate()` holds, re-checked after every change of the map."""
        while not predicate():
            changed = self._changed
            await changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
