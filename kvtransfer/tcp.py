"""The "tcp" transport: KV blocks between CPU workers on any host, with nothing to install.

The owner (a prefill worker's engine core) keeps its pool in ordinary memory and serves it on a
TCP port of the worker's --host, over mutual TLS with the cluster's certificates when the
worker has them; a decode worker's core dials each such pool once and reads each pull's blocks
straight into its own pool. A plain stream rather than a gRPC call on the worker's port: the
pool lives in the engine core's process, not the servicer's, so a gRPC reply would copy every
block across the core's pipe first and again into a message; here the core serves its own
memory with one thread a connection and needs from its worker only what `WorkerSite` carries
(host, TLS, the lease table).

    request   b"TKV1" | pool token (16) | lease id length (1) | lease id | n (4) | n ids (4 each)
    reply     status (1) | message length (2) | message      status 0: ok, 1: refused,
                                                             message "field: why" when refused
              then, when ok: the n blocks in the order asked, block_bytes each
              then one byte: 0, or 1 when the lease ended while they went (discard them)

Integers are big-endian and unsigned. Who may read what:
- the pool token, 128 random bits in the descriptor's handle, which only Register hands out
  (with cluster TLS, to decode workers alone): a wrong one is refused and the connection closed;
- the lease: the owner sends only blocks of a lease live in its table (LeaseTable.blocks), and
  looks again once they are sent: a lease released or expired meanwhile, whose blocks may be
  reused, fails the pull (a lease, once gone, never comes back);
- with cluster TLS both ends present certificates the cluster CA signed: the owner serves only
  a decode worker's, the reader dials only a prefill worker's.

Bounds: a lease id is at most MAX_LEASE_ID bytes, a request at most the pool's block count, a
message MAX_MESSAGE bytes; the reader takes exactly n * block_bytes bytes for its own n, into
its own blocks, and nothing else from the peer; an owner holds at most MAX_CONNECTIONS.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import secrets
import socket
import ssl
import struct
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass
from typing import Any

import torch

from tandem.errors import InvalidArgument
from tandem.kvtransfer.descriptor import PoolDescriptor
from tandem.kvtransfer.pool import Allocation
from tandem.kvtransfer.remote import Finished, TransferStats
from tandem.kvtransfer.transports import SiteTls, WorkerSite

log = logging.getLogger(__name__)

MAGIC = b"TKV1"
TOKEN_BYTES = 16
MAX_LEASE_ID = 64  # a lease id is 32 hex characters (kvtransfer/lease.py)
MAX_MESSAGE = 1024
MAX_CONNECTIONS = 64  # one a decode worker; past this a connection is closed at once
# An owner closes a connection that has not shown the pool's token this long after it opened
# (its TLS handshake included: a reader sends its first request at once), or, once it has, is
# silent this long (a reader dials again): a peer without the token holds no thread for long.
FIRST_S, IDLE_S = 10.0, 600.0
LINGER_S, LINGER_BYTES = 5.0, 1 << 20  # what a refused peer may still send, dropped
OK, REFUSED = 0, 1
LEASE_KEPT, LEASE_ENDED = 0, 1
# Cluster identities (runtime/cluster_roles.py, which kvtransfer may not import; a test holds
# them equal): the owner serves this certificate's holders, the reader dials that name.
DECODE_IDENTITY = "spiffe://tandem/decode/"
PREFILL_NAME = "prefill.tandem.internal"

_HEAD = struct.Struct("!4s16sB")   # magic, token, lease id length
_COUNT = struct.Struct("!I")
_REPLY = struct.Struct("!BH")      # status, message length
_HANDLE = struct.Struct("!16sHB")  # token, port, tls; the host follows (UTF-8)


class PullRefused(RuntimeError):
    """The owner refused a pull; `field` names what it refused (lease_id, src_block_ids...)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class TcpHandle:
    """A tcp pool's descriptor handle: where it is served and the token that opens it (a
    capability: never logged)."""

    token: bytes
    port: int
    tls: bool
    host: str

    def pack(self) -> bytes:
        return _HANDLE.pack(self.token, self.port, self.tls) + self.host.encode()

    @classmethod
    def unpack(cls, data: bytes) -> TcpHandle:
        if len(data) <= _HANDLE.size or len(data) > _HANDLE.size + 255:
            raise InvalidArgument("handle", f"a tcp handle is {_HANDLE.size + 1} to "
                                            f"{_HANDLE.size + 255} bytes, got {len(data)}")
        token, port, tls = _HANDLE.unpack_from(data)
        try:
            host = data[_HANDLE.size:].decode()
        except UnicodeDecodeError:
            raise InvalidArgument("handle", "a tcp handle's host is not UTF-8") from None
        if not port or tls > 1:
            raise InvalidArgument("handle", "is not a tcp pool's handle")
        return cls(token, port, bool(tls), host)


