"""The "nixl" transport (`TRANSPORT`): KV blocks between hosts over NVIDIA NIXL (UCX underneath: RDMA,
NVLink/cuda_ipc, TCP, shared memory; UCX picks what the two ends share).

Each worker process has one NIXL agent (`default_endpoint()`, an `NixlEndpoint`). A prefill
worker registers its pool (DRAM or VRAM) with it and hands out, as the descriptor's handle, the
agent's metadata and the pool's base address (`NixlHandle`); the handle travels over the
existing gRPC Register call, never over a side channel of NIXL's own (no listener thread). A
decode worker loads that metadata once (`connect` -> NixlRemotePool, in nixl_remote.py),
registers its own pool on first use, and moves each request's KV with one NIXL READ:

    prefill pool (remote, registered)         decode pool (local, registered)
    [ 0 | 1 | 2 | 3 | 4 | 5 | ... ]           [ 0 | 1 | 2 | 3 | 4 | 5 | ... ]
          ^^^^^^^^^       ^                     ^^^^^^^^^           ^
    one descriptor per run of blocks adjacent on both sides (kvtransfer/runs.py; a block is
    all layers, K and V: block_bytes, contiguous), made for each transfer: UCX moves each
    descriptor as one copy (over cuda_ipc, one cudaMemcpyAsync), so a prompt whose blocks
    form a few runs moves at the rate of one large copy.

A pull (or a posted transfer, polled) ends done (the blocks are in place, the lease may be
released), or failed, timed out or cancelled, and then only once NIXL no longer writes into the
destination blocks (an active transfer is cancelled; one that cannot be is waited for), so the
caller may free them. Every transfer handle is released exactly once. NIXL is an optional
dependency (the `nixl` extra), imported on first use. UCX is configured by its environment:
UCX_NET_DEVICES (mlx5_0:1 for RDMA, eth0 for TCP, lo in the tests), UCX_TLS.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tandem.errors import InvalidArgument
from tandem.kvtransfer.descriptor import PoolDescriptor
from tandem.kvtransfer.nixl_remote import NixlHandle, NixlRemotePool, Transfer
from tandem.kvtransfer.pool import Allocation
from tandem.kvtransfer.remote import Finished, TransferStats
from tandem.kvtransfer.runs import block_runs

EXTRA = "nixl"
INSTALL_HINT = f"pip install 'tandem[{EXTRA}]'"

# Waiting for a transfer: poll without sleeping for SPIN_S (a 2k-token prompt over NVLink
# takes ~0.4-1.2 ms; a sleep, ~60 us at least on Linux, and a doubling backoff made such
# transfers look up to twice as long), then back off up to MAX_POLL_S, which keeps a long
# wait (a transfer over TCP) cheap.
SPIN_S = 2e-3
MAX_POLL_S = 1e-3


class NixlUnavailable(RuntimeError):
    """The nixl package is not installed (or cannot load)."""


class TransferFailed(RuntimeError):
    """NIXL reported an error for a transfer (the peer is gone, unreachable, or refused)."""


class PullCancelled(RuntimeError):
    """A pull was cancelled by its caller before it completed."""


def load_nixl() -> Any:
    """The nixl._api module, or NixlUnavailable naming the extra to install."""
    try:
        from nixl import _api  # noqa: PLC0415 - optional dependency, loaded on first use
    except ImportError as e:
        raise NixlUnavailable(f"the nixl transport needs the NIXL package, which cannot be "
                              f"imported ({e}): {INSTALL_HINT}") from e
    # NIXL's Python logger prints plain text to stdout by a handler of its own; its records go
    # through this process's logging instead (one JSON line per event, like every other).
    nixl_log = logging.getLogger("nixl")
    nixl_log.handlers.clear()
    nixl_log.propagate = True
    return _api


def _run_rows(base: int, block_bytes: int, starts: Sequence[int], lengths: Sequence[int],
              device_id: int) -> np.ndarray:
    """NIXL descriptors (address, length, device id), one per run of blocks."""
    rows = np.empty((len(starts), 3), dtype=np.int64)
    rows[:, 0] = base + np.asarray(starts, dtype=np.int64) * block_bytes
    rows[:, 1] = np.asarray(lengths, dtype=np.int64) * block_bytes
    rows[:, 2] = device_id
    return rows


def _mem(tensor: torch.Tensor) -> tuple[str, int]:
    """NIXL memory type and device id of a tensor."""
    if tensor.is_cuda:
        return "VRAM", tensor.device.index if tensor.device.index is not None else 0
    return "DRAM", 0


@dataclass(eq=False)
class _Region:
    """A pool tensor registered with the agent."""

    tensor: torch.Tensor
    reg: Any                # nixlRegDList, for deregister_memory


class NixlEndpoint:
    """One NIXL agent (UCX backend) and what it has registered and loaded. Thread-safe: calls
    into the agent are serialized by one lock. With `progress_thread`, NIXL's own thread
    progresses UCX (needed to serve reads over TCP); without, the polls of a transfer's wait
    do (a reader's)."""

    def __init__(self, name: str | None = None, agent: Any = None,
                 progress_thread: bool = True) -> None:
        self.name = name or f"tandem-{socket.gethostname()}-{os.getpid()}-{os.urandom(4).hex()}"
        if agent is None:
            api = load_nixl()
            agent = api.nixl_agent(self.name, api.nixl_agent_config(
                enable_prog_thread=progress_thread, backends=["UCX"]))
        self.agent = agent
        self.progress_thread = progress_thread  # NIXL's own (see default_endpoint)
        self._lock = threading.RLock()
        self._regions: dict[tuple[int, int, str], _Region] = {}
        self._peers: dict[str, int] = {}  # remote agent name -> open NixlRemotePools
        self.leaked_handles = 0  # transfer handles NIXL refused to release (see _release)
        self._closed = False

    # -- local memory ------------------------------------------------------------------------
    def register(self, pool: torch.Tensor) -> _Region:
        """Register a contiguous pool tensor's memory (idempotent). The endpoint keeps the
        tensor alive until `deregister`."""
        if not pool.is_contiguous():
            raise InvalidArgument("pool", "must be a contiguous tensor")
        key = (pool.data_ptr(), pool.numel() * pool.element_size(), str(pool.device))
        with self._lock:
            self._check_open()
            region = self._regions.get(key)
            if region is None:
                mem, dev = _mem(pool)
                reg = self.agent.register_memory([(pool.data_ptr(), key[1], dev, "")], mem)
                region = self._regions[key] = _Region(pool, reg)
            return region

    def deregister(self, pool: torch.Tensor) -> None:
        """Undo `register` (idempotent). Peers reading it from now on get an error."""
        key = (pool.data_ptr(), pool.numel() * pool.element_size(), str(pool.device))
        with self._lock:
            region = self._regions.pop(key, None)
            if region is not None and not self._closed:
                self.agent.deregister_memory(region.reg)

    def export(self, pool: torch.Tensor) -> bytes:
        """Register `pool` and return the handle a peer needs to read it (a capability)."""
        self.register(pool)
        with self._lock:
            metadata = self.agent.get_agent_metadata()
        return NixlHandle(self.name, pool.data_ptr(), metadata).pack()

    # -- peers -------------------------------------------------------------------------------
    def connect(self, desc: PoolDescriptor) -> NixlRemotePool:
        """Load a peer's agent metadata, once per open NixlRemotePool. Errors name the
        descriptor's redacted fields, never its handle."""
        if desc.transport != "nixl":
            raise InvalidArgument("transport", f"expected a nixl pool, got {desc.transport!r}")
        handle = NixlHandle.unpack(desc.handle)
        with self._lock:
            self._check_open()
            try:
                name = self.agent.add_remote_agent(handle.metadata)
            except Exception as e:  # noqa: BLE001 - its text may quote the metadata
                raise TransferFailed(f"cannot load the NIXL metadata of pool "
                                     f"{desc.redacted()}: {type(e).__name__}") from None
            name = name.decode() if isinstance(name, bytes) else name
            self._peers[name] = self._peers.get(name, 0) + 1
        return NixlRemotePool(self, desc, name, handle.base)

    def disconnect(self, remote: NixlRemotePool) -> None:
        """Release what `connect` made for `remote` (its close() calls this, once)."""
        self._drop_peer(remote.peer)

    def _drop_peer(self, name: str) -> None:
        with self._lock:
            left = self._peers.get(name, 0) - 1
            if left > 0:
                self._peers[name] = left
                return
            self._peers.pop(name, None)
            if not self._closed:
                with contextlib.suppress(Exception):  # already gone: nothing left to drop
                    self.agent.remove_remote_agent(name)

    # -- transfers ---------------------------------------------------------------------------
    def read(self, remote: NixlRemotePool, local: torch.Tensor, src_block_ids: Sequence[int],
             dst_block_ids: Sequence[int], deadline: float | None,
             cancel: threading.Event | None) -> None:
        """Blocks src_block_ids of the peer's pool into dst_block_ids of `local`."""
        self.complete(self.post("READ", remote, local, dst_block_ids, src_block_ids), deadline,
                      cancel)

    def write(self, remote: NixlRemotePool, local: torch.Tensor, src_block_ids: Sequence[int],
              dst_block_ids: Sequence[int], deadline: float | None,
              cancel: threading.Event | None) -> None:
        """Blocks src_block_ids of `local` into dst_block_ids of the peer's pool (a push: on
        one host UCX's cuda_ipc may serve a remote write faster than a remote read)."""
        self.complete(self.post("WRITE", remote, local, src_block_ids, dst_block_ids), deadline,
                      cancel)

    def post(self, op: str, remote: NixlRemotePool, local: torch.Tensor,
             local_ids: Sequence[int], remote_ids: Sequence[int]) -> Transfer:
        """Start one transfer (READ: the peer's blocks remote_ids[i] into local_ids[i] of
        `local`, registered here on first use; WRITE: the other way), one descriptor per run
        of blocks adjacent on both sides. Every Transfer posted ends in `complete`, `poll`
        returning True or raising, or `abandon`."""
        what = f"{len(local_ids)} blocks {'from' if op == 'READ' else 'to'} {remote.peer}"
        runs = block_runs(local_ids, remote_ids)
        assert runs is not None  # no limit
        local_starts, remote_starts, lengths = zip(*runs, strict=True)
        mem, dev = _mem(local)
        desc = remote.descriptor
        remote_mem = "DRAM" if desc.device_index < 0 else "VRAM"
        local_rows = _run_rows(local.data_ptr(), desc.block_bytes, local_starts, lengths, dev)
        remote_rows = _run_rows(remote.base, desc.block_bytes, remote_starts, lengths,
                                max(desc.device_index, 0))
        with self._lock:
            self._check_open()
            self.register(local)
            try:
                handle = self.agent.initialize_xfer(
                    op, self.agent.get_xfer_descs(local_rows, mem),
                    self.agent.get_xfer_descs(remote_rows, remote_mem), remote.peer)
            except Exception as e:  # NIXL's own errors (peer gone, no backend)
                raise TransferFailed(f"NIXL cannot {op.lower()} {what}: {e}") from e
            transfer = Transfer(op, what, handle)
            try:
                transfer.state = self.agent.transfer(handle)
            except Exception as e:
                self.abandon(transfer)
                raise TransferFailed(f"NIXL cannot {op.lower()} {what}: {e}") from e
        return transfer

    def poll(self, transfer: Transfer) -> bool:
        """Whether a posted transfer is over, without waiting: once it is, `complete` (its
        handle released; TransferFailed if it failed)."""
        if transfer.state == "PROC":
            transfer.state = self._state(transfer.handle)
        if transfer.state == "PROC":
            return False
        self.complete(transfer, None, None)
        return True

    def complete(self, transfer: Transfer, deadline: float | None,
                 cancel: threading.Event | None) -> None:
        """Wait for a posted transfer and release its handle (once, whatever happens). Raises
        TransferFailed, TimeoutError or PullCancelled, each only once NIXL no longer writes
        into the transfer's destination."""
        try:
            if transfer.state == "PROC":
                transfer.state = self._wait(transfer.handle, deadline, cancel)
            if transfer.state != "DONE":
                raise TransferFailed(f"NIXL failed to {transfer.op.lower()} {transfer.what}")
        finally:
            self.abandon(transfer)

    def abandon(self, transfer: Transfer) -> None:
        """Release a posted transfer (once; idempotent): NIXL cancels it if still active, or it
        is waited for until nothing writes into its destination."""
        if not transfer.released:
            transfer.released = True
            self._release(transfer.handle)

    def _state(self, handle: Any) -> str:
        with self._lock:
            return self.agent.check_xfer_state(handle)

    def _wait(self, handle: Any, deadline: float | None, cancel: threading.Event | None) -> str:
        spin_until = time.monotonic() + SPIN_S
        delay = 0.0
        while (state := self._state(handle)) == "PROC":
            if cancel is not None and cancel.is_set():
                raise PullCancelled("the KV pull was cancelled")
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise TimeoutError("the KV pull did not complete before the lease's deadline")
            if now < spin_until:
                time.sleep(0)  # lets other threads run (the GIL), no timer
                continue
            delay = min(max(delay * 2, 5e-5), MAX_POLL_S)
            if cancel is not None:
                cancel.wait(delay)
            else:
                time.sleep(delay)
        return state

    def _release(self, handle: Any) -> None:
        """Release a transfer handle; NIXL cancels it if still active. When it cannot (it
        refuses the release), wait until the transfer is no longer in flight, then release:
        the caller frees the destination blocks after this returns. That wait has no deadline
        on purpose (a late write into reused blocks would corrupt another request); UCX ends a
        transfer whose peer is gone with an error of its own (its keepalive and timeouts)."""
        refused = 0
        while True:
            try:
                with self._lock:
                    self.agent.release_xfer_handle(handle)
                return
            except Exception:  # noqa: BLE001 - NIXL: "cannot cancel now", or a bad handle
                refused += 1
            try:
                state = self._state(handle)
            except Exception:  # noqa: BLE001 - a handle NIXL no longer knows is not in flight
                state = "ERR"
            if state != "PROC" and refused > 1:
                # Not in flight, and refused twice: NIXL keeps it (its agent re-releases such
                # handles when it is destroyed); nothing writes into the blocks any more.
                self.leaked_handles += 1
                return
            time.sleep(MAX_POLL_S if state == "PROC" else 0)

    # -- lifetime ----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the NIXL endpoint is closed")

    @property
    def num_registered(self) -> int:
        return len(self._regions)

    @property
    def num_peers(self) -> int:
        return len(self._peers)

    def close(self) -> None:
        """Deregister everything and drop every peer (idempotent)."""
        with self._lock:
            if self._closed:
                return
            for region in list(self._regions.values()):
                self.deregister(region.tensor)
            for name in list(self._peers):
                self._peers[name] = 1
                self._drop_peer(name)
            self._closed = True


# -- the process's endpoint --------------------------------------------------------------------
_default: NixlEndpoint | None = None
_default_lock = threading.Lock()


def default_endpoint(serves: bool = True) -> NixlEndpoint:
    """This process's endpoint, made on first use (one NIXL agent per process). A process
    that serves a pool (a prefill worker) runs NIXL's progress thread: a peer's READ over a
    transport without one-sided access in hardware (TCP) needs this side to make progress.
    A process made to read only (`serves=False`: a decode worker) runs none: its own polls
    drive UCX, and NIXL's thread, which wakes on a timer of at least 1 ms, added 0.2-0.4 ms
    to each ~0.7 ms pull over NVLink (BENCHMARKS.md "Over NIXL")."""
    global _default
    with _default_lock:
        if _default is None or _default._closed:
            _default = NixlEndpoint(progress_thread=serves)
        elif serves and not _default.progress_thread:
            raise RuntimeError("this process's NIXL endpoint was made to read only (no "
                               "progress thread), so it cannot serve a pool: allocate the "
                               "pool before opening a peer's")
        return _default


def allocate_nixl_pool(nbytes: int, device: torch.device,
                       endpoint: NixlEndpoint | None = None,
                       ) -> tuple[torch.Tensor, weakref.finalize, bytes, int, Any]:
    """A zeroed uint8 pool of `nbytes` on `device` (CPU: DRAM, CUDA: VRAM) registered with
    `endpoint` (default: the process's): (tensor, finalizer observing its memory, handle,
    device index for the descriptor, on_close which deregisters it)."""
    endpoint = endpoint or default_endpoint(serves=True)
    tensor = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    handle = endpoint.export(tensor)
    device_index = -1 if device.type == "cpu" else tensor.device.index
    memory = weakref.finalize(tensor, lambda: None)  # views hold it as their base
    memory.atexit = False

    def on_close() -> None:
        endpoint.deregister(tensor)

    return tensor, memory, handle, device_index, on_close


# -- the transport -----------------------------------------------------------------------------
class NixlTransport:
    name = "nixl"

    def allocate(self, nbytes: int, device: torch.device, block_bytes: int = 0,
                 site: object = None) -> Allocation:
        return Allocation(*allocate_nixl_pool(nbytes, device))

    def open(self, desc: PoolDescriptor, device: Any, site: object = None) -> NixlRemotePool:
        """Nothing to map: reads go through this process's endpoint, made to read only."""
        return default_endpoint(serves=False).connect(desc)

    def pull(self, remote: NixlRemotePool, local: torch.Tensor, src_block_ids: Sequence[int],
             dst_block_ids: Sequence[int], deadline: float | None = None,
             lease_id: str = "") -> TransferStats:
        """One READ, waited for; past `deadline` cancelled and TimeoutError raised."""
        n = len(src_block_ids)
        start = time.perf_counter()
        remote.pull(local, src_block_ids, dst_block_ids, deadline=deadline)
        return TransferStats(num_blocks=n, bytes=n * remote.descriptor.block_bytes,
                             seconds=time.perf_counter() - start if n else 0.0)

    def puller(self, local: torch.Tensor) -> NixlPuller:
        return NixlPuller(local)


TRANSPORT = NixlTransport()

# NIXL READs in flight share the link: posted all at once on a slow one, each takes as long as
# all of them, and every one outlives its lease (2x H100, UCX over TCP at 0.4 GB/s: 247 of 300
# requests failed). So a decode core's pulls are posted oldest first while the bytes in flight
# would move in INFLIGHT_S at the rate the last pulls moved (at least INFLIGHT_MIN bytes, and
# always one pull); the others wait, their leases renewed by the worker meanwhile.
INFLIGHT_S = 1.0
INFLIGHT_MIN = 256 << 20


class NixlPuller:
    """A decode core's pulls over NIXL into `local`: the pulls not ended, oldest first, and the
    rate the last ones moved at (bytes a second, posting to seen done; a running average)."""

    def __init__(self, local: torch.Tensor) -> None:
        self.local = local
        self.queue: list[NixlPull] = []
        self.rate: float | None = None

    def start(self, remote: NixlRemotePool, src_block_ids: list[int],
              dst_block_ids: list[int], deadline: Any, lease_id: str = "",
              ) -> NixlPull | Finished:
        """A pull to poll (its READ posted by a later poll), or, with nothing to move, one
        that is over."""
        if not src_block_ids:
            return Finished(TransferStats(0, 0, 0.0))
        pull = NixlPull(self, remote, src_block_ids, dst_block_ids, deadline)
        self.queue.append(pull)
        return pull


class NixlPull:
    """A pull over NIXL, a Transfer that completes outside the engine's stream (the engine
    polls it between steps, its sequence unscheduled): its READ is posted once the engine's
    stream has passed the pull's making (a step in flight may still write blocks freed since)
    and the older pulls are posted, within the bytes in flight the link allows; it ends once
    (done, failed, past `deadline()`, or cancelled because its request ended)."""

    outside_stream = True

    def __init__(self, puller: NixlPuller, pool: NixlRemotePool, src_block_ids: list[int],
                 dst_block_ids: list[int], deadline: Any) -> None:
        self.puller, self.pool, self.deadline = puller, pool, deadline
        self.src, self.dst = src_block_ids, dst_block_ids
        self.local = puller.local
        self.gate: Any = None  # CUDA: an event after the work the stream holds now
        if self.local.is_cuda:
            with torch.cuda.device(self.local.device):
                self.gate = torch.cuda.Event()
                self.gate.record()
        self.transfer: Transfer | None = None
        self.posted = 0.0
        self.seconds = 0.0
        self.ended = False
        self.error: Exception | None = None

    def done(self) -> bool:
        if self.ended:
            if self.error is not None:
                raise self.error
            return True
        try:
            if self.transfer is None:
                if (self.gate is not None and not self.gate.query()) or not self.may_post():
                    return self._in_time()
                self.posted = time.perf_counter()
                self.transfer = self.pool.start_pull(self.local, self.src, self.dst)
            if not self.pool.endpoint.poll(self.transfer):
                return self._in_time()
        except Exception as e:
            self._end(e)
            raise
        self._end(None)
        return True

    def wait(self) -> None:
        while not self.done():
            time.sleep(MAX_POLL_S)

    @property
    def nbytes(self) -> int:
        return len(self.src) * self.pool.descriptor.block_bytes

    def may_post(self) -> bool:
        """Every older pull posted, and this one's bytes within what may be in flight (or
        nothing in flight)."""
        in_flight = 0
        for pull in self.puller.queue:
            if pull is self:
                break
            if pull.transfer is None:
                return False
            in_flight += pull.nbytes
        rate = self.puller.rate
        cap = max(INFLIGHT_MIN, rate * INFLIGHT_S if rate is not None else 0)
        return in_flight == 0 or in_flight + self.nbytes <= cap

    def cancel(self) -> None:
        if not self.ended:
            self._end(RuntimeError("the request ended before its KV arrived"))

    def stats(self) -> TransferStats:
        return TransferStats(len(self.src), self.nbytes if self.error is None else 0,
                             self.seconds)

    def _in_time(self) -> bool:
        if time.monotonic() > self.deadline():
            raise TimeoutError("the KV pull did not complete before the lease's deadline")
        return False

    def _end(self, error: Exception | None) -> None:
        self.ended, self.error = True, error
        if self.transfer is not None and error is not None:
            self.pool.endpoint.abandon(self.transfer)  # cancelled, or outwaited
        self.puller.queue.remove(self)
        if self.transfer is not None:
            self.seconds = time.perf_counter() - self.posted
        if error is None and self.seconds > 0:
            rate = self.nbytes / self.seconds
            old = self.puller.rate
            self.puller.rate = rate if old is None else 0.7 * old + 0.3 * rate
