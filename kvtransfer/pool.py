"""A worker's own KV pool, allocated so that peers can map it.

    pool: [num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]

One tensor, block-major: block b (all layers, K and V) is the contiguous chunk `pool[b]`,
`descriptor.block_bytes` long. The pool is the whole shared allocation from offset 0, so a peer
maps it from the descriptor alone. The memory comes from the transport (kvtransfer/transports.py
lists them: a shared-memory segment, a cudaMalloc'd allocation with a CUDA IPC handle, a tensor
registered with NIXL), as an `Allocation`.

Lifetime: `close()` gives up the pool object's reference, and what the transport must undo at
once is undone (a shared-memory name removed: nothing stays in /dev/shm). The memory, or this
process's mapping of a peer's memory, is released when no tensor view of it is left, so a view
kept past close() never dangles. `mapped` says whether that has happened.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import NamedTuple, Self

import torch

from tandem.errors import InvalidArgument
from tandem.kvtransfer import transports
from tandem.kvtransfer.descriptor import PoolDescriptor

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
               torch.float8_e4m3fn: "float8_e4m3fn"}
TORCH_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


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


class RemotePool(MappedPool):
    """A peer's pool mapped here; `tensor` lives on the device it was opened on (for cuda_ipc
    that may be peer memory). Opened once per peer and kept; close() unmaps it once no tensor
    view is left. Never unlinks or frees the peer's memory."""


class Allocation(NamedTuple):
    """What a transport allocates for a pool: `nbytes` of uint8 memory peers can reach."""

    tensor: torch.Tensor         # 1-d uint8, the whole allocation
    memory: weakref.finalize     # alive while the memory is held (see MappedPool.mapped)
    handle: bytes                # the descriptor's handle: a capability
    device_index: int            # -1 on the CPU
    on_close: Callable[[], None] | None = None  # undone at close() (a name unlinked...)


def allocate_pool(*, num_blocks: int, num_layers: int, block_size: int, num_kv_heads: int,
                  head_dim: int, dtype: torch.dtype, device: torch.device | str,
                  transport: str, site: transports.WorkerSite | None = None) -> LocalPool:
    """Allocate a zeroed KV pool that peers can map, over one of kvtransfer/transports.py's
    transports (each says where its pools may live); `site`: where this worker runs (default:
    loopback, no TLS, no leases)."""
    dims = {"num_blocks": num_blocks, "num_layers": num_layers, "block_size": block_size,
            "num_kv_heads": num_kv_heads, "head_dim": head_dim}
    for name, value in dims.items():
        if value < 1:
            raise InvalidArgument(name, f"must be >= 1, got {value}")
    if dtype not in DTYPE_NAMES:
        raise InvalidArgument("dtype", f"must be one of {', '.join(TORCH_DTYPES)}, got {dtype}")
    device = torch.device(device)
    block_bytes = num_layers * 2 * block_size * num_kv_heads * head_dim * dtype.itemsize
    tensor, memory, handle, device_index, on_close = transports.load(transport).allocate(
        num_blocks * block_bytes, device, block_bytes, site or transports.WorkerSite())
    descriptor = PoolDescriptor(dtype=DTYPE_NAMES[dtype], transport=transport, handle=handle,
                                device_index=device_index, owner_pid=os.getpid(), **dims)
    tensor.zero_()  # as bytes, whatever the KV dtype
    tensor = tensor.view(dtype).view(descriptor.shape)
    if tensor.is_cuda:
        # A peer may read the pool as soon as it holds the descriptor: let the zeros land first.
        torch.cuda.synchronize(tensor.device)
    return LocalPool(tensor, descriptor, memory, on_close)
