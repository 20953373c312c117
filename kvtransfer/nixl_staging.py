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
                        │ copy_pool_blocks, on the current stream, as each chunk lands
    local pool  [ .. 3 .. 17 .. 5 .. 90 .. ]

Chunks overlap: while chunk k's local copy runs, chunk k+1 is on the wire; a slot is read into
again only once its last copy has run (a CUDA event). When `staged_read` returns, every READ is
done (the peer's blocks may be released) and the local copies are queued on the current stream
in order before anything launched on it later (a decode worker's next step); on the CPU they
are done.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvtransfer.remote import copy_pool_blocks
from kvtransfer.runs import block_runs, order_like

if TYPE_CHECKING:
    from kvtransfer.nixl import NixlEndpoint, Transfer
    from kvtransfer.nixl_remote import NixlRemotePool

# A pull goes direct when it has at most this many runs of blocks adjacent on both sides (one
# descriptor each: 8 runs of a 2k-token prompt moved at 0.74-0.85 of one large copy, lease I/K),
# staged when its source has at most half as many runs as the pairs do.
MAX_DIRECT_RUNS = 8
# A decode worker's staging area: this many blocks (at most STAGING_BYTES), in 4 slots.
STAGING_BLOCKS = 64
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

    def _take_slot(self) -> int:
        slot = self._next
        self._next = (slot + 1) % self.slots
        event, self._copied[slot] = self._copied[slot], None
        if event is not None:
            event.synchronize()  # its last copy has run: the slot may be written again
        return slot

    def _copy_out(self, stage_ids: Sequence[int], local: torch.Tensor,
                  dst_ids: Sequence[int]) -> None:
        if not local.is_cuda:
            copy_pool_blocks(self.tensor, local, stage_ids, dst_ids)
            return
        with torch.cuda.device(local.device):
            copy_pool_blocks(self.tensor, local, stage_ids, dst_ids)
            event = torch.cuda.Event()
            event.record()
        self._copied[stage_ids[0] // self.chunk] = event

    def close(self, endpoint: NixlEndpoint | None) -> None:
        """Wait for pending copies and deregister the area (idempotent)."""
        for event in self._copied:
            if event is not None:
                event.synchronize()
        self._copied = [None] * self.slots
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
    n, chunk = len(src_ids), staging.chunk
    # (transfer, its staging blocks, start, end): pairs a..b of the pull
    inflight: deque[tuple[Transfer, list[int], int, int]] = deque()

    def land_first() -> None:
        transfer, stage_ids, a, b = inflight.popleft()
        endpoint.complete(transfer, deadline, cancel)
        staging._copy_out(stage_ids, local, dst_ids[a:b])

    try:
        for a in range(0, n, chunk):
            b = min(a + chunk, n)
            if len(inflight) == staging.slots:
                land_first()  # its slot is the one to use next
            first = staging._take_slot() * chunk
            # the slot's blocks in the order of the chunk's source runs (either direction)
            stage_ids = order_like(src_ids[a:b], range(first, first + b - a))
            inflight.append((endpoint.post("READ", remote, staging.tensor, stage_ids,
                                           src_ids[a:b]), stage_ids, a, b))
            while inflight and endpoint.done(inflight[0][0]):
                land_first()
        while inflight:
            land_first()
    finally:
        for transfer, *_ in inflight:  # after an error: cancel or outwait the rest
            endpoint.abandon(transfer)
