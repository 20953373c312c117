"""A peer's pool over the nixl transport, as a decode worker holds it (`NixlRemotePool`, made by
kvtransfer/nixl.py's `NixlEndpoint.connect` from the pool's `NixlHandle`): the ids of a pull
checked against both pools, then one READ through the endpoint, waited for (`pull`) or not
(`start_pull`).
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from tandem.errors import InvalidArgument
from tandem.kvtransfer.descriptor import PoolDescriptor


@dataclass(eq=False)
class Transfer:
    """A posted NIXL transfer: its handle and last known state (PROC, DONE or ERR)."""

    op: str                 # READ | WRITE
    what: str               # for errors: "N blocks from <peer>"
    handle: Any
    state: str = "PROC"
    released: bool = False


class Endpoint(Protocol):
    """What a NixlRemotePool asks of the endpoint that connected it (kvtransfer/nixl.py's
    NixlEndpoint, which imports this module: the pool knows its endpoint by this shape only)."""

    def read(self, remote: NixlRemotePool, local: torch.Tensor, src_block_ids: Sequence[int],
             dst_block_ids: Sequence[int], deadline: float | None,
             cancel: threading.Event | None) -> None: ...

    def write(self, remote: NixlRemotePool, local: torch.Tensor, src_block_ids: Sequence[int],
              dst_block_ids: Sequence[int], deadline: float | None,
              cancel: threading.Event | None) -> None: ...

    def post(self, op: str, remote: NixlRemotePool, local: torch.Tensor,
             local_ids: Sequence[int], remote_ids: Sequence[int]) -> Transfer: ...

    def disconnect(self, remote: NixlRemotePool) -> None: ...


@dataclass(frozen=True)
class NixlHandle:
    """What a PoolDescriptor's handle holds for the nixl transport: the owner's agent name, the
    pool's base address in the owner's address space, and the agent's metadata (its
    connection info and the memory it registered; a capability: never logged)."""

    agent: str
    base: int
    metadata: bytes = field(repr=False)

    MAGIC = b"TNX1"
    _HEAD = struct.Struct("<4sQH")  # magic, base address, agent name length

    def pack(self) -> bytes:
        name = self.agent.encode()
        return self._HEAD.pack(self.MAGIC, self.base, len(name)) + name + self.metadata

    @classmethod
    def unpack(cls, data: bytes) -> NixlHandle:
        head = cls._HEAD.size
        if len(data) < head:
            raise InvalidArgument("handle", "is not a nixl pool handle")  # bytes withheld
        magic, base, n = cls._HEAD.unpack_from(data)
        if magic != cls.MAGIC or len(data) < head + n + 1:
            raise InvalidArgument("handle", "is not a nixl pool handle")
        return cls(data[head:head + n].decode(), base, data[head + n:])


class NixlRemotePool:
    """A peer's pool reached over NIXL: the peer's agent loaded, and the pool's base address
    in the peer's address space (transfers name its blocks from it). Nothing is mapped here;
    `pull` reads blocks into a local pool. close() releases what connect() made
    (idempotent)."""

    def __init__(self, endpoint: Endpoint, descriptor: PoolDescriptor, peer: str,
                 base: int) -> None:
        self.endpoint = endpoint
        self.descriptor = descriptor
        self.peer = peer
        self.base = base
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def pull(self, local: torch.Tensor, src_block_ids: Sequence[int],
             dst_block_ids: Sequence[int], *, deadline: float | None = None,
             cancel: threading.Event | None = None) -> None:
        """Read blocks `src_block_ids[i]` of the peer's pool into blocks `dst_block_ids[i]` of
        `local` (same layout; registered with this endpoint on first use). One READ; returns
        when it is done. Raises TransferFailed, TimeoutError (past `deadline`, a
        time.monotonic() value) or PullCancelled (`cancel` set), each only once nothing writes
        into the destination blocks any more."""
        if self._closed:
            raise RuntimeError("NixlRemotePool is closed")
        _check_ids(self.descriptor, local, src_block_ids, dst_block_ids)
        if src_block_ids:
            self.endpoint.read(self, local, src_block_ids, dst_block_ids, deadline, cancel)

    def start_pull(self, local: torch.Tensor, src_block_ids: Sequence[int],
                   dst_block_ids: Sequence[int]) -> Transfer:
        """`pull` without its wait: the READ posted (ids checked first, by name). The caller
        owns the Transfer: NixlEndpoint.poll until it is done, or abandon it; either releases
        it, and only then may the destination blocks be reused."""
        if self._closed:
            raise RuntimeError("NixlRemotePool is closed")
        _check_ids(self.descriptor, local, src_block_ids, dst_block_ids)
        return self.endpoint.post("READ", self, local, dst_block_ids, src_block_ids)

    def push(self, local: torch.Tensor, src_block_ids: Sequence[int],
             dst_block_ids: Sequence[int], *, deadline: float | None = None,
             cancel: threading.Event | None = None) -> None:
        """Write blocks `src_block_ids[i]` of `local` into blocks `dst_block_ids[i]` of the
        peer's pool (which the peer must have given for that: a capability, as for reads).
        One WRITE; returns when it is done; errors as `pull`'s."""
        if self._closed:
            raise RuntimeError("NixlRemotePool is closed")
        _check_ids(self.descriptor, local, dst_block_ids, src_block_ids,
                   names=("dst_block_ids", "src_block_ids"))
        if src_block_ids:
            self.endpoint.write(self, local, src_block_ids, dst_block_ids, deadline, cancel)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.endpoint.disconnect(self)

    def __enter__(self) -> NixlRemotePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"NixlRemotePool({self.descriptor.redacted()}, {state})"


def _check_ids(desc: PoolDescriptor, local: torch.Tensor, src_ids: Sequence[int],
               dst_ids: Sequence[int],
               names: tuple[str, str] = ("src_block_ids", "dst_block_ids")) -> None:
    """src_ids index the peer's pool, dst_ids `local` (a pull's names; a push's swapped)."""
    # Out-of-range ids would make NIXL read or write outside the registered pools: check here.
    dtype_bytes = local.element_size()
    if (tuple(local.shape[1:]) != desc.shape[1:]
            or local[0].numel() * dtype_bytes != desc.block_bytes):
        raise InvalidArgument("local", f"pool {local.dtype} {tuple(local.shape)} cannot take "
                                       f"blocks of {desc.dtype} {desc.shape}")
    remote_name, local_name = names
    if len(src_ids) != len(dst_ids):
        raise InvalidArgument("dst_block_ids", f"{len(dst_ids)} ids for {len(src_ids)} "
                                               "source blocks")
    for name, ids, limit in ((remote_name, src_ids, desc.num_blocks),
                             (local_name, dst_ids, local.shape[0])):
        if ids and (min(ids) < 0 or max(ids) >= limit):
            raise InvalidArgument(name, f"ids must be in [0, {limit}), got {min(ids)}..{max(ids)}")
    written = dst_ids if local_name == "dst_block_ids" else src_ids
    if len(set(written)) != len(written):
        raise InvalidArgument("dst_block_ids", "ids must be distinct")
