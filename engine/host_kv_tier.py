"""A host-memory tier under the prefix cache: full blocks the GPU pool evicts are kept in host
memory (pinned on CUDA), and a prompt whose prefix continues past the GPU's cached blocks gets
the rest copied back into fresh pool blocks instead of computing it.

    device pool (BlockPool)                     host tier (an LRU of slots)
    cached free block reallocated ──D2H copy──▶  slot keyed by the block's chained hash
    prefix match past the pool's hits ◀─H2D──    slot copied into a fresh block, published
                                                 in the prefix cache under the same hash

Keys are the prefix cache's chained hashes (engine/block_pool.py hash_block, salted at the root
by cache_salt), so a host slot matches exactly the prompts the pool's entry matched: a salted
prefix is never served to another salt from either tier.

Copies are recorded while the scheduler allocates (evictions, restores) and issued, in the
order recorded, by `flush` before the step runs. On CUDA they run on a side stream that first
waits for the work already queued on the step's stream (a step in flight may still be writing
an evicted block), and the step's stream waits for them in turn: no host wait, the copies
overlap whatever the device runs before. On the CPU they are plain copies.

Host memory is taken a chunk at a time, the first when the tier is made and the others by a
thread of its own (HostChunks) right after, until the tier reaches its size: pinning costs about a second per GiB (faulting and
locking the pages; measured on a 2-core VM: 0.5-1.2 s/GiB), too slow for the step's thread (a
256 MiB chunk taken there held a step for a few hundred ms) and for start-up (tens of GiB would
delay it by tens of seconds). Until the memory is there the tier holds fewer blocks: an
eviction finding no ready slot reuses the least recently used one, or keeps nothing; it never
waits.

The inclusive tier keeps a slot after restoring it: the block evicted again later costs no copy.
FP8 pools hold per-(layer, KV head) scales, fixed for the pool's life (engine/quantization/
kv_cache.py): a block's bytes are valid under them wherever they are kept, so the tier copies
the bytes alone.

Tensor parallelism: rank 0's tier decides (the index, which block goes to which slot); every
other rank keeps a tier of the same capacity for its own heads and replays rank 0's copies, in
the same order, before its next step (`mirror`, engine/tp_group.py RankKV.host_copies). The
flag sizes the worker's tier: its bytes are split over the ranks.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.engine.block_pool import split_changes

log = logging.getLogger(__name__)

# Default size: this share of the host memory available when the engine starts (CUDA only).
AUTO_FRACTION = 0.1
# The tier takes host memory in chunks of about this size, off the step's thread.
CHUNK_BYTES = 256 << 20


@dataclass(frozen=True)
class HostTierStats:
    """Counters in blocks (hits: blocks restored; misses: blocks of prompts found in neither
    tier once the lookup reached the host), bytes in use and the tier's size."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0  # slots dropped from the LRU to make room
    stored: int = 0  # blocks copied in
    bytes_used: int = 0
    capacity_bytes: int = 0
    allocated_bytes: int = 0  # host memory taken (whole chunks, or the shared segment)


