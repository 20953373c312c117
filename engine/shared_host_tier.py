"""A host tier shared by the workers of one host (--host-kv-share NAME): one segment of shared
memory, /dev/shm/tandem-tier-NAME, that every worker given the same name maps. A block one
worker's pool evicts is found there by the others, so a conversation moved to another worker of
the host has its KV copied back rather than computed (or pulled) again.

    /dev/shm/tandem-tier-NAME
    ┌ header (4 KiB) ──────────────────┬ table: per slot ─────────────────┬ data ─────────────┐
    │ magic, sizes, fingerprint,       │ hash, LRU stamp, state, pins,    │ slot 0 | slot 1 … │
    │ tier id, clock, used, pids       │ parent, children, depth (int64)  │ (a block's bytes) │
    └──────────────────────────────────┴──────────────────────────────────┴───────────────────┘

Slots form a set-associative cache: a hash lives in one of WAYS slots of the set `hash %
num_sets`, found with no shared dictionary. A full set makes room by dropping the slot whose
loss costs least: a restore copies a prompt's blocks back up to the first one missing, so
dropping a block that the tier holds the next block of a chain for (its child) loses that whole
rest of the chain, while dropping the last block held of a chain (a leaf) loses one block. The
victim is the set's least recently used unpinned leaf, or, when every slot of the set has a
child held, its deepest (the fewest blocks after it), least recently used of those:

    chain:  h0 ── h1 ── h2 ── h3          (h3: a leaf; h0-h2 have a child held)
    a set holding h1 (older) and h3 (newer) drops h3: the restore still returns h0-h2

Each slot keeps its parent's hash, its depth and the number of its children held, kept as slots come and
go (a parent stored again after its children keeps no count of them: it may be taken for a
leaf). Every change of the header or the table happens under an flock of the segment (a few
integer writes; the copies run outside it):

    FREE ──put (the evicting worker)──▶ WRITING ──its copy done──▶ READY ──LRU──▶ (reused)
                                                                   │ lookup pins it; a pinned
                                                                   │ slot is never reused

Only READY slots are found; a reader pins what it will copy and unpins once the copy is done,
so a slot's bytes never change under a reader. Keys are the prefix cache's chained hashes,
salted at the root by cache_salt: a salted prefix matches only its own salt, from whichever
worker stored it. The header's fingerprint (the checkpoint, the pool's block layout and dtype)
refuses a worker whose blocks would mean something else.

Lifetime: each worker's pid is recorded while attached; the last to detach removes the name. A
worker that attaches when no recorded pid is alive (the others crashed) starts the segment
afresh (a crashed worker may have left slots pinned or half written).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import mmap
import os
import secrets
from collections import OrderedDict
from collections.abc import Iterator

import torch

from tandem.engine.block_pool import split_changes
from tandem.engine.host_kv_tier import (
    HostKVTier,
    RestoreTicket,
    host_tier_capacity,
    host_tier_for,
)
from tandem.errors import InvalidArgument

SHM_DIR = "/dev/shm"
PREFIX = "tandem-tier-"
MAGIC = 0x3254524549544B54  # "TKTIER2" little-endian, version 2 (parents and children)
HEADER = 4096
WAYS = 8
MAX_ATTACHED = 256
FREE, WRITING, READY = 0, 1, 2
# Header words (int64): the fingerprint is 4 words, the tier id 2.
(H_MAGIC, H_SLOTS, H_WAYS, H_BLOCK_BYTES, H_CLOCK, H_USED, H_FP, H_ID) = (0, 1, 2, 3, 4, 5, 6, 10)
H_PIDS = 16
# Table words per slot.
T_HASH, T_STAMP, T_STATE, T_PINS, T_PARENT, T_KIDS, T_DEPTH, T_WORDS = 0, 1, 2, 3, 4, 5, 6, 7
NO_PARENT = -1  # a first block's parent (hash() never returns -1)


def tier_for(pool: torch.Tensor, requested_gb: float | None, *, enabled: bool, share: str,
             fp: bytes, ranks: int = 1) -> HostKVTier | None:
    """The engine's host tier: shared under the name `share` (its blocks meaning what `fp`
    says; tensor parallelism refuses it, engine/config.py), or its own when `share` is empty,
    `ranks` tensor-parallel ranks each keeping its part of the flag's bytes; None when off."""
    if not share:
        return host_tier_for(pool, requested_gb, enabled=enabled, ranks=ranks)
    capacity = host_tier_capacity(pool, requested_gb, enabled=enabled)
    return SharedHostKVTier(pool, capacity, share, fp) if capacity >= 1 else None


