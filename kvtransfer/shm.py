"""The "shm" transport: a pool in a POSIX shared-memory segment named
"tandem-kv-<pid>-<random>", mapped by peers on the same host; CPU pools only (CPU deployments
and tests). A pull is a CPU copy, done when it returns.

Lifetime: the owner removes the segment's name at close() (nothing stays in /dev/shm); the
memory stays mapped, here and in peers, until the last tensor view of it is gone.
"""

from __future__ import annotations

import mmap
import os
import secrets
import weakref
from collections.abc import Sequence
from multiprocessing.shared_memory import SharedMemory

import torch

from tandem.errors import InvalidArgument
from tandem.kvtransfer.descriptor import PoolDescriptor
from tandem.kvtransfer.pool import TORCH_DTYPES, Allocation, RemotePool
from tandem.kvtransfer.remote import Finished, TransferStats, copy_mapped

SHM_PREFIX = "tandem-kv-"
SHM_DIR = "/dev/shm"


class ShmTransport:
    name = "shm"

    def allocate(self, nbytes: int, device: torch.device, block_bytes: int = 0,
                 site: object = None) -> Allocation:
        if device.type != "cpu":
            raise InvalidArgument("transport", f"a shm pool lives on the CPU, not on {device}")
        shm = _create_shm(nbytes)
        tensor, memory = _shm_tensor(shm, nbytes)
        return Allocation(tensor, memory, shm.name.encode(), -1, shm.unlink)

    def open(self, desc: PoolDescriptor, device: torch.device | str,
             site: object = None) -> RemotePool:
        device = torch.device(device)
        if device.type != "cpu":
            raise InvalidArgument("transport", f"a shm pool is mapped on the CPU, not on {device}")
        tensor, memory = _open_shm(desc)
        return RemotePool(tensor.view(TORCH_DTYPES[desc.dtype]).view(desc.shape), desc, memory)

    def pull(self, remote: RemotePool, local: torch.Tensor, src_block_ids: Sequence[int],
             dst_block_ids: Sequence[int], deadline: float | None = None,
             lease_id: str = "") -> TransferStats:
        return copy_mapped(remote, local, src_block_ids, dst_block_ids)

    def puller(self, local: torch.Tensor) -> ShmPuller:
        return ShmPuller(local)


class ShmPuller:
    """A decode core's pulls into `local`: each a copy, done when start() returns."""

    def __init__(self, local: torch.Tensor) -> None:
        self.local = local

    def start(self, remote: RemotePool, src_block_ids: list[int], dst_block_ids: list[int],
              deadline: object = None, lease_id: str = "") -> Finished:
        return Finished(copy_mapped(remote, self.local, src_block_ids, dst_block_ids))


TRANSPORT = ShmTransport()


def _create_shm(nbytes: int) -> SharedMemory:
    if os.path.isdir(SHM_DIR):
        # Segments are sparse: one larger than the tmpfs is created without error and then
        # kills the process with SIGBUS when a page past the limit is first touched (docker's
        # default /dev/shm is 64 MiB). Refuse it here instead.
        st = os.statvfs(SHM_DIR)
        free = st.f_bavail * st.f_frsize
        if nbytes > free:
            raise InvalidArgument("num_blocks", f"a {nbytes}-byte shm pool does not fit in "
                                                f"{SHM_DIR} ({free} bytes free)")
    name = f"{SHM_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
    return SharedMemory(name=name, create=True, size=nbytes)


def _shm_tensor(shm: SharedMemory, nbytes: int) -> tuple[torch.Tensor, weakref.finalize]:
    """A uint8 tensor over the first `nbytes` of a segment, and the finalizer that unmaps the
    segment after the last view of that tensor is gone.

    The tensor holds `view`, a slice of shm.buf. While it lives, SharedMemory.close() cannot
    unmap (mmap refuses with BufferError), so no code path leaves a tensor dangling;
    when it dies, the finalizer closes the SharedMemory.
    """
    view = shm.buf[:nbytes]
    memory = weakref.finalize(view, shm.close)
    memory.atexit = False  # at exit the process unmaps everything anyway
    return torch.frombuffer(view, dtype=torch.uint8), memory


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