# -- the owner's side ----------------------------------------------------------------------------
class PoolServer:
    """Serves one pool's blocks to readers holding its token and a live lease: an accepting
    thread and one thread a connection, all stopped and joined by close()."""

    def __init__(self, pool: torch.Tensor, block_bytes: int, token: bytes,
                 site: WorkerSite) -> None:
        assert site.lease_blocks is not None
        self.view = memoryview(pool.numpy())  # 1-d uint8; the tensor outlives the server
        self.block_bytes, self.num_blocks = block_bytes, pool.numel() // block_bytes
        self.token, self.lease_blocks = token, site.lease_blocks
        self.tls = _server_context(site.tls) if site.tls is not None else None
        family = socket.AF_INET6 if ":" in site.host else socket.AF_INET
        self.listener = socket.create_server((site.host, 0), family=family)
        self.port = self.listener.getsockname()[1]
        # Where readers dial: the bound host, or this host's name for a wildcard (as the
        # worker advertises its own address).
        self.host = site.host if site.host not in ("0.0.0.0", "::") else socket.gethostname()
        self.lock = threading.Lock()
        self.conns: dict[threading.Thread, socket.socket] = {}
        self.threads: list[threading.Thread] = []  # every connection's, joined by close()
        self.closed = False
        self.acceptor = threading.Thread(target=self._accept, name="tcp-kv-accept", daemon=True)
        self.acceptor.start()

    def close(self) -> None:
        """Stop serving (idempotent): once it returns, no thread reads the pool."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
        _shut(self.listener)  # wakes accept()
        self.acceptor.join()
        self.listener.close()
        while True:  # a connection may swap its socket for a TLS one meanwhile: look again
            with self.lock:
                live = list(self.conns.items())
            if not live:
                break
            for thread, conn in live:
                _shut(conn)  # wakes a recv or send
                thread.join(0.05)
        for thread in self.threads:
            thread.join()  # each past its last touch of the pool
        self.view = memoryview(b"")  # the pool's memory goes with its last view

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # closed
            with self.lock:
                if self.closed or len(self.conns) >= MAX_CONNECTIONS:
                    conn.close()
                    continue
                thread = threading.Thread(target=self._serve, args=(conn,),
                                          name="tcp-kv-serve", daemon=True)
                self.conns[thread] = conn
                self.threads = [t for t in self.threads if t.is_alive()] + [thread]
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        me = threading.current_thread()
        try:
            conn.settimeout(FIRST_S)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls is not None:
                conn = self.tls.wrap_socket(conn, server_side=True)  # the CA's certificates only
                with self.lock:
                    self.conns[me] = conn
                    if self.closed:
                        return
                if not _holds(conn, DECODE_IDENTITY):
                    return
            while not self.closed and self._answer(conn):
                pass
        except (OSError, ValueError):
            pass  # the reader went, or broke the protocol: it dials again
        except Exception:  # a bug, not a peer: said, and this connection alone ends
            log.exception("the tcp KV server failed on a connection")
        finally:
            with self.lock:
                self.conns.pop(me, None)
            conn.close()

    def _answer(self, conn: socket.socket) -> bool:
        """One request; False when the connection must close."""
        head = _recv(conn, _HEAD.size, eof_ok=True)
        if head is None:
            return False
        magic, token, lease_len = _HEAD.unpack(head)
        if magic != MAGIC:
            return False
        if not hmac.compare_digest(token, self.token):
            return _refuse(conn, "handle", "does not open this pool", keep=False)
        conn.settimeout(IDLE_S)
        if not 0 < lease_len <= MAX_LEASE_ID:
            return _refuse(conn, "lease_id", f"must be 1 to {MAX_LEASE_ID} bytes, got "
                                             f"{lease_len}", keep=False)
        lease_id = _recv(conn, lease_len).decode("ascii", errors="replace")
        (count,) = _COUNT.unpack(_recv(conn, _COUNT.size))
        if count > self.num_blocks:
            return _refuse(conn, "src_block_ids", f"at most {self.num_blocks} blocks a pull, "
                                                  f"got {count}", keep=False)
        ids = struct.unpack(f"!{count}I", _recv(conn, 4 * count))
        lease = self.lease_blocks(lease_id)
        if lease is None:
            return _refuse(conn, "lease_id", "no live lease of this pool has this id")
        held = set(lease)
        outside = next((b for b in ids if b not in held), None)
        if outside is not None:
            return _refuse(conn, "src_block_ids", f"block {outside} is not one of the lease's")
        conn.sendall(_REPLY.pack(OK, 0))
        bb = self.block_bytes
        for block in ids:
            conn.sendall(self.view[block * bb:(block + 1) * bb])
        kept = self.lease_blocks(lease_id) is not None
        conn.sendall(bytes([LEASE_KEPT if kept else LEASE_ENDED]))
        return True


def _refuse(conn: socket.socket, field: str, why: str, keep: bool = True) -> bool:
    """Send a refusal naming the field; unless `keep`, then close gently (see _linger)."""
    message = f"{field}: {why}".encode()[:MAX_MESSAGE]
    conn.sendall(_REPLY.pack(REFUSED, len(message)) + message)
    if not keep:
        _linger(conn)
    return keep


def _linger(conn: socket.socket) -> None:
    """Before closing a connection whose request was not read to its end: closing with bytes
    unread sends a reset, which can destroy the refusal before the peer reads it. So the
    owner's side is shut, and what the peer still sends is read into a fixed buffer and
    dropped, until it closes, LINGER_BYTES went, or LINGER_S passed."""
    conn.shutdown(socket.SHUT_WR)
    conn.settimeout(LINGER_S)
    sink, dropped = bytearray(1 << 16), 0
    while dropped < LINGER_BYTES and (k := conn.recv_into(sink)):
        dropped += k


# -- the reader's side -------------------------------------------------------------------------
class TcpRemotePool:
    """A peer's tcp pool as a decode worker reaches it: one connection, dialed on first use and
    again after any error; one pull at a time."""

    def __init__(self, desc: PoolDescriptor, handle: TcpHandle,
                 tls: ssl.SSLContext | None) -> None:
        self.descriptor, self.handle, self.tls = desc, handle, tls
        self.lock = threading.Lock()  # one pull at a time on the connection
        self.sock: socket.socket | None = None
        self.closed = False
        # The read in flight (its cancel event), so that `interrupt` stops that one alone.
        self.state = threading.Lock()
        self.reading: threading.Event | None = None

    def read(self, local: torch.Tensor, src_block_ids: Sequence[int],
             dst_block_ids: Sequence[int], lease_id: str,
             deadline: Callable[[], float] | None = None,
             cancel: threading.Event | None = None) -> TransferStats:
        """Blocks src_block_ids (of lease `lease_id`) into dst_block_ids of `local`: done when
        it returns. Past `deadline()` TimeoutError; once `cancel` is set (and `interrupt`),
        RuntimeError; the owner's refusal, PullRefused."""
        blocks = self._check(local, src_block_ids, dst_block_ids, lease_id)
        n, bb = len(src_block_ids), self.descriptor.block_bytes
        if not n:
            return TransferStats(0, 0, 0.0)
        start = time.perf_counter()
        request = (_HEAD.pack(MAGIC, self.handle.token, len(lease_id)) + lease_id.encode()
                   + _COUNT.pack(n) + struct.pack(f"!{n}I", *src_block_ids))
        cancel = cancel or threading.Event()
        with self.lock:
            try:
                with self.state:
                    self.reading = cancel
                if cancel.is_set():
                    raise RuntimeError("the KV pull was cancelled")
                sock = self._connect(deadline, cancel)
                sock.sendall(request)
                status, length = _REPLY.unpack(_recv(sock, _REPLY.size, deadline))
                if length > MAX_MESSAGE:
                    raise ConnectionError(f"the owner's reply says {length} bytes of message")
                if status != OK:
                    field, _, why = _recv(sock, length, deadline).decode(
                        errors="replace").partition(": ")
                    raise PullRefused(field, why)
                for block in dst_block_ids:
                    if cancel.is_set():
                        raise RuntimeError("the KV pull was cancelled")
                    _recv_into(sock, blocks[block * bb:(block + 1) * bb], deadline)
                if _recv(sock, 1, deadline)[0] != LEASE_KEPT:
                    raise PullRefused("lease_id", "the lease ended while its blocks were sent")
            except BaseException as e:
                self._hang_up()  # in an unknown state: the next pull dials again
                if cancel.is_set():  # interrupted on purpose: say so, not how
                    raise RuntimeError("the KV pull was cancelled") from e
                raise
            finally:
                with self.state:
                    self.reading = None
        return TransferStats(n, n * bb, time.perf_counter() - start)

    def interrupt(self, cancel: threading.Event) -> None:
        """From another thread: the read given `cancel`, if in flight, fails at once."""
        with self.state:
            if self.reading is cancel and self.sock is not None:
                _shut(self.sock)

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self._hang_up()

    def _check(self, local: torch.Tensor, src: Sequence[int], dst: Sequence[int],
               lease_id: str) -> memoryview:
        """The pull's arguments checked, naming the field; `local` as a memoryview of bytes."""
        desc = self.descriptor
        if local.device.type != "cpu" or not local.is_contiguous():
            raise InvalidArgument("local", f"a tcp pull lands in a contiguous CPU pool, not on "
                                           f"{local.device}")
        if local.dim() != 6 or local[0].numel() * local.element_size() != desc.block_bytes:
            raise InvalidArgument("local", f"pool {local.dtype} {tuple(local.shape)} cannot "
                                           f"take blocks of {desc.block_bytes} bytes")
        if not 0 < len(lease_id) <= MAX_LEASE_ID or not lease_id.isascii():
            raise InvalidArgument("lease_id", f"must be 1 to {MAX_LEASE_ID} ASCII characters")
        if len(src) != len(dst):
            raise InvalidArgument("dst_block_ids", f"{len(dst)} ids for {len(src)} source "
                                                   "blocks")
        for field, ids, limit in (("src_block_ids", src, desc.num_blocks),
                                  ("dst_block_ids", dst, local.shape[0])):
            if ids and (min(ids) < 0 or max(ids) >= limit):
                raise InvalidArgument(field, f"ids must be in [0, {limit}), got "
                                             f"{min(ids)}..{max(ids)}")
        if len(set(dst)) != len(dst):
            raise InvalidArgument("dst_block_ids", "ids must be distinct")
        return memoryview(local.view(-1).view(torch.uint8).numpy())

    def _connect(self, deadline: Callable[[], float] | None,
                 cancel: threading.Event) -> socket.socket:
        if self.closed:
            raise RuntimeError(f"the tcp pool {self.descriptor.redacted()} is closed")
        if self.sock is None:
            h = self.handle
            sock = socket.create_connection((h.host, h.port), timeout=_left(deadline))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls is not None:
                sock = self.tls.wrap_socket(sock, server_hostname=PREFILL_NAME)
            with self.state:  # an interrupt before this found no socket: shut it now
                self.sock = sock
                if cancel.is_set():
                    _shut(sock)
        return self.sock

    def _hang_up(self) -> None:
        with self.state:
            sock, self.sock = self.sock, None
        if sock is not None:
            sock.close()