def segment_path(name: str) -> str:
    if not name or not all(c.isalnum() or c in "-_." for c in name) or len(name) > 100:
        raise InvalidArgument("host_kv_share", f"must be 1-100 letters, digits, '-', '_' or "
                                               f"'.', got {name!r}")
    return os.path.join(SHM_DIR, PREFIX + name)


def fingerprint(*parts: object) -> bytes:
    """32 bytes naming what a block's bytes mean: workers whose parts differ never share."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=32).digest()


class SharedBlockIndex:
    """The shared table, as HostKVTier's index: get (pins), put, pin/unpin, publish, plus this
    worker's counters and KV events. Torch-free but for `data`, the slots' bytes."""

    def __init__(self, path: str, num_slots: int, block_bytes: int, fp: bytes) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.path = path
        self.hits = self.misses = self.evictions = self.stored = 0
        self.events: dict[int, bool] | None = None
        # Children this worker stored before their parent was held (a pool evicts a prompt's
        # later blocks first): parent hash -> children, counted on the parent once it comes.
        self.early_children: OrderedDict[int, int] = OrderedDict()
        self.fd = self._open_current()
        try:
            with self._locked():
                self._attach(num_slots, block_bytes, fp)
        except BaseException:
            os.close(self.fd)
            raise

    # -- attach and detach -------------------------------------------------------------------
    def _open_current(self) -> int:
        """An fd on the segment the name refers to now (not one the last worker removed after
        we opened it: checked under the lock by _attach)."""
        return os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)

    def _attach(self, num_slots: int, block_bytes: int, fp: bytes) -> None:
        while os.fstat(self.fd).st_ino != _inode(self.path):  # removed meanwhile: open anew
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = self._open_current()
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        ways = min(WAYS, num_slots)
        num_slots -= num_slots % ways
        size = os.fstat(self.fd).st_size
        fresh = size < HEADER or not self._others_alive()
        if fresh:
            size = HEADER + num_slots * T_WORDS * 8
            size = -(-size // 4096) * 4096 + num_slots * block_bytes
            os.ftruncate(self.fd, 0)  # drop a dead segment's pages
            os.ftruncate(self.fd, size)
        self.mm = mmap.mmap(self.fd, size)
        self.head = memoryview(self.mm)[:HEADER].cast("q")
        if fresh:
            self._init_header(num_slots, ways, block_bytes, fp)
        self._check(num_slots, block_bytes, fp)
        self.capacity, self.ways = self.head[H_SLOTS], self.head[H_WAYS]
        self.num_sets = self.capacity // self.ways
        table_end = HEADER + self.capacity * T_WORDS * 8
        self.table = memoryview(self.mm)[HEADER:table_end].cast("q")
        self.data_offset = -(-table_end // 4096) * 4096
        self._add_pid(os.getpid())

    def _init_header(self, num_slots: int, ways: int, block_bytes: int, fp: bytes) -> None:
        h = self.head
        h[H_SLOTS], h[H_WAYS], h[H_BLOCK_BYTES] = num_slots, ways, block_bytes
        h[H_CLOCK] = h[H_USED] = 0
        words = memoryview(fp + secrets.token_bytes(16)).cast("q")
        for i in range(6):
            h[H_FP + i] = words[i]
        for i in range(MAX_ATTACHED):
            h[H_PIDS + i] = 0
        h[H_MAGIC] = MAGIC

    def _check(self, num_slots: int, block_bytes: int, fp: bytes) -> None:
        h = self.head
        if h[H_MAGIC] != MAGIC:
            raise InvalidArgument("host_kv_share", f"{self.path} is not a tier of this version")
        if bytes(h[H_FP:H_FP + 4].cast("B")) != fp or h[H_BLOCK_BYTES] != block_bytes:
            raise InvalidArgument("host_kv_share", f"{self.path} is shared by workers of another "
                                                   "checkpoint or KV layout")
        if h[H_SLOTS] != num_slots:
            raise InvalidArgument("host_kv_cache_gb", f"{self.path} holds {h[H_SLOTS]} blocks, "
                                                      f"this worker asks for {num_slots}: give "
                                                      "every worker sharing it the same size")

    def _pids(self) -> range:
        return range(H_PIDS, H_PIDS + MAX_ATTACHED)

    def _others_alive(self) -> bool:
        """Whether a worker recorded in the existing header is alive (then the segment stays)."""
        with mmap.mmap(self.fd, HEADER) as m:
            head = memoryview(m).cast("q")
            try:
                return head[H_MAGIC] == MAGIC and any(
                    _alive(head[i]) for i in self._pids() if head[i])
            finally:
                head.release()

    def _add_pid(self, pid: int) -> None:
        for i in self._pids():
            if self.head[i] and not _alive(self.head[i]):
                self.head[i] = 0
        for i in self._pids():
            if not self.head[i]:
                self.head[i] = pid
                return
        raise InvalidArgument("host_kv_share", f"more than {MAX_ATTACHED} workers share "
                                               f"{self.path}")

    def close(self) -> None:
        """Detach; the last worker out removes the name (the memory goes with the mappings)."""
        if self.fd < 0:
            return
        with self._locked():
            pid = os.getpid()
            for i in self._pids():
                if self.head[i] == pid:
                    self.head[i] = 0
                    break
            if not any(self.head[i] for i in self._pids()):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
        os.close(self.fd)
        self.fd = -1

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    # -- the index ---------------------------------------------------------------------------
    @property
    def tier_id(self) -> str:
        return bytes(self.head[H_ID:H_ID + 2].cast("B")).hex()

    def __len__(self) -> int:
        return self.head[H_USED]

    def get(self, block_hash: int) -> int | None:
        """The READY slot holding this prefix, pinned and now most recently used; or None."""
        with self._locked():
            slot = self._find(block_hash)
            if slot is None or self.table[slot * T_WORDS + T_STATE] != READY:
                return None
            t = slot * T_WORDS
            self.table[t + T_STAMP] = self._tick()
            self.table[t + T_PINS] += 1
            return slot

    def put(self, block_hash: int, parent: int | None = None, depth: int = 0) -> int | None:
        """A slot, now WRITING, to copy a block with this hash into (`parent`: the hash of the
        block before it, None for a first block; `depth`: its index in its prompt); None when
        nothing is to be copied: the tier holds it (or another worker is writing it), or every
        slot of its set is pinned or being written."""
        with self._locked():
            slot = self._find(block_hash)
            if slot is not None:
                self.table[slot * T_WORDS + T_STAMP] = self._tick()
                self._record(block_hash, True)
                return None
            slot = self._victim(block_hash)
            if slot is None:
                return None
            t = self.table
            i = slot * T_WORDS
            t[i + T_HASH], t[i + T_STAMP], t[i + T_STATE], t[i + T_PINS] = (
                block_hash, self._tick(), WRITING, 0)
            t[i + T_PARENT] = NO_PARENT if parent is None else parent
            t[i + T_KIDS] = self.early_children.pop(block_hash, 0)
            t[i + T_DEPTH] = depth
            self._count_child(t[i + T_PARENT], +1)
            self.stored += 1
            self._record(block_hash, True)
            return slot

    def publish(self, slots: list[int]) -> None:
        """These slots' copies are done: other workers may read them."""
        with self._locked():
            for s in slots:
                self.table[s * T_WORDS + T_STATE] = READY

    def pin(self, slots: list[int]) -> None:
        with self._locked():
            for s in slots:
                self.table[s * T_WORDS + T_PINS] += 1

    def unpin(self, slots: list[int]) -> None:
        with self._locked():
            for s in slots:
                self.table[s * T_WORDS + T_PINS] -= 1

    def take_events(self) -> tuple[list[int], list[int]]:
        events = self.events
        if events:
            self.events = {}
        return split_changes(events)

    def slots_in_use(self) -> list[tuple[int, int, int]]:
        """(hash, state, pins) of every used slot (tests and tools)."""
        with self._locked():
            t = self.table
            return [(t[i + T_HASH], t[i + T_STATE], t[i + T_PINS])
                    for i in range(0, len(t), T_WORDS) if t[i + T_STATE] != FREE]

    def slots_children(self) -> list[tuple[int, int, int, int]]:
        """(hash, parent, depth, children held) of every used slot (tests and tools)."""
        with self._locked():
            t = self.table
            return [(t[i + T_HASH], t[i + T_PARENT], t[i + T_DEPTH], t[i + T_KIDS])
                    for i in range(0, len(t), T_WORDS) if t[i + T_STATE] != FREE]

    def _find(self, block_hash: int) -> int | None:
        t = self.table
        first = (block_hash % self.num_sets) * self.ways
        for s in range(first, first + self.ways):
            i = s * T_WORDS
            if t[i + T_STATE] != FREE and t[i + T_HASH] == block_hash:
                return s
        return None

    def _victim(self, block_hash: int) -> int | None:
        """A free slot of the hash's set, else the READY unpinned slot whose loss costs least:
        its least recently used leaf (no child held), else its deepest (the fewest blocks
        after it), least recently used of those (dropped: reported, counted)."""
        t = self.table
        first = (block_hash % self.num_sets) * self.ways
        best = best_key = None
        for s in range(first, first + self.ways):
            i = s * T_WORDS
            state = t[i + T_STATE]
            if state == FREE:
                self.head[H_USED] += 1
                return s
            if state == READY and not t[i + T_PINS]:
                kids = t[i + T_KIDS] > 0
                key = (kids, -t[i + T_DEPTH] if kids else 0, t[i + T_STAMP])
                if best_key is None or key < best_key:
                    best, best_key = s, key
        if best is not None:
            i = best * T_WORDS
            self._count_child(t[i + T_PARENT], -1)
            self.evictions += 1
            self._record(t[i + T_HASH], False)
        return best

    def _count_child(self, parent: int, delta: int) -> None:
        """A child of `parent` came (+1) or went (-1): counted on the parent's slot, or, while
        the tier does not hold the parent, kept for it (at most `capacity` parents)."""
        if parent == NO_PARENT:
            return
        p = self._find(parent)
        if p is not None:
            i = p * T_WORDS + T_KIDS
            self.table[i] = max(0, self.table[i] + delta)
            return
        early = self.early_children
        n = early.pop(parent, 0) + delta
        if n > 0:
            early[parent] = n
            if len(early) > self.capacity:
                early.popitem(last=False)

    def _tick(self) -> int:
        self.head[H_CLOCK] += 1
        return self.head[H_CLOCK]

    def _record(self, block_hash: int, held: bool) -> None:
        if self.events is not None:
            self.events[block_hash] = held