class HostBlockIndex:
    """The tier's bookkeeping, torch-free: hash -> slot in LRU order (oldest first), free slots,
    and slots pinned while a restore from them is still to be issued (never reused then)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        # Slots 0..usable-1 have host memory now (HostChunks.ready): put hands out no other.
        self.usable = capacity
        self.lru: OrderedDict[int, int] = OrderedDict()
        self.free_slots = list(range(capacity - 1, -1, -1))  # pop() gives slot 0 first
        self.pinned: set[int] = set()
        self.hits = self.misses = self.evictions = self.stored = 0
        # Changes of the set of hashes held since take_events (hash -> True held, False
        # dropped; its last change), for the worker's KV events. None: not recorded.
        self.events: dict[int, bool] | None = None

    def __len__(self) -> int:
        return len(self.lru)

    def get(self, block_hash: int) -> int | None:
        """The slot holding this prefix (now most recently used), or None."""
        slot = self.lru.get(block_hash)
        if slot is not None:
            self.lru.move_to_end(block_hash)
        return slot

    def put(self, block_hash: int, parent: int | None = None, depth: int = 0) -> int | None:
        """A slot to copy a block with this hash into, or None when nothing is to be copied:
        the tier holds the prefix already (touched), or every slot is pinned. (`parent`,
        `depth`: where the block sits in its chain; one LRU over every slot needs neither: a
        pool evicts a sequence's later blocks first, and so does this LRU.)"""
        if block_hash in self.lru:
            self.lru.move_to_end(block_hash)
            self._record(block_hash, True)  # kept: the pool's copy went, this one holds
            return None
        if self.free_slots and self.free_slots[-1] < self.usable:
            slot = self.free_slots.pop()
        else:
            slot = self._evict_lru()
        if slot is None:
            return None
        self.lru[block_hash] = slot
        self.stored += 1
        self._record(block_hash, True)
        return slot

    def take_events(self) -> tuple[list[int], list[int]]:
        """(hashes now held, hashes dropped) since the last call, a hash in one list at most."""
        events = self.events
        if events:
            self.events = {}
        return split_changes(events)

    def _record(self, block_hash: int, held: bool) -> None:
        if self.events is not None:
            self.events[block_hash] = held

    def _evict_lru(self) -> int | None:
        for h, slot in self.lru.items():
            if slot not in self.pinned:
                del self.lru[h]
                self.evictions += 1
                self._record(h, False)
                return slot
        return None


def _chunk(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """One chunk of host memory with every page in place (pinning faults them in; on the CPU
    the fill does, here rather than in the first copies)."""
    t = torch.empty(shape, dtype=dtype, pin_memory=pin)
    if not pin:
        t.view(torch.uint8).fill_(0)
    return t


class HostChunks:
    """The tier's host memory, the one owner of it: chunks of `chunk_blocks` slots taken in
    slot order, the first at start, the others by a thread of its own until `capacity` slots
    are there.

        slots:  [ chunk 0 | chunk 1 | chunk 2 | ... ]    ready: slots with memory now
                 ───ready────────▶  (the thread appends; readers never wait)

    `ready` only grows, and a chunk is in `chunks` before `ready` counts its slots."""

    def __init__(self, capacity: int, chunk_blocks: int, shape: tuple[int, ...],
                 dtype: torch.dtype, pin: bool,
                 allocate: Callable[[tuple[int, ...], torch.dtype, bool], torch.Tensor] = _chunk,
                 ) -> None:
        self.capacity, self.chunk_blocks = capacity, chunk_blocks
        self.chunks: list[torch.Tensor] = []
        self.ready = 0
        self.done = threading.Event()  # every chunk taken, or growth stopped
        self._grew = threading.Condition()
        self._stop = False
        # The first chunk now, at start (at most CHUNK_BYTES: a fraction of a second), so that
        # the tier keeps blocks from the first eviction on; the rest on the thread.
        self.chunks.append(allocate((min(chunk_blocks, capacity), *shape), dtype, pin))
        self.ready = len(self.chunks[0])
        self._thread = threading.Thread(target=self._grow, args=(shape, dtype, pin, allocate),
                                        name="host-kv-tier-memory", daemon=True)
        self._thread.start()

    def _grow(self, shape: tuple[int, ...], dtype: torch.dtype, pin: bool,
              allocate: Callable[[tuple[int, ...], torch.dtype, bool], torch.Tensor]) -> None:
        try:
            while self.ready < self.capacity and not self._stop:
                n = min(self.chunk_blocks, self.capacity - self.ready)
                self.chunks.append(allocate((n, *shape), dtype, pin))
                with self._grew:
                    self.ready += n
                    self._grew.notify_all()
        except Exception:  # out of host (pinnable) memory: the tier stays this size
            log.exception("host KV tier: could not take more host memory; it keeps %d of %d "
                          "blocks", self.ready, self.capacity)
        finally:
            with self._grew:
                self.done.set()
                self._grew.notify_all()

    def wait_ready(self, slots: int) -> int:
        """Wait until `slots` slots have memory, or growth ended; the slots ready (tests and
        tools: the engine never waits for its tier's memory)."""
        with self._grew:
            self._grew.wait_for(lambda: self.ready >= slots or self.done.is_set())
            return self.ready

    def slot(self, slot: int) -> torch.Tensor:
        """The memory of a ready slot."""
        c, i = divmod(slot, self.chunk_blocks)
        return self.chunks[c][i]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    def close(self) -> None:
        """Stop growing (after the chunk being taken, if any)."""
        self._stop = True
        self._thread.join()


class RestoreTicket:
    """The copies of one step's deferred restores: done once the event recorded after them on
    the tier's stream has passed (None until the step's flush issues them)."""

    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = None

    def done(self) -> bool:
        return self.event is not None and self.event.query()


class _Done:
    """A CPU tier's copies: done when issued (plain copies on the step's thread)."""

    @staticmethod
    def query() -> bool:
        return True


class HostKVTier:
    """The tier of one engine's pool: the host chunks, the index, and the copies still to be
    issued. `offload` is the BlockPool's eviction hook; KVCacheManager calls `lookup`, `pin`,
    `restore` and `unpin`; the engine calls `flush` once per step, after scheduling."""

    def __init__(self, pool: torch.Tensor, capacity_blocks: int) -> None:
        self.pool = pool
        self.index = self._make_index(capacity_blocks)
        self.block_bytes = pool[0].nbytes
        self.memory = self._make_memory(capacity_blocks)
        # (to_host, pool block, slot) in the order the scheduler caused them.
        self.ops: list[tuple[bool, int, int]] = []
        self.stream = torch.cuda.Stream(pool.device) if pool.is_cuda else None
        # Tensor parallelism: the other ranks' replay of each flush's copies (ops, wait).
        self.mirror: Callable[[list[tuple[bool, int, int]], bool], None] | None = None
        # Restores that the step need not wait for (their request waits instead): (pool block,
        # slot), issued after `ops`, and the ticket their requests wait on.
        self.deferred: list[tuple[int, int]] = []
        self.ticket: RestoreTicket | None = None
        # Whether restores may be deferred: their copies run beside the steps (CUDA).
        self.async_restores = self.stream is not None

    def _make_index(self, capacity_blocks: int) -> HostBlockIndex:
        return HostBlockIndex(capacity_blocks)

    def _make_memory(self, capacity_blocks: int) -> HostChunks | None:
        chunk_blocks = max(1, min(capacity_blocks, CHUNK_BYTES // self.block_bytes))
        self.index.usable = 0  # as the chunks come
        return HostChunks(capacity_blocks, chunk_blocks, tuple(self.pool.shape[1:]),
                          self.pool.dtype, self.pool.is_cuda, allocate=_chunk)

    @property
    def tier_id(self) -> str:
        """The id routers group the workers reading this tier by ("": this worker's own)."""
        return ""

    def close(self) -> None:
        """The engine stops (a private tier's memory goes with the process)."""
        if self.memory is not None:
            self.memory.close()

    def wait_for_memory(self) -> float:
        """Wait until the thread has taken every chunk; the seconds waited. The engine waits
        at start, before its worker says it is ready: taking pinned memory while steps run
        held them up (on an H200 host, 24 GiB a worker made the first requests' TTFT ~8 s)."""
        t0 = time.perf_counter()
        if self.memory is not None:
            self.memory.done.wait()
        return time.perf_counter() - t0

    @property
    def capacity_bytes(self) -> int:
        return self.index.capacity * self.block_bytes

    @property
    def allocated_bytes(self) -> int:
        """Host memory taken so far (whole chunks; never above capacity_bytes)."""
        return self.memory.nbytes

    def slot(self, slot: int) -> torch.Tensor:
        """The host memory of one slot (handed out by the index: its memory is ready; but a
        tensor-parallel rank replaying rank 0's copies waits if its own memory is behind)."""
        if slot >= self.memory.ready:
            self.memory.wait_ready(slot + 1)
        return self.memory.slot(slot)

    def stats(self) -> HostTierStats:
        ix = self.index
        return HostTierStats(ix.hits, ix.misses, ix.evictions, ix.stored,
                             len(ix) * self.block_bytes, self.capacity_bytes,
                             self.allocated_bytes)

    # -- the pool's side ---------------------------------------------------------------------
    def offload(self, block: int, block_hash: int, parent: int | None = None,
                depth: int = 0) -> None:
        """A cached block is being reallocated: keep its KV (copied before the step that
        overwrites it). `parent`: the hash of the block before it (None: a first block);
        `depth`: its index in its prompt."""
        if self.memory is not None:
            self.index.usable = self.memory.ready  # only slots with memory: never wait for it
        slot = self.index.put(block_hash, parent, depth)
        if slot is not None:
            self.ops.append((True, block, slot))

    # -- the prefix match's side -------------------------------------------------------------
    def lookup(self, block_hash: int) -> int | None:
        """The slot holding this prefix, pinned (never reused) until `unpin`; or None."""
        slot = self.index.get(block_hash)
        if slot is not None:
            self.index.pinned.add(slot)
        return slot

    def unpin(self, slots: list[int]) -> None:
        # A deferred restore's slot stays pinned until its copy is issued (flush): copies
        # recorded later are issued before it, and one of them may not overwrite the slot.
        reading = {slot for _, slot in self.deferred}
        self.index.pinned.difference_update(s for s in slots if s not in reading)

    def restore(self, slot: int, block: int, deferred: bool = False) -> RestoreTicket | None:
        """Copy a slot back into a pool block. `deferred`: the step need not wait for it; the
        ticket returned says when it is done (the request reading the block waits for it)."""
        self.index.hits += 1
        if not deferred:
            self.ops.append((False, block, slot))
            return None
        self.deferred.append((block, slot))
        if self.ticket is None:
            self.ticket = RestoreTicket()
        return self.ticket

    def count_misses(self, n: int) -> None:
        self.index.misses += n

    # -- the engine's side -------------------------------------------------------------------
    def flush(self, wait: bool = False) -> None:
        """Issue the recorded copies, in order, then the deferred restores. The step's stream
        waits for the former (the step reads or overwrites those blocks), not for the latter
        (only their requests read them, once their ticket is done). `wait`: return only once
        the former are done (a writer outside the step's stream, a NIXL pull, may touch these
        blocks next).

            side stream:  [wait step's queue] offloads, ordered restores ●E  deferred ●T
            step stream:  ... step N ──────────────────── wait E ─ step N+1 ...
            a deferred request joins the first step scheduled once T has passed"""
        if not self.ops and not self.deferred:
            return
        ops, self.ops = self.ops, []
        deferred, self.deferred = self.deferred, []
        ticket, self.ticket = self.ticket, None
        if self.mirror is not None:  # the other ranks: the same copies, in the same order (a
            # rank's step waits for its restores: rank 0's ticket holds their request back)
            self.mirror(ops + [(False, b, s) for b, s in deferred], wait)
        if self.stream is None:
            self._copy(ops, non_blocking=False)
            self._copy([(False, b, s) for b, s in deferred], non_blocking=False)
            if ticket is not None:
                ticket.event = self._record()
        else:
            main = torch.cuda.current_stream(self.pool.device)
            self.stream.wait_stream(main)  # after the writes already queued (a step in flight)
            with torch.cuda.stream(self.stream):
                self._copy(ops, non_blocking=True)
                main.wait_stream(self.stream)  # the next step reads or overwrites these blocks
                self._copy([(False, b, s) for b, s in deferred], non_blocking=True)
                if ticket is not None:
                    ticket.event = self._record()
            if wait:
                self.stream.synchronize()
        self._issued([slot for _, slot in deferred])

    def _issued(self, slots: list[int]) -> None:
        """Deferred restores from these slots are issued: later copies follow them in stream
        order, so the slots may be reused."""
        self.index.pinned.difference_update(slots)

    def _record(self):
        """An event on the tier's stream after the copies issued so far (the CPU's copies are
        done when issued)."""
        if self.stream is None:
            return _Done()
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    @torch.inference_mode()
    def _copy(self, ops: list[tuple[bool, int, int]], non_blocking: bool) -> None:
        pool = self.pool
        for to_host, block, slot in ops:
            if to_host:
                self.slot(slot).copy_(pool[block], non_blocking=non_blocking)
            else:
                pool[block].copy_(self.slot(slot), non_blocking=non_blocking)


def host_tier_bytes(requested_gb: float | None, device: torch.device) -> int:
    """The tier's size in bytes: the flag's, or by default (None) AUTO_FRACTION of the host
    memory available now on CUDA and none on the CPU (there the pool is host memory already:
    a larger pool does the same job without the copies)."""
    if requested_gb is not None:
        return int(requested_gb * (1 << 30))
    if device.type != "cuda":
        return 0
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0
    return int(available * AUTO_FRACTION)


def host_tier_capacity(pool: torch.Tensor, requested_gb: float | None, *, enabled: bool,
                       ranks: int = 1) -> int:
    """The tier's size for this pool, in blocks (0: off, or `enabled` false); `ranks`
    tensor-parallel ranks each keep that many blocks of their own heads."""
    if not enabled:
        return 0
    return host_tier_bytes(requested_gb, pool.device) // (pool[0].nbytes * ranks)


def host_tier_for(pool: torch.Tensor, requested_gb: float | None, *,
                  enabled: bool, ranks: int = 1) -> HostKVTier | None:
    """The tier for this pool, or None (off: size 0, or `enabled` false)."""
    capacity = host_tier_capacity(pool, requested_gb, enabled=enabled, ranks=ranks)
    return HostKVTier(pool, capacity) if capacity >= 1 else None
