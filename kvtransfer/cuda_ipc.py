"""The "cuda_ipc" transport: a pool in one cudaMalloc'd allocation, made with cupy, whose CUDA
IPC handle peers on the same host open (this GPU, or a peer GPU with peer access). The pool
must be an allocation base (cudaIpcGetMemHandle exports whole allocations, and a tensor from
torch's caching allocator may sit inside a larger segment); torch.cuda.memory_allocated() does
not count it. A decode core's pull is launched on its stream and not waited for
(kvtransfer/remote.py launch_pull): the next step reads the blocks in stream order.

cupy is imported when a pool is allocated or opened, never at import.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence

import torch

from tandem.errors import InvalidArgument
from tandem.kvtransfer import remote as copies
from tandem.kvtransfer.descriptor import PoolDescriptor
from tandem.kvtransfer.pool import TORCH_DTYPES, Allocation, RemotePool
from tandem.kvtransfer.remote import PendingPull, TransferStats

# cudaIpcMemLazyEnablePeerAccess: map memory of another GPU by enabling peer access as needed.
IPC_LAZY_ENABLE_PEER_ACCESS = 1


class CudaIpcTransport:
    name = "cuda_ipc"

    def allocate(self, nbytes: int, device: torch.device, block_bytes: int = 0,
                 site: object = None) -> Allocation:
        if device.type != "cuda":
            raise InvalidArgument("transport", f"a cuda_ipc pool lives on a CUDA device, "
                                               f"not on {device}")
        index = device.index if device.index is not None else torch.cuda.current_device()
        tensor, memory, handle = _allocate_cuda(nbytes, index)
        return Allocation(tensor, memory, handle, index)

    def open(self, desc: PoolDescriptor, device: torch.device | str,
             site: object = None) -> RemotePool:
        device = torch.device(device)
        if device.type != "cuda":
            raise InvalidArgument("transport", f"a cuda_ipc pool is mapped on a CUDA device, "
                                               f"not on {device}")
        index = device.index if device.index is not None else torch.cuda.current_device()
        tensor, memory = _open_cuda_ipc(desc, index)
        return RemotePool(tensor.view(TORCH_DTYPES[desc.dtype]).view(desc.shape), desc, memory)

    def pull(self, remote: RemotePool, local: torch.Tensor, src_block_ids: Sequence[int],
             dst_block_ids: Sequence[int], deadline: float | None = None,
             lease_id: str = "") -> TransferStats:
        return copies.copy_mapped(remote, local, src_block_ids, dst_block_ids)

    def puller(self, local: torch.Tensor) -> CudaIpcPuller:
        return CudaIpcPuller(local)


class CudaIpcPuller:
    """A decode core's pulls into `local`: each launched on the current stream, done once the
    stream passed it."""

    def __init__(self, local: torch.Tensor) -> None:
        self.local = local

    def start(self, remote: RemotePool, src_block_ids: list[int], dst_block_ids: list[int],
              deadline: object = None, lease_id: str = "") -> PendingPull:
        return copies.launch_pull(remote, self.local, src_block_ids, dst_block_ids)


TRANSPORT = CudaIpcTransport()


class _DeviceMemory:
    """Stands for one raw device allocation or IPC mapping. The cupy UnownedMemory behind every
    tensor view holds it, so its finalizer runs once no view is left."""


def device_memory_tensor(ptr: int, nbytes: int, device_index: int,
                         release: Callable[[], None]) -> tuple[torch.Tensor, weakref.finalize]:
    """A uint8 CUDA tensor over raw device memory at `ptr`, as seen from `device_index`; runs
    `release` once no view of it is left. The pointer goes through cupy (UnownedMemory on
    `device_index`: for peer memory, cupy would otherwise ask the pointer and get the peer's
    device) and DLPack, whose capsule keeps the cupy array alive as long as the tensor."""
    import cupy  # noqa: PLC0415 - cuda_ipc only

    owner = _DeviceMemory()
    memory = weakref.finalize(owner, release)
    memory.atexit = False  # at exit the driver tears down every allocation and mapping
    with cupy.cuda.Device(device_index):  # DLPack's stream handshake runs on this device
        unowned = cupy.cuda.UnownedMemory(ptr, nbytes, owner, device_index)
        array = cupy.ndarray((nbytes,), dtype=cupy.uint8,
                             memptr=cupy.cuda.MemoryPointer(unowned, 0))
        return torch.from_dlpack(array), memory


def on_device(device_index: int, fn: Callable[[int], object], ptr: int) -> None:
    """Call a cupy runtime function on a pointer with `device_index` current."""
    import cupy  # noqa: PLC0415 - cuda_ipc only

    with cupy.cuda.Device(device_index):
        fn(ptr)


def _allocate_cuda(nbytes: int, device_index: int) -> tuple[torch.Tensor, weakref.finalize,
                                                            bytes]:
    import cupy  # noqa: PLC0415 - only the cuda_ipc transport needs cupy

    runtime = cupy.cuda.runtime
    with cupy.cuda.Device(device_index):
        ptr = runtime.malloc(nbytes)  # cudaMalloc: ptr is the allocation base
        try:
            handle = bytes(runtime.ipcGetMemHandle(ptr))
        except BaseException:
            runtime.free(ptr)
            raise
    # From here on the finalizer owns ptr: it frees it once no tensor view is left.
    free = functools.partial(on_device, device_index, runtime.free, ptr)
    tensor, memory = device_memory_tensor(ptr, nbytes, device_index, free)
    return tensor, memory, handle


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