def _left(deadline: Callable[[], float] | None) -> float | None:
    """Seconds until the deadline (a socket timeout); TimeoutError once it passed."""
    if deadline is None:
        return None
    left = deadline() - time.monotonic()
    if left <= 0:
        raise TimeoutError("the KV pull did not complete before the lease's deadline")
    return left


def _recv(sock: socket.socket, n: int, deadline: Callable[[], float] | None = None,
          eof_ok: bool = False) -> bytes | None:
    """Exactly n bytes (None at a clean end of stream before any, when eof_ok)."""
    buf = bytearray(n)
    got = _recv_into(sock, memoryview(buf), deadline, eof_ok)
    return None if got is None else bytes(buf)


def _recv_into(sock: socket.socket, into: memoryview, deadline: Callable[[], float] | None,
               eof_ok: bool = False) -> int | None:
    got = 0
    while got < len(into):
        if deadline is not None:
            sock.settimeout(_left(deadline))
        k = sock.recv_into(into[got:])
        if not k:
            if got == 0 and eof_ok:
                return None
            raise ConnectionError("the peer closed the KV stream mid-message")
        got += k
    return got


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # not connected, or already closed
        sock.shutdown(socket.SHUT_RDWR)


# -- TLS -----------------------------------------------------------------------------------------
def _server_context(tls: SiteTls) -> ssl.SSLContext:
    """Mutual TLS with the cluster's CA: a peer without a certificate it signed is refused in
    the handshake."""
    ctx = _context(ssl.PROTOCOL_TLS_SERVER, tls)
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def _client_context(tls: SiteTls) -> ssl.SSLContext:
    return _context(ssl.PROTOCOL_TLS_CLIENT, tls)  # checks the owner's name and chain


