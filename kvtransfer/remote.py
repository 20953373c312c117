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

import functools
import mmap
import os
import time
import weakref
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvtransfer.descriptor import PoolDescriptor
from kvtransfer.pool import (
    SHM_DIR,
    SHM_PREFIX,
    TORCH_DTYPES,
    MappedPool,
    device_memory_tensor,
    on_device,
)
from kvtransfer.runs import block_runs
from tandem.errors import InvalidArgument

# cudaIpcMemLazyEnablePeerAccess: map memory of another GPU by enabling peer access as needed.
IPC_LAZY_ENABLE_PEER_ACCESS = 1

# A pull of at most this many runs is one cudaMemcpyAsync per run (the copy engines move a run
# at the rate of one large peer copy, plus a few microseconds each); more, and one copy_blocks
# launch. On 2x H100, a 2k-token prompt launched behind a busy stream, as a decode worker
# launches it (`benchmarks/transfer/kv_transfer.py`; BENCHMARKS.md "Runs of adjacent blocks"): the
# kernel 0.73 ms bf16 / 0.38 FP8 on any ids; the copy engines 0.68 / 0.35 for one run,
# 0.71-0.72 / 0.38 for 8, 0.74-0.75 / 0.41 for 16; their host time ~half the kernel's.
MAX_COPY_RUNS = 8


class RemotePool(MappedPool):
    """A peer's pool mapped here; `tensor` lives on the device it was opened on (for cuda_ipc
    that may be peer memory). Opened once per peer and kept; close() unmaps it once no tensor
    view is left. Never unlinks or frees the peer's memory."""


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


def open_remote_pool(desc: PoolDescriptor, device: torch.device | str) -> RemotePool:
    """Map a peer's pool: attach its shared-memory segment ("shm", device must be the CPU) or
    open its CUDA IPC handle on `device` ("cuda_ipc"; same GPU or a peer GPU of this host).
    A "nixl" pool is not mapped: this returns a kvtransfer.nixl_remote.NixlRemotePool, which
    pull_blocks reads from over NIXL (any host, any device).

    Check the layout against your own pool first (`check_compatible`). Errors carry the
    descriptor's redacted fields, never its handle.
    """
    device = torch.device(device)
    if desc.transport == "nixl":  # nothing to map: reads go through this process's NIXL agent
        from kvtransfer.nixl import default_endpoint  # noqa: PLC0415 - optional extra

        return default_endpoint(serves=False).connect(desc)  # type: ignore[return-value]
    if desc.transport == "shm":
        if device.type != "cpu":
            raise InvalidArgument("transport", f"a shm pool is mapped on the CPU, not on {device}")
        tensor, memory = _open_shm(desc)
    else:
        if device.type != "cuda":
            raise InvalidArgument("transport", f"a cuda_ipc pool is mapped on a CUDA device, "
                                               f"not on {device}")
        index = device.index if device.index is not None else torch.cuda.current_device()
        tensor, memory = _open_cuda_ipc(desc, index)
    tensor = tensor.view(TORCH_DTYPES[desc.dtype]).view(desc.shape)
    return RemotePool(tensor, desc, memory)


def pull_blocks(remote: RemotePool, local: torch.Tensor, src_block_ids: Sequence[int],
                dst_block_ids: Sequence[int], deadline: float | None = None) -> TransferStats:
    """Copy blocks `src_block_ids[i]` of the remote pool into blocks `dst_block_ids[i]` of
    `local` (a pool tensor of the same layout, on the device the remote pool was opened on).

    CPU: one index_select + index_copy_. CUDA: one launch of kernels.copy_blocks on the current
    stream, then a wait for that stream: when this returns, the blocks are in place and the
    peer may reuse its blocks (release the lease).

    nixl: one NIXL READ, waited for; past `deadline` (time.monotonic()) it is cancelled and
    TimeoutError raised (the local copies above take no deadline: they cannot stall on a peer).
    """
    if remote.descriptor.transport == "nixl":
        n = len(src_block_ids)
        start = time.perf_counter()
        remote.pull(local, src_block_ids, dst_block_ids, deadline=deadline)  # type: ignore[attr-defined]
        return TransferStats(num_blocks=n, bytes=n * remote.descriptor.block_bytes,
                             seconds=time.perf_counter() - start if n else 0.0)
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


class PendingPull:
    """A pull launched on a CUDA stream and not waited for: events around it tell when it is
    done and how long it took on the device."""

    def __init__(self, num_blocks: int, nbytes: int, start: torch.cuda.Event,
                 end: torch.cuda.Event) -> None:
        self.num_blocks, self.bytes = num_blocks, nbytes
        self.start, self.end = start, end

    def done(self) -> bool:
        return self.end.query()

    def wait(self) -> None:
        self.end.synchronize()

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
        from kernels.copy_blocks import copy_blocks  # noqa: PLC0415 - triton only on CUDA
    except ImportError as e:
        raise RuntimeError("pull_blocks on CUDA needs the gather kernel "
                           f"kernels.copy_blocks.copy_blocks, which cannot be imported: {e}") from e
    return copy_blocks


def _open_shm(desc: PoolDescriptor) -> tuple[torch.Tensor, weakref.finalize]:
    """Map a peer's segment, read-write, as /dev/shm/<name> (what shm_open does on Linux).

    Not through SharedMemory(name): before Python 3.13 that registers the segment with this
    process's resource tracker, which unlinks it when this process exits, pulling the pool
    from under its owner (cpython gh-82300). Unregistering right after is no cure: a process
    that shares its owner's tracker (a multiprocessing child of a common parent, or the owner
    itself) would drop the owner's own entry. Mapping the file never involves the tracker.
    """
    name = desc.shm_name
    if "/" in name or not name.startswith(SHM_PREFIX):
        raise InvalidArgument("handle", "is not the name of a Tandem shm pool")  # name withheld
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
    except OSError as e:  # its text would carry the path, i.e. the name
        raise RuntimeError(f"cannot open shm pool {desc.redacted()}: {e.strerror}") from None
    try:
        size = os.fstat(fd).st_size
        if size < desc.pool_bytes:
            raise InvalidArgument("num_blocks", f"segment of {size} bytes is smaller than the "
                                                f"described pool ({desc.pool_bytes} bytes)")
        mapping = mmap.mmap(fd, desc.pool_bytes)
    finally:
        os.close(fd)  # the mapping stays valid without the descriptor
    # The tensor holds `mapping`; nothing calls mapping.close(), so it is unmapped when the last
    # view is gone. The finalizer only observes that (RemotePool.mapped).
    unmapped = weakref.finalize(mapping, lambda: None)
    return torch.frombuffer(mapping, dtype=torch.uint8), unmapped


def _open_cuda_ipc(desc: PoolDescriptor, index: int) -> tuple[torch.Tensor, weakref.finalize]:
    import cupy  # noqa: PLC0415 - only the cuda_ipc transport needs cupy

    runtime = cupy.cuda.runtime
    try:
        with cupy.cuda.Device(index):
            ptr = runtime.ipcOpenMemHandle(desc.handle, IPC_LAZY_ENABLE_PEER_ACCESS)
    except runtime.CUDARuntimeError as e:
        # str(e) is the CUDA error name and text; the handle stays out of the message.
        raise RuntimeError(
            f"cannot open the CUDA IPC handle of pool {desc.redacted()} on cuda:{index}: {e}. "
            "The owner must be another process on this host, sharing its IPC namespace "
            "(docker: ipc: host)") from e
    close = functools.partial(on_device, index, runtime.ipcCloseMemHandle, ptr)
    return device_memory_tensor(ptr, desc.pool_bytes, index, close)
