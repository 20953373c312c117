"""A worker's own KV pool, allocated so that peers can map it.

    pool: [num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]

One tensor, block-major: block b (all layers, K and V) is the contiguous chunk `pool[b]`,
`descriptor.block_bytes` long. The pool is the whole shared allocation from offset 0, so a peer
maps it from the descriptor alone.

Transports:
- "shm": a POSIX shared-memory segment named "tandem-kv-<pid>-<random>"; CPU only.
- "nixl": a plain tensor (CPU or CUDA) registered with this process's NIXL agent
  (kvtransfer/nixl.py); peers read it over UCX, on this host or another.
- "cuda_ipc": one cudaMalloc'd allocation made with cupy, so its pointer is an allocation base:
  cudaIpcGetMemHandle exports whole allocations, and a tensor from torch's caching allocator
  may sit inside a larger segment. torch.cuda.memory_allocated() does not count it.

Lifetime: `close()` gives up the pool object's reference, and the owner's shared-memory name is
removed at once (nothing stays in /dev/shm). The memory, or this process's mapping of a peer's
memory, is released when no tensor view of it is left, so a view kept past close() never
dangles. `mapped` says whether that has happened.
"""

from __future__ import annotations

import functools
import os
import secrets
import weakref
from collections.abc import Callable
from multiprocessing.shared_memory import SharedMemory
from typing import Self

import torch

from kvtransfer.descriptor import PoolDescriptor
from tandem.errors import InvalidArgument

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
               torch.float8_e4m3fn: "float8_e4m3fn"}
TORCH_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}

SHM_PREFIX = "tandem-kv-"
SHM_DIR = "/dev/shm"


class MappedPool:
    """A pool tensor plus the finalizer that releases its memory. Base of LocalPool (this
    worker's pool) and RemotePool (a peer's pool mapped here)."""

    def __init__(self, tensor: torch.Tensor, descriptor: PoolDescriptor,
                 memory: weakref.finalize, on_close: Callable[[], None] | None = None) -> None:
        self._tensor: torch.Tensor | None = tensor
        self.descriptor = descriptor
        self._memory = memory
        self._on_close = on_close

    @property
    def tensor(self) -> torch.Tensor:
        """The 6-d pool tensor. Raises RuntimeError after close()."""
        if self._tensor is None:
            raise RuntimeError(f"{type(self).__name__} is closed")
        return self._tensor

    @property
    def closed(self) -> bool:
        return self._tensor is None

    @property
    def mapped(self) -> bool:
        """Whether the memory is still held here: until close(), and after it for as long as
        some tensor view of the pool is alive."""
        return self._memory.alive

    def close(self) -> None:
        """Drop this object's reference to the pool (idempotent); see the module docstring."""
        if self._tensor is None:
            return
        self._tensor = None
        if self._on_close is not None:
            self._on_close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"{type(self).__name__}({self.descriptor.redacted()}, {state})"


class LocalPool(MappedPool):
    """This worker's pool. `descriptor` is what a peer needs to map it; its handle is a
    capability, sent to peers and never logged."""


def allocate_pool(*, num_blocks: int, num_layers: int, block_size: int, num_kv_heads: int,
                  head_dim: int, dtype: torch.dtype, device: torch.device | str,
                  transport: str) -> LocalPool:
    """Allocate a zeroed KV pool that peers can map: transport "shm" on the CPU, "cuda_ipc" on
    a CUDA device (needs cupy), "nixl" on either (needs the nixl extra)."""
    dims = {"num_blocks": num_blocks, "num_layers": num_layers, "block_size": block_size,
            "num_kv_heads": num_kv_heads, "head_dim": head_dim}
    for name, value in dims.items():
        if value < 1:
            raise InvalidArgument(name, f"must be >= 1, got {value}")
    if dtype not in DTYPE_NAMES:
        raise InvalidArgument("dtype", f"must be one of {', '.join(TORCH_DTYPES)}, got {dtype}")
    device = torch.device(device)
    nbytes = num_blocks * num_layers * 2 * block_size * num_kv_heads * head_dim * dtype.itemsize
    on_close = None
    if transport == "shm":
        if device.type != "cpu":
            raise InvalidArgument("transport", f"a shm pool lives on the CPU, not on {device}")
        shm = _create_shm(nbytes)
        tensor, memory = _shm_tensor(shm, nbytes)
        handle, device_index, on_close = shm.name.encode(), -1, shm.unlink
    elif transport == "cuda_ipc":
        if device.type != "cuda":
            raise InvalidArgument("transport", f"a cuda_ipc pool lives on a CUDA device, "
                                               f"not on {device}")
        device_index = device.index if device.index is not None else torch.cuda.current_device()
        tensor, memory, handle = _allocate_cuda(nbytes, device_index)
    elif transport == "nixl":
        from kvtransfer.nixl import allocate_nixl_pool  # noqa: PLC0415 - optional extra

        tensor, memory, handle, device_index, on_close = allocate_nixl_pool(nbytes, device)
    else:
        raise InvalidArgument("transport", f"must be shm, cuda_ipc or nixl, got {transport!r}")
    descriptor = PoolDescriptor(dtype=DTYPE_NAMES[dtype], transport=transport, handle=handle,
                                device_index=device_index, owner_pid=os.getpid(), **dims)
    tensor.zero_()  # as bytes, whatever the KV dtype
    tensor = tensor.view(dtype).view(descriptor.shape)
    if tensor.is_cuda:
        # A peer may read the pool as soon as it holds the descriptor: let the zeros land first.
        torch.cuda.synchronize(tensor.device)
    return LocalPool(tensor, descriptor, memory, on_close)


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