def _context(protocol: int, tls: SiteTls) -> ssl.SSLContext:
    ctx = ssl.SSLContext(protocol)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_verify_locations(cadata=tls.ca.decode())
    # ssl loads a certificate and key from files only: a private directory, gone once loaded.
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="tandem-tls-", dir=shm) as d:
        cert, key = os.path.join(d, "cert.pem"), os.path.join(d, "key.pem")
        for path, data in ((cert, tls.cert), (key, tls.key)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        ctx.load_cert_chain(cert, key)
    return ctx


def _holds(conn: ssl.SSLSocket, identity_prefix: str) -> bool:
    """Whether the peer's certificate names exactly one SPIFFE id, and it starts so."""
    cert = conn.getpeercert() or {}
    ids = [v for k, v in cert.get("subjectAltName", ()) if k == "URI"
           and v.startswith("spiffe://")]
    return len(ids) == 1 and ids[0].startswith(identity_prefix)


# -- the transport -------------------------------------------------------------------------------
class TcpTransport:
    name = "tcp"

    def allocate(self, nbytes: int, device: torch.device, block_bytes: int,
                 site: WorkerSite) -> Allocation:
        if device.type != "cpu":
            raise InvalidArgument("transport", f"a tcp pool lives on the CPU, not on {device}")
        if site.lease_blocks is None:
            raise InvalidArgument("transport", "a tcp pool is served by a prefill worker's "
                                               "engine, which checks each pull's lease (not "
                                               "by a tensor-parallel rank)")
        tensor = torch.zeros(nbytes, dtype=torch.uint8)
        token = secrets.token_bytes(TOKEN_BYTES)
        server = PoolServer(tensor, block_bytes, token, site)
        memory = weakref.finalize(tensor, lambda: None)  # views hold it as their base
        memory.atexit = False
        handle = TcpHandle(token, server.port, server.tls is not None, server.host).pack()
        return Allocation(tensor, memory, handle, -1, server.close)

    def open(self, desc: PoolDescriptor, device: Any, site: WorkerSite) -> TcpRemotePool:
        """Nothing to map: a connection, dialed on the first pull."""
        if torch.device(device).type != "cpu":
            raise InvalidArgument("transport", f"a tcp pool is read into the CPU, not {device}")
        handle = TcpHandle.unpack(desc.handle)
        if handle.tls != (site.tls is not None):
            raise InvalidArgument("handle", "the pool is served with cluster TLS and this "
                                            "worker has none, or the other way round: start "
                                            "both with the same --cluster-* flags")
        return TcpRemotePool(desc, handle, _client_context(site.tls) if handle.tls else None)

    def pull(self, remote: TcpRemotePool, local: torch.Tensor, src_block_ids: Sequence[int],
             dst_block_ids: Sequence[int], deadline: float | None = None,
             lease_id: str = "") -> TransferStats:
        until = None if deadline is None else (lambda: deadline)
        return remote.read(local, src_block_ids, dst_block_ids, lease_id, until)

    def puller(self, local: torch.Tensor) -> TcpPuller:
        return TcpPuller(local)


TRANSPORT = TcpTransport()


class TcpPuller:
    """A decode core's pulls into `local`, each read by one thread of its own, in order: the
    engine polls them between steps, their requests unscheduled meanwhile."""

    def __init__(self, local: torch.Tensor) -> None:
        self.local = local
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="tcp-kv-pull")

    def start(self, remote: TcpRemotePool, src_block_ids: list[int], dst_block_ids: list[int],
              deadline: Callable[[], float], lease_id: str) -> TcpPull | Finished:
        if not src_block_ids:
            return Finished(TransferStats(0, 0, 0.0))
        return TcpPull(self, remote, src_block_ids, dst_block_ids, deadline, lease_id)


