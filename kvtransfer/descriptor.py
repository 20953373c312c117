"""What a worker tells a peer about its KV pool: layout, transport, and the handle to map it.

A decode worker asks each prefill worker for its PoolDescriptor once, refuses it when the layout
differs from its own (`check_compatible`), and maps it with `tandem.kvtransfer.remote.open_remote_pool`.

The handle is a capability: whoever holds it can read and write the whole pool. It never appears
in a repr, a log line or an exception; log `redacted()` instead.

Plain Python: no torch import, so the router and the tests can use it anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from tandem.errors import InvalidArgument, LayoutMismatch
from tandem.kvtransfer import transports

# Bytes per element of each dtype Tandem stores KV in: the model dtypes (engine.config.DTYPES)
# and e4m3 (--kv-cache-dtype fp8; its scales are static, the same on every worker, so FP8
# pages move unchanged like any other).
DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}

# The fields two pools must share to exchange blocks, in the order they are checked.
# num_blocks may differ: each side addresses only its own block ids.
LAYOUT_FIELDS = ("dtype", "block_size", "num_layers", "num_kv_heads", "head_dim")
# What to change when a field differs: the flags that set it, the same on both workers.
LAYOUT_HINTS = {
    "dtype": "start the prefill and decode workers with the same --kv-cache-dtype (and, with "
             "--kv-cache-dtype auto, the same --dtype)",
    "block_size": "start both workers with the same --block-size",
}


@dataclass(frozen=True)
class PoolDescriptor:
    """A worker's KV pool: one block-major tensor

        [num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]

    starting at the base of the shared allocation the handle names (offset 0, so no offset
    field). `handle` is the shared-memory segment name (UTF-8) for "shm", the 64-byte
    cudaIpcMemHandle for "cuda_ipc", the owner's NIXL agent metadata and pool address for
    "nixl" (kvtransfer.nixl.NixlHandle). `device_index` is -1 for a CPU pool, else the CUDA device
    the pool lives on as its owner numbers it. `owner_pid` is the owning process, for
    diagnostics and for refusing to map one's own pool over IPC.
    """

    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int
    transport: str
    handle: bytes = field(repr=False)
    device_index: int
    owner_pid: int
    # Tensor parallelism (0 in all three: one rank, num_kv_heads is the model's): this pool
    # holds rank tensor_parallel_rank's num_kv_heads of the model's model_kv_heads
    # (engine.parallel.rank_heads).
    model_kv_heads: int = 0
    tensor_parallel_size: int = 0
    tensor_parallel_rank: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise InvalidArgument("dtype", f"must be one of {', '.join(DTYPE_SIZES)}, "
                                           f"got {self.dtype!r}")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim", "num_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidArgument(name, f"must be a positive int, got {value!r}")
        transports.entry(self.transport)  # a registered transport, or named as the field
        # Messages below describe the handle's type and length, never its bytes.
        if not isinstance(self.handle, bytes) or not self.handle:
            raise InvalidArgument("handle", "must be non-empty bytes")
        transports.check_placement(self.transport, self.handle, self.device_index)

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        """The pool tensor's shape."""
        return (self.num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads,
                self.head_dim)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: all layers, K and V; the unit a transfer moves."""
        return (self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim
                * DTYPE_SIZES[self.dtype])

    @property
    def pool_bytes(self) -> int:
        """Bytes of the whole pool (the size of the shared allocation)."""
        return self.num_blocks * self.block_bytes

    @property
    def shm_name(self) -> str:
        """The shared-memory segment name of a "shm" pool. Part of the capability: don't log."""
        if self.transport != "shm":
            raise ValueError(f"a {self.transport} pool has no shared-memory name")
        return self.handle.decode()

    def redacted(self) -> dict[str, Any]:
        """Every field but the handle, for logs and traces."""
        return {
            "dtype": self.dtype,
            "block_size": self.block_size,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "num_blocks": self.num_blocks,
            "transport": self.transport,
            "device_index": self.device_index,
            "owner_pid": self.owner_pid,
            "model_kv_heads": self.model_kv_heads,
            "tensor_parallel_size": self.tensor_parallel_size,
            "tensor_parallel_rank": self.tensor_parallel_rank,
        }


class PoolLayout(Protocol):
    """What check_compatible reads: a PoolDescriptor, or anything with these fields (a decode
    worker's layout, sent without a handle)."""

    @property
    def dtype(self) -> str: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...


def model_kv_heads(layout: PoolLayout) -> int:
    """The model's KV heads (a tensor-parallel rank's pool holds some of them)."""
    return getattr(layout, "model_kv_heads", 0) or layout.num_kv_heads


def tp_size(layout: PoolLayout) -> int:
    return getattr(layout, "tensor_parallel_size", 0) or 1


def check_compatible(local: PoolLayout, remote: PoolLayout) -> None:
    """Raise LayoutMismatch naming the first of LAYOUT_FIELDS where the pools differ.

    Blocks of two pools that pass can be copied byte for byte: each is `block_bytes` with the
    same [layers, K/V, tokens, heads, head_dim] layout. Between tensor-parallel workers the
    model's KV heads must agree and one TP size divide the other; each decode rank then copies
    its heads from the prefill ranks holding them (kvtransfer/tp_pull.py).
    """
    for name in LAYOUT_FIELDS:
        mine, theirs = getattr(local, name), getattr(remote, name)
        if name == "num_kv_heads":
            mine, theirs = model_kv_heads(local), model_kv_heads(remote)
        if mine != theirs:
            raise LayoutMismatch(name, mine, theirs,
                                 LAYOUT_HINTS.get(name, "serve the same --model on both workers"))
    a, b = tp_size(local), tp_size(remote)
    if a % b and b % a:
        raise LayoutMismatch("tensor_parallel_size", a, b,
                             "use tensor-parallel sizes where one divides the other")
