"""Staged NIXL reads: a pull whose destination blocks are scattered lands in a contiguous
staging area first, then moves into place with a local copy.

UCX moves each NIXL descriptor as one copy (over NVLink, one cuMemcpyDtoDAsync on one stream
per peer), and a copy has a fixed cost on the copy engine: 128 scattered 2 MiB blocks took
1.3-1.9 ms against 0.7 ms for the same bytes in one piece (BENCHMARKS.md "Over NIXL"). A
prefill worker's blocks for a prompt come in long runs (it allocates a prompt's chunk at
once), a decode worker's fresh blocks often do not (its free queue mixes every finished
sequence's blocks in least-recently-used order, which the prefix cache needs). So the READ
goes into staging blocks in the source's order, one descriptor per source run, and the local
copy (device memory to device memory, ~4x NVLink's rate) scatters them:

    peer pool   [ .. 7 8 9 10 11 12 .. 40 41 42 .. ]        one descriptor per source run
                        │ READ, in chunks                     (per chunk; a slot's blocks are
                        │                                      ordered like the source's)
    staging     [ s0 s1 s2 s3 | s4 s5 s6 s7 ]  slots of `chunk` blocks, used round-robin
                        │ a local copy on the current stream as each chunk lands (CUDA:
                        │ copy_blocks, the pull's ids uploaded once)
    local pool  [ .. 3 .. 17 .. 5 .. 90 .. ]

Chunks overlap: while chunk k's local copy runs, chunk k+1 is on the wire; a slot is read into
again only once its last copy has run (a CUDA event). When `staged_read` returns, every READ is
done (the peer's blocks may be released) and the local copies are queued on the current stream
in order before anything launched on it later (a decode worker's next step); on the CPU they
are done.
"""

from __future__ import annotations

import threading
from array import array
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvtransfer.remote import copy_blocks_kernel, copy_pool_blocks
from kvtransfer.runs import block_runs, order_like

if TYPE_CHECKING:
    from kvtransfer.nixl import NixlEndpoint, Transfer
    from kvtransfer.nixl_remote import NixlRemotePool

# A pull goes direct when it has at most this many runs of blocks adjacent on both sides (one
# descriptor each: 8 runs of a 2k-token prompt moved at 0.74-0.85 of one large copy, lease I/K),
# staged when its source has at most half as many runs as the pairs do.
MAX_DIRECT_RUNS = 8
# A decode worker's staging area: this many blocks (at most STAGING_BYTES), in 4 slots: a
# 2k-token prompt of Llama-3.1-8B (128 blocks of 2 MiB) in 4 READs of 32 blocks.
STAGING_BLOCKS = 128
STAGING_BYTES = 256 << 20
STAGING_SLOTS = 4


