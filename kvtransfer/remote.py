"""A peer's KV pool mapped into this process, and the copy of its blocks into ours.

A decode worker opens each prefill worker's pool once (`open_remote_pool`), keeps it, and for
each request pulls the request's blocks into blocks of its own pool (`pull_blocks`):

    remote pool (P)                         local pool (D)
    [ 0 | 1 | 2 | 3 | 4 | 5 | ... ]         [ 0 | 1 | 2 | 3 | 4 | 5 | ... ]
          ^       ^   ^                       ^       ^           ^
          src_block_ids = [4, 1, 3]  ──►  dst_block_ids = [5, 0, 2]

Each block is one contiguous chunk (all layers, K and V), so a transfer of N blocks is N chunk
copies. On CUDA, blocks adjacent on both sides (runs, kvtransfer/runs.py) go to the copy
engines, one cudaMemcpyAsync per run, when there are at most MAX_COPY_RUNS of them; otherwise
one copy_blocks kernel launch moves them all.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tandem.errors import InvalidArgument
from tandem.kvtransfer import transports
from tandem.kvtransfer.descriptor import PoolDescriptor
from tandem.kvtransfer.pool import RemotePool  # the peers' pools this module copies from
from tandem.kvtransfer.runs import block_runs

# A pull of at most this many runs is one cudaMemcpyAsync per run (the copy engines move a run
# at the rate of one large peer copy, plus a few microseconds each); more, and one copy_blocks
# launch. On 2x H100, a 2k-token prompt launched behind a busy stream, as a decode worker
# launches it (`benchmarks/transfer/kv_transfer.py`; BENCHMARKS.md "Runs of adjacent blocks"): the
# kernel 0.73 ms bf16 / 0.38 FP8 on any ids; the copy engines 0.68 / 0.35 for one run,
# 0.71-0.72 / 0.38 for 8, 0.74-0.75 / 0.41 for 16; their host time ~half the kernel's.
MAX_COPY_RUNS = 8


@dataclass(frozen=True)
class TransferStats:
    """One pull: blocks and bytes moved, wall-clock seconds including the wait for the copy."""

    num_blocks: int
    bytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        """Gigabytes (1e9 bytes) per second."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def open_remote_pool(desc: PoolDescriptor, device: torch.device | str,
                     site: transports.WorkerSite | None = None) -> Any:
    """Map a peer's pool on `device`, over its transport (kvtransfer/transports.py): a
    RemotePool for a transport that maps it (a shared-memory segment on the CPU; a CUDA IPC
    handle on this GPU or a peer GPU of this host), or what the transport reads through (NIXL:
    a kvtransfer.nixl_remote.NixlRemotePool, any host, any device; tcp: a connection, dialed
    with `site`'s TLS). pull_blocks takes either.

    Check the layout against your own pool first (`check_compatible`). Errors carry the
    descriptor's redacted fields, never its handle.
    """
    return transports.load(desc.transport).open(desc, device, site or transports.WorkerSite())


def pull_blocks(remote: Any, local: torch.Tensor, src_block_ids: Sequence[int],
                dst_block_ids: Sequence[int], deadline: float | None = None,
                lease_id: str = "") -> TransferStats:
    """Copy blocks `src_block_ids[i]` of the remote pool into blocks `dst_block_ids[i]` of
    `local` (a pool tensor of the same layout, on the device the remote pool was opened on),
    over the pool's transport, and wait: when this returns, the blocks are in place and the
    peer may reuse its blocks (release the lease). Past `deadline` (time.monotonic()) a
    transport that can stall on a peer (NIXL, tcp) cancels and raises TimeoutError; local
    copies take no deadline. `lease_id`: the lease the blocks are under (a transport whose
    owner serves the blocks itself, tcp, sends only a live lease's blocks)."""
    return transports.load(remote.descriptor.transport).pull(remote, local, src_block_ids,
                                                             dst_block_ids, deadline, lease_id)


def copy_mapped(remote: RemotePool, local: torch.Tensor, src_block_ids: Sequence[int],
                dst_block_ids: Sequence[int]) -> TransferStats:
    """pull_blocks between pools mapped as tensors. CPU: one index_select + index_copy_.
    CUDA: the copies launched on the current stream (launch_pull), then a wait for that
    stream."""
    src_pool = remote.tensor
    _check_pull(src_pool, local, src_block_ids, dst_block_ids)
    n = len(src_block_ids)
    if n == 0:
        return TransferStats(num_blocks=0, bytes=0, seconds=0.0)
    start = time.perf_counter()
    if local.is_cuda:
        launch_pull(remote, local, src_block_ids, dst_block_ids, checked=True)
        torch.cuda.current_stream(local.device).synchronize()
    else:
        src_ids = torch.tensor(src_block_ids, dtype=torch.int64)
        dst_ids = torch.tensor(dst_block_ids, dtype=torch.int64)
        # As bytes: pages move unchanged, and the CPU has no index_copy_ for float8.
        local.view(torch.uint8).index_copy_(0, dst_ids,
                                            src_pool.view(torch.uint8).index_select(0, src_ids))
    seconds = time.perf_counter() - start
    return TransferStats(num_blocks=n, bytes=n * local[0].numel() * local.element_size(),
                         seconds=seconds)