class SharedHostKVTier(HostKVTier):
    """HostKVTier over a SharedBlockIndex: the slots are the segment's, written by whichever
    worker evicts a block and read by every worker; a slot is published once its copy is done,
    and a slot being read stays pinned until its copy is."""

    def __init__(self, pool: torch.Tensor, capacity_blocks: int, name: str, fp: bytes) -> None:
        self._name, self._fp = name, fp
        super().__init__(pool, capacity_blocks)
        ix = self.index
        flat = torch.frombuffer(ix.mm, dtype=torch.uint8, offset=ix.data_offset,
                                count=ix.capacity * self.block_bytes)
        self.data = flat.view(pool.dtype).view(ix.capacity, *pool.shape[1:])
        # Copies issued and not yet known done (CUDA): (event, written slots, read slots).
        self.pending: list[tuple[torch.cuda.Event | None, list[int], list[int]]] = []

    def _make_index(self, capacity_blocks: int) -> SharedBlockIndex:
        return SharedBlockIndex(segment_path(self._name), capacity_blocks,
                                self.pool[0].nbytes, self._fp)

    def _make_memory(self, capacity_blocks: int) -> None:
        return None  # the segment's pages, mapped by the index (taken as they are written)

    @property
    def tier_id(self) -> str:
        return self.index.tier_id

    def slot(self, slot: int) -> torch.Tensor:
        return self.data[slot]

    @property
    def allocated_bytes(self) -> int:
        return self.data.nbytes

    def lookup(self, block_hash: int) -> int | None:
        return self.index.get(block_hash)  # pinned by get itself: another worker may evict

    def unpin(self, slots: list[int]) -> None:
        self.index.unpin(slots)

    def restore(self, slot: int, block: int, deferred: bool = False) -> RestoreTicket | None:
        self.index.pin([slot])  # held until the copy is done, past the caller's unpin
        return super().restore(slot, block, deferred)

    def _issued(self, slots: list[int]) -> None:
        """Pinned until their copies are done (_settle), not merely issued: another worker
        may reuse a slot as soon as it is unpinned."""

    def flush(self, wait: bool = False) -> None:
        self._settle(block=False)
        ops, deferred = list(self.ops), list(self.deferred)
        super().flush(wait)
        if not ops and not deferred:
            return
        written = [slot for to_host, _, slot in ops if to_host]
        read = [slot for to_host, _, slot in ops if not to_host] + [s for _, s in deferred]
        event = None
        if self.stream is not None and not wait:
            event = torch.cuda.Event()
            event.record(self.stream)
        self.pending.append((event, written, read))
        self._settle(block=False)

    def _settle(self, block: bool) -> None:
        """Publish the slots written and unpin the slots read by the copies now done."""
        while self.pending:
            event, written, read = self.pending[0]
            if event is not None and not event.query():
                if not block:
                    return
                event.synchronize()
            self.pending.pop(0)
            self.index.publish(written)
            self.index.unpin(read)

    def close(self) -> None:
        self._settle(block=True)
        self.index.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None
