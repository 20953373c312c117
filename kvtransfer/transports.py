"""The KV transports: how a decode worker reaches a prefill worker's pool. One list.

Each transport is one module of kvtransfer/ with a `TRANSPORT` object (a `Transport`: allocate
a pool peers can map, open a peer's pool, pull blocks from it) and one `register(...)` line
below, which says what the CLI, the descriptor checks and tensor parallelism need to know
without importing it. Everything that names transports reads this list: `--transport`'s
choices and default (prefill_svc/server.py, also `tandem worker`), PoolDescriptor's checks,
which pools tensor-parallel ranks can copy heads out of (engine/tp_group.py), and the decode
core's pulls (engine/serving/kv_pulls.py), which only ever talk to a `Transport`.

    module              TRANSPORT
    kvtransfer/shm.py       ShmTransport      a shared-memory segment; CPU workers of one host
    kvtransfer/cuda_ipc.py  CudaIpcTransport  a CUDA IPC handle; GPUs of one host (cupy)
    kvtransfer/nixl.py      NixlTransport     NIXL over UCX; any host, CPU or GPU (nixl extra)
    kvtransfer/tcp.py       TcpTransport      a TCP stream the owner serves; CPU workers, any host

A transport that serves its pool itself (tcp) learns where its worker runs from a `WorkerSite`
(the worker's --host, its cluster TLS, the lease table's lookup), handed to every `allocate` and
`open`; a pull names its lease (`lease_id`), so such a server can refuse blocks outside it.

Plain Python, no torch: the CLI and the descriptor import this; a transport module is imported
on first use (`load`), and imports its own optional packages (cupy, nixl) only when it runs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tandem.errors import InvalidArgument


@dataclass(frozen=True)
class TransportEntry:
    """A transport as the rest of Tandem sees it before importing it."""

    name: str                  # --transport's value, PoolDescriptor.transport
    module: str                # holds TRANSPORT, imported on first use
    devices: tuple[str, ...]   # where its pools live: "cpu", "cuda"
    summary: str               # for --transport's help
    # Peers' pools are mapped here as tensors: a tensor-parallel decode worker copies each
    # rank's heads out of them (kvtransfer/tp_pull.py).
    maps_tensors: bool = True
    handle_bytes: int | None = None  # a handle's fixed length, when it has one


@dataclass(frozen=True)
class SiteTls:
    """A worker's cluster TLS (the CA, its certificate and key) as PEM bytes: read by the worker,
    since its engine core cannot open the worker's files (they may be the worker's /dev/fd/N)."""

    ca: bytes
    cert: bytes
    key: bytes = field(repr=False)

    @classmethod
    def read(cls, tls: Any) -> SiteTls:
        """From a runtime.security.ClusterTls (its ca, cert and key paths)."""
        return cls(tls.ca.read_bytes(), tls.cert.read_bytes(), tls.key.read_bytes())


@dataclass(frozen=True)
class WorkerSite:
    """Where a worker's engine runs, for a transport that listens or dials itself (tcp); the
    others ignore it. Built once by the engine core (engine/serving/engine_core.py)."""

    host: str = "127.0.0.1"  # the worker's --host: where its own listeners bind
    tls: SiteTls | None = None  # its cluster TLS, or None (plain TCP)
    # Owner side: the blocks of a live lease of this worker's (None once released, expired or
    # never granted). Called from a transport's own threads: a read of the lease table, no
    # more.
    lease_blocks: Callable[[str], Sequence[int] | None] | None = None


_REGISTRY: dict[str, TransportEntry] = {}


def register(entry: TransportEntry) -> None:
    if entry.name in _REGISTRY:
        raise ValueError(f"transport {entry.name!r} is registered twice")
    _REGISTRY[entry.name] = entry


# -- the transports, one line each (a CLI default is the first that serves the device) ----------
register(TransportEntry("shm", "tandem.kvtransfer.shm", ("cpu",), "a shared-memory segment, CPU "
                        "workers of one host"))
register(TransportEntry("cuda_ipc", "tandem.kvtransfer.cuda_ipc", ("cuda",), "a CUDA IPC handle, GPUs "
                        "of one host (needs cupy)", handle_bytes=64))
register(TransportEntry("nixl", "tandem.kvtransfer.nixl", ("cpu", "cuda"), "NIXL over UCX, from other "
                        "hosts too (needs the nixl extra)", maps_tensors=False))
register(TransportEntry("tcp", "tandem.kvtransfer.tcp", ("cpu",), "a TCP stream the prefill "
                        "worker serves, CPU workers on any host (no extra)", maps_tensors=False))


def names() -> tuple[str, ...]:
    """Every transport's name, in registration order."""
    return tuple(_REGISTRY)