class Finished:
    """A pull that was over when it started (a copy waited for): a Transfer
    (kvtransfer/transports.py) that is done."""

    outside_stream = False

    def __init__(self, stats: TransferStats) -> None:
        self._stats = stats

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        pass

    def cancel(self) -> None:
        pass

    def stats(self) -> TransferStats:
        return self._stats


class PendingPull:
    """A pull launched on a CUDA stream and not waited for: events around it tell when it is
    done and how long it took on the device. A Transfer (kvtransfer/transports.py) in the
    stream's order: the engine's next step, launched after it, reads the blocks."""

    outside_stream = False

    def __init__(self, num_blocks: int, nbytes: int, start: torch.cuda.Event,
                 end: torch.cuda.Event) -> None:
        self.num_blocks, self.bytes = num_blocks, nbytes
        self.start, self.end = start, end

    def done(self) -> bool:
        return self.end.query()

    def wait(self) -> None:
        self.end.synchronize()

    def cancel(self) -> None:
        self.wait()  # a copy on the stream runs to its end

    def stats(self) -> TransferStats:
        """Once done: the copy's device time (from the stream reaching it to its end)."""
        return TransferStats(self.num_blocks, self.bytes, self.start.elapsed_time(self.end) / 1e3)


def launch_pull(remote: RemotePool, local: torch.Tensor, src_block_ids: Sequence[int],
                dst_block_ids: Sequence[int], checked: bool = False) -> PendingPull:
    """The CUDA half of pull_blocks without its wait: the copies launched on the current
    stream (one cudaMemcpyAsync per run of adjacent blocks, or the ids uploaded and one
    copy_blocks launch), after whatever that stream already holds and before whatever is
    launched on it later (a decode worker's next step reads the blocks in order; its step in
    flight, which may still write blocks just freed and now pulled into, writes first). The
    peer may reuse its blocks only once `done()`."""
    src_pool = remote.tensor
    if not checked:
        _check_pull(src_pool, local, src_block_ids, dst_block_ids)
    n = len(src_block_ids)
    runs = block_runs(src_block_ids, dst_block_ids, limit=MAX_COPY_RUNS)
    copy_blocks = None if runs or not n else _copy_blocks_kernel()
    with torch.cuda.device(local.device):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if runs:
            src_bytes, dst_bytes = _as_bytes(src_pool), _as_bytes(local)
            for s, d, k in runs:  # each a contiguous range on both sides: one memcpy
                dst_bytes[d:d + k].copy_(src_bytes[s:s + k])
        elif n:
            # Both id lists in one pinned upload: at ~1 ms per transfer, every extra
            # synchronous copy shows in the achieved bandwidth. Built from an array: a third
            # of torch.tensor's host time for a list of ints.
            ids = torch.frombuffer(array("q", [*src_block_ids, *dst_block_ids]),
                                   dtype=torch.int64).view(2, n)
            ids = ids.pin_memory().to(local.device, non_blocking=True)
            copy_blocks(src_pool, local, ids[0], ids[1])  # type: ignore[misc]
        end.record()
    return PendingPull(n, n * local[0].numel() * local.element_size(), start, end)


def _as_bytes(pool: torch.Tensor) -> torch.Tensor:
    """A block-major pool as [num_blocks, block bytes] of uint8 (FP8 pools included)."""
    return pool.view(pool.shape[0], -1).view(torch.uint8)


def _check_pull(src: torch.Tensor, dst: torch.Tensor, src_ids: Sequence[int],
                dst_ids: Sequence[int]) -> None:
    # An id out of range would make the CUDA kernel read or write out of bounds, a sticky error
    # that ends the process: check ids here, in Python, before any launch.
    if src.dtype != dst.dtype or src.shape[1:] != dst.shape[1:]:
        raise InvalidArgument("local", f"pool {dst.dtype} {tuple(dst.shape)} cannot take blocks "
                                       f"of {src.dtype} {tuple(src.shape)}")
    check_block_ids(src, dst, src_ids, dst_ids)


def check_block_ids(src: torch.Tensor, dst: torch.Tensor, src_ids: Sequence[int],
                    dst_ids: Sequence[int]) -> None:
    """Both pools on one device, ids paired one to one, in range, destinations distinct: what
    any copy between two pools needs before a launch (whole blocks here, heads in tp_pull)."""
    if src.device != dst.device:
        raise InvalidArgument("local", f"remote pool is mapped on {src.device}, local pool is on "
                                       f"{dst.device}")
    if len(src_ids) != len(dst_ids):
        raise InvalidArgument("dst_block_ids", f"{len(dst_ids)} ids for {len(src_ids)} "
                                               "source blocks")
    for field, ids, limit in (("src_block_ids", src_ids, src.shape[0]),
                              ("dst_block_ids", dst_ids, dst.shape[0])):
        if ids and (min(ids) < 0 or max(ids) >= limit):
            raise InvalidArgument(field, f"ids must be in [0, {limit}), got {min(ids)}..{max(ids)}")
    if len(set(dst_ids)) != len(dst_ids):
        raise InvalidArgument("dst_block_ids", "ids must be distinct")


def _copy_blocks_kernel() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                                      None]:
    try:
        from tandem.kernels.copy_blocks import copy_blocks  # noqa: PLC0415 - triton only on CUDA
    except ImportError as e:
        raise RuntimeError("pull_blocks on CUDA needs the gather kernel "
                           f"tandem.kernels.copy_blocks.copy_blocks, which cannot be imported: {e}") from e
    return copy_blocks