class TcpPull:
    """One pull on the puller's reader thread: a Transfer that completes outside the engine's
    stream, and ends once (done, failed, past its deadline, or cancelled)."""

    outside_stream = True

    def __init__(self, puller: TcpPuller, remote: TcpRemotePool, src_block_ids: list[int],
                 dst_block_ids: list[int], deadline: Callable[[], float],
                 lease_id: str) -> None:
        self.remote, self.num_blocks = remote, len(src_block_ids)
        self.cancelled = threading.Event()
        self.future = puller.reader.submit(remote.read, puller.local, src_block_ids,
                                           dst_block_ids, lease_id, deadline, self.cancelled)

    def done(self) -> bool:
        if not self.future.done():
            return False
        self.future.result()  # raises its error
        return True

    def wait(self) -> None:
        wait_for([self.future])

    def cancel(self) -> None:
        """Stopped; returns once nothing writes its blocks."""
        self.cancelled.set()
        if not self.future.cancel():  # running (or over): interrupt it and let it end
            self.remote.interrupt(self.cancelled)
            wait_for([self.future])

    def stats(self) -> TransferStats:
        if self.future.done() and not self.future.cancelled() and \
                self.future.exception() is None:
            return self.future.result()
        return TransferStats(self.num_blocks, 0, 0.0)