def entry(name: str) -> TransportEntry:
    """The transport called `name`, or InvalidArgument naming the field `transport`."""
    found = _REGISTRY.get(name)
    if found is None:
        raise InvalidArgument("transport", f"must be one of {', '.join(_REGISTRY)}, "
                                           f"got {name!r}")
    return found


def default_for(device: str) -> str:
    """The transport a prefill worker on `device` ("cpu", "cuda", "cuda:1") uses unless told."""
    kind = device.split(":")[0]
    return next(e.name for e in _REGISTRY.values() if kind in e.devices)


def describe() -> str:
    """The transports for --transport's help: each with its summary, and the defaults."""
    each = "; ".join(f"{e.name}: {e.summary}" for e in _REGISTRY.values())
    return f"{each} (default: {default_for('cpu')} on cpu, {default_for('cuda')} on cuda)"


def tensor_transports() -> tuple[str, ...]:
    """The transports whose pools map as tensors (tensor parallelism moves heads over them)."""
    return tuple(e.name for e in _REGISTRY.values() if e.maps_tensors)


def map_device(name: str, local_device: Any) -> Any:
    """Where a decode worker whose pool is on `local_device` opens a peer's pool of this
    transport: the CPU for a transport of CPU pools only, else its own device."""
    return "cpu" if entry(name).devices == ("cpu",) else local_device


def check_placement(name: str, handle: bytes, device_index: int) -> None:
    """A descriptor's handle and device index, checked against its transport (device_index
    -1 means the CPU). Messages describe the handle's length, never its bytes."""
    e = entry(name)
    if e.handle_bytes is not None and len(handle) != e.handle_bytes:
        raise InvalidArgument("handle", f"a {name} handle is {e.handle_bytes} bytes, "
                                        f"got {len(handle)}")
    if e.devices == ("cpu",) and device_index != -1:
        raise InvalidArgument("device_index", f"a {name} pool is on the CPU (-1), "
                                              f"got {device_index}")
    if e.devices == ("cuda",) and device_index < 0:
        raise InvalidArgument("device_index", f"a {name} pool lives on a CUDA device, "
                                              f"got {device_index}")
    if device_index < -1:
        raise InvalidArgument("device_index", f"a {name} pool is in host memory (-1) or on "
                                              f"a CUDA device, got {device_index}")


def load(name: str) -> Transport:
    """The transport's TRANSPORT object (its module imported on first use)."""
    return importlib.import_module(entry(name).module).TRANSPORT


# -- what a transport module provides ----------------------------------------------------------
class Transfer(Protocol):
    """A pull a transport started (`Puller.start`). It ends once: done, or failed
    (done() raises), and only then may its destination blocks be reused or its lease go."""

    # The engine waits for it, its request unscheduled, while other requests step (NIXL);
    # else it is in place, or ordered before the engine's next step on the device, at start.
    outside_stream: bool

    def done(self) -> bool:
        """Whether it ended, without waiting; raises its error if it failed."""

    def wait(self) -> None:
        """Block until it ended (done() tells how)."""

    def cancel(self) -> None:
        """Its request ended first: stop it; returns once nothing writes the blocks."""

    def stats(self) -> Any:
        """Once ended: a kvtransfer.remote.TransferStats (bytes 0 if it failed)."""


class Transport(Protocol):
    """The worker side of one transport (its module's TRANSPORT)."""

    name: str

    def allocate(self, nbytes: int, device: Any, block_bytes: int, site: WorkerSite) -> Any:
        """A zeroed shareable allocation of `nbytes` (whole blocks of `block_bytes`) on
        `device`: a kvtransfer.pool.Allocation (InvalidArgument naming `transport` if it
        cannot live there). Its on_close stops whatever serves it."""

    def open(self, desc: Any, device: Any, site: WorkerSite) -> Any:
        """A peer's pool (PoolDescriptor) as this process reaches it, on `device`: a
        kvtransfer.pool.RemotePool, or what the transport reads through; close() gives it up."""

    def pull(self, remote: Any, local: Any, src_block_ids: Any, dst_block_ids: Any,
             deadline: float | None, lease_id: str) -> Any:
        """Copy blocks src_block_ids[i] (of lease `lease_id`) of `remote` into
        dst_block_ids[i] of `local` and wait: TransferStats. Past `deadline`
        (time.monotonic()), TimeoutError."""

    def puller(self, local: Any) -> Puller:
        """The decode core's pulls into its pool `local`."""


class Puller(Protocol):
    def start(self, remote: Any, src_block_ids: list[int], dst_block_ids: list[int],
              deadline: Callable[[], float], lease_id: str) -> Transfer:
        """The decode core's pull of blocks of lease `lease_id`: started, not waited for.
        `deadline()` is the lease's deadline as of now (renewals move it)."""
