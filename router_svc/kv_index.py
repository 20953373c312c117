"""The router's map of what its workers' prefix caches hold, fed by their KV events (WatchKV).

    block hash ──▶ bitmask of worker slots holding that block
                   (slot i: bit i; a worker gets a slot while connected)

Host tiers (engine/host_kv_tier.py): a second map of the same shape records which workers hold
a block in host memory rather than in their pool. A worker's tier is its own, or shared by the
workers of its host (--host-kv-share): workers reporting the same tier id form a group; a block
any of them stored there is readable by all of them, and one any of them reports dropped is
gone for all (whichever worker's eviction dropped it).

    hash ──▶ bitmask of slots holding it on GPU          (blocks)
    hash ──▶ bitmask of slots that stored it in a tier   (host; read through each slot's group)

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
from typing import NamedTuple

DEFAULT_MAX_BLOCKS = 1 << 20


class TierMatch(NamedTuple):
    """A worker's longest run of a prompt's leading blocks it can serve without computing
    them: `gpu` from its pool, then `host` more that it reads from a host tier."""

    gpu: int
    host: int


class KVIndex:
    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.max_blocks = max_blocks  # hashes of both maps together
        self.blocks: dict[int, int] = {}  # hash -> bitmask of slots (on GPU)
        self.counts: dict[int, int] = {}  # slot -> hashes under its bit
        self.host: dict[int, int] = {}  # hash -> bitmask of slots that stored it in a tier
        self.host_counts: dict[int, int] = {}
        self.tier_of: dict[int, str] = {}  # slot -> its shared tier's id (absent: private)
        self._changed = asyncio.Event()

    def __len__(self) -> int:
        return len(self.blocks)

    # -- updates -----------------------------------------------------------------------------
    def apply(self, slot: int, stored: Iterable[int], removed: Iterable[int],
              host_stored: Iterable[int] = (), host_removed: Iterable[int] = ()) -> None:
        """A worker's events: `removed` first, then `stored` (a hash is in one of them at most,
        its last change); the same for its host tier. A hash its tier dropped is dropped for
        every worker sharing the tier."""
        _update(self.blocks, self.counts, 1 << slot, stored, removed)
        if host_stored or host_removed:
            _update(self.host, self.host_counts, 1 << slot, host_stored, host_removed,
                    removed_mask=self.group(slot))
        if len(self.blocks) + len(self.host) > self.max_blocks:
            self._shrink()
        self._notify()

    def set_tier(self, slot: int, tier_id: str) -> None:
        """The worker in `slot` reads the host tier `tier_id`, shared with every worker that
        says the same id ("": a tier of its own, or none)."""
        if tier_id:
            self.tier_of[slot] = tier_id
        else:
            self.tier_of.pop(slot, None)

    def group(self, slot: int) -> int:
        """Bitmask of the slots whose host tier `slot` reads (itself at least)."""
        tier = self.tier_of.get(slot)
        if tier is None:
            return 1 << slot
        mask = 0
        for s, t in self.tier_of.items():
            if t == tier:
                mask |= 1 << s
        return mask

    def clear(self, slot: int) -> None:
        """Forget everything the worker in `slot` said (its events stopped: it restarted, left,
        or its call broke). O(map size), and free when the slot holds nothing. Blocks it stored
        in a shared tier stay readable by the others only while they report them too."""
        self.tier_of.pop(slot, None)
        cleared = _clear(self.blocks, self.counts, slot)
        if _clear(self.host, self.host_counts, slot) or cleared:
            self._notify()

    def _shrink(self) -> None:
        """Drop the oldest tenth of the entries (insertion order) of the larger map, in one
        rebuild: popping them one by one from the front of a dict is quadratic."""
        if len(self.blocks) >= len(self.host):
            self.blocks = _drop_oldest(self.blocks, self.counts)
        else:
            self.host = _drop_oldest(self.host, self.host_counts)

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

    def match_tiers(self, hashes: Sequence[int], slots: Iterable[int]) -> dict[int, TierMatch]:
        """slot -> its TierMatch for the prompt: `gpu` as `match`, `host` the blocks past them
        that its pool or its host tier holds (a GPU block past the first host one counts as a
        host one: a pool evicts a sequence's later blocks first, so that is rare)."""
        slots = list(slots)
        gpu = self.match(hashes, slots)
        if not self.host:
            return {s: TierMatch(gpu[s], 0) for s in slots}
        groups = {s: self.group(s) for s in slots}
        out = {}
        for s in slots:
            n = gpu[s]
            bit, group = 1 << s, groups[s]
            while n < len(hashes) and (self.blocks.get(hashes[n], 0) & bit
                                       or self.host.get(hashes[n], 0) & group):
                n += 1
            out[s] = TierMatch(gpu[s], n - gpu[s])
        return out

    def lender(self, hashes: Sequence[int], dest: int, slots: Iterable[int],
               min_gain: int = 1) -> tuple[int, int] | None:
        """(slot, blocks): among `slots`, the worker that can serve the longest run of the
        prompt's leading blocks (`hashes`) from its pool and a host tier that `dest` cannot
        read (another host's, or a private one), some of the run in that tier; None when none
        holds `min_gain` blocks more than `dest` serves itself (its GPU and readable host
        blocks, as match_tiers counts them)."""
        slots = [s for s in slots if s != dest]
        matches = self.match_tiers(hashes, [dest, *slots])
        best = (-1, matches[dest].gpu + matches[dest].host + min_gain - 1)
        readable = self.group(dest)
        for s in slots:
            m = matches[s]
            if m.host and not readable & (1 << s) and m.gpu + m.host > best[1]:
                best = (s, m.gpu + m.host)
        return best if best[0] >= 0 else None

    def holds(self, slot: int, h: int) -> bool:
        return bool(self.blocks.get(h, 0) & (1 << slot))

    def holds_on_host(self, slot: int, h: int) -> bool:
        """Whether `slot` can read h from a host tier (its own, or the one it shares)."""
        return bool(self.host.get(h, 0) & self.group(slot))

    # -- waiting (tests, tools) --------------------------------------------------------------
    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        """Return once `predicate()` holds, re-checked after every change of the map."""
        while not predicate():
            changed = self._changed
            await changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


def _update(blocks: dict[int, int], counts: dict[int, int], bit: int, stored: Iterable[int],
            removed: Iterable[int], removed_mask: int | None = None) -> None:
    """Unset `removed_mask` (default: `bit`) on the removed hashes, then set `bit` on the
    stored ones, keeping each slot's count of hashes in `counts`."""
    clear = bit if removed_mask is None else removed_mask
    for h in removed:
        m = blocks.get(h, 0)
        gone = m & clear
        if gone:
            m &= ~gone
            if m:
                blocks[h] = m
            else:
                del blocks[h]
            _count(counts, gone, -1)
    for h in stored:
        m = blocks.get(h, 0)
        if not m & bit:
            blocks[h] = m | bit
            _count(counts, bit, 1)


def _count(counts: dict[int, int], mask: int, delta: int) -> None:
    while mask:
        low = mask & -mask
        slot = low.bit_length() - 1
        counts[slot] = counts.get(slot, 0) + delta
        mask ^= low


def _clear(blocks: dict[int, int], counts: dict[int, int], slot: int) -> bool:
    """Unset `slot`'s bit everywhere; whether it had any."""
    if not counts.pop(slot, 0):
        return False
    bit = 1 << slot
    for h, m in list(blocks.items()):
        if m & bit:
            if m == bit:
                del blocks[h]
            else:
                blocks[h] = m & ~bit
    return True


def _drop_oldest(blocks: dict[int, int], counts: dict[int, int]) -> dict[int, int]:
    drop = max(1, len(blocks) // 10)
    for m in itertools.islice(blocks.values(), drop):
        _count(counts, m, -1)
    return dict(itertools.islice(blocks.items(), drop, None))