class Staging:
    """A contiguous area of `num_blocks` blocks shaped like `like`'s (a pool), on its device,
    in `slots` slots of `chunk` blocks; registered with the endpoint on its first READ. One
    pull at a time (a decode worker's engine thread)."""

    def __init__(self, like: torch.Tensor, num_blocks: int = STAGING_BLOCKS,
                 slots: int = STAGING_SLOTS, max_bytes: int = STAGING_BYTES) -> None:
        block_bytes = like[0].numel() * like.element_size()
        num_blocks = max(slots, min(num_blocks, max_bytes // max(block_bytes, 1)))
        self.chunk = num_blocks // slots
        self.slots = slots
        self.tensor = torch.empty((self.chunk * slots, *like.shape[1:]), dtype=like.dtype,
                                  device=like.device)
        # the event after each slot's last local copy (CUDA), None when there is none pending
        self._copied: list[Any] = [None] * slots
        self._next = 0
        # CUDA: a pull's ids go up in one copy from this pinned buffer (grown as needed), which
        # is written again only once that copy has run (_uploaded)
        self._pinned: torch.Tensor | None = None
        self._uploaded: Any = None
        self.staged_reads = 0  # pulls that went through here (a counter for tests and figures)

    @property
    def num_blocks(self) -> int:
        return self.tensor.shape[0]

    def wants(self, src_ids: Sequence[int], dst_ids: Sequence[int]) -> bool:
        """Whether a pull of these pairs should be staged: more than MAX_DIRECT_RUNS runs, of
        which the source alone makes at most half."""
        if block_runs(src_ids, dst_ids, limit=MAX_DIRECT_RUNS) is not None:
            return False
        pairs = len(block_runs(src_ids, dst_ids) or ())
        return 2 * len(block_runs(src_ids, src_ids) or ()) <= pairs

    def plan(self, src_ids: Sequence[int]) -> list[tuple[int, int, int, list[int]]]:
        """The pull's chunks, (start, end, slot, staging block ids): slots round-robin, each
        chunk's staging blocks ordered like its source blocks (kvtransfer.runs.order_like: a
        source run in either direction is one descriptor)."""
        out = []
        for k, a in enumerate(range(0, len(src_ids), self.chunk)):
            b = min(a + self.chunk, len(src_ids))
            slot = (self._next + k) % self.slots
            first = slot * self.chunk
            out.append((a, b, slot, order_like(src_ids[a:b], range(first, first + b - a))))
        self._next = (self._next + len(out)) % self.slots
        return out

    def upload(self, stage_ids: Sequence[int], dst_ids: Sequence[int]) -> torch.Tensor | None:
        """CUDA: [2, n] int64 on the device (staging ids, destination ids), in one copy queued
        on the current stream; None on the CPU."""
        if not self.tensor.is_cuda:
            return None
        n = len(dst_ids)
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the last pull's ids have left the pinned buffer
        if self._pinned is None or self._pinned.numel() < 2 * n:
            self._pinned = torch.empty(2 * max(n, self.num_blocks), dtype=torch.int64,
                                       pin_memory=True)
        host = self._pinned[:2 * n]
        host.copy_(torch.frombuffer(array("q", [*stage_ids, *dst_ids]), dtype=torch.int64))
        with torch.cuda.device(self.tensor.device):
            ids = host.view(2, n).to(self.tensor.device, non_blocking=True)
            self._uploaded = torch.cuda.Event()
            self._uploaded.record()
        return ids

    def wait_slot(self, slot: int) -> None:
        """Until the slot's last local copy has run (it may be written again)."""
        event, self._copied[slot] = self._copied[slot], None
        if event is not None:
            event.synchronize()

    def copy_out(self, slot: int, stage_ids: Sequence[int], local: torch.Tensor,
                 dst_ids: Sequence[int], ids: torch.Tensor | None, a: int, b: int) -> None:
        """A landed chunk into its blocks of `local`: CUDA, one copy_blocks launch on the
        current stream with the uploaded ids[:, a:b]; CPU, done at once."""
        if ids is None:
            copy_pool_blocks(self.tensor, local, stage_ids, dst_ids)
            return
        with torch.cuda.device(local.device):
            copy_blocks_kernel()(self.tensor, local, ids[0, a:b], ids[1, a:b])
            event = torch.cuda.Event()
            event.record()
        self._copied[slot] = event

    def close(self, endpoint: NixlEndpoint | None) -> None:
        """Wait for pending copies and deregister the area (idempotent)."""
        for slot in range(self.slots):
            self.wait_slot(slot)
        if self._uploaded is not None:
            self._uploaded.synchronize()
            self._uploaded = None
        if endpoint is not None:
            endpoint.deregister(self.tensor)


def staged_read(endpoint: NixlEndpoint, remote: NixlRemotePool, staging: Staging,
                local: torch.Tensor, src_ids: Sequence[int], dst_ids: Sequence[int],
                deadline: float | None, cancel: threading.Event | None) -> None:
    """Blocks src_ids of the peer's pool into dst_ids of `local` through `staging` (same block
    layout and device as `local`; ids checked by the caller). Errors as NixlEndpoint.read's:
    raised once no READ is in flight (every handle released); blocks already copied into
    place stay there (the caller frees them)."""
    staging.staged_reads += 1
    chunks = staging.plan(src_ids)
    ids = staging.upload([i for *_, stage in chunks for i in stage], dst_ids)
    inflight: deque[tuple[Transfer, int, int, int, list[int]]] = deque()

    def land_first() -> None:
        transfer, a, b, slot, stage_ids = inflight.popleft()
        endpoint.complete(transfer, deadline, cancel)
        staging.copy_out(slot, stage_ids, local, dst_ids[a:b], ids, a, b)

    try:
        for a, b, slot, stage_ids in chunks:
            if len(inflight) == staging.slots:
                land_first()  # the slot about to be read into again
            staging.wait_slot(slot)
            inflight.append((endpoint.post("READ", remote, staging.tensor, stage_ids,
                                           src_ids[a:b]), a, b, slot, stage_ids))
            while inflight and endpoint.done(inflight[0][0]):
                land_first()
        while inflight:
            land_first()
    finally:
        for transfer, *_ in inflight:  # after an error: cancel or outwait the rest
            endpoint.abandon(transfer)
